"""Lens and patching on a Llama-shaped model: RMSNorm, untied head, (hidden, residual) block outputs."""

from __future__ import annotations

import pytest

import nnvllm as nv
from conftest import engine_kwargs, shared_engine
from test_analyses import _hf_lens_probs, _hf_patched_diff, _summary

CHECKPOINT = "llama"  # its shared engine's (conftest._checkpoint_of)


@pytest.fixture(scope="module")
def llama(tiny_paths, tp):
    return tiny_paths["llama"], shared_engine(tiny_paths["llama"], tp)  # conftest.SHARED_ENGINE_FILES


def test_llama_lens_matches_transformers(llama, fidelity):
    path, model = llama
    lens = nv.logit_lens(model, "The capital of France is", max_tokens=3, ignore_eos=True)
    seq = model.tokenizer.encode("The capital of France is") + lens.generated[:-1]
    hf = fidelity.calibrated(lambda device: _hf_lens_probs(path, seq, device))
    assert lens.top_probs.shape[:2] == hf.value.shape[:2]
    hf.check(lens.top_probs, 1e-4, lambda ref: ref.topk(5, dim=-1).values, "top-5 lens probs")
    assert lens.unembed.norm.kind == "rmsnorm"


def test_llama_patch_matches_transformers(llama, fidelity):
    path, model = llama
    clean, corrupt = "The capital of France is", "The capital of Italy is"
    res = nv.patch(model, clean, corrupt, " Paris", " Rome", progress=False)
    for layer, pos in [(0, 3), (1, 3), (2, 4), (1, 0)]:
        hf = fidelity.calibrated(lambda device, layer=layer, pos=pos: _hf_patched_diff(
            path, clean, corrupt, layer, pos, " Paris", " Rome", device))
        hf.check(float(res.patched_diff[layer, pos]), 1e-3, what=f"patched_diff{(layer, pos)}")
    # patching the last layer at the last position restores the clean logits exactly
    assert abs(float(res.effect[-1, -1]) - 1.0) < 1e-3


def test_compare_bf16_engine_with_fp32_reference(llama, fidelity):
    """A bf16 engine against the fp32 reference: a measurable, bounded discrepancy."""
    path, model = llama
    prompts = ["The capital of France is", "Paris is the capital of"]
    fp32 = nv.generate(model, prompts, max_tokens=4, ignore_eos=True)
    model.close()  # the shared engine: a later test that asks for it starts it again
    bf16_model = nv.load(path, **engine_kwargs(dtype="bfloat16"))
    try:
        bf16 = nv.generate(bf16_model, prompts, max_tokens=4, ignore_eos=True)
    finally:
        bf16_model.close()
    assert bf16.meta["dtype"] == "torch.bfloat16"
    ref = fidelity.reference(path, prompts, tokens=bf16.tokens).value
    hf32 = fidelity.reference(path, prompts, tokens=fp32.tokens)
    s32 = nv.compare(fp32, hf32.value).summary()
    s16 = nv.compare(bf16, ref).summary()
    print("fp32:", s32, "\nbf16:", s16)
    hf32.check_distance(s32["max_abs"], 1e-3, _summary("max_abs"), "fp32 max_abs")
    assert s16["max_abs"] > 10 * s32["max_abs"]  # bf16 rounding is visible...
    assert s16["min_cosine"] > 0.98  # ...but the stream points the same way
