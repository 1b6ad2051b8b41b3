"""The explorers of a result: :class:`LensExplorer`, :class:`SamplesExplorer`, :class:`PatchExplorer`
and :class:`CompareView`; what they draw comes from :mod:`nnvllm.views`."""

from __future__ import annotations

from ..analyses import logit_lens, patch
from ..capture import generate
from ..compare import Discrepancy, compare
from ..patching import PatchResult
from ..plotting import shows_roles
from ..results import Run
from ..views import (
    METRICS,
    as_prompt,
    compare_figure,
    lens_figure,
    lens_status_html,
    lens_table_html,
    patch_cell_html,
    patch_figure,
    per_position,
    position_roles,
    position_table_html,
    prompt_fields,
    prompt_tokens,
    samples_figure,
    samples_table_html,
    samples_text_html,
    shown_positions,
    step_position,
    summary_html,
    token_options,
)
from .base import W, _button, _check_open, _Explorer, _side_by_side

__all__ = ["LENS_TOP_K", "CompareView", "LensExplorer", "PatchExplorer", "SamplesExplorer"]

#: Top-k the lens is computed with; the widget's top-k slider shows up to this many.
LENS_TOP_K = 10


def _chat_boxes(prompt, chat: bool, system: str) -> tuple[str, W.Checkbox, W.Text]:
    """The text for a prompt's text box, its ``chat`` box (the text as one user message, rendered by the
    model's chat template) and the ``system`` box (a system message before it, when not empty), from
    ``prompt``: a str, or a conversation of one user message after at most one system message."""
    text, is_chat, own_system = prompt_fields(prompt)
    system = system or own_system
    box = W.Checkbox(value=bool(chat or is_chat or system), description="chat", indent=False,
                     layout=W.Layout(width="70px"))
    sys_box = W.Text(value=system, description="system", placeholder="system prompt (optional)",
                     continuous_update=False, disabled=not box.value, layout=W.Layout(width="360px"))
    box.observe(lambda change: setattr(sys_box, "disabled", not change["new"]), names="value")
    return text, box, sys_box


class _TextPrompt:
    """An explorer whose ``prompt`` box, with its ``chat`` and ``system`` boxes, gives one prompt."""

    prompt: W.Text
    chat: W.Checkbox
    system: W.Text

    def prompt_value(self) -> str | list[dict]:
        """The prompt the boxes stand for: the text, or with ``chat`` a conversation (:func:`nnvllm.views.as_prompt`)."""
        return as_prompt(self.prompt.value, self.chat.value, self.system.value)


def _hide_box() -> W.Checkbox:
    return W.Checkbox(value=False, description="hide chat template", indent=False,
                      layout=W.Layout(width="160px"))


