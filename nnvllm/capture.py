"""Capture a whole generation: every step's logits, the samples, every layer's activations.

How it stays fast: nnsight's per-invoke interventions cost Python work per prompt x step x layer
(measured 2-5x bare vLLM on CPU, 24x on an H200, see STACK.md). Here the engine's worker gets plain
torch hooks instead, installed for the duration of one ``generate`` call through vLLM's
``collective_rpc``. Each hook copies the whole ``[tokens_this_step, width]`` slab once per layer and
step, whatever the number of prompts; a pre-hook on the model records which rows belong to which
request (``input_batch.req_ids`` and ``query_start_loc``) and their positions. After the generation
the worker sorts rows into per-request ``[layer, pos, width]`` tensors by position, which also
handles chunked prefill (a prompt split over steps) and preemption (rows recomputed: the last wins).

Under tensor parallelism every rank runs the hooks; sites that are one rank's slice (``mlp_in``,
``mlp_act``) are all-gathered inside the hook, and rank 0's record is returned.
"""

from __future__ import annotations

import dataclasses
import functools
import pickle
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from .arch import SITES
from .results import Run
from .sampling import sample_stats

__all__ = ["generate"]

_SHARDED = ("mlp_in", "mlp_act")  # column-parallel outputs: each TP rank holds a slice of the width


@dataclass(frozen=True)
class _Spec:
    blocks: str
    family: str
    layers: tuple[int, ...]
    sites: dict  # site -> (path relative to block, "input"|"output")
    logits: bool = True


# ---------------------------------------------------------------- worker side (runs in the engine)


class _Recorder:
    def __init__(self, runner: Any, spec: _Spec) -> None:
        from vllm.distributed import get_tensor_model_parallel_world_size

        self.runner, self.spec = runner, spec
        self.tp = get_tensor_model_parallel_world_size()
        self.steps: list[dict] = []
        self.cur: dict | None = None
        model = runner.get_model()
        blocks = model.get_submodule(spec.blocks)
        self.handles = [model.register_forward_pre_hook(self._begin_step, with_kwargs=True)]
        for site, (path, side) in spec.sites.items():
            for j, layer in enumerate(spec.layers):
                mod = blocks[layer].get_submodule(path) if path else blocks[layer]
                if side == "output":
                    h = mod.register_forward_hook(functools.partial(self._on_output, site, j))
                else:
                    h = mod.register_forward_pre_hook(functools.partial(self._on_input, site, j))
                self.handles.append(h)
        if spec.logits:
            self.handles.append(model.logits_processor.register_forward_hook(self._on_logits))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []

    # One call per engine step, before the forward: which rows are whose.
    def _begin_step(self, module, args, kwargs):
        r = self.runner
        n = r.input_batch.num_reqs
        qsl = np.array(r.query_start_loc.np[: n + 1], copy=True)
        positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
        ntok = int(qsl[-1])
        self.cur = {
            "req_ids": list(r.input_batch.req_ids[:n]),
            "qsl": qsl,
            "positions": positions[:ntok].detach().to("cpu", copy=True),
            "acts": {s: [None] * len(self.spec.layers) for s in self.spec.sites},
            "logits": None,
        }
        self.steps.append(self.cur)

    def _store(self, site: str, j: int, x: torch.Tensor) -> None:
        cur = self.cur
        if cur is None:
            return
        x = x[: int(cur["qsl"][-1])]
        if self.tp > 1 and site in _SHARDED:
            x = self._gather(site, x)
        cur["acts"][site][j] = x.detach().clone()

    def _gather(self, site: str, x: torch.Tensor) -> torch.Tensor:
        from vllm.distributed import tensor_model_parallel_all_gather

        if site == "mlp_in" and self.spec.family == "llama":
            # Merged gate_up: each rank holds [gate_r, up_r]; the full width is [gate..., up...].
            g, u = x.chunk(2, dim=-1)
            return torch.cat(
                [tensor_model_parallel_all_gather(g.contiguous(), -1),
                 tensor_model_parallel_all_gather(u.contiguous(), -1)], dim=-1)
        return tensor_model_parallel_all_gather(x.contiguous(), -1)

    def _on_output(self, site, j, module, args, out):
        if site == "resid" and isinstance(out, tuple):
            # Llama-style blocks return (hidden, residual); the residual stream is their sum.
            x = out[0] if out[1] is None else out[0] + out[1]
        else:
            x = out[0] if isinstance(out, tuple) else out
        self._store(site, j, x)

    def _on_input(self, site, j, module, args):
        self._store(site, j, args[0])

    def _on_logits(self, module, args, out):
        if self.cur is not None and out is not None:
            n = len(self.cur["req_ids"])
            self.cur["logits"] = out[:n].detach().float().to("cpu", copy=True)

    def collect(self) -> dict[str, dict]:
        """Return {request_id: {"acts": {site: [layer, pos, width]}, "logits": {pos: [d_vocab]}}}."""
        per: dict[str, dict] = {}
        for st in self.steps:
            qsl, pos = st["qsl"], st["positions"]
            stacked = {
                s: torch.stack(v) for s, v in st["acts"].items() if v and all(t is not None for t in v)
            }
            for j, rid in enumerate(st["req_ids"]):
                a, b = int(qsl[j]), int(qsl[j + 1])
                if b <= a:
                    continue
                entry = per.setdefault(rid, {"chunks": [], "logits": {}})
                entry["chunks"].append((pos[a:b], {s: t[:, a:b] for s, t in stacked.items()}))
                if st["logits"] is not None:
                    entry["logits"][int(pos[b - 1])] = st["logits"][j]  # later steps overwrite
        out = {}
        for rid, entry in per.items():
            acts = {}
            if entry["chunks"]:
                n_pos = max(int(p.max()) for p, _ in entry["chunks"]) + 1
                for s in entry["chunks"][0][1]:
                    first = entry["chunks"][0][1][s]
                    buf = first.new_zeros(first.shape[0], n_pos, first.shape[-1])
                    for p, ch in entry["chunks"]:  # in step order: a recomputed row overwrites
                        buf[:, p.long()] = ch[s]
                    acts[s] = buf.cpu()
            # One stacked tensor per request: pickling thousands of per-step rows costs more
            # than the whole generation (measured: ~0.3 s for 64 prompts x 32 steps).
            pos = sorted(entry["logits"])
            out[rid] = {"acts": acts, "logit_pos": pos,
                        "logits": torch.stack([entry["logits"][p] for p in pos]) if pos else None}
        return out


