"""What a head view shows, as pure functions of a :class:`~nnvllm.Run` and an :class:`~nnvllm.heads.Attribution`.

A run made with ``sites=["q", "k"]`` rebuilds any head's attention pattern (:meth:`~nnvllm.Run.attention`);
``nv.attribute(run, target, versus)`` splits a logit difference into each head's share at every
generated step. The functions here read those two for one request, one generated step, one block
and one head, and return tensors, tidy tables and HTML:

- the head's pattern over the tokens, from the query that produced the step's token
  (:func:`head_pattern`; position :func:`query_position`), as shaded text (:func:`pattern_text_html`);
- the tokens it attends to most (:func:`top_attended`, :func:`top_attended_html`);
- its attribution (:func:`head_attribution`, :func:`head_status_html`) and the block × head map of
  every head's (:func:`attribution_map`, :func:`attribution_cells`, :func:`head_options`).

No engine, no ipywidgets: :class:`nnvllm.widgets.HeadExplorer` shows them,
:func:`nnvllm.plotting_heads.plot_head_pattern` and :func:`nnvllm.plotting_heads.plot_head_attribution`
draw them.

Step ``s`` is the generation step that produced generated token ``s``: its logits come from the
stream at position ``prompt_len - 1 + s``, and that position's query is the one whose pattern is
shown (it sees the prompt and the generated tokens before ``s``).

Example::

    run = nv.generate(model, "The capital of France is", max_tokens=3, sites=["q", "k", "z", "mlp"])
    att = nv.attribute(run, target=" Paris", versus=" Rome")
    top_attended(run, layer=1, head=0, step=0)      # where head 1.0 looks when " Paris" is written
    attribution_map(att, step=0)                     # [layer, head]: each head's share of the difference
"""

from __future__ import annotations

import html

from torch import Tensor

from .views_features import token_labels

__all__ = [
    "attribution_cells",
    "attribution_color",
    "attribution_map",
    "head_attribution",
    "head_options",
    "head_pattern",
    "head_status_html",
    "pattern_text_html",
    "query_position",
    "step_options",
    "top_attended",
    "top_attended_html",
]

#: The colour of attention weight (and of a chosen token), as r, g, b: the views' highlight orange.
ATTENTION_RGB = (255, 127, 14)
#: The diverging colour map of attributions: blue raises the target's logit, red lowers it.
ATTRIBUTION_CMAP = "RdBu"


def _int(name: str, value, n: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not -n <= value < n:
        raise ValueError(f"{name}={value!r} out of range for {what} (0-{n - 1})")
    return value % n


def _request(run, request: int) -> int:
    return _int("request", request, len(run.prompts), f"a run of {len(run.prompts)} request(s)")


def query_position(run, step: int, request: int = 0) -> int:
    """Return the position whose query attended when generated token ``step`` was produced: ``prompt_len - 1 + step``.

    Example::

        query_position(run, 0)          # the last prompt token's position
    """
    request = _request(run, request)
    n = len(run.tokens[request])
    step = _int("step", step, n, f"request {request}'s {n} generated token(s)")
    return len(run.prompt_ids[request]) - 1 + step


def step_options(run, request: int = 0, tokenizer=None) -> list[tuple[str, int]]:
    """``(label, step)`` for each generated step of one request, for a step picker: ``"0: ' Paris'"``."""
    request = _request(run, request)
    tok = tokenizer if tokenizer is not None else getattr(run, "tokenizer", None)
    ids = run.tokens[request]
    text = [tok.decode([int(t)]) if tok is not None else str(int(t)) for t in ids]
    return [(f"{s}: {t!r}", s) for s, t in enumerate(text)]


def _head(run, layer: int, head: int) -> tuple[int, int]:
    """(layer, head) checked against the run's captured layers and its attention's heads."""
    spec = (getattr(run, "meta", None) or {}).get("attention")
    if spec is None or "q" not in run.sites or "k" not in run.sites:
        raise ValueError("this run has no q and k: a head's pattern is rebuilt from them; generate with "
                         "sites=['q', 'k'] (and the layers you want)")
    if isinstance(layer, bool) or not isinstance(layer, int) or layer not in run.layers:
        raise ValueError(f"layer={layer!r}: expected a captured block index; this run holds layers {run.layers}")
    n_heads = int(spec["n_heads"])
    return layer, _int("head", head, n_heads, f"a block of {n_heads} heads")


def head_pattern(run, layer: int, head: int, step: int = 0, request: int = 0) -> Tensor:
    """Return ``[pos]``: head ``layer.head``'s attention over one request's tokens from the query of ``step``.

    Each entry is the weight on that position's token; they sum to 1 over the positions the query
    sees (``0..query_position(run, step)``, within a sliding window) and are 0 after it.

    Example::

        head_pattern(run, 1, 0, step=0)     # tensor([0.01, 0.00, 0.01, 0.97, 0.01, 0., ...])
    """
    layer, head = _head(run, layer, head)
    q = query_position(run, step, request)
    return run.attention(layer, request, heads=[head], queries=[q])[0, 0]


def top_attended(run, layer: int, head: int, step: int = 0, request: int = 0, *, k: int = 5, tokenizer=None):
    """Return the tokens head ``layer.head`` attends to most from the query of ``step``, as a table.

    Columns: ``rank``, ``pos``, ``token`` (its text), ``generated`` (a generated token fed back),
    ``weight``; at most ``k`` rows, the largest weight first, only positions with a weight above 0.

    Example::

        top_attended(run, 1, 0, step=0, k=3)
    """
    import pandas as pd

    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r}: expected a positive int, e.g. k=5")
    request = _request(run, request)
    weights = head_pattern(run, layer, head, step, request)
    labels = token_labels(run, request, tokenizer)
    prompt_len = len(run.prompt_ids[request])
    values, order = weights.topk(min(k, weights.numel()))
    rows = [{"rank": r, "pos": int(p), "token": labels[int(p)], "generated": int(p) >= prompt_len, "weight": float(w)}
            for r, (w, p) in enumerate(zip(values, order)) if float(w) > 0]
    return pd.DataFrame(rows, columns=["rank", "pos", "token", "generated", "weight"])


