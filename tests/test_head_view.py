"""The head view (nnvllm.views_heads, nnvllm.plotting_heads) on synthetic runs, in milliseconds.

A run's q and k are random; every pattern, table and strip is checked against a softmax written out
here by hand from those q and k; the attribution map against a hand-built Attribution. The
HeadExplorer over a real engine is tested in tests/test_widgets.py.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest
import torch

from nnvllm.arch import AttentionSpec
from nnvllm.heads import Attribution
from nnvllm.plotting_heads import plot_head_attribution, plot_head_pattern
from nnvllm.results import Run, Samples
from nnvllm.views_heads import (
    attribution_cells,
    attribution_color,
    attribution_map,
    head_attribution,
    head_options,
    head_pattern,
    head_status_html,
    pattern_text_html,
    query_position,
    step_options,
    top_attended,
    top_attended_html,
)

N_LAYERS, N_HEADS, D_HEAD = 3, 2, 4
PROMPT, GENERATED = [0, 1, 2, 3, 4], [5, 8, 6]  # "The capital of France is" -> " Paris" "<b>&" "."


class WordTokenizer:
    WORDS = ("The", " capital", " of", " France", " is", " Paris", ".", " Rome", "<b>&")

    def decode(self, ids):
        return "".join(self.WORDS[int(t)] for t in ids)


def make_run(layers=(0, 1, 2), sites=("q", "k")) -> Run:
    """One request of 5 prompt tokens and 3 generated (7 positions), random q and k at ``layers``."""
    g = torch.Generator().manual_seed(0)
    n_pos = len(PROMPT) + len(GENERATED) - 1
    spec = AttentionSpec("gpt2", N_LAYERS, N_HEADS, N_HEADS, D_HEAD, scale=D_HEAD ** -0.5)
    qk = {s: [torch.randn(len(layers), n_pos, N_HEADS, D_HEAD, generator=g) * 2] for s in sites}
    s = Samples(torch.tensor(GENERATED), torch.ones(3), torch.tensor(GENERATED)[:, None], torch.ones(3, 1))
    run = Run(prompts=["The capital of France is"], prompt_ids=[PROMPT], tokens=[GENERATED], text=[" Paris<b>&."],
              logits=None, samples=[s], resid=None, layers=list(layers), sites=qk,
              meta={"attention": spec.to_dict()})
    run.tokenizer = WordTokenizer()
    return run


def by_hand(run: Run, layer: int, head: int, query: int) -> torch.Tensor:
    """``[pos]``: softmax over keys 0..query of scale * q . k, zeros after: the pattern written out."""
    j = run.layers.index(layer)
    q, k = run.sites["q"][0][j, query, head], run.sites["k"][0][j, : query + 1, head]
    w = torch.softmax((k @ q) * D_HEAD ** -0.5, -1)
    return torch.cat([w, torch.zeros(run.positions(0) - query - 1)])


def make_attribution() -> Attribution:
    heads = torch.arange(3 * N_LAYERS * N_HEADS, dtype=torch.float32).reshape(3, N_LAYERS, N_HEADS) / 10 - 0.8
    heads[0, 1, 0] = 2.0  # the largest at step 0
    heads[0, 2, 1] = -1.5  # the second, negative
    z = torch.zeros(3, N_LAYERS)
    return Attribution(target=5, versus=7, heads=[heads], mlp=[z], attn_bias=[z], embed=[torch.zeros(3)],
                       bias=[torch.zeros(3)], logit_diff=[torch.tensor([3.25, 1.0, -2.0])], labels=(" Paris", " Rome"))


def test_the_query_is_the_position_that_drew_the_step():
    run = make_run()
    assert [query_position(run, s) for s in range(3)] == [4, 5, 6]
    assert query_position(run, -1) == 6
    assert step_options(run) == [("0: ' Paris'", 0), ("1: '<b>&'", 1), ("2: '.'", 2)]
    with pytest.raises(ValueError, match=r"step=3 out of range for request 0's 3 generated token\(s\) \(0-2\)"):
        query_position(run, 3)
    with pytest.raises(ValueError, match=r"request=1 out of range"):
        query_position(run, 0, request=1)


@pytest.mark.parametrize("layer,head,step", [(0, 0, 0), (1, 1, 0), (2, 0, 2), (1, 0, 1)])
def test_head_pattern_is_the_softmax_of_its_query_over_the_keys_it_sees(layer, head, step):
    run = make_run()
    q = query_position(run, step)
    got = head_pattern(run, layer, head, step)
    assert got.shape == (7,)
    assert torch.allclose(got, by_hand(run, layer, head, q), atol=1e-6)
    assert float(got[: q + 1].sum()) == pytest.approx(1.0, abs=1e-6) and not got[q + 1:].any()


def test_head_pattern_reads_the_captured_layers_only():
    run = make_run(layers=(1, 2))
    assert torch.allclose(head_pattern(run, 2, 1, 1), by_hand(run, 2, 1, 5), atol=1e-6)
    with pytest.raises(ValueError, match=r"layer=0: expected a captured block index; this run holds layers \[1, 2\]"):
        head_pattern(run, 0, 0)
    with pytest.raises(ValueError, match=r"head=2 out of range for a block of 2 heads \(0-1\)"):
        head_pattern(run, 1, 2)
    with pytest.raises(ValueError, match=r"sites=\['q', 'k'\]"):
        head_pattern(make_run(sites=("q",)), 0, 0)


def test_top_attended_lists_the_largest_weights_with_their_tokens():
    run = make_run()
    want = by_hand(run, 1, 0, 6)
    table = top_attended(run, 1, 0, step=2, k=4)
    order = want.argsort(descending=True)[:4].tolist()
    assert list(table["pos"]) == order and list(table["rank"]) == [0, 1, 2, 3]
    assert list(table["weight"]) == pytest.approx(want[order].tolist(), abs=1e-6)
    words = WordTokenizer.WORDS
    seq = PROMPT + GENERATED[:-1]
    assert list(table["token"]) == [words[seq[p]] for p in order]
    assert list(table["generated"]) == [p >= 5 for p in order]
    assert len(top_attended(run, 1, 0, step=0, k=10)) == 5  # from position 4: five keys seen, none after
    with pytest.raises(ValueError, match=r"k=0: expected a positive int"):
        top_attended(run, 1, 0, k=0)

    page = top_attended_html(run, 1, 0, step=2, k=4)
    assert page.count("<tr data-pos=") == 4 and f"<tr data-pos='{order[0]}'>" in page
    assert "head 1.0 from position 6 (<code style='white-space:pre'>&#x27;&lt;b&gt;&amp;&#x27;</code>)" in page


def test_pattern_text_shades_each_token_by_its_weight():
    run = make_run()
    page = pattern_text_html(run, 2, 1, step=1)
    want = by_hand(run, 2, 1, 5)
    spans = page.split("<span data-pos=")[1:]
    assert len(spans) == 7
    assert [float(s.split("data-weight='")[1].split("'")[0]) for s in spans] == pytest.approx(want.tolist(), rel=1e-3)
    assert "outline:" in spans[5] and all("outline:" not in s for i, s in enumerate(spans) if i != 5)
    assert "color:#aaa" in spans[6] and "color:#aaa" not in spans[5]  # after the query: not seen
    assert "font-style:italic" in spans[5] and "font-style:italic" not in spans[4]  # generated, fed back
    texts = [s.split(">", 1)[1].split("</span>")[0] for s in spans]
    assert texts[6] == "&lt;b&gt;&amp;" and "<b>&" not in page  # escaped
    assert "." not in "".join(texts)  # the last generated token is never fed back: no position holds it


def test_attribution_map_options_and_cells():
    att = make_attribution()
    amap = attribution_map(att, step=0)
    assert torch.equal(amap, att.heads[0][0])
    assert head_attribution(att, 1, 0, step=0) == pytest.approx(2.0)
    assert head_attribution(att, 2, 1, step=0) == pytest.approx(-1.5)
    options = head_options(att, step=0)
    assert [v for _, v in options[:2]] == [(1, 0), (2, 1)] and options[0][0] == "1.0: +2.000"
    assert len(options) == N_LAYERS * N_HEADS and len(head_options(att, step=0, k=3)) == 3
    values = [abs(head_attribution(att, layer, h)) for _, (layer, h) in options]
    assert values == sorted(values, reverse=True)
    cells = attribution_cells(att, step=0)
    assert torch.equal(torch.tensor([[c["value"] for c in row] for row in cells]), amap)
    assert [(c["layer"], c["head"]) for row in cells for c in row] == [(i, h) for i in range(3) for h in range(2)]
    assert cells[1][0]["color"] == attribution_color(2.0, 2.0) and cells[1][0]["dark"]
    middle = attribution_color(0.0, 2.0)  # RdBu's white middle, as the drawn map colours 0
    assert middle == matplotlib.colors.to_hex(matplotlib.colormaps["RdBu"](0.5))
    assert all(int(middle[i:i + 2], 16) > 0xF0 for i in (1, 3, 5))
    blue, red = attribution_color(1.0, 1.0), attribution_color(-1.0, 1.0)  # raises the target: blue
    assert int(blue[5:7], 16) > int(blue[1:3], 16) and int(red[1:3], 16) > int(red[5:7], 16)
    assert attribution_color(5.0, 1.0) == blue  # beyond the scale: its end
    with pytest.raises(ValueError, match=r"vmax=0: expected a positive number"):
        attribution_color(1.0, 0)
    with pytest.raises(ValueError, match=r"step=3 out of range for request 0's 3 generated step\(s\)"):
        attribution_map(att, step=3)
    with pytest.raises(TypeError, match=r"expected an nnvllm.heads.Attribution"):
        attribution_map(amap)
    with pytest.raises(ValueError, match=r"layer=3 out of range for 3 blocks"):
        head_attribution(att, 3, 0)


def test_head_status_says_what_the_head_adds_and_where_it_looks():
    run, att = make_run(), make_attribution()
    line = head_status_html(run, att, 2, 1, step=0)
    assert "head 2.1 at step 0 adds <b>-1.500</b> to logit(&#x27; Paris&#x27;) - logit(&#x27; Rome&#x27;)" in line
    assert "(rank 2 of 6 heads by size; the difference is +3.250)" in line
    top = int(by_hand(run, 2, 1, 4).argmax())
    assert f"at position {top} (" in line


def test_plot_head_pattern_draws_the_patterns_it_names():
    run = make_run()
    ax = plot_head_pattern(run, 1, None, step=1, mark=(1, 1))
    shown = ax.images[0].get_array()
    assert shown.shape == (2, 7)
    for h in range(2):
        assert torch.allclose(torch.as_tensor(shown[h]), by_hand(run, 1, h, 5), atol=1e-6)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["head 1.0", "head 1.1"]
    assert [t.get_text() for t in ax.get_xticklabels()][:2] == ["The", "␣capital"]
    assert ax.get_title() == "where block 1's heads look from position 5 (␣Paris) to write <b>& (step 1)"
    hatched = [p for p in ax.patches if p.get_hatch()]
    assert len(hatched) == 1 and hatched[0].get_x() == pytest.approx(5.5)  # the one key it cannot see
    outlined = [p for p in ax.patches if not p.get_fill() and p.get_linestyle() == "-"]
    assert len(outlined) == 1 and outlined[0].get_y() == pytest.approx(0.5)  # head 1.1's row
    ax = plot_head_pattern(run, 2, 0, step=-1, annotate=False)
    assert ax.images[0].get_array().shape == (1, 7) and not ax.texts
    assert ax.get_title() == "where head 2.0 looks from position 6 (<b>&) to write . (step 2)"
    with pytest.raises(ValueError, match=r"head=5 out of range"):
        plot_head_pattern(run, 1, [0, 5])
    with pytest.raises(ValueError, match=r"layer=\[\]: expected"):
        plot_head_pattern(run, [])


def test_plot_head_pattern_of_every_head_has_a_row_per_block_and_head():
    run = make_run(layers=(1, 2))
    ax = plot_head_pattern(run, step=0, annotate=False)  # every captured block, every head
    assert [t.get_text() for t in ax.get_yticklabels()] == ["head 1.0", "head 1.1", "head 2.0", "head 2.1"]
    shown = torch.as_tensor(ax.images[0].get_array())
    want = torch.stack([by_hand(run, layer, h, 4) for layer in (1, 2) for h in (0, 1)])
    assert torch.allclose(shown, want, atol=1e-6)
    assert [line.get_ydata()[0] for line in ax.lines if line.get_linewidth() == 0.6] == [1.5]  # between the blocks
    assert ax.get_title().startswith("where the heads look from position 4 (␣is) to write ␣Paris")


def test_plot_head_attribution_draws_the_map_with_a_symmetric_scale():
    att = make_attribution()
    ax = plot_head_attribution(att, step=0, mark=(2, 1))
    assert torch.allclose(torch.as_tensor(ax.images[0].get_array()), att.heads[0][0])
    assert ax.images[0].get_clim() == (-2.0, 2.0)
    outline = [p for p in ax.patches if not p.get_fill()]
    assert len(outline) == 1 and (outline[0].get_x(), outline[0].get_y()) == (0.5, 1.5)
    assert "+2.00" in [t.get_text() for t in ax.texts]
    assert ax.get_title() == "each head's share of logit(␣Paris) − logit(␣Rome) = +3.25, step 0"
