"""Heads: q/k/v/z, attention patterns rebuilt from q and k, per-head writes, direct logit attribution.

The first part is pure (synthetic tensors) and transformers-only (every family's tiny checkpoint:
patterns rebuilt from the reference's q and k equal transformers' eager ``output_attentions``); the
second drives the engine and holds its captures to the same ground truth.
"""

from __future__ import annotations

import math

import pytest
import torch

import nnvllm as nv
from nnvllm.arch import ARCHS, AttentionSpec, Heads, attention_spec
from nnvllm.heads import HeadWeights, head_results, pattern_chunks, patterns
from nnvllm.testing import KINDS, tiny_checkpoint

PROMPT = "The capital of France is Paris and the capital of Italy is"


def _spec(**kw) -> AttentionSpec:
    d = dict(family="llama", n_layers=2, n_heads=4, n_kv_heads=2, d_head=8, scale=8 ** -0.5)
    return AttentionSpec(**{**d, **kw})


def _naive(q, k, spec, layer):
    """The pattern written out head by head, position by position (no batching, no chunks)."""
    P = q.shape[0]
    out = torch.zeros(spec.n_heads, P, P)
    for h in range(spec.n_heads):
        g = h // spec.group
        for p in range(P):
            lo = 0 if spec.window(layer) is None else max(0, p - spec.window(layer) + 1)
            s = torch.stack([q[p, h] @ k[j, g] for j in range(lo, p + 1)]) * spec.scale
            if spec.soft_cap:
                s = spec.soft_cap * torch.tanh(s / spec.soft_cap)
            out[h, p, lo:p + 1] = torch.softmax(s, 0)
    return out


@pytest.mark.parametrize("kw", [{}, {"soft_cap": 2.0}, {"windows": (3, None)}, {"n_kv_heads": 4}, {"n_kv_heads": 1}])
def test_patterns_equal_the_written_out_softmax(kw):
    torch.manual_seed(0)
    spec = _spec(**kw)
    q, k = torch.randn(9, 4, 8) * 3, torch.randn(9, spec.n_kv_heads, 8) * 3
    for layer in range(2):
        pat = patterns(q, k, spec, layer)
        assert pat.shape == (4, 9, 9)
        assert (pat - _naive(q, k, spec, layer)).abs().max() < 1e-6
        assert torch.allclose(pat.sum(-1), torch.ones(4, 9))
        assert not pat.triu(1).any()  # causal: no key after the query
        if spec.window(layer) is not None:
            assert not pat.tril(-spec.window(layer)).any()  # nothing older than the window
    # flat [pos, heads * d_head] inputs are the same tensors
    assert torch.equal(patterns(q.flatten(1), k.flatten(1), spec, 0), patterns(q, k, spec, 0))


def test_patterns_in_chunks_heads_and_queries_are_slices_of_the_whole():
    torch.manual_seed(1)
    spec = _spec(windows=(4, None))
    q, k = torch.randn(23, 4, 8), torch.randn(23, 2, 8)
    whole = patterns(q, k, spec, 0)
    small = patterns(q, k, spec, 0, budget=1)  # one query per chunk
    assert (whole - small).abs().max() < 1e-6  # (fp32 rounding of other batch shapes)
    assert (patterns(q, k, spec, 0, heads=[3, 1]) - whole[[3, 1]]).abs().max() < 1e-6
    assert (patterns(q, k, spec, 0, queries=[20, 5]) - whole[:, [20, 5]]).abs().max() < 1e-6
    assert (patterns(q, k, spec, 0, queries=slice(-3, None)) - whole[:, -3:]).abs().max() < 1e-6
    chunks = list(pattern_chunks(q, k, spec, 0, budget=2 * 4 * 23 * 4 * 5))  # 5 queries per chunk
    assert [len(r) for r, _ in chunks] == [5, 5, 5, 5, 3]


