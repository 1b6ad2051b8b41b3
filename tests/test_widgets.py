"""Widgets, tested through their state: set a control's ``.value``, click a button, read the result.

The pure views (nnvllm.views) run on synthetic tensors; the explorers run on the real toy engine (module-scoped
``toy`` fixture). The one real-browser check of a widget is tests/test_browser.py.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import nnvllm as nv
from nnvllm.lens import Lens, Norm, Unembed
from nnvllm.views import (
    as_prompt,
    error_html,
    lens_figure,
    lens_rows,
    lens_status_html,
    lens_table_html,
    live_lens_html,
    per_position,
    position_roles,
    prompt_fields,
    samples_text_html,
    shown_positions,
    step_position,
    summary_html,
    token_options,
)
from nnvllm.widgets import (
    CompareView,
    EngineClosed,
    FeatureExplorer,
    HeadExplorer,
    LensExplorer,
    LiveGeneration,
    PatchExplorer,
    SamplesExplorer,
)

CLEAN, CORRUPT = "The capital of France is", "The capital of Italy is"


# --- pure helpers ------------------------------------------------------------------------------


class WordTokenizer:
    """Tokenizer stand-in: id t <-> WORDS[t]; encode splits on spaces, keeping the leading space."""

    WORDS = ("The", " capital", " of", " France", " is", " Paris", ".", " Rome", "<b>&")

    def encode(self, s, add_special_tokens=True):
        out, word = [], ""
        for c in s:
            if c == " " and word:
                out.append(self.WORDS.index(word))
                word = ""
            word += c
        return out + ([self.WORDS.index(word)] if word else [])

    def decode(self, ids):
        return "".join(self.WORDS[int(t)] for t in ids)


def make_lens(n_layer=3, prompt_len=5, generated=(5, 6), k=4) -> Lens:
    tok = WordTokenizer()
    seq = [0, 1, 2, 3, 4][:prompt_len] + list(generated[:-1])
    n_pos, d_model, d_vocab = len(seq), 4, len(tok.WORDS)
    g = torch.Generator().manual_seed(0)
    probs = torch.rand(n_layer, n_pos, d_vocab, generator=g).softmax(-1)
    top_probs, top_ids = probs.topk(k, dim=-1)
    top_ids[-1, prompt_len - 1, 0] = 5  # the last layer says " Paris" after " is"
    top_ids[0, 0, 1] = 8  # a token that needs escaping
    unembed = Unembed(Norm("rmsnorm", torch.ones(d_model)), torch.randn(d_vocab, d_model, generator=g))
    return Lens(top_ids=top_ids, top_probs=top_probs, layers=list(range(n_layer)),
                labels=[tok.decode([t]) for t in seq], prompt_len=prompt_len,
                resid=torch.randn(n_layer, n_pos, d_model, generator=g), unembed=unembed, tokenizer=tok,
                generated=list(generated))


def test_step_position():
    lens = make_lens()
    assert step_position(lens, 0) == 4 and step_position(lens, 1) == 5
    with pytest.raises(ValueError, match="step=2 out of range for a lens of 2 generated tokens"):
        step_position(lens, 2)


def test_lens_rows_and_table_html():
    lens = make_lens()
    rows = lens_rows(lens, -1, k=3)
    assert [r["pos"] for r in rows] == list(range(6))
    assert rows[4]["input"] == " is" and rows[4]["top"][0][0] == " Paris"
    assert [r["generated"] for r in rows] == [False] * 5 + [True]
    assert len(rows[0]["top"]) == 3 and lens_rows(lens, 0, k=99)[0]["top"].__len__() == 4  # capped at k
    html = lens_table_html(lens, 2, k=3, highlight_pos=4)
    assert "layer 2: top-3" in html
    row4 = html.split("data-pos='4'")[1].split("</tr>")[0]
    assert "background" in row4 and "<code style='white-space:pre'> Paris</code>" in row4
    assert html.count("<tr data-pos=") == 6 and html.count("<th>top ") == 3
    assert "&lt;b&gt;&amp;" in lens_table_html(lens, 0, k=2) and "<b>&" not in lens_table_html(lens, 0, k=2)
    with pytest.raises(ValueError, match="layer_index=3 out of range for a lens of 3 layers"):
        lens_rows(lens, 3)
    with pytest.raises(ValueError, match="k=0 must be a positive int"):
        lens_rows(lens, 0, k=0)


def test_token_options():
    assert token_options(WordTokenizer(), CLEAN) == [
        ("0: 'The'", 0), ("1: ' capital'", 1), ("2: ' of'", 2), ("3: ' France'", 3), ("4: ' is'", 4)]



def _run(perturb=0.0, prompts=("a", "b")):
    g = torch.Generator().manual_seed(0)
    resid = [torch.randn(2, 4, 8, generator=g) for _ in prompts]
    if perturb:
        resid = [r.clone() for r in resid]
        resid[0][1, 2] += perturb
    s = nv.Samples(torch.tensor([1, 2]), torch.ones(2), torch.tensor([[1], [2]]), torch.ones(2, 1))
    return nv.Run(prompts=list(prompts), prompt_ids=[[0, 1, 2]] * len(prompts), tokens=[[1, 2]] * len(prompts),
                  text=["x"] * len(prompts), logits=[torch.zeros(2, 5)] * len(prompts), samples=[s] * len(prompts),
                  resid=resid, layers=[0, 1])


def test_per_position_and_summary_html():
    d = nv.compare(_run(), _run(perturb=1.0), names=("ref", "<test>"))
    table = per_position(d, "max_abs", 1)
    assert list(table.index) == [0, 1] and list(table.columns) == [0, 1, 2, 3]
    assert table.loc[0, 2] == pytest.approx(1.0) and table.loc[1].max() == 0.0
    html = summary_html(d)
    assert "ref vs &lt;test&gt;" in html and "token_agreement" in html
    with pytest.raises(ValueError, match="metric='kl'"):
        per_position(d, "kl", 0)


def test_error_html_escapes_and_keeps_traceback():
    try:
        raise ValueError("layer=40 out of range <for> a 12-layer model")
    except ValueError as e:
        out = error_html(e)
    assert "ValueError: layer=40 out of range &lt;for&gt; a 12-layer model" in out
    assert "<details>" in out and "test_error_html_escapes_and_keeps_traceback" in out


def test_compare_view_on_synthetic_runs():
    view = CompareView({"ref": _run(), "perturbed": _run(perturb=1.0), "other prompts": _run(prompts=("c", "d"))})
    assert view.last_error is None and view.discrepancy.summary()["max_abs"] == pytest.approx(1.0)
    assert view.layer.value == 0 and view.widget._dom_classes == ("nnvllm-compare",)
    first = view.png
    view.layer.value = 1
    assert view.png != first and "rel_err at layer 1" in view.table.value
    view.metric.value = "cosine"
    assert "cosine at layer 1" in view.table.value
    ax_l, ax_p = view.figure.axes
    assert ax_l.get_ylabel() == "1 - cosine (log)" and ax_p.get_ylabel() == ""  # one label, shared y axis
    assert ax_p in ax_l.get_shared_y_axes().get_siblings(ax_l)
    view.b.value = "other prompts"  # an error, shown in the widget, not raised
    assert "same prompts" in view.error.value and isinstance(view.last_error, ValueError)
    assert view.discrepancy is None
    # Nothing of the last pair stays on show: no picture, no tables, and the slider draws nothing stale.
    assert view.plot.outputs == () and view.png is None and view.table.value == view.summary.value == ""
    view.layer.value = 0
    assert view.png is None and view.drawn == {}
    view.b.value = "perturbed"  # recovers
    assert view.error.value == "" and view.last_error is None and view.discrepancy is not None
    assert view.drawn == {"a": "ref", "b": "perturbed", "metric": "cosine", "layer": 0}
    with pytest.raises(TypeError, match="dict"):
        CompareView([_run()])


def test_compare_view_marks_exact_zeros_instead_of_rounding():
    # Layer 0 and most positions are identical in the two runs: 1 - cosine there is exactly 0, drawn as
    # "exact" on the floor of the log axis, never as -2.2e-16 or 1e-16.
    view = CompareView({"ref": _run(), "perturbed": _run(perturb=1.0)}, metric="cosine")
    ax_l = view.figure.axes[0]
    data = [ln for ln in ax_l.lines if ln.get_transform() == ax_l.transData]
    assert len(data) == 1 and torch.isnan(torch.tensor(data[0].get_ydata()[0])) and data[0].get_ydata()[1] > 0
    assert [t.get_text() for t in ax_l.texts] == ["exact"] and ax_l.get_ylim()[0] > 1e-9
    assert "e-16" not in view.table.value and "e-17" not in view.table.value
    view.layer.value = 1  # position 2 differs at layer 1; the others are exact
    assert [t.get_text() for t in view.figure.axes[1].texts] == ["exact", "exact"]


def test_compare_view_draws_the_sliders_current_value():
    """Whatever order values arrive in (one by one, batched by hold_sync as a browser's message is, or
    with notifications held), the picture and ``drawn`` are those of the controls' values now."""
    view = CompareView({"ref": _run(), "perturbed": _run(perturb=1.0)})
    for v in (1, 0, 1):
        view.layer.value = v
        assert view.drawn["layer"] == view.layer.value == v
        assert view.figure.axes[1].get_title().startswith(f"layer {v}:")
    with view.layer.hold_sync():
        view.layer.value = 0
        view.metric.value = "max_abs"
    assert (view.drawn["layer"], view.drawn["metric"]) == (0, "max_abs")
    with view.layer.hold_trait_notifications(), view.metric.hold_trait_notifications():
        view.layer.value = 1
        view.metric.value = "rel_err"
    assert (view.drawn["layer"], view.drawn["metric"]) == (1, "rel_err")
    assert "rel_err at layer 1" in view.table.value and view.figure.axes[0].lines[-1].get_xdata()[0] == 1


