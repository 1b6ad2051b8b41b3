"""Capture a whole generation: every step's logits, the samples, every layer's activations.

The client side. What runs in the engine (taps that survive CUDA-graph replay, per-step row
placement, hand-off through shared memory) is :mod:`nnvllm.engine.worker`; how a call reaches the engine
(in-process or isolated) is :mod:`nnvllm.engine.transport`. This module validates the call, hands it to the
model's transport, and assembles a :class:`~nnvllm.Run` whose per-request tensors are views of the
few large buffers the worker handed over. It imports neither vLLM nor nnsight.
"""

from __future__ import annotations

import os
import time
import weakref
from typing import Sequence

import torch

from . import _validate
from . import chat as _chat
from .engine.heap import gc_delta, gc_pauses
from .engine.transport import CLIENT_TIMINGS, PROMPT_TAG, engine_of
from .results import Run, Samples

__all__ = ["generate"]

# The worker's account of the last call: collect-time breakdown (benchmarks) and placement counts
# (rows placed, prompt chunks), which the scheduling tests read.
_LAST_TIMINGS: dict[str, float] = {}
_LAST_STATS: dict[str, int] = {}

# ---------------------------------------------------------------- client side


def _size_hint(model, prompts: list, max_tokens: int, lens: list[int] | None = None) -> dict:
    """Rows and steps the worker's arena needs (exact prompt lengths when the tokenizer is at hand)."""
    n_prompt = sum(lens) if lens is not None else None
    if n_prompt is None:
        try:
            n_prompt = sum(len(ids) for ids in model.tokenizer(prompts)["input_ids"])
        except Exception:
            return {}
    return {"rows_hint": n_prompt + len(prompts) * max_tokens, "steps_hint": len(prompts) * max_tokens}


def _layers(spec, n_layers: int) -> list[int]:
    """``layers=`` as block indices (see :func:`nnvllm._validate.layers`)."""
    return _validate.layers(spec, n_layers)


def _prompts(prompts) -> list:
    """``prompts=`` as a list of non-empty str and conversations (see :func:`nnvllm._validate.prompts`)."""
    return _validate.prompts(prompts)


def _context_len(model, engine) -> int | None:
    """The engine's context length (``max_model_len``), or None where it is not at hand cheaply."""
    try:
        n = engine.info().get("max_model_len")  # an isolated engine reports it
        if n is None:
            n = model.llm.llm_engine.model_config.max_model_len  # in-process
    except Exception:  # noqa: BLE001  unknown: the engine checks it itself
        return None
    return int(n) if isinstance(n, int) and n > 0 else None


def _prompt_ids(model, prompts: list, rendered: list | None = None) -> list[list[int]] | None:
    """Token ids per prompt, as the engine would make them (None without a tokenizer): the model's
    tokenizer is the one vLLM resolved for the checkpoint, called as vLLM calls it (special tokens
    added, no truncation). ``rendered``: the conversations among ``prompts`` already rendered
    (:func:`nnvllm.chat.render_prompts`)."""
    tok = getattr(model, "tokenizer", None)
    if tok is None:
        return None
    if rendered is None:
        if not any(_chat.is_conversation(p) for p in prompts):
            try:
                return [list(ids) for ids in tok(prompts)["input_ids"]]
            except Exception:  # noqa: BLE001
                return None
        rendered = _chat.render_prompts(tok, prompts)
    try:
        text = [i for i, r in enumerate(rendered) if r is None]
        ids = dict(zip(text, tok([prompts[i] for i in text])["input_ids"])) if text else {}
        return [list(r.ids) if r is not None else list(ids[i]) for i, r in enumerate(rendered)]
    except Exception:  # noqa: BLE001
        return None


def _prompt_lens(model, prompts: list, rendered: list | None = None) -> list[int] | None:
    """Token count per prompt, as the engine will see it (None without a tokenizer); see :func:`_prompt_ids`."""
    ids = _prompt_ids(model, prompts, rendered)
    return None if ids is None else [len(x) for x in ids]


