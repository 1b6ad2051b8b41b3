"""Matplotlib views of nnvllm results: ``plot_*(result, ax=None) -> Axes``.

Each function draws on ``ax`` (or on a new ``plt.subplots()`` figure when ax is None) and returns
the Axes. None calls ``plt.show()`` or writes files: the notebook or the caller decides.
pyplot is imported inside the functions, so importing this module selects no backend.

Tokens are labelled so that whitespace shows: a space is ``␣`` (" is" reads ``␣is``), a newline
``↵``, a tab ``⇥``; other control characters are escaped (``\\x00``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["lens_figsize", "log_metric", "plot_compare", "plot_lens", "plot_patch", "plot_samples", "show_token"]

_GENERATED_COLOR = "tab:red"
_VISIBLE = {" ": "␣", "\n": "↵", "\t": "⇥"}
#: Font sizes (points) a lens cell label may take, largest first; below the last it wraps, then is cut.
CELL_FONT_SIZES = (8.0, 7.5, 7.0, 6.5)


def show_token(text: str, width: int | None = None) -> str:
    """Return a token as a label that shows its whitespace: ``" is"`` -> ``"␣is"``, ``"\\n"`` -> ``"↵"``.

    Other unprintable characters are escaped (``"\\x00"``), an empty token is ``''``, and matplotlib's
    ``$`` is escaped so it never starts mathtext. ``width`` cuts a longer label with ``…``.

    Example::

        show_token(" Paris")        # '␣Paris'
    """
    out = "".join(_VISIBLE.get(c, c if c.isprintable() else repr(c)[1:-1]) for c in str(text)) or "''"
    if width is not None and len(out) > width:
        out = out[: max(width - 1, 1)] + "…"
    return out.replace("$", r"\$")


def _name(text: str, width: int = 40) -> str:
    """A run's name in a title or label: kept as typed (spaces are spaces), cut at ``width``, ``$`` escaped."""
    text = str(text)
    text = text if len(text) <= width else text[: width - 1] + "…"
    return text.replace("$", r"\$")


def plot_lens(lens, ax=None, *, annotate: bool = True, max_positions: int = 40):
    """Draw a logit lens: top-1 probability per layer (y) × position (x), cells labelled by token.

    Generated positions (``p >= prompt_len``) sit right of a dashed line and have red tick
    labels. Position ``p``'s cell is the lens's guess at token ``p + 1``. Each cell's label is
    fitted inside its cell: 8 pt where it fits, smaller down to 6.5 pt, then on two lines, and cut
    with ``…`` only when even that does not fit (give the figure more width per position).

    Args:
        lens: a :class:`nnvllm.lens.Lens`.
        ax: Axes to draw on; a new figure when None (sized to the data: ~0.6 in per position).
        annotate: write the top-1 token text in each cell.
        max_positions: show at most this many positions (the last ones, where the prediction
            and the generated tokens are).

    Returns:
        The Axes.

    Example::

        plot_lens(lens, max_positions=20)
    """
    import matplotlib.pyplot as plt

    if isinstance(max_positions, bool) or not isinstance(max_positions, int) or max_positions < 1:
        raise ValueError(f"max_positions={max_positions!r} must be a positive int, e.g. 40.") from None
    n_layer, n_pos, _ = lens.top_ids.shape
    start = max(0, n_pos - max_positions)
    n_shown = n_pos - start
    if ax is None:
        _, ax = plt.subplots(figsize=lens_figsize(n_shown, n_layer))
    probs = lens.top_probs[:, start:, 0].detach().float().cpu().numpy()
    ids = lens.top_ids[:, start:, 0].cpu().numpy()
    im = ax.imshow(
        probs, aspect="auto", origin="lower", cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest"
    )
    ax.figure.colorbar(im, ax=ax, label="top-1 probability")

    shown = list(range(start, n_pos))
    ax.set_xticks(range(len(shown)))
    ax.set_xticklabels([show_token(lens.labels[p], 14) for p in shown], rotation=90, fontsize=8)
    for tick, p in zip(ax.get_xticklabels(), shown):
        if p >= lens.prompt_len:
            tick.set_color(_GENERATED_COLOR)
            tick.set_fontstyle("italic")
    ax.set_yticks(range(n_layer))
    ax.set_yticklabels([str(layer) for layer in lens.layers])
    if start < lens.prompt_len < n_pos:
        ax.axvline(lens.prompt_len - start - 0.5, color=_GENERATED_COLOR, linestyle="--", linewidth=1)

    if annotate:
        fit = _CellFit(ax, n_cols=n_shown, n_rows=n_layer)
        for j in range(probs.shape[0]):
            for c in range(probs.shape[1]):
                text, size = fit(show_token(_decode(lens.tokenizer, int(ids[j, c]))))
                ax.text(c, j, text, ha="center", va="center", fontsize=size, linespacing=1.0,
                        color="white" if probs[j, c] > 0.5 else "black")

    ax.set_xlabel("position (input token)" + (f", last {len(shown)} of {n_pos}" if start else ""))
    ax.set_ylabel("layer")
    ax.set_title("logit lens: top-1 token and probability")
    return ax