class CaptureWorker:
    """Worker methods nnvllm's engine workers carry (reached by name through ``collective_rpc``).

    By name, not as a function: a multiprocess engine serializes RPCs with msgspec, which refuses
    functions. Results travel pickled, as bytes (as nnsight's own ``collect_nnsight`` does).
    """

    def nnvllm_arm(self, spec: dict) -> None:
        old = getattr(self, "_nnvllm_recorder", None)
        if old is not None:
            old.remove()
        spec = _Spec(spec["blocks"], spec["family"], tuple(spec["layers"]),
                     {k: tuple(v) for k, v in spec["sites"].items()}, spec["logits"])
        self._nnvllm_recorder = _Recorder(self.model_runner, spec)

    def nnvllm_collect(self) -> bytes | None:
        import pickle

        from vllm.distributed import get_tensor_model_parallel_rank

        rec = getattr(self, "_nnvllm_recorder", None)
        if rec is None:
            return None
        rec.remove()
        self._nnvllm_recorder = None
        # Every rank recorded the same full-width values; only rank 0's travel back.
        return pickle.dumps(rec.collect()) if get_tensor_model_parallel_rank() == 0 else None

    def nnvllm_unembed(self, final_norm: str, unembed: str) -> bytes:
        """Return this rank's final norm and its slice of the unembedding (original vocab rows only)."""
        import pickle

        model = self.model_runner.get_model()
        norm = model.get_submodule(final_norm)
        head = model.get_submodule(unembed)
        w = head.weight.detach()
        idx = getattr(head, "shard_indices", None)
        if idx is not None:  # VocabParallelEmbedding / ParallelLMHead: [org slice, padding, added]
            w = w[: idx.num_org_elements]
        bias = getattr(head, "bias", None)
        eps = getattr(norm, "eps", None) or getattr(norm, "variance_epsilon", 1e-6)
        return pickle.dumps({
            "kind": "layernorm" if getattr(norm, "bias", None) is not None else "rmsnorm",
            "norm_weight": norm.weight.detach().float().cpu(),
            "norm_bias": None if getattr(norm, "bias", None) is None else norm.bias.detach().float().cpu(),
            "eps": float(eps),
            "weight": w.float().cpu(),
            "bias": None if bias is None or idx is None else bias.detach()[: idx.num_org_elements].float().cpu(),
        })


