"""Load a model on a vLLM engine through nnsight, on a GPU when CUDA is there and on vLLM's CPU backend otherwise.

``load`` returns nnsight's ``VLLM`` (a subclass of it), so everything nnsight users write works
unchanged::

    model = nv.load()                         # the embedded toy model
    with model.trace("The capital of France is", temperature=0.0):
        h = model.transformer.h[2].output.clone().save()

Two things differ from plain nnsight, both fixes rather than features:
- On CPU the engine uses the worker from :mod:`nnvllm._cpu_worker` (nnsight 0.8.1 has none).
- Parameter-free modules that vLLM shares between blocks (GPT-2's activation) are given one copy
  per block, in the client's tree and in the worker's (:func:`nnvllm.arch.untie_shared_modules`),
  so ``h[i].mlp.act.output`` is block i's value instead of block 0's.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import sys
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import _compat, _validate
from ._procs import check_sleep, real_stdout, tree_rss
from .arch import Arch, arch_for, untie_shared_modules

__all__ = ["load", "engines", "EngineInfo", "cpu_defaults", "has_cuda"]

# 256 MiB: the toy model needs 3 KiB of KV cache per token (6 layers x K,V x 64 x fp32), so this
# holds ~87k tokens; the engine starts without sizing the cache from the NUMA node (docs/engines.md
# has the start-time measurements).
_CPU_KV_CACHE_BYTES = 256 * 2**20


def has_cuda() -> bool:
    """Return whether a CUDA device is usable (decides GPU vLLM vs the CPU backend)."""
    import torch

    return torch.cuda.is_available()


def cpu_defaults(tensor_parallel_size: int = 1) -> dict[str, Any]:
    """Return the engine arguments nnvllm uses on CPU unless the caller sets them.

    - ``dtype="float32"``: vLLM runs fp32 checkpoints in bf16 on CPU otherwise; fp32 is what makes
      numbers comparable with transformers, and on CPU the small models it suits lose little speed.
    - ``kv_cache_memory_bytes``: without a size the CPU worker sizes the cache from the NUMA node
      and may refuse to start; 256 MiB starts fast and fits the toy and test models many times over.
    """
    d: dict[str, Any] = {"dtype": "float32"}
    if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):  # the env var silently wins over the arg
        d["kv_cache_memory_bytes"] = _CPU_KV_CACHE_BYTES
    return d


GPU_SHARE_ENV = "NNVLLM_GPU_MEMORY_UTILIZATION"
KV_CACHE_ENV = "NNVLLM_KV_CACHE_MEMORY_BYTES"


def fit_gpu_memory(engine_args: dict[str, Any]) -> dict[str, Any]:
    """Size a GPU engine to the memory that is free, unless the caller chose a size.

    vLLM takes ``gpu_memory_utilization`` (default 0.9) of each GPU's *total* memory and refuses to
    start when less than that is free, so a second engine in one notebook (or next to another
    process) fails at vLLM's default (even with ``kv_cache_memory_bytes``, which leaves that check in
    place). Without ``gpu_memory_utilization`` from the caller, this sets it to 0.9 x the free share
    of the engine's fullest GPU when less than 98% is free; the first engine on an empty GPU gets
    vLLM's default unchanged. Read through NVML, so the notebook process creates no CUDA context.
    ``NNVLLM_GPU_MEMORY_UTILIZATION=0.3`` (say) gives every such engine that share instead, for
    several engines or processes sharing a GPU (the GPU test lane sets it). ``NNVLLM_KV_CACHE_MEMORY_BYTES=1GiB``
    gives engines whose caller sets no ``kv_cache_memory_bytes`` a fixed KV cache, which skips vLLM's
    memory profiling: that profiling fails when another process frees GPU memory meanwhile (seen on a
    shared H200: "Error in memory profiling ... other processes sharing the same container").
    """
    kv = os.environ.get(KV_CACHE_ENV, "").strip()
    if kv and "kv_cache_memory_bytes" not in engine_args:
        from .store import parse_bytes

        try:
            engine_args = {**engine_args, "kv_cache_memory_bytes": parse_bytes(kv)}
        except (ValueError, TypeError):
            raise ValueError(f"{KV_CACHE_ENV}={kv!r}; expected a size such as '1GiB' or '512MB'") from None
    if "gpu_memory_utilization" in engine_args:  # (no NVML call needed)
        return engine_args
    env = os.environ.get(GPU_SHARE_ENV, "").strip()
    if env:
        try:
            share = float(env)
        except ValueError:
            share = -1.0
        if not 0 < share <= 1:
            raise ValueError(f"{GPU_SHARE_ENV}={env!r}; expected a fraction of GPU memory in (0, 1], e.g. 0.3")
        return {**engine_args, "gpu_memory_utilization": share}
    n = int(engine_args.get("tensor_parallel_size", 1) or 1) * int(engine_args.get("pipeline_parallel_size", 1) or 1)
    return _fit(engine_args, _free_gpu_share(n))


def _fit(engine_args: dict[str, Any], share: float | None) -> dict[str, Any]:
    """:func:`fit_gpu_memory` given the free share of memory (None: unknown)."""
    if "gpu_memory_utilization" in engine_args or share is None or share >= 0.98:
        return engine_args
    util = 0.9 * share
    if util < 0.02:
        raise RuntimeError(
            f"the GPU(s) this engine would use have {100 * share:.1f}% of their memory free. Close an "
            "engine you no longer need (nv.engines() lists them, each with .close()), or pass "
            "gpu_memory_utilization=... / kv_cache_memory_bytes=... yourself.")
    return {**engine_args, "gpu_memory_utilization": round(util - 0.005, 3)}


def _free_gpu_share(n: int) -> float | None:
    """min(free / total) over the first ``n`` visible GPUs, through NVML; None if NVML is not there."""
    try:
        import pynvml
    except ImportError:
        try:
            from vllm.third_party import pynvml  # vLLM carries a copy
        except ImportError:
            return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001
        return None
    try:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = [x.strip() for x in visible.split(",") if x.strip()] if visible else [str(i) for i in range(n)]
        shares = []
        for dev in ids[:n]:
            h = (pynvml.nvmlDeviceGetHandleByIndex(int(dev)) if dev.isdigit()
                 else pynvml.nvmlDeviceGetHandleByUUID(dev))
            mem = pynvml.nvmlDeviceGetMemoryInfo(h)
            shares.append(mem.free / mem.total)
        return min(shares) if shares else None
    except Exception:  # noqa: BLE001 (an unusual device naming: leave vLLM's default)
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def _cpu_environment(tp: int) -> None:
    # vLLM reads these when the engine is built, not at import: set them here, never at import.
    # The engine core in this process: at TP=1 the worker runs in it too (~3 s start instead of ~17 s,
    # one process, no __main__ guard needed); at TP>1 the workers are vLLM's processes either way and
    # this saves the EngineCore process between them (toy model, TP=2, 2-core box: start 38 s instead
    # of 54 s, 78 instead of 95 CPU-s, session 14). (An AsyncLLM, as in the isolated server, keeps its
    # EngineCore process either way; at TP=1 this makes vLLM run the worker inside EngineCore instead
    # of a third process: measured 27 s start and 1.6 GB instead of 41 s and 2.3 GB.)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    _compat.shorter_busy_loop()  # TP>1: the executor's reads of its workers' replies (_compat)
    if tp == 1:
        return
    if "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # Without an explicit binding TP>1 fails with "Not enough allowed NUMA nodes".
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < tp:
            raise ValueError(
                f"tensor_parallel_size={tp} needs at least {tp} CPU cores; this process may use "
                f"{len(cores)}. Lower tensor_parallel_size."
            )
        per = len(cores) // tp
        groups = [cores[i * per : (i + 1) * per] for i in range(tp)]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(
            f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0]) for g in groups
        )


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


# What a local checkpoint's weights look like to vLLM's default loader (safetensors, then .bin, then .pt).
_WEIGHT_GLOBS = ("*.safetensors", "*.bin", "*.pt", "*.index.json")
# load_format values that read those files from the model folder; others (dummy, tensorizer, gguf,
# runai_streamer, ...) bring or make their weights elsewhere, so the folder is not checked for them.
_FOLDER_FORMATS = (None, "auto", "safetensors", "fastsafetensors", "pt", "npcache")


def _needs_weight_files(engine_args: dict) -> bool:
    """Whether the engine will read weight files from a local model folder (not with ``load_format="dummy"``)."""
    fmt = engine_args.get("load_format")
    return (fmt.lower() if isinstance(fmt, str) else fmt) in _FOLDER_FORMATS


def _read_config(cfg: Path) -> dict:
    """The JSON object in a checkpoint's config.json, or an error naming the file and the fix."""
    try:
        data = json.loads(cfg.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        where = f" (line {e.lineno}, column {e.colno}: {e.msg})" if isinstance(e, json.JSONDecodeError) else ""
        raise ValueError(
            f"{str(cfg)!r} is not valid JSON{where}. A checkpoint's config.json must be complete JSON: "
            "copy it again from the original checkpoint (a download or copy may have been cut short)."
        ) from None
    if not isinstance(data, dict):
        raise ValueError(  # noqa: TRY004  a broken file, not an argument of the wrong type
            f"{str(cfg)!r} holds a JSON {type(data).__name__} ({_short_json(data)}); config.json must hold a "
            "JSON object (the model's configuration, {\"architectures\": [...], ...}). Copy the checkpoint's "
            "own config.json into the folder."
        ) from None
    return data


def _short_json(data: Any, limit: int = 40) -> str:
    text = json.dumps(data)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_weight_files(folder: Path) -> None:
    if not any(next(folder.glob(g), None) for g in _WEIGHT_GLOBS):
        raise FileNotFoundError(
            f"{str(folder)!r} has a config.json but no weights: expected *.safetensors, *.bin or *.pt files "
            "(or an index such as model.safetensors.index.json) next to it. Put the checkpoint's weight "
            "files in this folder, or pass load_format='dummy' for random weights."
        ) from None


def _preflight(model: str | os.PathLike | None, weights: bool) -> tuple[str, Arch]:
    """What load() checks before an engine starts: the config, a known layout, then (local) weight files."""
    path, cfg = _resolve(model)
    arch = arch_for(cfg.get("architectures"), where=repr(path))
    if weights and Path(path).is_dir():
        _check_weight_files(Path(path))
    return path, arch


def _is_hub_id(model: Any) -> bool:
    """Whether ``model`` names a hub repository rather than something on this machine."""
    return (isinstance(model, str) and bool(_HUB_ID.match(model)) and not model.startswith((".", "/", "~"))
            and not Path(model).expanduser().exists())


def _resolve(model: str | os.PathLike | None) -> tuple[str, dict]:
    """Return (path or hub id, config dict), or raise an error that says what was expected."""
    if model is None:
        from . import toy

        model = toy.check()
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(
            f"load(model=...) takes a checkpoint directory or a hub id (str), got {type(model).__name__}"
        ) from None
    p = Path(model).expanduser()
    if p.is_dir():
        cfg = p / "config.json"
        if not cfg.is_file():
            raise ValueError(
                f"{str(p)!r} is a directory but not a Hugging Face model: it has no config.json. "
                "Pass the folder that holds config.json and the weights."
            ) from None
        return str(p.resolve()), _read_config(cfg)
    if p.exists():
        raise ValueError(f"{str(p)!r} is a file; pass the model's directory (the one holding config.json)")
    if not _HUB_ID.match(str(model)) or str(model).startswith((".", "/", "~")):
        raise FileNotFoundError(
            f"no model directory at {str(model)!r}. Pass an existing checkpoint folder, a hub id "
            "such as 'openai-community/gpt2', or nothing for the embedded toy model."
        ) from None
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(model)).to_dict()
    except Exception as e:  # hub unreachable, unknown id, gated...
        raise FileNotFoundError(
            f"{str(model)!r} is not a local directory and its config could not be fetched from the "
            f"hub ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). Download the "
            "model to a folder and pass that folder."
        ) from None
    return str(model), cfg


