"""One dataset collected by several engines (nnvllm.distributed): isolated engines and Ray actors.

The bookkeeping (who gets which chunk, what a lost engine's chunks become, what the index lists) is
checked first on stand-in engines whose generate is made up per prompt (test_store's ``fake_run``:
the same prompt gives the same numbers on any engine), cheaply and exhaustively. Then on real
engines of the toy model: two isolated engines, and two Ray actors each holding an engine; each
time the fanned-out dataset equals a one-engine collect of the same prompts (tokens bit for bit,
activations within fp32 rounding of a different batch), and killing one engine mid-collect leaves a
dataset equal to an uninterrupted one, every request once.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import types

import pytest
import torch
from test_store import D_MODEL, D_VOCAB, N_LAYERS, fake_run

import nnvllm.capture
from nnvllm import store
from nnvllm.arch import arch_for
from nnvllm.engine.isolated import EngineDied

PROMPTS = [f"prompt number {i}" + "x" * (i % 3) for i in range(11)]


@pytest.fixture
def engines(monkeypatch):
    """Three stand-in engines; nnvllm.capture.generate made up per prompt. ``die_on`` (a set of call
    numbers, per engine) makes that call raise EngineDied, ``fail_on`` a ValueError."""
    lock = threading.Lock()

    def generate(model, prompts, **kw):
        with lock:
            model.calls.append(list(prompts))
            n = len(model.calls)
        time.sleep(model.delay)
        if n in model.die_on:
            raise EngineDied(f"the engine {model.name} was killed")
        if n in model.fail_on:
            raise ValueError("a request the engine refused")
        return fake_run(prompts, **kw)

    monkeypatch.setattr(nnvllm.capture, "generate", generate)

    def make(name):
        return types.SimpleNamespace(checkpoint="fake", n_layers=N_LAYERS, tokenizer=None, name=name, calls=[],
                                     die_on=set(), fail_on=set(), delay=0.0, pid=None,
                                     arch=arch_for(["GPT2LMHeadModel"]),
                                     config=types.SimpleNamespace(hidden_size=D_MODEL, vocab_size=D_VOCAB))

    return [make(n) for n in "abc"]


def _index(path) -> dict:
    return json.loads((path / "index.json").read_text())


def _same(ds, want) -> None:
    """Every request once, with what one generate over all the prompts gives."""
    assert ds.complete and len(ds) == len(want.prompts)
    listed = [r for e in ds._index["shards"] for r in e["requests"]]
    assert sorted(listed) == list(range(len(want.prompts)))  # nothing lost, nothing twice
    for i in range(len(want.prompts)):
        r = ds[i]
        assert r.prompt == want.prompts[i] and r.tokens == want.tokens[i]
        assert torch.equal(r.resid, want.resid[i])


def test_fanned_out_equals_one_engine(tmp_path, engines):
    kw = {"max_tokens": 3, "batch_size": 2, "progress": False}
    one = store.collect(engines[0], PROMPTS, tmp_path / "one", **kw)
    for e in engines:
        e.calls.clear()
    many = store.collect(engines, PROMPTS, tmp_path / "many", **kw)
    whole = fake_run(PROMPTS, max_tokens=3)
    _same(one, whole)
    _same(many, whole)
    # Each engine made some of the shards, each request in exactly one generate call.
    assert all(e.calls for e in engines)
    assert sorted(p for e in engines for c in e.calls for p in c) == sorted(PROMPTS)
    index = _index(tmp_path / "many")
    assert index["settings"] == _index(tmp_path / "one")["settings"] and index["widths"] == {"resid": D_MODEL}
    assert len({e["engine"] for e in index["shards"]}) == 3
    assert [min(e["requests"]) for e in index["shards"]] == sorted(min(e["requests"]) for e in index["shards"])
    batches = list(many.iter_batches("resid", layer=1, batch_rows=1000))
    assert torch.equal(torch.cat(batches), torch.cat([r[1] for r in whole.resid]))  # dataset order
    assert sorted(p.name for p in (tmp_path / "many").iterdir()) == sorted(
        ["index.json", *(e["file"] for e in index["shards"])])


def test_few_chunks_go_one_to_each_engine(tmp_path, engines):
    """Two chunks for three engines: two engines get one each (not one engine both)."""
    store.collect(engines, PROMPTS, tmp_path / "ds", max_tokens=3, batch_size=6, progress=False)
    assert sorted(len(e.calls) for e in engines) == [0, 1, 1]


def test_a_seed_draws_by_global_index_whichever_engine(tmp_path, engines, monkeypatch):
    """Each chunk asks for request_seed(seed, i) with i the prompt's index in the whole list."""
    from nnvllm._validate import request_seed

    asked = {}
    real = nnvllm.capture.generate

    def recording(model, prompts, **kw):
        asked.update(zip(prompts, kw["seed"]))
        return real(model, prompts, **kw)

    monkeypatch.setattr(nnvllm.capture, "generate", recording)
    store.collect(engines, PROMPTS, tmp_path / "ds", max_tokens=3, batch_size=3, temperature=1.0, seed=7,
                  progress=False)
    assert asked == {p: request_seed(7, i) for i, p in enumerate(PROMPTS)}


