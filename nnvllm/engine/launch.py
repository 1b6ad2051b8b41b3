"""The isolated engine's process group: start ``python -m nnvllm.engine.server``, wait for its port,
report why it died (the first real error in its log), and end the whole group."""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .procs import TOKEN_ENV  # stdlib-only at import


def _tail(path: Path | None, lines: int = 30) -> str:
    if path is None or not path.exists():
        return "(no log)"
    text = path.read_bytes()[-20000:].decode(errors="replace").splitlines()
    return "\n".join("    " + ln for ln in text[-lines:])


_ERROR_LINE = re.compile(r"([A-Za-z_][\w.]*(?:Error|Exception)): (.+)")
_NOT_THE_CAUSE = ("Engine core initialization failed", "See root cause above")


def _cause(path: Path | None) -> str:
    """The first exception a log records that is not vLLM's "see root cause above" (vLLM prints the
    engine core's real error long before its last lines), as one line; "" if none."""
    if path is None or not path.exists():
        return ""
    for ln in path.read_bytes()[-2_000_000:].decode(errors="replace").splitlines():
        m = _ERROR_LINE.search(ln)
        if m and not any(x in ln for x in _NOT_THE_CAUSE):
            return f"{m.group(1)}: {m.group(2).strip()}"
    return ""


def _log_report(path: Path | None) -> str:
    cause = _cause(path)
    first = f"First error in its log: {cause}\n" if cause else ""
    return f"{first}Last lines of its log ({path}):\n{_tail(path)}"


def _describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with code {rc}"


# This process's folders in the temporary directory, named with its pid: an isolated engine's
# (its log, port file and vLLM's sockets) and a URL attach's (the engine's config and tokenizer).
ENGINE_DIR, REMOTE_DIR = "nnvllm-engine-", "nnvllm-remote-"


def sweep_stale_dirs() -> list[str]:
    """Remove the folders of :data:`ENGINE_DIR` and :data:`REMOTE_DIR` whose process is gone (a
    kernel killed before it could remove them; an engine whose client is gone removes its own too)."""
    import shutil

    root, gone = Path(tempfile.gettempdir()), []
    for d in root.glob("nnvllm-*-*-*"):
        name = d.name
        prefix = next((p for p in (ENGINE_DIR, REMOTE_DIR) if name.startswith(p)), None)
        if prefix is None or not d.is_dir():
            continue
        try:
            pid = int(name[len(prefix):].split("-", 1)[0])
            os.kill(pid, 0)
        except ValueError:
            continue  # not named by this scheme
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
            gone.append(str(d))
        except PermissionError:
            pass  # another user's process holds it
    return gone


class _Server:
    """One ``python -m nnvllm.engine.server`` process group started by this process."""

    def __init__(self, checkpoint: str, engine_args: dict) -> None:
        sweep_stale_dirs()
        self.dir = Path(tempfile.mkdtemp(prefix=f"{ENGINE_DIR}{os.getpid()}-"))
        self.log = self.dir / "engine.log"
        self.token = secrets.token_urlsafe(32)
        port_file = self.dir / "port"
        # The folder that holds this nnvllm package goes first: the engine runs the client's code, from a
        # checkout that is not installed too (not the package's own folder, whose modules would then
        # be top-level names there: `sampling`, `testing`, `engine`).
        pkg_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, TOKEN_ENV: self.token,
               "PYTHONPATH": os.pathsep.join(filter(None, [pkg_root, os.environ.get("PYTHONPATH")]))}
        # An in-process engine of this process may have set these for itself (nnvllm.engine sets them
        # in os.environ); the server sets its own for its tensor-parallel size.
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        # vLLM's ZMQ sockets between its processes are files (``VLLM_RPC_BASE_PATH``, the temporary
        # folder by default), which a group ended by SIGKILL (end()) never removes: in this engine's
        # folder they go with it. (A socket's path holds at most 107 bytes: the folder, "/", a uuid.)
        if "VLLM_RPC_BASE_PATH" not in env and len(str(self.dir)) + 37 <= 107:
            env["VLLM_RPC_BASE_PATH"] = str(self.dir)
        tp = int(engine_args.get("tensor_parallel_size", 1))
        if len(env.get("VLLM_CPU_OMP_THREADS_BIND", "").split("|")) != tp:
            env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        cmd = [sys.executable, "-m", "nnvllm.engine.server", checkpoint, "--port", "0",
               "--port-file", str(port_file), "--watch-pid", str(os.getpid()), "--owned-dir", str(self.dir),
               "--engine-args", json.dumps(engine_args)]
        with open(self.log, "wb") as log:
            # A new session: its own process group, ended as a whole (SIGTERM of the server alone
            # leaves vLLM's EngineCore and workers running, holding their memory).
            self.popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                          env=env, start_new_session=True)
        self.pid = self.pgid = self.popen.pid
        self._port_file = port_file
        self.url: str | None = None

    def wait_ready(self, deadline: float, what: str) -> str:
        """Return the URL once ``/health`` answers 200; raise with the log's tail otherwise."""
        import httpx

        while True:
            rc = self.popen.poll()
            if rc is not None:
                raise RuntimeError(
                    f"the engine process for {what} {_describe_exit(rc)} while starting. "
                    + _log_report(self.log)
                ) from None
            if self.url is None and self._port_file.exists():
                self.url = f"http://127.0.0.1:{int(self._port_file.read_text())}"
            if self.url is not None:
                try:
                    if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                        return self.url
                except httpx.TransportError:
                    pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the engine for {what} did not start within start_timeout; it was stopped. Pass a "
                    f"larger start_timeout= if it is only slow. " + _log_report(self.log)
                ) from None
            time.sleep(0.2)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def members(self) -> list:
        """The live processes of this server's group (orphans of a killed server included)."""
        import psutil

        procs = {}
        try:
            root = psutil.Process(self.pid)
            for p in [root, *root.children(recursive=True)]:
                procs[p.pid] = p
        except psutil.NoSuchProcess:
            pass
        for p in psutil.process_iter():
            try:
                if p.pid not in procs and os.getpgid(p.pid) == self.pgid:
                    procs[p.pid] = p
            except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
                pass
        return list(procs.values())

    def end(self) -> None:
        """End the whole process group at once, and the shared memory it holds.

        SIGKILL, not SIGTERM: measured on CPU, vLLM's EngineCore takes ~5 s to answer SIGTERM (its
        process manager then force-kills it anyway), and the memory comes back the same way. What a
        kill could leave is vLLM's shared-memory segments in /dev/shm (hundreds of MB reserved). The
        group's multiprocessing resource tracker removes those once every other process is gone, so
        it is killed last; segments still there after it are unlinked from the processes' maps.
        """
        import psutil

        procs = self.members()
        shm, trackers = set(), []
        for p in procs:
            try:
                shm |= {m.path for m in p.memory_maps() if m.path.startswith("/dev/shm/")}
                if "resource_tracker" in " ".join(p.cmdline()):
                    trackers.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        others = [p for p in procs if p not in trackers]
        for p in others:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(others, timeout=10)
        psutil.wait_procs(trackers, timeout=3)  # it cleans up and exits once its clients are gone
        try:
            os.killpg(self.pgid, signal.SIGKILL)  # whatever is left of the group
        except (ProcessLookupError, PermissionError):
            pass
        for p in trackers:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for path in shm:
            try:
                os.unlink(path)
            except OSError:
                pass

