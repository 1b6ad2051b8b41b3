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
from .plotting import shows_roles

__all__ = [
    "as_prompt",
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
    "position_roles",
    "position_table_html",
    "prompt_fields",
    "prompt_tokens",
    "samples_figure",
    "samples_table_html",
    "samples_text_html",
    "shown_positions",
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
        token), ``top`` (list of ``(token text, prob)``, most likely first), ``role`` (the position's
        label, :attr:`nnvllm.Lens.roles`, or None).

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
            "role": lens.roles[p] if lens.roles is not None else None,
        }
        for p in range(n_pos)
    ]


def lens_table_html(lens, layer_index: int, k: int = 5, highlight_pos: int | None = None) -> str:
    """Return an HTML table of one layer's top-``k`` lens tokens at each position.

    One row per position (input token, then the ``k`` most likely next tokens with their
    probabilities). Generated positions are italic; ``highlight_pos`` gets a coloured row. Token
    text is HTML-escaped and whitespace is kept, so the string contains e.g. ``" Paris"``. A
    conversation's lens gets a ``role`` column, the chat template's rows in grey.

    Example::

        HTML(lens_table_html(lens, -1, k=3))
    """
    rows = lens_rows(lens, layer_index, k)
    k = len(rows[0]["top"]) if rows else 0
    block = lens.layers[layer_index]
    head = "".join(f"<th>top {r + 1}</th>" for r in range(k))
    with_roles = shows_roles(lens.roles)
    out = [
        "<table class='nnvllm-table' style='border-collapse:collapse;font-size:12px'>",
        f"<caption style='text-align:left'>layer {block}: top-{k} next tokens at each position</caption>",
        f"<tr><th>pos</th>{'<th>role</th>' if with_roles else ''}<th>input</th>{head}</tr>",
    ]
    for r in rows:
        style = []
        if r["pos"] == highlight_pos:
            style.append(f"background:{HIGHLIGHT}33")
        if r["generated"]:
            style.append("font-style:italic")
        if with_roles and r["role"] == "template":
            style.append("color:#888")
        role = f"<td>{html.escape(r['role'])}</td>" if with_roles else ""
        cells = "".join(
            f"<td style='padding:0 6px;white-space:nowrap'>{tok_html(t)} <span style='color:#666'>{q:.2f}</span></td>"
            for t, q in r["top"]
        )
        out.append(
            f"<tr data-pos='{r['pos']}' style='{';'.join(style)}'><td>{r['pos']}</td>{role}"
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


def as_prompt(text: str, chat: bool = False, system: str = ""):
    """The prompt an explorer's text box stands for: the text itself, or with ``chat`` a conversation
    of one user message (after a system message when ``system`` is not empty), which the verbs render
    with the model's chat template.

    Example::

        as_prompt("The capital of France is", chat=True)   # [{'role': 'user', 'content': 'The capital ...'}]
    """
    if not chat:
        return text
    return ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]


def prompt_fields(prompt) -> tuple[str, bool, str]:
    """The text box, chat box and system box that stand for ``prompt``: ``(text, chat, system)``, the
    inverse of :func:`as_prompt`. A conversation there is one user message, after at most one system
    message.

    Example::

        prompt_fields([{"role": "user", "content": "The capital of France is"}])   # ('The capital ...', True, '')
    """
    from .chat import is_conversation

    if isinstance(prompt, str):
        return prompt, False, ""
    if not is_conversation(prompt):
        raise TypeError(f"prompt of type {type(prompt).__name__}: an explorer takes a str or a conversation of "
                        "one user message, e.g. [{'role': 'user', 'content': 'The capital of France is'}]")
    roles = [m.get("role") for m in prompt]
    texts = [m.get("content") for m in prompt]
    if roles not in (["user"], ["system", "user"]) or not all(isinstance(t, str) for t in texts):
        raise ValueError(f"a conversation of roles {roles}: an explorer's text box holds one user message (after "
                         "at most one system message, text content); pass such a conversation, or call the verb "
                         "(nv.logit_lens, nv.generate, nv.patch) with the whole conversation")
    return texts[-1], True, texts[0] if len(texts) == 2 else ""


