"""The hand-off copy made while the engine generates (``NNVLLM_HANDOVER=mirror``).

By default the hand-off copies the arena into its shared-memory files after the last step, one DMA
(Llama-1B shape, 64 x 128, every block, the logits and the samples: 738 MB in 14.4 ms on an H100,
median of run ``llama1b_paired_split``), while the engine has nothing else to do. Here the rows each step places in the arena are also written into
the files as the generation goes: every :data:`MIRROR_STEPS` steps, the rows those steps placed
are gathered from the arena and written into the file (on a CUDA engine through the page-locked
file's device address, by a kernel on a stream of their own, so the writes overlap the next steps),
and the hand-off copies only what the last steps placed. Where a step's host work (vLLM's scheduler,
its inputs) outlasts its kernels, the device runs the writes in that idle time.

Only the sites' arenas are mirrored (the logits, the sampling statistics and the SAE features are
copied at the end as before), and only while the capture has one arena and its files are ready
(made and, on a GPU, page-locked) by the time the rows are written: a capture that outgrows its
arena, or whose file is not ready by the hand-off, is copied at the end whole, as by default.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch

MIRROR_STEPS = 8  # steps whose rows are written together (each write costs the host a few launches)


class _HostView:
    """The device's description of a page-locked file's bytes (``__cuda_array_interface__``)."""

    def __init__(self, ptr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (nbytes,), "typestr": "|u1",
                                         "version": 2, "strides": None}


def _view(f: Any, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """File ``f``'s first bytes as a tensor of ``shape`` that the engine's device writes into (None:
    it cannot, the file not being page-locked)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if f.size < nbytes:
        return None
    if device.type != "cuda":
        return f.host(nbytes, dtype, shape)
    if not f.registered or not f.ptr:
        return None
    raw = torch.as_tensor(_HostView(f.ptr, nbytes), device=device)
    return raw.view(dtype).view(shape)


_STREAMS: dict[Any, Any] = {}  # device -> the stream the writes run on


class _Mirror:
    """One capture's mirror of its first arena's sites into their hand-off files."""

    def __init__(self, shm: Any, sites: list[str], device: torch.device, timings: dict) -> None:
        self.shm = shm
        self.sites = list(sites)
        self.device = device
        self.timings = timings
        self.pending: list[torch.Tensor] = []  # each step's destination rows not yet written
        self.files: dict[str, tuple[Any, torch.Tensor]] = {}  # site -> (file, its writable view)
        self.off = not self.sites  # given up: the hand-off copies the whole arena at the end
        self.placing: Any = None  # the stream the steps place their rows on (a CUDA engine)
        self.written = False
        shm.writers.append(self.wait)

    def stop(self) -> None:
        self.off, self.pending, self.files = True, [], {}

    def placed(self, k: int, dst: torch.Tensor, arena: dict) -> None:
        """The step placed its rows at ``dst`` of arena ``k``."""
        if self.off:
            return
        if k != 0:  # a second arena: its rows have no file yet
            self.stop()
            return
        self.pending.append(dst)
        if self.placing is None and self.device.type == "cuda":
            self.placing = torch.cuda.current_stream(self.device)
        if len(self.pending) >= MIRROR_STEPS:
            self.write(arena)

    def write(self, arena: dict, last: bool = False) -> None:
        """Write the pending steps' rows into the files (every file ready, else they wait; ``last``:
        the hand-off is next, and a file not ready means the end copy)."""
        if self.off or not self.pending:
            return
        h0 = time.perf_counter()
        for s in self.sites:
            if s in self.files:
                continue
            x = arena[s]
            f = self.shm.ready_file(s)
            view = None if f is None else _view(f, (x.shape[0], x.shape[1] - 1, *x.shape[2:]), x.dtype, self.device)
            if view is None:
                if last or f is not None:  # (a file that is ready but cannot be written: the end copy)
                    self.stop()
                return
            self.files[s] = (f, view)
        rows = self.pending[0] if len(self.pending) == 1 else torch.cat(self.pending)
        self.pending = []
        if self.device.type == "cuda":
            stream = _STREAMS.get(self.device)
            if stream is None:
                stream = _STREAMS[self.device] = torch.cuda.Stream(self.device)
            stream.wait_stream(self.placing)  # the rows are placed
            with torch.cuda.stream(stream):
                for s, (_, view) in self.files.items():
                    view.index_copy_(1, rows, arena[s].index_select(1, rows))
            rows.record_stream(stream)
        else:
            for s, (_, view) in self.files.items():
                view.index_copy_(1, rows, arena[s].index_select(1, rows))
        self.written = True
        self.timings["mirror_host"] = self.timings.get("mirror_host", 0.0) + time.perf_counter() - h0
        self.timings["mirror_writes"] = self.timings.get("mirror_writes", 0) + 1

    def wait(self) -> None:
        """Until every write issued is done."""
        if self.written and self.device.type == "cuda":
            _STREAMS[self.device].synchronize()

    def finish(self, arena: dict, used_rows: int) -> dict[str, Any]:
        """Before the hand-off: the last steps' rows written and waited for; the files that hold their
        site's whole tensor (``used_rows`` rows: the file's layout), by site."""
        with torch.inference_mode():  # (the views and the arena were made in vLLM's steps, under it)
            self.write(arena, last=True)
        self.wait()  # (also after a stop: the end copy must not race writes still in flight)
        if self.off:
            return {}
        return {s: f for s, (f, _) in self.files.items() if arena[s].shape[1] - 1 == used_rows}