_CLASSES: dict[str, type] = {}


def __getattr__(name: str):
    # The model classes are built on first use (importing nnvllm must not import vLLM) and then
    # reachable as nnvllm.engine.<name>, in any process. That is what lets cloudpickle pickle them
    # by reference when nnsight ships a model with every invoke: by value, each trace re-pickled
    # every method and searched all of sys.modules for some of them (measured on CPU: a 36-invoke
    # trace took 18-20 s instead of 0.1-0.2 s, in-process and isolated alike).
    if name in ("GPUModel", "CPUModel"):
        return dict(zip(("GPUModel", "CPUModel"), _model_classes()))[name]
    if name in ("IsolatedGPUModel", "IsolatedCPUModel"):
        return _client_class(gpu=name == "IsolatedGPUModel")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _model_classes():
    """Build the nnsight ``VLLM`` subclasses once, lazily: importing nnvllm must not import vLLM."""
    if "CPUModel" not in _CLASSES:
        GPUModel, CPUModel = _build_model_classes()
        for cls in (GPUModel, CPUModel):
            cls.__qualname__ = cls.__name__  # importable as nnvllm.engine.<name> (see __getattr__)
            _CLASSES[cls.__name__] = cls
    return _CLASSES["GPUModel"], _CLASSES["CPUModel"]