def generate(
    model,
    prompts: str | list[str],
    max_tokens: int = 10,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    layers="all",
    logits: bool = True,
    top_k: int = 5,
    sites: Sequence[str] = (),
    ignore_eos: bool = False,
    edits=None,
    saes=None,
    sae_k: int = 32,
    sae_dense: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: dict | None = None,
) -> Run:
    """Generate from ``prompts`` on the engine and capture logits, samples and activations.

    Args:
        model: from :func:`nnvllm.load`.
        prompts: one prompt or a list; each becomes one vLLM request, batched by the engine. A prompt
            is a str (tokenized as vLLM's ``LLM.generate`` does) or a conversation, a list of
            ``{"role", "content"}`` messages, rendered as vLLM's ``LLM.chat`` renders it
            (:mod:`nnvllm.chat`: the chat template with the generation prompt added); ``run.roles``
            labels every position (system, user, assistant, template).
        max_tokens: tokens to generate per prompt (one logits row each).
        temperature: 0 is greedy.
        top_p: nucleus sampling mass.
        seed: makes sampling reproducible: the same seed draws the same tokens. Each request draws
            with a seed of its own, derived from ``seed`` and its index in ``prompts``
            (:func:`nnvllm._validate.request_seed`: the same rule in :func:`nnvllm.stream`,
            :func:`nnvllm.collect` and :func:`nnvllm.reference`), so identical prompts give
            independent draws. A list of one seed per prompt is used as it is.
        layers: blocks whose output (the residual stream) to keep: "all", an int, a list, or None.
        logits: keep the ``[step, d_vocab]`` pre-sampling logits (samples are computed either way).
        top_k: how many alternatives :class:`~nnvllm.results.Samples` reports per step.
        sites: extra per-block sites to keep, from ``("attn", "mlp", "mlp_in", "mlp_act", "router")``,
            for the same ``layers``.
        ignore_eos: keep generating past the end-of-sequence token (a fixed number of steps).
        edits: :class:`~nnvllm.edits.Edit` s made while generating (steering, ablation, scaling; see
            :mod:`nnvllm.edits`), for every prompt; ``run.meta["edits"]`` records them.
        saes: :class:`~nnvllm.SAE` s (``nv.SAE.load(path, site=..., layer=...)``) to encode their
            site with inside the engine, at every position: ``run.features[s][i]`` is
            ``(ids [pos, k], values [pos, k])`` for SAE ``s`` and request ``i``, and
            ``run.sae_errors[s][i]`` the reconstruction error's norm per position. Only these leave
            the engine: pass ``layers=None`` to keep no residual stream beside them.
        sae_k: features kept per position (the most active, largest first).
        sae_dense: keep every feature (``run.features[s][i]`` is ``[pos, d_sae]``) instead of the top ``sae_k``.
        chat_template: for conversations: a Jinja template (or a template file's path) to render them
            with instead of the checkpoint's, as in vLLM's ``LLM.chat``.
        chat_template_kwargs: for conversations: the template's keywords, e.g. ``{"enable_thinking": False}``.

    Returns:
        A :class:`~nnvllm.results.Run`; ``run.resid[i]`` is ``[layer, pos, d_model]`` over the prompt
        and every generated token that was fed back.

    Example:
        >>> run = nv.generate(model, ["The capital of France is"], max_tokens=3)   # doctest: +SKIP
        >>> run.text[0], run.resid[0].shape                                        # doctest: +SKIP
        (' Paris.', torch.Size([6, 6, 64]))
    """
    t0, gc0 = time.perf_counter(), gc_pauses()
    CLIENT_TIMINGS.clear()
    req = _request(model, prompts, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                   layers=layers, logits=logits, top_k=top_k, sites=sites, ignore_eos=ignore_eos, edits=edits,
                   saes=saes, sae_k=sae_k, sae_dense=sae_dense, chat_template=chat_template,
                   chat_template_kwargs=chat_template_kwargs)
    t1 = time.perf_counter()
    outputs, handoff = req.engine.capture(req.prompts, req.params, req.spec)
    t2 = time.perf_counter()
    run = _assemble(model, req, outputs, handoff)
    _LAST_TIMINGS.update({f"client_{k}": v for k, v in CLIENT_TIMINGS.items()})
    _LAST_TIMINGS.update(client_request=t1 - t0, client_capture=t2 - t1, client_assemble=time.perf_counter() - t2)
    _LAST_TIMINGS.update(gc_delta(gc0, "client_"))
    return run


