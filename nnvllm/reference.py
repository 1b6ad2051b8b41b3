"""The same capture on plain transformers: the ground truth every vLLM number is checked against.

``reference(path, prompts, ...)`` returns a :class:`~nnvllm.results.Run` shaped exactly like
:func:`nnvllm.generate`'s, computed by an HF model with forward hooks on the same module paths
(:mod:`nnvllm.arch`). Given ``tokens=run.tokens`` it replays another run's generated tokens
(teacher forcing), so activations and logits can be compared position by position even where
sampling would have drawn differently.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import sys
from typing import Sequence

import torch

from . import _validate
from .arch import HEAD_SITES, arch_for, attention_spec
from .results import Run
from .sampling import sample_stats

__all__ = ["reference", "load_reference", "attentions"]


def _tokens(tokens, n_prompts: int) -> list[list[int]] | None:
    """``tokens=`` (teacher forcing): None, or one non-empty list of token ids per prompt."""
    if tokens is None:
        return None
    expected = f"expected None or one list of token ids per prompt ({n_prompts})"
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise TypeError(f"tokens={_validate._show(tokens)}: {expected}")
    if len(tokens) != n_prompts:
        raise ValueError(f"tokens has {len(tokens)} entries for {n_prompts} prompts; give one list per prompt")
    out = []
    for i, t in enumerate(tokens):
        if isinstance(t, (str, bytes)) or not isinstance(t, Sequence) or not len(t):
            raise (ValueError if isinstance(t, Sequence) and not isinstance(t, (str, bytes)) else TypeError)(
                f"tokens[{i}]={_validate._show(t)}: {expected}, each non-empty")
        out.append([_validate.integer(f"tokens[{i}][{j}]", x, lo=0) for j, x in enumerate(t)])
    return out


@functools.lru_cache(maxsize=4)
def load_reference(path: str, dtype: str = "float32", device: str = "cpu"):
    """Return ``(hf_model, tokenizer)`` for ``path`` in eval mode on ``device`` (cached: the last four are kept)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from transformers import AutoConfig

    kw = {}
    config = AutoConfig.from_pretrained(path)
    if getattr(config, "attn_logit_softcapping", None):
        kw["attn_implementation"] = "eager"  # SDPA has no attention soft-cap (Gemma 2): the exact path
    plain_transformers_classes(config)
    with no_transformers_bars():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **kw).to(device).eval()
    return model, AutoTokenizer.from_pretrained(path)


def plain_transformers_classes(config) -> bool:
    """Make transformers' classes for ``config`` its own again if vLLM changed them in this process.

    vLLM's Transformers backend (how it runs GPT-NeoX on vLLM 0.32 and OLMo 2) decorates transformers'
    model classes in place for torch.compile (``support_torch_compile`` adds a base class and a new
    ``__init__`` that needs vLLM's config), so building the reference after an in-process engine
    failed ("Current vLLM config is not set"). Re-importing the modeling module gives fresh, plain
    classes for the reference; the engine's modules keep the decorated ones. Returns whether it did.
    """
    import importlib
    import sys

    from transformers import AutoModelForCausalLM

    try:
        cls = AutoModelForCausalLM._model_mapping[type(config)]
    except Exception:  # noqa: BLE001  (an unknown config: from_pretrained says so itself)
        return False
    module = sys.modules.get(cls.__module__)
    if module is None:
        return False
    touched = any(isinstance(c, type) and any(b.__name__ == "TorchCompileWithNoGuardsWrapper" for b in c.__mro__)
                  for c in vars(module).values())
    if touched:
        importlib.reload(module)
    return touched


