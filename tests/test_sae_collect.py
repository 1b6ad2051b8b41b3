"""SAE features in datasets on disk, sae-lens's activation cache, and clamping a feature while generating.

``nv.collect(..., saes=[...])`` writes each request's features beside its activations and reads them
back as ``nv.generate`` finds them; ``nv.collect(..., format="sae_lens")`` writes the cache sae-lens's
trainer reads, read back here by sae-lens's own ``ActivationsStore``; ``nv.Edit.clamp`` sets a
feature's activation and keeps the SAE's error, checked against the same edit made with
transformers hooks.
"""

from __future__ import annotations

import json

import pytest
import torch

import nnvllm as nv

PROMPTS = ["The capital of France is", "Paris is", "The Eiffel Tower is in the city of"]
STEPS = 3
LAYER = 2
D_SAE = 128


def _sae(arch: str, layer: int = LAYER, seed: int = 0, hook: str | None = None, **cfg) -> nv.SAE:
    """A random SAE on the toy model's residual stream after block ``layer`` (d_model 64; or at sae-lens
    hook ``hook``, 64 wide), built in memory (the engine reads it from the folder it is saved to)."""
    g = torch.Generator().manual_seed(seed)
    d = 64
    w_enc = torch.randn(d, D_SAE, generator=g) / d ** 0.5
    weights = {"W_enc": w_enc, "W_dec": w_enc.T.contiguous() + 0.1 * torch.randn(D_SAE, d, generator=g) / d ** 0.5,
               "b_enc": 0.1 * torch.randn(D_SAE, generator=g), "b_dec": 0.1 * torch.randn(d, generator=g)}
    if arch == "jumprelu":
        weights["threshold"] = torch.rand(D_SAE, generator=g) * 0.3
    return nv.SAE.from_state({"architecture": arch, "d_in": d, "d_sae": D_SAE, "dtype": "float32",
                              "metadata": {"hook_name": hook or f"blocks.{layer}.hook_resid_post"}, **cfg}, weights)


@pytest.fixture(scope="module")
def saes():
    return {"standard": _sae("standard", normalize_activations="layer_norm"), "topk": _sae("topk", layer=1, seed=1, k=10),
            "jumprelu": _sae("jumprelu", seed=2, normalize_activations="layer_norm")}


# The residual stream is the same whatever the batch make-up of collect's chunks (on the CPU, bit for
# bit), but an SAE encodes a whole engine step's rows in one GEMM, and a GEMM over another number of
# rows may round fp32 one ulp apart: features of one chunk equal generate's bit for bit, chunked
# ones within ROUNDING (on a GPU, other tilings: the looser bound).
ROUNDING = 1e-4 if torch.cuda.is_available() else 1e-6
STREAM = 1e-4 if torch.cuda.is_available() else 0.0  # the stream itself: bit for bit on the CPU


def _dense(ids, values) -> torch.Tensor:
    """``[pos, d_sae]`` of top-k features: what the ids and values say, in feature order (ties of two
    values may come in either order; the code they make is the same)."""
    return torch.zeros(ids.shape[0], D_SAE, dtype=values.dtype).scatter_(1, ids.long(), values)


# ---------------------------------------------------------------- collect(saes=...)


