"""What runs inside the engine's worker process: recording a generation, and handing its bytes over.

This module is imported by the engine workers (``_gpu.py``, ``_cpu_worker.py``); the client never imports
it. The client side of a capture is :func:`nnvllm.capture.generate`.

How a capture stays at the cost of moving its bytes (see DESIGN.md, "The hot path"):

- **Taps installed once, at model load**, before vLLM records its CUDA graphs. A tap is a forward
  hook that copies one site of one block into a preallocated static buffer ``[layer, rows, width]``
  (rows: vLLM's largest graph batch). While vLLM records a graph the copy is recorded with it, so
  every replay refills the buffer with no Python at all. In an eager step (prefill, a batch larger
  than any graph, the CPU backend) the hook runs and does the same copy.
- **Once per engine step**, after the forward (:meth:`RecordingRunner.execute_model`): one
  ``index_copy_`` per site moves this step's rows from the static buffer to their final place in a
  per-call arena laid out request by request, ``arena[site][layer, offset(request) + position]``.
  The destination rows are computed on the host from vLLM's per-step batch layout
  (``input_batch.req_ids``, ``query_start_loc``) plus the positions tensor on the device — no host
  sync, no per-request or per-layer Python. The logits row of each request goes to its step's slot
  the same way. Recomputed rows (preemption) land on the same place (the last write wins); chunked
  prefill lands by position.
- **At collect**, the sampling statistics are computed on the device for all steps at once, and the
  arena is copied once into files in shared memory (``/dev/shm``); the RPC result is only their
  names and the layout. The client maps the files: nothing is pickled and no RPC size limit applies.
  In a single-process engine (vLLM's CPU default here) the tensors are handed over directly.

Under tensor parallelism every rank runs the taps; the sites that are one rank's slice (``mlp_in``,
``mlp_act``) are all-gathered once per step, and rank 0 keeps the record.
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid
from typing import Any

import numpy as np
import torch

__all__ = ["RecordingRunner", "CaptureWorker", "SHM_PREFIX"]

_SHARDED = ("mlp_in", "mlp_act")  # column-parallel outputs: each TP rank holds a slice of the width
SHM_PREFIX = "nnvllm-cap-"
# Static buffers for graph replay are kept under this many bytes per engine; sites that would not
# fit are recorded by running the steps of a capture that asks for them eagerly.
STATIC_BUDGET = int(os.environ.get("NNVLLM_STATIC_BUDGET", 2 << 30))


def shm_dir() -> str:
    d = "/dev/shm"
    return d if os.path.isdir(d) and os.access(d, os.W_OK) else tempfile.gettempdir()


class _Taps:
    """The permanent hooks of one model and their static buffers (one per site: ``[layer, cap, width]``)."""

    def __init__(self, runner: Any, arch: dict, cap: int) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        self.runner = runner
        self.arch = arch
        self.tp = get_tensor_model_parallel_world_size()
        self.rank = get_tensor_model_parallel_rank()
        self.active = False  # a capture is armed (eager hooks record only then)
        self.fired: dict[str, torch.Tensor] = {}  # site -> the buffer eager hooks wrote this step
        self.static: dict[str, torch.Tensor] = {}
        self.eager: dict[str, torch.Tensor] = {}
        model = runner.get_model()
        blocks = model.get_submodule(arch["blocks"])
        self.n_layers = len(blocks)
        self.handles = []
        # Widths are learnt from the first value a hook sees (sharded sites are a slice per rank).
        self.width: dict[str, int] = {}
        self.dtype = runner.model_config.dtype
        self.device = runner.device
        self.cap = cap
        self.sites: list[str] = []
        for site, (path, side) in arch["sites"].items():
            for j in range(self.n_layers):
                mod = blocks[j].get_submodule(path) if path else blocks[j]
                if side == "output":
                    self.handles.append(mod.register_forward_hook(self._output_hook(site, j)))
                else:
                    self.handles.append(mod.register_forward_pre_hook(self._input_hook(site, j)))
            self.sites.append(site)
        self.in_graph: set[str] = set()  # sites whose copy is recorded in the CUDA graphs
        self.edits: list[dict] = []  # armed edits (see arm_edits); the hooks make them in eager steps
        # [layer, width]: what every replayed CUDA graph adds to each block's residual stream (zero
        # unless steering edits are armed): steering at graph speed (see replayable).
        self.gadd: torch.Tensor | None = None
        self._prompt_rows: tuple | None = None  # this forward's (position, is-prompt, is-generated) per row

    # ---- edits (nv.generate(..., edits=[...]))
    def replayable(self, edits: list[dict]) -> bool:
        """Whether replayed CUDA graphs can make ``edits``: adding vectors to the residual stream at
        generated positions (a replayed graph runs decode steps only, whose rows are all generated
        positions). Anything else runs the edited generation's steps eagerly."""
        return self.gadd is not None and all(
            e["op"] == "add" and e["site"] == "resid" and e["positions"] in ("all", "generated")  # (a str)
            and e.get("prompts") is None for e in edits)

    def arm_edits(self, edits: list[dict]) -> None:
        """Edits for the next generation (:func:`nnvllm.edits.to_spec`): ``{"site", "layers", "op":
        add|set|scale|patch, "vector" (list) or None, "values" ([layer, pos, width] lists, patch) or
        None, "value", "scale", "positions": all|prompt|generated}``. Eager steps make them in the
        hooks; if :meth:`replayable`, their sum per layer also goes into :attr:`gadd` for replays."""
        armed = []
        for e in edits:
            vec, vals = e.get("vector"), e.get("values")
            pr, at = e.get("prompts"), e["positions"]
            armed.append({**e, "layers": {j: k for k, j in enumerate(e["layers"])},
                          "at": torch.tensor(at, dtype=torch.int64, device=self.device) if isinstance(at, list) else None,
                          "prompts": None if pr is None else torch.tensor(pr, dtype=torch.int64, device=self.device),
                          "vec": None if vec is None else torch.tensor(vec, dtype=torch.float32, device=self.device),
                          "vals": None if vals is None else torch.tensor(vals, dtype=torch.float32, device=self.device)})
        self.disarm_edits()
        if armed and self.replayable(edits):
            acc = torch.zeros(self.gadd.shape, dtype=torch.float32, device=self.device)
            for e in armed:
                for j in e["layers"]:
                    acc[j] += e["vec"] * e["scale"]
            self.gadd.copy_(acc)  # one edit per layer: the very values the hook adds, (vec * scale).to(dtype)
        self.edits = armed

    def disarm_edits(self) -> None:
        self.edits = []
        if self.gadd is not None:
            self.gadd.zero_()

    def _rows(self, n: int, device) -> tuple[torch.Tensor, ...]:
        """This forward's position of each of its ``n`` rows, whether the row is a prompt or a
        generated position, and its request's prompt index in the call (-1: untagged), computed once
        per step. Rows vLLM padded get a position past every sequence and count as neither prompt
        nor generated, so no edit touches them."""
        if self._prompt_rows is None or self._prompt_rows[0].shape[0] != n:
            r = self.runner
            nreq = r.input_batch.num_reqs
            qsl = r.query_start_loc.np[: nreq + 1]
            real = int(qsl[-1])
            ids = r.input_batch.req_ids[:nreq]
            plen = np.array([_prompt_len(r.requests[i]) for i in ids], dtype=np.int64)
            row_plen = torch.from_numpy(np.repeat(plen, np.diff(qsl))).to(device)
            # the prompt index generate() tags each request with (transport.PROMPT_TAG), for per-prompt edits
            tag = np.array([(r.requests[i].sampling_params.extra_args or {}).get("nnvllm_prompt", -1) for i in ids],
                           dtype=np.int64)
            which = torch.full((n,), -1, dtype=torch.int64, device=device)
            which[:real] = torch.from_numpy(np.repeat(tag, np.diff(qsl))).to(device)
            pos = torch.full((n,), torch.iinfo(torch.int64).max, dtype=torch.int64, device=device)
            pos[:real] = r.positions[:real].to(device)
            prompt = torch.zeros(n, dtype=torch.bool, device=device)
            prompt[:real] = pos[:real] < row_plen
            generated = torch.zeros(n, dtype=torch.bool, device=device)
            generated[:real] = ~prompt[:real]
            self._prompt_rows = (pos, prompt, generated, which)
        return self._prompt_rows

    def _apply_edits(self, site: str, j: int, x: torch.Tensor, residual: torch.Tensor | None = None) -> None:
        """Edit ``x`` in place (and ``residual``: for a Llama-style block the stream is their sum)."""
        for e in self.edits:
            if e["site"] != site or j not in e["layers"]:
                continue
            pos, prompt, generated, which = self._rows(x.shape[0], x.device)
            if e["at"] is not None:  # explicit token positions
                m = torch.isin(pos, e["at"])
            else:
                m = {"all": None, "prompt": prompt, "generated": generated}[e["positions"]]
            if e["prompts"] is not None:
                mine = torch.isin(which, e["prompts"])
                m = mine if m is None else (m & mine)
            op, vec = e["op"], e["vec"]
            if op == "patch":  # another run's value at each row's position, where it has one
                src = e["vals"][e["layers"][j]]  # [P, width]
                inside = pos < src.shape[0]
                new = src[pos.clamp(max=src.shape[0] - 1)].to(x.dtype)
                m = inside if m is None else (m & inside)
            elif op == "add":
                new = x + (vec * e["scale"]).to(x.dtype)
            elif op == "set":
                new = (vec.to(x.dtype).expand_as(x) if vec is not None else torch.full_like(x, float(e["value"])))
            else:  # scale
                new = ((x + residual) if residual is not None else x) * e["scale"]
            if residual is not None and op != "add":  # the edited value is the whole stream
                residual.copy_(torch.zeros_like(residual) if m is None else residual.masked_fill(m[:, None], 0))
            x.copy_(new if m is None else torch.where(m[:, None], new, x))

    # ---- the hooks
    def _buf(self, site: str, n: int, like: torch.Tensor) -> torch.Tensor | None:
        if site not in self.width:
            self.width[site] = like.shape[-1]
        if n <= self.cap and site in self.static:
            return self.static[site]
        buf = self.eager.get(site)
        if buf is None or buf.shape[1] < n:
            rows = max(n, 2 * (0 if buf is None else buf.shape[1]))
            buf = self.eager[site] = torch.empty(self.n_layers, rows, like.shape[-1], dtype=like.dtype,
                                                 device=like.device)
        return buf

    def _write(self, site: str, j: int, x: torch.Tensor, residual: torch.Tensor | None = None) -> None:
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if not (capturing or self.active):
            return
        n = x.shape[0]
        if capturing and site not in self.static:
            return  # not recorded in graphs: a capture that wants it runs eagerly
        buf = self._buf(site, n, x)
        dst = buf[j, :n]
        if residual is None:
            dst.copy_(x)
        else:
            torch.add(x, residual, out=dst)
        if not capturing:
            self.fired[site] = buf

    def _output_hook(self, site: str, j: int):
        def hook(module, args, out):
            if site == "resid" and self.gadd is not None:
                h = out[0] if isinstance(out, tuple) else out
                if h.is_cuda and torch.cuda.is_current_stream_capturing():
                    h.add_(self.gadd[j])  # recorded into every graph (see arm_edits); eager steps skip it
            if isinstance(out, tuple):
                if site == "resid" and len(out) > 1 and isinstance(out[1], torch.Tensor):
                    # Llama-style blocks return (hidden, residual): the residual stream is their sum.
                    h, r = _tokens(out[0]), _tokens(out[1])
                    if self.edits:
                        self._apply_edits(site, j, h, r)
                    self._write(site, j, h, r)
                    return
                out = out[0]
            out = _tokens(out)
            if self.edits:
                self._apply_edits(site, j, out)
            self._write(site, j, out)
        return hook

    def _input_hook(self, site: str, j: int):
        def hook(module, args):
            x = _tokens(args[0])
            if self.edits:
                self._apply_edits(site, j, x)
            self._write(site, j, x)
        return hook

    def allocate_static(self, widths: dict[str, int]) -> None:
        """Static buffers for graph replay, as many sites as fit in :data:`STATIC_BUDGET`."""
        if self.cap <= 0:
            return
        item = torch.empty((), dtype=self.dtype).element_size()
        used = 0
        for site in self.sites:  # in table order: resid first
            w = widths.get(site)
            if w is None:
                continue
            size = self.n_layers * self.cap * w * item
            if used + size > STATIC_BUDGET:
                continue
            self.static[site] = torch.zeros(self.n_layers, self.cap, w, dtype=self.dtype, device=self.device)
            used += size
            self.in_graph.add(site)
        if "resid" in widths:
            self.gadd = torch.zeros(self.n_layers, widths["resid"], dtype=self.dtype, device=self.device)


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """``[tokens, width]``: vLLM's native blocks see the batch's tokens flattened; transformers' blocks
    under vLLM's Transformers backend see ``[1, tokens, width]`` (a view, so in-place edits land)."""
    return x[0] if x.dim() == 3 and x.shape[0] == 1 else x


