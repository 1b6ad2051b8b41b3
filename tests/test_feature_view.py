"""The feature view (nnvllm.views_features, nnvllm.plotting_features) on synthetic runs, in milliseconds.

A run's features are built from a known dense code: the sparse top-k the engine would hand over, or
the code itself (``sae_dense=True``); every table, strip and HTML view is checked against that code.
The widget over a real engine is tested in tests/test_widgets.py.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
import torch

from nnvllm.plotting import show_token
from nnvllm.plotting_features import plot_feature_strip, plot_token_features
from nnvllm.results import Run, Samples
from nnvllm.views_features import (
    feature_activations,
    feature_status_html,
    feature_strip,
    feature_summary,
    feature_text_html,
    position_options,
    request_features,
    token_features,
    token_features_html,
    token_labels,
)

D_SAE, K = 12, 3


class WordTokenizer:
    WORDS = ("The", " capital", " of", " France", " is", " Paris", ".", " Rome", "<b>&", "\n")

    def decode(self, ids):
        return "".join(self.WORDS[int(t)] for t in ids)


def _code(n_pos: int, seed: int) -> torch.Tensor:
    """A dense code ``[pos, D_SAE]``: a few features fire at each position (some positions none)."""
    g = torch.Generator().manual_seed(seed)
    code = torch.relu(torch.randn(n_pos, D_SAE, generator=g) - 0.9)
    code[1] = 0.0  # a position where nothing fires
    return code


def make_run(dense: bool = False, k: int = K) -> tuple[Run, list[torch.Tensor]]:
    """Two requests (prompt + generated tokens) and their dense codes; features sparse (top ``k``) or dense."""
    prompts = [[0, 1, 2, 3, 4], [8, 9, 4]]
    generated = [[5, 6, 7], [7, 6]]
    codes = [_code(len(p) + len(t) - 1, seed=i) for i, (p, t) in enumerate(zip(prompts, generated))]
    feats = []
    for c in codes:
        if dense:
            feats.append(c)
        else:
            values, ids = c.topk(k, dim=-1, sorted=True)
            feats.append((ids.to(torch.int32), values))
    samples = [Samples(ids=torch.tensor(t), probs=torch.ones(len(t)), top_ids=torch.tensor(t)[:, None],
                       top_probs=torch.ones(len(t), 1)) for t in generated]
    tok = WordTokenizer()
    run = Run(prompts=[tok.decode(p) for p in prompts], prompt_ids=prompts, tokens=generated,
              text=[tok.decode(t) for t in generated], logits=None, samples=samples, resid=None, layers=[],
              features=[feats], sae_errors=[[torch.zeros(c.shape[0]) for c in codes]],
              meta={"saes": [{"site": "resid", "layer": 3, "d_sae": D_SAE}]})
    run.tokenizer = tok
    return run, codes


def _topk_only(code: torch.Tensor, k: int) -> torch.Tensor:
    """The code with everything outside each position's top ``k`` zeroed: what sparse features can see."""
    values, ids = code.topk(k, dim=-1)
    return torch.zeros_like(code).scatter_(-1, ids, values)


@pytest.mark.parametrize("dense", [False, True])
def test_request_features_are_the_code_largest_first(dense):
    run, codes = make_run(dense)
    for i, code in enumerate(codes):
        ids, values = request_features(run, i)
        assert ids.dtype == torch.int64 and values.dtype == torch.float32
        assert ids.shape == values.shape and ids.shape[0] == code.shape[0]
        assert torch.equal(values, torch.gather(code, 1, ids))  # each value is its feature's
        assert (values[:, :-1] >= values[:, 1:]).all()  # largest first
        if dense:  # cut to the most features firing at one position: nothing that fires is lost
            assert ids.shape[1] == int((code > 0).sum(-1).max())
            assert torch.allclose(values.sum(-1), code.sum(-1))


