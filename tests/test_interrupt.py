"""Ctrl-C during nv.generate (a notebook's stop button) leaves the engine answering (issue 15, item 0)."""

from __future__ import annotations

import faulthandler
import signal
import threading
import time

import pytest

import nnvllm as nv

PROMPTS = [f"The capital of {c} is" for c in list(nv.toy.CAPITALS)[:16]]


def _interrupt_then_check(model):
    expected = nv.generate(model, "The capital of France is", max_tokens=3).text
    faulthandler.dump_traceback_later(120, exit=True)  # a wedged engine fails the run instead of hanging it
    try:
        timer = threading.Timer(0.3, lambda: signal.raise_signal(signal.SIGINT))
        timer.start()
        t = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            nv.generate(model, PROMPTS * 8, max_tokens=58, ignore_eos=True)
        assert time.perf_counter() - t < 60
        again = nv.generate(model, "The capital of France is", max_tokens=3)
        assert again.text == expected
        assert again.resid[0].shape[1] == again.positions(0)
    finally:
        faulthandler.cancel_dump_traceback_later()


def test_interrupt_in_process(toy):
    _interrupt_then_check(toy)


@pytest.fixture(scope="module")
def isolated_toy(toy_path):
    model = nv.load(toy_path, isolate=True)
    yield model
    model.close()


def test_interrupt_isolated(isolated_toy):
    _interrupt_then_check(isolated_toy)
