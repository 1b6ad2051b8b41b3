"""Tiny random checkpoints (GPT-2, Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and 3, Qwen3-MoE, GPT-NeoX,
OLMo 2; tokenizer included) for tests that need other shapes.

Built locally from a config in a second or two; no model hub. They reuse the toy model's tokenizer.
Head sizes are 32: vLLM's CPU attention refuses some head sizes (24 fails at engine start).

Example:
    >>> from nnvllm.testing import tiny_checkpoint
    >>> path = tiny_checkpoint("llama", "/tmp/tiny-llama")     # doctest: +SKIP
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

__all__ = ["tiny_checkpoint", "KINDS", "TF32"]

KINDS = ("gpt2", "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen3_moe", "gpt_neox", "olmo2")


def tiny_checkpoint(
    kind: str, out_dir: str | os.PathLike, *, n_layers: int = 3, d_model: int = 64, seed: int = 0
) -> str:
    """Write a random ``kind`` (one of :data:`KINDS`) checkpoint with a tokenizer to ``out_dir``.

    The Llama-style ones use grouped-query attention (2 query heads, 1 KV head) and an untied LM
    head, so tests see vLLM's ``(hidden, residual)`` block outputs and a separate unembedding;
    Qwen2 adds q/k/v biases, Qwen3 per-head q/k RMSNorms, Mistral is Llama's layout under its own name,
    Phi-3 fuses q/k/v and gate/up into single projections in transformers too; Gemma 2 has sandwich
    norms, a scaled embedding, ``(1 + w)`` RMSNorms, soft-capped attention and final logits, and a tied head;
    Gemma 3 (text) adds per-head q/k norms and local/global attention layers, without soft-caps;
    Qwen3-MoE has a sparse mixture-of-experts MLP in every block (4 experts, 2 per token); GPT-NeoX
    (Pythia's layout) has parallel attention and MLP, LayerNorms, partial rotary and an untied head;
    OLMo 2 has post-norms around each sublayer and q/k norms.
    """
    import torch
    import transformers
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    from . import toy

    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; expected one of {KINDS}")
    out = Path(out_dir)
    if (out / "config.json").is_file():
        return str(out)
    tok = AutoTokenizer.from_pretrained(toy.check())
    torch.manual_seed(seed)
    if kind == "gpt_neox":
        cfg = transformers.GPTNeoXConfig(
            vocab_size=len(tok), hidden_size=d_model, intermediate_size=2 * d_model, num_hidden_layers=n_layers,
            num_attention_heads=d_model // 32, max_position_embeddings=128, rotary_pct=0.25,
            use_parallel_residual=True, tie_word_embeddings=False, bos_token_id=tok.eos_token_id,
            eos_token_id=tok.eos_token_id, attention_dropout=0.0, hidden_dropout=0.0,
        )
        model = transformers.GPTNeoXForCausalLM(cfg)
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.mul_(5.0)
    elif kind == "gpt2":
        cfg = GPT2Config(
            vocab_size=len(tok), n_positions=128, n_embd=d_model, n_layer=n_layers, n_head=d_model // 32,
            bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
        )
        model = GPT2LMHeadModel(cfg)
    else:
        names = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "phi3": "Phi3",
                 "gemma2": "Gemma2", "gemma3": "Gemma3", "qwen3_moe": "Qwen3Moe", "olmo2": "Olmo2"}[kind]
        config_cls = getattr(transformers, "Gemma3TextConfig" if kind == "gemma3" else f"{names}Config")
        model_cls = getattr(transformers, f"{names}ForCausalLM")
        extra = {"sliding_window": None} if kind in ("mistral", "qwen2", "qwen3", "phi3", "qwen3_moe") else {}
        if kind == "qwen3_moe":
            extra.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=d_model, decoder_sparse_step=1,
                         mlp_only_layers=[], norm_topk_prob=True)
        tied = False
        if kind == "gemma2":  # soft-caps low enough that random weights reach them
            extra.update(head_dim=32, query_pre_attn_scalar=32, sliding_window=64, attn_logit_softcapping=5.0,
                         final_logit_softcapping=3.0, pad_token_id=tok.eos_token_id, hidden_activation="gelu_pytorch_tanh")
            tied = True
        elif kind == "gemma3":
            extra.update(head_dim=32, query_pre_attn_scalar=32, sliding_window=8, pad_token_id=tok.eos_token_id,
                         hidden_activation="gelu_pytorch_tanh")  # a short window: local layers differ
            tied = True
        elif kind == "phi3":  # its defaults name a pad id of a 32k vocabulary
            extra.update(pad_token_id=tok.eos_token_id, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)
        elif kind == "olmo2":  # (head size d_model / heads = 32)
            extra.update(pad_token_id=tok.eos_token_id)
        elif "head_dim" not in extra:
            extra["head_dim"] = 32
        cfg = config_cls(
            vocab_size=len(tok), hidden_size=d_model, intermediate_size=2 * d_model, num_hidden_layers=n_layers,
            num_attention_heads=d_model // 32, num_key_value_heads=max(1, d_model // 64), max_position_embeddings=128,
            tie_word_embeddings=tied, bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
            rms_norm_eps=1e-5, **extra,
        )
        model = model_cls(cfg)
        # Random init gives near-zero norms' effect; scale weights up so layers differ visibly.
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() > 1:
                    p.mul_(5.0)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    from .reference import no_transformers_bars

    with no_transformers_bars():
        model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    tmp.rename(out)
    return str(out)


class TF32:
    """Context manager: TF32 for fp32 matmuls (cuBLAS) and convolutions (cuDNN) on or off.

    Used where transformers on a GPU is the reference (tests' fidelity bounds, benchmarks/fp32_gpu.py).
    """

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        import torch

        self.saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = self.on

    def __exit__(self, *exc):
        import torch

        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = self.saved