class LensExplorer(_TextPrompt, _Explorer):
    """Logit lens of one prompt over generation: heatmap, a chosen layer's top-k table, a chosen step.

    Controls: ``prompt`` (Text), ``chat`` (Checkbox: the text as one user message, rendered by the
    model's chat template) and ``system`` (Text: a system message before it, when not empty),
    ``max_tokens``, ``run_button`` (runs the engine), ``layer`` (IntSlider, CSS class ``nnvllm-layer``:
    the layer whose top tokens the table shows and the heatmap outlines), ``step`` (generated step
    whose predicting position is marked), ``top_k`` and ``hide_template`` (Checkbox: the heatmap
    without a conversation's template positions). Views: ``plot`` (Output, class ``nnvllm-plot``),
    ``table`` (HTML), ``status`` (HTML). State: ``lens`` (:class:`nnvllm.lens.Lens`), ``png``,
    ``last_error``; :meth:`prompt_value` is what the boxes stand for.

    The first run happens at construction (one short generation), so the widget opens with a
    picture; later runs happen on the button.

    Example::

        ex = LensExplorer(model, "The capital of France is", max_tokens=5)
        ex.layer.value = 5                  # redraws; no engine call
        ex.prompt.value = "The capital of Italy is"; ex.run_button.click()
        ex.chat.value = True; ex.run_button.click()      # the same words as a user message
    """

    def __init__(self, model, prompt: str | list[dict] = "The capital of France is", max_tokens: int = 5,
                 run_now: bool = True, *, chat: bool = False, system: str = "") -> None:
        super().__init__()
        self.model = model
        self.lens = None
        n = model.n_layers
        text, self.chat, self.system = _chat_boxes(prompt, chat, system)
        self.prompt = W.Text(value=text, description="prompt", continuous_update=False,
                             layout=W.Layout(width="420px"))
        self.max_tokens = W.BoundedIntText(value=max_tokens, min=1, max=256, description="max tokens",
                                           layout=W.Layout(width="160px"))
        self.run_button = _button("Run", self.run)
        self.layer = W.IntSlider(value=0, min=0, max=n - 1, description="layer", continuous_update=False)
        self.layer.add_class("nnvllm-layer")
        self.step = W.IntSlider(value=0, min=0, max=max(max_tokens - 1, 0), description="step",
                                continuous_update=False)
        self.top_k = W.IntSlider(value=5, min=1, max=LENS_TOP_K, description="top-k", continuous_update=False)
        self.hide_template = _hide_box()
        self.plot = W.Output()
        self.plot.add_class("nnvllm-plot")
        self.table = W.HTML()
        self.status = W.HTML()
        for w in (self.layer, self.step, self.hide_template):
            w.observe(lambda _: self._guard(self.redraw), names="value")
        self.top_k.observe(lambda _: self._guard(self._update_table), names="value")
        self.widget = W.VBox([
            W.HBox([self.prompt, self.max_tokens, self.run_button]),
            W.HBox([self.chat, self.system]),
            W.HBox([self.layer, self.step, self.top_k, self.hide_template]),
            self.status,
            self.error,
            _side_by_side(self.plot, self.table),
            self.log_box,
        ])
        self.widget.add_class("nnvllm-lens")
        if run_now:
            self.run()

    def run(self) -> None:
        """Run the lens on the current prompt (the slow call); errors go to the error area."""
        self._slow_call(self._run)

    def _run(self) -> None:
        _check_open(self.model)
        lens = self._quiet(logit_lens, self.model, self.prompt_value(), max_tokens=int(self.max_tokens.value),
                           top_k=LENS_TOP_K)
        self.lens = lens
        with self.step.hold_trait_notifications(), self.layer.hold_trait_notifications():
            self.layer.max = len(lens.layers) - 1
            self.step.max = max(len(lens.generated) - 1, 0)
            self.step.value = min(self.step.value, self.step.max)
        self.top_k.max = int(lens.top_ids.shape[-1])
        self.redraw()

    @property
    def position(self) -> int:
        """The position the step slider points at (the one predicting generated token ``step``)."""
        return step_position(self.lens, int(self.step.value))

    def _update_table(self) -> None:
        if self.lens is None:
            return
        self.table.value = lens_table_html(self.lens, int(self.layer.value), int(self.top_k.value),
                                           highlight_pos=self.position)

    def redraw(self) -> None:
        """Redraw the heatmap (chosen layer outlined, chosen step's position marked), table and status,
        for the sliders' values as they are now."""
        lens = self.lens
        if lens is None:
            return
        j, step = int(self.layer.value), int(self.step.value)
        hide = self.hide_template.value and shows_roles(lens.roles)
        fig = lens_figure(lens, j, step, positions="content" if hide else "all")
        self._show(self.plot, fig, f"<logit lens heatmap, layer {lens.layers[j]}, step {step}>", layer=j, step=step)
        self._update_table()
        self.status.value = lens_status_html(lens, j, step)


