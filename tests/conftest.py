"""Shared fixtures: real vLLM engines (CPU build here) on the toy model and tiny random checkpoints.

Engines are module-scoped and closed after their module: vLLM's in-process engine holds a
process-wide distributed group, so one engine runs at a time.
"""

from __future__ import annotations

import os

import pytest

from notebook_kernels import a_second_kernel_if_the_first_dies

from nnvllm.testing import TF32

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_addoption(parser):
    parser.addoption("--tp", type=int, default=1, help="tensor-parallel size for engine tests (default 1)")


@pytest.fixture(scope="session")
def tp(request) -> int:
    return request.config.getoption("--tp")


@pytest.hookimpl(trylast=True)  # after pytest's own reordering (fixtures), which the sort keeps
def pytest_collection_modifyitems(config, items):
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its order is the order units are dealt out
        _slowest_first(items)
        _one_engine_start_each(items)  # within the shared-engine unit
    elif getattr(config.option, "dist", "no") == "no":  # one process (the TP=2 stage): engines in turn
        _one_engine_start_each(items)
    _notebooks_run_in_the_browser(config, items)
    a_second_kernel_if_the_first_dies(items)
    tp = config.getoption("--tp")
    try:
        import torch

        cuda = torch.cuda.is_available()
    except Exception:
        cuda = False
    for item in items:
        if "tp" in item.keywords and tp < 2:
            item.add_marker(pytest.mark.skip(reason="TP-only test: run with --tp 2"))
        if "gpu" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


def _notebooks_run_in_the_browser(config, items) -> None:
    """Leave out nbmake's run of a notebook that a browser test of this session runs whole.

    tests/test_browser.py runs notebooks 01, 05 and 06 with Run All in JupyterLab
    (``BROWSER_NOTEBOOKS``) and fails unless every cell ran without an error (``browser.run_all``), as
    nbmake does, then uses their widgets. Both in one session (make test) would run each notebook twice,
    each in a kernel of its own that imports vLLM and starts an engine. Where the browser test cannot
    run (no chromium or playwright, or deselected), nbmake's run stays.
    """
    tests = [i for i in items if "test_browser.py::" in i.nodeid]
    if not tests or tests[0].module.browser.missing_requirements():
        return
    chosen = {i.nodeid.rsplit("::", 1)[1] for i in tests}
    notebooks = set()
    for name, nbs in tests[0].module.BROWSER_NOTEBOOKS.items():
        if name in chosen:
            notebooks |= {nbs} if isinstance(nbs, str) else set(nbs)
    gone = [i for i in items if any(i.nodeid.split("::", 1)[0].endswith(nb) for nb in notebooks)]
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = [i for i in items if i not in gone]


# Test files whose parametrized cases each start an engine of their own: under pytest-xdist's
# --dist loadfile (make test, the GPU lane) each case is a unit of its own, so the cases spread over
# the workers (test_families.py: eleven families at ~40 s per engine start on a shared H200 kept one
# worker busy past the GPU lane's time limit). Every other file stays whole on one worker, where its
# tests share the file's module-scoped engines.
SPLIT_BY_CASE = ("tests/test_families.py",)

# Test files whose engines are shared (shared_engine below): an engine stays open after its file for
# the next file that asks for the same checkpoint and arguments. Under pytest-xdist they are one work
# unit, run back to back by one worker, checkpoint by checkpoint (_one_engine_start_each): three
# engine starts (toy, llama, gpt2) at TP=1 instead of fifteen, ~4 CPU-s each on the 2-core box; in
# one process (the TP=2 stage) the same order. Their tests must leave the engine as
# they found it: what one leaves armed shows in the next.
SHARED_ENGINE_FILES = (
    "test_vllm.py", "test_edits.py", "test_stream.py", "test_engine.py", "test_widgets.py", "test_store.py",
    "test_analyses.py", "test_capture.py", "test_bad_input.py", "test_bad_input_more.py", "test_interrupt.py",
    "test_analyses_llama.py", "test_heads.py", "test_reliability.py", "test_sae.py", "test_sae_collect.py",
)
SHARED_UNIT = "tests/(shared engines)"


def _shares(path) -> bool:
    """Whether the test file at ``path`` (a node id or a module's file) takes its engines from shared_engine."""
    return str(path).split("::", 1)[0].replace("\\", "/").rsplit("/", 1)[-1] in SHARED_ENGINE_FILES


