"""The engine contract: the four calls nnvllm's verbs make of an engine, and its in-process transport.

:func:`nnvllm.generate`, :func:`nnvllm.stream`, :func:`nnvllm.logit_lens` and :func:`nnvllm.patch`
reach the engine only through an object with these methods (:func:`engine_of` gives the model's):

- ``capture(prompts, params, spec)`` — arm the worker (:mod:`nnvllm.engine.worker`), generate the prompts as
  one vLLM batch, collect: ``(plain outputs, the worker's hand-off)``;
- ``stream(prompts, params, spec, stop)`` — the same, yielding ``("step", outputs so far, peek)``
  after each engine step, then ``("done", outputs, hand-off)``;
- ``unembed(final_norm, unembed)`` — each TP rank's final norm and unembedding slice;
- ``info()`` — dtype, vocabulary size, TP size;
- ``sleep_support()``, ``sleep(level)``, ``wake()`` — vLLM's sleep mode: whether the platform has it
  and the engine was started with it, then the calls themselves.

The model's lifecycle (``close``, ``sleep``, ``wake``, ``with``, its repr) is written once, in
``nnvllm.engine``'s model mixin, over this contract; an isolated model only says how its engine ends.

Two transports implement it and differ only in how calls and bytes travel: :class:`InProcessEngine`
(here: vLLM's ``LLM`` in this process, called directly) and :class:`nnvllm.engine.isolated.RemoteEngine`
(HTTP to ``python -m nnvllm.engine.server``, whose endpoints drive vLLM's ``AsyncLLM`` in that process).
What a capture *is* — the worker RPCs and their order, the per-prompt ``SamplingParams``, a vLLM
output as plain data, a stream's bookkeeping (:class:`StreamBook`) — is defined once, here, and
used by both. The activations never travel through either: the worker hands them over in shared
memory and the hand-off names the files.

One call drives an in-process engine at a time (:class:`EngineLock`): vLLM's ``LLM`` is not
thread-safe, and two threads stepping one engine corrupted its scheduler and the process's heap.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

__all__ = ["PROMPT_TAG", "EngineBusy", "EngineLock", "InProcessEngine", "StreamBook", "engine_lock", "engine_of", "pack",
           "plain_output", "sampling_params", "unpack"]

# Where the last capture's client-side time went (benchmarks): the arm RPC, the engine's generate,
# the collect RPC (hand-off included); isolated: the HTTP call. generate() reports them as client_*.
CLIENT_TIMINGS: dict[str, float] = {}

PROMPT_TAG = "nnvllm_prompt"  # SamplingParams.extra_args key: the request's prompt index (per-prompt edits)

# The worker's RPC methods (nnvllm.engine.worker.runner.CaptureWorker), in the order a capture calls them.
ARM, PEEK, COLLECT, DISARM = "nnvllm_arm", "nnvllm_peek", "nnvllm_collect", "nnvllm_disarm"
UNEMBED = "nnvllm_unembed"  # each TP rank's final norm and unembedding slice
READOUT = "nnvllm_readout"  # each TP rank's part of an attribution's readout (nnvllm.heads.Readout)


JSON_TYPE = "application/json"


def _is_plain(x) -> bool:
    """``x`` survives a JSON round trip unchanged: str-keyed dicts, lists, str, int, float, bool, None."""
    if isinstance(x, dict):
        return all(isinstance(k, str) and _is_plain(v) for k, v in x.items())
    if isinstance(x, list):
        return all(_is_plain(v) for v in x)
    return x is None or isinstance(x, (str, int, float, bool))


def pack(obj) -> tuple[bytes, str]:
    """A capture's request or reply as bytes and their content type: JSON when it is plain data (a
    reply always is: ids, text, the hand-off's file names), else ``torch.save`` (an edit's tensors).

    Decoding a 64-request reply with ``torch.load(weights_only=True)`` took 7.4–12.5 ms on the 2-core
    CPU box, ``json.loads`` 0.34–0.67 ms (``benchmarks/reply_decode.py``); on the H200 the isolated
    GPT-2-small call spends ~0.5 ms there with JSON, ~9 ms with ``torch.load``.
    Neither decoder runs code.
    """
    import json

    if _is_plain(obj):
        return json.dumps(obj).encode(), JSON_TYPE
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue(), "application/octet-stream"


def unpack(data: bytes, content_type: str | None):
    """What :func:`pack` made (tensors to the CPU); never unpickles code (:func:`.wire.load_data`)."""
    if (content_type or "").startswith(JSON_TYPE):
        import json

        return json.loads(data)
    from .wire import load_data

    return load_data(data, "a capture's request or reply")


def plain_output(out) -> dict:
    """A vLLM ``RequestOutput`` as the plain dict a ``Run`` is assembled from (both transports)."""
    gen = out.outputs[0]
    return {"request_id": str(out.request_id), "prompt_token_ids": list(out.prompt_token_ids),
            "token_ids": list(gen.token_ids), "text": gen.text, "finished": bool(out.finished)}


def speed_settings(vllm_config) -> dict:
    """What vLLM settled on for an engine that decides its speed, as both transports' ``info()``
    report it: whether the scheduler overlaps a step's host work with the previous step's forward
    (``async_scheduling``), and how the forward runs (torch.compile's ``compile_mode``, 0 for none;
    ``cudagraph_mode``)."""
    cc = vllm_config.compilation_config
    return {"async_scheduling": bool(vllm_config.scheduler_config.async_scheduling),
            "compile_mode": None if cc.mode is None else int(cc.mode), "cudagraph_mode": str(getattr(cc.cudagraph_mode, "name", cc.cudagraph_mode))}


def collect_tokens(outputs: list[dict]) -> dict[str, list[int]]:
    """The worker's ``nnvllm_collect`` argument: each request's generated ids, by request id."""
    return {o["request_id"]: o["token_ids"] for o in outputs}


def sampling_params(params: dict | list[dict], n: int | None = None, output_kind=None):
    """vLLM ``SamplingParams`` from ``generate``'s plain params: one for all prompts (a dict, ``n``
    None), or one per prompt (a list of dicts, or a dict and ``n``: per-prompt edits tag each request
    with its index, :data:`PROMPT_TAG`). ``output_kind``: vLLM's ``RequestOutputKind`` (server)."""
    from vllm import SamplingParams

    kw = {} if output_kind is None else {"output_kind": output_kind}
    if isinstance(params, list):
        return [SamplingParams(**p, **kw) for p in params]
    if n is None:
        return SamplingParams(**params, **kw)
    return [SamplingParams(**params, **kw) for _ in range(n)]