def test_grouped_query_heads_share_their_kv_head():
    torch.manual_seed(2)
    spec = _spec(n_heads=4, n_kv_heads=2)
    q1 = torch.randn(6, 1, 8)
    q = q1.expand(6, 4, 8)  # every query head asks the same
    k = torch.randn(6, 2, 8)
    pat = patterns(q, k, spec, 0)
    assert torch.equal(pat[0], pat[1]) and torch.equal(pat[2], pat[3])  # heads 0, 1 read KV head 0
    assert not torch.allclose(pat[0], pat[2])


def test_patterns_refuse_what_does_not_fit():
    spec = _spec()
    q, k = torch.randn(5, 4, 8), torch.randn(5, 2, 8)
    with pytest.raises(ValueError, match=r"k has shape \(5, 4, 8\); expected \[\.\.\., 2, 8\]"):
        patterns(q, torch.randn(5, 4, 8), spec, 0)
    with pytest.raises(ValueError, match="q has 5 positions and k 6"):
        patterns(q, torch.randn(6, 2, 8), spec, 0)
    with pytest.raises(ValueError, match="expected \\[\\.\\.\\., 4, 8\\]"):
        patterns(torch.randn(5, 30), k, spec, 0)
    with pytest.raises(ValueError, match="head 4 out of range for 4 heads"):
        patterns(q, k, spec, 0, heads=[4])
    with pytest.raises(ValueError, match="layer=2: expected a block index 0-1"):
        patterns(q, k, spec, 2)
    with pytest.raises(ValueError, match="positions outside 0-4"):
        patterns(q, k, spec, 0, queries=[5])
    with pytest.raises(ValueError, match="not a multiple of n_kv_heads"):
        _spec(n_kv_heads=3)


def test_attention_spec_reads_each_config_and_refuses_what_is_not_softmax_of_q_k():
    gpt2 = {"architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_head": 2, "n_layer": 3}
    s = attention_spec(gpt2)
    assert (s.n_heads, s.n_kv_heads, s.d_head, s.rotary_dims, s.windows) == (2, 2, 32, 0, (None,) * 3)
    llama = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "num_hidden_layers": 2, "head_dim": 32}
    s = attention_spec(llama)
    assert (s.n_heads, s.n_kv_heads, s.d_head, s.group, s.scale) == (4, 2, 32, 2, 32 ** -0.5)
    assert attention_spec({**llama, "sliding_window": 16}).windows == (16, 16)  # Mistral: every layer
    assert attention_spec({**llama, "sliding_window": 16, "use_sliding_window": False}).windows == (None, None)
    gemma = {**llama, "architectures": ["Gemma2ForCausalLM"], "query_pre_attn_scalar": 256,
             "attn_logit_softcapping": 50.0, "sliding_window": 4096,
             "layer_types": ["sliding_attention", "full_attention"]}
    s = attention_spec(gemma)
    assert (s.scale, s.soft_cap, s.windows) == (256 ** -0.5, 50.0, (4096, None))
    with pytest.raises(ValueError, match="multi-head latent attention"):
        attention_spec({**llama, "kv_lora_rank": 512})
    with pytest.raises(ValueError, match="ALiBi"):
        attention_spec({**llama, "alibi": True})
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        attention_spec({**gpt2, "scale_attn_by_inverse_layer_idx": True})
    import dataclasses

    with pytest.raises(ValueError, match="not read per head"):
        attention_spec(llama, dataclasses.replace(ARCHS["LlamaForCausalLM"], heads=None))
    assert AttentionSpec.from_dict(s.to_dict()) == s


