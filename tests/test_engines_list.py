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


def test_a_start_walks_the_whole_heap_once_and_leaves_it_as_vllm_does(toy_path):
    """nnvllm.engine._one_gc_pass: vLLM collects garbage about ten times while an in-process engine
    starts, each pass over every object of the process (~2.5 s of a ~4.5 s start on the CPU box). nnvllm
    collects once and freezes the heap, so vLLM's passes walk only what the start creates. Counted
    here: full collections while nothing is frozen (five before the change on the CPU box, one after
    it), in a process that has started an engine before (a first start imports much of vLLM, and the
    imports set off collections of their own)."""
    import gc
    import weakref

    nv.load(toy_path, isolate=False, **engine_kwargs(1)).close()

    class Cycle:
        pass

    c = Cycle()
    c.me = c
    gone = weakref.ref(c)
    del c  # garbage from before the start: still freed by it, as vLLM's own passes freed it
    full: list = []

    def count(phase, info):
        if phase == "start" and info["generation"] == 2 and not gc.get_freeze_count():
            full.append(1)

    gc.callbacks.append(count)
    try:
        model = nv.load(toy_path, isolate=False, **engine_kwargs(1))
    finally:
        gc.callbacks.remove(count)
    try:
        assert gone() is None
        assert len(full) == 1, f"{len(full)} full collections over the unfrozen heap during the start"
        assert gc.get_freeze_count() > 0  # vLLM froze the heap at the end of its start, as it does alone
        assert nv.generate(model, "The capital of France is", max_tokens=2).tokens[0]
    finally:
        model.close()
    assert gc.get_freeze_count() == 0  # vLLM's shutdown unfroze it
    with pytest.raises(Exception, match="max_model_len"):
        nv.load(toy_path, isolate=False, **engine_kwargs(1, max_model_len=10**7))
    assert gc.get_freeze_count() == 0  # a failed start leaves nothing frozen
