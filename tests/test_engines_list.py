"""nv.engines() lists every live engine; one the notebook lost track of can still be closed from it."""

from __future__ import annotations

import os

import pytest
import torch

import nnvllm as nv
from conftest import engine_kwargs


def test_an_engine_listed_by_engines_can_be_closed_from_the_list(toy_path):
    # Re-running a `model = nv.load()` cell: the old object is only held by something the user does
    # not see (IPython's output history, a widget); stand-in: this list.
    history = [nv.load(toy_path, isolate=False, **engine_kwargs(1))]
    listed = [e for e in nv.engines() if e.kind == "in-process"]
    assert listed, nv.engines()
    for e in listed:
        e.close()
    assert history[0].vllm_entrypoint is None  # closed
    assert not [e for e in nv.engines() if e.kind == "in-process"]


def test_reloading_hands_back_the_same_engine_or_closes_the_old_one(toy_path, tiny_paths, capsys):
    """Re-running a notebook's load cell: the same model and arguments give the running engine back;
    another model closes the old engine first (vLLM's distributed state is per process, so two
    in-process engines would break each other), and the old object says it was closed."""
    m1 = nv.load(toy_path, isolate=False, **engine_kwargs(1))
    try:
        before = nv.generate(m1, "The capital of France is", max_tokens=3)
        capsys.readouterr()
        again = nv.load(toy_path, isolate=False, **engine_kwargs(1))
        assert again is m1
        assert "already loaded" in capsys.readouterr().out
        after = nv.generate(m1, "The capital of France is", max_tokens=3)
        assert after.tokens == before.tokens and torch.equal(after.resid[0], before.resid[0])
        with nv.load(tiny_paths["llama"], isolate=False, **engine_kwargs(1)) as m2:
            out = capsys.readouterr().out
            assert "closing the in-process engine" in out, out
            assert m1.vllm_entrypoint is None
            with pytest.raises(RuntimeError, match="closed"):
                nv.generate(m1, "The capital of France is", max_tokens=1)
            assert nv.generate(m2, "The capital of France is", max_tokens=2).tokens[0]
            assert [e.model for e in nv.engines() if e.kind == "in-process"] == [m2.checkpoint]
    finally:
        m1.close()


def test_a_start_and_a_close_walk_the_whole_heap_once_each(toy_path):
    """nnvllm.engine._start_collections: vLLM collects garbage about ten times while an in-process
    engine starts, each pass over every object of the process that runs its EngineCore (~2.5 s of a
    ~4.5 s start on the CPU box). Where that is this process (the CPU at TP=1), the first pass freezes
    the heap, so the others walk only what the start creates. Counted here: full collections while
    nothing is frozen (one, where vLLM alone makes five on the CPU box), in a process that has
    started an engine before (a first start imports much of vLLM; its imports' automatic passes are
    off during the start too). Where the EngineCore runs in its own process (the GPU), vLLM
    collects nothing here, and the start ends with one full collection, which frees the garbage from
    before it, and freezes what survives (so that a call's full collection does not walk the heap of
    vLLM and torch); the close unfreezes it.
    Closing (nnvllm.engine._collections_deferred): one full collection, after which the engine is
    gone, instead of vLLM's two during its shutdown and nnvllm's one after it."""
    import gc
    import weakref

    from nnvllm.engine import _core_in_this_process

    nv.load(toy_path, isolate=False, **engine_kwargs(1)).close()
    core_here = _core_in_this_process("sync")  # read after a load: nv.load sets the environment
    frozen_before = gc.get_freeze_count()
    if core_here:
        assert frozen_before == 0  # the close before unfroze what the start froze

    class Cycle:
        pass

    c = Cycle()
    c.me = c
    gone = weakref.ref(c)
    del c  # garbage from before the start: still freed by it, as vLLM's own passes freed it
    full: list = []
    unfrozen: list = []

    def count(phase, info):
        if phase == "start" and info["generation"] == 2:
            full.append(1)
            if not gc.get_freeze_count():
                unfrozen.append(1)

    gc.callbacks.append(count)
    try:
        model = nv.load(toy_path, isolate=False, **engine_kwargs(1))
    finally:
        gc.callbacks.remove(count)
    try:
        if core_here:
            assert gone() is None
            assert len(unfrozen) == 1, f"{len(unfrozen)} full collections over the unfrozen heap during the start"
            assert gc.get_freeze_count() > 0  # vLLM froze the heap at the end of its start, as it does alone
        else:  # one full collection at the end of the start, which froze what survived it
            assert gone() is None
            assert len(full) == 1, f"{len(full)} full collections in this process while an engine started elsewhere"
            assert gc.get_freeze_count() > frozen_before, "the start did not freeze this process's heap"
        assert nv.generate(model, "The capital of France is", max_tokens=2).tokens[0]
        engine = weakref.ref(model.llm.llm_engine)
        full.clear()
        gc.callbacks.append(count)
    finally:
        try:
            model.close()
        finally:
            if count in gc.callbacks:
                gc.callbacks.remove(count)
    # nnvllm.engine._collections_deferred: where the core runs here, vLLM's shutdown collects nothing
    # and close collects once, after which the engine is gone (it collected three times before).
    if core_here:
        assert len(full) == 1, f"{len(full)} full collections during close"
        assert engine() is None, "the closed engine is still alive"
    if core_here:
        assert gc.get_freeze_count() == 0  # vLLM's shutdown unfroze it
    else:
        assert gc.get_freeze_count() == frozen_before
    with pytest.raises(Exception, match="max_model_len"):
        nv.load(toy_path, isolate=False, **engine_kwargs(1, max_model_len=10**7))
    assert gc.get_freeze_count() == frozen_before  # a failed start leaves the heap as it found it