@pytest.mark.parametrize("dense", [False, True])
def test_feature_activations_read_the_code_at_every_position(dense):
    run, codes = make_run(dense)
    for i, code in enumerate(codes):
        seen = code if dense else _topk_only(code, K)
        for f in range(D_SAE):
            assert torch.equal(feature_activations(run, f, i), seen[:, f])
        assert torch.equal(feature_strip(run, [4, 0], i), torch.stack([seen[:, 4], seen[:, 0]]))
    assert feature_strip(run, 2).shape == (1, codes[0].shape[0])


def test_token_features_is_a_tidy_table_of_what_fires():
    run, codes = make_run()
    table = token_features(run, 0, k=2)
    assert list(table.columns) == ["request", "pos", "step", "token", "token_id", "generated", "rank", "feature",
                                   "activation"]
    seen = _topk_only(codes[0], K)
    expected = []
    for p in range(codes[0].shape[0]):
        values, ids = seen[p].topk(2)
        expected += [(p, r, int(f), float(v)) for r, (f, v) in enumerate(zip(ids, values)) if v > 0]
    assert list(zip(table["pos"], table["rank"], table["feature"], table["activation"])) == expected
    assert 1 not in set(table["pos"])  # nothing fires there: no row
    assert (table["activation"] > 0).all()
    labels = token_labels(run, 0)
    assert labels == ["The", " capital", " of", " France", " is", " Paris", "."]
    assert all(t == labels[p] for p, t in zip(table["pos"], table["token"]))
    # Generated tokens: the fed-back ones, with the step that produced them; prompt tokens have no step.
    gen = token_features(run, 0, k=1, positions="generated")
    assert set(gen["pos"]) <= {5, 6} and gen["generated"].all()
    assert list(gen["step"]) == [p - 5 for p in gen["pos"]]
    prompt = token_features(run, 0, k=1, positions="prompt")
    assert not prompt["generated"].any() and prompt["step"].isna().all()
    assert list(token_features(run, 0, k=1, positions=[-1])["pos"]) == [6] * (codes[0][6].max() > 0)
    both = token_features(run, None, k=1)
    assert set(both["request"]) == {0, 1} and len(both) == len(token_features(run, 0, k=1)) + len(
        token_features(run, 1, k=1))


def test_feature_summary_ranks_features_by_their_strongest_activation():
    run, codes = make_run()
    summary = feature_summary(run, n=None)
    seen = [_topk_only(c, K) for c in codes]
    fires = {f: sum(int((s[:, f] > 0).sum()) for s in seen) for f in range(D_SAE)}
    top = {f: max(float(s[:, f].max()) for s in seen) for f in range(D_SAE)}
    assert set(summary["feature"]) == {f for f in range(D_SAE) if fires[f]}
    assert list(summary["max_activation"]) == sorted(summary["max_activation"], reverse=True)
    for row in summary.itertuples():
        assert row.max_activation == pytest.approx(top[row.feature]) and row.fires == fires[row.feature]
        assert float(seen[row.request][row.pos, row.feature]) == pytest.approx(row.max_activation)
        assert row.token == token_labels(run, row.request)[row.pos]
    assert len(feature_summary(run, n=2)) == 2
    one = feature_summary(run, request=1, n=None)
    assert set(one["request"]) == {1}
    run.features[0] = [(ids, torch.zeros_like(values)) for ids, values in run.features[0]]  # nothing fires
    assert feature_summary(run).empty and token_features(run).empty


def test_html_views_show_the_activations_and_escape_the_text():
    run, _ = make_run()
    acts = feature_activations(run, 5, 1)
    text = feature_text_html(run, 5, 1, selected=2)
    # Request 1's positions: "<b>&", "\n", " is", then the generated " Rome" (its last token "." is never fed)
    assert "&lt;b&gt;&amp;" in text and "<b>&" not in text and "white-space:pre-wrap" in text
    assert text.count("<span data-pos=") == len(acts)
    for p, a in enumerate(acts.tolist()):
        assert f"data-pos='{p}' data-activation='{a:.4g}'" in text
    assert text.count("outline:") == 1 and "data-pos='2'" in text.split("outline:")[0].rsplit("<span", 1)[1]
    assert text.count("font-style:italic") == 1 and text.endswith(" Rome</span></div>")  # generated
    table = token_features_html(run, 3, 0, k=K, selected=int(request_features(run, 0)[0][3, 0]))
    rows = token_features(run, 0, k=K, positions=[3])
    assert table.count("<tr data-feature=") == len(rows) and "background:rgba" in table
    assert "&#x27; France&#x27;" in table  # the token quoted: its space shows
    assert "none fires here" in token_features_html(run, 1)
    status = feature_status_html(run, 5, 1)
    if acts.max() > 0:
        assert f"{float(acts.max()):.3f}" in status and f"position {int(acts.argmax())}" in status
    assert position_options(run, 0)[3] == ("3: ' France'", 3)
    assert position_options(run, 0)[5] == ("5: ' Paris' (generated)", 5)


