"""SAE features at the taps: the armed SAEs encode their sites' rows on the device, a block of steps at a time.

A capture with ``saes`` (:func:`nnvllm.generate`) arms one :class:`_Features`. After each forward the
taps hold every block's value of each site for the step's rows (a static buffer a replayed CUDA graph
refilled, or the buffer an eager hook wrote). SAEs of one kind (:func:`nnvllm.sae_group.stack_key`: the
usual case, one SAE per layer of a release) run as one group: their layers' rows are gathered into
``[G, tokens, d_in]`` and encoded by one batched matmul, so the Python and kernel launches do not grow
with the number of SAEs. Per row the group keeps the top-``k`` feature ids (int32) and activations, or
the dense code when asked, and the reconstruction error's norm; the arena places these like any site
(:mod:`.arena`) and only they cross to the client: 32 features of a 16k-feature SAE are 256 bytes per
position against 4 KB of a d=2048 residual row in fp16.

Each step only copies its rows into a staging block (:meth:`_Features.stage`: one copy per group and
one of the rows' places in the arena); the block is encoded when full, and before anything reads the
arena (:meth:`_Features.flush`: collect, a stream's peek). A decode step of a 64-prompt batch has 64
rows, so encoding a step at a time would read every SAE's weights (a GB for 16 SAEs of 16k features on
a 1B model) and launch the encoder's kernels for 64 rows; a block of ``NNVLLM_SAE_BLOCK_ROWS`` rows
(default: as many as :data:`CHUNK_BYTES` of dense code allows, at most 4,096) reads them once for many
steps. ``NNVLLM_SAE_BLOCK_ROWS=0`` encodes each step as it comes (for comparison). A step with more
rows than a block (a long prefill) is encoded at once, in chunks of :data:`CHUNK_BYTES`.

SAEs are read from their folders (:meth:`nnvllm.SAE.load`) on the rank that keeps the record, stacked
on the device, and kept there between calls (:data:`_CACHE`, keyed by folders, file times and dtype).
"""

from __future__ import annotations

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
MAX_BLOCK_ROWS = 4096


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
        # layers l0, l0 + 1, ... (one SAE per layer of a release): a slice of the site, no gather
        self.span = (layers[0], layers[-1] + 1) if layers == list(range(layers[0], layers[-1] + 1)) else None
        self.k = k
        self.staged: torch.Tensor | None = None  # [G, block rows, d_in]: the rows waiting to be encoded

    def rows(self, source) -> torch.Tensor:
        """This step's ``[G, tokens, d_in]``; ``source(site)`` is the site's ``[layer, tokens, width]``."""
        if self.span is not None:
            return source(self.site)[self.span[0]: self.span[1]]
        return source(self.site).index_select(0, self.layers)

    def item(self) -> int:
        return self.sae.dtype.itemsize


class _Features:
    """The armed SAEs of one capture: what they read and, on the keeping rank, their groups."""

    def __init__(self, specs: list[dict], device, keep: bool, block_rows: int | None = None) -> None:
        self.specs = list(specs)
        self.sites = sorted({s["site"] for s in self.specs})  # every rank gathers these under TP
        self.groups: list[_Group] = []
        # The staging block (module docstring): rows staged so far, their places (arena row indices)
        # and runs (arena, start, end) of consecutive staged rows that go to the same arena.
        self.block = 0
        self.n_staged = 0
        self.places: torch.Tensor | None = None
        self.runs: list[list[int]] = []
        # (start, end) CUDA events around each encoding of a block: its device time, read at collect
        # without a host sync in the steps (the benchmarks' sae_gpu)
        self.events: list = []
        self.encodings = 0  # encodings run so far (blocks, and steps larger than a block): run stats
        if keep and self.specs:
            self._build(device)
            widest = max(len(g.members) * g.sae.d_sae * g.item() for g in self.groups)
            # the call's NNVLLM_SAE_BLOCK_ROWS, read by the client (capture._sae_block_rows)
            self.block = block_rows if block_rows is not None else max(1, min(MAX_BLOCK_ROWS, CHUNK_BYTES // widest))

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
        return out

    def nbytes_per_row(self) -> int:
        from ...sae import _row_bytes

        return sum(len(grp.members) * _row_bytes(grp.sae.d_sae, grp.k, grp.item()) for grp in self.groups)

    def stage(self, source, places: torch.Tensor, arena: int, arenas: list[dict], pick=None) -> None:
        """Take this step's rows of one arena: ``places`` their rows in ``arenas[arena]``, ``pick`` (or
        None: all) the step's rows that go there. Encodes the block first when they do not fit in it."""
        n = int(places.shape[0])
        if self.n_staged + n > self.block:
            self.flush(arenas)
        if n > self.block:  # a step larger than a block: encoded at once
            self.encodings += 1
            out = self.encode([g.rows(source) if pick is None else g.rows(source).index_select(1, pick)
                               for g in self.groups])
            self._place(out, arenas[arena], places, 0, n)
            return
        a, b = self.n_staged, self.n_staged + n
        if self.places is None:
            self.places = torch.empty(self.block, dtype=torch.long, device=places.device)
        for g in self.groups:
            if g.staged is None:
                g.staged = torch.empty(len(g.members), self.block, g.sae.d_in, dtype=source(g.site).dtype,
                                       device=places.device)
            x = g.rows(source)
            g.staged[:, a:b].copy_(x if pick is None else x.index_select(1, pick))
        self.places[a:b].copy_(places)
        if self.runs and self.runs[-1][0] == arena and self.runs[-1][2] == a:
            self.runs[-1][2] = b
        else:
            self.runs.append([arena, a, b])
        self.n_staged = b

    def flush(self, arenas: list[dict]) -> None:
        """Encode the staged rows and place them in their arenas."""
        if not self.n_staged:
            return
        n = self.n_staged
        ev = None
        if self.places.device.type == "cuda":
            ev = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            ev[0].record()
        self.encodings += 1
        out = self.encode([g.staged[:, :n] for g in self.groups])
        for k, a, b in self.runs:
            self._place(out, arenas[k], self.places[a:b], a, b)
        if ev is not None:
            ev[1].record()
            self.events.append(ev)
        self.n_staged, self.runs = 0, []

    def device_seconds(self) -> float | None:
        """The device's seconds in the encodings so far (None off a GPU); waits for the last one."""
        if not self.events:
            return None
        self.events[-1][1].synchronize()
        return sum(a.elapsed_time(b) for a, b in self.events) / 1e3

    def drop(self) -> None:
        """Forget the staged rows (a failed capture)."""
        self.n_staged, self.runs = 0, []

    @staticmethod
    def _place(out: dict[str, torch.Tensor], arena: dict, places: torch.Tensor, a: int, b: int) -> None:
        for name, v in out.items():  # [G, rows, ...]: like a site's [layer, tokens, width]
            arena[name].index_copy_(1, places, v[:, a:b])

    def encode(self, xs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Arena entries ``[G, rows, ...]`` of each group's rows ``xs[g]`` (``[G, rows, d_in]``)."""
        out = {}
        for g, (grp, x) in enumerate(zip(self.groups, xs)):
            step = max(1, CHUNK_BYTES // (x.shape[0] * grp.sae.d_sae * grp.item()))
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
