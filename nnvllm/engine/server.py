"""Serve one nnvllm engine over HTTP: nnsight's serve app, nnvllm's engine, nnvllm's endpoints.

    python -m nnvllm.engine.server MODEL [--port P] [--token T] [--tensor-parallel-size 2] [--dtype float32 ...]

``nv.load(path, isolate=True)`` starts this in its own process (group) and talks to it; anyone may
start it by hand and attach with ``nv.load(url="http://127.0.0.1:P", token=T)``. Why our own entry
rather than ``nnsight-serve``: that one builds plain ``VLLM``, which fails on CPU (no accelerator) and
lacks nnvllm's capture methods in the worker. What this adds to nnsight's ``server.app``:

- the engine is nnvllm's model class (CPU worker, untied shared modules, capture hooks), ``mode="async"``;
- anyio's lazily loaded classes are imported before nnsight (else every request returned 500);
- a constant-time token check on every endpoint except ``/health`` (header ``ndif-api-key``);
- ``POST /v1/nnvllm/generate``, ``/v1/nnvllm/unembed`` and ``/v1/nnvllm/readout`` (what
  :func:`nnvllm.generate`, :func:`nnvllm.analyses.unembedding` and :func:`nnvllm.attribute` need), ``GET /v1/nnvllm/info``, ``GET /v1/nnvllm/files``
  (config + tokenizer, so a remote client can build its meta model), ``POST /v1/nnvllm/sleep|wake``;
- ``/v1/nnsight/generate`` replaced by a copy of nnsight's handler with three fixes: nnsight's
  per-file source caches are cleared per request (an edited file or notebook cell at the same path
  ran its OLD invoke bodies), a name saved in several invokes comes back as a list in invoke order
  (as in-process; the stock server kept only the last invoke's), and a dead engine is a 503; its
  reply is data only, with every saved tensor in one buffer (:func:`nnvllm.engine.wire.pack_tensors`),
  rebuilt on the CPU as the worker sends them (:func:`nnvllm.engine.trace_saves.saves_arrive_on_the_cpu`);
- ``/health`` reports a dead engine core (the stock one says 200 while every trace fails);
- on SIGTERM the engine is shut down (the stock server died leaving EngineCore running), and with
  ``--watch-pid`` the server ends itself and its process group when that process is gone.

Binds 127.0.0.1 unless ``--host`` says otherwise: the server runs code its clients send.
"""

import argparse
import gc
import json
import os
import secrets
import signal
import socket
import sys
import threading
import time

__all__ = ["ENGINE_DIED", "TOKEN_ENV", "TOKEN_HEADER", "main"]

from .procs import ENGINE_DIED, TOKEN_ENV, TOKEN_HEADER  # (stdlib-only at import)


def _watch_parent(pid: int, owned_dir: str | None = None) -> None:
    """End this server (and its process group) once process ``pid`` is gone: a killed kernel.

    What the engine made goes with it, since its client cannot clean up any more: the hand-off files
    of the group's processes in shared memory (at once, after the engine's shutdown, and before the
    last kill) and ``owned_dir``, the client's folder for this engine (its log, port file and vLLM's sockets).
    """
    import psutil

    ppid = os.getppid()

    def gone() -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE or os.getppid() != ppid
        except psutil.NoSuchProcess:
            return True

    def loop():
        while not gone():
            time.sleep(0.5)
        _remove_what_the_engine_made(owned_dir)
        os.kill(os.getpid(), signal.SIGTERM)  # graceful: the engine shuts down in the lifespan
        time.sleep(10.0)
        _remove_what_the_engine_made(owned_dir)
        if os.getpgrp() == os.getpid():  # our own group (start_new_session): end all of it
            os.killpg(os.getpgrp(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=loop, name="nnvllm-watch-parent", daemon=True).start()


def _remove_what_the_engine_made(owned_dir: str | None) -> None:
    """The group's hand-off files in shared memory and ``owned_dir``; never raises."""
    import shutil

    try:
        from .worker.leftovers import sweep_group

        sweep_group()
    except Exception:  # noqa: BLE001, S110  ending anyway: remove what can be removed
        pass
    if owned_dir:
        shutil.rmtree(owned_dir, ignore_errors=True)


def _parse(argv: list[str] | None = None) -> tuple[argparse.Namespace, dict]:
    from nnsight.modeling.vllm.serve.cli import _parse_vllm_args

    p = argparse.ArgumentParser(
        prog="python -m nnvllm.engine.server",
        description="Serve one nnvllm engine (nnsight VLLM, async) over HTTP. Unrecognised --flag value "
        "pairs are vLLM engine arguments, e.g. --tensor-parallel-size 2 --dtype float32.",
    )
    p.add_argument("model", help="checkpoint directory or hub id")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=0, help="port; 0 picks a free one (default)")
    p.add_argument("--token", default=None,
                   help=f"required token (header {TOKEN_HEADER}); else ${TOKEN_ENV}; "
                   "else a random one, printed")
    p.add_argument("--port-file", default=None, help="write the bound port here once serving")
    p.add_argument("--watch-pid", type=int, default=None, help="shut down when this process is gone")
    p.add_argument("--owned-dir", default=None,
                   help="with --watch-pid: a folder of the watched process's for this engine, removed when it is gone")
    p.add_argument("--engine-args", default=None, help="engine arguments as a JSON object")
    args, rest = p.parse_known_args(argv)
    short = [a for a in rest if a.startswith("-") and not a.startswith("--")]
    if short:
        p.error(f"unrecognised {short}: spell engine arguments out (--tensor-parallel-size 2, not -tp 2)")
    engine_args = _parse_vllm_args(rest)
    if args.engine_args:
        engine_args.update(json.loads(args.engine_args))
    return args, engine_args


