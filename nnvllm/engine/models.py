"""nnvllm's nnsight ``VLLM`` subclasses and the engine arguments they start with (GPU and CPU).

The classes are built on first use (:func:`model_classes`), because importing nnvllm must not
import vLLM. Two things differ from plain nnsight, both fixes rather than features: on CPU the
engine runs the worker of :mod:`nnvllm.engine.worker.cpu` (nnsight 0.8.1 has none), and
parameter-free modules that vLLM shares between blocks (GPT-2's activation) get one copy per block
(:func:`nnvllm.arch.untie_shared_modules`), so ``h[i].mlp.act.output`` is block i's value.
"""

from __future__ import annotations

import gc
import json
import os
import re
from pathlib import Path
from typing import Any

from ..arch import Arch, arch_for, untie_shared_modules
from . import compat as _compat
from .procs import check_sleep
from .trace_payload import envoy_ids, envoys_by_reference, trace_blocks_ship_only_what_they_read

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
        from .._validate import parse_bytes

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
    # of 54 s, 78 instead of 95 CPU-s). (An AsyncLLM, as in the isolated server, keeps its
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
        from .. import toy

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


def model_classes():
    """Build the nnsight ``VLLM`` subclasses once, lazily: importing nnvllm must not import vLLM."""
    if "CPUModel" not in _CLASSES:
        GPUModel, CPUModel = _buildmodel_classes()
        for cls in (GPUModel, CPUModel):
            cls.__qualname__ = cls.__name__  # importable as nnvllm.engine.<name> (its __getattr__)
            cls.__module__ = "nnvllm.engine"
            _CLASSES[cls.__name__] = cls
    return _CLASSES["GPUModel"], _CLASSES["CPUModel"]


def _buildmodel_classes():
    from nnsight.modeling.vllm import VLLM

    from .cpu import CPUVLLM

    class _Mixin:
        arch: Arch
        checkpoint: str

        def _load_meta(self, repo_id: str, **kwargs: Any):
            from .compat import tolerant_meta_weight_processing, transformers_classes_kept

            kwargs.pop("cuda_graphs", None)
            kwargs.pop("exact", None)
            with tolerant_meta_weight_processing(), transformers_classes_kept(meta=True):
                module = super()._load_meta(repo_id, **kwargs)
            untie_shared_modules(module)
            return module

        def _load(self, repo_id: str, **kwargs: Any):
            from .compat import transformers_classes_kept
            from .transport import model_lock

            with transformers_classes_kept():  # the user's transformers stays as it was (compat)
                module = super()._load(repo_id, **kwargs)
            model_lock(self)  # one call drives an in-process engine at a time (transport.EngineLock)
            return module

        def __init__(self, *args: Any, **kwargs: Any):
            # Every process that builds one (in-process, an isolated client, its server) sends trace
            # blocks: they carry only what they read, and the envoys as ids (trace_payload).
            trace_blocks_ship_only_what_they_read()
            super().__init__(*args, **kwargs)
            envoys_by_reference(self)

        def _remoteable_persistent_objects(self) -> dict:
            return {**super()._remoteable_persistent_objects(), **envoy_ids(self)}

        def trace(self, *inputs: Any, **kwargs: Any):
            # The trace holds an in-process engine from building its invokes to collecting its saves
            # (transport.EngineLock): two threads tracing one engine corrupted it.
            from . import transport

            if kwargs.get("tracer_cls") is None and transport.model_lock(self) is not None:
                kwargs["tracer_cls"] = transport.SerialTracer
            return super().trace(*inputs, **kwargs)

        def _generate(self, *inputs: Any, **kwargs: Any):
            from .transport import holding

            with holding(self, "model.generate"):
                return super()._generate(*inputs, **kwargs)

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
            from .heap import _collections_deferred, _core_in_this_process, _thaw

            with _collections_deferred(_core_in_this_process("sync")):
                try:
                    llm.llm_engine.engine_core.shutdown()
                except Exception:
                    pass
                del llm
                VLLM._cleanup_distributed()
            _thaw()
            gc.collect()

        def log(self, last: int | None = 200) -> str:
            """The engine's log: what vLLM logged and the warnings its libraries raised, kept out of the
            notebook (the last ``last`` lines; None: all). An isolated engine's own log file follows."""
            from .logs import ENGINE_LOG, LogText

            text = ENGINE_LOG.text(last)
            path = getattr(self, "log_path", None)
            if path is not None and os.path.exists(path):
                with open(path, errors="replace") as f:
                    lines = f.read().splitlines()
                text += f"\n--- the engine process's log ({path}) ---\n" + "\n".join(
                    lines if last is None else lines[-last:])
            return LogText(text)

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
        _WORKER_CLS = "nnvllm.engine.worker.gpu.NNsightUntiedGPUWorker"

        # nnsight runs an engine without taps eagerly (its hooks cannot fire in a replayed graph).
        # nnvllm's recording taps are recorded into the graphs (nnvllm.engine.worker.taps), and its runner
        # serves an nnsight trace between graph pieces or runs its steps eagerly (engine.worker.pieces),
        # so the engine keeps vLLM's CUDA graphs.
        def _load(self, repo_id: str, **kwargs: Any):
            self._nnvllm_graphs = bool(kwargs.pop("cuda_graphs", False))
            if kwargs.pop("exact", False):
                exact_environment()
            if kwargs.get("distributed_executor_backend") == "ray":
                ray_copies_nnvllm_environment()
            return super()._load(repo_id, **kwargs)

        def _load_sync(self, repo_id: str, **kwargs: Any):
            from nnsight.modeling.vllm.engines.engine import NNsightLLMEngine
            from vllm import LLM

            llm = LLM(repo_id, worker_cls=self._WORKER_CLS,
                      **_graph_args(self._nnvllm_graphs, kwargs))
            llm.llm_engine.__class__ = NNsightLLMEngine  # as nnsight's own _load_sync
            return llm

        def _load_async(self, repo_id: str, **kwargs: Any):
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            args = AsyncEngineArgs(model=repo_id, worker_cls=self._WORKER_CLS,
                                   **_graph_args(self._nnvllm_graphs, kwargs))
            return AsyncLLM.from_engine_args(args)

    class CPUModel(_Mixin, CPUVLLM):
        # NNVLLM_COMPILE=1: vLLM's CPU backend traces the forward with torch.compile (nnsight runs it
        # eagerly); the taps are inside the compiled forward as opaque ops (engine.worker.taps).
        def _load_sync(self, repo_id: str, **kwargs: Any):
            if not compile_forward():
                return super()._load_sync(repo_id, **kwargs)
            from nnsight.modeling.vllm.engines.engine import NNsightLLMEngine
            from vllm import LLM

            llm = LLM(repo_id, worker_cls=self._WORKER_CLS, **_compile_args(kwargs))
            llm.llm_engine.__class__ = NNsightLLMEngine
            return llm

        def _load_async(self, repo_id: str, **kwargs: Any):
            if not compile_forward():
                return super()._load_async(repo_id, **kwargs)
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            return AsyncLLM.from_engine_args(
                AsyncEngineArgs(model=repo_id, worker_cls=self._WORKER_CLS, **_compile_args(kwargs)))

    return GPUModel, CPUModel