# ---------------------------------------------------------------- the engine adapter
# generate() and unembedding() reach the engine through one of these: in-process it is vLLM's
# synchronous LLM in this process; an isolated engine (nnvllm.isolated) provides its own adapter
# with the same three methods, which do the same over HTTP. Everything else stays client side.


def plain_output(out) -> dict:
    """A vLLM ``RequestOutput`` as the plain dict a ``Run`` is assembled from (both engine kinds)."""
    gen = out.outputs[0]
    return {"request_id": str(out.request_id), "prompt_token_ids": list(out.prompt_token_ids),
            "token_ids": list(gen.token_ids), "text": gen.text}


class InProcessEngine:
    """The engine in this process (``model.llm``), called directly."""

    def __init__(self, model) -> None:
        llm = model.llm
        if llm is None:
            raise RuntimeError("this model was closed; load it again with nv.load(...)")
        self.llm = llm

    def capture(self, prompts: list[str], params: dict, spec: dict) -> tuple[list[dict], bytes | None]:
        """Arm the capture hooks, generate, collect: (plain outputs, pickled records)."""
        from vllm import SamplingParams

        self.llm.collective_rpc("nnvllm_arm", args=(spec,))
        try:
            outputs = self.llm.generate(prompts, SamplingParams(**params), use_tqdm=False)
        finally:
            raw = self.llm.collective_rpc("nnvllm_collect")[0]
        return [plain_output(o) for o in outputs], raw

    def unembed(self, final_norm: str, unembed: str) -> list[dict]:
        """Each TP rank's final norm and unembedding slice (see ``CaptureWorker.nnvllm_unembed``)."""
        parts = self.llm.collective_rpc("nnvllm_unembed", args=(final_norm, unembed))
        return [pickle.loads(b) for b in parts]

    def info(self) -> dict:
        eng = self.llm.llm_engine
        return {"dtype": str(eng.model_config.dtype), "vocab_size": eng.model_config.get_vocab_size(),
                "tp": eng.vllm_config.parallel_config.tensor_parallel_size}


def engine_of(model):
    """The adapter ``generate``/``unembedding`` call: the model's own (isolated) or in-process."""
    own = getattr(type(model), "_engine_adapter", None)
    return own(model) if own is not None else InProcessEngine(model)


# ---------------------------------------------------------------- client side


def _layers(spec, n_layers: int) -> list[int]:
    if spec is None:
        return []
    if isinstance(spec, str):
        if spec != "all":
            raise ValueError(f"layers={spec!r}; expected 'all', an int, a list of ints or None")
        return list(range(n_layers))
    items = [spec] if isinstance(spec, int) else list(spec)
    out = []
    for x in items:
        if not isinstance(x, (int, np.integer)) or isinstance(x, bool):
            raise TypeError(f"layers must hold ints, got {x!r} ({type(x).__name__})")
        if not -n_layers <= x < n_layers:
            raise ValueError(
                f"layer={x} out of range for a {n_layers}-layer model (0-{n_layers - 1})"
            ) from None
        out.append(int(x) % n_layers)
    return out


def _prompts(prompts) -> list[str]:
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, Sequence) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise TypeError(
            f"prompts must be a str or a non-empty list of str, got {type(prompts).__name__}"
            + (f" {prompts!r}"[:80] if not isinstance(prompts, Sequence) or not prompts else "")
        ) from None
    if any(not p for p in prompts):
        raise ValueError("prompts contains an empty string; every prompt needs at least one token")
    return list(prompts)


