"""Change the model while it generates: steering, ablation, scaling (``nv.generate(..., edits=[...])``).

An :class:`Edit` names a site (``resid``, ``attn``, ``mlp``, ``mlp_in``, ``mlp_act``, or ``z``: the
heads' outputs, with ``heads=`` to edit some of them), the blocks it applies to, which positions (``"all"``, ``"prompt"`` or ``"generated"``: the fed-back tokens) and what
it does to each of those rows:

- ``Edit.add(vector, layers, scale=1.0)``: ``x + scale * vector`` (steering);
- ``Edit.set(value, layers)``: ``x = value`` (a float, e.g. 0 to ablate, or a vector);
- ``Edit.scale(factor, layers)``: ``x * factor``;
- ``Edit.feature(sae, feature, scale)``: ``x + scale * sae.W_dec[feature]`` at the SAE's site and layer;
- ``Edit.clamp(sae, feature, value)``: the SAE's code of ``x`` with that feature set to ``value``,
  decoded, plus the SAE's error (``x + decode(acts') - decode(acts)``: an unchanged clamp changes nothing);
- ``Edit.patch(run, layers)``: another run's value at the same position (patching over a generation).

On the engine the edits run in the same permanent hooks that record activations (worker side, no
per-request Python): every row of the batch that the position rule selects is edited in place, at
every step, before it is recorded, so the :class:`~nnvllm.Run` shows the edited values. On an engine
that replays CUDA graphs, steering (``add`` to ``resid`` at ``"all"`` or ``"generated"`` positions)
runs inside the graphs; any other edit runs the edited generation's steps eagerly (docs/edits.md). :func:`nnvllm.reference`
takes the same edits and makes them with transformers hooks (the tests compare the two).

For the residual stream of a Llama-style block (vLLM returns ``(hidden, residual)``, whose sum is
the stream), ``add`` adds to the stream, ``set`` and ``scale`` make the edited value the whole
stream. An edit applies to every prompt of the call, or to the ones its ``prompts=`` lists.

Heads: ``site="z"`` is every head's output before the attention's output projection (``[heads *
d_head]`` per row, head by head); ``heads=[h, ...]`` limits an edit to those heads' slices, so
``Edit.set(0.0, layers=5, site="z", heads=[3])`` ablates head 5.3 and ``Edit.patch(clean, layers=5,
site="z", heads=[3])`` patches that head from another run (TransformerLens's ``hook_z``). With
``heads``, a vector is ``[d_head]`` and goes into each named head. The other per-head sites (``q``,
``k``, ``v``) are read only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
from torch import Tensor

__all__ = ["Edit"]

_OPS = ("add", "set", "scale", "patch", "clamp")
_HEAD_EDIT_SITES = ("z",)  # per-head sites an edit may write (q, k and v are read only)
_POSITIONS = ("all", "prompt", "generated")
_FULL_WIDTH = ("resid", "attn", "mlp")  # the same on every tensor-parallel rank
# Sites each TP rank holds a slice of that the worker still edits rightly: its heads' columns of z
# (rank r holds heads r * H / tp and up), so it takes its slice of a vector or a patch.
_BY_RANK = ("z",)


@dataclass(frozen=True)
class Edit:
    """One edit; build it with :meth:`add`, :meth:`set`, :meth:`scale`, :meth:`patch`, :meth:`feature` or :meth:`clamp`.

    Attributes:
        op: ``"add"``, ``"set"``, ``"scale"``, ``"patch"`` or ``"clamp"``.
        site: where (``"resid"`` by default).
        layers: block indices (negative counts from the end).
        vector: ``[width]`` for ``add`` and a vector ``set``, else None.
        value: the float of a scalar ``set``, else None.
        factor: ``add``'s scale or ``scale``'s factor (1.0 for ``set``).
        positions: ``"all"``, ``"prompt"``, ``"generated"``, or a tuple of token positions (0: the
            first prompt token; a generated token's position is the prompt length plus its index).
        values: ``[len(layers), pos, width]`` for ``patch``: another run's values, position by position.
        prompts: indices of the prompts of the call it applies to, or None for every prompt.
        heads: for ``site="z"``: the heads it edits (None: every head).
        sae: the :class:`~nnvllm.SAE` of a ``clamp``, else None.
        clamps: ``((feature, value), ...)``: what a ``clamp`` sets, else None.
    """

    op: str
    site: str
    layers: tuple[int, ...]
    vector: Tensor | None = None
    value: float | None = None
    factor: float = 1.0
    positions: str | tuple[int, ...] = "all"
    values: Tensor | None = None  # [layer, pos, width] for "patch": the source run's values
    prompts: tuple[int, ...] | None = None  # the prompts of the call it applies to (None: all)
    sae: Any = None
    clamps: tuple[tuple[int, float], ...] | None = None
    heads: tuple[int, ...] | None = None  # site "z": the heads it edits (None: all)

    @classmethod
    def add(cls, vector, layers, scale: float = 1.0, *, site: str = "resid", positions: str = "all",
            prompts=None, heads=None) -> Edit:
        """Add ``scale * vector`` (``[width]``; ``[d_head]`` into each of ``heads`` at site ``z``) to
        ``site`` at ``layers`` (steering)."""
        return cls._make("add", site, layers, vector=vector, factor=scale, positions=positions, prompts=prompts,
                         heads=heads)

    @classmethod
    def set(cls, value, layers, *, site: str = "resid", positions: str = "all", prompts=None, heads=None) -> Edit:
        """Set ``site`` at ``layers`` to ``value`` (a float, e.g. ``0.0`` to ablate, or a ``[width]`` vector;
        at site ``z`` with ``heads``, ``Edit.set(0.0, 5, site="z", heads=[3])`` zero-ablates head 5.3)."""
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return cls._make("set", site, layers, value=float(value), positions=positions, prompts=prompts, heads=heads)
        return cls._make("set", site, layers, vector=_as_vector(value, "value"), positions=positions, prompts=prompts,
                         heads=heads)

    @classmethod
    def patch(cls, source, layers, *, site: str = "resid", request: int = 0, positions: str = "all",
              prompts=None, heads=None) -> Edit:
        """Replace ``site`` at ``layers`` with another run's values, position by position (activation
        patching over a whole generation): row ``p`` gets ``source``'s value at position ``p`` of
        request ``request``; positions past the source's are left alone.

        Args:
            source: a :class:`~nnvllm.Run` that captured ``site`` at ``layers`` (e.g. the clean run).
            heads: at site ``z``, patch only these heads (per-head activation patching).
        """
        from .results import Run

        if not isinstance(source, Run):
            raise TypeError(f"source must be an nnvllm Run (from nv.generate or nv.reference), got {type(source).__name__}")
        per = source.resid if site == "resid" else source.sites.get(site)
        if per is None:
            raise ValueError(f"the source run did not capture site {site!r}; generate it with sites=[{site!r}]")
        if isinstance(request, bool) or not isinstance(request, int) or not 0 <= request < len(source):
            raise ValueError(f"request={request!r}; the source run has {len(source)} request(s)")
        layers = [layers] if isinstance(layers, int) and not isinstance(layers, bool) else list(layers)
        missing = [j for j in layers if j not in source.layers]
        if missing:
            raise ValueError(f"layers={missing} are not among the layers the source run captured "
                             f"({source.layers}); give block indices it has (0 and up)")
        rows = [source.layers.index(j) for j in layers]
        values = per[request][rows].detach().float().cpu()
        if values.ndim == 4:  # a per-head site [layer, pos, heads, d_head]: the engine's flat row
            values = values.flatten(-2)
        return cls._make("patch", site, layers, positions=positions, values=values, prompts=prompts, heads=heads)

    @classmethod
    def scale(cls, factor: float, layers, *, site: str = "resid", positions: str = "all", prompts=None,
              heads=None) -> Edit:
        """Multiply ``site`` at ``layers`` (at site ``z``: of ``heads``) by ``factor``."""
        return cls._make("scale", site, layers, factor=factor, positions=positions, prompts=prompts, heads=heads)

    @classmethod
    def feature(cls, sae, feature: int, scale: float = 1.0, *, positions: str = "all", prompts=None) -> Edit:
        """Steer by a sparse-autoencoder feature: add ``scale * sae.W_dec[feature]`` (the direction the
        feature writes) to the SAE's site at its layer, as Neuronpedia's and sae-lens's steering do.

        Args:
            sae: an :class:`~nnvllm.SAE` (``nv.SAE.load``); its ``site`` and ``layer`` say where.
            feature: the feature's index, 0 to ``sae.d_sae - 1``.
            scale: how much of the direction to add (negative steers away from the feature).

        Example:
            >>> sae = nv.SAE.load("saes/blocks.3.hook_resid_post")                    # doctest: +SKIP
            >>> nv.generate(model, "I think", edits=[nv.Edit.feature(sae, 1234, 8.0)])  # doctest: +SKIP
        """
        from .sae import SAE

        if not isinstance(sae, SAE):
            raise TypeError(f"sae must be an nv.SAE (nv.SAE.load(path, site=..., layer=...)), got {type(sae).__name__}")
        return cls.add(sae.direction(feature), sae.layer, scale, site=sae.site, positions=positions, prompts=prompts)

    @classmethod
    def clamp(cls, sae, feature, value, *, positions: str = "all", prompts=None) -> Edit:
        """Clamp sparse-autoencoder features: at the SAE's site and layer, encode ``x``, set ``feature``'s
        activation to ``value``, and write back the decode of that code plus the SAE's error term
        ``x - decode(encode(x))``, i.e. ``x + decode(acts') - decode(acts)`` (:meth:`nnvllm.SAE.clamp_delta`).
        The error is kept, so only the feature moves: clamping a feature to the activation it has
        leaves the stream bit for bit (0 on an inactive feature, for instance). ``value=0`` ablates
        the feature; a large value makes it fire everywhere (Neuronpedia's and sae-lens's clamping).

        A clamp runs the edited generation's steps eagerly (it encodes with the SAE in the hook; only
        ``add`` edits to the residual stream replay inside CUDA graphs).

        Args:
            sae: an :class:`~nnvllm.SAE`; its ``site`` and ``layer`` say where.
            feature: a feature id, or a list of them (clamped at once).
            value: the activation to set: a float, or one per feature.

        Example:
            >>> nv.generate(model, "I think", edits=[nv.Edit.clamp(sae, 1234, 0.0)])  # doctest: +SKIP
        """
        from .sae import SAE

        if not isinstance(sae, SAE):
            raise TypeError(f"sae must be an nv.SAE (nv.SAE.load(path, site=..., layer=...)), got {type(sae).__name__}")
        feats = [feature] if isinstance(feature, int) or not isinstance(feature, (list, tuple, range)) else list(feature)
        if not feats or not all(isinstance(f, int) and not isinstance(f, bool) and 0 <= f < sae.d_sae for f in feats) \
                or len(set(feats)) != len(feats):
            raise ValueError(f"feature={feature!r}; expected a feature id in 0..{sae.d_sae - 1}, or a list of "
                             "distinct ones")
        vals = [value] * len(feats) if isinstance(value, (int, float)) else value
        if not isinstance(vals, (list, tuple)) or len(vals) != len(feats) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in vals):
            raise ValueError(f"value={value!r}; expected a finite float, or one per feature ({len(feats)})")
        base = cls._make("clamp", sae.site, sae.layer, positions=positions, prompts=prompts)
        return replace(base, sae=sae, clamps=tuple((int(f), float(v)) for f, v in zip(feats, vals)))

    @classmethod
    def _make(cls, op, site, layers, *, vector=None, value=None, factor=1.0, positions="all", values=None,
              prompts=None, heads=None) -> Edit:
        from .arch import HEAD_SITES, SITES

        if site in HEAD_SITES and site not in _HEAD_EDIT_SITES:
            raise ValueError(f"site={site!r} is read only; edit the heads' outputs with site='z' (and heads=[...])")
        if site not in SITES + _HEAD_EDIT_SITES:
            raise ValueError(f"site={site!r}; expected one of {list(SITES + _HEAD_EDIT_SITES)}")
        if heads is not None:
            if site not in _HEAD_EDIT_SITES:
                raise ValueError(f"heads={heads!r} with site={site!r}: heads are edited at site 'z' (each head's "
                                 "output before the attention's output projection); give site='z'")
            heads = (heads,) if isinstance(heads, int) and not isinstance(heads, bool) else heads
            if not isinstance(heads, (list, tuple, range)) or not heads or not all(
                    isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in heads):
                raise ValueError(f"heads={heads!r}; expected None (every head) or head indices (ints from 0), "
                                 "e.g. heads=[3]")
            heads = tuple(sorted(set(heads)))
        if isinstance(positions, int) and not isinstance(positions, bool):
            positions = (positions,)
        if isinstance(positions, (list, tuple, range)):
            if not positions or not all(isinstance(p, int) and not isinstance(p, bool) and p >= 0 for p in positions):
                raise ValueError(f"positions={positions!r}; expected 'all', 'prompt', 'generated' or token "
                                 "positions (ints from 0: the first prompt token is 0)")
            positions = tuple(sorted(set(positions)))
        elif positions not in _POSITIONS:
            raise ValueError(f"positions={positions!r}; expected one of {list(_POSITIONS)} or a list of "
                             "token positions (ints from 0)")
        if isinstance(layers, bool) or not isinstance(layers, (int, list, tuple, range)):
            raise TypeError(f"layers={layers!r}; expected a block index or a list of them")
        layers = (layers,) if isinstance(layers, int) else tuple(layers)
        if not layers or not all(isinstance(j, int) and not isinstance(j, bool) for j in layers):
            raise ValueError(f"layers={layers!r}; expected one or more block indices (ints)")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not math.isfinite(factor):
            raise ValueError(f"scale/factor={factor!r}; expected a finite number")
        if value is not None and not math.isfinite(value):
            raise ValueError(f"value={value!r}; expected a finite number")
        if vector is not None:
            vector = _as_vector(vector)
            if vector.ndim != 1 or not vector.numel():
                raise ValueError(f"vector has shape {tuple(vector.shape)}; expected [width], e.g. [d_model] for "
                                 "the residual stream (nv.steering_vector makes one)")
            if not torch.isfinite(vector).all():
                raise ValueError("vector holds NaN or inf")
        if prompts is not None:
            prompts = (prompts,) if isinstance(prompts, int) and not isinstance(prompts, bool) else prompts
            if not isinstance(prompts, (list, tuple, range)) or not prompts or not all(
                    isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in prompts):
                raise ValueError(f"prompts={prompts!r}; expected None (every prompt) or indices of the call's "
                                 "prompts (0 and up), e.g. prompts=[0, 2]")
            prompts = tuple(sorted(set(prompts)))
        return cls(op, site, layers, vector, value, float(factor), positions, values, prompts, heads=heads)

    def describe(self) -> dict[str, Any]:
        """What a Run records of this edit (JSON; a vector as its width and norm)."""
        d: dict[str, Any] = {"op": self.op, "site": self.site, "layers": list(self.layers),
                             "positions": self.positions if isinstance(self.positions, str) else list(self.positions)}
        if self.prompts is not None:
            d["prompts"] = list(self.prompts)
        if self.heads is not None:
            d["heads"] = list(self.heads)
        if self.op in ("add", "scale"):
            d["scale" if self.op == "add" else "factor"] = self.factor
        if self.vector is not None:
            d["vector"] = {"width": int(self.vector.numel()), "norm": float(self.vector.norm())}
        if self.value is not None:
            d["value"] = self.value
        if self.values is not None:
            d["values"] = {"positions": int(self.values.shape[1]), "width": int(self.values.shape[2])}
        if self.clamps is not None:
            d["sae"] = {"hook_name": self.sae.hook_name, "architecture": self.sae.architecture, "d_sae": self.sae.d_sae}
            d["clamp"] = [list(fv) for fv in self.clamps]
        return d


def _as_vector(vector, name: str = "vector") -> Tensor:
    """A vector edit's values as a float tensor on the CPU; anything that is not numbers is refused."""
    expected = "expected a [width] tensor (or list) of numbers, e.g. nv.steering_vector(...)"
    if name == "value":
        expected = "expected a float (0.0 ablates) or a [width] tensor (or list) of numbers"
    if isinstance(vector, Tensor):
        if vector.is_complex() or vector.dtype == torch.bool:
            raise TypeError(f"{name} is a {vector.dtype} tensor; {expected}")
        return vector.detach().float().cpu()
    if isinstance(vector, (str, bytes, bool)) or vector is None:
        raise TypeError(f"{name}={vector!r}: {expected}")
    try:
        return torch.as_tensor(vector).detach().float().cpu()
    except (TypeError, ValueError, RuntimeError):
        shown = repr(vector)
        raise TypeError(f"{name}={shown[:60] + '...' if len(shown) > 60 else shown} ({type(vector).__name__}): "
                        f"{expected}") from None