# Seconds each test file takes on the 2-core CPU machine at TP=1: from the junit report of a 2-worker
# run with chromium present (test_families.py in all, its cases dealt out one by one), or, for the
# notebooks (make test runs them in the same pool) and files without such a measurement, estimated
# from the CPU seconds each used in a run of make test (scripts/cpu_by_test.py: each process's CPU
# counted to the test that started it). Workers take the slowest units first (longest-first
# scheduling): xdist's default order, the files with the most tests first, leaves
# test_isolated_lifecycle.py's 3 tests (~150 s) to the end, one worker running them alone. A file not
# listed counts as 0 s and goes last; re-measure when a file's cost moves.
FILE_SECONDS = {
    "test_isolated.py": 200, "test_browser.py": 300, "test_isolated_lifecycle.py": 100, "test_families.py": 120,
    "05_several_models.ipynb": 80, "04_discrepancies.ipynb": 45, "test_engine.py": 45, "test_docs.py": 40,
    "test_edits.py": 42, "test_capture.py": 35, "02_sampled_tokens.ipynb": 32, "06_steering.ipynb": 32,
    "test_capture_scheduling.py": 32, "01_logit_lens.ipynb": 30, "03_activation_patching.ipynb": 28,
    "test_bad_input_more.py": 25, "test_pure.py": 22, "test_engines_list.py": 22, "test_compat.py": 20,
    "test_bad_input.py": 20, "test_widgets.py": 19, "test_analyses_llama.py": 15,
    "test_stream.py": 12, "test_analyses.py": 12, "test_store.py": 11, "test_interrupt.py": 10, "test_vllm.py": 8,
    "test_reliability_engine.py": 260, "test_distributed.py": 140, "test_chat.py": 70, "test_sae.py": 110,
    "test_heads.py": 65, "test_sae_collect.py": 40, "test_reliability.py": 20, "07_heads.ipynb": 45,
    "08_features.ipynb": 55, "test_compile.py": 90,
}


def _unit(nodeid: str) -> str:
    """The xdist work unit of a test: its file; for a file in SPLIT_BY_CASE its case; for the files of
    SHARED_ENGINE_FILES one unit for all of them."""
    file = nodeid.split("::", 1)[0]
    if _shares(file):
        return SHARED_UNIT
    if file.endswith(SPLIT_BY_CASE) and nodeid.endswith("]"):
        return file + "[" + nodeid.rsplit("[", 1)[1]
    return file


def _slowest_first(items) -> None:
    units: dict = {}  # file -> its units
    for item in items:
        units.setdefault(item.nodeid.split("::", 1)[0], set()).add(_unit(item.nodeid))
    shared = sum(FILE_SECONDS.get(f.rsplit("/", 1)[-1], 0) for f in units if _shares(f))

    def seconds(item) -> float:  # a file's seconds, shared by its units; the shared unit's: its files'
        file = item.nodeid.split("::", 1)[0]
        if _shares(file):
            return shared
        return FILE_SECONDS.get(file.rsplit("/", 1)[-1], 0) / len(units[file])

    # stable: the tests of one file keep their order (module-scoped engines, parametrization)
    items.sort(key=lambda item: -seconds(item))


def _one_engine_start_each(items) -> None:
    """Run the tests of the engine-sharing files (``SHARED_ENGINE_FILES``) checkpoint by checkpoint.

    In one process the shared engine lives from module to module (shared_engine below), but pytest
    keeps a module's parametrized cases together: test_vllm (toy), test_edits (toy, llama),
    test_stream (llama, toy) started three TP=2 engines, toy twice (38 s on the 2-core CPU box). Here
    the toy cases of all of them run before the llama cases: one start per checkpoint. Module fixtures
    are set up again when a module is re-entered (cheap; the engine is the shared one). Other tests
    keep their places.
    """
    slots = [i for i, item in enumerate(items) if _shares(item.nodeid)]
    order: dict = {}
    for i in slots:
        order.setdefault(_checkpoint_of(items[i]), len(order))
    moved = sorted((items[i] for i in slots), key=lambda item: order[_checkpoint_of(item)])  # stable
    for i, item in zip(slots, moved):
        items[i] = item


