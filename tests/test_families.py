"""Llama-layout families beyond Llama itself, each on a tiny random checkpoint, against transformers:
Mistral, Qwen2 (q/k/v biases), Qwen3 (per-head q/k RMSNorm) and Phi-3 (q/k/v and
gate/up fused in transformers too) and Gemma 2 (sandwich norms, scaled embedding, (1 + w) RMSNorm,
soft-capped attention and final logits, tied head: the lens must apply the engine's soft-cap) and
Gemma 3 text (q/k norms, local and global attention layers), and one mixture-of-experts family,
Qwen3-MoE (its "mlp" site is the sparse MoE block's output; no mlp_in/mlp_act); GPT-NeoX (Pythia:
parallel attention and MLP, LayerNorms, partial rotary, untied head) and OLMo 2 (post-norms, q/k norms),
which vLLM runs through its Transformers backend (its tree puts the blocks at model.layers: the layout
maps itself there, Arch.in_engine; on vLLM 0.26 GPT-NeoX is native, at transformers' paths).

For each: greedy tokens equal transformers'; every site within 1e-3 at fp32; the lens's last layer
is the engine's next-token distribution; direct logit attribution read in the engine sums to its
logits and equals the attribution from transformers' weights; one patch cell equals the same edit made with transformers
hooks; and no two blocks' activation modules are one object (the GPT-2 ``mlp.act`` trap).
"""

from __future__ import annotations

import pytest
import torch

import nnvllm as nv
from conftest import engine_kwargs
from nnvllm.testing import tiny_checkpoint
from test_analyses import _hf_patched_diff

FAMILIES = ["mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen3_moe", "gpt_neox", "olmo2"]
FAMILY_OF = {"mistral": "llama", "qwen2": "llama", "qwen3": "llama", "phi3": "phi3", "gemma2": "gemma2",
             "gemma3": "gemma3", "qwen3_moe": "qwen3_moe", "gpt_neox": "gpt_neox", "olmo2": "olmo2"}
MOE = {"qwen3_moe"}
PROMPTS = ["The capital of France is", "Paris is the capital of"]
SITES = ("attn", "mlp", "mlp_in", "mlp_act", "router")


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request, tmp_path_factory, tp):
    path = tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "ckpt")
    model = nv.load(path, **engine_kwargs(tp))
    yield request.param, path, model
    model.close()


def test_family_captures_match_transformers(fam, fidelity):
    kind, path, model = fam
    assert model.arch.family == FAMILY_OF[kind]
    sites = tuple(s for s in SITES if s in model.arch.sites)  # (MoE: no mlp_in/mlp_act; OLMo 2: no mlp_in)
    run = nv.generate(model, PROMPTS, max_tokens=4, ignore_eos=True, sites=sites)
    hf = fidelity.reference(path, PROMPTS, max_tokens=4, ignore_eos=True, sites=sites)
    assert run.tokens == hf.value.tokens, kind
    for i in range(len(PROMPTS)):
        hf.check(run.resid[i], 1e-3, lambda r, i=i: r.resid[i], f"{kind} resid[{i}]")
        hf.check(run.logits[i], 1e-3, lambda r, i=i: r.logits[i], f"{kind} logits[{i}]")
        for s in sites:
            hf.check(run.sites[s][i], 1e-3, lambda r, s=s, i=i: r.sites[s][i], f"{kind} {s}[{i}]")
    if kind in MOE:
        with pytest.raises(ValueError, match=r"the qwen3_moe family offers \['resid', 'attn', 'mlp', 'router'\]"):
            nv.generate(model, PROMPTS[0], max_tokens=1, sites=["mlp_act"])
        assert nv.generate(model, PROMPTS[0], max_tokens=1).tokens  # the engine is fine
        # The router's logits are the routing: its softmax's top-k are the experts each token went to.
        top = run.sites["router"][0].float().softmax(-1).topk(2, dim=-1).indices
        assert top.shape == (model.n_layers, run.resid[0].shape[1], 2) and top.unique().numel() > 2
    else:
        with pytest.raises(ValueError, match="only a mixture-of-experts family has a router"):
            nv.generate(model, PROMPTS[0], max_tokens=1, sites=["router"])


