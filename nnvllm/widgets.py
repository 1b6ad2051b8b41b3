"""Thin ipywidgets controllers over nnvllm's analyses, for exploring in a notebook.

Each explorer owns its controls and its state; slow calls (anything that runs the engine) sit
behind a button, views that only re-read a result (choosing a layer, a step, a cell) redraw at
once without the engine. An exception from a callback is shown in the widget's error area
(``.error``, CSS class ``nnvllm-error``) and kept in ``.last_error``; the widget keeps working.
What the engine prints while it runs (vLLM's progress bars) goes to a folded "engine log" (``.log``).

Everything a test needs is state: set a control's ``.value``, call ``.run_button.click()``, read
the result attributes (``lens``, ``result``, ``run``, ``discrepancy``), the table HTML
(``.table.value``) and the last drawn image (``.png``, PNG bytes).

This is the only module that imports ipywidgets. What the widgets show (tables, HTML, figures) is
computed by the pure functions of :mod:`nnvllm.views`, tested without a notebook; the analyses
they run are nnvllm's verbs (``nv.logit_lens``, ``nv.patch``, ``nv.compare``, ``nv.stream``).

Example::

    from nnvllm.widgets import LensExplorer
    LensExplorer(model, "The capital of France is")      # displays as its widget
"""

from __future__ import annotations

import base64
import html
from collections.abc import Callable
from typing import Any

import ipywidgets as W

from .analyses import logit_lens, patch
from .capture import generate
from .compare import Discrepancy, compare
from .patching import PatchResult
from .results import Run
from .views import (
    HIGHLIGHT,
    METRICS,
    error_html,
    figure,
    figure_png,
    lens_rows,
    lens_table_html,
    live_lens_html,
    per_position,
    plain_title,
    position_table_html,
    step_position,
    summary_html,
    tok_html,
    token_options,
)

__all__ = ["CompareView", "LensExplorer", "LiveGeneration", "PatchExplorer", "SamplesExplorer"]

#: Top-k the lens is computed with; the widget's top-k slider shows up to this many.
LENS_TOP_K = 10


# ---------------------------------------------------------------------------------- the explorers