def test_a_lost_engine_loses_and_duplicates_nothing(tmp_path, engines):
    engines[1].die_on = {2}  # its second chunk: it has one in flight beside it, which is lost too
    engines[1].delay = 0.05
    with pytest.warns(RuntimeWarning, match=r"#1 was lost mid-collect \(EngineDied: the engine b was killed\)"):
        ds = store.collect(engines, PROMPTS, tmp_path / "ds", max_tokens=3, batch_size=1, progress=False)
    _same(ds, fake_run(PROMPTS, max_tokens=3))
    by = {}
    for e in _index(tmp_path / "ds")["shards"]:
        by.setdefault(e["engine"], []).extend(e["requests"])
    assert len(by) == 3 and len(by[next(k for k in by if k.endswith("#1"))]) >= 1  # b finished one first
    assert all(len(c) == 1 for e in engines for c in e.calls)


def test_every_engine_lost_keeps_the_shards_and_resumes(tmp_path, engines):
    for e in engines:
        e.die_on = {3, 4, 5, 6}
    with pytest.raises(RuntimeError, match="every engine was lost mid-collect") as err, pytest.warns(RuntimeWarning):
        store.collect(engines, PROMPTS, tmp_path / "ds", max_tokens=3, batch_size=1, progress=False)
    assert "call nv.collect again" in str(err.value)
    part = store.open(tmp_path / "ds")
    assert 0 < len(part) < len(PROMPTS)
    assert not [p for p in (tmp_path / "ds").iterdir() if p.suffix == ".tmp"]
    done = {i for e in part._index["shards"] for i in e["requests"]}
    engines[0].die_on, engines[0].calls = set(), []
    ds = store.collect(engines[:1], PROMPTS, tmp_path / "ds", max_tokens=3, batch_size=1, progress=False)
    assert sorted(p for c in engines[0].calls for p in c) == sorted(p for i, p in enumerate(PROMPTS) if i not in done)
    _same(ds, fake_run(PROMPTS, max_tokens=3))


def test_an_error_that_is_not_a_lost_engine_is_raised(tmp_path, engines):
    """A request an engine refuses would be refused by any: raised, not handed on; what finished stays."""
    engines[2].fail_on = {1}
    with pytest.raises(ValueError, match="a request the engine refused"):
        store.collect(engines, PROMPTS, tmp_path / "ds", max_tokens=3, batch_size=1, progress=False)
    part = store.open(tmp_path / "ds")
    assert len(part) < len(PROMPTS) and all(len(c) == 1 for e in engines for c in e.calls)
    assert len({p for e in engines for c in e.calls for p in c}) == sum(len(e.calls) for e in engines)


def test_engines_are_checked_before_anything_runs(tmp_path, engines):
    other = types.SimpleNamespace(**{**vars(engines[1]), "checkpoint": "another"})
    with pytest.raises(ValueError, match="the engines differ: .* runs 'fake' .* runs 'another'"):
        store.collect([engines[0], other], PROMPTS, tmp_path / "a", progress=False)
    with pytest.raises(ValueError, match="listed twice"):
        store.collect([engines[0], engines[0]], PROMPTS, tmp_path / "a", progress=False)
    with pytest.raises(ValueError, match=r"model=\[\]"):
        store.collect([], PROMPTS, tmp_path / "a", progress=False)
    with pytest.raises(TypeError, match=r"model\[1\]="):
        store.collect([engines[0], "gpt2"], PROMPTS, tmp_path / "a", progress=False)
    assert not (tmp_path / "a").exists() and not any(e.calls for e in engines)


