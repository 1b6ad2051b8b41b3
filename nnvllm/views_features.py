"""What a feature view shows, as pure functions of a :class:`~nnvllm.Run` made with ``generate(saes=...)``.

A run with SAEs holds, per SAE ``s`` and request ``i``, the most active features at every captured
position: ``run.features[s][i] = (ids [pos, k], values [pos, k])`` (or the dense code
``[pos, d_sae]`` with ``sae_dense=True``). The functions here read that and return tensors, tidy
pandas tables and HTML: which features fire on each token (:func:`token_features`), where one
feature fires over the text (:func:`feature_activations`, :func:`feature_text_html`), and the
features that fire most over a run (:func:`feature_summary`). No engine, no ipywidgets;
:class:`nnvllm.widgets.FeatureExplorer` shows them, :func:`nnvllm.plotting.plot_feature_strip` and
:func:`nnvllm.plotting.plot_token_features` draw them.

A request's positions are its prompt tokens, then each generated token that was fed back (the last
generated token is never fed, so it has no features). With sparse features a feature outside a
position's top ``k`` reads as 0 there: it may fire weakly below the ``k``-th value.

Example::

    run = nv.generate(model, "The capital of France is", saes=[sae], sae_k=8)
    token_features(run, k=3)              # one row per (position, feature that fires)
    feature_activations(run, 60)          # [pos]: feature 60 at each token
"""

from __future__ import annotations

import html

import torch
from torch import Tensor

__all__ = [
    "feature_activations",
    "feature_status_html",
    "feature_strip",
    "feature_summary",
    "feature_text_html",
    "position_options",
    "request_features",
    "token_features",
    "token_features_html",
    "token_labels",
]

#: The colour of a feature's activation (and of a chosen token), as r, g, b: the views' highlight orange.
FEATURE_RGB = (255, 127, 14)