def test_an_engine_start_collects_only_what_it_made(monkeypatch):
    """_start_collections, the context every engine start runs in: no automatic collection during it.
    Where the EngineCore runs in this process a full collection (vLLM's) still frees garbage and
    freezes what survives, so the next one walks only what came after; elsewhere a full collection
    asked for here walks nothing (nnsight's meta tree asks for two through vLLM's model loader, and
    the memory vLLM's collections free is the EngineCore's); an in-process engine's start there
    (``mode="sync"``) ends with one full collection and freezes what survives, a heap frozen before
    included, so that no young collection walks what the start made; its close unfreezes it
    (``heap._thaw``). A process forked during the start (vLLM's EngineCore on the GPU and in the isolated server)
    collects as usual from the start, its inherited heap frozen. A failed start unfreezes the heap."""
    import gc
    import weakref

    from nnvllm.engine import heap as engine
    from nnvllm.engine import _core_in_this_process, _start_collections

    class Cycle:
        pass

    def garbage():
        c = Cycle()
        c.me = c
        return weakref.ref(c)

    real = gc.collect
    before = gc.get_freeze_count()
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")  # vLLM's default, the GPU's
    assert not _core_in_this_process("sync")
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # nnvllm's CPU engine at TP=1
    assert _core_in_this_process("sync")
    assert not _core_in_this_process("async")  # the isolated server's AsyncLLM
    full: list = []
    passes: list = []

    def count(phase, info):
        if phase == "start":
            passes.append(info["generation"])
            if info["generation"] == 2:
                full.append(1)

    gc.callbacks.append(count)
    try:
        with _start_collections("async"):  # the EngineCore runs elsewhere
            assert not gc.isenabled()
            for _ in range(20_000):  # allocations that set off many automatic passes: none runs
                garbage()
            assert not passes
            gone = garbage()
            assert gc.collect() == 0  # vLLM's full collections walk nothing here (its memory is elsewhere)
            assert not full and gone() is not None
            gc.collect(0)  # a young pass still runs
            assert passes == [0] and gone() is None
            assert gc.get_freeze_count() == before  # nothing frozen here
        assert gc.isenabled() and gc.collect is real
        gone = garbage()
        gc.collect()  # after the start, collection is as it was
        assert gone() is None and len(full) == 1
        full.clear()
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
        gc.freeze()  # a heap someone froze before the start (on the H100's image, 375 objects)
        with _start_collections("sync"):  # an in-process engine whose EngineCore runs elsewhere (the GPU)
            made = [Cycle() for _ in range(20_000)]  # what a start makes and keeps,
            for _ in range(20_000):  # and what it drops
                garbage()
            gone = garbage()
            assert gc.collect() == 0 and gone() is not None and not full
            assert len(gc.get_objects(0)) + len(gc.get_objects(1)) > 20_000  # all young: no pass ran
        # The start ends with one full collection, which frees its garbage, and freezes what survives
        # (someone else's frozen objects included): no young collection walks what the start made.
        assert gone() is None and len(full) == 1
        assert gc.get_freeze_count() > len(made)
        assert len(gc.get_objects(0)) + len(gc.get_objects(1)) < 1_000
        engine._thaw()  # (the close)
        assert gc.get_freeze_count() == 0
        del made, gone  # (dropped before the re-freeze below: a frozen object freed later lowers the count)
        if before:
            gc.freeze()  # (as it found it: frozen)
        before = gc.get_freeze_count()
        monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        full.clear()
        with pytest.raises(RuntimeError, match="failed"), _start_collections("sync"):  # the core here
            gone = garbage()
            gc.collect()
            assert gone() is None
            if not before:  # (a heap frozen by someone else is not frozen further)
                frozen = gc.get_freeze_count()
                assert frozen > 0
                gone = garbage()
                gc.collect()  # walks what came after the first: the garbage made since is freed
                assert gone() is None and gc.get_freeze_count() >= frozen
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # vLLM's EngineCore, forked during the start
                try:
                    state = (gc.isenabled(), gc.collect is real, gc.get_freeze_count() > 0,
                             engine._STARTING is None)
                    os.write(write, repr(state).encode())
                finally:
                    os._exit(0)
            os.close(write)
            with os.fdopen(read) as f:
                child = f.read()
            os.waitpid(pid, 0)
            assert child == "(True, True, True, True)", child
            assert not gc.isenabled() and gc.collect is not real  # the start goes on here
            raise RuntimeError("the start failed")
        assert gc.isenabled() and gc.collect is real
    finally:
        gc.callbacks.remove(count)
    assert gc.get_freeze_count() == before  # the failed start unfroze what it froze


