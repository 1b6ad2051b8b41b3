"""Discrepancies between two runs of the same prompts: vLLM vs transformers, TP=1 vs TP=2, bf16 vs fp32.

Two runs are compared only where they saw the same input. Once the generated tokens differ
(the *fork*), later positions hold different tokens and any difference there is expected, so:

- activations are compared at positions ``p`` where both runs' token sequences agree on every
  position up to and including ``p`` (``prompt_len + fork`` positions when the tokens fork);
- logits are compared for steps up to and including the fork step (its logits still come from
  identical inputs; they are what made the sampled tokens differ).

Example::

    d = compare(hf_run, vllm_run, names=("hf", "vllm"))   # the reference first
    d.summary()            # worst max_abs, min cosine, max KL, agreement, forks
    d.per_layer("rel_err") # where the error grows
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from .results import Run

__all__ = ["Discrepancy", "compare"]

_ACT_COLUMNS = ["request", "layer", "pos", "max_abs", "rel_err", "cosine", "site"]
_LOGIT_COLUMNS = ["request", "step", "kl", "top1_agree", "max_abs"]
_METRICS = ("max_abs", "rel_err", "cosine")
_EMPTY_DTYPES = {
    "request": "int64",
    "layer": "int64",
    "pos": "int64",
    "step": "int64",
    "top1_agree": "bool",
    "site": "object",
}


@dataclass(repr=False)
class Discrepancy:
    """How two runs differ, as tidy tables.

    Attributes:
        resid: one row per (request, layer, pos, site) compared; columns ``request, layer, pos,
            max_abs, rel_err, cosine, site``. ``layer`` is the block index; ``site`` is
            ``"resid"`` or an extra site both runs captured. ``max_abs = max|a - b|``,
            ``rel_err = ||a - b||₂ / ||a||₂``, ``cosine`` = cosine similarity (float64).
        logits: one row per (request, step) compared; columns ``request, step, kl, top1_agree,
            max_abs`` with ``kl = KL(softmax(a) || softmax(b))`` in float64.
        fork: per request, the first generated step whose tokens differ, or None.
        token_agreement: fraction of generated tokens equal over each request's common length.
        names: what to call the two runs.
    """

    resid: pd.DataFrame
    logits: pd.DataFrame
    fork: list[int | None]
    token_agreement: float
    names: tuple[str, str] = ("a", "b")

    def __repr__(self) -> str:
        s = self.summary()
        return (
            f"Discrepancy({self.names[0]} vs {self.names[1]}: max_abs={s['max_abs']:.3g}, "
            f"min_cosine={s['min_cosine']:.6g}, max_kl={s['max_kl']:.3g}, "
            f"top1_agreement={s['top1_agreement']:.3g}, token_agreement={s['token_agreement']:.3g}, "
            f"forks={s['forks']})"
        )

    def per_layer(self, metric: str = "max_abs", site: str = "resid") -> pd.Series:
        """Return the worst value of one metric per layer, over requests and positions.

        Worst is the maximum for ``max_abs`` and ``rel_err`` and the minimum for ``cosine``.

        Args:
            metric: ``"max_abs"``, ``"rel_err"`` or ``"cosine"``.
            site: which site's rows (``"resid"`` unless both runs captured others).

        Returns:
            A Series indexed by block index (``layer``), named after the metric.
        """
        if metric not in _METRICS:
            raise ValueError(
                f"metric={metric!r} is not one of {_METRICS}; pass e.g. metric='rel_err'."
            ) from None
        have = sorted(set(self.resid["site"]))
        if have and site not in have:
            raise ValueError(
                f"site={site!r} was not compared; the compared sites are {have}. Pass one of those."
            ) from None
        rows = self.resid[self.resid["site"] == site]
        g = rows.groupby("layer")[metric]
        out = g.min() if metric == "cosine" else g.max()
        out.name = metric
        return out

    def summary(self) -> dict:
        """Return the headline numbers as a dict.

        Keys: ``max_abs``, ``max_rel_err``, ``min_cosine`` (over the ``resid`` rows; NaN if no
        residual stream was compared), ``max_kl``, ``top1_agreement`` (fraction of compared steps
        whose argmax agrees; NaN without logits), ``token_agreement``, ``forks`` (per request,
        the fork step or None), ``names``.
        """
        r = self.resid[self.resid["site"] == "resid"]
        nan = float("nan")
        return {
            "names": tuple(self.names),
            "max_abs": float(r["max_abs"].max()) if len(r) else nan,
            "max_rel_err": float(r["rel_err"].max()) if len(r) else nan,
            "min_cosine": float(r["cosine"].min()) if len(r) else nan,
            "max_kl": float(self.logits["kl"].max()) if len(self.logits) else nan,
            "top1_agreement": float(self.logits["top1_agree"].mean()) if len(self.logits) else nan,
            "token_agreement": float(self.token_agreement),
            "forks": list(self.fork),
        }

    def plot(self, ax=None):
        """Draw per-layer error lines; see :func:`nnvllm.plotting.plot_compare`."""
        from .plotting import plot_compare

        return plot_compare(self, ax=ax)


def compare(a: Run, b: Run, names: tuple[str, str] = ("a", "b")) -> Discrepancy:
    """Compare two runs of the same prompts, only where both saw the same input.

    Args:
        a: the reference run (``rel_err`` divides by its norm; KL is ``KL(a || b)``).
        b: the run under test.
        names: labels for the two runs in summaries and plots.

    Returns:
        A :class:`Discrepancy`.

    Example::

        d = compare(run_tp1, run_tp2, names=("tp1", "tp2"))
        d.per_layer("max_abs")
    """
    for name, r in (("a", a), ("b", b)):
        if not isinstance(r, Run):
            raise TypeError(
                f"compare({name}=...) takes a nnvllm.results.Run, got {type(r).__name__}; pass what "
                "nnvllm's generate (or reference) returned."
            ) from None
    if not isinstance(names, (tuple, list)) or len(names) != 2:
        raise ValueError(f"names={names!r} must be two labels, e.g. names=('vllm', 'hf').") from None
    if list(a.prompts) != list(b.prompts):
        if len(a.prompts) != len(b.prompts):
            what = f"{len(a.prompts)} prompts vs {len(b.prompts)}"
        else:
            i = next(i for i, (x, y) in enumerate(zip(a.prompts, b.prompts)) if x != y)
            what = f"prompt {i} differs: {a.prompts[i]!r} vs {b.prompts[i]!r}"
        raise ValueError(
            f"compare needs two runs of the same prompts, got {what}; generate both from the same list."
        ) from None
    if list(a.layers) != list(b.layers):
        raise ValueError(
            f"compare needs the same captured layers, got {names[0]}.layers={list(a.layers)} and "
            f"{names[1]}.layers={list(b.layers)}; capture the same layers in both runs."
        ) from None

    forks: list[int | None] = []
    agree = total = 0
    for i in range(len(a)):
        ta, tb = list(a.tokens[i]), list(b.tokens[i])
        n = min(len(ta), len(tb))
        same = [x == y for x, y in zip(ta[:n], tb[:n])]
        forks.append(same.index(False) if not all(same) else None)
        agree += sum(same)
        total += n

    act_frames = []
    sites = []
    if a.resid is not None and b.resid is not None:
        sites.append(("resid", a.resid, b.resid))
    for name in sorted(set(a.sites) & set(b.sites)):
        sites.append((name, a.sites[name], b.sites[name]))
    for i in range(len(a)):
        n_same = _common_prefix(a.sequence(i), b.sequence(i))
        for site, xs, ys in sites:
            x, y = _site_pair(xs, ys, i, site, len(a.layers), names)
            n = min(n_same, x.shape[1], y.shape[1])
            act_frames.append(_act_rows(x[:, :n], y[:, :n], i, list(a.layers), site))

    logit_frames = []
    if a.logits is not None and b.logits is not None:
        for i in range(len(a)):
            la, lb = a.logits[i], b.logits[i]
            if la.shape[-1] != lb.shape[-1]:
                raise ValueError(
                    f"request {i}: {names[0]} has logits over d_vocab={la.shape[-1]} and {names[1]} over "
                    f"{lb.shape[-1]}; compare runs of the same model (slice padded vocab rows off first)."
                ) from None
            n = min(la.shape[0], lb.shape[0])
            if forks[i] is not None:
                n = min(n, forks[i] + 1)
            logit_frames.append(_logit_rows(la[:n], lb[:n], i))

    return Discrepancy(
        resid=_concat(act_frames, _ACT_COLUMNS),
        logits=_concat(logit_frames, _LOGIT_COLUMNS),
        fork=forks,
        token_agreement=agree / total if total else float("nan"),
        names=(str(names[0]), str(names[1])),
    )


# --- helpers -----------------------------------------------------------------------------------


def _common_prefix(x: list[int], y: list[int]) -> int:
    n = 0
    for u, v in zip(x, y):
        if u != v:
            break
        n += 1
    return n


def _site_pair(xs, ys, i: int, site: str, n_layer: int, names) -> tuple[Tensor, Tensor]:
    x, y = xs[i], ys[i]
    for nm, t in ((names[0], x), (names[1], y)):
        if t.ndim != 3 or t.shape[0] != n_layer:
            raise ValueError(
                f"request {i}: {nm}'s {site} has shape {tuple(t.shape)}, expected [layer={n_layer}, pos, "
                "width]; the run is malformed (was it captured with these layers?)."
            ) from None
    if x.shape[-1] != y.shape[-1]:
        raise ValueError(
            f"request {i}: {site} width differs ({names[0]}: {x.shape[-1]}, {names[1]}: {y.shape[-1]}); "
            "compare runs of the same model."
        ) from None
    return x, y


def _act_rows(x: Tensor, y: Tensor, i: int, layers: list[int], site: str) -> pd.DataFrame:
    x, y = x.detach().cpu().double(), y.detach().cpu().double()
    n_layer, n_pos = x.shape[:2]
    d = x - y
    d_norm = d.norm(dim=-1)
    x_norm, y_norm = x.norm(dim=-1), y.norm(dim=-1)
    # Zero vectors: identical ones count as exact agreement rather than 0/0.
    identical = d_norm == 0
    rel = torch.where(
        x_norm > 0, d_norm / x_norm.clamp_min(1e-300), torch.where(identical, 0.0, float("inf"))
    )
    denom = x_norm * y_norm
    cos = torch.where(
        denom > 0,
        (x * y).sum(-1) / denom.clamp_min(1e-300),
        torch.where(identical, 1.0, 0.0),
    )
    return pd.DataFrame(
        {
            "request": np.full(n_layer * n_pos, i, dtype=np.int64),
            "layer": np.repeat(np.asarray(layers, dtype=np.int64), n_pos),
            "pos": np.tile(np.arange(n_pos, dtype=np.int64), n_layer),
            "max_abs": d.abs().amax(-1).reshape(-1).numpy() if d.shape[-1] else np.zeros(n_layer * n_pos),
            "rel_err": rel.reshape(-1).numpy(),
            "cosine": cos.reshape(-1).numpy(),
            "site": site,
        }
    )


def _logit_rows(la: Tensor, lb: Tensor, i: int) -> pd.DataFrame:
    la, lb = la.detach().cpu().double(), lb.detach().cpu().double()
    lpa, lpb = la.log_softmax(-1), lb.log_softmax(-1)
    pa = lpa.exp()
    # 0 * log(0/q) = 0: tokens a rules out (masked to -inf) contribute nothing.
    kl = torch.where(pa > 0, pa * (lpa - lpb), 0.0).sum(-1)
    diff = torch.where(la == lb, 0.0, (la - lb).abs())  # -inf == -inf is agreement, not NaN
    n = la.shape[0]
    return pd.DataFrame(
        {
            "request": np.full(n, i, dtype=np.int64),
            "step": np.arange(n, dtype=np.int64),
            "kl": kl.numpy(),
            "top1_agree": (la.argmax(-1) == lb.argmax(-1)).numpy(),
            "max_abs": diff.amax(-1).numpy() if n else np.zeros(0),
        }
    )


def _concat(frames: list[pd.DataFrame], columns: list[str]) -> pd.DataFrame:
    frames = [f for f in frames if len(f)]
    if not frames:
        return pd.DataFrame({c: pd.Series(dtype=_EMPTY_DTYPES.get(c, "float64")) for c in columns})
    return pd.concat(frames, ignore_index=True)[columns]
