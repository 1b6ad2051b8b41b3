"""The taps: permanent hooks that copy each site of each block into static buffers, and apply edits there.

Taps are installed once, at model load, before vLLM records its CUDA graphs. A tap is a forward hook
that copies one site of one block into a preallocated static buffer ``[layer, rows, width]`` (rows:
vLLM's largest graph batch). While vLLM records a graph the copy is recorded with it, so every replay
refills the buffer with no Python at all. In an eager step (prefill, a batch larger than any graph,
the CPU backend) the hook runs and does the same copy. Edits land in place at the same hooks.

Under tensor parallelism every rank runs the taps; the sites that are one rank's slice
(``_SHARDED``, and the per-head sites: each rank holds its heads) are all-gathered once per step
(:mod:`.arena`), and rank 0 keeps the record.

The per-head sites (``q``, ``k``, ``v``, ``z``; :data:`nnvllm.arch.HEAD_SITES`) are read where vLLM's
attention layer receives q, k and v (after the rotary embedding) and at the input of the attention's
output projection (z), each flat ``[tokens, heads * d_head]`` like any site. A native vLLM model calls
its ``Attention`` layer as a module (a forward pre-hook reads the three); under vLLM's Transformers
backend transformers' attention module calls vLLM's attention function, registered as ``"vllm"`` with
transformers, which calls the layer's ``forward`` directly (no module hook fires), so that function
is wrapped once per process (:func:`_backend_attention`) and finds the taps of the calling module.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

# Column-parallel outputs: each TP rank holds a slice of the width.
_SHARDED = ("mlp_in", "mlp_act")
_HEAD_SITES = ("q", "k", "v", "z")  # each TP rank holds its heads (KV heads: replicated where fewer than ranks)
# Under the Transformers backend: id(transformers' attention module) -> its block's q/k/v writer, for the wrapped
# attention function (one model per worker process; a new install replaces the entries).
_BACKEND: dict[int, Any] = {}
# Static buffers for graph replay are kept under this many bytes per engine; sites that would not
# fit are recorded by running the steps of a capture that asks for them eagerly.
STATIC_BUDGET = int(os.environ.get("NNVLLM_STATIC_BUDGET", 2 << 30))


def graph_sites(value: str | None, sites: list[str]) -> list[str]:
    """The sites whose copies the CUDA graphs record, in table order: ``NNVLLM_GRAPH_SITES``
    (comma-separated, e.g. ``resid``) or, unset, every site. Each recorded site costs every replayed
    step one copy per block, read or not; a site left out is captured by running the steps that ask
    for it eagerly."""
    if value is None or not value.strip():
        return list(sites)
    named = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in named if v not in sites]
    if unknown:
        raise ValueError(f"NNVLLM_GRAPH_SITES={value!r} names {unknown}, which this model does not offer; "
                         f"expected a comma-separated subset of {list(sites)}, or leave it unset for every site")
    return [s for s in sites if s in named]


class _Taps:
    """The permanent hooks of one model and their static buffers (one per site: ``[layer, cap, width]``)."""

    def __init__(self, runner: Any, arch: dict, cap: int, compiled: bool = False) -> None:
        from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

        self.runner = runner
        self.arch = arch
        # Under vLLM's torch.compile the hooks are traced into the compiled forward: each calls one of
        # nnvllm's opaque ops (tap, tap_qkv), whose Python runs at every call of the compiled code.
        self.compiled = compiled
        self.tp = get_tensor_model_parallel_world_size()
        self.rank = get_tensor_model_parallel_rank()
        self.active = False  # a capture is armed (eager hooks record only then)
        self.wanted: set[str] | None = None  # the sites the armed capture reads (None: every site)
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
        self.heads = arch.get("heads") or {}
        if self.heads.get("core"):
            self._install_heads(blocks)
        self.in_graph: set[str] = set()  # sites whose copy is recorded in the CUDA graphs
        self.edits: list[dict] = []  # armed edits (see arm_edits); the hooks make them in eager steps
        # [layer, width]: what every replayed CUDA graph adds to each block's residual stream (zero
        # unless steering edits are armed): steering at graph speed (see replayable).
        self.gadd: torch.Tensor | None = None
        self._prompt_rows: tuple | None = None  # this forward's (position, is-prompt, is-generated) per row

    # ---- per-head sites
    def _install_heads(self, blocks) -> None:
        h = self.heads
        for j in range(self.n_layers):
            core = blocks[j].get_submodule(h["core"])
            if h.get("backend"):
                _backend_attention()
                _BACKEND[id(blocks[j].get_submodule(h["core"].rsplit(".", 1)[0]))] = self._qkv_writer(j)
            else:
                self.handles.append(core.register_forward_pre_hook(self._qkv_hook(j), with_kwargs=True))
            out = blocks[j].get_submodule(h["out"])
            self.handles.append(out.register_forward_pre_hook(self._input_hook("z", j)))
        self.sites.extend(_HEAD_SITES)

    def _qkv_writer(self, j: int):
        """``(q, k, v) -> None`` for block ``j``: :meth:`write_qkv`, or under torch.compile the opaque
        op that calls it."""
        if not self.compiled:
            return lambda q, k, v: self.write_qkv(j, q, k, v)
        key, op = _register(lambda q, k, v: self.write_qkv(j, q, k, v)), _ops().tap_qkv
        return lambda q, k, v: op(q, k, v, key)

    def _qkv_hook(self, j: int):
        write = self._qkv_writer(j)

        def hook(module, args, kwargs):
            qkv = list(args[:3]) + [kwargs.get(n) for n in ("query", "key", "value")[len(args[:3]):]]
            write(*qkv)
        return hook

    def write_qkv(self, j: int, q, k, v) -> None:
        for site, x in (("q", q), ("k", k), ("v", v)):
            if x is not None:
                self._write(site, j, x.reshape(x.shape[0], -1) if x.dim() != 2 else x)

    def sharded(self, site: str) -> bool:
        """Whether each TP rank holds a slice of ``site``'s width (gathered once per step)."""
        return self.tp > 1 and (site in _SHARDED or site in _HEAD_SITES)

    def full_width(self, site: str) -> int:
        """``site``'s width once gathered over the TP ranks (KV heads replicated over ranks count once)."""
        w = self.width.get(site) or self.widths[site]
        if not self.sharded(site):
            return w
        if site in ("k", "v"):
            return self.heads["n_kv_heads"] * self.heads["head_size"]
        return w * self.tp

    def kv_take(self) -> torch.Tensor | None:
        """After gathering k or v over the ranks: which gathered heads are the model's KV heads, in order
        (with fewer KV heads than ranks, rank ``r`` holds KV head ``r // (tp / n_kv_heads)``)."""
        n_kv = self.heads["n_kv_heads"]
        if n_kv >= self.tp:
            return None
        return torch.arange(n_kv, device=self.device) * (self.tp // n_kv)

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
        add|set|scale|patch|clamp, "vector" (list) or None, "values" ([layer, pos, width] lists, patch) or
        None, "value", "scale", "positions": all|prompt|generated}``; a clamp also names its SAE
        (``"sae"``: its folder, read here) and ``"clamp"``: ``[feature, value]`` pairs. Eager steps make them in the
        hooks; if :meth:`replayable`, their sum per layer also goes into :attr:`gadd` for replays."""
        from .features import edit_saes

        armed = []
        saes = iter(edit_saes([e["sae"] for e in edits if e["op"] == "clamp"], self.device))
        for e in edits:
            if e["site"] == "z" and self._head_columns(e.get("heads")) is None:
                continue  # none of the heads it edits is this rank's
            vec, vals = e.get("vector"), e.get("values")
            pr, at = e.get("prompts"), e["positions"]
            if e["op"] == "clamp":  # the SAE on the device, the features and the values they are set to
                fv = torch.tensor(e["clamp"], dtype=torch.float64, device=self.device)
                e = {**e, "sae_obj": next(saes), "feats": fv[:, 0].long(), "to": fv[:, 1].float()}
            armed.append({**e, "layers": {j: k for k, j in enumerate(e["layers"])},
                          "at": torch.tensor(at, dtype=torch.int64, device=self.device) if isinstance(at, list) else None,
                          "prompts": None if pr is None else torch.tensor(pr, dtype=torch.int64, device=self.device),
                          "vec": None if vec is None else torch.tensor(vec, dtype=torch.float32, device=self.device),
                          "vals": None if vals is None else torch.tensor(vals, dtype=torch.float32, device=self.device)})
            if e["site"] == "z":
                armed[-1] = self._by_head(armed[-1])
        self.disarm_edits()
        if armed and self.replayable(edits):
            acc = torch.zeros(self.gadd.shape, dtype=torch.float32, device=self.device)
            for e in armed:
                for j in e["layers"]:
                    acc[j] += e["vec"] * e["scale"]
            self.gadd.copy_(acc)  # one edit per layer: the very values the hook adds, (vec * scale).to(dtype)
        self.edits = armed

    def _head_columns(self, heads: list[int] | None) -> torch.Tensor | None:
        """This rank's columns of z that an edit of ``heads`` (None: all) touches, as a bool mask over
        its heads (rank ``r`` holds heads ``r * H / tp`` and up, head by head), or None where it holds
        none of them."""
        d, hl = self.heads["head_size"], self.heads["n_heads"] // self.tp
        lo = self.rank * hl
        local = [h - lo for h in (range(lo, lo + hl) if heads is None else heads) if lo <= h < lo + hl]
        if not local:
            return None
        cols = torch.zeros(hl, d, dtype=torch.bool, device=self.device)
        cols[local] = True
        return cols.flatten()

    def _by_head(self, e: dict) -> dict:
        """An armed edit of z as this rank makes it: its columns (``"cols"``, None: all of them), a
        vector over this rank's heads (one head's vector repeated into each, or the rank's slice of a
        whole-width one), the rank's slice of a patch's values."""
        d, hl = self.heads["head_size"], self.heads["n_heads"] // self.tp
        lo = self.rank * hl * d
        vec, vals = e["vec"], e["vals"]
        if vec is not None:
            vec = vec.repeat(hl) if e.get("heads") is not None else vec[lo: lo + hl * d]
        if vals is not None:
            vals = vals[..., lo: lo + hl * d]
        cols = None if e.get("heads") is None else self._head_columns(e["heads"])
        return {**e, "vec": vec, "vals": vals, "cols": cols}

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
            elif op == "clamp":  # the SAE reads the whole stream; its delta goes where add's vector goes
                stream = (x + residual) if residual is not None else x
                new = x + e["sae_obj"].clamp_delta(stream, e["feats"], e["to"]).to(x.dtype)
            elif op == "set":
                new = (vec.to(x.dtype).expand_as(x) if vec is not None else torch.full_like(x, float(e["value"])))
            else:  # scale
                new = ((x + residual) if residual is not None else x) * e["scale"]
            if residual is not None and op not in ("add", "clamp"):  # the edited value is the whole stream
                residual.copy_(torch.zeros_like(residual) if m is None else residual.masked_fill(m[:, None], 0))
            cols = e.get("cols")  # z: the columns of the heads it edits
            if cols is not None:
                x.copy_(torch.where(cols if m is None else (m[:, None] & cols), new, x))
            else:
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
        if not capturing and (not self.active or (self.wanted is not None and site not in self.wanted)):
            return  # an eager step copies only what the armed capture reads
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

    def _tap(self, site: str, j: int, x: torch.Tensor, residual: torch.Tensor | None = None) -> None:
        """One site of block ``j`` as a forward reaches it: ``x`` (``[tokens, width]``; with
        ``residual``, a Llama-style block's stream is their sum). While a graph is recorded, the armed
        steering of :attr:`gadd` is recorded into it; edits are made in place; then the copy."""
        if site == "resid" and self.gadd is not None and x.is_cuda and torch.cuda.is_current_stream_capturing():
            x.add_(self.gadd[j])  # recorded into every graph (see arm_edits); eager steps skip it
        if self.edits:
            self._apply_edits(site, j, x, residual)
        self._write(site, j, x, residual)

    def _site_tap(self, site: str, j: int):
        """``(x, residual=None) -> None`` for one site of block ``j``: :meth:`_tap`, or under
        torch.compile the opaque op that calls it."""
        if not self.compiled:
            return lambda x, r=None: self._tap(site, j, x, r)
        key, op = _register(lambda x, r: self._tap(site, j, x, r)), _ops().tap
        return lambda x, r=None: op(x, r, key)

    def _output_hook(self, site: str, j: int):
        tap = self._site_tap(site, j)

        def hook(module, args, out):
            if isinstance(out, tuple):
                if site == "resid" and len(out) > 1 and isinstance(out[1], torch.Tensor):
                    # Llama-style blocks return (hidden, residual): the residual stream is their sum.
                    tap(_tokens(out[0]), _tokens(out[1]))
                    return
                out = out[0]
            tap(_tokens(out))
        return hook

    def _input_hook(self, site: str, j: int):
        tap = self._site_tap(site, j)

        def hook(module, args):
            tap(_tokens(args[0]))
        return hook

    def allocate_static(self, widths: dict[str, int]) -> None:
        """Static buffers for graph replay: of the sites :func:`graph_sites` names, as many as fit in
        :data:`STATIC_BUDGET`."""
        if self.cap <= 0:
            return
        item = self.dtype.itemsize
        used = 0
        for site in graph_sites(os.environ.get("NNVLLM_GRAPH_SITES"), self.sites):  # in table order: resid first
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


# Under torch.compile: key -> the Python a traced hook's opaque op runs (one model per worker process).
_TAPPED: list = []
_OPS: Any = None


def _register(fn) -> int:
    _TAPPED.append(fn)
    return len(_TAPPED) - 1


def _ops() -> Any:
    """nnvllm's two opaque ops, registered with torch once per process: ``nnvllm::tap(x, residual,
    key)`` and ``nnvllm::tap_qkv(q, k, v, key)``. torch.compile keeps each as one call in the compiled
    forward (tap's declared in-place writes, tap_qkv's declared side effect keep them there), so the
    taps' Python (edits, the copy into a static buffer, recorded along with a CUDA graph) runs as in an
    eager forward. Registered when the taps are installed, before vLLM traces the forward."""
    global _OPS
    if _OPS is None:
        from torch.fx.node import has_side_effect
        from torch.library import custom_op

        @custom_op("nnvllm::tap", mutates_args=("x", "residual"))
        def tap(x: torch.Tensor, residual: torch.Tensor | None, key: int) -> None:
            _TAPPED[key](x, residual)

        @tap.register_fake
        def _(x, residual, key):
            return None

        # q, k and v are only read: a declared write would have the compiler copy q (and re-join q,
        # k, v after it) in every block; marked as having a side effect, the call is kept anyway.
        @custom_op("nnvllm::tap_qkv", mutates_args=())
        def tap_qkv(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, key: int) -> None:
            _TAPPED[key](q, k, v)

        @tap_qkv.register_fake
        def _(q, k, v, key):
            return None

        has_side_effect(torch.ops.nnvllm.tap_qkv.default)
        _OPS = torch.ops.nnvllm
    return _OPS


def _tokens(x: torch.Tensor) -> torch.Tensor:
    """``[tokens, width]``: vLLM's native blocks see the batch's tokens flattened; transformers' blocks
    under vLLM's Transformers backend see ``[1, tokens, width]`` (a view, so in-place edits land)."""
    return x[0] if x.dim() == 3 and x.shape[0] == 1 else x