def _checkpoint_of(item) -> str:
    """The checkpoint an engine-sharing test runs on: its ``model`` (or ``engine``) parameter, else its
    module's ``CHECKPOINT``, else the toy model."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    return str(params.get("model", params.get("engine", getattr(item.module, "CHECKPOINT", "toy"))))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    config.option.loadscopereorder = False  # the work units go in the order collected (above)

    class FilesAndCases(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

    return FilesAndCases(config, log)


@pytest.fixture(scope="session")
def toy_path() -> str:
    import nnvllm as nv

    return nv.toy.check()


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory) -> dict[str, str]:
    from nnvllm.testing import tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    return {k: tiny_checkpoint(k, root / k) for k in ("gpt2", "llama")}


def _share_the_gpu() -> None:
    """On a GPU the lane runs several pytest processes per GPU: an engine a test starts with nv.load's
    defaults (the README's code, a notebook's) must not take 0.9 of the free memory from the others."""
    import torch

    if torch.cuda.is_available():
        os.environ.setdefault("NNVLLM_GPU_MEMORY_UTILIZATION", "0.25")
        # vLLM's memory profiling at start fails when another process frees memory meanwhile: a
        # fixed KV cache skips it (the README test's engine fails so beside other test processes).
        os.environ.setdefault("NNVLLM_KV_CACHE_MEMORY_BYTES", "1GiB")


_share_the_gpu()


def same_values(a, b) -> bool:
    """Two calls' captures of the same prompts agree: bit for bit on CPU (an in-process engine steps
    its whole batch at once); on a GPU within 1e-4. There the engine core runs in its own process and
    may start a prefill before every request of the call has arrived (a first step can hold one of
    three prompts), and a different batch make-up changes fp32 rounding (~1e-6). Under
    ``NNVLLM_COMPILE=1`` also within 1e-4: a step that carries an nnsight trace runs the plain
    forward and any other step the compiled one, whose fused kernels round differently (~4e-7 on the
    toy model). A left-over edit moves values by far more than the bound."""
    import torch

    if a.shape != b.shape:
        return False
    if not a.is_cuda and not torch.cuda.is_available() and os.environ.get("NNVLLM_COMPILE", "0") in ("0", ""):
        return torch.equal(a, b)
    return bool((a.float() - b.float()).abs().max() <= 1e-4)


def engine_kwargs(tp: int = 1, **kw) -> dict:
    """Engine arguments for fidelity tests: fp32 everywhere (vLLM runs fp32 checkpoints in half
    precision by default); on a GPU, ``exact=True`` and a small fixed KV cache so engines load quickly
    and side by side."""
    import torch

    d = {"tensor_parallel_size": tp, "dtype": "float32"}
    if torch.cuda.is_available():
        # Full-precision fp32 attention (nv.load's exact=True): without it vLLM's Triton attention
        # multiplies in TF32 and the engine is ~1e-3 from transformers (docs/discrepancies.md).
        d["exact"] = True
        # A fixed 1 GiB KV cache (plenty for these models) skips vLLM's memory profiling and holds
        # ~2 GiB per engine, so test engines can share a GPU with other work (vLLM still checks at
        # start that 0.3 of the GPU is free).
        d["gpu_memory_utilization"] = 0.3
        d["kv_cache_memory_bytes"] = 1 << 30
    out = {**d, **kw}
    if out.get("dtype") != "float32":
        out.pop("exact", None)  # exact=True is fp32 only
    return out


def _engine(path, tp):
    import nnvllm as nv

    return nv.load(path, **engine_kwargs(tp))


# ------------------------------------------------------------------ engines shared across test files
# The files of SHARED_ENGINE_FILES take their engines from shared_engine(): the engine stays open after
# the file, for the next file that asks for the same checkpoint and arguments. Only one in-process
# engine may live in a process, so the shared one is closed before any other test file starts (the
# autouse fixture below) and at the end of the session.

_SHARED: dict = {}


def _is_open(model) -> bool:
    if getattr(model, "_nnvllm_isolated", False):
        return not model._closed and model._dead is None
    return model.vllm_entrypoint is not None


def shared_engine(path, tp, **kw):
    import nnvllm as nv
    from nnvllm.engine import default_isolate

    if kw.get("isolate") is False and not default_isolate():
        del kw["isolate"]  # (the default here: the same engine as the files that do not say it)
    args = engine_kwargs(tp, **kw)
    key = (str(path), repr(sorted(args.items())))
    held = _SHARED.get("engine")
    if held is not None and held[0] == key and _is_open(held[1]):
        return held[1]
    release_shared_engine()
    model = nv.load(path, **args)
    _SHARED["engine"] = (key, model)
    return model


def seed_engine(kind: str, path, tp):
    """The shared engine of the seed's modules (test_edits.py, test_stream.py) for checkpoint ``kind``.

    At TP>1 the llama engine is isolated (``isolate=True``) and the toy one in-process: the TP=2 stage
    covers both transports with the engines it starts anyway. (A third TP=2 engine, an isolated toy,
    would cost ~100 s of the 2-core box's CPU, each of its four processes importing vLLM.)"""
    return shared_engine(path, tp, **({"isolate": True} if tp > 1 and kind == "llama" else {}))


def release_shared_engine() -> None:
    held = _SHARED.pop("engine", None)
    if held is not None:
        held[1].close()


@pytest.fixture(autouse=True, scope="module")
def _shared_engine_only_where_shared(request):
    if not _shares(request.module.__file__):
        release_shared_engine()
    yield


@pytest.fixture(autouse=True, scope="session")
def _shared_engine_closed_at_the_end():
    yield
    release_shared_engine()


@pytest.fixture(scope="module")
def toy(request, toy_path, tp):
    if _shares(request.module.__file__):
        yield shared_engine(toy_path, tp)
        return
    model = _engine(toy_path, tp)
    yield model
    model.close()


# ------------------------------------------------------------------ fidelity: vLLM vs transformers

CALIBRATION_FACTOR = 4.0


def max_abs_diff(a, b) -> float:
    """max |a - b| over all elements (tensors of one shape, or two numbers), as a Python float."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = torch.as_tensor(a).cpu(), torch.as_tensor(b).cpu()
        assert a.shape == b.shape, (tuple(a.shape), tuple(b.shape))
        return (a.float() - b.float()).abs().max().item()
    return abs(float(a) - float(b))


class Reference:
    """A transformers value computed where the engine runs, and the bound vLLM's value is held to.

    ``value`` is what the test compares against: transformers on the CPU in a CPU run; transformers
    in fp32 on the engine's GPU (TF32 off) in a GPU run. ``bound(cpu_bound, get)`` is ``cpu_bound``
    on the CPU; on a GPU it is ``max(cpu_bound, CALIBRATION_FACTOR * d)`` where ``d`` is the measured
    distance, for the same quantity ``get(...)``, between transformers on that GPU and transformers
    on the CPU: the spread that the GPU's own IEEE fp32 kernels produce on this model and input.
    The GPU test engines run with ``exact=True`` (full-precision fp32 attention), whose kernels are
    of that kind; measured on an H200, ``d`` is ~5e-7 on activations, so the CPU bound decides.
    """

    def __init__(self, value, cpu=None):
        self.value, self._cpu = value, cpu

    @property
    def calibrated(self) -> bool:
        return self._cpu is not None

    def device_distance(self, get=lambda x: x, dist=max_abs_diff) -> float | None:
        """dist(get(transformers GPU), get(transformers CPU)); None on a CPU run."""
        return float(dist(get(self.value), get(self._cpu))) if self.calibrated else None

    def bound(self, cpu_bound: float, get=lambda x: x, dist=max_abs_diff) -> float:
        """The bound for quantity ``get(reference)``: ``cpu_bound`` on CPU, calibrated on a GPU."""
        d = self.device_distance(get, dist)
        return cpu_bound if d is None else max(cpu_bound, CALIBRATION_FACTOR * d)

    def check(self, actual, cpu_bound: float, get=lambda x: x, what: str = "") -> float:
        """Assert ``max|actual - get(value)| < bound(cpu_bound, get)``; return the distance."""
        return self.check_distance(max_abs_diff(actual, get(self.value)), cpu_bound,
                                   lambda a, b: max_abs_diff(get(a), get(b)), what)

    def check_distance(self, d: float, cpu_bound: float, dist, what: str = "") -> float:
        """Assert ``d < bound``, the bound calibrated with ``dist(gpu_ref, cpu_ref)`` (a distance between
        two references of the kind the test measured ``d`` with, e.g. a ``nv.compare`` summary entry)."""
        t = self.device_distance(dist=dist)
        b = cpu_bound if t is None else max(cpu_bound, CALIBRATION_FACTOR * t)
        _FIDELITY_LOG.append({"test": os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" ", 1)[0],
                              "what": str(what), "max_abs": d, "bound": b, "cpu_bound": cpu_bound,
                              "gpu_vs_cpu": t, "device": "cpu" if t is None else "cuda"})
        how = "CPU bound" if t is None else (
            f"max(CPU bound {cpu_bound:g}, {CALIBRATION_FACTOR:g} x transformers GPU-vs-CPU {t:.3g})")
        assert d < b, f"{what}: vLLM vs transformers max|Δ| = {d:.3g}, bound {b:.3g} ({how})"
        return d


class Fidelity:
    """Transformers references for fidelity asserts, on the device the engine runs on.

    On CPU: transformers on the CPU, and every bound is the test's fixed CPU bound (unchanged).
    On a GPU: transformers in fp32 on the same GPU (TF32 off, torch's default), so that the device
    itself is not part of the difference; each bound is derived per quantity from a measured
    distance — transformers on the GPU vs transformers on the CPU — times ``CALIBRATION_FACTOR`` (4),
    floored at the CPU bound. The engines are loaded with ``exact=True``: vLLM's default fp32
    attention multiplies in TF32 and sits ~1e-3 from transformers, which no bound derived from IEEE
    kernels covers (docs/discrepancies.md has the measurement; ``tests/test_gpu_exact.py`` the check).
    """

    def __init__(self, device: str):
        self.device = device

    @property
    def gpu(self) -> bool:
        return self.device != "cpu"

    def calibrated(self, compute) -> Reference:
        """``compute(device)`` -> a value on the CPU; run here, and on a GPU also on the CPU."""
        if not self.gpu:
            return Reference(compute("cpu"))
        with TF32(False):
            value = compute(self.device)
        return Reference(value, compute("cpu"))

    def reference(self, path, prompts, **kw) -> Reference:
        """``nv.reference(path, prompts, **kw)`` here; on a GPU the CPU calibration replays its tokens."""
        import nnvllm as nv

        if not self.gpu:
            return Reference(nv.reference(path, prompts, **kw))
        with TF32(False):
            value = nv.reference(path, prompts, device=self.device, **kw)
        forced = {**kw, "tokens": value.tokens}  # calibrate on the same positions
        return Reference(value, nv.reference(path, prompts, **forced))


_FIDELITY_LOG: list[dict] = []


@pytest.fixture(scope="session")
def fidelity() -> Fidelity:
    """References and bounds for every assert that compares vLLM with transformers (see :class:`Fidelity`)."""
    import torch

    return Fidelity("cuda" if torch.cuda.is_available() else "cpu")


def pytest_runtest_logreport(report):
    """With ``NNVLLM_FAILURES_NOW=1`` (scripts/gpu_lane.sh sets it) a failure's traceback is written when
    the test fails, not in the summary at the end: a stage cut at its time limit still says why."""
    # (under xdist the controller writes it; a worker's stderr reaches the log as well)
    if report.failed and os.environ.get("NNVLLM_FAILURES_NOW") == "1" and not os.environ.get("PYTEST_XDIST_WORKER"):
        import sys

        sys.stderr.write(f"\n--- FAILED {report.nodeid} ({report.when}):\n{report.longreprtext[-8000:]}\n")
        sys.stderr.flush()


def pytest_unconfigure(config):
    """With ``NNVLLM_FAILURES_NOW=1``, a pytest process (an xdist worker too) still alive
    ``faulthandler_timeout`` seconds after its session ended writes every thread's stack: a stage that
    waits at exit, after every test has reported, then says what it waits on."""
    timeout = config.getini("faulthandler_timeout")
    if os.environ.get("NNVLLM_FAILURES_NOW") == "1" and timeout:
        import faulthandler
        import sys

        faulthandler.dump_traceback_later(float(timeout), file=sys.__stderr__)


def pytest_terminal_summary(terminalreporter):
    """On a GPU, list each fidelity check's distance and calibrated bound (NNVLLM_FIDELITY_JSON: also as JSON)."""
    rows = [r for r in _FIDELITY_LOG if r["device"] != "cpu"]
    out = os.environ.get("NNVLLM_FIDELITY_JSON")
    if out and _FIDELITY_LOG:
        import json

        with open(out, "w") as f:
            json.dump({"factor": CALIBRATION_FACTOR, "checks": _FIDELITY_LOG}, f, indent=1)
    if rows:
        terminalreporter.section(f"fidelity bounds (GPU: max(CPU bound, {CALIBRATION_FACTOR:g} x GPU-vs-CPU))")
        for r in rows:
            terminalreporter.write_line(f"{r['max_abs']:9.3g} < {r['bound']:9.3g}  (CPU {r['cpu_bound']:g}, "
                                        f"GPU-vs-CPU {r['gpu_vs_cpu']:.3g})  {r['test']} {r['what']}")
