"""What nnsight 0.8.1 needs to run on vLLM's CPU backend.

nnsight's ``VLLM`` fails on a machine without an accelerator in two places:

1. **Client**, while it builds the meta-device module tree: vLLM's ``DummyModelLoader.load_model``
   calls ``torch.accelerator.empty_cache()``, which raises "Cannot access accelerator device when
   none is available". nnsight's ``_meta_device`` only fakes ``torch.cuda.get_device_capability``.
   :class:`CPUVLLM` also makes ``torch.accelerator.empty_cache``/``synchronize`` no-ops while the
   tree is built (nothing runs on a device then, so there is nothing to empty or wait for).
2. **Worker**: nnsight names its ``NNsightGPUWorker`` (a subclass of vLLM's GPU ``Worker``) as the
   engine's ``worker_cls``, and that raises "Unsupported device type: cpu".
   :class:`NNsightCPUWorker` takes nnsight's worker methods and vLLM's ``CPUWorker``, and once the
   ``CPUModelRunner`` is built swaps its class to :class:`NNsightCPUModelRunner`, which inherits
   nnsight's runner (the interleaving) and vLLM's CPU runner (the device work), in that order.

vLLM imports the worker class by its dotted name in every engine process, so it lives in an
importable module of the package: :mod:`nnvllm.engine.worker.cpu`, kept apart because importing vLLM's CPU
worker patches ``torch.cuda`` for the whole process (this module is imported on every machine, as
the base of nnvllm's CPU model class). Only used where CUDA is absent; on a GPU nnvllm uses
nnsight's ``VLLM`` with :mod:`nnvllm.engine.worker.gpu`'s worker.
"""

from __future__ import annotations

import contextlib
import os
import re
from unittest import mock

import torch
from nnsight.modeling.vllm import VLLM

__all__ = ["BIND_ENV", "CPUVLLM", "bound_cores"]


BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def bound_cores(world_size: int) -> set[int] | None:
    """The cores ``VLLM_CPU_OMP_THREADS_BIND`` gives a one-rank CPU engine (``"0"``, ``"2-3"``,
    ``"0,2-3"``), or None where nnvllm leaves it to vLLM: unset, ``auto``, ``nobind``, one list a
    rank (``"0|1"``), or several ranks. Raises ValueError, saying what is expected, for a value that
    is not a core list or names cores this process may not use. Read by ``nv.load`` before an
    engine starts and by the engine's worker (:func:`nnvllm.engine.worker.cpu.bind_threads`)."""
    mask = os.environ.get(BIND_ENV, "auto").strip()
    if world_size != 1 or mask in ("", "auto", "nobind") or "|" in mask:
        return None
    cores: set[int] = set()
    for part in mask.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if m is None or int(m[2] or m[1]) < int(m[1]):
            cores = set()
            break
        cores.update(range(int(m[1]), int(m[2] or m[1]) + 1))
    if not cores:
        raise ValueError(f"{BIND_ENV}={mask!r}; expected core ids such as '0', '0-3' or '0,2-3' "
                         "(or 'auto', 'nobind')")
    allowed = os.sched_getaffinity(0)
    if not cores <= allowed:
        raise ValueError(f"{BIND_ENV}={mask!r} names cores {sorted(cores - allowed)} that this process may "
                         f"not use; it may use {sorted(allowed)}: name some of those (e.g. '{min(allowed)}'), "
                         "or unset it")
    return cores


class CPUVLLM(VLLM):
    """nnsight's ``VLLM`` for a machine with no accelerator: vLLM's CPU backend underneath."""

    _WORKER_CLS = "nnvllm.engine.worker.cpu.NNsightCPUWorker"  # imported only by CPU engine processes

    @staticmethod
    @contextlib.contextmanager
    def _meta_device():
        with VLLM._meta_device(), mock.patch.object(
            torch.accelerator, "empty_cache", lambda: None
        ), mock.patch.object(torch.accelerator, "synchronize", lambda *a, **k: None):
            yield