def _index(name: str, value, n: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -n <= value < n:
        raise ValueError(f"{name}={value!r} out of range for {what} (0-{n - 1})")
    return value % n


def _check(run, request: int, sae: int) -> tuple[int, int]:
    """(request, sae) as non-negative indices, after checking that the run has SAE features."""
    if not getattr(run, "features", None):
        raise ValueError("this run has no SAE features; generate with saes=[sae], e.g. "
                         "nv.generate(model, prompt, saes=[nv.SAE.load(path)])")
    sae = _index("sae", sae, len(run.features), f"a run of {len(run.features)} SAE(s)")
    request = _index("request", request, len(run.features[sae]), f"a run of {len(run.features[sae])} request(s)")
    return request, sae


def _d_sae(run, sae: int) -> int | None:
    saes = (getattr(run, "meta", None) or {}).get("saes") or []
    return int(saes[sae]["d_sae"]) if sae < len(saes) and "d_sae" in saes[sae] else None


def request_features(run, request: int = 0, sae: int = 0) -> tuple[Tensor, Tensor]:
    """Return one request's features: ``(ids [pos, k] int64, values [pos, k] float32)``, largest first.

    Sparse features come back as the engine kept them. A dense code (``sae_dense=True``) is cut to
    the most features that fire at any one position (at least 1), largest first.

    Example::

        ids, values = request_features(run, 0)
        ids[3, 0], values[3, 0]           # the strongest feature at position 3 and its activation
    """
    request, sae = _check(run, request, sae)
    got = run.features[sae][request]
    if isinstance(got, tuple):
        ids, values = got
        return ids.long(), values.float()
    code = got.float()
    k = max(int((code > 0).sum(-1).max()) if code.numel() else 1, 1)
    values, ids = code.topk(min(k, code.shape[-1]), dim=-1, sorted=True)
    return ids.long(), values


def feature_activations(run, feature: int, request: int = 0, sae: int = 0) -> Tensor:
    """Return ``[pos]``: feature ``feature``'s activation at each position of one request.

    Exact for a dense code; with sparse features, 0 where the feature is not among a position's
    top ``k`` (it may fire weakly there, below the ``k``-th value).

    Example::

        feature_activations(run, 60)      # tensor([0., 0., 0., 0.99, 0., ...])
    """
    request, sae = _check(run, request, sae)
    d_sae = _d_sae(run, sae)
    got = run.features[sae][request]
    if d_sae is None and not isinstance(got, tuple):
        d_sae = int(got.shape[-1])
    if isinstance(feature, bool) or not isinstance(feature, int) or feature < 0 or (d_sae is not None and feature >= d_sae):
        top = f"0-{d_sae - 1}" if d_sae is not None else "0 or more"
        raise ValueError(f"feature={feature!r}: expected a feature id of the SAE ({top})")
    if not isinstance(got, tuple):
        return got[:, feature].float()
    ids, values = got
    return (values.float() * (ids.long() == feature)).sum(-1)


def token_labels(run, request: int = 0, tokenizer=None) -> list[str]:
    """The text of each captured position of one request (prompt tokens, then the generated tokens
    fed back), through ``tokenizer`` or the run's own (``run.tokenizer``); token ids without one."""
    tok = tokenizer if tokenizer is not None else getattr(run, "tokenizer", None)
    seq = run.sequence(request)
    if tok is None:
        return [str(int(t)) for t in seq]
    return [tok.decode([int(t)]) for t in seq]


def _positions(run, request: int, positions) -> list[int]:
    n, prompt_len = run.positions(request), len(run.prompt_ids[request])
    if positions == "all":
        return list(range(n))
    if positions == "prompt":
        return list(range(min(prompt_len, n)))
    if positions == "generated":
        return list(range(prompt_len, n))
    chosen = [positions] if isinstance(positions, int) and not isinstance(positions, bool) else positions
    if not isinstance(chosen, (list, tuple, range)) or not all(
            isinstance(p, int) and not isinstance(p, bool) and -n <= p < n for p in chosen):
        raise ValueError(f"positions={positions!r}: expected 'all', 'prompt', 'generated', or position(s) in "
                         f"0-{n - 1} (request {request} has {n} captured positions)")
    return [p % n for p in chosen]


def token_features(run, request: int | None = 0, sae: int = 0, *, k: int = 5, positions="all",
                   tokenizer=None):
    """Return the features that fire most on each token, as a tidy table (one row per token and feature).

    Args:
        run: a Run made with ``generate(..., saes=[...])``.
        request: the request, or None for every request.
        sae: which SAE of the run (index into ``run.features``).
        k: at most this many features per token, the most active first.
        positions: ``"all"``, ``"prompt"``, ``"generated"`` (the generated tokens that were fed back)
            or a list of positions.
        tokenizer: to write each token's text (default: the run's own).

    Returns:
        A DataFrame with columns ``request, pos, step, token, token_id, generated, rank, feature,
        activation``; ``step`` is the generation step that produced the token (``<NA>`` for a prompt
        token). Only features that fire (activation > 0) have rows: a token where none fires has none.

    Example::

        token_features(run, k=3, positions="generated")
    """
    import pandas as pd

    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r}: expected a positive int, e.g. k=5")
    if request is None:
        sae = _check(run, 0, sae)[1]
        requests = range(len(run.features[sae]))
    else:
        requests = [_check(run, request, sae)[0]]
    rows = []
    for i in requests:
        ids, values = request_features(run, i, sae)
        labels, seq = token_labels(run, i, tokenizer), run.sequence(i)
        prompt_len = len(run.prompt_ids[i])
        for p in _positions(run, i, positions):
            for r in range(min(k, ids.shape[-1])):
                a = float(values[p, r])
                if a <= 0:
                    break  # largest first: nothing after fires either
                rows.append({"request": i, "pos": p, "step": p - prompt_len if p >= prompt_len else None,
                             "token": labels[p], "token_id": int(seq[p]), "generated": p >= prompt_len,
                             "rank": r, "feature": int(ids[p, r]), "activation": a})
    columns = ["request", "pos", "step", "token", "token_id", "generated", "rank", "feature", "activation"]
    frame = pd.DataFrame(rows, columns=columns)
    frame["step"] = frame["step"].astype("Int64")
    return frame


