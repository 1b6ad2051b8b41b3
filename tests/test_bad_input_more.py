"""Bad input to ``nv.load``, ``nv.patch`` and ``nv.logit_lens`` is refused before any engine work.

``nv.load`` rows build broken checkpoint folders from the toy model's files and must fail before an
engine starts (``_build_engine`` and ``isolated.start`` are replaced by tripwires). ``nv.patch`` and
``nv.logit_lens`` rows run against one in-process toy engine; after each refusal it still answers
a clean prompt exactly as before.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import shared_engine

import nnvllm as nv
import nnvllm.engine as engine_mod

CLEAN = "The capital of France is"
CORRUPT = "The capital of Italy is"
TOY_VOCAB = 622  # the toy model's vocab_size (config.json)
TOY_CONTEXT = 64  # n_positions


class EngineStarted(AssertionError):
    """Raised by the tripwires: a bad load() got as far as starting an engine."""


@pytest.fixture
def no_engine(monkeypatch):
    """Replace both ways load() starts an engine by tripwires that record the arguments they got."""
    calls: list = []

    def build(model, **engine_args):
        calls.append((model, engine_args))
        raise EngineStarted(f"an in-process engine was started for {model!r}")

    def start(cls, path, arch, engine_args, timeout):
        calls.append((path, engine_args))
        raise EngineStarted(f"an isolated engine was started for {path!r}")

    from nnvllm.engine import isolated

    monkeypatch.setattr(engine_mod, "_build_engine", build)
    monkeypatch.setattr(isolated, "start", start)
    return calls


def _checkpoint(root: Path, config: str | None = None, weights: bool = True) -> str:
    """A copy of the toy checkpoint in ``root`` with config.json replaced by ``config`` (text) if given."""
    toy = Path(nv.toy.check())
    root.mkdir(parents=True, exist_ok=True)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(toy / f, root / f)
    if weights:
        shutil.copy(toy / "model.safetensors", root / "model.safetensors")
    if config is not None:
        (root / "config.json").write_text(config)
    return str(root)


def _truncated_config() -> str:
    text = (Path(nv.toy.check()) / "config.json").read_text()
    return text[: len(text) // 2]


# (how to build the model argument from tmp_path or None, load kwargs, exception, substrings of its message)
LOAD_ROWS = [
    ("truncated config.json", lambda d: _checkpoint(d, _truncated_config()), {}, ValueError,
     ["config.json", "not valid JSON"]),
    ("config.json holds a list", lambda d: _checkpoint(d, "[1, 2]"), {}, ValueError,
     ["config.json", "config.json must hold a JSON object"]),
    ("config.json holds a string", lambda d: _checkpoint(d, '"gpt2"'), {}, ValueError,
     ["config.json must hold a JSON object"]),
    ("no weights", lambda d: _checkpoint(d, weights=False), {}, FileNotFoundError,
     ["has a config.json but no weights", "*.safetensors", "*.bin", "*.pt", "load_format='dummy'"]),
    ("no weights, isolated", lambda d: _checkpoint(d, weights=False), {"isolate": True}, FileNotFoundError,
     ["has a config.json but no weights"]),
    ("unknown architecture and no weights: the architecture is named first",
     lambda d: _checkpoint(d, json.dumps({"architectures": ["BertForMaskedLM"]}), weights=False), {}, ValueError,
     ["nnvllm knows the layout of"]),
    ("no weights, load_format=auto", lambda d: _checkpoint(d, weights=False), {"load_format": "auto"},
     FileNotFoundError, ["no weights"]),
    ("dtype=float33", None, {"dtype": "float33"}, ValueError,
     ["dtype='float33'", "'auto', 'float32', 'float16', 'bfloat16', 'half', 'float'", "torch.float32"]),
    ("dtype=float33, isolated", None, {"dtype": "float33", "isolate": True}, ValueError, ["dtype='float33'"]),
    ("dtype=32", None, {"dtype": 32}, TypeError, ["dtype=32", "'float32'"]),
    ("max_model_len=-5", None, {"max_model_len": -5}, ValueError, ["max_model_len=-5", "positive int"]),
    ("max_model_len=0", None, {"max_model_len": 0}, ValueError, ["max_model_len=0", "positive int"]),
    ("max_model_len='x'", None, {"max_model_len": "x"}, TypeError, ["max_model_len='x'", "positive int"]),
    ("max_model_len=1.5", None, {"max_model_len": 1.5}, TypeError, ["max_model_len=1.5"]),
    ("tensor_parallel_size=0", None, {"tensor_parallel_size": 0}, ValueError,
     ["tensor_parallel_size=0", "expected an int >= 1"]),
    ("tensor_parallel_size='2'", None, {"tensor_parallel_size": "2"}, TypeError,
     ["tensor_parallel_size='2'", "expected an int >= 1"]),
    ("tensor_parallel_size=True", None, {"tensor_parallel_size": True}, TypeError, ["tensor_parallel_size=True"]),
    ("tensor_parallel_size=0, isolated", None, {"tensor_parallel_size": 0, "isolate": True}, ValueError,
     ["tensor_parallel_size=0"]),
    ("exact with fp16", None, {"exact": True, "dtype": "float16"}, ValueError, ["exact=True", "dtype='float16'"]),
    ("exact='yes'", None, {"exact": "yes"}, TypeError, ["exact='yes'", "True or False"]),
    ("cuda_graphs=1", None, {"cuda_graphs": 1}, TypeError, ["cuda_graphs=1", "True or False"]),
    ("seed='x'", None, {"seed": "x"}, TypeError, ["seed='x'", "expected None or an int"]),
    ("seed=-1", None, {"seed": -1}, ValueError, ["seed=-1", "2**63 - 1"]),
    ("seed='x', isolated", None, {"seed": "x", "isolate": True}, TypeError, ["seed='x'"]),
    ("max_model_len=10**6", None, {"max_model_len": 10**6}, ValueError,
     ["max_model_len=1000000", f"the model's context is {TOY_CONTEXT} tokens (config.json n_positions)",
      f"max_model_len <= {TOY_CONTEXT}"]),
    ("max_model_len=10**6, isolated", None, {"max_model_len": 10**6, "isolate": True}, ValueError,
     ["max_model_len=1000000"]),
    ("kv_cache_memory_bytes=1", None, {"kv_cache_memory_bytes": 1}, ValueError,
     ["kv_cache_memory_bytes=1", f"one sequence of {TOY_CONTEXT} tokens (max_model_len)", "kv_cache_memory_bytes >="]),
    ("kv_cache_memory_bytes=1, isolated", None, {"kv_cache_memory_bytes": 1, "isolate": True}, ValueError,
     ["kv_cache_memory_bytes=1"]),
    ("kv_cache_memory_bytes too small for max_model_len=32", None,
     {"kv_cache_memory_bytes": "10KiB", "max_model_len": 32}, ValueError,
     ["kv_cache_memory_bytes=10240", "one sequence of 32 tokens"]),
    ("kv_cache_memory_bytes='lots'", None, {"kv_cache_memory_bytes": "lots"}, ValueError,
     ["kv_cache_memory_bytes='lots'", "'1.5GiB'"]),
    ("kv_cache_memory_bytes=1.5", None, {"kv_cache_memory_bytes": 1.5}, TypeError, ["kv_cache_memory_bytes=1.5"]),
    ("compilation_config mode=3", None, {"compilation_config": {"mode": 3}}, ValueError,
     ["compilation_config={'mode': 3}", "torch.compile", "Leave 'mode' out"]),
    ("compilation_config mode='VLLM_COMPILE', isolated", None,
     {"compilation_config": {"mode": "VLLM_COMPILE"}, "isolate": True}, ValueError,
     ["compilation_config={'mode': 'VLLM_COMPILE'}"]),
    ("compilation_config level=3", None, {"compilation_config": {"level": 3}}, ValueError,
     ["compilation_config={'level': 3}", "Leave 'level' out"]),
    ("compilation_config='x'", None, {"compilation_config": "x"}, TypeError,
     ["compilation_config='x'", "expected a dict"]),
]


@pytest.mark.parametrize("row", LOAD_ROWS, ids=[r[0] for r in LOAD_ROWS])
def test_bad_load_is_refused_before_an_engine_starts(no_engine, tmp_path, row):
    _, make, kwargs, exc, needles = row
    model = None if make is None else make(tmp_path / "ckpt")
    kwargs = {"isolate": False, **kwargs}
    with pytest.raises(exc) as info:
        nv.load(model, **kwargs)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    if model is not None and exc is FileNotFoundError:
        assert model in str(info.value)  # names the folder
    assert no_engine == []


# What the checks must let through: each reaches the engine start with these arguments.
VALID_LOADS = [
    ("load_format=dummy, no weights", lambda d: _checkpoint(d, weights=False), {"load_format": "dummy"}),
    ("load_format=dummy, no weights, isolated", lambda d: _checkpoint(d, weights=False),
     {"load_format": "dummy", "isolate": True}),
    ("weights as pytorch_model.bin", lambda d: _bin_checkpoint(d), {}),
    ("a hub id (not fetched in-process)", lambda d: "openai-community/gpt2", {}),
    ("dtype=BFloat16, max_model_len=-1", None, {"dtype": "BFloat16", "max_model_len": -1}),
    ("dtype=torch.float16, max_model_len=None", None, {"dtype": torch.float16, "max_model_len": None}),
    ("tensor_parallel_size=np.int64(1)", None, {"tensor_parallel_size": np.int64(1)}),
    ("exact=True, dtype=float32", None, {"exact": True, "dtype": "float32"}),
    ("seed=7, max_model_len=the context", None, {"seed": 7, "max_model_len": TOY_CONTEXT}),
    ("kv_cache_memory_bytes=256 MiB", None, {"kv_cache_memory_bytes": 256 << 20}),
    ("compilation_config without compile", None,
     {"compilation_config": {"mode": 0, "max_cudagraph_capture_size": 8}}),
    ("compilation_config mode='NONE'", None, {"compilation_config": {"mode": "NONE"}}),
]


def test_a_longer_context_passes_where_vllm_is_told_to_allow_it(no_engine, monkeypatch):
    """vLLM takes a max_model_len beyond the model's with VLLM_ALLOW_LONG_MAX_MODEL_LEN=1: so does load()."""
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    with pytest.raises(EngineStarted):
        nv.load(None, isolate=False, max_model_len=2 * TOY_CONTEXT)
    with pytest.raises(EngineStarted):  # a KV cache size given as text becomes bytes
        nv.load(None, isolate=False, kv_cache_memory_bytes="1MiB")
    assert no_engine[-1][1]["kv_cache_memory_bytes"] == 2**20


