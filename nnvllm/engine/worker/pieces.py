"""How each step of a graph engine runs: its full CUDA graph, the graph in pieces with nnsight's
traces served between them, or eagerly.

A replayed CUDA graph runs no Python, so an nnsight trace (``with model.trace(...)``) cannot be
served inside one. vLLM's *breakable* graphs (``VLLM_USE_BREAKABLE_CUDAGRAPH=1``) are recorded in
pieces: a Python callable registered while a piece is recorded runs between two pieces on every
replay (nnsight's own ``taps`` use this). nnvllm's graph engine records, for every decode batch
size, both vLLM's full graph and such a piecewise graph whose seams are every block's output (and
vLLM's attention, which a piecewise graph runs eagerly). Each decode step then runs

- its **full graph** when no trace is in it (``nv.generate``, ``nv.collect``: nnvllm's own taps
  are recorded inside both kinds of graph);
- its **piecewise graph** when every trace in it waits only at block outputs (or outside the
  model's forward: logits, samples): the trace is served at the seams, reads and edits alike, at
  close to graph speed;
- **eagerly** when a trace waits anywhere else (a submodule, a block's input, an operation inside
  a forward, a ``tracer.cache()`` of such places), when ``model.edit`` is installed, or when an
  nnvllm capture needs it (non-additive edits, sites not recorded in the graphs).

Prefill and mixed steps run eagerly, as on an engine without piecewise graphs.

nnsight counts the visits of every location to match a trace's ``tracer.iter`` step to the model's.
A piecewise step visits only the seams, so after it the locations inside the forward that it did
not visit are counted as an eager step would have (:meth:`StepPlan.finish`). A trace that, in a
piecewise step, went on from a seam to a location inside the forward missed it; it ends with an
error that says so (its first step and any step where it waits there at the start run eagerly).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import torch

GRAPHS, PIECES, EAGER = "graphs", "pieces", "eager"


def breakable_graphs() -> bool:
    """Whether this vLLM records breakable (piecewise) CUDA graphs and they are switched on."""
    try:
        from vllm.compilation.breakable_cudagraph import is_breakable_cudagraph_enabled
    except ImportError:
        return False
    return bool(is_breakable_cudagraph_enabled())


def _interleaver_class():
    """nnsight's graph-aware interleaver, serving seams (``graph_taps``) in piecewise steps and every
    location in eager ones (nnsight's own skips non-taps everywhere), and learning which locations
    lie inside the recorded graphs."""
    from nnsight.intervention.interleaver import Interleaver
    from nnsight.modeling.vllm.interleaver import VLLMInterleaver, _capture, _weak

    class PieceInterleaver(VLLMInterleaver):
        def handle(self, provider: str, value: Any) -> Any:
            if self.learning and torch.cuda.is_current_stream_capturing():
                self.in_graph.add(provider)
            if provider in self.graph_taps:
                capture = _capture()
                if capture is not None:  # recording a piecewise graph: serve here on every replay
                    live = _weak(value)
                    capture.add_eager(lambda: self.replay(provider, live))
                    return value
            return Interleaver.handle(self, provider, value)

        def _reindex_parked(self) -> None:
            super()._reindex_parked()
            for m in self.mediators:
                p = m.pending
                if p is not None and p.provider is not None and self.off_seams(p.provider):
                    m.nnvllm_eager = True  # it reads inside the forward: its later steps run eagerly

        def off_seams(self, provider: str) -> bool:
            """Whether ``provider`` lies inside the recorded forward and is not a seam."""
            if provider in self.graph_taps:
                return False
            if provider in self.in_graph:
                return True
            module, sourced, _ = provider.partition(".source.")  # an operation inside a forward
            return bool(sourced) and (module + ".output") in self.in_graph

    return PieceInterleaver


class StepPlan:
    """The runner's choice of how each step runs, and the bookkeeping a piecewise step needs."""

    def __init__(self, runner: Any, blocks: str, n_layers: int) -> None:
        self.runner = runner
        self.pieces = False  # piecewise graphs are recorded (see before_capture)
        self.modes: collections.Counter = collections.Counter()  # steps run per mode (nnvllm_step_modes)
        self.mode: str | None = None  # this step's
        self.before: dict[str, int] | None = None  # nnsight's visit counts before a traced step
        self.per_step: dict[str, int] = {}  # visits an eager step makes inside the forward, off the seams
        if runner.device.type != "cuda" or not breakable_graphs() or not hasattr(runner, "nnsight_model"):
            return
        from vllm.config import CUDAGraphMode

        il = runner.nnsight_model.interleaver
        il.__class__ = _interleaver_class()
        il.graph_taps = frozenset(f"model.{blocks}.{j}.output" for j in range(n_layers))
        il.in_graph, il.learning = set(), False
        disp = runner.cudagraph_dispatcher
        dispatch = disp.dispatch

        def no_full_in_pieces(*args, **kwargs):
            if self.mode == PIECES:
                kwargs["invalid_modes"] = set(kwargs.get("invalid_modes") or ()) | {CUDAGraphMode.FULL}
            return dispatch(*args, **kwargs)

        disp.dispatch = no_full_in_pieces

    # ---- recording
    def before_capture(self) -> None:
        """Record piecewise graphs for the decode batch sizes only (prefill runs eagerly), and learn
        which locations the recorded forward visits. Piecewise steps are on when vLLM (its attention
        backend having had its say) records both kinds of graph."""
        il = getattr(getattr(self.runner, "nnsight_model", None), "interleaver", None)
        if not hasattr(il, "graph_taps"):
            return
        from vllm.config import CUDAGraphMode

        keys = self.runner.cudagraph_dispatcher.cudagraph_keys
        if not keys[CUDAGraphMode.PIECEWISE] or not keys[CUDAGraphMode.FULL]:
            return
        keys[CUDAGraphMode.PIECEWISE] = {dataclasses.replace(k, num_reqs=None, uniform=False)
                                        for k in keys[CUDAGraphMode.FULL]}
        il.learning = self.pieces = True

    def after_capture(self) -> None:
        il = getattr(getattr(self.runner, "nnsight_model", None), "interleaver", None)
        if il is not None and hasattr(il, "learning"):
            il.learning = False

    # ---- each step
    def choose(self, decode: bool) -> str:
        """How the step about to run should run (before vLLM dispatches it)."""
        r = self.runner
        cap = getattr(r, "_nnvllm_capture", None)
        if cap is not None and cap.need_eager:
            return EAGER
        if self.pieces and not decode:
            return EAGER  # prefill and mixed steps: eager, as on a FULL_DECODE_ONLY engine
        reqs = getattr(r, "nnsight_requests", None)
        if reqs is None:
            return GRAPHS
        if reqs.templates:
            return EAGER  # model.edit runs on every request
        il = r.nnsight_model.interleaver
        if not il.mediators:
            return GRAPHS
        if not self.pieces:
            return EAGER
        for m in il.mediators:
            p = m.pending
            if getattr(m, "nnvllm_eager", False) or (p is not None and p.provider is not None
                                                     and il.off_seams(p.provider)):
                return EAGER
        if any(il.off_seams(p) for p in il.observers):
            return EAGER  # a tracer.cache() of locations inside the forward
        return PIECES

    def start(self, dispatched: Any) -> None:
        """The step's mode as vLLM dispatched it (a batch too large for a graph runs eagerly)."""
        name = getattr(dispatched, "name", str(dispatched))
        self.mode = {"FULL": GRAPHS, "PIECEWISE": PIECES}.get(name, EAGER)
        self.modes[self.mode] += 1
        il = getattr(getattr(self.runner, "nnsight_model", None), "interleaver", None)
        self.before = dict(il.counts) if self.pieces and il is not None and il.mediators else None

    def finish(self) -> None:
        """After the forward: keep nnsight's visit counts as an eager step would leave them; end the
        traces that missed a location inside a piecewise step."""
        before, self.before = self.before, None
        mode, self.mode = self.mode, None
        if before is None:
            return
        il = self.runner.nnsight_model.interleaver
        counts = il.counts
        if mode == EAGER:
            self.per_step = {p: n - before.get(p, 0) for p, n in counts.items()
                             if n != before.get(p, 0) and il.off_seams(p)}
            return
        if mode != PIECES:
            return
        for p, d in self.per_step.items():
            if counts.get(p, 0) == before.get(p, 0):
                counts[p] = counts.get(p, 0) + d
        for m in list(il.mediators):
            p = m.pending
            if (p is not None and p.provider is not None and p.iteration is not None
                    and il.off_seams(p.provider) and p.iteration < m.occurrence(p.provider)):
                _missed(m, p.provider)


def _missed(mediator: Any, provider: str) -> None:
    """End a trace that waited, in a piecewise step, for a location that step does not visit."""
    from greenlet import getcurrent
    from nnsight.intervention.interleaver import OutOfOrderError

    error = OutOfOrderError(
        f"'{provider}' lies inside the model's forward, and this trace first asked for it in a generation "
        "step that ran as a CUDA graph in pieces, which stops only at the blocks' outputs. A trace that "
        "waits there at the start of a step (for example, reads it at every step) runs that step eagerly; "
        "read it from the trace's first step on, or load the model with cuda_graphs=False.")
    try:
        mediator.worker.parent = getcurrent()
        mediator.pending = mediator.worker.throw(error)
        return  # the block caught it and went on
    except BaseException as thrown:  # noqa: BLE001 (it ends the request, as the interleaver's deferred errors do)
        mediator.exception = thrown
    mediator.pending = None
