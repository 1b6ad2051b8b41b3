"""How each step of a graph engine runs: its whole CUDA graph, the same graph in pieces with nnsight's
traces served between them, or eagerly.

A replayed CUDA graph runs no Python, so an nnsight trace (``with model.trace(...)``) cannot be
served inside one. For every decode batch size nnvllm's graph engine records vLLM's full graph twice:
whole, and in pieces whose seams are the blocks' outputs. The pieces are recorded with vLLM's
breakable capture (:class:`~vllm.compilation.breakable_cudagraph.BreakableCUDAGraphCapture`): a
Python callable registered while a piece is recorded runs between two pieces on every replay
(nnsight's own ``taps`` use it; nnsight's handoff is that callable). The step's runtime mode stays
FULL while they are recorded, so vLLM's attention is recorded inside the pieces, as in the whole
graph, and the seams are the blocks' outputs only. Each decode step then runs

- its **whole graph** when no trace is in it (``nv.generate``, ``nv.collect``: nnvllm's own taps
  are recorded inside both recordings), and when every trace in it waits outside the model's
  forward (``model.logits``, ``model.samples``, the result): nothing inside the forward is served;
- its **graph in pieces** when every trace in it waits only at block outputs (or outside the
  forward): the trace is served at the seams, reads and edits alike, each seam's value from the
  step's slot of a ring the pieces copy it into (:mod:`.ring`), or a clone;
- **eagerly** when a trace waits anywhere else (a submodule, a block's input, an operation inside
  a forward, a ``tracer.cache()`` of such places), when ``model.edit`` is installed, or when an
  nnvllm capture needs it (non-additive edits, sites not recorded in the graphs).

Prefill and mixed steps run eagerly (the engine records decode graphs only).

nnsight counts the visits of every location to match a trace's ``tracer.iter`` step to the model's.
A step in pieces visits only the seams, and a traced step on the whole graph none, so after it the
locations inside the forward that it did not visit are counted as an eager step would have
(:meth:`StepPlan.finish`). A trace that, in such a
step, went on from a seam to a location inside the forward missed it; it ends with an error that
says so (its first step and any step where it waits there at the start run eagerly).

``NNVLLM_TRACE_PIECES=0`` (in the engine's environment, so before ``nv.load``) records no pieces:
every traced step then runs eagerly.

A decode step that a trace makes eager is noted for the trace's requests, with the reason; the client
says so in one warning after the trace (:func:`nnvllm.engine.transport.eager_notice`).
"""

from __future__ import annotations

import collections
import itertools
import operator
import time
from typing import Any

import torch

from .ring import Ring, ring_bytes

GRAPHS, PIECES, EAGER = "graphs", "pieces", "eager"


def trace_pieces() -> bool:
    """Whether a graph engine records its decode graphs in pieces too, so that a step carrying an
    nnsight trace that reads or edits only the blocks' outputs replays them instead of running
    eagerly: on where vLLM has breakable CUDA graph capture; ``NNVLLM_TRACE_PIECES=0`` turns it off."""
    from ..models import _switch

    if not _switch("NNVLLM_TRACE_PIECES"):
        return False
    try:
        import vllm.compilation.breakable_cudagraph  # noqa: F401
    except ImportError:
        return False
    return True