def test_register_arch_carries_heads_to_engine_processes(monkeypatch):
    import dataclasses
    import json

    from nnvllm.arch import _from_env

    monkeypatch.setenv("NNVLLM_ARCHS", "{}")
    monkeypatch.setitem(ARCHS, "MyLlama", ARCHS["LlamaForCausalLM"])  # restored after the test
    mine = dataclasses.replace(ARCHS["Gemma2ForCausalLM"], family="mine")
    nv.register_arch("MyLlama", mine)
    back = _from_env("MyLlama")
    assert back == mine and isinstance(back.heads, Heads) and back.heads.post_norms == mine.heads.post_norms
    assert "heads" in json.loads(__import__("os").environ["NNVLLM_ARCHS"])["MyLlama"]
    with pytest.raises(TypeError, match="arch.heads must be"):
        nv.register_arch("Bad", dataclasses.replace(mine, heads={"core": "x"}))


def test_head_results_sum_to_the_projection():
    torch.manual_seed(3)
    z, w = torch.randn(5, 3, 4), torch.randn(16, 12)
    r = head_results(z, w, 3)
    assert r.shape == (5, 3, 16)
    assert (r.sum(1) - z.flatten(1) @ w.T).abs().max() < 1e-5
    with pytest.raises(ValueError, match="w_o must be"):
        head_results(z, torch.randn(16, 13), 3)


# ------------------------------------------------------------------ every family, on transformers

@pytest.fixture(scope="module", params=KINDS)
def family(request, tmp_path_factory):
    return request.param, tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "ckpt")


