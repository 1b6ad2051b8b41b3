"""Plain result containers: CPU tensors in dataclasses, with tidy tables and safe save/load.

Dimension names used everywhere: ``request, layer, pos, step, d_model, d_vocab, k``.
A request's positions are its prompt tokens followed by each generated token that was fed back,
so ``pos`` runs over ``prompt_len + steps - 1`` entries (the last sampled token is never fed).
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

__all__ = ["Run", "Samples"]


@dataclass
class Samples:
    """What the sampler drew for one request, one row per generated step.

    Attributes:
        ids: ``[step]`` the sampled token ids.
        probs: ``[step]`` each sampled id's probability under the distribution actually sampled
            from (temperature and top-p applied; greedy gives the plain softmax).
        top_ids: ``[step, k]`` the k most likely ids under that distribution.
        top_probs: ``[step, k]`` their probabilities.
        logprobs: ``[step]`` each sampled id's log-probability under the model itself
            (``log_softmax`` of the pre-sampling logits: no temperature, no top-p), or None where it
            was not computed (runs saved before it existed, samples built by hand).
    """

    ids: Tensor
    probs: Tensor
    top_ids: Tensor
    top_probs: Tensor
    logprobs: Tensor | None = None

    def __len__(self) -> int:
        return int(self.ids.shape[0])


@dataclass
class Run:
    """Everything captured from one generation over several prompts (index ``i`` = request).

    Attributes:
        prompts: the prompts as given: a str, or a conversation (a list of ``{"role", "content"}`` messages).
        prompt_ids: ``prompts[i]`` as token ids.
        tokens: generated ids of request i (``list[int]``).
        text: the generated text of request i.
        logits: per request ``[step, d_vocab]`` pre-sampling logits, or None if not captured.
        samples: per request :class:`Samples`.
        resid: per request ``[layer, pos, d_model]`` residual stream after each captured block, or
            None. ``resid[i][j, p]`` is block ``layers[j]``'s output at position ``p``.
        sites: extra sites by name (``"attn"``, ``"mlp"``, ``"mlp_in"``, ``"mlp_act"``), each a list
            of per-request ``[layer, pos, width]`` tensors.
        layers: the block indices captured (the ``layer`` axis).
        features: per SAE of ``generate(..., saes=[...])`` (in that order), per request the features
            at each position: ``(ids [pos, k], values [pos, k])``, the ``k`` most active features
            largest first (ids int32), or the dense code ``[pos, d_sae]`` with ``sae_dense=True``.
            ``run.features[s][i][0][p]`` are the features SAE ``s`` finds at position ``p`` of
            request ``i``. ``meta["saes"]`` describes each SAE (site, layer, d_sae, folder).
        sae_errors: per SAE, per request ``[pos]``: the norm of the site's value minus the SAE's
            reconstruction of it (what the SAE misses), per position.
        sampling: the sampling settings used (temperature, top_p, seed, max_tokens, top_k).
        meta: where it came from (``engine``: "vllm" or "transformers", ``model``, ``dtype``, ``tp``;
            ``chat``: the ``chat_template``/``chat_template_kwargs`` conversations were rendered with).
        roles: per request, one label per captured position (beside :meth:`sequence`): the role of the
            message a prompt token carries (``"system"``, ``"user"``, ``"assistant"``), ``"template"``
            for what the chat template adds (role headers, special tokens), ``"assistant"`` for the
            generated tokens. A plain str prompt's tokens are ``"user"`` (special tokens ``"template"``).
        prompt_text: per request, the text the model read: a conversation rendered by its chat
            template, or the prompt itself.
    """

    prompts: list[str]
    prompt_ids: list[list[int]]
    tokens: list[list[int]]
    text: list[str]
    logits: list[Tensor] | None
    samples: list[Samples]
    resid: list[Tensor] | None
    layers: list[int]
    sites: dict[str, list[Tensor]] = field(default_factory=dict)
    features: list[list[tuple[Tensor, Tensor] | Tensor]] = field(default_factory=list)
    sae_errors: list[list[Tensor]] = field(default_factory=list)
    sampling: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)
    roles: list[list[str]] = field(default_factory=list)
    prompt_text: list[str] = field(default_factory=list)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("engine_model", None)  # a weak reference to the engine that made it: not data
        return state

    def __len__(self) -> int:
        return len(self.prompts)

    def plot(self, i: int = 0, ax=None, *, tokenizer: Any = None):
        """Draw request ``i``'s sampled tokens and the top alternatives (:func:`nnvllm.plotting.plot_samples`).

        Tokens are labelled with their text: through ``tokenizer``, or else the tokenizer the run
        was made with (``run.tokenizer``; a run loaded from a file labels token ids).
        """
        from .plotting import plot_samples

        return plot_samples(self, i, ax=ax, tokenizer=tokenizer)

    def __repr__(self) -> str:
        # The dataclass repr printed every tensor: megabytes in a notebook cell for a large run.
        n = len(self.prompts)
        steps = sorted({len(t) for t in self.tokens})
        parts = [f"{n} request{'s' if n != 1 else ''}",
                 f"steps {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}" if steps else "no steps"]
        if self.resid is not None and self.layers:
            parts.append(f"layers {self.layers[0]}..{self.layers[-1]} ({len(self.layers)})")
        if self.sites:
            parts.append("sites " + ", ".join(self.sites))
        if self.features:
            parts.append(f"features of {len(self.features)} SAE{'s' if len(self.features) != 1 else ''}")
        parts.append("logits" if self.logits is not None else "no logits")
        src = ", ".join(str(self.meta[k]) for k in ("engine", "dtype") if self.meta.get(k))
        text = repr(self.text[0][:30]) + (" ..." if n > 1 else "") if n else ""
        return f"<Run: {'; '.join(parts)}{'; ' + src if src else ''}; text {text}>"

    def positions(self, i: int) -> int:
        """Number of positions captured for request i: ``prompt_len + steps - 1``."""
        return len(self.prompt_ids[i]) + len(self.tokens[i]) - 1

    def sequence(self, i: int) -> list[int]:
        """Token ids at request i's captured positions (prompt, then the fed-back generated ids)."""
        return list(self.prompt_ids[i]) + list(self.tokens[i][:-1])

    def attention(self, layer: int, request: int = 0, heads=None, *, queries=None, budget: int = 256 << 20,
                  device=None) -> Tensor:
        """Return the attention pattern ``[heads, query_pos, key_pos]`` of block ``layer`` for one request.

        Rebuilt from the captured ``q`` and ``k`` (``sites=["q", "k"]``) with the model's own scale,
        causal mask, sliding window, soft-cap and grouped-query sharing (:func:`nnvllm.heads.patterns`),
        over the prompt and every generated step: row ``p`` is what the token at position ``p``
        attended to (the step that produced generated token ``s`` reads row ``prompt_len - 1 + s``).

        Args:
            layer: a captured block index (negative counts from the end of ``run.layers``).
            request: the request index.
            heads: None (every head), an int or a list of head indices.
            queries: None (every position), a slice, or query positions.
            budget: bytes of scores computed at once (memory only; the result does not change).
            device: where to compute (e.g. "cuda"); the result stays there. Default: where q and k
                are (the CPU for a Run).

        Example:
            >>> run = nv.generate(model, "The capital of France is", sites=["q", "k"])   # doctest: +SKIP
            >>> run.attention(3, heads=[1])[0, -1]        # head 3.1's last row: where it looks  # doctest: +SKIP
        """
        from .arch import AttentionSpec
        from .heads import patterns

        missing = [s for s in ("q", "k") if s not in self.sites]
        if missing or "attention" not in self.meta:
            raise ValueError(f"this run has no {' and '.join(missing) or 'attention description'}: patterns are "
                             "rebuilt from the queries and keys; generate with sites=['q', 'k'] (and the layers "
                             "you want)")
        if isinstance(layer, bool) or not isinstance(layer, int):
            raise TypeError(f"layer={layer!r}: expected a block index (int) among the captured layers {self.layers}")
        if layer < 0 and -len(self.layers) <= layer:
            layer = self.layers[layer]
        if layer not in self.layers:
            raise ValueError(f"layer={layer}: not captured; this run holds layers {self.layers}")
        if isinstance(request, bool) or not isinstance(request, int) or not -len(self) <= request < len(self):
            raise ValueError(f"request={request!r}: expected an index 0-{len(self) - 1}")
        j = self.layers.index(layer)
        spec = AttentionSpec.from_dict(self.meta["attention"])
        q, k = self.sites["q"][request][j], self.sites["k"][request][j]
        if device is not None:
            q, k = q.to(device), k.to(device)
        return patterns(q, k, spec, layer, heads=heads, queries=queries, budget=budget)

    def to_frame(self, by: str = "step"):
        """Return one row per (request, step): the sampled token, its probability and rank-1 alternative.

        Columns: ``request, step, token_id, prob, top1_id, top1_prob`` (+ ``logit`` when captured).
        ``by="position"``: one row per (request, pos) instead: ``request, pos, token_id, role``
        (:attr:`roles`; None where the run has none) and ``generated``.
        """
        import pandas as pd

        if by == "position":
            return pd.DataFrame([
                {"request": i, "pos": p, "token_id": int(t),
                 "role": self.roles[i][p] if i < len(self.roles) and p < len(self.roles[i]) else None,
                 "generated": p >= len(self.prompt_ids[i])}
                for i in range(len(self.prompts)) for p, t in enumerate(self.sequence(i))])
        if by != "step":
            raise ValueError(f"by={by!r}: expected 'step' (a row per generated step) or 'position' (a row per "
                             "captured position, with its role)")
        rows = []
        for i, s in enumerate(self.samples):
            for t in range(len(s)):
                row = {
                    "request": i,
                    "step": t,
                    "token_id": int(s.ids[t]),
                    "prob": float(s.probs[t]),
                    "top1_id": int(s.top_ids[t, 0]),
                    "top1_prob": float(s.top_probs[t, 0]),
                }
                if self.logits is not None:
                    row["logit"] = float(self.logits[i][t, s.ids[t]])
                rows.append(row)
        return pd.DataFrame(rows)

    def save(self, path: str | Path) -> None:
        """Write the run to ``path`` as one safetensors file that cannot run code when read.

        Every tensor is stored under a key (``resid/0``, ``sites/attn/3``, ``logits/2``,
        ``samples/1/top_ids``); the rest (prompts, ids, text, layers, sampling, meta) is JSON in the
        file's metadata, with a format tag (``nnvllm.run/2``) and a sha256 of the tensors, so a
        damaged file is refused on :meth:`load`. The write is atomic: a temporary file in the same
        directory is renamed over ``path`` only once complete, so an interrupted save keeps the
        previous file. ``sampling`` and ``meta`` must be JSON-serialisable (tuples come back as lists).

        Example:
            >>> run.save("run.safetensors")                        # doctest: +SKIP
            >>> nv.Run.load("run.safetensors").text == run.text    # doctest: +SKIP
            True
        """
        tensors: dict[str, Tensor] = {}
        n = len(self.prompts)
        for i in range(n):
            if self.resid is not None:
                tensors[f"resid/{i}"] = self.resid[i]
            for name, per in self.sites.items():
                tensors[f"sites/{name}/{i}"] = per[i]
            if self.logits is not None:
                tensors[f"logits/{i}"] = self.logits[i]
            for f in _SAMPLE_FIELDS + _OPTIONAL_SAMPLE_FIELDS:
                if getattr(self.samples[i], f) is not None:
                    tensors[f"samples/{i}/{f}"] = getattr(self.samples[i], f)
            for s, per in enumerate(self.features):
                if isinstance(per[i], tuple):
                    tensors[f"features/{s}/{i}/ids"], tensors[f"features/{s}/{i}/values"] = per[i]
                else:
                    tensors[f"features/{s}/{i}/dense"] = per[i]
                if s < len(self.sae_errors):
                    tensors[f"sae_errors/{s}/{i}"] = self.sae_errors[s][i]
        info = {
            "n": n, "prompts": self.prompts, "prompt_ids": self.prompt_ids, "tokens": self.tokens,
            "text": self.text, "layers": self.layers, "sampling": self.sampling, "meta": self.meta,
            "roles": self.roles, "prompt_text": self.prompt_text,
            "resid": self.resid is not None, "logits": self.logits is not None, "sites": list(self.sites),
            "features": [bool(per) and not isinstance(per[0], tuple) for per in self.features],  # dense?
            "sae_errors": len(self.sae_errors),
        }
        save_tensors(tensors, path, {"nnvllm.run": _to_json(info, "Run")}, fmt=RUN_FORMAT)

    @classmethod
    def load(cls, path: str | Path) -> Run:
        """Read a run written by :meth:`save`; never unpickles.

        Raises:
            ValueError: the file is truncated, damaged (checksum mismatch), not an nnvllm run, or an
                old torch-pickle run file (those can run code when read; see the message).
        """
        tensors, meta = load_tensors(path, fmt=RUN_FORMAT)
        try:
            info = json.loads(meta["nnvllm.run"])
            n = info["n"]
            return cls(
                prompts=info["prompts"], prompt_ids=info["prompt_ids"], tokens=info["tokens"],
                text=info["text"],
                logits=[tensors[f"logits/{i}"] for i in range(n)] if info["logits"] else None,
                samples=[Samples(**{f: tensors[f"samples/{i}/{f}"] for f in _SAMPLE_FIELDS},
                                 **{f: tensors.get(f"samples/{i}/{f}") for f in _OPTIONAL_SAMPLE_FIELDS})
                         for i in range(n)],
                resid=[tensors[f"resid/{i}"] for i in range(n)] if info["resid"] else None,
                layers=info["layers"],
                sites={s: [tensors[f"sites/{s}/{i}"] for i in range(n)] for s in info["sites"]},
                sampling=info["sampling"], meta=info["meta"],
                roles=info.get("roles", []), prompt_text=info.get("prompt_text", []),
                features=[[tensors[f"features/{s}/{i}/dense"] if dense else
                           (tensors[f"features/{s}/{i}/ids"], tensors[f"features/{s}/{i}/values"]) for i in range(n)]
                          for s, dense in enumerate(info.get("features", []))],
                sae_errors=[[tensors[f"sae_errors/{s}/{i}"] for i in range(n)] for s in range(info.get("sae_errors", 0))],
            )
        except (KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"{str(path)!r} is damaged: its run description is incomplete ({e!r}); "
                             "re-create it") from None


