"""What an engine leaves in shared memory when its processes end, and who removes it.

The hand-off files (:mod:`.handoff`) are named ``nnvllm-cap-<pid of the process that made them>-…``
in ``/dev/shm``. A process that exits normally removes its own (``_Spares.drop`` at exit); one that
is killed cannot, so: each engine sweeps the files of gone processes when it loads
(:func:`sweep_stale`); an isolated engine's processes end with their server (:func:`watch_server`)
and remove their group's files first (:func:`sweep_group`), as the server does when its client is
gone (``nnvllm.engine.server``). Standard library only.
"""

from __future__ import annotations

import os
import tempfile

__all__ = ["SHM_PREFIX", "shm_dir", "sweep_group", "sweep_stale", "watch_server"]

SHM_PREFIX = "nnvllm-cap-"


def shm_dir() -> str:
    d = "/dev/shm"
    return d if os.path.isdir(d) and os.access(d, os.W_OK) else tempfile.gettempdir()


def watch_server() -> None:
    """In an isolated engine's processes: end the process group when its server is gone.

    The server (``nnvllm.engine.server``) is the parent of vLLM's EngineCore; killed with SIGKILL it cannot
    stop them, and they kept their memory (GPU memory on a GPU) until the client's next call. This
    thread, started where the model loads (EngineCore, or each worker under TP), checks every half
    second and ends the group (the server's session, which holds nothing else).
    """
    import threading
    import time

    pid = int(os.environ.get("NNVLLM_SERVER_PID") or 0)
    if not pid or pid == os.getpid() or os.getpgrp() != pid:
        return  # not inside an isolated engine's own process group

    def alive() -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:  # a killed server stays a zombie until the client reaps it
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    def loop() -> None:
        while alive():
            time.sleep(0.5)
        sweep_group()  # the group's hand-off files go with it (a SIGKILL runs no atexit)
        os.killpg(os.getpgrp(), 9)

    threading.Thread(target=loop, name="nnvllm-watch-server", daemon=True).start()


def sweep_stale() -> list[str]:
    """Remove hand-off files whose engine process is gone (a client killed before it mapped them)."""
    d, gone = shm_dir(), []
    for name in os.listdir(d):
        if not name.startswith(SHM_PREFIX):
            continue
        try:
            pid = int(name[len(SHM_PREFIX):].split("-", 1)[0])
            os.kill(pid, 0)
        except (ValueError, ProcessLookupError):
            try:
                os.unlink(os.path.join(d, name))
                gone.append(name)
            except OSError:
                pass
        except PermissionError:
            pass
    return gone


def sweep_group() -> list[str]:
    """Remove the hand-off files that processes of this process group made (alive or not), and those
    of gone processes: what an isolated engine leaves in shared memory when it ends because its
    client or its server was killed. The spares and recycled files a worker keeps between calls
    are removed at its exit, which a SIGKILL skips; unlinking a file a process still maps is safe
    (its memory goes when the mapping does)."""
    d, gone, group = shm_dir(), [], os.getpgrp()
    for name in os.listdir(d):
        if not name.startswith(SHM_PREFIX):
            continue
        try:
            pid = int(name[len(SHM_PREFIX):].split("-", 1)[0])
            ours = os.getpgid(pid) == group
        except ValueError:
            continue
        except ProcessLookupError:
            ours = True  # its process is gone: stale, whoever made it
        except PermissionError:
            ours = False
        if ours:
            try:
                os.unlink(os.path.join(d, name))
                gone.append(name)
            except OSError:
                pass
    return gone