@contextlib.contextmanager
def no_transformers_bars():
    """transformers' "Loading weights" / "Writing model shards" bars off while nnvllm loads or writes a
    checkpoint for the user; the user's own setting is restored after."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


_SAMPLING_EPS = 1e-5  # vLLM samples greedily below this temperature


class _Sampler:
    """One request's draws as vLLM's sampler makes them for a request with its own ``seed``.

    vLLM divides the fp32 logits by the temperature, masks top-p as :func:`nnvllm.sampling.sampling_probs`
    does, then on the CPU (``TopKTopPSampler.forward_cpu``) takes the request's next
    ``randint(0, 2**31)`` from a ``torch.Generator`` seeded with its seed and draws
    ``argmax(logits + gumbel)``, the Gumbel noise of token ``j`` hashed from that number and ``j``
    (SplitMix64, in float64: ``fused_gumbel_argmax``); on a GPU (``forward_native``) it draws
    ``argmax(probs / q)``, ``q`` exponential noise from a CUDA generator seeded with the seed.
    """

    def __init__(self, seed: int, device) -> None:
        self.device = torch.device(device)
        self.gen = torch.Generator(device=self.device).manual_seed(seed)

    def __call__(self, logits, temperature: float, top_p: float) -> int:
        if temperature < _SAMPLING_EPS:
            return int(logits.argmax())
        x = logits.float() / temperature
        if top_p < 1.0:  # vLLM's apply_top_k_top_p_pytorch (the one nnvllm.sampling repeats)
            srt, idx = x.sort(descending=False)
            mask = srt.softmax(-1).cumsum(-1) <= 1 - top_p
            mask[-1] = False
            x = x.scatter(-1, idx, srt.masked_fill(mask, float("-inf")))
        if self.device.type == "cuda":
            probs = x.softmax(-1, dtype=torch.float32)
            q = torch.empty_like(probs).exponential_(generator=self.gen)
            return int(probs.div(q).argmax())
        noise_seed = int(torch.randint(0, 2**31, (1,), generator=self.gen, dtype=torch.long))
        return int((x.double().cpu() + _gumbel(noise_seed, x.shape[-1])).argmax())


def _u64(x: int) -> int:
    """A uint64 constant as the int64 bit pattern torch holds."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x, n: int):
    """Logical right shift of int64 tensors that hold uint64 bits."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def _splitmix64(z):
    z = (z ^ _shr(z, 30)) * _u64(0xBF58476D1CE4E5B9)
    z = (z ^ _shr(z, 27)) * _u64(0x94D049BB133111EB)
    return z ^ _shr(z, 31)


def _gumbel(seed: int, vocab: int):
    """``[vocab]`` float64 Gumbel noise of vLLM's CPU sampler for one row drawn with ``seed``."""
    key = _splitmix64(torch.tensor(seed, dtype=torch.int64))
    i = torch.arange(1, vocab + 1, dtype=torch.int64)
    bits = _shr(_splitmix64(key + i * _u64(0x9E3779B97F4A7C15)), 11)
    u = (bits.double() + 0.5) * 2.0**-53
    return -torch.log(-torch.log(u))


# ---------------------------------------------------------------- per-head sites (q, k, v, z) and patterns
# transformers hands each layer's q, k, v ([batch, heads, pos, d_head], after the rotary embedding) to
# an attention function it looks up by name. A function of nnvllm's, registered once, records them
# and runs the family's own eager attention (the exact path: scale, soft-cap, window mask, GQA), whose
# probabilities it also records; the recorder of the current call is a context variable, so two
# calls never share one.
_CAPTURE_IMPL = "nnvllm_heads"
_RECORDER: contextvars.ContextVar = contextvars.ContextVar("nnvllm_heads_recorder", default=None)


def _recording_attention(module, query, key, value, attention_mask, **kwargs):
    eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if eager is None:
        raise RuntimeError(f"{type(module).__name__}: its modeling module has no eager_attention_forward, which "
                           "nnvllm's reference runs to record q, k, v and the attention probabilities")
    out, probs = eager(module, query, key, value, attention_mask, **kwargs)
    record = _RECORDER.get()
    if record is not None:
        record(module, query, key, value, probs)
    return out, probs


