"""Ctrl-C during nv.generate (a notebook's stop button) leaves the engine answering.

The isolated engine's case is test_isolated.py::test_interrupt_isolated (on that file's engine)."""

from __future__ import annotations

import faulthandler
import signal
import threading
import time

import pytest

import nnvllm as nv
from conftest import shared_engine

PROMPTS = [f"The capital of {c} is" for c in list(nv.toy.CAPITALS)[:16]]


def _sigint_when(busy, delay: float = 0.0) -> threading.Thread:
    """SIGINT this process once ``busy()`` says requests are in flight (then ``delay`` later)."""
    def run():
        deadline = time.time() + 60
        while not busy() and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(delay)
        signal.raise_signal(signal.SIGINT)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _interrupt_then_check(model, busy, delay=0.0):
    expected = nv.generate(model, "The capital of France is", max_tokens=3).text
    faulthandler.dump_traceback_later(120, exit=True)  # a wedged engine fails the run instead of hanging it
    try:
        t = time.perf_counter()
        with pytest.raises(KeyboardInterrupt) as stopped:
            _sigint_when(busy, delay)
            nv.generate(model, PROMPTS * 16, max_tokens=58, ignore_eos=True)
        assert time.perf_counter() - t < 60
        # A notebook shows a stop the user asked for as one line (IPython's _render_traceback_).
        shown = stopped.value._render_traceback_()
        assert len(shown) == 1 and "engine is ready" in shown[0], shown
        again = nv.generate(model, "The capital of France is", max_tokens=3)
        assert again.text == expected
        assert again.resid[0].shape[1] == again.positions(0)
    finally:
        faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def in_process_toy(toy_path):
    # on a GPU the default is isolated; engines shared: conftest.SHARED_ENGINE_FILES
    return shared_engine(toy_path, 1, isolate=False)


def test_interrupt_in_process(in_process_toy):
    # In-process, the engine is in this process: interrupt once it holds the batch's requests.
    toy = in_process_toy
    _interrupt_then_check(toy, lambda: toy.llm.llm_engine.get_num_unfinished_requests() > 100)
