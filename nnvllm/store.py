"""Runs larger than memory, on disk: collect activations in chunks, read them back lazily.

For activation datasets (sparse-autoencoder training, probing): :func:`collect` generates a long
list of prompts chunk by chunk under a memory budget and writes each chunk as one safetensors shard
as soon as it is produced; :func:`open` (or ``collect``'s return value) reads it back without
loading it: one request (``ds[i]``), or batches of rows of one site and layer across all shards
(``ds.iter_batches``).

A dataset is a directory::

    out/
      index.json                 settings, per-shard file name, request ids, sha256, per-request text
      shard-00000.safetensors    requests 0..k-1, concatenated along positions
      shard-00001.safetensors    ...

In a shard, ``resid`` is ``[layer, total_pos, d_model]`` (the shard's requests one after another
along ``pos``) and ``offsets`` ``[request + 1]`` says where each request starts; ``sites/<name>``
likewise. Per-step quantities (logits, see :func:`collect`'s ``logits=``) are concatenated along
``step`` with ``step_offsets``. ``ids`` ``[total_pos]`` holds the token id at each position (prompt,
then the fed-back generated ids), so every activation row knows its token. Few, large,
position-major tensors are what memory-mapping and row batches want.

Shards and ``index.json`` are written atomically (a temporary file, then a rename), and the index
is rewritten after every shard: an interrupted ``collect`` keeps every finished shard, and calling it
again with the same arguments resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ._validate import parse_bytes
from .results import Pieces, Run, atomic_write, file_digest, write_safetensors

__all__ = ["Dataset", "Record", "collect", "open", "parse_bytes", "write_shard"]

FORMAT = "nnvllm.dataset/1"
SHARD_FORMAT = "nnvllm.shard/1"
INDEX = "index.json"
LOGITS = ("none", "chosen", "top_k", "full")




# ---------------------------------------------------------------- writing one shard (pure)


def _policy(logits: str) -> str:
    if logits not in LOGITS:
        raise ValueError(f"logits={logits!r}; expected one of {list(LOGITS)}")
    return logits


def _cat(parts: list[Tensor], dim: int) -> Tensor:
    # torch.cat reads views (also non-contiguous ones into a shared buffer) and returns one new tensor.
    return torch.cat(parts, dim=dim) if parts else torch.zeros(0)


def _offsets(lengths: list[int]) -> Tensor:
    return torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)


def write_shard(run: Run, path: str | Path, request_ids: Sequence[int], logits_policy: str = "chosen",
                fsync: bool = True) -> dict:
    """Write ``run`` as one shard file at ``path`` (atomically) and return its index entry.

    Args:
        run: a :class:`~nnvllm.results.Run` (its tensors may be views; they are written from their memory).
        path: the shard file to write.
        request_ids: the dataset-wide index of each of ``run``'s requests.
        logits_policy: what to keep per generated step; see :func:`collect`.
        fsync: wait until the file is on the disk before returning (see :func:`collect`).

    Returns:
        ``{"file", "requests", "sha256", "bytes", "records"}``; ``records`` holds per request
        ``prompt, prompt_ids, tokens, text, positions, steps``.
    """
    policy = _policy(logits_policy)
    path = Path(path)
    n = len(run)
    ids = [int(i) for i in request_ids]
    if len(ids) != n:
        raise ValueError(f"request_ids has {len(ids)} entries for a run of {n} requests")
    positions = [run.positions(i) for i in range(n)]
    steps = [len(run.samples[i]) for i in range(n)]
    # Every tensor is written from the run's own memory (views into the engine's hand-off buffers),
    # piece by piece: no concatenated copy is made (see results.write_safetensors).
    tensors: dict[str, Pieces] = {
        "offsets": Pieces.of(_offsets(positions)),
        "ids": Pieces.of(torch.tensor([t for i in range(n) for t in run.sequence(i)], dtype=torch.int64)),
    }
    acts = {"resid": run.resid} if run.resid is not None else {}
    acts.update({f"sites/{s}": per for s, per in run.sites.items()})
    for key, per in acts.items():
        for i, t in enumerate(per):
            if t.shape[1] != positions[i]:
                raise ValueError(f"{key}[{i}] has {t.shape[1]} positions; prompt + fed-back tokens make "
                                 f"{positions[i]}")
        tensors[key] = Pieces.cat(list(per), dim=1)
    if policy != "none":
        tensors["step_offsets"] = Pieces.of(_offsets(steps))
    if policy == "chosen":
        lp = []
        for i, s in enumerate(run.samples):
            if s.logprobs is not None:  # the model's log-probability, computed by the engine
                lp.append(s.logprobs.float())
            elif run.logits is not None:  # the same, from the logits
                lp.append(torch.log_softmax(run.logits[i].float(), -1).gather(-1, s.ids[:, None].long())[:, 0])
            else:  # under the sampling distribution (temperature, top-p): only the same when greedy
                lp.append(s.probs.float().log())
        tensors["logprobs"] = Pieces.of(_cat(lp, dim=0))
    elif policy == "top_k":
        tensors["top_ids"] = Pieces.cat([s.top_ids for s in run.samples], dim=0)
        tensors["top_probs"] = Pieces.cat([s.top_probs for s in run.samples], dim=0)
    elif policy == "full":
        if run.logits is None:
            raise ValueError("logits_policy='full' needs a run with logits (nv.generate(..., logits=True))")
        tensors["logits"] = Pieces.cat(list(run.logits), dim=0)
    meta = {"requests": json.dumps(ids), "logits": policy, "layers": json.dumps(run.layers),
            "sites": json.dumps(list(acts)), "format": SHARD_FORMAT}
    sha = write_safetensors(path, tensors, meta, fsync=fsync)
    records = [{"prompt": run.prompts[i], "prompt_ids": list(run.prompt_ids[i]), "tokens": list(run.tokens[i]),
                "text": run.text[i], "positions": positions[i], "steps": steps[i]} for i in range(n)]
    return {"file": path.name, "requests": ids, "sha256": sha, "bytes": path.stat().st_size,
            "records": records}


# ---------------------------------------------------------------- chunk size from a memory budget


def _config_int(model, *names: str) -> int | None:
    cfg = getattr(model, "config", None)
    for name in names:
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None


def _prompt_tokens(model, prompts: list[str]) -> int:
    """Longest prompt in tokens among the first 1000 (the tokenizer if the model has one, else chars/2+1)."""
    sample = prompts[:1000]
    tok = getattr(model, "tokenizer", None)
    try:
        return max(len(x) for x in tok(sample)["input_ids"]) + 1  # +1: a BOS token some models add
    except Exception:  # noqa: BLE001 (no tokenizer, or an unusual one: the estimate is rough anyway)
        return max(len(p) // 2 + 1 for p in sample)


# Chunks held at once: the one the engine hands over and up to WRITERS being written.
WRITERS = 2
IN_FLIGHT = WRITERS + 1


def _request_bytes(*, prompt_tokens: int, max_tokens: int, pos_bytes: int, d_vocab: int) -> int:
    """Bytes one request holds in this process until its shard is written.

    ``pos_bytes`` is one position's activations over all captured layers and sites (a shard is
    written straight from them, no copy); ``d_vocab`` > 0 adds ``[step, d_vocab]`` logits (policy
    "full"; 4 bytes a value, an upper bound for a half-precision engine).
    """
    return (prompt_tokens + max_tokens) * pos_bytes + 4 * max_tokens * d_vocab


def _estimate_pos_bytes(model, n_layers: int, sites: Sequence[str], value_bytes: int = 4) -> int:
    """One position's bytes over ``n_layers`` and ``sites`` from the config's widths, ``value_bytes``
    a value (the engine's dtype; measured after the first chunk)."""
    d_model = _config_int(model, "hidden_size", "n_embd", "d_model") or 4096
    d_mlp = _config_int(model, "intermediate_size", "n_inner") or 4 * d_model
    width = {"resid": d_model, "attn": d_model, "mlp": d_model, "mlp_in": 2 * d_mlp, "mlp_act": d_mlp}
    return value_bytes * n_layers * sum(width.get(s, d_mlp) for s in ("resid", *sites))


def _engine_facts(model) -> tuple[int, int | None]:
    """(bytes a captured value takes, the scheduler's most requests at once) of ``model``'s engine;
    (4, None) where the engine does not say."""
    try:
        from .engine.transport import engine_of

        info = engine_of(model).info()
    except Exception:  # noqa: BLE001 (a stand-in model, a closed one: the estimate stays rough)
        return 4, None
    dtype = str(info.get("dtype", "")).removeprefix("torch.")
    value = {"float16": 2, "bfloat16": 2, "float32": 4}.get(dtype, 4)
    wave = info.get("max_num_seqs")
    return value, int(wave) if isinstance(wave, int) and wave > 0 else None


def _next_chunk(left: int, fits: int, wave: int | None) -> int:
    """Prompts in the next chunk: ``left`` to go, ``fits`` the most the budget allows, ``wave`` the
    most the engine's scheduler runs at once (``max_num_seqs``).

    A generate call costs about its step count, whatever its batch (the H200, lane K: 8 chunks of 128
    prompts took 9.32 s, 16 of 64 took 11.25 s for the same 1,024 prompts), and the requests past a
    wave wait for a whole second pass. So: whole waves when the budget holds at least one; otherwise
    as few chunks as the budget allows, of equal size (1,024 prompts at 283 a chunk: four of 256,
    not three of 283 and a fourth of 175).
    """
    fits = max(1, fits)
    if wave and fits >= wave:
        return min(left, fits - fits % wave)
    n = -(-left // fits)
    return -(-left // n)


def _pos_bytes(run: Run) -> int | None:
    """Measured: one position's activation bytes in ``run`` (None without activations)."""
    per = ([run.resid] if run.resid is not None else []) + list(run.sites.values())
    if not per or not len(run):
        return None
    return sum(p[0].shape[0] * p[0].shape[-1] * p[0].element_size() for p in per)


# ---------------------------------------------------------------- collect


def _settings_diff(old: dict, new: dict) -> list[str]:
    return [f"{k}: {old.get(k)!r} there, {new.get(k)!r} here" for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)]


def _write_index(out: Path, index: dict | str, fsync: bool = True) -> None:
    text = index if isinstance(index, str) else json.dumps(index, ensure_ascii=False)
    atomic_write(out / INDEX, lambda tmp: tmp.write_text(text), fsync=fsync)


def _read_index(out: Path) -> dict:
    p = out / INDEX
    try:
        index = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"no nnvllm dataset at {str(out)!r}: it has no {INDEX}; create one with "
                         "nnvllm.collect(model, prompts, out)") from None
    except (ValueError, UnicodeDecodeError):
        raise ValueError(f"{str(p)!r} is damaged: not JSON") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ValueError(f"{str(p)!r} is not an {FORMAT} index "
                         f"(format={index.get('format') if isinstance(index, dict) else None!r})")
    return index


def _layers_setting(layers) -> Any:
    if layers is None or isinstance(layers, str):
        return layers
    return [layers] if isinstance(layers, int) else [int(x) for x in layers]


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
) -> Dataset:
    """Generate from many prompts in chunks and write the activations to disk as they come.

    Each chunk is one :func:`nnvllm.generate` call and becomes one shard; nothing but the current
    chunk is held in memory. With ``seed`` (or greedy), results do not depend on the chunking:
    vLLM seeds each request on its own.

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
    ``memory_budget`` may change); different prompts or settings are refused.

    Args:
        model: from :func:`nnvllm.load`.
        prompts: the prompts, one request each (dataset index = position in this list).
        out: the dataset directory (created; must be empty or hold this same dataset).
        max_tokens: tokens per prompt, as for :func:`nnvllm.generate` (so are ``layers``, ``sites``,
            ``temperature``, ``top_p``, ``seed``, ``top_k`` and ``ignore_eos``).
        logits: the logits policy above.
        batch_size: prompts per chunk (and shard); None chooses it from ``memory_budget``.
        memory_budget: see above.
        progress: show a ``tqdm`` bar over requests.
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

    from .capture import generate

    policy = _policy(logits)
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or not all(isinstance(p, str) for p in prompts):
        raise TypeError(f"prompts must be a list of str (one request each), got {type(prompts).__name__}")
    if not prompts or not all(prompts):
        raise ValueError("prompts is empty or holds an empty string; every prompt needs at least one token")
    prompts = list(prompts)
    if batch_size is not None and (isinstance(batch_size, bool) or not isinstance(batch_size, int)
                                   or batch_size < 1):
        raise ValueError(f"batch_size={batch_size!r}; expected an int >= 1 or None (from memory_budget)")
    budget = parse_bytes(memory_budget)
    if isinstance(sites, str):
        sites = (sites,)
    settings = {
        "model": getattr(model, "checkpoint", None), "max_tokens": max_tokens, "layers": _layers_setting(layers),
        "sites": list(sites), "logits": policy, "temperature": temperature, "top_p": top_p, "seed": seed,
        "top_k": top_k, "ignore_eos": ignore_eos,
    }
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
        missing = [s["file"] for s in index["shards"] if not (out / s["file"]).is_file()]
        if missing:
            raise ValueError(f"out={str(out)!r} lacks shards its index lists: {missing}; pass a new out=")
        for stale in out.glob(".*.tmp"):  # left by a killed write (ours: see results.atomic_write)
            stale.unlink()
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
    # "chosen" comes from the engine (Samples.logprobs): only "full" ships the logits themselves.
    want_logits = policy == "full"
    d_vocab = _config_int(model, "vocab_size") or 2**17
    prompt_tokens = _prompt_tokens(model, prompts) if todo and batch_size is None else 0
    pos_bytes = None

    value_bytes, wave = _engine_facts(model) if todo and batch_size is None else (4, None)

    def chunk_size(left: int) -> int:
        if batch_size is not None:
            return batch_size
        n_layers = model.n_layers if layers == "all" else len(_layers_setting(layers) or [])
        pb = (pos_bytes or _estimate_pos_bytes(model, n_layers, sites, value_bytes)) if n_layers else 0
        each = _request_bytes(prompt_tokens=prompt_tokens, max_tokens=max_tokens, pos_bytes=pb,
                              d_vocab=d_vocab if want_logits else 0)
        return _next_chunk(left, budget // (IN_FLIGHT * max(each, 1)), wave)

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
    next_shard = 1 + max((int(m.group(1)) for e in index["shards"]
                          if (m := re.fullmatch(r"shard-(\d+)\.safetensors", e["file"]))), default=-1)
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
            run = generate(model, [prompts[i] for i in ids], max_tokens=max_tokens, temperature=temperature,
                           top_p=top_p, seed=seed, layers=layers, logits=want_logits, top_k=top_k,
                           sites=sites, ignore_eos=ignore_eos)
            if index["layers"] is None:
                acts = ({"resid": run.resid} if run.resid is not None else {}) | run.sites
                index.update(layers=run.layers, meta=run.meta,
                             widths={s: int(p[0].shape[-1]) for s, p in acts.items()},
                             dtype=str(next(iter(acts.values()))[0].dtype).removeprefix("torch.") if acts else None)
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
        prompt, prompt_ids, tokens, text: as in :class:`~nnvllm.results.Run`.
        ids: ``[pos]`` the token id at each position (prompt, then fed-back generated ids).
        resid: ``[layer, pos, d_model]``, or None if not collected.
        sites: ``{name: [layer, pos, width]}``.
        logprobs: ``[step]`` (logits policy "chosen"), else None.
        top_ids, top_probs: ``[step, k]`` (policy "top_k"), else None.
        logits: ``[step, d_vocab]`` (policy "full"), else None.
    """

    index: int
    prompt: str
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


