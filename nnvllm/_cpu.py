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

vLLM imports the worker class by its dotted name in every engine process, so it must live in an
importable module of the package: this one. Only used where CUDA is absent; on a GPU nnvllm uses
nnsight's ``VLLM`` unchanged.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch
from nnsight.modeling.vllm import VLLM
from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner
from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from .arch import untie_shared_modules
from ._worker import CaptureWorker, RecordingRunner

__all__ = ["CPUVLLM", "NNsightCPUWorker", "NNsightCPUModelRunner"]


class _UntiedCPURunner(CPUModelRunner):
    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        # Before nnsight builds its envoy tree over the model (NNsightGPUModelRunner.load_model).
        untie_shared_modules(self.get_model())


class NNsightCPUModelRunner(RecordingRunner, NNsightGPUModelRunner, _UntiedCPURunner):
    """nnsight's interleaving runner over vLLM's CPU model runner (adds no state).

    Also unties modules vLLM shares between blocks (see :func:`nnvllm.arch.untie_shared_modules`).
    """


class NNsightCPUWorker(CaptureWorker, NNsightGPUWorker, CPUWorker):
    """vLLM's CPU worker with nnsight's RPC methods (``collect_nnsight``, ``nnsight_register``, ...)."""

    def init_device(self) -> None:
        CPUWorker.init_device(self)
        runner = self.model_runner
        if type(runner) is not CPUModelRunner:
            raise NotImplementedError(
                f"nnvllm instruments vLLM's CPUModelRunner, but this worker built "
                f"{type(runner).__module__}.{type(runner).__name__}. "
                "Unset VLLM_USE_V2_MODEL_RUNNER to trace on CPU."
            )
        runner.__class__ = NNsightCPUModelRunner


class CPUVLLM(VLLM):
    """nnsight's ``VLLM`` for a machine with no accelerator: vLLM's CPU backend underneath."""

    _WORKER_CLS = f"{__name__}.NNsightCPUWorker"

    @staticmethod
    @contextlib.contextmanager
    def _meta_device():
        with VLLM._meta_device(), mock.patch.object(
            torch.accelerator, "empty_cache", lambda: None
        ), mock.patch.object(torch.accelerator, "synchronize", lambda *a, **k: None):
            yield
