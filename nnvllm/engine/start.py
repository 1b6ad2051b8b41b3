"""Starting an engine in this process: the model class, its arguments, and the start-up log kept
out of the user's page (garbage collection around the start: :mod:`.heap`)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from ..arch import arch_for
from . import compat as _compat
from .heap import _start_collections
from .models import _cpu_environment, _resolve, cpu_defaults, has_cuda, model_classes
from .procs import real_stdout

def _build_engine(model: str | os.PathLike | None, *, mode: str = "sync", **engine_args: Any):
    """Build and dispatch nnvllm's model class in this process (``mode="async"``: the server's AsyncLLM)."""
    with _start_collections(mode):
        return _start(model, mode=mode, **engine_args)


def _start(model: str | os.PathLike | None, *, mode: str, **engine_args: Any):
    from . import _other_in_process_engines

    _compat.check_versions()
    open_ = _other_in_process_engines(None)
    if open_ and mode == "sync":
        # vLLM keeps its distributed state (process groups) per process: closing either of two
        # in-process engines tears that state down under the other (load() closes the old one first).
        raise RuntimeError(
            f"this process already runs an in-process engine ({open_[0].checkpoint!r}); vLLM's state is "
            "per process, so a second one here would break when either is closed. Close it first "
            "(model.close(), or nv.engines()[i].close()), or load this one in its own process with "
            "nv.load(..., isolate=True).")
    path, cfg = _resolve(model)
    arch = arch_for(cfg.get("architectures"), where=repr(path))
    GPUModel, CPUModel = model_classes()
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
    if quiet:
        from .logs import ENGINE_LOG

        ENGINE_LOG.add(log.text)
    return m


class _Log:
    text = ""


@contextlib.contextmanager
def _c_stderr_to_log(on: bool):
    """While an in-process CPU engine starts, send what C/C++ code writes to file descriptor 2 to a log.

    torch's "NUMA binding: Using MEMBIND policy ..." warning is written there by C++ and so escapes
    Jupyter's ``%%capture`` in every load cell. Only for the in-process CPU engine
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


