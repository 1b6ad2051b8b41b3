"""Capture over generation, checked against plain transformers at fp32 on three checkpoints:
the embedded toy GPT-2, a tiny random GPT-2 and a tiny random Llama (GQA, untied head).

Bounds are CPU bounds; on a GPU the ``fidelity`` fixture (conftest.py) compares with transformers on
the same GPU and calibrates each bound from transformers' own GPU-vs-CPU distance (engines with exact=True)."""

from __future__ import annotations

import pytest
import torch

import nnvllm as nv
from conftest import shared_engine

PROMPTS = ["The capital of France is", "The Eiffel Tower is in the city of", "Paris is"]
SITES = ("attn", "mlp", "mlp_in", "mlp_act")
TOL = 1e-3  # fp32, CPU; see the fidelity fixture for GPUs


@pytest.fixture(scope="module", params=["toy", "gpt2", "llama"])
def engine(request, toy_path, tiny_paths, tp):
    path = toy_path if request.param == "toy" else tiny_paths[request.param]
    return path, shared_engine(path, tp)  # conftest.SHARED_ENGINE_FILES


def _maxdiff(a, b):
    assert a.shape == b.shape, (a.shape, b.shape)
    return (a.float() - b.float()).abs().max().item()


def test_every_quantity_matches_transformers(engine, fidelity):
    path, model = engine
    run = nv.generate(model, PROMPTS, max_tokens=5, sites=SITES, ignore_eos=True)
    hf = fidelity.reference(path, PROMPTS, max_tokens=5, sites=SITES, ignore_eos=True)
    ref = hf.value
    assert run.tokens == ref.tokens  # greedy: identical
    assert run.prompt_ids == ref.prompt_ids
    for i in range(len(PROMPTS)):
        n_pos = len(run.prompt_ids[i]) + 5 - 1  # prompt + fed-back tokens; different per prompt
        assert run.resid[i].shape == (model.n_layers, n_pos, run.resid[i].shape[-1])
        assert run.logits[i].shape[0] == 5
        hf.check(run.resid[i], TOL, lambda r, i=i: r.resid[i], f"resid[{i}]")
        hf.check(run.logits[i], TOL, lambda r, i=i: r.logits[i], f"logits[{i}]")
        for s in SITES:
            hf.check(run.sites[s][i], TOL, lambda r, s=s, i=i: r.sites[s][i], f"{s}[{i}]")
        assert torch.equal(run.samples[i].ids, torch.tensor(run.tokens[i]))
        hf.check(run.samples[i].probs, 1e-4, lambda r, i=i: r.samples[i].probs, f"samples[{i}].probs")
        hf.check(run.samples[i].logprobs, TOL, lambda r, i=i: r.samples[i].logprobs, f"samples[{i}].logprobs")


def test_blocks_differ_per_layer_for_shared_activation_module(engine, fidelity):
    """vLLM's GPT-2 shares one activation module across blocks; each block must get its own value."""
    path, model = engine
    run = nv.generate(model, PROMPTS[0], max_tokens=1, layers=[0, 1], sites=("mlp_act",))
    hf = fidelity.reference(path, PROMPTS[0], max_tokens=1, layers=[0, 1], sites=("mlp_act",))
    a = run.sites["mlp_act"][0]
    assert _maxdiff(a[0], a[1]) > 1e-2
    hf.check(a, TOL, lambda r: r.sites["mlp_act"][0], "mlp_act")


def test_layer_subset_and_no_capture(engine, fidelity):
    path, model = engine
    run = nv.generate(model, PROMPTS[:2], max_tokens=2, layers=[-1, 0], logits=False)
    assert run.layers == [model.n_layers - 1, 0]
    assert run.logits is None and run.resid[0].shape[0] == 2
    hf = fidelity.reference(path, PROMPTS[:2], max_tokens=2, layers=[-1, 0])
    hf.check(run.resid[1], TOL, lambda r: r.resid[1], "resid[1]")
    bare = nv.generate(model, PROMPTS[:2], max_tokens=2, layers=None)
    assert bare.resid is None and bare.tokens == run.tokens


