"""Load a model on a vLLM engine through nnsight, on a GPU when CUDA is there and on vLLM's CPU backend otherwise.

``load`` returns nnsight's ``VLLM`` (a subclass of it), so everything nnsight users write works
unchanged::

    model = nv.load()                         # the embedded toy model
    with model.trace("The capital of France is", temperature=0.0):
        h = model.transformer.h[2].output.clone().save()

Two things differ from plain nnsight, both fixes rather than features:
- On CPU the engine uses the worker from :mod:`nnvllm._cpu` (nnsight 0.8.1 has none).
- Parameter-free modules that vLLM shares between blocks (GPT-2's activation) are given one copy
  per block, in the client's tree and in the worker's (:func:`nnvllm.arch.untie_shared_modules`),
  so ``h[i].mlp.act.output`` is block i's value instead of block 0's.
"""

from __future__ import annotations

import gc
import json
import os
import re
from pathlib import Path
from typing import Any

from .arch import Arch, arch_for, untie_shared_modules

__all__ = ["load", "cpu_defaults", "has_cuda"]

# Measured on the 2-core dev machine (see docs/engine.md): in-process engine starts in ~3 s
# against ~17 s with vLLM's engine process; a 256 MiB KV cache holds 1,000s of toy tokens.
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


def _cpu_environment(tp: int) -> None:
    # vLLM reads these when the engine is built, not at import: set them here, never at import.
    if tp == 1:
        # In-process engine: ~3 s start instead of ~17 s, one process, no __main__ guard needed.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    elif "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
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
        return str(p.resolve()), json.loads(cfg.read_text())
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


def _model_classes():
    """Build the nnsight ``VLLM`` subclasses lazily: importing nnvllm must not import vLLM."""
    from nnsight.modeling.vllm import VLLM

    from ._cpu import CPUVLLM

    class _Mixin:
        arch: Arch
        checkpoint: str

        def _load_meta(self, repo_id: str, **kwargs: Any):
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
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:
                pass
            del llm
            VLLM._cleanup_distributed()
            gc.collect()

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.close()

        def __repr__(self) -> str:
            state = "closed" if self.vllm_entrypoint is None else "running"
            return f"<nnvllm model {self.checkpoint!r} ({self.arch.family}, {self.n_layers} layers, {state})>"

    class GPUModel(_Mixin, VLLM):
        _WORKER_CLS = "nnvllm._gpu.NNsightUntiedGPUWorker"

    class CPUModel(_Mixin, CPUVLLM):
        pass

    return GPUModel, CPUModel


def load(model: str | os.PathLike | None = None, **engine_args: Any):
    """Start a vLLM engine on ``model`` and return it as an nnsight ``VLLM`` model.

    Args:
        model: a checkpoint directory, a hub id, or None for the embedded toy model.
        **engine_args: vLLM engine arguments (``tensor_parallel_size``, ``dtype``, ``max_model_len``,
            ...). On CPU, :func:`cpu_defaults` fills the ones not given.

    Returns:
        The model, usable as ``with model.trace(prompt, temperature=0.0): ...``; it also has
        ``.arch`` (module layout), ``.n_layers``, ``.llm`` (the ``vllm.LLM``) and ``.close()``.

    Example:
        >>> model = nv.load()                                   # doctest: +SKIP
        >>> run = nv.generate(model, "The capital of France is", max_tokens=3)   # doctest: +SKIP
    """
    path, cfg = _resolve(model)
    arch = arch_for(cfg.get("architectures"), where=repr(path))
    GPUModel, CPUModel = _model_classes()
    tp = int(engine_args.get("tensor_parallel_size", 1))
    if has_cuda():
        cls = GPUModel
    else:
        cls = CPUModel
        _cpu_environment(tp)
        engine_args = {**cpu_defaults(tp), **engine_args}
    m = cls(path, dispatch=True, **engine_args)
    m.arch = arch
    m.checkpoint = path
    return m