# ---------------------------------------------------------------- safe files (also used by store.py)
# One safetensors file: tensors + str->str metadata. safetensors parses a JSON header and copies raw
# bytes, so reading a file cannot run code (torch.load(weights_only=False) unpickles, which can).

RUN_FORMAT = "nnvllm.run/2"
_SAMPLE_FIELDS = ("ids", "probs", "top_ids", "top_probs")
_OPTIONAL_SAMPLE_FIELDS = ("logprobs",)
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


def _to_json(obj: Any, what: str) -> str:
    def default(x):
        if isinstance(x, (np.integer, np.floating, np.bool_)):
            return x.item()
        raise TypeError(
            f"{what} holds {x!r} ({type(x).__name__}), which cannot be saved; its metadata (sampling, meta, "
            "ids, text) must be JSON values: str, int, float, bool, None, lists and dicts")
    return json.dumps(obj, default=default, ensure_ascii=False)


def tensor_digest(tensors: dict[str, Tensor]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order (independent of layout)."""
    h = hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k].detach()
        h.update(f"{k}\0{t.dtype!s}\0{tuple(t.shape)}\0".encode())
        if t.numel():
            h.update(t.contiguous().reshape(-1).view(torch.uint8).cpu().numpy())
    return h.hexdigest()


def file_digest(path: str | Path) -> str:
    """sha256 of a whole file, read in 16 MiB pieces."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(16 * 2**20):
            h.update(chunk)
    return h.hexdigest()


def save_tensors(tensors: dict[str, Tensor], path: str | Path, metadata: dict[str, str], *, fmt: str,
                 tensor_sha: bool = True) -> str:
    """Atomically write ``tensors`` and ``metadata`` (+ ``format``, and ``sha256`` of the tensors unless
    ``tensor_sha=False``) to ``path`` as a safetensors file; return the sha256 of the file written.

    Views are written piece by piece (see :func:`write_safetensors`), never copied whole.
    """
    meta = {**metadata, "format": fmt}
    if tensor_sha:
        meta["sha256"] = tensor_digest(tensors)
    return write_safetensors(path, {k: Pieces.of(t) for k, t in tensors.items()}, meta)


_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}
_WRITE_BLOCK = 64 << 20  # bytes per write() and per hash update


