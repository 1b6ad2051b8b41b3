"""Matplotlib views of nnvllm results: ``plot_*(result, ax=None) -> Axes``.

Each function draws on ``ax`` (or on a new ``plt.subplots()`` figure when ax is None) and returns
the Axes. None calls ``plt.show()`` or writes files: the notebook or the caller decides.
pyplot is imported inside the functions, so importing this module selects no backend.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["plot_compare", "plot_lens", "plot_patch", "plot_samples"]

_GENERATED_COLOR = "tab:red"


def plot_lens(lens, ax=None, *, annotate: bool = True, max_positions: int = 40):
    """Draw a logit lens: top-1 probability per layer (y) × position (x), cells labelled by token.

    Generated positions (``p >= prompt_len``) sit right of a dashed line and have red tick
    labels. Position ``p``'s cell is the lens's guess at token ``p + 1``.

    Args:
        lens: a :class:`nnvllm.lens.Lens`.
        ax: Axes to draw on; a new figure when None.
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
        # Sized to the data (issue 14, item 5): matplotlib's default 6.4 in squeezed 40 positions into
        # ~4-character, 5 px cells. ~0.45 in per position and ~0.4 in per layer, up to 24 in wide.
        _, ax = plt.subplots(figsize=(min(24.0, max(6.0, 2.0 + 0.45 * n_shown)), max(3.0, 1.6 + 0.4 * n_layer)))
    cell_in = (ax.figure.get_figwidth() * ax.get_position().width) / max(n_shown, 1)
    probs = lens.top_probs[:, start:, 0].detach().float().cpu().numpy()
    ids = lens.top_ids[:, start:, 0].cpu().numpy()
    im = ax.imshow(
        probs, aspect="auto", origin="lower", cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest"
    )
    ax.figure.colorbar(im, ax=ax, label="top-1 probability")

    shown = list(range(start, n_pos))
    ax.set_xticks(range(len(shown)))
    ax.set_xticklabels([_show(lens.labels[p]) for p in shown], rotation=90, fontsize=8)
    for tick, p in zip(ax.get_xticklabels(), shown):
        if p >= lens.prompt_len:
            tick.set_color(_GENERATED_COLOR)
            tick.set_fontstyle("italic")
    ax.set_yticks(range(n_layer))
    ax.set_yticklabels([str(layer) for layer in lens.layers])
    if start < lens.prompt_len < n_pos:
        ax.axvline(lens.prompt_len - start - 0.5, color=_GENERATED_COLOR, linestyle="--", linewidth=1)

    if annotate:
        cache: dict[int, str] = {}
        cell_chars = max(2, min(8, int(cell_in / 0.065)))  # ~0.065 in per character at 6 pt
        for j in range(probs.shape[0]):
            for c in range(probs.shape[1]):
                t = int(ids[j, c])
                if t not in cache:
                    cache[t] = _show(_decode(lens.tokenizer, t), width=cell_chars)
                ax.text(
                    c,
                    j,
                    cache[t],
                    ha="center",
                    va="center",
                    fontsize=6,
                    color="white" if probs[j, c] > 0.5 else "black",
                )

    ax.set_xlabel("position (input token)" + (f", last {len(shown)} of {n_pos}" if start else ""))
    ax.set_ylabel("layer")
    ax.set_title("logit lens: top-1 token and probability")
    return ax


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
        [f"{_show(lab)} ({p})" for lab, p in zip(res.labels, res.positions)], rotation=90, fontsize=8
    )
    ax.set_yticks(range(len(res.layers)))
    ax.set_yticklabels([str(layer) for layer in res.layers])
    ax.set_xlabel("position (clean token)")
    ax.set_ylabel("layer")
    step = f", step {res.step}" if res.step else ""
    ax.set_title(f"patching {res.site}: {res.answer!r} vs {res.wrong!r}{step}")
    return ax


def plot_compare(d, ax=None):
    """Draw per-layer discrepancy between two runs: max|Δ|, relative error and 1 - cosine.

    The y axis is logarithmic; exact zeros are drawn at 1e-16 (below float64 resolution) so
    identical runs still show a line.

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
    title = f"{_show(str(a), 40)} vs {_show(str(b), 40)} (residual stream)"
    if len(d.resid) == 0 or not (d.resid["site"] == "resid").any():
        ax.text(0.5, 0.5, "no residual stream compared", ha="center", va="center", transform=ax.transAxes)
    else:
        floor = 1e-16
        series = {
            "max |Δ|": d.per_layer("max_abs"),
            "‖Δ‖ / ‖a‖": d.per_layer("rel_err"),
            "1 - cosine": 1.0 - d.per_layer("cosine"),
        }
        for label, s in series.items():
            ax.plot(
                s.index.to_numpy(), np.clip(s.to_numpy(dtype=float), floor, None), marker="o", label=label
            )
        ax.set_yscale("log")
        ax.set_xticks(series["max |Δ|"].index.to_numpy())
        ax.set_xlabel("layer")
        ax.set_ylabel(f"worst over requests and positions ({_show(str(a), 40)} - {_show(str(b), 40)})")
        ax.legend(fontsize=8)
    forked = [(i, t) for i, t in enumerate(d.fork) if t is not None]
    if forked:
        i, t = min(forked, key=lambda it: it[1])
        more = f", {len(forked)}/{len(d.fork)} requests fork" if len(d.fork) > 1 else ""
        title += f"\ntokens fork at step {t} (request {i}){more}; only earlier positions compared"
    ax.set_title(title, fontsize=10)
    return ax


def plot_samples(run, i: int, ax=None, *, tokenizer: Any = None):
    """Draw what the sampler drew at each step: the sampled token's probability and the top-k.

    Bars are the sampled tokens' probabilities; grey dots are the top-k alternatives (the
    distribution actually sampled from). A bar well below the top dot means a less likely token
    was drawn.

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
                    _show(_decode(tokenizer, int(top_ids[t, 0])), width=8),
                    (t, top[t, 0]),
                    textcoords="offset points",
                    xytext=(0, 4),
                    ha="center",
                    fontsize=6,
                    color="grey",
                )
    ax.set_xticks(steps)
    ax.set_xticklabels([_show(_decode(tokenizer, int(t))) for t in ids], rotation=90, fontsize=8)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("generated token (step)")
    ax.set_ylabel("probability")
    ax.set_title(f"request {i % n}: sampled tokens and top alternatives")
    ax.legend(fontsize=8, loc="lower right")
    return ax


def _axes(ax, plt):
    if ax is None:
        _, ax = plt.subplots()
    return ax


def _decode(tokenizer: Any, token_id: int) -> str:
    return str(token_id) if tokenizer is None else tokenizer.decode([int(token_id)])


def _show(text: str, width: int = 12) -> str:
    """Make a token printable in a tick or cell: escape control chars and mathtext's ``$``, truncate."""
    text = text.replace("\n", "\\n").replace("\t", "\\t").replace("\r", "\\r")
    text = text if len(text) <= width else text[: width - 1] + "…"
    return text.replace("$", r"\$")
