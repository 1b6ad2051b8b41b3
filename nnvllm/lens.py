"""Logit lens: read each layer's residual stream through the final norm and the unembedding.

The lens asks "what would the model predict if it stopped after block ``layer``?": take the
residual stream after that block, apply the model's final norm, multiply by the unembedding and
softmax. Everything here is plain torch on whatever device the tensors live on (CPU for a
:class:`~nnvllm.results.Run`); no engine is involved, so it runs on synthetic tensors in tests.

Position ``p`` holds token ``labels[p]``; its lens distribution is a guess at token ``p + 1``.

Example::

    unembed = Unembed(Norm("layernorm", ln_f.weight, ln_f.bias, 1e-5), lm_head.weight)
    lens = Lens.from_run(run, 0, unembed, k=5, tokenizer=tok)
    lens.prob_of(" Paris")[-1]   # [pos]: the last block's probability of " Paris" at each position
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Lens", "Norm", "Unembed", "apply_norm", "lens_prob_of", "lens_topk", "project"]

_NORM_KINDS = ("layernorm", "rmsnorm")


@dataclass(frozen=True)
class Norm:
    """A model's final normalisation, as plain tensors.

    Attributes:
        kind: ``"layernorm"`` (GPT-2) or ``"rmsnorm"`` (Llama-style).
        weight: ``[d_model]`` the scale.
        bias: ``[d_model]`` the shift (LayerNorm only), or None.
        eps: the epsilon added to the variance (or mean square).
    """

    kind: str
    weight: Tensor
    bias: Tensor | None = None
    eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.kind not in _NORM_KINDS:
            raise ValueError(
                f"Norm(kind={self.kind!r}) is not one of {_NORM_KINDS}; use 'layernorm' for GPT-2-style "
                "models and 'rmsnorm' for Llama-style ones."
            ) from None
        if not isinstance(self.weight, Tensor) or self.weight.ndim != 1:
            raise TypeError(
                f"Norm.weight must be a 1-D tensor [d_model], got {_describe(self.weight)}; pass the "
                "final norm's weight (e.g. model.transformer.ln_f.weight)."
            ) from None
        if self.bias is not None:
            if self.kind == "rmsnorm":
                raise ValueError(
                    "Norm(kind='rmsnorm') takes no bias, got one; pass bias=None or kind='layernorm'."
                ) from None
            if not isinstance(self.bias, Tensor) or tuple(self.bias.shape) != tuple(self.weight.shape):
                raise ValueError(
                    f"Norm.bias must match weight's shape {tuple(self.weight.shape)}, got "
                    f"{_describe(self.bias)}; pass the same norm's bias."
                ) from None

    @property
    def d_model(self) -> int:
        return int(self.weight.shape[0])


@dataclass(frozen=True)
class Unembed:
    """Final norm + unembedding: everything needed to turn a residual vector into logits.

    Attributes:
        norm: the final :class:`Norm`.
        weight: ``[d_vocab, d_model]`` the unembedding (the LM head's weight, tied or not).
        bias: ``[d_vocab]`` the LM head's bias, or None (the usual case).
        soft_cap: a final-logit soft-cap, ``soft_cap * tanh(logits / soft_cap)`` (Gemma 2), or None.
        scale: a factor on the logits after that (1 for most models), as vLLM's logits processor.
    """

    norm: Norm
    weight: Tensor
    bias: Tensor | None = None
    soft_cap: float | None = None
    scale: float = 1.0

    def __post_init__(self) -> None:
        if self.soft_cap is not None and not (isinstance(self.soft_cap, (int, float)) and self.soft_cap > 0):
            raise ValueError(f"Unembed.soft_cap={self.soft_cap!r}; expected a positive number or None")
        if not isinstance(self.norm, Norm):
            raise TypeError(
                f"Unembed.norm must be a nnvllm.lens.Norm, got {type(self.norm).__name__}; wrap the "
                "final norm's tensors in Norm(kind, weight, bias, eps)."
            ) from None
        if not isinstance(self.weight, Tensor) or self.weight.ndim != 2:
            raise TypeError(
                f"Unembed.weight must be a 2-D tensor [d_vocab, d_model], got {_describe(self.weight)}; "
                "pass the LM head's weight."
            ) from None
        if self.weight.shape[1] != self.norm.d_model:
            raise ValueError(
                f"Unembed.weight has shape {tuple(self.weight.shape)} but the norm has d_model="
                f"{self.norm.d_model}; expected [d_vocab, {self.norm.d_model}] (transpose it if it "
                "is [d_model, d_vocab])."
            ) from None
        if self.bias is not None and tuple(self.bias.shape) != (self.weight.shape[0],):
            raise ValueError(
                f"Unembed.bias must have shape ({self.weight.shape[0]},) = [d_vocab], got "
                f"{_describe(self.bias)}; pass the LM head's bias or None."
            ) from None

    @property
    def d_model(self) -> int:
        return int(self.weight.shape[1])

    @property
    def d_vocab(self) -> int:
        return int(self.weight.shape[0])


def apply_norm(x: Tensor, norm: Norm) -> Tensor:
    """Apply ``norm`` to the last axis of ``x``, in float32.

    LayerNorm matches ``torch.nn.functional.layer_norm``; RMSNorm is Llama's
    ``x * rsqrt(mean(x**2) + eps) * weight``.

    Args:
        x: ``[..., d_model]`` residual vectors, any float dtype.
        norm: the final norm.

    Returns:
        ``[..., d_model]`` float32.

    Example::

        apply_norm(torch.randn(3, 8), Norm("rmsnorm", torch.ones(8), None, 1e-6))
    """
    _check_width(x, norm.d_model, "apply_norm")
    x = x.float()
    w = norm.weight.to(device=x.device, dtype=torch.float32)
    if norm.kind == "layernorm":
        b = None if norm.bias is None else norm.bias.to(device=x.device, dtype=torch.float32)
        return F.layer_norm(x, (x.shape[-1],), w, b, norm.eps)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * w


def project(resid: Tensor, unembed: Unembed) -> Tensor:
    """Project residual vectors to logits through the final norm and the unembedding.

    Args:
        resid: ``[..., d_model]`` residual vectors.
        unembed: the final norm and unembedding.

    Returns:
        ``[..., d_vocab]`` float32 logits.

    Example::

        logits = project(run.resid[0][-1], unembed)   # [pos, d_vocab]
    """
    _check_width(resid, unembed.d_model, "project")
    return _project(resid, _to_f32(unembed, resid.device))


def lens_topk(resid: Tensor, unembed: Unembed, k: int = 5, chunk: int = 64) -> tuple[Tensor, Tensor]:
    """Return the k most likely tokens of each (layer, pos) under the logit lens.

    Positions are processed ``chunk`` at a time, so at most ``[layer, chunk, d_vocab]`` logits
    exist at once.

    Args:
        resid: ``[layer, pos, d_model]`` residual stream.
        unembed: the final norm and unembedding.
        k: how many tokens to keep per (layer, pos).
        chunk: positions per chunk (memory knob only; the result does not depend on it).

    Returns:
        ``(top_ids, top_probs)``: ``[layer, pos, k]`` long ids and their float32 softmax
        probabilities, most likely first.

    Example::

        ids, probs = lens_topk(run.resid[0], unembed, k=3)
    """
    _check_resid(resid, unembed, "lens_topk")
    k = _check_positive_int(k, "k")
    chunk = _check_positive_int(chunk, "chunk")
    if k > unembed.d_vocab:
        raise ValueError(
            f"lens_topk(k={k}) is larger than the vocabulary (d_vocab={unembed.d_vocab}); pass "
            f"k <= {unembed.d_vocab}."
        ) from None
    u = _to_f32(unembed, resid.device)
    ids, probs = [], []
    for s in range(0, resid.shape[1], chunk):
        logits = _project(resid[:, s : s + chunk], u)  # [layer, c, d_vocab]
        top_logits, top_ids = logits.topk(k, dim=-1)
        probs.append((top_logits - logits.logsumexp(-1, keepdim=True)).exp())
        ids.append(top_ids)
    if not ids:  # zero positions
        shape = (resid.shape[0], 0, k)
        return (
            torch.empty(shape, dtype=torch.long, device=resid.device),
            torch.empty(shape, dtype=torch.float32, device=resid.device),
        )
    return torch.cat(ids, dim=1), torch.cat(probs, dim=1)


def lens_prob_of(resid: Tensor, unembed: Unembed, token_ids: int | list[int], chunk: int = 64) -> Tensor:
    """Return the logit-lens probability of given token(s) at each (layer, pos).

    Args:
        resid: ``[layer, pos, d_model]`` residual stream.
        unembed: the final norm and unembedding.
        token_ids: one id, or a list of n ids.
        chunk: positions per chunk (memory knob only).

    Returns:
        ``[layer, pos]`` float32 for one id, ``[layer, pos, n]`` for a list.

    Example::

        p = lens_prob_of(run.resid[0], unembed, tok.encode(" Paris")[0])   # [layer, pos]
    """
    _check_resid(resid, unembed, "lens_prob_of")
    chunk = _check_positive_int(chunk, "chunk")
    single = not isinstance(token_ids, (list, tuple))
    ids = [token_ids] if single else list(token_ids)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < unembed.d_vocab:
            raise ValueError(
                f"lens_prob_of(token_ids={token_ids!r}): {t!r} is not a token id in 0-"
                f"{unembed.d_vocab - 1}; pass int ids (tokenizer.encode(text, add_special_tokens=False))."
            ) from None
    index = torch.tensor(ids, dtype=torch.long, device=resid.device)
    u = _to_f32(unembed, resid.device)
    out = [
        _project(resid[:, s : s + chunk], u).log_softmax(-1).index_select(-1, index).exp()
        for s in range(0, resid.shape[1], chunk)
    ]
    probs = (
        torch.cat(out, dim=1)
        if out
        else torch.empty((resid.shape[0], 0, len(ids)), dtype=torch.float32, device=resid.device)
    )
    return probs[..., 0] if single else probs


@dataclass(repr=False)
class Lens:
    """A logit lens over one request: the top-k tokens at every captured (layer, pos).

    Attributes:
        top_ids: ``[layer, pos, k]`` token ids, most likely first.
        top_probs: ``[layer, pos, k]`` their probabilities.
        layers: block index of each entry of the ``layer`` axis.
        labels: the token text at each position (the input there, not the prediction).
        prompt_len: positions ``p >= prompt_len`` hold generated tokens.
        resid: ``[layer, pos, d_model]`` the residual stream, kept so :meth:`prob_of` works.
        unembed: the final norm and unembedding used.
        tokenizer: an HF tokenizer for decoding and :meth:`prob_of` strings, or None.
        generated: the generated token ids.
        roles: each position's label (:attr:`nnvllm.Run.roles`: system, user, assistant, template),
            or None.
        positions: each position's index in the request (after :meth:`select`), or None for
            ``0..pos-1``.

    Example::

        lens = Lens.from_run(run, 0, unembed, tokenizer=tok)
        lens.top_tokens(-1)      # the last block's top-1 token at each position
        lens.plot()
    """

    top_ids: Tensor
    top_probs: Tensor
    layers: list[int]
    labels: list[str]
    prompt_len: int
    resid: Tensor
    unembed: Unembed
    tokenizer: Any = None
    generated: list[int] = field(default_factory=list)
    roles: list[str] | None = None
    positions: list[int] | None = None

    def __post_init__(self) -> None:
        if self.top_ids.ndim != 3 or self.top_ids.shape != self.top_probs.shape:
            raise ValueError(
                f"Lens.top_ids and top_probs must both be [layer, pos, k], got "
                f"{tuple(self.top_ids.shape)} and {tuple(self.top_probs.shape)}; build them with lens_topk."
            ) from None
        n_layer, n_pos, _ = self.top_ids.shape
        if len(self.layers) != n_layer or len(self.labels) != n_pos:
            raise ValueError(
                f"Lens has top_ids of shape [layer={n_layer}, pos={n_pos}, k] but {len(self.layers)} "
                f"layers and {len(self.labels)} labels; pass one block index per layer and one label "
                "per position."
            ) from None
        for name in ("roles", "positions"):
            v = getattr(self, name)
            if v is not None and len(v) != n_pos:
                raise ValueError(f"Lens has {n_pos} positions but {len(v)} {name}; pass one per position or None.")

    @classmethod
    def from_run(
        cls, run, i: int, unembed: Unembed, *, k: int = 5, tokenizer: Any = None, chunk: int = 64
    ) -> Lens:
        """Build the lens of request ``i`` of a :class:`~nnvllm.results.Run` captured with resid.

        Args:
            run: a Run whose ``resid`` was captured.
            i: the request index.
            unembed: the model's final norm and unembedding.
            k: top tokens kept per (layer, pos).
            tokenizer: optional HF tokenizer, used for labels and string lookups.
            chunk: positions per chunk (memory knob only).

        Returns:
            The :class:`Lens`.
        """
        if run.resid is None:
            raise ValueError(
                "Lens.from_run needs a run with resid captured, got run.resid=None; generate again "
                "with the residual stream captured."
            ) from None
        if not -len(run) <= i < len(run):
            raise ValueError(
                f"request i={i} out of range for a run of {len(run)} requests (0-{len(run) - 1})."
            ) from None
        i = i % len(run)
        resid = run.resid[i]
        seq = run.sequence(i)[: resid.shape[1]]
        top_ids, top_probs = lens_topk(resid, unembed, k=k, chunk=chunk)
        return cls(
            top_ids=top_ids,
            top_probs=top_probs,
            layers=list(run.layers),
            labels=[_decode(tokenizer, t) for t in seq],
            prompt_len=len(run.prompt_ids[i]),
            resid=resid,
            unembed=unembed,
            tokenizer=tokenizer,
            generated=list(run.tokens[i]),
            roles=list(run.roles[i][: resid.shape[1]]) if i < len(run.roles) else None,
        )

    def __repr__(self) -> str:
        n_layer, n_pos, k = self.top_ids.shape
        return (
            f"Lens(layers={n_layer}, pos={n_pos} (prompt {self.prompt_len}), k={k}, "
            f"d_vocab={self.unembed.d_vocab})"
        )

    def select(self, positions) -> Lens:
        """Return the lens over some positions only, e.g. ``lens.select("content")`` without the chat
        template's tokens.

        Args:
            positions: ``"content"`` (every position not labelled ``"template"``), a role (``"user"``,
                ``"system"``, ``"assistant"``, ``"template"``), a list of roles, or a list of
                position indices.

        Returns:
            A :class:`Lens` whose :attr:`positions` say where each kept position was.
        """
        from .chat import select_positions

        n = self.top_ids.shape[1]
        if isinstance(positions, str) or (isinstance(positions, (list, tuple)) and positions
                                          and all(isinstance(r, str) for r in positions)):
            if self.roles is None:
                raise ValueError(f"Lens.select({positions!r}) selects by role, and this lens has no roles; "
                                 "pass position indices")
            idx = select_positions(self.roles, positions) or list(range(n))
        elif isinstance(positions, (list, tuple, range)) and all(
                isinstance(p, int) and not isinstance(p, bool) and -n <= p < n for p in positions):
            idx = [p % n for p in positions]
        else:
            raise ValueError(f"Lens.select({positions!r}): expected 'content', a role, a list of roles or a list "
                             f"of position indices in 0..{n - 1}")
        where = self.positions or list(range(n))
        t = torch.as_tensor(idx, dtype=torch.long)
        return Lens(top_ids=self.top_ids[:, t], top_probs=self.top_probs[:, t], layers=list(self.layers),
                    labels=[self.labels[p] for p in idx], prompt_len=sum(p < self.prompt_len for p in idx),
                    resid=self.resid[:, t.to(self.resid.device)], unembed=self.unembed, tokenizer=self.tokenizer,
                    generated=list(self.generated),
                    roles=None if self.roles is None else [self.roles[p] for p in idx],
                    positions=[where[p] for p in idx])

    def prob_of(self, token: int | str) -> Tensor:
        """Return the lens probability of one token at every (layer, pos).

        Args:
            token: a token id, or a string that the tokenizer encodes to exactly one token.

        Returns:
            ``[layer, pos]`` float32.
        """
        if isinstance(token, str):
            if self.tokenizer is None:
                raise ValueError(
                    f"Lens.prob_of({token!r}) needs a tokenizer to encode a string, and this lens has "
                    "none; pass a token id or build the lens with tokenizer=."
                ) from None
            ids = list(self.tokenizer.encode(token, add_special_tokens=False))
            if len(ids) != 1:
                pieces = [_decode(self.tokenizer, t) for t in ids]
                raise ValueError(
                    f"Lens.prob_of({token!r}): the string encodes to {len(ids)} tokens {pieces} "
                    f"(ids {ids}), expected exactly one; pass one of these ids or a single-token "
                    "string (mind the leading space)."
                ) from None
            token = ids[0]
        elif isinstance(token, bool) or not isinstance(token, int):
            raise TypeError(
                f"Lens.prob_of takes a token id (int) or a one-token string, got "
                f"{type(token).__name__}; pass int(token) or the text."
            ) from None
        return lens_prob_of(self.resid, self.unembed, token)

    def top_tokens(self, layer_index: int) -> list[str]:
        """Return the top-1 token at each position for one entry of the ``layer`` axis.

        Args:
            layer_index: index into :attr:`layers` (so ``-1`` is the last captured block), not a
                block number.

        Returns:
            The decoded top-1 token per position (token ids as strings without a tokenizer).
        """
        n = len(self.layers)
        if isinstance(layer_index, bool) or not isinstance(layer_index, int) or not -n <= layer_index < n:
            raise ValueError(
                f"layer_index={layer_index!r} out of range for a lens of {n} layers (0-{n - 1}, or "
                f"negative); it indexes Lens.layers={self.layers}, not block numbers."
            ) from None
        return [_decode(self.tokenizer, int(t)) for t in self.top_ids[layer_index, :, 0]]

    def plot(self, ax=None, **kw):
        """Draw the lens as a layer × position heatmap; see :func:`nnvllm.plotting.plot_lens`."""
        from .plotting import plot_lens

        return plot_lens(self, ax=ax, **kw)

    def to_frame(self):
        """Return one row per (layer, pos, rank).

        Columns: ``layer`` (block index), ``pos``, ``label`` (token at pos), ``rank`` (0 = top),
        ``token_id``, ``token`` (decoded, or the id as text), ``prob``; and ``role`` (the position's
        label, :attr:`roles`) when the lens has roles.
        """
        import numpy as np
        import pandas as pd

        n_layer, n_pos, k = self.top_ids.shape
        ids = self.top_ids.cpu().reshape(-1).numpy()
        vocab = {int(t): _decode(self.tokenizer, int(t)) for t in np.unique(ids)}
        pos = np.asarray(self.positions if self.positions is not None else range(n_pos), dtype=np.int64)
        frame = pd.DataFrame(
            {
                "layer": np.repeat(np.asarray(self.layers, dtype=np.int64), n_pos * k),
                "pos": np.tile(np.repeat(pos, k), n_layer),
                "label": np.tile(np.repeat(np.asarray(self.labels, dtype=object), k), n_layer),
                "rank": np.tile(np.arange(k), n_layer * n_pos),
                "token_id": ids,
                "token": [vocab[int(t)] for t in ids],
                "prob": self.top_probs.detach().float().cpu().reshape(-1).numpy(),
            }
        )
        if self.roles is not None:
            frame.insert(3, "role", np.tile(np.repeat(np.asarray(self.roles, dtype=object), k), n_layer))
        return frame


# --- helpers -----------------------------------------------------------------------------------


def _decode(tokenizer: Any, token_id: int) -> str:
    return str(token_id) if tokenizer is None else tokenizer.decode([int(token_id)])


def _describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def _check_width(x: Tensor, d_model: int, fn: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{fn} takes a tensor [..., d_model], got {type(x).__name__}.") from None
    if x.ndim == 0 or x.shape[-1] != d_model:
        raise ValueError(
            f"{fn} got a tensor of shape {tuple(x.shape)} but the model has d_model={d_model}; the "
            "last axis must be d_model (pass the residual stream, not logits)."
        ) from None


def _check_resid(resid: Tensor, unembed: Unembed, fn: str) -> None:
    _check_width(resid, unembed.d_model, fn)
    if resid.ndim != 3:
        raise ValueError(
            f"{fn} takes resid of shape [layer, pos, d_model], got {tuple(resid.shape)}; for one "
            "layer pass resid[None] (or resid.unsqueeze(0))."
        ) from None


def _check_positive_int(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}={v!r} must be a positive int; pass e.g. {name}=5.") from None
    return v


def _to_f32(u: Unembed, device: torch.device) -> Unembed:
    """Cast once per call, not once per chunk (a bf16 LM head is the big tensor here)."""

    def cast(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.to(device=device, dtype=torch.float32)

    n = u.norm
    return Unembed(Norm(n.kind, cast(n.weight), cast(n.bias), n.eps), cast(u.weight), cast(u.bias),
                   u.soft_cap, u.scale)


def _project(resid: Tensor, u: Unembed) -> Tensor:
    logits = apply_norm(resid, u.norm) @ u.weight.T
    if u.bias is not None:
        logits = logits + u.bias
    if u.soft_cap is not None:  # the order of vLLM's LogitsProcessor: soft-cap, then scale
        logits = torch.tanh(logits / u.soft_cap) * u.soft_cap
    if u.scale != 1.0:
        logits = logits * u.scale
    return logits