def prompt_tokens(tokenizer, prompt) -> list[tuple[int, str, str]]:
    """``(pos, token text, role)`` for each token of a prompt as the verbs read it: a str through
    ``tokenizer.encode`` (special tokens included, as :func:`nnvllm.patch` counts positions), a
    conversation rendered by its chat template (:func:`nnvllm.chat.render`); roles as
    :attr:`nnvllm.Run.roles` labels them.

    Example::

        prompt_tokens(model.tokenizer, [{"role": "user", "content": "The capital"}])[0]  # (0, '<|endoftext|>', 'template')
    """
    from .chat import is_conversation, plain_roles, render

    if is_conversation(prompt):
        r = render(tokenizer, prompt)
        ids, roles = r.ids, r.roles
    else:
        ids = tokenizer.encode(prompt)
        roles = plain_roles(tokenizer, ids)
    return [(p, tokenizer.decode([t]), role) for p, (t, role) in enumerate(zip(ids, roles))]


def token_options(tokenizer, prompt) -> list[tuple[str, int]]:
    """Return ``(label, pos)`` for each token of ``prompt`` as :func:`nnvllm.patch` positions count them.

    A str through ``tokenizer.encode`` (special tokens included, e.g. a BOS); a conversation rendered
    by its chat template, the template's tokens labelled ``(template)`` (:func:`prompt_tokens`).

    Example::

        token_options(model.tokenizer, "The capital of France is")[3]   # ("3: ' France'", 3)
    """
    chat = not isinstance(prompt, str)
    return [(f"{p}: {text!r}" + (" (template)" if chat and role == "template" else ""), p)
            for p, text, role in prompt_tokens(tokenizer, prompt)]



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


def lens_figure(lens, layer_index: int, step: int, max_positions: int = 40, positions="all"):
    """The :class:`~nnvllm.widgets.LensExplorer` picture: the lens heatmap with layer ``layer_index``
    outlined and the position that predicts generated token ``step`` dotted (where it is drawn).

    ``positions`` draws some positions only, as :func:`nnvllm.plotting.plot_lens` takes them
    (``"content"``: without the chat template's).

    Example::

        figure_png(lens_figure(lens, -1, 0))
    """
    from .plotting import lens_figsize, title_pad

    n_layer, n_pos, _ = lens.top_ids.shape
    j = range(n_layer)[layer_index]
    pos = step_position(lens, step) if lens.generated else lens.prompt_len - 1
    target = (lens.positions or range(n_pos))[pos]  # the predicting position, as the request counts it
    if not (isinstance(positions, str) and positions == "all"):
        lens = lens.select(positions)
        n_pos = lens.top_ids.shape[1]
    shown = min(n_pos, max_positions)
    start = n_pos - shown
    fig = figure(*lens_figsize(shown, n_layer))
    ax = fig.subplots()
    lens.plot(ax=ax, max_positions=max_positions)
    ax.add_patch(_rect(-0.5, j - 0.5, shown, 1.0, lw=2.5))
    where = list(lens.positions or range(n_pos))
    col = where.index(target) if target in where else -1
    if col >= start:  # hidden (a template position) or cut off: no column to dot
        ax.add_patch(_rect(col - start - 0.5, -0.5, 1.0, n_layer, lw=1.5, ls=":"))
    ax.set_title(f"logit lens: layer {lens.layers[j]} outlined, step {step} dotted", fontsize=10, pad=title_pad(ax))
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
    """The :class:`~nnvllm.widgets.PatchExplorer` picture: the sweep's heatmap, cell (``layer``, ``pos``)
    outlined; a sweep over a conversation with its template's columns hatched and its roles named."""
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


def position_roles(run) -> list[str] | None:
    """One label per position for a view over all of a run's requests at once: the position's role
    (:attr:`nnvllm.Run.roles`) where every request that reaches it agrees, ``"mixed"`` where they
    differ; None for a run without roles.

    Example::

        position_roles(run)[:3]     # ['template', 'user', 'user']
    """
    if not run.roles:
        return None
    out = []
    for p in range(max(len(r) for r in run.roles)):
        seen = {r[p] for r in run.roles if p < len(r)}
        out.append(seen.pop() if len(seen) == 1 else "mixed")
    return out


