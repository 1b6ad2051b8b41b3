"""Capture under vLLM's scheduler at its hardest: chunked prefill, preemption, and a failed recording.

Rows are placed by (request, position) once per engine step (``nnvllm.engine.worker``), so a prompt split
over several steps, or a request preempted and recomputed, must still give every position exactly
once with the value transformers computes. A recording that fails inside the engine must fail that
capture alone: the engine keeps answering.
"""

from __future__ import annotations

import os

import pytest
import torch

import nnvllm as nv
from nnvllm.engine.worker import spares
from nnvllm.engine.worker.handoff import SHM_PREFIX, shm_dir

from conftest import engine_kwargs

FACTS = [p for p, _ in nv.toy.FACTS][:12]


@pytest.fixture(scope="module")
def toy(toy_path, tp):
    # In-process (on a GPU too, where nv.load isolates by default): the failed-recording test arms
    # the worker directly through toy.llm.
    model = nv.load(toy_path, isolate=False, **engine_kwargs(tp))
    yield model
    model.close()


def _check(run, toy_path, tag):
    ref = nv.reference(toy_path, run.prompts, tokens=run.tokens)
    for i in range(len(run)):
        assert run.resid[i].shape[1] == run.positions(i)
        assert (run.resid[i] - ref.resid[i]).abs().max() <= 1e-3
        assert (run.logits[i] - ref.logits[i]).abs().max() <= 1e-3


@pytest.mark.skipif(torch.cuda.is_available(), reason="fixed CPU fp32 bounds; on a GPU, capture fidelity is checked with calibrated bounds in test_capture.py")
def test_chunked_prefill_places_every_position_once(toy_path):
    # 8 tokens per step: every prompt is split across steps, and several prompts share a step.
    model = nv.load(toy_path, isolate=False, **engine_kwargs(1, enable_chunked_prefill=True,
                                                               max_num_batched_tokens=8, max_num_seqs=4))
    try:
        run = nv.generate(model, FACTS, max_tokens=6, ignore_eos=True, sites=("mlp",))
    finally:
        model.close()
    from nnvllm.capture import _LAST_STATS

    assert _LAST_STATS["partial_prefills"] > 0  # prompts really were split over steps
    _check(run, toy_path, "chunked")


@pytest.mark.skipif(torch.cuda.is_available(), reason="fixed CPU fp32 bounds; on a GPU, capture fidelity is checked with calibrated bounds in test_capture.py")
def test_a_prompt_computed_a_token_a_step_beside_decoding_requests_keeps_its_logits_rows(toy_path):
    """A step budget of as many tokens as requests: while three requests decode, the fourth's prompt
    goes in one token a step, in steps shaped like decode steps (one token per request). Its logits
    rows are kept only from its last prompt token on, as in any other step. Every fourth prompt is
    three times as long, so that the rows a misplaced prompt token would land on (before its own)
    hold logits already written: a misplacement shows in another request's logits."""
    long = [" ".join(FACTS[i:i + 3]) for i in range(0, 9, 3)]
    prompts = [p for i in range(3) for p in (*FACTS[3 * i:3 * i + 3], long[i])]
    model = nv.load(toy_path, isolate=False, **engine_kwargs(1, enable_chunked_prefill=True,
                                                               max_num_batched_tokens=4, max_num_seqs=4))
    try:
        run = nv.generate(model, prompts, max_tokens=6, ignore_eos=True)
    finally:
        model.close()
    from nnvllm.capture import _LAST_STATS

    assert _LAST_STATS["prompt_token_steps"] > 0  # decode-shaped steps carried a prompt token
    _check(run, toy_path, "a token a step")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the KV-cache size and 32-token blocks that force preemption are chosen for the CPU backend")
def test_preempted_requests_are_recomputed_and_placed_by_position(toy_path, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)  # it would override the size below
    # 1 MiB of KV cache in 32-token blocks for 24 requests that grow past one block: vLLM preempts
    # running requests and recomputes them (measured: 1352 rows placed for 1056 positions).
    model = nv.load(toy_path, isolate=False, **engine_kwargs(1, kv_cache_memory_bytes=1 << 20, max_model_len=64,
                                                               block_size=32))
    try:
        run = nv.generate(model, FACTS * 2, max_tokens=40, ignore_eos=True)
    finally:
        model.close()
    from nnvllm.capture import _LAST_STATS

    assert _LAST_STATS["rows"] > sum(run.positions(i) for i in range(len(run)))  # rows were recomputed
    _check(run, toy_path, "preempted")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU engine's arenas are host memory; a GPU's come from torch's caching allocator")
