"""SAE features in datasets on disk: what ``nv.collect(..., saes=[...])`` writes per shard and reads back.

A shard of a dataset collected with ``saes`` holds, per SAE ``s`` (in the order of ``saes``), every
request's positions one after another, as its activations are (the shard's ``offsets`` say where
each request starts)::

    features/<s>/ids     [total_pos, k] int32   the k most active features, largest first
    features/<s>/values  [total_pos, k]         their activations
    features/<s>/dense   [total_pos, d_sae]     instead of the two above, with sae_dense=True
    sae_errors/<s>       [total_pos]            the norm of the site's value minus the SAE's decode

``index.json``'s settings describe each SAE (:func:`describe`: its site, layer, architecture,
widths, hook name, ``k`` or dense, and a fingerprint of its files: :func:`fingerprint`), so that
resuming a collection with another SAE is refused rather than mixed into the dataset.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import Tensor

from .results import Pieces, Run
from .sae import CFG_FILENAME, WEIGHTS_FILENAME, _row_bytes

__all__ = ["check", "describe", "fingerprint", "pos_bytes", "read", "shard_tensors"]

_BLOCKS, _BLOCK = 64, 16 << 10


def fingerprint(folder: str | Path) -> str:
    """sha256 of an SAE folder's ``cfg.json``, its weights file's size and 64 blocks of 16 KiB spread
    over that file (its header first). Two different SAEs differ there (another config, or other
    weights, which differ all over the file), and it reads 1 MiB where a whole release of
    16k-feature SAEs is gigabytes, which hashing in full would add to every collect call."""
    folder = Path(folder)
    h = hashlib.sha256((folder / CFG_FILENAME).read_bytes())
    weights = folder / WEIGHTS_FILENAME
    size = weights.stat().st_size
    h.update(str(size).encode())
    with weights.open("rb") as f:
        for k in range(_BLOCKS):
            f.seek(k * max(0, size - _BLOCK) // (_BLOCKS - 1))
            h.update(f.read(_BLOCK))
    return h.hexdigest()


def check(saes, model, k: int, dense: bool) -> list[dict]:
    """Check :func:`nnvllm.collect`'s ``saes``, ``sae_k`` and ``sae_dense`` against ``model`` (as
    :func:`nnvllm.generate` does); return :func:`describe` of them (``[]`` without SAEs)."""
    from .edits import site_widths
    from .sae import SAE
    from .sae_group import resolve

    specs = resolve(saes, model.arch, model.n_layers, site_widths(model), k, dense)
    return describe([saes] if isinstance(saes, SAE) else list(saes or []), specs)


def describe(saes: list, specs: list[dict]) -> list[dict]:
    """What a dataset's settings record of its SAEs (JSON), from the SAEs and their engine specs
    (:func:`nnvllm.sae_group.resolve`)."""
    return [{"site": x.site, "layer": x.layer, "architecture": x.architecture, "d_in": x.d_in, "d_sae": x.d_sae,
             "hook_name": x.hook_name, "k": sp["k"], "dtype": sp["dtype"],
             "fingerprint": fingerprint(sp["path"])} for x, sp in zip(saes, specs)]


def pos_bytes(described: list[dict]) -> int:
    """Bytes one position's features and errors take over the SAEs ``described`` (:func:`describe`)."""
    return sum(_row_bytes(d["d_sae"], d["k"], getattr(torch, d["dtype"]).itemsize) for d in described)


def shard_tensors(run: Run, positions: list[int]) -> dict[str, Pieces]:
    """The shard's tensors of ``run``'s features and errors (views written from the run's memory);
    ``positions``: each request's position count, which every per-request tensor must have."""
    out: dict[str, Pieces] = {}
    for s, per in enumerate(run.features):
        parts = {"dense": list(per)} if per and not isinstance(per[0], tuple) else {
            "ids": [p[0] for p in per], "values": [p[1] for p in per]}
        parts = {f"features/{s}/{k}": v for k, v in parts.items()}
        parts[f"sae_errors/{s}"] = list(run.sae_errors[s])
        for key, ts in parts.items():
            for i, t in enumerate(ts):
                if t.shape[0] != positions[i]:
                    raise ValueError(f"{key}[{i}] has {t.shape[0]} positions; prompt + fed-back tokens make "
                                     f"{positions[i]}")
            out[key] = Pieces.cat(ts, dim=0)
    return out


def read(f, a: int, b: int, described: list[dict]) -> tuple[list, list[Tensor]]:
    """One request's ``(features, sae_errors)`` (as :class:`~nnvllm.Run` holds them) from the open
    shard ``f`` (``safe_open``), positions ``a:b``. Copies, not views of the memory-mapped file."""
    features, errors = [], []
    for s, d in enumerate(described):
        if d["k"] is None:
            features.append(f.get_slice(f"features/{s}/dense")[a:b].clone())
        else:
            features.append((f.get_slice(f"features/{s}/ids")[a:b].clone(),
                             f.get_slice(f"features/{s}/values")[a:b].clone()))
        errors.append(f.get_slice(f"sae_errors/{s}")[a:b].clone())
    return features, errors
