"""Where a step in pieces keeps the blocks' outputs it serves a trace: slots the graphs write into.

A replayed graph writes every step's seams into the same memory, so a trace that keeps what it is
served needs a copy of its own. Made on the host at each seam, that copy is a clone per tensor (an
allocation and a kernel launch each: on an H100 host ~10 µs a tensor, most of what a seam costs
nnvllm). Instead, the pieces recorded for at most :attr:`Ring.rows` tokens also copy each seam's
output, inside the graph, into one slot of a ring the engine owns, at the slot that a one-element
device tensor (:attr:`Ring.index`) names. Before each step in pieces the host picks a slot that no
served value still holds and writes its number there; the seams then serve views of that slot: no
launch and no allocation at a seam.

Each slot has a storage of its own, so the slot's use count says whether anything outside the ring
still holds it (a trace that keeps what it was served, a view of it, a later step's list). A held
slot is never written. When every slot is held (a trace keeping every step's values), the step
serves clones, as an engine without a ring does, and its graphs write into a slot that nothing is
served from. Only outputs whose first dimension is the step's tokens are kept there (a model on
vLLM's Transformers backend, ``[1, tokens, width]``, is served clones).

``NNVLLM_TRACE_RING_BYTES`` (default 64 MiB of device memory; 0: no ring, every seam is served a
clone) bounds the ring; read where the engine starts. The slots are made in vLLM's first recording
of the graphs, the one that sizes their memory before the KV cache, so vLLM counts them. A served
view's memory is the ring's, not an allocation of its own: ``record_stream`` and ``resize_`` on it
do not apply.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch

SLOTS = 4  # slots served from; one more takes the writes of a step whose slots are all held
ALIGN = 256  # bytes: where each tensor of a slot starts


def ring_bytes() -> int:
    v = os.environ.get("NNVLLM_TRACE_RING_BYTES", str(64 << 20)).strip()
    try:
        n = int(v)
    except ValueError:
        n = -1
    if n < 0:
        raise ValueError(f"NNVLLM_TRACE_RING_BYTES={v!r}; expected a number of bytes (0 turns the ring off)")
    return n


def _layout(value: Any, tokens: int) -> tuple | None:
    """A seam output's layout: ``(single, ((dtype, row shape), ...))`` for a tensor, or a tuple of
    tensors, whose first dimension is the step's ``tokens``; None for anything else (served clones)."""
    if isinstance(value, torch.Tensor):
        ts, single = (value,), True
    elif type(value) is tuple and value and all(isinstance(t, torch.Tensor) for t in value):
        ts, single = value, False
    else:
        return None
    if any(t.dim() == 0 or t.shape[0] != tokens for t in ts):
        return None
    return single, tuple((t.dtype, tuple(t.shape[1:])) for t in ts)


def _use_count(storage: torch.UntypedStorage) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


class Held:
    """One seam's slots: ``views[slot]`` is its tensors in that slot, ``[rows, *row]`` each."""

    __slots__ = ("views", "single")

    def __init__(self, views: list, single: bool) -> None:
        self.views = views
        self.single = single

    def serve(self, slot: int, total: int) -> Any:
        """The seam's value in ``slot``, cut to the step's ``total`` rows."""
        v = self.views[slot]
        if self.single:
            return v[0][:total]
        return tuple([t[:total] for t in v])