def test_lens_views_quote_tokens_and_follow_the_layer():
    lens = make_lens()
    status = lens_status_html(lens, -1, 0)
    # A token in a sentence is quoted so its space shows: "position 4 (' is'): lens top-1 ' Paris'".
    assert "step 0 generated <code style='white-space:pre'>&#x27; Paris&#x27;</code>" in status
    assert "position 4 (<code style='white-space:pre'>&#x27; is&#x27;</code>)" in status
    assert "lens top-1 <code style='white-space:pre'>&#x27; Paris&#x27;</code>, p = " in status
    fig = lens_figure(lens, 1, 1)
    (ax, _) = fig.axes  # the heatmap and its colour bar
    assert ax.get_title() == "logit lens: layer 1 outlined, step 1 dotted"
    outline, dots = ax.patches
    assert outline.get_y() == 0.5 and dots.get_x() == step_position(lens, 1) - 0.5
    assert [t.get_text() for t in ax.get_xticklabels()][:2] == ["The", "␣capital"]


def test_prompt_boxes_stand_for_a_conversation():
    conv = [{"role": "user", "content": CLEAN}]
    with_system = [{"role": "system", "content": "Answer."}] + conv
    assert as_prompt(CLEAN) == CLEAN and as_prompt(CLEAN, chat=True) == conv
    assert as_prompt(CLEAN, chat=True, system="Answer.") == with_system
    assert as_prompt(CLEAN, chat=False, system="Answer.") == CLEAN  # the system box belongs to chat
    for prompt in (CLEAN, conv, with_system):
        assert as_prompt(*prompt_fields(prompt)) == prompt
    with pytest.raises(ValueError, match="one user message"):
        prompt_fields(conv + [{"role": "assistant", "content": " Paris"}])
    with pytest.raises(TypeError, match="a str or a conversation"):
        prompt_fields(3)


