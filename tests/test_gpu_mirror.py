"""The hand-off written during the generation on a graph engine (``NNVLLM_HANDOVER=mirror``, GPU only).

On a GPU the mirror writes each few steps' rows into the page-locked hand-off files through their
device address, on a stream of its own (:mod:`nnvllm.engine.worker.mirror`). An isolated graph engine
started with it must hand over what the same engine started without it hands over (the end copy),
with every site's tensor taken from the files written during the generation, call after call; the
tests on the CPU (tests/test_mirror.py) check the values against transformers under chunked prefill
and preemption.
"""

from __future__ import annotations

import pytest

import nnvllm as nv
from nnvllm import capture

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "Paris is the capital of", "The capital of Italy is"] * 8


def _calls(toy_path, monkeypatch, mode: str | None):
    if mode is None:
        monkeypatch.delenv("NNVLLM_HANDOVER", raising=False)
    else:
        monkeypatch.setenv("NNVLLM_HANDOVER", mode)
    model = nv.load(toy_path, isolate=True, dtype="float32", gpu_memory_utilization=0.3,
                    kv_cache_memory_bytes=1 << 30)
    try:
        out = []
        for _ in range(3):  # the first call's files may not be ready in time; the next calls' are spares
            run = nv.generate(model, PROMPTS, max_tokens=24, ignore_eos=True, sites=("mlp",))
            out.append((run, dict(capture._LAST_TIMINGS), dict(capture._LAST_STATS)))
        return out
    finally:
        model.close()


def test_a_graph_engine_hands_over_what_it_wrote_during_the_generation(toy_path, monkeypatch):
    mirrored = _calls(toy_path, monkeypatch, "mirror")
    plain = _calls(toy_path, monkeypatch, None)
    for (run, _, stats), (ref, ref_timings, _) in zip(mirrored, plain):
        assert not stats["eager"], stats  # the graphs ran
        assert run.tokens == ref.tokens
        for i in range(len(run)):
            for a, b in ((run.resid[i], ref.resid[i]), (run.sites["mlp"][i], ref.sites["mlp"][i]),
                         (run.logits[i], ref.logits[i])):
                assert a.shape == b.shape and float((a - b).abs().max()) <= 1e-4 * max(1.0, float(b.abs().max()))
        assert "handover_mirrored_bytes" not in ref_timings
    run, timings, _ = mirrored[-1]
    rows = sum(len(run.prompt_ids[i]) + 24 for i in range(len(run)))
    per_row = sum(x[0].shape[0] * x[0].shape[-1] * x[0].element_size() for x in (run.resid, run.sites["mlp"]))
    assert timings.get("handover_mirrored_bytes") == rows * per_row, timings
    assert timings["mirror_writes"] >= 24 // 8, timings
    print("hand-off copy, mirrored:", [t.get("handover_copy") for _, t, _ in mirrored],
          "end copy:", [t.get("handover_copy") for _, t, _ in plain])
