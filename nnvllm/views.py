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
    "compare_figure",
    "error_html",
    "figure_png",
    "lens_figure",
    "lens_rows",
    "lens_status_html",
    "lens_table_html",
    "live_lens_html",
    "patch_cell_html",
    "patch_figure",
    "per_position",
    "position_table_html",
    "samples_figure",
    "samples_table_html",
    "samples_text_html",
    "step_position",
    "summary_html",
    "tok_quoted",
    "token_options",
]

HIGHLIGHT = "#ff7f0e"  # the colour of a chosen cell, row or layer, everywhere
METRICS = ("max_abs", "rel_err", "cosine")  # the per-position metrics of a Discrepancy


def tok_html(text: str) -> str:
    """A token as HTML: escaped, whitespace kept (``white-space: pre``) so " Paris" shows its space."""
    return f"<code style='white-space:pre'>{html.escape(text)}</code>"


def tok_quoted(text: str) -> str:
    """A token inside a sentence, as HTML: quoted the way Python writes it (``' in'``, ``'\\n'``), so a
    space or newline cannot vanish into the sentence around it."""
    return f"<code style='white-space:pre'>{html.escape(repr(text))}</code>"


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


def position_table_html(table, metric: str, layer: int, exact=None) -> str:
    """The per-position table of :func:`per_position` as HTML: cosine shown as ``1 - cosine`` (a
    cosine of 0.9999999 and of 1 both print as 1.000000000), 0 where ``exact`` (a table of the same
    shape, True where the numbers are identical) says so or rounding took it below 0, and "n/a"
    where a request has no such position (it is shorter, or its tokens forked earlier)."""
    name = "1 - cosine" if metric == "cosine" else metric
    shown = table
    if metric == "cosine":
        shown = (1.0 - table).clip(lower=0.0)
        if exact is not None:
            shown = shown.mask(exact.reindex_like(shown).fillna(False).astype(bool), 0.0)
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


def error_html(exc: BaseException, with_traceback: bool = True) -> str:
    """Return an exception as HTML: its message in red, the traceback folded below (unless
    ``with_traceback=False``, for errors whose message says all, such as a closed engine)."""
    msg = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    out = f"<div style='color:#b00020'><b>Error:</b> <code style='white-space:pre-wrap'>{html.escape(msg)}</code></div>"
    if not with_traceback:
        return out
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return (out + "<details><summary>traceback</summary><pre style='font-size:11px'>"
            f"{html.escape(tb)}</pre></details>")


def figure_png(fig) -> bytes:
    """Render a matplotlib Figure to PNG bytes (no pyplot, no backend state touched)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    return buf.getvalue()


def figure(width: float, height: float):
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height))


# ------------------------------------------------------------------------- what each explorer draws


def lens_figure(lens, layer_index: int, step: int, max_positions: int = 40):
    """The :class:`~nnvllm.widgets.LensExplorer` picture: the lens heatmap with layer ``layer_index``
    outlined and the position that predicts generated token ``step`` dotted.

    Example::

        figure_png(lens_figure(lens, -1, 0))
    """
    from .plotting import lens_figsize

    n_layer, n_pos, _ = lens.top_ids.shape
    j = range(n_layer)[layer_index]
    shown = min(n_pos, max_positions)
    start = n_pos - shown
    fig = figure(*lens_figsize(shown, n_layer))
    ax = fig.subplots()
    lens.plot(ax=ax, max_positions=max_positions)
    ax.add_patch(_rect(-0.5, j - 0.5, shown, 1.0, lw=2.5))
    pos = step_position(lens, step) if lens.generated else lens.prompt_len - 1
    if pos >= start:
        ax.add_patch(_rect(pos - start - 0.5, -0.5, 1.0, n_layer, lw=1.5, ls=":"))
    ax.set_title(f"logit lens: layer {lens.layers[j]} outlined, step {step} dotted", fontsize=10)
    return fig


def lens_status_html(lens, layer_index: int, step: int) -> str:
    """One line under the lens explorer: what was generated at ``step`` and what the lens at layer
    ``layer_index`` predicts there, tokens quoted (``' is'``) so their spaces show.

    Example::

        lens_status_html(lens, -1, 0)   # "step 0 generated ' Paris' · layer 5, position 4 (' is'): top-1 ' Paris', p = 0.98"
    """
    pos = step_position(lens, step) if lens.generated else lens.prompt_len - 1
    row = lens_rows(lens, layer_index, 1)[pos]
    top, p = row["top"][0]
    if lens.generated:
        gen = lens.generated[step]
        gen_text = lens.tokenizer.decode([gen]) if lens.tokenizer else str(gen)
        head = f"step {step} generated {tok_quoted(gen_text)}"
    else:
        head = "nothing generated"
    return (f"{head} &middot; layer {lens.layers[layer_index]}, position {pos} ({tok_quoted(row['input'])}): "
            f"lens top-1 {tok_quoted(top)}, p = {p:.2f}")


def patch_figure(res, layer: int, pos: int):
    """The :class:`~nnvllm.widgets.PatchExplorer` picture: the sweep's heatmap, cell (``layer``, ``pos``) outlined."""
    j, p = res.layers.index(layer), res.positions.index(pos)
    fig = figure(max(6.0, 2.5 + 0.6 * len(res.positions)), max(3.0, 1.8 + 0.42 * len(res.layers)))
    ax = fig.subplots()
    res.plot(ax=ax)
    ax.add_patch(_rect(p - 0.5, j - 0.5, 1.0, 1.0, lw=2.5))
    return fig