class SamplesExplorer(_TextPrompt, _Explorer):
    """Sample a continuation and see what the sampler drew at each step, with its alternatives.

    Controls: ``prompt``, ``chat`` and ``system`` (as :class:`LensExplorer`'s), ``max_tokens``,
    ``temperature``, ``top_p``, ``seed`` and ``run_button`` ("Sample", runs the engine). Views: ``plot`` (Output, class ``nnvllm-plot``:
    :func:`nnvllm.plotting.plot_samples`), ``text`` (HTML: the continuation, each token shaded by
    its probability), ``table`` (HTML: one row per step). State: ``run``, ``png``, ``last_error``.

    Example::

        ex = SamplesExplorer(model, "The capital of France is")
        ex.temperature.value = 1.5; ex.run_button.click()
    """

    def __init__(self, model, prompt: str | list[dict] = "The capital of France is", max_tokens: int = 10,
                 temperature: float = 0.8, top_p: float = 0.95, seed: int = 0, run_now: bool = True, *,
                 chat: bool = False, system: str = "") -> None:
        super().__init__()
        self.model = model
        self.run: Run | None = None  # the last sampled run (one request)
        text, self.chat, self.system = _chat_boxes(prompt, chat, system)
        self.prompt = W.Text(value=text, description="prompt", continuous_update=False,
                             layout=W.Layout(width="420px"))
        self.max_tokens = W.BoundedIntText(value=max_tokens, min=1, max=256, description="max tokens",
                                           layout=W.Layout(width="160px"))
        wide = {"description_width": "initial"}  # "temperature" was cut at ipywidgets' default label width
        self.temperature = W.FloatSlider(value=temperature, min=0.0, max=2.0, step=0.05,
                                         description="temperature", continuous_update=False, style=wide)
        self.top_p = W.FloatSlider(value=top_p, min=0.05, max=1.0, step=0.05, description="top-p",
                                   continuous_update=False, style=wide)
        self.seed = W.IntText(value=seed, description="seed", layout=W.Layout(width="160px"))
        self.run_button = _button("Sample", self.sample)
        self.plot = W.Output()
        self.plot.add_class("nnvllm-plot")
        self.text = W.HTML()
        self.table = W.HTML()
        self.widget = W.VBox([
            W.HBox([self.prompt, self.max_tokens, self.run_button]),
            W.HBox([self.chat, self.system]),
            W.HBox([self.temperature, self.top_p, self.seed]),
            self.error,
            self.text,
            _side_by_side(self.plot, self.table),
            self.log_box,
        ])
        self.widget.add_class("nnvllm-samples")
        if run_now:
            self.sample()

    def sample(self) -> None:
        """Generate with the current settings (the slow call); errors go to the error area."""
        self._slow_call(self._sample)

    def _sample(self) -> None:
        _check_open(self.model)
        run = self._quiet(generate, self.model, self.prompt_value(), max_tokens=int(self.max_tokens.value),
                          temperature=float(self.temperature.value), top_p=float(self.top_p.value),
                          seed=int(self.seed.value), layers=None, logits=False)
        self.run = run
        tok = self.model.tokenizer
        self._show(self.plot, samples_figure(run, tok), "<sampled tokens plot>")
        self.text.value = samples_text_html(run, tok)
        self.table.value = samples_table_html(run, tok)