@contextlib.contextmanager
def _heads_recorded(model, record):
    """Run ``model`` with :func:`_recording_attention` (eager attention, masks as eager builds them),
    calling ``record(module, q, k, v, probs)`` for every attention layer; the model's own attention
    implementation is restored after."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(_CAPTURE_IMPL, _recording_attention)
    AttentionMaskInterface.register(_CAPTURE_IMPL, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    was = model.config._attn_implementation
    token = _RECORDER.set(record)
    model.set_attn_implementation(_CAPTURE_IMPL)
    try:
        yield
    finally:
        model.set_attn_implementation(was)
        _RECORDER.reset(token)


def _split_head_sites(sites) -> tuple:
    """``sites=`` as (the per-block sites, the per-head ones of :data:`nnvllm.arch.HEAD_SITES`)."""
    if isinstance(sites, str):
        sites = (sites,)
    if sites is None or not isinstance(sites, Sequence):
        return sites, ()
    heads = tuple(dict.fromkeys(s for s in sites if isinstance(s, str) and s in HEAD_SITES))
    return tuple(s for s in sites if not (isinstance(s, str) and s in HEAD_SITES)), heads


def _head_hooks(model, arch, layer_ids: list[int], wanted: Sequence[str], got: dict) -> list:
    """z: a pre-hook on each wanted block's output projection; q, k, v come from the recorder."""
    handles = []
    if "z" in wanted:
        blocks = model.get_submodule(arch.blocks)
        for j, layer in enumerate(layer_ids):
            mod = blocks[layer].get_submodule(arch.heads.hf_out or arch.heads.out)
            handles.append(mod.register_forward_pre_hook(
                lambda m, a, j=j: got.__setitem__(("z", j), a[0][0].detach().float().cpu().clone())))
    return handles


def _head_acts(got: dict, wanted: Sequence[str], n_layers: int, n_heads: int) -> dict:
    """{site: [layer, pos, heads, d_head]} from what the recorder and hooks kept."""
    acts = {}
    for s in wanted:
        if s == "z":
            acts[s] = torch.stack([got[("z", j)].unflatten(-1, (n_heads, -1)) for j in range(n_layers)])
        else:  # [1, heads, pos, d_head] -> [pos, heads, d_head]
            acts[s] = torch.stack([got[(s, j)][0].transpose(0, 1) for j in range(n_layers)])
    return acts


def attentions(path: str, ids: Sequence[int], *, dtype: str = "float32", device: str = "cpu") -> torch.Tensor:
    """transformers' eager attention probabilities (``output_attentions=True``) over ``ids``.

    Returns:
        ``[layer, heads, pos, pos]`` float32 on the CPU: the ground truth for
        :meth:`nnvllm.Run.attention` (sdpa returns none, and drops Gemma 2's attention soft-cap, so the
        forward runs eager attention).
    """
    model, _ = load_reference(str(path), dtype, str(device))
    was = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(torch.tensor([list(ids)], device=model.device), output_attentions=True)
    finally:
        model.set_attn_implementation(was)
    return torch.stack([a[0].float().cpu() for a in out.attentions])


def _forward_capture(model, arch, ids: list[int], layer_ids: list[int], wanted: Sequence[str]):
    """One forward over ``ids`` with hooks; returns (logits [pos, vocab], {site: [layer, pos, width]})."""
    blocks = model.get_submodule(arch.blocks)
    got: dict[tuple[str, int], torch.Tensor] = {}
    heads = [s for s in wanted if s in HEAD_SITES]
    wanted = [s for s in wanted if s not in HEAD_SITES]
    handles = _head_hooks(model, arch, layer_ids, heads, got)
    where = {layer: j for j, layer in enumerate(layer_ids)}

    def record(module, q, k, v, probs):
        j = where.get(getattr(module, "layer_idx", None))
        for s, x in (("q", q), ("k", k), ("v", v)):
            if j is not None and s in heads:
                got[(s, j)] = x.detach().float().cpu().clone()

    def put(key, x):  # [1, pos, width]; a few modules (an MoE router) see the tokens flattened: [pos, width]
        got[key] = (x[0] if x.dim() == 3 else x).detach().float().cpu().clone()

    def hook(mod, side, key):
        if side == "input":
            return mod.register_forward_pre_hook(lambda m, a: put(key, a[0]))
        return mod.register_forward_hook(lambda m, a, o: put(key, o[0] if isinstance(o, tuple) else o))

    for j, layer in enumerate(layer_ids):
        b = blocks[layer]
        for s in wanted:
            paths, side = arch.hf_site(s)
            if isinstance(paths, tuple):  # parts transformers keeps apart and vLLM merges: concatenated
                for k, p in enumerate(paths):
                    handles.append(hook(b.get_submodule(p), side, (s, j, k)))
            else:
                handles.append(hook(b.get_submodule(paths) if paths else b, side, (s, j)))
    try:
        with torch.no_grad(), (_heads_recorded(model, record) if {"q", "k", "v"} & set(heads)
                               else contextlib.nullcontext()):
            logits = model(torch.tensor([ids], device=model.device)).logits[0].float().cpu()
    finally:
        for h in handles:
            h.remove()
    acts = _head_acts(got, heads, len(layer_ids), getattr(model.config, "num_attention_heads", None)
                      or model.config.n_head) if heads else {}
    for s in wanted:
        paths, _ = arch.hf_site(s)
        if isinstance(paths, tuple):
            acts[s] = torch.stack([torch.cat([got[(s, j, k)] for k in range(len(paths))], -1)
                                   for j in range(len(layer_ids))])
        else:
            acts[s] = torch.stack([got[(s, j)] for j in range(len(layer_ids))])
    return logits, acts


