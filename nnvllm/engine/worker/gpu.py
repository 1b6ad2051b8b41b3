"""nnsight's GPU worker, with the shared-module fix (:func:`nnvllm.arch.untie_shared_modules`).

vLLM imports this class by name in each engine process (``worker_cls``), so it lives in a module.
"""

from __future__ import annotations

from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner
from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from ...arch import untie_shared_modules
from .runner import CaptureWorker, RecordingRunner


class _UntiedGPURunner(GPUModelRunner):
    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        # Before nnsight builds its envoy tree over the model (NNsightGPUModelRunner.load_model).
        untie_shared_modules(self.get_model())


class NNsightUntiedGPUModelRunner(RecordingRunner, NNsightGPUModelRunner, _UntiedGPURunner):
    """nnsight's runner over a model whose shared stateless modules were copied per block, with
    nnvllm's recording taps (:class:`nnvllm.engine.worker.runner.RecordingRunner`)."""


class NNsightUntiedGPUWorker(CaptureWorker, NNsightGPUWorker):
    def init_device(self) -> None:
        super().init_device()  # checks the runner and installs NNsightGPUModelRunner
        self.model_runner.__class__ = NNsightUntiedGPUModelRunner