def _tensors(x: Any) -> list:
    """The tensors in ``x`` (a tensor, or tuples, lists and dicts of them), in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def _each(x: Any, fn: Any) -> Any:
    """``fn`` applied to each tensor in ``x``; a tensor and a plain tuple of tensors (a block's output)
    without nnsight's general walk, which costs more than the copy at a seam."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if type(x) is tuple:
        return tuple([_each(v, fn) for v in x])
    from nnsight.util import apply

    return apply(x, fn, torch.Tensor)


def _cut(t: torch.Tensor, total: int) -> torch.Tensor:
    """``t`` cut to the step's first ``total`` tokens: a graph recorded for a batch size fills only
    those with this step's tokens; the rest is padding no request owns. The tokens are the first
    dimension, or the second under a batch of one (vLLM's Transformers backend: ``[1, tokens,
    width]``, which nnsight's batcher splits among the invokes only when it holds the step's tokens)."""
    if t.dim() and t.shape[0] > total:
        return t[:total]
    if t.dim() >= 3 and t.shape[0] == 1 and t.shape[1] > total:
        return t[:, :total]
    return t


def _copy_rows(x: Any, total: int) -> Any:
    """A copy of ``x``'s tensors cut to ``total`` rows (:func:`_cut`), in one walk."""
    if isinstance(x, torch.Tensor):
        return _cut(x, total).clone()
    return _each(x, lambda t: _cut(t, total).clone())


def _interleaver_class():
    """nnsight's graph-aware interleaver, serving seams (``graph_taps``) in steps in pieces and every
    location in eager ones (nnsight's own skips non-taps everywhere), and learning which locations
    lie inside the recorded graphs."""
    from nnsight.intervention.interleaver import Interleaver
    from nnsight.modeling.vllm.interleaver import VLLMInterleaver, _capture, _copy_into, _weak

    class PieceInterleaver(VLLMInterleaver):
        def replay(self, location: str, live: Any, held: Any = None) -> None:
            # A replayed graph writes every step's seams into the same memory, so a trace that
            # keeps what it is served (``h.output.save()`` at every step, a cache) is served its own
            # copy, as an eager step's output is a tensor of its own: the step's slot of the ring,
            # which the graph wrote at this seam (``held``, .ring), or else a clone; what the trace
            # leaves in the copy (an assignment, an in-place edit) lands back in the graph's memory.
            if not self.interleaving or (location not in self.parked and not self.observers.get(location)):
                return super().replay(location, live)  # (nothing served: the visit is counted)
            t0 = time.perf_counter()
            total = self.batcher.total
            slot = None if held is None else self.ring.slot
            # The copy is a normal tensor, not an inference tensor like the step's: it keeps a version
            # counter, which an in-place edit moves, so a trace that only reads costs no write-back.
            # (The C++ guard, which torch.inference_mode(False) wraps: this runs at every seam.)
            with torch._C._InferenceMode(False):
                tc = time.perf_counter()
                served = _copy_rows(live, total) if slot is None else held.serve(slot, total)
                tc = time.perf_counter() - tc
            kept = _tensors(served)
            versions = [t._version for t in kept]
            t1 = time.perf_counter()
            out = self.handle(location, served)
            t2 = time.perf_counter()
            if out is served:  # read, or edited in place
                edited = any(t._version != v for t, v in zip(kept, versions))
            else:  # swapped, or a part of it
                after = _tensors(out)
                edited = len(after) != len(kept) or any(a is not t or a._version != v
                                                        for a, t, v in zip(after, kept, versions))
            if edited:
                _copy_into(_each(live, lambda t: _cut(t, total)), out)
            clock = self.seam_clock  # (nnvllm_step_modes: where a seam's host time goes)
            clock[0] += 1
            clock[1] += t1 - t0 + time.perf_counter() - t2
            clock[2] += t2 - t1
            clock[3] += tc
            clock[4] += slot is not None

        def handle(self, provider: str, value: Any) -> Any:
            if self.learning and torch.cuda.is_current_stream_capturing():
                self.in_graph.add(provider)
                if provider in self.graph_taps and self.ring is not None:
                    self.ring.learn(provider, value)
            if provider in self.graph_taps and self.recording:
                capture = _capture()  # (~2 µs: only while the pieces are recorded)
                if capture is not None:  # recording the pieces: serve here on every replay
                    live = _weak(value)
                    held = None if self.ring is None else self.ring.record(provider, value)
                    capture.add_eager(lambda: self.replay(provider, live, held))
                    return value
            return Interleaver.handle(self, provider, value)

        def _reindex_parked(self) -> None:
            super()._reindex_parked()
            for m in self.mediators:
                p = m.pending
                if p is not None and p.provider is not None and self.off_seams(p.provider):
                    m.nnvllm_eager = p.provider  # it reads inside the forward: its later steps run eagerly

        def off_seams(self, provider: str) -> bool:
            """Whether ``provider`` lies inside the recorded forward and is not a seam."""
            if provider in self.graph_taps:
                return False
            if provider in self.in_graph:
                return True
            module, sourced, _ = provider.partition(".source.")  # an operation inside a forward
            return bool(sourced) and (module + ".output") in self.in_graph

    return PieceInterleaver


def _graphs_class(base: type) -> type:
    """vLLM's full-graph wrapper (``base``), which also records each decode graph in pieces and
    replays those in a step the plan runs in pieces."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context, is_forward_context_available

    class GraphsAndPieces(base):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            if not is_forward_context_available():
                return super().__call__(*args, **kwargs)
            ctx = get_forward_context()
            if ctx.cudagraph_runtime_mode != CUDAGraphMode.FULL:
                return super().__call__(*args, **kwargs)
            plan = self.nnvllm_plan
            if plan.mode == PIECES:
                if plan.ring is not None:
                    plan.ring.start(ctx.batch_descriptor.num_tokens)
                return self.nnvllm_pieces(*args, **kwargs)
            if plan.mode == EAGER:  # a trace, and no pieces of this size: the forward itself
                return self.runnable(*args, **kwargs)
            entry = self.concrete_cudagraph_entries.get(ctx.batch_descriptor)
            recording = entry is None or entry.cudagraph is None
            if recording and plan.ring is not None:
                plan.ring.tokens = ctx.batch_descriptor.num_tokens
            out = super().__call__(*args, **kwargs)
            if recording:
                # The same inputs (vLLM's static buffers), recorded again in pieces; the whole graph's
                # output is still held, so the pieces' memory does not overlap it. Under torch.compile
                # the pieces are the plain forward, whose seams are nnsight's hooks.
                skip, ctx.skip_compiled = ctx.skip_compiled, True
                if plan.ring is not None:  # (the whole graph's recording has shown the seams' outputs)
                    plan.ring.make(ctx.batch_descriptor.num_tokens)
                il = plan.runner.nnsight_model.interleaver
                il.recording = True
                try:
                    self.nnvllm_pieces(*args, **kwargs)
                finally:
                    ctx.skip_compiled = skip
                    il.recording = False
                if plan.ring is not None:  # (under torch.compile the layouts are learned only now: made in
                    plan.ring.make(ctx.batch_descriptor.num_tokens)  # this first size's window all the same)
            return out

        def nnvllm_has_pieces(self, descriptor: Any) -> bool:
            entry = self.nnvllm_pieces.entries.get(descriptor)
            return entry is not None and entry.capture is not None

    return GraphsAndPieces


class StepPlan:
    """The runner's choice of how each step runs, and the bookkeeping a step in pieces needs."""

    def __init__(self, runner: Any, blocks: str, n_layers: int, largest: int = 0) -> None:
        self.runner = runner
        self.pieces = False  # decode graphs are recorded in pieces too
        self.graphs: Any = None  # vLLM's full-graph wrapper, once it records pieces too
        self.modes: collections.Counter = collections.Counter()  # steps run per mode (nnvllm_step_modes)
        self.seconds = 0.0  # the worker's host time in steps (nnvllm_step_modes's step_seconds)
        self.longest = 0.0  # the longest of those (step_longest)
        # Seams served in steps in pieces; host seconds in nnvllm's copies at them; in nnsight's serving
        # (the traces' code included: nnsight's invokes are greenlets on this thread); in the copies'
        # clones or the ring's views alone; seams served from the ring.
        self.seams: list = [0, 0.0, 0.0, 0.0, 0]
        self.ring: Ring | None = None  # where a step in pieces keeps what its seams serve (.ring)
        self.mode: str | None = None  # this step's
        # The step carries nnsight's work (a trace, model.edit): under torch.compile its forward runs
        # uncompiled, where nnsight's hooks are (see RecordingRunner._model_forward).
        self.uncompiled = False
        self.before: dict[str, int] | None = None  # nnsight's visit counts before a traced step
        self.per_step: dict[str, int] = {}  # visits an eager step makes inside the forward, off the seams
        # The visits a step of each mode owes nnsight's counts, as (locations, visits) (from per_step).
        self._owed: dict[str, tuple[tuple, tuple]] = {GRAPHS: ((), ()), PIECES: ((), ())}
        self.traced = False  # the step carries a trace (its counts are kept in finish)
        # Why traced decode steps ran eagerly on a graph engine, per request: {request id: [why, steps,
        # (ids the request is known by)]}, until the client asks (CaptureWorker.nnvllm_eager_notes).
        self.notes: dict[str, list] = {}
        self.graph_engine = runner.device.type == "cuda" and not getattr(runner.model_config, "enforce_eager", True)
        if runner.device.type != "cuda" or not hasattr(runner, "nnsight_model") or not trace_pieces():
            return
        from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper
        from vllm.compilation.cuda_graph import CUDAGraphWrapper
        from vllm.config import CUDAGraphMode

        # After load_model, vLLM's full-graph wrapper is the runner's model. Swapped now, before vLLM
        # profiles the graphs' memory, so that the profile records the pieces too.
        graphs = runner.model
        if type(graphs) is not CUDAGraphWrapper or graphs.runtime_mode != CUDAGraphMode.FULL:
            return  # no full graphs (eager, or wrapped otherwise, e.g. micro-batching): traced steps run eagerly
        graphs.__class__ = _graphs_class(CUDAGraphWrapper)
        graphs.nnvllm_plan = self
        graphs.nnvllm_pieces = BreakableCUDAGraphWrapper(graphs.runnable, graphs.vllm_config,
                                                         runtime_mode=CUDAGraphMode.FULL)
        self.graphs = graphs
        il = runner.nnsight_model.interleaver
        il.__class__ = _interleaver_class()
        il.graph_taps = frozenset(f"model.{blocks}.{j}.output" for j in range(n_layers))
        il.in_graph, il.learning, il.recording = set(), False, False
        il.seam_clock = self.seams
        budget = ring_bytes()
        self.ring = il.ring = Ring(runner.device, budget, largest) if budget else None
        self.pieces = True

    def timings(self) -> dict:
        """The steps run per mode and the host time in them since the last :meth:`reset`
        (``CaptureWorker.nnvllm_step_modes``)."""
        out = {**self.modes, "step_seconds": self.seconds, "step_longest": self.longest}
        if self.pieces:
            n, copy, serve, clones, ring = self.seams
            out.update(seams_served=n, seam_copy_seconds=copy, seam_serve_seconds=serve, seam_clone_seconds=clones,
                       seams_from_ring=ring, ring_rows=self.ring.rows if self.ring is not None else 0)
        return out

    def reset(self) -> None:
        self.modes.clear()
        self.seconds = self.longest = 0.0
        self.seams[:] = [0, 0.0, 0.0, 0.0, 0]

    # ---- recording
    def before_capture(self) -> None:
        """Learn which locations the recorded forward visits (nnsight's handoff runs while vLLM
        records the graphs)."""
        if self.pieces:
            self.runner.nnsight_model.interleaver.learning = True

    def after_capture(self) -> None:
        if self.pieces:
            self.runner.nnsight_model.interleaver.learning = False

    # ---- each step
    def choose(self, decode: bool) -> str:
        """How the step about to run should run (before vLLM dispatches it). A decode step that a
        trace makes eager on a graph engine is noted for the trace's requests (:meth:`take_notes`)."""
        mode, why = self._choose()
        reqs = getattr(self.runner, "nnsight_requests", None)
        self.uncompiled = reqs is not None and bool(reqs.templates or self.runner.nnsight_model.interleaver.mediators)
        if mode == EAGER and why is not None and decode and self.graph_engine:
            self._note(why)
        return mode

    def _choose(self) -> tuple[str, str | None]:
        r = self.runner
        cap = getattr(r, "_nnvllm_capture", None)
        if cap is not None and cap.need_eager:
            return EAGER, None  # nnvllm's own capture (nv.generate reports it in its stats)
        reqs = getattr(r, "nnsight_requests", None)
        if reqs is None:
            return GRAPHS, None
        if reqs.templates:
            return EAGER, "model.edit is installed (its edits run on every request)"
        il = r.nnsight_model.interleaver
        if not il.mediators:
            return GRAPHS, None
        if not self.pieces:
            return EAGER, ("this engine records no graphs in pieces (NNVLLM_TRACE_PIECES=0, or a vLLM "
                           "without breakable CUDA graph capture)")
        for m in il.mediators:
            p = m.pending
            where = getattr(m, "nnvllm_eager", None) or (
                p.provider if p is not None and p.provider is not None and il.off_seams(p.provider) else None)
            if where:
                return EAGER, f"a trace reads {where}, inside the forward, not a block's output"
        for p in il.observers:
            if il.off_seams(p):
                return EAGER, f"a tracer.cache() keeps {p}, inside the forward, not a block's output"
        # Every trace waits after the forward (a trace of the logits or samples alone): the whole graph,
        # once an eager traced step has shown which locations a forward visits (a trace's first step,
        # its prefill, is one), since finish counts them.
        if (il.graph_taps <= self.per_step.keys() and not any(p in il.graph_taps for p in il.observers)
                and all(_after_forward(il, m.pending) for m in il.mediators)):
            return GRAPHS, None
        return PIECES, None

    def _note(self, why: str) -> None:
        r = self.runner
        traced = {id(m) for m in r.nnsight_model.interleaver.mediators}
        for request in r.nnsight_requests.requests.values():
            if id(request.mediator) in traced:  # a trace's own worker (not model.edit's copies)
                note = self.notes.setdefault(request.id, [why, 0, {request.id, request.stem, request.engine_id}])
                note[1] += 1
        while len(self.notes) > 4096:  # requests whose client never asked (a failed call)
            self.notes.pop(next(iter(self.notes)))

    def take_notes(self, request_ids: list[str] | None) -> dict[str, tuple[str, int]]:
        """The notes of the named requests (the client's ids; None: every request's), removed here:
        ``{id: (why, steps)}``."""
        out = {}
        for key in list(self.notes):
            why, steps, names = self.notes[key]
            hit = names if request_ids is None else names & set(request_ids)
            if hit:
                out[min(hit)] = (why, steps)
                del self.notes[key]
        return out

    def start(self, dispatched: Any, descriptor: Any) -> None:
        """The step's mode as vLLM dispatched it (prefill, and a batch too large for a graph, run
        eagerly; a traced step runs in pieces only where they were recorded for its size)."""
        if getattr(dispatched, "name", str(dispatched)) != "FULL" or (
                self.mode == PIECES and not self.graphs.nnvllm_has_pieces(descriptor)):
            self.mode = EAGER
        self.modes[self.mode] += 1
        il = getattr(getattr(self.runner, "nnsight_model", None), "interleaver", None)
        self.traced = self.pieces and il is not None and bool(il.mediators)
        self.before = dict(il.counts) if self.traced and self.mode == EAGER else None

    def finish(self) -> None:
        """After the forward: keep nnsight's visit counts as an eager step would leave them; end the
        traces that missed a location inside a step in pieces."""
        before, self.before = self.before, None
        mode, self.mode = self.mode, None
        traced, self.traced = self.traced, False
        if not traced:
            return
        il = self.runner.nnsight_model.interleaver
        counts = il.counts
        if mode == EAGER:
            self.per_step = {p: n - before.get(p, 0) for p, n in counts.items()
                             if n != before.get(p, 0) and (p in il.graph_taps or il.off_seams(p))}
            keys = tuple(self.per_step)
            off = tuple(p for p in keys if p not in il.graph_taps)
            self._owed = {GRAPHS: (keys, tuple(self.per_step[p] for p in keys)),  # it visited nothing
                          PIECES: (off, tuple(self.per_step[p] for p in off))}  # it visited the seams
            return
        if mode not in (PIECES, GRAPHS):
            return
        keys, visits = self._owed[mode]
        # (One dict update over C iterators: several hundred locations after every step.)
        counts.update(zip(keys, map(operator.add, map(counts.get, keys, itertools.repeat(0)), visits)))
        if mode != PIECES:
            return  # (the whole graph: every trace waited after the forward, and missed nothing inside it)
        for m in list(il.mediators):
            p = m.pending
            if (p is not None and p.provider is not None and p.iteration is not None
                    and il.off_seams(p.provider) and p.iteration < m.occurrence(p.provider)):
                _missed(m, p.provider)


def _after_forward(il: Any, pending: Any) -> bool:
    """Whether a trace's ``pending`` request (None: it has none) waits after the model's forward (the
    logits, the samples, the result) or nowhere."""
    if pending is None:
        return True
    where = pending.provider
    return where is not None and where not in il.graph_taps and not il.off_seams(where)


def _missed(mediator: Any, provider: str) -> None:
    """End a trace that waited, in a step in pieces, for a location that step does not visit."""
    from greenlet import getcurrent
    from nnsight.intervention.interleaver import OutOfOrderError

    error = OutOfOrderError(
        f"'{provider}' lies inside the model's forward, and this trace first asked for it in a generation "
        "step that ran as a CUDA graph in pieces, which stop only at the blocks' outputs. A trace that "
        "waits there at the start of a step (for example, reads it at every step) runs that step eagerly; "
        "read it from the trace's first step on, or load the model with cuda_graphs=False.")
    try:
        mediator.worker.parent = getcurrent()
        mediator.pending = mediator.worker.throw(error)
        return  # the block caught it and went on
    except BaseException as thrown:  # noqa: BLE001 (it ends the request, as the interleaver's deferred errors do)
        mediator.exception = thrown
    mediator.pending = None
