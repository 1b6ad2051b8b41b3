"""Per-architecture facts: where the blocks, final norm and unembedding live, and what a block returns.

The same module paths hold in vLLM's model tree and in transformers' (vLLM mirrors the HF
names), so one table serves the engine, the capture hooks and the reference.

Sites (what ``sites=`` in :func:`nnvllm.generate` accepts), each a per-block ``[pos, width]`` value:

=========  ===============================================  =========
site       meaning                                          width
=========  ===============================================  =========
resid      residual stream after the block (always taken)   d_model
attn       attention output (after its out-projection)      d_model
mlp        MLP output                                       d_model
mlp_in     MLP activation input (GPT-2: c_fc output; Llama:  d_mlp (x2
           gate_up output, gate and up concatenated)         Llama)
mlp_act    MLP activation output (input of the down-proj)   d_mlp
router     a mixture-of-experts block's router logits       n_experts
           (before softmax and top-k: the routing)
=========  ===============================================  =========

Per-head sites (:data:`HEAD_SITES`), each a per-block ``[pos, heads, d_head]`` value, read where the
family's attention runs (:class:`Heads`):

=========  ===============================================  =========
site       meaning                                          heads
=========  ===============================================  =========
q          queries after the rotary embedding (and q-norm)  n_heads
k          keys after the rotary embedding (and k-norm);    n_kv_heads
           grouped-query attention: the KV heads as they
           are, each shared by ``n_heads / n_kv_heads``
           query heads (query head h reads KV head
           ``h // (n_heads / n_kv_heads)``)
v          values, KV heads as ``k``                        n_kv_heads
z          each head's output (its pattern times v), the    n_heads
           input of the attention's output projection
=========  ===============================================  =========

What a family's attention computes (heads, scale, soft-cap, sliding windows, rotary) is read from its
HF config by :func:`attention_spec`: the facts :mod:`nnvllm.heads` rebuilds patterns and per-head
writes with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

__all__ = ["Arch", "ARCHS", "AttentionSpec", "HEAD_SITES", "Heads", "SITES", "arch_for", "attention_spec",
           "register_arch", "untie_shared_modules"]

SITES = ("resid", "attn", "mlp", "mlp_in", "mlp_act", "router")
HEAD_SITES = ("q", "k", "v", "z")


@dataclass(frozen=True)
class Heads:
    """Where one family's attention heads are read, relative to a block.

    Attributes:
        core: vLLM's ``Attention`` layer: its inputs are ``(q, k, v)``, flat ``[tokens, heads * d_head]``,
            after the rotary embedding (and any q/k norm). Native vLLM models call it as
            ``self.attn(q, k, v)``; under vLLM's Transformers backend it is attached to transformers'
            attention module as ``.attn`` and called through ``.forward`` (no module hooks fire), so
            the engine wraps its ``forward``.
        out: the attention's output projection (``o_proj``, GPT-2's ``c_proj``): its input is ``z``,
            every head's output concatenated head by head; its weight ``W_O`` maps head ``h``'s
            slice ``[h * d_head, (h + 1) * d_head)`` into the residual stream.
        hf_attn: transformers' attention module (its attention function receives ``q, k, v`` as
            ``[batch, heads, pos, d_head]``; its ``layer_idx`` names the block).
        hf_out: transformers' output projection where its path differs from ``out``.
        post_norms: ``(after attention, after MLP)``: norms applied to each sublayer's output before
            it is added to the residual stream (Gemma 2 and 3's sandwich norms, OLMo 2's post-norms),
            or None. A head's write into the stream passes through the first, frozen at the scale of
            the whole attention output at that position (see :func:`nnvllm.heads.head_results`).
        out_is_conv1d: transformers keeps ``out``'s weight as ``[in, out]`` (GPT-2's ``Conv1D``)
            instead of a ``Linear``'s ``[out, in]``.
    """

    core: str
    out: str
    hf_attn: str
    hf_out: str | None = None
    post_norms: tuple[str, str] | None = None
    out_is_conv1d: bool = False

    def site(self, name: str) -> tuple[str, str]:
        """``(module path in a block, what to read)`` in vLLM's tree: ``"input:0"``, ``"input:1"``,
        ``"input:2"`` (the core's q, k, v) or ``"input"`` (z, the out-projection's input)."""
        if name == "z":
            return self.out, "input"
        if name in ("q", "k", "v"):
            return self.core, f"input:{'qkv'.index(name)}"
        raise ValueError(f"site={name!r} is not a per-head site; expected one of {list(HEAD_SITES)}")


@dataclass(frozen=True)
class AttentionSpec:
    """What one model's attention computes, read from its HF config (:func:`attention_spec`).

    The pattern of query head ``h`` at layer ``l`` is
    ``softmax(cap * tanh(scale * q_h . k_g / cap) + mask)`` over key positions, with ``g`` the KV
    head that query head reads (``h // (n_heads // n_kv_heads)``), ``cap`` the soft-cap (none: no
    tanh), and the mask causal, limited to the last ``windows[l]`` positions (the query's own
    included) where the layer has a sliding window.

    Attributes:
        family: the :class:`Arch` family.
        n_layers: blocks.
        n_heads: query heads.
        n_kv_heads: key/value heads (fewer than ``n_heads`` under grouped-query attention).
        d_head: the width of one head.
        scale: the factor on ``q . k`` (``d_head ** -0.5``; Gemma: ``query_pre_attn_scalar ** -0.5``).
        soft_cap: the attention-logit soft-cap (Gemma 2), or None.
        windows: per layer, the sliding window in positions (the query's own included), or None for
            full causal attention.
        rotary_dims: how many of each head's dims the rotary embedding turns (0: learned absolute
            positions, GPT-2; fewer than ``d_head``: partial rotary, GPT-NeoX). Captured q and k are
            taken after it, so patterns need nothing more from it.
    """

    family: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    scale: float
    soft_cap: float | None = None
    windows: tuple = ()
    rotary_dims: int = 0

    def __post_init__(self) -> None:
        for name in ("n_layers", "n_heads", "n_kv_heads", "d_head"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"AttentionSpec.{name}={v!r}: expected a positive int")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"AttentionSpec: n_heads={self.n_heads} is not a multiple of n_kv_heads="
                             f"{self.n_kv_heads}; grouped-query attention shares each KV head among "
                             "n_heads / n_kv_heads query heads")
        if not (isinstance(self.scale, (int, float)) and self.scale > 0):
            raise ValueError(f"AttentionSpec.scale={self.scale!r}: expected a positive number")
        if self.soft_cap is not None and not (isinstance(self.soft_cap, (int, float)) and self.soft_cap > 0):
            raise ValueError(f"AttentionSpec.soft_cap={self.soft_cap!r}: expected a positive number or None")
        windows = tuple(self.windows) if self.windows else (None,) * self.n_layers
        if len(windows) != self.n_layers or any(w is not None and (not isinstance(w, int) or w < 1)
                                                  for w in windows):
            raise ValueError(f"AttentionSpec.windows={self.windows!r}: expected one entry per layer "
                             f"({self.n_layers}), each None or a positive int")
        object.__setattr__(self, "windows", windows)

    @property
    def group(self) -> int:
        """Query heads per KV head."""
        return self.n_heads // self.n_kv_heads

    def window(self, layer: int) -> int | None:
        return self.windows[layer]

    def to_dict(self) -> dict:
        """A JSON-ready dict (kept in ``Run.meta["attention"]``); :meth:`from_dict` reads it back."""
        return {**dataclasses.asdict(self), "windows": list(self.windows)}

    @classmethod
    def from_dict(cls, d: dict) -> "AttentionSpec":
        return cls(**{**d, "windows": tuple(d.get("windows") or ())})


@dataclass(frozen=True)
class Arch:
    """Where things live in one model family, and what its blocks return. Paths are relative to the
    causal-LM root module; one entry serves the engine's taps, the logit lens and the reference.

    Attributes:
        family: a short name ("gpt2", "llama", "phi3", ...).
        blocks: the ModuleList of blocks.
        final_norm: the norm after the last block (the lens applies the engine's own module).
        unembed: the LM head (tied or not).
        sites: site -> (module path relative to a block, "input" | "output") in vLLM's tree.
        hf_sites: where transformers' tree differs: site -> path, or a tuple of paths whose outputs
            are concatenated (transformers' separate gate and up projections, merged in vLLM).
        merged_gate_up: vLLM's ``mlp_in`` is one merged [gate | up] projection (tensor parallelism
            gathers the two halves separately).
        returns_residual: vLLM's block returns ``(hidden, residual)`` whose sum is the residual
            stream (Llama-style fused add-norm); otherwise it returns the stream itself.
        logit_softcap: the config key of a final-logit soft-cap (``cap * tanh(logits / cap)``), or None.
        heads: where the per-head sites (:data:`HEAD_SITES`) are read (:class:`Heads`), or None
            where the family's attention is not read per head.
        embed: the token embedding (transformers' path), for the embedding's term of a logit
            attribution.
        pos_embed: a learned position embedding added to it (GPT-2's ``wpe``), or None.
        embed_scale: the embedding is multiplied by ``sqrt(d_model)`` before the first block (Gemma).
    """

    family: str
    blocks: str
    final_norm: str
    unembed: str
    sites: dict
    hf_sites: dict = field(default_factory=dict)
    merged_gate_up: bool = False
    returns_residual: bool = False
    logit_softcap: str | None = None
    heads: Heads | None = None
    embed: str | None = None
    pos_embed: str | None = None
    embed_scale: bool = False

    def in_engine(self, root) -> "Arch":
        """This layout with ``blocks``, ``final_norm`` and ``unembed`` as they are in ``root``, vLLM's
        model tree. vLLM runs some families through its Transformers backend
        (``TransformersForCausalLM``: transformers' own blocks under ``model``, the head at
        ``lm_head``) instead of a native class with transformers' paths: GPT-NeoX on vLLM 0.32 (native
        on 0.26), OLMo 2 on both. Sites are relative to a block: the same either way."""
        try:
            root.get_submodule(self.blocks)
            return self
        except AttributeError:
            pass
        if type(root).__name__.startswith("Transformers"):
            inner = lambda path: "model." + path.split(".", 1)[1] if "." in path else path  # noqa: E731
            moved = dataclasses.replace(self, blocks=inner(self.blocks), final_norm=inner(self.final_norm),
                                        unembed="lm_head")
            try:
                root.get_submodule(moved.blocks)
                return moved
            except AttributeError:
                pass
        raise ValueError(f"the {self.family} layout puts its blocks at {self.blocks!r}, which vLLM's "
                         f"{type(root).__name__} does not have; register a layout for it with nnvllm.register_arch")

    def site(self, name: str) -> tuple[str, str]:
        if name not in self.sites:
            raise ValueError(f"site={name!r} is not one of {sorted(self.sites)}") from None
        return self.sites[name]

    def check_sites(self, names) -> None:
        """Raise a ValueError naming what this family offers if a site is not one of its sites."""
        missing = [n for n in names if n not in self.sites and not (n in HEAD_SITES and self.heads is not None)]
        if missing:
            why = []
            if set(HEAD_SITES) & set(missing):
                why.append("its attention is not read per head")
            if "router" in missing:
                why.append("only a mixture-of-experts family has a router")
            if {"mlp_in", "mlp_act"} & set(missing) and "router" in self.sites:
                why.append("a mixture-of-experts block has no single MLP activation to read")
            raise ValueError(
                f"sites={list(missing)!r}: the {self.family} family offers {[s for s in SITES if s in self.sites]}"
                + (f" and the per-head sites {list(HEAD_SITES)}" if self.heads is not None else "")
                + (f" ({'; '.join(why)})" if why else ""))

    def hf_site(self, name: str) -> tuple[str | tuple[str, ...], str]:
        """(path or paths, side) of a site in transformers' tree."""
        path, side = self.site(name)
        return self.hf_sites.get(name, path), side


_GPT2 = Arch(
    family="gpt2",
    blocks="transformer.h",
    final_norm="transformer.ln_f",
    unembed="lm_head",
    sites={
        "resid": ("", "output"),
        "attn": ("attn", "output"),
        "mlp": ("mlp", "output"),
        "mlp_in": ("mlp.c_fc", "output"),
        "mlp_act": ("mlp.c_proj", "input"),
    },
    heads=Heads(core="attn.attn", out="attn.c_proj", hf_attn="attn", out_is_conv1d=True),
    embed="transformer.wte",
    pos_embed="transformer.wpe",
)
_LLAMA_SITES = {
    "resid": ("", "output"),
    "attn": ("self_attn", "output"),
    "mlp": ("mlp", "output"),
    "mlp_in": ("mlp.gate_up_proj", "output"),
    "mlp_act": ("mlp.down_proj", "input"),
}
_LLAMA_HEADS = Heads(core="self_attn.attn", out="self_attn.o_proj", hf_attn="self_attn")
_LLAMA = Arch(
    family="llama",
    blocks="model.layers",
    final_norm="model.norm",
    unembed="lm_head",
    sites=_LLAMA_SITES,
    hf_sites={"mlp_in": ("mlp.gate_proj", "mlp.up_proj")},
    merged_gate_up=True,
    returns_residual=True,
    heads=_LLAMA_HEADS,
    embed="model.embed_tokens",
)
# Phi-3: vLLM runs it as Llama; transformers fuses gate and up too ([gate | up], like vLLM).
_PHI3 = Arch(family="phi3", blocks="model.layers", final_norm="model.norm", unembed="lm_head",
             sites=_LLAMA_SITES, merged_gate_up=True, returns_residual=True, heads=_LLAMA_HEADS,
             embed="model.embed_tokens")

# Gemma 2: Llama's sites; sandwich norms sit outside them. The embedding scale (sqrt(d_model)) is in
# the stream; the lens applies the (1 + w) final norm and the final-logit soft-cap the engine applies.
_SANDWICH = ("post_attention_layernorm", "post_feedforward_layernorm")
_GEMMA_HEADS = Heads(core="self_attn.attn", out="self_attn.o_proj", hf_attn="self_attn", post_norms=_SANDWICH)
_GEMMA2 = Arch(family="gemma2", blocks="model.layers", final_norm="model.norm", unembed="model.embed_tokens",
               sites=_LLAMA_SITES, hf_sites={"mlp_in": ("mlp.gate_proj", "mlp.up_proj")},
               merged_gate_up=True, returns_residual=True, logit_softcap="final_logit_softcapping",
               heads=_GEMMA_HEADS, embed="model.embed_tokens", embed_scale=True)

# Gemma 3 (text): Gemma 2's layout with per-head q/k norms inside attention and an lm_head module
# (tied); no soft-caps by default.
_GEMMA3 = Arch(family="gemma3", blocks="model.layers", final_norm="model.norm", unembed="lm_head",
               sites=_LLAMA_SITES, hf_sites={"mlp_in": ("mlp.gate_proj", "mlp.up_proj")},
               merged_gate_up=True, returns_residual=True, logit_softcap="final_logit_softcapping",
               heads=_GEMMA_HEADS, embed="model.embed_tokens", embed_scale=True)

# Qwen3-MoE: Llama's layout, with a sparse mixture-of-experts block as the MLP. Its output (routed
# experts combined, all-reduced under TP) is the "mlp" site; per-expert sites are not offered. The
# router's logits (the gate's output, one per expert, replicated under TP) are the "router" site:
# the routing itself is their softmax's top-k.
_QWEN3_MOE = Arch(family="qwen3_moe", blocks="model.layers", final_norm="model.norm", unembed="lm_head",
                  sites={**{k: v for k, v in _LLAMA_SITES.items() if k in ("resid", "attn", "mlp")},
                         "router": ("mlp.gate", "output")},
                  returns_residual=True, heads=_LLAMA_HEADS, embed="model.embed_tokens")

# GPT-NeoX (Pythia): parallel attention and MLP, one residual add; LayerNorms; untied embed_out. The
# block returns the stream. Native in vLLM 0.26, the Transformers backend in 0.32 (Arch.in_engine).
_GPT_NEOX = Arch(family="gpt_neox", blocks="gpt_neox.layers", final_norm="gpt_neox.final_layer_norm",
                 unembed="embed_out",
                 sites={"resid": ("", "output"), "attn": ("attention", "output"), "mlp": ("mlp", "output"),
                        "mlp_in": ("mlp.dense_h_to_4h", "output"), "mlp_act": ("mlp.dense_4h_to_h", "input")},
                 heads=Heads(core="attention.attn", out="attention.dense", hf_attn="attention"),
                 embed="gpt_neox.embed_in")

# OLMo 2: post-norms (each sublayer's output is normed before its residual add; "attn" and "mlp" are
# the sublayer outputs before those norms), q/k norms. vLLM runs it through its Transformers backend:
# transformers' own block, which returns the stream; gate and up stay two projections there, so there
# is no single mlp_in.
_OLMO2 = Arch(family="olmo2", blocks="model.layers", final_norm="model.norm", unembed="lm_head",
              sites={"resid": ("", "output"), "attn": ("self_attn", "output"), "mlp": ("mlp", "output"),
                     "mlp_act": ("mlp.down_proj", "input")},
              heads=Heads(core="self_attn.attn", out="self_attn.o_proj", hf_attn="self_attn", post_norms=_SANDWICH),
              embed="model.embed_tokens")

#: HF architecture name -> layout.
ARCHS: dict[str, Arch] = {
    "GPT2LMHeadModel": _GPT2,
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,  # q/k norms sit inside attention: no site moves
    "Phi3ForCausalLM": _PHI3,
    "Gemma2ForCausalLM": _GEMMA2,
    "Gemma3ForCausalLM": _GEMMA3,
    "Qwen3MoeForCausalLM": _QWEN3_MOE,
    "GPTNeoXForCausalLM": _GPT_NEOX,
    "Olmo2ForCausalLM": _OLMO2,
}


def register_arch(architecture: str, arch: Arch) -> None:
    """Teach nnvllm the layout of another family (see docs/families.md for a walk-through).

    Args:
        architecture: the name in the checkpoint's ``config.json`` ``architectures`` list.
        arch: its :class:`Arch`. Every site path must exist in vLLM's model tree (and, through
            ``hf_sites``, in transformers' for :func:`nnvllm.reference`).

    Engine processes (vLLM's engine core, an isolated engine's server, tensor-parallel workers)
    learn it through the environment they inherit (``NNVLLM_ARCHS``): register before
    :func:`nnvllm.load`.

    Example:
        >>> nv.register_arch("MyLlamaForCausalLM", nv.ARCHS["LlamaForCausalLM"])   # doctest: +SKIP
    """
    import json
    import os

    if not isinstance(architecture, str) or not architecture:
        raise TypeError(f"architecture must be the name in config.json's architectures, got {architecture!r}")
    if not isinstance(arch, Arch):
        raise TypeError(f"arch must be an nnvllm.Arch, got {type(arch).__name__}")
    if "resid" not in arch.sites:
        raise ValueError("arch.sites must define 'resid' (the block itself: ('', 'output'))")
    for name, spec in arch.sites.items():
        if name not in SITES or not (isinstance(spec, tuple) and len(spec) == 2 and spec[1] in ("input", "output")):
            raise ValueError(f"arch.sites[{name!r}] = {spec!r}; expected a site of {SITES} mapped to "
                             "(path in a block, 'input' | 'output')")
    if arch.heads is not None and not isinstance(arch.heads, Heads):
        raise TypeError(f"arch.heads must be an nnvllm.arch.Heads or None, got {type(arch.heads).__name__}")
    ARCHS[architecture] = arch
    registered = json.loads(os.environ.get(_ENV, "{}") or "{}")
    registered[architecture] = dataclasses.asdict(arch)
    os.environ[_ENV] = json.dumps(registered)


_ENV = "NNVLLM_ARCHS"


def _from_env(name: str) -> Arch | None:
    """A layout registered in a parent process (see :func:`register_arch`)."""
    import json
    import os

    d = json.loads(os.environ.get(_ENV, "{}") or "{}").get(name)
    if d is None:
        return None
    d["sites"] = {k: tuple(v) for k, v in d["sites"].items()}
    d["hf_sites"] = {k: tuple(v) if isinstance(v, list) else v for k, v in d.get("hf_sites", {}).items()}
    if d.get("heads") is not None:
        h = dict(d["heads"])
        h["post_norms"] = tuple(h["post_norms"]) if h.get("post_norms") else None
        d["heads"] = Heads(**h)
    return Arch(**d)


def arch_for(architectures: list[str] | None, where: str = "this checkpoint") -> Arch:
    """Return the layout for a config's ``architectures`` list, or raise a ValueError that says why."""
    for name in architectures or []:
        found = _from_env(name)  # registered (in this process or a parent): may replace a built-in
        if found is not None:
            return found
        if name in ARCHS:
            return ARCHS[name]
    raise ValueError(
        f"{where} declares architectures={architectures!r}; nnvllm knows the layout of "
        f"{sorted(ARCHS)}. For another family, describe its layout with nnvllm.Arch and register it "
        "with nnvllm.register_arch(name, arch) (docs/families.md walks through one)."
    ) from None


def _get(config, key: str, default=None):
    """``config.key`` of a transformers config, a dict (``config.json``) or any object."""
    if isinstance(config, dict):
        v = config.get(key, default)
    else:
        v = getattr(config, key, default)
    return default if v is None else v


# Config keys of attention that is not softmax(scale * q . k) over the captured q and k: a pattern
# rebuilt from them would be a guess, so attention_spec refuses (key -> what the model does instead).
_NOT_PLAIN_SOFTMAX = {
    "kv_lora_rank": "multi-head latent attention (MLA): keys are rebuilt from a compressed latent inside "
                    "the attention kernel, so no per-head k is handed to it",
    "alibi": "ALiBi: a per-head linear bias is added to q . k inside the kernel",
    "use_alibi": "ALiBi: a per-head linear bias is added to q . k inside the kernel",
    "position_embedding_type": None,  # checked below: only "alibi" is refused
    "model_type": None,  # checked below: gpt-oss's attention sinks
}


def attention_spec(config, arch: "Arch | None" = None) -> AttentionSpec:
    """Read what a model's attention computes from its HF config (a ``PretrainedConfig``, or the dict of
    its ``config.json``; a config that transformers normalises, such as Qwen2's ``layer_types``,
    is best given as the ``PretrainedConfig``).

    Heads, KV heads and head width; the scale (``d_head ** -0.5``, Gemma's
    ``query_pre_attn_scalar ** -0.5``); Gemma 2's attention-logit soft-cap; the sliding window of each
    layer (``layer_types`` naming ``"sliding_attention"`` layers, else ``sliding_window`` on every
    layer); the rotary dims.

    Raises:
        ValueError: the family's heads are not read (``arch.heads`` is None), or its attention is not
            ``softmax(scale * q . k)`` over the q and k its attention layer receives (multi-head latent
            attention, ALiBi, attention sinks), or a GPT-2 config asks for a scaling vLLM's GPT-2 does
            not apply; the message says which.

    Example:
        >>> spec = attention_spec({"architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_head": 2, "n_layer": 3})
        >>> spec.n_heads, spec.d_head, round(spec.scale, 4)
        (2, 32, 0.1768)
    """
    archs = _get(config, "architectures")
    if arch is None:
        arch = arch_for(archs)
    family = arch.family
    if arch.heads is None:
        raise ValueError(f"the {family} family's attention is not read per head (its Arch has heads=None), so "
                         "there are no q/k/v/z sites or patterns for it; describe where its attention layer "
                         "and output projection are with nnvllm.arch.Heads and register_arch")
    for key, why in _NOT_PLAIN_SOFTMAX.items():
        v = _get(config, key)
        if key == "position_embedding_type":
            why = "ALiBi: a per-head linear bias is added to q . k inside the kernel" if v == "alibi" else None
        if key == "model_type":
            why = "attention sinks: a learned extra logit joins each head's softmax" if v == "gpt_oss" else None
        if why and v not in (None, False, 0, ""):
            raise ValueError(f"{archs}: {why}. Its attention is not softmax(scale * q . k) over the q and k the "
                             f"attention layer receives ({key}={v!r} in its config), so nnvllm cannot rebuild its "
                             "patterns exactly and refuses rather than guess.")
    n_layers = _get(config, "num_hidden_layers") or _get(config, "n_layer")
    n_heads = _get(config, "num_attention_heads") or _get(config, "n_head")
    d_model = _get(config, "hidden_size") or _get(config, "n_embd")
    if not (n_layers and n_heads and d_model):
        raise ValueError(f"{archs}: the config names no layer count, head count or width "
                         "(num_hidden_layers/n_layer, num_attention_heads/n_head, hidden_size/n_embd)")
    n_kv = _get(config, "num_key_value_heads") or n_heads
    d_head = _get(config, "head_dim") or d_model // n_heads
    scale = d_head ** -0.5
    if family == "gpt2":
        if _get(config, "scale_attn_by_inverse_layer_idx", False) or not _get(config, "scale_attn_weights", True):
            raise ValueError(
                f"{archs}: scale_attn_by_inverse_layer_idx={_get(config, 'scale_attn_by_inverse_layer_idx')!r}, "
                f"scale_attn_weights={_get(config, 'scale_attn_weights')!r}: vLLM's GPT-2 scales q . k by "
                "d_head ** -0.5 on every layer, so its attention is not this checkpoint's and nnvllm will not "
                "rebuild patterns for it")
    if _get(config, "query_pre_attn_scalar"):  # Gemma
        scale = float(_get(config, "query_pre_attn_scalar")) ** -0.5
    soft_cap = _get(config, "attn_logit_softcapping")
    window = _get(config, "sliding_window")
    types = _get(config, "layer_types")
    if types:
        windows = tuple(window if t == "sliding_attention" and window else None for t in types)
    elif window and _get(config, "use_sliding_window", True):
        windows = (int(window),) * n_layers
    else:
        windows = (None,) * n_layers
    if family == "gpt2":
        rotary = 0
    else:  # the fraction of each head the rotary embedding turns (GPT-NeoX's rotary_pct in older configs)
        rope = _get(config, "rope_parameters", {}) or {}
        frac = (_get(config, "partial_rotary_factor") or _get(config, "rotary_pct")
                or (rope.get("partial_rotary_factor") if isinstance(rope, dict) else None) or 1.0)
        rotary = int(d_head * float(frac))
    return AttentionSpec(family=family, n_layers=int(n_layers), n_heads=int(n_heads), n_kv_heads=int(n_kv),
                         d_head=int(d_head), scale=float(scale),
                         soft_cap=float(soft_cap) if soft_cap else None, windows=windows, rotary_dims=rotary)


def untie_shared_modules(root) -> list[str]:
    """Give every reference of a parameter-free module shared by several parents its own copy.

    vLLM's GPT-2 builds ONE activation module for all blocks (``get_act_fn`` caches it). A hook
    on it fires once per block and nnsight maps every ``h[i].mlp.act`` onto ``h.0.mlp.act``, so
    reading ``h[5].mlp.act.output`` silently returns block 0's value. Stateless modules can be
    copied without changing the computation; after this each path is its own module. Returns the
    paths that received a copy.
    """
    import copy

    seen: dict[int, str] = {}
    fixed: list[str] = []
    stack = [("", root)]
    while stack:
        prefix, mod = stack.pop()
        for name, child in list(mod._modules.items()):
            if child is None:
                continue
            path = f"{prefix}.{name}" if prefix else name
            if id(child) in seen and next(child.parameters(), None) is None and not child._buffers:
                child = copy.deepcopy(child)
                mod._modules[name] = child
                fixed.append(path)
            seen.setdefault(id(child), path)
            stack.append((path, child))
    return fixed