def _build_model_classes():
    from nnsight.modeling.vllm import VLLM

    from ._cpu import CPUVLLM

    class _Mixin:
        arch: Arch
        checkpoint: str

        def _load_meta(self, repo_id: str, **kwargs: Any):
            from ._compat import tolerant_meta_weight_processing

            kwargs.pop("cuda_graphs", None)
            kwargs.pop("exact", None)
            with tolerant_meta_weight_processing():
                module = super()._load_meta(repo_id, **kwargs)
            untie_shared_modules(module)
            return module

        @property
        def n_layers(self) -> int:
            return len(self._module.get_submodule(self.arch.blocks))

        @property
        def llm(self):
            """The underlying ``vllm.LLM``."""
            return self.vllm_entrypoint

        def close(self) -> None:
            """Shut the engine down; the object cannot trace afterwards."""
            llm, self.vllm_entrypoint = self.vllm_entrypoint, None
            if llm is None:
                return
            with _collections_deferred(_core_in_this_process("sync")):
                try:
                    llm.llm_engine.engine_core.shutdown()
                except Exception:
                    pass
                del llm
                VLLM._cleanup_distributed()
            gc.collect()

        def sleep(self, level: int = 1) -> None:
            """Offload (level 1) or drop (level 2) the weights and free the KV cache, keeping the engine
            (in-process or isolated).

            vLLM's sleep mode: GPU only, and the model must be loaded with ``enable_sleep_mode=True``.
            """
            self._sleep_engine().sleep(level)

        def wake(self) -> None:
            """Undo :meth:`sleep`."""
            self._sleep_engine().wake()

        def _sleep_engine(self):
            from .transport import engine_of

            engine = engine_of(self)  # a closed (or dead) engine says so here
            check_sleep(*engine.sleep_support())
            return engine

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

        def _state(self) -> str:
            return "closed" if self.vllm_entrypoint is None else "running"

        def __repr__(self) -> str:
            return f"<nnvllm model {self.checkpoint!r} ({self.arch.family}, {self.n_layers} layers, {self._state()})>"

    class GPUModel(_Mixin, VLLM):
        _WORKER_CLS = "nnvllm._gpu.NNsightUntiedGPUWorker"

        # nnsight runs an engine without taps eagerly (its hooks cannot fire in a replayed graph).
        # nnvllm's recording taps are recorded into the graphs (nnvllm._worker), and its runner runs
        # any step that carries an nnsight trace eagerly, so the engine keeps vLLM's CUDA graphs.
        def _load(self, repo_id: str, **kwargs: Any):
            self._nnvllm_graphs = bool(kwargs.pop("cuda_graphs", False))
            if kwargs.pop("exact", False):
                exact_environment()
            return super()._load(repo_id, **kwargs)

        def _load_sync(self, repo_id: str, **kwargs: Any):
            from nnsight.modeling.vllm.engines.engine import NNsightLLMEngine
            from vllm import LLM

            llm = LLM(repo_id, worker_cls=self._WORKER_CLS, **_graph_args(self._nnvllm_graphs, kwargs))
            llm.llm_engine.__class__ = NNsightLLMEngine  # as nnsight's own _load_sync
            return llm

        def _load_async(self, repo_id: str, **kwargs: Any):
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            args = AsyncEngineArgs(model=repo_id, worker_cls=self._WORKER_CLS,
                                   **_graph_args(self._nnvllm_graphs, kwargs))
            return AsyncLLM.from_engine_args(args)

    class CPUModel(_Mixin, CPUVLLM):
        pass

    return GPUModel, CPUModel


