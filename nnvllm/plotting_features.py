"""Matplotlib views of SAE features in a run: ``plot_*(run, ..., ax=None) -> Axes``, as in :mod:`nnvllm.plotting`.

:func:`plot_feature_strip` draws where features fire over the text (features × tokens),
:func:`plot_token_features` the features that fire most on one token. What they draw comes from
:mod:`nnvllm.views_features`; tokens are labelled with :func:`nnvllm.plotting.show_token` (a space
shows as ``␣``). None calls ``plt.show()`` or writes files.
"""

from __future__ import annotations

import numpy as np

from .plotting import _GENERATED_COLOR, _axes, show_token
from .views_features import _check, feature_strip, request_features, token_labels

__all__ = ["feature_strip_figsize", "plot_feature_strip", "plot_token_features"]

_CMAP = "Oranges"
_MARK = "#1f77b4"  # the outline of a chosen token or feature: blue on the orange scale


def feature_strip_figsize(n_positions: int, n_features: int) -> tuple[float, float]:
    """The figure size (inches) :func:`plot_feature_strip` takes: ~0.45 in per token, 0.4 per feature."""
    return min(26.0, max(5.0, 2.4 + 0.45 * n_positions)), max(2.0, 1.7 + 0.4 * n_features)


def plot_feature_strip(run, features, request: int = 0, sae: int = 0, *, tokenizer=None, ax=None,
                       annotate: bool = True, mark_pos: int | None = None, mark_feature: int | None = None):
    """Draw where features fire over one request's text: activation per feature (y) × token (x).

    Darker is stronger (one colour scale for every row, from 0); cells hold the activation where it
    is above 0 and ``annotate``. Generated tokens (fed back to the model) sit right of a dashed line
    and have red tick labels. With sparse features a cell outside the position's top ``k`` is 0.

    Args:
        run: a Run made with ``generate(..., saes=[...])``.
        features: a feature id or a list of them (one row each, top to bottom).
        request: the request whose text is drawn.
        sae: which SAE of the run.
        tokenizer: to label the tokens (default: the run's own).
        ax: Axes to draw on; a new figure when None (sized to the text).
        annotate: write each nonzero activation in its cell.
        mark_pos, mark_feature: outline that token's column / that feature's row.

    Returns:
        The Axes.

    Example::

        plot_feature_strip(run, [60, 73])
    """
    import matplotlib.pyplot as plt

    features = [features] if isinstance(features, int) and not isinstance(features, bool) else list(features)
    acts = feature_strip(run, features, request, sae).numpy()
    labels = token_labels(run, request, tokenizer)
    prompt_len = len(run.prompt_ids[request])
    n_feat, n_pos = acts.shape
    if ax is None:
        _, ax = plt.subplots(figsize=feature_strip_figsize(n_pos, n_feat))
    top = float(acts.max()) if acts.size and acts.max() > 0 else 1.0
    im = ax.imshow(acts, aspect="auto", cmap=_CMAP, vmin=0.0, vmax=top, interpolation="nearest")
    ax.figure.colorbar(im, ax=ax, label="activation", fraction=0.05, pad=0.02)
    ax.set_xticks(range(n_pos))
    ax.set_xticklabels([show_token(t, 14) for t in labels], rotation=90, fontsize=8)
    for tick, p in zip(ax.get_xticklabels(), range(n_pos)):
        if p >= prompt_len:
            tick.set_color(_GENERATED_COLOR)
            tick.set_fontstyle("italic")
    if prompt_len < n_pos:
        ax.axvline(prompt_len - 0.5, color=_GENERATED_COLOR, linestyle="--", linewidth=1)
    ax.set_yticks(range(n_feat))
    ax.set_yticklabels([f"feature {f}" for f in features], fontsize=8)
    if annotate:
        for j in range(n_feat):
            for p in range(n_pos):
                if acts[j, p] > 0:
                    ax.text(p, j, f"{acts[j, p]:.2f}", ha="center", va="center", fontsize=6.5,
                            color="white" if acts[j, p] > 0.6 * top else "black")
    if mark_pos is not None:
        ax.add_patch(_rect(mark_pos % n_pos - 0.5, -0.5, 1.0, n_feat, ls=":"))
    if mark_feature is not None and mark_feature in features:
        ax.add_patch(_rect(-0.5, features.index(mark_feature) - 0.5, n_pos, 1.0))
    ax.set_xlabel("token (position)")
    what = f"feature {features[0]}" if n_feat == 1 else f"{n_feat} features"
    ax.set_title(f"where {what} fire{'s' if n_feat == 1 else ''} over request {request}", fontsize=10)
    return ax


def plot_token_features(run, pos: int, request: int = 0, sae: int = 0, *, k: int = 10, tokenizer=None, ax=None):
    """Draw the features that fire most on one token: a bar per feature, the strongest on top.

    Args:
        run: a Run made with ``generate(..., saes=[...])``.
        pos: the token's position in the request (prompt tokens, then generated ones fed back).
        request, sae: which request and SAE.
        k: at most this many features.
        tokenizer: to name the token (default: the run's own).
        ax: Axes to draw on; a new figure when None.

    Returns:
        The Axes.

    Example::

        plot_token_features(run, 3, k=5)
    """
    import matplotlib.pyplot as plt

    request, sae = _check(run, request, sae)
    n = run.positions(request)
    if isinstance(pos, bool) or not isinstance(pos, int) or not -n <= pos < n:
        raise ValueError(f"pos={pos!r} out of range for request {request}'s {n} captured positions (0-{n - 1})")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r}: expected a positive int, e.g. k=10")
    pos %= n
    ids, values = request_features(run, request, sae)
    ids, values = ids[pos, :k].numpy(), values[pos, :k].numpy()
    keep = values > 0
    ids, values = ids[keep], values[keep]
    ax = _axes(ax, plt)
    y = np.arange(len(ids))
    ax.barh(y, values, color="tab:orange")
    ax.set_yticks(y)
    ax.set_yticklabels([f"feature {f}" for f in ids], fontsize=8)
    ax.invert_yaxis()  # the strongest on top
    ax.set_xlabel("activation")
    label = show_token(token_labels(run, request, tokenizer)[pos], 20)
    if not len(ids):
        ax.text(0.5, 0.5, "no feature fires here", ha="center", va="center", transform=ax.transAxes)
    ax.set_title(f"position {pos} ({label}): the features that fire most", fontsize=10)
    return ax


def _rect(x, y, w, h, lw=2.0, ls="-"):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), w, h, fill=False, edgecolor=_MARK, linewidth=lw, linestyle=ls, clip_on=False)