def feature_summary(run, sae: int = 0, *, n: int = 10, request: int | None = None, tokenizer=None):
    """Return the features that fire most over a run: one row per feature, strongest first.

    Columns: ``feature``, ``max_activation``, ``request`` and ``pos`` of that maximum, ``token`` there,
    ``fires`` (positions where it fires, over the requests looked at) and ``mean_activation`` over
    those positions. ``n`` rows at most (None: every feature that fires); ``request`` limits it to one.

    Example::

        feature_summary(run, n=5)
    """
    import pandas as pd

    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"n={n!r}: expected a positive int (rows to show) or None for every feature")
    sae = _check(run, 0, sae)[1]
    requests = range(len(run.features[sae])) if request is None else [_check(run, request, sae)[0]]
    columns = ["feature", "max_activation", "request", "pos", "token", "fires", "mean_activation"]
    # Every (request, pos, feature, value) that fires, at once: one pass in torch, not one per entry.
    found = []
    for i in requests:
        ids, values = request_features(run, i, sae)
        on = (values > 0).nonzero()
        found.append((torch.full((len(on),), i), on[:, 0], ids[on[:, 0], on[:, 1]], values[on[:, 0], on[:, 1]]))
    if not found or not sum(len(r) for r, *_ in found):
        return pd.DataFrame([], columns=columns)
    req, pos, ids, values = (torch.cat(x) for x in zip(*found))
    width = int(ids.max()) + 1
    top = torch.zeros(width).scatter_reduce(0, ids, values, "amax")
    fires = torch.bincount(ids, minlength=width)
    total = torch.bincount(ids, weights=values.double(), minlength=width)
    order = sorted((f for f in range(width) if fires[f]), key=lambda f: (-float(top[f]), f))[:n]
    rows, labels = [], {}
    for f in order:
        at = int(((ids == f) & (values == top[f])).nonzero()[0, 0])  # the first place it is strongest
        i, p = int(req[at]), int(pos[at])
        if i not in labels:
            labels[i] = token_labels(run, i, tokenizer)
        rows.append({"feature": f, "max_activation": float(top[f]), "request": i, "pos": p,
                     "token": labels[i][p], "fires": int(fires[f]),
                     "mean_activation": float(total[f]) / int(fires[f])})
    return pd.DataFrame(rows, columns=columns)


def position_options(run, request: int = 0, tokenizer=None) -> list[tuple[str, int]]:
    """``(label, pos)`` for each captured position of one request, for a token picker: ``"3: ' France'"``,
    a generated token marked ``(generated)``."""
    prompt_len = len(run.prompt_ids[request])
    return [(f"{p}: {t!r}" + (" (generated)" if p >= prompt_len else ""), p)
            for p, t in enumerate(token_labels(run, request, tokenizer))]


def _quoted(text: str) -> str:
    # repr: a token's leading space or newline cannot vanish into the sentence around it
    return f"<code style='white-space:pre'>{html.escape(repr(text))}</code>"