def test_collect_writes_the_features_generate_finds(toy, saes, tmp_path):
    picked = [saes["standard"], saes["topk"]]
    kw = {"max_tokens": STEPS, "ignore_eos": True, "saes": picked, "layers": None, "sae_k": 5, "progress": False}
    run = nv.generate(toy, PROMPTS, **{k: v for k, v in kw.items() if k != "progress"})
    one = nv.collect(toy, PROMPTS, tmp_path / "one", **kw)  # one chunk: generate's very call
    chunked = nv.collect(toy, PROMPTS, tmp_path / "chunked", batch_size=2, **kw)
    for ds in (one, chunked):
        assert len(ds) == len(PROMPTS) and ds.sites == []
        assert [d["k"] for d in ds.settings["saes"]] == [5, 5] and ds.settings["saes"][1]["architecture"] == "topk"
        ds.verify()
    exact = not torch.cuda.is_available()  # (on a GPU an isolated engine's first step may hold fewer prompts)
    for i in range(len(PROMPTS)):
        rec, part = one[i], chunked[i]
        assert rec.tokens == part.tokens == run.tokens[i] and rec.resid is None and len(rec.features) == 2
        for s in range(2):
            (ids, values), (want_ids, want_values) = rec.features[s], run.features[s][i]
            assert ids.dtype == torch.int32 and ids.shape == values.shape == (run.positions(i), 5)
            if exact:
                assert torch.equal(ids, want_ids) and torch.equal(values, want_values)
                assert torch.equal(rec.sae_errors[s], run.sae_errors[s][i])
            torch.testing.assert_close(_dense(*part.features[s]), _dense(want_ids, want_values), rtol=0,
                                       atol=ROUNDING)
            torch.testing.assert_close(part.sae_errors[s], run.sae_errors[s][i], rtol=0, atol=ROUNDING)

    # dense codes beside the residual stream: the features are the SAE's encoding of the stored stream
    jump = {"max_tokens": STEPS, "ignore_eos": True, "layers": [LAYER], "sae_dense": True, "progress": False}
    dense = nv.collect(toy, PROMPTS[:2], tmp_path / "dense", saes=[saes["jumprelu"]], **jump)
    for i in range(2):
        rec = dense[i]
        assert rec.features[0].shape == (rec.resid.shape[1], D_SAE)
        torch.testing.assert_close(rec.features[0], saes["jumprelu"].encode(rec.resid[0]), rtol=1e-5, atol=1e-5)
        assert (rec.features[0] > 0).any()
    assert dense.settings["saes"][0]["k"] is None

    # another SAE is another dataset: resuming with it is refused
    with pytest.raises(ValueError, match="other settings.*saes"):
        nv.collect(toy, PROMPTS[:2], tmp_path / "dense", saes=[_sae("jumprelu", seed=5)], **jump)
    # a dataset without SAEs reads back no features
    plain = nv.collect(toy, PROMPTS[:1], tmp_path / "plain", max_tokens=2, layers=[LAYER], progress=False)
    assert plain[0].features == [] and plain[0].sae_errors == [] and "saes" not in plain.settings


def test_an_sae_fingerprint_tells_saes_apart(tmp_path):
    from nnvllm.sae_data import fingerprint

    one, same, other = _sae("standard", seed=1), _sae("standard", seed=1), _sae("standard", seed=2)
    prints = [fingerprint(x.save(tmp_path / str(k))) for k, x in enumerate((one, same, other))]
    assert prints[0] == prints[1] != prints[2]  # same config, other weights: told apart


def test_collect_refuses_saes_that_do_not_fit(toy, saes, tmp_path):
    with pytest.raises(ValueError, match=r"sae_k=0; expected an int in 1..128"):
        nv.collect(toy, PROMPTS, tmp_path / "a", saes=[saes["standard"]], sae_k=0, progress=False)
    with pytest.raises(TypeError, match="saes must be a list of nv.SAE"):
        nv.collect(toy, PROMPTS, tmp_path / "a", saes=["folder"], progress=False)
    assert not (tmp_path / "a").exists()  # refused before anything is written


# ---------------------------------------------------------------- format="sae_lens"