def _site_widths(model: Any, arch: dict, tp: int) -> dict[str, int]:
    """Per-rank widths of each site, from the module shapes (no forward needed)."""
    blocks = model.get_submodule(arch["blocks"])
    cfg = getattr(model, "config", None)
    d = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    out = {}
    for site, (path, side) in arch["sites"].items():
        if site in ("resid", "attn", "mlp"):
            out[site] = d
            continue
        mod = blocks[0].get_submodule(path)
        # vLLM's parallel linear layers know their per-rank sizes (weights may be repacked).
        attr = "output_size_per_partition" if side == "output" else "input_size_per_partition"
        out[site] = getattr(mod, attr, None) or getattr(mod, "output_size" if side == "output" else "input_size", None)
    return {k: v for k, v in out.items() if v}


class _Capture:
    """One armed capture: its arena (request-major rows) and the per-step placement."""

    def __init__(self, taps: _Taps, spec: dict) -> None:
        self.taps = taps
        self.layers = list(spec["layers"])
        self.sites = [s for s in spec["sites"]]
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
        self.need_eager = (any(s not in taps.in_graph for s in self.sites)
                           or (bool(edits) and not taps.replayable(edits))) and taps.cap > 0
        self.requests: dict[str, tuple[int, int, int, int, int]] = {}  # rid -> (arena, off, rows, loff, plen)
        self.arenas: list[dict[str, torch.Tensor]] = []
        self.free_rows = 0
        self.free_steps = 0
        self.last_ids: list[str] | None = None
        self.merged_gate_up = bool(taps.arch.get("merged_gate_up"))
        # Logits stay in the engine's dtype (what its sampler upcasts): half the bytes of fp32 in fp16.
        self.logits_dtype = taps.dtype
        remote = spec.get("client_pid") != os.getpid()
        self.shm = _ShmFiles(taps.device) if remote and self.keep else None
        # files of the client's dropped Runs, ready again (see _Spares); the client hears which
        self.taken_back = _SPARES.take_back(spec.get("returned")) if remote else []
        self.timings: dict[str, float] = {}
        self.stats = {"rows": 0, "partial_prefills": 0, "steps": 0, "batch_changes": 0, "eager": bool(self.need_eager)}
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
        item = torch.empty((), dtype=t.dtype).element_size()
        width = sum(t.widths.get(s, 0) * (t.tp if s in _SHARDED else 1) for s in self.sites)
        need = self.hint_rows * len(self.layers) * width * item + self.hint_steps * self._vocab() * 4
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
                w = t.width.get(s) or t.widths[s]
                if s in _SHARDED:
                    w *= t.tp
                a[s] = torch.empty(len(self.layers), rows_n + 1, w, dtype=t.dtype, device=t.device)
            a["_logits"] = torch.zeros(steps_n + 1, self._vocab(), dtype=self.logits_dtype, device=t.device)
            if self.shm is not None:  # the files the hand-off will fill (logits only when asked for)
                for name, x in a.items():
                    if name != "_logits":
                        self.shm.prepare(x[:, :rows_n].numel() * x.element_size())
                    elif self.logits:
                        self.shm.prepare(steps_n * x.shape[1] * x.element_size())
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
        t = self.taps
        n = runner.input_batch.num_reqs
        if n == 0:
            return
        qsl = runner.query_start_loc.np[: n + 1]
        ntok = int(qsl[-1])
        if ntok == 0:
            return
        ids = runner.input_batch.req_ids[:n]
        dev = t.device
        # Sharded sites: all ranks gather (a collective each rank must join), rank 0 keeps.
        gathered = {}
        for s in self.sites:
            if t.tp > 1 and s in _SHARDED:
                src = t.fired.get(s, t.static.get(s))
                gathered[s] = _gather(src[:, :ntok], s, self.merged_gate_up)
        if not self.keep or self.error is not None:
            return
        try:
            self._place_step(runner, n, qsl, ntok, ids, gathered)
        except Exception as e:  # noqa: BLE001
            # A failed recording (e.g. out of device memory for the arena) fails this capture
            # alone: the generation goes on, the engine stays up, collect() reports the cause.
            self.error = f"{type(e).__name__}: {e}"
            self.arenas = []
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
        counts = np.diff(qsl)
        tok_req = np.repeat(np.arange(n), counts)
        # Bookkeeping the tests read (host-side numbers only): rows placed, prompt chunks seen.
        self.stats["rows"] += ntok
        self.stats["steps"] += 1
        done = runner.input_batch.num_computed_tokens_cpu[:n] + counts
        self.stats["partial_prefills"] += int((done < self.tab[:, 3]).sum())
        if self.streaming:  # (a loop over the batch's requests: only when a stream will peek)
            self.done.update(zip(ids, done.tolist()))
        pos = runner.positions[:ntok]
        if pos.device != dev:
            pos = pos.to(dev)
        arenas_here = np.unique(self.tab[:, 0])
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
            for s in self.sites:
                src = gathered.get(s)
                if src is None:
                    buf = t.fired.get(s, t.static.get(s))
                    if buf is None:
                        raise RuntimeError(f"nnvllm: no value of site {s!r} was recorded this step "
                                           "(a replayed CUDA graph without it); load with cuda_graphs=False")
                    src = buf[:, :ntok]
                if self.layer_idx is not None:
                    src = src.index_select(0, self.layer_idx)
                if src_rows is not None:
                    src = src.index_select(1, src_rows)
                arena[s].index_copy_(1, dst, src)
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

    def peek(self) -> dict:
        """For nv.stream: each request's rows computed since the last peek (positions ``[from, to)``
        of the residual stream, on the host) and the logits rows of the steps those positions
        produced (step ``s`` comes from position ``plen - 1 + s``). Small: a few positions per call."""
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
            self.peeked[rid] = done
            out[rid] = ent
        return out

    # ---- at the end
    def collect(self, tokens: dict[str, list[int]], same_process: bool) -> dict | None:
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
            if self.sample is not None and used_steps:
                t0 = _now(dev)
                tensors.update(self._samples(arena["_logits"][:used_steps], k, reqs, tokens))
                self.timings["samples"] = self.timings.get("samples", 0.0) + _now(dev) - t0
            if self.logits:
                tensors["_logits"] = arena["_logits"][:used_steps]
            t0 = _now(dev)
            out["arenas"].append(_handover(tensors, same_process, self.shm, self.timings))
            self.timings["handover"] = self.timings.get("handover", 0.0) + _now(dev) - t0
        out["timings"] = dict(self.timings)
        out["stats"] = dict(self.stats)
        out["taken_back"] = list(self.taken_back)
        return out

    def _samples(self, logits: torch.Tensor, k: int, reqs: dict, tokens: dict) -> dict[str, torch.Tensor]:
        """Sampling statistics for every step row at once (see :mod:`nnvllm.sampling`)."""
        from .sampling import chosen_logprobs, sampling_probs

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
        step = max(1, (256 << 20) // (logits.shape[-1] * 4))  # rows per chunk: ~256 MB of fp32 probs
        for a in range(0, logits.shape[0], step):
            p = sampling_probs(logits[a: a + step], temp, top_p)
            top = p.topk(kk, dim=-1)
            probs_c.append(p.gather(-1, chosen[a: a + step, None])[:, 0])
            top_i.append(top.indices)
            top_p_.append(top.values)
            logp.append(chosen_logprobs(logits[a: a + step], chosen[a: a + step]))
        return {"_probs": torch.cat(probs_c), "_top_ids": torch.cat(top_i), "_top_probs": torch.cat(top_p_),
                "_logprobs": torch.cat(logp)}


def _prompt_len(st: Any) -> int:
    """A vLLM request state's prompt length."""
    return len(st.prompt_token_ids) if st.prompt_token_ids is not None else int(st.num_prompt_tokens)


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


def _gather(x: torch.Tensor, site: str, merged_gate_up: bool) -> torch.Tensor:
    from vllm.distributed import tensor_model_parallel_all_gather

    if site == "mlp_in" and merged_gate_up:
        # Merged gate_up: each rank holds [gate_r, up_r]; the full width is [gate..., up...].
        g, u = x.chunk(2, dim=-1)
        return torch.cat([tensor_model_parallel_all_gather(g.contiguous(), -1),
                          tensor_model_parallel_all_gather(u.contiguous(), -1)], dim=-1)
    return tensor_model_parallel_all_gather(x.contiguous(), -1)


def watch_server() -> None:
    """In an isolated engine's processes: end the process group when its server is gone.

    The server (``nnvllm.server``) is the parent of vLLM's EngineCore; killed with SIGKILL it cannot
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


class _ShmFile:
    """One file in shared memory, mapped here: ``path``, its open ``fd``, the mapping, and whether the
    mapping is registered with CUDA (page-locked, so a device copy lands in it by DMA)."""

    def __init__(self, nbytes: int, pin: bool = False, device: Any = None) -> None:
        self.path = os.path.join(shm_dir(), f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        self.size = nbytes
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self.mm = None
        self.ptr = 0
        self.registered = False
        self.spare = False  # made between captures (_Spares)
        self.prep: dict[str, float] = {}  # seconds per preparation stage (benchmarks)
        if nbytes:
            try:
                import mmap
                import time

                t0 = time.perf_counter()
                os.posix_fallocate(self.fd, 0, nbytes)
                t1 = time.perf_counter()
                self.mm = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
                t2 = time.perf_counter()
                if pin:
                    self.register(device)
                self.prep = {"fallocate": t1 - t0, "map": t2 - t1, "register": time.perf_counter() - t2}
            except BaseException:  # e.g. /dev/shm full: leave no file behind
                os.close(self.fd)
                os.unlink(self.path)
                raise

    def register(self, device: Any = None) -> bool:
        if self.registered or not self.size:
            return self.registered
        if device is not None and getattr(device, "type", None) == "cuda":
            torch.cuda.set_device(device)  # a pool thread starts on device 0
        self.ptr = torch.frombuffer(self.mm, dtype=torch.uint8).data_ptr()
        # cudaHostRegisterPortable (1): page-locked for every CUDA context of the process.
        self.registered = torch.cuda.cudart().cudaHostRegister(self.ptr, self.size, 1) == 0
        return self.registered

    def host(self, nbytes: int, dtype: torch.dtype, shape) -> torch.Tensor:
        return torch.frombuffer(self.mm, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)

    def release(self, keep: int) -> None:
        """Unmap here (the client maps the file by name) and cut the file to its first ``keep`` bytes."""
        if self.registered:
            torch.cuda.cudart().cudaHostUnregister(self.ptr)
            self.registered = False
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # a tensor still views it; the mapping goes with that tensor
                pass
        try:
            if keep < self.size:
                os.ftruncate(self.fd, keep)
        finally:
            os.close(self.fd)

    def discard(self) -> None:
        self.release(self.size)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


# Hand-off files kept ready between captures (bytes; 0 turns it off), see _Spares.
SPARE_BYTES = int(os.environ.get("NNVLLM_SPARE_BYTES", 4 << 30))


class _Spares:
    """Hand-off files made ready between captures, one per file the last capture handed over.

    Preparing a file (allocating its pages, mapping them, page-locking them for DMA) costs about as
    much as a short generation: measured on an H200, a 64 x 128 capture of the Llama-1B shape waited
    0.12 s at hand-off for its 0.74 GB of files prepared while it generated. Calls in a row usually
    have the same shape (``nv.collect``'s chunks always do), so after each hand-off the worker makes
    files of the same sizes in the background, while the engine is idle, up to
    ``NNVLLM_SPARE_BYTES`` (default 4 GiB of shared memory held between calls; 0: none). A later
    capture takes the smallest that fits (cut to its size when handed over); the rest are replaced.
    They go with the engine: unlinked at exit, swept by the next engine if its process was killed.

    Handed-over files are recycled too: the worker keeps the newest of them mapped (and page-locked)
    in ``kept``, within the same budget, and does not let the client unlink them. When every tensor
    of a Run that views such a file is gone, the client names the file in its next call
    (``spec["returned"]``, see :func:`open_handover`) and the worker takes it back as a spare, ready
    at no cost: calls in a row that drop their Runs (a benchmark, ``nv.collect``'s chunks) prepare
    no file at all. A kept file the client still holds is never reused; the oldest are let go
    (unmapped and unlinked here; the client's mapping stays valid) when newer ones need the room.
    """

    def __init__(self) -> None:
        self.files: list[tuple[int, Any]] = []  # (size, future of _ShmFile)
        self.kept: dict[str, _ShmFile] = {}  # handed over, still mapped here, oldest first
        self.pool = None
        self.pending: list = []  # futures of background work (see wait)

    def kept_bytes(self) -> int:
        return sum(f.size for f in self.kept.values())

    def keep(self, f: "_ShmFile") -> bool:
        """Keep handed-over ``f`` mapped for recycling, letting the oldest kept files go if the budget
        needs it; False (and nothing kept) when ``f`` alone is over it."""
        if SPARE_BYTES <= 0 or f.size > SPARE_BYTES:
            return False
        while self.kept and self.kept_bytes() + f.size > SPARE_BYTES:
            old = self.kept.pop(next(iter(self.kept)))
            self.submit(old.discard)
        self.kept[f.path] = f
        return True

    def take_back(self, paths) -> list[str]:
        """Kept files whose Runs the client has dropped become spares again (mapped, page-locked)."""
        import concurrent.futures

        taken = []
        for p in paths or ():
            f = self.kept.pop(p, None)
            if f is None:  # not this worker's, or let go already
                continue
            fut = concurrent.futures.Future()
            fut.set_result(f)
            f.spare = True
            self.files.insert(0, (f.size, fut))  # taken before a same-size spare that may still be in the making
            taken.append(p)
        return taken

    def submit(self, fn, *args):
        fut = self.executor().submit(fn, *args)
        self.pending = [f for f in self.pending if not f.done()] + [fut]
        return fut

    def wait(self) -> None:
        """Until the background work submitted so far is done (tests)."""
        for f in list(self.pending):
            f.exception()

    def executor(self):
        if self.pool is None:
            import atexit
            import concurrent.futures

            self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="nnvllm-shm")
            atexit.register(self.drop)
        return self.pool

    def take(self, nbytes: int) -> tuple[int, Any] | None:
        fits = [(size, i) for i, (size, _) in enumerate(self.files) if nbytes <= size <= 2 * nbytes + (64 << 20)]
        return self.files.pop(min(fits)[1]) if fits else None

    def refill(self, sizes: list[int], leftovers: list[tuple[int, Any]], make) -> None:
        """Replace the spares by files of ``sizes`` (largest first, within what SPARE_BYTES leaves
        beside the kept files), reusing ``leftovers`` (prepared, never handed over) that fit; discard
        every other file."""
        old, self.files, total = self.files + leftovers, [], self.kept_bytes()
        for size in sorted(sizes, reverse=True):
            if total + size > SPARE_BYTES:
                continue
            total += size
            fit = [(s, i) for i, (s, _) in enumerate(old) if size <= s <= 2 * size + (64 << 20)]
            self.files.append(old.pop(min(fit)[1]) if fit else (size, self.submit(make, size)))
        for _, fut in old:
            self.submit(_discard_when_ready, fut)

    def drop(self) -> None:
        files, self.files = self.files, []
        for _, fut in files:
            _discard_when_ready(fut)
        kept, self.kept = self.kept, {}
        for f in kept.values():
            f.discard()


def _spare(nbytes: int, pin: bool, device: Any) -> "_ShmFile":
    f = _ShmFile(nbytes, pin, device)
    f.spare = True
    return f


def _discard_when_ready(fut) -> None:
    try:
        fut.result(timeout=30).discard()
    except Exception:  # noqa: BLE001 (a file that failed to be made left nothing behind)
        pass


_SPARES = _Spares()


class _ShmFiles:
    """The hand-off files of one capture, made ready in background threads while the engine generates.

    A fresh tmpfs page costs a fault and zeroing when first touched; done at hand-off time that is
    tens of ms per 100 MB. The sizes are known once the arena exists, so the files are allocated
    (``posix_fallocate``), mapped with ``MAP_POPULATE`` and, in ``pin`` mode, page-locked for DMA
    during the generation instead, or taken from the files the last capture left ready
    (:class:`_Spares`). After the copy, unmapping (and unpinning) happens in the background too.
    """

    def __init__(self, device: Any = None) -> None:
        # page-locked for DMA only on a CUDA engine
        self.pin = _handover_mode() == "pin" and getattr(device, "type", None) == "cuda"
        self.device = device
        self.ready: list[tuple[int, Any]] = []  # (size, future of _ShmFile)
        self.handed: set[str] = set()  # paths the client maps (and then unlinks)
        self.sizes: list[int] = []  # bytes of each file handed over
        self.made: list[str] = []  # every path this capture created outside ``ready``

    def _make(self, nbytes: int, pin: bool = False) -> _ShmFile:
        """A file made outside ``ready`` (removed at :meth:`discard` unless handed over)."""
        f = _ShmFile(nbytes, pin, self.device)
        self.made.append(f.path)
        return f

    def prepare(self, nbytes: int) -> None:
        self.ready.append(_SPARES.take(nbytes) or (nbytes, _SPARES.submit(_ShmFile, nbytes, self.pin, self.device)))

    def take(self, nbytes: int, timings: dict | None = None) -> _ShmFile:
        """The smallest prepared file of at least ``nbytes`` (waiting for that one only), else a spare
        that fits, else a new one; it is handed over. ``timings`` gets how its preparation went
        (benchmarks)."""
        fits = [(size, i) for i, (size, _) in enumerate(self.ready) if size >= nbytes]
        # else not prepared (the sampling statistics' tensors never are): a spare, else a new file
        fut = self.ready.pop(min(fits)[1])[1] if fits else (_SPARES.take(nbytes) or (0, None))[1]
        ready = fut is not None and fut.done()
        t0 = time.perf_counter()
        f = fut.result() if fut is not None else self._make(nbytes)
        if timings is not None and fut is not None:  # blocked on a file still being prepared
            timings["handover_wait"] = timings.get("handover_wait", 0.0) + time.perf_counter() - t0
        self.handed.add(f.path)
        self.sizes.append(nbytes)
        if timings is not None:
            for k, v in f.prep.items():
                timings[f"file_{k}"] = timings.get(f"file_{k}", 0.0) + v
            timings["files_ready"] = timings.get("files_ready", 0) + int(ready)
            timings["files_spare"] = timings.get("files_spare", 0) + int(f.spare)
        return f

    def release(self, f: _ShmFile, keep: int) -> bool:
        """After its copy: kept mapped for recycling (True: the client must not unlink it), else
        unmapped and cut to ``keep`` bytes in the background."""
        if _SPARES.keep(f):
            return True
        _SPARES.submit(f.release, keep)
        return False

    def discard(self) -> None:
        """Keep files like the ones handed over ready for the next capture (:class:`_Spares`),
        release the rest, and remove every file of this capture the client will not unlink,
        whatever path led here (an error mid-hand-off included)."""
        ready, self.ready = self.ready, []
        if SPARE_BYTES > 0 and self.sizes:
            _SPARES.refill(self.sizes, ready, lambda n: _spare(n, self.pin, self.device))
        else:
            for _, fut in ready:
                _SPARES.submit(_discard_when_ready, fut)
        for path in self.made:
            if path not in self.handed:
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass


def _handover_mode() -> str:
    mode = os.environ.get("NNVLLM_HANDOVER", "pin")
    if mode not in ("stage", "pin", "plain"):
        raise ValueError(f"NNVLLM_HANDOVER={mode!r}; expected 'stage', 'pin' or 'plain'")
    return mode


_STAGING: list = []  # two pinned buffers, reused across hand-offs


def _d2h(host: torch.Tensor, v: torch.Tensor, mode: str, f: _ShmFile | None = None) -> None:
    """Copy device tensor ``v`` into the shared-memory tensor ``host`` (same shape)."""
    if not v.is_cuda:
        host.copy_(v)
        return
    if mode == "pin" and f is not None and (f.registered or f.register(v.device)):
        host.copy_(v, non_blocking=True)  # DMA straight into the page-locked file
        torch.cuda.current_stream().synchronize()
        return
    if mode in ("stage", "pin"):
        # Device -> pinned staging (DMA) -> shared memory (multi-threaded CPU copy), two buffers
        # so the next chunk's DMA overlaps this chunk's CPU copy.
        chunk = 64 << 20
        if not _STAGING:
            _STAGING.extend(torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(2))
        src = v.contiguous().view(-1).view(torch.uint8)
        dst = host.view(-1).view(torch.uint8)
        events = [torch.cuda.Event(), torch.cuda.Event()]
        threads = torch.get_num_threads()
        torch.set_num_threads(max(threads, min(8, os.cpu_count() or 1)))
        try:
            n = src.numel()
            starts = list(range(0, n, chunk))
            for i, a in enumerate(starts):
                b = min(a + chunk, n)
                k = i % 2
                _STAGING[k][: b - a].copy_(src[a:b], non_blocking=True)
                events[k].record()
                if i > 0:
                    pa = starts[i - 1]
                    pb = min(pa + chunk, n)
                    events[1 - k].synchronize()
                    dst[pa:pb].copy_(_STAGING[1 - k][: pb - pa])
            if starts:
                k = (len(starts) - 1) % 2
                a = starts[-1]
                events[k].synchronize()
                dst[a:].copy_(_STAGING[k][: n - a])
        finally:
            torch.set_num_threads(threads)
        return
    host.copy_(v)


def _handover(tensors: dict[str, torch.Tensor], same_process: bool, shm: "_ShmFiles | None" = None,
              timings: dict[str, float] | None = None) -> dict:
    """Move tensors to the client: directly in one process, else through files in shared memory.

    Each tensor becomes one file in ``/dev/shm``, prepared during the generation (:class:`_ShmFiles`).
    ``NNVLLM_HANDOVER`` picks how a GPU tensor gets there: ``pin`` (default: the file's pages are
    page-locked while it is prepared, and the copy is one DMA into them), ``stage`` (DMA into a
    pinned staging buffer, then a multi-threaded copy) or ``plain`` (a pageable copy). Measured on an
    H200 (Llama-1B shape, 64 x 128, ~0.7 GB): hand-off 0.12 s with ``pin``, 0.21 s with ``stage``
    (benchmarks/results/gpu/README.md).
    """
    if same_process:
        return {"tensors": {k: v.to("cpu") for k, v in tensors.items()}}
    import time

    mode = _handover_mode()
    files = {}
    timings = {} if timings is None else timings
    for name, v in tensors.items():
        nbytes = v.numel() * v.element_size()
        t0, c0 = time.perf_counter(), time.thread_time()
        f = shm.take(nbytes, timings) if shm is not None else _ShmFile(nbytes)
        t1 = time.perf_counter()
        # this thread's CPU time in it: far below handover_file means it waited (GIL, kernel locks)
        timings["handover_file_cpu"] = timings.get("handover_file_cpu", 0.0) + time.thread_time() - c0
        if nbytes:
            _d2h(f.host(nbytes, v.dtype, v.shape), v, mode, f)
        # where the hand-off's time goes (benchmarks): waiting for a prepared file, then the copy
        timings["handover_file"] = timings.get("handover_file", 0.0) + t1 - t0
        timings["handover_copy"] = timings.get("handover_copy", 0.0) + time.perf_counter() - t1
        timings["handover_bytes"] = timings.get("handover_bytes", 0) + nbytes
        kept = shm.release(f, nbytes) if shm is not None else f.release(nbytes)
        files[name] = {"path": f.path, "dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)}
        if kept:
            files[name]["kept"] = True  # recycled (see _Spares): the client returns it, never unlinks it
    return {"files": files}


# Client side: recycled hand-off files (see _Spares) whose tensors are all gone, to name in the next call.
_RETURNED: set[str] = set()
# path -> how many times this process has mapped it: only the finalizer of its latest mapping returns it
_MAPPED: dict[str, int] = {}


def returned_files() -> list[str]:
    """The recycled hand-off files this process no longer uses (still present), for the next call's spec."""
    paths = _RETURNED.copy()  # (one C call: a finalizer adding a path cannot interleave)
    for p in [p for p in paths if not os.path.exists(p)]:  # its engine let it go, or ended
        _RETURNED.discard(p)
        _MAPPED.pop(p, None)
        paths.discard(p)
    return sorted(paths)


def _return(path: str, mapping: int) -> None:
    """Finalizer of a kept file's mapping: the file goes back unless it was handed over (and mapped) again."""
    if _MAPPED.get(path) == mapping:
        _RETURNED.add(path)


def taken_back(paths) -> None:
    """The engine took these files back (the hand-off's ``taken_back``)."""
    _RETURNED.difference_update(paths or ())


def _map_kept(path: str, nbytes: int) -> torch.Tensor:
    """Map a recycled file; when the last tensor viewing it is freed, it is returned to the engine."""
    import mmap
    import weakref

    with open(path, "r+b") as fh:
        mm = mmap.mmap(fh.fileno(), nbytes)
    arr = np.frombuffer(mm, dtype=np.uint8, count=nbytes)  # torch.from_numpy keeps arr while any view lives
    # The file is in use again. A call that ended without its hand-off (a stream left early, an
    # interrupt, an error) never heard which returned files the engine took back, so this path may
    # still be listed as returned: named in the next call, the engine would hand it over a second
    # time, over this mapping's values. And a finalizer of an older mapping of the same file, run
    # late (a cycle), must not return it either.
    mapping = _MAPPED[path] = _MAPPED.get(path, 0) + 1
    _RETURNED.discard(path)
    weakref.finalize(arr, _return, path, mapping)
    return torch.from_numpy(arr)


def open_handover(part: dict) -> dict[str, torch.Tensor]:
    """The client side of :func:`_handover`: map the files (then unlink them, unless the engine keeps
    them for recycling) or take the tensors."""
    if "tensors" in part:
        return part["tensors"]
    out = {}
    for name, f in part["files"].items():
        dtype = getattr(torch, f["dtype"])
        numel = int(np.prod(f["shape"])) if f["shape"] else 1
        item = torch.empty((), dtype=dtype).element_size()
        kept = bool(f.get("kept"))
        try:
            if numel and kept:
                out[name] = _map_kept(f["path"], numel * item).view(dtype).view(f["shape"])
            elif numel:
                t = torch.from_file(f["path"], shared=True, size=numel * item, dtype=torch.uint8)
                out[name] = t.view(dtype).view(f["shape"])
            else:
                out[name] = torch.empty(f["shape"], dtype=dtype)
                if kept:
                    _RETURNED.add(f["path"])
        finally:
            if not kept:
                try:
                    os.unlink(f["path"])  # the mapping keeps the memory until the tensor is freed
                except FileNotFoundError:
                    pass
    return out


def discard_handover(part: dict) -> None:
    for f in part.get("files", {}).values():
        if f.get("kept"):
            _RETURNED.add(f["path"])
            continue
        try:
            os.unlink(f["path"])
        except FileNotFoundError:
            pass


class RecordingRunner:
    """Model-runner mixin (first in the MRO): installs the taps at load, places rows each step.

    Also keeps nnsight's tracing honest on an engine that replays CUDA graphs: any step that carries
    an nnsight request (or runs under an installed ``model.edit``) runs eagerly, so every module
    nnsight may read or edit runs in Python.
    """

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        self.nnvllm_install()  # before vLLM records its CUDA graphs (capture_model comes later)
        sweep_stale()
        watch_server()

    def nnvllm_install(self) -> None:
        if getattr(self, "_nnvllm_taps", None) is not None:
            return
        from .arch import arch_for

        a = arch_for(self.model_config.architectures).in_engine(self.get_model())
        arch = {"family": a.family, "blocks": a.blocks, "sites": dict(a.sites), "merged_gate_up": a.merged_gate_up}
        cap = 0
        if self.device.type == "cuda" and not self.model_config.enforce_eager:
            sizes = getattr(self, "cudagraph_batch_sizes", None) or []
            cap = max(sizes) if sizes else int(
                getattr(self.compilation_config, "max_cudagraph_capture_size", 0) or 0)
        taps = _Taps(self, arch, cap)
        taps.widths = _site_widths(self.get_model(), arch, taps.tp)
        if cap:
            taps.allocate_static(taps.widths)
        self._nnvllm_taps = taps
        self._nnvllm_capture = None

    def _determine_batch_execution_and_padding(self, *args, **kwargs):
        if self._nnvllm_wants_eager():
            kwargs["force_eager"] = True
        return super()._determine_batch_execution_and_padding(*args, **kwargs)

    def _nnvllm_wants_eager(self) -> bool:
        cap = getattr(self, "_nnvllm_capture", None)
        if cap is not None and cap.need_eager:
            return True
        reqs = getattr(self, "nnsight_requests", None)
        if reqs is None:
            return False
        if reqs.templates:
            return True
        return any(r.mediator is not None for r in reqs.requests.values())

    def execute_model(self, scheduler_output, intermediate_tensors=None):
        taps = getattr(self, "_nnvllm_taps", None)
        cap = getattr(self, "_nnvllm_capture", None)
        if taps is not None:
            taps.fired = {}
            taps._prompt_rows = None
        out = super().execute_model(scheduler_output, intermediate_tensors)
        if cap is not None and out is None:
            cap.step(self)
        return out


class CaptureWorker:
    """Worker methods nnvllm's engine workers carry (reached by name through ``collective_rpc``).

    By name, not as a function: a multiprocess engine serializes RPCs with msgspec, which refuses
    functions. Results are small: the bytes of a capture travel through shared memory.
    """

    def init_device(self) -> None:
        # vLLM starts torch.distributed here (also for one device): keep its store on loopback.
        from ._compat import bind_stores_to_loopback

        bind_stores_to_loopback()
        super().init_device()

    def nnvllm_arm(self, spec: dict) -> None:
        runner = self.model_runner
        runner.nnvllm_install()
        cap = _Capture(runner._nnvllm_taps, spec)
        cap.check_memory()
        runner._nnvllm_taps.arm_edits(spec.get("edits") or [])
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

    def nnvllm_collect(self, tokens: dict, client_pid: int | None = None) -> dict | None:
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
            return cap.collect(tokens, same_process=client_pid == os.getpid())
        finally:
            if cap.shm is not None:
                cap.shm.discard()

    def nnvllm_unembed(self, final_norm: str, unembed: str) -> bytes:
        """Return this rank's final norm and its slice of the unembedding (original vocab rows only)."""
        from .arch import arch_for

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
