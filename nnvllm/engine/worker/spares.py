"""Hand-off files kept ready between captures (:class:`_Spares`), for :mod:`.handoff`."""

from __future__ import annotations

import os
import threading
from typing import Any

# Hand-off files kept ready between captures (bytes; 0 turns it off), see _Spares.
SPARE_BYTES = int(os.environ.get("NNVLLM_SPARE_BYTES", 4 << 30))
# Seconds without a capture after a hand-off before new spares are made (see _Spares).
SPARE_IDLE_S = 0.5


class _Spares:
    """Hand-off files made ready between captures, one per file the last capture handed over.

    Preparing a file (allocating its pages, mapping them, page-locking them for DMA) costs about as
    much as a short generation: measured on an H200, a 64 x 128 capture of the Llama-1B shape waited
    0.12 s at hand-off for its 0.74 GB of files prepared while it generated. Calls in a row usually
    have the same shape (``nv.collect``'s chunks always do), so once the engine has been idle for
    :data:`SPARE_IDLE_S` after a hand-off the worker makes files of the same sizes in the background,
    up to ``NNVLLM_SPARE_BYTES`` (default 4 GiB of shared memory held between calls; 0: none). A
    later capture takes the smallest that fits (cut to its size when handed over); spares of other
    shapes stay ready too while the budget allows (:meth:`refill`).
    They go with the engine: unlinked at exit, swept by the next engine if its process was killed.

    Why wait for idleness: the files are made in the engine's own process, and page-locking 0.74 GB
    holds up the CUDA calls of the step loop. Made right after the hand-off, they would be made
    during the next call whenever calls come back to back, and that call takes longer (on an H100,
    Llama-1B shape 64 x 128, spares made at once: the call after the warm-up, which made them, took
    0.79 s; the calls after it 0.57 s). A capture that starts before the engine has been idle that long
    (:meth:`take_back`, as it is armed) cancels the making; it takes the files its client returned,
    else prepares its own while it generates, as a first call does.

    Handed-over files are recycled too: the worker keeps the newest of them mapped (and page-locked)
    in ``kept``, within the same budget, and does not let the client unlink them. When every tensor
    of a Run that views such a file is gone, the client names the file in its next call
    (``spec["returned"]``, see :func:`.handoff.open_handover`) and the worker takes it back as a
    spare, ready at no cost: calls in a row that drop their Runs (a benchmark, ``nv.collect``'s
    chunks) prepare no file at all. A kept file the client still holds is never reused; the oldest
    are let go (unmapped and unlinked here; the client's mapping stays valid) when newer ones need
    the room.
    """

    def __init__(self) -> None:
        self.files: list[tuple[int, Any]] = []  # (size, future of _ShmFile)
        self.kept: dict[str, Any] = {}  # handed over, still mapped here, oldest first
        self.pool = None
        self.pending: list = []  # futures of background work (see wait)
        self.lock = threading.Lock()  # self.files: the worker's thread and the idle timer's
        self.epoch = 0  # captures armed so far: a timer set before the latest one does nothing
        self.timer: threading.Timer | None = None

    def kept_bytes(self) -> int:
        return sum(f.size for f in self.kept.values())

    def keep(self, f) -> bool:
        """Keep handed-over ``f`` mapped for recycling, letting the oldest kept files go if the budget
        needs it; False (and nothing kept) when ``f`` alone is over it."""
        if SPARE_BYTES <= 0 or f.size > SPARE_BYTES:
            return False
        with self.lock:
            while self.kept and self.kept_bytes() + f.size > SPARE_BYTES:
                old = self.kept.pop(next(iter(self.kept)))
                self.submit(old.discard)
            self.kept[f.path] = f
        return True

    def take_back(self, paths) -> list[str]:
        """As a capture is armed: spares not yet made wait for the next idle time, and kept files
        whose Runs the client has dropped become spares again (mapped, page-locked)."""
        import concurrent.futures

        self.cancel_timer()
        taken = []
        with self.lock:
            for p in paths or ():
                f = self.kept.pop(p, None)
                if f is None:  # not this worker's, or let go already
                    continue
                fut = concurrent.futures.Future()
                fut.set_result(f)
                f.spare = True
                self.files.insert(0, (f.size, fut))  # taken before a same-size spare that may still be in the making
                taken.append(p)
        return taken

    def cancel_timer(self) -> None:
        with self.lock:
            self.epoch += 1
            timer, self.timer = self.timer, None
        if timer is not None:
            timer.cancel()

    def submit(self, fn, *args):
        fut = self.executor().submit(fn, *args)
        self.pending = [f for f in self.pending if not f.done()] + [fut]
        return fut

    def wait(self) -> None:
        """Until the background work submitted so far is done, spares waiting for idleness included
        (tests, ``nnvllm_spares``)."""
        timer = self.timer
        if timer is not None:
            timer.join()
        for f in list(self.pending):
            f.exception()

    def executor(self):
        if self.pool is None:
            import atexit
            import concurrent.futures

            self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="nnvllm-shm")
            atexit.register(self.drop)
        return self.pool

    def take(self, nbytes: int) -> tuple[int, Any] | None:
        with self.lock:
            fits = [(size, i) for i, (size, _) in enumerate(self.files) if nbytes <= size <= 2 * nbytes + (64 << 20)]
            return self.files.pop(min(fits)[1]) if fits else None

    def refill(self, sizes: list[int], leftovers: list[tuple[int, Any]], make) -> None:
        """Keep spares of ``sizes`` (largest first, within what SPARE_BYTES leaves beside the kept
        files): the spares and ``leftovers`` (prepared, never handed over) that fit now, new files
        once the engine is idle (:data:`SPARE_IDLE_S`); keep the other spares too while the budget
        allows, and discard the rest.

        The others are kept because calls of different shapes alternate (a notebook asks for every
        layer, then for the logits alone): discarded after a small call, the big files would be made
        again during the next big call's generation (on the CPU toy engine, calls keeping tokens only
        and every layer in turn: 4 new files in each of the second kind)."""
        self.cancel_timer()
        with self.lock:
            old, self.files, total = self.files + leftovers, [], self.kept_bytes()
            missing = []
            for size in sorted(sizes, reverse=True):
                if total + size > SPARE_BYTES:
                    continue
                fit = [(s, i) for i, (s, _) in enumerate(old) if size <= s <= 2 * size + (64 << 20)]
                if fit:
                    self.files.append(old.pop(min(fit)[1]))
                else:
                    missing.append(size)
                total += size
            for size, fut in old:  # (taken-back files first: the newest shapes)
                if total + size <= SPARE_BYTES:
                    self.files.append((size, fut))
                    total += size
                else:
                    self.submit(_discard_when_ready, fut)
            if missing:
                self.timer = threading.Timer(SPARE_IDLE_S, self._make_when_idle, (self.epoch, missing, make))
                self.timer.daemon = True
                self.timer.start()

    def _make_when_idle(self, epoch: int, sizes: list[int], make) -> None:
        with self.lock:
            if epoch != self.epoch:  # a capture was armed meanwhile
                return
            total = self.kept_bytes() + sum(size for size, _ in self.files)
            for size in sizes:
                if total + size <= SPARE_BYTES:
                    self.files.append((size, self.submit(make, size)))
                    total += size

    def drop(self) -> None:
        self.cancel_timer()
        with self.lock:
            files, self.files = self.files, []
            kept, self.kept = self.kept, {}
        for _, fut in files:
            _discard_when_ready(fut)
        for f in kept.values():
            f.discard()


def _discard_when_ready(fut) -> None:
    try:
        fut.result(timeout=30).discard()
    except Exception:  # noqa: BLE001 (a file that failed to be made left nothing behind)
        pass


_SPARES = _Spares()