class _Request:
    """One validated call (generate or stream): what the engine gets and what assembling its Run needs."""

    def __init__(self, **kw) -> None:
        self.__dict__.update(kw)


def _request(model, prompts, *, max_tokens, temperature, top_p, seed, layers, logits, top_k, sites, ignore_eos,
             edits, stream: bool = False, saes=None, sae_k: int = 32, sae_dense: bool = False,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None) -> _Request:
    # Every argument is checked here, on the client: a bad value must never reach (and wedge) the engine.
    if getattr(model, "arch", None) is None or not hasattr(model, "n_layers"):
        raise TypeError(f"model={_validate._show(model)}: expected a model from nv.load(...)")
    prompts = _prompts(prompts)
    # Conversations are rendered here, once, for every verb: the engine gets their token ids (what
    # vLLM's LLM.chat hands it), and the run keeps their text and role labels.
    rendered = _chat.render_prompts(getattr(model, "tokenizer", None), prompts, chat_template=chat_template,
                                    chat_template_kwargs=chat_template_kwargs)
    checked = _validate.sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                 top_k=top_k, logits=logits, ignore_eos=ignore_eos, n_prompts=len(prompts))
    max_tokens, temperature, top_p, seed, top_k, logits, ignore_eos = (checked[k] for k in (
        "max_tokens", "temperature", "top_p", "seed", "top_k", "logits", "ignore_eos"))
    sites = _validate.sites(sites)
    model.arch.check_sites(sites)
    layer_ids = _layers(layers, model.n_layers)
    if sites and not layer_ids:
        raise ValueError(f"sites={list(sites)!r} needs layers (which blocks to read them at); got layers={layers!r}")
    engine = engine_of(model)  # a closed (or dead) engine says so here
    top_k = _validate.top_k_count(top_k, engine.info().get("vocab_size"))
    prompt_ids = _prompt_ids(model, prompts, rendered)
    prompt_lens = None if prompt_ids is None else [len(x) for x in prompt_ids]
    _validate.fits_context(prompt_lens, max_tokens, _context_len(model, engine))
    from . import edits as _edits
    from .engine.worker.crosshost import client_probe
    from .engine.worker.handoff import returned_files

    edit_list = _edits.resolve(edits, model.arch, model.n_layers, _edits.site_widths(model),
                               engine.info()["tp"] if edits else 1, n_prompts=len(prompts),
                               n_positions=None if prompt_lens is None else [n + max_tokens - 1 for n in prompt_lens],
                               d_head=(_edits.head_shape(model) or (None, None))[1])
    from .sae_group import resolve as _resolve_saes

    sae_specs = _resolve_saes(saes, model.arch, model.n_layers, _edits.site_widths(model), sae_k, sae_dense)
    arch = model.arch
    wanted = (("resid",) if layer_ids else ()) + sites
    params = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, ignore_eos=ignore_eos)
    seeds = _validate.request_seeds(seed, len(prompts))  # each request its own draw (_validate.request_seed)
    tagged = any(e.prompts is not None for e in edit_list)  # the worker tells prompts apart by this tag
    if seeds is not None or tagged:
        params = [dict(params, **({"seed": seeds[i]} if seeds is not None else {}),
                       **({"extra_args": {PROMPT_TAG: i}} if tagged else {})) for i in range(len(prompts))]
    spec = {"family": arch.family, "layers": list(layer_ids), "sites": list(wanted), "logits": bool(logits),
            "sample": {"temperature": float(temperature), "top_p": float(top_p), "k": int(top_k)},
            "client_pid": os.getpid(), "client_shm": client_probe(),  # where the hand-off can reach
            "edits": _edits.to_spec(edit_list), "stream": bool(stream),
            "returned": returned_files(),  # hand-off files of dropped Runs, for the engine to reuse
            "saes": sae_specs, **_sae_block_rows(sae_specs),
            **_size_hint(model, prompts, max_tokens, prompt_lens)}
    sampling = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, top_k=top_k,
                    ignore_eos=ignore_eos)
    chat = {k: v for k, v in (("chat_template", chat_template), ("chat_template_kwargs", chat_template_kwargs))
            if v is not None and any(r is not None for r in rendered)}
    # The engine gets token ids, tokenized here in one batch: vLLM would tokenize each prompt again
    # on its own, one call a prompt (0.4 ms each for the toy model on the 2-core CPU box, before the
    # first step of a call can run).
    engine_prompts = ([p if r is None else {"prompt_token_ids": list(r.ids)} for p, r in zip(prompts, rendered)]
                      if prompt_ids is None else [{"prompt_token_ids": ids} for ids in prompt_ids])
    return _Request(engine=engine, prompts=engine_prompts, sources=prompts, rendered=rendered, chat=chat,
                    params=params, spec=spec, layer_ids=layer_ids, wanted=wanted,
                    logits=logits, edit_list=edit_list, sampling=sampling,
                    saes=list(saes) if isinstance(saes, (list, tuple)) else [saes] if saes is not None else [],
                    sae_specs=sae_specs)


