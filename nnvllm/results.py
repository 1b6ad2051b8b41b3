"""Plain result containers: CPU tensors in dataclasses, with tidy tables and save/load.

Dimension names used everywhere: ``request, layer, pos, step, d_model, d_vocab, k``.
A request's positions are its prompt tokens followed by each generated token that was fed back,
so ``pos`` runs over ``prompt_len + steps - 1`` entries (the last sampled token is never fed).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["Samples", "Run"]


@dataclass
class Samples:
    """What the sampler drew for one request, one row per generated step.

    Attributes:
        ids: ``[step]`` the sampled token ids.
        probs: ``[step]`` each sampled id's probability under the distribution actually sampled
            from (temperature and top-p applied; greedy gives the plain softmax).
        top_ids: ``[step, k]`` the k most likely ids under that distribution.
        top_probs: ``[step, k]`` their probabilities.
    """

    ids: Tensor
    probs: Tensor
    top_ids: Tensor
    top_probs: Tensor

    def __len__(self) -> int:
        return int(self.ids.shape[0])


@dataclass
class Run:
    """Everything captured from one generation over several prompts (index ``i`` = request).

    Attributes:
        prompts: the prompt strings.
        prompt_ids: ``prompts[i]`` as token ids.
        tokens: generated ids of request i (``list[int]``).
        text: the generated text of request i.
        logits: per request ``[step, d_vocab]`` pre-sampling logits, or None if not captured.
        samples: per request :class:`Samples`.
        resid: per request ``[layer, pos, d_model]`` residual stream after each captured block, or
            None. ``resid[i][j, p]`` is block ``layers[j]``'s output at position ``p``.
        sites: extra sites by name (``"attn"``, ``"mlp"``, ``"mlp_in"``, ``"mlp_act"``), each a list
            of per-request ``[layer, pos, width]`` tensors.
        layers: the block indices captured (the ``layer`` axis).
        sampling: the sampling settings used (temperature, top_p, seed, max_tokens, top_k).
        meta: where it came from (``engine``: "vllm" or "transformers", ``model``, ``dtype``, ``tp``).
    """

    prompts: list[str]
    prompt_ids: list[list[int]]
    tokens: list[list[int]]
    text: list[str]
    logits: list[Tensor] | None
    samples: list[Samples]
    resid: list[Tensor] | None
    layers: list[int]
    sites: dict[str, list[Tensor]] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    meta: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.prompts)

    def positions(self, i: int) -> int:
        """Number of positions captured for request i: ``prompt_len + steps - 1``."""
        return len(self.prompt_ids[i]) + len(self.tokens[i]) - 1

    def sequence(self, i: int) -> list[int]:
        """Token ids at request i's captured positions (prompt, then the fed-back generated ids)."""
        return list(self.prompt_ids[i]) + list(self.tokens[i][:-1])

    def to_frame(self):
        """Return one row per (request, step): the sampled token, its probability and rank-1 alternative.

        Columns: ``request, step, token_id, prob, top1_id, top1_prob`` (+ ``logit`` when captured).
        """
        import pandas as pd

        rows = []
        for i, s in enumerate(self.samples):
            for t in range(len(s)):
                row = {
                    "request": i,
                    "step": t,
                    "token_id": int(s.ids[t]),
                    "prob": float(s.probs[t]),
                    "top1_id": int(s.top_ids[t, 0]),
                    "top1_prob": float(s.top_probs[t, 0]),
                }
                if self.logits is not None:
                    row["logit"] = float(self.logits[i][t, s.ids[t]])
                rows.append(row)
        return pd.DataFrame(rows)

    def save(self, path: str | Path) -> None:
        """Write the run to ``path`` (a torch file; tensors stay tensors)."""
        d = asdict(self)
        torch.save(d, Path(path))

    @classmethod
    def load(cls, path: str | Path) -> "Run":
        """Read a run written by :meth:`save`."""
        d = torch.load(Path(path), weights_only=False)
        d["samples"] = [Samples(**s) for s in d["samples"]]
        return cls(**d)
