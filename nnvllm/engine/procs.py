"""Small process and stdio helpers shared by the engine floor (:mod:`nnvllm.engine`), the isolated
client (:mod:`.isolated`) and its server (:mod:`.server`): they sit below all three, so none of those
imports another to reach them. Standard library only at import.
"""

from __future__ import annotations

import contextlib
import sys

__all__ = ["CALL_HEADER", "ENGINE_DIED", "Interrupted", "TOKEN_ENV", "TOKEN_HEADER", "check_sleep", "real_stdout", "tree_rss"]

TOKEN_HEADER = "ndif-api-key"  # what nnsight's serve client sends
TOKEN_ENV = "NNVLLM_TOKEN"  # how nv.load(isolate=True) hands the token over (argv is world-readable)
ENGINE_DIED = "nnvllm: engine died"  # the 503 detail clients turn into nv.EngineDied
CALL_HEADER = "nnvllm-call"  # a call's id, which /v1/nnvllm/abort names (the client's Ctrl-C)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (a notebook's stop button) ended a call, and the engine is ready for the next one.

    A stop the user asked for is not an error to debug: IPython shows an exception that has
    ``_render_traceback_`` as the lines it returns, so a notebook shows this one line instead of a
    traceback through vLLM. It is still a ``KeyboardInterrupt`` to everything that catches one.
    """

    def _render_traceback_(self) -> list[str]:
        return [f"KeyboardInterrupt: {self}"]


@contextlib.contextmanager
def real_stdout():
    """Give vLLM a stdout with a file descriptor while it starts.

    vLLM (0.26, GPU) silences C-level output while it creates its process groups by duplicating
    ``sys.stdout.fileno()``; under Jupyter's ``%%capture`` (or any stream without a descriptor)
    that raises ``UnsupportedOperation: fileno`` and ``nv.load`` failed. For the start only, such a
    stream is swapped for the process's real stdout (what vLLM prints then goes to the kernel's log).
    """
    try:
        sys.stdout.fileno()
        ok = True
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        ok = False
    if ok or sys.__stdout__ is None:
        yield
        return
    kept, sys.stdout = sys.stdout, sys.__stdout__
    try:
        yield
    finally:
        sys.stdout = kept


def check_sleep(platform_ok: bool, enabled: bool) -> None:
    if not platform_ok:
        raise NotImplementedError(
            "vLLM's sleep mode needs a GPU; on CPU vLLM ignores it (its CPUWorker only logs a warning). "
            "To give an engine's memory back here, close it: model.close() (with isolate=True, close() "
            "ends the engine's processes and all of their memory comes back)."
        )
    if not enabled:
        raise ValueError("this engine was loaded without sleep mode; load it with "
                         "nv.load(..., enable_sleep_mode=True) to use sleep()/wake()")


def tree_rss(pid: int) -> int | None:
    """Resident memory (bytes) of process ``pid`` and all its descendants; None if it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return None
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total
