"""The one-call analyses on a running engine: logit lens over generation and activation patching.

The math lives in the pure modules (:mod:`nnvllm.lens`, :mod:`nnvllm.patching`,
:mod:`nnvllm.compare`); this module only gathers what they need from the engine.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Sequence

import torch
from torch import Tensor
from tqdm.auto import tqdm

from . import _validate
from . import chat as _chat
from .capture import generate
from .lens import Lens, Norm, Unembed
from .patching import PatchResult, logit_diff, normalized_effect, plan

__all__ = ["unembedding", "logit_lens", "patch", "steering_vector"]


def unembedding(model) -> Unembed:
    """Return the model's final norm and unembedding as the engine holds them (gathered over TP ranks).

    Cached on the model: the weights do not change while the engine runs.
    """
    cached = model.__dict__.get("_nnvllm_unembed")
    if cached is not None:
        return cached
    from .engine.transport import engine_of

    engine = engine_of(model)  # in-process or isolated: each TP rank's norm + unembedding slice
    parts = engine.unembed(model.arch.final_norm, model.arch.unembed)
    first = parts[0]
    weight = torch.cat([p["weight"] for p in parts]) if len(parts) > 1 else first["weight"]
    bias = None if first["bias"] is None else torch.cat([p["bias"] for p in parts])
    weight = weight[: engine.info()["vocab_size"]]  # no padding rows
    u = Unembed(norm=Norm(first["kind"], first["norm_weight"], first["norm_bias"], first["eps"]),
                weight=weight, bias=bias, soft_cap=first.get("soft_cap"), scale=first.get("scale", 1.0))
    model.__dict__["_nnvllm_unembed"] = u
    return u


def logit_lens(model, prompt: str | list[dict], max_tokens: int = 10, layers="all", top_k: int = 5, **sampling: Any) -> Lens:
    """Project every block's residual, at every prompt position and generated step, to the vocabulary.

    Each block's output goes through the model's own final norm and unembedding (GPT-2 ``ln_f``,
    Llama ``norm``; tied or untied heads; gathered across TP ranks). At the last layer this equals
    the engine's next-token distribution at every generated step.

    Args:
        model: from :func:`nnvllm.load`.
        prompt: one prompt: a str, or a conversation (a list of ``{"role", "content"}`` messages,
            rendered with the chat template; ``chat_template=`` and ``chat_template_kwargs=`` go to
            :func:`nnvllm.generate`). ``lens.roles`` labels each position; ``lens.select("content")``
            keeps the messages' tokens only.
        max_tokens: generated steps to follow (greedy unless ``temperature=`` is given).
        layers: "all", an int or a list of block indices.
        top_k: tokens kept per (layer, pos); full ``[layer, pos, d_vocab]`` is never kept.
        **sampling: passed to :func:`nnvllm.generate` (``temperature``, ``top_p``, ``seed``, ``ignore_eos``).

    Returns:
        A :class:`~nnvllm.lens.Lens` with ``top_ids``/``top_probs`` ``[layer, pos, k]``,
        ``prob_of(token)`` and ``plot()``.

    Example:
        >>> lens = nv.logit_lens(model, "The capital of France is", max_tokens=3)   # doctest: +SKIP
        >>> lens.prob_of(" Paris")[:, 4]                                           # doctest: +SKIP
    """
    _check_model(model)
    if _chat.is_conversation(prompt):
        prompt = _validate.conversation(prompt, "prompt")
    elif not isinstance(prompt, str):
        raise TypeError(f"prompt={_validate._show(prompt)}: logit_lens takes one prompt (a non-empty str or a "
                        f"conversation), got {type(prompt).__name__}; loop for several")
    if not prompt:
        raise ValueError("prompt='': logit_lens needs a non-empty prompt (an empty one has no token to start "
                         "from); pass text such as 'The capital of France is'")
    if not _validate.layers(layers, model.n_layers):  # checked here: generate() takes no layers as valid
        raise ValueError(f"layers={layers!r}: the logit lens reads block outputs; expected 'all', a block index "
                         f"or a list of them (0-{model.n_layers - 1})")
    # top_k (at most the vocabulary) and the rest are checked by generate() before the engine runs.
    run = generate(model, [prompt], max_tokens=max_tokens, layers=layers, logits=False, top_k=top_k, **sampling)
    return Lens.from_run(run, 0, unembedding(model), k=top_k, tokenizer=model.tokenizer)


def _check_model(model) -> None:
    if getattr(model, "arch", None) is None or not hasattr(model, "n_layers"):
        raise TypeError(f"model={_validate._show(model)}: expected a model from nv.load(...)")


def _one_prompt(name: str, value: Any) -> str | list[dict]:
    if _chat.is_conversation(value):
        return _validate.conversation(value, name)
    if not isinstance(value, str):
        raise TypeError(f"{name}={_validate._show(value)}: expected one prompt (a non-empty str or a conversation)")
    if not value:
        raise ValueError(f"{name}='': expected a non-empty prompt (an empty one has no token to patch)")
    return value


def _single_token(tok, text: str | int, name: str, vocab_size: int | None = None, verb: str = "patching") -> int:
    """One token id from text (exactly one token) or an id in ``0..vocab_size-1``; ``verb`` names the
    analysis in the error."""
    if _validate._is_int(text):
        return _validate.token_id(name, text, vocab_size)
    if not isinstance(text, str):
        rng = "" if vocab_size is None else f" in 0..{vocab_size - 1}"
        raise TypeError(f"{name}={_validate._show(text)}: expected one token, as text (e.g. ' Paris') or an "
                        f"int token id{rng}")
    ids = tok.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        pieces = [tok.decode([i]) for i in ids]
        # Suggest a text that is one token (' ' + text is often two tokens itself).
        cands = [" " + text.strip(), text.strip()] + ([" " + pieces[0].strip(), pieces[0]] if pieces else [])
        good = next((c for c in cands if c.strip() and len(tok.encode(c, add_special_tokens=False)) == 1), None)
        hint = f"e.g. {good!r}" if good is not None else "often with a leading space"
        raise ValueError(
            f"{name}={text!r} is {len(ids)} tokens {pieces}; {verb} compares single tokens. "
            f"Pass one token ({hint}) or a token id."
        ) from None
    return ids[0]


def patch(
    model,
    clean: str,
    corrupt: str,
    answer: str | int,
    wrong: str | int,
    layers="all",
    positions="all",
    site: str = "resid",
    step: int = 0,
    progress=True,
    chat_template: str | None = None,
    chat_template_kwargs: dict | None = None,
) -> PatchResult:
    """Patch clean activations into the corrupt run, one (layer, position) at a time.

    For each cell the corrupt prompt runs with that block's ``site`` value at that position replaced
    by the clean prompt's, and the normalized logit difference ``answer - wrong`` of the first
    generated token is measured: 1 = clean behaviour restored, 0 = corrupt baseline. The clean and
    corrupt runs are one generation; the patched runs are batched generations of the corrupt prompt
    (64 per call), each carrying its own edit (:class:`~nnvllm.Edit` ``set`` at one layer and
    position, ``prompts=[k]``), made by the engine's worker hooks: the same for every model family
    nnvllm captures, including those vLLM runs through its Transformers backend.

    Args:
        model: from :func:`nnvllm.load`.
        clean: the prompt whose activations are copied: a str or a conversation (a list of
            ``{"role", "content"}`` messages, rendered with the chat template).
        corrupt: the prompt they are written into (same number of tokens as ``clean``).
        answer: the clean answer (one token, text or id).
        wrong: the competing token, typically the corrupt prompt's answer.
        layers: "all", an int or a list of blocks (negative counts from the end).
        positions: "all", an int or a list of prompt positions; or by the clean prompt's labels
            (:attr:`nnvllm.Run.roles`): "content" (every position but the chat template's), a role
            such as "user" or "system", or a list of roles.
        site: "resid" (block output), "attn" or "mlp" output.
        step: 0 patches prompt positions and measures the first generated token. ``step=s > 0``
            patches a generated step instead: both prompts generate greedily, the value at the
            position fed at decode step ``s`` (the clean run's) is written into the corrupt run at
            that step, and the logits of step ``s`` are measured; ``positions`` must stay "all".
        progress: show a progress bar while the patched runs go (True), not (False), or call
            ``progress(done, total)`` (cells) after each batch of them (a widget's bar).
        chat_template, chat_template_kwargs: how conversations are rendered (:func:`nnvllm.generate`).

    Returns:
        A :class:`~nnvllm.patching.PatchResult` (``effect`` ``[layer, pos]``, ``plot()``, ``to_frame()``).

    Example:
        >>> res = nv.patch(model, clean="The capital of France is", corrupt="The capital of Italy is",
        ...                answer=" Paris", wrong=" Rome")                          # doctest: +SKIP
    """
    from .capture import _context_len
    from .engine.transport import engine_of

    # Every argument is checked before the engine does any work: a bad step or token id would
    # otherwise fail only after the clean and corrupt generations, or after every patched pass.
    _check_model(model)
    if site not in ("resid", "attn", "mlp"):
        raise ValueError(f"site={site!r}; patch() writes 'resid', 'attn' or 'mlp' (same width as the stream)")
    clean, corrupt = _one_prompt("clean", clean), _one_prompt("corrupt", corrupt)
    step = _validate.integer("step", step, lo=0, expected="expected an int >= 0 (0 = the prompt, s = generated step s)")
    if not (isinstance(progress, bool) or callable(progress)):  # the check runs before any engine work
        raise TypeError(f"progress={progress!r}; expected True, False or a function progress(done, total)")
    engine = engine_of(model)  # a closed (or dead) engine says so here
    tok = model.tokenizer
    vocab = engine.info().get("vocab_size")
    a_id, w_id = _single_token(tok, answer, "answer", vocab), _single_token(tok, wrong, "wrong", vocab)
    if a_id == w_id:
        raise ValueError(
            f"answer={answer!r} and wrong={wrong!r} are the same token (id {a_id}); patching measures "
            "logit[answer] - logit[wrong], which would be 0 everywhere. Pass the clean prompt's answer and a "
            "competing token (typically the corrupt prompt's answer)."
        ) from None
    chat = {"chat_template": chat_template, "chat_template_kwargs": chat_template_kwargs}
    rendered = _chat.render_prompts(tok, [clean, corrupt], **chat)
    c_ids, x_ids = (list(r.ids) if r is not None else tok.encode(p) for p, r in zip((clean, corrupt), rendered))
    roles = list(rendered[0].roles) if rendered[0] is not None else _chat.plain_roles(tok, c_ids)
    positions = _chat.select_positions(roles, positions) or positions
    if len(c_ids) != len(x_ids):
        raise ValueError(
            f"clean has {len(c_ids)} tokens and corrupt {len(x_ids)}; patching position by position "
            "needs prompts of the same length. Change a word of the same token length."
        ) from None
    context = _context_len(model, engine)
    if context is not None and len(c_ids) + step + 1 > context:
        # step s is measured after s + 1 generated tokens: prompt + s + 1 must fit the context.
        top = context - len(c_ids) - 1
        fix = (f"expected step <= {top}" if top >= 0 else
               "no step fits: shorten the prompts (they alone fill the context)")
        raise ValueError(
            f"step={step}: the prompts are {len(c_ids)} tokens and the model's context is {context}, so "
            f"generated step s needs {len(c_ids)} + s + 1 <= {context} tokens; {fix}"
        ) from None
    if step and positions != "all":
        raise ValueError(
            f"positions={positions!r} with step={step}: a generated step has one position (the token fed "
            "at that step); leave positions='all'"
        )
    L, P = plan(model.n_layers, len(c_ids), layers, positions)
    if step:
        P = [len(c_ids) - 1 + step]
    base = generate(model, [clean, corrupt], max_tokens=step + 1, layers=L, ignore_eos=True,
                    sites=() if site == "resid" else (site,), **chat)
    clean_acts = (base.resid if site == "resid" else base.sites[site])[0]
    clean_diff = float(logit_diff(base.logits[0][step], a_id, w_id))
    corrupt_diff = float(logit_diff(base.logits[1][step], a_id, w_id))
    if clean_diff <= 0 or clean_diff <= corrupt_diff:
        # Normalized effects divide by (clean - corrupt): with the clean prompt not preferring the
        # answer (or not more than the corrupt one), every effect below is meaningless.
        warnings.warn(
            f"the clean prompt does not prefer answer={answer!r} over wrong={wrong!r}, or not more than the "
            f"corrupt prompt does (logit difference {clean_diff:.3f} clean, {corrupt_diff:.3f} corrupt), so the "
            "normalized effects are not meaningful. Check the tokens (a leading space is usually part of "
            "the token: ' Paris', not 'Paris').", UserWarning, stacklevel=2)
    seq = base.sequence(0)

    cells = [(j, layer, p) for j, layer in enumerate(L) for p in P]
    diffs = torch.zeros(len(cells))
    chunk = 64  # patched runs per call: bounded so a progress bar moves and memory stays flat
    bar = tqdm(total=len(cells), desc="patching", disable=progress is not True, leave=False)
    from .edits import Edit

    for start in range(0, len(cells), chunk):
        part = cells[start : start + chunk]
        # One batch of corrupt runs, each with its own edit (prompts=[k]): the clean value of the site
        # at that layer and position, made by the worker's hooks (nnvllm.edits) like any edit. For a
        # Llama-style block's stream the edit makes the whole stream the clean one. Step s > 0 patches
        # the position fed at that step (P holds it), so only that step's forward is touched.
        edits = [Edit.set(clean_acts[j, p], layers=[layer], site=site, positions=[p], prompts=[k])
                 for k, (j, layer, p) in enumerate(part)]
        run = generate(model, [corrupt] * len(part), max_tokens=step + 1, layers=None, ignore_eos=True, edits=edits,
                       **chat)
        for k in range(len(part)):
            diffs[start + k] = float(logit_diff(run.logits[k][step], a_id, w_id))
        bar.update(len(part))
        if callable(progress):
            progress(start + len(part), len(cells))
    bar.close()
    patched = diffs.view(len(L), len(P))
    return PatchResult(
        effect=normalized_effect(patched, clean_diff, corrupt_diff),
        patched_diff=patched,
        clean_diff=clean_diff,
        corrupt_diff=corrupt_diff,
        layers=L,
        positions=P,
        labels=[tok.decode([seq[p]]) for p in P],
        roles=[base.roles[0][p] for p in P],
        site=site,
        answer=tok.decode([a_id]),
        wrong=tok.decode([w_id]),
        step=step,
    )


def steering_vector(model, positive: Sequence[str], negative: Sequence[str], layer: int, *,
                    chat_template: str | None = None, chat_template_kwargs: dict | None = None) -> Tensor:
    """The mean difference of the residual stream after block ``layer`` at each prompt's last token,
    ``mean(positive) - mean(negative)`` (contrastive prompts): a direction for :meth:`Edit.add`.

    A prompt may be a conversation (a list of ``{"role", "content"}`` messages): its last token is
    then the chat template's generation prompt, rendered as :func:`nnvllm.generate` renders it
    (``chat_template``, ``chat_template_kwargs``).

    Example:
        >>> v = nv.steering_vector(model, ["The capital of Italy is"], ["The capital of France is"], layer=3)  # doctest: +SKIP
        >>> run = nv.generate(model, "The capital of France is", edits=[nv.Edit.add(v, layers=3, scale=2)])  # doctest: +SKIP
    """
    _check_model(model)
    for name, ps in (("positive", positive), ("negative", negative)):
        if isinstance(ps, str) or not ps or _chat.is_conversation(ps):
            raise ValueError(f"{name} must be a non-empty list of prompts (a conversation among them in a list "
                             "of its own)")
    # Checked here, in the user's own words: generate() would name its own argument, layers=[layer].
    n = model.n_layers
    layer = _validate.integer("layer", layer, lo=-n, hi=n - 1, expected=(
        f"expected one block index of this {n}-layer model, 0-{n - 1} (or -{n}..-1 from the end)"))
    run = generate(model, list(positive) + list(negative), max_tokens=1, layers=[layer], logits=False,
                   chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
    last = torch.stack([r[0, len(p) - 1].float() for r, p in zip(run.resid, run.prompt_ids)])
    return last[: len(positive)].mean(0) - last[len(positive):].mean(0)


def attribute(run, target: str | int, versus: str | int | None = None, *, weights=None):
    """Direct logit attribution over a generation: each head's, each MLP's and the embedding's share of
    ``logit[target] - logit[versus]`` at every generated step of every request.

    The run must hold every block's ``z`` and ``mlp`` (``nv.generate(model, prompts, sites=["z",
    "mlp"])``; families that norm each sublayer's output, Gemma 2/3 and OLMo 2, also ``"attn"``).
    At step ``s`` the stream at position ``prompt_len - 1 + s`` (the one whose logits drew token
    ``s``) is split into its components; each is read through the final norm frozen at that
    position's own scale and the unembedding of the two tokens (TransformerLens's convention; see
    :mod:`nnvllm.heads`). The terms sum to the logit difference the engine computed there (before a
    final soft-cap) up to fp32 rounding: :meth:`~nnvllm.heads.Attribution.total`.

    Where the run's engine still runs, the weights stay there: the engine carries the direction
    being read (the two tokens' unembedding through the final norm) back through each block's
    output projection, ``W_O[h]^T g`` per head, summed over tensor-parallel ranks in head order, and
    hands back those ``[layer, head, d_head]`` vectors with the bias and embedding terms
    (``CaptureWorker.nnvllm_readout``); the captured z, MLP outputs and stream are read with them
    here. For a run whose engine is closed (or a saved or transformers run) the weights are read
    from the run's checkpoint with transformers (cached; in the run's dtype), or from ``weights``.

    Args:
        run: a :class:`~nnvllm.results.Run` of :func:`nnvllm.generate` (or :func:`nnvllm.reference`).
        target: one token, as text (``" Paris"``) or an id.
        versus: the token it is compared with, or None for the target's logit alone.
        weights: a :class:`~nnvllm.heads.HeadWeights` to use instead of the checkpoint's.

    Returns:
        An :class:`~nnvllm.heads.Attribution`: per request ``heads [step, layer, head]``,
        ``mlp [step, layer]``, ``embed [step]``, the bias terms, and ``logit_diff [step]``.

    Example:
        >>> run = nv.generate(model, "The capital of France is", max_tokens=3, sites=["z", "mlp"])  # doctest: +SKIP
        >>> att = nv.attribute(run, target=" Paris", versus=" Rome")                             # doctest: +SKIP
        >>> att.top_heads(0, step=0)        # (layer, head, logit difference it adds)             # doctest: +SKIP
    """
    from .arch import arch_for
    from .engine.transport import engine_of
    from .heads import Attribution, HeadWeights, Readout, direction, logit_attribution, uncap
    from .lens import apply_norm
    from .results import Run

    if not isinstance(run, Run):
        raise TypeError(f"run={_validate._show(run)}: expected an nnvllm.Run from nv.generate(..., sites=['z', 'mlp'])")
    tok = getattr(run, "tokenizer", None)
    model = _live_engine(run) if weights is None else None
    if model is not None:  # the weights stay in the engine (see above)
        post = model.arch.heads.post_norms is not None
    elif weights is None:
        from .reference import load_reference

        hf, hf_tok = load_reference(str(run.meta.get("model")), str(run.meta.get("dtype", "float32")).removeprefix("torch."))
        arch = arch_for(hf.config.architectures)
        weights = HeadWeights.from_module(hf, arch, hf.config)
        tok = tok or hf_tok
        post = arch.heads.post_norms is not None
    elif not isinstance(weights, HeadWeights):
        raise TypeError(f"weights={_validate._show(weights)}: expected an nnvllm.heads.HeadWeights or None")
    else:
        post = weights.post_attn is not None
    need = ["z", "mlp"] + (["attn"] if post else [])
    missing = [s for s in need if s not in run.sites]
    L = weights.n_layers if model is None else model.n_layers
    if missing or run.resid is None or list(run.layers) != list(range(L)):
        raise ValueError(f"attribution needs every block's {need} and residual stream; this run has sites "
                         f"{list(run.sites)} at layers {run.layers}. Generate with sites={need} and layers='all'.")
    vocab = weights.unembed.shape[0] if model is None else engine_of(model).info()["vocab_size"]
    t_id = _single_token(tok, target, "target", vocab, "attribution") \
        if tok is not None or not isinstance(target, str) else None
    v_id = None if versus is None else _single_token(tok, versus, "versus", vocab, "attribution")
    if t_id is None:
        raise ValueError(f"target={target!r}: no tokenizer to read it with; pass a token id")
    if v_id == t_id:
        raise ValueError(f"target={target!r} and versus={versus!r} are the same token (id {t_id}); the difference "
                         "would be 0 everywhere. Pass two different tokens, or versus=None.")
    # The readout (the direction carried back through every block's weights) is made once per call;
    # each request is then read at its generated steps' positions, a contiguous range: views of the
    # captured tensors, nothing gathered or concatenated.
    n_heads = run.meta.get("attention", {}).get("n_heads")
    starts = [len(run.prompt_ids[i]) - 1 for i in range(len(run))]
    steps = [len(run.tokens[i]) for i in range(len(run))]
    where = [torch.arange(a, a + T) for a, T in zip(starts, steps)]
    rows = [t_id] + ([v_id] if v_id is not None else [])  # the two tokens' rows of weights.unembed
    if model is not None:  # one round trip: the engine reads its weights with the two tokens' direction
        ids = torch.cat([torch.tensor(run.sequence(i))[pos] for i, pos in enumerate(where)])
        got, weights = _engine_readout(model, t_id, v_id, ids, torch.cat(where))
        readout, g_bias = got["readout"], got["bias"]
        embed_dots = readout.embed.float()
        rows = list(range(len(rows)))
    else:
        if n_heads is None:  # a [layer, pos, heads, d_head] z carries its heads
            if run.sites["z"][0].ndim != 4:
                raise ValueError("this run does not say how many heads its z holds (meta['attention']); make it "
                                 "with nv.generate or nv.reference, which record it")
            n_heads = run.sites["z"][0].shape[-2]
        g, g_bias = direction(weights.unembed, weights.final_norm, t_id, v_id, weights.logit_scale,
                              weights.unembed_bias)
        readout = Readout.from_weights(weights, g, int(n_heads))
        embed_dots = torch.cat([weights.embedding(torch.tensor(run.sequence(i))[pos], pos).float() @ g
                                for i, pos in enumerate(where)])
    out: dict[str, list] = {k: [] for k in ("heads", "mlp", "attn_bias", "embed", "bias")}
    diffs = []
    off = 0
    for i, (a, T) in enumerate(zip(starts, steps)):
        z = run.sites["z"][i].narrow(1, a, T)
        if z.ndim == 3:  # [layer, pos, heads * d_head]
            z = z.unflatten(-1, (n_heads or readout.heads.shape[1], -1))
        resid = run.resid[i][-1].narrow(0, a, T).float()
        if run.logits is not None:
            lg = uncap(run.logits[i][:, [t_id] + ([v_id] if v_id is not None else [])], weights.soft_cap)
        else:  # the same quantity from the stream itself
            lg = apply_norm(resid, weights.final_norm) @ weights.unembed[rows].float().T
            if weights.unembed_bias is not None:
                lg = lg + weights.unembed_bias[rows].float()
            lg = lg * weights.logit_scale
        diffs.append((lg[:, 0] - (lg[:, 1] if v_id is not None else 0.0)).float())
        terms = logit_attribution(None, t_id, v_id, z=z, mlp=run.sites["mlp"][i].narrow(1, a, T), resid=resid,
                                  embed=None, attn=run.sites["attn"][i].narrow(1, a, T) if post else None,
                                  readout=dataclasses.replace(readout, embed=embed_dots[off: off + T]),
                                  final_norm=weights.final_norm, bias=g_bias)
        off += T
        for k in out:
            out[k].append(terms[k])
    out["logit_diff"] = diffs
    labels = tuple(None if x is None else (tok.decode([x]) if tok is not None else str(x)) for x in (t_id, v_id))
    return Attribution(target=t_id, versus=v_id, labels=labels, meta={"model": run.meta.get("model")}, **out)


def _live_engine(run):
    """The model whose engine made ``run``, while that engine runs (else None: the weights come from
    the checkpoint)."""
    ref = getattr(run, "engine_model", None)
    model = ref() if ref is not None else None
    if model is None:
        return None
    from .engine.transport import engine_of

    try:
        engine_of(model).info()
    except (RuntimeError, ConnectionError):  # closed or dead: the checkpoint still has the weights
        return None
    return model


def _engine_readout(model, target: int, versus: int | None, ids: Tensor, positions: Tensor):
    """The engine's readout of ``logit[target] - logit[versus]`` (``CaptureWorker.nnvllm_readout``): the
    :class:`~nnvllm.heads.Readout` (each TP rank's heads joined in head order; the embedding's and
    biases' terms summed over the ranks), with a stand-in :class:`~nnvllm.heads.HeadWeights` that holds
    the engine's final norm and the two tokens' unembedding rows (rows 0 and 1)."""
    from .engine.transport import engine_of
    from .heads import HeadWeights, Readout

    parts = engine_of(model).readout(target, versus, ids.tolist(), positions.tolist())
    first = parts[0]
    L = model.n_layers
    norm = lambda n: Norm(n["kind"], n["weight"], n["bias"], n["eps"])  # noqa: E731
    post = None if first["post"] is None else [tuple(norm(n) for n in pair) for pair in first["post"]]
    heads = torch.cat([p["heads"] for p in parts], dim=1)  # [layer, every head's d_head], in head order
    readout = Readout(heads=heads.view(L, -1, first["d_head"]), attn_bias=sum(p["attn_bias"] for p in parts),
                      mlp=first["mlp"] if first["mlp"] is not None else first["g"].expand(L, -1),
                      attn_norm_bias=first["attn_norm_bias"] if post else torch.zeros(L),
                      mlp_bias=first["mlp_bias"] if post else torch.zeros(L), post=post,
                      embed=sum(p["embed"] for p in parts))
    stand_in = HeadWeights(w_o=torch.empty(L, 0, 0), final_norm=norm(first["final_norm"]), unembed=first["rows"],
                           embed=torch.empty(0), unembed_bias=first["row_bias"], logit_scale=first["logit_scale"],
                           soft_cap=first["soft_cap"])
    return {"readout": readout, "bias": first["bias"]}, stand_in
