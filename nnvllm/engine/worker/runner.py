"""The runner and worker mixins that vLLM's worker classes (:mod:`.gpu`, :mod:`.cpu`) are built from.

:class:`RecordingRunner` installs the taps at model load and places each step's rows after the
forward; :class:`CaptureWorker` is what the client reaches through ``collective_rpc``: arm a capture,
collect it, hand it over. The client never imports this module; the client side of a capture is
:func:`nnvllm.capture.generate`.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner

from ..heap import gc_delta, gc_pauses
from .arena import _HOST, _Capture
from .handoff import _SPARES, sweep_stale, watch_server
from .pieces import EAGER, StepPlan
from .taps import _site_widths, _Taps, head_layout

class RecordingRunner:
    """Model-runner mixin (first in the MRO): installs the taps at load, places rows each step.

    Also keeps nnsight's tracing honest on an engine that replays CUDA graphs: a step that carries an
    nnsight trace runs in graph pieces with the trace served at the blocks' outputs, or eagerly where
    the trace reads elsewhere (:mod:`.pieces`).
    """

    def load_model(self, *args, **kwargs) -> None:
        from ..logs import dump_stacks_if_asked

        dump_stacks_if_asked()  # (NNVLLM_STACKS: where a stuck worker waits, see docs/engines.md)
        super().load_model(*args, **kwargs)
        from ..trace_payload import envoy_ids
        from ..trace_saves import saves_travel_as_bytes

        self.nnsight_persistent_objects.update(envoy_ids(self.nnsight_model))  # (trace_payload.envoys_by_reference)
        saves_travel_as_bytes()
        self.nnvllm_install()  # before vLLM records its CUDA graphs (capture_model comes later)
        sweep_stale()
        watch_server()

    def nnvllm_install(self) -> None:
        if getattr(self, "_nnvllm_taps", None) is not None:
            return
        from ...arch import arch_for

        a = arch_for(self.model_config.architectures).in_engine(self.get_model())
        arch = {"family": a.family, "blocks": a.blocks, "sites": dict(a.sites), "merged_gate_up": a.merged_gate_up,
                "heads": head_layout(a, self.get_model(), self.model_config.hf_config)}
        cap = 0
        if self.device.type == "cuda" and not self.model_config.enforce_eager:
            sizes = getattr(self, "cudagraph_batch_sizes", None) or []
            cap = max(sizes) if sizes else int(
                getattr(self.compilation_config, "max_cudagraph_capture_size", 0) or 0)
        is_compiled = compiled(self)
        if is_compiled:
            _plain_native_ops(self.get_model())
        taps = _Taps(self, arch, cap, compiled=is_compiled)
        taps.widths = _site_widths(self.get_model(), arch, taps.tp)
        if cap:
            taps.allocate_static(taps.widths)
        self._nnvllm_taps = taps
        self._nnvllm_capture = None
        self._nnvllm_plan = StepPlan(self, arch["blocks"], taps.n_layers, cap)

    def capture_model(self, *args, **kwargs):
        return _recording(self, super().capture_model, *args, **kwargs)

    def profile_cudagraph_memory(self, *args, **kwargs):
        # vLLM records the graphs once before it sizes the KV cache, to size their memory: recorded as
        # capture_model records them (nnsight's interleaver open, as nnsight's runner opens it there), so
        # that the pieces' handoffs and the trace ring's slots (.ring: made in this first recording, and
        # kept) are in what it counts.
        interleaver = self.nnsight_model.interleaver
        with interleaver:
            interleaver.busy = True
            return _recording(self, super().profile_cudagraph_memory, *args, **kwargs)

    def _determine_batch_execution_and_padding(self, *args, **kwargs):
        plan = getattr(self, "_nnvllm_plan", None)
        if plan is None or kwargs.get("force_uniform_decode") is not None:
            return super()._determine_batch_execution_and_padding(*args, **kwargs)  # recording, warm-up
        plan.mode = plan.choose(_decode_step(self, args, kwargs))
        if plan.mode == EAGER:
            kwargs["force_eager"] = True
        out = super()._determine_batch_execution_and_padding(*args, **kwargs)
        plan.start(out[0], out[1])
        return out

    def _model_forward(self, *args, **kwargs):
        plan, taps = getattr(self, "_nnvllm_plan", None), getattr(self, "_nnvllm_taps", None)
        if plan is not None and taps is not None and taps.compiled:
            plan.modes["plain" if plan.uncompiled else "compiled"] += 1
            if plan.uncompiled:
                from vllm.forward_context import get_forward_context

                get_forward_context().skip_compiled = True  # nnsight's hooks run only in the plain forward
        return super()._model_forward(*args, **kwargs)

    # ---- nnsight's per-request work, only in steps that carry some
    def _update_states(self, scheduler_output) -> None:
        if _nnsight_idle(self, scheduler_output.scheduled_new_reqs):
            plan = getattr(self, "_nnvllm_plan", None)
            # (A step that schedules no token runs no forward: under async scheduling one retires
            # the requests that finished in the step before.)
            if plan is not None and scheduler_output.total_num_scheduled_tokens:
                plan.modes["untraced"] += 1
            return super(NNsightGPUModelRunner, self)._update_states(scheduler_output)
        return super()._update_states(scheduler_output)

    def sample_tokens(self, *args, **kwargs):
        t = time.perf_counter()
        try:
            if _nnsight_idle(self):
                return super(NNsightGPUModelRunner, self).sample_tokens(*args, **kwargs)
            return super().sample_tokens(*args, **kwargs)
        finally:
            _host_seconds(self, t)

    def _sample(self, *args, **kwargs):
        if _nnsight_idle(self):
            return super(NNsightGPUModelRunner, self)._sample(*args, **kwargs)
        return super()._sample(*args, **kwargs)

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        t = time.perf_counter()
        taps = getattr(self, "_nnvllm_taps", None)
        cap = getattr(self, "_nnvllm_capture", None)
        if taps is not None:
            taps.fired = {}
            taps._prompt_rows = None
        try:
            out = super().execute_model(scheduler_output, intermediate_tensors)
            plan = getattr(self, "_nnvllm_plan", None)
            if plan is not None:
                plan.finish()
            if cap is not None and out is None:
                cap.step(self)
            return out
        finally:
            _host_seconds(self, t)


def _recording(runner: Any, record: Any, *args, **kwargs) -> Any:
    """vLLM's recording of its graphs (``record``), with the step plan learning what the recorded
    forward visits and outputs (:meth:`.pieces.StepPlan.before_capture`)."""
    plan = getattr(runner, "_nnvllm_plan", None)
    if plan is not None:
        plan.before_capture()
    try:
        return record(*args, **kwargs)
    finally:
        if plan is not None:
            plan.after_capture()


def _allocator_counts() -> dict[str, int]:
    """torch's caching allocator's device calls so far on this GPU (none on the CPU)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    stats = torch.cuda.memory_stats()
    return {"cuda_mallocs": stats.get("num_device_alloc", 0), "cuda_frees": stats.get("num_device_free", 0),
            "cuda_malloc_retries": stats.get("num_alloc_retries", 0)}


