"""What a dataset is on disk: shards, the index that lists them, and how many requests a shard holds.

A dataset is a directory (written by :func:`nnvllm.collect`, read by :class:`nnvllm.store.Dataset`)::

    out/
      index.json                 settings, per-shard file name, request ids, sha256, per-request text
      shard-00000.safetensors    requests 0..k-1, concatenated along positions
      shard-00001.safetensors    ...

In a shard, ``resid`` is ``[layer, total_pos, d_model]`` (the shard's requests one after another
along ``pos``) and ``offsets`` ``[request + 1]`` says where each request starts; ``sites/<name>``
likewise, and with SAEs their features per position (:mod:`nnvllm.sae_data`). Per-step quantities
(logits, see :func:`nnvllm.collect`'s ``logits=``) are concatenated along ``step`` with
``step_offsets``. ``ids`` ``[total_pos]`` holds the token id at each position (prompt, then the
fed-back generated ids), so every activation row knows its token. Few, large, position-major
tensors are what memory-mapping and row batches want.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from . import _validate
from .results import Pieces, Run, atomic_write, file_digest, write_safetensors

__all__ = ["FORMAT", "INDEX", "LOGITS", "SHARD_FORMAT", "write_shard"]

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
    if run.features:  # per SAE of collect(saes=...): positions one after another, as the activations
        from .sae_data import shard_tensors

        tensors.update(shard_tensors(run, positions))
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
                "text": run.text[i], "positions": positions[i], "steps": steps[i],
                **({"roles": list(run.roles[i])} if i < len(run.roles) else {}),
                **({"prompt_text": run.prompt_text[i]} if i < len(run.prompt_text) else {})} for i in range(n)]
    return {"file": path.name, "requests": ids, "sha256": sha, "bytes": path.stat().st_size,
            "records": records}



# ---------------------------------------------------------------- the index


def _index_facts(run: Run) -> dict:
    """What the index records of a dataset's first chunk: layers, widths, dtype, the run's meta."""
    acts = ({"resid": run.resid} if run.resid is not None else {}) | run.sites
    return {"layers": run.layers, "meta": run.meta, "widths": {s: int(p[0].shape[-1]) for s, p in acts.items()},
            "dtype": str(next(iter(acts.values()))[0].dtype).removeprefix("torch.") if acts else None}


def _write_index(out: Path, index: dict | str, fsync: bool = True) -> None:
    text = index if isinstance(index, str) else json.dumps(index, ensure_ascii=False)
    atomic_write(out / INDEX, lambda tmp: tmp.write_text(text), fsync=fsync)


def _read_index(out: Path) -> dict:
    p = out / INDEX
    if out.exists() and not out.is_dir():
        raise ValueError(f"{str(out)!r} is a file, not a dataset: a dataset is the directory nnvllm.collect "
                         f"wrote (it holds {INDEX} and the shards); pass that directory")
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
    problem = _index_problem(index)
    if problem:
        raise ValueError(f"{str(p)!r} is damaged: {problem}. Re-create the dataset (collect into a new directory).")
    return index


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _safe_name(name) -> bool:
    """A shard's file name as the index lists it: a plain name inside the dataset folder (no folder
    part, not absolute, not "." or ".."), so a crafted index cannot make a read leave the folder."""
    return (isinstance(name, str) and bool(name) and name not in (".", "..") and "/" not in name
            and "\\" not in name and "\0" not in name and not Path(name).is_absolute() and Path(name).name == name)


def _index_problem(index: dict) -> str | None:
    """What is wrong with a parsed index (its keys, types and shard entries), or None."""
    settings, n, shards = index.get("settings"), index.get("n_requests"), index.get("shards")
    if not isinstance(settings, dict) or settings.get("logits") not in LOGITS:
        return f"settings={_validate._show(settings)} (expected the collect settings, logits one of {list(LOGITS)})"
    if not _is_int(n) or n < 0:
        return f"n_requests={_validate._show(n)} (expected an int >= 0)"
    layers, widths = index.get("layers"), index.get("widths")
    if layers is not None and (not isinstance(layers, list) or not all(_is_int(x) for x in layers)):
        return f"layers={_validate._show(layers)} (expected a list of block indices)"
    if widths is not None and (not isinstance(widths, dict) or not all(
            isinstance(k, str) and _is_int(v) and v > 0 for k, v in widths.items())):
        return f"widths={_validate._show(widths)} (expected {{site: width}})"
    if not isinstance(shards, list):
        return f"shards={_validate._show(shards)} (expected a list)"
    seen: set[int] = set()
    for k, e in enumerate(shards):
        if not isinstance(e, dict):
            return f"shards[{k}]={_validate._show(e)} (expected an entry with file, requests, records, sha256, bytes)"
        if not _safe_name(e.get("file")):
            return (f"shards[{k}].file={_validate._show(e.get('file'))} is not a file name inside the dataset "
                    "folder (a folder part, an absolute path or '..')")
        reqs, recs = e.get("requests"), e.get("records")
        if not isinstance(reqs, list) or not reqs or not all(_is_int(r) and 0 <= r < n for r in reqs):
            return f"shards[{k}].requests={_validate._show(reqs)} (expected request indices in 0..{n - 1})"
        if seen.intersection(reqs) or len(set(reqs)) != len(reqs):
            return f"shards[{k}] lists requests another entry lists too"
        seen.update(reqs)
        if not isinstance(recs, list) or len(recs) != len(reqs) or not all(
                isinstance(r, dict) and isinstance(r.get("prompt"), (str, list)) and isinstance(r.get("text"), str)
                and isinstance(r.get("prompt_ids"), list) and isinstance(r.get("tokens"), list) for r in recs):
            return f"shards[{k}].records (expected one record per request: prompt, prompt_ids, tokens, text)"
        if not isinstance(e.get("sha256"), str) or not _is_int(e.get("bytes")) or e["bytes"] < 0:
            return f"shards[{k}] (expected its sha256 and its size in bytes)"
    return None


def _shard_problem(path: Path, entry: dict, checksum: bool = True) -> str | None:
    """What is wrong with the shard file at ``path`` against its index ``entry`` (its size, and
    with ``checksum`` its sha256), or None."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return "is missing"
    except OSError as e:
        return f"cannot be read ({e.strerror or e})"
    if not path.is_file():
        return "is not a file"
    if size != entry["bytes"]:
        return f"is {size:,} bytes where the index lists {entry['bytes']:,} (truncated or replaced)"
    if checksum:
        try:
            if file_digest(path) != entry["sha256"]:
                return "is damaged (checksum mismatch)"
        except OSError as e:
            return f"cannot be read ({e.strerror or e})"
    return None