def test_sae_lens_cache_is_what_sae_lens_reads(toy, tmp_path):
    """The cache holds generate's activations packed into rows of context_size positions; sae-lens's
    ActivationsStore (from_cache_activations, no model) reads them back."""
    pytest.importorskip("sae_lens", reason="sae-lens is in the dev extra (make setup)")
    import datasets
    from sae_lens.config import CacheActivationsRunnerConfig
    from sae_lens.training.activations_store import ActivationsStore

    from nnvllm.sae import site_of_hook
    from nnvllm.sae_cache import SIDECAR, hook_name

    layers, sites, C = [1, LAYER], ["mlp", "z"], 4
    kw = {"max_tokens": STEPS, "ignore_eos": True, "layers": layers, "sites": sites}
    run = nv.generate(toy, PROMPTS, **kw)
    out = tmp_path / "cache"
    ds = nv.collect(toy, PROMPTS, out, format="sae_lens", context_size=C, batch_size=2, progress=False, **kw)
    total = sum(run.positions(i) for i in range(len(PROMPTS)))
    rows = total // C
    names = [hook_name(s, layer) for s in ("resid", *sites) for layer in layers]
    assert names[0] == "blocks.1.hook_resid_post" and names[-1] == "blocks.2.attn.hook_z"
    assert [site_of_hook(n) for n in names] == [(s, layer) for s in ("resid", *sites) for layer in layers]
    assert isinstance(ds, datasets.Dataset) and len(ds) == rows and set(ds.column_names) == {*names, "token_ids"}
    assert ds.features["blocks.2.hook_mlp_out"] == datasets.Array2D(shape=(C, 64), dtype="float32")
    assert ds.features["token_ids"] == datasets.Sequence(datasets.Value("int32"), length=C)
    side = json.loads((out / SIDECAR).read_text())
    assert (side["rows"], side["positions"], side["positions_left_out"]) == (rows, total, total % C)
    assert side["hook_names"] == names and side["settings"]["layers"] == layers

    ids = torch.tensor([t for i in range(len(PROMPTS)) for t in run.sequence(i)], dtype=torch.int32)[:rows * C]

    def stream(site, layer):  # every request's positions one after another, as the cache packs them
        per = run.resid if site == "resid" else run.sites[site]
        return torch.cat([per[i][layers.index(layer)].flatten(1) for i in range(len(PROMPTS))])[:rows * C]

    back = datasets.load_from_disk(str(out)).with_format("torch")
    for name in names:
        torch.testing.assert_close(back[:][name], stream(*site_of_hook(name)).reshape(rows, C, -1), rtol=0,
                                   atol=STREAM, msg=name)
    assert torch.equal(back[:]["token_ids"], ids.reshape(rows, C))

    for name in ("blocks.2.hook_resid_post", "blocks.2.attn.hook_z"):
        cfg = CacheActivationsRunnerConfig(
            dataset_path="(generated by nnvllm)", model_name=toy.checkpoint, model_batch_size=2, hook_name=name,
            d_in=64, training_tokens=10**6, context_size=C, new_cached_activations_path=str(out), dtype="float32",
            device="cpu")
        store = ActivationsStore.from_cache_activations(None, cfg)  # what sae-lens's trainer reads
        acts, tokens = store.get_raw_llm_batch()
        torch.testing.assert_close(acts, stream(*site_of_hook(name))[: 2 * C], rtol=0, atol=STREAM)
        assert torch.equal(tokens.long(), ids[: 2 * C].long())

    # float16 on request; a non-empty folder is refused, as sae-lens's runner refuses it
    half = nv.collect(toy, PROMPTS[:2], tmp_path / "half", format="sae_lens", context_size=3, dtype="float16",
                      progress=False, max_tokens=STEPS, ignore_eos=True, layers=[LAYER])
    assert half.features["blocks.2.hook_resid_post"].dtype == "float16"
    got = half.with_format("torch")[:]["blocks.2.hook_resid_post"]  # (datasets' torch format widens to fp32)
    want = torch.cat([run.resid[i][1] for i in range(2)])
    torch.testing.assert_close(got.reshape(-1, 64), want[: got.shape[0] * 3].half().float(), rtol=0, atol=STREAM)
    with pytest.raises(ValueError, match="exists and is not empty"):
        nv.collect(toy, PROMPTS, out, format="sae_lens", context_size=C, progress=False, **kw)


def test_sae_lens_format_refusals(toy, saes, tmp_path):
    pytest.importorskip("datasets")
    bad = [({"format": "parquet"}, "format='parquet'; expected 'nnvllm'"),
           ({"context_size": 8}, "context_size= and dtype= shape sae-lens's activation cache"),
           ({"format": "sae_lens", "context_size": 0}, "context_size=0; expected an int >= 1"),
           ({"format": "sae_lens", "dtype": "bfloat16"}, "Arrow has no bfloat16"),
           ({"format": "sae_lens", "saes": [saes["standard"]]}, "sae-lens's cache holds activations only"),
           ({"format": "sae_lens", "logits": "full"}, "sae-lens's cache holds no logits"),
           ({"format": "sae_lens", "layers": None}, "needs layers")]
    for kw, match in bad:
        with pytest.raises(ValueError, match=match):
            nv.collect(toy, PROMPTS, tmp_path / "x", progress=False, **kw)
    assert not (tmp_path / "x").exists()
    # fewer positions than one row: an empty cache of the same columns, and a warning that says so
    with pytest.warns(UserWarning, match="fill no row of context_size=500"):
        empty = nv.collect(toy, PROMPTS[:1], tmp_path / "e", format="sae_lens", context_size=500, max_tokens=1,
                           layers=[0], progress=False)
    assert len(empty) == 0 and empty.features["blocks.0.hook_resid_post"].shape == (500, 64)


# ---------------------------------------------------------------- Edit.clamp


