"""An engine the notebook lost track of can still be closed from nv.engines() (issue 14, item 3)."""

from __future__ import annotations

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