def feature_text_html(run, feature: int, request: int = 0, sae: int = 0, *, tokenizer=None,
                      selected: int | None = None, vmax: float | None = None) -> str:
    """Return the request's text with each token shaded by ``feature``'s activation there.

    Each token is a ``<span>`` with ``data-pos`` and ``data-activation`` and its value as a tooltip;
    darker is stronger (scaled to ``vmax``, default the feature's maximum over the request). Generated
    tokens are italic, ``selected`` (a position) is outlined. Whitespace is kept as it is.

    Example::

        HTML(feature_text_html(run, 60, selected=3))
    """
    acts = feature_activations(run, feature, request, sae)
    labels = token_labels(run, request, tokenizer)
    prompt_len = len(run.prompt_ids[request])
    top = float(vmax) if vmax is not None else float(acts.max()) if acts.numel() else 0.0
    r, g, b = FEATURE_RGB
    spans = []
    for p, (text, a) in enumerate(zip(labels, acts.tolist())):
        alpha = min(a / top, 1.0) * 0.85 if top > 0 and a > 0 else 0.0
        style = [f"background:rgba({r},{g},{b},{alpha:.2f})", "border-radius:2px"]
        if p >= prompt_len:
            style.append("font-style:italic")
        if p == selected:
            style.append("outline:2px solid #1f77b4")
        spans.append(f"<span data-pos='{p}' data-activation='{a:.4g}' title='pos {p}: {a:.3f}' "
                     f"style='{';'.join(style)}'>{html.escape(text)}</span>")
    return (f"<div class='nnvllm-feature-text' data-feature='{feature}' "
            f"style='white-space:pre-wrap;font-family:monospace;line-height:1.8'>{''.join(spans)}</div>")


def token_features_html(run, pos: int, request: int = 0, sae: int = 0, *, k: int = 10, tokenizer=None,
                        selected: int | None = None) -> str:
    """Return an HTML table of the features that fire most at position ``pos``, a bar per activation,
    the row of feature ``selected`` highlighted.

    Example::

        HTML(token_features_html(run, 3, k=5))
    """
    table = token_features(run, request, sae, k=k, positions=[pos], tokenizer=tokenizer)
    label = token_labels(run, request, tokenizer)[pos % run.positions(request)]
    caption = f"position {pos % run.positions(request)} ({_quoted(label)}): the features that fire most"
    if table.empty:
        return f"<div class='nnvllm-table'>{caption}: none fires here</div>"
    top = float(table["activation"].max())
    r, g, b = FEATURE_RGB
    out = ["<table class='nnvllm-table' style='border-collapse:collapse;font-size:12px'>",
           f"<caption style='text-align:left'>{caption}</caption>",
           "<tr><th>rank</th><th>feature</th><th>activation</th><th></th></tr>"]
    for row in table.itertuples():
        shade = f" style='background:rgba({r},{g},{b},0.2)'" if row.feature == selected else ""
        width = round(120 * row.activation / top)
        out.append(f"<tr data-feature='{row.feature}'{shade}><td>{row.rank}</td><td>{row.feature}</td>"
                   f"<td style='text-align:right;padding:0 6px'>{row.activation:.3f}</td>"
                   f"<td><div style='width:{width}px;height:8px;background:rgb({r},{g},{b})'></div></td></tr>")
    out.append("</table>")
    return "\n".join(out)


def feature_status_html(run, feature: int, request: int = 0, sae: int = 0, *, tokenizer=None) -> str:
    """One line on a feature over one request: how many tokens it fires on and where it fires most."""
    acts = feature_activations(run, feature, request, sae)
    on = int((acts > 0).sum())
    if on == 0:
        return f"feature {feature} fires on none of the {acts.numel()} tokens"
    p = int(acts.argmax())
    label = token_labels(run, request, tokenizer)[p]
    return (f"feature {feature} fires on {on} of {acts.numel()} tokens; most at position {p} "
            f"({_quoted(label)}): <b>{float(acts[p]):.3f}</b>")


def feature_strip(run, features, request: int = 0, sae: int = 0) -> Tensor:
    """``[len(features), pos]``: each feature's activation at each position (rows of :func:`feature_activations`)."""
    if isinstance(features, int) and not isinstance(features, bool):
        features = [features]
    if not isinstance(features, (list, tuple, range)) or not features:
        raise ValueError(f"features={features!r}: expected a feature id or a non-empty list of them")
    return torch.stack([feature_activations(run, f, request, sae) for f in features])
