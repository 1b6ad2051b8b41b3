"""Matplotlib views of attention heads: ``plot_*(..., ax=None) -> Axes``, as in :mod:`nnvllm.plotting`.

:func:`plot_head_pattern` draws where heads look over the text from one step's query (a heat strip:
heads × tokens), :func:`plot_head_attribution` the block × head map of each head's share of a logit
difference. What they draw comes from :mod:`nnvllm.views_heads`; tokens are labelled with
:func:`nnvllm.plotting.show_token` (a space shows as ``␣``). None calls ``plt.show()`` or writes files.
"""

from __future__ import annotations

import torch

from .plotting import _GENERATED_COLOR, show_token
from .views_features import token_labels
from .views_heads import ATTRIBUTION_CMAP, _head, _vmax, attribution_map, head_pattern, query_position

__all__ = ["head_pattern_figsize", "plot_head_attribution", "plot_head_pattern"]

_CMAP = "Oranges"
_MARK = "#1f77b4"  # the outline of a chosen head or token: blue on the orange scale
_MAP_MARK = "#ff7f0e"  # on the blue-red attribution map, the chosen head is outlined in orange


def head_pattern_figsize(n_positions: int, n_rows: int) -> tuple[float, float]:
    """The figure size (inches) :func:`plot_head_pattern` takes: ~0.45 in per token, 0.3 per head."""
    return min(26.0, max(5.0, 2.4 + 0.45 * n_positions)), min(40.0, max(1.9, 1.6 + 0.3 * n_rows))


def _list(value, every: list[int], name: str) -> list[int]:
    if value is None:
        return list(every)
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    try:
        out = list(value)
    except TypeError:
        raise TypeError(f"{name}={value!r}: expected an int, a list of ints or None") from None
    if not out:
        raise ValueError(f"{name}=[]: expected an int, a list of ints, or None for every one")
    return out


def plot_head_pattern(run, layer=None, head=None, step: int = 0, request: int = 0, *, tokenizer=None, ax=None,
                      annotate: bool = True, mark: tuple[int, int] | None = None):
    """Draw a heat strip of where heads look from the query of ``step``: weight per head (y) × token (x).

    The query is the position whose logits drew generated token ``step`` (outlined, dotted); the
    tokens after it, which it cannot see, are hatched. Generated tokens (fed back to the model) sit
    right of a dashed line and have red tick labels. One colour scale, 0 to 1, for every row; a thin
    line between blocks.

    Args:
        run: a Run made with ``sites=["q", "k"]``.
        layer: a captured block index, a list of them, or None for every captured block.
        head: a head, a list of heads, or None for every head; one row per (block, head), top to bottom.
        step: the generated step whose query is shown.
        request: the request whose text is drawn.
        tokenizer: to label the tokens (default: the run's own).
        ax: Axes to draw on; a new figure when None (sized to the text and the rows).
        annotate: write each weight of at least 0.01 in its cell.
        mark: a ``(layer, head)`` whose row to outline.

    Returns:
        The Axes.

    Example::

        plot_head_pattern(run, 1, step=0)            # both heads of block 1 when " Paris" is written
        plot_head_pattern(run)                       # every head of every captured block
    """
    import matplotlib.pyplot as plt

    n_heads = int(run.meta["attention"]["n_heads"]) if "attention" in (run.meta or {}) else 1
    layers = _list(layer, run.layers, "layer")
    heads = _list(head, list(range(n_heads)), "head")
    rows = [_head(run, i, h) for i in layers for h in heads]
    weights = torch.stack([head_pattern(run, i, h, step, request) for i, h in rows]).numpy()
    q = query_position(run, step, request)
    request %= len(run.prompts)
    step = q - (len(run.prompt_ids[request]) - 1)
    labels = token_labels(run, request, tokenizer)
    prompt_len = len(run.prompt_ids[request])
    n_rows, n_pos = weights.shape
    if ax is None:
        _, ax = plt.subplots(figsize=head_pattern_figsize(n_pos, n_rows))
    im = ax.imshow(weights, aspect="auto", cmap=_CMAP, vmin=0.0, vmax=1.0, interpolation="nearest")
    ax.figure.colorbar(im, ax=ax, label="attention", fraction=0.05, pad=0.02)
    if q + 1 < n_pos:  # what the query cannot see
        from matplotlib.patches import Rectangle

        ax.add_patch(Rectangle((q + 0.5, -0.5), n_pos - q - 1, n_rows, facecolor="#eeeeee", edgecolor="#bbbbbb",
                               hatch="//", linewidth=0))
    ax.set_xticks(range(n_pos))
    ax.set_xticklabels([show_token(t, 14) for t in labels], rotation=90, fontsize=8)
    for tick, p in zip(ax.get_xticklabels(), range(n_pos)):
        if p >= prompt_len:
            tick.set_color(_GENERATED_COLOR)
            tick.set_fontstyle("italic")
        if p == q:
            tick.set_fontweight("bold")
    if prompt_len < n_pos:
        ax.axvline(prompt_len - 0.5, color=_GENERATED_COLOR, linestyle="--", linewidth=1)
    ax.set_yticks(range(n_rows))
    ax.set_yticklabels([f"head {i}.{h}" for i, h in rows], fontsize=8)
    for r in range(1, n_rows):
        if rows[r][0] != rows[r - 1][0]:
            ax.axhline(r - 0.5, color="#888888", linewidth=0.6)
    if annotate:
        for j in range(n_rows):
            for p in range(q + 1):
                if weights[j, p] >= 0.01:
                    ax.text(p, j, f"{weights[j, p]:.2f}", ha="center", va="center", fontsize=6.5,
                            color="white" if weights[j, p] > 0.6 else "black")
    ax.add_patch(_rect(q - 0.5, -0.5, 1.0, n_rows, ls=":"))
    if mark is not None and tuple(mark) in rows:
        ax.add_patch(_rect(-0.5, rows.index(tuple(mark)) - 0.5, n_pos, 1.0))
    ax.set_xlabel("token (position) attended to")
    who = (f"head {rows[0][0]}.{rows[0][1]}" if n_rows == 1 else f"block {layers[0]}'s heads" if len(layers) == 1
           else "the heads")
    tok = tokenizer if tokenizer is not None else getattr(run, "tokenizer", None)
    wrote = run.tokens[request][step]
    wrote = tok.decode([int(wrote)]) if tok is not None else str(int(wrote))
    ax.set_title(f"where {who} look{'s' if n_rows == 1 else ''} from position {q} ({show_token(labels[q], 14)}) "
                 f"to write {show_token(wrote, 14)} (step {step})", fontsize=10)
    return ax


