"""Unit tests of the pure analysis modules (lens, patching, compare, plotting) on synthetic tensors.

No engine, no checkpoint: every expected value is computed here by brute force.
"""

from __future__ import annotations

import copy
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
import torch
from torch import Tensor

from nnvllm.compare import Discrepancy, compare
from nnvllm.lens import Lens, Norm, Unembed, apply_norm, lens_prob_of, lens_topk, project
from nnvllm.patching import PatchResult, logit_diff, normalized_effect, plan
from nnvllm.plotting import (
    lens_figsize,
    log_metric,
    plot_compare,
    plot_lens,
    plot_patch,
    plot_samples,
    role_spans,
    show_token,
    title_pad,
)
from nnvllm.results import Run, Samples

D_MODEL, D_VOCAB = 8, 13


# --- fixtures ----------------------------------------------------------------------------------


class CharTokenizer:
    """Tokenizer stand-in: id t <-> the letter chr(ord('a') + t); a string is one token per char."""

    def encode(self, s, add_special_tokens=True):
        return [ord(c) - ord("a") for c in s]

    def decode(self, ids):
        return "".join(chr(ord("a") + int(t)) for t in ids)


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def make_unembed(kind="layernorm", bias=False, seed=0, dtype=torch.float32) -> Unembed:
    g = torch.Generator().manual_seed(seed)
    w = 1 + 0.1 * torch.randn(D_MODEL, generator=g)
    b = 0.1 * torch.randn(D_MODEL, generator=g) if kind == "layernorm" else None
    W = torch.randn(D_VOCAB, D_MODEL, generator=g)
    ub = torch.randn(D_VOCAB, generator=g) if bias else None
    cast = lambda t: None if t is None else t.to(dtype)
    return Unembed(Norm(kind, cast(w), cast(b), 1e-5), cast(W), cast(ub))


def make_run(n_req=2, prompt_len=4, steps=3, layers=(0, 1, 2), seed=0, sites=("attn",), logits=True) -> Run:
    g = torch.Generator().manual_seed(seed)
    prompt_ids = [[(3 * i + p) % D_VOCAB for p in range(prompt_len)] for i in range(n_req)]
    tokens = [[(5 + i + t) % D_VOCAB for t in range(steps)] for i in range(n_req)]
    n_pos = prompt_len + steps - 1
    samples = []
    for i in range(n_req):
        top_probs, top_ids = torch.rand(steps, D_VOCAB, generator=g).softmax(-1).topk(3, dim=-1)
        samples.append(Samples(torch.tensor(tokens[i]), top_probs[:, 1].clone(), top_ids, top_probs))
    return Run(
        prompts=[f"prompt {i}" for i in range(n_req)],
        prompt_ids=prompt_ids,
        tokens=tokens,
        text=["".join(chr(97 + t) for t in tok) for tok in tokens],
        logits=[torch.randn(steps, D_VOCAB, generator=g) for _ in range(n_req)] if logits else None,
        samples=samples,
        resid=[torch.randn(len(layers), n_pos, D_MODEL, generator=g) for _ in range(n_req)],
        layers=list(layers),
        sites={s: [torch.randn(len(layers), n_pos, 6, generator=g) for _ in range(n_req)] for s in sites},
        sampling={"temperature": 0.0},
        meta={"engine": "synthetic"},
    )


def brute_probs(resid: Tensor, u: Unembed) -> Tensor:
    x = resid.double()
    n = u.norm
    if n.kind == "layernorm":
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        h = (x - mu) / torch.sqrt(var + n.eps) * n.weight.double() + n.bias.double()
    else:
        h = x / torch.sqrt((x**2).mean(-1, keepdim=True) + n.eps) * n.weight.double()
    logits = h @ u.weight.double().T
    if u.bias is not None:
        logits = logits + u.bias.double()
    return logits.softmax(-1)


# --- lens --------------------------------------------------------------------------------------


def test_apply_norm_layernorm_matches_torch():
    torch.manual_seed(0)
    ln = torch.nn.LayerNorm(D_MODEL, eps=1e-5)
    with torch.no_grad():
        ln.weight.normal_()
        ln.bias.normal_()
    x = torch.randn(3, 5, D_MODEL)
    got = apply_norm(x, Norm("layernorm", ln.weight.detach(), ln.bias.detach(), 1e-5))
    torch.testing.assert_close(got, ln(x).detach())


def test_apply_norm_rmsnorm_matches_hand_formula_in_float32():
    torch.manual_seed(1)
    w = torch.randn(D_MODEL)
    x = torch.randn(4, D_MODEL).to(torch.bfloat16)
    got = apply_norm(x, Norm("rmsnorm", w.to(torch.bfloat16), None, 1e-6))
    assert got.dtype == torch.float32
    xf = x.float()
    want = xf / torch.sqrt((xf**2).mean(-1, keepdim=True) + 1e-6) * w.to(torch.bfloat16).float()
    torch.testing.assert_close(got, want)


def test_norm_and_unembed_validate():
    with pytest.raises(ValueError, match="not one of"):
        Norm("batchnorm", torch.ones(4))
    with pytest.raises(ValueError, match="takes no bias"):
        Norm("rmsnorm", torch.ones(4), torch.zeros(4))
    with pytest.raises(ValueError, match="transpose"):
        Unembed(Norm("rmsnorm", torch.ones(4)), torch.randn(4, 10))
    with pytest.raises(ValueError, match="d_model=8"):
        apply_norm(torch.randn(2, 5), Norm("rmsnorm", torch.ones(8)))