def resolve(edits: Sequence[Edit] | None, arch, n_layers: int, widths: dict[str, int] | None, tp: int = 1,
            n_prompts: int | None = None, n_positions: Sequence[int] | None = None,
            d_head: int | None = None) -> list[Edit]:
    """Check ``edits`` against a model (sites it offers, layers it has, vector widths; ``d_head``: one
    head's width, for edits at site ``z``) and the call (``n_prompts``; ``n_positions``: per prompt, the
    positions its forwards can reach: prompt tokens + max_tokens - 1); negative layers become block
    indices. Raises ValueError / TypeError saying what to fix."""
    if edits is None:
        return []
    if isinstance(edits, Edit):
        edits = [edits]
    if not isinstance(edits, (list, tuple)) or not all(isinstance(e, Edit) for e in edits):
        raise TypeError("edits must be a list of nv.Edit (Edit.add / Edit.set / Edit.scale)")
    out = []
    for e in edits:
        arch.check_sites([e.site])
        if e.site == "z" and e.heads is not None and d_head and (widths or {}).get("z"):
            n_heads = widths["z"] // d_head
            if max(e.heads) >= n_heads:
                raise ValueError(f"heads={list(e.heads)}: the model has {n_heads} heads per block (0..{n_heads - 1})")
        layers = []
        for j in e.layers:
            if not -n_layers <= j < n_layers:
                raise ValueError(f"edit at layer {j}: the model has {n_layers} blocks (0..{n_layers - 1})")
            layers.append(j % n_layers)
        if e.values is not None:
            if tp > 1 and e.site not in _FULL_WIDTH + _BY_RANK:
                raise ValueError(f"patching site {e.site!r} under tensor parallelism (each rank holds a slice of "
                                 f"it) is not supported; use {list(_FULL_WIDTH + _BY_RANK)}")
            want = (widths or {}).get(e.site)
            if want is not None and e.values.shape[-1] != want:
                raise ValueError(f"the source run's {e.site!r} is {e.values.shape[-1]} wide; this model's is {want}")
        if e.sae is not None:
            if tp > 1 and e.site not in _FULL_WIDTH:
                raise ValueError(f"a clamp at site {e.site!r} under tensor parallelism (each rank holds a slice of "
                                 f"it) is not supported; use an SAE on one of {list(_FULL_WIDTH)}")
            if (widths or {}).get(e.site):
                e.sae.check_width(widths[e.site], where=" in this model (Edit.clamp)")
        if e.vector is not None:
            if tp > 1 and e.site not in _FULL_WIDTH + _BY_RANK:
                raise ValueError(f"a vector edit at site {e.site!r} under tensor parallelism (each rank holds a "
                                 f"slice of it) is not supported; use {list(_FULL_WIDTH + _BY_RANK)} or a scalar")
            want = (widths or {}).get(e.site)
            if e.heads is not None:  # one head's width, into each named head
                if d_head and e.vector.numel() != d_head:
                    raise ValueError(f"edit vector has width {e.vector.numel()}; with heads={list(e.heads)} it goes "
                                     f"into each head, {d_head} wide (d_head)")
            elif want is not None and e.vector.numel() != want:
                raise ValueError(f"edit vector has width {e.vector.numel()}; site {e.site!r} of this model is "
                                 f"{want} wide" + (f" ({want // d_head} heads of {d_head}; give heads=[...] for a "
                                                   f"[{d_head}] vector per head)" if e.site == "z" and d_head else ""))
        if e.prompts is not None and n_prompts is not None and max(e.prompts) >= n_prompts:
            raise ValueError(f"edit for prompts={list(e.prompts)}: the call has {n_prompts} prompt(s) "
                             f"(0..{n_prompts - 1})")
        if isinstance(e.positions, tuple) and n_positions:
            # A position no request reaches would change nothing, silently, yet be recorded as an edit.
            reach = max(n_positions[i] for i in (e.prompts if e.prompts is not None else range(len(n_positions))))
            past = [p for p in e.positions if p >= reach]
            if past:
                raise ValueError(
                    f"edit positions={list(e.positions)}: {past} lie past the end of every sequence it applies to "
                    f"(positions 0..{reach - 1}: prompt tokens, then each generated token fed back; the last "
                    "generated token is never fed back); give positions inside that range, or raise max_tokens")
        out.append(replace(e, layers=tuple(layers)))
    return out


