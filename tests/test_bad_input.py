"""Nothing a user passes to ``nv.generate`` may wedge or kill an engine.

Every bad argument is refused on the client, before the engine sees it, with an error that names
the argument; after each refusal the same engine still answers a clean prompt exactly as before.
One in-process engine runs the whole table; tests/test_isolated.py runs a representative part of it
(ISOLATED_ROWS) on its isolated engine.
"""

from __future__ import annotations

import math
import re

import pytest

import nnvllm as nv
from conftest import shared_engine

CLEAN = "The capital of France is"
LONG = " ".join(["Paris"] * 40)  # ~40 tokens: the toy model's context is 64

# (kwargs for nv.generate, the exception, a substring of its message that names the argument)
ROWS = [
    # seed: vLLM seeds are signed 64-bit ints; a bool is not a seed
    ({"seed": "abc"}, TypeError, "seed='abc'"),
    ({"seed": 2**70}, ValueError, "seed="),
    ({"seed": 2**63}, ValueError, "seed="),
    ({"seed": -1}, ValueError, "seed=-1"),
    ({"seed": 1.5}, TypeError, "seed=1.5"),
    ({"seed": True}, TypeError, "seed=True"),
    # temperature: a finite number >= 0
    ({"temperature": "0.5"}, TypeError, "temperature='0.5'"),
    ({"temperature": "hot"}, TypeError, "temperature='hot': expected a number >= 0"),
    ({"temperature": None}, TypeError, "temperature=None"),
    ({"temperature": math.nan}, ValueError, "temperature=nan"),
    ({"temperature": math.inf}, ValueError, "temperature=inf"),
    ({"temperature": -1}, ValueError, "temperature=-1"),
    ({"temperature": True}, TypeError, "temperature=True"),
    # top_p: 0 < top_p <= 1
    ({"top_p": 0}, ValueError, "top_p=0"),
    ({"top_p": 1.5}, ValueError, "top_p=1.5"),
    ({"top_p": -0.1}, ValueError, "top_p=-0.1"),
    ({"top_p": math.nan}, ValueError, "top_p=nan"),
    ({"top_p": "x"}, TypeError, "top_p='x'"),
    ({"top_p": None}, TypeError, "top_p=None"),
    # max_tokens: an int >= 1 that fits the context with the prompt
    ({"max_tokens": True}, TypeError, "max_tokens=True"),
    ({"max_tokens": 0}, ValueError, "max_tokens=0"),
    ({"max_tokens": -5}, ValueError, "max_tokens=-5"),
    ({"max_tokens": 1.5}, TypeError, "max_tokens=1.5"),
    ({"max_tokens": "3"}, TypeError, "max_tokens='3'"),
    ({"max_tokens": None}, TypeError, "max_tokens=None"),
    ({"max_tokens": 10**9}, ValueError, "max_tokens=1000000000"),
    ({"prompts": LONG, "max_tokens": 30}, ValueError, "max_tokens=30"),
    ({"prompts": [CLEAN, " ".join(["Paris"] * 80)], "max_tokens": 1}, ValueError, "prompts[1] is"),
    # layers: "all", an int, a list of ints in range, or None
    ({"layers": 1.5}, TypeError, "layers=1.5"),
    ({"layers": "first"}, ValueError, "layers='first'"),
    ({"layers": [0, "x"]}, TypeError, "layers[1]='x'"),
    ({"layers": [None]}, TypeError, "layers[0]=None"),
    ({"layers": [99]}, ValueError, "layer=99 out of range for a 6-layer model"),
    ({"layers": -7}, ValueError, "layer=-7 out of range"),
    ({"layers": True}, TypeError, "layers=True"),
    ({"layers": [0, True]}, TypeError, "layers[1]=True"),
    # prompts: one non-empty str, or a non-empty list of them
    ({"prompts": ["ok", None]}, TypeError, "prompts[1] is None; every prompt must be a non-empty str"),
    ({"prompts": ["The", 3]}, TypeError, "prompts[1] is 3"),
    ({"prompts": [CLEAN, ""]}, ValueError, "prompts[1] is ''"),
    ({"prompts": ""}, ValueError, "prompts=''"),
    ({"prompts": [""]}, ValueError, "prompts[0] is ''"),
    ({"prompts": []}, ValueError, "prompts=[]"),
    ({"prompts": None}, TypeError, "prompts=None"),
    ({"prompts": 42}, TypeError, "prompts=42"),
    ({"prompts": b"The capital"}, TypeError, "prompts=b'The capital'"),
    # top_k: an int >= 1
    ({"top_k": 0}, ValueError, "top_k=0"),
    ({"top_k": "5"}, TypeError, "top_k='5'"),
    ({"top_k": True}, TypeError, "top_k=True"),
    ({"top_k": 2.0}, TypeError, "top_k=2.0"),
    # sites: names from SITES[1:], and they need layers
    ({"sites": ["nope"]}, ValueError, "sites=['nope']"),
    ({"sites": 5}, TypeError, "sites=5"),
    ({"sites": [3]}, TypeError, "sites[0]=3"),
    ({"sites": "resid"}, ValueError, "sites=['resid']"),
    ({"sites": ["mlp"], "layers": None}, ValueError, "sites=['mlp'] needs layers"),
    # flags: bools only
    ({"logits": "yes"}, TypeError, "logits='yes'"),
    ({"logits": None}, TypeError, "logits=None"),
    ({"ignore_eos": "no"}, TypeError, "ignore_eos='no'"),
    ({"ignore_eos": 1}, TypeError, "ignore_eos=1"),
    # a misspelt argument is Python's own TypeError, and names it
    ({"temprature": 0.5}, TypeError, "temprature"),
]

