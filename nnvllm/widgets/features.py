"""The SAE feature explorer: :class:`FeatureExplorer` (pick a token, see its features; pick a feature,
see where it fires); what it shows comes from :mod:`nnvllm.views_features`."""

from __future__ import annotations

from ..capture import generate
from ..plotting_features import feature_strip_figsize, plot_feature_strip
from ..results import Run
from ..sae import SAE
from ..views import figure
from ..views_features import (
    feature_activations,
    feature_status_html,
    feature_text_html,
    position_options,
    token_features,
    token_features_html,
)
from .base import W, _button, _check_open, _Explorer, _side_by_side

__all__ = ["FeatureExplorer"]

#: Features of the chosen token drawn as rows of the strip (the list beside it shows ``k``).
STRIP_ROWS = 5


class FeatureExplorer(_Explorer):
    """Which SAE features fire on each token of a generation, and where one feature fires over the text.

    Runs ``nv.generate(model, prompt, saes=[sae], sae_k=k)`` (the encoding happens in the engine) and
    shows request 0: pick a token (``token``: prompt tokens, then the generated ones that were fed
    back) and ``features`` lists the features that fire on it, strongest first; pick one there (or
    type any id into ``feature``) and the text is shaded by that feature's activation at every token
    (``text``), the strip below draws the token's strongest features over the text with the chosen
    feature's row and the chosen token's column outlined (``plot``), and ``status`` says where it
    fires most.

    Controls: ``prompt``, ``max_tokens``, ``run_button`` (runs the engine), ``token`` (Dropdown, CSS
    class ``nnvllm-token``), ``features`` (Select, class ``nnvllm-feature-list``), ``feature``
    (BoundedIntText, class ``nnvllm-feature``). Views: ``text`` (HTML, class ``nnvllm-feature-view``),
    ``table`` (HTML: the token's features with bars), ``status`` (HTML), ``plot`` (Output, class
    ``nnvllm-plot``). State: ``run``, ``position``, ``activations`` (``[pos]``: the shown feature at
    each token), ``png``, ``last_error``. Changing the token or the feature redraws without the engine.

    Example::

        ex = FeatureExplorer(model, "The capital of France is", sae, max_tokens=3)
        ex.token.value = 3                      # ' France': its features, strongest first
        ex.feature.value = ex.features.options[0][1]
        ex.activations                           # where that feature fires
    """

    def __init__(self, model, prompt: str = "The capital of France is", sae: SAE | None = None, max_tokens: int = 5,
                 k: int = 16, run_now: bool = True) -> None:
        super().__init__()
        if not isinstance(sae, SAE):
            raise TypeError(f"FeatureExplorer needs an SAE for the model, e.g. sae=nv.SAE.load(path); got "
                            f"{type(sae).__name__}")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= sae.d_sae:
            raise ValueError(f"k={k!r}: expected features kept per token, 1 to the SAE's d_sae={sae.d_sae}")
        self.model, self.sae, self.k = model, sae, k
        self.run: Run | None = None
        self._drawing = True
        self.prompt = W.Text(value=prompt, description="prompt", continuous_update=False,
                             layout=W.Layout(width="420px"))
        self.max_tokens = W.BoundedIntText(value=max_tokens, min=1, max=256, description="max tokens",
                                           layout=W.Layout(width="160px"))
        self.run_button = _button("Run", self.generate)
        self.token = W.Dropdown(options=[], description="token", layout=W.Layout(width="300px"))
        self.token.add_class("nnvllm-token")
        self.features = W.Select(options=[], description="its features", rows=8, style={"description_width": "initial"},
                                 layout=W.Layout(width="260px"))
        self.features.add_class("nnvllm-feature-list")
        self.feature = W.BoundedIntText(value=0, min=0, max=sae.d_sae - 1, description="feature",
                                        layout=W.Layout(width="180px"))
        self.feature.add_class("nnvllm-feature")
        self.text = W.HTML()
        self.text.add_class("nnvllm-feature-view")
        self.table = W.HTML()
        self.status = W.HTML()
        self.plot = W.Output()
        self.plot.add_class("nnvllm-plot")
        self.token.observe(lambda _: self._guard(self._token_changed), names="value")
        self.features.observe(lambda _: self._guard(self._list_changed), names="value")
        self.feature.observe(lambda _: self._guard(self.redraw), names="value")
        self.widget = W.VBox([
            W.HBox([self.prompt, self.max_tokens, self.run_button]),
            W.HBox([W.VBox([self.token, self.feature]), self.features]),
            self.status,
            self.error,
            self.text,
            _side_by_side(self.plot, self.table),
            self.log_box,
        ])
        self.widget.add_class("nnvllm-features")
        if run_now:
            self.generate()

    def generate(self) -> None:
        """Generate with the SAE on the current prompt (the slow call); errors go to the error area."""
        self._slow_call(self._generate)

    def _generate(self) -> None:
        _check_open(self.model)
        run = self._quiet(generate, self.model, self.prompt.value, max_tokens=int(self.max_tokens.value),
                          layers=None, logits=False, saes=[self.sae], sae_k=self.k)
        self.run = run
        self._drawing = False  # options, then values: one redraw at the end
        try:
            self.token.options = position_options(run, 0)
            self.token.value = len(run.prompt_ids[0]) - 1  # the token that predicted the first generated one
            self._list_features()
        finally:
            self._drawing = True
        self.redraw()

    @property
    def position(self) -> int:
        """The chosen token's position (prompt tokens first, then the generated ones fed back)."""
        return int(self.token.value)

    @property
    def activations(self):
        """``[pos]``: the shown feature's activation at each token of the text (0 outside a token's top ``k``)."""
        if self.run is None:
            raise ValueError("nothing generated yet; press 'Run' (or call .generate()) first")
        return feature_activations(self.run, int(self.feature.value))

    def _list_features(self) -> None:
        """Fill ``features`` with the chosen token's features and show the strongest."""
        rows = token_features(self.run, 0, k=self.k, positions=[self.position])
        self.features.options = [(f"{f}: {a:.3f}", int(f)) for f, a in zip(rows["feature"], rows["activation"])]
        if len(rows):
            self.features.value = int(rows["feature"].iloc[0])
            self.feature.value = int(rows["feature"].iloc[0])

    def _token_changed(self) -> None:
        if self.run is None or not self._drawing:
            return
        self._drawing = False
        try:
            self._list_features()
        finally:
            self._drawing = True
        self.redraw()

    def _list_changed(self) -> None:
        if self._drawing and self.features.value is not None:
            self.feature.value = int(self.features.value)  # its observer redraws

    def redraw(self) -> None:
        """Redraw the shaded text, the token's table, the status line and the strip for the chosen token
        and feature."""
        run = self.run
        if run is None or not self._drawing:
            return
        pos, f = self.position, int(self.feature.value)
        self.text.value = feature_text_html(run, f, selected=pos)
        self.table.value = token_features_html(run, pos, k=self.k, selected=f)
        self.status.value = feature_status_html(run, f)
        rows = [int(x) for x in token_features(run, 0, k=STRIP_ROWS, positions=[pos])["feature"]]
        rows = rows + [f] if f not in rows else rows
        fig = figure(*feature_strip_figsize(run.positions(0), len(rows)))
        plot_feature_strip(run, rows, ax=fig.subplots(), mark_pos=pos, mark_feature=f)
        fig.tight_layout()
        self._show(self.plot, fig, f"<feature strip, token {pos}, feature {f}>", pos=pos, feature=f)