def _preload_anyio() -> None:
    """Import anyio's lazily loaded classes before nnsight is imported.

    nnsight adds ``.save`` to every object; anyio classes first loaded after that fail anyio's own
    type-annotation check ("Attribute 'save' is missing its type annotation") and every request
    returns 500. So they are loaded first, before anything here imports nnsight.
    """
    if "nnsight" in sys.modules:
        raise RuntimeError(
            "nnvllm.engine.server must import anyio before nnsight; run it as python -m nnvllm.engine.server")
    import anyio._backends._asyncio  # noqa: F401
    import anyio.abc._sockets  # noqa: F401
    import anyio.streams.file  # noqa: F401
    import anyio.streams.tls  # noqa: F401


def main(argv: list[str] | None = None) -> None:
    # vLLM's own log format in this process's log file (a notebook client turns vLLM's configuring off).
    os.environ["VLLM_CONFIGURE_LOGGING"] = "1"
    _preload_anyio()
    from .logs import dump_stacks_if_asked

    dump_stacks_if_asked()
    args, engine_args = _parse(argv)
    token = args.token or os.environ.pop(TOKEN_ENV, None)
    if not token:
        token = secrets.token_urlsafe(32)
        print(f"nnvllm.engine.server: token (header {TOKEN_HEADER}): {token}", flush=True)
    if args.watch_pid:
        _watch_parent(args.watch_pid, args.owned_dir)
    # vLLM's EngineCore and workers inherit this and end their process group once this server is
    # gone (killed with SIGKILL, e.g. by the OOM killer): see nnvllm.engine.worker.handoff.watch_server.
    os.environ["NNVLLM_SERVER_PID"] = str(os.getpid())
    # vLLM's single-process executor starts torch.distributed at tcp://<this host's IP>: on the H200
    # the engine then listened on a non-loopback address. The server is loopback-only; so is its engine.
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")

    from . import _build_engine
    from .routes import _install

    model = _build_engine(args.model, mode="async", **engine_args)

    import uvicorn
    from nnsight.modeling.vllm.serve.server import app, set_model

    set_model(model)
    _install(app, token, model, model.checkpoint)
    from .trace_saves import saves_arrive_on_the_cpu

    saves_arrive_on_the_cpu()  # (its replies carry them on the CPU: no round trip through the GPU)
    # What is alive now lasts as long as this server. One pass frees the start's garbage (automatic
    # collection was off during the start: heap._start_collections) and the rest is frozen, so the
    # full collections of later calls walk only what calls make. Otherwise the first call's full
    # collection walks the whole heap of the imports and the engine.
    gc.collect()
    gc.freeze()

    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.listen(128)
    port = sock.getsockname()[1]
    if args.host not in ("127.0.0.1", "::1", "localhost"):
        print(f"nnvllm.engine.server: WARNING: bound to {args.host}: reachable from the network; it runs "
              "client-sent code, guarded only by the token.", flush=True)
    print(f"nnvllm.engine.server: serving {model.checkpoint} on http://{args.host}:{port}", flush=True)
    if args.port_file:  # written atomically, after the bind: the client reads a complete port
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(port))
        os.replace(tmp, args.port_file)
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])


if __name__ == "__main__":
    sys.exit(main())