def plot_head_attribution(att, step: int = 0, request: int = 0, *, ax=None, mark: tuple[int, int] | None = None,
                          annotate: bool = True):
    """Draw each head's direct attribution at ``step`` as a block (y) × head (x) map.

    Blue raises ``logit[target] - logit[versus]``, red lowers it; the scale is symmetric about 0 and
    reaches the largest ``|attribution|`` on the map. ``mark`` outlines one ``(layer, head)``.

    Args:
        att: an :class:`~nnvllm.heads.Attribution` from ``nv.attribute``.
        step: the generated step.
        request: the request.
        ax: Axes to draw on; a new figure when None.
        mark: a ``(layer, head)`` to outline.
        annotate: write each value in its cell.

    Returns:
        The Axes.

    Example::

        plot_head_attribution(nv.attribute(run, " Paris", " Rome"), step=0, mark=(1, 0))
    """
    import matplotlib.pyplot as plt

    amap = attribution_map(att, step, request).numpy()
    n_layers, n_heads = amap.shape
    vmax = _vmax(torch.from_numpy(amap))
    if ax is None:
        _, ax = plt.subplots(figsize=(min(20.0, max(3.6, 1.8 + 0.55 * n_heads)), min(14.0, max(2.6, 1.0 + 0.35 * n_layers))))
    im = ax.imshow(amap, aspect="auto", cmap=ATTRIBUTION_CMAP, vmin=-vmax, vmax=vmax, interpolation="nearest")
    ax.figure.colorbar(im, ax=ax, label="logit difference added", fraction=0.08, pad=0.03)
    ax.set_xticks(range(n_heads))
    ax.set_yticks(range(n_layers))
    ax.set_xlabel("head")
    ax.set_ylabel("block")
    if annotate and n_layers * n_heads <= 400:
        for layer in range(n_layers):
            for h in range(n_heads):
                v = amap[layer, h]
                ax.text(h, layer, f"{v:+.2f}", ha="center", va="center", fontsize=7,
                        color="white" if abs(v) > 0.6 * vmax else "black")
    if mark is not None:
        layer, h = mark
        ax.add_patch(_rect(h - 0.5, layer - 0.5, 1.0, 1.0, color=_MAP_MARK, lw=2.5))
    target, versus = att.labels
    what = f"logit({show_token(target or '', 14)})" + (f" − logit({show_token(versus, 14)})" if att.versus is not None else "")
    total = float(att.logit_diff[request][step])
    ax.set_title(f"each head's share of {what} = {total:+.2f}, step {step}", fontsize=10)
    return ax


def _rect(x, y, w, h, lw=2.0, ls="-", color=_MARK):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), w, h, fill=False, edgecolor=color, linewidth=lw, linestyle=ls, clip_on=False)