def _quoted(text: str) -> str:
    # repr: a token's leading space or newline cannot vanish into the sentence around it
    return f"<code style='white-space:pre'>{html.escape(repr(text))}</code>"


def top_attended_html(run, layer: int, head: int, step: int = 0, request: int = 0, *, k: int = 5,
                      tokenizer=None) -> str:
    """Return an HTML table of the tokens head ``layer.head`` attends to most at ``step``, a bar per weight."""
    table = top_attended(run, layer, head, step, request, k=k, tokenizer=tokenizer)
    q = query_position(run, step, request)
    label = token_labels(run, request, tokenizer)[q]
    r, g, b = ATTENTION_RGB
    out = ["<table class='nnvllm-table' style='border-collapse:collapse;font-size:12px'>",
           (f"<caption style='text-align:left'>head {layer}.{head} from position {q} ({_quoted(label)}): "
            "the tokens it attends to most</caption>"),
           "<tr><th>rank</th><th>pos</th><th>token</th><th>weight</th><th></th></tr>"]
    for row in table.itertuples():
        style = " style='font-style:italic'" if row.generated else ""
        out.append(f"<tr data-pos='{row.pos}'><td>{row.rank}</td><td>{row.pos}</td><td{style}>{_quoted(row.token)}</td>"
                   f"<td style='text-align:right;padding:0 6px'>{row.weight:.3f}</td>"
                   f"<td><div style='width:{round(120 * row.weight)}px;height:8px;background:rgb({r},{g},{b})'>"
                   "</div></td></tr>")
    out.append("</table>")
    return "\n".join(out)


def pattern_text_html(run, layer: int, head: int, step: int = 0, request: int = 0, *, tokenizer=None) -> str:
    """Return the request's text with each token shaded by head ``layer.head``'s attention to it at ``step``.

    Each token is a ``<span>`` with ``data-pos`` and ``data-weight`` and its weight as a tooltip;
    darker is more (1.0 is the darkest). The query's own token is outlined; tokens after it (which
    it cannot see) are grey; generated tokens are italic. Whitespace is kept as it is.
    """
    weights = head_pattern(run, layer, head, step, request)
    q = query_position(run, step, request)
    labels = token_labels(run, request, tokenizer)
    prompt_len = len(run.prompt_ids[request])
    r, g, b = ATTENTION_RGB
    spans = []
    for p, (text, w) in enumerate(zip(labels, weights.tolist())):
        style = [f"background:rgba({r},{g},{b},{min(w, 1.0) * 0.85:.2f})", "border-radius:2px"]
        if p >= prompt_len:
            style.append("font-style:italic")
        if p == q:
            style.append("outline:2px solid #1f77b4")
        if p > q:
            style.append("color:#aaa")
        spans.append(f"<span data-pos='{p}' data-weight='{w:.4g}' title='pos {p}: {w:.3f}' "
                     f"style='{';'.join(style)}'>{html.escape(text)}</span>")
    return (f"<div class='nnvllm-pattern-text' data-head='{layer}.{head}' data-step='{step}' "
            f"style='white-space:pre-wrap;font-family:monospace;line-height:1.8'>{''.join(spans)}</div>")