def _host_seconds(runner: Any, t: float) -> None:
    """Add the time since ``t`` to the runner's host seconds in its steps (``nnvllm_step_modes``'s
    ``step_seconds``: the worker's share of a call, traces' serving included)."""
    plan = getattr(runner, "_nnvllm_plan", None)
    if plan is not None:
        dt = time.perf_counter() - t
        plan.seconds += dt
        plan.longest = max(plan.longest, dt)


def _nnsight_idle(runner: Any, new_requests: Any = ()) -> bool:
    """Whether nnsight has nothing to do in this step: no request it tracks (a trace's, or one a
    ``model.edit`` block rides), no ``model.edit`` installed, and no arriving request that carries
    nnsight's arguments. Then its runner's per-step work (``Requests.add``/``scope``/``harvest`` over
    every request in the batch, serving the logits and samples to no worker) changes nothing, and the
    step runs vLLM's own ``_update_states``, ``sample_tokens`` and ``_sample``. An untraced request
    that arrives this way is one nnsight never tracks; should a trace join the batch later, nnsight
    counts its tokens as another tenant's, as it does for any request it does not track."""
    reqs = getattr(runner, "nnsight_requests", None)
    if reqs is None or reqs.requests or reqs.templates:
        return False
    for data in new_requests:
        extra = getattr(getattr(data, "sampling_params", None), "extra_args", None) or {}
        if any(str(k).startswith("nnsight") for k in extra):
            return False
    return True