CLAMP_SAES = [("standard", {}), ("standard", {"normalize_activations": "layer_norm"}),
              ("standard", {"normalize_activations": "constant_norm_rescale", "apply_b_dec_to_input": False}),
              ("topk", {"k": 12, "rescale_acts_by_decoder_norm": True}), ("jumprelu", {}),
              ("standard", {"finetuning_scaling_factor": True})]


@pytest.mark.parametrize(("arch", "cfg"), CLAMP_SAES, ids=[f"{a}-{'-'.join(c)}" for a, c in CLAMP_SAES])
def test_clamp_delta_is_the_clamped_decode_plus_the_error(arch, cfg):
    sae = _sae(arch, seed=3, **cfg)
    if cfg.get("finetuning_scaling_factor"):
        weights = sae.tensors() | {"scaling_factor": torch.rand(D_SAE, generator=torch.Generator().manual_seed(4)) + 0.5}
        sae = nv.SAE.from_state(sae.cfg, weights)
        assert sae.finetuning_scaling_factor is not None
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(5)) * 2
    acts = sae.encode(x)
    on, off = int(acts.mean(0).argmax()), int(acts.mean(0).argmin())
    assert (acts[:, on] > 0).sum() > 5 and (acts[:, off] == 0).any()
    feats, to = torch.tensor([on, off]), torch.tensor([3.0, 1.5])
    clamped = acts.clone()
    clamped[:, feats] = to
    want = sae.decode(clamped, x=x) + sae.error(x)  # the decode of the edited code, the SAE's error kept
    torch.testing.assert_close(x + sae.clamp_delta(x, feats, to), want, rtol=1e-5, atol=1e-5)
    # unchanged: features set to the activations they have (per position) add exactly nothing
    assert torch.equal(x + sae.clamp_delta(x, feats, acts[:, feats]), x)


def test_clamp_edit_checks_its_arguments(toy, saes):
    sae = saes["standard"]
    e = nv.Edit.clamp(sae, [3, 7], [2.0, 0.0], positions="generated", prompts=[1])
    assert (e.op, e.site, e.layers, e.clamps, e.sae) == ("clamp", "resid", (LAYER,), ((3, 2.0), (7, 0.0)), sae)
    assert e.describe()["clamp"] == [[3, 2.0], [7, 0.0]] and e.describe()["sae"]["d_sae"] == D_SAE
    assert nv.Edit.clamp(sae, 5, 1).clamps == ((5, 1.0),)
    with pytest.raises(TypeError, match="sae must be an nv.SAE"):
        nv.Edit.clamp("folder", 3, 0.0)
    for feature in (D_SAE, -1, [2, 2], [], "3", True):
        with pytest.raises(ValueError, match="expected a feature id in 0..127"):
            nv.Edit.clamp(sae, feature, 0.0)
    for value in (float("nan"), [1.0], "0", None):
        with pytest.raises(ValueError, match="expected a finite float, or one per feature"):
            nv.Edit.clamp(sae, [1, 2], value)
    narrow = nv.SAE.from_state({"d_in": 32, "d_sae": 8, "metadata": {"hook_name": "blocks.1.hook_resid_post"}},
                               {"W_enc": torch.zeros(32, 8), "W_dec": torch.zeros(8, 32), "b_enc": torch.zeros(8),
                                "b_dec": torch.zeros(32)})
    with pytest.raises(ValueError, match="reads d_in=32 values per position, but that site is 64 wide"):
        nv.generate(toy, PROMPTS[0], max_tokens=1, edits=[nv.Edit.clamp(narrow, 0, 1.0)])


def test_an_unchanged_clamp_leaves_the_stream_bit_equal(toy, saes):
    """Clamping features to the activations they have (0: features that never fire here) leaves every
    layer's stream and the logits bit for bit: the SAE's error is kept exactly, not re-added."""
    sae = saes["topk"]
    kw = {"max_tokens": STEPS, "ignore_eos": True}
    # The baseline runs eagerly too (an edit that cannot replay in CUDA graphs, adding exact zeros), so
    # that on a GPU both runs take the same kernels.
    eager = nv.Edit.add(torch.zeros(64), layers=0, positions="prompt")
    base = nv.generate(toy, PROMPTS, edits=[eager], saes=[sae], sae_dense=True, **kw)
    code = torch.cat(base.features[0])
    quiet = [f for f in range(D_SAE) if not code[:, f].any()][:4]
    assert quiet and code.any(dim=0).sum() > 10  # some features never fire, many do
    same = nv.generate(toy, PROMPTS, edits=[eager, nv.Edit.clamp(sae, quiet, 0.0)], **kw)
    assert same.tokens == base.tokens
    for i in range(len(PROMPTS)):
        assert torch.equal(same.resid[i], base.resid[i]) and torch.equal(same.logits[i], base.logits[i])
    # the same features clamped to 2 move the stream from block 1 on (over the prompt, the same tokens)
    moved = nv.generate(toy, PROMPTS[:1], edits=[eager, nv.Edit.clamp(sae, quiet, 2.0)], **kw)
    n = len(base.prompt_ids[0])
    assert torch.equal(moved.resid[0][0, :n], base.resid[0][0, :n])
    assert (moved.resid[0][1, :n] - base.resid[0][1, :n]).norm(dim=-1).min() > 0.1


