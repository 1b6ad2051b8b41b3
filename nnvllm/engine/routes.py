"""The isolated server's endpoints, installed on nnsight's serve app (:func:`_install`).

The routes are what :mod:`.server`'s docstring lists: nnvllm's capture, stream, unembed, readout, info, files
and sleep endpoints, nnsight's trace endpoint with its fixes, the token check and ``/health``.
"""

# No `from __future__ import annotations`: FastAPI reads the handlers' annotations (``Request``,
# imported inside _install) at route creation; postponed, they would not resolve (422 on every call).
import asyncio
import contextlib
import hmac
import io
import os
import pickle
import tarfile
import tempfile
import time
import uuid
from typing import Any

from .aborts import Calls, ClientLeft, while_client_waits  # (stdlib-only at import)
from .heap import gc_delta, gc_pauses  # (stdlib-only at import)
from .procs import ENGINE_DIED, TOKEN_HEADER  # (stdlib-only at import)
from .transport import (ARM, COLLECT, DISARM, PEEK, READOUT, UNEMBED, StreamBook, collect_tokens, eager_notice, pack,  # (stdlib-only at import)
                        plain_output, sampling_params, speed_settings, unpack)
from .wire import pack_tensors, to_data  # (stdlib-only at import)


def _torch_payload(obj: Any):
    import torch
    from fastapi import Response

    buf = io.BytesIO()
    torch.save(obj, buf)
    return Response(content=buf.getvalue(), media_type="application/octet-stream")


def _packed(obj: Any):
    """A capture's reply (:func:`nnvllm.engine.transport.pack`: JSON when plain, as a reply always is)."""
    from fastapi import Response

    data, kind = pack(obj)
    return Response(content=data, media_type=kind)


def _error(status: int, detail: str):
    from fastapi.responses import JSONResponse

    return JSONResponse(status_code=status, content={"detail": detail})


def _dead(engine) -> bool:
    return engine is None or bool(getattr(engine, "errored", False))


async def _rpc(engine, method: str, args: tuple = ()):
    """``engine.collective_rpc`` that gives up when the engine core dies while it waits.

    A worker RPC sent just as the EngineCore died waited for ever (seen in CI: a test killed the core
    right after a restart and the next ``nv.generate`` hung instead of raising EngineDied).
    """
    task = asyncio.ensure_future(engine.collective_rpc(method, args=args))
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            return task.result()
        if _dead(engine):
            task.cancel()
            raise RuntimeError(f"the engine core died during {method}")


_BACKGROUND: set = set()  # replies nobody waits for (the loop keeps only weak references to tasks)


def _unwaited(coro) -> None:
    """Run ``coro`` in the background; its result (or error) is dropped."""
    task = asyncio.ensure_future(coro)
    _BACKGROUND.add(task)
    task.add_done_callback(lambda t: (_BACKGROUND.discard(t), t.cancelled() or t.exception()))


_POLL_S = 0.002  # how often the hold checks that every request is in; it adds at most this to a call


async def _start_together(engine, ids: list[str], tasks: list, start) -> None:
    """``tasks.extend(start())`` (one task per request, ``ids`` their request ids) with vLLM's
    scheduler held until every request is in, so that a call's prompts run as one batch.

    AsyncLLM sends requests to the engine core one by one, and the core steps as soon as the first
    arrives: the rest trickled into later steps, each a mixed prefill-and-decode step run without
    CUDA graphs (64 prompts: 33 steps and 3 batches instead of 32 and 1 on the CPU box; on the H200
    the GPT-2-small shape's isolated capture took 1.44x in-process). vLLM's pause ("keep":
    new requests queue, nothing steps) goes out before the first request and the resume after the
    last, over the one socket the core reads in order. Neither reply is waited for: a pause sent
    while other requests run (an nnsight trace) replies only once the engine is idle.
    """
    core = engine.engine_core
    added = getattr(getattr(engine, "output_processor", None), "external_req_ids", None)  # by the caller's id
    # NNVLLM_ONE_BATCH=0 lets the requests trickle in as the in-process engine's do (benchmarks: the
    # hold costs the adds' time, ~28 ms for 64 requests on the H200 host, which the trickle overlaps).
    if (len(ids) < 2 or added is None or not hasattr(core, "pause_scheduler_async")  # (one request: one batch)
            or os.environ.get("NNVLLM_ONE_BATCH", "1") == "0"):
        tasks.extend(start())
        return
    _unwaited(core.pause_scheduler_async(mode="keep", clear_cache=False))
    await asyncio.sleep(0)  # the pause goes out before the first request
    try:
        tasks.extend(start())
        loop = asyncio.get_running_loop()
        until = loop.time() + 5.0
        # A request is registered and sent in one go (AsyncLLM._add_request): registered means sent.
        # The wait sleeps between checks rather than spins: a loop that wakes often takes the event
        # loop from the adds, and from the thread of vLLM's renderer where it renders unrendered
        # prompts (2-core CPU box, toy model, 64 rendered prompts: the adds took 8.5 ms checking every
        # 2 ms, 11.2 ms spinning; 512 unrendered prompts x 16 tokens: 3.8-4.3 s a call spinning, 3.6 s
        # checking every 0.5 ms, 1.0-1.1 s every 2 ms, as without the hold).
        while not all(i in added for i in ids) and not any(t.done() for t in tasks) and loop.time() < until:
            await asyncio.sleep(_POLL_S)
    finally:
        _unwaited(core.resume_scheduler_async())