def test_reference_heads_equal_transformers_eager(family):
    """Patterns rebuilt from the reference's q and k equal transformers' eager output_attentions (the
    family's scale, soft-cap, windows, GQA); z is each pattern times v; the heads' writes sum to the
    attention output; the attribution's terms sum to the logit difference."""
    from nnvllm.arch import arch_for
    from nnvllm.reference import attentions, load_reference

    kind, path = family
    run = nv.reference(path, [PROMPT, "Paris is the capital of"], max_tokens=3, ignore_eos=True,
                       sites=["q", "k", "v", "z", "attn", "mlp"])
    spec = AttentionSpec.from_dict(run.meta["attention"])
    hf, _ = load_reference(path)
    weights = HeadWeights.from_module(hf, arch_for(hf.config.architectures), hf.config)
    for i in range(2):
        truth = attentions(path, run.sequence(i))
        P = run.positions(i)
        assert run.sites["q"][i].shape == (spec.n_layers, P, spec.n_heads, spec.d_head)
        assert run.sites["k"][i].shape == (spec.n_layers, P, spec.n_kv_heads, spec.d_head)
        for layer in range(spec.n_layers):
            pat = run.attention(layer, i)
            assert (pat - truth[layer]).abs().max() < 1e-5, (kind, layer)
            v = run.sites["v"][i][layer][:, torch.arange(spec.n_heads) // spec.group]
            z = torch.einsum("hqk,khd->qhd", pat, v)
            assert (z - run.sites["z"][i][layer]).abs().max() < 1e-5, (kind, layer)
            attn = head_results(run.sites["z"][i][layer], weights.w_o[layer], spec.n_heads).sum(1)
            if weights.b_o is not None:
                attn = attn + weights.b_o[layer]
            assert (attn - run.sites["attn"][i][layer]).abs().max() < 1e-4, (kind, layer)
    if any(w for w in spec.windows) and kind == "gemma3":  # the window is shorter than the prompt: it bites
        assert run.attention(0, 0)[:, -1, 0].abs().max() == 0
    att = nv.attribute(run, " Paris", " Rome")
    for i in range(2):
        d = att.logit_diff[i]
        assert (att.total(i) - d).abs().max() < 1e-4 * max(1.0, float(d.abs().max())), kind
        assert att.heads[i].shape == (3, spec.n_layers, spec.n_heads) and att.mlp[i].shape == (3, spec.n_layers)


def test_attention_needs_q_and_k_and_survives_save(tmp_path):
    path = tiny_checkpoint("llama", tmp_path / "llama")  # one family is enough for the Run plumbing
    run = nv.reference(path, PROMPT, max_tokens=2, sites=["q", "k"])
    run.save(tmp_path / "r.safetensors")
    back = nv.Run.load(tmp_path / "r.safetensors")
    assert torch.equal(back.attention(-1, 0, heads=1), run.attention(2, 0, heads=[1]))
    plain = nv.reference(path, PROMPT, max_tokens=2)
    with pytest.raises(ValueError, match=r"sites=\['q', 'k'\]"):
        plain.attention(0)
    with pytest.raises(ValueError, match="layer=7: not captured"):
        run.attention(7)
    with pytest.raises(ValueError, match=r"Generate with sites=\['z', 'mlp'\]"):
        nv.attribute(run, " Paris", " Rome")
    assert math.isfinite(float(run.attention(0).sum()))


def test_a_run_file_whose_header_length_starts_with_0x80_loads(tmp_path):
    """A safetensors header of 128 mod 256 bytes makes the file's first byte 0x80, a pickle's first byte:
    such a file (a run with q and k hit it) is a run, not an old pickle."""
    import struct

    from nnvllm.results import RUN_FORMAT, load_tensors, save_tensors

    for pad in range(300):  # vary the metadata until the header's length is 128 mod 256
        path = tmp_path / f"r{pad}.safetensors"
        save_tensors({"x": torch.arange(3.0)}, path, {"pad": "p" * pad}, fmt=RUN_FORMAT)
        if path.read_bytes()[0] == 0x80:
            break
    assert struct.unpack("<Q", path.read_bytes()[:8])[0] % 256 == 128
    tensors, meta = load_tensors(path, fmt=RUN_FORMAT)
    assert torch.equal(tensors["x"], torch.arange(3.0)) and meta["pad"] == "p" * pad
    torch.save({"x": 1}, tmp_path / "old.pt", _use_new_zipfile_serialization=False)  # a real pickle: refused
    with pytest.raises(ValueError, match="old torch-pickle"):
        load_tensors(tmp_path / "old.pt", fmt=RUN_FORMAT)


# ------------------------------------------------------------------ the engine, against transformers
# Engines shared with other test files (conftest.SHARED_ENGINE_FILES): the toy model (GPT-2 layout),
# tiny GPT-2 and tiny Llama (grouped-query attention: 2 query heads share 1 KV head; at --tp 2 each
# rank holds one query head and a copy of the KV head).

ENGINE_PROMPTS = [PROMPT, "Paris is the capital of"]
HEAD_SITES = ["q", "k", "v", "z", "attn", "mlp"]


@pytest.fixture(scope="module", params=["toy", "gpt2", "llama"])
def model(request, toy_path, tiny_paths, tp):
    from conftest import shared_engine

    path = toy_path if request.param == "toy" else tiny_paths[request.param]
    return request.param, path, shared_engine(path, tp)


def test_engine_heads_equal_transformers(model, fidelity):
    """q, k, v, z equal transformers' (teacher-forced on the engine's tokens); patterns rebuilt from the
    engine's q and k equal transformers' eager output_attentions (<= 1e-4 at fp32); z is each
    pattern times v; the heads' writes (z_h @ W_O[h]) plus the projection's bias are the engine's
    attention output; and the attribution's terms sum to the engine's own logit difference."""
    from nnvllm.reference import attentions

    kind, path, engine = model
    run = nv.generate(engine, ENGINE_PROMPTS, max_tokens=4, ignore_eos=True, sites=HEAD_SITES)
    spec = AttentionSpec.from_dict(run.meta["attention"])
    assert spec == attention_spec(__import__("json").load(open(f"{path}/config.json")))
    ref = fidelity.reference(path, ENGINE_PROMPTS, tokens=run.tokens, sites=HEAD_SITES)
    att = nv.attribute(run, " Paris", " Rome")
    for i in range(len(ENGINE_PROMPTS)):
        P = run.positions(i)
        assert run.sites["q"][i].shape == (spec.n_layers, P, spec.n_heads, spec.d_head)
        assert run.sites["k"][i].shape == run.sites["v"][i].shape == (spec.n_layers, P, spec.n_kv_heads, spec.d_head)
        for s in ("q", "k", "v", "z"):
            ref.check(run.sites[s][i], 1e-4, lambda r, s=s, i=i: r.sites[s][i], f"{kind} {s}[{i}]")
        seq = run.sequence(i)
        truth = fidelity.calibrated(lambda device, seq=seq: attentions(path, seq, device=device))
        pats = torch.stack([run.attention(layer, i) for layer in run.layers])
        truth.check(pats, 1e-4, what=f"{kind} patterns[{i}]")
        for layer in run.layers:
            v = run.sites["v"][i][layer][:, torch.arange(spec.n_heads) // spec.group].float()
            z = torch.einsum("hqk,khd->qhd", pats[layer], v)
            assert (z - run.sites["z"][i][layer]).abs().max() < 1e-4, (kind, i, layer)
        d = att.logit_diff[i]  # the engine's logits, not recomputed
        assert (att.total(i) - d).abs().max() < 1e-4 * max(1.0, float(d.abs().max())), (kind, i)
    # per-head writes sum to the engine's attention output (W_O read with transformers from the checkpoint)
    from nnvllm.arch import arch_for
    from nnvllm.reference import load_reference

    hf, _ = load_reference(path)
    weights = HeadWeights.from_module(hf, arch_for(hf.config.architectures), hf.config)
    for layer in run.layers:
        out = head_results(run.sites["z"][0][layer], weights.w_o[layer], spec.n_heads).sum(1)
        out = out + (weights.b_o[layer] if weights.b_o is not None else 0)
        assert (out - run.sites["attn"][0][layer]).abs().max() < 1e-4, (kind, layer)
    # the attribution above read the weights in the engine (its readout); from transformers' copy of the
    # checkpoint's weights every term is the same
    assert run.engine_model() is engine
    here = nv.attribute(run, " Paris", " Rome", weights=weights)
    for part in ("heads", "mlp", "attn_bias", "embed", "bias"):
        for i in range(len(ENGINE_PROMPTS)):
            a, b = getattr(att, part)[i], getattr(here, part)[i]
            assert a.shape == b.shape and (a - b).abs().max() < 1e-4 * max(1.0, float(b.abs().max())), (kind, part, i)


def test_engine_heads_of_some_layers_and_the_refusals(model):
    kind, path, engine = model
    run = nv.generate(engine, ENGINE_PROMPTS[1], max_tokens=3, layers=[1], sites=["q", "k"])
    assert list(run.sites) == ["q", "k"] and run.sites["q"][0].shape[0] == 1
    full = nv.generate(engine, ENGINE_PROMPTS[1], max_tokens=3, sites=["q", "k"])
    assert full.tokens == run.tokens
    assert torch.equal(run.attention(1), full.attention(1))  # the same rows, whatever else is captured
    last = run.attention(1, queries=[-1], heads=0)  # the last generated step's row of head 1.0
    assert last.shape == (1, 1, run.positions(0)) and abs(float(last.sum()) - 1) < 1e-5
    with pytest.raises(ValueError, match="layer=0: not captured"):
        run.attention(0)
    with pytest.raises(ValueError, match="needs layers"):
        nv.generate(engine, ENGINE_PROMPTS[1], max_tokens=1, layers=None, sites=["z"])
    with pytest.raises(ValueError, match="unknown"):
        nv.generate(engine, ENGINE_PROMPTS[1], max_tokens=1, sites=["pattern"])
    attributable = nv.generate(engine, ENGINE_PROMPTS[1], max_tokens=1, sites=["z", "mlp"])
    with pytest.raises(ValueError, match="same token"):
        nv.attribute(attributable, " Paris", " Paris")
    with pytest.raises(ValueError, match="tokens .*; attribution compares single tokens"):
        nv.attribute(attributable, " Paris France", " Rome")
    assert nv.generate(engine, ENGINE_PROMPTS[1], max_tokens=1).tokens  # the engine is fine