def compiled(runner: Any) -> bool:
    """Whether vLLM runs this runner's forward through torch.compile (``NNVLLM_COMPILE=1``): some module
    of the model carries vLLM's compile decorator, switched on (``do_not_compile`` False)."""
    return any(getattr(m, "do_not_compile", True) is False for m in runner.get_model().modules())


def _plain_native_ops(model: Any) -> None:
    """Run vLLM's custom ops that use their native forward through it directly, not through the
    separate ``torch.compile`` vLLM wraps it in when the engine compiles (e.g. ``SiluAndMul``).

    Inside the compiled forward Dynamo traces the native forward either way. The plain forward, which
    a step carrying an nnsight trace runs, would otherwise compile that wrapper on its first call, and
    the first call is the recording of the graph pieces, where torch refuses to compile ("torch.compile
    cannot JIT compile during CUDA graph capture").
    """
    from vllm.model_executor.custom_op import CustomOp

    for m in model.modules():
        # vLLM's dispatch gives one of the op's own forwards (a method, or a static native forward)
        # or a compiled wrapper of the native one.
        if not isinstance(m, CustomOp):
            continue
        f = m._forward_method
        if f != m.forward_native and getattr(f, "__self__", None) is not m:
            m._forward_method = m.forward_native


def _decode_step(runner: Any, args: tuple, kwargs: dict) -> bool:
    """Whether the step vLLM is dispatching is a pure decode step (every request one new token),
    from the arguments of ``_determine_batch_execution_and_padding``."""
    names = ("num_tokens", "num_reqs", "num_scheduled_tokens_np", "max_num_scheduled_tokens")
    got = dict(zip(names, args))
    got.update({k: kwargs[k] for k in names if k in kwargs})
    q = int(getattr(runner, "uniform_decode_query_len", 1) or 1)
    try:
        return int(got["max_num_scheduled_tokens"]) == q and int(got["num_tokens"]) == int(got["num_reqs"]) * q
    except (KeyError, TypeError):
        return False


