"""An engine the notebook lost track of can still be closed from nv.engines() (issue 14, item 3)."""

from __future__ import annotations

import pytest
import torch

import nnvllm as nv
from conftest import engine_kwargs


def test_an_engine_listed_by_engines_can_be_closed_from_the_list(toy_path):
    # Re-running a `model = nv.load()` cell: the old object is only held by something the user does
    # not see (IPython's output history, a widget); stand-in: this list.
    history = [nv.load(toy_path, isolate=False, **engine_kwargs(1))]
    listed = [e for e in nv.engines() if e.kind == "in-process"]
    assert listed, nv.engines()
    for e in listed:
        e.close()
    assert history[0].vllm_entrypoint is None  # closed
    assert not [e for e in nv.engines() if e.kind == "in-process"]


def test_a_second_in_process_engine_is_refused_and_the_first_keeps_working(toy_path, tiny_paths):
    # Issue 14, item 2: a second in-process engine started, then closing either broke the other
    # (vLLM's distributed state is per process). Now the second load says what to do instead.
    m1 = nv.load(toy_path, isolate=False, **engine_kwargs(1))
    try:
        before = nv.generate(m1, "The capital of France is", max_tokens=3)
        with pytest.raises(RuntimeError, match=r"already runs an in-process engine.*isolate=True"):
            nv.load(tiny_paths["llama"], isolate=False, **engine_kwargs(1))
        after = nv.generate(m1, "The capital of France is", max_tokens=3)
        assert after.tokens == before.tokens and torch.equal(after.resid[0], before.resid[0])
    finally:
        m1.close()
    with nv.load(tiny_paths["llama"], isolate=False, **engine_kwargs(1)) as m2:  # after close(): fine
        assert nv.generate(m2, "The capital of France is", max_tokens=2).tokens[0]