def _label(run: Run, req: _Request, i: int, rid: str, p_ids: list[int], toks: list[int]) -> None:
    """``run.roles[i]`` and ``run.prompt_text[i]``: the prompt's labels, then ``"assistant"`` for every
    generated token fed back."""
    r = req.rendered[i]
    if r is not None and list(r.ids) != list(p_ids):
        raise RuntimeError(f"request {rid}: the engine ran other prompt tokens than the conversation rendered "
                           "here; the client's tokenizer and the engine's differ")
    roles = list(r.roles) if r is not None else _chat.plain_roles(run.tokenizer, p_ids)
    run.roles.append(roles + ["assistant"] * max(len(toks) - 1, 0))
    run.prompt_text.append(r.text if r is not None else req.sources[i])


def _sae_block_rows(sae_specs) -> dict:
    """``NNVLLM_SAE_BLOCK_ROWS`` as this process sees it at the call, for the worker (whose process may
    have been started before the variable was set): rows the SAEs encode at once, 0 for each step."""
    value = os.environ.get("NNVLLM_SAE_BLOCK_ROWS")
    if not sae_specs or not value:
        return {}
    try:
        rows = int(value)
    except ValueError:
        rows = -1
    if rows < 0:
        raise ValueError(f"NNVLLM_SAE_BLOCK_ROWS={value!r}: expected a whole number of rows (0: encode "
                         "each step as it comes); unset it for the default")
    return {"sae_block_rows": rows}


def _describe(sae, spec: dict) -> dict:
    """What ``run.meta["saes"]`` records of one SAE (JSON: it is saved with the run)."""
    return {"site": sae.site, "layer": sae.layer, "architecture": sae.architecture, "d_in": sae.d_in,
            "d_sae": sae.d_sae, "hook_name": sae.hook_name, "path": spec["path"],
            "k": spec["k"], "dense": spec["k"] is None}


