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
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

__all__ = ["Arch", "ARCHS", "SITES", "arch_for", "register_arch", "untie_shared_modules"]

SITES = ("resid", "attn", "mlp", "mlp_in", "mlp_act", "router")


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
        missing = [n for n in names if n not in self.sites]
        if missing:
            why = []
            if "router" in missing:
                why.append("only a mixture-of-experts family has a router")
            if {"mlp_in", "mlp_act"} & set(missing) and "router" in self.sites:
                why.append("a mixture-of-experts block has no single MLP activation to read")
            raise ValueError(
                f"sites={list(missing)!r}: the {self.family} family offers {[s for s in SITES if s in self.sites]}"
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
)
_LLAMA_SITES = {
    "resid": ("", "output"),
    "attn": ("self_attn", "output"),
    "mlp": ("mlp", "output"),
    "mlp_in": ("mlp.gate_up_proj", "output"),
    "mlp_act": ("mlp.down_proj", "input"),
}
_LLAMA = Arch(
    family="llama",
    blocks="model.layers",
    final_norm="model.norm",
    unembed="lm_head",
    sites=_LLAMA_SITES,
    hf_sites={"mlp_in": ("mlp.gate_proj", "mlp.up_proj")},
    merged_gate_up=True,
    returns_residual=True,
)
# Phi-3: vLLM runs it as Llama; transformers fuses gate and up too ([gate | up], like vLLM).
_PHI3 = Arch(family="phi3", blocks="model.layers", final_norm="model.norm", unembed="lm_head",
             sites=_LLAMA_SITES, merged_gate_up=True, returns_residual=True)

# Gemma 2: Llama's sites; sandwich norms sit outside them. The embedding scale (sqrt(d_model)) is in
# the stream; the lens applies the (1 + w) final norm and the final-logit soft-cap the engine applies.
_GEMMA2 = Arch(family="gemma2", blocks="model.layers", final_norm="model.norm", unembed="model.embed_tokens",
               sites=_LLAMA_SITES, hf_sites={"mlp_in": ("mlp.gate_proj", "mlp.up_proj")},
               merged_gate_up=True, returns_residual=True, logit_softcap="final_logit_softcapping")

# Gemma 3 (text): Gemma 2's layout with per-head q/k norms inside attention and an lm_head module
# (tied); no soft-caps by default.
_GEMMA3 = Arch(family="gemma3", blocks="model.layers", final_norm="model.norm", unembed="lm_head",
               sites=_LLAMA_SITES, hf_sites={"mlp_in": ("mlp.gate_proj", "mlp.up_proj")},
               merged_gate_up=True, returns_residual=True, logit_softcap="final_logit_softcapping")

# Qwen3-MoE: Llama's layout, with a sparse mixture-of-experts block as the MLP. Its output (routed
# experts combined, all-reduced under TP) is the "mlp" site; per-expert sites are not offered. The
# router's logits (the gate's output, one per expert, replicated under TP) are the "router" site:
# the routing itself is their softmax's top-k.
_QWEN3_MOE = Arch(family="qwen3_moe", blocks="model.layers", final_norm="model.norm", unembed="lm_head",
                  sites={**{k: v for k, v in _LLAMA_SITES.items() if k in ("resid", "attn", "mlp")},
                         "router": ("mlp.gate", "output")},
                  returns_residual=True)

# GPT-NeoX (Pythia): parallel attention and MLP, one residual add; LayerNorms; untied embed_out. The
# block returns the stream. Native in vLLM 0.26, the Transformers backend in 0.32 (Arch.in_engine).
_GPT_NEOX = Arch(family="gpt_neox", blocks="gpt_neox.layers", final_norm="gpt_neox.final_layer_norm",
                 unembed="embed_out",
                 sites={"resid": ("", "output"), "attn": ("attention", "output"), "mlp": ("mlp", "output"),
                        "mlp_in": ("mlp.dense_h_to_4h", "output"), "mlp_act": ("mlp.dense_4h_to_h", "input")})

# OLMo 2: post-norms (each sublayer's output is normed before its residual add; "attn" and "mlp" are
# the sublayer outputs before those norms), q/k norms. vLLM runs it through its Transformers backend:
# transformers' own block, which returns the stream; gate and up stay two projections there, so there
# is no single mlp_in.
_OLMO2 = Arch(family="olmo2", blocks="model.layers", final_norm="model.norm", unembed="lm_head",
              sites={"resid": ("", "output"), "attn": ("self_attn", "output"), "mlp": ("mlp", "output"),
                     "mlp_act": ("mlp.down_proj", "input")})

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
