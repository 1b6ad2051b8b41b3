"""Shared fixtures: real vLLM engines (CPU build here) on the toy model and tiny random checkpoints.

Engines are module-scoped and closed after their module: vLLM's in-process engine holds a
process-wide distributed group, so one engine runs at a time.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_addoption(parser):
    parser.addoption("--tp", type=int, default=1, help="tensor-parallel size for engine tests (default 1)")


@pytest.fixture(scope="session")
def tp(request) -> int:
    return request.config.getoption("--tp")


def pytest_collection_modifyitems(config, items):
    tp = config.getoption("--tp")
    try:
        import torch

        cuda = torch.cuda.is_available()
    except Exception:
        cuda = False
    for item in items:
        if "tp" in item.keywords and tp < 2:
            item.add_marker(pytest.mark.skip(reason="TP-only test: run with --tp 2"))
        if "gpu" in item.keywords and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))


@pytest.fixture(scope="session")
def toy_path() -> str:
    import nnvllm as nv

    return nv.toy.check()


@pytest.fixture(scope="session")
def tiny_paths(tmp_path_factory) -> dict[str, str]:
    from nnvllm.testing import tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    return {k: tiny_checkpoint(k, root / k) for k in ("gpt2", "llama")}


def engine_kwargs(tp: int = 1, **kw) -> dict:
    """Engine arguments for fidelity tests: fp32 everywhere (vLLM runs fp32 checkpoints in half
    precision by default), and on a GPU a small memory share so engines load one after another."""
    import torch

    d = {"tensor_parallel_size": tp, "dtype": "float32"}
    if torch.cuda.is_available():
        d["gpu_memory_utilization"] = 0.3
    return {**d, **kw}


def _engine(path, tp):
    import nnvllm as nv

    return nv.load(path, **engine_kwargs(tp))


@pytest.fixture(scope="module")
def toy(toy_path, tp):
    model = _engine(toy_path, tp)
    yield model
    model.close()