def test_lens_views_label_a_conversations_positions():
    lens = make_lens()  # The capital of France is | Paris
    lens.roles = ["template", "user", "user", "user", "user", "assistant"]
    assert lens_rows(lens, -1)[0]["role"] == "template" and lens_rows(make_lens(), -1)[0]["role"] is None
    table = lens_table_html(lens, -1)
    assert "<th>pos</th><th>role</th><th>input</th>" in table
    rows = [table.split(f"data-pos='{p}'")[1].split("</tr>")[0] for p in (0, 1)]
    assert "color:#888" in rows[0] and "<td>template</td>" in rows[0] and "color:#888" not in rows[1]
    assert "<th>role</th>" not in lens_table_html(make_lens(), -1)  # a plain prompt: no role column

    ax = lens_figure(lens, 1, 0).axes[0]
    assert [p.get_x() for p in ax.patches if p.get_gid() == "nnvllm-template"] == [-0.5]
    assert ax.get_title() == "logit lens: layer 1 outlined, step 0 dotted"
    ax = lens_figure(lens, 1, 0, positions="content").axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["␣capital", "␣of", "␣France", "␣is", "␣Paris"]
    _, dots = ax.patches  # the layer's outline, the step's dotted column
    assert dots.get_x() == 3 - 0.5  # position 4 (" is") predicts step 0: the fourth column shown
    lens.roles = ["user"] * 4 + ["template", "assistant"]  # that position hidden: nothing to dot
    assert len(lens_figure(lens, 1, 0, positions="content").axes[0].patches) == 1


def test_samples_text_shows_the_conversation_as_the_model_read_it():
    run = _run(prompts=("a",))
    run.prompts = [[{"role": "user", "content": "<b>&"}]]
    run.prompt_text = ["<|endoftext|><b>&"]
    out = samples_text_html(run, WordTokenizer())
    assert out.startswith("<div style='white-space:pre-wrap'>&lt;|endoftext|&gt;&lt;b&gt;&amp;<span")
    assert out.endswith(">" + " of</span></div>")


def test_compare_view_hatches_and_hides_template_positions():
    runs = {"ref": _run(), "perturbed": _run(perturb=1.0)}
    for run in runs.values():
        run.roles = [["template", "user", "user", "assistant"]] * 2
    assert position_roles(runs["ref"]) == ["template", "user", "user", "assistant"]
    view = CompareView(runs)
    view.layer.value = 1
    ax_p = view.figure.axes[1]
    assert [p.get_x() for p in ax_p.patches if p.get_gid() == "nnvllm-template"] == [-0.5]
    assert [t.get_text() for t in ax_p.texts if t.get_gid() == "nnvllm-role"] == ["user", "assistant"]
    columns = view.table.value.count("<th>0</th>")  # position 0's column, and request 0's row
    view.hide_template.value = True
    ax_p = view.figure.axes[1]
    data = [ln for ln in ax_p.lines if ln.get_transform() == ax_p.transData]
    assert list(data[0].get_xdata()) == [1, 2, 3] and not any(p.get_gid() == "nnvllm-template" for p in ax_p.patches)
    assert view.table.value.count("<th>0</th>") == columns - 1
    # Requests that label a position differently: "mixed" there, kept by "content".
    runs["ref"].roles = [["template", "user", "user"], ["template", "system", "user", "assistant"]]
    assert position_roles(runs["ref"]) == ["template", "mixed", "user", "assistant"]
    assert shown_positions(position_roles(runs["ref"]), "content", [0, 1, 2, 3]) == [1, 2, 3]
    assert position_roles(_run()) is None
    with pytest.raises(ValueError, match="no roles"):
        shown_positions(None, "content", [0, 1])


def test_steering_vector_names_the_users_argument(toy):
    n = toy.n_layers
    with pytest.raises(ValueError, match=rf"^layer=10: expected one block index of this {n}-layer model") as e:
        nv.steering_vector(toy, [CORRUPT], [CLEAN], layer=10)
    assert "layers" not in str(e.value)
    with pytest.raises(TypeError, match=r"^layer=\[3\]: expected one block index"):
        nv.steering_vector(toy, [CORRUPT], [CLEAN], layer=[3])