@dataclass
class Pieces:
    """One tensor of a safetensors file given as contiguous pieces whose bytes, one after another,
    are its row-major data: a concatenation or a strided view is written without first being copied
    into one new tensor."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    parts: list[Tensor]

    @classmethod
    def of(cls, t: Tensor) -> Pieces:
        return cls(t.dtype, tuple(t.shape), _contiguous_parts(t))

    @classmethod
    def cat(cls, parts: list[Tensor], dim: int) -> Pieces:
        """``torch.cat(parts, dim)`` as pieces: for ``dim=1``, layer ``j`` of every part, then ``j + 1``."""
        if not parts:
            return cls(torch.float32, (0,), [])
        shape = list(parts[0].shape)
        shape[dim] = sum(int(p.shape[dim]) for p in parts)
        if dim == 0:
            out = [q for p in parts for q in _contiguous_parts(p)]
        elif dim == 1:
            out = [q for j in range(shape[0]) for p in parts for q in _contiguous_parts(p[j])]
        else:
            out = _contiguous_parts(torch.cat(parts, dim=dim))
        return cls(parts[0].dtype, tuple(shape), out)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts)


def _contiguous_parts(t: Tensor) -> list[Tensor]:
    """``t``'s row-major bytes as contiguous CPU tensors: itself, its rows (a slice along a later
    axis is contiguous per row), or else one contiguous copy."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_contiguous():
        return [t]
    if 1 < t.ndim and t.shape[0] <= 4096 and t[0].is_contiguous():
        return [t[j] for j in range(t.shape[0])]
    return [t.contiguous()]


