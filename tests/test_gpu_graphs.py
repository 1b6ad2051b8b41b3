"""An engine that replays CUDA graphs captures and patches exactly what the eager engine does (GPU only).

Measured on an H200 with benchmarks/capture_gpu.py (random fp16 Llama-1B and GPT-2-small shapes):
every residual and logit bit-identical between ``cuda_graphs=True`` and ``cuda_graphs=False``.
This test keeps that true on the toy model, in fp32, and runs ``nv.patch`` on both engines (its
passes run eagerly on the graph engine: they carry an nnsight trace).
"""

from __future__ import annotations

import pytest
import torch

import nnvllm as nv

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "Paris is the capital of", "The capital of Italy is"]


def _capture(toy_path, graphs: bool):
    model = nv.load(toy_path, isolate=False, dtype="float32", gpu_memory_utilization=0.3,
                    kv_cache_memory_bytes=1 << 30, cuda_graphs=graphs)
    try:
        run = nv.generate(model, PROMPTS * 8, max_tokens=12, ignore_eos=True, sites=("attn", "mlp_act"))
        res = nv.patch(model, PROMPTS[0], PROMPTS[2], " Paris", " Rome", progress=False)
        return run, res
    finally:
        model.close()


def test_graph_engine_captures_and_patches_what_the_eager_engine_does(toy_path):
    eager, eager_patch = _capture(toy_path, graphs=False)
    graphs, graphs_patch = _capture(toy_path, graphs=True)
    assert graphs.tokens == eager.tokens
    for i in range(len(eager)):
        assert torch.equal(graphs.resid[i], eager.resid[i])
        assert torch.equal(graphs.logits[i], eager.logits[i])
        for s in ("attn", "mlp_act"):
            assert torch.equal(graphs.sites[s][i], eager.sites[s][i])
    # nv.patch's traces run eagerly on both engines. Its results were bit-identical in one H200 run
    # (lane_b) and ~1e-4 apart in another (bench_c: -6.8381 vs -6.8382 in one cell): two eager runs of
    # the same batch, not graphs against eager. Within fp32 rounding of a logit difference of ~7.
    assert (graphs_patch.patched_diff - eager_patch.patched_diff).abs().max() < 1e-3
    assert abs(graphs_patch.effect[-1, -1] - 1) < 1e-3  # the last block at the last position restores all