def _assemble(model, req: _Request, outputs: list[dict], handoff: dict | None) -> Run:
    """The Run of a finished (or stopped) call from the engine's outputs and the worker's hand-off."""
    info = req.engine.info()
    if handoff is None:
        raise RuntimeError("the engine returned no capture; was it restarted during the call?")
    if handoff.get("error"):
        raise RuntimeError(f"the capture failed inside the engine: {handoff['error']}")
    from .engine.worker.handoff import open_handover, taken_back

    taken_back(handoff.get("taken_back"))
    arenas = [open_handover(a, model) for a in handoff["arenas"]]
    _LAST_TIMINGS.clear()
    _LAST_TIMINGS.update(handoff.get("timings") or {})
    _LAST_STATS.clear()
    _LAST_STATS.update(handoff.get("stats") or {})
    # Internal request ids are the external id plus "-<8 random chars>" (vLLM >= 0.11).
    external = {o["request_id"] for o in outputs}
    by_external = {(rid if rid in external else rid.rsplit("-", 1)[0]): rec
                   for rid, rec in handoff["requests"].items()}
    layer_ids, wanted, logits = req.layer_ids, req.wanted, req.logits
    run = Run(prompts=req.sources, prompt_ids=[], tokens=[], text=[], logits=[] if logits else None,
              samples=[], resid=[] if layer_ids else None, layers=layer_ids,
              sites={s: [] for s in wanted if s != "resid"}, sampling=dict(req.sampling),
              meta=dict(engine="vllm", model=model.checkpoint, dtype=info["dtype"], tp=info["tp"],
                        **({"edits": [e.describe() for e in req.edit_list]} if req.edit_list else {}),
                        **({"saes": [_describe(x, sp) for x, sp in zip(req.saes, req.sae_specs)]} if req.saes else {}),
                        **(handoff.get("meta") or {}),  # the engine's attention spec, with q/k/v/z
                        **({"chat": dict(req.chat)} if req.chat else {})),
              features=[[] for _ in req.sae_specs], sae_errors=[[] for _ in req.sae_specs])
    run.tokenizer = getattr(model, "tokenizer", None)  # for labels (Run.plot); not saved with the run
    run.engine_model = weakref.ref(model)  # nv.attribute reads the weights there while it runs; not saved
    for out in outputs:
        rid = out["request_id"]
        rec = by_external.get(rid)
        if rec is None:
            raise RuntimeError(f"no capture arrived for request {rid}; was the engine restarted?")
        a = arenas[rec["arena"]]
        p_ids = out["prompt_token_ids"]
        toks = out["token_ids"]
        n_pos = len(p_ids) + len(toks) - 1
        if len(p_ids) != rec["plen"]:
            raise RuntimeError(f"request {rid}: the engine saw {rec['plen']} prompt tokens, the output {len(p_ids)}")
        run.prompt_ids.append(p_ids)
        run.tokens.append(toks)
        run.text.append(out["text"])
        _label(run, req, len(run.prompt_ids) - 1, rid, p_ids, toks)
        lo, T = rec["loff"], len(toks)
        run.samples.append(Samples(ids=torch.as_tensor(toks, dtype=torch.long), probs=a["_probs"][lo:lo + T],
                                   top_ids=a["_top_ids"][lo:lo + T], top_probs=a["_top_probs"][lo:lo + T],
                                   logprobs=a["_logprobs"][lo:lo + T] if "_logprobs" in a else None))
        if logits:
            run.logits.append(a["_logits"][lo:lo + T])
        for s in wanted:
            t = a[s][:, rec["off"]:rec["off"] + n_pos]  # a view: no copy per request
            (run.resid if s == "resid" else run.sites[s]).append(t)
        off = rec["off"]
        for j, spec in enumerate(req.sae_specs):  # views, as the sites; SAEs of one kind share a tensor
            g, m = handoff["sae_groups"][j]
            rows = slice(off, off + n_pos)
            run.features[j].append(a[f"_sae{g}_dense"][m, rows] if spec["k"] is None else
                                   (a[f"_sae{g}_ids"][m, rows], a[f"_sae{g}_values"][m, rows]))
            run.sae_errors[j].append(a[f"_sae{g}_error"][m, rows])
    return run

