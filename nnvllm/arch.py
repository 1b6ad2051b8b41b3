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
=========  ===============================================  =========
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Arch", "ARCHS", "SITES", "arch_for", "untie_shared_modules"]

SITES = ("resid", "attn", "mlp", "mlp_in", "mlp_act")


@dataclass(frozen=True)
class Arch:
    """Where things live in one model family. Paths are relative to the causal-LM root module."""

    family: str  # "gpt2" | "llama"
    blocks: str  # the ModuleList of blocks
    final_norm: str
    unembed: str  # the LM head (tied or not)
    # site -> (module path relative to a block, "input" | "output")
    sites: dict

    def site(self, name: str) -> tuple[str, str]:
        if name not in self.sites:
            raise ValueError(f"site={name!r} is not one of {sorted(self.sites)}") from None
        return self.sites[name]


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
_LLAMA = Arch(
    family="llama",
    blocks="model.layers",
    final_norm="model.norm",
    unembed="lm_head",
    sites={
        "resid": ("", "output"),
        "attn": ("self_attn", "output"),
        "mlp": ("mlp", "output"),
        "mlp_in": ("mlp.gate_up_proj", "output"),
        "mlp_act": ("mlp.down_proj", "input"),
    },
)

#: HF architecture name -> layout. Llama-style families share vLLM's (hidden, residual) block output.
ARCHS: dict[str, Arch] = {
    "GPT2LMHeadModel": _GPT2,
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,
}


def arch_for(architectures: list[str] | None, where: str = "this checkpoint") -> Arch:
    """Return the layout for a config's ``architectures`` list, or raise a ValueError that says why."""
    for name in architectures or []:
        if name in ARCHS:
            return ARCHS[name]
    raise ValueError(
        f"{where} declares architectures={architectures!r}; nnvllm knows the layout of "
        f"{sorted(ARCHS)}. Add an entry to nnvllm.arch.ARCHS for another family."
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
