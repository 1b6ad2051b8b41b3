"""Attention heads: patterns rebuilt from captured q and k, each head's write, direct logit attribution.

Plain torch on whatever device the tensors live on (CPU for a :class:`~nnvllm.results.Run`); no
engine is involved, so everything here runs on synthetic tensors in tests.

**Patterns.** vLLM's paged and flash attention never materialise the attention probabilities.
:func:`patterns` rebuilds them from the ``q`` and ``k`` the attention layer received (after the rotary
embedding and any q/k norm) with the model's own rule, :class:`~nnvllm.arch.AttentionSpec`::

    pattern[h, p, j] = softmax_j( cap * tanh(scale * q[p, h] . k[j, h // group] / cap) ),   j <= p,
                                  p - j < window  (sliding-window layers)

``group = n_heads / n_kv_heads`` query heads share one KV head (grouped-query attention); without a
soft-cap there is no tanh. Masked entries are exactly 0. Query positions are processed in chunks so
that at most ``budget`` bytes of scores exist at once; the result itself is ``[heads, queries, keys]``
float32 (pick ``heads`` and ``queries`` to keep it small: one head of a 4,096-token request is 64 MiB).
Families whose attention is not ``softmax(scale * q . k)`` over those q and k (latent attention,
ALiBi, attention sinks) are refused when their :class:`~nnvllm.arch.AttentionSpec` is read.

**Per-head writes.** ``z`` (each head's output, the input of the output projection) times that head's
slice of ``W_O`` is what the head writes: ``result[p, h] = W_O[:, h*d_head:(h+1)*d_head] @ z[p, h]``;
summed over heads, plus the projection's bias, it is the attention output (:func:`head_results`).

**Direct logit attribution** (:func:`logit_attribution`): how much each component of the residual
stream at a position adds to ``logit[target] - logit[versus]`` there. The final norm is not linear;
as in TransformerLens (``cache.apply_ln_to_stack(..., pos_slice=-1)``, ``logit_attrs``) it is
*frozen*: its scale (the LayerNorm's standard deviation, the RMSNorm's root mean square) is taken
from the whole stream at that position and every component is divided by it (a LayerNorm also
centres each component). With the scale frozen the norm is linear, so the terms add up exactly:

    sum(heads) + sum(attention biases) + sum(MLPs) + embedding + final biases = logit difference

(``final biases``: the final norm's bias and the unembedding's, projected on the direction). The
identity holds at the real scale of that position only; at another scale (another prompt, an ablated
stream) the terms are a linear approximation. Families with a norm on each sublayer's output before
its residual add (Gemma 2/3, OLMo 2) pass each head's write through that norm frozen the same way, at
the scale of the whole attention output at that position. A final-logit soft-cap (Gemma 2) is not
linear: the attribution is of the logit difference before it (``cap * atanh(logit / cap)``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor

from .arch import AttentionSpec
from .lens import Norm

__all__ = ["Attribution", "HeadWeights", "Readout", "direction", "head_results", "logit_attribution",
           "pattern_chunks", "patterns", "split_heads", "uncap"]

_BUDGET = 256 << 20  # bytes of fp32 scores held at once by pattern_chunks


def split_heads(x: Tensor, n_heads: int, d_head: int, name: str = "x") -> Tensor:
    """``[..., heads * d_head]`` as ``[..., heads, d_head]`` (a view); ``[..., heads, d_head]`` as it is."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a tensor [pos, heads, d_head] (or [pos, heads * d_head]), got "
                        f"{type(x).__name__}")
    if x.ndim >= 2 and tuple(x.shape[-2:]) == (n_heads, d_head):
        return x
    if x.ndim >= 1 and x.shape[-1] == n_heads * d_head:
        return x.unflatten(-1, (n_heads, d_head))
    raise ValueError(f"{name} has shape {tuple(x.shape)}; expected [..., {n_heads}, {d_head}] or "
                     f"[..., {n_heads * d_head}] ({n_heads} heads of {d_head})")


