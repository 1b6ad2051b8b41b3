"""sae-lens's activation cache: ``nv.collect(..., format="sae_lens")`` writes what sae-lens's trainer reads.

sae-lens trains an SAE on activations it cached with its ``CacheActivationsRunner``: a Hugging Face
``datasets`` dataset saved to disk (Arrow files, ``state.json``, ``dataset_info.json``), one row per
sequence of ``context_size`` tokens, a column per hook, ``{hook_name}: Array2D((context_size, d_in),
dtype)``, and ``token_ids: Sequence(int32, length=context_size)``. Its ``ActivationsStore`` (given
``cached_activations_path``) opens it with ``datasets.load_from_disk`` and reads the column of its
``hook_name``, checking the shape is ``(context_size, d_in)``. This module writes that layout
from nnvllm's captures, so an SAE trains on activations generated at vLLM's speed, with no
conversion step:

- a column per captured site and layer, named as TransformerLens names hooks (:func:`hook_name`:
  ``blocks.L.hook_resid_post``, ``blocks.L.hook_mlp_out``, ...; the names :func:`nnvllm.sae.site_of_hook`
  reads back), ``d_in`` the site's width (``z``, ``q``, ``k``, ``v`` flat, as sae-lens flattens heads);
- rows of ``context_size`` positions, packed: every request's positions (prompt, then each
  generated token fed back) one after another in prompt order, cut into rows. sae-lens's own
  store packs a tokenized dataset into rows the same way; its trainer flattens rows to tokens. The
  positions past the last full row are left out (the sidecar counts them);
- ``float32`` (sae-lens's default ``dtype``) or ``float16``: Arrow has no ``bfloat16``, so a
  bf16 engine's values are widened;
- Arrow files of at most :data:`FILE_BYTES` (sae-lens keeps its buffers under 2 GB: the ``datasets``
  writer has trouble past that), consolidated as sae-lens consolidates its shards;
- ``nnvllm.json`` beside them: the collect settings, the hook names, the counts (``datasets``
  ignores the file).

The folder must be new or empty, as sae-lens's runner requires; a collection that stops leaves no
dataset (its partial files are removed, or, after a kill, cleared by the next call).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from .sae import _TL_SITES

__all__ = ["DTYPES", "FILE_BYTES", "FORMATS", "SIDECAR", "check", "hook_name", "write"]

FORMATS = ("nnvllm", "sae_lens")
DTYPES = ("float32", "float16")
FILE_BYTES = 1 << 30
SIDECAR = "nnvllm.json"
CACHE_FORMAT = "nnvllm.sae_lens_cache/1"
_PARTIAL = ".nnvllm-part-*.arrow.tmp"  # an Arrow file being written (renamed into place at the end)
_HOOKS = {site: hook for hook, site in _TL_SITES.items()}


def hook_name(site: str, layer: int) -> str:
    """TransformerLens's hook name of nnvllm's ``site`` at block ``layer`` (sae-lens's ``hook_name``).

    Example:
        >>> hook_name("mlp_act", 3)
        'blocks.3.mlp.hook_post'
    """
    if site not in _HOOKS:
        raise ValueError(f"site={site!r} has no TransformerLens hook name for sae-lens's cache; the sites that do: "
                         f"{list(_HOOKS)}")
    return f"blocks.{layer}.{_HOOKS[site]}"


def check(format: str, *, context_size, dtype, saes: list, logits: str, several: bool, layers: list[int],
          sites) -> tuple[int | None, str | None]:
    """Check :func:`nnvllm.collect`'s ``format``, ``context_size`` and ``dtype`` against the rest of the
    call; return ``(context_size, dtype)`` with sae-lens's defaults filled in (None for format="nnvllm")."""
    if format not in FORMATS:
        raise ValueError(f"format={format!r}; expected 'nnvllm' (nnvllm's shards, read with nv.store.open) or "
                         "'sae_lens' (the activation cache sae-lens's trainer reads)")
    if format == "nnvllm":
        if context_size is not None or dtype is not None:
            raise ValueError("context_size= and dtype= shape sae-lens's activation cache; pass format='sae_lens' "
                             "with them, or leave them out")
        return None, None
    context_size = 128 if context_size is None else context_size
    if isinstance(context_size, bool) or not isinstance(context_size, int) or context_size < 1:
        raise ValueError(f"context_size={context_size!r}; expected an int >= 1: positions per row of the cache "
                         "(sae-lens's context_size)")
    dtype = "float32" if dtype is None else str(dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; expected one of {list(DTYPES)} (Arrow has no bfloat16: a bf16 "
                         "engine's values are widened)")
    if saes:
        raise ValueError("saes= writes SAE features into nnvllm's shards; sae-lens's cache holds activations "
                         "only: pass format='nnvllm' for features")
    if logits not in ("chosen", "none"):
        raise ValueError(f"logits={logits!r}: sae-lens's cache holds no logits; leave logits out with "
                         "format='sae_lens', or pass format='nnvllm'")
    if several:
        raise ValueError("format='sae_lens' is written by one engine; pass one model (several engines write "
                         "format='nnvllm')")
    if not layers:
        raise ValueError("format='sae_lens' needs layers (the blocks whose activations to cache); got none")
    for site in ("resid", *sites):
        hook_name(site, 0)
    _datasets()
    return context_size, dtype


def _datasets():
    try:
        import datasets
    except ImportError:
        raise ImportError("format='sae_lens' writes a Hugging Face datasets cache: pip install datasets "
                          "(it comes with sae-lens)") from None
    return datasets


def write(out: str | Path, n_prompts: int, generate_chunk: Callable[[list[int]], Any],
          chunk_size: Callable[[int], int], layers: list[int], sites, *, context_size: int, dtype: str,
          settings: dict, progress: bool = True):
    """Generate every prompt chunk by chunk (``generate_chunk(ids)`` returns the chunk's Run,
    ``chunk_size(left)`` the next chunk's size) and write sae-lens's cache to ``out``.

    Returns:
        The cache as a ``datasets.Dataset`` (``datasets.load_from_disk(out)``).
    """
    from tqdm.auto import tqdm

    datasets = _datasets()
    from datasets.arrow_writer import ArrowWriter
    from datasets.fingerprint import generate_fingerprint

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(not p.match(_PARTIAL) for p in out.iterdir())):
        raise ValueError(f"out={str(out)!r} exists and is not empty; sae-lens's cache is written into a new or "
                         "empty directory (as sae-lens's CacheActivationsRunner requires): pass a new out=")
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob(_PARTIAL):  # left by a killed collection
        stale.unlink()
    columns = [(site, j, hook_name(site, layer)) for site in ("resid", *sites) for j, layer in enumerate(layers)]
    np_dtype = getattr(torch, dtype)
    features = None  # the columns' Arrow types, once the first chunk shows the sites' widths
    files: list[Path] = []
    state = {"writer": None, "rows": 0}
    carry: dict[str, torch.Tensor] = {}
    counts = {"requests": 0, "positions": 0, "rows": 0}
    bar = tqdm(total=n_prompts, disable=not progress, unit="req", desc="collect (sae_lens)")

    def open_file(widths: dict[str, int]) -> None:
        nonlocal features
        features = datasets.Features({name: datasets.Array2D(shape=(context_size, widths[name]), dtype=dtype)
                                      for _, _, name in columns}
                                     | {"token_ids": datasets.Sequence(datasets.Value("int32"), length=context_size)})
        files.append(out / _PARTIAL.replace("*", f"{len(files):05d}"))
        state["writer"], state["rows"] = ArrowWriter(features=features, path=str(files[-1])), 0

    def close_file() -> None:
        if state["writer"] is not None:
            state["writer"].finalize()
            state["writer"].close()
            state["writer"] = None

    def write_rows(rows: dict[str, torch.Tensor]) -> None:
        n = len(rows["token_ids"])
        widths = {name: rows[name].shape[-1] for _, _, name in columns}
        row_bytes = context_size * (4 + sum(widths.values()) * np_dtype.itemsize)
        per_file = max(1, FILE_BYTES // row_bytes)
        a = 0
        while a < n:
            if state["writer"] is None or state["rows"] == per_file:
                close_file()
                open_file(widths)
            b = min(n, a + per_file - state["rows"])
            table = datasets.Dataset.from_dict({k: v[a:b].numpy() for k, v in rows.items()}, features=features)
            state["writer"].write_table(table.data.table)
            state["rows"] += b - a
            a = b

    try:
        start = 0
        while start < n_prompts:
            ids = list(range(start, min(n_prompts, start + chunk_size(n_prompts - start))))
            run = generate_chunk(ids)
            parts: dict[str, list[torch.Tensor]] = {k: [v] for k, v in carry.items()}
            for i in range(len(run)):
                parts.setdefault("token_ids", []).append(torch.tensor(run.sequence(i), dtype=torch.int32))
                for site, j, name in columns:
                    per = run.resid if site == "resid" else run.sites[site]
                    parts.setdefault(name, []).append(per[i][j].flatten(1))  # heads flat, as sae-lens has them
                counts["positions"] += run.positions(i)
            del run  # its buffers go back once the rows below are copied out of them
            total = sum(len(t) for t in parts["token_ids"])
            keep = total - total % context_size
            whole = {k: torch.cat(v) for k, v in parts.items()}
            carry = {k: v[keep:].clone() for k, v in whole.items()}
            rows = {k: v[:keep].to(np_dtype if k != "token_ids" else torch.int32).reshape(keep // context_size,
                                                                                           context_size, *v.shape[1:])
                    for k, v in whole.items()}
            if keep:
                write_rows(rows)
            counts["rows"] += keep // context_size
            counts["requests"] += len(ids)
            start += len(ids)
            bar.update(len(ids))
        if not files:  # fewer positions than one row: an empty dataset of the same columns
            warnings.warn(f"the {counts['positions']} positions collected fill no row of context_size={context_size}; "
                          "the cache is empty: pass a smaller context_size or more prompts / max_tokens",
                          UserWarning, stacklevel=3)
            open_file({name: carry[name].shape[-1] for _, _, name in columns})
        close_file()
        names = [f"data-{k:05d}-of-{len(files):05d}.arrow" for k in range(len(files))]
        for f, name in zip(files, names):
            f.rename(out / name)
    except BaseException:
        close_file()
        for f in files:
            f.unlink(missing_ok=True)
        raise
    finally:
        bar.close()
    info = asdict(datasets.DatasetInfo(features=features))
    (out / "dataset_info.json").write_text(json.dumps({k: info[k] for k in sorted(info)}, indent=2))
    state_json = {"_data_files": [{"filename": n} for n in names], "_fingerprint": None, "_format_columns": None,
                  "_format_kwargs": {}, "_format_type": None, "_output_all_columns": False, "_split": None}
    (out / "state.json").write_text(json.dumps(state_json, indent=2, sort_keys=True))
    # The fingerprint of the dataset as it loads, as sae-lens's consolidation sets it.
    state_json["_fingerprint"] = generate_fingerprint(datasets.load_from_disk(str(out)))
    (out / "state.json").write_text(json.dumps(state_json, indent=2, sort_keys=True))
    (out / SIDECAR).write_text(json.dumps({
        "format": CACHE_FORMAT, "settings": settings, "context_size": context_size, "dtype": dtype,
        "hook_names": [name for _, _, name in columns], "n_requests": counts["requests"],
        "positions": counts["positions"], "rows": counts["rows"],
        "positions_left_out": counts["positions"] - counts["rows"] * context_size}, indent=1))
    return datasets.load_from_disk(str(out))