class StreamBook:
    """One streamed capture's bookkeeping, the same on both transports: the latest output of each
    request, when a stop may abort (once every request has begun: an abort before a request reached
    the engine would be lost), and the outputs the final collect gets."""

    def __init__(self, ids: list[str]) -> None:
        self.ids = list(ids)
        self.latest: dict[str, dict] = {}
        self.stopped = False

    def update(self, outputs) -> None:
        """Record plain outputs (:func:`plain_output`) as they come."""
        for o in outputs:
            self.latest[o["request_id"]] = o

    def snapshot(self) -> list[dict | None]:
        """Each request's latest output, in prompt order (None before its first)."""
        return [self.latest.get(i) for i in self.ids]

    def unfinished(self) -> list[str]:
        return [i for i in self.ids if not (i in self.latest and self.latest[i]["finished"])]

    def stop(self, asked: bool) -> list[str] | None:
        """None to go on; else (once, when a stop was ``asked`` and every request has begun) the ids
        to abort, possibly none: the stream ends with what was produced."""
        if not asked or self.stopped or len(self.latest) < len(self.ids):
            return None
        self.stopped = True
        return self.unfinished()

    def outputs(self) -> list[dict]:
        """The final outputs, in prompt order."""
        return [self.latest[i] for i in self.ids]


