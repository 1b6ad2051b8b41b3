"""The attention head explorer: :class:`HeadExplorer` (pick a step, a block and a head; see where it looks
and what it adds to a logit difference); what it shows comes from :mod:`nnvllm.views_heads`."""

from __future__ import annotations

from ..analyses import attribute
from ..capture import generate
from ..heads import Attribution
from ..plotting_heads import head_pattern_figsize, plot_head_pattern
from ..results import Run
from ..views import figure
from ..views_heads import (
    attribution_cells,
    head_options,
    head_pattern,
    head_status_html,
    pattern_text_html,
    query_position,
    step_options,
    top_attended_html,
)
from .base import W, _button, _check_open, _Explorer

__all__ = ["HeadExplorer"]

#: Heads listed in the "strongest heads" picker (largest absolute attribution first).
STRONGEST = 12
#: What the explorer captures: q and k for patterns; z, mlp (and attn, for families that norm each
#: sublayer's output) for the attribution.
SITES = ("q", "k", "z", "mlp", "attn")
_CHOSEN = "2px solid #ff7f0e"


class HeadExplorer(_Explorer):
    """Attention heads over one generation: where a head looks, and what it adds to a logit difference.

    Runs ``nv.generate(model, prompt, sites=["q", "k", "z", "mlp", "attn"])`` and
    ``nv.attribute(run, target, versus)``, then shows request 0. Pick a generated ``step`` (the query
    is the position whose logits drew that token), a ``layer`` and a ``head``: ``plot`` draws the head's
    pattern over the tokens as a heat strip, ``text`` shades the text by it, ``table`` lists the
    tokens it attends to most, and ``status`` says what the head adds to ``logit[target] -
    logit[versus]`` at that step. The block × head ``map`` colours every head by its attribution at the
    step (blue raises the difference, red lowers it); clicking a cell opens that head, as does picking
    it in ``strongest`` (the heads by size of attribution). The first run opens the strongest head at
    step 0; a later run (a new prompt or new tokens) keeps the chosen head.

    Controls: ``prompt``, ``target`` (one token; empty: the token generated at step 0), ``versus``
    (one token; empty: the target's logit alone), ``max_tokens``, ``run_button`` (runs the engine),
    ``step`` (Dropdown, CSS class ``nnvllm-step``), ``layer`` (IntSlider, class ``nnvllm-layer``),
    ``head`` (IntSlider, class ``nnvllm-head``), ``strongest`` (Dropdown, class ``nnvllm-head-list``),
    ``map`` (GridBox of Buttons, class ``nnvllm-head-map``; ``cells[layer][head]`` is a Button, class
    ``nnvllm-head-cell``). Views: ``plot`` (Output, class ``nnvllm-plot``), ``text`` (HTML, class
    ``nnvllm-head-text``), ``table`` (HTML) and ``status`` (HTML, class ``nnvllm-head-status``). State: ``run``, ``attribution``,
    ``position`` (the query), ``pattern`` (``[pos]``, the shown head's weights), ``png``,
    ``last_error``. Every choice after the run redraws without the engine.

    A model of many heads makes a map of as many buttons (a 16-block, 32-head model: 512). The
    attribution reads the output projections, the final norm and the unembedding from the checkpoint
    with transformers, on this machine (``nv.attribute``; cached per checkpoint after the first run).

    Example::

        ex = HeadExplorer(model, "The capital of France is", target=" Paris", versus=" Rome")
        ex.cells[1][0].click()                  # head 1.0: where it looks when " Paris" is written
        ex.pattern, ex.status.value
    """

    def __init__(self, model, prompt: str = "The capital of France is", target: str | int | None = " Paris",
                 versus: str | int | None = " Rome", max_tokens: int = 3, run_now: bool = True) -> None:
        super().__init__()
        self.model = model
        self.run: Run | None = None
        self.attribution: Attribution | None = None
        self.cells: list[list[W.Button]] = []
        self._drawing = True
        text = {"continuous_update": False}
        self.prompt = W.Text(value=prompt, description="prompt", layout=W.Layout(width="420px"), **text)
        self.max_tokens = W.BoundedIntText(value=max_tokens, min=1, max=256, description="max tokens",
                                           layout=W.Layout(width="160px"))
        self.target = W.Text(value="" if target is None else str(target), description="target",
                             placeholder="one token; empty: the first generated", layout=W.Layout(width="260px"), **text)
        self.versus = W.Text(value="" if versus is None else str(versus), description="versus",
                             placeholder="one token; empty: none", layout=W.Layout(width="260px"), **text)
        self.run_button = _button("Run", self.generate)
        self.step = W.Dropdown(options=[], description="step", layout=W.Layout(width="220px"))
        self.step.add_class("nnvllm-step")
        self.layer = W.IntSlider(value=0, min=0, max=max(model.n_layers - 1, 0), description="layer",
                                 continuous_update=False)
        self.layer.add_class("nnvllm-layer")
        self.head = W.IntSlider(value=0, min=0, max=0, description="head", continuous_update=False)
        self.head.add_class("nnvllm-head")
        self.strongest = W.Dropdown(options=[], description="strongest heads", style={"description_width": "initial"},
                                    layout=W.Layout(width="260px"))
        self.strongest.add_class("nnvllm-head-list")
        self.map = W.GridBox(layout=W.Layout(grid_gap="2px"))
        self.map.add_class("nnvllm-head-map")
        self.plot = W.Output()
        self.plot.add_class("nnvllm-plot")
        self.text = W.HTML()
        self.text.add_class("nnvllm-head-text")
        self.table = W.HTML()
        self.status = W.HTML()
        self.status.add_class("nnvllm-head-status")
        self.step.observe(lambda _: self._guard(self._step_changed), names="value")
        for w in (self.layer, self.head):
            w.observe(lambda _: self._guard(self.redraw), names="value")
        self.strongest.observe(lambda _: self._guard(self._picked), names="value")
        self.widget = W.VBox([
            W.HBox([self.prompt, self.max_tokens, self.run_button]),
            W.HBox([self.target, self.versus]),
            W.HBox([self.step, self.layer, self.head, self.strongest]),
            self.status,
            self.error,
            W.HBox([W.VBox([W.HTML("<b>each head's attribution</b> (click one)"), self.map]),
                    W.VBox([self.text, self.table])], layout=W.Layout(flex_flow="row wrap", align_items="flex-start")),
            self.plot,
            self.log_box,
        ])
        self.widget.add_class("nnvllm-heads")
        if run_now:
            self.generate()

    # ------------------------------------------------------------------ the engine call

    def generate(self) -> None:
        """Generate and attribute with the current settings (the slow call); errors go to the error area."""
        self._slow_call(self._generate)

    def _token(self, box: W.Text) -> str | None:
        return box.value if box.value != "" else None

    def _generate(self) -> None:
        _check_open(self.model)
        run = self._quiet(generate, self.model, self.prompt.value, max_tokens=int(self.max_tokens.value),
                          sites=list(SITES), layers="all")
        target = self._token(self.target)
        att = attribute(run, target=run.tokens[0][0] if target is None else target, versus=self._token(self.versus))
        first = self.run is None
        self.run, self.attribution = run, att
        n_layers, n_heads = att.heads[0].shape[1:]
        self._drawing = False  # options and ranges first, then values: one redraw at the end
        try:
            self.layer.max, self.head.max = n_layers - 1, n_heads - 1
            self.step.options = step_options(run, 0)
            self.step.value = 0
            self._build_map(n_layers, n_heads)
            if first:  # open on the strongest head; later runs keep the head chosen, to compare prompts
                self.layer.value, self.head.value = head_options(att, 0, 0, k=1)[0][1]
            self._fill_step()
        finally:
            self._drawing = True
        self.redraw()

    # ------------------------------------------------------------------ choosing

    def _build_map(self, n_layers: int, n_heads: int) -> None:
        if len(self.cells) == n_layers and all(len(row) == n_heads for row in self.cells):
            return
        self.cells = [[self._cell(layer, h) for h in range(n_heads)] for layer in range(n_layers)]
        corner = [W.HTML("")] + [W.HTML(f"<small>head {h}</small>") for h in range(n_heads)]
        rows = [[W.HTML(f"<small>block {layer}</small>")] + self.cells[layer] for layer in range(n_layers)]
        self.map.children = corner + [w for row in rows for w in row]
        self.map.layout.grid_template_columns = f"max-content repeat({n_heads}, 58px)"

    def _cell(self, layer: int, head: int) -> W.Button:
        b = W.Button(description="", layout=W.Layout(width="58px", height="24px", padding="0"))
        b.add_class("nnvllm-head-cell")
        b.on_click(lambda _: self._guard(self.select, layer, head))
        return b

    def _fill_step(self) -> None:
        """Colour the map and list the strongest heads for the chosen step."""
        step = int(self.step.value)
        for row in attribution_cells(self.attribution, step, 0):
            for c in row:
                b = self.cells[c["layer"]][c["head"]]
                b.description = f"{c['value']:+.2f}"
                b.tooltip = f"head {c['layer']}.{c['head']}: {c['value']:+.3f}"
                b.style.button_color = c["color"]
                b.style.text_color = "white" if c["dark"] else "black"
        self.strongest.options = head_options(self.attribution, step, 0, k=STRONGEST)
        self._sync_strongest()

    def _sync_strongest(self) -> None:
        chosen = (int(self.layer.value), int(self.head.value))
        self.strongest.value = chosen if chosen in [v for _, v in self.strongest.options] else None

    def select(self, layer: int, head: int) -> None:
        """Open head ``layer.head`` (what a click on its map cell does): one redraw."""
        self._drawing = False
        try:
            self.layer.value, self.head.value = int(layer), int(head)
        finally:
            self._drawing = True
        self.redraw()

    def _picked(self) -> None:
        if self._drawing and self.strongest.value is not None:
            self.select(*self.strongest.value)

    def _step_changed(self) -> None:
        if self.run is None or not self._drawing:
            return
        self._drawing = False
        try:
            self._fill_step()
        finally:
            self._drawing = True
        self.redraw()

    # ------------------------------------------------------------------ what it shows

    @property
    def position(self) -> int:
        """The query position of the chosen step (the one whose logits drew its token)."""
        if self.run is None:
            raise ValueError("nothing generated yet; press 'Run' (or call .generate()) first")
        return query_position(self.run, int(self.step.value), 0)

    @property
    def pattern(self):
        """``[pos]``: the shown head's attention over the tokens from the chosen step's query."""
        if self.run is None:
            raise ValueError("nothing generated yet; press 'Run' (or call .generate()) first")
        return head_pattern(self.run, int(self.layer.value), int(self.head.value), int(self.step.value), 0)

    def redraw(self) -> None:
        """Redraw the heat strip, the shaded text, the table, the status line and the map's outline for
        the chosen step, block and head."""
        run, att = self.run, self.attribution
        if run is None or att is None or not self._drawing:
            return
        step, layer, head = int(self.step.value), int(self.layer.value), int(self.head.value)
        for row in self.cells:
            for b in row:
                b.layout.border = None
        self.cells[layer][head].layout.border = _CHOSEN
        self._drawing = False
        try:
            self._sync_strongest()
        finally:
            self._drawing = True
        self.text.value = pattern_text_html(run, layer, head, step, 0)
        self.table.value = top_attended_html(run, layer, head, step, 0)
        self.status.value = head_status_html(run, att, layer, head, step, 0)
        fig = figure(*head_pattern_figsize(run.positions(0), 1))
        plot_head_pattern(run, layer, head, step, 0, ax=fig.subplots())
        fig.tight_layout()
        self._show(self.plot, fig, f"<attention of head {layer}.{head}, step {step}>", step=step, layer=layer, head=head)