_SMALL = 4 << 20  # pieces below this size are gathered into blocks of about this size


def _byte_views(parts: list[Tensor]):
    """The bytes of ``parts`` in order, as blocks of at most ``_WRITE_BLOCK``. Small pieces (a feature
    dataset's shard holds tens of thousands of a few kilobytes each) are copied together first, so
    a write or hash update costs one call per block, not per piece."""
    buf = bytearray()
    for t in parts:
        if not t.numel():
            continue
        b = memoryview(t.reshape(-1).view(torch.uint8).numpy())
        if len(b) < _SMALL:
            buf += b
            if len(buf) >= _SMALL:
                yield memoryview(buf)
                buf = bytearray()
            continue
        if buf:
            yield memoryview(buf)
            buf = bytearray()
        for a in range(0, len(b), _WRITE_BLOCK):
            yield b[a:a + _WRITE_BLOCK]
    if buf:
        yield memoryview(buf)


def write_safetensors(path: str | Path, tensors: dict[str, Pieces], metadata: dict[str, str], *,
                      fsync: bool = True) -> str:
    """Atomically write a safetensors file from :class:`Pieces`; return the file's sha256.

    The bytes go from the pieces straight to the file (no intermediate buffer), and the sha256 is
    computed from the same memory in a second thread while they are written: one read of the data,
    two cores. The layout is safetensors' (8-byte little-endian header size, a JSON header padded
    with spaces to a multiple of 8, then the tensors back to back), so any safetensors reader opens it.
    """
    import concurrent.futures

    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    off = 0
    for name, p in tensors.items():
        if p.dtype not in _ST_DTYPES:
            raise TypeError(f"{name}: dtype {p.dtype} cannot be written to safetensors")
        n = p.nbytes
        want = int(np.prod(p.shape)) * p.dtype.itemsize
        if n != want:
            raise ValueError(f"{name}: the pieces hold {n} bytes, shape {list(p.shape)} of {p.dtype} needs {want}")
        header[name] = {"dtype": _ST_DTYPES[p.dtype], "shape": list(p.shape), "data_offsets": [off, off + n]}
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    digest: list[str] = []

    def write(tmp: Path) -> None:
        # One pass over the pieces: each block is written here and hashed in a second thread, in
        # order (one worker), while the next is written; at most a few blocks wait for the hash.
        h = hashlib.sha256(head)
        with concurrent.futures.ThreadPoolExecutor(1) as pool, open(tmp, "wb") as f:
            f.write(head)
            pending: collections.deque = collections.deque()
            for p in tensors.values():
                for b in _byte_views(p.parts):
                    pending.append(pool.submit(h.update, b))
                    f.write(b)
                    while len(pending) > 4:
                        pending.popleft().result()
            for fut in pending:
                fut.result()
        digest.append(h.hexdigest())

    atomic_write(Path(path), write, fsync=fsync)
    return digest[0]


