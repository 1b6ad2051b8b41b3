"""Garbage collection around an engine's start and close.

An engine start imports torch, transformers, nnsight and vLLM over a growing heap; left alone,
Python's automatic collections and vLLM's own ``gc.collect()`` calls (model load, KV-cache profile,
``freeze_gc_heap``) walk the whole heap a dozen times or more, several seconds of a CPU start.
:func:`_start_collections` keeps automatic collection off for the start and makes vLLM's full
collections walk only what is new; :func:`_collections_deferred` does the same for a close.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time

def _core_in_this_process(mode: str) -> bool:
    """Whether vLLM will run its EngineCore (and, at TP=1, the worker) inside this process: a sync
    ``LLM`` with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (nnvllm's in-process CPU engine at TP=1). vLLM's
    default (1, the GPU) and the server's AsyncLLM run it in a process of their own."""
    import vllm.envs

    return mode == "sync" and not vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING


_STARTING: tuple | None = None  # (gc.collect as it was, gc was enabled) while an engine starts here


@contextlib.contextmanager
def _start_collections(mode: str):
    """While an engine starts (its imports of torch, transformers, nnsight and vLLM included): no
    automatic garbage collections, and each full collection vLLM asks for walks only what was made
    since the one before.

    A process that starts an engine walks its whole heap again and again: while it imports vLLM,
    Python's automatic full collections (a dozen over a heap that keeps growing), then vLLM's own
    ``gc.collect()`` after every weight load and KV-cache profile and before it freezes the heap
    (``base_loader.load_model``, ``_cleanup_profiling_kv_cache``, ``gc_utils.freeze_gc_heap``) where
    its EngineCore runs: 17 full passes, ~6 s of a ~20 s first start of the toy engine on the 2-core
    CPU box. Here automatic collection is off for the start, and where the EngineCore
    runs in this process (``_core_in_this_process``: the CPU at TP=1 and in-process TP>1) each of
    vLLM's full collections freezes what survives it (``gc.freeze``), so the next one walks only what
    the start made since: the same garbage is freed (what the start makes and drops, vLLM's reason
    for collecting), and the heap ends frozen, as vLLM leaves it at the end of a start anyway (and
    unfreezes at shutdown). Where the EngineCore runs elsewhere, the full collections asked for here
    are skipped (nnsight's meta tree, built through vLLM's model loader, asks for two: passes over the
    whole heap that free no engine memory), and a process forked during the start (vLLM's EngineCore:
    the GPU, the isolated server) gets collection back at once, its inherited heap frozen (vLLM
    freezes it at the end of the EngineCore's start). An in-process engine whose EngineCore runs
    elsewhere (``mode="sync"``: the GPU) ends its start with one full collection, which frees the
    start's garbage, and freezes what survives, as vLLM does in the EngineCore and the isolated server
    in its own process. Otherwise everything the start made stays in the young generations (automatic
    collection was off), and a young collection a few calls later walks all of it (on the H100, after
    the toy model's start: 0.49M objects in generation 1; in the Llama-1B trace benchmark, one young
    collection of 0.25-0.32 s in one call of a series of ten). This freezes whatever the heap holds,
    objects someone else froze before included, and :func:`_thaw` unfreezes all of it at close.
    Where the EngineCore runs here, a heap someone else froze is not frozen further. After a failed
    start a heap frozen here is unfrozen again.
    """
    global _STARTING, _FROZE
    real, enabled, frozen = gc.collect, gc.isenabled(), gc.get_freeze_count()

    def collect(generation: int = 2) -> int:
        core_here = _core_in_this_process(mode)
        if generation == 2 and not core_here:
            # vLLM's collections that free its memory run where its EngineCore is; here a full pass
            # (nnsight builds its meta tree through vLLM's model loader, which collects twice) would
            # walk the whole heap for nothing. The pass at the end of the start frees the start's garbage.
            return 0
        n = real(generation)
        if generation == 2 and not frozen:
            gc.freeze()
        return n

    gc.disable()
    gc.collect = collect
    _STARTING = (real, enabled)
    ok = False
    try:
        yield
        ok = True
    finally:
        _STARTING = None
        gc.collect = real
        if enabled:
            gc.enable()
        if not ok and not frozen:
            gc.unfreeze()
    if mode == "sync" and not _core_in_this_process(mode):
        real()
        gc.freeze()
        _FROZE = True


_FROZE = False  # an in-process engine's start froze this process's heap (its EngineCore runs elsewhere)


def _thaw() -> None:
    """At an in-process engine's close: unfreeze the heap its start froze, so that the full collection
    after the close frees the engine's objects (where the EngineCore runs here, vLLM's shutdown
    unfreezes it)."""
    global _FROZE
    if _FROZE:
        _FROZE = False
        gc.unfreeze()


def _collections_in_forked_child() -> None:
    global _STARTING
    if _STARTING is not None:  # forked while an engine starts (vLLM's EngineCore): collect as usual
        real, enabled = _STARTING
        _STARTING = None
        gc.collect = real
        gc.freeze()  # the inherited heap: the imports, all of it lasting
        if enabled:
            gc.enable()


os.register_at_fork(after_in_child=_collections_in_forked_child)  # (a no-op unless an engine is starting)


@contextlib.contextmanager
def _collections_deferred(core_here: bool = True):
    """While an in-process engine shuts down: vLLM's ``gc.collect()`` calls do nothing (the caller
    collects once afterwards, when the engine is unreferenced and its objects are garbage).

    Where vLLM's EngineCore runs in this process (the CPU), its shutdown collects twice over the whole
    heap (``EngineCore.shutdown`` unfreezes the heap, then ``cleanup_dist_env_and_memory`` and the
    model runner's KV-cache cleanup collect), while the engine is still referenced from the closing
    call, so those passes cannot free it: ~0.75 s each on the 2-core box, close 2.5 s instead of
    ~1 s. Elsewhere (``core_here=False``) nothing changes.
    """
    if not core_here:
        yield
        return
    real = gc.collect
    gc.collect = lambda generation=2: 0
    try:
        yield
    finally:
        gc.collect = real


class _Pauses:
    """This process's time in garbage collections since it was installed (``gc.callbacks``): seconds,
    and how many collections ran of the oldest generation (``full``) and of the younger two."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.full = 0
        self.young = 0
        self._t0: float | None = None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif self._t0 is not None:
            self.seconds += time.perf_counter() - self._t0
            self._t0 = None
            if info.get("generation") == 2:
                self.full += 1
            else:
                self.young += 1


_PAUSES: _Pauses | None = None


def gc_pauses() -> tuple[float, int, int]:
    """(seconds, full collections, younger collections) spent in garbage collection by this process so
    far; the first call starts the count. A call's share is the difference of two readings
    (:func:`gc_delta`): the benchmarks read it per capture to tell collection pauses from other host
    time in a step loop."""
    global _PAUSES
    if _PAUSES is None:
        _PAUSES = _Pauses()
        gc.callbacks.append(_PAUSES)
    return _PAUSES.seconds, _PAUSES.full, _PAUSES.young


def gc_delta(before: tuple[float, int, int], prefix: str = "") -> dict[str, float]:
    """What this process spent in garbage collection since ``before`` (a :func:`gc_pauses` reading),
    as timings: ``gc`` seconds, ``gc_full`` and ``gc_young`` counts (names after ``prefix``)."""
    s, f, y = gc_pauses()
    return {f"{prefix}gc": s - before[0], f"{prefix}gc_full": f - before[1], f"{prefix}gc_young": y - before[2]}
