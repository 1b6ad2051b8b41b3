"""Seeded batches, the reference's draws and raw nnsight traces across invokes, on the real engine.

- A seed makes a batch reproducible, not identical: each request draws with its own seed
  (``nnvllm._validate.request_seed``), the same in ``nv.generate``, ``nv.stream`` and ``nv.reference``
  (``nv.collect``'s chunks: tests/test_store.py).
- ``nv.reference`` draws, with the same seed, the tokens the CPU engine draws.
- A list saved above several ``tracer.invoke`` blocks: nnsight merges the invokes' copies slot by
  slot, so pre-sized slots (or a dict) come back whole; appends to one list do not.
"""

from __future__ import annotations

import pytest
import torch

import nnvllm as nv
from nnvllm._validate import request_seed

SAME = ["The capital of"] * 8
MIXED = ["The capital of France is", "Paris is the capital of", "The capital of Italy is", "Rome is"]


def test_a_seed_makes_a_batch_reproducible_not_identical(toy):
    kw = {"max_tokens": 6, "temperature": 1.5, "layers": None, "logits": False}
    a = nv.generate(toy, SAME, seed=0, **kw)
    assert len({tuple(t) for t in a.tokens}) > 1, a.text  # eight independent draws, not one drawn eight times
    assert nv.generate(toy, SAME, seed=0, **kw).tokens == a.tokens  # the same call draws the same again
    assert nv.generate(toy, SAME, seed=1, **kw).tokens != a.tokens
    assert a.sampling["seed"] == 0
    s = nv.stream(toy, SAME, seed=0, **kw)
    for _ in s:
        pass
    assert s.run.tokens == a.tokens  # a stream draws as generate does
    # Row 5 again, alone, with the seed the rule gave it in the batch.
    alone = nv.generate(toy, SAME[5], seed=[request_seed(0, 5)], **kw)
    assert alone.tokens == [a.tokens[5]] and alone.sampling["seed"] == [request_seed(0, 5)]


def test_the_seed_rule():
    seeds = [request_seed(0, i) for i in range(1000)]
    assert len(set(seeds)) == 1000 and all(0 <= s < 2**63 for s in seeds)
    assert request_seed(0, 1) != request_seed(1, 0)  # neighbouring seeds do not share draws
    assert request_seed(2**63 - 1, 10**9) == request_seed(2**63 - 1, 10**9)
    with pytest.raises(ValueError, match=r"seed holds 1 seeds for 2 prompt\(s\)"):
        nv.reference(nv.toy.path(), MIXED[:2], seed=[1], max_tokens=1)
    with pytest.raises(ValueError, match=r"seed\[1\]=-1"):
        nv.reference(nv.toy.path(), MIXED[:2], seed=[1, -1], max_tokens=1)
    with pytest.raises(TypeError, match=r"seed\[0\]='a'"):
        nv.reference(nv.toy.path(), MIXED[:2], seed=["a", 1], max_tokens=1)


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_the_reference_draws_what_the_engine_draws(toy, toy_path, top_p):
    """Per request, the engine's sampler (Gumbel-max on the CPU, exponential race on a GPU) with the
    request's seed: transformers' logits pick the same tokens, step after step."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    prompts = SAME + MIXED
    run = nv.generate(toy, prompts, max_tokens=8, temperature=1.5, top_p=top_p, seed=3, layers=None)
    ref = nv.reference(toy_path, prompts, max_tokens=8, temperature=1.5, top_p=top_p, seed=3, layers=None,
                       device=device)
    assert len({tuple(t) for t in run.tokens[:8]}) > 1
    assert ref.tokens == run.tokens
    assert [s.ids.tolist() for s in ref.samples] == run.tokens


def _saved_across_invokes(model, prompts, kind):
    with torch.no_grad(), model.trace(temperature=0.0, top_p=1) as tracer:
        if kind == "a list each":
            out = [[] for _ in prompts].save()
        elif kind == "one list":
            out = [].save()
        elif kind == "slots":
            out = [None] * len(prompts)
            out.save()
        else:
            out = {}.save()
        for i, p in enumerate(prompts):
            with tracer.invoke(p):
                top = model.logits.argmax(dim=-1)
                if kind == "a list each":
                    out[i].append(top)
                elif kind == "one list":
                    out.append(top)
                else:
                    out[i] = top
    return out


def test_values_saved_above_several_invokes(toy):
    """Each invoke is its own vLLM request and fills its own copy of a container saved above the
    invokes; nnsight (0.8.1, ``nnsight.modeling.vllm.collect.merge_shared_saves``) merges the copies
    slot by slot, with ``None`` as the only unwritten mark. Pre-sized slots and dicts come back whole;
    appends come back with the last invoke's only. This is nnsight's merge (the isolated server calls
    the same function), not nnvllm's: if the two asserts on appends fail, nnsight merges appends now."""
    prompts = MIXED[:2]
    want = [t[0] for t in nv.generate(toy, prompts, max_tokens=1, layers=None).tokens]
    slots = _saved_across_invokes(toy, prompts, "slots")
    assert [int(t) for t in slots] == want
    by_key = _saved_across_invokes(toy, prompts, "dict")
    assert {k: int(v) for k, v in by_key.items()} == dict(enumerate(want))
    # What nnsight does with appends (nnsight's own tests/test_vllm.py::test_shared_list_across_invokes):
    each = _saved_across_invokes(toy, prompts, "a list each")
    assert [[int(t) for t in x] for x in each] == [[], [want[1]]]
    one = _saved_across_invokes(toy, prompts, "one list")
    assert [int(t) for t in one] == [want[1]]


def test_edit_vector_of_the_wrong_kind():
    with pytest.raises(TypeError, match=r"vector='x': expected a \[width\] tensor \(or list\) of numbers"):
        nv.Edit.add("x", layers=0)
    with pytest.raises(TypeError, match=r"value=None: expected a float \(0.0 ablates\) or a \[width\] tensor"):
        nv.Edit.set(None, layers=0)
    with pytest.raises(TypeError, match="value='off'"):
        nv.Edit.set("off", layers=0)
    with pytest.raises(TypeError, match=r"vector=\['a', 'b'\] \(list\)"):
        nv.Edit.add(["a", "b"], layers=0)
    with pytest.raises(TypeError, match="vector is a torch.complex64 tensor"):
        nv.Edit.add(torch.zeros(4, dtype=torch.complex64), layers=0)
    assert nv.Edit.add([1, 2.5], layers=0).vector.tolist() == [1.0, 2.5]
