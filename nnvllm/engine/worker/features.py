"""SAE features at the taps: the armed SAEs encode their sites' rows once per engine step, on the device.

A capture with ``saes`` (:func:`nnvllm.generate`) arms one :class:`_Features`. After each forward the
taps hold every block's value of each site for the step's rows (a static buffer a replayed CUDA graph
refilled, or the buffer an eager hook wrote). SAEs of one kind (:func:`nnvllm.sae_group.stack_key`: the
usual case, one SAE per layer of a release) run as one group: their layers' rows are gathered into
``[G, tokens, d_in]`` and encoded by one batched matmul, so the Python and kernel launches per step do
not grow with the number of SAEs. Per row the group keeps the top-``k`` feature ids (int32) and
activations, or the dense code when asked, and the reconstruction error's norm; the arena places
these like any site (:mod:`.arena`) and only they cross to the client: 32 features of a
16k-feature SAE are 256 bytes per position against 4 KB of a d=2048 residual row in fp16.

On a GPU the encoding runs on a CUDA stream of its own (:attr:`_Features.stream`): it reads a copy of
the step's rows taken on the engine's stream, so the next step's forward (which refills the taps'
buffers) need not wait for it, and the two overlap; readers of the arena wait for the stream
(:meth:`_Features.join`). ``NNVLLM_SAE_STREAM=0`` encodes on the engine's stream instead.

SAEs are read from their folders (:meth:`nnvllm.SAE.load`) on the rank that keeps the record, stacked
on the device, and kept there between calls (:data:`_CACHE`, keyed by folders, file times and dtype).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

# group key -> stacked SAE on the device; holds the groups of the last call only.
_CACHE: dict[tuple, Any] = {}
# member key -> its stack_key, once read: a call with the last call's SAEs reads no weights at all.
_KIND: dict[tuple, tuple] = {}
# Rows encoded at once: the dense code of a chunk stays under this many bytes (a prefill step of
# thousands of tokens times many 16k-feature SAEs would otherwise need gigabytes at once).
CHUNK_BYTES = int(os.environ.get("NNVLLM_SAE_CHUNK_BYTES") or 512 << 20)


def _member_key(spec: dict, device) -> tuple:
    from ...sae import WEIGHTS_FILENAME

    mtime = os.stat(os.path.join(spec["path"], WEIGHTS_FILENAME)).st_mtime_ns
    return (spec["path"], mtime, spec["site"], spec["layer"], spec["dtype"], str(device))


# member key -> the SAE of a clamp edit (nv.Edit.clamp), on the device: the last call's only.
_EDIT_SAES: dict[tuple, Any] = {}


def edit_saes(specs: list[dict], device) -> list[Any]:
    """The SAEs the clamp edits of a call name (``{"path", "site", "layer", "dtype"}`` each), on
    ``device``: read once, kept while the next call names them too."""
    from ...sae import SAE

    keys = [_member_key(s, device) for s in specs]
    kept = {k: _EDIT_SAES[k] for k in keys if k in _EDIT_SAES}
    for k, s in zip(keys, specs):
        if k not in kept:
            kept[k] = SAE.load(s["path"], site=s["site"], layer=s["layer"], dtype=s["dtype"], device=device)
    _EDIT_SAES.clear()
    _EDIT_SAES.update(kept)
    return [kept[k] for k in keys]


class _Group:
    """SAEs of one kind, one site and one output form, encoded together."""

    def __init__(self, members: list[int], sae: Any, site: str, layers: list[int], k: int | None, device) -> None:
        self.members = members  # indices into the call's SAE list
        self.sae = sae  # stacked (nnvllm.sae_group.stack)
        self.site = site
        self.layers = torch.tensor(layers, dtype=torch.long, device=device)
        self.k = k


class _Features:
    """The armed SAEs of one capture: what they read and, on the keeping rank, their groups."""

    def __init__(self, specs: list[dict], device, keep: bool) -> None:
        self.specs = list(specs)
        self.sites = sorted({s["site"] for s in self.specs})  # every rank gathers these under TP
        self.groups: list[_Group] = []
        self.stream = None  # the encoding's CUDA stream (module docstring)
        if keep and self.specs:
            self._build(device)
            if torch.device(device).type == "cuda" and os.environ.get("NNVLLM_SAE_STREAM", "1") != "0":
                self.stream = torch.cuda.Stream(device=device)

    def _build(self, device) -> None:
        from ...sae import SAE
        from ...sae_group import stack, stack_key

        keys = [_member_key(s, device) for s in self.specs]
        loaded: dict[int, Any] = {}

        def load(i: int) -> Any:
            if i not in loaded:
                spec = self.specs[i]
                loaded[i] = SAE.load(spec["path"], site=spec["site"], layer=spec["layer"], dtype=spec["dtype"])
                _KIND[keys[i]] = stack_key(loaded[i])
            return loaded[i]

        plan: dict[tuple, list[int]] = {}
        for i, spec in enumerate(self.specs):
            if keys[i] not in _KIND:
                load(i)
            plan.setdefault((_KIND[keys[i]], spec["site"], spec["k"]), []).append(i)
        cache = {}
        for (_, site, k), members in plan.items():
            gkey = tuple(keys[i] for i in members)
            stacked = _CACHE.get(gkey)
            if stacked is None:
                stacked = stack([load(i) for i in members], device=device)
            cache[gkey] = stacked
            self.groups.append(_Group(members, stacked, site, [self.specs[i]["layer"] for i in members], k, device))
        _CACHE.clear()  # the last call's groups only: the device memory of SAEs no longer asked for goes back
        _CACHE.update(cache)

    def __bool__(self) -> bool:
        return bool(self.specs)

    def where(self) -> list[list[int]]:
        """Per SAE of the call, ``[group, row in the group]`` (the hand-off's layout, for the client)."""
        out = [[0, 0] for _ in self.specs]
        for g, grp in enumerate(self.groups):
            for j, i in enumerate(grp.members):
                out[i] = [g, j]
        return out

    def allocate(self, rows: int, device) -> dict[str, torch.Tensor]:
        """Arena entries ``[G, rows, ...]`` per group (one spare row, as the sites have)."""
        out = {}
        for g, grp in enumerate(self.groups):
            n, dt = len(grp.members), grp.sae.dtype
            if grp.k is None:
                out[f"_sae{g}_dense"] = torch.zeros(n, rows + 1, grp.sae.d_sae, dtype=dt, device=device)
            else:
                out[f"_sae{g}_ids"] = torch.zeros(n, rows + 1, grp.k, dtype=torch.int32, device=device)
                out[f"_sae{g}_values"] = torch.zeros(n, rows + 1, grp.k, dtype=dt, device=device)
            out[f"_sae{g}_error"] = torch.zeros(n, rows + 1, dtype=dt, device=device)
        self.mine(*out.values())  # written on our stream
        return out

    def nbytes_per_row(self) -> int:
        n = 0
        for grp in self.groups:
            item = torch.empty((), dtype=grp.sae.dtype).element_size()
            n += len(grp.members) * ((grp.sae.d_sae * item if grp.k is None else grp.k * (4 + item)) + item)
        return n

    def inputs(self, source) -> list[torch.Tensor]:
        """Per group, a copy of this step's rows of its layers ``[G, tokens, d_in]``, taken on the current
        stream; ``source(site)`` is the site's ``[layer, tokens, width]``. Ready for :meth:`encode` on
        :attr:`stream`."""
        xs = [source(grp.site).index_select(0, grp.layers) for grp in self.groups]
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
            for x in xs:  # allocated on the current stream, read on ours: not reused before we are done
                x.record_stream(self.stream)
        return xs

    def on_stream(self):
        """A context that runs the work inside it on :attr:`stream` (where there is one)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def mine(self, *tensors: torch.Tensor) -> None:
        """Tensors made on the current stream that work on :attr:`stream` reads or writes: their memory
        is not reused before that work is done."""
        if self.stream is not None:
            for x in tensors:
                x.record_stream(self.stream)

    def join(self) -> None:
        """Make the current stream wait for the encoding so far (before anything reads the arena)."""
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)

    def encode(self, xs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """This step's entries ``[G, tokens, ...]`` from :meth:`inputs`; call it inside :meth:`on_stream`."""
        out = {}
        for g, (grp, x) in enumerate(zip(self.groups, xs)):
            item = torch.empty((), dtype=grp.sae.dtype).element_size()
            step = max(1, CHUNK_BYTES // (x.shape[0] * grp.sae.d_sae * item))
            parts = [self._encode(grp, x[:, a: a + step]) for a in range(0, x.shape[1], step)]
            for name, v in zip(parts[0], zip(*(p.values() for p in parts))):
                out[f"_sae{g}_{name}"] = v[0] if len(v) == 1 else torch.cat(v, dim=1)
        return out

    @staticmethod
    def _encode(grp: _Group, x: torch.Tensor) -> dict[str, torch.Tensor]:
        acts, err = grp.sae.encode_with_error(x)
        if grp.k is None:
            return {"dense": acts, "error": err}
        values, ids = torch.topk(acts, k=grp.k, dim=-1, sorted=True)
        return {"ids": ids.to(torch.int32), "values": values, "error": err}