def site_widths(model) -> dict[str, int]:
    """Full widths of each site from the model's config (what an edit vector must match)."""
    cfg = getattr(model, "config", None)
    d = getattr(cfg, "hidden_size", None) or getattr(cfg, "n_embd", None)
    if not d:
        return {}
    d_mlp = getattr(cfg, "intermediate_size", None) or getattr(cfg, "n_inner", None) or 4 * d
    merged = getattr(getattr(model, "arch", None), "merged_gate_up", False)
    out = {"resid": d, "attn": d, "mlp": d, "mlp_act": d_mlp, "mlp_in": d_mlp * (2 if merged else 1)}
    if getattr(cfg, "num_experts", None):
        out["router"] = cfg.num_experts
    shape = head_shape(model)
    if shape:
        out["z"] = shape[0] * shape[1]
    return out


def head_shape(model) -> tuple[int, int] | None:
    """``(heads, d_head)`` of ``model``'s attention, or None where its heads are not read (``Arch.heads``)."""
    from .arch import attention_spec

    if getattr(getattr(model, "arch", None), "heads", None) is None or getattr(model, "config", None) is None:
        return None
    try:
        spec = attention_spec(model.config, model.arch)
    except ValueError:  # attention that is not softmax(q . k): its heads are not read
        return None
    return spec.n_heads, spec.d_head


