"""The hand-off copy made during the generation (``NNVLLM_HANDOVER=mirror``, :mod:`nnvllm.engine.worker.mirror`).

The sites' rows each step places are written into the hand-off files as the steps go, so the files
must end up holding what the arena holds, under vLLM's scheduler at its hardest too: prompts split
over steps (chunked prefill) and requests preempted and recomputed, whose rows are written again.
Driven here on an isolated CPU engine, whose hand-off goes through the same files; the values are
checked against transformers.
"""

from __future__ import annotations

import pytest
import torch

import nnvllm as nv
from nnvllm import capture

from conftest import engine_kwargs

FACTS = [p for p, _ in nv.toy.FACTS][:12]
SCHEDULES = {
    # 8 tokens a step: every prompt split over steps, several prompts in one step
    "chunked": (dict(enable_chunked_prefill=True, max_num_batched_tokens=8, max_num_seqs=4), FACTS, 20),
    # 1 MiB of KV cache in 32-token blocks for 24 requests that grow past one block: preempted and recomputed
    "preempted": (dict(kv_cache_memory_bytes=1 << 20, max_model_len=64, block_size=32), FACTS * 2, 40),
}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the schedules (8-token steps, a 1 MiB KV cache) are chosen for the CPU backend; GPU: tests/test_gpu_mirror.py")
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_the_files_written_during_the_generation_hold_what_transformers_computes(toy_path, monkeypatch, schedule):
    kw, prompts, tokens = SCHEDULES[schedule]
    monkeypatch.setenv("NNVLLM_HANDOVER", "mirror")
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # it would override the KV cache size
    model = nv.load(toy_path, isolate=True, **engine_kwargs(1, **kw))
    try:
        runs, timings = [], []
        for _ in range(3):  # the first call's files may not be ready in time; the next calls' are spares
            runs.append(nv.generate(model, prompts, max_tokens=tokens, ignore_eos=True, sites=("mlp",)))
            timings.append(dict(capture._LAST_TIMINGS))
            stats = dict(capture._LAST_STATS)
    finally:
        model.close()
    if schedule == "chunked":
        assert stats["partial_prefills"] > 0  # prompts really were split over steps
    else:
        assert stats["rows"] > sum(runs[-1].positions(i) for i in range(len(runs[-1])))  # rows were recomputed
    last = timings[-1]
    # every site's tensor came from the files written during the generation, none copied at the end
    run = runs[-1]
    rows = sum(len(run.prompt_ids[i]) + tokens for i in range(len(run)))  # (each request's rows, as placed)
    per_row = sum(x[0].shape[0] * x[0].shape[-1] * x[0].element_size() for x in (run.resid, run.sites["mlp"]))
    nbytes = rows * per_row
    assert last.get("handover_mirrored_bytes") == nbytes, last
    assert last["mirror_writes"] >= tokens // 8, last
    ref = nv.reference(toy_path, prompts, tokens=runs[-1].tokens, sites=("mlp",))
    for run in runs:
        assert run.tokens == runs[-1].tokens
        for i in range(len(run)):
            assert run.resid[i].shape[1] == run.positions(i)
            assert (run.resid[i] - ref.resid[i]).abs().max() <= 1e-3
            assert (run.sites["mlp"][i] - ref.sites["mlp"][i]).abs().max() <= 1e-3
            assert (run.logits[i] - ref.logits[i]).abs().max() <= 1e-3