def lens_figsize(n_positions: int, n_layers: int) -> tuple[float, float]:
    """The figure size (inches) :func:`plot_lens` takes for a lens: ~0.6 in per position, 0.42 per layer."""
    return min(26.0, max(6.0, 2.2 + 0.6 * n_positions)), max(3.0, 1.6 + 0.42 * n_layers)


class _CellFit:
    """Choose, per label, the largest font size (then two lines, then a cut) that fits a heatmap cell.

    Widths are measured with matplotlib's own text layout at the Axes' current size, once per label.
    """

    def __init__(self, ax, n_cols: int, n_rows: int) -> None:
        from matplotlib.text import Text

        box = ax.get_window_extent()
        dpi = ax.figure.dpi
        # Cell size in points, less a margin so neighbouring labels never touch.
        self.w = box.width / max(n_cols, 1) * 72.0 / dpi * 0.9
        self.h = box.height / max(n_rows, 1) * 72.0 / dpi * 0.92
        self._probe = Text(0, 0, "", figure=ax.figure, fontsize=10.0, linespacing=1.0)
        self._cache: dict[str, tuple[str, float]] = {}

    def _size_at_10(self, text: str) -> tuple[float, float]:
        self._probe.set_text(text)
        bb = self._probe.get_window_extent()
        scale = 72.0 / self._probe.figure.dpi
        return bb.width * scale, bb.height * scale

    def _fits(self, text: str, size: float) -> bool:
        w, h = self._size_at_10(text)
        return w * size / 10.0 <= self.w and h * size / 10.0 <= self.h

    def __call__(self, label: str) -> tuple[str, float]:
        if label in self._cache:
            return self._cache[label]
        out = None
        for size in CELL_FONT_SIZES:
            if self._fits(label, size):
                out = (label, size)
                break
        if out is None and len(label) > 3:  # two lines: "<|endof" / "text|>"
            half = (len(label) + 1) // 2
            two = label[:half] + "\n" + label[half:]
            for size in CELL_FONT_SIZES[1:]:
                if self._fits(two, size):
                    out = (two, size)
                    break
        if out is None:  # cut, keeping as much as fits on one line at the smallest size
            size, cut = CELL_FONT_SIZES[-1], label
            while len(cut) > 1 and not self._fits(cut + "…", size):
                cut = cut[:-1]
            out = (cut + "…", size)
        self._cache[label] = out
        return out


def plot_patch(res, ax=None, vmin: float | None = None, vmax: float | None = None):
    """Draw a patching sweep: normalized effect per layer (y) × position (x), centred at 0.

    The colour scale is fixed and symmetric, -1..1 (1 = the clean answer fully restored), widened
    only when an effect goes past it, so that two plots read alike: an effect of 0.33 is a third as
    dark as a full restoration, whatever else is in the plot.

    Args:
        res: a :class:`nnvllm.patching.PatchResult`.
        ax: Axes to draw on; a new figure when None.
        vmin, vmax: the colour range, to override the fixed one.

    Returns:
        The Axes.

    Example::

        plot_patch(res)
    """
    import matplotlib.pyplot as plt

    ax = _axes(ax, plt)
    effect = res.effect.detach().double().cpu().numpy()
    finite = np.abs(effect[np.isfinite(effect)])
    lim = max(float(finite.max()) if finite.size else 1.0, 1.0)
    vmin = -lim if vmin is None else vmin
    vmax = lim if vmax is None else vmax
    im = ax.imshow(
        effect, aspect="auto", origin="lower", cmap="RdBu_r", vmin=vmin, vmax=vmax, interpolation="nearest"
    )
    ax.figure.colorbar(im, ax=ax, label="normalized effect (1 = clean restored)")
    ax.set_xticks(range(len(res.positions)))
    ax.set_xticklabels(
        [f"{show_token(lab, 14)} ({p})" for lab, p in zip(res.labels, res.positions)], rotation=90, fontsize=8
    )
    ax.set_yticks(range(len(res.layers)))
    ax.set_yticklabels([str(layer) for layer in res.layers])
    ax.set_xlabel("position (clean token)")
    ax.set_ylabel("layer")
    step = f", step {res.step}" if res.step else ""
    ax.set_title(f"patching {res.site}: {res.answer!r} vs {res.wrong!r}{step}".replace("$", r"\$"))
    return ax


