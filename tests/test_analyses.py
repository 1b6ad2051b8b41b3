"""Logit lens, patching and discrepancy reports on the real engine, proven against transformers.

Bounds are CPU bounds; on a GPU the ``fidelity`` fixture (conftest.py) compares with transformers on
the same GPU and calibrates each bound from transformers' own GPU-vs-CPU distance (engines with exact=True)."""

from __future__ import annotations

import pytest
import torch

import nnvllm as nv
from nnvllm.reference import load_reference

CLEAN, CORRUPT = "The capital of France is", "The capital of Italy is"


def _hf_lens_probs(path, ids, device="cpu"):
    """[layer, pos, d_vocab] lens probabilities computed with plain transformers on ``device`` (returned on CPU)."""
    hf, _ = load_reference(path, "float32", device)
    arch = nv.arch.arch_for(hf.config.architectures)
    out = {}
    blocks = hf.get_submodule(arch.blocks)
    hooks = [b.register_forward_hook(lambda m, a, o, i=i: out.__setitem__(i, (o[0] if isinstance(o, tuple) else o)[0]))
             for i, b in enumerate(blocks)]
    with torch.no_grad():
        hf(torch.tensor([ids], device=device))
        for h in hooks:
            h.remove()
        norm, head = hf.get_submodule(arch.final_norm), hf.get_submodule(arch.unembed)
        return torch.stack([head(norm(out[i])).float().softmax(-1) for i in range(len(blocks))]).cpu()


def test_lens_last_layer_is_the_engines_next_token_distribution(toy):
    lens = nv.logit_lens(toy, CLEAN, max_tokens=4, ignore_eos=True)
    run = nv.generate(toy, CLEAN, max_tokens=4, ignore_eos=True, layers=None)
    P = len(run.prompt_ids[0])
    assert lens.top_ids.shape == (toy.n_layers, P + 3, 5)
    for t in range(4):
        engine = run.logits[0][t].softmax(-1)
        top = engine.topk(5)
        assert torch.equal(lens.top_ids[-1, P - 1 + t], top.indices)
        assert (lens.top_probs[-1, P - 1 + t] - top.values).abs().max() < 1e-4
        tok = run.tokens[0][t]
        assert abs(lens.prob_of(tok)[-1, P - 1 + t] - engine[tok]) < 1e-4


def test_lens_matches_transformers_at_every_layer_and_position(toy, toy_path, fidelity):
    lens = nv.logit_lens(toy, CLEAN, max_tokens=3, ignore_eos=True)
    seq = toy.tokenizer.encode(CLEAN) + lens.generated[:-1]
    hf = fidelity.calibrated(lambda device: _hf_lens_probs(toy_path, seq, device))
    hf.check(lens.top_probs, 1e-4, lambda ref: ref.topk(5, dim=-1).values, "top-5 lens probs")
    paris = toy.tokenizer.encode(" Paris")[0]
    hf.check(lens.prob_of(" Paris"), 1e-4, lambda ref: ref[..., paris], "lens P(Paris)")