def test_a_cpu_engines_next_call_reuses_the_host_memory_of_a_dropped_run_and_never_of_a_held_one(toy_path):
    """On the CPU a capture's arena is host memory, and in one process the Run views it. A call while
    an earlier Run is held writes elsewhere (the held Run's values stay as they were); once the Runs
    are dropped, the next call writes into the last capture's memory, and its values are right. The
    engine lets that memory go when it closes."""
    import weakref

    from nnvllm.engine.worker import arena

    def ptr(t):
        return t.untyped_storage().data_ptr()

    model = nv.load(toy_path, isolate=False, **engine_kwargs(1))
    try:
        first = nv.generate(model, FACTS, max_tokens=4)
        kept = first.resid[0].clone()
        second = nv.generate(model, FACTS, max_tokens=4)
        assert torch.equal(first.resid[0], kept)
        assert ptr(second.resid[0]) != ptr(first.resid[0])
        blocks = [weakref.ref(b) for b, _ in arena._HOST.free]  # the second call's
        assert any(ptr(b()) == ptr(second.resid[0]) for b in blocks)
        del first, second
        third = nv.generate(model, FACTS, max_tokens=4)
        assert all(b() is not None for b in blocks)
        assert any(ptr(b()) == ptr(third.resid[0]) for b in blocks)
        _check(third, toy_path, "reused")
        model.close()  # the engine lets its kept memory go; a Run still views what it holds
        assert all(b() is None for b in blocks) and third.resid[0].abs().sum() > 0
    finally:
        model.close()