class _Explorer:
    """What every explorer shares: the error area, guarded callbacks and PNG output."""

    widget: W.Box

    def __init__(self) -> None:
        self.error = W.HTML(value="")
        self.error.add_class("nnvllm-error")
        self.last_error: BaseException | None = None
        self.png: bytes | None = None  # the last image drawn into .plot
        self.draws = 0
        # The engine's own progress bars and warnings land here, folded away, not in the page.
        self.log = W.Output()
        self.log_box = W.Accordion(children=[self.log], titles=("engine log",), selected_index=None)

    def _quiet(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call ``fn`` with its printed output captured in ``.log`` (in a kernel); return its result."""
        box: dict[str, Any] = {}
        with self.log:  # in IPython, Output.__exit__ swallows exceptions: carry them out by hand
            try:
                box["value"] = fn(*args, **kwargs)
            except Exception as e:  # noqa: BLE001
                box["error"] = e
        if "error" in box:
            raise box["error"]
        return box["value"]

    def _guard(self, fn: Callable[..., Any], *args: Any, clear: bool = False) -> bool:
        """Run a callback; show an exception in the error area instead of losing it."""
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - a widget callback must not lose errors
            self.last_error = e
            self.error.value = error_html(e)
            return False
        if clear:
            self.last_error = None
            self.error.value = ""
        return True

    def _clear_error(self) -> None:
        self.last_error = None
        self.error.value = ""

    def _show(self, out: W.Output, fig, text: str) -> None:
        # Replacing the outputs in one assignment works with or without a kernel and any backend.
        png = figure_png(fig)
        out.outputs = (
            {
                "output_type": "display_data",
                "data": {"image/png": base64.b64encode(png).decode("ascii"), "text/plain": text},
                "metadata": {},
            },
        )
        self.png = png
        self.draws += 1

    def _repr_mimebundle_(self, **kwargs):
        """The live widget, plus a static ``text/html`` copy of what it shows now (its last figure
        and error), for places with no widget manager: an HTML export such as ``make demo``'s, or a
        notebook viewer. JupyterLab shows the widget (its mime type ranks first there)."""
        bundle = self.widget._repr_mimebundle_(**kwargs)
        if isinstance(bundle, tuple):  # (data, metadata)
            data, meta = bundle
        else:
            data, meta = bundle, None
        if self.png:
            img = base64.b64encode(self.png).decode("ascii")
            data = {**data, "text/html": (f"<div class='nnvllm-static'><img src='data:image/png;base64,{img}'/>"
                                          f"{self.error.value}</div>")}
        return data if meta is None else (data, meta)


def _side_by_side(plot: W.Output, other: W.Widget) -> W.HBox:
    # The plot keeps its natural size; a wide table wraps below it instead of squeezing it.
    plot.layout = W.Layout(flex="0 0 auto")
    return W.HBox([plot, other], layout=W.Layout(flex_flow="row wrap", align_items="flex-start"))


def _button(description: str, on_click: Callable[[], None]) -> W.Button:
    b = W.Button(description=description, button_style="primary")
    b.on_click(lambda _: on_click())
    return b


class LensExplorer(_Explorer):
    """Logit lens of one prompt over generation: heatmap, a chosen layer's top-k table, a chosen step.

    Controls: ``prompt`` (Text), ``max_tokens``, ``run_button`` (runs the engine), ``layer``
    (IntSlider, CSS class ``nnvllm-layer``: the layer whose top tokens the table shows and the
    heatmap outlines), ``step`` (generated step whose predicting position is marked) and ``top_k``.
    Views: ``plot`` (Output, class ``nnvllm-plot``), ``table`` (HTML), ``status`` (HTML).
    State: ``lens`` (:class:`nnvllm.lens.Lens`), ``png``, ``last_error``.

    The first run happens at construction (one short generation), so the widget opens with a
    picture; later runs happen on the button.

    Example::

        ex = LensExplorer(model, "The capital of France is", max_tokens=5)
        ex.layer.value = 5                  # redraws; no engine call
        ex.prompt.value = "The capital of Italy is"; ex.run_button.click()
    """

    def __init__(self, model, prompt: str = "The capital of France is", max_tokens: int = 5,
                 run_now: bool = True) -> None:
        super().__init__()
        self.model = model
        self.lens = None
        n = model.n_layers
        self.prompt = W.Text(value=prompt, description="prompt", continuous_update=False,
                             layout=W.Layout(width="420px"))
        self.max_tokens = W.BoundedIntText(value=max_tokens, min=1, max=256, description="max tokens",
                                           layout=W.Layout(width="160px"))
        self.run_button = _button("Run", self.run)
        self.layer = W.IntSlider(value=0, min=0, max=n - 1, description="layer", continuous_update=False)
        self.layer.add_class("nnvllm-layer")
        self.step = W.IntSlider(value=0, min=0, max=max(max_tokens - 1, 0), description="step",
                                continuous_update=False)
        self.top_k = W.IntSlider(value=5, min=1, max=LENS_TOP_K, description="top-k", continuous_update=False)
        self.plot = W.Output()
        self.plot.add_class("nnvllm-plot")
        self.table = W.HTML()
        self.status = W.HTML()
        self.layer.observe(lambda _: self._guard(self.redraw), names="value")
        self.step.observe(lambda _: self._guard(self.redraw), names="value")
        self.top_k.observe(lambda _: self._guard(self._update_table), names="value")
        self.widget = W.VBox([
            W.HBox([self.prompt, self.max_tokens, self.run_button]),
            W.HBox([self.layer, self.step, self.top_k]),
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
        self.run_button.disabled = True
        try:
            self._guard(self._run, clear=True)
        finally:
            self.run_button.disabled = False

    def _run(self) -> None:
        lens = self._quiet(logit_lens, self.model, self.prompt.value, max_tokens=int(self.max_tokens.value),
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
        """Redraw the heatmap (chosen layer outlined, chosen step's position marked), table and status."""
        lens = self.lens
        if lens is None:
            return
        j, pos = int(self.layer.value), self.position
        n_layer, n_pos, _ = lens.top_ids.shape
        shown = min(n_pos, 40)
        start = n_pos - shown  # plot_lens shows the last 40 positions
        fig = figure(max(6.0, 2.0 + 0.55 * shown), max(3.0, 1.6 + 0.42 * n_layer))
        ax = fig.subplots()
        lens.plot(ax=ax, max_positions=40)
        ax.add_patch(_rect(-0.5, j - 0.5, shown, 1.0, lw=2.5))
        if pos >= start:
            ax.add_patch(_rect(pos - start - 0.5, -0.5, 1.0, n_layer, lw=1.5, ls=":"))
        ax.set_title(f"logit lens: layer {lens.layers[j]} outlined, step {self.step.value} dotted", fontsize=10)
        self._show(self.plot, fig, f"<logit lens heatmap, layer {lens.layers[j]}>")
        self._update_table()
        row = lens_rows(lens, j, 1)[pos]
        gen = lens.generated[int(self.step.value)] if lens.generated else None
        gen_text = "" if gen is None else (lens.tokenizer.decode([gen]) if lens.tokenizer else str(gen))
        self.status.value = (
            f"step {self.step.value}: the model generated {tok_html(gen_text)}; at layer {lens.layers[j]} "
            f"the lens's top-1 at position {pos} ({tok_html(row['input'])}) is {tok_html(row['top'][0][0])} "
            f"(p={row['top'][0][1]:.2f})"
        )


def _rect(x, y, w, h, lw=2.0, ls="-"):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), w, h, fill=False, edgecolor=HIGHLIGHT, linewidth=lw, linestyle=ls, clip_on=False)