def _no_raw_prompt_warning() -> None:
    """``LLMEngine.add_request`` with a str prompt (what ``LLM.generate`` takes) warns on newer vLLM
    that raw prompts are deprecated; the stream passes what generate passes: keep it off the page."""
    import logging

    class _Drop(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return "Passing raw prompts" not in record.getMessage()

    log = logging.getLogger("vllm.v1.engine.input_processor")
    if not any(isinstance(f, _Drop) or type(f).__name__ == "_Drop" for f in log.filters):
        log.addFilter(_Drop())


class EngineBusy(RuntimeError):
    """A call on an in-process engine from the thread whose own earlier call on it has not finished:
    a stream (``nv.stream``) still being iterated, or a call made from inside one."""


class EngineLock:
    """Turn-taking on one in-process engine: one call drives it at a time.

    vLLM's ``LLM`` is not thread-safe: two threads calling ``nv.generate`` on one engine aborted the
    process (``malloc_consolidate(): invalid chunk size``) or wedged it, and a ``LiveGeneration``
    streaming in its thread while ``nv.generate`` ran in the next cell broke vLLM's scheduler state.
    So every call that drives the engine holds it for its whole length: ``nv.generate`` (arm,
    generate, collect), a stream from its first step to its end, ``model.trace`` / ``with
    model.generate`` (from building the invokes to collecting the saves), a plain
    ``model.generate(...)``, ``sleep`` / ``wake``.

    - A call from **another thread** waits its turn, then runs: both calls get the answers they would
      have got one after the other. (Ctrl-C ends a wait; a stream being iterated by another thread
      is waited for until it ends, is stopped, or is left.)
    - A call from **the thread that holds the engine** raises :class:`EngineBusy` at once: that
      thread's stream is suspended between two steps (a ``for`` loop over ``nv.stream`` not
      finished, or a call made in its body), and waiting would wait for ever. Finish the stream,
      ``break`` out of it, or call its ``stop()`` and finish the loop; then call again.
    - Worker RPCs (``engine.collective_rpc``: the unembedding a stream's steps read, nnsight's
      ``model.edit`` registrations, a user's own) wait for a call running in another thread and go
      through from the thread that holds the engine: between two steps the worker is idle.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None  # the thread holding the engine
        self._what = ""  # the call holding it (for EngineBusy's message)

    @property
    def held(self) -> bool:
        return self._owner is not None

    def _acquire(self, what: str) -> None:
        while not self._lock.acquire(timeout=0.1):  # short waits: Ctrl-C ends a long one
            pass
        self._owner, self._what = threading.get_ident(), what

    def adopt(self) -> None:
        """The call holding the engine now runs in this thread: a stream iterated (or closed, by the
        garbage collector) in another thread than the one it started in."""
        if self._owner is not None:
            self._owner = threading.get_ident()

    def _release(self) -> None:
        self._owner, self._what = None, ""
        self._lock.release()

    @contextlib.contextmanager
    def call(self, what: str):
        """Hold the engine for a call (``what`` names it in the busy message)."""
        if self._owner == threading.get_ident():
            raise EngineBusy(
                f"{what} cannot run on this engine now: {self._what}, started in this thread, has not "
                "finished (a stream's loop left suspended between steps, or a call made inside one). "
                "Finish that stream (iterate it to the end), break out of its loop, or call its stop() "
                "and finish the loop; then call again. Calls from other threads wait their turn.")
        self._acquire(what)
        try:
            yield
        finally:
            self._release()

    @contextlib.contextmanager
    def rpc(self):
        """Hold the engine for one worker RPC, unless this thread holds it already."""
        if self._owner == threading.get_ident():
            yield
            return
        self._acquire("a worker RPC")
        try:
            yield
        finally:
            self._release()


_LOCKS_MADE = threading.Lock()


def engine_lock(llm) -> EngineLock:
    """The :class:`EngineLock` of an in-process ``vllm.LLM`` (made on first use; from then on its
    engine's ``collective_rpc`` goes through :meth:`EngineLock.rpc`)."""
    lock = getattr(llm, "_nnvllm_lock", None)
    if lock is not None:
        return lock
    with _LOCKS_MADE:
        lock = getattr(llm, "_nnvllm_lock", None)
        if lock is None:
            lock = EngineLock()
            _guard_rpcs(llm.llm_engine, lock)
            llm._nnvllm_lock = lock
    return lock


def _guard_rpcs(eng, lock: EngineLock) -> None:
    import weakref

    real = type(eng).collective_rpc
    ref = weakref.ref(eng)  # (no cycle from the engine to itself through this function)

    def collective_rpc(*args, **kwargs):
        with lock.rpc():
            return real(ref(), *args, **kwargs)

    eng.collective_rpc = collective_rpc


def model_lock(model) -> EngineLock | None:
    """The :class:`EngineLock` of ``model``'s engine if it runs in this process as a ``vllm.LLM``;
    None for an isolated (or closed) model, and for the isolated server's own async engine."""
    llm = getattr(model, "vllm_entrypoint", None)
    if llm is None or getattr(model, "_async_engine", False) or not hasattr(llm, "llm_engine"):
        return None
    return engine_lock(llm)


@contextlib.contextmanager
def holding(model, what: str):
    """Hold ``model``'s in-process engine for a call (:meth:`EngineLock.call`); nothing to hold otherwise."""
    lock = model_lock(model)
    if lock is None:
        yield
        return
    with lock.call(what):
        yield


def _serial_tracer_class():
    """nnsight's ``VLLMTracer`` whose ``execute`` (building the invokes, running them on the engine,
    collecting the saves) holds the engine: what ``model.trace`` and ``with model.generate`` build."""
    from nnsight.modeling.vllm.tracer import VLLMTracer

    class SerialTracer(VLLMTracer):
        def execute(self, code) -> None:
            with holding(self.envoy, "model.trace"):
                done = False
                try:
                    super().execute(code)
                    done = True
                finally:  # its steps that ran eagerly on a graph engine, if any: said, or (failed) let go
                    warn_eager_steps(self.envoy, say=done)

    # importable as nnvllm.engine.transport.SerialTracer (module __getattr__): pickled by reference
    SerialTracer.__module__, SerialTracer.__qualname__ = __name__, "SerialTracer"
    return SerialTracer


def __getattr__(name: str):
    if name == "SerialTracer":  # built on first use: importing this module must not import nnsight
        cls = globals().get("_SERIAL_TRACER")
        if cls is None:
            cls = globals()["_SERIAL_TRACER"] = _serial_tracer_class()
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def eager_notice(per_rank: list) -> str | None:
    """The one-line notice for a trace whose decode steps ran eagerly on a CUDA graph engine, from
    every rank's ``nnvllm_eager_notes`` (``{request id: (why, steps)}``), or None when none did."""
    notes = {}
    for part in per_rank:
        for rid, (why, steps) in (part or {}).items():
            notes.setdefault(rid, (why, int(steps)))
    if not notes:
        return None
    why = next(iter(notes.values()))[0]
    steps = max(n for _, n in notes.values())
    return (f"nnvllm: {steps} decode step(s) of this trace ran eagerly on the CUDA graph engine: {why} "
            "(which traced steps run eagerly, and why: docs/capture.md, 'nnsight traces on a graph engine')")


def warn_eager_steps(model, say: bool = True) -> None:
    """After a trace on an in-process graph engine (which it held alone: transport.SerialTracer), ask
    the workers why its decode steps ran eagerly, if any did, and say so in one warning (``say``). A
    notice never fails the trace it is about. The workers give each note once, so a trace that failed
    takes its notes too (``say=False``): left there, they would be the next trace's notice."""
    llm = getattr(model, "vllm_entrypoint", None)
    if llm is None or not getattr(model, "_nnvllm_graphs", False):  # (models.uses_cuda_graphs, in-process)
        return
    try:
        notice = eager_notice(llm.collective_rpc("nnvllm_eager_notes"))
    except Exception:  # noqa: BLE001
        return
    if notice and say:
        import warnings

        warnings.warn(notice, stacklevel=4)


def _take_returned(spec: dict, model: object) -> dict:
    """``spec`` naming the recycled hand-off files this process has let go of that ``model``'s engine
    handed over, each named to this call only (:func:`nnvllm.engine.worker.handoff.take_returned`): two
    calls naming one file let the engine hand it over to the first and write the second's values
    into it."""
    if "returned" not in spec:
        return spec
    from .worker.handoff import take_returned

    return {**spec, "returned": take_returned(model)}


class InProcessEngine:
    """The engine in this process (``model.llm``), called directly, one call at a time (:class:`EngineLock`)."""

    def __init__(self, model) -> None:
        llm = model.llm
        if llm is None:
            raise RuntimeError("this model was closed; load it again with nv.load(...)")
        self.model = model  # (whose hand-off files its calls name as returned)
        self.llm = llm
        self.lock = engine_lock(llm)

    def capture(self, prompts: list[str], params: dict, spec: dict) -> tuple[list[dict], dict | None]:
        """Arm the worker, generate, collect: (plain outputs, the worker's hand-off)."""
        with self.lock.call("nv.generate"):
            spec = _take_returned(spec, self.model)
            t0 = time.perf_counter()
            self.llm.collective_rpc(ARM, args=(spec,))
            t1 = time.perf_counter()
            try:
                with interruptible(self.llm):
                    outputs = [plain_output(o) for o in self.llm.generate(prompts, sampling_params(params),
                                                                          use_tqdm=False)]
            except BaseException:
                self.llm.collective_rpc(DISARM)
                raise
            t2 = time.perf_counter()
            handoff = self.llm.collective_rpc(COLLECT, args=(collect_tokens(outputs),))[0]
        CLIENT_TIMINGS.update(arm=t1 - t0, generate=t2 - t1, collect=time.perf_counter() - t2)
        return outputs, handoff

    def stream(self, prompts: list[str], params, spec: dict, stop: threading.Event):
        """:meth:`capture`, step by step: yields ``("step", outputs so far, peek)`` after each engine
        step (``peek``: the worker's new rows, ``CaptureWorker.nnvllm_peek``), then ``("done",
        outputs, hand-off)``. ``stop`` set: the requests are aborted (once each has begun) and the
        call ends with what was produced. Closing the generator early aborts and disarms. The engine
        is held from the first step to the end (:class:`EngineLock`)."""
        with self.lock.call("a stream (nv.stream, LiveGeneration)"):
            yield from self._stream(prompts, params, _take_returned(spec, self.model), stop)

    def _stream(self, prompts: list[str], params, spec: dict, stop: threading.Event):
        import uuid

        _no_raw_prompt_warning()
        eng = self.llm.llm_engine
        sps = sampling_params(params, len(prompts))
        book = StreamBook([f"nvstream{uuid.uuid4().hex}" for _ in prompts])  # external ids (no "-": see _assemble)
        self.llm.collective_rpc(ARM, args=(spec,))
        armed = True
        try:
            for rid, prompt, sp in zip(book.ids, prompts, sps):
                eng.add_request(rid, prompt, sp)
            while eng.has_unfinished_requests():
                book.update(plain_output(o) for o in eng.step())
                peek = self.llm.collective_rpc(PEEK)[0]
                yield "step", book.snapshot(), peek
                self.lock.adopt()  # (resumed, perhaps by another thread)
                abort = book.stop(stop.is_set())
                if abort is not None:
                    eng.abort_request(abort)
                    break
            outputs = book.outputs()
            armed = False
            handoff = self.llm.collective_rpc(COLLECT, args=(collect_tokens(outputs),))[0]
            yield "done", outputs, handoff
        finally:
            self.lock.adopt()  # (closed, perhaps by the garbage collector in another thread)
            if armed:  # an error, or the consumer stopped iterating: leave the engine clean
                with contextlib.suppress(Exception):
                    eng.abort_request(book.unfinished())
                    while eng.has_unfinished_requests():
                        eng.step()
                with contextlib.suppress(Exception):
                    self.llm.collective_rpc(DISARM)

    def unembed(self, final_norm: str, unembed: str) -> list[dict]:
        """Each TP rank's final norm and unembedding slice (see ``CaptureWorker.nnvllm_unembed``); a
        read the worker answers between a stream's steps too (:meth:`EngineLock.rpc`)."""
        import pickle

        return [pickle.loads(b) for b in self.llm.collective_rpc(UNEMBED, args=(final_norm, unembed))]

    def readout(self, target: int, versus: int | None, ids: list[int], positions: list[int]) -> list[dict]:
        """Each TP rank's part of a direct logit attribution's readout (``CaptureWorker.nnvllm_readout``)."""
        import pickle

        return [pickle.loads(b) for b in self.llm.collective_rpc(READOUT, args=(target, versus, ids, positions))]

    def info(self) -> dict:
        eng = self.llm.llm_engine
        return {"dtype": str(eng.model_config.dtype), "vocab_size": eng.model_config.get_vocab_size(),
                "tp": eng.vllm_config.parallel_config.tensor_parallel_size,
                "max_num_seqs": eng.vllm_config.scheduler_config.max_num_seqs, **speed_settings(eng.vllm_config)}

    def sleep_support(self) -> tuple[bool, bool]:
        from vllm.platforms import current_platform

        return (current_platform.is_sleep_mode_available(),
                bool(getattr(self.llm.llm_engine.model_config, "enable_sleep_mode", False)))

    def sleep(self, level: int) -> None:
        with self.lock.call("model.sleep()"):
            self.llm.sleep(level)

    def wake(self) -> None:
        with self.lock.call("model.wake()"):
            self.llm.wake_up()


@contextlib.contextmanager
def interruptible(llm):
    """Let Ctrl-C (a notebook's stop button) end a generation between engine steps, cleanly.

    An in-process engine steps in this thread; an interrupt landing inside a step left its requests
    in vLLM's scheduler and the next call spun forever. While this is active, the first SIGINT only
    sets a flag; before its next step the engine aborts every unfinished request and
    ``KeyboardInterrupt`` is raised, so the engine is ready for the next call. A second SIGINT
    interrupts at once (for a step that never returns).
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    eng = llm.llm_engine
    asked = threading.Event()
    real_step = eng.step

    def on_sigint(signum, frame):
        if asked.is_set():
            raise KeyboardInterrupt
        asked.set()

    def step(*args, **kwargs):
        if asked.is_set():
            pending = list(getattr(eng.output_processor, "request_states", {}))
            if pending:
                eng.abort_request(pending, internal=True)
            from .procs import Interrupted

            raise Interrupted("generation interrupted; its requests were aborted and the engine is ready")
        return real_step(*args, **kwargs)

    previous = signal.signal(signal.SIGINT, on_sigint)
    eng.step = step
    try:
        yield
    finally:
        del eng.step  # the instance attribute; the class's step is back
        signal.signal(signal.SIGINT, previous)


def engine_of(model):
    """The model's transport: its own (an isolated model's :class:`~nnvllm.engine.isolated.RemoteEngine`)
    or :class:`InProcessEngine`."""
    own = getattr(type(model), "_engine_adapter", None)
    return own(model) if own is not None else InProcessEngine(model)
