"""Activation patching: plans (which layers × positions), metrics, and the result container.

The recipe (as in TransformerLens's ``patching``): run a *clean* prompt and a *corrupt* prompt
that differ in one fact; then re-run the corrupt prompt with one activation (layer, pos) taken
from the clean run. The logit difference ``logit[answer] - logit[wrong]`` moves from its corrupt
value toward its clean value by the fraction that activation carries::

    effect = (patched - corrupt) / (clean - corrupt)     # 1 = fully restored, 0 = no effect

This module is pure: running the patched forward passes lives with the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = ["PatchResult", "logit_diff", "normalized_effect", "plan"]


def logit_diff(logits: Tensor, answer: int, wrong: int) -> Tensor:
    """Return ``logits[..., answer] - logits[..., wrong]``.

    Args:
        logits: ``[..., d_vocab]`` logits.
        answer: the id of the correct answer token.
        wrong: the id of the competing token.

    Returns:
        ``[...]`` the difference (``logits``' dtype).

    Example::

        logit_diff(run.logits[0][0], tok.encode(" Paris")[0], tok.encode(" Rome")[0])
    """
    if not isinstance(logits, Tensor) or logits.ndim == 0:
        raise TypeError(
            f"logit_diff takes logits [..., d_vocab] as a tensor, got {_describe(logits)}."
        ) from None
    d_vocab = logits.shape[-1]
    for name, t in (("answer", answer), ("wrong", wrong)):
        if isinstance(t, bool) or not isinstance(t, int) or not -d_vocab <= t < d_vocab:
            raise ValueError(
                f"logit_diff({name}={t!r}) is not a token id for logits with d_vocab={d_vocab} "
                f"(0-{d_vocab - 1}); pass an int id (tokenizer.encode(text, add_special_tokens=False)[0])."
            ) from None
    return logits[..., answer] - logits[..., wrong]


def normalized_effect(patched: Tensor | float, clean: Tensor | float, corrupt: Tensor | float) -> Tensor:
    """Return how far patching moved a metric from its corrupt toward its clean value.

    ``(patched - corrupt) / (clean - corrupt)``: 1 where the patch fully restores the clean
    behaviour, 0 where it changes nothing (negative or above 1 is possible).

    Args:
        patched: ``[...]`` the metric (e.g. logit difference) under each patch.
        clean: the metric on the clean prompt (scalar or broadcastable to ``patched``).
        corrupt: the metric on the corrupt prompt (likewise).

    Returns:
        A tensor with ``patched``'s shape.

    Example::

        normalized_effect(torch.tensor([2.0, 0.5]), clean=2.0, corrupt=0.0)   # tensor([1.0, 0.25])
    """
    patched_t = torch.as_tensor(patched)
    if not patched_t.is_floating_point():
        patched_t = patched_t.float()
    clean_t = torch.as_tensor(clean, dtype=patched_t.dtype, device=patched_t.device)
    corrupt_t = torch.as_tensor(corrupt, dtype=patched_t.dtype, device=patched_t.device)
    gap = clean_t - corrupt_t
    if bool((gap.abs() < 1e-6).any()):
        raise ValueError(
            f"clean and corrupt give the same logit difference (clean={_short(clean_t)}, "
            f"corrupt={_short(corrupt_t)}), so there is nothing for a patch to restore; choose "
            "prompts/answers that differ (the clean prompt should favour `answer`, the corrupt one "
            "`wrong`)."
        ) from None
    return (patched_t - corrupt_t) / gap


@dataclass(repr=False)
class PatchResult:
    """The outcome of a patching sweep over layers × positions.

    Attributes:
        effect: ``[layer, pos]`` normalized effect (1 = clean restored, 0 = no change).
        patched_diff: ``[layer, pos]`` raw logit differences under each patch.
        clean_diff: the clean prompt's logit difference.
        corrupt_diff: the corrupt prompt's logit difference.
        layers: block index of each row.
        positions: prompt position of each column.
        labels: the clean prompt's token at each patched position.
        site: what was patched (``"resid"``, ``"attn"``, ``"mlp"``, ...).
        answer: the correct answer token's text.
        wrong: the competing token's text.
        step: the generation step whose logits were measured (0 = the first generated token).
        roles: the clean prompt's label at each patched position (:attr:`nnvllm.Run.roles`: system,
            user, assistant, template), or None.

    Example::

        res.best()     # (layer, pos, effect) of the strongest restoring patch
        res.plot()
    """

    effect: Tensor
    patched_diff: Tensor
    clean_diff: float
    corrupt_diff: float
    layers: list[int]
    positions: list[int]
    labels: list[str]
    site: str
    answer: str
    wrong: str
    step: int = 0
    roles: list[str] | None = None

    def __post_init__(self) -> None:
        shape = (len(self.layers), len(self.positions))
        for name in ("effect", "patched_diff"):
            t = getattr(self, name)
            if not isinstance(t, Tensor) or tuple(t.shape) != shape:
                raise ValueError(
                    f"PatchResult.{name} must be [layer, pos] = {shape} for {len(self.layers)} layers and "
                    f"{len(self.positions)} positions, got {_describe(t)}."
                ) from None
        if len(self.labels) != len(self.positions):
            raise ValueError(
                f"PatchResult has {len(self.positions)} positions but {len(self.labels)} labels; pass "
                "the clean prompt's token at each patched position."
            ) from None
        if self.roles is not None and len(self.roles) != len(self.positions):
            raise ValueError(f"PatchResult has {len(self.positions)} positions but {len(self.roles)} roles; pass "
                             "the clean prompt's label at each patched position, or None.") from None

    def __repr__(self) -> str:
        layer, pos, eff = self.best()
        return (
            f"PatchResult(site={self.site!r}, {self.answer!r} vs {self.wrong!r}, "
            f"layers={len(self.layers)}, positions={len(self.positions)}, clean_diff={self.clean_diff:.3g}, "
            f"corrupt_diff={self.corrupt_diff:.3g}, best=(layer {layer}, pos {pos}, {eff:.3g}))"
        )

    def to_frame(self):
        """Return one row per (layer, pos): ``layer, pos, label, effect, logit_diff`` (and ``role``,
        the position's label, when the result has :attr:`roles`)."""
        import numpy as np
        import pandas as pd

        n_layer, n_pos = len(self.layers), len(self.positions)
        frame = pd.DataFrame(
            {
                "layer": np.repeat(np.asarray(self.layers, dtype=np.int64), n_pos),
                "pos": np.tile(np.asarray(self.positions, dtype=np.int64), n_layer),
                "label": np.tile(np.asarray(self.labels, dtype=object), n_layer),
                "effect": self.effect.detach().double().cpu().reshape(-1).numpy(),
                "logit_diff": self.patched_diff.detach().double().cpu().reshape(-1).numpy(),
            }
        )
        if self.roles is not None:
            frame.insert(3, "role", np.tile(np.asarray(self.roles, dtype=object), n_layer))
        return frame

    def plot(self, ax=None, vmin: float | None = None, vmax: float | None = None, *, positions="all"):
        """Draw the effect as a layer × position heatmap; see :func:`nnvllm.plotting.plot_patch`
        (``positions="content"`` leaves a conversation's template positions out)."""
        from .plotting import plot_patch

        return plot_patch(self, ax=ax, vmin=vmin, vmax=vmax, positions=positions)

    def best(self) -> tuple[int, int, float]:
        """Return ``(layer, pos, effect)`` of the patch with the largest effect (block index, position)."""
        if self.effect.numel() == 0:
            raise ValueError("PatchResult.best() has no patches to choose from (0 layers or positions).")
        flat = int(torch.nan_to_num(self.effect.double(), nan=-float("inf")).argmax())
        j, p = divmod(flat, len(self.positions))
        return self.layers[j], self.positions[p], float(self.effect[j, p])


def plan(
    n_layers: int,
    prompt_len: int,
    layers: str | int | list[int] = "all",
    positions: str | int | list[int] = "all",
) -> tuple[list[int], list[int]]:
    """Resolve which layers and positions a patching sweep visits.

    Negative indices count from the end, as in Python; duplicates (``[-1, 11]`` on 12 layers)
    are kept once, in first-seen order.

    Args:
        n_layers: blocks in the model.
        prompt_len: tokens in the (clean) prompt.
        layers: ``"all"``, one index, or a list of indices.
        positions: ``"all"``, one index, or a list of indices.

    Returns:
        ``(layers, positions)`` as lists of non-negative ints.

    Example::

        plan(12, 7, layers=[0, -1], positions=-1)   # ([0, 11], [6])
    """
    for name, v in (("n_layers", n_layers), ("prompt_len", prompt_len)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"plan({name}={v!r}) must be a positive int.") from None
    return (
        _resolve(layers, n_layers, "layer", f"a {n_layers}-layer model"),
        _resolve(positions, prompt_len, "pos", f"a {prompt_len}-token prompt"),
    )


def _resolve(spec: Any, n: int, what: str, where: str) -> list[int]:
    arg = "layers" if what == "layer" else "positions"
    if isinstance(spec, str):
        if spec != "all":
            raise ValueError(
                f"{arg}={spec!r} is not understood; pass 'all', an int or a list of ints."
            ) from None
        return list(range(n))
    items = [spec] if isinstance(spec, int) else spec
    if isinstance(spec, bool) or not isinstance(items, (list, tuple, range)):
        raise TypeError(
            f"{arg}={spec!r} ({type(spec).__name__}) is not understood; pass 'all', an int or a list of ints."
        ) from None
    if len(items) == 0:
        raise ValueError(f"{arg}=[] selects nothing; pass 'all', an int or a non-empty list.") from None
    out: list[int] = []
    for v in items:
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{arg} must hold ints, got {v!r} ({type(v).__name__}) in {spec!r}.") from None
        if not -n <= v < n:
            raise ValueError(
                f"{what}={v} out of range for {where} (0-{n - 1}); negative indices count from the end."
            ) from None
        v %= n
        if v not in out:
            out.append(v)
    return out


def _describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    return type(x).__name__


def _short(t: Tensor) -> str:
    return f"{t.item():.6g}" if t.numel() == 1 else f"tensor of shape {tuple(t.shape)}"