@pytest.mark.parametrize("kind,bias", [("layernorm", False), ("rmsnorm", True)])
def test_project_matches_brute_force(kind, bias):
    u = make_unembed(kind, bias)
    x = torch.randn(2, 3, D_MODEL)
    logits = project(x, u)
    assert logits.shape == (2, 3, D_VOCAB) and logits.dtype == torch.float32
    torch.testing.assert_close(logits.double().softmax(-1), brute_probs(x, u), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_lens_topk_matches_full_softmax_topk(kind):
    u = make_unembed(kind)
    resid = torch.randn(3, 7, D_MODEL)
    ids, probs = lens_topk(resid, u, k=4, chunk=3)
    want_probs, want_ids = brute_probs(resid, u).topk(4, dim=-1)
    assert ids.shape == probs.shape == (3, 7, 4)
    assert ids.dtype == torch.long and probs.dtype == torch.float32
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(probs.double(), want_probs, atol=1e-5, rtol=1e-4)
    ids_1, probs_1 = lens_topk(resid, u, k=4, chunk=10**9)
    assert torch.equal(ids, ids_1)
    torch.testing.assert_close(probs, probs_1)


def test_lens_topk_chunks_positions(monkeypatch):
    import nnvllm.lens as lens_mod

    seen = []
    real = lens_mod._project
    monkeypatch.setattr(lens_mod, "_project", lambda r, u: seen.append(r.shape[1]) or real(r, u))
    lens_topk(torch.randn(2, 10, D_MODEL), make_unembed(), k=2, chunk=4)
    assert seen == [4, 4, 2]
    seen.clear()
    lens_prob_of(torch.randn(2, 10, D_MODEL), make_unembed(), [1, 2], chunk=3)
    assert seen == [3, 3, 3, 1]


def test_lens_topk_validates():
    u = make_unembed()
    with pytest.raises(ValueError, match="larger than the vocabulary"):
        lens_topk(torch.randn(1, 2, D_MODEL), u, k=D_VOCAB + 1)
    with pytest.raises(ValueError, match=r"\[layer, pos, d_model\]"):
        lens_topk(torch.randn(2, D_MODEL), u)
    with pytest.raises(ValueError, match="positive int"):
        lens_topk(torch.randn(1, 2, D_MODEL), u, chunk=0)


def test_lens_prob_of_matches_brute_force():
    u = make_unembed("rmsnorm", bias=True)
    resid = torch.randn(2, 5, D_MODEL)
    full = brute_probs(resid, u)
    one = lens_prob_of(resid, u, 3, chunk=2)
    assert one.shape == (2, 5)
    torch.testing.assert_close(one.double(), full[..., 3], atol=1e-6, rtol=1e-4)
    many = lens_prob_of(resid, u, [3, 0, 12], chunk=2)
    assert many.shape == (2, 5, 3)
    torch.testing.assert_close(many.double(), full[..., [3, 0, 12]], atol=1e-6, rtol=1e-4)
    with pytest.raises(ValueError, match="not a token id"):
        lens_prob_of(resid, u, D_VOCAB)


def test_lens_from_run_and_methods():
    run, u, tok = make_run(), make_unembed(), CharTokenizer()
    lens = Lens.from_run(run, 1, u, k=3, tokenizer=tok)
    n_pos = run.positions(1)
    assert lens.top_ids.shape == (3, n_pos, 3)
    assert lens.layers == [0, 1, 2] and lens.prompt_len == 4 and lens.generated == run.tokens[1]
    assert lens.labels == [tok.decode([t]) for t in run.sequence(1)]
    ids, _ = lens_topk(run.resid[1], u, k=3)
    assert torch.equal(lens.top_ids, ids)
    assert lens.top_tokens(-1) == [tok.decode([int(t)]) for t in ids[2, :, 0]]
    torch.testing.assert_close(lens.prob_of("d"), lens_prob_of(run.resid[1], u, 3))
    torch.testing.assert_close(lens.prob_of(3), lens.prob_of("d"))
    with pytest.raises(ValueError, match=r"2 tokens \['a', 'b'\]"):
        lens.prob_of("ab")
    with pytest.raises(ValueError, match="out of range"):
        lens.top_tokens(3)
    assert "Lens(" in repr(lens)

    plain = Lens.from_run(run, 0, u, k=2)
    assert plain.labels == [str(t) for t in run.sequence(0)]
    assert plain.top_tokens(0) == [str(int(t)) for t in plain.top_ids[0, :, 0]]
    with pytest.raises(ValueError, match="needs a tokenizer"):
        plain.prob_of("d")


def test_lens_to_frame():
    run, u = make_run(), make_unembed()
    lens = Lens.from_run(run, 0, u, k=2, tokenizer=CharTokenizer())
    df = lens.to_frame()
    n_pos = run.positions(0)
    assert list(df.columns) == ["layer", "pos", "label", "rank", "token_id", "token", "prob"]
    assert len(df) == 3 * n_pos * 2
    row = df[(df.layer == 2) & (df.pos == 5) & (df["rank"] == 1)].iloc[0]
    assert row.token_id == int(lens.top_ids[2, 5, 1])
    assert row.prob == pytest.approx(float(lens.top_probs[2, 5, 1]))
    assert row.label == lens.labels[5]


# --- patching ----------------------------------------------------------------------------------


def test_logit_diff_and_normalized_effect():
    logits = torch.randn(4, 3, D_VOCAB)
    torch.testing.assert_close(logit_diff(logits, 2, 7), logits[..., 2] - logits[..., 7])
    with pytest.raises(ValueError, match="not a token id"):
        logit_diff(logits, D_VOCAB, 0)
    clean, corrupt = 3.0, -1.0
    patched = torch.tensor([[3.0, -1.0], [1.0, 5.0]])
    eff = normalized_effect(patched, clean, corrupt)
    torch.testing.assert_close(eff, torch.tensor([[1.0, 0.0], [0.5, 1.5]]))
    assert float(normalized_effect(clean, clean, corrupt)) == 1.0
    assert float(normalized_effect(corrupt, clean, corrupt)) == 0.0
    with pytest.raises(ValueError, match="same logit difference.*choose prompts/answers that differ"):
        normalized_effect(patched, 2.0, 2.0 + 1e-8)


def test_plan():
    assert plan(12, 5) == (list(range(12)), list(range(5)))
    assert plan(12, 5, layers=-1, positions=[0, -1]) == ([11], [0, 4])
    assert plan(12, 5, layers=[-1, 11, 3]) == ([11, 3], list(range(5)))
    with pytest.raises(ValueError, match=r"layer=40 out of range for a 12-layer model \(0-11\)"):
        plan(12, 5, layers=40)
    with pytest.raises(ValueError, match=r"pos=-6 out of range for a 5-token prompt \(0-4\)"):
        plan(12, 5, positions=[0, -6])
    with pytest.raises(ValueError, match="'all', an int"):
        plan(12, 5, layers="some")
    with pytest.raises(TypeError, match="must hold ints"):
        plan(12, 5, layers=[1.0])
    with pytest.raises(ValueError, match="selects nothing"):
        plan(12, 5, positions=[])


def make_patch() -> PatchResult:
    layers, positions = [0, 2, 4], [1, 3]
    diff = torch.tensor([[0.0, 1.0], [2.0, -0.5], [0.5, 1.5]])
    return PatchResult(
        effect=normalized_effect(diff, 2.0, 0.0),
        patched_diff=diff,
        clean_diff=2.0,
        corrupt_diff=0.0,
        layers=layers,
        positions=positions,
        labels=["b", "d"],
        site="resid",
        answer=" Paris",
        wrong=" Rome",
    )


def test_patch_result():
    res = make_patch()
    assert res.best() == (2, 1, 1.0)
    df = res.to_frame()
    assert list(df.columns) == ["layer", "pos", "label", "effect", "logit_diff"]
    assert df.iloc[3].tolist() == [2, 3, "d", -0.25, -0.5]
    assert "best=(layer 2, pos 1" in repr(res)
    with pytest.raises(ValueError, match=r"\[layer, pos\] = \(3, 2\)"):
        PatchResult(
            torch.zeros(2, 2), torch.zeros(3, 2), 1.0, 0.0, [0, 1, 2], [0, 1], ["a", "b"], "resid", "x", "y"
        )


# --- compare -----------------------------------------------------------------------------------


def test_compare_with_itself_is_exact():
    run = make_run()
    d = compare(run, copy.deepcopy(run), names=("vllm", "hf"))
    assert isinstance(d, Discrepancy)
    assert d.fork == [None, None] and d.token_agreement == 1.0
    assert list(d.resid.columns) == ["request", "layer", "pos", "max_abs", "rel_err", "cosine", "site"]
    assert set(d.resid.site) == {"resid", "attn"}
    n_rows = sum(3 * run.positions(i) for i in range(len(run)))
    assert (d.resid.site == "resid").sum() == n_rows
    assert (d.resid.max_abs == 0).all() and (d.resid.rel_err == 0).all()
    assert d.resid.cosine.to_numpy() == pytest.approx(1.0, abs=1e-12)
    assert list(d.logits.columns) == ["request", "step", "kl", "top1_agree", "max_abs"]
    assert len(d.logits) == 2 * 3
    assert d.logits.kl.to_numpy() == pytest.approx(0.0, abs=1e-12)
    assert d.logits.top1_agree.all() and (d.logits.max_abs == 0).all()
    s = d.summary()
    assert s["max_abs"] == 0 and s["max_kl"] == pytest.approx(0, abs=1e-12)
    assert s["top1_agreement"] == 1.0 and s["forks"] == [None, None] and s["names"] == ("vllm", "hf")
    assert d.per_layer().index.tolist() == [0, 1, 2]


def test_compare_finds_perturbation():
    a = make_run()
    b = copy.deepcopy(a)
    b.resid[1][2, 4, 5] += 0.25  # request 1, layer axis 2 (block 2), pos 4
    b.logits[0][1, 7] -= 2.0
    d = compare(a, b)
    r = d.resid[d.resid.site == "resid"]
    hit = r[r.max_abs > 0]
    assert len(hit) == 1
    assert hit.iloc[0][["request", "layer", "pos"]].tolist() == [1, 2, 4]
    assert hit.iloc[0].max_abs == pytest.approx(0.25)
    x = a.resid[1][2, 4].double()
    y = b.resid[1][2, 4].double()
    assert hit.iloc[0].rel_err == pytest.approx(0.25 / float(x.norm()))
    assert hit.iloc[0].cosine == pytest.approx(float(x @ y / (x.norm() * y.norm())))
    assert d.per_layer("max_abs").tolist() == pytest.approx([0, 0, 0.25])
    assert d.per_layer("cosine")[2] < 1
    assert (d.resid[d.resid.site == "attn"].max_abs == 0).all()
    lg = d.logits.set_index(["request", "step"])
    assert lg.loc[(0, 1), "max_abs"] == pytest.approx(2.0)
    pa = a.logits[0][1].double().softmax(-1)
    pb = b.logits[0][1].double().softmax(-1)
    assert lg.loc[(0, 1), "kl"] == pytest.approx(float((pa * (pa / pb).log()).sum()))
    assert lg.loc[(0, 0), "kl"] == 0
    assert d.summary()["max_abs"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="not one of"):
        d.per_layer("l2")
    with pytest.raises(ValueError, match="was not compared"):
        d.per_layer(site="mlp")


def test_compare_fork_limits_positions_and_steps():
    a = make_run(prompt_len=4, steps=5)
    b = copy.deepcopy(a)
    b.tokens[0][2] = (b.tokens[0][2] + 1) % D_VOCAB  # fork at step 2 in request 0
    b.tokens[0][3] = (b.tokens[0][3] + 1) % D_VOCAB
    # After the fork the activations differ a lot; they must not be compared.
    b.resid[0][:, 4 + 2 :] += 100.0
    b.logits[0][3:] += torch.randn(2, D_VOCAB)
    d = compare(a, b)
    assert d.fork == [2, None]
    assert d.token_agreement == pytest.approx(8 / 10)
    r0 = d.resid[(d.resid.request == 0) & (d.resid.site == "resid")]
    assert sorted(set(r0.pos)) == list(range(4 + 2))  # positions 0..prompt_len+fork-1
    assert (r0.max_abs == 0).all()
    r1 = d.resid[(d.resid.request == 1) & (d.resid.site == "resid")]
    assert sorted(set(r1.pos)) == list(range(a.positions(1)))
    assert d.logits[d.logits.request == 0].step.tolist() == [0, 1, 2]
    assert d.logits[d.logits.request == 1].step.tolist() == [0, 1, 2, 3, 4]
    assert d.summary()["forks"] == [2, None]
    assert "fork" in repr(d)


def test_compare_validates_and_handles_missing_parts():
    a = make_run()
    b = copy.deepcopy(a)
    b.prompts[1] = "other"
    with pytest.raises(ValueError, match="prompt 1 differs"):
        compare(a, b)
    c = make_run(layers=(0, 1, 3))
    with pytest.raises(ValueError, match="same captured layers"):
        compare(a, c)
    with pytest.raises(TypeError, match="nnvllm.results.Run"):
        compare(a, "run")
    bare = copy.deepcopy(a)
    bare.resid, bare.logits, bare.sites = None, None, {}
    d = compare(a, bare)
    assert (
        d.resid.empty
        and d.logits.empty
        and d.logits.columns.tolist() == ["request", "step", "kl", "top1_agree", "max_abs"]
    )
    s = d.summary()
    assert s["max_abs"] != s["max_abs"] and s["token_agreement"] == 1.0  # NaN without resid
    assert d.per_layer().empty


def test_compare_kl_with_masked_logits():
    a = make_run(n_req=1)
    a.logits[0][:, 5] = -float("inf")
    b = copy.deepcopy(a)
    d = compare(a, b)
    assert d.logits.kl.to_numpy() == pytest.approx(0.0, abs=1e-12)
    assert (d.logits.max_abs == 0).all()


# --- plotting ----------------------------------------------------------------------------------


def test_plot_lens():
    run = make_run(prompt_len=4, steps=5)
    lens = Lens.from_run(run, 0, make_unembed(), k=2, tokenizer=CharTokenizer())
    ax = plot_lens(lens)
    assert len(ax.images) == 1
    assert ax.images[0].get_array().shape == (3, run.positions(0))
    assert len(ax.texts) == 3 * run.positions(0)
    assert len(ax.lines) == 1  # the prompt/generated boundary
    ticks = ax.get_xticklabels()
    assert [t.get_text() for t in ticks] == lens.labels
    assert ticks[4].get_color() != ticks[3].get_color()

    # Sized to the data: 40 positions get ~0.45 in each, not matplotlib's 6.4 in.
    big = Lens.from_run(make_run(prompt_len=4, steps=37), 0, make_unembed(), k=2, tokenizer=CharTokenizer())
    ax40 = plot_lens(big)
    assert ax40.images[0].get_array().shape[1] == 40 and ax40.figure.get_figwidth() >= 0.4 * 40
    plt.close(ax40.figure)

    _, own = plt.subplots()
    ax2 = lens.plot(ax=own, annotate=False, max_positions=3)
    assert ax2 is own and not ax2.texts
    assert ax2.images[0].get_array().shape == (3, 3)
    assert not ax2.lines  # only generated positions shown: no boundary inside the view


def test_plot_patch():
    res = make_patch()
    ax = res.plot()
    assert len(ax.images) == 1
    lo, hi = ax.images[0].get_clim()
    assert lo == -hi
    assert [t.get_text() for t in ax.get_xticklabels()] == ["b (1)", "d (3)"]
    assert plot_patch(res).images


def test_plot_patch_uses_one_fixed_scale():
    """Two sweeps with different largest effects share the -1..1 scale, so their plots compare."""
    import dataclasses

    res = make_patch()
    small = dataclasses.replace(res, effect=res.effect.clamp(-1, 1) * 0.33 / max(float(res.effect.abs().max()), 1e-9))
    big = dataclasses.replace(res, effect=torch.full_like(res.effect, 0.2).index_fill_(1, torch.tensor([0]), 1.5))
    assert small.plot().images[0].get_clim() == (-1.0, 1.0)
    assert big.plot().images[0].get_clim() == (-1.5, 1.5)  # widened only past a full restoration
    assert small.plot(vmin=-0.5, vmax=0.5).images[0].get_clim() == (-0.5, 0.5)


def test_plot_compare():
    a = make_run()
    b = copy.deepcopy(a)
    b.tokens[1][1] += 1
    b.resid[0] += 1e-3 * torch.randn_like(b.resid[0])
    d = compare(a, b, names=("tp1", "tp2"))
    ax = d.plot()
    assert len(ax.lines) == 3 and ax.get_yscale() == "log"
    assert "fork at step 1" in ax.get_title()
    ax_same = plot_compare(compare(a, a))
    assert "fork" not in ax_same.get_title()
    # Identical runs: every value is an exact 0, drawn as floor markers labelled "exact", not at 1e-16.
    data = [ln for ln in ax_same.lines if ln.get_transform() == ax_same.transData]
    assert len(data) == 3 and all(np.isnan(ln.get_ydata()).all() for ln in data)
    assert any(t.get_text() == "exact" for t in ax_same.texts)


# A conversation's positions: template, a system message, template, a user message, the template's
# generation prompt, then two generated (assistant) positions.
CHAT_ROLES = ["template", "system", "system", "template", "user", "user", "user", "template", "assistant", "assistant"]


def chat_lens(roles=CHAT_ROLES) -> Lens:
    run = make_run(n_req=1, prompt_len=8, steps=3)
    run.roles = [list(roles)] if roles is not None else []
    return Lens.from_run(run, 0, make_unembed(), k=2, tokenizer=CharTokenizer())


def _marks(ax) -> tuple[list[tuple[float, float]], list[tuple[str, float]], list[float]]:
    """What the role marks drew: hatched column ranges, the role names and their x, the gap lines' x."""
    hatched = [(round(p.get_x(), 6), round(p.get_x() + p.get_width(), 6)) for p in ax.patches
               if p.get_gid() == "nnvllm-template"]
    names = [(t.get_text(), float(t.get_position()[0])) for t in ax.texts if t.get_gid() == "nnvllm-role"]
    gaps = [float(ln.get_xdata()[0]) for ln in ax.lines if ln.get_gid() == "nnvllm-gap"]
    return hatched, names, gaps


def test_role_spans_break_at_a_new_label_or_a_hidden_position():
    assert role_spans(CHAT_ROLES) == [(0, 0, "template"), (1, 2, "system"), (3, 3, "template"), (4, 6, "user"),
                                      (7, 7, "template"), (8, 9, "assistant")]
    assert role_spans(["user"] * 3, where=[1, 2, 5]) == [(0, 1, "user"), (2, 2, "user")]
    assert role_spans([]) == []


def test_plot_lens_hatches_the_template_and_names_each_role():
    lens = chat_lens()
    ax = plot_lens(lens)
    hatched, names, gaps = _marks(ax)
    assert hatched == [(-0.5, 0.5), (2.5, 3.5), (6.5, 7.5)]  # the template's three columns
    assert names == [("system", 1.5), ("user", 5.0), ("assistant", 8.5)] and gaps == []
    ticks = ax.get_xticklabels()
    assert [t.get_color() for t in ticks[:2]] == ["0.5", "black"]  # template tick grey, the system's not
    assert ticks[8].get_color() == "tab:red"  # generated positions keep their colour
    assert ax.get_xlabel().endswith("hatched: chat template") and title_pad(ax) > 6
    assert len(ax.texts) == 3 * 10 + 3  # the cells' tokens and the three role names
    colours: dict[int, set] = {}
    for t in ax.texts:
        if t.get_gid() is None:
            colours.setdefault(round(t.get_position()[0]), set()).add(t.get_color())
    assert colours[0] == colours[3] == colours[7] == {"black"}  # lightened columns: dark labels
    assert colours[4] == {"white"}  # a user column of probabilities > 0.5 keeps white labels

    # positions="content" draws the messages' positions only (Lens.select), a dotted line where the
    # template's were; the prompt/generated boundary stays where it belongs.
    ax = lens.plot(positions="content")
    keep = [p for p, r in enumerate(CHAT_ROLES) if r != "template"]
    assert ax.images[0].get_array().shape == (3, len(keep))
    assert [t.get_text() for t in ax.get_xticklabels()] == [show_token(lens.labels[p]) for p in keep]
    hatched, names, gaps = _marks(ax)
    assert hatched == [] and gaps == [1.5, 4.5]  # 2 -> 4 and 6 -> 8 skip a template position
    assert [n for n, _ in names] == ["system", "user", "assistant"]
    assert sum(ln.get_color() == "tab:red" for ln in ax.lines) == 1  # the boundary, between 6 and 8
    assert ax.images[0].get_array()[0, 2] == pytest.approx(float(lens.top_probs[0, 4, 0]))

    # One role only: the columns are that role's, nothing to name.
    ax = plot_lens(lens, positions="user")
    assert ax.images[0].get_array().shape == (3, 3) and _marks(ax)[:2] == ([], [])
    # The last positions only (max_positions): the marks follow the columns shown.
    hatched, names, _ = _marks(plot_lens(lens, max_positions=4))
    assert hatched == [(0.5, 1.5)] and names == [("user", 0.0), ("assistant", 2.5)]


def test_plot_lens_of_a_plain_prompt_has_no_role_marks():
    for roles in (None, ["user"] * 8 + ["assistant"] * 2):
        lens = chat_lens(roles)
        ax = plot_lens(lens)
        assert _marks(ax) == ([], [], []) and title_pad(ax) is None
        assert len(ax.lines) == 1 and "hatched" not in ax.get_xlabel()
    with pytest.raises(ValueError, match="no roles"):
        plot_lens(chat_lens(None), positions="content")
    with pytest.raises(ValueError, match="selects no position"):
        plot_lens(chat_lens(["user"] * 10), positions="system")


def test_plot_patch_marks_roles_and_draws_the_positions_asked_for():
    effect = torch.linspace(-0.5, 1.0, 2 * 6).reshape(2, 6)
    res = PatchResult(effect=effect, patched_diff=effect * 2, clean_diff=2.0, corrupt_diff=0.0, layers=[0, 3],
                      positions=[0, 1, 2, 3, 4, 5], labels=list("abcdef"), site="resid", answer=" Paris",
                      wrong=" Rome", roles=["template", "system", "template", "user", "user", "template"])
    ax = res.plot()
    hatched, names, gaps = _marks(ax)
    assert hatched == [(-0.5, 0.5), (1.5, 2.5), (4.5, 5.5)] and names == [("system", 1.0), ("user", 3.5)]
    assert gaps == [] and [t.get_color() for t in ax.get_xticklabels()][:2] == ["0.5", "black"]

    ax = res.plot(positions="content")
    assert [t.get_text() for t in ax.get_xticklabels()] == ["b (1)", "d (3)", "e (4)"]
    assert np.array_equal(ax.images[0].get_array(), effect[:, [1, 3, 4]].numpy())
    assert ax.images[0].get_clim() == (-1.0, 1.0)  # the whole sweep's colour scale
    hatched, names, gaps = _marks(ax)
    assert hatched == [] and gaps == [0.5] and [n for n, _ in names] == ["system", "user"]
    assert [t.get_text() for t in res.plot(positions=[4, 1]).get_xticklabels()] == ["b (1)", "e (4)"]
    assert res.plot(positions=["user"]).images[0].get_array().shape == (2, 2)
    with pytest.raises(ValueError, match=r"positions=\[7\].*\[0, 1, 2, 3, 4, 5\]"):
        res.plot(positions=[7])
    with pytest.raises(ValueError, match="no roles"):
        make_patch().plot(positions="content")


class WordTokenizer:
    """Tokenizer stand-in with long, special and whitespace tokens: id t <-> WORDS[t % 13]."""

    WORDS = ("official", "<|endoftext|>", " is", "\n", " ", "a", " Paris", "Kenya", "$x", "\t", "ab cd", "xyz", "Q")

    def decode(self, ids):
        return "".join(self.WORDS[int(t) % len(self.WORDS)] for t in ids)


def word_lens(n_layer=6, n_pos=10, prompt_len=5) -> Lens:
    """A lens whose top-1 tokens run through every word of WordTokenizer, cell by cell."""
    tok = WordTokenizer()
    top_ids = torch.arange(n_layer * n_pos * 2).reshape(n_layer, n_pos, 2) % len(tok.WORDS)
    top_probs = torch.linspace(0.05, 0.95, n_layer * n_pos * 2).reshape(n_layer, n_pos, 2)
    return Lens(top_ids=top_ids, top_probs=top_probs, layers=list(range(n_layer)),
                labels=[tok.decode([p]) for p in range(n_pos)], prompt_len=prompt_len,
                resid=torch.zeros(n_layer, n_pos, D_MODEL), unembed=make_unembed(), tokenizer=tok,
                generated=list(range(prompt_len, n_pos)))


def test_show_token_makes_whitespace_visible():
    assert show_token(" is") == "␣is" and show_token("\n") == "↵" and show_token("\t") == "⇥"
    assert show_token(" ") == "␣" and show_token("") == "''" and show_token("\x00") == "\\x00"
    assert show_token("$x") == r"\$x" and show_token("<|endoftext|>", 8) == "<|endof…"


@pytest.mark.parametrize("figsize", [None, (8, 4.5), (7, 3)])  # plot_lens's own size; notebooks 01 and 05
def test_lens_cell_labels_fit_inside_their_cells(figsize):
    lens = word_lens()
    ax = plot_lens(lens) if figsize is None else plot_lens(lens, ax=plt.subplots(figsize=figsize)[1])
    if figsize is None:
        assert tuple(ax.figure.get_size_inches()) == lens_figsize(10, 6)
    ax.figure.canvas.draw()
    renderer = ax.figure.canvas.get_renderer()
    cells = ax.texts
    assert len(cells) == 6 * 10
    for t in cells:
        c, j = t.get_position()
        (x0, y0), (x1, y1) = ax.transData.transform([(c - 0.5, j - 0.5), (c + 0.5, j + 0.5)])
        bb = t.get_window_extent(renderer)
        assert x0 <= bb.x0 and bb.x1 <= x1 and y0 <= bb.y0 and bb.y1 <= y1, (t.get_text(), figsize)
        assert t.get_fontsize() >= 6.5
    texts = {t.get_text().replace("\n", "") for t in cells}
    # Whitespace tokens are visible, and a word as long as "official" is shown whole at these sizes.
    assert {"␣is", "↵", "␣", "⇥", "␣Paris", "official", "ab␣cd"} <= texts
    if figsize is None:  # the size plot_lens picks shows even <|endoftext|> whole (on two lines)
        assert "<|endoftext|>" in texts and not any(t.endswith("…") for t in texts)
    ticks = [t.get_text() for t in ax.get_xticklabels()]
    assert ticks[2:5] == ["␣is", "↵", "␣"]


def test_log_metric_marks_exact_zeros_and_clips_rounding():
    _, ax = plt.subplots()
    # 1 - cosine of identical vectors can come out as -2.2e-16: that is 0, and 0 is "exact".
    log_metric(ax, [0, 1, 2, 3, 4], [-2.2e-16, 0.0, 1e-6, 1e-3, 0.0], label="1 - cosine")
    (line, floor) = ax.lines
    assert np.isnan(line.get_ydata()[[0, 1, 4]]).all() and list(line.get_ydata()[2:4]) == [1e-6, 1e-3]
    assert list(floor.get_xdata()) == [0, 1, 4] and floor.get_transform() != ax.transData
    assert sorted(t.get_position()[0] for t in ax.texts if t.get_text() == "exact") == [0.5, 4.0]  # one per run
    lo, hi = ax.get_ylim()
    assert 1e-9 < lo < 1e-6 and 1e-3 < hi < 1e-1  # the range follows the nonzero values, not 1e-16


def test_plot_compare_side_by_side_shares_one_y_label():
    a = make_run()
    b = copy.deepcopy(a)
    b.resid[0] += 1e-3 * torch.randn_like(b.resid[0])
    fig, axes = plt.subplots(1, 2, sharey=True)
    plot_compare(compare(a, b), ax=axes[0])
    plot_compare(compare(a, a), ax=axes[1])
    assert axes[0].get_ylabel() and axes[1].get_ylabel() == ""
    _, alone = plt.subplots()
    assert plot_compare(compare(a, b), ax=alone).get_ylabel()


def test_plot_samples_legend_leaves_the_bars_free():
    run = make_run(steps=8)
    run.samples[1].probs[:] = 1.0  # bars up to the top, where a legend inside would sit
    fig, ax = plt.subplots(figsize=(8, 3.5))  # notebook 02's size
    plot_samples(run, 1, ax=ax, tokenizer=WordTokenizer())
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(r)
    axes_box = ax.get_window_extent(r)
    assert legend.x0 >= axes_box.x1  # right of the Axes
    for bar in ax.patches:
        assert not legend.overlaps(bar.get_window_extent(r))
    for note in ax.texts:  # names of tokens passed over stay inside the Axes
        assert axes_box.contains(*note.get_window_extent(r).p0) and axes_box.contains(*note.get_window_extent(r).p1)
    assert [t.get_text() for t in ax.get_xticklabels()][:2] == [show_token(WordTokenizer().decode([t]), 14)
                                                                 for t in run.tokens[1][:2]]


def test_plot_samples():
    run = make_run()
    ax = plot_samples(run, 1, tokenizer=CharTokenizer())
    assert len(ax.patches) == len(run.samples[1])
    assert ax.collections  # the top-k dots
    assert [t.get_text() for t in ax.get_xticklabels()] == [chr(97 + t) for t in run.tokens[1]]
    with pytest.raises(ValueError, match="out of range"):
        plot_samples(run, 5)


# --- results & purity --------------------------------------------------------------------------


def test_run_save_load_round_trip(tmp_path):
    run = make_run()
    run.save(tmp_path / "run.pt")
    back = Run.load(tmp_path / "run.pt")
    assert back.prompts == run.prompts and back.tokens == run.tokens and back.layers == run.layers
    assert isinstance(back.samples[0], Samples)
    assert torch.equal(back.samples[1].top_ids, run.samples[1].top_ids)
    assert all(torch.equal(x, y) for x, y in zip(back.resid, run.resid))
    assert torch.equal(back.sites["attn"][0], run.sites["attn"][0])
    assert back.meta == run.meta and back.sampling == run.sampling
    pd.testing.assert_frame_equal(back.to_frame(), run.to_frame())
    d = compare(run, back)
    assert d.summary()["max_abs"] == 0


def test_pure_modules_import_no_engine():
    """The pure modules (lens, compare, patching, plotting, views, ...) import neither an engine,
    transformers nor ipywidgets, even lazily."""
    import ast
    import importlib

    for name in ("lens", "compare", "patching", "plotting", "results", "store", "_validate", "views"):
        path = importlib.import_module(f"nnvllm.{name}").__file__
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
        mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
        bad = {m for m in mods if m.split(".")[0] in ("vllm", "nnsight", "transformers", "ipywidgets")}
        assert not bad, (name, bad)


def test_import_nnvllm_loads_no_engine():
    """`import nnvllm` imports neither vLLM, nnsight, transformers nor ipywidgets."""
    import subprocess
    import sys

    code = ("import sys, nnvllm; print(sorted({m.split('.')[0] for m in sys.modules "
            "if m.split('.')[0] in ('vllm', 'nnsight', 'transformers', 'ipywidgets')}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_gpu_engines_are_sized_to_free_memory():
    from nnvllm.engine import _fit

    assert _fit({}, None) == {}  # no NVML: vLLM's default
    assert _fit({}, 0.995) == {}  # an empty GPU: vLLM's default
    got = _fit({"dtype": "float16"}, 0.10)["gpu_memory_utilization"]
    assert 0.08 < got < 0.09  # 0.9 x the free 10%, a little under
    assert _fit({"gpu_memory_utilization": 0.5}, 0.10) == {"gpu_memory_utilization": 0.5}  # the caller's choice
    assert "gpu_memory_utilization" in _fit({"kv_cache_memory_bytes": 1 << 30}, 0.5)
    with pytest.raises(RuntimeError, match="nv.engines"):
        _fit({}, 0.01)


def test_a_fixed_gpu_share_for_engines_from_the_environment(monkeypatch):
    from nnvllm.engine import GPU_SHARE_ENV, KV_CACHE_ENV, fit_gpu_memory

    monkeypatch.delenv(KV_CACHE_ENV, raising=False)  # (the GPU lane sets it for its engines)
    monkeypatch.setenv(GPU_SHARE_ENV, "0.3")
    assert fit_gpu_memory({"dtype": "float16"}) == {"dtype": "float16", "gpu_memory_utilization": 0.3}
    assert fit_gpu_memory({"gpu_memory_utilization": 0.5}) == {"gpu_memory_utilization": 0.5}  # the caller's
    for bad in ("1.5", "0", "lots"):
        monkeypatch.setenv(GPU_SHARE_ENV, bad)
        with pytest.raises(ValueError, match="NNVLLM_GPU_MEMORY_UTILIZATION"):
            fit_gpu_memory({})
    monkeypatch.setenv(GPU_SHARE_ENV, "0.3")
    monkeypatch.setenv("NNVLLM_KV_CACHE_MEMORY_BYTES", "1GiB")
    assert fit_gpu_memory({}) == {"gpu_memory_utilization": 0.3, "kv_cache_memory_bytes": 1 << 30}
    assert fit_gpu_memory({"kv_cache_memory_bytes": 5})["kv_cache_memory_bytes"] == 5  # the caller's
    monkeypatch.setenv("NNVLLM_KV_CACHE_MEMORY_BYTES", "lots")
    with pytest.raises(ValueError, match="NNVLLM_KV_CACHE_MEMORY_BYTES='lots'"):
        fit_gpu_memory({})


def test_names_with_mathtext_characters_plot_and_tables_read_right():
    # "$" in a name must not start matplotlib's mathtext (a ParseException on "^"); the per-position
    # cosine table shows 1 - cosine (a cosine near 1 prints as 1.000000000 everywhere) and n/a, not
    # NaN, where a request is shorter.
    import matplotlib.pyplot as plt

    from nnvllm.views import per_position, position_table_html

    a = make_run()
    b = copy.deepcopy(a)
    b.resid[0] += 1e-4 * torch.randn_like(b.resid[0])
    b.tokens[1][0] += 1  # request 1 forks at step 0: fewer positions compared
    d = compare(a, b, names=("vllm $x^$", "hf"))
    ax = plot_compare(d)
    ax.figure.canvas.draw()  # mathtext is parsed at draw time
    assert "$x^$" in ax.get_title().replace("\\$", "$")
    plt.close(ax.figure)
    html_ = position_table_html(per_position(d, "cosine", 0), "cosine", 0)
    assert "1 - cosine" in html_ and "n/a" in html_ and "1.000000000" not in html_ and "NaN" not in html_


def test_run_plot_labels_tokens_with_the_runs_tokenizer():
    # A Run has plot(); without tokenizer= the run's own tokenizer labels the bars.
    run = make_run()
    ax = run.plot(1)
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(t) for t in run.tokens[1]]  # none: ids
    run.tokenizer = CharTokenizer()  # what nv.generate / nv.reference set
    ax = run.plot(1)
    assert [t.get_text() for t in ax.get_xticklabels()] == [chr(97 + t) for t in run.tokens[1]]



def test_result_classes_are_exported():
    # The classes nnvllm's functions return are reachable from the package.
    import nnvllm as nv

    for name, module in [("Lens", "lens"), ("PatchResult", "patching"), ("Discrepancy", "compare"),
                         ("Dataset", "store"), ("EngineInfo", "engine"), ("Run", "results"), ("Samples", "results")]:
        cls = getattr(nv, name)
        assert name in nv.__all__ and cls.__module__ == f"nnvllm.{module}", name
    # Conversations: nv.chat.render shows a conversation's text, ids and roles before any run.
    assert "chat" in nv.__all__ and nv.chat.render.__module__ == "nnvllm.chat"


def test_a_loopback_rendezvous_listens_on_loopback_only():
    """torch's TCPStore listens on every interface whatever host it is given; vLLM's engines start
    one at 127.0.0.1 (on an H200 it listened on ':::PORT'). nnvllm's engine workers bind it first."""
    import datetime
    import importlib
    import socket

    import psutil

    from nnvllm.engine.compat import bind_stores_to_loopback

    rdzv = importlib.import_module("torch.distributed.rendezvous")
    before = rdzv.TCPStore  # an in-process engine of an earlier test may have wrapped it already
    rdzv.TCPStore = getattr(before, "_nnvllm_real", before)  # torch's own

    def store_on_a_free_port():
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()
        return port, rdzv._create_c10d_store("127.0.0.1", port, 0, 1, datetime.timedelta(seconds=10))

    def listening(port):
        return [c.laddr.ip for c in psutil.Process().net_connections(kind="inet")
                if c.status == psutil.CONN_LISTEN and c.laddr.port == port]

    try:
        port, plain = store_on_a_free_port()
        assert listening(port) and listening(port)[0] not in ("127.0.0.1", "::1")  # what torch does alone
        del plain
        bind_stores_to_loopback()
        bind_stores_to_loopback()  # twice: still one wrapper
        port, store = store_on_a_free_port()
        assert listening(port) == ["127.0.0.1"]
        store.set("k", b"v")
        assert store.get("k") == b"v"
    finally:
        rdzv.TCPStore = before


def test_a_failed_engine_start_names_the_first_error_in_its_log(tmp_path):
    """vLLM ends a failed start with "Engine core initialization failed. See root cause above";
    the cause is far above the log's last lines, so the error quotes it first."""
    from nnvllm.engine.isolated import _cause, _log_report

    log = tmp_path / "engine.log"
    log.write_text("\n".join(
        ["INFO starting"]
        + ["(EngineCore pid=12) ERROR Traceback (most recent call last):",
           "(EngineCore pid=12) ERROR ValueError: Free memory on device cuda:0 (20.1/139.8 GiB) on startup "
           "is less than desired GPU memory utilization (0.3, 41.9 GiB)."]
        + [f"noise line {i}" for i in range(100)]
        + ["[rank0]: RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"]))
    assert _cause(log).startswith("ValueError: Free memory on device cuda:0 (20.1/139.8 GiB)")
    report = _log_report(log)
    assert report.startswith("First error in its log: ValueError: Free memory")
    assert "Engine core initialization failed" in report  # the tail is still there
    log.write_text("just INFO lines\n")
    assert _cause(log) == "" and _log_report(log).startswith("Last lines of its log")


def test_register_arch_reaches_engine_processes(monkeypatch):
    """A registered family is known here and in any process started afterwards (engine processes
    inherit the environment); bad entries are refused; the unknown-family error says how to add one."""
    import dataclasses
    import os
    import subprocess
    import sys

    import nnvllm as nv
    from nnvllm.arch import arch_for

    monkeypatch.delenv("NNVLLM_ARCHS", raising=False)
    monkeypatch.setattr(nv.arch, "ARCHS", dict(nv.ARCHS))
    with pytest.raises(ValueError, match=r"nnvllm.register_arch\(name, arch\)"):
        arch_for(["MyLMForCausalLM"])
    mine = dataclasses.replace(nv.ARCHS["LlamaForCausalLM"], family="mylm")
    nv.arch.register_arch("MyLMForCausalLM", mine)
    assert arch_for(["MyLMForCausalLM"]) == mine
    code = ("from nnvllm.arch import arch_for; a = arch_for(['MyLMForCausalLM']); "
            "print(a.family, a.sites['mlp_in'], a.hf_sites['mlp_in'], a.merged_gate_up)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=dict(os.environ))
    assert out.stdout.split() == ["mylm", "('mlp.gate_up_proj',", "'output')", "('mlp.gate_proj',", "'mlp.up_proj')", "True"]
    with pytest.raises(ValueError, match="expected a site of"):
        nv.arch.register_arch("Bad", dataclasses.replace(mine, sites={"resid": ("", "output"), "mlpp": ("mlp", "output")}))
    with pytest.raises(ValueError, match="must define 'resid'"):
        nv.arch.register_arch("Bad", dataclasses.replace(mine, sites={"attn": ("self_attn", "output")}))
    with pytest.raises(TypeError, match="nnvllm.Arch"):
        nv.arch.register_arch("Bad", {"blocks": "x"})


def test_nnvllm_shows_no_transformers_bars(tmp_path, capsys):
    """No "Writing model shards" / "Loading weights" bars in cells that build or load a checkpoint for
    the user; the user's own setting is kept."""
    from transformers.utils import logging as hf_logging

    from nnvllm.reference import load_reference
    from nnvllm.testing import tiny_checkpoint

    path = tiny_checkpoint("llama", tmp_path / "ckpt")
    load_reference.__wrapped__(path, "float32", "cpu")  # not the cached one
    err = capsys.readouterr().err
    assert "Writing model shards" not in err and "Loading weights" not in err, err[-500:]
    assert hf_logging.is_progress_bar_enabled()


def _package_imports() -> dict[str, set[str]]:
    """Every module of the package (dotted name) -> the package modules it imports, counting imports
    inside functions too (a cycle there is still a tangle, and a lazy import can hide it)."""
    import ast

    import nnvllm

    root = Path(nnvllm.__file__).parent
    names = {}
    for p in root.rglob("*.py"):
        parts = ("nnvllm",) + p.relative_to(root).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph = {}
    for name, p in names.items():
        package = name if p.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
                cands = [f"{target}.{a.name}" for a in node.names]  # `from . import x`: x is the module
                for cand in ([target] if node.module else []) + cands:
                    if cand in names:
                        deps.add(cand)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("nnvllm"):
                deps |= {c for c in [node.module] + [f"{node.module}.{a.name}" for a in node.names] if c in names}
        graph[name] = deps - {name}
    return graph


def test_the_package_import_graph_has_no_cycles():
    """nnvllm's modules import one another in one direction only. A package importing its own rooms
    (``nnvllm.engine`` -> ``nnvllm.engine.models``) is how a package is built; a room importing its
    package back lazily is the one allowed way up, and only within the engine floor's own package."""
    graph = _package_imports()
    for name in graph:  # drop package -> own-room edges' reverse only where the room is inside it
        graph[name] = {d for d in graph[name] if not (name.startswith(d + ".") and d.startswith("nnvllm.engine"))}
    found = []

    def visit(node, path):
        for nxt in graph[node]:
            if nxt == path[0]:
                found.append(" -> ".join(path + [nxt]))
            elif nxt not in path:
                visit(nxt, path + [nxt])

    for start in graph:
        visit(start, [start])
    assert not found, found[:5]


#: The verbs and the top floor: the engine floor never imports them (helpers it needs live on the ground floor).
ABOVE_THE_ENGINE = {"nnvllm.capture", "nnvllm.store", "nnvllm.analyses", "nnvllm.streaming", "nnvllm.views",
                    "nnvllm.widgets", "nnvllm.reference"}


def test_the_engine_floor_imports_nothing_above_it():
    graph = _package_imports()
    bad = {m: sorted(d & ABOVE_THE_ENGINE) for m, d in graph.items()
           if m.startswith("nnvllm.engine") and d & ABOVE_THE_ENGINE}
    assert not bad, f"the engine floor imports verbs or widgets: {bad}"


def test_no_module_of_the_package_is_over_600_lines():
    import nnvllm

    long = {str(p.relative_to(Path(nnvllm.__file__).parent)): n for p in Path(nnvllm.__file__).parent.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 600}
    assert not long, f"modules over 600 lines (split them into rooms with clear names): {long}"


def test_only_the_engine_floor_imports_vllm_or_nnsight():
    """vLLM and nnsight are imported (even lazily) by ``nnvllm.engine`` and its rooms only."""
    import ast

    import nnvllm

    root = Path(nnvllm.__file__).parent
    bad = {}
    for p in root.rglob("*.py"):
        tree = ast.parse(p.read_text())
        mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        mods |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
        engine = sorted(m for m in mods if m.split(".")[0] in ("vllm", "nnsight"))
        if engine and p.relative_to(root).parts[0] != "engine":
            bad[str(p.relative_to(root))] = engine
    assert not bad, f"modules outside the engine floor import vLLM/nnsight: {bad}"


def test_a_capture_travels_as_json_when_plain_and_as_tensors_otherwise():
    from nnvllm.engine.transport import pack, unpack

    reply = {"outputs": [{"request_id": "a1", "prompt_token_ids": [1, 2], "token_ids": [3], "text": "é",
                          "finished": True}], "handoff": {"files": [{"path": "/dev/shm/x", "shape": [2, 3]}]},
             "error": None, "timings": {"add": 0.25}}
    data, kind = pack(reply)
    assert kind == "application/json" and unpack(data, kind) == reply
    # A steering vector in the spec: torch's format (loaded without unpickling code), values intact.
    req = {"prompts": ["x"], "spec": {"edits": [{"vector": torch.arange(4.0)}]}}
    data, kind = pack(req)
    assert kind == "application/octet-stream"
    assert torch.equal(unpack(data, kind)["spec"]["edits"][0]["vector"], torch.arange(4.0))
    # What JSON would change is not sent as JSON: int keys, tuples.
    for changed in ({1: "a"}, {"a": (1, 2)}):
        assert pack(changed)[1] == "application/octet-stream" and unpack(*pack(changed)) == changed


def test_the_eager_steps_notice_is_one_line_naming_why_and_how_many():
    """A trace whose decode steps ran eagerly on a graph engine gets one line from every rank's notes:
    the largest step count of its requests and the first reason; nothing when no step did."""
    from nnvllm.engine.transport import eager_notice

    assert eager_notice([]) is None and eager_notice([{}, None]) is None
    why = "a trace reads model.transformer.h.0.mlp.output, inside the forward, not a block's output"
    notice = eager_notice([{"a": (why, 4), "b": (why, 5)}, {"a": (why, 4)}])
    assert notice.startswith("nnvllm: 5 decode step(s) of this trace ran eagerly on the CUDA graph engine: " + why)
    assert "\n" not in notice and "docs/capture.md" in notice


def test_graph_sites_names_what_the_cuda_graphs_record():
    """NNVLLM_GRAPH_SITES (read by a GPU engine's worker at load): unset, every site; else the named
    subset in table order; a name the model lacks is refused with what it offers."""
    from nnvllm.engine.worker.taps import graph_sites

    sites = ["resid", "attn_out", "mlp_out", "q", "k", "v", "z"]
    assert graph_sites(None, sites) == sites and graph_sites(" ", sites) == sites
    assert graph_sites("z, resid", sites) == ["resid", "z"]
    with pytest.raises(ValueError, match=r"NNVLLM_GRAPH_SITES='resid,heads' names \['heads'\].*subset of"):
        graph_sites("resid,heads", sites)


def test_the_ring_serves_each_step_its_slot_and_never_writes_a_held_one():
    """The ring a graph engine's steps in pieces copy their seams into (worker/ring.py), driven here
    eagerly on the CPU: the copies that a recording puts in its pieces, run by hand at each step."""
    from nnvllm.engine.worker.ring import SLOTS, Ring

    def step(ring, values, tokens):  # a step in pieces: its slot, then each seam's recorded copy
        ring.tokens = tokens  # (the batch its pieces were recorded for)
        ring.start(tokens)
        for seam, v in values.items():
            assert ring.record(seam, v) is not None
        return ring.slot

    d = 8
    ring = Ring(torch.device("cpu"), budget=1 << 20, largest=16)
    ring.tokens = 16  # the whole graph of the largest batch, recorded first
    pair = (torch.zeros(16, d, dtype=torch.float16), torch.zeros(16, d, dtype=torch.float16))
    ring.learn("model.layers.0.output", pair)
    ring.learn("model.layers.1.output", torch.zeros(16, 2 * d))
    ring.learn("model.layers.2.output", [torch.zeros(16, d)])  # not a tensor or a tuple of them: clones
    ring.learn("model.layers.3.output", torch.zeros(1, 16, d))  # tokens on dim 1 (Transformers backend): clones
    ring.make(16)
    assert ring.rows == 16 and set(ring.held) == {"model.layers.0.output", "model.layers.1.output"}
    g = torch.Generator().manual_seed(0)
    kept, slots = [], []
    for _ in range(SLOTS + 2):
        vals = {"model.layers.0.output": tuple(torch.randn(4, d, generator=g).half() for _ in range(2)),
                "model.layers.1.output": torch.randn(4, 2 * d, generator=g)}
        slot = step(ring, vals, 4)
        slots.append(slot)
        if slot is None:  # every slot held: the copies went to the slot nothing is served from
            assert int(ring.index) == SLOTS
            continue
        h, r = ring.held["model.layers.0.output"].serve(slot, 3)
        x = ring.held["model.layers.1.output"].serve(slot, 3)
        assert h.shape == (3, d) and torch.equal(h, vals["model.layers.0.output"][0][:3])
        assert torch.equal(r, vals["model.layers.0.output"][1][:3]) and torch.equal(x, vals["model.layers.1.output"][:3])
        kept.append((x[1:], vals["model.layers.1.output"][1:3].clone()))  # a view of a served value, kept
    # Each kept view held its slot: the next steps took the others, and once all were held, none.
    assert slots == list(range(SLOTS)) + [None, None]
    assert all(torch.equal(v, want) for v, want in kept)  # never written over
    kept.pop(1)  # slot 1 let go: the next step takes it, and only it
    assert step(ring, {"model.layers.1.output": torch.ones(4, 2 * d)}, 4) == 1
    assert all(torch.equal(v, want) for v, want in kept)
    x = ring.held["model.layers.1.output"].serve(1, 4)  # an in-place edit of a served value moves its
    v = x._version  # version counter (the seam writes back only then)
    x.add_(1)
    assert not x.is_inference() and x._version != v
    ring.start(17)  # more rows than a slot holds: clones, and the index names no served slot
    assert ring.slot is None and int(ring.index) == SLOTS
    ring.tokens = 4
    assert ring.record("model.layers.1.output", torch.zeros(4, d)) is None  # another layout: clones
    assert ring.record("model.layers.1.output", torch.zeros(1, 4, 2 * d)) is None  # tokens not on dim 0
    small = Ring(torch.device("cpu"), budget=1 << 10)  # no row fits: no slots, every step clones
    small.tokens = 16
    small.learn("model.layers.1.output", torch.zeros(16, 2 * d))
    small.make(16)
    small.start(1)
    assert small.rows == 0 and small.slot is None
    later = Ring(torch.device("cpu"), budget=1 << 20, largest=16)  # made at a smaller batch than the largest
    later.tokens = 4  # (under torch.compile: the first pieces recorded)
    later.learn("model.layers.1.output", torch.zeros(4, 2 * d))
    later.make(4)
    assert later.rows == 16  # sized for the largest batch all the same
