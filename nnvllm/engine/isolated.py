"""Isolated engines: the vLLM engine in its own process group, this process holding a meta model.

vLLM keeps its memory (GPU memory above all) until the process that holds it ends: an engine run
with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps it after ``close()``, and vLLM's EngineCore outlives a
kernel that dies without closing (43 GB of an H200 stayed held, docs/engines.md).
``nv.load(path, isolate=True)`` therefore starts
``python -m nnvllm.engine.server`` (:mod:`nnvllm.engine.server`) in a new session (its own process group), on
127.0.0.1, a free port and a random token, and returns a model that

- holds only nnsight's meta-device module tree (never dispatched; its torch TCPStore closed right
  after the build), so ``with model.trace(...)`` is written exactly as in-process and runs on the
  engine through nnsight's serve protocol, over ONE kept-alive HTTP client for the session;
- reaches nnvllm's capture and unembedding through :class:`RemoteEngine` (the same three calls as
  :class:`nnvllm.engine.transport.InProcessEngine`), so :func:`nnvllm.generate`, :func:`nnvllm.logit_lens`
  and :func:`nnvllm.patch` work unchanged;
- ends the whole process group on ``close()``, ``with``-exit, interpreter exit (``atexit``) and, via
  the server's parent watch, when this process is killed (a kernel shut down or restarted);
- raises :class:`EngineDied` when the engine is gone, and comes back with ``model.restart()``.

``nv.load(url=..., token=...)`` attaches the same kind of model to a server someone started by hand.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import threading
import time
import uuid
import warnings
import weakref
from pathlib import Path
from typing import Any

__all__ = ["EngineDied", "RemoteEngine", "start", "attach", "tree_rss"]

from .launch import _cause, _describe_exit, _log_report, _Server, _tail  # noqa: F401 (tests import them from here)
from .procs import CALL_HEADER, ENGINE_DIED, TOKEN_HEADER, Interrupted, real_stdout, tree_rss  # stdlib-only at import

_CONNECT_TIMEOUT = 10.0


class EngineDied(RuntimeError):
    """The engine behind an isolated model is gone (killed, crashed, out of memory).

    The message says why and what to do: ``model.restart()`` starts a new engine with the same
    arguments in a fresh process, with no kernel restart.
    """


# ---------------------------------------------------------------- the HTTP connection


class _Connection:
    """One kept-alive ``httpx.Client`` per engine, carrying the token; errors become clear ones."""

    def __init__(self, model, url: str, token: str) -> None:
        self._model = weakref.ref(model)
        self.url = url.rstrip("/")
        self.token = token
        self.client = self._client()

    def _client(self):
        import httpx
        from nnsight.modeling.vllm.serve import http

        return httpx.Client(base_url=self.url, headers={TOKEN_HEADER: self.token},
                            timeout=httpx.Timeout(_CONNECT_TIMEOUT, read=http.READ_TIMEOUT))

    def close(self) -> None:
        self.client.close()

    def request(self, method: str, path: str, **kw: Any):
        import httpx

        model = self._model()
        if model is None:
            raise RuntimeError("this engine's model object is gone")
        call = uuid.uuid4().hex  # what /v1/nnvllm/abort names if Ctrl-C ends this call
        kw["headers"] = {**(kw.get("headers") or {}), CALL_HEADER: call}
        try:
            try:
                r = self.client.request(method, path, **kw)
            except (httpx.RemoteProtocolError, httpx.ConnectError, httpx.ReadError):
                # A kept-alive connection the server closed (it does after an error reply) reads as
                # "Server disconnected" on the next call: that is not a death while the server is
                # up. One fresh connection, one retry; a second failure is judged below.
                if not model._engine_alive():
                    raise
                self.client.close()
                self.client = self._client()
                r = self.client.request(method, path, **kw)
        except httpx.TimeoutException:
            if model is not None and model._engine_alive():
                raise TimeoutError(
                    f"the engine at {self.url} did not answer {path} in time; it may be wedged. "
                    "model.restart() starts a fresh one."
                ) from None
            model._engine_died(f"it stopped answering ({path} timed out)")
        except httpx.TransportError as e:
            # ConnectError (nothing listens), ReadError / RemoteProtocolError (it died mid-request).
            model._engine_died(f"its server stopped answering ({type(e).__name__}: {e})")
        except KeyboardInterrupt:
            # Ctrl-C mid-request: the server cuts the call's requests (routes: a capture or trace
            # whose client gave up), as an in-process engine aborts them; a fresh client so no
            # half-read connection is reused. One line in a notebook (Interrupted), not the
            # traceback through httpx.
            self.client.close()
            self.client = self._client()
            with contextlib.suppress(Exception):
                self.client.post("/v1/nnvllm/abort", json={"call": call}, timeout=5.0)
            what = {"/v1/nnvllm/generate": "the call", "/v1/nnsight/generate": "the trace"}.get(path, path)
            raise Interrupted(f"{what} was interrupted; its requests were aborted and the engine is ready") from None
        except BaseException:
            self.client.close()
            self.client = self._client()
            raise
        if r.status_code == 200:
            return r
        # After an error reply the server may close this connection: never reuse it.
        self.client.close()
        self.client = self._client()
        try:
            detail = r.json().get("detail", r.reason_phrase)
        except Exception:  # noqa: BLE001  a non-JSON error body
            detail = r.reason_phrase
        if r.status_code == 503 and detail == ENGINE_DIED:
            model._engine_died("its engine core stopped (vLLM EngineDeadError); the HTTP server was still up")
        if r.status_code == 401:
            raise PermissionError(f"the engine at {self.url} refused the token: {detail}. Pass the token "
                                  "the server was started with (nv.load(url=..., token=...)).") from None
        raise ConnectionError(
            f"the engine at {self.url} answered {method} {path} with {r.status_code}: {detail}")


def _serve_backend_class():
    """nnsight's serve backend, sending over the model's kept-alive connection (not a client per trace)."""
    from nnsight.intervention.errors import raise_deferred
    from nnsight.modeling.vllm.serve import http
    from nnsight.modeling.vllm.serve.backend import LocalServeBackend

    from .wire import UnsafeReply, load_data, unpack_tensors

    class KeptAliveServeBackend(LocalServeBackend):
        def _send(self, blob: bytes) -> dict:
            conn = self.model._connection()
            r = conn.request("POST", "/v1/nnsight/generate", content=blob, headers=http.headers(None))
            # Data only (nnvllm.engine.wire): a reply that would run code is refused, never unpickled.
            what = f"the reply of the engine at {conn.url} to a trace"
            result = load_data(r.content, what)
            if not isinstance(result, dict) or not isinstance(result.get("saves", {}), dict):
                raise UnsafeReply(f"{what} is not a trace's reply (a dict with 'saves' and 'error'); it was refused")
            raise_deferred(result.get("error"))
            if isinstance(result.get("notice"), str):  # traced steps that ran eagerly on a graph engine
                warnings.warn(result["notice"], stacklevel=5)
            if "packed_saves" in result:  # (nnvllm's server: the tensors in one buffer, wire.pack_tensors)
                saves = unpack_tensors(result["packed_saves"], what)
                if not isinstance(saves, dict):
                    raise UnsafeReply(f"{what} is not a trace's reply (its saves are not a dict); it was refused")
                return saves
            return result.get("saves", {})

    return KeptAliveServeBackend


class RemoteEngine:
    """An isolated model's engine adapter: :class:`nnvllm.engine.transport.InProcessEngine`'s calls, over HTTP."""

    def __init__(self, model) -> None:
        self.model = model
        self.conn = model._connection()  # raises if closed or dead

    def capture(self, prompts: list[str], params: dict, spec: dict) -> tuple[list[dict], dict | None]:
        from .transport import CLIENT_TIMINGS, _take_returned, pack, unpack

        t0 = time.perf_counter()
        body, kind = pack({"prompts": prompts, "params": params, "spec": _take_returned(spec, self.model)})
        r = self.conn.request("POST", "/v1/nnvllm/generate", content=body, headers={"Content-Type": kind})
        CLIENT_TIMINGS.update(http=time.perf_counter() - t0)
        # Plain data only (ids, text, file names of the shared-memory hand-off), as JSON: never unpickled.
        res = unpack(r.content, r.headers.get("content-type"))
        # The server's share of ``http`` (lock wait, arm, adding the requests, generating, collecting;
        # ``total`` from the body's arrival to the reply built): the rest is the transport.
        CLIENT_TIMINGS.update({f"server_{k}": float(v) for k, v in (res.get("timings") or {}).items()})
        if r.headers.get("nnvllm-server-seconds"):
            CLIENT_TIMINGS["server_total"] = float(r.headers["nnvllm-server-seconds"])
        if res.get("error"):
            kind, msg = res["error"]
            exc = {"ValueError": ValueError, "TypeError": TypeError}.get(kind, RuntimeError)
            raise exc(f"the engine refused the request: {kind}: {msg}") from None
        return res["outputs"], res["handoff"]

    def stream(self, prompts: list[str], params, spec: dict, stop: threading.Event):
        """:meth:`nnvllm.engine.transport.InProcessEngine.stream` over HTTP: the server streams frames
        (``/v1/nnvllm/stream``); ``stop`` set sends ``/v1/nnvllm/stream/stop`` once."""
        import struct
        import uuid

        import httpx
        import torch

        from .transport import _take_returned
        from .wire import load_data

        spec = _take_returned(spec, self.model)
        sid = uuid.uuid4().hex
        buf = io.BytesIO()
        asked = stop.is_set()  # stopped before it began: the stop travels with the request
        torch.save({"prompts": prompts, "params": params, "spec": spec, "stream_id": sid, "stop": asked}, buf)
        conn, model = self.conn, self.model
        ended = False
        try:
            with conn.client.stream("POST", "/v1/nnvllm/stream", content=buf.getvalue(),
                                    headers={"Content-Type": "application/octet-stream"}) as r:
                if r.status_code != 200:
                    r.read()
                    conn.request("GET", "/v1/nnvllm/info")  # a dead engine or a bad token raises its clear error
                    raise ConnectionError(f"the engine at {conn.url} answered the stream with {r.status_code}")
                pending = b""
                for chunk in r.iter_bytes():
                    pending += chunk
                    while len(pending) >= 8:
                        n = struct.unpack("<Q", pending[:8])[0]
                        if len(pending) < 8 + n:
                            break
                        # Plain data and tensors only: never unpickle code (nnvllm.engine.wire).
                        msg = load_data(pending[8: 8 + n], f"a frame of the stream from {conn.url}")
                        pending = pending[8 + n:]
                        if msg.get("error"):
                            kind, text = msg["error"]
                            if text == ENGINE_DIED:
                                model._engine_died("its engine core stopped during a stream")
                            raise RuntimeError(f"the engine failed during the stream: {kind}: {text}")
                        if "handoff" in msg:
                            ended = True
                            yield "done", msg["outputs"], msg["handoff"]
                            return
                        yield "step", msg["outputs"], msg["peek"]
                        if stop.is_set() and not asked:
                            asked = True
                            conn.request("POST", "/v1/nnvllm/stream/stop", json={"stream_id": sid})
        except httpx.TransportError as e:
            if not model._engine_alive():
                model._engine_died(f"its server stopped answering during a stream ({type(e).__name__})")
            raise ConnectionError(f"the stream from {conn.url} broke off: {type(e).__name__}: {e}") from None
        except KeyboardInterrupt:  # (the finally cuts the generation)
            raise Interrupted("the stream was interrupted; its requests were aborted and the engine is ready") from None
        finally:
            if not ended and model._dead is None:  # left early (break, an error): the server cuts the generation
                with contextlib.suppress(Exception):
                    conn.request("POST", "/v1/nnvllm/stream/stop", json={"stream_id": sid, "abort": True})
        raise ConnectionError(f"the stream from {conn.url} ended without its result")

    def unembed(self, final_norm: str, unembed: str) -> list[dict]:
        from .wire import load_data

        body = {"final_norm": final_norm, "unembed": unembed}
        r = self.conn.request("POST", "/v1/nnvllm/unembed", json=body)
        # Tensors, floats and strings only: loaded without unpickling code (nnvllm.engine.wire).
        return load_data(r.content, f"the unembedding from {self.conn.url}")["parts"]

    def readout(self, target: int, versus: int | None, ids: list[int], positions: list[int]) -> list[dict]:
        from .wire import load_data

        r = self.conn.request("POST", "/v1/nnvllm/readout",
                              json={"target": target, "versus": versus, "ids": ids, "positions": positions})
        return load_data(r.content, f"the attribution readout from {self.conn.url}")["parts"]

    def info(self) -> dict:
        return self.model._info

    def sleep_support(self) -> tuple[bool, bool]:
        return self.model._info.get("sleep_platform", False), self.model._info.get("sleep_mode", False)

    def sleep(self, level: int) -> None:
        self.conn.request("POST", "/v1/nnvllm/sleep", json={"level": int(level)})

    def wake(self) -> None:
        self.conn.request("POST", "/v1/nnvllm/wake")


# ---------------------------------------------------------------- the model


_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> isolated model we started
_atexit_lock = threading.Lock()
_atexit_done = False


def _close_all() -> None:
    for model in list(_LIVE.values()):
        try:
            model._stop()
            model._forget_remote_dir()
        except Exception:  # noqa: BLE001, S110  at exit: end what can be ended, never raise
            pass


def _register_atexit() -> None:
    global _atexit_done
    with _atexit_lock:
        if not _atexit_done:
            atexit.register(_close_all)
            _atexit_done = True


_LOCAL_ONLY = ("_conn", "_server", "_relaunch", "_info", "_attach_url", "_attach_token", "_dead", "_closed",
               "_nnvllm_unembed", "_remote_dir")


class IsolatedMixin:
    """What an isolated (or attached) model adds to nnvllm's model class; comes first in the MRO."""

    _nnvllm_isolated = True

    # -- set by start()/attach()
    checkpoint: str
    _conn: _Connection | None
    _server: _Server | None
    _info: dict
    _relaunch: dict | None  # how to start it again (None: attached to someone else's server)
    _dead: str | None
    _closed: bool

    def _engine_adapter(self) -> RemoteEngine:
        return RemoteEngine(self)

    def __getstate__(self) -> dict:
        # A trace ships the model object to the server (nnsight pickles its __dict__): never the
        # connection, process handle, token or cached unembedding; the server has its own.
        state = super().__getstate__()
        for k in _LOCAL_ONLY:
            state.pop(k, None)
        return state

    # -- state
    def _connection(self) -> _Connection:
        if self._closed:
            raise RuntimeError(
                "this model was closed; load it again with nv.load(...) or call model.restart()")
        if self._dead is not None:
            raise EngineDied(self._dead)
        return self._conn

    def _engine_alive(self) -> bool:
        if self._server is not None:
            return self._server.alive()
        import httpx

        try:
            return httpx.get(self._conn.url + "/health", timeout=5.0).status_code == 200
        except httpx.TransportError:
            return False

    def _engine_died(self, why: str):
        """Record the death, free what is left of the process group, raise :class:`EngineDied`."""
        server = self._server
        if server is not None:
            try:
                server.popen.wait(timeout=2.0)  # a server killed mid-request: let its exit show
            except subprocess.TimeoutExpired:
                pass
            rc = server.popen.poll()
            if rc is not None:
                why = f"the engine process (pid {server.pid}) {_describe_exit(rc)}"
            server.end()
            self._dead = (
                f"the isolated engine for {self.checkpoint!r} died: {why}. What was left of its process "
                "group was ended and its memory freed. Call model.restart() to start a new engine with the "
                "same arguments (no kernel restart needed). " + _log_report(server.log)
            )
        else:
            self._dead = (
                f"the engine at {self._conn.url} died or is unreachable: {why}. Start it again there "
                "(python -m nnvllm.engine.server ...) and call model.restart() to re-attach."
            )
        _LIVE.pop(id(self), None)
        raise EngineDied(self._dead) from None

    # -- nnsight entry points, pointed at the engine
    def trace(self, *inputs: Any, **kwargs: Any):
        if kwargs.get("serve") is None and kwargs.get("backend") is None and not kwargs.get("remote"):
            self._connection()  # closed / dead: say so before the block runs
            kwargs["backend"] = _serve_backend_class()(self, self._conn.url)
        return super().trace(*inputs, **kwargs)

    def edit(self, *, serve: str | None = None, api_key: str | None = None, **kwargs: Any):
        conn = self._connection()
        return super().edit(serve=serve or conn.url, api_key=api_key or conn.token, **kwargs)

    def dispatch(self) -> None:
        raise RuntimeError(
            "this model's engine runs in another process (isolated); the local copy holds no weights "
            "and is never loaded. Trace it with `with model.trace(...)`, or use nv.generate(model, ...)."
        )

    def _generate(self, *inputs: Any, **kwargs: Any):
        raise NotImplementedError(
            "model.generate(...) without a `with` block runs vLLM in this process, and this model's "
            "engine is isolated in another one. Use nv.generate(model, prompts, ...) or "
            "`with model.generate(...)` / `with model.trace(...)`."
        )

    @property
    def llm(self):
        raise RuntimeError(
            "this model's engine runs in another process (isolate=True): there is no vllm.LLM here. "
            "Use nv.generate / model.trace, or load with isolate=False for direct access to vLLM."
        )

    # -- lifecycle
    @property
    def url(self) -> str | None:
        return None if self._conn is None else self._conn.url

    @property
    def pid(self) -> int | None:
        """The engine server's process id (None when attached to a server started elsewhere)."""
        return None if self._server is None else self._server.pid

    @property
    def log_path(self) -> Path | None:
        return None if self._server is None else self._server.log

    def _stop(self) -> None:
        _LIVE.pop(id(self), None)
        if self._conn is not None:
            self._conn.close()
        if self._server is not None:
            self._server.end()
            if self._dead is None:  # keep the log of an engine that died, for the message
                shutil.rmtree(self._server.dir, ignore_errors=True)  # (its log, port file and vLLM's sockets)
            self._server = None

    def close(self) -> None:
        """End the engine's process group (its memory comes back); the model refuses to run afterwards.

        On a model attached with ``nv.load(url=...)`` this only disconnects: the engine is someone else's.
        """
        if self._closed:
            return
        self._stop()
        self._forget_remote_dir()
        self._closed = True

    def _forget_remote_dir(self) -> None:
        where = self.__dict__.pop("_remote_dir", None)  # (attached by URL: the engine's config, tokenizer)
        if where:
            shutil.rmtree(where, ignore_errors=True)

    def restart(self) -> None:
        """Start a new engine with the same arguments (or re-attach to the same URL); no kernel restart."""
        self._stop()
        self.__dict__.pop("_nnvllm_unembed", None)
        if self._relaunch is None:
            _connect(self, self._attach_url, self._attach_token)
        else:
            _launch(self, **self._relaunch)
        self._closed = False
        self._dead = None

    def _state(self) -> str:
        if self._closed or self._dead:
            where = "closed" if self._closed else "dead: model.restart()"
        else:
            where = f"pid {self.pid}" if self._server is not None else f"attached to {self.url}"
        return f"isolated, {where}"