def test_a_load_prints_one_line_and_the_engine_log_keeps_the_rest(toy_path):
    """In a fresh process (as a notebook kernel): vLLM's warnings, torch's C++ NUMA note and the weight
    loading bar stay off the page, the load says one line, ``model.log()`` has what vLLM said, and the
    user's own tracebacks carry no ``[rank0]:`` prefix (torch.distributed wraps sys.excepthook)."""
    import subprocess
    import sys

    code = (
        "import sys, nnvllm as nv\n"
        f"m = nv.load({toy_path!r}, isolate=False)\n"
        "print('LOG', 'LD_PRELOAD' in m.log(None) or 'WARNING' in m.log(None))\n"
        "print('HOOK', sys.excepthook is sys.__excepthook__)\n"
        "m.close()\n"
        "raise ValueError('the user error')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("NNVLLM_VERBOSE", "VLLM_CONFIGURE_LOGGING")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    loaded = [ln for ln in lines if ln.startswith("nnvllm: ")]
    device = "GPU" if torch.cuda.is_available() else "CPU"
    assert len(loaded) == 1 and f"in-process {device} engine" in loaded[0], lines
    assert "LOG True" in lines and "HOOK True" in lines, lines
    tb = out.stderr.splitlines()
    assert tb[-1] == "ValueError: the user error" and not [ln for ln in tb if "[rank" in ln], out.stderr
    # Nothing else: the one line, the two answers, and the user's own traceback.
    assert len(lines) == 3 + len([ln for ln in tb if ln.strip()]), lines


def test_torch_log_records_during_an_engine_start_go_to_the_engine_log(capfd):
    """torch's own warnings (vLLM 0.33's import makes torch 2.14 log three deprecations) go to the
    engine log while an engine starts, not to the page; afterwards torch's logging is as it was."""
    import logging

    from nnvllm.engine import logs

    import torch._dynamo  # noqa: F401 - a logger of torch's with a handler of its own

    loggers = [logging.getLogger(n) for n in ("torch", "torch._dynamo")]
    before = [(lg.handlers[:], lg.propagate) for lg in loggers]
    assert before[1][0], "torch._dynamo's logger has no handler of its own here: the test misses that case"
    with logs.captured_warnings():
        logging.getLogger("torch._opaque_base").warning("torch._opaque_base is deprecated (a test)")
        logging.getLogger("torch._dynamo.convert_frame").warning("a recompilation (a test)")
    for line in ("torch._opaque_base is deprecated (a test)", "a recompilation (a test)"):
        assert line in logs.ENGINE_LOG.text(last=20), line
    out, err = capfd.readouterr()
    assert "(a test)" not in out + err, (out, err)
    assert [(lg.handlers[:], lg.propagate) for lg in loggers] == before
    # An error still reaches the page, in one line that names torch.
    with logs.captured_warnings():
        logging.getLogger("torch._library.opaque_object").error("a failure (a test)\nits details")
    out, err = capfd.readouterr()
    assert err.strip() == "nnvllm: torch error: a failure (a test) (model.log() has the rest)", err
