"""Sparse autoencoders: nv.SAE.load reads what sae-lens saves, and encodes/decodes as sae-lens does.

The SAEs here are built with sae-lens's own classes (random weights, every parameter moved off its
initial value so each term of the encoder counts), saved with its ``save_model``, loaded by
``nv.SAE.load`` and compared with sae-lens's ``encode``/``decode`` on the same inputs.
"""

from __future__ import annotations

import json

import pytest
import torch

import nnvllm as nv
from nnvllm.sae import site_of_hook

sae_lens = pytest.importorskip("sae_lens", reason="sae-lens is in the dev extra (make setup)")

D_IN, D_SAE = 64, 256


def _sae_lens_sae(arch: str, *, hook_name="blocks.3.hook_resid_post", seed=0, **cfg):
    """A random sae-lens inference SAE of ``arch`` whose every parameter is drawn (not left at init)."""
    from sae_lens import (GatedSAE, GatedSAEConfig, JumpReLUSAE, JumpReLUSAEConfig, StandardSAE,
                          StandardSAEConfig, TopKSAE, TopKSAEConfig)

    classes = {"standard": (StandardSAE, StandardSAEConfig), "jumprelu": (JumpReLUSAE, JumpReLUSAEConfig),
               "topk": (TopKSAE, TopKSAEConfig), "gated": (GatedSAE, GatedSAEConfig)}
    sae_cls, cfg_cls = classes[arch]
    config = cfg_cls(d_in=D_IN, d_sae=D_SAE, **cfg)
    config.metadata.hook_name = hook_name
    sae = sae_cls(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sae.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim == 1 else 1.0 / D_IN ** 0.5))
        if arch == "jumprelu":  # thresholds a fraction of features pass
            sae.threshold.copy_(torch.rand(D_SAE, generator=g) * 0.5)
    return sae


def _inputs(n=40, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D_IN, generator=g) * 2 + 0.5


ARCHS = [
    ("standard", {}),
    ("standard", {"apply_b_dec_to_input": False}),
    ("jumprelu", {}),
    ("jumprelu", {"normalize_activations": "layer_norm"}),
    ("topk", {"k": 8}),
    ("topk", {"k": 8, "rescale_acts_by_decoder_norm": True}),
    ("topk", {"k": 8, "normalize_activations": "constant_norm_rescale"}),
    ("gated", {}),
    ("standard", {"normalize_activations": "expected_average_only_in"}),
]


@pytest.mark.parametrize(("arch", "cfg"), ARCHS, ids=[f"{a}-{'-'.join(f'{k}={v}' for k, v in c.items())}"
                                                       for a, c in ARCHS])
def test_load_encodes_and_decodes_as_sae_lens(tmp_path, arch, cfg):
    ref = _sae_lens_sae(arch, **cfg)
    ref.save_model(tmp_path / "sae")
    sae = nv.SAE.load(tmp_path / "sae")
    assert (sae.architecture, sae.site, sae.layer, sae.d_in, sae.d_sae) == (arch, "resid", 3, D_IN, D_SAE)
    x = _inputs()
    with torch.no_grad():
        want = ref.encode(x)
        got = sae.encode(x)
        assert (want > 0).sum() > 0 and (want == 0).sum() > 0  # some fire, some do not: a real test
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        want_out = ref.decode(ref.encode(x))  # sae-lens keeps the input's norm stats between the two
        torch.testing.assert_close(sae.decode(got, x=x), want_out, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sae.reconstruct(x), want_out, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sae.error_norm(x), (x - want_out).norm(dim=-1), rtol=1e-5, atol=1e-5)
        ids, values = sae.top_features(x, 5)
        want_values = want.topk(5, dim=-1).values
        torch.testing.assert_close(values, want_values, rtol=0, atol=0)
        # the ids point at those values in sae-lens's dense code
        torch.testing.assert_close(want.gather(-1, ids), values, rtol=0, atol=0)


def test_load_from_disk_agrees_with_ours(tmp_path):
    """sae-lens's own SAE.load_from_disk and nv.SAE.load read the same folder to the same numbers."""
    from sae_lens import SAE as SaeLensSAE

    _sae_lens_sae("jumprelu", seed=3).save_model(tmp_path)
    theirs, ours = SaeLensSAE.load_from_disk(tmp_path), nv.SAE.load(tmp_path / "cfg.json")
    x = _inputs(seed=4)
    with torch.no_grad():
        torch.testing.assert_close(ours.encode(x), theirs.encode(x), rtol=0, atol=0)


@pytest.mark.parametrize(("hook", "where"), [
    ("blocks.3.hook_resid_post", ("resid", 3)), ("blocks.4.hook_resid_pre", ("resid", 3)),
    ("blocks.0.hook_resid_pre", None), ("blocks.2.hook_mlp_out", ("mlp", 2)),
    ("blocks.2.hook_attn_out", ("attn", 2)), ("blocks.5.mlp.hook_post", ("mlp_act", 5)),
    ("blocks.1.attn.hook_z", ("z", 1)), ("blocks.1.hook_resid_mid", None),
    ("model.layers.7", ("resid", 7)), ("transformer.h.2.mlp", ("mlp", 2)), ("model.layers.7.input_layernorm", None),
])
def test_site_of_hook(hook, where):
    assert site_of_hook(hook) == where