class CaptureWorker:
    """Worker methods nnvllm's engine workers carry (reached by name through ``collective_rpc``).

    By name, not as a function: a multiprocess engine serializes RPCs with msgspec, which refuses
    functions. Results are small: the bytes of a capture travel through shared memory.
    """

    def init_device(self) -> None:
        # vLLM starts torch.distributed here (also for one device): keep its store on loopback.
        from ..compat import bind_stores_to_loopback

        bind_stores_to_loopback()
        super().init_device()

    def shutdown(self) -> None:
        _HOST.drop()  # an in-process CPU engine's worker lives in the notebook: its kept memory goes now
        super().shutdown()

    def nnvllm_arm(self, spec: dict) -> None:
        runner = self.model_runner
        runner.nnvllm_install()
        cap = _Capture(runner._nnvllm_taps, spec)
        cap.check_memory()
        runner._nnvllm_taps.arm_edits(spec.get("edits") or [])
        runner._nnvllm_taps.wanted = set(cap.sites) | set(cap.features.sites)
        runner._nnvllm_taps.active = True
        runner._nnvllm_capture = cap

    def nnvllm_disarm(self) -> None:
        runner = self.model_runner
        taps = getattr(runner, "_nnvllm_taps", None)
        if taps is not None:
            taps.active = False
            taps.disarm_edits()
        cap = getattr(runner, "_nnvllm_capture", None)
        runner._nnvllm_capture = None
        _HOST.end()
        if cap is not None and cap.shm is not None:
            cap.shm.discard()

    def nnvllm_spares(self, drop: bool = False) -> dict:
        """This worker's pid, the hand-off files it keeps ready between captures and the handed-over
        ones it keeps for recycling (:class:`_Spares`); ``drop=True`` removes them all (their shared
        memory goes back now; a client's mapping of one stays valid). Reports after the background work
        submitted so far (files being made, let go or released) is done."""
        _SPARES.wait()
        paths = []
        for _, fut in _SPARES.files:
            try:
                paths.append(fut.result(timeout=30).path)
            except Exception:  # noqa: BLE001
                pass
        kept = list(_SPARES.kept)
        if drop:
            _SPARES.drop()
        return {"pid": os.getpid(), "files": paths, "kept": kept}

    def nnvllm_step_modes(self, reset: bool = False) -> dict:
        """How many engine steps ran as whole CUDA graphs, as graphs in pieces (an nnsight trace served
        at the blocks' outputs) and eagerly, since the engine started or the last ``reset``; and whether
        the decode graphs are recorded in pieces too (:mod:`.pieces`). Under ``NNVLLM_COMPILE=1`` also
        how many forwards ran the compiled code (``compiled``) and the plain forward (``plain``: steps
        carrying nnsight's work). ``untraced`` counts the steps in which nnsight had no work, which
        skipped its per-request bookkeeping (:func:`_nnsight_idle`). ``step_seconds``: the worker's host
        time in its steps (``execute_model`` and ``sample_tokens``, traces' serving included), and
        ``step_longest``: the longest of those calls (one stall, or a slower step throughout);
        ``seams_served``: the blocks' outputs served to traces in steps in pieces, with the host seconds
        they took in nnvllm's copies (``seam_copy_seconds``; ``seam_clone_seconds`` of it in the clones,
        or the ring's views, themselves) and in nnsight's serving, the traces' own code included
        (``seam_serve_seconds``); ``seams_from_ring``: those served from the ring's slots, no clone
        (:mod:`.ring`; ``ring_rows``: the tokens a slot holds, 0 without a ring);
        ``worker_gc``, ``worker_gc_full`` and ``worker_gc_young``: this worker process's
        garbage-collection pauses; on a GPU, ``cuda_mallocs``, ``cuda_frees`` and ``cuda_malloc_retries``:
        torch's caching allocator's calls to the device (a retry frees every cached block first); all
        over the same span (the first ask starts the counts)."""
        plan = getattr(self.model_runner, "_nnvllm_plan", None)
        if not hasattr(self, "_nnvllm_since"):
            self._nnvllm_since = (gc_pauses(), _allocator_counts())
        gc0, mem0 = self._nnvllm_since
        mem = _allocator_counts()
        times = plan.timings() if plan is not None else {"step_seconds": 0.0, "step_longest": 0.0}
        out = {"pieces_recorded": plan is not None and plan.pieces, **times, **gc_delta(gc0, "worker_"),
               **{k: n - mem0.get(k, n) for k, n in mem.items()}}
        if reset:
            if plan is not None:
                plan.reset()
            self._nnvllm_since = (gc_pauses(), mem)
        return out

    def nnvllm_eager_notes(self, request_ids: list | None = None) -> dict:
        """Why decode steps of the named requests' traces (None: of every trace since the last ask)
        ran eagerly on this graph engine, and how many: ``{request id: (why, steps)}``, each note given
        once (:meth:`.pieces.StepPlan.take_notes`)."""
        plan = getattr(self.model_runner, "_nnvllm_plan", None)
        return {} if plan is None else plan.take_notes(None if request_ids is None else list(request_ids))

    def nnvllm_peek(self) -> bytes | None:
        """The armed capture's rows since the last peek (nv.stream) as ``torch.save`` bytes (an RPC
        result crosses processes as msgpack, which does not keep tensors), or None when none is armed."""
        cap = getattr(self.model_runner, "_nnvllm_capture", None)
        if cap is None:
            return None
        import io

        buf = io.BytesIO()
        torch.save(cap.peek(), buf)
        return buf.getvalue()

    def nnvllm_collect(self, tokens: dict) -> dict | None:
        runner = self.model_runner
        cap = getattr(runner, "_nnvllm_capture", None)
        taps = getattr(runner, "_nnvllm_taps", None)
        if taps is not None:
            taps.active = False
            taps.disarm_edits()
        runner._nnvllm_capture = None
        if cap is None:
            return None
        try:
            return cap.collect(tokens)
        finally:
            _HOST.end()
            if cap.shm is not None:
                cap.shm.discard()

    def nnvllm_readout(self, target: int, versus: int | None, ids: list[int], positions: list[int]) -> bytes:
        """This rank's part of the direct logit attribution of ``logit[target] - logit[versus]``
        (:class:`nnvllm.heads.Readout`), made where the weights are. The two tokens' unembedding rows
        (summed over the ranks that hold them, so every rank has them) through the final norm give the
        direction ``g``; then per block ``W_O^T g`` for the heads this rank holds (through a
        post-attention norm's weight where the family has one), the output projection's bias dotted
        with it (rank 0 adds that bias), the post-norms as plain values and what an MLP output is read
        with; and the embedding at ``ids`` / ``positions`` dotted with ``g`` for the rows this rank
        holds (the client sums the ranks). Also the final norm, the two rows and the logits' scale and
        soft-cap, for the client's frozen scale and logit difference."""
        import pickle

        from vllm.distributed import tensor_model_parallel_all_reduce

        from ...arch import arch_for
        from ...heads import _bias_dot, _norm_of, _through

        model = self.model_runner.get_model()
        taps = self.model_runner._nnvllm_taps
        a = arch_for(self.model_runner.model_config.architectures)
        ae = a.in_engine(model)
        blocks = model.get_submodule(ae.blocks)
        dev = self.model_runner.device
        toks = torch.tensor([target] + ([versus] if versus is not None else []), device=dev)
        head = model.get_submodule(ae.unembed)
        rows = tensor_model_parallel_all_reduce(_rows(head, toks, taps.tp))  # [1 or 2, d_model]
        bias = getattr(head, "bias", None)
        row_bias = None if bias is None else tensor_model_parallel_all_reduce(_rows(head, toks, taps.tp, bias))
        proc = getattr(model, "logits_processor", None)
        scale = float(getattr(proc, "scale", None) or 1.0)
        cap = getattr(proc, "soft_cap", None)
        final = _norm_of(model.get_submodule(ae.final_norm))
        d = (rows[0] - (rows[1] if versus is not None else 0.0)) * scale
        g = _through(final, d)
        g_bias = _bias_dot(final, d) + (0.0 if row_bias is None else scale * (
            row_bias[0] - (row_bias[1] if versus is not None else 0.0)))
        heads, attn_bias, mlp, attn_norm_bias, mlp_bias, post = [], [], [], [], [], []
        for blk in blocks:
            ga = gm = g
            if a.heads.post_norms:
                na, nm = (_norm_of(blk.get_submodule(p)) for p in a.heads.post_norms)
                ga, gm = _through(na, g), _through(nm, g)
                attn_norm_bias.append(float(_bias_dot(na, g)))
                mlp_bias.append(float(_bias_dot(nm, g)))
                post.append([_plain_norm(n) for n in (na, nm)])
                mlp.append(gm)
            out = blk.get_submodule(taps.heads["out"])
            heads.append(_weight_t(out, self.model_runner.model_config.dtype, dev) @ ga)  # (one copy to the host below)
            b = getattr(out, "bias", None)
            attn_bias.append(float(b.float() @ ga) if b is not None and taps.rank == 0 else 0.0)
        ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
        embed = _rows_dot(_embedding(model, a.embed), ids_t, g, taps.rank)
        if a.embed_scale:  # Gemma: the embedding times sqrt(d_model), rounded to the model's dtype
            embed = embed * float(torch.tensor(g.shape[0] ** 0.5, dtype=self.model_runner.model_config.dtype))
        if a.pos_embed:
            embed = embed + _rows_dot(_embedding(model, a.pos_embed), torch.tensor(positions, device=dev), g, taps.rank)
        return pickle.dumps({"heads": torch.stack(heads).cpu(), "d_head": int(taps.heads["head_size"]),
                             "attn_bias": torch.tensor(attn_bias),
                             "attn_norm_bias": torch.tensor(attn_norm_bias) if post else None,
                             "mlp_bias": torch.tensor(mlp_bias) if post else None,
                             "mlp": torch.stack(mlp).cpu() if post else None, "post": post or None,
                             "embed": embed.cpu(), "g": g.cpu(), "bias": torch.as_tensor(g_bias).float().cpu(),
                             "final_norm": _plain_norm(final), "rows": rows.float().cpu(),
                             "row_bias": None if row_bias is None else row_bias.float().cpu(),
                             "logit_scale": scale, "soft_cap": None if cap is None else float(cap)})

    def nnvllm_unembed(self, final_norm: str, unembed: str) -> bytes:
        """Return this rank's final norm and its slice of the unembedding (original vocab rows only)."""
        from ...arch import arch_for

        model = self.model_runner.get_model()
        try:
            norm, head = model.get_submodule(final_norm), model.get_submodule(unembed)
        except AttributeError:  # the client named transformers' paths; vLLM's tree moves them
            a = arch_for(self.model_runner.model_config.architectures).in_engine(model)
            norm, head = model.get_submodule(a.final_norm), model.get_submodule(a.unembed)
        w = head.weight.detach()
        idx = getattr(head, "shard_indices", None)
        if idx is not None:  # VocabParallelEmbedding / ParallelLMHead: [org slice, padding, added]
            w = w[: idx.num_org_elements]
        bias = getattr(head, "bias", None)
        eps = getattr(norm, "eps", None) or getattr(norm, "variance_epsilon", 1e-6)
        norm_weight = norm.weight.detach().float().cpu()
        if type(norm).__name__.startswith("Gemma"):  # Gemma's RMSNorm scales by (1 + weight)
            norm_weight = norm_weight + 1.0
        # What vLLM's LogitsProcessor does after the unembedding (Gemma 2's final soft-cap, a scale).
        proc = getattr(model, "logits_processor", None)
        soft_cap = getattr(proc, "soft_cap", None)
        scale = getattr(proc, "scale", 1.0)
        import pickle

        return pickle.dumps({
            "kind": "layernorm" if getattr(norm, "bias", None) is not None else "rmsnorm",
            "soft_cap": None if soft_cap is None else float(soft_cap),
            "scale": float(scale if scale is not None else 1.0),
            "norm_weight": norm_weight,
            "norm_bias": None if getattr(norm, "bias", None) is None else norm.bias.detach().float().cpu(),
            "eps": float(eps),
            "weight": w.float().cpu(),
            "bias": None if bias is None or idx is None else bias.detach()[: idx.num_org_elements].float().cpu(),
        })