def log_metric(ax, x, y, style: str = "o-", *, label: str | None = None, color=None) -> None:
    """Plot values ``>= 0`` on a log y axis, exact zeros included.

    Negative values (``1 - cosine`` of -2.2e-16 is rounding) count as 0. A log axis has no 0, so
    exact zeros are not faked at a tiny value: they are hollow markers on the Axes' floor, each run
    of them labelled "exact", and the line breaks there. The y range follows the nonzero values.

    Example::

        log_metric(ax, layers, 1.0 - cosines, label="1 - cosine")
    """
    x = np.asarray(x)
    y = np.clip(np.asarray(y, dtype=float), 0.0, None)  # NaN stays NaN: nothing compared there
    zero = y == 0.0
    (line,) = ax.plot(x, np.where(zero, np.nan, y), style, label=label, color=color)
    ax.set_yscale("log")
    if zero.any():
        floor = ax.get_xaxis_transform()  # x in data, y in axes coordinates: 0 is the bottom edge
        ax.plot(x[zero], np.full(int(zero.sum()), 0.04), ls="none", marker=line.get_marker() or "o",
                mfc="none", mec=line.get_color(), transform=floor, clip_on=False)
        marked = {round(t.get_position()[0], 9) for t in ax.texts if t.get_gid() == "nnvllm-exact"}
        for run in _runs(np.flatnonzero(zero)):
            mid = float(np.mean(x[run].astype(float)))
            if round(mid, 9) not in marked:  # one label per run, shared by the series that are 0 there
                ax.text(mid, 0.09, "exact", transform=floor, ha="center", va="bottom", fontsize=7,
                        color="0.35", gid="nnvllm-exact")
    _fit_log_range(ax)


def _fit_log_range(ax) -> None:
    """Set the y range from every data line's positive values, with room below for the floor's
    exact-zero markers (4% up) and their label; an Axes of zeros only gets 1e-12..1. Axes that share
    the y axis (``sharey=True``) share the range, so their data count too."""
    ys = [np.asarray(ln.get_ydata(), dtype=float) for a in ax.get_shared_y_axes().get_siblings(ax)
          for ln in a.lines if ln.get_transform() == a.transData]
    pos = np.concatenate([v[np.isfinite(v) & (v > 0)] for v in ys]) if ys else np.empty(0)
    if not pos.size:
        ax.set_ylim(1e-12, 1.0)
        return
    lo, hi = np.log10(pos.min()), np.log10(pos.max())
    span = max(hi - lo, 1.0)
    ax.set_ylim(10 ** (lo - 0.3 * span), 10 ** (hi + 0.1 * span))


def _runs(idx: np.ndarray) -> list[np.ndarray]:
    """Split sorted indices into runs of consecutive ones."""
    return [r for r in np.split(idx, np.flatnonzero(np.diff(idx) > 1) + 1) if r.size]


def plot_compare(d, ax=None):
    """Draw per-layer discrepancy between two runs: max|Δ|, relative error and 1 - cosine.

    The y axis is logarithmic. Exact zeros (identical numbers, as before an edit's layer) are
    hollow markers on the floor labelled "exact", never a made-up tiny value; ``1 - cosine`` is 0
    where the numbers are identical (the cosine's rounding aside) and below 0 counts as 0. On an Axes that shares its y axis with one to its left, the y label is
    left to that one.

    Args:
        d: a :class:`nnvllm.compare.Discrepancy`.
        ax: Axes to draw on; a new figure when None.

    Returns:
        The Axes.

    Example::

        plot_compare(compare(hf_run, vllm_run, names=("hf", "vllm")))
    """
    import matplotlib.pyplot as plt

    ax = _axes(ax, plt)
    a, b = d.names
    title = f"{_name(a)} vs {_name(b)} (residual stream)"
    if len(d.resid) == 0 or not (d.resid["site"] == "resid").any():
        ax.text(0.5, 0.5, "no residual stream compared", ha="center", va="center", transform=ax.transAxes)
    else:
        max_abs = d.per_layer("max_abs")
        series = {
            "max |Δ|": max_abs,
            "‖Δ‖ / ‖a‖": d.per_layer("rel_err"),
            # Where the numbers are identical, 1 - cosine is 0, whatever the rounding of the cosine says.
            "1 - cosine": (1.0 - d.per_layer("cosine")).where(max_abs != 0, 0.0),
        }
        for label, s in series.items():
            log_metric(ax, s.index.to_numpy(), s.to_numpy(dtype=float), label=label)
        ax.set_xticks(series["max |Δ|"].index.to_numpy())
        ax.set_xlabel("layer")
        if not _shares_y_with_a_left_neighbour(ax):
            ax.set_ylabel("worst over requests, positions")
        ax.legend(fontsize=8)
    forked = [(i, t) for i, t in enumerate(d.fork) if t is not None]
    if forked:
        i, t = min(forked, key=lambda it: it[1])
        more = f", {len(forked)}/{len(d.fork)} requests fork" if len(d.fork) > 1 else ""
        title += f"\ntokens fork at step {t} (request {i}){more}; only earlier positions compared"
    ax.set_title(title, fontsize=10)
    return ax