def _check_json(engine_args: dict) -> None:
    try:
        json.dumps(engine_args)
    except TypeError as e:
        raise TypeError(
            f"isolate=True sends engine arguments to another process as JSON, and {e}. Pass plain values "
            "(str, int, float, bool, lists, dicts), or load with isolate=False."
        ) from None


def _meta_model(cls, checkpoint: str, engine_args: dict):
    """Build the client's meta-only model (never dispatched) and close its torch TCPStore."""
    with real_stdout():
        model = cls(checkpoint, **engine_args)
    if getattr(model, "_owns_distributed", False):
        # VLLM.__init__ started a process group (a TCPStore listening on every interface) only to
        # build the meta tree; nothing here needs it, so it goes now.
        model._cleanup_distributed()
        model._owns_distributed = False
    return model


def _launch(model, *, checkpoint: str, engine_args: dict, start_timeout: float, server: _Server | None = None,
            deadline: float | None = None) -> None:
    deadline = deadline if deadline is not None else time.monotonic() + start_timeout
    server = server or _Server(checkpoint, engine_args)
    try:
        url = server.wait_ready(deadline, repr(checkpoint))
        model._server = server
        _connect(model, url, server.token)
    except BaseException:  # a timeout, a failed start, KeyboardInterrupt: never leave it running
        server.end()
        model._server = None
        raise