def test_only_widgets_imports_ipywidgets():
    code = ("import sys, nnvllm, nnvllm.lens, nnvllm.patching, nnvllm.compare, nnvllm.plotting, nnvllm.analyses;"
            "assert 'ipywidgets' not in sys.modules, 'ipywidgets imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- explorers on the toy engine ----------------------------------------------------------------


def test_lens_explorer(toy):
    ex = LensExplorer(toy, CLEAN, max_tokens=5)
    assert ex.last_error is None and ex.lens is not None
    assert ex.widget._dom_classes == ("nnvllm-lens",)
    assert ex.layer._dom_classes == ("nnvllm-layer",) and ex.plot._dom_classes == ("nnvllm-plot",)
    assert ex.layer.value == 0 and ex.layer.max == toy.n_layers - 1  # starts at the bottom, not the max
    assert not ex.layer.continuous_update and ex.draws == 1
    assert ex.plot.outputs[0]["data"]["image/png"] and ex.png.startswith(b"\x89PNG")
    assert ex.step.max == len(ex.lens.generated) - 1

    before = ex.png
    ex.layer.value = toy.n_layers - 1  # redraws in place, no engine call
    assert ex.png != before and ex.draws == 2
    last_prompt_pos = ex.lens.prompt_len - 1
    row = ex.table.value.split(f"data-pos='{last_prompt_pos}'")[1].split("</tr>")[0]
    first_cell = row.split("<td style='padding:0 6px;white-space:nowrap'>")[1]
    assert first_cell.startswith("<code style='white-space:pre'> Paris</code>")
    assert f"layer {toy.n_layers - 1}, position {last_prompt_pos}" in ex.status.value
    assert "lens top-1 <code style='white-space:pre'>&#x27; Paris&#x27;</code>" in ex.status.value
    assert ex.drawn == {"layer": toy.n_layers - 1, "step": 0}

    ex.top_k.value = 2
    assert ex.table.value.count("<th>top ") == 2 and ex.draws == 2  # table only
    ex.step.value = 1
    assert ex.position == last_prompt_pos + 1 and ex.draws == 3
    with ex.layer.hold_sync():  # one message from the browser carrying the new value
        ex.layer.value = 2
    assert ex.drawn == {"layer": 2, "step": 1} and ex.figure.axes[0].get_title().startswith("logit lens: layer 2 ")

    ex.prompt.value = ""  # a bad prompt: the error shows in the widget, the old lens stays
    ex.run_button.click()
    assert "empty" in ex.error.value and ex.last_error is not None
    assert ex.lens.labels[3] == " France" and not ex.run_button.disabled

    ex.prompt.value = CORRUPT  # and the widget still works
    ex.run_button.click()
    assert ex.error.value == "" and ex.last_error is None
    assert ex.lens.labels[3] == " Italy" and ex.lens.top_tokens(-1)[ex.lens.prompt_len - 1] == " Rome"


def test_patch_explorer(toy):
    ex = PatchExplorer(toy, CLEAN, CORRUPT, " Paris", " Rome")
    assert ex.result is None and ex.widget._dom_classes == ("nnvllm-patch",)
    assert ex.positions.value == (0, 1, 2, 3, 4) and ex.layers.value == (0, toy.n_layers - 1)
    ex.run_button.click()
    assert ex.last_error is None, ex.error.value
    assert (ex.progress.value, ex.progress.max) == (toy.n_layers * 5,) * 2  # cells, from patch's callback
    res = ex.result
    assert res.layers == list(range(toy.n_layers)) and res.positions == [0, 1, 2, 3, 4]
    assert ex.effect_at(toy.n_layers - 1, 4) == pytest.approx(1.0, abs=1e-4)  # last block, last pos: all of it
    assert ex.effect_at(0, 3) > 0.5  # the subject " France" carries the fact at layer 0
    assert res.effect[:, :3].abs().max() < 1e-4  # positions before the subject are the same tokens
    assert (ex.cell_layer.value, ex.cell_pos.value) == res.best()[:2]
    before = ex.png
    ex.cell_layer.value, ex.cell_pos.value = 0, 3
    assert ex.png != before and "layer 0 at position 3 (<code style='white-space:pre'>&#x27; France&#x27;" in ex.cell.value
    assert ex.drawn == {"layer": 0, "pos": 3}

    done = (ex.progress.value, ex.progress.max)
    ex.answer.value = "Paris France"  # two tokens: error in the widget, result kept
    ex.run_button.click()
    assert "2 tokens" in ex.error.value and ex.result is res
    assert (ex.progress.value, ex.progress.max) == done  # the bar still tells the kept sweep's story
    assert "e.g. &#x27; Paris&#x27;" in ex.error.value or "e.g. ' Paris'" in ex.error.value  # a one-token hint

    ex.answer.value = " Paris"
    assert ex.error.value == "" and ex.last_error is None  # fixing the input clears its error
    ex.site.value = "mlp"
    ex.layers.value = (0, 1)
    ex.positions.value = (3, 4)
    ex.run_button.click()
    assert ex.error.value == "" and ex.result.site == "mlp"
    assert ex.result.layers == [0, 1] and ex.result.positions == [3, 4]
    assert ex.progress.value == ex.progress.max == 4

    ex.clean.value = "The capital of Spain is"  # positions follow the clean prompt's tokens
    assert ex.positions.options[3] == ("3: ' Spain'", 3)


def test_samples_explorer(toy):
    ex = SamplesExplorer(toy, CLEAN, max_tokens=4, temperature=0.0)
    assert ex.last_error is None and ex.widget._dom_classes == ("nnvllm-samples",)
    s = ex.run.samples[0]
    assert torch.equal(s.ids, s.top_ids[:, 0])  # greedy: the top token every step
    assert "> Paris</span>" in ex.text.value and "<td>' Paris'</td>" in ex.table.value

    ex.temperature.value, ex.top_p.value, ex.seed.value = 1.5, 1.0, 3
    ex.prompt.value = "The"
    ex.max_tokens.value = 8
    ex.run_button.click()
    first = ex.run.tokens
    ex.run_button.click()
    assert ex.run.tokens == first and ex.run.sampling["temperature"] == 1.5  # a seed reproduces the draw

    before = ex.png
    ex.top_p.value = 0.05  # a tiny nucleus: every drawn token still has probability > 0 in it
    ex.run_button.click()
    assert ex.run.sampling["top_p"] == 0.05 and bool((ex.run.samples[0].probs > 0).all())
    assert ex.png != before

    ex.prompt.value = ""
    ex.run_button.click()
    assert "prompt" in ex.error.value and ex.run.prompts == ["The"]


def test_compare_view_vllm_vs_transformers(toy, toy_path):
    prompts = [CLEAN, "The Colosseum is in the city of"]
    run = nv.generate(toy, prompts, max_tokens=4)
    ref = nv.reference(toy_path, prompts, tokens=run.tokens)
    view = CompareView({"transformers": ref, "vllm": run}, metric="rel_err")
    s = view.discrepancy.summary()
    assert view.last_error is None and s["token_agreement"] == 1.0 and s["max_rel_err"] < 1e-4
    assert "transformers vs vllm" in view.summary.value
    view.layer.value = 3
    assert "rel_err at layer 3" in view.table.value


def test_explorer_carries_a_static_copy_for_html_exports(toy):
    # make demo's HTML has no widget manager offline, so the explorer's display data also holds its
    # figure as text/html: without it the export shows an empty output where the explorer is.
    ex = LensExplorer(toy, "The capital of France is", max_tokens=2)
    data = ex._repr_mimebundle_()
    data = data[0] if isinstance(data, tuple) else data
    assert "application/vnd.jupyter.widget-view+json" in data
    assert "data:image/png;base64," in data["text/html"] and ex.png


def test_explorers_take_a_conversation(toy):
    """The chat box makes the text box one user message (the system box a system message before it):
    the lens, the samples and the patching sweep run on the conversation, its template marked."""
    conv = [{"role": "user", "content": CLEAN}]
    ex = LensExplorer(toy, conv, max_tokens=2)
    assert ex.last_error is None and ex.chat.value and not ex.system.disabled and ex.prompt.value == CLEAN
    assert ex.prompt_value() == conv and ex.lens.roles == ["template"] + ["user"] * 5 + ["assistant"]
    assert ex.lens.top_tokens(-1)[5] == " Paris"  # the toy model answers in its template
    ax = ex.figure.axes[0]
    assert [p.get_x() for p in ax.patches if p.get_gid() == "nnvllm-template"] == [-0.5]
    assert "<th>role</th>" in ex.table.value
    ex.hide_template.value = True  # redraws without the template's position; no engine call
    ax = ex.figure.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()][:2] == ["The", "␣capital"]
    assert not any(p.get_gid() == "nnvllm-template" for p in ax.patches)
    ex.system.value = "Answer."
    ex.run_button.click()
    assert ex.last_error is None and ex.lens.roles[:7] == ["template"] + ["system"] * 5 + ["template"]
    ex.chat.value = False
    ex.run_button.click()
    assert ex.system.disabled and ex.lens.roles[0] == "user" and ex.lens.labels[0] == "The"

    samples = SamplesExplorer(toy, CLEAN, max_tokens=2, temperature=0.0, chat=True)
    assert samples.run.prompts == [conv] and samples.run.prompt_text == ["<|endoftext|>" + CLEAN]
    assert samples.text.value.startswith(f"<div style='white-space:pre-wrap'>&lt;|endoftext|&gt;{CLEAN}<span")
    assert "> Paris</span>" in samples.text.value

    corrupt = [{"role": "user", "content": CORRUPT}]
    px = PatchExplorer(toy, conv, corrupt, " Paris", " Rome")
    assert px.chat.value and px.prompts() == (conv, corrupt)
    assert px.positions.options[0] == ("0: '<|endoftext|>' (template)", 0)
    assert px.positions.value == (1, 2, 3, 4, 5)  # the template's token is left out at first
    px.layers.value = (0, 1)
    px.run_button.click()
    assert px.last_error is None, px.error.value
    assert px.result.positions == [1, 2, 3, 4, 5] and px.result.roles == ["user"] * 5
    assert px.effect_at(0, 4) > 0.9  # " France" carries the answer at layer 0, as in a plain prompt
    px.positions.value = (0, 4)
    px.run_button.click()
    assert [p.get_x() for p in px.figure.axes[0].patches if p.get_gid() == "nnvllm-template"] == [-0.5]
    px.chat.value = False  # back to plain text: the positions follow
    assert px.positions.options[0] == ("0: 'The'", 0) and px.positions.value == (0, 1, 2, 3, 4)
    with pytest.raises(ValueError, match="unlike clean"):
        PatchExplorer(toy, CLEAN, corrupt, " Paris", " Rome")

    import html
    import re

    live = LiveGeneration(toy, conv, max_tokens=2, ignore_eos=True)  # shows the text the model reads
    assert live.wait(60) is not None and live.last_error is None and live.run.prompts == [conv]
    assert html.unescape(re.sub(r"<[^>]+>", "", live.text.value)) == "<|endoftext|>" + CLEAN + live.run.text[0]