def _shares_y_with_a_left_neighbour(ax) -> bool:
    """Whether ``ax`` shares its y axis with another Axes left of it (``sharey=True``: one label is enough)."""
    siblings = [o for o in ax.get_shared_y_axes().get_siblings(ax) if o is not ax]
    x0 = ax.get_position().x0
    return any(o.get_position().x0 < x0 - 1e-9 for o in siblings)


def plot_samples(run, i: int, ax=None, *, tokenizer: Any = None):
    """Draw what the sampler drew at each step: the sampled token's probability and the top-k.

    Bars are the sampled tokens' probabilities; grey dots are the top-k alternatives (the
    distribution actually sampled from). A bar well below the top dot means a less likely token
    was drawn; that top token is named above its dot. The legend sits right of the Axes, off the bars.

    Args:
        run: a :class:`nnvllm.results.Run` (only ``run.samples[i]`` is read).
        i: the request index.
        ax: Axes to draw on; a new figure when None.
        tokenizer: HF tokenizer to label the steps with token text; by default the one the run
            was made with (``run.tokenizer``, set by :func:`nnvllm.generate` and
            :func:`nnvllm.reference`; a run loaded from a file has none: token ids).

    Returns:
        The Axes.

    Example::

        plot_samples(run, 0, tokenizer=tok)
    """
    import matplotlib.pyplot as plt

    n = len(run.samples)
    if isinstance(i, bool) or not isinstance(i, int) or not -n <= i < n:
        raise ValueError(f"request i={i!r} out of range for a run of {n} requests (0-{n - 1}).") from None
    s = run.samples[i]
    if tokenizer is None:
        tokenizer = getattr(run, "tokenizer", None)  # set by nv.generate / nv.reference
    ax = _axes(ax, plt)
    steps = np.arange(len(s))
    probs = s.probs.detach().float().cpu().numpy()
    top = s.top_probs.detach().float().cpu().numpy().reshape(len(s), -1)
    top_ids = s.top_ids.cpu().numpy().reshape(len(s), -1)
    ids = s.ids.cpu().numpy()
    ax.bar(steps, probs, color="tab:blue", alpha=0.7, label="sampled token")
    if top.size:
        xs = np.repeat(steps, top.shape[1])
        ax.scatter(xs, top.reshape(-1), color="grey", s=12, zorder=3, label=f"top-{top.shape[1]}")
        for t in steps:
            if top_ids[t, 0] != ids[t]:  # a non-top token was drawn: name the one passed over
                ax.annotate(
                    show_token(_decode(tokenizer, int(top_ids[t, 0])), width=8),
                    (t, top[t, 0]),
                    textcoords="offset points",
                    xytext=(0, 4),
                    ha="center",
                    fontsize=7,
                    color="0.35",
                )
    ax.set_xticks(steps)
    ax.set_xticklabels([show_token(_decode(tokenizer, int(t)), 14) for t in ids], rotation=90, fontsize=8)
    ax.set_ylim(0, 1.15)  # room above p = 1 for the name of a token passed over
    ax.set_yticks([0.0, 0.25, 0.5, 0.75, 1.0])
    ax.set_xlabel("generated token (step)")
    ax.set_ylabel("probability")
    ax.set_title(f"request {i % n}: sampled tokens and top alternatives")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return ax


def _axes(ax, plt):
    if ax is None:
        _, ax = plt.subplots()
    return ax


def _decode(tokenizer: Any, token_id: int) -> str:
    return str(token_id) if tokenizer is None else tokenizer.decode([int(token_id)])