def patch_cell_html(res, layer: int, pos: int) -> str:
    """One cell of a patching sweep in words: its effect, logit difference and what 0 and 1 mean."""
    j, p = res.layers.index(layer), res.positions.index(pos)
    return (
        f"patching {res.site} of layer {layer} at position {pos} ({tok_quoted(res.labels[p])}): "
        f"effect <b>{float(res.effect[j, p]):.3f}</b> (logit diff {float(res.patched_diff[j, p]):.3f}; "
        f"clean {res.clean_diff:.3f}, corrupt {res.corrupt_diff:.3f}; 1 = clean answer "
        f"{tok_quoted(res.answer)} restored, 0 = no change)"
    )


def compare_figure(d: Discrepancy, metric: str, layer: int):
    """The :class:`~nnvllm.widgets.CompareView` picture: ``metric`` per layer (``layer`` marked) and, on
    the same y axis, per position at that layer; ``cosine`` is drawn as ``1 - cosine`` on the log
    axis, exact zeros marked "exact" (:func:`nnvllm.plotting.log_metric`)."""
    from .plotting import log_metric

    fig = figure(8.0, 3.2)  # 10 in was clipped in JupyterLab with the file browser open
    ax_l, ax_p = fig.subplots(1, 2, sharey=True)
    if len(d.resid) == 0:
        ax_l.text(0.5, 0.5, "no residual stream compared", ha="center", transform=ax_l.transAxes)
        return fig
    name = "1 - cosine" if metric == "cosine" else metric
    per_layer = d.per_layer(metric)
    table = per_position(d, metric, layer)
    worst = table.min(axis=0) if metric == "cosine" else table.max(axis=0)
    if metric == "cosine":  # 1 - cosine, and 0 where the numbers are identical (the rounding aside)
        per_layer = (1.0 - per_layer).where(d.per_layer("max_abs") != 0, 0.0)
        worst = (1.0 - worst).where(per_position(d, "max_abs", layer).max(axis=0) != 0, 0.0)
    log_metric(ax_l, per_layer.index.to_numpy(), per_layer.to_numpy(dtype=float), "o-")
    log_metric(ax_p, worst.index.to_numpy(), worst.to_numpy(dtype=float), "s-")
    ax_l.axvline(layer, color=HIGHLIGHT, lw=2)
    ax_l.set_xticks(per_layer.index.to_numpy())
    ax_p.set_xticks(worst.index.to_numpy())
    ax_l.set_ylabel(f"{name} (log)")  # the right panel shares this axis: one label
    ax_l.set_xlabel("layer")
    ax_p.set_xlabel("position")
    ax_l.set_title(f"worst {name} per layer ({plain_title(d.names[0])} vs {plain_title(d.names[1])})", fontsize=9)
    ax_p.set_title(f"layer {layer}: worst {name} per position over requests", fontsize=9)
    fig.tight_layout()
    return fig


def samples_figure(run, tokenizer):
    """The :class:`~nnvllm.widgets.SamplesExplorer` picture: :func:`nnvllm.plotting.plot_samples` of request 0."""
    from .plotting import plot_samples

    fig = figure(max(6.0, 1.5 + 0.5 * len(run.samples[0])), 3.6)
    plot_samples(run, 0, ax=fig.subplots(), tokenizer=tokenizer)
    return fig


def samples_text_html(run, tokenizer) -> str:
    """Request 0's prompt and continuation, each generated token shaded by its probability."""
    s = run.samples[0]
    pieces = "".join(
        f"<span title='p={float(q):.3f}' style='background:rgba(31,119,180,{0.15 + 0.6 * float(q):.2f})'>"
        f"{html.escape(tokenizer.decode([int(t)]))}</span>"
        for t, q in zip(s.ids.tolist(), s.probs)
    )
    return f"<div style='white-space:pre-wrap'>{html.escape(run.prompts[0])}{pieces}</div>"


def samples_table_html(run, tokenizer) -> str:
    """One row per generated step: the token drawn, its probability, the top-1 token and its probability."""
    frame = run.to_frame()
    # repr: a table cell would drop a token's leading space
    frame.insert(3, "token", [repr(tokenizer.decode([int(t)])) for t in frame["token_id"]])
    frame["top1"] = [repr(tokenizer.decode([int(t)])) for t in frame["top1_id"]]
    return frame[["step", "token", "prob", "top1", "top1_prob"]].to_html(
        index=False, float_format="{:.3f}".format, classes="nnvllm-table")


def _rect(x, y, w, h, lw=2.0, ls="-"):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), w, h, fill=False, edgecolor=HIGHLIGHT, linewidth=lw, linestyle=ls, clip_on=False)