def _heads(heads, n_heads: int) -> list[int]:
    if heads is None:
        return list(range(n_heads))
    items = [heads] if isinstance(heads, int) and not isinstance(heads, bool) else heads
    try:
        items = list(items)
    except TypeError:
        raise TypeError(f"heads={heads!r}: expected None (every head), an int or a list of ints") from None
    out = []
    for h in items:
        if isinstance(h, bool) or not isinstance(h, int):
            raise TypeError(f"heads={heads!r}: expected None (every head), an int or a list of ints")
        if not -n_heads <= h < n_heads:
            raise ValueError(f"heads={heads!r}: head {h} out of range for {n_heads} heads (0-{n_heads - 1})")
        out.append(h % n_heads)
    return out


def _queries(queries, n_pos: int, device) -> Tensor:
    if queries is None:
        return torch.arange(n_pos, device=device)
    if isinstance(queries, slice):
        return torch.arange(n_pos, device=device)[queries]
    q = torch.as_tensor(queries, device=device).reshape(-1)
    if q.dtype in (torch.bool, torch.float16, torch.float32, torch.float64, torch.bfloat16):
        raise TypeError(f"queries={queries!r}: expected None, a slice, or integer positions")
    if q.numel() and (int(q.min()) < -n_pos or int(q.max()) >= n_pos):
        raise ValueError(f"queries holds positions outside 0-{n_pos - 1} (the request's {n_pos} positions)")
    return q.long() % n_pos


def _check_qk(q: Tensor, k: Tensor, spec: AttentionSpec, layer: int) -> tuple[Tensor, Tensor]:
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"spec must be an nnvllm.arch.AttentionSpec, got {type(spec).__name__}")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < spec.n_layers:
        raise ValueError(f"layer={layer!r}: expected a block index 0-{spec.n_layers - 1} (the window of a "
                         "sliding-window layer depends on it)")
    q = split_heads(q, spec.n_heads, spec.d_head, "q")
    k = split_heads(k, spec.n_kv_heads, spec.d_head, "k")
    if q.ndim != 3 or k.ndim != 3:
        raise ValueError(f"q and k must be one request's [pos, heads, d_head], got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    if q.shape[1:] != (spec.n_heads, spec.d_head) or k.shape[1:] != (spec.n_kv_heads, spec.d_head):
        raise ValueError(f"q is {tuple(q.shape)} and k {tuple(k.shape)}; this model's attention has "
                         f"q [pos, {spec.n_heads}, {spec.d_head}] and k [pos, {spec.n_kv_heads}, {spec.d_head}]")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q has {q.shape[0]} positions and k {k.shape[0]}; pass one request's q and k over the "
                         "same positions")
    return q, k