def default_cuda_graphs() -> bool:
    """``cuda_graphs`` when :func:`load` is not given it: ``NNVLLM_CUDA_GRAPHS=1`` turns it on (default off)."""
    v = os.environ.get("NNVLLM_CUDA_GRAPHS", "0").strip().lower()
    if v not in ("0", "1", "true", "false", ""):
        raise ValueError(f"NNVLLM_CUDA_GRAPHS={v!r}; expected 1 or 0")
    return v in ("1", "true")


def exact_environment() -> None:
    """Make fp32 on the GPU match transformers: Triton's fp32 dot products in full precision.

    Measured on an H200 (vLLM 0.26, ``benchmarks/fp32_gpu.py``, docs/discrepancies.md): vLLM's fp32
    attention (TRITON_ATTN) calls ``tl.dot`` without a precision, and Triton then multiplies fp32 in
    TF32; that alone is the whole gap to transformers (toy model: 9.0e-4 on the residual stream,
    9.8e-3 on the logits; with ``TRITON_F32_DEFAULT=ieee`` 4.8e-7 and 4.8e-6). Triton reads the
    variable when it compiles a kernel, so it is set in this process (and so inherited by the engine
    processes it starts); it also applies to other Triton kernels compiled here afterwards.
    """
    os.environ["TRITON_F32_DEFAULT"] = "ieee"