def reference(
    path: str,
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
    tokens: list[list[int]] | None = None,
    dtype: str = "float32",
    device: str | torch.device = "cpu",
    edits=None,
    chat_template: str | None = None,
    chat_template_kwargs: dict | None = None,
) -> Run:
    """Generate with plain transformers and capture what :func:`nnvllm.generate` captures.

    Args:
        path: checkpoint directory (or hub id) — the one given to :func:`nnvllm.load`.
        tokens: replay these generated ids per prompt instead of generating (teacher forcing),
            e.g. ``tokens=run.tokens`` to compare with a vLLM run position by position.
        dtype: "float32" (default), "bfloat16" or "float16".
        device: where transformers runs ("cpu", the default, or e.g. "cuda"); the returned tensors
            are on the CPU either way. On a GPU, fp32 matmuls follow torch's TF32 setting
            (``torch.backends.cuda.matmul.allow_tf32``, off by default).
        edits: the :class:`~nnvllm.edits.Edit` s of :func:`nnvllm.generate`, made with transformers
            hooks at every forward (the same rows: all, prompt or fed-back positions).
        chat_template, chat_template_kwargs: how conversations among ``prompts`` are rendered, as
            in :func:`nnvllm.generate` (the same rendering, :mod:`nnvllm.chat`, with this tokenizer).

    The other arguments are those of :func:`nnvllm.generate`. Sampling (temperature > 0) draws as
    vLLM's sampler does, request by request with the seed :func:`nnvllm.generate` gives that request
    (:func:`nnvllm._validate.request_seed`; ``seed=None`` draws as ``seed=0``): on the CPU the
    Gumbel-max draw of vLLM's CPU sampler (a torch ``Generator`` per request gives each step's
    noise seed, SplitMix64 noise per token), on a GPU the exponential race of vLLM's PyTorch
    sampler with a per-request CUDA ``Generator``. So the reference draws the tokens a seeded
    vLLM run on that kind of device draws, as long as the two models' logits agree to well within
    the gaps between competing tokens; ``tokens=`` compares position by position regardless.

    Example:
        >>> ref = nv.reference(nv.toy.path(), "The capital of France is", max_tokens=3)  # doctest: +SKIP
    """
    import json
    from pathlib import Path

    path = _validate.checkpoint(path)
    prompts = _validate.prompts(prompts)
    checked = _validate.sampling(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                                 top_k=top_k, logits=logits, ignore_eos=ignore_eos, n_prompts=len(prompts))
    max_tokens, temperature, top_p, seed, top_k, logits, ignore_eos = (checked[k] for k in (
        "max_tokens", "temperature", "top_p", "seed", "top_k", "logits", "ignore_eos"))
    sites, head_sites = _split_head_sites(sites)
    sites = _validate.sites(sites)
    tokens = _tokens(tokens, len(prompts))
    dt = getattr(torch, dtype, None) if isinstance(dtype, str) else None
    if not (isinstance(dt, torch.dtype) and dt.is_floating_point):
        raise (TypeError if not isinstance(dtype, str) else ValueError)(
            f"dtype={_validate._show(dtype)}: expected a torch float dtype's name: 'float32', 'bfloat16' or 'float16'")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={_validate._show(device)}: expected a torch device such as 'cpu' or 'cuda'") from None
    model, tok = load_reference(str(path), dtype, str(device))
    cfg = json.loads((Path(path) / "config.json").read_text()) if Path(path).is_dir() else model.config.to_dict()
    arch = arch_for(cfg.get("architectures"), where=repr(path))
    arch.check_sites(sites)
    spec = attention_spec(model.config, arch) if head_sites else None  # refuses where heads cannot be read
    from . import edits as _edits

    layer_ids = _validate.layers(layers, len(model.get_submodule(arch.blocks)))
    if sites and not layer_ids:
        raise ValueError(f"sites={list(sites)!r} needs layers (which blocks to read them at); got layers={layers!r}")
    if head_sites and not layer_ids:
        raise ValueError(f"sites={list(head_sites)!r} needs layers (which blocks to read them at); got layers={layers!r}")
    wanted = (("resid",) if layer_ids else ()) + sites + head_sites
    vocab = model.get_input_embeddings().num_embeddings
    top_k = _validate.top_k_count(top_k, vocab)
    from . import chat as _chat

    rendered = _chat.render_prompts(tok, prompts, chat_template=chat_template,
                                    chat_template_kwargs=chat_template_kwargs)
    prompt_ids = [list(r.ids) if r is not None else tok.encode(p) for p, r in zip(prompts, rendered)]
    chat = {k: v for k, v in (("chat_template", chat_template), ("chat_template_kwargs", chat_template_kwargs))
            if v is not None and any(r is not None for r in rendered)}
    reach = [len(p) + (len(t) if tokens is not None else max_tokens) - 1
             for p, t in zip(prompt_ids, tokens or [None] * len(prompts))]
    edit_list = _edits.resolve(edits, arch, len(model.get_submodule(arch.blocks)), None, n_prompts=len(prompts),
                               n_positions=reach)
    for i, t in enumerate(tokens or ()):
        bad = [x for x in t if not 0 <= x < vocab]
        if bad:
            raise ValueError(f"tokens[{i}] holds ids {bad[:5]} outside the vocabulary (0-{vocab - 1})")
    if tokens is None:
        context = getattr(model.config, "max_position_embeddings", None) or getattr(model.config, "n_positions", None)
        _validate.fits_context([len(p) for p in prompt_ids], max_tokens, context if isinstance(context, int) else None)
    seeds = _validate.request_seeds(0 if seed is None else seed, len(prompts))
    eos = tok.eos_token_id

    run = Run(prompts=prompts, prompt_ids=[], tokens=[], text=[], logits=[] if logits else None, samples=[],
              resid=[] if layer_ids else None, layers=layer_ids, sites={s: [] for s in wanted if s != "resid"},
              sampling=dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                            top_k=top_k, ignore_eos=ignore_eos),
              meta=dict(engine="transformers", model=str(path), dtype=dtype, tp=1, device=str(device),
                        **({"edits": [e.describe() for e in edit_list]} if edit_list else {}),
                        **({"attention": spec.to_dict()} if spec is not None else {}),
                        **({"chat": chat} if chat else {})))
    run.tokenizer = tok  # for labels (Run.plot); not saved with the run
    for i, prompt in enumerate(prompts):
        p_ids = prompt_ids[i]
        handles = _edits.hf_hooks(model, arch, edit_list, len(p_ids), prompt=i)  # the same edits, by hooks
        try:
            if tokens is not None:
                toks = list(tokens[i])
            else:
                toks = []
                draw = _Sampler(seeds[i], model.device) if temperature > 0 else None
                for _ in range(max_tokens):
                    with torch.no_grad():
                        last = model(torch.tensor([p_ids + toks], device=model.device)).logits[0, -1].float()
                    nxt = int(last.argmax()) if draw is None else draw(last, temperature, top_p)
                    toks.append(nxt)
                    if nxt == eos and not ignore_eos:
                        break
            seq = p_ids + toks[:-1]
            lg, acts = _forward_capture(model, arch, seq, layer_ids, wanted)
        finally:
            for h in handles:
                h.remove()
        step_logits = lg[len(p_ids) - 1:]
        run.prompt_ids.append(p_ids)
        run.tokens.append(toks)
        run.text.append(tok.decode(toks, skip_special_tokens=True))
        r = rendered[i]
        run.roles.append((list(r.roles) if r is not None else _chat.plain_roles(tok, p_ids))
                         + ["assistant"] * max(len(toks) - 1, 0))
        run.prompt_text.append(r.text if r is not None else prompt)
        run.samples.append(sample_stats(step_logits, toks, temperature=temperature, top_p=top_p, k=top_k))
        if logits:
            run.logits.append(step_logits)
        for s, t in acts.items():
            (run.resid if s == "resid" else run.sites[s]).append(t)
    return run