def _chunks(q: Tensor, k: Tensor, spec: AttentionSpec, layer: int, hs: list[int], qpos: Tensor, budget: int):
    """Yield ``(rows, lo, probs [heads, c, top - lo])``: the chunk's query positions and their
    probabilities over keys ``lo..top-1``, the only keys they can see (all others are 0)."""
    dev = q.device
    head_idx = torch.tensor(hs, dtype=torch.long, device=dev)
    kv_idx = head_idx // spec.group
    window = spec.window(layer)
    cap = spec.soft_cap
    per_row = 2 * max(1, len(hs)) * max(1, q.shape[0]) * 4  # scores (the softmax's output), mask
    step = max(1, int(budget) // per_row)
    for a in range(0, qpos.numel(), step):
        rows = qpos[a:a + step]
        if not rows.numel():
            continue
        top = int(rows.max()) + 1  # no query of the chunk sees a key past its own position
        lo = 0 if window is None else max(0, int(rows.min()) - window + 1)
        qc = q.index_select(0, rows).index_select(1, head_idx).float().transpose(0, 1)  # [H, c, d]
        kc = k[lo:top].index_select(1, kv_idx).float().permute(1, 2, 0)  # [H, d, K]
        scores = torch.bmm(qc, kc).mul_(spec.scale)  # [H, c, K]
        if cap is not None:
            scores.div_(cap).tanh_().mul_(cap)
        kpos = torch.arange(lo, top, device=dev)
        hidden = kpos[None, :] > rows[:, None]
        if window is not None:
            hidden |= kpos[None, :] <= rows[:, None] - window
        yield rows, lo, torch.softmax(scores.masked_fill_(hidden, float("-inf")), -1)


def pattern_chunks(q: Tensor, k: Tensor, spec: AttentionSpec, layer: int, *, heads=None, queries=None,
                   budget: int = _BUDGET) -> Iterator[tuple[Tensor, Tensor]]:
    """Yield ``(query positions [c], pattern [heads, c, keys])`` chunk by chunk (see :func:`patterns`).

    At most about ``budget`` bytes of float32 scores exist at once; a consumer that keeps only what it
    needs (the top keys of each query, one head) holds no full pattern at all.
    """
    q, k = _check_qk(q, k, spec, layer)
    hs = _heads(heads, spec.n_heads)
    qpos = _queries(queries, q.shape[0], q.device)
    for rows, lo, probs in _chunks(q, k, spec, layer, hs, qpos, budget):
        out = torch.zeros(len(hs), rows.numel(), q.shape[0], dtype=torch.float32, device=q.device)
        out[:, :, lo:lo + probs.shape[-1]] = probs
        yield rows, out


def patterns(q: Tensor, k: Tensor, spec: AttentionSpec, layer: int, *, heads=None, queries=None,
             budget: int = _BUDGET) -> Tensor:
    """Rebuild one layer's attention patterns from its captured q and k.

    Args:
        q: ``[pos, n_heads, d_head]`` (or ``[pos, n_heads * d_head]``) one request's queries at ``layer``.
        k: ``[pos, n_kv_heads, d_head]`` its keys (the KV heads as they are).
        spec: the model's :class:`~nnvllm.arch.AttentionSpec` (scale, soft-cap, windows, GQA).
        layer: the block index (its sliding window, if any).
        heads: None (every query head), an int or a list of head indices.
        queries: None (every position), a slice, or query positions.
        budget: bytes of scores held at once (memory knob only; the result does not depend on it).

    Returns:
        ``[heads, queries, pos]`` float32 probabilities on ``q``'s device; each row sums to 1 over the
        keys its query sees (``j <= p``, within the window), and is 0 elsewhere.

    Example::

        pat = patterns(run.sites["q"][0][3], run.sites["k"][0][3], spec, layer=3, heads=[5])
    """
    q, k = _check_qk(q, k, spec, layer)
    hs = _heads(heads, spec.n_heads)
    qpos = _queries(queries, q.shape[0], q.device)
    out = torch.zeros(len(hs), qpos.numel(), q.shape[0], dtype=torch.float32, device=q.device)
    at = 0
    for rows, lo, probs in _chunks(q, k, spec, layer, hs, qpos, budget):
        out[:, at:at + rows.numel(), lo:lo + probs.shape[-1]] = probs
        at += rows.numel()
    return out


def head_results(z: Tensor, w_o: Tensor, n_heads: int) -> Tensor:
    """Each head's write into the stream: ``result[..., h, :] = W_O[:, h*d_head:(h+1)*d_head] @ z[..., h, :]``.

    Args:
        z: ``[..., heads, d_head]`` (or ``[..., heads * d_head]``) the input of the output projection.
        w_o: ``[d_model, heads * d_head]`` the output projection's weight (a ``Linear``'s layout).
        n_heads: heads.

    Returns:
        ``[..., heads, d_model]`` float32. Summed over heads, plus the projection's bias, it is the
        attention output.
    """
    if not isinstance(w_o, Tensor) or w_o.ndim != 2 or w_o.shape[1] % n_heads:
        raise ValueError(f"w_o must be [d_model, heads * d_head] (a Linear's [out, in] layout) with {n_heads} heads, "
                         f"got {tuple(getattr(w_o, 'shape', ()))}")
    z = split_heads(z, n_heads, w_o.shape[1] // n_heads, "z").float()
    w = w_o.float().to(z.device).unflatten(1, (z.shape[-2], z.shape[-1]))  # [d_model, H, d]
    return torch.einsum("...hd,mhd->...hm", z, w)


# ---------------------------------------------------------------- direct logit attribution


# Bytes of float32 a direct logit attribution converts at once (z of several layers).
_CHUNK_BYTES = 256 << 20


def _frozen(norm: Norm, x: Tensor) -> Tensor:
    """The norm's scale at each row of ``x`` [..., d_model]: the LayerNorm's standard deviation, the
    RMSNorm's root mean square (eps included): what the norm divides by."""
    x = x.float()
    if norm.kind == "layernorm":
        return torch.sqrt(x.var(-1, unbiased=False) + norm.eps)
    return torch.sqrt(x.pow(2).mean(-1) + norm.eps)


def _through(norm: Norm, g: Tensor) -> Tensor:
    """The vector ``v`` with ``(norm's linear part applied to c) . g == c . v`` for any ``c``: the
    weight, and a LayerNorm's centring (symmetric, so it moves onto ``g``)."""
    v = norm.weight.float().to(g.device) * g
    if norm.kind == "layernorm":
        v = v - v.mean()
    return v


def _bias_dot(norm: Norm, g: Tensor) -> Tensor:
    return torch.zeros((), device=g.device) if norm.bias is None else norm.bias.float().to(g.device) @ g


@dataclass
class HeadWeights:
    """The weights an attribution needs, as plain tensors (any device; float32 is used).

    Attributes:
        w_o: ``[layer, d_model, heads * d_head]`` each block's attention output projection (``Linear``
            layout: head ``h`` owns columns ``h*d_head:(h+1)*d_head``).
        b_o: ``[layer, d_model]`` its bias, or None.
        final_norm: the final :class:`~nnvllm.lens.Norm` (Gemma's ``(1 + w)`` folded into its weight).
        unembed: ``[d_vocab, d_model]`` the unembedding (rows are read for the two tokens).
        unembed_bias: ``[d_vocab]`` or None.
        embed: ``[d_vocab, d_model]`` the token embedding.
        pos_embed: ``[n_positions, d_model]`` a learned position embedding (GPT-2), or None.
        embed_scale: the factor on the embedding before the first block (Gemma: ``sqrt(d_model)``), 1.0 else.
        post_attn: per layer, the norm on the attention output before its residual add (Gemma 2/3,
            OLMo 2), or None.
        post_mlp: per layer, the norm on the MLP output before its residual add, or None.
        logit_scale: a factor on the logits (vLLM's logits processor ``scale``), 1.0 for most models.
        soft_cap: the final-logit soft-cap (Gemma 2), or None.
    """

    w_o: Tensor
    final_norm: Norm
    unembed: Tensor
    embed: Tensor
    b_o: Tensor | None = None
    unembed_bias: Tensor | None = None
    pos_embed: Tensor | None = None
    embed_scale: float = 1.0
    post_attn: list[Norm] | None = None
    post_mlp: list[Norm] | None = None
    logit_scale: float = 1.0
    soft_cap: float | None = None

    @property
    def n_layers(self) -> int:
        return int(self.w_o.shape[0])

    @classmethod
    def from_module(cls, root: torch.nn.Module, arch, config: Any = None) -> HeadWeights:
        """Read them from a model's modules at transformers' paths (:class:`~nnvllm.arch.Arch`'s
        ``blocks``, ``final_norm``, ``unembed``, ``embed``, ``heads.hf_out``); views, not copies.

        ``config`` (the HF config) gives the final-logit soft-cap where the family has one.
        """
        if arch.heads is None or arch.embed is None:
            raise ValueError(f"the {arch.family} family's heads are not described (Arch.heads / Arch.embed); "
                             "there is nothing to attribute to")
        blocks = root.get_submodule(arch.blocks)
        out_path = arch.heads.hf_out or arch.heads.out
        w, b = [], []
        for blk in blocks:
            m = blk.get_submodule(out_path)
            w.append(m.weight.detach().t() if arch.heads.out_is_conv1d else m.weight.detach())
            b.append(None if getattr(m, "bias", None) is None else m.bias.detach())
        post_attn = post_mlp = None
        if arch.heads.post_norms:
            post_attn = [_norm_of(blk.get_submodule(arch.heads.post_norms[0])) for blk in blocks]
            post_mlp = [_norm_of(blk.get_submodule(arch.heads.post_norms[1])) for blk in blocks]
        try:
            head = root.get_submodule(arch.unembed)
        except AttributeError:  # transformers renamed it (GPT-NeoX's embed_out is lm_head in transformers 5)
            head = root.get_output_embeddings()
        emb = root.get_submodule(arch.embed).weight.detach()
        cap = None
        if arch.logit_softcap and config is not None:
            cap = getattr(config, arch.logit_softcap, None)
        return cls(
            w_o=torch.stack(w), b_o=None if b[0] is None else torch.stack(b),
            final_norm=_norm_of(root.get_submodule(arch.final_norm)),
            unembed=head.weight.detach(),
            unembed_bias=None if getattr(head, "bias", None) is None else head.bias.detach(),
            embed=emb,
            pos_embed=root.get_submodule(arch.pos_embed).weight.detach() if arch.pos_embed else None,
            embed_scale=float(torch.tensor(emb.shape[1] ** 0.5, dtype=emb.dtype)) if arch.embed_scale else 1.0,
            post_attn=post_attn, post_mlp=post_mlp, soft_cap=float(cap) if cap else None)

    def embedding(self, ids: Sequence[int] | Tensor, positions: Sequence[int] | Tensor) -> Tensor:
        """``[n, d_model]`` what enters the first block for these tokens at these positions."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.embed.device)
        e = self.embed.index_select(0, ids).float() * self.embed_scale
        if self.pos_embed is not None:
            pos = torch.as_tensor(positions, dtype=torch.long, device=self.pos_embed.device)
            e = e + self.pos_embed.index_select(0, pos).float()
        return e


def _norm_of(m: torch.nn.Module) -> Norm:
    """A norm module as a :class:`~nnvllm.lens.Norm` (Gemma's RMSNorm scales by ``1 + weight``)."""
    w = m.weight.detach().float()
    if type(m).__name__.startswith("Gemma"):
        w = w + 1.0
    bias = getattr(m, "bias", None)
    eps = getattr(m, "eps", None) or getattr(m, "variance_epsilon", None) or 1e-6
    return Norm("layernorm" if bias is not None else "rmsnorm", w,
                None if bias is None else bias.detach().float(), float(eps))


def uncap(logits: Tensor, soft_cap: float | None) -> Tensor:
    """The logits before a final soft-cap ``cap * tanh(x / cap)``: ``cap * atanh(logits / cap)``."""
    if soft_cap is None:
        return logits.float()
    return torch.atanh((logits.float() / soft_cap).clamp(-1 + 1e-7, 1 - 1e-7)) * soft_cap


@dataclass
class Readout:
    """What each part of the stream is read with in a direct logit attribution: the direction ``g``
    (the unembedding difference through the frozen final norm's linear part) carried back through
    each block's weights. Small (no ``W_O``): the engine computes it where the weights are
    (``CaptureWorker.nnvllm_readout``), or :meth:`from_weights` from :class:`HeadWeights`.

    Attributes:
        heads: ``[layer, heads, d_head]`` ``W_O[h]^T g`` (through a post-attention norm's weight).
        attn_bias: ``[layer]`` the output projection's bias read like a head's write (divided by a
            post-attention norm's frozen scale where there is one).
        mlp: ``[layer, d_model]`` what an MLP output is dotted with (``g``, or through a post-MLP norm).
        attn_norm_bias: ``[layer]`` a post-attention norm's bias dotted with ``g`` (0 without one).
        mlp_bias: ``[layer]`` a post-MLP norm's bias dotted with ``g`` (0 without one).
        post: per layer ``(attention norm, MLP norm)`` applied before each residual add (their frozen
            scales divide the terms), or None.
        embed: ``[n]`` the embedding at the attributed positions dotted with ``g``, or None (then
            :func:`logit_attribution` takes the embedding rows).
    """

    heads: Tensor
    attn_bias: Tensor
    mlp: Tensor
    attn_norm_bias: Tensor
    mlp_bias: Tensor
    post: list[tuple[Norm, Norm]] | None = None
    embed: Tensor | None = None

    @classmethod
    def from_weights(cls, weights: HeadWeights, g: Tensor, n_heads: int) -> Readout:
        L, dev = weights.n_layers, g.device
        heads, mlp = [], []
        attn_bias, attn_norm_bias, mlp_bias = (torch.zeros(L, device=dev) for _ in range(3))
        post = None if weights.post_attn is None else list(zip(weights.post_attn, weights.post_mlp))
        for layer in range(L):
            ga = gm = g
            if post:
                na, nm = post[layer]
                ga, gm = _through(na, g), _through(nm, g)
                attn_norm_bias[layer] += _bias_dot(na, g)
                mlp_bias[layer] += _bias_dot(nm, g)
            heads.append((weights.w_o[layer].float().to(dev).t() @ ga).view(n_heads, -1))  # [H, d]
            if weights.b_o is not None:
                attn_bias[layer] += weights.b_o[layer].float().to(dev) @ ga
            mlp.append(gm)
        return cls(torch.stack(heads), attn_bias, torch.stack(mlp), attn_norm_bias, mlp_bias, post)


def direction(unembed: Tensor, final_norm: Norm, target: int, versus: int | None, logit_scale: float = 1.0,
              unembed_bias: Tensor | None = None, device=None) -> tuple[Tensor, Tensor]:
    """``(g, bias)``: the direction in the stream whose dot product, divided by the final norm's
    frozen scale, is a component's share of ``logit[target] - logit[versus]``; and the constant
    the final norm's and unembedding's biases add."""
    d = unembed[target].float().to(device) - (unembed[versus].float().to(device) if versus is not None else 0.0)
    d = d * logit_scale
    bias = _bias_dot(final_norm, d)
    if unembed_bias is not None:
        ub = unembed_bias.float().to(device)
        bias = bias + logit_scale * (ub[target] - (ub[versus] if versus is not None else 0.0))
    return _through(final_norm, d), bias


def logit_attribution(weights: HeadWeights | None, target: int, versus: int | None, *, z: Tensor, mlp: Tensor,
                      resid: Tensor, embed: Tensor | None, attn: Tensor | None = None,
                      readout: Readout | None = None, final_norm: Norm | None = None,
                      bias: Tensor | None = None) -> dict[str, Tensor]:
    """Direct logit attribution of ``logit[target] - logit[versus]`` at some positions of one request.

    Args:
        weights: :class:`HeadWeights`; or None with ``readout``, ``final_norm`` and ``bias`` (what the
            engine computed: :class:`Readout`, :func:`direction`).
        target: the token whose logit is explained.
        versus: the token it is compared with, or None (the target's logit alone).
        z: ``[layer, n, heads, d_head]`` every block's z at the n positions.
        mlp: ``[layer, n, d_model]`` every block's MLP output there.
        resid: ``[n, d_model]`` the stream after the last block there (sets the frozen final-norm scale).
        embed: ``[n, d_model]`` the embedding there (:meth:`HeadWeights.embedding`); None where the
            readout carries its dot products.
        attn: ``[layer, n, d_model]`` every block's attention output (needed where a norm follows
            each sublayer: its frozen scale).

    Returns:
        dict of float32 tensors: ``heads`` ``[n, layer, head]``, ``attn_bias`` ``[n, layer]`` (the
        output projection's bias and a post-norm's bias), ``mlp`` ``[n, layer]``, ``embed`` ``[n]``,
        ``bias`` ``[n]`` (final norm and unembedding biases), ``scale`` ``[n]`` (the frozen final-norm
        scale). Their sum is the logit difference before any final soft-cap.
    """
    if z.ndim != 4:
        raise ValueError(f"z must be [layer, n, heads, d_head], got {tuple(z.shape)}")
    L, n_heads, d_head = z.shape[0], z.shape[2], z.shape[3]
    dev = resid.device
    if readout is None:
        if weights.n_layers != L or n_heads * d_head != weights.w_o.shape[2]:
            raise ValueError(f"z has {L} layers of {n_heads} heads of {d_head}; the model has {weights.n_layers} "
                             f"blocks whose W_O takes {weights.w_o.shape[2]} inputs")
        g, bias = direction(weights.unembed, weights.final_norm, target, versus, weights.logit_scale,
                            weights.unembed_bias, dev)
        final_norm = weights.final_norm
        readout = Readout.from_weights(weights, g, n_heads)
        readout.embed = None if embed is None else embed.to(dev).float() @ g
    if readout.heads.shape[0] != L or mlp.shape[0] != L:
        raise ValueError(f"z has {L} layers and mlp {mlp.shape[0]}; attribution needs every one of the "
                         f"model's {readout.heads.shape[0]} blocks")
    if readout.heads.shape[1:] != (n_heads, d_head):
        raise ValueError(f"z has {n_heads} heads of {d_head}; the model's W_O reads {tuple(readout.heads.shape[1:])}")
    if readout.post is not None and attn is None:
        raise ValueError("this family normalises each sublayer's output before its residual add: pass attn "
                         "(the attention output at the same positions) for its frozen scale")
    scale = _frozen(final_norm, resid)  # [n]
    n = resid.shape[0]
    # Each head's dot product as one matrix product per layer: z [n, heads * d_head] times a
    # block-diagonal [heads * d_head, heads] (head h's column holds W_O[h]^T g in head h's rows), so no
    # [n, heads, d_head] product is materialised; layers go in chunks whose float32 copy of z stays
    # under _CHUNK_BYTES (a 4k-position request's z in float32 is 32 MB a layer on a 1B model).
    w_heads = torch.zeros(L, n_heads, d_head, n_heads, device=dev)
    idx = torch.arange(n_heads, device=dev)
    w_heads[:, idx, :, idx] = readout.heads.to(dev).float().transpose(0, 1)  # [heads, layer, d_head]
    w_heads = w_heads.flatten(1, 2)  # [layer, heads * d_head, heads]
    w_mlp = readout.mlp.to(dev).float()[:, :, None]  # [layer, d_model, 1]
    heads = torch.empty(L, n, n_heads, device=dev)
    mlp_t = torch.empty(L, n, device=dev)
    step = max(1, _CHUNK_BYTES // max(1, n * n_heads * d_head * 4))
    for a in range(0, L, step):
        b = min(L, a + step)
        torch.bmm(z[a:b].flatten(-2).to(dev).float(), w_heads[a:b], out=heads[a:b])
        mlp_t[a:b] = torch.bmm(mlp[a:b].to(dev).float(), w_mlp[a:b]).squeeze(-1)
    attn_bias = readout.attn_bias.to(dev).float()[:, None].expand(L, n)
    if readout.post is not None:  # each sublayer's own frozen scale divides its terms
        ra = torch.stack([1.0 / _frozen(na, attn[layer].to(dev)) for layer, (na, _) in enumerate(readout.post)])
        rm = torch.stack([1.0 / _frozen(nm, mlp[layer].to(dev)) for layer, (_, nm) in enumerate(readout.post)])
        heads = heads * ra[..., None]
        attn_bias = attn_bias * ra
        mlp_t = mlp_t * rm
    attn_bias = attn_bias + readout.attn_norm_bias.to(dev).float()[:, None]
    mlp_t = mlp_t + readout.mlp_bias.to(dev).float()[:, None]
    inv = 1.0 / scale
    return {"heads": heads.permute(1, 0, 2) * inv[:, None, None], "attn_bias": attn_bias.t() * inv[:, None],
            "mlp": mlp_t.t() * inv[:, None], "embed": readout.embed.to(dev).float() * inv,
            "bias": bias.expand(n).clone() if bias.ndim == 0 else bias, "scale": scale}


@dataclass
class Attribution:
    """Direct logit attribution over a generation: how much each head, MLP and the embedding add to
    ``logit[target] - logit[versus]`` at every generated step (see :mod:`nnvllm.heads` for the
    convention: the final norm frozen at each step's own scale, as TransformerLens does).

    Attributes:
        target: the token id explained.
        versus: the token id compared with, or None.
        heads: per request ``[step, layer, head]``.
        mlp: per request ``[step, layer]``.
        attn_bias: per request ``[step, layer]`` the attention's bias terms (output projection, post-norm).
        embed: per request ``[step]``.
        bias: per request ``[step]`` the final norm's and the unembedding's bias terms.
        logit_diff: per request ``[step]`` the engine's logit difference at that step (before any final
            soft-cap); the terms sum to it (:meth:`total`).
        labels: the two tokens as text.
    """

    target: int
    versus: int | None
    heads: list[Tensor]
    mlp: list[Tensor]
    attn_bias: list[Tensor]
    embed: list[Tensor]
    bias: list[Tensor]
    logit_diff: list[Tensor]
    labels: tuple[str, str | None] = ("", None)
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.heads)

    def total(self, i: int = 0) -> Tensor:
        """``[step]`` the sum of every term of request ``i``: equal to :attr:`logit_diff` up to rounding."""
        return (self.heads[i].sum((1, 2)) + self.attn_bias[i].sum(1) + self.mlp[i].sum(1) + self.embed[i]
                + self.bias[i])

    def top_heads(self, i: int = 0, step: int = 0, k: int = 5) -> list[tuple[int, int, float]]:
        """The ``k`` heads with the largest absolute attribution at ``step``: ``(layer, head, value)``."""
        a = self.heads[i][step]
        flat = a.flatten()
        idx = flat.abs().topk(min(k, flat.numel())).indices
        return [(int(j) // a.shape[1], int(j) % a.shape[1], float(flat[j])) for j in idx]

    def to_frame(self):
        """One row per (request, step, layer, head): ``request, step, layer, head, value`` (``head`` -1:
        the MLP of that layer)."""
        import pandas as pd

        rows = []
        for i in range(len(self)):
            h, m = self.heads[i], self.mlp[i]
            S, L, H = h.shape
            for s in range(S):
                for layer in range(L):
                    rows.extend({"request": i, "step": s, "layer": layer, "head": hh, "value": float(h[s, layer, hh])}
                                for hh in range(H))
                    rows.append({"request": i, "step": s, "layer": layer, "head": -1, "value": float(m[s, layer])})
        return pd.DataFrame(rows)

    def __repr__(self) -> str:
        t, v = self.labels
        shape = tuple(self.heads[0].shape) if self.heads else ()
        return (f"<Attribution: {t!r}" + (f" - {v!r}" if self.versus is not None else "")
                + f"; {len(self)} request(s); heads {shape} [step, layer, head]>")