def uses_cuda_graphs(model) -> bool:
    """Whether ``model``'s engine replays CUDA graphs (loaded with ``cuda_graphs=True`` on a GPU)."""
    if getattr(model, "_nnvllm_graphs", False):
        return True
    relaunch = getattr(model, "_relaunch", None) or {}
    return bool((relaunch.get("engine_args") or {}).get("cuda_graphs")) and has_cuda()


def _graph_args(graphs: bool, kwargs: dict) -> dict:
    """vLLM engine arguments for nnvllm's GPU engine: CUDA graphs on (default) or eager.

    With graphs: full graphs for decode steps, prefill eager, and no torch.compile (a compiled
    graph would not run the taps' hooks while vLLM records the graphs). Measured on an H200, see
    benchmarks/results/capture_gpu_h200.json.
    """
    kwargs = dict(kwargs)
    kwargs.pop("enforce_eager", None)
    if not graphs:
        return {**kwargs, "enforce_eager": True}
    cc = kwargs.pop("compilation_config", None) or {}
    if not isinstance(cc, dict):
        raise TypeError("compilation_config= must be a dict for nnvllm's engine (it sets mode and cudagraph_mode)")
    cc = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", **cc}
    return {**kwargs, "enforce_eager": False, "compilation_config": cc}


def _build_engine(model: str | os.PathLike | None, *, mode: str = "sync", **engine_args: Any):
    """Build and dispatch nnvllm's model class in this process (``mode="async"``: the server's AsyncLLM)."""
    with _start_collections(mode):
        return _start(model, mode=mode, **engine_args)