def test_live_lens_html():
    cells = [[("a", 0.5), ("<b>", 1.0)], [("c", float("nan")), ("d", 0.25)]]
    out = live_lens_html([0, 5], cells, [" x", "y"])
    assert out.count("<tr>") == 3 and "&lt;b&gt;" in out  # token text is escaped
    assert out.index("L5") < out.index("L0")  # the last layer on top
    assert out.count("<td></td>") == 1 and "title='0.250'" in out


def test_a_step_of_several_tokens_gives_a_column_each_with_the_lens_on_the_newest():
    """An isolated engine can bring several tokens in one stream step; the step's lens is the newest
    token's. The live panel gets a column per token (earlier ones empty), so it never shows a lens under
    the wrong token and its width is the number of tokens."""
    import math

    from nnvllm.streaming import Step
    from nnvllm.widgets.live import step_columns

    def step(tokens, ids, ps):
        return Step(index=0, tokens=[tokens], text=[""], probs=[[0.5] * len(tokens)],
                    lens_ids=torch.tensor([ids]), lens_probs=torch.tensor([ps]), finished=[False])

    cols = step_columns(step([5, 7, 9], [3, 4], [0.25, 0.75]), lambda i: f"<{i}>", 2)
    assert [t for t, _ in cols] == ["<5>", "<7>", "<9>"]
    assert cols[2][1] == [("<3>", 0.25), ("<4>", 0.75)]
    assert all(c == "" and math.isnan(p) for _, cells in cols[:2] for c, p in cells)
    out = live_lens_html([0, 1], [cells for _, cells in cols], [t for t, _ in cols])
    assert out.count("<td") == 2 * 3 and out.count("<td></td>") == 2 * 2
    one = step_columns(step([5], [3, -1], [0.25, float("nan")]), lambda i: f"<{i}>", 2)
    assert one[0][0] == "<5>" and one[0][1][0] == ("<3>", 0.25) and one[0][1][1][0] == ""
    no_layers = Step(index=0, tokens=[[5, 6]], text=[""], probs=[[0.5, 0.5]], lens_ids=None, lens_probs=None,
                     finished=[False])
    assert step_columns(no_layers, str, 0) == [("5", None), ("6", None)]