# ---------------------------------------------------------------- resuming a collection


def _settings_diff(old: dict, new: dict) -> list[str]:
    return [f"{k}: {old.get(k)!r} there, {new.get(k)!r} here" for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)]


def _drop_bad_shards(out: Path, index: dict, fsync: bool) -> None:
    """On resume: every listed shard is checked (size and sha256: one read of each); a missing or
    damaged one is removed with its index entry, so that its requests are collected again."""
    bad = [(e, why) for e in index["shards"] if (why := _shard_problem(out / e["file"], e)) is not None]
    if not bad:
        return
    for e, _ in bad:
        (out / e["file"]).unlink(missing_ok=True)
        index["shards"].remove(e)
    _write_index(out, index, fsync)
    warnings.warn(f"out={str(out)!r}: " + "; ".join(f"{e['file']} {why}" for e, why in bad)
                  + f"; its {sum(len(e['requests']) for e, _ in bad)} request(s) are collected again",
                  UserWarning, stacklevel=3)


def _layers_setting(layers) -> Any:
    if layers is None or isinstance(layers, str):
        return layers
    return [layers] if isinstance(layers, int) else [int(x) for x in layers]



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


def _engine(model):
    """``model``'s engine transport; None for a stand-in that has none. A closed engine raises."""
    from .engine.transport import engine_of

    try:
        return engine_of(model)
    except AttributeError:  # no engine at all (a stand-in model): the estimates stay rough
        return None


def _engine_facts(model) -> tuple[int, int | None]:
    """(bytes a captured value takes, the scheduler's most requests at once) of ``model``'s engine;
    (4, None) where the engine does not say."""
    try:
        engine = _engine(model)
        info = engine.info() if engine is not None else {}
    except Exception:  # noqa: BLE001 (a closed engine: the estimate stays rough)
        return 4, None
    return _facts(info)


def _facts(info: dict) -> tuple[int, int | None]:
    """:func:`_engine_facts` from an engine's ``info()``."""
    dtype = str(info.get("dtype", "")).removeprefix("torch.")
    value = {"float16": 2, "bfloat16": 2, "float32": 4}.get(dtype, 4)
    wave = info.get("max_num_seqs")
    return value, int(wave) if isinstance(wave, int) and wave > 0 else None


def _next_chunk(left: int, fits: int, wave: int | None) -> int:
    """Prompts in the next chunk: ``left`` to go, ``fits`` the most the budget allows, ``wave`` the
    most the engine's scheduler runs at once (``max_num_seqs``).

    A generate call costs about its step count, whatever its batch (on an H200: 8 chunks of 128
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
