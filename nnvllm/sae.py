"""Sparse autoencoders (SAEs) in sae-lens's saved layout: load, encode, decode, top-k features.

An SAE saved by sae-lens is a folder with ``cfg.json`` (the architecture, ``d_in``, ``d_sae``, the
input options and, under ``metadata``, the ``hook_name`` it was trained on) and
``sae_weights.safetensors`` (``W_enc [d_in, d_sae]``, ``b_enc [d_sae]``, ``W_dec [d_sae, d_in]``,
``b_dec [d_in]``, plus ``threshold`` for JumpReLU, ``b_gate``/``b_mag``/``r_mag`` for gated).
:meth:`SAE.load` reads that folder with torch and safetensors alone (no sae-lens, no hub) and
computes exactly what sae-lens's ``SAE.encode``/``decode`` compute:

==========  =====================================================================================
standard    ``relu(x' @ W_enc + b_enc)``
jumprelu    ``relu(h) * (h > threshold)`` with ``h = x' @ W_enc + b_enc``
topk        the k largest of ``h`` (times the decoder row norms with
            ``rescale_acts_by_decoder_norm``), relu'd; every other feature 0
gated       ``(x' @ W_enc + b_gate > 0) * relu(x' @ (W_enc * exp(r_mag)) + b_mag)``
==========  =====================================================================================

where ``x' = normalise(x) - b_dec`` (``- b_dec`` only with ``apply_b_dec_to_input``). The decode is
``acts @ W_dec + b_dec`` (topk with ``rescale_acts_by_decoder_norm`` divides the acts by the row
norms first), with the normalisation undone. ``normalize_activations`` follows sae-lens:
``"layer_norm"`` and ``"constant_norm_rescale"`` depend on the input and are undone on decode;
``"expected_average_only_in"`` and ``"covariance_whitening"`` are folded into the weights when
sae-lens saves an inference SAE, so they change nothing at load (as in sae-lens's
``SAE.load_from_disk``). Configs written before sae-lens 6 (``hook_point``, ``activation_fn_str``,
a boolean ``normalize_activations``, a ``scaling_factor`` weight) are read the way sae-lens reads them.

Sites: the ``hook_name`` (TransformerLens names, or the module path when sae-lens ran on a
transformers model) gives nnvllm's site and layer: ``blocks.L.hook_resid_post`` is ``("resid", L)``,
``blocks.L.hook_resid_pre`` is ``("resid", L-1)`` (the same stream), ``hook_attn_out`` ``"attn"``,
``hook_mlp_out`` ``"mlp"``, ``mlp.hook_post`` ``"mlp_act"``, ``mlp.hook_pre`` ``"mlp_in"``,
``attn.hook_z``/``hook_q``/``hook_k``/``hook_v`` the head sites ``"z"``/``"q"``/``"k"``/``"v"``;
``model.layers.L`` / ``transformer.h.L`` ``("resid", L)``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

__all__ = ["ARCHITECTURES", "SAE", "site_of_hook"]

CFG_FILENAME = "cfg.json"
WEIGHTS_FILENAME = "sae_weights.safetensors"

#: architecture -> the weights it needs beyond W_enc, W_dec, b_dec.
ARCHITECTURES: dict[str, tuple[str, ...]] = {
    "standard": ("b_enc",),
    "jumprelu": ("b_enc", "threshold"),
    "topk": ("b_enc",),
    "gated": ("b_gate", "b_mag", "r_mag"),
}
# sae-lens's other inference classes, named in the error so a user knows why theirs is refused.
_OTHER_SAE_LENS = ("abstopk", "transcoder", "skip_transcoder", "jumprelu_transcoder",
                   "jumprelu_skip_transcoder", "temporal", "matching_pursuit")
_NORMALISATIONS = ("none", "expected_average_only_in", "constant_norm_rescale", "layer_norm",
                   "covariance_whitening")
_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
           "bfloat16": torch.bfloat16}

_TL_HOOK = re.compile(r"^blocks\.(\d+)\.(.+)$")
_TL_SITES = {"hook_resid_post": "resid", "hook_attn_out": "attn", "hook_mlp_out": "mlp",
             "mlp.hook_post": "mlp_act", "mlp.hook_pre": "mlp_in", "attn.hook_z": "z",
             "attn.hook_q": "q", "attn.hook_k": "k", "attn.hook_v": "v"}
# A transformers module path: <root>.(h|layers).L[.<sublayer>] (sae-lens hooks a module's output).
_HF_HOOK = re.compile(r"^(?:.*\.)?(?:h|layers)\.(\d+)(?:\.(\w+))?$")
_HF_SITES = {None: "resid", "mlp": "mlp", "attn": "attn", "self_attn": "attn", "attention": "attn"}


def site_of_hook(hook_name: str) -> tuple[str, int] | None:
    """nnvllm's ``(site, layer)`` for an sae-lens ``hook_name``, or None where no site matches.

    Example:
        >>> site_of_hook("blocks.6.hook_resid_pre")
        ('resid', 5)
    """
    m = _TL_HOOK.match(hook_name)
    if m:
        layer, rest = int(m.group(1)), m.group(2)
        if rest == "hook_resid_pre":
            # The stream entering block L is block L-1's output; block 0's input is the embedding.
            return ("resid", layer - 1) if layer > 0 else None
        return (_TL_SITES[rest], layer) if rest in _TL_SITES else None
    m = _HF_HOOK.match(hook_name)
    if m and m.group(2) in _HF_SITES:
        return _HF_SITES[m.group(2)], int(m.group(1))
    return None


@dataclass(frozen=True, eq=False)
class SAE:
    """A sparse autoencoder for one site and layer of a model (sae-lens's inference SAE, in torch).

    Build one with :meth:`SAE.load`. Tensors are ``[..., d_in]`` activations in, ``[..., d_sae]``
    feature activations out; inputs are cast to the SAE's dtype first (as sae-lens does).

    Attributes:
        site: the nnvllm site it reads (``"resid"``, ``"mlp"``, ...).
        layer: the block index of that site.
        architecture: ``"standard"``, ``"jumprelu"``, ``"topk"`` or ``"gated"``.
        W_enc: ``[d_in, d_sae]``. W_dec: ``[d_sae, d_in]``. b_enc: ``[d_sae]`` (None for gated).
        b_dec: ``[d_in]``. threshold: ``[d_sae]`` (jumprelu). b_gate, b_mag, r_mag: ``[d_sae]`` (gated).
        k: the TopK architecture's number of active features (None otherwise).
        apply_b_dec_to_input: subtract ``b_dec`` from the input before encoding.
        normalize_activations: sae-lens's input normalisation.
        reshape_activations: ``"hook_z"``: an SAE on the heads' outputs, which also takes them as
            ``[..., n_heads, d_head]`` (flattened first, as sae-lens does); nnvllm's ``z`` site is flat.
        rescale_acts_by_decoder_norm: TopK's selection on ``h * |W_dec[f]|`` (decode divides back).
        finetuning_scaling_factor: ``[d_sae]`` multiplying the acts before the decode (pre-6 files).
        hook_name: the hook the file names (None if it names none).
        cfg: the file's config as read (after the pre-6 defaults).
        path: the folder it came from (None if built in memory).
    """

    site: str
    layer: int
    architecture: str
    W_enc: Tensor
    W_dec: Tensor
    b_dec: Tensor
    b_enc: Tensor | None = None
    threshold: Tensor | None = None
    b_gate: Tensor | None = None
    b_mag: Tensor | None = None
    r_mag: Tensor | None = None
    k: int | None = None
    apply_b_dec_to_input: bool = True
    normalize_activations: str = "none"
    reshape_activations: str = "none"
    rescale_acts_by_decoder_norm: bool = False
    finetuning_scaling_factor: Tensor | None = None
    hook_name: str | None = None
    cfg: dict[str, Any] = field(default_factory=dict, repr=False)
    path: str | None = None

    # ------------------------------------------------------------------ loading
    @classmethod
    def load(cls, path: str | Path, *, site: str | None = None, layer: int | None = None,
             dtype: torch.dtype | str | None = None, device: str | torch.device = "cpu") -> SAE:
        """Load an SAE saved by sae-lens (``save_model`` / ``save_inference_model``) from disk.

        Args:
            path: the folder holding ``cfg.json`` and ``sae_weights.safetensors`` (or either file).
            site: the nnvllm site it reads; default: from the file's ``hook_name``.
            layer: the block index; default: from the file's ``hook_name``. Given ``site``/``layer``
                win over the ``hook_name``.
            dtype: the dtype to compute in; default: the file's ``dtype`` (sae-lens's default too).
            device: where the weights go.

        Example:
            >>> sae = SAE.load("saes/gpt2-small-res-jb/blocks.8.hook_resid_pre")   # doctest: +SKIP
            >>> sae.site, sae.layer, sae.d_sae                                     # doctest: +SKIP
            ('resid', 7, 24576)
        """
        folder = Path(path)
        if folder.is_file():
            folder = folder.parent
        cfg_path, weights_path = folder / CFG_FILENAME, folder / WEIGHTS_FILENAME
        if not cfg_path.is_file() or not weights_path.is_file():
            missing = [p.name for p in (cfg_path, weights_path) if not p.is_file()]
            raise FileNotFoundError(
                f"SAE.load({str(path)!r}): expected a folder saved by sae-lens with {CFG_FILENAME} and "
                f"{WEIGHTS_FILENAME}; {' and '.join(missing)} not found in {str(folder)!r}")
        try:
            cfg = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"SAE.load: {str(cfg_path)!r} is not valid JSON ({e}); expected the "
                             "cfg.json sae-lens writes beside the weights") from None
        if not isinstance(cfg, dict):
            raise TypeError(f"SAE.load: {str(cfg_path)!r} holds a {type(cfg).__name__}, expected a JSON "
                             "object (sae-lens's SAE config)")
        cfg = _sae_lens_defaults(cfg)
        from safetensors import SafetensorError
        from safetensors.torch import load_file
        try:
            weights = load_file(str(weights_path), device="cpu")
        except (SafetensorError, OSError) as e:
            raise ValueError(f"SAE.load: {str(weights_path)!r} is not a readable safetensors file "
                             f"({type(e).__name__}: {e})") from None
        return cls.from_state(cfg, weights, site=site, layer=layer, dtype=dtype, device=device,
                              path=str(folder))

    @classmethod
    def from_state(cls, cfg: dict[str, Any], weights: dict[str, Tensor], *, site: str | None = None,
                   layer: int | None = None, dtype: torch.dtype | str | None = None,
                   device: str | torch.device = "cpu", path: str | None = None) -> SAE:
        """Build an SAE from an sae-lens config dict and its state dict (what :meth:`load` reads)."""
        where = path or "the config"
        arch = cfg.get("architecture", "standard")
        if arch not in ARCHITECTURES:
            known = ", ".join(ARCHITECTURES)
            extra = (f" ({arch!r} is one of sae-lens's architectures that nnvllm does not encode)"
                     if arch in _OTHER_SAE_LENS else "")
            raise ValueError(f"SAE.load({where!r}): architecture={arch!r} is not supported; expected one "
                             f"of {known}{extra}")
        for key in ("d_in", "d_sae"):
            if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
                raise ValueError(f"SAE.load({where!r}): cfg.json needs a positive integer {key!r}, got "
                                 f"{cfg.get(key)!r}")
        d_in, d_sae = cfg["d_in"], cfg["d_sae"]
        norm = cfg.get("normalize_activations", "none") or "none"
        if norm not in _NORMALISATIONS:
            raise ValueError(f"SAE.load({where!r}): normalize_activations={norm!r}; expected one of "
                             f"{', '.join(_NORMALISATIONS)}")
        meta = cfg.get("metadata") or {}
        if meta.get("hook_head_index") is not None:
            raise ValueError(f"SAE.load({where!r}): the SAE reads one head (hook_head_index="
                             f"{meta['hook_head_index']}); nnvllm encodes whole sites only")
        if dtype is None:
            dtype = cfg.get("dtype", "float32")
        dtype = _dtype(dtype, where)

        weights = dict(weights)
        scaling = _scaling_factor(weights, cfg, where)
        shapes = {"W_enc": (d_in, d_sae), "W_dec": (d_sae, d_in), "b_dec": (d_in,), "b_enc": (d_sae,),
                  "threshold": (d_sae,), "b_gate": (d_sae,), "b_mag": (d_sae,), "r_mag": (d_sae,)}
        need = ("W_enc", "W_dec", "b_dec") + ARCHITECTURES[arch]
        missing = [n for n in need if n not in weights]
        if missing:
            raise ValueError(f"SAE.load({where!r}): a {arch} SAE needs weights {list(need)}; "
                             f"{missing} missing (the file has {sorted(weights)})")
        tensors = {}
        for name in need:
            t = weights[name]
            if tuple(t.shape) != shapes[name]:
                raise ValueError(f"SAE.load({where!r}): {name} has shape {tuple(t.shape)}, expected "
                                 f"{shapes[name]} for d_in={d_in}, d_sae={d_sae}")
            tensors[name] = t.to(device=device, dtype=dtype)
        k = None
        if arch == "topk":
            k = cfg.get("k", 100)  # sae-lens's TopKSAEConfig default
            if not isinstance(k, int) or not 0 < k <= d_sae:
                raise ValueError(f"SAE.load({where!r}): a topk SAE needs 0 < k <= d_sae={d_sae}, got k={k!r}")

        hook_name = meta.get("hook_name")
        if site is None or layer is None:
            found = site_of_hook(hook_name) if isinstance(hook_name, str) else None
            if found is None:
                said = (f"its hook_name {hook_name!r} names no nnvllm site" if hook_name
                        else "its cfg.json names no hook_name")
                raise ValueError(f"SAE.load({where!r}): {said}; pass site= and layer= (e.g. "
                                 "site='resid', layer=6 for the residual stream after block 6)")
            site = found[0] if site is None else site
            layer = found[1] if layer is None else layer
        if not isinstance(site, str):
            raise TypeError(f"SAE.load: site must be a site name such as 'resid', got {site!r}")
        if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
            raise ValueError(f"SAE.load: layer must be a block index >= 0, got {layer!r}")
        return cls(site=site, layer=layer, architecture=arch, k=k,
                   apply_b_dec_to_input=bool(cfg.get("apply_b_dec_to_input", True)),
                   normalize_activations=norm,
                   reshape_activations=cfg.get("reshape_activations") or "none",
                   rescale_acts_by_decoder_norm=bool(cfg.get("rescale_acts_by_decoder_norm", False)),
                   finetuning_scaling_factor=None if scaling is None else scaling.to(device=device, dtype=dtype),
                   hook_name=hook_name, cfg=cfg, path=path, **tensors)

    # ------------------------------------------------------------------ shape and placement
    @property
    def d_in(self) -> int:
        return int(self.W_enc.shape[-2])

    @property
    def d_sae(self) -> int:
        return int(self.W_enc.shape[-1])

    def _row_norms(self) -> Tensor:
        """``|W_dec[f]|`` per feature, shaped to broadcast over positions (also stacked: :mod:`nnvllm.sae_group`)."""
        n = self.W_dec.norm(dim=-1)
        return n if self.W_dec.ndim == 2 else n.unsqueeze(-2)

    @property
    def dtype(self) -> torch.dtype:
        return self.W_enc.dtype

    @property
    def device(self) -> torch.device:
        return self.W_enc.device

    def tensors(self) -> dict[str, Tensor]:
        """The weights by sae-lens's names (only those this architecture has)."""
        names = ("W_enc", "W_dec", "b_dec") + ARCHITECTURES[self.architecture]
        out = {n: getattr(self, n) for n in names}
        if self.finetuning_scaling_factor is not None:
            out["finetuning_scaling_factor"] = self.finetuning_scaling_factor
        return out

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> SAE:
        """A copy with every weight on ``device`` and/or in ``dtype``."""
        moved = {n: t.to(device=device or t.device, dtype=dtype or t.dtype) for n, t in self.tensors().items()}
        return replace(self, **moved)

    def check_width(self, width: int, *, where: str = "") -> None:
        """Raise a ValueError unless ``width`` (the site's width in the model) is this SAE's ``d_in``."""
        if width != self.d_in:
            raise ValueError(
                f"the SAE for site={self.site!r}, layer={self.layer} reads d_in={self.d_in} values per "
                f"position, but that site is {width} wide{where}; load the SAE trained on this model's "
                f"{self.site} (or pass the site it was trained on)")

    # ------------------------------------------------------------------ the math
    def _flat(self, x: Tensor) -> Tensor:
        """``x`` as ``[..., d_in]``: a ``hook_z`` SAE also takes ``[..., n_heads, d_head]``."""
        if (x.shape[-1] != self.d_in and self.reshape_activations == "hook_z" and x.ndim >= 2
                and x.shape[-2] * x.shape[-1] == self.d_in):
            return x.flatten(-2)
        return x

    def _input(self, x: Tensor) -> tuple[Tensor, tuple[Tensor, Tensor] | None]:
        """(the encoder's input ``x'``, what undoes the normalisation on decode: (scale, shift))."""
        x = self._flat(x)
        if x.shape[-1] != self.d_in:
            raise ValueError(f"the SAE takes [..., {self.d_in}] activations, got shape {tuple(x.shape)}")
        x = x.to(self.dtype)
        undo = None
        if self.normalize_activations == "constant_norm_rescale":
            coeff = (self.d_in ** 0.5) / x.norm(dim=-1, keepdim=True)
            x = x * coeff
            undo = (1 / coeff, None)
        elif self.normalize_activations == "layer_norm":
            mu = x.mean(dim=-1, keepdim=True)
            x = x - mu
            std = x.std(dim=-1, keepdim=True)
            x = x / (std + 1e-5)
            undo = (std, mu)
        return x - self.b_dec * self.apply_b_dec_to_input, undo

    def _hidden_pre(self, sae_in: Tensor) -> Tensor:
        if self.architecture == "gated":
            return sae_in @ (self.W_enc * self.r_mag.exp()) + self.b_mag
        return sae_in @ self.W_enc + self.b_enc

    def _acts(self, sae_in: Tensor) -> Tensor:
        pre = self._hidden_pre(sae_in)
        if self.architecture == "standard":
            return torch.relu(pre)
        if self.architecture == "jumprelu":
            return torch.relu(pre) * (pre > self.threshold).to(pre.dtype)
        if self.architecture == "gated":
            gate = ((sae_in @ self.W_enc + self.b_gate) > 0).to(self.dtype)
            return gate * torch.relu(pre)
        if self.rescale_acts_by_decoder_norm:
            pre = pre * self._row_norms()
        values, ids = torch.topk(pre, k=self.k, dim=-1, sorted=False)
        return torch.zeros_like(pre).scatter_(-1, ids, values.relu())

    def encode(self, x: Tensor) -> Tensor:
        """Feature activations ``[..., d_sae]`` of activations ``x [..., d_in]`` (sae-lens's ``encode``)."""
        return self._acts(self._input(x)[0])

    def decode(self, acts: Tensor, *, x: Tensor | None = None) -> Tensor:
        """The reconstruction ``[..., d_in]`` of feature activations ``acts [..., d_sae]``.

        Args:
            acts: feature activations, dense.
            x: the activations they were encoded from; needed only where the normalisation depends
                on the input (``layer_norm``, ``constant_norm_rescale``), to undo it.
        """
        undo = None
        if self.normalize_activations in ("layer_norm", "constant_norm_rescale"):
            if x is None:
                raise ValueError(f"decode of an SAE with normalize_activations={self.normalize_activations!r} "
                                 "needs the input it was encoded from: decode(acts, x=x)")
            undo = self._input(x)[1]
        return self._decode(acts.to(self.dtype), undo)

    def _decode(self, acts: Tensor, undo) -> Tensor:
        if self.finetuning_scaling_factor is not None:
            acts = acts * self.finetuning_scaling_factor
        if self.architecture == "topk" and self.rescale_acts_by_decoder_norm:
            acts = acts * (1 / self._row_norms())
        out = acts @ self.W_dec + self.b_dec
        if undo is not None:
            scale, shift = undo
            out = out * scale if shift is None else out * scale + shift
        return out

    def reconstruct(self, x: Tensor) -> Tensor:
        """``decode(encode(x))``: what the SAE keeps of ``x`` (in ``x``'s shape)."""
        sae_in, undo = self._input(x)
        return self._decode(self._acts(sae_in), undo).reshape(x.shape)

    def encode_with_error(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(encode(x), error_norm(x))`` with one encode: the feature activations ``[..., d_sae]`` and
        the L2 norm ``[...]`` of what the reconstruction misses."""
        sae_in, undo = self._input(x)
        acts = self._acts(sae_in)
        return acts, (self._flat(x).to(self.dtype) - self._decode(acts, undo)).norm(dim=-1)

    def clamp_delta(self, x: Tensor, features: Tensor, values: Tensor) -> Tensor:
        """What clamping ``features`` to ``values`` adds to ``x [..., d_in]`` (in the SAE's dtype and
        ``x``'s shape): ``decode(acts') - decode(acts)``, ``acts = encode(x)`` and ``acts'`` the same with
        ``acts'[..., features] = values``. So ``x + clamp_delta(...)`` is ``decode(acts') + error(x)``: the
        SAE's error is kept. The delta is linear in ``values - acts[..., features]``: a feature clamped to
        the activation it has adds exactly 0, and an unchanged clamp leaves ``x`` bit for bit.

        Args:
            features: ``[F]`` feature ids (int64). values: ``[F]`` the activations to set them to.
        """
        sae_in, undo = self._input(x)
        coef = values.to(self.dtype) - self._acts(sae_in)[..., features]  # [..., F]
        if self.finetuning_scaling_factor is not None:
            coef = coef * self.finetuning_scaling_factor[features]
        if self.architecture == "topk" and self.rescale_acts_by_decoder_norm:
            coef = coef * (1 / self._row_norms()[features])
        delta = coef @ self.W_dec[features]
        return (delta if undo is None else delta * undo[0]).reshape(x.shape)

    def error(self, x: Tensor) -> Tensor:
        """``x - reconstruct(x)``, in the SAE's dtype: what the SAE misses (sae-lens's ``hook_sae_error``)."""
        return x.to(self.dtype) - self.reconstruct(x)

    def error_norm(self, x: Tensor) -> Tensor:
        """``[...]`` the L2 norm of :meth:`error` per position: the reconstruction error researchers check first."""
        return self._flat(self.error(x)).norm(dim=-1)

    def top_features(self, x: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """The ``k`` most active features per position: ``(ids [..., k] int64, values [..., k])``,
        largest first. Where fewer than ``k`` fire, the rest have value 0 (their ids are arbitrary)."""
        if isinstance(k, bool) or not isinstance(k, int) or not 0 < k <= self.d_sae:
            raise ValueError(f"k must be an int in 1..{self.d_sae} (the SAE's d_sae), got {k!r}")
        values, ids = torch.topk(self.encode(x), k=k, dim=-1, sorted=True)
        return ids, values

    def save(self, path: str | Path) -> Path:
        """Write the SAE in sae-lens's layout (``cfg.json`` + ``sae_weights.safetensors``) to the folder
        ``path``: :meth:`load` and sae-lens's ``SAE.load_from_disk`` read it back. Returns the folder.

        The engine reads an SAE from its folder: an SAE built in memory is saved before it is used
        there (see :func:`nnvllm.generate`'s ``saes=``)."""
        from safetensors.torch import save_file

        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        cfg = {k: v for k, v in self.cfg.items() if k not in ("finetuning_scaling_factor",)}
        meta = dict(cfg.get("metadata") or {})
        meta.setdefault("sae_lens_version", "6.0.0")  # the layout written here is sae-lens 6's
        if self.hook_name is not None:
            meta["hook_name"] = self.hook_name
        cfg.update(d_in=self.d_in, d_sae=self.d_sae, architecture=self.architecture,
                   dtype=str(self.dtype).removeprefix("torch."), device="cpu",
                   apply_b_dec_to_input=self.apply_b_dec_to_input,
                   normalize_activations=self.normalize_activations,
                   reshape_activations=self.reshape_activations, metadata=meta)
        for key in ("hook_name", "hook_point", "hook_head_index", "activation_fn", "activation_fn_str",
                    "activation_fn_kwargs", "sae_lens_version"):
            cfg.pop(key, None)  # pre-6 spellings: their values live in the fields above now
        if self.architecture == "topk":
            cfg.update(k=self.k, rescale_acts_by_decoder_norm=self.rescale_acts_by_decoder_norm)
        weights = {n: t.detach().to("cpu").contiguous() for n, t in self.tensors().items()}
        if "finetuning_scaling_factor" in weights:  # sae-lens's pre-6 name and switch for it
            weights["scaling_factor"] = weights.pop("finetuning_scaling_factor")
            cfg["finetuning_scaling_factor"] = True
        save_file(weights, str(folder / WEIGHTS_FILENAME))
        (folder / CFG_FILENAME).write_text(json.dumps(cfg))
        return folder

    def direction(self, feature: int) -> Tensor:
        """``[d_in]`` the decoder row of ``feature``: what the feature writes into the site."""
        if isinstance(feature, bool) or not isinstance(feature, int) or not 0 <= feature < self.d_sae:
            raise ValueError(f"feature must be an int in 0..{self.d_sae - 1}, got {feature!r}")
        return self.W_dec[feature]

    def __repr__(self) -> str:
        extra = f", k={self.k}" if self.k is not None else ""
        return (f"SAE({self.architecture}, site={self.site!r}, layer={self.layer}, d_in={self.d_in}, "
                f"d_sae={self.d_sae}{extra}, dtype={str(self.dtype).removeprefix('torch.')})")


def _row_bytes(d_sae: int, k: int | None, itemsize: int) -> int:
    """Bytes one position of one SAE keeps in a capture: its ``d_sae`` feature values (``k`` None), or
    its ``k`` top feature ids (int32) and values, and its reconstruction error (one value)."""
    return (d_sae * itemsize if k is None else k * (4 + itemsize)) + itemsize


def _dtype(dtype, where: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"SAE.load({where!r}): dtype={dtype!r}; expected one of {', '.join(_DTYPES)}")
    return _DTYPES[name]


def _sae_lens_defaults(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config as sae-lens 6 sees it: configs from before 6.0 renamed and defaulted the way
    sae-lens's ``handle_pre_6_0_config`` does; the hook name moved under ``metadata``."""
    version = cfg.get("sae_lens_version") or (cfg.get("metadata") or {}).get("sae_lens_version")
    if not version or _major(version) < 6:
        renames = {"hook_point": "hook_name", "hook_point_head_index": "hook_head_index",
                   "activation_fn_str": "activation_fn"}
        cfg = {renames.get(k, k): v for k, v in cfg.items()}
        cfg.setdefault("apply_b_dec_to_input", True)
        cfg.setdefault("finetuning_scaling_factor", False)
        cfg.setdefault("architecture", "standard")
        cfg.setdefault("reshape_activations", "hook_z" if "hook_z" in str(cfg.get("hook_name", "")) else "none")
        if cfg.get("activation_fn") == "topk" and (cfg.get("activation_fn_kwargs") or {}).get("k") is not None:
            cfg["architecture"] = "topk"
            cfg["k"] = cfg["activation_fn_kwargs"]["k"]
        if isinstance(cfg.get("normalize_activations"), bool):
            cfg["normalize_activations"] = "expected_average_only_in" if cfg["normalize_activations"] else "none"
        if cfg.get("normalize_activations") is None:
            cfg["normalize_activations"] = "none"
        meta = dict(cfg.get("metadata") or {})
        for key in ("hook_name", "hook_head_index", "model_name", "neuronpedia_id"):
            if key in cfg:
                meta.setdefault(key, cfg[key])
        cfg["metadata"] = meta
    return cfg


def _major(version: str) -> int:
    m = re.match(r"\s*v?(\d+)", str(version))
    return int(m.group(1)) if m else 0


def _scaling_factor(weights: dict[str, Tensor], cfg: dict[str, Any], where: str) -> Tensor | None:
    """sae-lens's ``scaling_factor`` weight: all ones means none (dropped, as sae-lens drops it);
    otherwise it multiplies the acts before the decode, and the config must say so."""
    s = weights.pop("scaling_factor", None)
    if s is None:
        s = weights.pop("finetuning_scaling_factor", None)
    if s is None or torch.allclose(s, torch.ones_like(s)):
        return None
    if not cfg.get("finetuning_scaling_factor"):
        raise ValueError(f"SAE.load({where!r}): the weights hold a scaling_factor that is not all ones but "
                         "cfg.json's finetuning_scaling_factor is false; expected both or neither")
    if tuple(s.shape) != (cfg["d_sae"],):
        raise ValueError(f"SAE.load({where!r}): scaling_factor has shape {tuple(s.shape)}, expected "
                         f"({cfg['d_sae']},)")
    return s