def _rendered(engine, prompts: list) -> list:
    """``prompts`` as vLLM's renderer makes them, in one call, as vLLM's own ``LLM.generate`` does.
    AsyncLLM renders a prompt it is given unrendered on its renderer's thread pool, one hand-off to a
    thread per request, each waiting for the GIL beside the event loop; a rendered one it takes inline."""
    try:
        from vllm.renderers.inputs.preprocess import parse_model_prompt
    except ImportError:  # a vLLM without the renderer: AsyncLLM renders each prompt itself
        return prompts
    renderer = engine.renderer
    return list(renderer.render_cmpl([parse_model_prompt(engine.model_config, p) for p in prompts],
                                     renderer.default_cmpl_tok_params))


def _merge_saves(mediators: list, per_request: list[dict]) -> dict:
    """Merge per-invoke saves the way nnsight's in-process engine does (``VLLM._collect``).

    A name saved by several invokes comes back as a list in invoke order; a container bound and
    saved above the invokes is merged slot-wise (nnsight's own ``merge_shared_saves``).
    """
    from nnsight.modeling.vllm.collect import merge_shared_saves

    values: dict[str, list] = {}
    for saves in per_request:
        for name, value in saves.items():
            values.setdefault(name, []).append(value)
    shared = merge_shared_saves(mediators, per_request)
    out = {}
    for name, found in values.items():
        if name in shared:
            out[name] = shared[name]
        elif len(found) > 1 and any(v is not found[0] for v in found):
            out[name] = found
        else:
            out[name] = found[0]
    return out