def atomic_write(path: Path, write, fsync: bool = True) -> None:
    """Call ``write(tmp)`` on a temporary name beside ``path``, flush it to disk, rename it over ``path``.

    The rename is atomic on POSIX filesystems, so ``path`` is always either the old file or the
    complete new one; on any error the temporary file is removed and the old file is untouched.
    ``fsync=False`` skips waiting for the disk: still atomic if the process dies, but a power loss
    or OS crash may leave the file incomplete.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_header(path: str | Path, *, fmt: str) -> tuple[dict, dict[str, str]]:
    """Return (tensor entries, metadata) of a safetensors file, or a ValueError saying what is wrong.

    Checks, without reading the tensors: not an old torch pickle, a parseable header, the expected
    ``format``, and a file long enough for every tensor (truncation).
    """
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        # A pickle starts with 0x80; so does a safetensors file whose header length is 128 mod 256,
        # whose header (after those 8 bytes) opens with "{".
        if head[:4] == b"PK\x03\x04" or (head[:1] == b"\x80" and f.read(1) != b"{"):
            raise ValueError(
                f"{str(path)!r} is an old torch-pickle file (nnvllm < 0.2 saved runs that way), not the "
                f"safe {fmt} format. Reading it runs whatever code it holds, so nnvllm refuses. If you "
                "trust its source, read it with torch.load(path, weights_only=False), rebuild the Run "
                "from the dict, and save it again to convert it.")
        if len(head) < 8:
            raise ValueError(f"{str(path)!r} is truncated ({size} bytes): not a complete {fmt} file; re-create it")
        n = struct.unpack("<Q", head)[0]
        if n > _MAX_HEADER:
            raise ValueError(f"{str(path)!r} is not a {fmt} file (no safetensors header)")
        if 8 + n > size:
            raise ValueError(f"{str(path)!r} is truncated: its header needs {8 + n} bytes, the file has "
                             f"{size}; re-create it")
        f.seek(8)
        raw = f.read(n)
    try:
        header = json.loads(raw)
        meta = header.pop("__metadata__", None) or {}
        end = max((int(e["data_offsets"][1]) for e in header.values()), default=0)
    except (ValueError, TypeError, KeyError, AttributeError, IndexError):
        raise ValueError(f"{str(path)!r} is damaged or not a {fmt} file: its header cannot be read") from None
    if meta.get("format") != fmt:
        raise ValueError(f"{str(path)!r} is not a {fmt} file (format={meta.get('format')!r})")
    if 8 + n + end > size:
        raise ValueError(f"{str(path)!r} is truncated: {8 + n + end} bytes expected, {size} found; re-create it")
    return header, meta


def load_tensors(path: str | Path, *, fmt: str) -> tuple[dict[str, Tensor], dict[str, str]]:
    """Read every tensor of a file written by :func:`save_tensors` and check its checksum."""
    from safetensors import SafetensorError, safe_open

    _, meta = read_header(path, fmt=fmt)
    try:
        with safe_open(str(path), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not iterable)
    except SafetensorError as e:
        raise ValueError(f"{str(path)!r} is damaged ({e}); re-create it") from None
    if tensor_digest(tensors) != meta.get("sha256"):
        raise ValueError(f"{str(path)!r} is damaged: checksum mismatch; re-create it")
    return tensors, meta
