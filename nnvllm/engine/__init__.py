"""The engine floor: load a model on a vLLM engine through nnsight, and list the live engines.

``load`` returns nnsight's ``VLLM`` (a subclass of it: :mod:`.models`), so everything nnsight users
write works unchanged::

    model = nv.load()                         # the embedded toy model
    with model.trace("The capital of France is", temperature=0.0):
        h = model.transformer.h[2].output.clone().save()

The rooms of this floor: :mod:`.models` (the model classes and engine arguments), :mod:`.start`
(starting an engine in this process), :mod:`.transport` (the one contract every verb calls, and its
in-process transport), :mod:`.isolated` and :mod:`.server` (the engine in its own process),
:mod:`.compat` (the supported versions and every private name of vLLM and nnsight relied on),
:mod:`.trace_payload` (what a trace block sends to the engine), :mod:`.trace_saves` (what its saves
send back), :mod:`.procs` (process helpers), and :mod:`.worker` (what runs inside vLLM's worker:
taps, per-step placement, the shared-memory hand-off, the runner and worker classes). Only this
floor and :mod:`nnvllm.reference` import vLLM, nnsight or transformers.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from typing import Any

from .. import _validate
from ..arch import arch_for
from . import compat as _compat
from . import logs
from .models import (_CLASSES, _is_hub_id, _needs_weight_files, _preflight, _resolve, cpu_defaults, default_cuda_graphs,
                     fit_gpu_memory, has_cuda, model_classes)
from .procs import tree_rss
from .start import _build_engine

# Reachable from here as well as from their rooms (tests and tools import them as nnvllm.engine.<name>).
from .models import GPU_SHARE_ENV, KV_CACHE_ENV, _fit, exact_environment, uses_cuda_graphs  # noqa: E402,F401
from .heap import _collections_deferred, _core_in_this_process, _start_collections  # noqa: E402,F401

__all__ = ["load", "engines", "EngineInfo", "cpu_defaults", "has_cuda"]


def __getattr__(name: str):
    # The model classes are built on first use (importing nnvllm must not import vLLM) and then
    # reachable as nnvllm.engine.<name>, in any process. That is what lets cloudpickle pickle them
    # by reference when nnsight ships a model with every invoke: by value, each trace re-pickled
    # every method and searched all of sys.modules for some of them (measured on CPU: a 36-invoke
    # trace took 18-20 s instead of 0.1-0.2 s, in-process and isolated alike).
    if name in ("GPUModel", "CPUModel"):
        return dict(zip(("GPUModel", "CPUModel"), model_classes()))[name]
    if name in ("IsolatedGPUModel", "IsolatedCPUModel"):
        return _client_class(gpu=name == "IsolatedGPUModel")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def default_isolate() -> bool:
    """Whether :func:`load` isolates the engine when ``isolate=`` is not given: on a GPU, yes.

    Measured (docs/engines.md): on the 2-core CPU machine an isolated engine starts 2.7x slower
    (24 s vs 9 s) and adds 13-60 ms per call, for memory that comes back on ``close()`` either way.
    On an H200 it starts 1.4x slower (58 s vs 43 s), and when the kernel dies without closing, an
    in-process engine's EngineCore stayed holding 43 GB of GPU memory; an isolated one was gone in 4 s.
    """
    return has_cuda()


# ---------------------------------------------------------------- live engines

_ENGINES: dict[int, weakref.ref] = {}  # id -> every model load() returned, alive or not


def _other_in_process_engines(model) -> list:
    """In-process engines of this process other than ``model`` (None: all) that are still open."""
    live = [m for m in (ref() for ref in list(_ENGINES.values())) if m is not None and m is not model]
    return [m for m in live if not getattr(m, "_nnvllm_isolated", False)
            and getattr(m, "vllm_entrypoint", None) is not None]


def _track(model) -> None:
    key = id(model)
    _ENGINES[key] = weakref.ref(model, lambda _r, k=key: _ENGINES.pop(k, None))


@dataclass(frozen=True)
class EngineInfo:
    """One live engine, as :func:`engines` lists it."""

    model: str
    kind: str  # "in-process" | "isolated" | "attached"
    pid: int | None  # the process holding the engine (this one for in-process; None when attached)
    rss_mib: float | None  # resident memory of that process and its children (RSS), MiB
    url: str | None
    _model: Any = field(default=None, repr=False, compare=False)  # a weakref to the model

    def close(self) -> None:
        """Close this engine (as ``model.close()``): e.g. one left behind by re-running a load cell."""
        model = self._model() if self._model is not None else None
        if model is not None:
            model.close()


def engines() -> list[EngineInfo]:
    """List the engines this process has loaded and not closed, with their process and memory.

    Memory is the RSS of the engine's process tree: an isolated engine's server and its vLLM
    processes; for an in-process engine, this whole process and its children other than isolated
    engines (vLLM's own worker processes under tensor parallelism). An engine attached with
    ``url=`` runs elsewhere: no pid or memory.

    Example:
        >>> nv.engines()                                        # doctest: +SKIP
        [EngineInfo(model='.../toy_model', kind='isolated', pid=4242, rss_mib=1661.0,
                    url='http://127.0.0.1:40731')]
    """

    live = [m for m in (ref() for ref in list(_ENGINES.values())) if m is not None]
    isolated = [m for m in live if getattr(m, "_nnvllm_isolated", False)]
    in_process = _other_in_process_engines(None)
    isolated = [m for m in isolated if not m._closed and m._dead is None]
    out = []
    for m in isolated:
        rss = tree_rss(m.pid) if m.pid is not None else None
        out.append(EngineInfo(m.checkpoint, "isolated" if m.pid is not None else "attached", m.pid,
                              None if rss is None else round(rss / 2**20, 1), m.url, weakref.ref(m)))
    if in_process:
        own = tree_rss(os.getpid()) - sum(tree_rss(m.pid) or 0 for m in isolated if m.pid is not None)
        for m in in_process:
            out.append(EngineInfo(m.checkpoint, "in-process", os.getpid(), round(own / 2**20, 1), None,
                                  weakref.ref(m)))
    return out


def _check_not_starting_a_process() -> None:
    """Refuse a load made while this process is being started by ``spawn`` (it imports the script
    that started it again). On a GPU vLLM starts its engine core that way, so a script that calls
    ``nv.load`` at its top level loads again in the child, whose engine fails with a message about
    bootstrapping, and the parent reports only that the engine core failed to start."""
    from multiprocessing import process

    if getattr(process.current_process(), "_inheriting", False):
        raise RuntimeError(
            "nv.load ran while a new process was starting: that process (vLLM's engine core, which vLLM "
            "starts with 'spawn' on a GPU) imports the script that called nv.load, and the script loads "
            "again at import. Put the script's work under `if __name__ == \"__main__\":` (a notebook "
            "needs nothing).")


def load(
    model: str | os.PathLike | None = None,
    *,
    isolate: bool | None = None,
    url: str | None = None,
    token: str | None = None,
    start_timeout: float = 600.0,
    **engine_args: Any,
):
    """Start a vLLM engine on ``model`` and return it as an nnsight ``VLLM`` model.

    Args:
        model: a checkpoint directory, a hub id, or None for the embedded toy model.
        isolate: run the engine in its own process group (``True``) or in this process (``False``).
            Isolated, ``close()`` gives all of its memory back and a crash or kill leaves this
            process (the kernel) alive; in-process starts faster. None picks per platform
            (:func:`default_isolate`: isolated on GPU, in-process on CPU; see docs/engines.md).
        url: attach to an engine started elsewhere with ``python -m nnvllm.engine.server MODEL --port P
            --token T``; ``model`` is then optional (its config comes from the server).
        token: the token of the engine at ``url``.
        start_timeout: seconds an isolated engine may take to start before it is stopped and a
            ``TimeoutError`` (with the end of its log) is raised.
        **engine_args: vLLM engine arguments (``tensor_parallel_size``, ``dtype``, ``max_model_len``,
            ...). On CPU, :func:`cpu_defaults` fills the ones not given. On a GPU the engine
            replays CUDA graphs for decode steps (``cuda_graphs=True``, the default;
            ``cuda_graphs=False`` or ``NNVLLM_CUDA_GRAPHS=0``: eager): :func:`nnvllm.generate`
            records through them (:mod:`nnvllm.engine.worker`; measured 3.1x faster than eager on an
            H200, same numbers bit for bit); a decode step of an nnsight trace that reads or edits
            only the blocks' outputs replays the graph in pieces, other traced steps run eagerly
            (:mod:`nnvllm.engine.worker.pieces`, docs/capture.md). ``NNVLLM_COMPILE=1`` (GPU and
            CPU): vLLM's torch.compile runs the forward, with the taps inside it as opaque ops.
            ``exact=True`` (GPU, fp32): full-precision fp32 attention, so that vLLM matches
            transformers to fp32 rounding (without it, Triton's TF32 dot products leave ~1e-3 on
            the residual stream; docs/discrepancies.md). Implies ``dtype="float32"``.

    Returns:
        The model, usable as ``with model.trace(prompt, temperature=0.0): ...``; it also has
        ``.arch`` (module layout), ``.n_layers``, ``.close()`` and, in-process, ``.llm`` (the
        ``vllm.LLM``); isolated, ``.restart()``, ``.pid`` and ``.url``.

    Example:
        >>> model = nv.load()                                   # doctest: +SKIP
        >>> run = nv.generate(model, "The capital of France is", max_tokens=3)   # doctest: +SKIP
        >>> with nv.load(isolate=True) as iso:                  # doctest: +SKIP
        ...     run = nv.generate(iso, "The capital of France is")
    """
    _check_not_starting_a_process()
    if url is not None:
        if isolate is False:
            raise ValueError(f"isolate=False asks for an engine in this process, but url={url!r} names one "
                             "running elsewhere; drop one of the two")
        if engine_args:
            raise ValueError(
                f"engine arguments {sorted(engine_args)} cannot apply to an engine that is already running "
                f"at {url}; they are set where it was started (python -m nnvllm.engine.server MODEL --flag value)"
            )
        from . import isolated

        def cls_for(where):
            path, cfg = _resolve(where)
            arch = arch_for(cfg.get("architectures"), where=repr(path))
            return _client_class(), path, arch

        logs.route_vllm_logs()
        before = len(logs.ENGINE_LOG.lines)
        with logs.captured_warnings(), logs.keep_excepthook():
            m = isolated.attach(cls_for, url, token, None if model is None else str(model))
        _track(m)
        _announce(m, before)
        return m
    if token is not None:
        raise ValueError("token= goes with url= (an engine started elsewhere); an engine nnvllm starts "
                         "gets its own random token")
    if isolate is None:
        isolate = default_isolate()
    if not isinstance(isolate, bool):
        raise TypeError(f"isolate={isolate!r}; expected True, False or None (the platform default)")
    # Every check that needs no engine runs here, before one starts (seconds to minutes of work).
    engine_args = _validate.engine_args(engine_args)
    _check_executor(engine_args)
    if not has_cuda():  # the cores a CPU engine is bound to (the engine's worker binds them)
        from .cpu import bound_cores

        bound_cores(int(engine_args.get("tensor_parallel_size", 1)))
    if engine_args.get("exact"):
        dt = engine_args.get("dtype", "float32")
        if str(dt).removeprefix("torch.") not in ("float32", "float"):
            raise ValueError(f"exact=True is fp32 matching transformers; it cannot go with dtype={dt!r}. "
                             "Drop dtype= (exact implies float32) or drop exact=True.")
        engine_args = {**engine_args, "dtype": "float32"}
    if not _is_hub_id(model):  # a context or KV cache the local config shows cannot work
        _validate.engine_fits(engine_args, _resolve(model)[1])
    if has_cuda():
        engine_args = fit_gpu_memory(engine_args)
        if "cuda_graphs" not in engine_args:
            engine_args = {**engine_args, "cuda_graphs": default_cuda_graphs()}
    weights = _needs_weight_files(engine_args)
    logs.route_vllm_logs()
    if not logs.verbose():  # vLLM's weight-loading bar writes to the notebook's stderr
        engine_args = {"use_tqdm_on_load": False, **engine_args}
    before = len(logs.ENGINE_LOG.lines)
    if not isolate:
        if not _is_hub_id(model):  # a local folder: its config and weights (_build_engine reads it again)
            _preflight(model, weights)
        same = _replace_in_process_engine(model, engine_args)
        if same is not None:
            return same
        with logs.captured_warnings(), logs.keep_excepthook():
            m = _build_engine(model, **engine_args)
        m._nnvllm_load_args = (m.checkpoint, engine_args)
        _track(m)
        _announce(m, before)
        return m
    from . import isolated

    path, arch = _preflight(model, weights)
    if not has_cuda():
        engine_args = {**cpu_defaults(int(engine_args.get("tensor_parallel_size", 1))), **engine_args}
    _compat.check_versions()
    with logs.captured_warnings(), logs.keep_excepthook():
        m = isolated.start(_client_class(), path, arch, engine_args, start_timeout)
    _track(m)
    _announce(m, before)
    return m


def _check_executor(engine_args: dict) -> None:
    """``distributed_executor_backend="ray"`` (vLLM's Ray executor: workers as Ray actors, on one host
    or several) goes to vLLM as given where the platform runs it; refused before anything starts
    where it does not (vLLM's CPU platform refuses it only once the engine is being built) or where
    Ray is not installed."""
    if engine_args.get("distributed_executor_backend") != "ray":
        return
    from vllm.platforms import current_platform

    if not current_platform.ray_device_key:  # vLLM's own test: an empty key is a platform without Ray
        raise ValueError(
            f"distributed_executor_backend='ray': vLLM's {current_platform.device_name!r} platform (the vLLM "
            "build on this machine) does not run Ray's executor ('current platform "
            f"{current_platform.device_name} does not support ray'); it needs a GPU. Here, drop the argument "
            "(vLLM's own executor), or spread a collection over several engines with nv.collect([engine, "
            "...], ...) (engines in Ray actors: nnvllm.distributed.ray_engines)")
    try:
        import ray  # noqa: F401
    except ImportError:
        raise ValueError("distributed_executor_backend='ray' needs Ray: pip install 'nnvllm[dist]' "
                         "(or pip install ray)") from None


def _replace_in_process_engine(model, engine_args: dict):
    """Re-running a notebook's load cell: one in-process engine per process (vLLM's distributed state
    is per process), so the running one is handed back when it is the same model with the same
    arguments, and closed otherwise; whoever still holds it gets a clear "closed" error."""
    open_ = _other_in_process_engines(None)
    if not open_:
        return None
    path = _resolve(model)[0]
    for old in open_:
        if getattr(old, "_nnvllm_load_args", None) == (path, engine_args):
            print(f"nnvllm: {_name(path)} is already loaded here with these arguments; returning that engine")
            return old
    for old in open_:
        print(f"nnvllm: closing the in-process engine of {_name(old.checkpoint)} to load {_name(path)} "
              "(one in-process engine per process; nv.load(..., isolate=True) runs several)")
        old.close()
    return None


def _name(path) -> str:
    return os.path.basename(str(path).rstrip("/")) or str(path)


def _announce(m, before: int) -> None:
    """The one line a load prints: model, engine, memory (and where the engine's warnings went)."""
    if logs.verbose():
        return
    import torch

    where = "isolated" if getattr(m, "_nnvllm_isolated", False) else "in-process"
    device = "GPU" if has_cuda() else "CPU"
    pid = getattr(m, "pid", None) if where == "isolated" else os.getpid()
    rss = tree_rss(pid) if pid else None
    mem = [] if rss is None else [f"{rss / 2**30:.1f} GiB RAM"]
    if device == "GPU":
        free, total = torch.cuda.mem_get_info()
        mem.append(f"{(total - free) / 2**30:.1f} GiB GPU memory in use")
    n = sum(1 for ln in list(logs.ENGINE_LOG.lines)[before:] if "WARNING" in ln)
    note = f"; {n} engine warning{'s' * (n != 1)} in model.log()" if n else ""
    print(f"nnvllm: {_name(m.checkpoint)} ({m.arch.family}, {m.n_layers} layers) on an {where} {device} engine, "
          f"{', '.join(mem) or 'memory unknown'}{note}")


def _client_class(gpu: bool | None = None):
    """nnvllm's model class with the isolated mixin first: a meta-only client of a served engine."""
    from .isolated import IsolatedMixin

    gpu = has_cuda() if gpu is None else gpu
    name = "IsolatedGPUModel" if gpu else "IsolatedCPUModel"
    if name not in _CLASSES:
        GPUModel, CPUModel = model_classes()
        cls = type(name, (IsolatedMixin, GPUModel if gpu else CPUModel), {"__module__": __name__})
        _CLASSES[name] = cls
    return _CLASSES[name]
