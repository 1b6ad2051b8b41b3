"""``NNVLLM_COMPILE=1``: vLLM's torch.compile runs the forward, with nnvllm's taps inside the compiled
code as opaque ops (``nnvllm::tap``, ``nnvllm::tap_qkv``), and steps carrying nnsight's work run the
plain forward. On the CPU vLLM traces the forward once with Dynamo and compiles it with inductor,
so these tests drive the same tracing and the same opaque ops as a GPU engine, without its graphs.

A compiled forward is traced once and vLLM drops Dynamo's guards: Python state a hook reads at that
trace (is a capture armed, which sites, which edits) would be baked in. Each test here changes that
state between calls (other sites, other layers, edits on and off) and checks every value against
transformers.
"""

from __future__ import annotations

import os

import pytest
import torch

import nnvllm as nv
from conftest import same_values

PROMPTS = ["The capital of France is", "Paris is the capital of"]


def _load_compiled(path, isolate: bool):
    """``nv.load`` with ``NNVLLM_COMPILE=1`` (read where the engine starts), the variable restored after."""
    from conftest import engine_kwargs

    old = os.environ.get("NNVLLM_COMPILE")
    os.environ["NNVLLM_COMPILE"] = "1"
    try:
        return nv.load(path, isolate=isolate, **engine_kwargs(1))
    finally:
        if old is None:
            os.environ.pop("NNVLLM_COMPILE")
        else:
            os.environ["NNVLLM_COMPILE"] = old


@pytest.fixture(scope="module", params=["toy", "llama"])
def compiled(request, toy_path, tiny_paths):
    from conftest import release_shared_engine

    release_shared_engine()  # one in-process engine at a time
    path = toy_path if request.param == "toy" else tiny_paths["llama"]
    model = _load_compiled(path, isolate=False)
    yield request.param, path, model
    model.close()


def run_width(model) -> int:
    return nv.generate(model, PROMPTS[0], max_tokens=1, layers=[0]).resid[0].shape[-1]


def _check_sites(ref, run, sites, label: str) -> None:
    """Each prompt's residual stream and every one of ``sites`` within 1e-4 of the reference."""
    for i in range(len(PROMPTS)):
        ref.check(run.resid[i], 1e-4, lambda r, i=i: r.resid[i], f"{label} resid[{i}]")
        for s in sites:
            ref.check(run.sites[s][i], 1e-4, lambda r, s=s, i=i: r.sites[s][i], f"{label} {s}[{i}]")


def _modes(model) -> dict:
    return model.llm.collective_rpc("nnvllm_step_modes", kwargs={"reset": True})[0]


def _sites(model) -> list[str]:
    """Every site but the residual stream (always kept for the chosen layers)."""
    return [s for s in model.arch.sites if s != "resid"] + (["q", "k", "v", "z"] if model.arch.heads is not None else [])


def test_every_site_and_then_others_equal_transformers(compiled, fidelity):
    """Every site at every layer, then one site at two layers, then tokens only, then every site again:
    each equals transformers teacher-forced on the engine's tokens, and every step ran compiled."""
    kind, path, model = compiled
    _modes(model)
    sites = _sites(model)
    run = nv.generate(model, PROMPTS, max_tokens=4, ignore_eos=True, sites=sites)
    ref = fidelity.reference(path, PROMPTS, tokens=run.tokens, sites=sites)
    _check_sites(ref, run, sites, kind)
    last = sites[-1]
    two = nv.generate(model, PROMPTS[::-1], max_tokens=3, ignore_eos=True, sites=[last], layers=[0, -1])
    ref2 = fidelity.reference(path, PROMPTS[::-1], tokens=two.tokens, sites=[last], layers=[0, -1])
    for i in range(len(PROMPTS)):
        ref2.check(two.sites[last][i], 1e-4, lambda r, i=i: r.sites[last][i], f"{kind} {last}[{i}], 2 layers")
    bare = nv.generate(model, PROMPTS, max_tokens=4, ignore_eos=True, layers=[])
    assert bare.tokens == run.tokens
    again = nv.generate(model, PROMPTS, max_tokens=4, ignore_eos=True, sites=sites)
    for i in range(len(PROMPTS)):
        assert same_values(again.resid[i], run.resid[i]), (kind, i)
        for s in sites:
            assert same_values(again.sites[s][i], run.sites[s][i]), (kind, s, i)
    modes = _modes(model)
    assert modes.get("compiled", 0) >= 4 + 3 + 4 + 4 and not modes.get("plain"), modes  # a step per token


