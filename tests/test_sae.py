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


def _sae_lens_sae(arch: str, *, hook_name="blocks.3.hook_resid_post", seed=0, d_in=D_IN, **cfg):
    """A random sae-lens inference SAE of ``arch`` whose every parameter is drawn (not left at init)."""
    from sae_lens import (
        GatedSAE,
        GatedSAEConfig,
        JumpReLUSAE,
        JumpReLUSAEConfig,
        StandardSAE,
        StandardSAEConfig,
        TopKSAE,
        TopKSAEConfig,
    )

    classes = {"standard": (StandardSAE, StandardSAEConfig), "jumprelu": (JumpReLUSAE, JumpReLUSAEConfig),
               "topk": (TopKSAE, TopKSAEConfig), "gated": (GatedSAE, GatedSAEConfig)}
    sae_cls, cfg_cls = classes[arch]
    config = cfg_cls(d_in=d_in, d_sae=D_SAE, **cfg)
    config.metadata.hook_name = hook_name
    sae = sae_cls(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in sae.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.3 if p.ndim == 1 else 1.0 / d_in ** 0.5))
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


def test_saved_sae_reads_back_in_sae_lens_and_here(tmp_path):
    """SAE.save writes sae-lens's layout: sae-lens's load_from_disk and SAE.load read it to the same code."""
    from sae_lens import SAE as SaeLensSAE

    for arch, cfg in (("topk", {"k": 8, "rescale_acts_by_decoder_norm": True}), ("jumprelu", {}), ("gated", {})):
        ref = _sae_lens_sae(arch, hook_name="blocks.4.hook_resid_pre", **cfg)
        ref.save_model(tmp_path / arch)
        ours = nv.SAE.load(tmp_path / arch)
        ours.save(tmp_path / f"{arch}-again")
        again, theirs = nv.SAE.load(tmp_path / f"{arch}-again"), SaeLensSAE.load_from_disk(tmp_path / f"{arch}-again")
        assert (again.site, again.layer, again.architecture, again.k) == ("resid", 3, arch, ours.k)
        x = _inputs(seed=5)
        with torch.no_grad():
            torch.testing.assert_close(again.encode(x), ref.encode(x), rtol=0, atol=0)
            torch.testing.assert_close(theirs.encode(x), ref.encode(x), rtol=0, atol=0)


@pytest.mark.parametrize(("arch", "cfg"), ARCHS, ids=[f"{a}-{'-'.join(f'{k}={v}' for k, v in c.items())}"
                                                       for a, c in ARCHS])