def test_bad_arguments_say_what_was_expected():
    run, _ = make_run()
    with pytest.raises(ValueError, match="no SAE features; generate with saes="):
        token_features(Run(prompts=["x"], prompt_ids=[[0]], tokens=[[1]], text=["y"], logits=None, samples=[],
                           resid=None, layers=[]))
    with pytest.raises(ValueError, match=r"feature=12: expected a feature id of the SAE \(0-11\)"):
        feature_activations(run, D_SAE)
    with pytest.raises(ValueError, match=r"request=2 out of range for a run of 2 request\(s\) \(0-1\)"):
        request_features(run, 2)
    with pytest.raises(ValueError, match=r"sae=1 out of range"):
        request_features(run, 0, sae=1)
    with pytest.raises(ValueError, match="positions='late'"):
        token_features(run, positions="late")
    with pytest.raises(ValueError, match="k=0"):
        token_features(run, k=0)
    with pytest.raises(ValueError, match="features=\\[\\]"):
        feature_strip(run, [])
    with pytest.raises(ValueError, match="pos=9 out of range"):
        plot_token_features(run, 9)


def test_plot_feature_strip_draws_features_over_the_visible_tokens():
    from matplotlib.figure import Figure

    run, _ = make_run()
    ax = Figure().subplots()
    assert plot_feature_strip(run, [4, 7], 0, ax=ax, mark_pos=3, mark_feature=7) is ax
    img = ax.get_images()[0].get_array()
    assert torch.equal(torch.as_tensor(img.data), feature_strip(run, [4, 7], 0))
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == [show_token(t, 14) for t in token_labels(run, 0)] and labels[3] == "␣France"
    colours = [t.get_color() for t in ax.get_xticklabels()]
    assert colours[4] != "tab:red" and colours[5] == colours[6] == "tab:red"  # generated
    assert [t.get_text() for t in ax.get_yticklabels()] == ["feature 4", "feature 7"]
    assert len(ax.texts) == int((feature_strip(run, [4, 7], 0) > 0).sum())  # a value in each cell that fires
    assert len(ax.patches) == 2  # the chosen token's column and the chosen feature's row
    assert "where 2 features fire" in ax.get_title()


def test_plot_token_features_draws_a_bar_per_feature_that_fires():
    from matplotlib.figure import Figure

    run, _ = make_run()
    ax = Figure().subplots()
    assert plot_token_features(run, 3, 0, k=K, ax=ax) is ax
    ids, values = request_features(run, 0)
    n = int((values[3] > 0).sum())
    heights = sorted(p.get_width() for p in ax.patches)
    assert heights == sorted(values[3, :n].tolist())
    assert [t.get_text() for t in ax.get_yticklabels()] == [f"feature {int(f)}" for f in ids[3, :n]]
    assert "␣France" in ax.get_title()
    empty = Figure().subplots()
    plot_token_features(run, 1, 0, ax=empty)
    assert not empty.patches and any("no feature fires" in t.get_text() for t in empty.texts)


def test_feature_modules_import_no_engine_and_no_widgets():
    import ast
    from pathlib import Path

    import nnvllm.plotting_features
    import nnvllm.views_features

    for mod in (nnvllm.views_features, nnvllm.plotting_features):
        tree = ast.parse(Path(mod.__file__).read_text())
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
        assert not {m for m in names if m.split(".")[0] in ("vllm", "nnsight", "transformers", "ipywidgets")}