def _install(app, token: str, model, checkpoint: str) -> None:
    """Add nnvllm's auth, routes and fixes to nnsight's FastAPI ``app`` (same app, same port)."""
    from fastapi import Request
    from fastapi.routing import APIRoute
    from nnsight.modeling.vllm.serve import server as serve

    expected = token.encode()

    @app.middleware("http")
    async def check_token(request: Request, call_next):
        # /health stays open (a liveness probe needs no secret); everything else runs client code.
        if request.url.path != "/health":
            got = request.headers.get(TOKEN_HEADER, "").encode()
            if not hmac.compare_digest(got, expected):
                return _error(401, f"missing or wrong token (header {TOKEN_HEADER!r})")
        return await call_next(request)

    capture_lock = asyncio.Lock()  # the capture hooks are per worker: one nv.generate at a time

    async def health():
        engine = model.vllm_entrypoint
        if engine is None:
            return _error(503, "engine not ready")
        if _dead(engine):
            return _error(503, ENGINE_DIED)
        return {"status": "ok", "pid": os.getpid()}

    calls = Calls()

    async def trace(request: Request):
        """nnsight's ``/v1/nnsight/generate``, with the fixes listed in the module docstring."""
        left = calls.start(request)
        try:
            return await _trace(request, left)
        finally:
            calls.end(request)

    async def _trace(request, left: asyncio.Event):
        from nnsight.intervention.errors import capture_exception
        from nnsight.modeling.vllm.engines.engine import acollect
        from nnsight.tracing import globals as tracing_globals
        from nnsight.tracing.tracer import dec as trace_scope_out
        from nnsight.tracing.tracer import inc as trace_scope_in

        from .models import uses_cuda_graphs

        model_ = serve._ready()
        body = await request.body()
        compress = request.headers.get("nnsight-compress", "False").lower() == "true"
        # From here to the first await nothing else runs, so no other build can see this one's
        # sources. Cleared per request: the caches key on the client's file name and never
        # re-read, so an edited file at the same path would run its old invoke bodies.
        tracing_globals.SOURCES.clear()
        tracing_globals.BLOCKS.clear()
        # The trace's code above its invokes runs here, as in the client's own `with model.trace`: in
        # a trace scope, so a value saved there (`out = [None] * n; out.save()`) is marked, and its name
        # rides with each invoke's worker (serialized in _attach_mediators, before the scope closes).
        trace_scope_in()
        try:
            tracer = serve._build_tracer(body, compress)
            _, (prompts, params, loras), forward_kwargs = tracer.prepare(tracer.info.code)
            mediators = model_._attach_mediators(params, **forward_kwargs)
        except Exception as exc:
            return serve._payload({}, capture_exception(exc))
        finally:
            model_.interleaver.cancel()
            trace_scope_out()
        engine = model_.vllm_entrypoint

        request_ids = []

        async def run_invoke(prompt, param, lora):
            request_id = uuid.uuid4().hex
            request_ids.append(request_id)
            collected = False
            try:
                output = None
                async for out in engine.generate(prompt, param, request_id, lora_request=lora):
                    output = out  # the last one is the whole output
                entry = await acollect(engine, request_id, output)
                collected = True
                return ({}, None) if entry is None else (entry["saves"], entry["error"])
            finally:
                if not collected:  # cancelled mid-generation: free the request's workers
                    await asyncio.shield(acollect(engine, request_id))

        gathered = asyncio.ensure_future(asyncio.gather(
            *(run_invoke(p, q, loras[i] if loras else None) for i, (p, q) in enumerate(zip(prompts, params))),
            return_exceptions=True,
        ))
        try:
            await while_client_waits(request, left, [gathered])
        except ClientLeft as e:  # cancelled, vLLM aborts each request; run_invoke collects its workers
            gathered.cancel()
            with contextlib.suppress(BaseException):
                await gathered
            return serve._payload({}, capture_exception(e))
        results = gathered.result()
        if _dead(engine):
            return _error(503, ENGINE_DIED)
        per_request, first_error = [], None
        for result in results:
            if isinstance(result, BaseException):
                first_error = first_error or capture_exception(result)
                per_request.append({})
                continue
            saves, error = result
            per_request.append(saves)
            first_error = first_error or error
        try:  # data only travels back (nnvllm.engine.wire): the client reads it with weights_only=True
            saves = to_data(_merge_saves(mediators, per_request), "the saved values")
        except TypeError as e:
            return serve._payload({}, capture_exception(e))
        notice = None
        if uses_cuda_graphs(model_):  # why traced steps ran eagerly, for the client to say (isolated.py)
            with contextlib.suppress(Exception):
                notice = eager_notice(await _rpc(engine, "nnvllm_eager_notes", (request_ids,)))
        # The saved tensors travel as one buffer (wire.pack_tensors), not a torch.save record each.
        return _torch_payload({"packed_saves": pack_tensors(saves), "error": first_error, "notice": notice})

    async def capture(request: Request):
        """Arm the capture, run the prompts concurrently, collect: one ``nv.generate``.

        The activations travel through shared memory (``nnvllm.engine.worker``): the reply is small.
        A client that gives up (``/v1/nnvllm/abort``) has its requests cut.
        """
        left = calls.start(request)
        try:
            return await _capture(request, left)
        finally:
            calls.end(request)

    async def abort(request: Request):
        """``{"call"}``: the client gave up on that call (Ctrl-C): cut its requests."""
        body = await request.json()
        return {"status": "ok", "running": calls.abort(str(body.get("call")))}

    async def _capture(request, left: asyncio.Event):
        from vllm.sampling_params import RequestOutputKind

        t0, gc0 = time.perf_counter(), gc_pauses()
        model_ = serve._ready()
        req = unpack(await request.body(), request.headers.get("content-type"))
        engine = model_.vllm_entrypoint
        try:
            # Final outputs only: a per-step output per request costs Python per request x step.
            params = sampling_params(req["params"], len(req["prompts"]), RequestOutputKind.FINAL_ONLY)
            prompts = _rendered(engine, req["prompts"])
        except Exception as e:  # noqa: BLE001 (bad parameters, or a prompt vLLM refuses)
            return _packed({"error": [type(e).__name__, str(e)]})

        async def one(prompt, sp, request_id):
            output = None
            async for out in engine.generate(prompt, sp, request_id):
                output = out  # the last one is the whole output
            return plain_output(output)

        ids = [uuid.uuid4().hex for _ in req["prompts"]]
        tasks: list = []
        async with capture_lock:
            try:
                t1 = time.perf_counter()
                await _rpc(engine, ARM, (req["spec"],))
                t2 = time.perf_counter()
                try:
                    await _start_together(engine, ids, tasks, lambda: [
                        asyncio.ensure_future(one(p, sp, i)) for p, sp, i in zip(prompts, params, ids)])
                    t3 = time.perf_counter()
                    await while_client_waits(request, left, tasks)
                    outputs = [t.result() for t in tasks]
                    t4 = time.perf_counter()
                except BaseException:
                    for t in tasks:  # cancelled, vLLM aborts each request
                        t.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    await _rpc(engine, DISARM)
                    raise
                finally:
                    # What nnsight's engine does for every finished request: wind up the workers an
                    # installed edit (model.edit) ran on them. One call for all, not one per request.
                    await _rpc(engine, "collect_nnsight", (ids, ids))
                handoff = (await _rpc(engine, COLLECT, (collect_tokens(outputs),)))[0]
                t5 = time.perf_counter()
            except Exception as e:
                if _dead(engine):
                    return _error(503, ENGINE_DIED)
                return _packed({"error": [type(e).__name__, str(e)]})
        # The server's share of the client's HTTP time (the client keeps it in CLIENT_TIMINGS).
        timings = dict(lock=t1 - t0, arm=t2 - t1, add=t3 - t2, generate=t4 - t3, collect=t5 - t4, **gc_delta(gc0))
        reply = _packed({"outputs": outputs, "handoff": handoff, "error": None, "timings": timings})
        timings["total"] = time.perf_counter() - t0  # (the reply above carries all but this: sent apart)
        reply.headers["nnvllm-server-seconds"] = f"{timings['total']:.6f}"
        return reply

    streams: dict[str, tuple[asyncio.Event, asyncio.Event]] = {}  # stream id -> (stop, abort) flags
    stream_tasks: set = set()  # the running streamed captures

    async def stream(request: Request):
        """``nv.stream``: the capture of ``/v1/nnvllm/generate``, step by step, as a streamed body of
        frames (8-byte little-endian length, then a ``torch.save`` of plain data and small tensors):
        ``{"outputs": [...], "peek": {...}}`` after each batch of engine outputs, then ``{"outputs",
        "handoff"}``, or ``{"error"}``.

        The capture runs in its own task, which holds the capture lock, and ends on its own: the
        response only reads its frames. (The response's generator is not closed when the client goes
        away while it waits to send; one that held the lock kept every later call waiting, seen as a
        hang after ``break`` in a stream.) A client that leaves early asks ``/v1/nnvllm/stream/stop``
        with ``abort``: the generation is cut, the worker disarmed, and nothing handed over; a
        response closed while the capture runs does the same."""
        import struct

        import torch
        from fastapi.responses import StreamingResponse
        from vllm.sampling_params import RequestOutputKind

        engine = serve._ready().vllm_entrypoint
        req = torch.load(io.BytesIO(await request.body()), weights_only=True)
        try:  # every step's output
            params = sampling_params(req["params"], len(req["prompts"]), RequestOutputKind.CUMULATIVE)
            prompts = _rendered(engine, req["prompts"])
        except Exception as e:  # noqa: BLE001 (bad parameters, or a prompt vLLM refuses)
            return _torch_payload({"error": (type(e).__name__, str(e))})
        sid = str(req["stream_id"])
        stop, gone = asyncio.Event(), asyncio.Event()
        if req.get("stop"):  # stopped before it began: it ends at its first step
            stop.set()
        streams[sid] = (stop, gone)
        book = StreamBook([uuid.uuid4().hex for _ in req["prompts"]])
        out: asyncio.Queue = asyncio.Queue()  # frames, then None

        def frame(obj) -> bytes:
            buf = io.BytesIO()
            torch.save(obj, buf)
            return struct.pack("<Q", buf.tell()) + buf.getvalue()

        async def produce():
            queue: asyncio.Queue = asyncio.Queue()

            async def one(prompt, sp, request_id):
                try:
                    async for o in engine.generate(prompt, sp, request_id):
                        await queue.put(plain_output(o))
                finally:
                    await queue.put(request_id)  # this request is over (finished or aborted)

            async def next_items():  # the outputs that came since the last call, or None once the client left
                items = []
                if queue.empty() and not gone.is_set():
                    get, left = asyncio.ensure_future(queue.get()), asyncio.ensure_future(gone.wait())
                    await asyncio.wait([get, left], return_when=asyncio.FIRST_COMPLETED)
                    left.cancel()
                    if get.done():
                        items.append(get.result())
                    else:
                        get.cancel()
                if gone.is_set():
                    return None
                while not queue.empty():
                    items.append(queue.get_nowait())
                return items

            async with capture_lock:
                tasks: list = []
                armed = False
                try:
                    await _rpc(engine, ARM, (req["spec"],))
                    armed = True
                    await _start_together(engine, book.ids, tasks, lambda: [
                        asyncio.ensure_future(one(p, sp, i)) for p, sp, i in zip(prompts, params, book.ids)])
                    running = len(tasks)
                    while running:
                        items = await next_items()
                        if items is None:
                            return  # the finally aborts and disarms
                        running -= sum(isinstance(it, str) for it in items)
                        book.update(it for it in items if not isinstance(it, str))
                        peek = (await _rpc(engine, PEEK))[0]
                        await out.put(frame({"outputs": book.snapshot(), "peek": peek}))
                        abort = book.stop(stop.is_set())
                        if abort:  # the requests end (aborted) and the loop drains them
                            await engine.abort(abort)
                    await asyncio.gather(*tasks, return_exceptions=True)
                    if gone.is_set():
                        return
                    outputs = book.outputs()
                    armed = False
                    handoff = (await _rpc(engine, COLLECT, (collect_tokens(outputs),)))[0]
                    await out.put(frame({"outputs": outputs, "handoff": handoff}))
                except Exception as e:  # noqa: BLE001
                    await out.put(frame({"error": (type(e).__name__, ENGINE_DIED if _dead(engine) else str(e))}))
                finally:
                    streams.pop(sid, None)
                    for t in tasks:
                        t.cancel()
                    if armed and not _dead(engine):
                        with contextlib.suppress(Exception):
                            await asyncio.gather(*tasks, return_exceptions=True)
                            await engine.abort(book.ids)
                            await _rpc(engine, DISARM)
                    await out.put(None)

        task = asyncio.ensure_future(produce())
        stream_tasks.add(task)  # (the loop keeps only a weak reference)
        task.add_done_callback(stream_tasks.discard)

        async def frames():
            ended = False
            try:
                while (f := await out.get()) is not None:
                    yield f
                ended = True
            finally:  # closed early (when it runs at all: see above): the capture stops too
                if not ended:
                    gone.set()

        return StreamingResponse(frames(), media_type="application/octet-stream")

    async def stream_stop(request: Request):
        """``{"stream_id"}``: end the stream at the next step, keeping what was produced; with
        ``"abort": true`` (the client left early): cut it, keep nothing."""
        body = await request.json()
        flags = streams.get(str(body.get("stream_id")))
        if flags is not None:
            flags[1 if body.get("abort") else 0].set()
        return {"status": "ok", "stopping": flags is not None}

    async def unembed(request: Request):
        body = await request.json()
        engine = serve._ready().vllm_entrypoint
        try:
            parts = await _rpc(engine, UNEMBED, (body["final_norm"], body["unembed"]))
        except Exception as e:
            if _dead(engine):
                return _error(503, ENGINE_DIED)
            return _error(500, f"{type(e).__name__}: {e}")
        return _torch_payload({"parts": [pickle.loads(p) for p in parts]})

    async def readout(request: Request):
        body = await request.json()
        engine = serve._ready().vllm_entrypoint
        try:
            parts = await _rpc(engine, READOUT, (body["target"], body["versus"], body["ids"], body["positions"]))
        except Exception as e:
            if _dead(engine):
                return _error(503, ENGINE_DIED)
            return _error(500, f"{type(e).__name__}: {e}")
        return _torch_payload({"parts": [pickle.loads(p) for p in parts]})

    async def info():
        engine = serve._ready().vllm_entrypoint
        mc = engine.model_config
        import torch
        from vllm.platforms import current_platform

        return {
            "checkpoint": checkpoint,
            "pid": os.getpid(),
            "dtype": str(mc.dtype),
            "tp": engine.vllm_config.parallel_config.tensor_parallel_size,
            "max_num_seqs": engine.vllm_config.scheduler_config.max_num_seqs,
            "vocab_size": mc.get_vocab_size(),
            "max_model_len": mc.max_model_len,
            "cuda": torch.cuda.is_available(),
            "sleep_platform": current_platform.is_sleep_mode_available(),
            "sleep_mode": bool(getattr(mc, "enable_sleep_mode", False)),
            **speed_settings(engine.vllm_config),
        }

    async def files():
        """Config and tokenizer files (never weights): what a client needs to build its meta model."""
        buf = io.BytesIO()
        with tempfile.TemporaryDirectory() as d:
            engine = serve._ready().vllm_entrypoint
            engine.model_config.hf_config.save_pretrained(d)
            model.tokenizer.save_pretrained(d)
            with tarfile.open(fileobj=buf, mode="w") as tar:
                for name in sorted(os.listdir(d)):
                    tar.add(os.path.join(d, name), arcname=name)
        from fastapi import Response

        return Response(content=buf.getvalue(), media_type="application/x-tar")

    async def sleep_(request: Request):
        engine = serve._ready().vllm_entrypoint
        level = int((await request.json()).get("level", 1))
        if not getattr(engine.model_config, "enable_sleep_mode", False):
            return _error(501, "this engine was started without enable_sleep_mode=True")
        await engine.sleep(level)
        return {"status": "ok", "sleeping": True}

    async def wake():
        engine = serve._ready().vllm_entrypoint
        if not getattr(engine.model_config, "enable_sleep_mode", False):
            return _error(501, "this engine was started without enable_sleep_mode=True")
        await engine.wake_up()
        return {"status": "ok", "sleeping": False}

    ours = [
        ("/health", health, ["GET"]),
        ("/v1/nnsight/generate", trace, ["POST"]),
        ("/v1/nnvllm/generate", capture, ["POST"]),
        ("/v1/nnvllm/stream", stream, ["POST"]),
        ("/v1/nnvllm/stream/stop", stream_stop, ["POST"]),
        ("/v1/nnvllm/abort", abort, ["POST"]),
        ("/v1/nnvllm/unembed", unembed, ["POST"]),
        ("/v1/nnvllm/readout", readout, ["POST"]),
        ("/v1/nnvllm/info", info, ["GET"]),
        ("/v1/nnvllm/files", files, ["GET"]),
        ("/v1/nnvllm/sleep", sleep_, ["POST"]),
        ("/v1/nnvllm/wake", wake, ["POST"]),
    ]
    paths = {p for p, _, _ in ours}
    # Ours replace nnsight's routes of the same path (a router matches the first route registered).
    kept = [r for r in app.router.routes if not (isinstance(r, APIRoute) and r.path in paths)]
    app.router.routes[:] = [APIRoute(p, fn, methods=m) for p, fn, m in ours] + kept

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        yield
        # uvicorn re-raises SIGTERM after its shutdown and the process dies without running
        # atexit: shut the engine (its EngineCore / worker processes) down here.
        engine = model.vllm_entrypoint
        if engine is not None:
            with contextlib.suppress(Exception):
                engine.shutdown()
        # Its workers' hand-off files (spares, recycled ones) are removed at their exit, which a
        # shutdown that ends in a kill skips.
        with contextlib.suppress(Exception):
            from .worker.leftovers import sweep_group

            sweep_group()

    app.router.lifespan_context = lifespan