class PatchExplorer(_Explorer):
    """Activation patching sweep with its heatmap and a single cell's effect.

    Controls: ``clean``, ``corrupt``, ``answer``, ``wrong`` (Text), ``chat`` (Checkbox: clean and
    corrupt each as one user message, rendered by the model's chat template) and ``system`` (Text: a
    system message before each, when not empty), ``site`` (Dropdown: resid, attn, mlp), ``layers``
    (IntRangeSlider of blocks), ``positions`` (SelectMultiple of the clean prompt's tokens; in a
    conversation the template's are marked and left out at first), ``run_button`` ("Run sweep": one :func:`nnvllm.patch` call whose progress
    callback moves ``progress``, cells done), then ``cell_layer`` and ``cell_pos`` (choose a cell of the result).
    Views: ``plot`` (Output, class ``nnvllm-plot``), ``cell`` (HTML). State: ``result``
    (:class:`~nnvllm.patching.PatchResult`), ``png``, ``last_error``.

    A sweep costs layers × positions forward passes, so nothing runs until the button is pressed
    (``run_now=True`` runs one at construction).

    Example::

        ex = PatchExplorer(model, "The capital of France is", "The capital of Italy is", " Paris", " Rome")
        ex.run_button.click(); ex.result.best()
    """

    def __init__(self, model, clean: str | list[dict] = "The capital of France is",
                 corrupt: str | list[dict] = "The capital of Italy is", answer: str = " Paris", wrong: str = " Rome",
                 site: str = "resid", run_now: bool = False, *, chat: bool = False, system: str = "") -> None:
        super().__init__()
        self.model = model
        self.result: PatchResult | None = None
        self._drawing = True
        n = model.n_layers
        clean_text, self.chat, self.system = _chat_boxes(clean, chat, system)
        corrupt_text, corrupt_chat, corrupt_system = prompt_fields(corrupt)
        if corrupt_chat and (not self.chat.value or corrupt_system != self.system.value):
            raise ValueError("corrupt is a conversation unlike clean (another system message, or clean is plain "
                             "text); the boxes hold one system prompt for both: pass clean and corrupt alike")
        text = {"continuous_update": False, "layout": W.Layout(width="360px")}
        self.clean = W.Text(value=clean_text, description="clean", **text)
        self.corrupt = W.Text(value=corrupt_text, description="corrupt", **text)
        self.answer = W.Text(value=answer, description="answer", placeholder="one token, e.g. ' Paris'",
                             continuous_update=False)
        self.wrong = W.Text(value=wrong, description="wrong", placeholder="one token, e.g. ' Rome'",
                            continuous_update=False)
        self.site = W.Dropdown(options=["resid", "attn", "mlp"], value=site, description="site")
        self.layers = W.IntRangeSlider(value=(0, n - 1), min=0, max=n - 1, description="layers",
                                       continuous_update=False)
        self.positions = W.SelectMultiple(description="positions", rows=6)
        self.run_button = _button("Run sweep", self.sweep)
        self.progress = W.IntProgress(value=0, min=0, max=1, description="cells done")
        self.progress.add_class("nnvllm-progress")
        self.cell_layer = W.SelectionSlider(options=[0], description="cell layer", continuous_update=False)
        self.cell_pos = W.SelectionSlider(options=[0], description="cell pos", continuous_update=False)
        self.plot = W.Output()
        self.plot.add_class("nnvllm-plot")
        self.cell = W.HTML()
        self._refresh_positions()
        for w in (self.clean, self.chat, self.system):
            w.observe(lambda _: self._guard(self._refresh_positions), names="value")
        # An error belongs to the inputs that caused it: editing any of them clears it (a notebook's
        # own test of a bad answer would otherwise leave its red error on the widget).
        for w in (self.clean, self.corrupt, self.answer, self.wrong, self.site, self.chat, self.system):
            w.observe(lambda _: self._clear_error(), names="value")
        self.cell_layer.observe(lambda _: self._guard(self.redraw), names="value")
        self.cell_pos.observe(lambda _: self._guard(self.redraw), names="value")
        self.widget = W.VBox([
            W.HBox([W.VBox([self.clean, self.corrupt]), W.VBox([self.answer, self.wrong])]),
            W.HBox([self.chat, self.system]),
            W.HBox([W.VBox([self.site, self.layers, W.HBox([self.run_button, self.progress])]), self.positions]),
            self.error,
            W.HBox([self.cell_layer, self.cell_pos]),
            self.cell,
            self.plot,
            self.log_box,
        ])
        self.widget.add_class("nnvllm-patch")
        if run_now:
            self.sweep()

    def prompts(self) -> tuple[str | list[dict], str | list[dict]]:
        """The clean and corrupt prompts the boxes stand for (:func:`nnvllm.views.as_prompt`)."""
        return tuple(as_prompt(box.value, self.chat.value, self.system.value) for box in (self.clean, self.corrupt))

    def _refresh_positions(self) -> None:
        # The clean prompt's tokens as patch() counts them; a conversation's template ones start unselected.
        tok, clean = self.model.tokenizer, self.prompts()[0]
        self.positions.options = token_options(tok, clean)
        self.positions.value = tuple(p for p, _, role in prompt_tokens(tok, clean)
                                     if not self.chat.value or role != "template")

    def sweep(self) -> None:
        """Run the sweep with the current settings (the slow call); errors go to the error area."""
        self._slow_call(self._sweep)

    def _sweep(self) -> None:
        _check_open(self.model)
        positions = list(self.positions.value)
        if not positions:
            raise ValueError("no positions selected; choose at least one token in 'positions'.")
        lo, hi = self.layers.value
        layers = list(range(lo, hi + 1))
        before = (self.progress.max, self.progress.value)

        def moved(done: int, total: int) -> None:
            self.progress.max, self.progress.value = total, done

        # One sweep (the base generations once), the bar moving with each batch of patched runs. A
        # sweep refused before it starts (a two-token answer) leaves the bar as the last sweep left it.
        try:
            res = self._quiet(patch, self.model, *self.prompts(), self.answer.value,
                              self.wrong.value, layers=layers, positions=positions, site=self.site.value,
                              progress=moved)
        except Exception:
            self.progress.max, self.progress.value = before
            raise
        self.result = res
        best_layer, best_pos, _ = res.best()
        self._drawing = False  # options first, then values: the observers redraw once at the end
        try:
            self.cell_layer.options = res.layers
            self.cell_pos.options = [(f"{p} {lab!r}", p) for p, lab in zip(res.positions, res.labels)]
            self.cell_layer.value, self.cell_pos.value = best_layer, best_pos
        finally:
            self._drawing = True
        self.redraw()

    def effect_at(self, layer: int, pos: int) -> float:
        """Return the normalized effect of patching block ``layer`` at position ``pos``."""
        res = self.result
        if res is None:
            raise ValueError("no sweep yet; press 'Run sweep' (or call .sweep()) first.")
        if layer not in res.layers or pos not in res.positions:
            raise ValueError(f"(layer {layer}, pos {pos}) was not swept; layers {res.layers}, positions {res.positions}.")
        return float(res.effect[res.layers.index(layer), res.positions.index(pos)])

    def redraw(self) -> None:
        """Redraw the heatmap with the chosen cell outlined, and the cell's numbers."""
        res = self.result
        if res is None or not self._drawing:
            return
        layer, pos = self.cell_layer.value, self.cell_pos.value
        self._show(self.plot, patch_figure(res, layer, pos), f"<patching heatmap, cell layer {layer} pos {pos}>",
                   layer=layer, pos=pos)
        self.cell.value = patch_cell_html(res, layer, pos)


