"""What an engine says, kept out of the user's page: vLLM's log records and warnings go to the engine
log (``model.log()``), and a load prints one line.

vLLM logs through its own ``vllm`` logger, whose handler writes to the ``sys.stdout`` of the moment
vLLM was imported, so Jupyter's ``%%capture`` does not hold it back; an engine start printed about ten
WARNING lines, most of them about vLLM's own environment (``LD_PRELOAD``, a global seed, chunked
prefill that nnvllm turns off on purpose). Here that handler is replaced by one that appends to the
process's engine log; errors still reach the user's stderr, in one line each. ``NNVLLM_VERBOSE=1``
leaves vLLM's logging as vLLM sets it.

Importing this module imports neither vLLM nor torch.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sys
import warnings

__all__ = ["ENGINE_LOG", "LogText", "verbose", "route_vllm_logs", "captured_warnings", "keep_excepthook"]

_MAX_LINES = 5000


class _EngineLog(logging.Handler):
    """The process's engine log: the last lines vLLM logged and the warnings raised while engines ran."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: collections.deque[str] = collections.deque(maxlen=_MAX_LINES)
        self.setFormatter(logging.Formatter("%(levelname)s %(asctime)s [%(name)s] %(message)s", "%H:%M:%S"))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(self.format(record))
        except Exception:  # noqa: BLE001 - a log line must never break a generation
            return
        if record.levelno >= logging.ERROR:
            # Errors matter to the user: one line on their stderr, the rest in the log.
            first = record.getMessage().strip().splitlines()[:1]
            pkg = record.name.split(".")[0]
            print(f"nnvllm: {'vLLM' if pkg == 'vllm' else pkg} error: {first[0] if first else record.levelname} (model.log() has the rest)",
                  file=sys.stderr)

    def add(self, text: str) -> None:
        for line in text.splitlines():
            if line.strip():
                self.lines.append(line)

    def text(self, last: int | None = None) -> str:
        lines = list(self.lines)
        return "\n".join(lines if last is None else lines[-last:])


ENGINE_LOG = _EngineLog()


class LogText(str):
    """A log's text that a notebook shows as lines (its repr is the text itself)."""

    def __repr__(self) -> str:
        return str(self)


def verbose() -> bool:
    """``NNVLLM_VERBOSE=1``: vLLM's own logging and warnings, as vLLM prints them."""
    return os.environ.get("NNVLLM_VERBOSE", "").strip().lower() not in ("", "0", "false")


_SAVED: list[logging.Handler] = []  # vLLM's own handlers, put back under NNVLLM_VERBOSE=1
_SET_ENV: list[str] = []  # the environment variables set here (and so unset again when verbose)


def route_vllm_logs() -> None:
    """Send vLLM's log records to :data:`ENGINE_LOG` instead of the notebook (idempotent); under
    ``NNVLLM_VERBOSE=1``, give vLLM its own logging back.

    vLLM configures its logger again whenever an engine starts (a ``dictConfig`` that would put its
    own handler back), so its configuring is turned off (``VLLM_CONFIGURE_LOGGING=0``, unless the
    user set it) and the handler installed here stays. An isolated engine's server configures vLLM's
    logging as usual: its output goes to its own log file.
    """
    if verbose():
        _unroute()
        return
    for name, value in (("VLLM_LOGGING_LEVEL", "WARNING"), ("VLLM_CONFIGURE_LOGGING", "0")):
        if name not in os.environ:
            os.environ[name] = value
            _SET_ENV.append(name)
    import vllm.logger  # noqa: F401 - configured already if vLLM was imported before: replaced below

    logger = logging.getLogger("vllm")
    if ENGINE_LOG in logger.handlers:
        return
    for h in list(logger.handlers):
        logger.removeHandler(h)
        _SAVED.append(h)
    logger.addHandler(ENGINE_LOG)
    logger.propagate = False
    if os.environ["VLLM_LOGGING_LEVEL"].upper() == "WARNING":
        logger.setLevel(logging.WARNING)


def _unroute() -> None:
    """Undo :func:`route_vllm_logs`: vLLM's handlers and environment as vLLM would have them."""
    while _SET_ENV:
        os.environ.pop(_SET_ENV.pop(), None)
    logger = logging.getLogger("vllm")
    if ENGINE_LOG not in logger.handlers:
        return
    logger.removeHandler(ENGINE_LOG)
    if not _SAVED:  # vLLM was first imported with its configuring off: a handler as vLLM's default
        h = logging.StreamHandler(sys.stdout)
        h.setFormatter(logging.Formatter(
            "(%(processName)s pid=%(process)d) %(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s",
            "%m-%d %H:%M:%S"))
        _SAVED.append(h)
    while _SAVED:
        logger.addHandler(_SAVED.pop(0))