# VLLM_CPU_OMP_THREADS_BIND values a one-rank CPU engine is refused with, and substrings of the message
BAD_BINDINGS = [("x", ["VLLM_CPU_OMP_THREADS_BIND='x'", "'0', '0-3' or '0,2-3'"]),
                ("0-", ["VLLM_CPU_OMP_THREADS_BIND='0-'", "expected core ids"]),
                ("4096", ["names cores [4096]", "this process may not use", "or unset it"])]


@pytest.mark.skipif(torch.cuda.is_available(), reason="binds a CPU engine's threads")
@pytest.mark.parametrize("isolate", [False, True])
@pytest.mark.parametrize("row", BAD_BINDINGS, ids=[r[0] for r in BAD_BINDINGS])
def test_a_binding_to_cores_that_cannot_be_used_is_refused_before_an_engine_starts(no_engine, monkeypatch,
                                                                                      row, isolate):
    mask, needles = row
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", mask)
    with pytest.raises(ValueError) as info:
        nv.load(None, isolate=isolate)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    assert no_engine == []
    core = str(min(os.sched_getaffinity(0)))
    for good in (core, "auto", "nobind", f"{core}|{core}"):  # one core, vLLM's own values, a list a rank
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", good)
        with pytest.raises(EngineStarted):
            nv.load(None, isolate=isolate)


