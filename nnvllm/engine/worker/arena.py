"""Per-step placement: where each step's rows of each request go, and the samples computed at collect.

Once per engine step, after the forward (:meth:`.runner.RecordingRunner.execute_model`), one
``index_copy_`` per site moves this step's rows from the taps' static buffers to their final place in
a per-call arena laid out request by request, ``arena[site][layer, offset(request) + position]``. The
destination rows are computed on the host from vLLM's per-step batch layout (``input_batch.req_ids``,
``query_start_loc``) plus the positions tensor on the device: no host sync, no per-request or
per-layer Python. The logits row of each request goes to its step's slot the same way. Recomputed
rows (preemption) land on the same place (the last write wins); chunked prefill lands by position.

At collect, the sampling statistics are computed on the device for all steps at once and the arena
is handed over (:mod:`.handoff`).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import torch

from ..heap import gc_delta, gc_pauses
from .crosshost import sees_client
from .features import _Features
from .handoff import _SPARES, _handover, _handover_mode, _ShmFiles, made_since_last_call
from .mirror import _Mirror
from .taps import _HEAD_SITES, _Taps, _prompt_len


class _HostBlocks:
    """Host memory for the arenas of a CPU engine, reused from one capture to the next.

    A CPU arena is host memory the size of the capture, and in one process the hand-off gives the
    ``Run`` views of it. A block over glibc's mapping threshold (at most 32 MiB) allocated anew in
    every call is a fresh mapping whose pages the capture's first writes fault in, and it goes back
    to the system when the ``Run`` is dropped: every call would pay for that again, some calls much
    more than others. Here the blocks of the last capture are kept, and the next capture takes one
    once nothing views it any more (its storage's use count is back to what it was when only this
    list held it); a block that a ``Run`` still views is left to it. At most the last capture's
    blocks are kept. A GPU engine's arenas come from torch's caching allocator.
    """

    def __init__(self) -> None:
        self.free: list[tuple[torch.Tensor, int]] = []  # (flat block, its use count when only this list held it)
        self.used: list[tuple[torch.Tensor, int]] = []  # the blocks the current capture took

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
              zero: bool = False) -> torch.Tensor:
        if device.type != "cpu":
            return (torch.zeros if zero else torch.empty)(shape, dtype=dtype, device=device)
        n = int(np.prod(shape))
        fits = [i for i, (b, base) in enumerate(self.free)
                if b.dtype == dtype and b.numel() >= n and _use_count(b) <= base]
        if fits:
            entry = self.free.pop(min(fits, key=lambda i: self.free[i][0].numel()))
        else:
            block = torch.empty(n, dtype=dtype)
            entry = (block, _use_count(block))
        self.used.append(entry)
        out = entry[0][:n].view(shape)
        return out.zero_() if zero else out

    def end(self) -> None:
        """The current capture is over (collected, dropped or failed): its blocks become the ones the
        next capture may take; older ones not taken are let go. Once per capture: a second call, and
        a capture that took no block, change nothing."""
        if self.used:
            self.free, self.used = self.used, []

    def drop(self) -> None:
        """Let every kept block go (the engine closes)."""
        self.free, self.used = [], []


def _use_count(t: torch.Tensor) -> int:
    """How many tensors (and views of them, numpy arrays...) hold ``t``'s storage."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


# One per process: in-process CPU engines of one notebook share it, and the use counts keep a block
# to one capture at a time.
_HOST = _HostBlocks()