def shown_positions(roles, positions, kept) -> list:
    """Which of the positions ``kept`` a view shows: all of them for ``positions="all"``, else those
    :func:`nnvllm.chat.select_positions` picks by their ``roles`` (one label per position of the request).

    Example::

        shown_positions(position_roles(run), "content", table.columns)
    """
    from .chat import select_positions

    kept = list(kept)
    if isinstance(positions, str) and positions == "all":
        return kept
    if roles is None:
        raise ValueError(f"positions={positions!r} selects by role, and these runs have no roles; pass "
                         "positions='all'")
    labels = [roles[p] if p < len(roles) else "mixed" for p in kept]
    cols = select_positions(labels, positions)
    if cols is None:
        raise ValueError(f"positions={positions!r}: expected 'all', 'content' (without the chat template), a "
                         "role such as 'user', or a list of roles")
    return [kept[c] for c in cols]


def compare_figure(d: Discrepancy, metric: str, layer: int, roles=None, positions="all"):
    """The :class:`~nnvllm.widgets.CompareView` picture: ``metric`` per layer (``layer`` marked) and, on
    the same y axis, per position at that layer; ``cosine`` is drawn as ``1 - cosine`` on the log
    axis, exact zeros marked "exact" (:func:`nnvllm.plotting.log_metric`).

    ``roles`` (one label per position, :func:`position_roles`) hatches a conversation's template
    positions and names its role spans over the per-position panel; ``positions="content"`` (or a
    role) draws only those positions there.

    Example::

        compare_figure(d, "rel_err", 3, roles=position_roles(run), positions="content")
    """
    from .plotting import log_metric, mark_roles, title_pad

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
    worst = worst[worst.index.isin(shown_positions(roles, positions, worst.index))]
    log_metric(ax_l, per_layer.index.to_numpy(), per_layer.to_numpy(dtype=float), "o-")
    log_metric(ax_p, worst.index.to_numpy(), worst.to_numpy(dtype=float), "s-")
    ax_l.axvline(layer, color=HIGHLIGHT, lw=2)
    ax_l.set_xticks(per_layer.index.to_numpy())
    ax_p.set_xticks(worst.index.to_numpy())
    ax_l.set_ylabel(f"{name} (log)")  # the right panel shares this axis: one label
    ax_l.set_xlabel("layer")
    ax_p.set_xlabel("position")
    if roles is not None:
        at = worst.index.to_numpy()
        ax_p.set_xlim(at.min() - 0.6, at.max() + 0.6)
        mark_roles(ax_p, [roles[p] if p < len(roles) else "mixed" for p in at], xs=at, where=at)
    pad = title_pad(ax_p)  # both titles at one height
    ax_l.set_title(f"worst {name} per layer ({plain_title(d.names[0])} vs {plain_title(d.names[1])})", fontsize=9,
                   pad=pad)
    ax_p.set_title(f"layer {layer}: worst {name} per position over requests", fontsize=9, pad=pad)
    fig.tight_layout()
    return fig


def samples_figure(run, tokenizer):
    """The :class:`~nnvllm.widgets.SamplesExplorer` picture: :func:`nnvllm.plotting.plot_samples` of request 0."""
    from .plotting import plot_samples

    fig = figure(max(6.0, 1.5 + 0.5 * len(run.samples[0])), 3.6)
    plot_samples(run, 0, ax=fig.subplots(), tokenizer=tokenizer)
    return fig


def samples_text_html(run, tokenizer) -> str:
    """Request 0's prompt as the model read it (a conversation rendered by its chat template:
    :attr:`nnvllm.Run.prompt_text`) and its continuation, each generated token shaded by its probability."""
    s = run.samples[0]
    pieces = "".join(
        f"<span title='p={float(q):.3f}' style='background:rgba(31,119,180,{0.15 + 0.6 * float(q):.2f})'>"
        f"{html.escape(tokenizer.decode([int(t)]))}</span>"
        for t, q in zip(s.ids.tolist(), s.probs)
    )
    prompt = run.prompt_text[0] if run.prompt_text else run.prompts[0]  # a run saved before prompt_text
    return f"<div style='white-space:pre-wrap'>{html.escape(prompt)}{pieces}</div>"


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