def test_lost_reason_reads_wrapped_errors():
    from nnvllm.distributed import lost_reason

    class RayTaskError(Exception):  # Ray's wrapper of an actor's own error: the original is .cause
        def __init__(self, cause):
            super().__init__("task failed")
            self.cause = cause

    class ActorDiedError(Exception):
        pass

    assert lost_reason(ActorDiedError("the actor died")) == "ActorDiedError: the actor died"
    assert lost_reason(RayTaskError(EngineDied("gone\nmore"))) == "EngineDied: gone"
    try:
        try:
            raise EngineDied("core stopped")
        except EngineDied as e:
            raise RuntimeError("generate failed") from e
    except RuntimeError as e:
        assert lost_reason(e) == "EngineDied: core stopped"
    assert lost_reason(ValueError("bad prompt")) is None


# --- real engines ----------------------------------------------------------------------------------

TOY_PROMPTS = ["The capital of France is", "Paris is the capital of", "The cat sat on the", "Once upon a time",
               "The capital of Italy is", "A dog ran", "Rome is a city in", "Hello there friend"]
KW = {"max_tokens": 4, "layers": [0, 2], "sites": ("mlp",), "temperature": 1.0, "seed": 5, "ignore_eos": True,
      "progress": False}


def _same_as(ds, ref) -> None:
    """``ds`` holds what ``ref`` holds, request by request: tokens bit for bit, activations within fp32
    rounding (a request batched with others runs other GEMM shapes)."""
    assert ds.complete and len(ds) == len(ref)
    listed = [r for e in ds._index["shards"] for r in e["requests"]]
    assert sorted(listed) == list(range(len(ref)))
    for i in range(len(ref)):
        a, b = ds[i], ref[i]
        assert a.tokens == b.tokens and a.prompt_ids == b.prompt_ids, i
        assert torch.allclose(a.resid, b.resid, atol=1e-5, rtol=0), i
        assert torch.allclose(a.sites["mlp"], b.sites["mlp"], atol=1e-5, rtol=0), i
        assert torch.allclose(a.logprobs, b.logprobs, atol=1e-5, rtol=0), i


def _kill_once_listed(path, who: str, kill) -> threading.Thread:
    """Call ``kill()`` as soon as the index lists a shard written by the engine named ``who``."""
    def watch():
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                shards = json.loads((path / "index.json").read_text())["shards"]
            except (OSError, ValueError):
                shards = []
            if any(e.get("engine") == who for e in shards):
                kill()
                return
            time.sleep(0.01)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t


def _bound_cores() -> list[int] | None:
    """Two cores, one for each engine of ``isolated_pair`` (on CPU with two cores or more), else None."""
    cores = sorted(os.sched_getaffinity(0))
    return cores[:2] if not torch.cuda.is_available() and len(cores) >= 2 else None


def _load_bound(core: int | None):
    import nnvllm as nv

    key, old = "VLLM_CPU_OMP_THREADS_BIND", os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    if core is not None:
        os.environ[key] = str(core)  # read by the engine's processes when they start
    try:
        return nv.load(isolate=True)
    finally:
        os.environ.pop(key, None) if old is None else os.environ.__setitem__(key, old)


@pytest.fixture(scope="module")
def isolated_pair():
    """Two isolated engines of the toy model (closed after the module); on CPU each bound to a core
    of its own, as benchmarks/collect_many.py runs them."""
    cores = _bound_cores() or [None, None]
    a = _load_bound(cores[0])
    try:
        b = _load_bound(cores[1])
    except BaseException:
        a.close()
        raise
    yield a, b
    a.close()
    b.close()