class CompareView(_Explorer):
    """Compare two of several runs of the same prompts: per-layer error, per-position detail, summary.

    Controls: ``a`` and ``b`` (Dropdowns of the run names; ``a`` is the reference), ``metric``
    (max_abs, rel_err, cosine), ``layer`` (SelectionSlider of captured blocks, class
    ``nnvllm-layer``) and ``hide_template`` (Checkbox: the per-position panel and table without a
    conversation's template positions, which are otherwise hatched). Comparing runs is pure and
    quick, so every change recomputes at once.
    Views: ``plot`` (Output, class ``nnvllm-plot``), ``summary`` and ``table`` (HTML).
    State: ``discrepancy`` (:class:`~nnvllm.compare.Discrepancy`), ``png``, ``last_error``.

    Example::

        view = CompareView({"transformers": ref, "vllm": run, "vllm bf16": run16})
        view.b.value = "vllm bf16"; view.discrepancy.summary()
    """

    def __init__(self, runs: dict[str, Run], a: str | None = None, b: str | None = None,
                 metric: str = "rel_err") -> None:
        super().__init__()
        if not isinstance(runs, dict) or not runs or not all(isinstance(r, Run) for r in runs.values()):
            raise TypeError(
                "CompareView takes a non-empty dict {name: Run}, e.g. {'transformers': ref, 'vllm': run}; "
                f"got {type(runs).__name__}."
            )
        if metric not in METRICS:
            raise ValueError(f"metric={metric!r} is not one of {METRICS}.")
        names = list(runs)
        self.runs = runs
        self.discrepancy: Discrepancy | None = None
        self.a = W.Dropdown(options=names, value=a or names[0], description="reference")
        self.b = W.Dropdown(options=names, value=b or names[min(1, len(names) - 1)], description="under test")
        self.metric = W.Dropdown(options=list(METRICS), value=metric, description="metric")
        layers = list(runs[self.a.value].layers) or [0]
        self.layer = W.SelectionSlider(options=layers, value=layers[0], description="layer",
                                       continuous_update=False)
        self.layer.add_class("nnvllm-layer")
        self.hide_template = _hide_box()
        self.plot = W.Output()
        self.plot.add_class("nnvllm-plot")
        self.summary = W.HTML()
        self.table = W.HTML()
        for w in (self.a, self.b):
            w.observe(lambda _: self._guard(self.recompute, clear=True), names="value")
        for w in (self.metric, self.layer, self.hide_template):
            w.observe(lambda _: self._guard(self.redraw), names="value")
        self.widget = W.VBox([
            W.HBox([self.a, self.b]),
            W.HBox([self.metric, self.layer, self.hide_template]),
            self.error,
            _side_by_side(self.plot, self.summary),
            self.table,
        ])
        self.widget.add_class("nnvllm-compare")
        self._guard(self.recompute, clear=True)

    def recompute(self) -> None:
        """Compare the two chosen runs, then redraw. Runs that cannot be compared clear the picture
        and the tables (the error says why): nothing on show belongs to another pair."""
        self.discrepancy = None
        a, b = self.a.value, self.b.value
        try:
            d = compare(self.runs[a], self.runs[b], names=(a, b))
        except Exception:
            self.plot.outputs, self.summary.value, self.table.value = (), "", ""
            self.png = self.figure = None
            self.drawn = {}
            raise
        self.discrepancy = d
        layers = list(self.runs[a].layers) or [0]
        if list(self.layer.options) != layers:
            self.layer.options = layers  # observers redraw; harmless, the discrepancy is set
        self.summary.value = summary_html(d)
        self.redraw()

    def redraw(self) -> None:
        """Draw the chosen metric per layer (chosen layer marked) and per position at that layer."""
        d = self.discrepancy
        if d is None:
            return
        metric, layer = self.metric.value, self.layer.value
        # The labels of the reference's positions (the runs read the same prompts).
        roles = position_roles(self.runs[self.a.value]) or position_roles(self.runs[self.b.value])
        hide = "content" if self.hide_template.value and shows_roles(roles) else "all"
        fig = compare_figure(d, metric, layer, roles=roles if shows_roles(roles) else None, positions=hide)
        if len(d.resid):
            table, exact = per_position(d, metric, layer), per_position(d, "max_abs", layer) == 0
            cols = shown_positions(roles, hide, table.columns)
            self.table.value = position_table_html(table[cols], metric, layer, exact=exact[cols])
        else:
            self.table.value = ""
        self._show(self.plot, fig, f"<{metric} per layer, layer {layer}>", a=d.names[0], b=d.names[1],
                   metric=metric, layer=layer)