def to_spec(edits: list[Edit]) -> list[dict]:
    """The plain form the engine's worker arms (lists, no tensors: RPCs serialize it). A clamp names
    its SAE's folder (the worker loads it, as it loads ``generate(saes=...)``) and ``[feature, value]`` s."""
    from .sae_group import folder_of

    return [{"op": e.op, "site": e.site, "layers": list(e.layers), "scale": e.factor,
             "positions": e.positions if isinstance(e.positions, str) else list(e.positions),
             "prompts": None if e.prompts is None else list(e.prompts),
             "heads": None if e.heads is None else list(e.heads),
             "value": e.value, "vector": None if e.vector is None else e.vector.tolist(),
             "values": None if e.values is None else e.values.tolist(),
             **({} if e.sae is None else {
                 "sae": {"path": folder_of(e.sae), "site": e.sae.site, "layer": e.sae.layer,
                         "dtype": str(e.sae.dtype).removeprefix("torch.")},
                 "clamp": [list(fv) for fv in e.clamps]})} for e in edits]


def hf_hooks(model, arch, edits: list[Edit], plen: int, prompt: int = 0) -> list:
    """Register the same edits on a transformers model (for :func:`nnvllm.reference`); returns handles.

    ``plen`` is the prompt length of the sequence the next forwards run over (one prompt at a time),
    ``prompt`` its index in the call (edits for other prompts are left out).
    """
    blocks = model.get_submodule(arch.blocks)
    handles = []
    on_device: dict[int, Any] = {}  # id(edit) -> its SAE on the model's device (clamp)
    if any(e.site == "z" for e in edits):
        from .arch import attention_spec

        n_heads = attention_spec(model.config, arch).n_heads

    def edited(e: Edit, x: Tensor, part: int = 0, parts: int = 1, e_layer: int = 0) -> Tensor:
        pos = torch.arange(x.shape[-2], device=x.device)
        if isinstance(e.positions, tuple):
            m = torch.isin(pos, torch.tensor(e.positions, device=x.device))
        else:
            m = None if e.positions == "all" else (pos < plen if e.positions == "prompt" else pos >= plen)
        vec = e.vector
        if vec is not None and parts > 1:  # a merged site split in transformers: this part's slice
            vec = vec.chunk(parts)[part]
        if vec is not None and e.heads is not None:  # one head's vector, into every head (masked below)
            vec = vec.repeat(n_heads)
        if e.op == "patch":
            src = e.values[e_layer].to(device=x.device, dtype=x.dtype)  # [P, width]
            if parts > 1:
                src = src.chunk(parts, dim=-1)[part]
            n = min(src.shape[0], x.shape[-2])
            new = x.clone()
            new[..., :n, :] = src[:n]
            inside = pos < src.shape[0]
            m = inside if m is None else (m & inside)
        elif e.op == "add":
            new = x + (vec * e.factor).to(device=x.device, dtype=x.dtype)
        elif e.op == "clamp":
            if parts > 1:
                raise ValueError(f"a clamp at site {e.site!r}: transformers splits it over {parts} modules here; "
                                 "clamp an SAE on another site")
            sae = on_device.setdefault(id(e), e.sae.to(device=x.device))
            feats, to = (torch.tensor(c, device=x.device) for c in zip(*e.clamps))
            new = x + sae.clamp_delta(x, feats.long(), to).to(x.dtype)
        elif e.op == "set":
            new = vec.to(device=x.device, dtype=x.dtype).expand_as(x) if vec is not None else torch.full_like(x, e.value)
        else:
            new = x * e.factor
        if e.heads is not None:  # z: only the named heads' columns
            cols = torch.zeros(n_heads, x.shape[-1] // n_heads, dtype=torch.bool, device=x.device)
            cols[list(e.heads)] = True
            cols = cols.flatten()
            return torch.where(cols if m is None else (m[:, None] & cols), new, x)
        return new if m is None else torch.where(m[:, None], new, x)

    for e in edits:
        if e.prompts is not None and prompt not in e.prompts:
            continue
        paths, side = ((arch.heads.hf_out or arch.heads.out), "input") if e.site == "z" else arch.hf_site(e.site)
        parts = paths if isinstance(paths, tuple) else (paths,)
        n = len(parts)  # bound into each hook below: the loops go on after it is made
        for li, j in enumerate(e.layers):
            for k, p in enumerate(parts):
                mod = blocks[j].get_submodule(p) if p else blocks[j]
                if side == "input":
                    def pre(m, args, e=e, k=k, li=li, n=n):
                        return (edited(e, args[0], k, n, li),) + tuple(args[1:])
                    handles.append(mod.register_forward_pre_hook(pre))
                else:
                    def post(m, args, out, e=e, k=k, li=li, n=n):
                        if isinstance(out, tuple):
                            return (edited(e, out[0], k, n, li),) + tuple(out[1:])
                        return edited(e, out, k, n, li)
                    handles.append(mod.register_forward_hook(post))
    return handles
