"""SAEs in the engine: several SAEs of one kind as one (:func:`stack`), and a call's ``saes=`` checked
against the model and turned into the plain specs the engine's worker arms (:func:`resolve`).

The worker reads an SAE from its folder (:meth:`nnvllm.SAE.load`): an SAE built in memory is saved
once to a temporary folder that lives as long as the SAE does (:func:`folder_of`).
"""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from .sae import SAE, WEIGHTS_FILENAME

__all__ = ["folder_of", "resolve", "stack", "stack_key"]


def stack(saes: Sequence[SAE], device: str | torch.device | None = None) -> SAE:
    """Several SAEs of one kind as one: each weight gains a leading SAE axis (biases ``[G, 1, width]``),
    and :meth:`SAE.encode` / :meth:`SAE.encode_with_error` take ``[G, pos, d_in]``, SAE ``g`` encoding
    row ``g``: one batched matmul instead of one per SAE (the engine's per-step encode).

    The SAEs must share architecture, widths, dtype and input options (:func:`stack_key`)."""
    first = saes[0]
    keys = {stack_key(x) for x in saes}
    if len(keys) != 1:
        raise ValueError(f"stack() takes SAEs of one kind (architecture, d_in, d_sae, dtype, input options); got {keys}")
    device = device or first.device

    def stacked(name: str) -> Tensor | None:
        parts = [getattr(x, name) for x in saes]
        if parts[0] is None:
            return None
        out = torch.empty((len(parts), *parts[0].shape), dtype=first.dtype, device=device)
        for g, t in enumerate(parts):
            out[g].copy_(t)
        return out if out.ndim == 3 else out.unsqueeze(1)  # biases broadcast over positions

    names = ("W_enc", "W_dec", "b_dec", "b_enc", "threshold", "b_gate", "b_mag", "r_mag", "finetuning_scaling_factor")
    return replace(first, hook_name=None, path=None, cfg={}, **{n: stacked(n) for n in names})


def stack_key(sae: SAE) -> tuple:
    """What SAEs must share to be stacked (:func:`stack`)."""
    return (sae.architecture, sae.d_in, sae.d_sae, sae.dtype, str(sae.device), sae.k, sae.apply_b_dec_to_input,
            sae.normalize_activations, sae.rescale_acts_by_decoder_norm, sae.finetuning_scaling_factor is None)


def resolve(saes, arch, n_layers: int, widths: dict[str, int], k: int, dense: bool) -> list[dict]:
    """Check ``saes`` against a model and the call's ``sae_k``/``sae_dense``; return the plain specs
    the engine's worker arms (folder, site, layer, dtype, k: None for the dense code).

    Args:
        saes: an :class:`SAE` or a list of them (None: none).
        arch: the model's :class:`~nnvllm.arch.Arch` (the sites it offers).
        n_layers: its block count. widths: its full site widths (``nnvllm.edits.site_widths``).
        k: features kept per position. dense: keep every feature instead.
    """
    if saes is None:
        return []
    if isinstance(saes, SAE):
        saes = [saes]
    if not isinstance(saes, (list, tuple)) or not all(isinstance(x, SAE) for x in saes):
        got = (type(saes).__name__ if not isinstance(saes, (list, tuple))
               else next(type(x).__name__ for x in saes if not isinstance(x, SAE)))
        raise TypeError(f"saes must be a list of nv.SAE (nv.SAE.load(path, site=..., layer=...)), got {got}")
    if not isinstance(dense, bool):
        raise TypeError(f"sae_dense={dense!r}; expected True (every feature) or False (the top sae_k)")
    specs = []
    for i, sae in enumerate(saes):
        arch.check_sites([sae.site])
        if sae.layer >= n_layers:
            raise ValueError(f"saes[{i}] reads layer={sae.layer}, out of range for a {n_layers}-layer model "
                             f"(0-{n_layers - 1}); load it with the layer it was trained on (layer=...)")
        if widths.get(sae.site):
            sae.check_width(widths[sae.site], where=f" in this model (saes[{i}])")
        if not dense and (isinstance(k, bool) or not isinstance(k, int) or not 0 < k <= sae.d_sae):
            raise ValueError(f"sae_k={k!r}; expected an int in 1..{sae.d_sae} (saes[{i}] has d_sae={sae.d_sae}), "
                             "or sae_dense=True for every feature")
        specs.append({"path": folder_of(sae), "site": sae.site, "layer": sae.layer,
                      "dtype": str(sae.dtype).removeprefix("torch."), "k": None if dense else k})
    return specs


# SAEs built in memory (no folder): the folder each was saved to for the engine, removed with the SAE.
_SAVED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def folder_of(sae: SAE) -> str:
    """The folder the engine reads ``sae`` from: its own, or one it is saved to once."""
    if sae.path is not None and (Path(sae.path) / WEIGHTS_FILENAME).is_file():
        return str(Path(sae.path).resolve())
    folder = _SAVED.get(sae)
    if folder is None:
        folder = tempfile.mkdtemp(prefix="nnvllm-sae-")
        sae.save(folder)
        weakref.finalize(sae, shutil.rmtree, folder, True)
        _SAVED[sae] = folder
    return folder