class Ring:
    """The slots of one engine's steps in pieces (see the module's docstring)."""

    def __init__(self, device: torch.device, budget: int, largest: int = 0) -> None:
        self.device = device
        self.budget = budget
        self.largest = largest  # the largest batch vLLM records graphs for (0: the first one recorded)
        self.tokens = 0  # the batch of the recording in progress (set before each)
        self.layouts: dict[str, tuple | None] = {}  # seam -> its layout, seen while vLLM records
        self.rows = 0  # tokens a slot holds (0: no slots yet, or none fit the budget)
        self.made = False
        self.flat: torch.Tensor | None = None  # the slots' memory, slot after slot
        self.dst: dict[str, tuple] = {}  # seam -> per tensor, [SLOTS + 1, rows, *row] over every slot
        self.held: dict[str, Held] = {}
        self.made_layouts: dict[str, tuple] = {}  # seam -> the layout its slots were made for
        self.storages: list = []  # slot -> its own storage (over its part of flat)
        self.base: list[int] = []  # slot -> its storage's use count with nothing served from it
        self.index: torch.Tensor | None = None  # the step's slot, on the device, for the recorded copies
        self.slot: int | None = None  # the step's slot (None: the step serves clones)
        self.next = 0

    def learn(self, seam: str, value: Any) -> None:
        """A seam's output while vLLM records (its whole graph comes before its pieces)."""
        self.layouts[seam] = _layout(value, self.tokens)

    def make(self, tokens: int) -> None:
        """The slots, each of as many rows as the largest batch recorded (or ``tokens``, the batch
        about to be recorded in pieces) or fewer, as the budget allows; once, outside any recording,
        from the layouts learned. (Under torch.compile the whole graph's forward runs no hooks: the
        layouts are learned while the first batch's pieces are recorded, and that batch is served
        clones.)"""
        if self.made or not self.budget or not any(lay is not None for lay in self.layouts.values()):
            return
        self.made = True
        tokens = max(tokens, self.largest)
        seams = [(s, lay) for s, lay in self.layouts.items() if lay is not None]
        row_bytes = sum(math.prod(r) * d.itemsize for _, (_, lay) in seams for d, r in lay)
        if not row_bytes:
            return
        padding = ALIGN * sum(len(lay) for _, (_, lay) in seams)  # (at most, a slot's)
        rows = min(tokens, (self.budget // (SLOTS + 1) - padding) // row_bytes)
        if rows < 1:
            return
        with torch.inference_mode(False):  # (vLLM records under it) tensors with version counters: see replay
            self._make(seams, rows)

    def _make(self, seams: list, rows: int) -> None:
        offsets, at = [], 0
        for _, (_, lay) in seams:
            offs = []
            for d, r in lay:
                offs.append(at)
                at += -(-(rows * math.prod(r) * d.itemsize) // ALIGN) * ALIGN
            offsets.append(offs)
        slot_bytes = at
        self.flat = torch.zeros((SLOTS + 1) * slot_bytes, dtype=torch.uint8, device=self.device)
        by_slot = self.flat.view(SLOTS + 1, slot_bytes)
        self.storages = [torch._C._construct_storage_from_data_pointer(self.flat.data_ptr() + k * slot_bytes,
                                                                       self.device, slot_bytes)
                         for k in range(SLOTS)]
        for (seam, (single, lay)), offs in zip(seams, offsets):
            dst, views = [], [[] for _ in range(SLOTS)]
            for (d, r), off in zip(lay, offs):
                n = rows * math.prod(r)
                dst.append(by_slot[:, off:off + n * d.itemsize].view(d).view(SLOTS + 1, rows, *r))
                stride = tuple(torch.empty((rows, *r), device="meta").stride())
                for k in range(SLOTS):
                    views[k].append(torch.empty(0, dtype=d, device=self.device).set_(
                        self.storages[k], off // d.itemsize, (rows, *r), stride))
            self.dst[seam] = tuple(dst)
            self.held[seam] = Held([tuple(v) for v in views], single)
            self.made_layouts[seam] = (single, lay)
        self.base = [_use_count(s) for s in self.storages]
        self.index = torch.zeros(1, dtype=torch.long, device=self.device)
        self.rows = rows

    def record(self, seam: str, value: Any) -> Held | None:
        """While vLLM records a step in pieces, at seam ``seam``: the copy of its output into the step's
        slot, recorded into the piece that ends there; the seam's slots (None: this seam is served
        clones)."""
        held = self.held.get(seam)
        if held is None or self.tokens > self.rows or _layout(value, self.tokens) != self.made_layouts[seam]:
            return None
        for dst, t in zip(self.dst[seam], (value,) if held.single else value):
            dst[:, :self.tokens].index_copy_(0, self.index, t.unsqueeze(0))
        return held

    def start(self, tokens: int) -> None:
        """Before a step in pieces of ``tokens`` rows: its slot, one no served value holds."""
        self.slot = None
        if not self.rows:
            return
        if tokens > self.rows:  # (its pieces copy nothing; the index still names no served slot)
            self.index.fill_(SLOTS)
            return
        for i in range(SLOTS):
            k = (self.next + i) % SLOTS
            if _use_count(self.storages[k]) == self.base[k]:
                self.slot, self.next = k, (k + 1) % SLOTS
                self.index.fill_(k)
                return
        self.index.fill_(SLOTS)  # every slot held: the graphs write where nothing is served from