@pytest.mark.slow
def test_a_one_rank_cpu_engine_computes_on_the_cores_it_is_bound_to(isolated_pair):
    """``VLLM_CPU_OMP_THREADS_BIND`` binds a one-rank CPU engine: vLLM's CPU backend binds only the
    workers its multiprocess executor starts, and a one-rank engine's worker runs in its engine core
    (nnvllm.engine.worker.cpu.bind_threads)."""
    import psutil

    cores = _bound_cores()
    if cores is None:
        pytest.skip("needs a CPU engine and two cores")
    for model, core in zip(isolated_pair, cores):
        procs = psutil.Process(model.pid).children(recursive=True)
        engine_cores = [p for p in procs if "EngineCore" in p.name() or "EngineCore" in " ".join(p.cmdline())]
        assert engine_cores, [(p.pid, p.name()) for p in procs]
        assert {tuple(os.sched_getaffinity(p.pid)) for p in engine_cores} == {(core,)}


@pytest.mark.slow
def test_a_worker_on_another_host_hands_over_inline(isolated_pair, monkeypatch):
    """A client whose shared memory the worker cannot see (its probe file is not there: another host)
    gets the capture through the engine's HTTP reply instead of /dev/shm files, with the same numbers."""
    import nnvllm as nv
    from nnvllm import capture
    from nnvllm.engine.worker import crosshost

    a, _ = isolated_pair
    kw = {"max_tokens": 3, "layers": "all", "sites": ("mlp",), "logits": True, "ignore_eos": True}
    near = nv.generate(a, TOY_PROMPTS[:3], **kw)
    assert capture._LAST_TIMINGS.get("handover_bytes", 0) > 0  # through files
    elsewhere = os.path.join(crosshost.shm_dir(), f"{crosshost.PROBE_PREFIX}{os.getpid()}-another-host")
    monkeypatch.setattr(crosshost, "client_probe", lambda: elsewhere)
    far = nv.generate(a, TOY_PROMPTS[:3], **kw)
    assert "handover_bytes" not in capture._LAST_TIMINGS  # no file was made: the bytes came inline
    assert far.tokens == near.tokens
    for i in range(3):
        assert torch.equal(far.resid[i], near.resid[i]) and torch.equal(far.sites["mlp"][i], near.sites["mlp"][i])
        assert torch.equal(far.logits[i], near.logits[i])
        assert torch.equal(far.samples[i].probs, near.samples[i].probs)


@pytest.mark.slow
def test_isolated_engines_fan_out_and_survive_a_kill(tmp_path, isolated_pair):
    """Two isolated engines: the fanned-out dataset equals one engine's, and after one engine is
    killed (its process group, SIGKILL) mid-collect, the dataset still equals it."""
    import nnvllm as nv
    from nnvllm.distributed import _label

    a, b = isolated_pair
    ref = nv.collect(a, TOY_PROMPTS, tmp_path / "one", batch_size=3, **KW)
    _same_as(nv.collect([a, b], TOY_PROMPTS, tmp_path / "two", batch_size=1, **KW), ref)
    assert len({e["engine"] for e in _index(tmp_path / "two")["shards"]}) == 2
    watcher = _kill_once_listed(tmp_path / "killed", _label(b), lambda: os.killpg(b.pid, signal.SIGKILL))
    with pytest.warns(RuntimeWarning, match=r"isolated engine pid \d+ .* was lost mid-collect \(EngineDied"):
        ds = nv.collect([a, b], TOY_PROMPTS * 2, tmp_path / "killed", batch_size=1, **KW)
    watcher.join(timeout=5)
    _same_as(ds, nv.collect(a, TOY_PROMPTS * 2, tmp_path / "one2", batch_size=8, **KW))
    assert b._dead is not None


def test_load_refuses_the_ray_executor_where_vllm_has_none():
    """vLLM's CPU platform has no Ray executor: nv.load says so, naming the platform, before an engine starts."""
    if torch.cuda.is_available():
        pytest.skip("the GPU platform runs Ray's executor (test_ray_executor_equals_the_engine_without_ray)")
    import nnvllm as nv

    before, t0 = len(nv.engines()), time.monotonic()
    with pytest.raises(ValueError, match=r"distributed_executor_backend='ray': vLLM's 'cpu' platform .* "
                                         r"does not support ray"):
        nv.load(distributed_executor_backend="ray")
    assert time.monotonic() - t0 < 30 and len(nv.engines()) == before  # no engine was started


