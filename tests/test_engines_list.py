"""A model lost by re-running a load cell can still be closed from nv.engines() (issue 14, item 3)."""

from __future__ import annotations

import nnvllm as nv
from conftest import engine_kwargs


def test_an_engine_listed_by_engines_can_be_closed_from_the_list(toy_path):
    model = nv.load(toy_path, isolate=False, **engine_kwargs(1))
    model = None  # noqa: F841  as a re-run `model = nv.load()` cell does: the old object is unreachable
    listed = [e for e in nv.engines() if e.kind == "in-process"]
    assert listed, nv.engines()
    for e in listed:
        e.close()
    assert not [e for e in nv.engines() if e.kind == "in-process"]