def test_family_attribution_read_in_the_engine(fam):
    """nv.attribute on a live engine reads the weights there (sandwich and post norms, scaled
    embeddings, untied heads, the Transformers backend's trees): its terms sum to the engine's logit
    difference and equal the attribution made from transformers' copy of the weights."""
    from nnvllm.arch import arch_for
    from nnvllm.heads import HeadWeights
    from nnvllm.reference import load_reference

    kind, path, model = fam
    sites = ["z", "mlp"] + (["attn"] if model.arch.heads.post_norms else [])
    run = nv.generate(model, PROMPTS, max_tokens=3, ignore_eos=True, sites=sites)
    att = nv.attribute(run, " Paris", " Rome")
    hf, _ = load_reference(path)
    ref = nv.attribute(run, " Paris", " Rome", weights=HeadWeights.from_module(hf, arch_for(hf.config.architectures),
                                                                                hf.config))
    for i in range(len(PROMPTS)):
        d = att.logit_diff[i]
        assert (att.total(i) - d).abs().max() < 1e-4 * max(1.0, float(d.abs().max())), kind
        for part in ("heads", "mlp", "attn_bias", "embed", "bias"):
            a, b = getattr(att, part)[i], getattr(ref, part)[i]
            assert a.shape == b.shape and (a - b).abs().max() < 1e-4 * max(1.0, float(b.abs().max())), (kind, part)


def test_family_lens_last_layer_is_the_engines_distribution(fam):
    kind, _, model = fam
    lens = nv.logit_lens(model, PROMPTS[0], max_tokens=3, ignore_eos=True)
    run = nv.generate(model, PROMPTS[0], max_tokens=3, ignore_eos=True, layers=None)
    P = len(run.prompt_ids[0])
    for t in range(3):
        top = run.logits[0][t].float().softmax(-1).topk(5)
        assert torch.equal(lens.top_ids[-1, P - 1 + t], top.indices), (kind, t)
        assert (lens.top_probs[-1, P - 1 + t] - top.values).abs().max() < 1e-4, (kind, t)
    assert lens.unembed.norm.kind == ("layernorm" if kind == "gpt_neox" else "rmsnorm")


@pytest.mark.filterwarnings("ignore:the clean prompt does not prefer")  # random weights know no capitals
def test_family_patch_cell_equals_transformers_hooks(fam, fidelity):
    kind, path, model = fam
    clean, corrupt = "The capital of France is", "The capital of Italy is"
    res = nv.patch(model, clean, corrupt, " Paris", " Rome", layers=[1], positions=[3], progress=False)
    hf = fidelity.calibrated(lambda device: _hf_patched_diff(path, clean, corrupt, 1, 3, " Paris", " Rome", device))
    hf.check(float(res.patched_diff[0, 0]), 1e-3, what=f"{kind} patched_diff(1, 3)")


def test_family_blocks_share_no_activation_module(fam):
    kind, _, model = fam
    if kind in MOE:
        pytest.skip("a mixture-of-experts block has no activation module: the experts' activation runs "
                    "inside vLLM's fused MoE kernel")
    blocks = model._module.get_submodule(model.arch.blocks)
    acts = [b.get_submodule("mlp.act" if kind == "gpt_neox" else "mlp.act_fn") for b in blocks]
    assert len({id(a) for a in acts}) == len(acts), kind


def _envoy_ids_in_the_workers(worker) -> list[str]:
    return sorted(k for k in worker.model_runner.nnsight_persistent_objects if k.startswith("Envoy:"))


def test_family_trace_names_envoys_the_engine_has(fam, fidelity):
    """A trace sends the model's envoys as ``Envoy:<path>`` ids (nnvllm.engine.trace_payload): every
    rank's worker has an envoy at each of those paths, and a trace that reaches a block through one
    reads the residual stream transformers computes there."""
    from nnvllm.engine.trace_payload import envoy_ids

    kind, path, model = fam
    if not getattr(model, "_nnvllm_isolated", False):  # (an isolated engine's workers take nnvllm's RPCs only)
        for ids in model.llm.collective_rpc(_envoy_ids_in_the_workers):
            assert ids == sorted(envoy_ids(model)), kind
    blocks = model
    for part in model.arch.blocks.split("."):
        blocks = getattr(blocks, part)
    with model.trace(PROMPTS[0], temperature=0.0, max_tokens=1):
        out = blocks[1].output
        stream = (out[0] + out[1] if isinstance(out, tuple) and len(out) == 2 and out[1] is not None
                  else out[0] if isinstance(out, tuple) else out).clone().save()
    stream = stream.cpu().reshape(-1, stream.shape[-1])  # (the Transformers backend's [1, tokens, width])
    hf = fidelity.reference(path, PROMPTS[:1], max_tokens=1, ignore_eos=True)
    hf.check(stream, 1e-3, lambda r: r.resid[0][1][: stream.shape[0]], f"{kind} block 1 read in a trace")