def test_the_ray_executor_copies_nnvllm_settings_into_its_workers(monkeypatch):
    """vLLM's Ray executor copies a fixed set of variable prefixes into its worker actors (which Ray's
    raylet starts, so they inherit nothing else); a load with the Ray backend adds ``NNVLLM_`` to
    them (``models.ray_copies_nnvllm_environment``), keeping the user's own, once."""
    from vllm.ray.ray_env import get_env_vars_to_copy

    from nnvllm.engine.models import ray_copies_nnvllm_environment

    monkeypatch.setenv("NNVLLM_ARCHS", "{}")
    monkeypatch.setenv("VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY", "MY_")
    monkeypatch.setenv("MY_SETTING", "1")
    assert "NNVLLM_ARCHS" not in get_env_vars_to_copy()  # what vLLM copies on its own
    ray_copies_nnvllm_environment()
    ray_copies_nnvllm_environment()
    assert os.environ["VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"] == "MY_,NNVLLM_"
    assert {"NNVLLM_ARCHS", "MY_SETTING"} <= get_env_vars_to_copy()


def _where_it_waits(m, since: float) -> None:
    """What a stuck engine says: its log, each engine process's latest stacks (``NNVLLM_STACKS``,
    Ray's actors included) and the end of Ray's worker logs."""
    import glob
    import tempfile

    if m is not None:
        print(m.log(80), flush=True)
    for f in sorted(glob.glob(os.path.join(tempfile.gettempdir(), "nnvllm-stacks-*.txt"))):
        if os.path.getmtime(f) >= since:
            print(f"--- {f}\n{open(f).read()[-12000:]}", flush=True)
    for f in sorted(glob.glob("/tmp/ray/session_latest/logs/worker-*.err"))[-8:]:
        print(f"--- {f}\n{open(f, errors='replace').read()[-3000:]}", flush=True)


@pytest.mark.gpu
def test_ray_executor_equals_the_engine_without_ray(tmp_path, monkeypatch):
    """On a GPU, TP=1 under vLLM's Ray executor (a one-GPU local Ray cluster): the same tokens,
    activations, logits and edits as the same engine on vLLM's own executor, through the taps and
    the hand-off (rank 0's worker is a Ray actor on this host: files in /dev/shm)."""
    pytest.importorskip("ray")
    import nnvllm as nv

    kw = {"max_tokens": 4, "layers": "all", "sites": ("mlp",), "logits": True, "temperature": 1.0, "seed": 3,
          "ignore_eos": True}
    got = {}
    monkeypatch.setenv("NNVLLM_STACKS", "30")  # each engine process's stacks, for _where_it_waits
    for backend in ("ray", None):
        extra = {"distributed_executor_backend": backend} if backend else {}
        say = lambda what, b=backend: print(f"ray test [{b}]: {what}", flush=True)  # noqa: E731  (-s: where it is)
        # Eager: the equality does not depend on CUDA graphs, and two torch.compile starts would take
        # most of a GPU test stage's time.
        # Should the load or a call hang, the engine says where (the test's own stack is faulthandler's).
        held: dict = {}
        dump = threading.Timer(90, lambda h=held: _where_it_waits(h.get("m"), time.time() - 600))
        dump.daemon = True
        dump.start()
        with nv.load(dtype="float32", cuda_graphs=False, **extra) as m:
            held["m"] = m
            say("loaded")
            run = nv.generate(m, TOY_PROMPTS, **kw)
            say("generated")
            v = torch.ones(m.config.n_embd) * 0.5
            steered = nv.generate(m, TOY_PROMPTS[:2], max_tokens=3, edits=[nv.Edit.add(v, layers=1)])
            say("steered")
            ds = nv.collect(m, TOY_PROMPTS, tmp_path / str(backend), batch_size=3, **{**KW, "progress": False})
            say("collected")
            got[backend] = (run, steered, [ds[i] for i in range(len(TOY_PROMPTS))])
            dump.cancel()
        say("closed")
    (run, steered, recs), (want, want_steered, want_recs) = got["ray"], got[None]
    assert run.tokens == want.tokens and steered.tokens == want_steered.tokens
    for i in range(len(TOY_PROMPTS)):
        assert torch.allclose(run.resid[i], want.resid[i], atol=1e-4, rtol=0), i
        assert torch.allclose(run.sites["mlp"][i], want.sites["mlp"][i], atol=1e-4, rtol=0), i
        assert torch.allclose(run.logits[i], want.logits[i], atol=1e-4, rtol=0), i
        assert recs[i].tokens == want_recs[i].tokens
        assert torch.allclose(recs[i].resid, want_recs[i].resid, atol=1e-4, rtol=0), i