def test_sampling_is_reproducible_with_seed_and_probs_are_the_sampling_distribution(engine):
    _, model = engine
    kw = dict(max_tokens=4, temperature=0.8, top_p=0.95, seed=1234, layers=None, ignore_eos=True)
    a = nv.generate(model, PROMPTS, **kw)
    b = nv.generate(model, PROMPTS, **kw)
    assert a.tokens == b.tokens
    for i in range(len(PROMPTS)):
        s = a.samples[i]
        probs = nv.sampling.sampling_probs(a.logits[i], 0.8, 0.95)
        assert torch.allclose(s.probs, probs.gather(-1, s.ids[:, None])[:, 0])
        assert (s.probs > 0).all()  # every draw lies inside the top-p set
        assert torch.allclose(probs.sum(-1), torch.ones(len(s)), atol=1e-5)
        assert (s.top_probs[:, :-1] >= s.top_probs[:, 1:]).all()
        # logprobs: the model's own, whatever the sampler did (no temperature, no top-p)
        want = torch.log_softmax(a.logits[i].float(), -1).gather(-1, s.ids[:, None])[:, 0]
        assert torch.allclose(s.logprobs, want, atol=1e-5)


def test_run_save_load_and_frame(engine, tmp_path):
    _, model = engine
    run = nv.generate(model, PROMPTS[:2], max_tokens=3, sites=("mlp",))
    run.save(tmp_path / "run.pt")
    back = nv.Run.load(tmp_path / "run.pt")
    assert back.tokens == run.tokens and torch.equal(back.resid[1], run.resid[1])
    assert torch.equal(back.sites["mlp"][0], run.sites["mlp"][0])
    assert run.samples[1].logprobs is not None and torch.equal(back.samples[1].logprobs, run.samples[1].logprobs)
    df = run.to_frame()
    assert len(df) == sum(len(t) for t in run.tokens)
    assert set(df.columns) >= {"request", "step", "token_id", "prob", "top1_id", "top1_prob", "logit"}


_ONE_PROCESS_SCRIPT = """
import os, sys, torch
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core and its worker in this process
sys.path.insert(0, sys.argv[3])
import nnvllm as nv
from nnvllm import capture
from conftest import engine_kwargs
m = nv.load(sys.argv[1], isolate=False, **engine_kwargs(1))
run = nv.generate(m, sys.argv[4:], max_tokens=4, sites=("mlp",), ignore_eos=True)
run.save(sys.argv[2] + "/run.pt")
torch.save(dict(capture._LAST_TIMINGS), sys.argv[2] + "/timings.pt")
m.close()
"""


def test_a_client_in_the_workers_process_gets_the_capture_by_the_fast_path(toy_path, tp, tmp_path, fidelity):
    """The engine core and its worker in the client's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``:
    nnvllm's CPU engine at TP=1, an option on a GPU). A CPU arena's tensors reach the Run as they
    are, with no copy; a CUDA arena's go through the page-locked shared-memory files (one DMA), not
    a pageable copy. Either way the values are transformers'."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if tp > 1:
        pytest.skip("the worker shares the client's process at TP=1 only")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}
    subprocess.run([sys.executable, "-c", _ONE_PROCESS_SCRIPT, str(toy_path), str(tmp_path),
                    str(Path(__file__).parent), *PROMPTS], check=True, env=env, timeout=600)
    run = nv.Run.load(tmp_path / "run.pt")
    timings = torch.load(tmp_path / "timings.pt")
    if torch.cuda.is_available():
        assert timings.get("handover_bytes", 0) > 0, timings  # through the files
    else:
        assert "handover_bytes" not in timings and "handover_copy" not in timings, timings  # as they are
    hf = fidelity.reference(toy_path, PROMPTS, max_tokens=4, sites=("mlp",), ignore_eos=True)
    assert run.tokens == hf.value.tokens
    for i in range(len(PROMPTS)):
        hf.check(run.resid[i], TOL, lambda r, i=i: r.resid[i], f"resid[{i}]")
        hf.check(run.sites["mlp"][i], TOL, lambda r, i=i: r.sites["mlp"][i], f"mlp[{i}]")
        hf.check(run.logits[i], TOL, lambda r, i=i: r.logits[i], f"logits[{i}]")
