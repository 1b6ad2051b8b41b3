"""SAE features at the taps: each armed SAE encodes its site's rows once per engine step, on the device.

A capture with ``saes`` (:func:`nnvllm.generate`) arms one :class:`_Features`. After each forward the
taps hold every block's value of each site for the step's rows (a static buffer a replayed CUDA graph
refilled, or the buffer an eager hook wrote); :meth:`_Features.encode` runs each SAE over its layer's
rows (one matmul, the activation, a top-k: a handful of kernels per SAE per step, no per-request
Python) and the arena places the results like any site (:mod:`.arena`): per row the top-``k`` feature
ids (int32) and activations, or the dense code when asked, and the reconstruction error's norm. Only
these cross to the client: 32 features of a 16k-feature SAE are 256 bytes per position against
4 KB of a d=2048 residual row in fp16.

SAEs are read from their folders (:meth:`nnvllm.SAE.load`) on the rank that keeps the record and kept
on the device between calls (:data:`_CACHE`, keyed by folder, file time and dtype).
"""

from __future__ import annotations

import os
from typing import Any

import torch

# (folder, weights mtime, dtype, device) -> SAE on the device; holds the SAEs of the last call only.
_CACHE: dict[tuple, Any] = {}


def _load(spec: dict, device) -> Any:
    from ...sae import WEIGHTS_FILENAME, SAE

    path = spec["path"]
    mtime = os.stat(os.path.join(path, WEIGHTS_FILENAME)).st_mtime_ns
    key = (path, mtime, spec["dtype"], str(device))
    sae = _CACHE.get(key)
    if sae is None:
        sae = SAE.load(path, site=spec["site"], layer=spec["layer"], dtype=spec["dtype"], device=device)
    return key, sae


class _Features:
    """The armed SAEs of one capture: what they read and, on the keeping rank, the SAEs themselves."""

    def __init__(self, specs: list[dict], device, keep: bool) -> None:
        self.specs = list(specs)
        self.sites = sorted({s["site"] for s in self.specs})  # every rank gathers these under TP
        self.saes: list[Any] = []
        if keep and self.specs:
            loaded = [_load(s, device) for s in self.specs]
            _CACHE.clear()
            _CACHE.update(loaded)
            self.saes = [sae for _, sae in loaded]

    def __bool__(self) -> bool:
        return bool(self.specs)

    def names(self, i: int) -> tuple[str, ...]:
        """The arena entries of SAE ``i``."""
        return (f"_sae{i}_dense",) if self.specs[i]["k"] is None else (f"_sae{i}_ids", f"_sae{i}_values")

    def allocate(self, rows: int, device) -> dict[str, torch.Tensor]:
        """Arena entries for ``rows`` positions (one spare row, as the sites have)."""
        out = {}
        for i, (spec, sae) in enumerate(zip(self.specs, self.saes)):
            k = spec["k"]
            if k is None:
                out[f"_sae{i}_dense"] = torch.zeros(rows + 1, sae.d_sae, dtype=sae.dtype, device=device)
            else:
                out[f"_sae{i}_ids"] = torch.zeros(rows + 1, k, dtype=torch.int32, device=device)
                out[f"_sae{i}_values"] = torch.zeros(rows + 1, k, dtype=sae.dtype, device=device)
            out[f"_sae{i}_error"] = torch.zeros(rows + 1, dtype=sae.dtype, device=device)
        return out

    def nbytes_per_row(self) -> int:
        n = 0
        for spec, sae in zip(self.specs, self.saes):
            item = torch.empty((), dtype=sae.dtype).element_size()
            n += (sae.d_sae * item if spec["k"] is None else spec["k"] * (4 + item)) + item
        return n

    def encode(self, source) -> dict[str, torch.Tensor]:
        """This step's entries, one row per token: ``source(site)`` is the site's ``[layer, tokens, width]``."""
        out = {}
        for i, (spec, sae) in enumerate(zip(self.specs, self.saes)):
            x = source(spec["site"])[spec["layer"]]
            acts, err = sae.encode_with_error(x)
            if spec["k"] is None:
                out[f"_sae{i}_dense"] = acts
            else:
                values, ids = torch.topk(acts, k=spec["k"], dim=-1, sorted=True)
                out[f"_sae{i}_ids"] = ids.to(torch.int32)
                out[f"_sae{i}_values"] = values
            out[f"_sae{i}_error"] = err
        return out