# ------------------------------------------------------------------------------- attribution


def _attribution(att, step: int, request: int) -> tuple[int, int]:
    from .heads import Attribution

    if not isinstance(att, Attribution):
        raise TypeError(f"expected an nnvllm.heads.Attribution from nv.attribute(run, target, versus), got "
                        f"{type(att).__name__}")
    request = _int("request", request, len(att), f"an attribution of {len(att)} request(s)")
    n = int(att.heads[request].shape[0])
    return request, _int("step", step, n, f"request {request}'s {n} generated step(s)")


def attribution_map(att, step: int = 0, request: int = 0) -> Tensor:
    """Return ``[layer, head]``: each head's direct attribution at ``step`` (``att.heads[request][step]``)."""
    request, step = _attribution(att, step, request)
    return att.heads[request][step]


def head_attribution(att, layer: int, head: int, step: int = 0, request: int = 0) -> float:
    """Return what head ``layer.head`` adds to the attribution's logit difference at ``step``."""
    amap = attribution_map(att, step, request)
    layer = _int("layer", layer, amap.shape[0], f"{amap.shape[0]} blocks")
    head = _int("head", head, amap.shape[1], f"a block of {amap.shape[1]} heads")
    return float(amap[layer, head])


def head_options(att, step: int = 0, request: int = 0, k: int | None = None) -> list[tuple[str, tuple[int, int]]]:
    """``(label, (layer, head))`` for the heads with the largest absolute attribution at ``step``,
    largest first (``k`` of them; None: every head), for a head picker: ``"1.0: +1.979"``."""
    amap = attribution_map(att, step, request)
    flat = amap.flatten()
    order = flat.abs().argsort(descending=True, stable=True)[: k if k is not None else flat.numel()]
    H = amap.shape[1]
    return [(f"{int(j) // H}.{int(j) % H}: {float(flat[j]):+.3f}", (int(j) // H, int(j) % H)) for j in order]


def _vmax(amap: Tensor) -> float:
    top = float(amap.abs().max()) if amap.numel() else 0.0
    return top if top > 0 else 1.0


def attribution_color(value: float, vmax: float) -> str:
    """The colour of an attribution on the map: ``#rrggbb`` on :data:`ATTRIBUTION_CMAP` from ``-vmax`` to
    ``vmax`` (0 is white; blue raises the target's logit, red lowers it)."""
    import matplotlib

    if not vmax > 0:
        raise ValueError(f"vmax={vmax!r}: expected a positive number (the largest |attribution| on the map)")
    x = min(max(0.5 + 0.5 * float(value) / vmax, 0.0), 1.0)
    return matplotlib.colors.to_hex(matplotlib.colormaps[ATTRIBUTION_CMAP](x))


def attribution_cells(att, step: int = 0, request: int = 0) -> list[list[dict]]:
    """The block × head map as rows of cells, one list per block: each cell ``{layer, head, value,
    color, dark}`` (``dark``: the colour is dark enough to need white text), one colour scale for the
    whole map, symmetric about 0."""
    amap = attribution_map(att, step, request)
    vmax = _vmax(amap)
    return [[{"layer": layer, "head": h, "value": float(v), "color": attribution_color(float(v), vmax),
              "dark": abs(float(v)) > 0.6 * vmax} for h, v in enumerate(row)] for layer, row in enumerate(amap)]


def head_status_html(run, att, layer: int, head: int, step: int = 0, request: int = 0, *, tokenizer=None) -> str:
    """One line on head ``layer.head`` at ``step``: what it adds to the logit difference, its rank among
    the heads, the difference itself, and the token it attends to most."""
    value = head_attribution(att, layer, head, step, request)
    amap = attribution_map(att, step, request)
    rank = int((amap.abs() > abs(value)).sum()) + 1
    target, versus = att.labels
    what = f"logit({target!r})" + (f" - logit({versus!r})" if att.versus is not None else "")
    total = float(att.logit_diff[request][step])
    top = top_attended(run, layer, head, step, request, k=1, tokenizer=tokenizer)
    looks = ("" if top.empty else
             f"; attends most to {_quoted(top['token'][0])} at position {int(top['pos'][0])} ({top['weight'][0]:.2f})")
    return (f"head {layer}.{head} at step {step} adds <b>{value:+.3f}</b> to {html.escape(what)} "
            f"(rank {rank} of {amap.numel()} heads by size; the difference is {total:+.3f}){looks}")
