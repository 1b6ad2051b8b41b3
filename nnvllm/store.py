"""Runs larger than memory, on disk: collect activations in chunks, read them back lazily.

For activation datasets (sparse-autoencoder training, probing): :func:`collect` generates a long
list of prompts chunk by chunk under a memory budget and writes each chunk as one safetensors shard
as soon as it is produced; :func:`open` (or ``collect``'s return value) reads it back without
loading it: one request (``ds[i]``), or batches of rows of one site and layer across all shards
(``ds.iter_batches``). The directory's layout, writing a shard, the index and the chunk sizes are
:mod:`nnvllm.shards`.

Shards and ``index.json`` are written atomically (a temporary file, then a rename), and the index
is rewritten after every shard: an interrupted ``collect`` keeps every finished shard, and calling it
again with the same arguments resumes where it stopped, after checking the shards it has. Nothing
on disk is trusted: the index is checked when it is read (its keys and types, and that every shard
it names is a plain file name inside the folder), and each shard's size and sha256 when it is first
read (:class:`Dataset`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from . import _validate
from ._validate import parse_bytes
from .shards import (FORMAT, IN_FLIGHT, INDEX, LOGITS, SHARD_FORMAT, WRITERS, _config_int, _engine,
                     _estimate_pos_bytes, _facts, _index_facts, _next_chunk, _policy, _pos_bytes, _prompt_tokens,
                     _read_index, _request_bytes, _shard_problem, _write_index, write_shard)
from .shards import _drop_bad_shards, _layers_setting, _settings_diff
from .shards import _engine_facts  # noqa: F401  (read as store._engine_facts by the tests)

__all__ = ["FORMAT", "INDEX", "LOGITS", "SHARD_FORMAT", "Dataset", "Record", "collect", "open", "parse_bytes",
           "write_shard"]


# ---------------------------------------------------------------- collect


def collect(
    model,
    prompts: Sequence[str],
    out: str | Path,
    *,
    max_tokens: int = 10,
    layers="all",
    sites: Sequence[str] = (),
    logits: str = "chosen",
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    top_k: int = 5,
    ignore_eos: bool = False,
    batch_size: int | None = None,
    memory_budget: int | str = "4GB",
    progress: bool = True,
    fsync: bool = False,
    chat_template: str | None = None,
    chat_template_kwargs: dict | None = None,
    saes=None, sae_k: int = 32, sae_dense: bool = False,
    format: str = "nnvllm", context_size: int | None = None, dtype: str | None = None,
) -> Dataset:
    """Generate from many prompts in chunks and write the activations to disk as they come.

    Each chunk is one :func:`nnvllm.generate` call and becomes one shard; nothing but the current
    chunk is held in memory. With ``seed`` (or greedy), results do not depend on the chunking:
    each request draws with the seed of its index in ``prompts`` (the rule of
    :func:`nnvllm.generate`, :func:`nnvllm._validate.request_seed`), whatever chunk it falls in, so
    ``collect`` and one ``generate`` over all the prompts draw the same tokens.

    Logits policy (``logits=``), what is kept per generated step:

    - ``"none"``: nothing.
    - ``"chosen"`` (default): ``logprobs [step]``, the log-probability of the sampled token under
      the model (``log_softmax`` of the pre-sampling logits, temperature and top-p not applied).
    - ``"top_k"``: ``top_ids, top_probs [step, k]``, the ``top_k`` likeliest tokens under the
      sampling distribution (as :class:`~nnvllm.results.Samples` reports them).
    - ``"full"``: ``logits [step, d_vocab]`` (fp32; large: ``4 * d_vocab`` bytes a step).

    Memory budget: unless ``batch_size`` is given, a chunk holds as many prompts as fit in a third
    of ``memory_budget`` (an int of bytes or ``"4GB"``, ``"512MB"``, ``"2GiB"``): while the engine
    generates one chunk, the two before it may still be being written. A request is estimated at
    ``(prompt_tokens + max_tokens) * layers * sum(widths) * value_bytes`` (the engine's dtype; the
    first chunk shows the real widths; a shard is written straight from the run's memory)
    ``+ 4 * max_tokens * d_vocab`` with ``logits="full"``, ``prompt_tokens`` the longest of the first
    1000 prompts. At least one prompt per chunk. The engine's own transient buffers come on top:
    leave headroom. Within that, chunks are cut to cost the fewest generate steps: whole scheduler
    batches (``max_num_seqs``) when the budget holds one, else equal chunks (a generate call costs
    about its step count whatever its batch, so a small last chunk costs nearly a full one).

    Speed: each chunk's shard is written (and its sha256 taken) in background threads while the
    engine generates the next chunk, so a collection costs about the generation or the disk,
    whichever is slower, not their sum.

    Resume: ``out`` keeps every finished shard and an index of them. Calling ``collect`` again with
    the same prompts and settings skips the requests already written (``batch_size`` and
    ``memory_budget`` may change); different prompts or settings are refused. Each listed shard is
    checked first (its size and sha256: one read of every shard); a missing, truncated or damaged
    one is deleted with a warning and its requests are collected again.

    Every argument is checked before anything is written to ``out``; a ``memory_budget`` that holds
    less than one request at a time is refused (pass a larger one, or ``batch_size``).

    Several engines: ``model`` may be a list of engines of one checkpoint and dtype (isolated
    engines, or :class:`nnvllm.distributed.RayEngine` s on a Ray cluster). The prompts are then
    shared out among them, chunk by chunk to whichever is free, into ONE dataset of the same format;
    an engine lost mid-collect is dropped with a warning and its chunks are redone by the others
    (:mod:`nnvllm.distributed`). The seed rule above makes the result the same as one engine's.

    Args:
        model: from :func:`nnvllm.load`, or a list of engines (see above).
        prompts: the prompts, one request each (dataset index = position in this list): a str or a
            conversation (a list of ``{"role", "content"}`` messages; each record keeps its ``roles``).
        out: the dataset directory (created; must be empty or hold this same dataset).
        max_tokens: tokens per prompt, as for :func:`nnvllm.generate` (so are ``layers``, ``sites``,
            ``temperature``, ``top_p``, ``seed``, ``top_k`` and ``ignore_eos``).
        logits: the logits policy above.
        batch_size: prompts per chunk (and shard); None chooses it from ``memory_budget``.
        memory_budget: see above.
        progress: show a ``tqdm`` bar over requests.
        chat_template, chat_template_kwargs: how conversations are rendered (:func:`nnvllm.generate`).
        saes, sae_k, sae_dense: SAEs to encode with in the engine, as :func:`nnvllm.generate` takes them:
            each record's ``features`` and ``sae_errors`` (:mod:`nnvllm.sae_data`), per SAE.
        format: ``"nnvllm"`` (these shards) or ``"sae_lens"``: the activation cache sae-lens's trainer
            reads (:mod:`nnvllm.sae_cache`: a ``datasets`` folder, rows of ``context_size`` positions,
            a column per site and layer, in ``dtype``); it returns that ``datasets.Dataset``, in a new
            or empty ``out``, from one engine, without resume.
        fsync: wait for each shard to reach the disk before listing it in the index. Off by
            default: an interrupted or killed ``collect`` still keeps every listed shard complete
            (files are renamed into place once written), but after a power loss or an OS crash a
            listed shard may be incomplete (``Dataset.verify`` finds it; collect again into a new
            directory). On: survives those too, at the disk's write speed (1.5 GB/s measured on
            the H200 host's disk, against ~3 GB/s into the page cache).

    Returns:
        The :class:`Dataset` at ``out``.

    Example:
        >>> ds = nv.collect(model, prompts, "acts/", max_tokens=32, layers=[6], sites=["mlp_act"])  # doctest: +SKIP
        >>> for x in ds.iter_batches("mlp_act", layer=6, batch_rows=4096):  # [rows, d_mlp]  # doctest: +SKIP
        ...     sae_step(x)
    """
    from tqdm.auto import tqdm

    from .capture import _context_len, _prompt_lens, generate

    # Several engines (a list): checked alike here, then fanned out (nnvllm.distributed); the
    # arguments are checked against the first.
    engines = None
    if isinstance(model, (list, tuple)):
        from .distributed import check_engines

        engines = list(model)
        check_engines(engines)
        model = engines[0]
    # Every argument is checked before anything is written to ``out``: a bad value that reached the
    # index would be recorded as the dataset's setting, and the corrected call refused as "other settings".
    if getattr(model, "arch", None) is None or not hasattr(model, "n_layers"):
        raise TypeError(f"model={_validate._show(model)}: expected a model from nv.load(...)")
    policy = _policy(logits)
    if isinstance(prompts, str) or not isinstance(prompts, Sequence):
        raise TypeError(f"prompts must be a list of prompts (one request each: a str or a conversation), got "
                        f"{type(prompts).__name__}")
    prompts = _validate.prompts(prompts)
    from . import chat as _chat

    # Rendered here to measure them (and to refuse a bad conversation before anything is written).
    rendered = _chat.render_prompts(getattr(model, "tokenizer", None), prompts, chat_template=chat_template,
                                    chat_template_kwargs=chat_template_kwargs)
    chat = {k: v for k, v in (("chat_template", chat_template), ("chat_template_kwargs", chat_template_kwargs))
            if v is not None}
    checked = _validate.sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                 top_k=top_k, logits=False, ignore_eos=ignore_eos, n_prompts=len(prompts))
    max_tokens, temperature, top_p, seed, top_k, ignore_eos = (checked[k] for k in (
        "max_tokens", "temperature", "top_p", "seed", "top_k", "ignore_eos"))
    sites = _validate.sites(sites)
    model.arch.check_sites(sites)
    layer_ids = _validate.layers(layers, model.n_layers)
    if sites and not layer_ids:
        raise ValueError(f"sites={list(sites)!r} needs layers (which blocks to read them at); got layers={layers!r}")
    from . import sae_cache, sae_data

    described = sae_data.check(saes, model, sae_k, sae_dense)  # [] without SAEs
    context_size, dtype = sae_cache.check(format, context_size=context_size, dtype=dtype, saes=described, logits=policy,
                                          several=engines is not None, layers=layer_ids, sites=sites)
    if batch_size is not None:
        batch_size = _validate.integer("batch_size", batch_size, lo=1,
                                       expected="expected an int >= 1 or None (chosen from memory_budget)")
    budget = parse_bytes(memory_budget)
    progress, fsync = _validate.boolean("progress", progress), _validate.boolean("fsync", fsync)
    if not isinstance(out, (str, os.PathLike)):
        raise TypeError(f"out={_validate._show(out)}: expected a directory path (str or pathlib.Path)")
    engine = _engine(model)  # a closed (or dead) engine says so here
    info = engine.info() if engine is not None else {}
    top_k = _validate.top_k_count(top_k, info.get("vocab_size"))
    prompt_lens = _prompt_lens(model, prompts, rendered)  # every prompt must fit the context with max_tokens
    _validate.fits_context(prompt_lens, max_tokens, _context_len(model, engine) if engine is not None else None)
    settings = {
        "model": getattr(model, "checkpoint", None), "max_tokens": max_tokens, "layers": _layers_setting(layers),
        "sites": list(sites), "logits": policy, "temperature": temperature, "top_p": top_p, "seed": seed,
        "top_k": top_k, "ignore_eos": ignore_eos, **({"chat": chat} if chat else {}),
        **({"saes": described} if described else {}),
    }
    # "chosen" comes from the engine (Samples.logprobs): only "full" ships the logits themselves.
    want_logits = policy == "full"
    d_vocab = _config_int(model, "vocab_size") or 2**17
    prompt_tokens = (max(prompt_lens[:1000]) + 1 if prompt_lens else _prompt_tokens(model, prompts)) \
        if batch_size is None else 0  # +1: a BOS token some models add
    value_bytes, wave = _facts(info)
    pos_bytes = None

    def request_bytes() -> int:
        n_layers = len(layer_ids)
        pb = (pos_bytes or _estimate_pos_bytes(model, n_layers, sites, value_bytes)) if n_layers else 0
        pb += sae_data.pos_bytes(described)
        return max(1, _request_bytes(prompt_tokens=prompt_tokens, max_tokens=max_tokens, pos_bytes=pb,
                                     d_vocab=d_vocab if want_logits else 0))

    if batch_size is None and budget // IN_FLIGHT < request_bytes():
        least = IN_FLIGHT * request_bytes()
        raise ValueError(
            f"memory_budget={memory_budget!r} holds less than one request: one takes about "
            f"{request_bytes():,} bytes here (prompt {prompt_tokens} + {max_tokens} tokens x the captured "
            f"layers and sites), and {IN_FLIGHT} chunks are in memory at once (one generated, two being "
            f"written); pass memory_budget >= {least:,} (e.g. '{-(-least // 2**20)}MiB'), or batch_size=")

    def chunk_size(left: int, in_flight: int = IN_FLIGHT) -> int:
        if batch_size is not None:
            return batch_size
        return _next_chunk(left, budget // (in_flight * request_bytes()), wave)

    def kwargs_for(ids: list[int]) -> dict:
        """A chunk's generate arguments: each request draws with the seed of its place in the whole
        list, whatever the chunking (and whichever engine runs it)."""
        seeds = None if seed is None else [seed[i] if isinstance(seed, list) else _validate.request_seed(seed, i)
                                           for i in ids]
        return dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seeds, layers=layers,
                    logits=want_logits, top_k=top_k, sites=sites, ignore_eos=ignore_eos,
                    **({"saes": saes, "sae_k": sae_k, "sae_dense": sae_dense} if described else {}),
                    **(chat if any(rendered[i] is not None for i in ids) else {}))

    if format == "sae_lens":
        def run_chunk(ids: list[int]):
            return generate(model, [prompts[i] for i in ids], **kwargs_for(ids))

        return sae_cache.write(out, len(prompts), run_chunk, chunk_size, layer_ids, sites, context_size=context_size,
                               dtype=dtype, settings=settings, progress=progress)
    out = Path(out)
    digest = hashlib.sha256(json.dumps(prompts, ensure_ascii=False).encode()).hexdigest()
    if (out / INDEX).exists():
        index = _read_index(out)
        diff = _settings_diff(index["settings"], settings)
        if diff:
            raise ValueError(f"out={str(out)!r} holds a dataset collected with other settings ("
                             + "; ".join(diff) + "). Call again with the same settings to resume, or "
                             "pass a new out=.")
        if index["n_requests"] != len(prompts) or index["prompts_sha256"] != digest:
            raise ValueError(f"out={str(out)!r} holds a dataset of {index['n_requests']} other prompts "
                             f"(this call has {len(prompts)}). Pass the same prompts to resume, or a new out=.")
        for stale in out.glob(".*.tmp"):  # left by a killed write (ours: see results.atomic_write)
            stale.unlink()
        _drop_bad_shards(out, index, fsync)
    else:
        if out.exists() and (not out.is_dir() or any(not (p.name.startswith(".") and p.suffix == ".tmp")
                                                     for p in out.iterdir())):
            raise ValueError(f"out={str(out)!r} exists and is not an nnvllm dataset (no {INDEX}); "
                             "pass a new or empty directory")
        out.mkdir(parents=True, exist_ok=True)
        index = {"format": FORMAT, "settings": settings, "n_requests": len(prompts), "prompts_sha256": digest,
                 "layers": None, "widths": None, "dtype": None, "meta": None, "shards": []}
        _write_index(out, index)

    done = {r for s in index["shards"] for r in s["requests"]}
    todo = [i for i in range(len(prompts)) if i not in done]

    next_shard = 1 + max((int(m.group(1)) for e in index["shards"]
                          if (m := re.fullmatch(r"shard-(\d+)\.safetensors", e["file"]))), default=-1)
    if engines is not None:
        from .distributed import fan_out

        fan_out(engines, prompts, index=index, todo=todo, out=out, chunk_size=chunk_size, kwargs_for=kwargs_for,
                next_shard=next_shard, policy=policy, fsync=fsync, progress=progress)
        return Dataset(out)

    # The engine generates chunk k + 1 while chunk k is written: shards are written in background
    # threads (at most WRITERS at once; the writer releases the GIL), and the index lists a shard
    # once its file is complete, in order.
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(WRITERS, thread_name_prefix="nnvllm-shard")
    # The index is rewritten after every shard, in order, by its own thread: renaming a file on a
    # disk busy with gigabytes of writes took 1.75 s over a 1,024-prompt run on the H200 host, time
    # the engine would otherwise wait.
    indexer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nnvllm-index")
    index_writes: list[concurrent.futures.Future] = []
    pending: list[tuple[concurrent.futures.Future, int]] = []
    bar = tqdm(total=len(prompts), initial=len(done), disable=not progress, unit="req", desc="collect")

    def finish_oldest() -> None:
        fut, n = pending.pop(0)
        index["shards"].append(fut.result())
        index_writes.append(indexer.submit(_write_index, out, json.dumps(index, ensure_ascii=False), fsync))
        bar.update(n)

    try:
        start = 0
        while start < len(todo):
            ids = todo[start:start + chunk_size(len(todo) - start)]
            run = generate(model, [prompts[i] for i in ids], **kwargs_for(ids))
            if index["layers"] is None:
                index.update(_index_facts(run))
            pos_bytes = _pos_bytes(run) or pos_bytes
            prompt_tokens = max(prompt_tokens, *(len(p) for p in run.prompt_ids))
            while len(pending) >= WRITERS:
                finish_oldest()
            name = f"shard-{next_shard:05d}.safetensors"  # never a listed shard's name, even after a gap
            next_shard += 1
            pending.append((pool.submit(write_shard, run, out / name, ids, policy, fsync), len(ids)))
            del run  # the writer holds it until its shard is written
            start += len(ids)
        while pending:
            finish_oldest()
    finally:
        # On an error or an interrupt: every shard already being written is finished and indexed
        # (an interrupted collect keeps them), then the error goes on.
        while pending:
            try:
                finish_oldest()
            except BaseException:  # noqa: BLE001  a failed write: its shard is simply not listed
                pass
        pool.shutdown(wait=True)
        indexer.shutdown(wait=True)  # the index on disk lists every finished shard before we return
        bar.close()
    for f in index_writes:
        f.result()  # a failed index write is an error
    return Dataset(out)


# ---------------------------------------------------------------- reading


@dataclass(frozen=True)
class Record:
    """One request of a :class:`Dataset`, read from its shard.

    Attributes:
        index: the request's position in the prompts given to :func:`collect`.
        prompt, prompt_ids, tokens, text: as in :class:`~nnvllm.results.Run` (``prompt``: a str or a
            conversation).
        ids: ``[pos]`` the token id at each position (prompt, then fed-back generated ids).
        resid: ``[layer, pos, d_model]``, or None if not collected.
        sites: ``{name: [layer, pos, width]}``.
        logprobs: ``[step]`` (logits policy "chosen"), else None.
        top_ids, top_probs: ``[step, k]`` (policy "top_k"), else None.
        logits: ``[step, d_vocab]`` (policy "full"), else None.
        roles: one label per position (:attr:`nnvllm.Run.roles`), or None (a dataset written without them).
        prompt_text: the text the model read (a conversation rendered by its template), or None.
        features, sae_errors: per SAE of ``collect(saes=...)``, as :attr:`nnvllm.Run.features` and
            :attr:`nnvllm.Run.sae_errors` hold one request's (``[]`` without SAEs).
    """

    index: int
    prompt: str | list[dict]
    prompt_ids: list[int]
    tokens: list[int]
    text: str
    ids: Tensor
    resid: Tensor | None
    sites: dict[str, Tensor] = field(default_factory=dict)
    logprobs: Tensor | None = None
    top_ids: Tensor | None = None
    top_probs: Tensor | None = None
    logits: Tensor | None = None
    roles: list[str] | None = None
    prompt_text: str | None = None
    features: list = field(default_factory=list)
    sae_errors: list = field(default_factory=list)


class Dataset:
    """A dataset written by :func:`collect`, read lazily: only what is asked for leaves the disk.

    Attributes:
        path: the directory.
        settings: the arguments it was collected with (``max_tokens``, ``layers``, ``logits``, ...).
        layers: the block indices on the ``layer`` axis.
        sites: the activation sites stored (``"resid"`` first when collected).
        widths: ``{site: width}``.
        n_prompts: how many prompts the dataset is for; ``len(ds)`` of them are written.

    Reads are checked: the first time this object reads a shard, the shard's size and sha256 are
    compared with the index, and a damaged shard raises a ``ValueError`` naming it instead of
    returning wrong numbers. That costs one pass over the shard's file, once: sha256 of a cached
    1 GiB file took 0.84-1.25 s on the 2-core CPU box, against milliseconds for one ``ds[i]``.
    ``check=False`` skips the sha256 (the size is still compared): reads are then unchecked, and
    :meth:`verify` checks every shard at once.

    Example:
        >>> ds = nnvllm.store.open("acts/")                          # doctest: +SKIP
        >>> ds[0].resid.shape                                        # [layer, pos, d_model]  # doctest: +SKIP
        >>> next(ds.iter_batches("resid", layer=3, batch_rows=1024)).shape   # [1024, d_model]  # doctest: +SKIP
    """

    def __init__(self, path: str | Path, *, check: bool = True) -> None:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(f"path={_validate._show(path)}: expected a dataset directory (str or pathlib.Path)")
        self.path = Path(path)
        self.check = _validate.boolean("check", check)
        self._checked: set[int] = set()  # shards whose file matched the index (this object)
        self._lock = threading.Lock()
        index = _read_index(self.path)
        self._index = index
        self.settings: dict = index["settings"]
        self.layers: list[int] = index["layers"] or []
        self.widths: dict[str, int] = index["widths"] or {}
        self.sites: list[str] = list(self.widths)
        self.n_prompts: int = index["n_requests"]
        self._where: dict[int, tuple[int, int]] = {
            r: (k, j) for k, s in enumerate(index["shards"]) for j, r in enumerate(s["requests"])
        }

    def __len__(self) -> int:
        """Number of requests written (``n_prompts`` once :func:`collect` finished)."""
        return len(self._where)

    @property
    def complete(self) -> bool:
        """Whether every prompt has been collected."""
        return len(self) == self.n_prompts

    def __repr__(self) -> str:
        return (f"<nnvllm Dataset {str(self.path)!r}: {len(self)}/{self.n_prompts} requests, "
                f"{len(self._index['shards'])} shards, sites {self.sites}, layers {self.layers}, "
                f"logits {self.settings['logits']!r}>")

    def _shard(self, k: int) -> Path:
        """Shard ``k``'s file, checked against the index the first time (see the class)."""
        entry = self._index["shards"][k]
        path = self.path / entry["file"]
        if k not in self._checked:
            with self._lock:
                if k not in self._checked:
                    why = _shard_problem(path, entry, checksum=self.check)
                    if why is not None:
                        raise ValueError(f"dataset shard {str(path)!r} {why}; its requests "
                                         f"{_span(entry['requests'])} cannot be read. ds.verify() checks every shard; "
                                         "collect again with the same arguments to redo it.")
                    self._checked.add(k)
        return path

    @contextlib.contextmanager
    def _open(self, k: int):
        """safe_open of shard ``k``; a read that fails names the file."""
        from safetensors import SafetensorError, safe_open

        path = self._shard(k)
        try:
            with safe_open(str(path), framework="pt") as f:
                yield f
        except (SafetensorError, OSError, KeyError, RuntimeError) as e:  # a damaged header, a missing tensor
            raise ValueError(f"dataset shard {str(path)!r} cannot be read ({type(e).__name__}: {e}); ds.verify() "
                             "checks every shard; collect again with the same arguments to redo a damaged one.") from None

    def __getitem__(self, i: int) -> Record:
        """Read request ``i`` (its slices of one shard only)."""
        if isinstance(i, bool) or not isinstance(i, int):
            raise TypeError(f"dataset index must be an int, got {type(i).__name__}")
        n = len(self)
        j = i + n if i < 0 else i
        if j not in self._where:
            more = "" if self.complete else f"; {self.n_prompts - n} prompts not collected yet (resume collect)"
            raise IndexError(f"request {i} out of range for a dataset of {n} requests (0-{n - 1}){more}")
        k, local = self._where[j]
        rec = self._index["shards"][k]["records"][local]
        policy = self.settings["logits"]
        with self._open(k) as f:
            off = f.get_slice("offsets")[local:local + 2].tolist()
            a, b = off[0], off[1]
            # Copies: safetensors' slices view the memory-mapped file, and a view of a file that is
            # later truncated in place kills the process (SIGBUS) when it is touched.
            acts = {s: f.get_slice("resid" if s == "resid" else f"sites/{s}")[:, a:b].clone() for s in self.sites}
            extra = {}
            if policy != "none":
                sa, sb = f.get_slice("step_offsets")[local:local + 2].tolist()
                names = {"chosen": ["logprobs"], "top_k": ["top_ids", "top_probs"], "full": ["logits"]}[policy]
                extra = {name: f.get_slice(name)[sa:sb].clone() for name in names}
            ids = f.get_slice("ids")[a:b].clone()
            if self.settings.get("saes"):
                from .sae_data import read

                extra["features"], extra["sae_errors"] = read(f, a, b, self.settings["saes"])
        return Record(index=j, prompt=rec["prompt"], prompt_ids=rec["prompt_ids"], tokens=rec["tokens"],
                      text=rec["text"], ids=ids, resid=acts.pop("resid", None), sites=acts, **extra,
                      roles=rec.get("roles"), prompt_text=rec.get("prompt_text"))

    def iter_batches(self, site: str = "resid", *, layer: int, batch_rows: int = 4096) -> Iterator[Tensor]:
        """Yield ``[rows, width]`` batches of one site at one layer, over every position of every request.

        Rows come in dataset order (request by request, position by position), ``batch_rows`` at a
        time (the last batch may be shorter); only one batch is read into memory at a time. Shuffle
        downstream if training needs it.

        Args:
            site: ``"resid"`` or a site collected with ``sites=``.
            layer: a block index in :attr:`layers`.
            batch_rows: rows per batch.
        """
        if site not in self.sites:
            raise ValueError(f"site={site!r} was not collected; this dataset has {self.sites}")
        if layer not in self.layers:
            raise ValueError(f"layer={layer!r} was not collected; this dataset has layers {self.layers}")
        if isinstance(batch_rows, bool) or not isinstance(batch_rows, int) or batch_rows < 1:
            raise ValueError(f"batch_rows={batch_rows!r}; expected an int >= 1")
        j = self.layers.index(layer)
        key = "resid" if site == "resid" else f"sites/{site}"
        pending: list[Tensor] = []
        have = 0
        for k in range(len(self._index["shards"])):
            with self._open(k) as f:
                sl = f.get_slice(key)
                total = sl.get_shape()[1]
                a = 0
                while a < total:
                    b = min(total, a + batch_rows - have)
                    pending.append(sl[j, a:b])
                    have += b - a
                    a = b
                    if have == batch_rows:
                        yield pending[0].clone() if len(pending) == 1 else torch.cat(pending)  # (copies: see above)
                        pending, have = [], 0
        if have:
            yield torch.cat(pending)

    def verify(self) -> None:
        """Check every shard against the size and sha256 in the index (reads every byte).

        Raises:
            ValueError: naming each missing or damaged shard.
        """
        bad = []
        for k, e in enumerate(self._index["shards"]):
            why = _shard_problem(self.path / e["file"], e)
            if why is None:
                self._checked.add(k)
            else:
                bad.append(f"{e['file']} {why}")
        if bad:
            raise ValueError(f"dataset {str(self.path)!r}: " + "; ".join(bad)
                             + ". Collect again with the same arguments to redo them.")


def open(path: str | Path, *, check: bool = True) -> Dataset:  # shadows the builtin here: use Path methods
    """Open the dataset :func:`collect` wrote at ``path`` (lazily: reads only ``index.json``).

    ``check``: compare each shard's sha256 with the index when it is first read (see :class:`Dataset`)."""
    return Dataset(path, check=check)


def _span(ids: list[int]) -> str:
    """Request indices, short: ``0-63`` for a run of them."""
    return f"{ids[0]}-{ids[-1]}" if ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 1 else str(ids)
