"""What nnvllm's widgets show, as pure functions: tables, HTML and figures from results.

Everything here reads a result (:class:`~nnvllm.Lens`, :class:`~nnvllm.Discrepancy`, a tokenizer)
and returns plain data, an HTML string or PNG bytes: no ipywidgets, no engine, so it is tested on
its own and usable outside a widget (``HTML(lens_table_html(lens, -1))``). :mod:`nnvllm.widgets`
holds only the controls and their state, and calls these.

Example::

    from nnvllm.views import lens_rows
    lens_rows(nv.logit_lens(model, "The capital of France is"), -1, k=3)
"""

from __future__ import annotations

import html
import io
import traceback

from .compare import Discrepancy

__all__ = [
    "error_html",
    "figure_png",
    "lens_rows",
    "lens_table_html",
    "live_lens_html",
    "per_position",
    "position_table_html",
    "step_position",
    "summary_html",
    "token_options",
]

HIGHLIGHT = "#ff7f0e"  # the colour of a chosen cell, row or layer, everywhere
METRICS = ("max_abs", "rel_err", "cosine")  # the per-position metrics of a Discrepancy


def tok_html(text: str) -> str:
    """A token as HTML: escaped, whitespace kept (``white-space: pre``) so " Paris" shows its space."""
    return f"<code style='white-space:pre'>{html.escape(text)}</code>"


def step_position(lens, step: int) -> int:
    """Return the position whose lens distribution predicts generated token ``step``.

    Position ``p`` holds token ``labels[p]`` and predicts token ``p + 1``; generated token 0 is
    predicted at the last prompt position, ``prompt_len - 1``.

    Example::

        step_position(lens, 0)      # lens.prompt_len - 1
    """
    n = len(lens.generated)
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < max(n, 1):
        raise ValueError(f"step={step!r} out of range for a lens of {n} generated tokens (0-{n - 1}).")
    return lens.prompt_len - 1 + step


def lens_rows(lens, layer_index: int, k: int = 5) -> list[dict]:
    """Return one row per position: the input token and the lens's top-``k`` at one layer.

    Args:
        lens: a :class:`nnvllm.lens.Lens`.
        layer_index: index into ``lens.layers`` (``-1`` is the last captured block).
        k: how many tokens per position (at most the lens's own k).

    Returns:
        Dicts with ``pos``, ``input`` (token text at pos), ``generated`` (pos holds a generated
        token), ``top`` (list of ``(token text, prob)``, most likely first).

    Example::

        lens_rows(lens, -1, k=3)[lens.prompt_len - 1]["top"][0]    # (' Paris', 0.98)
    """
    n_layer, n_pos, k_max = lens.top_ids.shape
    if isinstance(layer_index, bool) or not isinstance(layer_index, int) or not -n_layer <= layer_index < n_layer:
        raise ValueError(
            f"layer_index={layer_index!r} out of range for a lens of {n_layer} layers (0-{n_layer - 1})."
        )
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r} must be a positive int, e.g. k=5.")
    k = min(k, k_max)
    ids = lens.top_ids[layer_index, :, :k].tolist()
    probs = lens.top_probs[layer_index, :, :k].float().tolist()
    tok = lens.tokenizer
    decode = (lambda t: str(t)) if tok is None else (lambda t: tok.decode([int(t)]))
    return [
        {
            "pos": p,
            "input": lens.labels[p],
            "generated": p >= lens.prompt_len,
            "top": [(decode(t), float(q)) for t, q in zip(ids[p], probs[p])],
        }
        for p in range(n_pos)
    ]


def lens_table_html(lens, layer_index: int, k: int = 5, highlight_pos: int | None = None) -> str:
    """Return an HTML table of one layer's top-``k`` lens tokens at each position.

    One row per position (input token, then the ``k`` most likely next tokens with their
    probabilities). Generated positions are italic; ``highlight_pos`` gets a coloured row. Token
    text is HTML-escaped and whitespace is kept, so the string contains e.g. ``" Paris"``.

    Example::

        HTML(lens_table_html(lens, -1, k=3))
    """
    rows = lens_rows(lens, layer_index, k)
    k = len(rows[0]["top"]) if rows else 0
    block = lens.layers[layer_index]
    head = "".join(f"<th>top {r + 1}</th>" for r in range(k))
    out = [
        "<table class='nnvllm-table' style='border-collapse:collapse;font-size:12px'>",
        f"<caption style='text-align:left'>layer {block}: top-{k} next tokens at each position</caption>",
        f"<tr><th>pos</th><th>input</th>{head}</tr>",
    ]
    for r in rows:
        style = []
        if r["pos"] == highlight_pos:
            style.append(f"background:{HIGHLIGHT}33")
        if r["generated"]:
            style.append("font-style:italic")
        cells = "".join(
            f"<td style='padding:0 6px;white-space:nowrap'>{tok_html(t)} <span style='color:#666'>{q:.2f}</span></td>"
            for t, q in r["top"]
        )
        out.append(
            f"<tr data-pos='{r['pos']}' style='{';'.join(style)}'><td>{r['pos']}</td>"
            f"<td>{tok_html(r['input'])}</td>{cells}</tr>"
        )
    out.append("</table>")
    return "\n".join(out)