class Dataset:
    """A dataset written by :func:`collect`, read lazily: only what is asked for leaves the disk.

    Attributes:
        path: the directory.
        settings: the arguments it was collected with (``max_tokens``, ``layers``, ``logits``, ...).
        layers: the block indices on the ``layer`` axis.
        sites: the activation sites stored (``"resid"`` first when collected).
        widths: ``{site: width}``.
        n_prompts: how many prompts the dataset is for; ``len(ds)`` of them are written.

    Example:
        >>> ds = nnvllm.store.open("acts/")                          # doctest: +SKIP
        >>> ds[0].resid.shape                                        # [layer, pos, d_model]  # doctest: +SKIP
        >>> next(ds.iter_batches("resid", layer=3, batch_rows=1024)).shape   # [1024, d_model]  # doctest: +SKIP
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
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
        return self.path / self._index["shards"][k]["file"]

    def __getitem__(self, i: int) -> Record:
        """Read request ``i`` (its slices of one shard only)."""
        from safetensors import safe_open

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
        with safe_open(str(self._shard(k)), framework="pt") as f:
            off = f.get_slice("offsets")[local:local + 2].tolist()
            a, b = off[0], off[1]
            acts = {s: f.get_slice("resid" if s == "resid" else f"sites/{s}")[:, a:b] for s in self.sites}
            extra = {}
            if policy != "none":
                sa, sb = f.get_slice("step_offsets")[local:local + 2].tolist()
                names = {"chosen": ["logprobs"], "top_k": ["top_ids", "top_probs"], "full": ["logits"]}[policy]
                extra = {name: f.get_slice(name)[sa:sb] for name in names}
            ids = f.get_slice("ids")[a:b]
        return Record(index=j, prompt=rec["prompt"], prompt_ids=rec["prompt_ids"], tokens=rec["tokens"],
                      text=rec["text"], ids=ids, resid=acts.pop("resid", None), sites=acts, **extra)

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
        from safetensors import safe_open

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
            with safe_open(str(self._shard(k)), framework="pt") as f:
                sl = f.get_slice(key)
                total = sl.get_shape()[1]
                a = 0
                while a < total:
                    b = min(total, a + batch_rows - have)
                    pending.append(sl[j, a:b])
                    have += b - a
                    a = b
                    if have == batch_rows:
                        yield pending[0] if len(pending) == 1 else torch.cat(pending)
                        pending, have = [], 0
        if have:
            yield torch.cat(pending)

    def verify(self) -> None:
        """Check every shard against the sha256 in the index (reads every byte).

        Raises:
            ValueError: naming each missing or damaged shard.
        """
        bad = []
        for s in self._index["shards"]:
            p = self.path / s["file"]
            if not p.is_file():
                bad.append(f"{s['file']} is missing")
            elif file_digest(p) != s["sha256"]:
                bad.append(f"{s['file']} is damaged (checksum mismatch)")
        if bad:
            raise ValueError(f"dataset {str(self.path)!r}: " + "; ".join(bad)
                             + ". Re-create it (collect into a new directory).")


def open(path: str | Path) -> Dataset:  # shadows the builtin inside this module: use Path methods here
    """Open the dataset :func:`collect` wrote at ``path`` (lazily: reads only ``index.json``)."""
    return Dataset(path)