def _embedding(model: Any, path: str) -> torch.nn.Module:
    """An embedding at transformers' ``path`` in vLLM's tree (under vLLM's Transformers backend the
    model's own tree sits under ``model``)."""
    try:
        return model.get_submodule(path)
    except AttributeError:
        return model.get_submodule("model." + path.split(".", 1)[1])


def _rows_dot(emb: torch.nn.Module, ids: torch.Tensor, g: torch.Tensor, rank: int) -> torch.Tensor:
    """``emb.weight[ids] . g`` for the rows this rank holds (0 for the others): a vocab-parallel
    embedding holds a slice of the rows on each rank; a whole one is counted on rank 0 only."""
    idx = getattr(emb, "shard_indices", None)
    w = emb.weight
    if idx is None:
        return (w.index_select(0, ids).float() @ g) if rank == 0 else torch.zeros(len(ids), device=g.device)
    lo, hi = idx.org_vocab_start_index, idx.org_vocab_end_index
    mine = (ids >= lo) & (ids < hi)
    out = torch.zeros(len(ids), device=g.device)
    if mine.any():
        out[mine] = w.index_select(0, ids[mine] - lo).float() @ g
    return out


def _weight_t(linear: torch.nn.Module, dtype: torch.dtype, device) -> torch.Tensor:
    """``W^T`` ``[this rank's inputs, outputs]`` of one of vLLM's linear layers, float32, read through the
    layer's own GEMM on the identity: vLLM's CPU backend packs the weight and frees ``.weight``,
    and a quantized layer's weight is not its values; its ``quant_method`` computes with both."""
    method = getattr(linear, "quant_method", None)
    if method is None:  # a plain torch Linear
        return linear.weight.detach().float().t()
    n = getattr(linear, "input_size_per_partition", None) or linear.input_size
    return method.apply(linear, torch.eye(n, dtype=dtype, device=device), None).float()


def _plain_norm(n: Any) -> dict:
    """A :class:`nnvllm.lens.Norm` as data (an attached client reads replies as data only)."""
    return {"kind": n.kind, "weight": n.weight.float().cpu(), "eps": float(n.eps),
            "bias": None if n.bias is None else n.bias.float().cpu()}


def _rows(head: torch.nn.Module, toks: torch.Tensor, tp: int, values: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``toks`` of an unembedding's weight (or of ``values``, its bias) that this rank holds,
    zeros for the rest: their sum over the ranks is the whole rows."""
    w = head.weight if values is None else values
    idx = getattr(head, "shard_indices", None)
    lo, hi = (0, w.shape[0]) if idx is None else (idx.org_vocab_start_index, idx.org_vocab_end_index)
    out = torch.zeros((len(toks),) + tuple(w.shape[1:]), dtype=torch.float32, device=w.device)
    mine = (toks >= lo) & (toks < hi)
    if idx is None and tp > 1:  # a whole (unsharded) head: every rank holds it; one adds it
        from vllm.distributed import get_tensor_model_parallel_rank

        mine &= get_tensor_model_parallel_rank() == 0
    if mine.any():
        out[mine] = w.index_select(0, toks[mine] - lo).float()
    return out