_LOAD_AT_TOP_LEVEL = r"""
import multiprocessing as mp
import sys

import nnvllm as nv

if mp.current_process().name == "MainProcess":
    child = mp.get_context("spawn").Process(target=print)  # as vLLM starts its engine core on a GPU
    child.start()
    child.join()
    sys.exit(child.exitcode)
nv.load(sys.argv[1])  # what the child runs while it imports this script: no main guard
"""


def test_a_load_in_a_process_being_started_says_to_add_a_main_guard(tmp_path):
    """A script that calls nv.load at its top level, in a process started by spawn (vLLM's engine
    core on a GPU imports the script again): the load is refused, naming the fix, instead of a
    second engine start whose failure the parent sees only as "engine core initialization failed"."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(_LOAD_AT_TOP_LEVEL)
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, str(script), str(tmp_path / "no-such-checkpoint")], capture_output=True,
                         text=True, timeout=300, env=env, cwd=tmp_path)
    assert out.returncode != 0
    assert "nv.load ran while a new process was starting" in out.stderr, out.stderr[-3000:]
    assert 'if __name__ == "__main__":' in out.stderr


def _bin_checkpoint(d: Path) -> str:
    path = _checkpoint(d, weights=False)
    (d / "pytorch_model.bin").write_bytes(b"")  # only its name is looked at before the engine starts
    return path


@pytest.mark.parametrize("row", VALID_LOADS, ids=[r[0] for r in VALID_LOADS])
def test_valid_load_passes_the_checks(no_engine, tmp_path, row):
    _, make, kwargs = row
    model = None if make is None else make(tmp_path / "ckpt")
    kwargs = {"isolate": False, **kwargs}
    with pytest.raises(EngineStarted):
        nv.load(model, **kwargs)
    (_, args), = no_engine
    for k, v in kwargs.items():
        if k == "compilation_config":  # the mode is nnvllm's to set: the rest goes on without it
            assert args[k] == {c: x for c, x in v.items() if c != "mode"}
        elif k != "isolate":
            assert args[k] == v and type(args[k]) is (int if k == "tensor_parallel_size" else type(v))  # normalised


# ---------------------------------------------------------------- patch and logit_lens on a live engine


@pytest.fixture(scope="module")
def toy_engine(toy_path):
    model = shared_engine(toy_path, 1, isolate=False)  # conftest.SHARED_ENGINE_FILES
    before = nv.generate(model, CLEAN, max_tokens=2).text[0]
    assert before.startswith(" Paris")
    yield model, before


def _patch(**kw):
    args = {"clean": CLEAN, "corrupt": CORRUPT, "answer": " Paris", "wrong": " Rome", "progress": False, **kw}
    return lambda model: nv.patch(model, **args)


def _lens(prompt, **kw):
    return lambda model: nv.logit_lens(model, prompt, max_tokens=1, **kw)


def _generate(**kw):
    return lambda model: nv.generate(model, kw.pop("prompts", CLEAN), **{"max_tokens": 2, **kw})


def _steer(**kw):
    return nv.Edit.add(torch.ones(64), layers=0, **kw)  # the toy's d_model is 64


N_PROMPT = 5  # tokens in CLEAN / CORRUPT for the toy tokenizer (checked below)
MAX_STEP = TOY_CONTEXT - N_PROMPT - 1

# (id, the call, the exception, substrings of its message)
ENGINE_ROWS = [
    ("patch answer=-1", _patch(answer=-1), ValueError, ["answer=-1", f"0..{TOY_VOCAB - 1}"]),
    ("patch wrong=-1", _patch(wrong=-1), ValueError, ["wrong=-1", f"0..{TOY_VOCAB - 1}"]),
    ("patch answer=vocab", _patch(answer=TOY_VOCAB), ValueError, [f"answer={TOY_VOCAB}", f"0..{TOY_VOCAB - 1}"]),
    ("patch wrong=10**9", _patch(wrong=10**9), ValueError, ["wrong=1000000000", f"0..{TOY_VOCAB - 1}"]),
    ("patch answer=True", _patch(answer=True), TypeError, ["answer=True", "token"]),
    ("patch answer=None", _patch(answer=None), TypeError, ["answer=None", "token"]),
    ("patch answer=1.0", _patch(answer=1.0), TypeError, ["answer=1.0"]),
    ("patch answer==wrong", _patch(wrong=" Paris"), ValueError, ["same token"]),
    ("patch step=100", _patch(step=100), ValueError, ["step=100", f"expected step <= {MAX_STEP}"]),
    ("patch step=max+1", _patch(step=MAX_STEP + 1), ValueError, [f"step={MAX_STEP + 1}", f"step <= {MAX_STEP}"]),
    ("patch step=-1", _patch(step=-1), ValueError, ["step=-1", "int >= 0"]),
    ("patch step=1.5", _patch(step=1.5), TypeError, ["step=1.5", "int >= 0"]),
    ("patch step=True", _patch(step=True), TypeError, ["step=True"]),
    ("patch clean=''", _patch(clean=""), ValueError, ["clean=''"]),
    ("patch corrupt=None", _patch(corrupt=None), TypeError, ["corrupt=None"]),
    ("patch progress='no'", _patch(progress="no"), TypeError, ["progress='no'"]),
    ("lens prompt=''", _lens(""), ValueError, ["prompt=''", "non-empty"]),
    ("lens prompt=42", _lens(42), TypeError, ["prompt=42", "one prompt"]),
    ("lens prompt=None", _lens(None), TypeError, ["prompt=None"]),
    ("lens a list", _lens([CLEAN, CORRUPT]), TypeError, ["one prompt"]),
    ("lens top_k=10**6", _lens(CLEAN, top_k=10**6), ValueError, ["top_k=1000000", f"top_k <= {TOY_VOCAB}"]),
    ("lens layers=None", _lens(CLEAN, layers=None), ValueError, ["layers=None", "the logit lens reads block outputs"]),
    ("lens layers=[]", _lens(CLEAN, layers=[]), ValueError, ["layers=[]"]),
    ("generate top_k=vocab+1", _generate(top_k=TOY_VOCAB + 1), ValueError,
     [f"top_k={TOY_VOCAB + 1}", f"1 <= top_k <= {TOY_VOCAB}", f"vocabulary has {TOY_VOCAB} tokens"]),
    ("stream top_k=10**6", lambda model: nv.stream(model, CLEAN, top_k=10**6), ValueError, ["top_k=1000000"]),
    ("generate a seed list of the wrong length", _generate(seed=[1, 2]), ValueError,
     ["seed holds 2 seeds for 1 prompt(s)"]),
    # CLEAN is 5 tokens: with max_tokens=2 the forwards see positions 0..5 (the last token is never fed)
    ("edit positions=[500]", _generate(edits=[_steer(positions=[500])]), ValueError,
     ["edit positions=[500]", "[500] lie past the end", "positions 0..5"]),
    ("edit positions=[6], one past", _generate(edits=[_steer(positions=[6])]), ValueError, ["[6] lie past the end"]),
    ("edit positions past the end of the prompt it applies to",
     _generate(prompts=[CLEAN, CLEAN + " and more words here"], edits=[_steer(positions=[8], prompts=[0])]),
     ValueError, ["[8] lie past the end", "positions 0..5"]),
    ("reference of a missing folder", lambda model: nv.reference("/nonexistent", CLEAN), FileNotFoundError,
     ["path='/nonexistent': no such checkpoint directory"]),
    ("reference of a file", lambda model: nv.reference(__file__, CLEAN), ValueError, ["is a file; pass the model's"]),
    ("reference top_k=10**6", lambda model: nv.reference(nv.toy.path(), CLEAN, top_k=10**6), ValueError,
     ["top_k=1000000", f"top_k <= {TOY_VOCAB}"]),
    ("reference edit positions=[500]",
     lambda model: nv.reference(nv.toy.path(), CLEAN, max_tokens=2, edits=[_steer(positions=[500])]), ValueError,
     ["[500] lie past the end"]),
    ("a file as a dataset", lambda model: nv.Dataset(__file__), ValueError, ["is a file, not a dataset"]),
]


def test_the_toy_prompts_have_the_length_the_table_assumes(toy_engine):
    model, _ = toy_engine
    assert len(model.tokenizer.encode(CLEAN)) == len(model.tokenizer.encode(CORRUPT)) == N_PROMPT
    assert model.llm.llm_engine.model_config.max_model_len == TOY_CONTEXT
    assert model.llm.llm_engine.model_config.get_vocab_size() == TOY_VOCAB


@pytest.fixture
def generations(monkeypatch):
    """Count the generations that reach the engine (captures and streams of the in-process transport)."""
    from nnvllm.engine import transport

    count = []
    for name in ("capture", "stream"):
        real = getattr(transport.InProcessEngine, name)

        def counted(self, *a, _real=real, **k):
            count.append(1)
            return _real(self, *a, **k)

        monkeypatch.setattr(transport.InProcessEngine, name, counted)
    return count


@pytest.mark.parametrize("row", ENGINE_ROWS, ids=[r[0] for r in ENGINE_ROWS])
def test_bad_analysis_argument_is_refused_and_the_engine_lives_on(toy_engine, generations, row):
    model, before = toy_engine
    _, call, exc, needles = row
    with pytest.raises(exc) as info:
        call(model)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    assert generations == []  # refused before anything was generated
    assert nv.generate(model, CLEAN, max_tokens=2).text[0] == before


def test_the_edges_the_new_checks_let_through(toy_engine):
    """The last position a generation feeds, top_k = the vocabulary."""
    model, before = toy_engine
    plain = nv.generate(model, CLEAN, max_tokens=2, top_k=TOY_VOCAB, ignore_eos=True)
    assert plain.samples[0].top_ids.shape == (2, TOY_VOCAB)
    steered = nv.generate(model, CLEAN, max_tokens=2, ignore_eos=True, edits=[_steer(positions=[5])])
    assert torch.equal(steered.resid[0][:, :5], plain.resid[0][:, :5])  # the prompt rows: untouched
    assert not torch.equal(steered.resid[0][:, 5], plain.resid[0][:, 5])  # the fed-back token's row: edited
    assert nv.generate(model, CLEAN, max_tokens=2).text[0] == before


@pytest.mark.parametrize("kw,needle", [({"seed": "x"}, "seed='x'"), ({"layers": 99}, "layer=99"),
                                       ({"sites": ["bogus"]}, "unknown ['bogus']"),
                                       ({"memory_budget": 1}, "memory_budget=1 holds less than one request"),
                                       ({"top_k": 10**6}, "top_k=1000000"),
                                       ({"max_tokens": 10**6}, "max_tokens=1000000")])
def test_collect_leaves_no_dataset_behind_for_a_bad_argument(toy_engine, generations, tmp_path, kw, needle):
    """A refused collect writes nothing: the corrected call then collects into the same folder."""
    model, _ = toy_engine
    with pytest.raises((ValueError, TypeError), match=re.escape(needle)):
        nv.collect(model, [CLEAN, CORRUPT], tmp_path / "ds", **{"max_tokens": 2, "progress": False, **kw})
    assert not (tmp_path / "ds").exists() and generations == []
    ds = nv.collect(model, [CLEAN, CORRUPT], tmp_path / "ds", max_tokens=2, progress=False)
    assert ds.complete


def test_the_largest_step_and_edge_token_ids_still_run(toy_engine):
    """The checks let through what is valid: the last step that fits, ids 0 and vocab-1."""
    model, before = toy_engine
    res = nv.patch(model, CLEAN, CORRUPT, 0, TOY_VOCAB - 1, layers=[5], step=MAX_STEP, progress=False)
    assert res.positions == [N_PROMPT - 1 + MAX_STEP] and res.step == MAX_STEP
    assert nv.generate(model, CLEAN, max_tokens=2).text[0] == before


def test_the_toy_config_is_what_the_rows_copy():
    cfg = json.loads((Path(nv.toy.check()) / "config.json").read_text())
    assert cfg["vocab_size"] == TOY_VOCAB and cfg["n_positions"] == TOY_CONTEXT


def test_patch_warns_when_the_clean_prompt_does_not_prefer_the_answer(toy_engine):
    """No leading spaces: 'Paris'/'Rome' are other tokens, the clean prompt does not prefer 'Paris':
    the normalized effects would be meaningless, so nv.patch says so."""
    with pytest.warns(UserWarning, match="does not prefer"):
        nv.patch(toy_engine[0], "The capital of France is", "The capital of Italy is", "Paris", "Rome",
                 layers=[0], positions=[-1], progress=False)