class _Capture:
    """One armed capture: its arena (request-major rows) and the per-step placement."""

    def __init__(self, taps: _Taps, spec: dict) -> None:
        _HOST.end()  # (a capture before this one that was never collected)
        self.taps = taps
        self.layers = list(spec["layers"])
        self.sites = [s for s in spec["sites"]]
        if any(s in _HEAD_SITES for s in self.sites) and not taps.heads.get("core"):
            raise ValueError(f"sites={[s for s in self.sites if s in _HEAD_SITES]}: "
                             f"{taps.heads.get('error') or 'this model has no per-head sites'}")
        self.keep = taps.rank == 0
        self.logits = spec.get("logits", True)
        self.sample = spec.get("sample")  # dict(temperature, top_p, k) or None
        self.hint_rows = int(spec.get("rows_hint") or 0)
        self.hint_steps = int(spec.get("steps_hint") or 0)
        self.layer_idx = None
        dev = taps.device
        if self.layers and self.layers != list(range(taps.n_layers)):
            self.layer_idx = torch.tensor(self.layers, dtype=torch.long, device=dev)
        # Edits run in the hooks, which a replayed CUDA graph skips: a capture with edits runs eagerly,
        # unless the graphs make them (steering the residual stream, see _Taps.replayable).
        edits = spec.get("edits") or []
        # SAEs armed for this capture (nv.generate(saes=...)): encoded each step from the taps' buffers
        self.features = _Features(spec.get("saes") or [], taps.device, self.keep, spec.get("sae_block_rows"))
        self.need_eager = (any(s not in taps.in_graph for s in self.sites + self.features.sites)
                           or (bool(edits) and not taps.replayable(edits))) and taps.cap > 0
        # The sites each TP rank holds a slice of, gathered every step (none with one rank).
        self.gather_sites = [s for s in dict.fromkeys(self.sites + self.features.sites) if taps.sharded(s)]
        self.requests: dict[str, tuple[int, int, int, int, int]] = {}  # rid -> (arena, off, rows, loff, plen)
        self.arenas: list[dict[str, torch.Tensor]] = []
        self.free_rows = 0
        self.free_steps = 0
        self.last_ids: list[str] | None = None
        # Every prompt of the current batch is computed (a step found it); true until the batch changes
        # or a step is not decode-shaped, and it spares the steady decode steps the check.
        self.prompts_done = False
        self.merged_gate_up = bool(taps.arch.get("merged_gate_up"))
        # Logits stay in the engine's dtype (what its sampler upcasts): half the bytes of fp32 in fp16.
        self.logits_dtype = taps.dtype
        # A worker on another host than the client (its shared memory not ours) hands over inline.
        self.inline = not sees_client(spec)
        # A client in this process takes a CPU arena's tensors as they are. A CUDA arena goes through the
        # shared-memory files even then: they are page-locked while the generation runs, so the copy is
        # one DMA (H100, Llama-1B shape 64 x 128, 738 MB: 0.015 s; a pageable .to("cpu"): 0.44 s).
        self.direct = spec.get("client_pid") == os.getpid() and not self.inline and taps.device.type != "cuda"
        files = not self.direct and not self.inline
        self.shm = _ShmFiles(taps.device) if files and self.keep else None
        # files of the client's dropped Runs, ready again (see _Spares); the client hears which
        self.taken_back = _SPARES.take_back(spec.get("returned")) if files else []
        self.timings: dict[str, float] = {"files_taken_back": len(self.taken_back)} if files else {}
        # the sites' rows also written into their files as the steps place them (NNVLLM_HANDOVER=mirror)
        self.mirror = (_Mirror(self.shm, self.sites, taps.device, self.timings)
                       if self.shm is not None and _handover_mode() == "mirror" else None)
        self.gc0 = gc_pauses()  # this process's collection pauses until the hand-off (benchmarks)
        self.stats = {"rows": 0, "partial_prefills": 0, "prompt_token_steps": 0, "steps": 0, "batch_changes": 0,
                      "eager": bool(self.need_eager)}
        # nv.stream: positions computed per request (kept only when streaming) and how far peek() went
        self.streaming = bool(spec.get("stream"))
        self.done: dict[str, int] = {}
        self.peeked: dict[str, int] = {}
        self.error: str | None = None

    def check_memory(self) -> None:
        """Refuse, before anything runs, a capture whose arena cannot fit in free device memory."""
        t = self.taps
        if t.device.type != "cuda" or not self.keep or not self.hint_rows:
            return
        item = t.dtype.itemsize
        width = sum(t.full_width(s) if s in t.widths else 0 for s in self.sites)
        need = (self.hint_rows * len(self.layers) * width * item + self.hint_steps * self._vocab() * 4
                + self.hint_rows * self.features.nbytes_per_row())
        free, _ = torch.cuda.mem_get_info(t.device)
        if need > 0.9 * free:
            raise ValueError(
                f"this capture needs about {need / 2**30:.1f} GiB of device memory for its arena and "
                f"{free / 2**30:.1f} GiB are free. Capture fewer prompts, layers or sites per call, "
                "pass logits=False, stream to disk with nv.collect(..., memory_budget=...), or load "
                "the engine with a lower gpu_memory_utilization.")

    # ---- arena
    def _arena_for(self, rows: int, steps: int) -> int:
        if not self.arenas or rows > self.free_rows or steps > self.free_steps:
            # Size for what the client announced, or else for every request the runner holds now,
            # and at least double the last arena: a few arenas per call at most.
            waiting = [st for rid, st in self.taps.runner.requests.items() if rid not in self.requests]
            guess_r = sum(len(st.prompt_token_ids or ()) + int(st.sampling_params.max_tokens or 1) for st in waiting)
            guess_s = sum(int(st.sampling_params.max_tokens or 1) for st in waiting)
            prev_r = self.arenas[-1][self.sites[0]].shape[1] if self.arenas and self.sites else 0
            rows_n = max(rows, self.hint_rows, guess_r, 2 * prev_r)
            steps_n = max(steps, self.hint_steps, guess_s, 2 * (self.arenas[-1]["_logits"].shape[0] if self.arenas else 0))
            self.hint_rows = self.hint_steps = 0  # the hint sizes the first arena only
            t = self.taps
            a: dict[str, torch.Tensor] = {}
            for s in self.sites:
                w = t.full_width(s)
                a[s] = _HOST.empty((len(self.layers), rows_n + 1, w), t.dtype, t.device)
            a["_logits"] = _HOST.empty((steps_n + 1, self._vocab()), self.logits_dtype, t.device, zero=True)
            a.update(self.features.allocate(rows_n, t.device))
            if self.shm is not None:  # the files the hand-off will fill (logits only when asked for)
                for name, x in a.items():
                    if name != "_logits":
                        self.shm.prepare(x[:, :rows_n].numel() * x.element_size(), name)
                    elif self.logits:
                        self.shm.prepare(steps_n * x.shape[1] * x.element_size(), name)
            self.arenas.append(a)
            self.used_rows, self.used_steps = 0, 0
            self.free_rows, self.free_steps = rows_n, steps_n
        k = len(self.arenas) - 1
        return k

    def _vocab(self) -> int:
        if not self.logits and self.sample is None:
            return 1
        return int(self.taps.runner.model_config.get_vocab_size())

    def _place(self, rid: str) -> tuple:
        st = self.taps.runner.requests[rid]
        plen = _prompt_len(st)
        mt = int(st.sampling_params.max_tokens or 1)
        rows, steps = plen + mt, mt
        k = self._arena_for(rows, steps)
        ent = (k, self.used_rows, rows, self.used_steps, plen)
        self.used_rows += rows
        self.used_steps += steps
        self.free_rows -= rows
        self.free_steps -= steps
        self.requests[rid] = ent
        return ent

    # ---- once per step
    def step(self, runner: Any) -> None:
        h0 = time.perf_counter()
        try:
            self._step(runner)
        finally:  # the host's time in the capture's part of each step (benchmarks)
            self.timings["step_host"] = self.timings.get("step_host", 0.0) + time.perf_counter() - h0

    def _step(self, runner: Any) -> None:
        t = self.taps
        n = runner.input_batch.num_reqs
        qsl = runner.query_start_loc.np[: n + 1]
        ntok = int(qsl[-1]) if n else 0
        if ntok == 0:
            self.prompts_done = False  # (a step without the batch: what comes next is looked at afresh)
            return
        ids = runner.input_batch.req_ids[:n]
        dev = t.device
        # Sharded sites: all ranks gather (a collective each rank must join), rank 0 keeps.
        gathered = {}
        for s in self.gather_sites:
            src = t.fired.get(s, t.static.get(s))
            gathered[s] = _gather(src[:, :ntok], s, self.merged_gate_up,
                                  t.kv_take() if s in ("k", "v") else None, t.heads.get("head_size"))
        if not self.keep or self.error is not None:
            return
        try:
            self._place_step(runner, n, qsl, ntok, ids, gathered)
        except Exception as e:  # noqa: BLE001
            # A failed recording (e.g. out of device memory for the arena) fails this capture
            # alone: the generation goes on, the engine stays up, collect() reports the cause.
            self.error = f"{type(e).__name__}: {e}"
            self.arenas = []
            self.features.drop()
            if dev.type == "cuda":
                torch.cuda.empty_cache()

    def _place_step(self, runner, n, qsl, ntok, ids, gathered) -> None:
        t = self.taps
        dev = t.device
        if ids != self.last_ids:
            # The batch changed: look its requests up (placing new ones). Columns: arena, row
            # offset, logits-row offset, prompt length. Steady decode steps skip this.
            ents = [self.requests.get(r) or self._place(r) for r in ids]
            self.last_ids = list(ids)
            self.stats["batch_changes"] += 1
            self.tab = np.array([[e[0], e[1], e[3], e[4]] for e in ents], dtype=np.int64)
            self.arenas_here = np.unique(self.tab[:, 0])
            self.on_device = None  # the batch's columns on the device, made at its first decode step
            self.prompts_done = False
        # Bookkeeping the tests read (host-side numbers only): rows placed, prompt chunks seen.
        self.stats["rows"] += ntok
        self.stats["steps"] += 1
        counts = None
        if ntok != n:
            self.prompts_done = False
        partial = 0
        if not self.prompts_done or self.streaming:
            # Once a step finds every prompt of the batch computed, each later decode step of the same
            # batch does too (computed tokens only grow; a preempted request leaves the batch).
            counts = np.diff(qsl)
            done = runner.input_batch.num_computed_tokens_cpu[:n] + counts
            partial = int((done < self.tab[:, 3]).sum())  # requests whose prompt is not all computed yet
            self.stats["partial_prefills"] += partial
            self.prompts_done = partial == 0 and ntok == n
            if self.streaming:  # (a loop over the batch's requests: only when a stream will peek)
                self.done.update(zip(ids, done.tolist()))
        pos = runner.positions[:ntok]
        if pos.device != dev:
            pos = pos.to(dev)
        def source(s: str) -> torch.Tensor:  # this step's [layer, tokens, width] of site s
            src = gathered.get(s)
            if src is None:
                buf = t.fired.get(s, t.static.get(s))
                if buf is None:
                    raise RuntimeError(f"nnvllm: no value of site {s!r} was recorded this step "
                                       "(a replayed CUDA graph without it); load with cuda_graphs=False")
                src = buf[:, :ntok]
            return src

        arenas_here = self.arenas_here
        if ntok == n and len(arenas_here) == 1:
            # A decode step (one token per request) of a batch in one arena: its destinations are
            # the batch's columns plus the positions, from columns kept on the device while the batch
            # stays; no host-to-device copy in the step.
            self.stats["prompt_token_steps"] += partial > 0  # (a decode-shaped step carrying a prompt token)
            self._decode_step(runner, n, pos, source, prompts_done=partial == 0)
            return
        if counts is None:  # (a decode step of a batch over several arenas)
            counts = np.diff(qsl)
        tok_req = np.repeat(np.arange(n), counts)  # each token's request
        for k in arenas_here:
            arena = self.arenas[int(k)]
            in_k = self.tab[:, 0] == k
            tok_sel = in_k[tok_req]
            if len(arenas_here) == 1:
                tok_off = torch.from_numpy(self.tab[tok_req, 1])
                dst = _to(tok_off, dev) + pos
                src_rows = None
            else:
                rows_np = np.nonzero(tok_sel)[0]
                src_rows = _to(torch.from_numpy(rows_np), dev)
                dst = _to(torch.from_numpy(self.tab[tok_req[rows_np], 1]), dev) + pos[src_rows]
            if self.features:  # staged, encoded a block of steps at a time (.features)
                h0 = time.perf_counter()
                self.features.stage(source, dst, int(k), self.arenas, src_rows)
                self.timings["sae_host"] = self.timings.get("sae_host", 0.0) + time.perf_counter() - h0
            for s in self.sites:
                src = source(s)
                if self.layer_idx is not None:
                    src = src.index_select(0, self.layer_idx)
                if src_rows is not None:
                    src = src.index_select(1, src_rows)
                arena[s].index_copy_(1, dst, src)
            if self.mirror is not None:
                self.mirror.placed(int(k), dst, arena)
            # The logits row of each request: its last scheduled token's position.
            lg = runner.execute_model_state.logits if runner.execute_model_state is not None else None
            if lg is None or arena["_logits"].shape[1] == 1:
                continue
            req_sel = np.nonzero(in_k)[0]
            last_tok = torch.from_numpy(qsl[1:][req_sel] - 1)
            lpos = pos[_to(last_tok, dev)]
            base = torch.from_numpy(self.tab[req_sel, 2] - (self.tab[req_sel, 3] - 1))
            ldst = _to(base, dev) + lpos
            # Rows of a prompt only partly prefilled this step go to the spare last row.
            ldst = torch.where(lpos >= _to(torch.from_numpy(self.tab[req_sel, 3] - 1), dev), ldst,
                               torch.full_like(ldst, arena["_logits"].shape[0] - 1))
            rows = lg[:n] if len(arenas_here) == 1 else lg[_to(torch.from_numpy(req_sel), dev)]
            arena["_logits"].index_copy_(0, ldst, rows.to(arena["_logits"].dtype))

    def _decode_step(self, runner, n, pos, source, prompts_done: bool) -> None:
        """Place a decode step of a batch in one arena. ``prompts_done``: every request's prompt is
        computed (the host knows it), so each request's one token is its last and its logits row is
        the token's own, with no choice to make on the device."""
        dev = self.taps.device
        if self.on_device is None:
            tab = self.tab
            cols = _to(torch.from_numpy(np.stack([tab[:, 1], tab[:, 2] - (tab[:, 3] - 1), tab[:, 3] - 1])), dev)
            # (row offsets and logits-row offsets together, then each, then the last prompt positions)
            self.on_device = (cols[:2], cols[0], cols[1], cols[2])
        bases, off, lbase, last_prompt = self.on_device
        arena = self.arenas[int(self.arenas_here[0])]
        lg = runner.execute_model_state.logits if runner.execute_model_state is not None else None
        keep_logits = lg is not None and arena["_logits"].shape[1] != 1
        ldst = None
        if keep_logits and prompts_done:
            both = bases + pos  # both destinations in one operation: a kernel launch fewer a step
            dst, ldst = both[0], both[1]  # (indexing: unpacking a tensor goes through Python's iterator)
        else:
            dst = off + pos
        if self.features:
            h0 = time.perf_counter()
            self.features.stage(source, dst, int(self.arenas_here[0]), self.arenas, None)
            self.timings["sae_host"] = self.timings.get("sae_host", 0.0) + time.perf_counter() - h0
        for s in self.sites:
            src = source(s)
            if self.layer_idx is not None:
                src = src.index_select(0, self.layer_idx)
            arena[s].index_copy_(1, dst, src)
        if self.mirror is not None:
            self.mirror.placed(int(self.arenas_here[0]), dst, arena)
        if not keep_logits:
            return
        if ldst is None:
            # A request's token is its logits row's, or goes to the spare last row while its prompt
            # is still being computed a token at a time.
            ldst = torch.where(pos >= last_prompt, lbase + pos, arena["_logits"].shape[0] - 1)
        arena["_logits"].index_copy_(0, ldst, lg[:n].to(arena["_logits"].dtype))

    def _flush(self) -> None:
        """Encode the SAEs' staged rows (before anything reads the arena). Fails the capture alone, as
        a failed step does."""
        if not self.features or self.error is not None or not self.keep:
            return
        try:
            h0 = time.perf_counter()
            with torch.inference_mode():  # (the arena and the staged rows were made in vLLM's step, under it)
                self.features.flush(self.arenas)
            self.timings["sae_host"] = self.timings.get("sae_host", 0.0) + time.perf_counter() - h0
        except Exception as e:  # noqa: BLE001
            self.error = f"{type(e).__name__}: {e}"
            self.arenas = []
            self.features.drop()
            if self.taps.device.type == "cuda":
                torch.cuda.empty_cache()

    def peek(self) -> dict:
        """For nv.stream: each request's rows computed since the last peek (positions ``[from, to)``
        of the residual stream and of each SAE's features, on the host) and the logits rows of the
        steps those positions produced (step ``s`` comes from position ``plen - 1 + s``). Small: a
        few positions per call."""
        self._flush()
        if self.error is not None:
            return {"error": self.error}
        if not self.keep:
            return {}
        out = {}
        for rid, done in self.done.items():
            a = self.peeked.get(rid, 0)
            if done <= a:
                continue
            k, off, rows, loff, plen = self.requests[rid]
            arena = self.arenas[k]
            ent: dict[str, Any] = {"plen": plen, "from": a, "to": done}
            if "resid" in self.sites:
                ent["resid"] = arena["resid"][:, off + a: off + done].to("cpu")
            s0, s1 = max(a - plen + 1, 0), max(done - plen + 1, 0)
            if s1 > s0 and arena["_logits"].shape[1] > 1:
                ent["logits"] = arena["_logits"][loff + s0: loff + s1].to("cpu")
            if self.features:  # per SAE of the call: its rows' top features (or dense code) and error
                ent["features"] = [{name: arena[key][m, off + a: off + done].to("cpu") for name in
                                    ("ids", "values", "dense", "error") if (key := f"_sae{g}_{name}") in arena}
                                   for g, m in self.features.where()]
            self.peeked[rid] = done
            out[rid] = ent
        return out

    # ---- at the end
    def collect(self, tokens: dict[str, list[int]]) -> dict | None:
        self._flush()
        if self.error is not None:
            return {"error": self.error}
        if not self.keep:
            return None
        t = self.taps
        dev = t.device
        reqs = {}
        for rid, (k, off, rows, loff, plen) in self.requests.items():
            reqs[rid] = {"arena": k, "off": off, "rows": rows, "loff": loff, "plen": plen}
        out: dict[str, Any] = {"requests": reqs, "arenas": []}
        for k, arena in enumerate(self.arenas):
            used_rows = max((r["off"] + r["rows"] for r in reqs.values() if r["arena"] == k), default=0)
            used_steps = max((r["loff"] + (r["rows"] - r["plen"]) for r in reqs.values() if r["arena"] == k), default=0)
            tensors: dict[str, torch.Tensor] = {}
            for s in self.sites:
                tensors[s] = arena[s][:, :used_rows]
                if s in _HEAD_SITES:  # [layer, pos, heads, d_head]: a view
                    tensors[s] = tensors[s].unflatten(-1, (-1, t.heads["head_size"]))
            for name in arena:
                if name.startswith("_sae"):
                    tensors[name] = arena[name][:, :used_rows]
            if self.sample is not None and used_steps:
                t0 = _now(dev)
                tensors.update(self._samples(arena["_logits"][:used_steps], k, reqs, tokens))
                self.timings["samples"] = self.timings.get("samples", 0.0) + _now(dev) - t0
            if self.logits:
                tensors["_logits"] = arena["_logits"][:used_steps]
            t0 = _now(dev)
            filled = self.mirror.finish(arena, used_rows) if self.mirror is not None and k == 0 else None
            out["arenas"].append(_handover(tensors, self.direct, self.shm, self.timings,
                                           inline=self.inline, filled=filled))
            self.timings["handover"] = self.timings.get("handover", 0.0) + _now(dev) - t0
        if any(s in _HEAD_SITES for s in self.sites):  # for the Run's meta: what Run.attention rebuilds with
            out["meta"] = {"attention": t.heads["spec"]}
        if (dev_s := self.features.device_seconds()) is not None:
            self.timings["sae_gpu"] = dev_s
        self.timings.update(gc_delta(self.gc0))
        if self.shm is not None:
            self.timings.update(made_since_last_call())
        out["timings"] = dict(self.timings)
        out["sae_groups"] = self.features.where()
        out["stats"] = dict(self.stats, **({"sae_encodings": self.features.encodings} if self.features else {}))
        out["taken_back"] = list(self.taken_back)
        return out

    def _samples(self, logits: torch.Tensor, k: int, reqs: dict, tokens: dict) -> dict[str, torch.Tensor]:
        """Sampling statistics for every step row at once (see :mod:`nnvllm.sampling`)."""
        from ...sampling import chosen_logprobs, sampling_probs

        dev = logits.device
        chosen = torch.zeros(logits.shape[0], dtype=torch.long)
        for rid, r in reqs.items():
            if r["arena"] != k:
                continue
            toks = tokens.get(rid)
            if toks is None:  # the client knows the external id; vLLM appends "-<8 hex>" to it
                toks = tokens.get(rid.rsplit("-", 1)[0])
            if toks is None:
                continue
            toks = toks[: r["rows"] - r["plen"]]
            chosen[r["loff"]: r["loff"] + len(toks)] = torch.as_tensor(toks, dtype=torch.long)
        chosen = chosen.to(dev)
        temp, top_p, kk = self.sample["temperature"], self.sample["top_p"], self.sample["k"]
        kk = min(kk, logits.shape[-1])
        probs_c, top_i, top_p_, logp = [], [], [], []
        # Rows per chunk: ~256 MB of fp32 probabilities on a GPU. On the CPU ~8 MB, so that each chunk's
        # temporaries come from the heap glibc reuses, not from mappings faulted in anew each call.
        step = max(1, ((256 if dev.type == "cuda" else 8) << 20) // (logits.shape[-1] * 4))
        for a in range(0, logits.shape[0], step):
            p = sampling_probs(logits[a: a + step], temp, top_p)
            top = p.topk(kk, dim=-1)
            probs_c.append(p.gather(-1, chosen[a: a + step, None])[:, 0])
            top_i.append(top.indices)
            top_p_.append(top.values)
            logp.append(chosen_logprobs(logits[a: a + step], chosen[a: a + step]))
        return {"_probs": torch.cat(probs_c), "_top_ids": torch.cat(top_i), "_top_probs": torch.cat(top_p_),
                "_logprobs": torch.cat(logp)}


def _now(dev) -> float:
    import time

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


def _to(x: torch.Tensor, dev) -> torch.Tensor:
    if dev.type == "cuda":
        # Pinned (from the caching host allocator, which keeps the block until the copy is done),
        # then an asynchronous copy: no host sync in the step.
        return x.pin_memory().to(dev, non_blocking=True)
    return x


def _gather(x: torch.Tensor, site: str, merged_gate_up: bool, kv_take: torch.Tensor | None = None,
            head_size: int | None = None) -> torch.Tensor:
    """``[layer, tokens, width]`` of every rank, in the model's order along the width.

    Per-head sites: rank ``r`` holds heads ``[r * n, (r + 1) * n)`` of q and z, and its KV heads of k
    and v, so the concatenation is the model's head order; with fewer KV heads than ranks each KV
    head sits on ``tp / n_kv_heads`` ranks and ``kv_take`` keeps one copy. (Gathering a fused QKV
    projection's output instead would interleave ``[q_r, k_r, v_r]`` per rank: not the model's layout.)
    """
    from vllm.distributed import tensor_model_parallel_all_gather

    if kv_take is not None:
        full = tensor_model_parallel_all_gather(x.contiguous(), -1)
        return full.unflatten(-1, (-1, head_size)).index_select(-2, kv_take).flatten(-2)
    if site == "mlp_in" and merged_gate_up:
        # Merged gate_up: each rank holds [gate_r, up_r]; the full width is [gate..., up...].
        g, u = x.chunk(2, dim=-1)
        return torch.cat([tensor_model_parallel_all_gather(g.contiguous(), -1),
                          tensor_model_parallel_all_gather(u.contiguous(), -1)], dim=-1)
    return tensor_model_parallel_all_gather(x.contiguous(), -1)