def test_edits_on_and_off_equal_transformers(compiled, fidelity):
    """Steering (add), set and scale edits, each in its own call between unedited ones: the edited
    generation equals transformers with the same edits, the unedited one equals the plain run."""
    kind, path, model = compiled
    d = run_width(model)
    g = torch.Generator().manual_seed(0)
    plain = nv.generate(model, PROMPTS, max_tokens=4, ignore_eos=True)
    for edits in ([nv.Edit.add(torch.randn(d, generator=g), layers=1, scale=4.0)],
                  [nv.Edit.set(torch.randn(d, generator=g), layers=[0], positions="prompt", site="mlp")],
                  [nv.Edit.scale(0.5, layers=[-1])]):
        run = nv.generate(model, PROMPTS, max_tokens=4, ignore_eos=True, edits=edits)
        ref = fidelity.reference(path, PROMPTS, max_tokens=4, ignore_eos=True, edits=edits)
        assert run.tokens == ref.value.tokens, (kind, edits[0].op)
        for i in range(len(PROMPTS)):
            ref.check(run.resid[i], 1e-4, lambda r, i=i: r.resid[i], f"{kind} {edits[0].op} resid[{i}]")
        after = nv.generate(model, PROMPTS, max_tokens=4, ignore_eos=True)
        assert after.tokens == plain.tokens
        for i in range(len(PROMPTS)):
            assert same_values(after.resid[i], plain.resid[i]), (kind, edits[0].op, i)
    assert not _modes(model).get("plain")


def _block(model, j: int):
    envoy = model
    for part in model.arch.blocks.split("."):
        envoy = getattr(envoy, part)
    return envoy[j]


def _stream(out):
    """A block's output as the residual stream (vLLM's Llama block returns (hidden, residual))."""
    return out[0] + out[1] if isinstance(out, tuple) else out


def test_an_nnsight_trace_runs_the_plain_forward(compiled, fidelity):
    """A trace that reads a block's output, and one that zeroes a block's output: the read equals
    transformers; the edited logits equal transformers' with the same edit; those steps ran the plain
    forward, and the next nv.generate runs compiled again and equals transformers."""
    kind, path, model = compiled
    _modes(model)
    with model.trace(PROMPTS[0], max_tokens=1, temperature=0.0):
        seen = _block(model, 2).output.save()
    seen = _stream(seen).float().cpu()
    ref = fidelity.reference(path, PROMPTS[0], max_tokens=1, layers=[2])
    ref.check(seen, 1e-4, lambda r: r.resid[0][0, : seen.shape[0]], f"{kind} traced block 2")
    with model.trace(PROMPTS[0], max_tokens=1, temperature=0.0):
        out = _block(model, 1).output
        for t in (out if isinstance(out, tuple) else (out,)):
            t[:] = 0
        logits = model.logits.save()
    zeroed = fidelity.reference(path, PROMPTS[0], max_tokens=1, edits=[nv.Edit.set(0.0, layers=[1])])
    zeroed.check(logits.float().cpu().reshape(-1), 1e-4, lambda r: r.logits[0][0], f"{kind} traced edit")
    modes = _modes(model)
    assert modes.get("plain", 0) >= 2, modes
    run = nv.generate(model, PROMPTS[0], max_tokens=2, ignore_eos=True)
    after = fidelity.reference(path, PROMPTS[0], tokens=run.tokens)
    after.check(run.resid[0], 1e-4, lambda r: r.resid[0], f"{kind} after the traces")
    modes = _modes(model)
    assert modes.get("compiled", 0) >= 2 and not modes.get("plain"), modes


def test_an_isolated_compiled_engine(toy_path, fidelity):
    """The isolated engine (the GPU's default) compiles in its own processes, which read
    NNVLLM_COMPILE when it starts: a capture of other sites than the one before it, and a trace, equal
    transformers."""
    model = _load_compiled(toy_path, isolate=True)
    try:
        for sites in (["mlp"], ["attn", "mlp_act"]):
            run = nv.generate(model, PROMPTS, max_tokens=3, ignore_eos=True, sites=sites, layers=[1, 4])
            ref = fidelity.reference(toy_path, PROMPTS, tokens=run.tokens, sites=sites, layers=[1, 4])
            for i in range(len(PROMPTS)):
                ref.check(run.resid[i], 1e-4, lambda r, i=i: r.resid[i], f"isolated resid[{i}]")
                for s in sites:
                    ref.check(run.sites[s][i], 1e-4, lambda r, s=s, i=i: r.sites[s][i], f"isolated {s}[{i}]")
        with model.trace(PROMPTS[0], max_tokens=1, temperature=0.0):
            seen = model.transformer.h[4].output.save()
        ref.check(seen.float().cpu(), 1e-4, lambda r: r.resid[0][1, : seen.shape[0]], "isolated traced block 4")
    finally:
        model.close()


def test_a_transformers_backend_family_compiles_with_its_heads(tmp_path, fidelity):
    """GPT-NeoX runs through vLLM's Transformers backend, whose attention function nnvllm wraps to read
    q, k and v (taps._backend_attention): compiled, its heads and sites equal transformers'."""
    from conftest import release_shared_engine
    from nnvllm.testing import tiny_checkpoint

    release_shared_engine()
    path = tiny_checkpoint("gpt_neox", tmp_path / "ckpt")
    model = _load_compiled(path, isolate=False)
    try:
        _modes(model)
        for sites in (["q", "k", "v", "z"], ["attn", "mlp"]):
            run = nv.generate(model, PROMPTS, max_tokens=3, ignore_eos=True, sites=sites)
            ref = fidelity.reference(path, PROMPTS, tokens=run.tokens, sites=sites)
            _check_sites(ref, run, sites, "gpt_neox")
        modes = _modes(model)
        assert modes.get("compiled", 0) >= 6 and not modes.get("plain"), modes
    finally:
        model.close()