def live_lens_html(layers: list[int], cells: list[list[tuple[str, float]]], generated: list[str]) -> str:
    """The live lens panel: one row per layer, one column per generated token (``generated``), each
    cell the lens's top-1 token at the position that produced that token, shaded by its probability.

    ``cells[t][j]`` is ``(token text, probability)`` for step ``t`` and ``layers[j]`` (the top row is the
    last layer, as in the lens heatmap). NaN probabilities (no value) show an empty cell.
    """
    head = "".join(f"<th style='padding:0 4px'>{tok_html(g)}</th>" for g in generated)
    rows = []
    for j in reversed(range(len(layers))):
        tds = []
        for col in cells:
            text, p = col[j]
            if p != p:  # NaN
                tds.append("<td></td>")
                continue
            tds.append(f"<td title='{p:.3f}' style='padding:0 4px;background:rgba(31,119,180,{0.15 + 0.7 * p:.2f})'>"
                       f"{tok_html(text)}</td>")
        rows.append(f"<tr><th style='text-align:right;padding-right:6px'>L{layers[j]}</th>{''.join(tds)}</tr>")
    return (f"<table class='nnvllm-live-lens' style='border-collapse:collapse;font-size:12px'>"
            f"<tr><th>layer</th>{head}</tr>{''.join(rows)}</table>")


def token_options(tokenizer, text: str) -> list[tuple[str, int]]:
    """Return ``(label, pos)`` for each token of ``text`` as :func:`nnvllm.patch` positions count them.

    The same ``tokenizer.encode(text)`` as ``patch`` (special tokens included, e.g. a BOS).

    Example::

        token_options(model.tokenizer, "The capital of France is")[3]   # ("3: ' France'", 3)
    """
    ids = tokenizer.encode(text)
    return [(f"{p}: {tokenizer.decode([t])!r}", p) for p, t in enumerate(ids)]



def per_position(d: Discrepancy, metric: str, layer: int):
    """Return one metric at one layer as a ``request × pos`` table (residual stream rows).

    Example::

        per_position(nv.compare(ref, run), "rel_err", 3)
    """
    if metric not in METRICS:
        raise ValueError(f"metric={metric!r} is not one of {METRICS}; pass e.g. metric='rel_err'.")
    rows = d.resid[(d.resid["site"] == "resid") & (d.resid["layer"] == layer)]
    return rows.pivot(index="request", columns="pos", values=metric)


def position_table_html(table, metric: str, layer: int) -> str:
    """The per-position table of :func:`per_position` as HTML: cosine shown as ``1 - cosine`` (a
    cosine of 0.9999999 and of 1 both print as 1.000000000), and "n/a" where a request has no such
    position (it is shorter, or its tokens forked earlier)."""
    name = "1 - cosine" if metric == "cosine" else metric
    shown = 1.0 - table if metric == "cosine" else table
    return (f"<b>{html.escape(name)} at layer {layer}</b> (rows: request, columns: position)"
            + shown.to_html(float_format="{:.3g}".format, na_rep="n/a", classes="nnvllm-table"))


def plain_title(text: str) -> str:
    """A name safe in a matplotlib title: ``$`` would start mathtext (a ParseException on a stray ``^``)."""
    return str(text).replace("$", r"\$")


def summary_html(d: Discrepancy) -> str:
    """Return :meth:`Discrepancy.summary` as a two-column HTML table."""
    s = d.summary()
    fmt = {
        "max_abs": "{:.3g}", "max_rel_err": "{:.3g}", "min_cosine": "{:.9f}", "max_kl": "{:.3g}",
        "top1_agreement": "{:.3f}", "token_agreement": "{:.3f}",
    }
    rows = [f"<tr><th colspan=2 style='text-align:left'>{html.escape(' vs '.join(s['names']))}</th></tr>"]
    for key, value in s.items():
        if key == "names":
            continue
        text = fmt[key].format(value) if key in fmt else str(value)
        rows.append(f"<tr><td>{html.escape(key)}</td><td style='padding-left:8px'>{html.escape(text)}</td></tr>")
    return "<table class='nnvllm-summary' style='font-size:12px'>" + "".join(rows) + "</table>"


def error_html(exc: BaseException) -> str:
    """Return an exception as HTML: its message in red, the traceback folded below."""
    msg = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return (
        f"<div style='color:#b00020'><b>Error:</b> <code style='white-space:pre-wrap'>{html.escape(msg)}"
        f"</code></div><details><summary>traceback</summary><pre style='font-size:11px'>"
        f"{html.escape(tb)}</pre></details>"
    )


def figure_png(fig) -> bytes:
    """Render a matplotlib Figure to PNG bytes (no pyplot, no backend state touched)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


def figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))