class SamplesExplorer(_Explorer):
    """Sample a continuation and see what the sampler drew at each step, with its alternatives.

    Controls: ``prompt``, ``max_tokens``, ``temperature``, ``top_p``, ``seed`` and ``run_button``
    ("Sample", runs the engine). Views: ``plot`` (Output, class ``nnvllm-plot``:
    :func:`nnvllm.plotting.plot_samples`), ``text`` (HTML: the continuation, each token shaded by
    its probability), ``table`` (HTML: one row per step). State: ``run``, ``png``, ``last_error``.

    Example::

        ex = SamplesExplorer(model, "The capital of France is")
        ex.temperature.value = 1.5; ex.run_button.click()
    """

    def __init__(self, model, prompt: str = "The capital of France is", max_tokens: int = 10,
                 temperature: float = 0.8, top_p: float = 0.95, seed: int = 0, run_now: bool = True) -> None:
        super().__init__()
        self.model = model
        self.run: Run | None = None  # the last sampled run (one request)
        self.prompt = W.Text(value=prompt, description="prompt", continuous_update=False,
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
        self.run_button.disabled = True
        try:
            self._guard(self._sample, clear=True)
        finally:
            self.run_button.disabled = False

    def _sample(self) -> None:
        from .plotting import plot_samples

        run = self._quiet(generate, self.model, self.prompt.value, max_tokens=int(self.max_tokens.value),
                          temperature=float(self.temperature.value), top_p=float(self.top_p.value),
                          seed=int(self.seed.value), layers=None, logits=False)
        self.run = run
        tok = self.model.tokenizer
        s = run.samples[0]
        fig = figure(max(6.0, 1.5 + 0.5 * len(s)), 3.6)
        plot_samples(run, 0, ax=fig.subplots(), tokenizer=tok)
        self._show(self.plot, fig, "<sampled tokens plot>")
        pieces = "".join(
            f"<span title='p={float(q):.3f}' style='background:rgba(31,119,180,{0.15 + 0.6 * float(q):.2f})'>"
            f"{html.escape(tok.decode([int(t)]))}</span>"
            for t, q in zip(s.ids.tolist(), s.probs)
        )
        self.text.value = f"<div style='white-space:pre-wrap'>{html.escape(run.prompts[0])}{pieces}</div>"
        frame = run.to_frame()
        # repr: a table cell would drop a token's leading space
        frame.insert(3, "token", [repr(tok.decode([int(t)])) for t in frame["token_id"]])
        frame["top1"] = [repr(tok.decode([int(t)])) for t in frame["top1_id"]]
        self.table.value = frame[["step", "token", "prob", "top1", "top1_prob"]].to_html(
            index=False, float_format="{:.3f}".format, classes="nnvllm-table")


class PatchExplorer(_Explorer):
    """Activation patching sweep with its heatmap and a single cell's effect.

    Controls: ``clean``, ``corrupt``, ``answer``, ``wrong`` (Text), ``site`` (Dropdown: resid, attn,
    mlp), ``layers`` (IntRangeSlider of blocks), ``positions`` (SelectMultiple of the clean
    prompt's tokens), ``run_button`` ("Run sweep": one :func:`nnvllm.patch` call whose progress
    callback moves ``progress``, cells done), then ``cell_layer`` and ``cell_pos`` (choose a cell of the result).
    Views: ``plot`` (Output, class ``nnvllm-plot``), ``cell`` (HTML). State: ``result``
    (:class:`~nnvllm.patching.PatchResult`), ``png``, ``last_error``.

    A sweep costs layers × positions forward passes, so nothing runs until the button is pressed
    (``run_now=True`` runs one at construction).

    Example::

        ex = PatchExplorer(model, "The capital of France is", "The capital of Italy is", " Paris", " Rome")
        ex.run_button.click(); ex.result.best()
    """

    def __init__(self, model, clean: str = "The capital of France is", corrupt: str = "The capital of Italy is",
                 answer: str = " Paris", wrong: str = " Rome", site: str = "resid", run_now: bool = False) -> None:
        super().__init__()
        self.model = model
        self.result: PatchResult | None = None
        self._drawing = True
        n = model.n_layers
        text = {"continuous_update": False, "layout": W.Layout(width="360px")}
        self.clean = W.Text(value=clean, description="clean", **text)
        self.corrupt = W.Text(value=corrupt, description="corrupt", **text)
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
        self.clean.observe(lambda _: self._guard(self._refresh_positions), names="value")
        # An error belongs to the inputs that caused it: editing any of them clears it (issue 14,
        # item 11: a notebook's own test of a bad answer left its red error on the widget).
        for w in (self.clean, self.corrupt, self.answer, self.wrong, self.site):
            w.observe(lambda _: self._clear_error(), names="value")
        self.cell_layer.observe(lambda _: self._guard(self.redraw), names="value")
        self.cell_pos.observe(lambda _: self._guard(self.redraw), names="value")
        self.widget = W.VBox([
            W.HBox([W.VBox([self.clean, self.corrupt]), W.VBox([self.answer, self.wrong])]),
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

    def _refresh_positions(self) -> None:
        opts = token_options(self.model.tokenizer, self.clean.value)
        self.positions.options = opts
        self.positions.value = tuple(p for _, p in opts)

    def sweep(self) -> None:
        """Run the sweep with the current settings (the slow call); errors go to the error area."""
        self.run_button.disabled = True
        try:
            self._guard(self._sweep, clear=True)
        finally:
            self.run_button.disabled = False

    def _sweep(self) -> None:
        positions = list(self.positions.value)
        if not positions:
            raise ValueError("no positions selected; choose at least one token in 'positions'.")
        lo, hi = self.layers.value
        layers = list(range(lo, hi + 1))
        self.progress.max, self.progress.value = len(layers) * len(positions), 0

        def moved(done: int, total: int) -> None:
            self.progress.max, self.progress.value = total, done

        # One sweep (the base generations once), the bar moving with each batch of patched runs.
        res = self._quiet(patch, self.model, self.clean.value, self.corrupt.value, self.answer.value,
                          self.wrong.value, layers=layers, positions=positions, site=self.site.value,
                          progress=moved)
        self.result = res
        best_layer, best_pos, _ = res.best()
        self._drawing = False  # options first, then values: the observers redraw once at the end
        self.cell_layer.options = res.layers
        self.cell_pos.options = [(f"{p} {lab!r}", p) for p, lab in zip(res.positions, res.labels)]
        self.cell_layer.value, self.cell_pos.value = best_layer, best_pos
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
        j, p = res.layers.index(layer), res.positions.index(pos)
        fig = figure(max(6.0, 2.5 + 0.6 * len(res.positions)), max(3.0, 1.8 + 0.42 * len(res.layers)))
        ax = fig.subplots()
        res.plot(ax=ax)
        ax.add_patch(_rect(p - 0.5, j - 0.5, 1.0, 1.0, lw=2.5))
        self._show(self.plot, fig, f"<patching heatmap, cell layer {layer} pos {pos}>")
        self.cell.value = (
            f"patching {res.site} of layer {layer} at position {pos} ({tok_html(res.labels[p])}): "
            f"effect <b>{float(res.effect[j, p]):.3f}</b> (logit diff {float(res.patched_diff[j, p]):.3f}; "
            f"clean {res.clean_diff:.3f}, corrupt {res.corrupt_diff:.3f}; 1 = clean answer "
            f"{tok_html(res.answer)} restored, 0 = no change)"
        )


class CompareView(_Explorer):
    """Compare two of several runs of the same prompts: per-layer error, per-position detail, summary.

    Controls: ``a`` and ``b`` (Dropdowns of the run names; ``a`` is the reference), ``metric``
    (max_abs, rel_err, cosine) and ``layer`` (SelectionSlider of captured blocks, class
    ``nnvllm-layer``). Comparing runs is pure and quick, so every change recomputes at once.
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
        self.plot = W.Output()
        self.plot.add_class("nnvllm-plot")
        self.summary = W.HTML()
        self.table = W.HTML()
        for w in (self.a, self.b):
            w.observe(lambda _: self._guard(self.recompute, clear=True), names="value")
        for w in (self.metric, self.layer):
            w.observe(lambda _: self._guard(self.redraw), names="value")
        self.widget = W.VBox([
            W.HBox([self.a, self.b]),
            W.HBox([self.metric, self.layer]),
            self.error,
            _side_by_side(self.plot, self.summary),
            self.table,
        ])
        self.widget.add_class("nnvllm-compare")
        self._guard(self.recompute, clear=True)

    def recompute(self) -> None:
        """Compare the two chosen runs, then redraw."""
        self.discrepancy = None
        a, b = self.a.value, self.b.value
        d = compare(self.runs[a], self.runs[b], names=(a, b))
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
        fig = figure(8.0, 3.2)  # 10 in was clipped in JupyterLab with the file browser open
        ax_l, ax_p = fig.subplots(1, 2)
        if len(d.resid) == 0:
            ax_l.text(0.5, 0.5, "no residual stream compared", ha="center", transform=ax_l.transAxes)
            self.table.value = ""
        else:
            per_layer = d.per_layer(metric)
            table = per_position(d, metric, layer)
            _draw_metric(ax_l, per_layer.index.to_numpy(), per_layer.to_numpy(dtype=float), metric, "o-")
            ax_l.axvline(layer, color=HIGHLIGHT, lw=2)
            ax_l.set_xlabel("layer")
            ax_l.set_title(f"worst {metric} per layer ({plain_title(d.names[0])} vs {plain_title(d.names[1])})", fontsize=9)
            worst = table.min(axis=0) if metric == "cosine" else table.max(axis=0)
            _draw_metric(ax_p, worst.index.to_numpy(), worst.to_numpy(dtype=float), metric, "s-")
            ax_p.set_xlabel("position")
            ax_p.set_title(f"layer {layer}: worst {metric} per position over requests", fontsize=9)
            self.table.value = position_table_html(table, metric, layer)
        fig.tight_layout()
        self._show(self.plot, fig, f"<{metric} per layer, layer {layer}>")


def _draw_metric(ax, x, y, metric: str, style: str) -> None:
    import numpy as np

    if metric == "cosine":  # 1 - cosine on a log axis: how far from parallel
        y, label = 1.0 - y, "1 - cosine"
    else:
        label = metric
    ax.plot(x, np.clip(y, 1e-16, None), style)
    ax.set_yscale("log")
    ax.set_ylabel(label + " (log)")
    ax.set_xticks(x)


class LiveGeneration(_Explorer):
    """One prompt generating live: the text as tokens arrive, a layers x steps panel of the logit
    lens's top-1 token at each step (:func:`live_lens_html`), and a Stop button that ends the
    generation and keeps what was produced (``.run``).

    The generation runs in a background thread (:func:`nnvllm.stream`), so the notebook, and the
    Stop button, stay responsive; call nothing else on the same engine until it is done
    (``.wait()``). ``pace`` (seconds) waits between steps, to watch a fast model. State for tests:
    ``.steps`` (the :class:`~nnvllm.Step` s), ``.text.value``, ``.panel.value``, ``.status.value``,
    ``.run``, ``.stop_button``.

    Example::

        live = LiveGeneration(model, "The capital of France is", max_tokens=40)   # displays live
        live.wait(); live.run
    """

    def __init__(self, model, prompt: str, max_tokens: int = 20, *, layers="all", pace: float = 0.0,
                 **generate_kwargs: Any) -> None:
        import threading

        from .streaming import stream

        super().__init__()
        if not isinstance(prompt, str):
            raise TypeError(f"prompt={prompt!r}: LiveGeneration shows one prompt (a str)")
        if isinstance(pace, bool) or not isinstance(pace, (int, float)) or not 0 <= pace <= 10:
            raise ValueError(f"pace={pace!r}; expected seconds between steps, 0 to 10")
        self.model = model
        self.pace = float(pace)
        self.stream = stream(model, [prompt], max_tokens=max_tokens, layers=layers, **generate_kwargs)
        self.layers = list(self.stream._req.layer_ids)
        self.steps: list = []
        self._cells: list[list[tuple[str, float]]] = []
        self._generated: list[str] = []
        self.prompt = prompt
        self.text = W.HTML(value=tok_html(prompt))
        self.text.add_class("nnvllm-live-text")
        self.panel = W.HTML(value="")
        self.panel.add_class("nnvllm-live-panel")
        self.status = W.HTML(value="generating")
        self.status.add_class("nnvllm-live-status")
        self.stop_button = W.Button(description="Stop", button_style="danger")
        self.stop_button.on_click(lambda _: self.stop())
        self.widget = W.VBox([W.HBox([self.stop_button, self.status]), self.text, self.panel, self.error])
        self.widget.add_class("nnvllm-live")
        self._thread = threading.Thread(target=self._drive, name="nnvllm-live", daemon=True)
        self._thread.start()

    @property
    def run(self) -> Run | None:
        """The whole Run once the generation has ended (stopped or not), else None."""
        return self.stream.run

    def stop(self) -> None:
        """End the generation at the next step; ``.run`` keeps what was produced."""
        self.stop_button.disabled = True
        self.stream.stop()

    def wait(self, timeout: float | None = None) -> Run | None:
        """Wait until the generation has ended; return its Run."""
        self._thread.join(timeout)
        return self.run

    def _drive(self) -> None:
        import time

        tok = getattr(self.model, "tokenizer", None)
        decode = (lambda i: tok.decode([i])) if tok is not None else str
        try:
            for step in self.stream:
                self.steps.append(step)
                self.text.value = tok_html(self.prompt) + f"<b>{tok_html(step.text[0])}</b>"
                if step.tokens[0]:
                    self._generated.append(decode(step.tokens[0][-1]))
                    if step.lens_ids is not None:
                        self._cells.append([(decode(int(i)) if i >= 0 else "", float(p))
                                            for i, p in zip(step.lens_ids[0].tolist(), step.lens_probs[0].tolist())])
                        self.panel.value = live_lens_html(self.layers, self._cells, self._generated)
                self.status.value = f"generating: {len(self._generated)} token(s)"
                if self.pace:
                    time.sleep(self.pace)
            n = len(self.run.tokens[0])
            self.status.value = (f"stopped after {n} token(s)" if self.stream.stopped else f"done: {n} token(s)")
        except Exception as e:  # noqa: BLE001 - shown in the widget, kept in .last_error
            self.last_error = e
            self.error.value = error_html(e)
            self.status.value = "failed"
        finally:
            self.stop_button.disabled = True
