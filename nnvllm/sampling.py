"""The sampling distribution vLLM draws from, recomputed from pre-sampling logits (pure torch).

vLLM's sampler divides the logits by the temperature, then applies top-k and top-p by sorting
ascending and masking the tokens whose cumulative probability stays within ``1 - top_p`` (the most
likely token always survives). :func:`sampling_probs` repeats exactly that, so the probability it
gives a sampled token is the one the engine used. Greedy decoding (``temperature == 0``) has no
distribution; its probabilities are the plain softmax of the logits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .results import Samples

__all__ = ["sampling_probs", "sample_stats", "chosen_logprobs"]


def sampling_probs(logits: Tensor, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> Tensor:
    """Return ``[step, d_vocab]`` probabilities of the distribution vLLM samples from.

    Args:
        logits: ``[step, d_vocab]`` pre-sampling logits.
        temperature: 0 means greedy (plain softmax is returned).
        top_p: nucleus mass in (0, 1].
        top_k: vLLM's own top-k truncation (0 or -1: off). Not the number of alternatives reported.
    """
    x = logits.float()
    if temperature and temperature > 0:
        x = x / temperature
    else:
        return x.softmax(-1)
    if top_k and 0 < top_k < x.shape[-1]:
        kth = x.topk(top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        srt, idx = x.sort(dim=-1, descending=False)
        cum = srt.softmax(-1).cumsum(-1)
        mask = cum <= 1 - top_p
        mask[..., -1] = False
        srt = srt.masked_fill(mask, float("-inf"))
        x = torch.empty_like(x).scatter_(-1, idx, srt)
    return x.softmax(-1)


def sample_stats(
    logits: Tensor, tokens: list[int] | Tensor, *, temperature: float, top_p: float, top_k: int = 0, k: int = 5
) -> Samples:
    """Return :class:`~nnvllm.results.Samples` for the drawn ``tokens`` given each step's logits."""
    ids = torch.as_tensor(list(tokens), dtype=torch.long)
    n = min(len(ids), logits.shape[0])
    ids = ids[:n]
    probs = sampling_probs(logits[:n], temperature, top_p, top_k)
    k = min(k, probs.shape[-1])
    top = probs.topk(k, dim=-1)
    return Samples(
        ids=ids,
        probs=probs.gather(-1, ids[:, None])[:, 0] if n else torch.zeros(0),
        top_ids=top.indices,
        top_probs=top.values,
        logprobs=chosen_logprobs(logits[:n], ids) if n else torch.zeros(0),
    )


def chosen_logprobs(logits: Tensor, ids: Tensor) -> Tensor:
    """``[step]`` the log-probability of ``ids[t]`` under ``log_softmax(logits[t])`` (the model's own)."""
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, None].to(logits.device).long())[:, 0]