def _start(model: str | os.PathLike | None, *, mode: str, **engine_args: Any):
    _compat.check_versions()
    open_ = _other_in_process_engines(None)
    if open_ and mode == "sync":
        # vLLM keeps its distributed state (process groups) per process: a second in-process engine
        # started, but closing either tore that state down under the other (issue 14, item 2).
        raise RuntimeError(
            f"this process already runs an in-process engine ({open_[0].checkpoint!r}); vLLM's state is "
            "per process, so a second one here would break when either is closed. Close it first "
            "(model.close(), or nv.engines()[i].close()), or load this one in its own process with "
            "nv.load(..., isolate=True).")
    path, cfg = _resolve(model)
    arch = arch_for(cfg.get("architectures"), where=repr(path))
    GPUModel, CPUModel = _model_classes()
    tp = int(engine_args.get("tensor_parallel_size", 1))
    if has_cuda():
        cls = GPUModel
    else:
        cls = CPUModel
        engine_args.pop("cuda_graphs", None)  # vLLM's CPU backend runs eagerly here
        engine_args.pop("exact", None)  # fp32 on CPU matches transformers already (tests: <= 1e-6)
        _cpu_environment(tp)
        engine_args = {**cpu_defaults(tp), **engine_args}
    quiet = cls is CPUModel and tp == 1 and mode == "sync" and not os.environ.get("NNVLLM_VERBOSE")
    # The isolated server's EngineCore forked instead of spawned on CPU (_compat.engine_core_by_fork).
    fork = _compat.engine_core_by_fork() if cls is CPUModel and mode == "async" else contextlib.nullcontext()
    with real_stdout(), _c_stderr_to_log(quiet) as log, fork:
        m = cls(path, dispatch=True, mode=mode, **engine_args)
    m.arch = arch.in_engine(m._module)  # vLLM's tree (its Transformers backend moves the blocks)
    m.checkpoint = path
    m.start_log = log.text if quiet else None
    return m


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
    CPU box (session 15). Here automatic collection is off for the start, and where the EngineCore
    runs in this process (``_core_in_this_process``: the CPU at TP=1 and in-process TP>1) each of
    vLLM's full collections freezes what survives it (``gc.freeze``), so the next one walks only what
    the start made since: the same garbage is freed (what the start makes and drops, vLLM's reason
    for collecting), and the heap ends frozen, as vLLM leaves it at the end of a start anyway (and
    unfreezes at shutdown). Where the EngineCore runs elsewhere, nothing is frozen here, and a
    process forked during the start (vLLM's EngineCore: the GPU, the isolated server) gets collection
    back at once, its inherited heap frozen (vLLM freezes it at the end of the EngineCore's start).
    A heap someone else froze is not frozen further; after a failed start a heap frozen here is
    unfrozen again.
    """
    global _STARTING
    real, enabled, frozen = gc.collect, gc.isenabled(), gc.get_freeze_count()

    def collect(generation: int = 2) -> int:
        n = real(generation)
        if generation == 2 and not frozen and _core_in_this_process(mode):
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
    ~1 s (session 14). Elsewhere (``core_here=False``) nothing changes.
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


class _Log:
    text = ""


@contextlib.contextmanager
def _c_stderr_to_log(on: bool):
    """While an in-process CPU engine starts, send what C/C++ code writes to file descriptor 2 to a log.

    torch's "NUMA binding: Using MEMBIND policy ..." warning is written there by C++ and so escaped
    Jupyter's ``%%capture`` in every load cell (issue 14, item 9). Only for the in-process CPU engine
    at TP=1, whose worker runs in this process: engine processes started meanwhile would inherit the
    redirection for their whole life. The text is kept as ``model.start_log``; if the start fails,
    it is added to the error. ``NNVLLM_VERBOSE=1`` leaves stderr alone.
    """
    log = _Log()
    if not on:
        yield log
        return
    import tempfile

    try:
        sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as f:
        os.dup2(f.fileno(), 2)
        try:
            yield log
        except BaseException as e:
            os.dup2(saved, 2)
            f.seek(0)
            text = f.read().decode(errors="replace")
            if text.strip() and hasattr(e, "add_note"):
                e.add_note("engine start-up messages (C/C++ stderr):\n" + "\n".join(text.splitlines()[-40:]))
            raise
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        log.text = f.read().decode(errors="replace")


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
    _ENGINES[id(model)] = weakref.ref(model, lambda _r, k=id(model): _ENGINES.pop(k, None))


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
        url: attach to an engine started elsewhere with ``python -m nnvllm.server MODEL --port P
            --token T``; ``model`` is then optional (its config comes from the server).
        token: the token of the engine at ``url``.
        start_timeout: seconds an isolated engine may take to start before it is stopped and a
            ``TimeoutError`` (with the end of its log) is raised.
        **engine_args: vLLM engine arguments (``tensor_parallel_size``, ``dtype``, ``max_model_len``,
            ...). On CPU, :func:`cpu_defaults` fills the ones not given. On a GPU,
            ``cuda_graphs=True`` makes the engine replay CUDA graphs for decode steps:
            :func:`nnvllm.generate` records through them (``nnvllm._worker``; measured 3.1x faster
            than eager on an H200, same numbers bit for bit) and steps of an nnsight trace run
            eagerly.
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
    if url is not None:
        if isolate is False:
            raise ValueError(f"isolate=False asks for an engine in this process, but url={url!r} names one "
                             "running elsewhere; drop one of the two")
        if engine_args:
            raise ValueError(
                f"engine arguments {sorted(engine_args)} cannot apply to an engine that is already running "
                f"at {url}; they are set where it was started (python -m nnvllm.server MODEL --flag value)"
            )
        from . import isolated

        def cls_for(where):
            path, cfg = _resolve(where)
            arch = arch_for(cfg.get("architectures"), where=repr(path))
            return _client_class(), path, arch

        m = isolated.attach(cls_for, url, token, None if model is None else str(model))
        _track(m)
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
    quiet_engine_logs()
    if engine_args.get("exact"):
        dt = engine_args.get("dtype", "float32")
        if str(dt).removeprefix("torch.") not in ("float32", "float"):
            raise ValueError(f"exact=True is fp32 matching transformers; it cannot go with dtype={dt!r}. "
                             "Drop dtype= (exact implies float32) or drop exact=True.")
        engine_args = {**engine_args, "dtype": "float32"}
    if has_cuda():
        engine_args = fit_gpu_memory(engine_args)
        if "cuda_graphs" not in engine_args:
            engine_args = {**engine_args, "cuda_graphs": default_cuda_graphs()}
    weights = _needs_weight_files(engine_args)
    if not isolate:
        if not _is_hub_id(model):  # a local folder: its config and weights (_build_engine reads it again)
            _preflight(model, weights)
        m = _build_engine(model, **engine_args)
        _track(m)
        return m
    from . import isolated

    path, arch = _preflight(model, weights)
    if not has_cuda():
        engine_args = {**cpu_defaults(int(engine_args.get("tensor_parallel_size", 1))), **engine_args}
    _compat.check_versions()
    m = isolated.start(_client_class(), path, arch, engine_args, start_timeout)
    _track(m)
    return m


def quiet_engine_logs() -> None:
    """vLLM's ~45 INFO lines per engine start, off unless asked for (issue 14, item 9).

    Sets ``VLLM_LOGGING_LEVEL=WARNING`` for vLLM in this process and the engine processes it starts,
    unless the caller set ``VLLM_LOGGING_LEVEL`` or ``NNVLLM_VERBOSE=1``. Warnings and errors still
    show, and an isolated engine's log keeps them (a failed start quotes the first error).
    """
    import logging

    if os.environ.get("NNVLLM_VERBOSE") or "VLLM_LOGGING_LEVEL" in os.environ:
        return
    os.environ["VLLM_LOGGING_LEVEL"] = "WARNING"
    logging.getLogger("vllm").setLevel(logging.WARNING)  # vLLM imported before: its logger is set up


def _client_class(gpu: bool | None = None):
    """nnvllm's model class with the isolated mixin first: a meta-only client of a served engine."""
    from .isolated import IsolatedMixin

    gpu = has_cuda() if gpu is None else gpu
    name = "IsolatedGPUModel" if gpu else "IsolatedCPUModel"
    if name not in _CLASSES:
        GPUModel, CPUModel = _model_classes()
        cls = type(name, (IsolatedMixin, GPUModel if gpu else CPUModel), {"__module__": __name__})
        _CLASSES[name] = cls
    return _CLASSES[name]
