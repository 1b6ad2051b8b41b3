"""An engine that replays CUDA graphs captures exactly what the eager engine captures (GPU only).

Measured on an H200 with benchmarks/capture_gpu.py (random fp16 Llama-1B and GPT-2-small shapes):
every residual and logit bit-identical between ``cuda_graphs=True`` and ``cuda_graphs=False``.
This test keeps that true on the toy model, in fp32, and checks that ``nv.patch`` refuses a graph
engine with a clear error instead of running on it.
"""

from __future__ import annotations

import pytest
import torch

import nnvllm as nv

pytestmark = pytest.mark.gpu

PROMPTS = ["The capital of France is", "Paris is the capital of", "The capital of Italy is"]


def _capture(toy_path, graphs: bool):
    model = nv.load(toy_path, isolate=False, dtype="float32", gpu_memory_utilization=0.3, cuda_graphs=graphs)
    try:
        run = nv.generate(model, PROMPTS * 8, max_tokens=12, ignore_eos=True, sites=("attn", "mlp_act"))
        if graphs:
            with pytest.raises(RuntimeError, match="cuda_graphs=False"):
                nv.patch(model, PROMPTS[0], PROMPTS[2], " Paris", " Rome")
        return run
    finally:
        model.close()


def test_graph_engine_captures_what_the_eager_engine_captures(toy_path):
    eager = _capture(toy_path, graphs=False)
    graphs = _capture(toy_path, graphs=True)
    assert graphs.tokens == eager.tokens
    for i in range(len(eager)):
        assert torch.equal(graphs.resid[i], eager.resid[i])
        assert torch.equal(graphs.logits[i], eager.logits[i])
        for s in ("attn", "mlp_act"):
            assert torch.equal(graphs.sites[s][i], eager.sites[s][i])