def test_stacked_saes_encode_as_each_does(tmp_path, arch, cfg):
    """stack() of SAEs of one kind: row g of a batched encode is SAE g's own encode (the engine's group)."""
    from nnvllm.sae_group import stack

    saes = []
    for seed in range(3):
        _sae_lens_sae(arch, seed=seed, **cfg).save_model(tmp_path / str(seed))
        saes.append(nv.SAE.load(tmp_path / str(seed)))
    both = stack(saes)
    assert both.W_enc.shape == (3, D_IN, D_SAE) and both.b_dec.shape == (3, 1, D_IN)
    x = torch.stack([_inputs(seed=g) for g in range(3)])
    acts, err = both.encode_with_error(x)
    for g, sae in enumerate(saes):
        torch.testing.assert_close(acts[g], sae.encode(x[g]), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(err[g], sae.error_norm(x[g]), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="stack\\(\\) takes SAEs of one kind"):
        stack([saes[0], saes[1].to(dtype=torch.float64)])


def test_hook_z_sae_takes_heads_as_sae_lens_does(tmp_path):
    """An SAE on the heads' outputs (hook_z) takes [..., n_heads, d_head] as sae-lens does, and the flat
    [..., n_heads * d_head] of nnvllm's z site to the same code."""
    ref = _sae_lens_sae("standard", hook_name="blocks.1.attn.hook_z", reshape_activations="hook_z")
    ref.save_model(tmp_path)
    sae = nv.SAE.load(tmp_path)
    assert (sae.site, sae.layer, sae.reshape_activations) == ("z", 1, "hook_z")
    heads = _inputs().view(-1, 2, D_IN // 2)
    with torch.no_grad():
        want = ref.encode(heads)
        torch.testing.assert_close(sae.encode(heads), want, rtol=0, atol=0)
        torch.testing.assert_close(sae.encode(heads.flatten(-2)), want, rtol=0, atol=0)
        recon = ref.decode(want)  # [pos, n_heads, d_head], as sae-lens reshapes it back
        torch.testing.assert_close(sae.reconstruct(heads), recon, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sae.error_norm(heads), (heads - recon).flatten(-2).norm(dim=-1), rtol=1e-5, atol=1e-5)


def test_encode_with_error_is_encode_and_error_norm(tmp_path):
    _sae_lens_sae("jumprelu", normalize_activations="layer_norm").save_model(tmp_path)
    sae = nv.SAE.load(tmp_path)
    x = _inputs()
    acts, err = sae.encode_with_error(x)
    assert torch.equal(acts, sae.encode(x)) and torch.equal(err, sae.error_norm(x))


# ---------------------------------------------------------------- in the engine (toy model, d_model 64)

PROMPTS = ["The capital of France is", "Paris is", "The Eiffel Tower is in the city of"]
LAYER = 2
STEPS = 4


@pytest.fixture(scope="module")
def saes(tmp_path_factory):
    """sae-lens SAEs on the toy model, saved and loaded back: on the residual stream (after blocks 1
    and 2), on block 1's MLP activation (a column-parallel site: gathered across ranks under TP) and on
    block 2's heads' outputs (z: heads split across ranks)."""
    root = tmp_path_factory.mktemp("saes")
    out = {}
    for arch, cfg in (("standard", {}), ("jumprelu", {}), ("topk", {"k": 12})):
        ref = _sae_lens_sae(arch, hook_name=f"blocks.{LAYER + 1}.hook_resid_pre", seed=7, **cfg)
        ref.save_model(root / arch)
        out[arch] = (ref, nv.SAE.load(root / arch))
    # one kind with the jumprelu above (same widths and options): the engine encodes the two as one group
    ref = _sae_lens_sae("jumprelu", hook_name="blocks.1.hook_resid_post", seed=9)
    ref.save_model(root / "jumprelu_1")
    out["jumprelu_1"] = (ref, nv.SAE.load(root / "jumprelu_1"))
    ref = _sae_lens_sae("jumprelu", hook_name="blocks.1.mlp.hook_post", seed=8, d_in=4 * D_IN)
    ref.save_model(root / "mlp_act")
    out["mlp_act"] = (ref, nv.SAE.load(root / "mlp_act"))
    # the heads' outputs (sae-lens's hook_z: [n_heads, d_head] per position; nnvllm's z site: flat)
    ref = _sae_lens_sae("topk", hook_name="blocks.2.attn.hook_z", seed=10, k=10, reshape_activations="hook_z")
    ref.save_model(root / "z")
    out["z"] = (ref, nv.SAE.load(root / "z"))
    return out


def _margin(sae, x) -> torch.Tensor:
    """[pos, d_sae] how far each pre-activation is from where the SAE's activation jumps (its
    threshold; for TopK the boundary between the k-th and (k+1)-th): below ~1e-3 the fp32 rounding
    between vLLM and transformers may move a feature across it."""
    with torch.no_grad():
        pre = sae._hidden_pre(sae._input(x)[0])
    if sae.architecture == "jumprelu":
        return (pre - sae.threshold).abs()
    if sae.architecture == "topk":
        top = pre.topk(sae.k + 1, dim=-1).values
        cut = (top[:, -2:-1] + top[:, -1:]) / 2
        return (pre - cut).abs()
    return pre.abs()


def test_features_in_the_engine_equal_sae_lens_on_transformers(toy, toy_path, saes, fidelity):
    """The engine's dense code and error equal sae-lens's encode of transformers' residual stream."""
    names = list(saes)
    run = nv.generate(toy, PROMPTS, max_tokens=STEPS, layers=None, ignore_eos=True,
                      saes=[saes[n][1] for n in names], sae_dense=True)
    assert run.resid is None and not run.sites and len(run.features) == len(names) == len(run.sae_errors)
    assert saes["mlp_act"][1].site == "mlp_act"
    hf = fidelity.reference(toy_path, PROMPTS, max_tokens=STEPS, layers=[1, LAYER], sites=("mlp_act", "z"),
                            ignore_eos=True)
    assert run.tokens == hf.value.tokens
    near = 0
    for s, name in enumerate(names):
        ref, sae = saes[name]

        def site_in(r, i, sae=sae):  # the SAE's input in reference run r (on the CPU, where sae-lens runs)
            per = r.resid if sae.site == "resid" else r.sites[sae.site]
            return per[i][[1, LAYER].index(sae.layer)].float().cpu()

        def code(r, i, ref=ref):
            with torch.no_grad():
                return ref.encode(site_in(r, i))

        def error(r, i, ref=ref):
            with torch.no_grad():
                return (site_in(r, i) - ref.decode(ref.encode(site_in(r, i)))).flatten(1).norm(dim=-1)

        for i in range(len(PROMPTS)):
            x, got = site_in(hf.value, i), run.features[s][i]
            assert got.shape == (run.positions(i), sae.d_sae) and got.dtype == torch.float32
            assert (code(hf.value, i) > 0).any()
            # Away from a jump the code is continuous in x and fp32 bounds hold. A feature within 1e-3
            # of its jump may land on either side; then only that position's error may differ more.
            steady = _margin(sae, x) > 1e-3
            near += int((~steady).sum())
            hf.check(torch.where(steady, got, 0), 1e-3, lambda r, i=i, m=steady, c=code: torch.where(m, c(r, i), 0),
                     f"{name} features[{i}]")
            rows = steady.all(dim=-1)
            hf.check(run.sae_errors[s][i][rows], 1e-3, lambda r, i=i, m=rows, e=error: e(r, i)[m], f"{name} error[{i}]")
    assert near < 0.01 * sum(run.positions(i) for i in range(len(PROMPTS))) * len(names) * D_SAE


def test_sparse_features_are_the_top_k_of_the_dense_code(toy, saes):
    picked = [saes["standard"][1], saes["topk"][1]]
    dense = nv.generate(toy, PROMPTS, max_tokens=STEPS, layers=None, ignore_eos=True, saes=picked, sae_dense=True)
    sparse = nv.generate(toy, PROMPTS, max_tokens=STEPS, layers=None, ignore_eos=True, saes=picked, sae_k=5)
    assert sparse.tokens == dense.tokens
    for s in range(len(picked)):
        for i in range(len(PROMPTS)):
            ids, values = sparse.features[s][i]
            d = dense.features[s][i]
            assert ids.shape == values.shape == (sparse.positions(i), 5) and ids.dtype == torch.int32
            assert torch.equal(values, d.topk(5, dim=-1).values)  # largest first, the same engine: bit-equal
            assert torch.equal(d.gather(-1, ids.long()), values)
            assert torch.equal(sparse.sae_errors[s][i], dense.sae_errors[s][i])
    assert sparse.meta["saes"][1]["architecture"] == "topk" and sparse.meta["saes"][0]["k"] == 5


def test_features_beside_the_residual_stream_are_its_encoding(toy, saes):
    """With the residual stream captured too, the features are the SAE's encoding of exactly that."""
    _, sae = saes["jumprelu"]
    run = nv.generate(toy, PROMPTS[:2], max_tokens=STEPS, layers=[0, LAYER], saes=[sae], sae_k=16, seed=3,
                      temperature=1.0)
    for i in range(2):
        want_ids, want_values = sae.top_features(run.resid[i][1], 16)
        ids, values = run.features[0][i]
        torch.testing.assert_close(values, want_values, rtol=1e-6, atol=1e-6)
        fires = want_values > 1e-4  # where a feature fires its id is the one the SAE picks
        assert torch.equal(ids.long()[fires], want_ids[fires])
        torch.testing.assert_close(run.sae_errors[0][i], sae.error_norm(run.resid[i][1]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_an_sae_in_half_precision_encodes_in_it(toy, saes, dtype):
    """``nv.SAE.load(path, dtype=...)`` in a tensor-core dtype: the engine encodes in that dtype, and its
    features and errors are sae-lens's encoding, in that dtype, of the residual stream captured beside
    them (within that dtype's rounding: the engine multiplies a group of SAEs at once)."""
    from sae_lens import SAE as SaeLensSAE

    _, sae32 = saes["jumprelu"]
    half = getattr(torch, dtype)
    sae = nv.SAE.load(sae32.path, dtype=dtype)
    ref = SaeLensSAE.load_from_disk(sae32.path, dtype=dtype)
    run = nv.generate(toy, PROMPTS[:2], max_tokens=STEPS, layers=[0, LAYER], saes=[sae], sae_k=16, ignore_eos=True)
    for i in range(2):
        x = run.resid[i][1].to(half)
        with torch.no_grad():
            want = ref.encode(x)
            want_err = (x - ref.decode(want)).float().norm(dim=-1)
        ids, values = run.features[0][i]
        assert values.dtype == half and run.sae_errors[0][i].dtype == half
        got = torch.zeros_like(want).scatter_(-1, ids.long(), values)  # the top 16 back into the code
        top = want.topk(16, dim=-1).values[:, -1:]  # the 16th value: below it a feature is not in the top 16
        sure = (_margin(sae32, run.resid[i][1]) > 0.05) & ((want - top).abs() > 0.05)
        kept = sure & (want >= top)
        assert kept.sum() >= 8 * want.shape[0], int(kept.sum())  # most of every position's top 16
        torch.testing.assert_close(got.float()[kept], want.float()[kept])
        torch.testing.assert_close(run.sae_errors[0][i].float(), want_err, rtol=2e-2, atol=2e-2)


def test_an_sae_built_in_memory_is_saved_for_the_engine(toy, saes):
    _, sae = saes["standard"]
    copy = nv.SAE.from_state(sae.cfg, sae.tensors())  # no folder
    assert copy.path is None
    run = nv.generate(toy, PROMPTS[0], max_tokens=2, layers=None, saes=[copy, sae], sae_k=4)
    assert torch.equal(run.features[0][0][1], run.features[1][0][1])
    folder = run.meta["saes"][0]["path"]
    assert folder != run.meta["saes"][1]["path"] and nv.SAE.load(folder).d_sae == sae.d_sae


def test_run_with_features_saves_and_loads(toy, saes, tmp_path):
    run = nv.generate(toy, PROMPTS[:2], max_tokens=2, layers=None, saes=[saes["topk"][1], saes["standard"][1]],
                      sae_k=3)
    dense = nv.generate(toy, PROMPTS[:1], max_tokens=2, layers=None, saes=[saes["topk"][1]], sae_dense=True)
    for r in (run, dense):
        r.save(tmp_path / "run.safetensors")
        back = nv.Run.load(tmp_path / "run.safetensors")
        assert back.meta["saes"] == r.meta["saes"] and len(back.features) == len(r.features)
        for s in range(len(r.features)):
            for i in range(len(r)):
                a, b = r.features[s][i], back.features[s][i]
                if isinstance(a, tuple):
                    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                else:
                    assert torch.equal(a, b)
                assert torch.equal(r.sae_errors[s][i], back.sae_errors[s][i])
    assert "features of 2 SAEs" in repr(run)


def test_saes_that_do_not_fit_the_model_are_refused(toy, saes, tmp_path):
    from dataclasses import replace

    from sae_lens import StandardSAE, StandardSAEConfig

    _, sae = saes["standard"]

    small = StandardSAE(StandardSAEConfig(d_in=32, d_sae=16))
    small.cfg.metadata.hook_name = "blocks.1.hook_resid_post"
    small.save_model(tmp_path / "small")
    with pytest.raises(ValueError, match="reads d_in=32 values per position, but that site is 64 wide"):
        nv.generate(toy, PROMPTS[0], max_tokens=1, saes=[nv.SAE.load(tmp_path / "small")])
    with pytest.raises(ValueError, match=r"layer=9, out of range for a 6-layer model \(0-5\)"):
        nv.generate(toy, PROMPTS[0], max_tokens=1, saes=[replace(sae, layer=9)])
    with pytest.raises(ValueError, match="router"):
        nv.generate(toy, PROMPTS[0], max_tokens=1, saes=[replace(sae, site="router")])
    with pytest.raises(ValueError, match=r"sae_k=0; expected an int in 1..256"):
        nv.generate(toy, PROMPTS[0], max_tokens=1, saes=[sae], sae_k=0)
    with pytest.raises(TypeError, match="saes must be a list of nv.SAE"):
        nv.generate(toy, PROMPTS[0], max_tokens=1, saes=["sae_folder"])
    # the engine is unharmed: a good call (one SAE, not in a list) still runs
    run = nv.generate(toy, PROMPTS[0], max_tokens=1, layers=None, saes=sae)
    assert run.features[0][0][0].shape == (run.positions(0), 32)


def test_steering_by_a_feature_is_the_same_addition_in_transformers(toy, toy_path, saes, fidelity):
    """Edit.feature adds scale * W_dec[f] at the SAE's site and layer: the engine's residual stream
    equals transformers' with the same edit made by hooks, and the feature fires more."""
    _, sae = saes["jumprelu"]
    plain = nv.generate(toy, PROMPTS[:2], max_tokens=STEPS, layers=[LAYER], ignore_eos=True, saes=[sae], sae_dense=True)
    # the feature whose decoder direction its own encoder reads most: steering raises its pre-activation
    # by 6 x that at every position (the encoder is linear up to the activation)
    f = int((sae.W_dec * sae.W_enc.T).sum(dim=-1).argmax())
    edit = nv.Edit.feature(sae, f, 6.0)
    assert (edit.op, edit.site, edit.layers) == ("add", "resid", (LAYER,))
    assert torch.equal(edit.vector, sae.W_dec[f]) and edit.factor == 6.0
    run = nv.generate(toy, PROMPTS[:2], max_tokens=STEPS, layers=[LAYER, LAYER + 1], ignore_eos=True, edits=[edit],
                      saes=[sae], sae_dense=True)
    hf = fidelity.reference(toy_path, PROMPTS[:2], max_tokens=STEPS, layers=[LAYER, LAYER + 1], ignore_eos=True,
                            edits=[edit])
    assert run.tokens == hf.value.tokens
    for i in range(2):
        hf.check(run.resid[i], 1e-3, lambda r, i=i: r.resid[i], f"steered resid[{i}]")
        # the SAE reads the steered stream: its code is the encoding of what the Run holds
        torch.testing.assert_close(run.features[0][i], sae.encode(run.resid[i][0]), rtol=1e-5, atol=1e-5)
    # over the prompt (the same tokens either way) block 2's output moved by exactly 6 x W_dec[f]
    n = len(run.prompt_ids[0])
    torch.testing.assert_close(run.resid[0][0, :n], plain.resid[0][0, :n] + 6.0 * sae.W_dec[f], rtol=1e-5, atol=1e-5)
    assert run.features[0][0][:, f].mean() > plain.features[0][0][:, f].mean() + 1.0
    with pytest.raises(TypeError, match="sae must be an nv.SAE"):
        nv.Edit.feature("folder", 3)
    with pytest.raises(ValueError, match=r"feature must be an int in 0..255"):
        nv.Edit.feature(sae, 256)


def _streamed_features_are_the_runs(stream, steps) -> None:
    """Each step's features are the run's at the position that produced each prompt's newest token."""
    run = stream.run
    seen = [0] * len(run)
    for step in steps:
        assert len(step.features) == len(run.features)
        for i, toks in enumerate(step.tokens):
            seen[i] += len(toks)
            for j, per in enumerate(step.features):
                if not toks:
                    continue
                pos = len(run.prompt_ids[i]) + seen[i] - 2
                want = run.features[j][i]
                assert per[i] is not None, (step.index, i, j)
                if isinstance(want, tuple):
                    assert torch.equal(per[i][0], want[0][pos]) and torch.equal(per[i][1], want[1][pos])
                else:
                    assert torch.equal(per[i], want[pos])
    assert seen == [len(t) for t in run.tokens]


def test_features_in_a_stream(toy, saes):
    """nv.stream(saes=...): every step carries each SAE's features of the newest positions, and the
    stream's run holds the features nv.generate finds (to fp32 rounding: a stream encodes the rows
    each peek finds, nv.generate a block of steps at a time, and a matmul's rounding depends on its
    row count)."""
    picked = [saes["topk"][1], saes["standard"][1]]
    kw = {"max_tokens": STEPS, "layers": [1], "ignore_eos": True, "saes": picked}
    for form in ({"sae_k": 6}, {"sae_dense": True}):
        want = nv.generate(toy, PROMPTS, **kw, **form)
        s = nv.stream(toy, PROMPTS, **kw, **form)
        steps = list(s)
        # A step brings one token per prompt on an in-process engine; an isolated one (every engine on
        # a GPU) generates ahead of the frames its client reads and can bring two in one step, so the
        # steps are checked to cover every token (_streamed_features_are_the_runs), not counted.
        assert s.run.tokens == want.tokens and len(steps) >= 2
        for j in range(len(picked)):
            for i in range(len(PROMPTS)):
                got, exp = s.run.features[j][i], want.features[j][i]
                if isinstance(exp, tuple):  # (ids, values)
                    assert torch.equal(got[0], exp[0]), (j, i)
                    got, exp = got[1], exp[1]
                torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5)
        _streamed_features_are_the_runs(s, steps)


def test_features_from_an_isolated_engine(toy, toy_path, saes, tp, monkeypatch):
    """An isolated engine (its own process; the SAE read from its folder there, the features back
    through shared memory) gives the in-process engine's features, in a stream too (there to fp32
    rounding, as in test_features_in_a_stream). NNVLLM_SAE_BLOCK_ROWS set after the engine started
    applies to the next call (the client sends it): 0 encodes each step alone, as a stream does where
    its peeks keep up with the engine (a peek encodes the steps since the last one, two where the
    engine ran ahead), and then the two pick the same features, their values equal to fp32 rounding;
    a value that is not a row count is refused before the call."""
    from conftest import engine_kwargs, same_values

    from nnvllm import capture

    picked = [saes["topk"][1], saes["mlp_act"][1]]
    kw = dict(max_tokens=STEPS, layers=None, ignore_eos=True, saes=picked, sae_k=6)
    here = nv.generate(toy, PROMPTS, **kw)
    iso = nv.load(toy_path, isolate=True, **engine_kwargs(tp))
    try:
        there = nv.generate(iso, PROMPTS, **kw)
        assert capture._LAST_STATS["sae_encodings"] == 1  # one block: every step's rows at collect
        streamed = nv.stream(iso, PROMPTS, **kw)
        steps = list(streamed)
        monkeypatch.setenv("NNVLLM_SAE_BLOCK_ROWS", "0")
        each_step = nv.generate(iso, PROMPTS, **kw)
        assert capture._LAST_STATS["sae_encodings"] == capture._LAST_STATS["steps"] > 1
        monkeypatch.setenv("NNVLLM_SAE_BLOCK_ROWS", "many")
        with pytest.raises(ValueError, match="NNVLLM_SAE_BLOCK_ROWS='many': expected a whole number"):
            nv.generate(iso, PROMPTS, **kw)
        monkeypatch.delenv("NNVLLM_SAE_BLOCK_ROWS")
        assert nv.generate(iso, PROMPTS, **kw).tokens == there.tokens  # the engine kept working
    finally:
        iso.close()
    assert each_step.tokens == there.tokens
    for s in range(len(picked)):
        for i in range(len(PROMPTS)):
            (ids, values), (s_ids, s_values) = each_step.features[s][i], streamed.run.features[s][i]
            assert torch.equal(ids, s_ids), (s, i)
            torch.testing.assert_close(values, s_values, atol=1e-5, rtol=1e-5)
    assert there.tokens == here.tokens == streamed.run.tokens
    for s in range(len(picked)):
        for i in range(len(PROMPTS)):
            for run in (there, streamed.run):
                assert torch.equal(run.features[s][i][0], here.features[s][i][0])
            assert same_values(there.features[s][i][1], here.features[s][i][1])
            assert same_values(there.sae_errors[s][i], here.sae_errors[s][i])
            # a stream encodes what each peek finds (fewer rows at once than nv.generate): fp32 rounding
            for got, want in ((streamed.run.features[s][i][1], here.features[s][i][1]),
                              (streamed.run.sae_errors[s][i], here.sae_errors[s][i])):
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-5)
    _streamed_features_are_the_runs(streamed, steps)