def ray_copies_nnvllm_environment() -> None:
    """Have vLLM's Ray executor copy ``NNVLLM_*`` variables into its worker actors.

    The executor copies a fixed set of prefixes (``VLLM_``, ``NCCL_``, ``HF_``, ...) from the process
    that starts it, plus those named in ``VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY``; a Ray actor is
    started by Ray's raylet, not by this process, so it inherits nothing else. The workers read
    nnvllm's settings there (families registered with :func:`nnvllm.arch.register_arch` in
    ``NNVLLM_ARCHS``, the static-buffer budget, the hand-off mode, ``NNVLLM_STACKS``)."""
    name = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
    have = [p.strip() for p in os.environ.get(name, "").split(",") if p.strip()]
    if "NNVLLM_" not in have:
        os.environ[name] = ",".join(have + ["NNVLLM_"])


def _switch(name: str) -> bool:
    """An on/off setting that is on unless set to 0 (or false); anything else is refused."""
    v = os.environ.get(name, "1").strip().lower()
    if v not in ("0", "1", "true", "false", ""):
        raise ValueError(f"{name}={v!r}; expected 1 or 0")
    return v in ("1", "true", "")


def compile_forward() -> bool:
    """Whether nnvllm's engines run the model's forward through vLLM's torch.compile, with the taps
    inside the compiled code as opaque ops: ``NNVLLM_COMPILE=1`` (read where the engine starts; off
    unless set). A step that carries nnsight's work (a trace, ``model.edit``) runs the plain forward,
    where nnsight's hooks are."""
    v = os.environ.get("NNVLLM_COMPILE", "0").strip().lower()
    if v not in ("0", "1", "true", "false", ""):
        raise ValueError(f"NNVLLM_COMPILE={v!r}; expected 1 or 0")
    on = v in ("1", "true")
    if on:
        # vLLM's ahead-of-time compile keys its cache on the forward's code object, and nnsight puts
        # a callable object in place of each module's forward; the in-process compile needs no key.
        os.environ["VLLM_USE_AOT_COMPILE"] = "0"
    return on


def _split_compilation(kwargs: dict) -> tuple[dict, dict]:
    """``kwargs`` without ``enforce_eager`` and ``compilation_config``, and that config (a dict)."""
    kwargs = dict(kwargs)
    kwargs.pop("enforce_eager", None)
    cc = kwargs.pop("compilation_config", None) or {}
    if not isinstance(cc, dict):
        raise TypeError("compilation_config= must be a dict for nnvllm's engine (it sets mode and cudagraph_mode)")
    return kwargs, cc


def _compile_args(kwargs: dict) -> dict:
    """vLLM engine arguments for a compiled forward on the CPU (vLLM's own default mode)."""
    kwargs, cc = _split_compilation(kwargs)
    return {**kwargs, "enforce_eager": False, "compilation_config": {**cc, "mode": 3}}


def default_cuda_graphs() -> bool:
    """``cuda_graphs`` when :func:`load` is not given it: on (vLLM's CUDA graphs replay the decode
    steps, with nnvllm's taps recorded into them); ``NNVLLM_CUDA_GRAPHS=0`` turns it off."""
    return _switch("NNVLLM_CUDA_GRAPHS")


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

    With graphs: full graphs for decode steps, prefill eager, and torch.compile only under
    ``NNVLLM_COMPILE=1`` (:func:`compile_forward`: the taps are then opaque ops inside the compiled
    forward; the plain hooks would be traced once and baked in). nnvllm's runner records each
    decode graph in pieces too, for steps that carry an nnsight trace (:mod:`.worker.pieces`).
    Measured on an H200, see benchmarks/results/capture_gpu_h200.json.
    """
    if not graphs:
        kwargs = dict(kwargs)
        kwargs.pop("enforce_eager", None)
        return {**kwargs, "enforce_eager": True}
    kwargs, cc = _split_compilation(kwargs)
    cc = {"mode": 3 if compile_forward() else 0, "cudagraph_mode": "FULL_DECODE_ONLY", **cc}
    return {**kwargs, "enforce_eager": False, "compilation_config": cc}