def test_a_clamp_equals_the_same_clamp_made_with_transformers_hooks(toy, toy_path, saes, fidelity):
    sae = saes["standard"]  # layer-norm input: the clamp is undone through the input's norm
    layers = [LAYER, LAYER + 1]
    kw = {"max_tokens": STEPS, "ignore_eos": True, "layers": layers}
    plain = nv.generate(toy, PROMPTS[:2], saes=[sae], sae_dense=True, **kw)
    code = torch.cat(plain.features[0])
    on = int(code.mean(0).argmax())  # fires most: clamped to 0, ablated
    off = int(code.mean(0).argmin())
    edits = [nv.Edit.clamp(sae, [on, off], [0.0, 6.0]),
             nv.Edit.clamp(sae, on, 8.0, positions="generated", prompts=[1])]
    run = nv.generate(toy, PROMPTS[:2], edits=edits, **kw)
    hf = fidelity.reference(toy_path, PROMPTS[:2], edits=edits, **kw)
    assert run.tokens == hf.value.tokens and run.meta["edits"][0]["clamp"] == [[on, 0.0], [off, 6.0]]
    for i in range(2):
        hf.check(run.resid[i], 1e-3, lambda r, i=i: r.resid[i], f"clamped resid[{i}]")
    # over the prompt (the same tokens either way) block 2's output is the first clamp of the plain stream
    n = len(run.prompt_ids[0])
    x = plain.resid[0][0, :n]
    want = x + sae.clamp_delta(x, torch.tensor([on, off]), torch.tensor([0.0, 6.0]))
    torch.testing.assert_close(run.resid[0][0, :n], want, rtol=1e-5, atol=1e-5)
    assert (run.resid[0][0, :n] - x).norm(dim=-1).min() > 0.1


def test_a_clamp_on_the_heads_outputs_equals_transformers(toy, toy_path, fidelity):
    """An SAE on z (sae-lens's hook_z: every head's output before the attention's output projection)
    clamps there as on the stream, equal to the same clamp made with transformers hooks; z at that
    block over the prompt is the clamp of the plain run's z."""
    sae = _sae("standard", seed=3, hook=f"blocks.{LAYER}.attn.hook_z", reshape_activations="hook_z")
    assert (sae.site, sae.layer) == ("z", LAYER)
    kw = {"max_tokens": STEPS, "ignore_eos": True, "sites": ["z"]}
    plain = nv.generate(toy, PROMPTS[:2], saes=[sae], sae_dense=True, **kw)
    on = int(torch.cat(plain.features[0]).mean(0).argmax())
    e = nv.Edit.clamp(sae, on, 5.0)
    run = nv.generate(toy, PROMPTS[:2], edits=[e], **kw)
    hf = fidelity.reference(toy_path, PROMPTS[:2], edits=[e], **kw)
    assert run.tokens == hf.value.tokens
    for i in range(2):
        hf.check(run.sites["z"][i], 1e-3, lambda r, i=i: r.sites["z"][i], f"clamped z[{i}]")
        hf.check(run.resid[i], 1e-3, lambda r, i=i: r.resid[i], f"clamped resid[{i}]")
    n = len(run.prompt_ids[0])
    x = plain.sites["z"][0][LAYER, :n].flatten(-2)
    want = x + sae.clamp_delta(x, torch.tensor([on]), torch.tensor([5.0]))
    torch.testing.assert_close(run.sites["z"][0][LAYER, :n].flatten(-2), want, rtol=1e-5, atol=1e-5)
    assert (want - x).norm(dim=-1).min() > 0.1