# --- Ray actors ------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A Ray cluster of this machine alone, on loopback, 2 CPUs; ended after the module.

    Two things ``ray.init()`` does not do here. Loopback: Ray connects to a local cluster through
    the machine's network address unless it is told there is no cluster beyond this machine
    (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, in this process and the cluster's). The agent's port:
    Ray's raylet waits a fixed 15 s for its dashboard agent to report the port it listens on and
    aborts the node if it has not ("Timed out waiting for file .../dashboard_agent_listen_port_...");
    on the 2-core box busy with other test processes the agent took 30-40 s to import and start,
    and ``ray.init()`` failed 3 times out of 3. The raylet does not wait for a port it is given:
    every agent port is chosen up front and handed to the agent and to the raylet (its
    ``--dashboard_agent_listen_port`` flag, which Ray's launcher does not pass).
    """
    ray = pytest.importorskip("ray")
    from ray._private import node as ray_node
    from ray._private import parameter as ray_parameter
    from ray._private import ray_constants
    from ray._private import services as ray_services

    saved = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"), ray_constants.ENABLE_RAY_CLUSTER
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    listen = _free_port()
    wrapper = tmp_path_factory.mktemp("ray") / "raylet"
    wrapper.write_text(f'#!/bin/sh\nexec {ray_services.RAYLET_EXECUTABLE} "$@" '
                       f'--dashboard_agent_listen_port={listen}\n')
    wrapper.chmod(0o755)
    real = ray_services.RAYLET_EXECUTABLE
    ray_services.RAYLET_EXECUTABLE = str(wrapper)
    node = None
    try:
        params = ray_parameter.RayParams(
            num_cpus=2, include_dashboard=False, node_ip_address="127.0.0.1", metrics_agent_port=_free_port(),
            dashboard_agent_listen_port=listen, runtime_env_agent_port=_free_port(),
            metrics_export_port=_free_port(), env_vars={"OMP_WAIT_POLICY": "PASSIVE"},
            object_store_memory=128 * 2**20)  # chunks' index entries only: Ray's default reserves 30% of RAM
        node = ray_node.Node(params, head=True, shutdown_at_exit=True, spawn_reaper=True)
        ray_services.RAYLET_EXECUTABLE = real
        ray.init(address=node.address, log_to_driver=False)
        yield ray
    finally:
        ray_services.RAYLET_EXECUTABLE = real
        ray.shutdown()
        if node is not None:
            node.kill_all_processes(check_alive=False, allow_graceful=True)
        if saved[0] is None:
            os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        else:
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = saved[0]
        ray_constants.ENABLE_RAY_CLUSTER = saved[1]


@pytest.mark.slow
def test_ray_actors_fan_out_and_survive_a_kill(tmp_path, ray_cluster):
    """Two Ray actors, each an nnvllm engine of the toy model (one CPU each): the fanned-out dataset
    equals one engine's, and after one actor is killed mid-collect (ray.kill) it still does."""
    import nnvllm as nv
    from nnvllm.distributed import RayEngine, ray_engines

    ray = ray_cluster
    a, b = ray_engines(n=2, num_cpus=1)
    try:
        assert isinstance(a, RayEngine) and a.pid != b.pid and a.checkpoint == b.checkpoint
        ref = nv.collect([a], TOY_PROMPTS, tmp_path / "one", batch_size=3, **KW)
        _same_as(nv.collect([a, b], TOY_PROMPTS, tmp_path / "two", batch_size=1, **KW), ref)
        assert {e["engine"] for e in _index(tmp_path / "two")["shards"]} == {a.label, b.label}
        watcher = _kill_once_listed(tmp_path / "killed", b.label, lambda: ray.kill(b.actor))
        with pytest.warns(RuntimeWarning, match=re.escape(b.label) + r" was lost mid-collect \(\w*Actor"):
            ds = nv.collect([a, b], TOY_PROMPTS * 2, tmp_path / "killed", batch_size=1, **KW)
        watcher.join(timeout=5)
        _same_as(ds, nv.collect([a], TOY_PROMPTS * 2, tmp_path / "one2", batch_size=8, **KW))
    finally:
        for e in (a, b):
            e.close()