def test_live_generation_streams_and_stops(toy):
    """LiveGeneration: tokens and the lens panel grow while the engine generates; Stop ends it and
    the Run keeps what was produced (equal to what the widget showed)."""
    import time

    # An isolated engine (every engine of the GPU lane) generates ahead of the frames the widget
    # shows, so a fast GPU can finish all 40 tokens before the click lands: the run is then whole.
    isolated = getattr(toy, "_nnvllm_isolated", False)
    live = LiveGeneration(toy, "The capital of France is", max_tokens=40, ignore_eos=True, pace=0.05)
    deadline = time.monotonic() + 60
    while len(live.steps) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    live.stop_button.click()
    run = live.wait(60)
    assert live.last_error is None, live.last_error
    n = len(run.tokens[0])
    assert (3 <= n <= 40 if isolated else 3 <= n < 40) and live.status.value == f"stopped after {n} token(s)"
    assert live.stop_button.disabled
    assert sum((s.tokens[0] for s in live.steps), []) == run.tokens[0]
    assert live.panel.value.count("<tr>") == toy.n_layers + 1
    assert live.panel.value.count("<td") == toy.n_layers * n
    import html
    import re

    assert html.unescape(re.sub(r"<[^>]+>", "", live.text.value)) == "The capital of France is" + run.text[0]
    done = LiveGeneration(toy, "The capital of France is", max_tokens=3, ignore_eos=True, layers=[0, -1])
    assert done.wait(60) is not None, (done.status.value, done.last_error)
    assert done.run.tokens == nv.generate(toy, "The capital of France is", max_tokens=3, ignore_eos=True).tokens
    assert done.status.value == "done: 3 token(s)" and done.panel.value.count("<tr>") == 3
    assert done.replay_button.disabled is False and done.stop_button.disabled
    first = done.run
    done.replay_button.click()  # the same generation again, shown from the start
    again = done.wait(60)
    assert again is not first and again.tokens == first.tokens and done.replays == 1
    assert done.status.value == "done: 3 token(s), replay 1" and len(done.steps) >= 1 and done.last_error is None
    done.replay()
    assert done.wait(60).tokens == first.tokens and done.status.value == "done: 3 token(s), replay 2"
    with pytest.raises(ValueError, match="pace"):
        LiveGeneration(toy, "x", pace=-1)