def generate(
    model,
    prompts: str | list[str],
    max_tokens: int = 10,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    layers="all",
    logits: bool = True,
    top_k: int = 5,
    sites: Sequence[str] = (),
    ignore_eos: bool = False,
) -> Run:
    """Generate from ``prompts`` on the engine and capture logits, samples and activations.

    Args:
        model: from :func:`nnvllm.load`.
        prompts: one prompt or a list; each becomes one vLLM request, batched by the engine.
        max_tokens: tokens to generate per prompt (one logits row each).
        temperature: 0 is greedy.
        top_p: nucleus sampling mass.
        seed: makes sampling reproducible: the same seed draws the same tokens.
        layers: blocks whose output (the residual stream) to keep: "all", an int, a list, or None.
        logits: keep the ``[step, d_vocab]`` pre-sampling logits (samples are computed either way).
        top_k: how many alternatives :class:`~nnvllm.results.Samples` reports per step.
        sites: extra per-block sites to keep, from ``("attn", "mlp", "mlp_in", "mlp_act")``,
            for the same ``layers``.
        ignore_eos: keep generating past the end-of-sequence token (a fixed number of steps).

    Returns:
        A :class:`~nnvllm.results.Run`; ``run.resid[i]`` is ``[layer, pos, d_model]`` over the prompt
        and every generated token that was fed back.

    Example:
        >>> run = nv.generate(model, ["The capital of France is"], max_tokens=3)   # doctest: +SKIP
        >>> run.text[0], run.resid[0].shape                                        # doctest: +SKIP
        (' Paris.', torch.Size([6, 6, 64]))
    """
    prompts = _prompts(prompts)
    if not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens={max_tokens!r}; expected an int >= 1")
    if temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"temperature={temperature}, top_p={top_p}; expected temperature >= 0 and 0 < top_p <= 1")
    if not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k={top_k!r}; expected an int >= 1 (alternatives reported per step)")
    if isinstance(sites, str):
        sites = (sites,)
    bad = [s for s in sites if s not in SITES or s == "resid"]
    if bad:
        raise ValueError(f"sites={list(sites)!r}: unknown {bad}; choose from {list(SITES[1:])}")
    engine = engine_of(model)  # a closed (or dead) engine says so here
    layer_ids = _layers(layers, model.n_layers)
    arch = model.arch
    wanted = (("resid",) if layer_ids else ()) + tuple(dict.fromkeys(sites))
    if sites and not layer_ids:
        raise ValueError("sites= needs layers (which blocks to read them at); got layers=None")
    spec = _Spec(
        blocks=arch.blocks, family=arch.family, layers=tuple(layer_ids),
        sites={s: arch.site(s) for s in wanted},
    )
    params = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, ignore_eos=ignore_eos)
    outputs, raw = engine.capture(prompts, params, dataclasses.asdict(spec))
    records = pickle.loads(raw) if raw else {}
    info = engine.info()
    # Internal request ids are the external id plus "-<8 random chars>" (vLLM >= 0.11).
    external = {o["request_id"] for o in outputs}
    by_external = {(rid if rid in external else rid.rsplit("-", 1)[0]): rec for rid, rec in records.items()}

    run = Run(prompts=prompts, prompt_ids=[], tokens=[], text=[], logits=[] if logits else None,
              samples=[], resid=[] if layer_ids else None, layers=layer_ids,
              sites={s: [] for s in wanted if s != "resid"},
              sampling=dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                            top_k=top_k, ignore_eos=ignore_eos),
              meta=dict(engine="vllm", model=model.checkpoint, dtype=info["dtype"], tp=info["tp"]))
    for out in outputs:
        rid = out["request_id"]
        rec = by_external.get(rid)
        if rec is None:
            raise RuntimeError(f"no capture arrived for request {rid}; was the engine restarted?")
        p_ids = out["prompt_token_ids"]
        toks = out["token_ids"]
        n_pos = len(p_ids) + len(toks) - 1
        run.prompt_ids.append(p_ids)
        run.tokens.append(toks)
        run.text.append(out["text"])
        by_pos = dict(zip(rec["logit_pos"], rec["logits"])) if rec["logits"] is not None else {}
        steps = [by_pos.get(len(p_ids) - 1 + t) for t in range(len(toks))]
        if any(s is None for s in steps):
            raise RuntimeError(f"missing logits for request {rid}: steps {[i for i, s in enumerate(steps) if s is None]}")
        lg = torch.stack(steps) if steps else torch.zeros(0)
        run.samples.append(sample_stats(lg, toks, temperature=temperature, top_p=top_p, k=top_k))
        if logits:
            run.logits.append(lg)
        for s, t in rec["acts"].items():
            t = t[:, :n_pos]
            if t.shape[1] != n_pos:
                raise RuntimeError(f"request {rid}: captured {t.shape[1]} positions of {n_pos} for {s}")
            (run.resid if s == "resid" else run.sites[s]).append(t)
    return run

