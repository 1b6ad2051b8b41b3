"""Edits while generating: steering, ablation and scaling, on the engine's worker,
against the same edits made with transformers hooks (nv.reference(..., edits=...)).

On the embedded toy model (GPT-2 layout) and a tiny Llama (whose blocks return (hidden, residual):
``set`` and ``scale`` of the stream must make the edited value the whole stream). With ``--tp 2``
the same tests run on a tensor-parallel engine.
"""

from __future__ import annotations

import pytest
import torch

import nnvllm as nv
from conftest import same_values, seed_engine

PROMPTS = ["The capital of France is", "Paris is the capital of"]
TOL = 1e-3  # fp32, CPU; the fidelity fixture calibrates it on a GPU


# Engines shared with other test files: conftest.SHARED_ENGINE_FILES.


@pytest.fixture(scope="module", params=["toy", "llama"])
def model(request, toy_path, tiny_paths, tp):
    path = toy_path if request.param == "toy" else tiny_paths["llama"]
    return request.param, path, seed_engine(request.param, path, tp)


def _edits(d: int, d_mlp: int, n_layers: int, w_in: int):
    """Each case: an edit, or a list of edits made in one call."""
    g = torch.Generator().manual_seed(0)
    return {
        "steer resid, all positions": nv.Edit.add(torch.randn(d, generator=g), layers=[1], scale=3.0),
        "steer resid, generated only, two layers": nv.Edit.add(torch.randn(d, generator=g), layers=[0, -1],
                                                               scale=2.0, positions="generated"),
        "ablate attn at generated positions": nv.Edit.set(0.0, layers=[n_layers // 2], site="attn",
                                                          positions="generated"),
        "set resid to a vector on the prompt": nv.Edit.set(torch.randn(d, generator=g), layers=[1],
                                                           positions="prompt"),
        "scale resid": nv.Edit.scale(0.25, layers=[0]),
        "scale mlp on the prompt": nv.Edit.scale(0.5, layers=[0, 1], site="mlp", positions="prompt"),
        "zero mlp_act": nv.Edit.set(0.0, layers=[1], site="mlp_act"),
        "ablate mlp at two token positions (one prompt, one generated)": nv.Edit.set(0.0, layers=[1], site="mlp",
                                                                                   positions=[1, 6]),
        # transformers splits a merged gate|up projection over two modules (llama): the first edit's
        # hooks keep its own split while the second edit's are made
        "steer mlp_in, then scale resid, in one call": [
            nv.Edit.add(torch.randn(w_in, generator=g), layers=[0], site="mlp_in", scale=2.0),
            nv.Edit.scale(0.5, layers=[1])],
    }


def test_each_edit_equals_the_same_edit_with_transformers_hooks(model, fidelity, tp):
    kind, path, m = model
    d = m.config.hidden_size
    d_mlp = getattr(m.config, "intermediate_size", None) or getattr(m.config, "n_inner", None) or 4 * d
    clean = nv.generate(m, PROMPTS, max_tokens=4, ignore_eos=True, sites=["mlp_in"])
    w_in = clean.sites["mlp_in"][0].shape[-1]
    moved = 0
    for name, es in _edits(d, d_mlp, m.n_layers, w_in).items():
        es = es if isinstance(es, list) else [es]
        if tp > 1 and any(e.site in ("mlp_in", "mlp_act") and e.vector is not None for e in es):
            continue
        run = nv.generate(m, PROMPTS, max_tokens=4, ignore_eos=True, edits=es, sites=["attn", "mlp"])
        hf = fidelity.reference(path, PROMPTS, max_tokens=4, ignore_eos=True, edits=es, sites=["attn", "mlp"])
        assert run.tokens == hf.value.tokens, (kind, name)
        for i in range(len(PROMPTS)):
            hf.check(run.resid[i], TOL, lambda r, i=i: r.resid[i], f"{kind} {name}: resid[{i}]")
            hf.check(run.logits[i], TOL, lambda r, i=i: r.logits[i], f"{kind} {name}: logits[{i}]")
            hf.check(run.sites["attn"][i], TOL, lambda r, i=i: r.sites["attn"][i], f"{kind} {name}: attn[{i}]")
        assert run.meta["edits"] == [e.describe() | {"layers": [j % m.n_layers for j in e.layers]} for e in es]
        # the edit did something: the stream moved somewhere after the first edited layer
        moved += max((a - b).abs().max().item() for a, b in zip(run.resid, clean.resid)) > 1e-2
    assert moved >= 5
    again = nv.generate(m, PROMPTS, max_tokens=4, ignore_eos=True)  # nothing left armed
    assert again.tokens == clean.tokens and same_values(again.resid[0], clean.resid[0])


def test_head_edits_equal_the_same_edits_with_transformers_hooks(model, fidelity, tp):
    """Edits at site z (each head's output before the attention's output projection) limited to some
    heads: ablating one, scaling two on the prompt, adding a vector into one, patching one from another
    prompt's run, scaling all; each equals the same edit made with transformers hooks (z, the stream
    and the logits), under tensor parallelism too (each rank edits the heads it holds). The ablated
    head's z is zero and, on the prompt, the layer's other heads are as without the edit."""
    from nnvllm.edits import head_shape

    kind, path, m = model
    n_heads, d_head = head_shape(m)
    assert n_heads >= 2
    L = m.n_layers // 2
    g = torch.Generator().manual_seed(1)
    clean = nv.generate(m, PROMPTS, max_tokens=4, ignore_eos=True, sites=["z"])
    other = nv.generate(m, "The capital of Italy is", max_tokens=4, ignore_eos=True, sites=["z"])
    edits = {
        "ablate one head": nv.Edit.set(0.0, layers=[L], site="z", heads=[1]),
        "scale two heads on the prompt": nv.Edit.scale(3.0, layers=[0, L], site="z", heads=[0, n_heads - 1],
                                                       positions="prompt"),
        "add a vector into one head": nv.Edit.add(torch.randn(d_head, generator=g), layers=[L], scale=4.0,
                                                  site="z", heads=[n_heads - 1]),
        "patch one head from another prompt's run": nv.Edit.patch(other, layers=[L], site="z", heads=[0]),
        "scale every head": nv.Edit.scale(0.5, layers=[L], site="z"),
    }
    moved = 0
    for name, e in edits.items():
        run = nv.generate(m, PROMPTS, max_tokens=4, ignore_eos=True, edits=[e], sites=["z"])
        hf = fidelity.reference(path, PROMPTS, max_tokens=4, ignore_eos=True, edits=[e], sites=["z"])
        assert run.tokens == hf.value.tokens, (kind, name)
        for i in range(len(PROMPTS)):
            hf.check(run.sites["z"][i], TOL, lambda r, i=i: r.sites["z"][i], f"{kind} {name}: z[{i}]")
            hf.check(run.resid[i], TOL, lambda r, i=i: r.resid[i], f"{kind} {name}: resid[{i}]")
            hf.check(run.logits[i], TOL, lambda r, i=i: r.logits[i], f"{kind} {name}: logits[{i}]")
        assert run.meta["edits"][0]["site"] == "z" and run.meta["edits"][0].get("heads") == (
            None if e.heads is None else list(e.heads))
        moved += max((a - b).abs().max().item() for a, b in zip(run.resid, clean.resid)) > 1e-2
        if name == "ablate one head":
            z, z0 = run.sites["z"][0][L], clean.sites["z"][0][L]  # [pos, heads, d_head]
            assert not z[:, 1].any()
            P = len(run.prompt_ids[0])
            keep = [h for h in range(n_heads) if h != 1]
            assert (z[:P, keep] - z0[:P, keep]).abs().max() < TOL, "the edit touched another head"
    assert moved == len(edits), moved
    with pytest.raises(ValueError, match=f"has {n_heads} heads per block"):
        nv.generate(m, PROMPTS[0], max_tokens=1, edits=[nv.Edit.set(0.0, layers=0, site="z", heads=[n_heads])])
    with pytest.raises(ValueError, match=f"goes into each head, {d_head} wide"):
        nv.generate(m, PROMPTS[0], max_tokens=1, edits=[nv.Edit.add(torch.ones(d_head + 1), 0, site="z", heads=[0])])
    with pytest.raises(ValueError, match="read only; edit the heads' outputs with site='z'"):
        nv.Edit.set(0.0, layers=0, site="q")
    with pytest.raises(ValueError, match="heads are edited at site 'z'"):
        nv.Edit.set(0.0, layers=0, site="attn", heads=[0])
    again = nv.generate(m, PROMPTS, max_tokens=4, ignore_eos=True, sites=["z"])  # nothing left armed
    assert again.tokens == clean.tokens and same_values(again.sites["z"][0], clean.sites["z"][0])


def test_steering_vector_from_contrastive_prompts_and_compare(model):
    kind, path, m = model
    v = nv.steering_vector(m, ["The capital of Italy is", "Rome is the capital of"],
                           ["The capital of France is", "Paris is the capital of"], layer=1)
    assert v.shape == (m.config.hidden_size,) and v.norm() > 0
    run = nv.generate(m, PROMPTS[0], max_tokens=1, layers=[1], logits=False)
    base = nv.generate(m, ["The capital of Italy is", "Rome is the capital of", "The capital of France is",
                           "Paris is the capital of"], max_tokens=1, layers=[1], logits=False)
    last = [r[0, len(p) - 1] for r, p in zip(base.resid, base.prompt_ids)]
    assert torch.allclose(v, (last[0] + last[1]) / 2 - (last[2] + last[3]) / 2, atol=1e-5)
    assert run.resid[0].shape[0] == 1
    clean = nv.generate(m, PROMPTS, max_tokens=3, ignore_eos=True)
    steered = nv.generate(m, PROMPTS, max_tokens=3, ignore_eos=True, edits=[nv.Edit.add(v, layers=1, scale=4.0)])
    report = nv.compare(clean, steered)
    assert report is not None


def test_per_prompt_edits(model, fidelity):
    """An edit with prompts= touches those prompts of the call only (the others equal a clean run)."""
    kind, path, m = model
    d = m.config.hidden_size
    g = torch.Generator().manual_seed(1)
    three = PROMPTS + ["The capital of Italy is"]
    edits = [nv.Edit.add(torch.randn(d, generator=g), layers=[1], scale=3.0, prompts=[1]),
             nv.Edit.scale(0.5, layers=[0], site="mlp", prompts=[1, 2], positions="generated")]
    clean = nv.generate(m, three, max_tokens=4, ignore_eos=True)
    run = nv.generate(m, three, max_tokens=4, ignore_eos=True, edits=edits)
    assert run.tokens[0] == clean.tokens[0] and (run.resid[0] - clean.resid[0]).abs().max() < 1e-5
    assert (run.resid[1] - clean.resid[1]).abs().max() > 1e-2 and (run.resid[2] - clean.resid[2]).abs().max() > 1e-3
    hf = fidelity.reference(path, three, max_tokens=4, ignore_eos=True, edits=edits)
    assert run.tokens == hf.value.tokens
    for i in range(3):
        hf.check(run.resid[i], TOL, lambda r, i=i: r.resid[i], f"{kind} per-prompt: resid[{i}]")
    assert run.meta["edits"][0]["prompts"] == [1]
    with pytest.raises(ValueError, match=r"the call has 3 prompt\(s\)"):
        nv.generate(m, three, max_tokens=1, edits=[nv.Edit.scale(2.0, layers=0, prompts=[3])])
    with pytest.raises(ValueError, match="prompts='0'"):
        nv.Edit.scale(2.0, layers=0, prompts="0")


def test_bad_edits_are_refused_before_the_engine_runs(model):
    kind, path, m = model
    d = m.config.hidden_size
    with pytest.raises(ValueError, match=rf"width 3; site 'resid' of this model is {d} wide"):
        nv.generate(m, PROMPTS[0], max_tokens=1, edits=[nv.Edit.add(torch.ones(3), layers=0)])
    with pytest.raises(ValueError, match=rf"the model has {m.n_layers} blocks"):
        nv.generate(m, PROMPTS[0], max_tokens=1, edits=[nv.Edit.scale(2.0, layers=[m.n_layers])])
    with pytest.raises(TypeError, match="edits must be a list of nv.Edit"):
        nv.generate(m, PROMPTS[0], max_tokens=1, edits=[{"op": "add"}])
    with pytest.raises(ValueError, match="token positions"):
        nv.Edit.scale(2.0, layers=0, positions=[-1])
    with pytest.raises(ValueError, match="positions='decode'"):
        nv.Edit.scale(2.0, layers=0, positions="decode")
    with pytest.raises(ValueError, match="site='resdi'"):
        nv.Edit.set(0.0, layers=0, site="resdi")
    with pytest.raises(ValueError, match="expected \\[width\\]"):
        nv.Edit.add(torch.ones(2, 2), layers=0)
    assert nv.generate(m, PROMPTS[0], max_tokens=2).tokens  # the engine keeps working


def test_patching_a_whole_generation_from_another_run(model, fidelity):
    """Edit.patch: another run's values, position by position, over a whole generation."""
    kind, path, m = model
    clean_p, corrupt_p = "The capital of France is", "The capital of Italy is"
    clean = nv.generate(m, clean_p, max_tokens=4, ignore_eos=True, sites=["attn"])
    whole = nv.Edit.patch(clean, layers=[1])  # the clean stream after block 1, every position
    run = nv.generate(m, corrupt_p, max_tokens=4, ignore_eos=True, edits=[whole])
    # From block 1 on, the corrupt prompt's generation is the clean one.
    assert run.tokens == clean.tokens
    assert (run.resid[0][1:] - clean.resid[0][1:]).abs().max() < TOL
    hf = fidelity.reference(path, corrupt_p, max_tokens=4, ignore_eos=True, edits=[whole])
    assert hf.value.tokens == run.tokens
    hf.check(run.resid[0], TOL, lambda r: r.resid[0], f"{kind} patched resid")
    part = nv.Edit.patch(clean, layers=[0, 1], site="attn", positions="prompt")
    run = nv.generate(m, corrupt_p, max_tokens=4, ignore_eos=True, edits=[part], sites=["attn"])
    hf = fidelity.reference(path, corrupt_p, max_tokens=4, ignore_eos=True, edits=[part], sites=["attn"])
    assert hf.value.tokens == run.tokens
    hf.check(run.sites["attn"][0], TOL, lambda r: r.sites["attn"][0], f"{kind} patched attn")
    assert run.meta["edits"][0]["op"] == "patch"
    with pytest.raises(ValueError, match="did not capture site 'mlp'"):
        nv.Edit.patch(clean, layers=[1], site="mlp")
    with pytest.raises(ValueError, match="not among the layers the source run captured"):
        nv.Edit.patch(nv.generate(m, clean_p, max_tokens=1, layers=[0]), layers=[1])


@pytest.mark.tp
def test_a_tp_engine_captures_what_transformers_computes(model, fidelity):
    """Under tensor parallelism, in-process (toy) and isolated (llama: ``conftest.seed_engine``), the
    residual stream, logits and the MLP's sharded sites (llama's merged gate|up projection is cut by
    rank) are gathered whole and equal transformers; the logit lens gathers the unembedding."""
    kind, path, m = model
    assert getattr(m, "_nnvllm_isolated", False) == (kind == "llama")
    sites = ("mlp_in", "mlp_act")
    run = nv.generate(m, PROMPTS, max_tokens=3, sites=sites, ignore_eos=True)
    lens = nv.logit_lens(m, PROMPTS[0], max_tokens=2)
    hf = fidelity.reference(path, PROMPTS, max_tokens=3, sites=sites, ignore_eos=True)
    assert run.meta["tp"] == 2 and run.tokens == hf.value.tokens
    for i in range(len(PROMPTS)):
        hf.check(run.resid[i], TOL, lambda r, i=i: r.resid[i], f"{kind} resid[{i}]")
        hf.check(run.logits[i], TOL, lambda r, i=i: r.logits[i], f"{kind} logits[{i}]")
        for s in sites:
            hf.check(run.sites[s][i], TOL, lambda r, s=s, i=i: r.sites[s][i], f"{kind} {s}[{i}]")
    assert lens.top_ids[-1, len(run.prompt_ids[0]) - 1, 0] == run.tokens[0][0]
    if kind == "llama" and not torch.cuda.is_available():
        # _compat.engine_core_by_fork at TP>1: the server's EngineCore forked, its workers spawned (a
        # process's /proc environ is what it was exec'd with; only a spawned one holds NNVLLM_SERVER_PID,
        # which the server sets at start: test_isolated.py::test_the_engine_core_is_forked_from_the_server_on_cpu).
        import psutil

        def spawned(p) -> bool:
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                return any(v.startswith(b"NNVLLM_SERVER_PID=") for v in f.read().split(b"\0"))

        (core,) = psutil.Process(m.pid).children()
        workers = core.children()
        assert not spawned(core) and len(workers) >= 2 and all(spawned(w) for w in workers), \
            [(p.cmdline()[:1], spawned(p)) for p in [core, *workers]]


def _random_sae(hook: str, d_in: int, seed: int, **cfg) -> nv.SAE:
    """A random ReLU SAE of 96 features at sae-lens hook ``hook``, ``d_in`` wide."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d_in, 96, generator=g) / d_in ** 0.5
    return nv.SAE.from_state({"architecture": "standard", "d_in": d_in, "d_sae": 96, "dtype": "float32",
                              "metadata": {"hook_name": hook}, **cfg},
                             {"W_enc": w, "W_dec": w.T.contiguous(), "b_enc": 0.05 * torch.randn(96, generator=g),
                              "b_dec": 0.05 * torch.randn(d_in, generator=g)})


@pytest.mark.tp
def test_features_and_a_clamp_under_tensor_parallelism(model, fidelity):
    """SAE features from a tensor-parallel engine (the residual stream is whole on every rank; mlp_act
    and z are gathered from the ranks' slices before rank 0 encodes) are each SAE's encoding of
    transformers' activations, and a clamp of the residual stream equals the same clamp made with
    transformers hooks."""
    from nnvllm.edits import site_widths

    kind, path, m = model
    w, L = site_widths(m), 1
    saes = [_random_sae(f"blocks.{L}.hook_resid_post", w["resid"], 0),
            _random_sae(f"blocks.{L}.mlp.hook_post", w["mlp_act"], 1),
            _random_sae(f"blocks.{L}.attn.hook_z", w["z"], 2, reshape_activations="hook_z")]
    assert [(x.site, x.layer) for x in saes] == [("resid", L), ("mlp_act", L), ("z", L)]
    run = nv.generate(m, PROMPTS, max_tokens=3, ignore_eos=True, saes=saes, sae_dense=True)
    assert run.meta["tp"] == 2
    hf = fidelity.reference(path, PROMPTS, tokens=run.tokens, sites=["mlp_act", "z"])

    def site_in(r, i, site):
        x = r.resid[i] if site == "resid" else r.sites[site][i]
        return x[L].flatten(1).float()  # [pos, width]: z's heads side by side, as the SAE reads them

    for s, sae in enumerate(saes):
        for i in range(len(PROMPTS)):
            hf.check(run.features[s][i], TOL, lambda r, i=i, sae=sae: sae.encode(site_in(r, i, sae.site)),
                     f"{kind} features of the {sae.site} SAE [{i}]")
            assert run.features[s][i].count_nonzero() > 0
    code = torch.cat(run.features[0])
    e = nv.Edit.clamp(saes[0], int(code.mean(0).argmax()), 6.0)
    clamped = nv.generate(m, PROMPTS, max_tokens=3, ignore_eos=True, edits=[e])
    hf = fidelity.reference(path, PROMPTS, max_tokens=3, ignore_eos=True, edits=[e])
    assert clamped.tokens == hf.value.tokens
    for i in range(len(PROMPTS)):
        hf.check(clamped.resid[i], TOL, lambda r, i=i: r.resid[i], f"{kind} clamped resid[{i}]")
    assert max((a - b).abs().max().item() for a, b in zip(clamped.resid, run.resid)) > 1e-2