def test_feature_explorer_lists_a_tokens_features_and_shades_where_one_fires(toy, tmp_path):
    """FeatureExplorer on the engine: a token's listed features are the SAE's encoding of the residual
    stream vLLM computed there (encoded on the client from a plain capture), strongest first; picking
    one shades the text by its activation at every token; a typed feature id is drawn too."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 48, generator=g) / 4
    cfg = {"architecture": "standard", "d_in": 64, "d_sae": 48, "dtype": "float32",
           "metadata": {"hook_name": "blocks.3.hook_resid_post"}}
    nv.SAE.from_state(cfg, {"W_enc": w, "W_dec": w.T.contiguous(), "b_enc": torch.zeros(48),
                            "b_dec": torch.zeros(64)}).save(tmp_path / "sae")
    sae = nv.SAE.load(tmp_path / "sae")
    ex = FeatureExplorer(toy, CLEAN, sae, max_tokens=3, k=8)
    assert ex.last_error is None and ex.run.text[0].startswith(" Paris") and ex.png is not None
    assert ex.widget._dom_classes == ("nnvllm-features",) and ex.token._dom_classes == ("nnvllm-token",)
    n = ex.run.positions(0)  # 5 prompt tokens, then the generated ones fed back
    assert ex.position == 4 and [p for _, p in ex.token.options] == list(range(n))
    code = sae.encode(nv.generate(toy, CLEAN, max_tokens=3, layers=[3]).resid[0][0])  # [pos, d_sae]

    ex.token.value = 3  # ' France'
    listed = [f for _, f in ex.features.options]
    want = code[3].topk(8)
    assert len(listed) == int((want.values > 0).sum())
    for f, a in zip(listed, want.values):  # strongest first, each the client's value within fp32 rounding
        assert float(code[3, f]) == pytest.approx(float(a), abs=1e-3)
    assert ex.feature.value == listed[0] and ex.drawn == {"pos": 3, "feature": listed[0]}
    assert "' France'" in ex.table.value.replace("&#x27;", "'") and ex.table.value.count("<tr data-feature=") == len(listed)

    ex.features.value = listed[2]  # pick the third: the text is shaded where it fires
    f = listed[2]
    assert ex.feature.value == f and ex.drawn == {"pos": 3, "feature": f}
    kept = code.topk(8, dim=-1).indices.eq(f).any(-1)  # positions where f is among the top 8
    assert torch.allclose(ex.activations, torch.where(kept, code[:, f], 0.0), atol=1e-3)
    spans = ex.text.value.split("<span data-pos=")[1:]
    assert len(spans) == n and "outline:" in spans[3]
    assert [float(s.split("data-activation='")[1].split("'")[0]) for s in spans] == pytest.approx(
        ex.activations.tolist(), abs=1e-3)
    assert f"feature {f} fires on {int((ex.activations > 0).sum())} of {n} tokens" in ex.status.value
    draws = ex.draws
    ex.feature.value = 47  # any feature, typed: drawn as a row of its own
    assert ex.draws == draws + 1 and ex.drawn == {"pos": 3, "feature": 47} and ex.last_error is None

    ex.prompt.value = "The capital of Italy is"
    ex.run_button.click()
    assert ex.run.text[0].startswith(" Rome") and ex.position == 4 and ex.last_error is None
    with pytest.raises(TypeError, match="needs an SAE"):
        FeatureExplorer(toy, CLEAN, str(tmp_path / "sae"))
    with pytest.raises(ValueError, match="k=0"):
        FeatureExplorer(toy, CLEAN, sae, k=0)


def test_head_explorer_opens_a_head_from_the_map_and_shows_its_pattern_and_attribution(toy):
    """HeadExplorer on the engine: the map, the pattern and the attribution it shows are Run.attention and
    nv.attribute of the same generation made here on its own; a click on a map cell opens that head, the
    strongest-heads list and the step picker drive it; a bad target shows an error and keeps the last result."""
    ex = HeadExplorer(toy, CLEAN, target=" Paris", versus=" Rome", max_tokens=3)
    assert ex.last_error is None and ex.run.text[0].startswith(" Paris") and ex.png.startswith(b"\x89PNG")
    assert ex.widget._dom_classes == ("nnvllm-heads",) and ex.map._dom_classes == ("nnvllm-head-map",)
    assert ex.layer._dom_classes == ("nnvllm-layer",) and ex.head._dom_classes == ("nnvllm-head",)
    assert ex.step._dom_classes == ("nnvllm-step",) and ex.plot._dom_classes == ("nnvllm-plot",)
    run = nv.generate(toy, CLEAN, max_tokens=3, sites=["q", "k", "z", "mlp"])
    att = nv.attribute(run, target=" Paris", versus=" Rome")
    steps, n_layers, n_heads = att.heads[0].shape
    assert ex.run.tokens == run.tokens and [s for _, s in ex.step.options] == list(range(steps))
    assert len(ex.cells) == n_layers and {len(row) for row in ex.cells} == {n_heads}
    assert len(ex.map.children) == (n_layers + 1) * (n_heads + 1)  # the head and block labels around the cells
    assert all(c._dom_classes == ("nnvllm-head-cell",) for row in ex.cells for c in row)
    shown = torch.tensor([[float(c.description) for c in row] for row in ex.cells])
    assert torch.allclose(shown, att.heads[0][0], atol=0.006)  # each cell: its head's value, to 2 decimals
    assert ex.strongest.options[0][1] == att.top_heads(0, 0, 1)[0][:2]
    assert (ex.layer.value, ex.head.value) == ex.strongest.value == att.top_heads(0, 0, 1)[0][:2]  # opens on it

    ex.cells[1][0].click()  # head 1.0: it reads the country into the last position
    assert (ex.layer.value, ex.head.value) == (1, 0) and ex.drawn == {"step": 0, "layer": 1, "head": 0}
    assert ex.cells[1][0].layout.border and not ex.cells[0][0].layout.border
    want = run.attention(1, 0, heads=[0], queries=[len(run.prompt_ids[0]) - 1])[0, 0]
    assert ex.position == 4 and torch.allclose(ex.pattern, want, atol=1e-5)
    top = int(want.argmax())
    assert ex.table.value.split("<tr data-pos='")[1].startswith(f"{top}'")
    assert top == 3 and "&#x27; France&#x27;" in ex.table.value  # the country, its text shown
    assert f"adds <b>{float(att.heads[0][0, 1, 0]):+.3f}</b>" in ex.status.value
    spans = ex.text.value.split("<span data-pos=")[1:]
    assert [float(x.split("data-weight='")[1].split("'")[0]) for x in spans] == pytest.approx(want.tolist(), abs=1e-3)
    assert ex.figure.axes[0].get_title().startswith("where head 1.0 looks from position 4")

    label, (layer, head) = ex.strongest.options[1]  # the second strongest, from the list
    ex.strongest.value = (layer, head)
    assert (ex.layer.value, ex.head.value) == (layer, head) and ex.drawn["layer"] == layer and ex.drawn["head"] == head
    assert label.startswith(f"{layer}.{head}: {float(att.heads[0][0, layer, head]):+.3f}")

    draws = ex.draws
    ex.step.value = 1  # the next token: the map recoloured for it, the query one position on
    assert ex.draws == draws + 1 and ex.position == 5 and ex.drawn == {"step": 1, "layer": layer, "head": head}
    shown = torch.tensor([[float(c.description) for c in row] for row in ex.cells])
    assert torch.allclose(shown, att.heads[0][1], atol=0.006)
    assert torch.allclose(ex.pattern, run.attention(layer, 0, heads=[head], queries=[5])[0, 0], atol=1e-5)
    ex.layer.value, ex.head.value = 0, 0  # the sliders open a head too
    assert ex.drawn == {"step": 1, "layer": 0, "head": 0} and ex.cells[0][0].layout.border

    ex.target.value = " Paris is"  # two tokens: refused, the last result stays on show
    ex.run_button.click()
    assert ex.last_error is not None and "target" in ex.error.value and ex.attribution.labels == (" Paris", " Rome")
    ex.target.value, ex.versus.value = "", ""  # the first generated token's logit alone
    ex.run_button.click()
    assert ex.last_error is None and ex.attribution.target == ex.run.tokens[0][0] and ex.attribution.versus is None
    assert ex.drawn == {"step": 0, "layer": 0, "head": 0}  # a new run keeps the head chosen
    assert "logit(&#x27; Paris&#x27;) (rank" in ex.status.value


def test_explorers_after_the_engine_is_closed(toy):
    """After ``model.close()`` (a notebook's last cell) every explorer stays usable: what re-reads a
    result still redraws, and what needs the engine says "engine closed — re-run the load cell" in
    one line, no traceback. Runs last in this file: it closes the shared toy engine (the next file
    that asks for one starts it again)."""
    lens_ex = LensExplorer(toy, CLEAN, max_tokens=3)
    samples_ex = SamplesExplorer(toy, CLEAN, max_tokens=2, temperature=0.0)
    patch_ex = PatchExplorer(toy, CLEAN, CORRUPT, " Paris", " Rome")
    head_ex = HeadExplorer(toy, CLEAN, max_tokens=2)
    live = LiveGeneration(toy, CLEAN, max_tokens=2)
    live.wait(60)
    kept = live.run
    toy.close()

    draws = lens_ex.draws
    lens_ex.layer.value = 1  # re-reads the kept lens: no engine needed
    assert lens_ex.draws == draws + 1 and lens_ex.drawn["layer"] == 1 and lens_ex.error.value == ""
    head_ex.cells[2][1].click()  # re-reads the kept run and attribution
    assert head_ex.drawn == {"step": 0, "layer": 2, "head": 1} and head_ex.error.value == ""
    for ex in (lens_ex, samples_ex, patch_ex, head_ex):
        ex.run_button.click()
        assert isinstance(ex.last_error, EngineClosed), ex
        assert "engine closed — re-run the load cell" in ex.error.value and "<details>" not in ex.error.value
        assert not ex.run_button.disabled
    assert lens_ex.lens is not None and samples_ex.run is not None and patch_ex.result is None
    live.replay_button.click()
    assert live.status.value == "engine closed" and "re-run the load cell" in live.error.value
    assert live.run is kept and live.replays == 0 and not live.replay_button.disabled