def _prompt_len(st: Any) -> int:
    """A vLLM request state's prompt length."""
    return len(st.prompt_token_ids) if st.prompt_token_ids is not None else int(st.num_prompt_tokens)


def head_layout(arch: Any, model: Any, config: Any) -> dict:
    """What the taps need of a family's heads (:class:`nnvllm.arch.Heads`) in this engine's model:
    module paths, whether the Transformers backend calls the attention layer, head counts and width,
    and the :class:`~nnvllm.arch.AttentionSpec` for the client; ``{"error": why}`` where the family's
    attention cannot be read per head (``attention_spec`` refuses it)."""
    from ...arch import attention_spec

    if arch.heads is None:
        return {"error": f"the {arch.family} family's attention is not read per head (its Arch has heads=None)"}
    try:
        spec = attention_spec(config, arch)
    except ValueError as e:
        return {"error": str(e)}
    blocks = model.get_submodule(arch.blocks)
    try:
        blocks[0].get_submodule(arch.heads.core)
        blocks[0].get_submodule(arch.heads.out)
    except AttributeError:
        return {"error": f"vLLM's {type(model).__name__} has no {arch.heads.core!r} or {arch.heads.out!r} in its "
                         "blocks, where the family's Heads put the attention layer and its output projection"}
    return {"core": arch.heads.core, "out": arch.heads.out, "backend": type(model).__name__.startswith("Transformers"),
            "n_heads": spec.n_heads, "n_kv_heads": spec.n_kv_heads, "head_size": spec.d_head,
            "spec": spec.to_dict()}


def _backend_attention() -> None:
    """Wrap the attention function vLLM's Transformers backend registers with transformers (once)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    inner = ALL_ATTENTION_FUNCTIONS["vllm"]
    if getattr(inner, "_nnvllm", False):
        return

    def attention(module, query, key, value, attention_mask, **kwargs):
        write = _BACKEND.get(id(module))
        if write is not None:  # [1, heads, tokens, d_head] -> [tokens, heads * d_head]
            write(*(x[0].transpose(0, 1) for x in (query, key, value)))
        return inner(module, query, key, value, attention_mask, **kwargs)

    attention._nnvllm = True
    ALL_ATTENTION_FUNCTIONS["vllm"] = attention


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
    h = arch.get("heads") or {}
    if h.get("core"):  # this rank's heads: vLLM's attention layer knows them
        core = blocks[0].get_submodule(h["core"])
        out["q"] = out["z"] = core.num_heads * core.head_size
        out["k"] = out["v"] = core.num_kv_heads * core.head_size
    return {k: v for k, v in out.items() if v}