# Warnings that vLLM, torch and transformers raise while an engine starts or runs are about their
# own internals (deprecations, NUMA binding, ...); they go to the engine log. Anything else, and
# every warning raised by the user's own code, is left alone.
_ENGINE_MODULES = ("vllm", "torch", "transformers", "nnsight", "triton", "pydantic", "huggingface_hub")


@contextlib.contextmanager
def captured_warnings():
    """Within the block, warnings raised from the engine's libraries, and torch's log records, go to
    :data:`ENGINE_LOG`.

    torch reports its own deprecations through its loggers, whose handlers write to stderr:
    vLLM 0.33 registers an opaque type when it is imported, and torch 2.14 answers with three
    ``W... torch/_opaque_base.py`` lines.
    """
    if verbose():
        yield
        return
    with _torch_logs_to_engine_log(), _warnings_to_engine_log():
        yield


@contextlib.contextmanager
def _torch_logs_to_engine_log():
    # The ``torch`` logger, and each of torch's loggers with handlers of its own (torch._logging
    # gives ``torch._dynamo``, ``torch._inductor``, ... their own, and stops their propagation).
    loggers = [logging.getLogger("torch")] + [
        lg for name, lg in list(logging.Logger.manager.loggerDict.items())
        if name.startswith("torch.") and isinstance(lg, logging.Logger) and lg.handlers]
    saved = [(lg, lg.handlers[:], lg.propagate) for lg in loggers]
    for lg in loggers:
        lg.handlers[:] = [ENGINE_LOG]
        lg.propagate = False
    try:
        yield
    finally:
        for lg, handlers, propagate in saved:
            if lg.handlers == [ENGINE_LOG]:  # (unless something configured torch's logging meanwhile)
                lg.handlers[:] = handlers
                lg.propagate = propagate


@contextlib.contextmanager
def _warnings_to_engine_log():
    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        parts = os.path.normpath(str(filename)).split(os.sep)
        if "site-packages" in parts and any(m in parts for m in _ENGINE_MODULES):
            ENGINE_LOG.add(f"WARNING [{category.__name__}] {filename}:{lineno}: {message}")
            return
        shown(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    try:
        yield
    finally:
        if warnings.showwarning is showwarning:
            warnings.showwarning = shown


@contextlib.contextmanager
def keep_excepthook():
    """Keep ``sys.excepthook`` as it was: ``torch.distributed.init_process_group`` wraps it to prefix
    ``[rank0]:`` to every line of every later traceback of the process, the user's own included."""
    hook = sys.excepthook
    try:
        yield
    finally:
        sys.excepthook = hook


# ---------------------------------------------------------------- stacks of a stuck engine

STACKS_ENV = "NNVLLM_STACKS"
_STACKS_STARTED: dict[int, str] = {}  # pid -> its file (a forked child starts its own thread)


def dump_stacks_if_asked() -> str | None:
    """Under ``NNVLLM_STACKS=SECONDS``: every SECONDS, write every thread's Python stack of this process
    to ``<tmp>/nnvllm-stacks-<pid>.txt`` (rewritten each time: the latest stacks). Called in each engine
    process (an isolated engine's server, each worker), so a hang shows where each process waits.
    A daemon thread reads the stacks under the GIL (``sys._current_frames``); faulthandler's timer
    is not used, because it reads other threads' frames without the GIL and can crash a process
    whose threads come and go. Returns the file's path, or None when not asked."""
    v = os.environ.get(STACKS_ENV, "").strip()
    if not v:
        return None
    try:
        every = float(v)
    except ValueError:
        raise ValueError(f"{STACKS_ENV}={v!r}: expected a number of seconds (e.g. 60)") from None
    if every <= 0:
        raise ValueError(f"{STACKS_ENV}={v!r}: expected a number of seconds above 0 (e.g. 60)")
    if os.getpid() in _STACKS_STARTED:
        return _STACKS_STARTED[os.getpid()]
    import tempfile
    import threading
    import time
    import traceback

    path = os.path.join(tempfile.gettempdir(), f"nnvllm-stacks-{os.getpid()}.txt")
    _STACKS_STARTED[os.getpid()] = path

    def write() -> None:
        while True:  # (a daemon: it ends with the process)
            time.sleep(every)
            names = {t.ident: t.name for t in threading.enumerate()}
            lines = [f"# pid {os.getpid()}, {time.strftime('%H:%M:%S')}: every thread's stack, most recent call last\n"]
            for ident, frame in sys._current_frames().items():
                lines.append(f"\n## thread {names.get(ident, '?')} ({ident})\n")
                lines.extend(traceback.format_stack(frame))
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                f.writelines(lines)
            os.replace(tmp, path)

    threading.Thread(target=write, name="nnvllm-stacks", daemon=True).start()
    return path