def test_toy_answer_emerges_in_later_layers_under_the_lens(toy):
    first = []
    for prompt, answer in nv.toy.FACTS[::3]:
        lens = nv.logit_lens(toy, prompt, max_tokens=1)
        top1 = lens.top_ids[:, len(toy.tokenizer.encode(prompt)) - 1, 0]
        a = toy.tokenizer.encode(answer)[0]
        hits = (top1 == a).tolist()
        first.append(hits.index(True) if True in hits else len(hits))
    assert sum(f == 0 for f in first) <= 0.05 * len(first)
    assert sorted(first)[len(first) // 2] >= 1
    assert sum(f < toy.n_layers for f in first) >= 0.95 * len(first)


def test_lens_rejects_bad_input(toy):
    with pytest.raises(TypeError, match="one prompt"):
        nv.logit_lens(toy, [CLEAN, CORRUPT])
    lens = nv.logit_lens(toy, CLEAN, max_tokens=1)
    with pytest.raises(ValueError, match="tokens"):
        lens.prob_of(" Paris is")


def _hf_patched_diff(path, clean, corrupt, layer, pos, answer, wrong, device="cpu"):
    hf, tok = load_reference(path, "float32", device)
    blocks = hf.get_submodule(nv.arch.arch_for(hf.config.architectures).blocks)
    saved = {}

    def first(o):
        return o[0] if isinstance(o, tuple) else o

    h = blocks[layer].register_forward_hook(lambda m, a, o: saved.__setitem__("x", first(o)[0, pos].clone()))
    with torch.no_grad():
        hf(torch.tensor([tok.encode(clean)], device=device))
    h.remove()

    def write(m, a, o):
        x = first(o).clone()
        x[0, pos] = saved["x"]
        return (x,) + tuple(o[1:]) if isinstance(o, tuple) else x

    h = blocks[layer].register_forward_hook(write)
    with torch.no_grad():
        lg = hf(torch.tensor([tok.encode(corrupt)], device=device)).logits[0, -1]
    h.remove()
    a, w = tok.encode(answer)[0], tok.encode(wrong)[0]
    return float(lg[a] - lg[w])


def test_patch_matches_transformers_and_finds_the_subject(toy, toy_path, fidelity):
    res = nv.patch(toy, clean=CLEAN, corrupt=CORRUPT, answer=" Paris", wrong=" Rome", progress=False)
    n = len(toy.tokenizer.encode(CLEAN))
    assert res.effect.shape == (toy.n_layers, n)
    subject = 3  # " France" / " Italy"
    assert res.labels[subject] == " France"
    for layer, pos in [(0, subject), (2, subject), (3, n - 1), (5, 0)]:
        hf = fidelity.calibrated(lambda device, layer=layer, pos=pos: _hf_patched_diff(
            toy_path, CLEAN, CORRUPT, layer, pos, " Paris", " Rome", device))
        hf.check(float(res.patched_diff[layer, pos]), 1e-3, what=f"patched_diff{(layer, pos)}")
    assert res.effect[0, subject] > 0.8  # the subject carries the fact early on
    assert res.effect[0, :subject].abs().max() < 0.05  # earlier positions carry nothing
    assert res.effect[-1, n - 1] > 0.99 and abs(res.effect[-1, subject]) < 0.05  # moved to the end
    df = res.to_frame()
    assert len(df) == toy.n_layers * n


def test_patch_other_sites_and_subsets(toy):
    res = nv.patch(toy, CLEAN, CORRUPT, " Paris", " Rome", layers=[0, 1], positions=[3, -1], site="mlp",
                   progress=False)
    assert res.effect.shape == (2, 2) and res.positions == [3, len(toy.tokenizer.encode(CLEAN)) - 1]
    attn = nv.patch(toy, CLEAN, CORRUPT, " Paris", " Rome", layers=[1], positions=[-1], site="attn",
                    progress=False)
    assert attn.effect.shape == (1, 1)
    with pytest.raises(ValueError, match="same length"):
        nv.patch(toy, CLEAN, "The capital of the United Kingdom is", " Paris", " Rome")
    with pytest.raises(ValueError, match="tokens"):
        nv.patch(toy, CLEAN, CORRUPT, " Paris France", " Rome")
    with pytest.raises(ValueError, match="out of range"):
        nv.patch(toy, CLEAN, CORRUPT, " Paris", " Rome", layers=[99])


def _summary(key, of=lambda v: v):
    """A distance between two reference runs: one entry of their nv.compare summary (for calibration)."""
    return lambda a, b: of(nv.compare(a, b).summary()[key])


def test_compare_vllm_with_transformers_fp32(toy, toy_path, fidelity):
    prompts = [CLEAN, "The Eiffel Tower is in the city of"]
    run = nv.generate(toy, prompts, max_tokens=4, ignore_eos=True)
    hf = fidelity.reference(toy_path, prompts, max_tokens=4, ignore_eos=True)
    d = nv.compare(hf.value, run, names=("hf", "vllm"))  # the reference first, as everywhere
    s = d.summary()
    hf.check_distance(s["max_abs"], 1e-3, _summary("max_abs"), "max_abs")
    hf.check_distance(1 - s["min_cosine"], 1 - 0.99999, _summary("min_cosine", lambda c: 1 - c), "1 - min_cosine")
    hf.check_distance(s["max_kl"], 1e-6, _summary("max_kl"), "max_kl")
    assert s["token_agreement"] == 1.0 and d.fork == [None, None]
    assert len(d.resid) == toy.n_layers * sum(run.positions(i) for i in range(2))
    assert d.plot() is not None


def test_compare_clean_vs_corrupt_run_shows_the_fork_and_compares_only_shared_prefix(toy):
    a = nv.generate(toy, [CLEAN], max_tokens=3, ignore_eos=True)
    b = nv.generate(toy, [CORRUPT], max_tokens=3, ignore_eos=True)
    b.prompts = a.prompts  # compare the two runs as if they were the same request
    d = nv.compare(a, b)
    assert d.fork == [0]  # Paris vs Rome at the first step
    # only positions 0-2 ("The capital of") hold the same tokens; causal attention makes them equal
    assert sorted(d.resid["pos"].unique()) == [0, 1, 2]
    assert d.summary()["max_abs"] == 0.0


def test_patch_a_generated_step_matches_transformers(toy, toy_path, fidelity):
    """step=1: the token fed at decode step 1 (" Paris" vs " Rome") is patched; step 1's logits measured."""
    res = nv.patch(toy, CLEAN, CORRUPT, ".", " Paris", step=1, progress=False)
    n = len(toy.tokenizer.encode(CLEAN))
    assert res.positions == [n] and res.labels == [" Paris"] and res.step == 1
    for layer in (0, 3, 5):
        hf = fidelity.calibrated(lambda device, layer=layer: _hf_patched_diff(
            toy_path, CLEAN + " Paris", CORRUPT + " Rome", layer, n, ".", " Paris", device))
        hf.check(float(res.patched_diff[layer, 0]), 1e-3, what=f"patched_diff[{layer}, 0]")
    with pytest.raises(ValueError, match="one position"):
        nv.patch(toy, CLEAN, CORRUPT, ".", " Paris", step=1, positions=[2])


def test_patch_prints_no_engine_progress_bars(toy, capfd):
    # progress=False means no bar at all, vLLM's "Processed prompts" bars included.
    capfd.readouterr()
    nv.patch(toy, "The capital of France is", "The capital of Italy is", " Paris", " Rome", layers=[0],
             progress=False)
    out, err = capfd.readouterr()
    assert "Processed prompts" not in out + err and "Rendering prompts" not in out + err, (out + err)[-500:]
    with toy.trace("The capital of France is", temperature=0.0, max_tokens=1):  # plain traces keep vLLM's bars
        pass
    out, err = capfd.readouterr()
    # (an isolated engine, the GPU default, prints its bars into its own log)
    assert "Processed prompts" in out + err or getattr(toy, "_nnvllm_isolated", False)