def test_site_and_layer_given_win_and_are_needed_without_a_hook(tmp_path):
    _sae_lens_sae("standard", hook_name="blocks.1.hook_resid_mid").save_model(tmp_path)
    with pytest.raises(ValueError, match=r"hook_name 'blocks.1.hook_resid_mid' names no nnvllm site.*site= and layer="):
        nv.SAE.load(tmp_path)
    sae = nv.SAE.load(tmp_path, site="resid", layer=1)
    assert (sae.site, sae.layer, sae.hook_name) == ("resid", 1, "blocks.1.hook_resid_mid")
    _sae_lens_sae("standard").save_model(tmp_path)  # blocks.3.hook_resid_post
    assert nv.SAE.load(tmp_path, layer=5).layer == 5


def test_pre_6_config_is_read_as_sae_lens_reads_it(tmp_path):
    """A config from sae-lens 3-5 (hook_point, activation_fn_str, topk in activation_fn_kwargs, boolean
    normalisation, an all-ones scaling_factor) loads as the TopK SAE sae-lens makes of it."""
    from safetensors.torch import save_file

    ref = _sae_lens_sae("topk", k=6)
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()} | {"scaling_factor": torch.ones(D_SAE)},
              str(tmp_path / "sae_weights.safetensors"))
    (tmp_path / "cfg.json").write_text(json.dumps({
        "d_in": D_IN, "d_sae": D_SAE, "dtype": "torch.float32", "hook_point": "blocks.6.hook_resid_pre",
        "activation_fn_str": "topk", "activation_fn_kwargs": {"k": 6}, "normalize_activations": False,
        "apply_b_dec_to_input": True, "sae_lens_training_version": "4.4.1"}))
    sae = nv.SAE.load(tmp_path)
    assert (sae.architecture, sae.k, sae.site, sae.layer) == ("topk", 6, "resid", 5)
    assert sae.finetuning_scaling_factor is None
    x = _inputs()
    with torch.no_grad():
        torch.testing.assert_close(sae.encode(x), ref.encode(x), rtol=0, atol=0)


def test_finetuning_scaling_factor_scales_the_decode(tmp_path):
    from safetensors.torch import save_file

    ref = _sae_lens_sae("standard")
    scale = torch.rand(D_SAE) + 0.5
    save_file({k: v.contiguous() for k, v in ref.state_dict().items()} | {"scaling_factor": scale},
              str(tmp_path / "sae_weights.safetensors"))
    cfg = {"d_in": D_IN, "d_sae": D_SAE, "hook_point": "blocks.3.hook_resid_post", "finetuning_scaling_factor": True}
    (tmp_path / "cfg.json").write_text(json.dumps(cfg))
    sae = nv.SAE.load(tmp_path)
    x = _inputs()
    with torch.no_grad():
        acts = ref.encode(x)
        torch.testing.assert_close(sae.reconstruct(x), (acts * scale) @ ref.W_dec + ref.b_dec)
    (tmp_path / "cfg.json").write_text(json.dumps(cfg | {"finetuning_scaling_factor": False}))
    with pytest.raises(ValueError, match="scaling_factor that is not all ones"):
        nv.SAE.load(tmp_path)


def test_bad_files_say_what_was_expected(tmp_path):
    with pytest.raises(FileNotFoundError, match="cfg.json and sae_weights.safetensors"):
        nv.SAE.load(tmp_path / "nowhere")
    _sae_lens_sae("standard").save_model(tmp_path)
    good = (tmp_path / "cfg.json").read_text()

    (tmp_path / "cfg.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        nv.SAE.load(tmp_path)
    (tmp_path / "cfg.json").write_text(json.dumps(json.loads(good) | {"architecture": "transcoder"}))
    with pytest.raises(ValueError, match=r"architecture='transcoder' is not supported; expected one of standard, jumprelu, topk, gated"):
        nv.SAE.load(tmp_path)
    (tmp_path / "cfg.json").write_text(json.dumps(json.loads(good) | {"architecture": "jumprelu"}))
    with pytest.raises(ValueError, match=r"needs weights .*\['threshold'\] missing"):
        nv.SAE.load(tmp_path)
    (tmp_path / "cfg.json").write_text(json.dumps(json.loads(good) | {"d_sae": D_SAE * 2}))
    with pytest.raises(ValueError, match=rf"W_enc has shape \({D_IN}, {D_SAE}\), expected \({D_IN}, {2 * D_SAE}\)"):
        nv.SAE.load(tmp_path)
    (tmp_path / "cfg.json").write_text(json.dumps(json.loads(good) | {"normalize_activations": "whiten"}))
    with pytest.raises(ValueError, match="normalize_activations='whiten'"):
        nv.SAE.load(tmp_path)
    (tmp_path / "cfg.json").write_text(good)
    (tmp_path / "sae_weights.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        nv.SAE.load(tmp_path)


def test_width_and_input_checks(tmp_path):
    _sae_lens_sae("topk", k=4).save_model(tmp_path)
    sae = nv.SAE.load(tmp_path)
    with pytest.raises(ValueError, match=rf"reads d_in={D_IN} values per position, but that site is 128 wide"):
        sae.check_width(128)
    sae.check_width(D_IN)
    with pytest.raises(ValueError, match=rf"takes \[..., {D_IN}\] activations, got shape \(3, 65\)"):
        sae.encode(torch.zeros(3, 65))
    with pytest.raises(ValueError, match=r"k must be an int in 1..256"):
        sae.top_features(torch.zeros(3, D_IN), 0)
    assert torch.equal(sae.direction(7), sae.W_dec[7])
    half = sae.to(dtype=torch.float64)
    assert half.dtype == torch.float64 and half.W_dec.dtype == torch.float64 and sae.dtype == torch.float32