def _connect(model, url: str, token: str) -> None:
    model._conn = _Connection(model, url, token)
    model._info = model._conn.request("GET", "/v1/nnvllm/info").json()
    _LIVE[id(model)] = model
    _register_atexit()


def start(cls, checkpoint: str, arch, engine_args: dict, start_timeout: float):
    """Start an isolated engine on ``checkpoint`` and return its client model (see module docstring)."""
    _check_json(engine_args)
    if not isinstance(start_timeout, (int, float)) or start_timeout <= 0:
        raise ValueError(f"start_timeout={start_timeout!r}; expected seconds > 0")
    deadline = time.monotonic() + start_timeout
    server = _Server(checkpoint, engine_args)  # starts now; the meta build below overlaps with it
    try:
        model = _meta_model(cls, checkpoint, engine_args)
    except BaseException:
        server.end()
        raise
    _init(model, checkpoint, arch)
    model._relaunch = {"checkpoint": checkpoint, "engine_args": dict(engine_args),
                       "start_timeout": start_timeout}
    _launch(model, **model._relaunch, server=server, deadline=deadline)
    return model


def attach(cls_for, url: str, token: str | None, checkpoint: str | None):
    """Attach to a running ``python -m nnvllm.engine.server`` at ``url`` (see module docstring)."""
    import httpx

    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"url={url!r}; expected the server's address, e.g. 'http://127.0.0.1:8000'")
    if not token:
        raise ValueError("nv.load(url=...) needs token=: the one the server was started with (--token), "
                         "or the one it printed at start")
    url = url.rstrip("/")
    try:
        r = httpx.get(url + "/v1/nnvllm/info", headers={TOKEN_HEADER: token}, timeout=_CONNECT_TIMEOUT)
    except httpx.TransportError as e:
        raise ConnectionError(f"no nnvllm engine answers at {url} ({type(e).__name__}: {e}). Start one with "
                              "python -m nnvllm.engine.server MODEL --port P --token T") from None
    if r.status_code == 401:
        raise PermissionError(
            f"the engine at {url} refused the token; pass the one it was started with") from None
    if r.status_code != 200:
        raise ConnectionError(f"the engine at {url} answered {r.status_code}: {r.text[:200]}") from None
    info = r.json()
    where = checkpoint or info["checkpoint"]
    if checkpoint is None and not Path(where).is_dir():
        # The engine's checkpoint is not on this machine: build the meta model from its config and
        # tokenizer, fetched from the server (no weights travel).
        files = httpx.get(url + "/v1/nnvllm/files", headers={TOKEN_HEADER: token}, timeout=60.0)
        files.raise_for_status()
        from .launch import REMOTE_DIR, sweep_stale_dirs

        sweep_stale_dirs()
        where = tempfile.mkdtemp(prefix=f"{REMOTE_DIR}{os.getpid()}-")
        with tarfile.open(fileobj=io.BytesIO(files.content)) as tar:
            tar.extractall(where, filter="data")
    cls, cfg_path, arch = cls_for(where)
    meta_args = {"dtype": info["dtype"].removeprefix("torch."), "max_model_len": info["max_model_len"]}
    model = _meta_model(cls, cfg_path, meta_args)
    _init(model, info["checkpoint"], arch)
    model._relaunch = None
    model._attach_url, model._attach_token = url, token
    if where != checkpoint and where != info["checkpoint"]:
        model._remote_dir = where  # removed at close() and exit; a killed kernel's at the next start
    _connect(model, url, token)
    return model


def _init(model, checkpoint: str, arch) -> None:
    model.arch = arch.in_engine(model._module)  # vLLM's tree (its Transformers backend moves the blocks)
    model.checkpoint = checkpoint
    model._conn = None
    model._server = None
    model._info = {}
    model._dead = None
    model._closed = False
