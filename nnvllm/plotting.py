"""Matplotlib views of nnvllm results: ``plot_*(result, ax=None) -> Axes``.

Each function draws on ``ax`` (or on a new ``plt.subplots()`` figure when ax is None) and returns
the Axes. None calls ``plt.show()`` or writes files: the notebook or the caller decides.
pyplot is imported inside the functions, so importing this module selects no backend.

Tokens are labelled so that whitespace shows: a space is ``␣`` (" is" reads ``␣is``), a newline
``↵``, a tab ``⇥``; other control characters are escaped (``\\x00``).

A conversation's positions carry labels (:attr:`nnvllm.Run.roles`): the lens and patching heatmaps
hatch the chat template's columns, grey its tick labels and name each system, user and assistant
span above the Axes (:func:`mark_roles`); ``positions="content"`` (or a role) draws only those
positions, a dotted line where hidden ones were. A plain prompt's plot has no such marks.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["ROLE_COLORS", "lens_figsize", "log_metric", "mark_roles", "plot_compare", "plot_lens", "plot_patch",
           "plot_samples", "role_spans", "show_token", "shows_roles", "title_pad"]

_GENERATED_COLOR = "tab:red"
_TEMPLATE = "template"  # nnvllm.chat.TEMPLATE; the string, so that drawing imports nothing to read it
#: The colour a role's span is named in; other roles (``"tool"``) are grey, the template hatched.
ROLE_COLORS = {"system": "tab:purple", "user": "tab:green", "assistant": _GENERATED_COLOR}
_TITLE_PAD = 22.0  # points above the Axes: room for the role names under the title
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


def role_spans(roles, where=None) -> list[tuple[int, int, str]]:
    """Runs of one label: ``(first, last, role)`` column indices, a run broken where ``where`` (each
    column's position in the request) skips positions.

    Example::

        role_spans(["template", "user", "user"])        # [(0, 0, 'template'), (1, 2, 'user')]
    """
    out: list[tuple[int, int, str]] = []
    for c, r in enumerate(roles):
        if out and out[-1][2] == r and (where is None or where[c] == where[c - 1] + 1):
            out[-1] = (out[-1][0], c, r)
        else:
            out.append((c, c, r))
    return out


def shows_roles(roles) -> bool:
    """Whether labels are worth marking: a conversation's (template or system positions), not a plain
    prompt's (all ``"user"``, its generated tokens ``"assistant"``), whose plot stays as it always was."""
    return roles is not None and any(r not in ("user", "assistant") for r in roles)


def mark_roles(ax, roles, xs=None, where=None) -> bool:
    """Mark a conversation's labels on a plot whose x axis is positions: the chat template's columns
    hatched (patches with gid ``"nnvllm-template"``) and their tick labels grey, each other role's span
    named above the Axes in its :data:`ROLE_COLORS` colour (texts with gid ``"nnvllm-role"``).

    Args:
        ax: the Axes; its x ticks, if set, are the columns in order.
        roles: one label per column (:attr:`nnvllm.Run.roles`).
        xs: each column's x coordinate (default ``0..n-1``: a heatmap's columns).
        where: each column's position in the request; a span breaks where positions were skipped.

    Returns:
        Whether anything was drawn: nothing for a plain prompt's labels (all user or assistant).

    Example::

        mark_roles(ax, lens.roles)
    """
    if not shows_roles(roles):
        return False
    from matplotlib.patches import Rectangle
    from matplotlib.transforms import blended_transform_factory

    xs = list(range(len(roles))) if xs is None else [float(x) for x in xs]
    top = blended_transform_factory(ax.transData, ax.transAxes)  # x in data, y in the Axes' 0..1
    for a, b, role in role_spans(roles, where):
        lo, hi = xs[a] - 0.5, xs[b] + 0.5
        if role == _TEMPLATE:
            ax.add_patch(Rectangle((lo, 0.0), hi - lo, 1.0, transform=top, facecolor="white", alpha=0.6,
                                   hatch="///", edgecolor="0.45", linewidth=0.0, zorder=2, gid="nnvllm-template"))
            continue
        color = ROLE_COLORS.get(role, "0.4")
        ax.add_patch(Rectangle((lo + 0.08, 1.012), hi - lo - 0.16, 0.018, transform=top, facecolor=color,
                               linewidth=0.0, clip_on=False, gid="nnvllm-role-span"))
        ax.text((xs[a] + xs[b]) / 2, 1.04, role, transform=top, ha="center", va="bottom", fontsize=8,
                color=color, clip_on=False, gid="nnvllm-role")
    ticks = ax.get_xticklabels()
    if len(ticks) == len(roles):
        for tick, role in zip(ticks, roles):
            if role == _TEMPLATE:
                tick.set_color("0.5")
    return True


def title_pad(ax) -> float | None:
    """The title's padding (points) for an Axes with role names above it, else None (matplotlib's own)."""
    return _TITLE_PAD if any(t.get_gid() == "nnvllm-role" for t in ax.texts) else None


def _mark_gaps(ax, where) -> None:
    """A dotted line between two columns whose positions are not neighbours (hidden positions there)."""
    for c in range(1, len(where)):
        if where[c] != where[c - 1] + 1:
            ax.axvline(c - 0.5, color="0.5", linestyle=":", linewidth=1.0, gid="nnvllm-gap")


def _selected(roles, positions, kept: list[int], what: str) -> list[int]:
    """Column indices of ``positions``: ``"all"``, ``"content"``, a role or a list of roles (read from
    ``roles``), or a list of the positions in ``kept`` (each column's position)."""
    from .chat import select_positions

    if isinstance(positions, str) and positions == "all":
        return list(range(len(kept)))
    by_role = isinstance(positions, str) or (isinstance(positions, (list, tuple)) and positions
                                              and all(isinstance(p, str) for p in positions))
    if by_role:
        if roles is None:
            raise ValueError(f"positions={positions!r} selects by role, and this {what} has no roles; pass "
                             f"positions='all' or a list of its positions {kept}")
        return select_positions(roles, positions) or list(range(len(kept)))
    if isinstance(positions, (list, tuple, range)) and positions and all(
            isinstance(p, int) and not isinstance(p, bool) and p in kept for p in positions):
        return sorted({kept.index(p) for p in positions})
    raise ValueError(f"positions={positions!r}: expected 'all', 'content' (without the chat template), a role "
                     f"such as 'user', a list of roles, or a list of this {what}'s positions {kept}")


def plot_lens(lens, ax=None, *, annotate: bool = True, max_positions: int = 40, positions="all"):
    """Draw a logit lens: top-1 probability per layer (y) × position (x), cells labelled by token.

    Generated positions (``p >= prompt_len``) sit right of a dashed line and have red tick
    labels. Position ``p``'s cell is the lens's guess at token ``p + 1``. Each cell's label is
    fitted inside its cell: 8 pt where it fits, smaller down to 6.5 pt, then on two lines, and cut
    with ``…`` only when even that does not fit (give the figure more width per position).

    A conversation's lens (``lens.roles``) hatches the chat template's columns and names the system,
    user and assistant spans above the heatmap (:func:`mark_roles`).

    Args:
        lens: a :class:`nnvllm.lens.Lens`.
        ax: Axes to draw on; a new figure when None (sized to the data: ~0.6 in per position).
        annotate: write the top-1 token text in each cell.
        max_positions: show at most this many positions (the last ones, where the prediction
            and the generated tokens are).
        positions: ``"all"``, or the positions to draw as :meth:`nnvllm.Lens.select` takes them:
            ``"content"`` (without the chat template's), a role such as ``"user"``, a list of roles,
            or a list of position indices. Hidden positions leave a dotted line.

    Returns:
        The Axes.

    Example::

        plot_lens(lens, max_positions=20)
        plot_lens(lens, positions="content")   # a conversation without its template tokens
    """
    import matplotlib.pyplot as plt

    if isinstance(max_positions, bool) or not isinstance(max_positions, int) or max_positions < 1:
        raise ValueError(f"max_positions={max_positions!r} must be a positive int, e.g. 40.") from None
    if not (isinstance(positions, str) and positions == "all"):
        lens = lens.select(positions)
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
    where = list(lens.positions)[start:] if lens.positions is not None else None
    if where is not None:
        _mark_gaps(ax, where)
    roles = lens.roles[start:] if lens.roles is not None else None
    marked = mark_roles(ax, roles, where=where)

    if annotate:
        fit = _CellFit(ax, n_cols=n_shown, n_rows=n_layer)
        # A hatched (template) column is lightened, so its labels are dark on any probability.
        faded = [marked and r == _TEMPLATE for r in roles] if roles is not None else [False] * n_shown
        for j in range(probs.shape[0]):
            for c in range(probs.shape[1]):
                text, size = fit(show_token(_decode(lens.tokenizer, int(ids[j, c]))))
                ax.text(c, j, text, ha="center", va="center", fontsize=size, linespacing=1.0,
                        color="white" if probs[j, c] > 0.5 and not faded[c] else "black")

    ax.set_xlabel("position (input token)" + (f", last {len(shown)} of {n_pos}" if start else "")
                  + ("; hatched: chat template" if marked and _TEMPLATE in roles else ""))
    ax.set_ylabel("layer")
    ax.set_title("logit lens: top-1 token and probability", pad=title_pad(ax))
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


def plot_patch(res, ax=None, vmin: float | None = None, vmax: float | None = None, *, positions="all"):
    """Draw a patching sweep: normalized effect per layer (y) × position (x), centred at 0.

    The colour scale is fixed and symmetric, -1..1 (1 = the clean answer fully restored), widened
    only when an effect goes past it, so that two plots read alike: an effect of 0.33 is a third as
    dark as a full restoration, whatever else is in the plot. A sweep over a conversation
    (``res.roles``) hatches the chat template's columns and names the role spans (:func:`mark_roles`).

    Args:
        res: a :class:`nnvllm.patching.PatchResult`.
        ax: Axes to draw on; a new figure when None.
        vmin, vmax: the colour range, to override the fixed one.
        positions: ``"all"`` the swept positions, or some of them: ``"content"`` (without the chat
            template's), a role such as ``"user"``, a list of roles, or a list of swept positions.
            The colour range is the whole sweep's either way.

    Returns:
        The Axes.

    Example::

        plot_patch(res, positions="user")
    """
    import matplotlib.pyplot as plt

    cols = _selected(res.roles, positions, list(res.positions), "patching result")
    effect = res.effect.detach().double().cpu().numpy()
    finite = np.abs(effect[np.isfinite(effect)])
    lim = max(float(finite.max()) if finite.size else 1.0, 1.0)
    vmin = -lim if vmin is None else vmin
    vmax = lim if vmax is None else vmax
    effect = effect[:, cols]
    where = [res.positions[c] for c in cols]
    labels = [res.labels[c] for c in cols]
    ax = _axes(ax, plt)
    im = ax.imshow(
        effect, aspect="auto", origin="lower", cmap="RdBu_r", vmin=vmin, vmax=vmax, interpolation="nearest"
    )
    ax.figure.colorbar(im, ax=ax, label="normalized effect (1 = clean restored)")
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels([f"{show_token(lab, 14)} ({p})" for lab, p in zip(labels, where)], rotation=90, fontsize=8)
    ax.set_yticks(range(len(res.layers)))
    ax.set_yticklabels([str(layer) for layer in res.layers])
    _mark_gaps(ax, where)
    roles = None if res.roles is None else [res.roles[c] for c in cols]
    marked = mark_roles(ax, roles, where=where)
    ax.set_xlabel("position (clean token)" + ("; hatched: chat template" if marked and _TEMPLATE in roles else ""))
    ax.set_ylabel("layer")
    step = f", step {res.step}" if res.step else ""
    title = f"patching {res.site}: {res.answer!r} vs {res.wrong!r}{step}".replace("$", r"\$")
    ax.set_title(title, pad=title_pad(ax))
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