def _id(row) -> str:
    return ",".join(f"{k}={v!r}"[:40] for k, v in row[0].items())


# A representative part of the table, for the isolated engine (by test id): run by tests/test_isolated.py
# on its engine.
ISOLATED = {"seed='abc'", "seed=1180591620717411303424", "temperature=nan", "temperature='hot'", "top_p=0",
            "max_tokens=True", "max_tokens=1000000000", "prompts='Paris Paris Paris Paris Paris P,max_tokens=30",
            "layers=1.5", "prompts=['ok', None]", "sites=5", "ignore_eos='no'"}
ISOLATED_ROWS = [r for r in ROWS if _id(r) in ISOLATED]


@pytest.fixture(scope="module")
def engine(toy_path):
    """The module's in-process engine and its answer to CLEAN (the isolated rows run in test_isolated.py)."""
    model = shared_engine(toy_path, 1, isolate=False)  # conftest.SHARED_ENGINE_FILES
    yield model, nv.generate(model, CLEAN, max_tokens=2).text[0]


def _refused_then_still_answers(model, before: str, kwargs: dict, exc: type, needle: str) -> None:
    kwargs = {"prompts": CLEAN, **kwargs}
    with pytest.raises(exc, match=re.escape(needle)) as info:
        nv.generate(model, **kwargs)
    assert "the engine refused" not in str(info.value)  # refused here, not by the engine
    after = nv.generate(model, CLEAN, max_tokens=2).text[0]
    assert after == before and after.startswith(" Paris")


def test_the_engine_is_sane_before_the_table(engine):
    _, before = engine
    assert before.startswith(" Paris")


@pytest.mark.parametrize("row", ROWS, ids=_id)
def test_bad_argument_is_refused_and_the_engine_lives_on(engine, row):
    model, before = engine
    _refused_then_still_answers(model, before, *row)


def test_valid_edge_values_still_run(engine):
    """The checks let through what worked before: numpy numbers, the largest seed, negative layers."""
    import numpy as np

    model, before = engine
    run = nv.generate(model, [CLEAN], max_tokens=np.int64(2), temperature=np.float32(0.0), top_p=1,
                      seed=2**63 - 1, layers=[-1, np.int64(0)], sites="mlp", logits=np.bool_(True))
    assert run.text[0] == before and run.layers == [5, 0] and list(run.sites) == ["mlp"]
    assert type(run.sampling["max_tokens"]) is int and run.sampling["seed"] == 2**63 - 1
    n = len(model.tokenizer(LONG)["input_ids"])
    run = nv.generate(model, LONG, max_tokens=64 - n, layers=None, ignore_eos=True)  # fills the context exactly
    assert len(run.tokens[0]) == 64 - n