def test_a_failed_recording_fails_alone_and_the_engine_keeps_answering(toy):
    first = nv.generate(toy, "The capital of France is", max_tokens=3)
    # Arm the worker with a site it has no tap for: the recording fails at the first step.
    toy.llm.collective_rpc("nnvllm_arm", args=({"family": toy.arch.family, "layers": [0], "sites": ["nope"],
                                                "logits": True, "sample": None, "client_pid": os.getpid()},))
    from vllm import SamplingParams

    out = toy.llm.generate(["The capital of Italy is"], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert out[0].outputs[0].text  # the generation itself completed
    res = toy.llm.collective_rpc("nnvllm_collect", args=({},))[0]
    assert "error" in res and "nope" in res["error"]
    again = nv.generate(toy, "The capital of France is", max_tokens=3)
    assert again.text == first.text and torch.equal(again.resid[0], first.resid[0])


def test_no_handoff_file_is_left_behind(toy):
    """After a capture the only hand-off files of the engine's worker are the ones it keeps ready for
    the next and the handed-over ones it keeps for recycling (on a GPU engine in its own process:
    _Spares); dropping those leaves none. Only this worker's files count (the GPU lane runs other
    engines beside this one)."""
    nv.generate(toy, FACTS[:4], max_tokens=3)
    info = toy.llm.collective_rpc("nnvllm_spares")[0]
    mine = lambda: {f for f in os.listdir(shm_dir()) if f.startswith(f"{SHM_PREFIX}{info['pid']}-")}  # noqa: E731
    assert mine() == {os.path.basename(p) for p in info["files"] + info["kept"]}
    assert toy.llm.collective_rpc("nnvllm_spares", kwargs={"drop": True})[0]["pid"] == info["pid"]
    assert mine() == set()


def _wait_for_pool():
    from nnvllm.engine.worker.handoff import _SPARES

    _SPARES.wait()


def test_handoff_files_not_handed_over_are_removed(monkeypatch):
    """The GPU hand-off's prepared files (driven here without a GPU): a tensor takes the smallest
    prepared file that fits; at the end every file the client will not map is removed, including
    one a failed hand-off made and never handed."""
    from nnvllm.engine.worker.handoff import _ShmFiles

    monkeypatch.setenv("NNVLLM_HANDOVER", "plain")  # no page-locking without CUDA
    monkeypatch.setattr(spares, "SPARE_BYTES", 0)  # no files kept for a next capture (tested below)
    mine = lambda: {f for f in os.listdir(shm_dir()) if f.startswith(f"{SHM_PREFIX}{os.getpid()}-")}  # noqa: E731
    before = mine()
    files = _ShmFiles()
    for n in (4096, 64, 1 << 20):
        files.prepare(n)
    small = files.take(32)
    assert small.size == 64  # not the 1 MiB file
    big = files.take(8 << 20)  # none fits: a new one
    assert big.size == 8 << 20
    stray = files._make(100)  # as if a hand-off failed after making it
    files.discard()  # (prepared files are discarded in the background)
    _wait_for_pool()
    left = mine() - before
    assert left == {os.path.basename(small.path), os.path.basename(big.path)}  # the client's to unlink
    assert not os.path.exists(stray.path)
    for f in (small, big, stray):
        f.release(0)
    for p in (small.path, big.path):
        os.unlink(p)


def test_a_file_prepared_for_one_tensor_is_not_taken_by_another(monkeypatch):
    """The hand-off's order (the residual stream, the sampling statistics, then the logits): the
    statistics are never prepared, and the smallest prepared file that fits them is the logits';
    each tensor gets the file made ready for it, and the statistics a file of their own size."""
    from nnvllm.engine.worker.handoff import _SPARES, _ShmFiles

    monkeypatch.setenv("NNVLLM_HANDOVER", "plain")
    monkeypatch.setattr(spares, "SPARE_BYTES", 0)
    _SPARES.drop()
    files = _ShmFiles()
    files.prepare(4 << 20, "resid")
    files.prepare(2 << 20, "_logits")
    prepared = {name: fut.result().path for _, fut, name in files.ready}
    timings: dict = {}
    resid = files.take(3 << 20, timings, "resid")
    probs = files.take(4096, timings, "_probs")
    logits = files.take(1 << 20, timings, "_logits")
    assert resid.path == prepared["resid"] and logits.path == prepared["_logits"]
    assert probs.path not in prepared.values() and probs.size == 4096
    assert timings["files_ready"] == 2  # the logits' file was ready: nothing made in the hand-off for it
    files.discard()
    _wait_for_pool()
    for f in (resid, probs, logits):
        f.release(0)
        os.unlink(f.path)


def test_handoff_files_are_kept_ready_for_the_next_capture(monkeypatch):
    """After a hand-off the worker prepares files of the sizes it handed over (within
    NNVLLM_SPARE_BYTES), reusing prepared files never handed over; the next capture of that shape
    takes them instead of making new ones; dropping the spares removes their files."""
    from nnvllm.engine.worker.handoff import _SPARES, _ShmFiles

    monkeypatch.setenv("NNVLLM_HANDOVER", "plain")
    monkeypatch.setattr(spares, "SPARE_BYTES", 5 << 20)
    mine = lambda: {f for f in os.listdir(shm_dir()) if f.startswith(f"{SHM_PREFIX}{os.getpid()}-")}  # noqa: E731
    _SPARES.drop()
    before = mine()
    first = _ShmFiles()
    for n in (1 << 20, 2 << 20, 5000):  # the third is an over-estimate never handed over
        first.prepare(n)
    handed = [first.take(1 << 20), first.take(2 << 20), first.take(3 << 20)]  # the last: made now
    first.discard()  # spares, largest first within 5 MiB: 3 MiB and 2 MiB (new); 1 MiB: over budget
    _wait_for_pool()
    assert sorted(size for size, _ in _SPARES.files) == [2 << 20, 3 << 20]
    spare_paths = {os.path.basename(fut.result().path) for _, fut in _SPARES.files}
    assert mine() - before == spare_paths | {os.path.basename(f.path) for f in handed}
    for f in handed:
        f.release(0)
        os.unlink(f.path)
    second = _ShmFiles()
    second.prepare(3 << 20)
    second.prepare(2 << 20)
    second.prepare(1 << 20)  # no spare that size: prepared anew
    timings: dict = {}
    got = [second.take(3 << 20, timings), second.take(2 << 20, timings)]
    assert {os.path.basename(f.path) for f in got} == spare_paths  # the spares, not new files
    # what the benchmarks read: both were spares, ready before the hand-off, so it hardly waited
    assert timings["files_spare"] == 2 and timings["files_ready"] == 2
    assert 0 <= timings["handover_wait"] < 0.5
    assert len(_SPARES.files) == 0
    second.discard()  # the same sizes again; the 1 MiB file never handed over is discarded
    _wait_for_pool()
    assert sorted(size for size, _ in _SPARES.files) == [2 << 20, 3 << 20]
    for f in got:
        f.release(0)
        os.unlink(f.path)
    _SPARES.drop()
    assert mine() == before



def test_calls_of_two_shapes_in_turn_make_no_new_files_after_the_first_of_each(monkeypatch):
    """A notebook alternates shapes (every layer, then tokens alone): after a small capture the big
    capture's files (its handed-over ones, returned by the client, and the spares made for it) stay
    ready within NNVLLM_SPARE_BYTES, so the next big capture takes them instead of preparing files
    while it generates."""
    from nnvllm.engine.worker import handoff as _worker
    from nnvllm.engine.worker.handoff import _SPARES, _ShmFiles

    monkeypatch.setenv("NNVLLM_HANDOVER", "plain")
    monkeypatch.setattr(spares, "SPARE_BYTES", 256 << 20)
    mine = lambda: {f for f in os.listdir(shm_dir()) if f.startswith(f"{SHM_PREFIX}{os.getpid()}-")}  # noqa: E731
    _SPARES.drop()
    before = mine()

    def capture(nbytes: int, returned: list[str]) -> tuple[str, dict]:
        _SPARES.take_back(returned)  # (what the worker does as a capture is armed)
        files = _ShmFiles()
        files.prepare(nbytes, "resid")
        timings: dict = {}
        f = files.take(nbytes, timings, "resid")
        assert files.release(f, nbytes)  # kept mapped for recycling
        files.discard()
        _wait_for_pool()
        return f.path, timings

    _worker.made_since_last_call()
    big, _ = capture(96 << 20, [])  # (a file fits a tensor up to 64 MiB smaller: these do not fit each other)
    assert _worker.made_since_last_call() == {"files_made": 2, "files_made_bytes": 2 * (96 << 20)}  # its own, a spare
    small, _ = capture(64 << 10, [big])  # the client dropped the big Run
    made = mine()
    _worker.made_since_last_call()
    again, timings = capture(96 << 20, [small])
    assert timings["files_spare"] == 1 and timings["files_ready"] == 1, timings
    assert mine() <= made  # no file made for it
    assert _worker.made_since_last_call() == {"files_made": 0, "files_made_bytes": 0}
    _SPARES.drop()
    for p in (big, small, again):
        if os.path.exists(p):
            os.unlink(p)
    assert mine() == before

def test_spares_are_made_once_the_engine_is_idle_and_not_while_the_next_capture_runs(monkeypatch):
    """Making a spare page-locks it in the engine's own process, which holds up the step loop's CUDA
    calls: the worker makes new spares only once no capture has been armed for SPARE_IDLE_S after a
    hand-off. A capture armed sooner (calls back to back) cancels the making and takes the files its
    client returned; after an idle time the spares are there for the next capture."""
    import time

    from nnvllm.engine.worker import handoff as _worker
    from nnvllm.engine.worker.handoff import _SPARES, _ShmFiles

    monkeypatch.setenv("NNVLLM_HANDOVER", "plain")
    monkeypatch.setattr(spares, "SPARE_BYTES", 64 << 20)
    monkeypatch.setattr(spares, "SPARE_IDLE_S", 0.3)
    mine = lambda: {f for f in os.listdir(shm_dir()) if f.startswith(f"{SHM_PREFIX}{os.getpid()}-")}  # noqa: E731
    _SPARES.drop()
    before = mine()

    def hand_off() -> str:  # a capture armed already: its hand-off
        files = _ShmFiles()
        files.prepare(8 << 20, "resid")
        f = files.take(8 << 20, None, "resid")
        assert files.release(f, 8 << 20)  # kept mapped for recycling
        files.discard()  # spares of its size: once the engine is idle
        return f.path

    _worker.made_since_last_call()
    _SPARES.take_back([])  # (what the worker does as a capture is armed)
    first = hand_off()
    assert _worker.made_since_last_call()["files_made"] == 1  # its own file
    _SPARES.take_back([first])  # the next call, back to back; its client returned the first's file
    time.sleep(0.6)  # it generates for twice SPARE_IDLE_S
    _SPARES.wait()
    assert _worker.made_since_last_call()["files_made"] == 0  # no file made while it ran
    second = hand_off()
    assert second == first  # the returned file went round
    time.sleep(0.6)  # idle since: a spare of its size is made
    _SPARES.wait()
    assert _worker.made_since_last_call()["files_made"] == 1
    assert [size for size, _ in _SPARES.files] == [8 << 20] and _SPARES.files[0][1].result().spare
    assert list(_SPARES.kept) == [first]
    _SPARES.drop()
    if os.path.exists(first):
        os.unlink(first)
    assert mine() == before


def test_handed_over_files_are_kept_for_recycling_within_the_budget(monkeypatch):
    """Handed-over files stay mapped in the worker for reuse (_Spares.kept), newest kept within
    NNVLLM_SPARE_BYTES (the oldest are let go: unmapped and unlinked); the ones the client returns
    become spares again, taken before other spares of their size; unknown paths are ignored."""
    from nnvllm.engine.worker.handoff import _SPARES, _ShmFile

    monkeypatch.setenv("NNVLLM_HANDOVER", "plain")
    monkeypatch.setattr(spares, "SPARE_BYTES", 5 << 20)
    _SPARES.drop()
    f1, f2, f3 = (_ShmFile(2 << 20) for _ in range(3))
    assert _SPARES.keep(f1) and _SPARES.keep(f2)
    assert _SPARES.keep(f3)  # 6 MiB would be over 5: the oldest, f1, goes
    _wait_for_pool()
    assert list(_SPARES.kept) == [f2.path, f3.path] and not os.path.exists(f1.path)
    big = _ShmFile(6 << 20)
    assert not _SPARES.keep(big)  # over the budget alone: released as before, not kept
    big.discard()
    assert list(_SPARES.kept) == [f2.path, f3.path]
    assert _SPARES.take_back([f3.path, "/dev/shm/not-this-workers"]) == [f3.path]
    assert list(_SPARES.kept) == [f2.path]
    size, fut = _SPARES.take(2 << 20)
    assert fut.result() is f3 and f3.spare and f3.mm is not None  # still mapped: ready at no cost
    f3.discard()
    _SPARES.drop()  # the kept f2 too
    assert not os.path.exists(f2.path) and _SPARES.kept == {}


def test_a_file_made_in_the_background_leaves_the_engine_thread_running():
    """Hand-off files are made in a pool thread while the engine's Python steps run; making one
    must not hold the GIL (``mmap(MAP_POPULATE)`` held it for the whole population, and a step
    waited that long). The main thread counts its longest pause while a 256 MiB file is made, and
    the file comes back with every page resident."""
    import ctypes
    import threading
    import time

    from nnvllm.engine.worker.handoff import _ShmFile

    n = 256 << 20
    made: dict = {}

    def make():
        t = time.perf_counter()
        made["file"] = _ShmFile(n)
        made["seconds"] = time.perf_counter() - t

    th = threading.Thread(target=make)
    longest, last = 0.0, time.perf_counter()
    th.start()
    while th.is_alive():
        now = time.perf_counter()
        longest, last = max(longest, now - last), now
    th.join()
    f = made["file"]
    try:
        assert f.prep["map"] > 0 and made["seconds"] > 0
        # the whole making is the bound the old code reached (the main thread stood still throughout)
        assert longest < 0.5 * made["seconds"], (longest, made)
        pages = n // os.sysconf("SC_PAGE_SIZE")
        vec = (ctypes.c_ubyte * pages)()
        view = ctypes.c_char.from_buffer(f.mm)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        assert libc.mincore(ctypes.addressof(view), n, vec) == 0, ctypes.get_errno()
        del view
        assert sum(b & 1 for b in vec) == pages  # every page faulted in before the hand-off needs it
    finally:
        f.discard()
