"""nnvllm's engine worker for vLLM's CPU backend (see :mod:`nnvllm.engine.cpu` for why it exists).

vLLM imports the worker class by its dotted name in every engine process. Importing this module
imports vLLM's CPU worker, whose ``cpu/shm.py`` replaces ``torch.cuda.Stream``, ``Event``,
``current_stream`` and ``Tensor.pin_memory`` with placeholders for the whole process: it must never
be imported where CUDA runs (seen on an H200: every nnsight trace then killed the engine core with
"expected stream to be a torch.Stream"). Only :data:`nnvllm.engine.cpu.CPUVLLM` names it, and only a
CPU engine loads it.
"""

from __future__ import annotations

from nnsight.modeling.vllm.model_runners.GPUModelRunner import NNsightGPUModelRunner
from nnsight.modeling.vllm.workers.GPUWorker import NNsightGPUWorker
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker

from ..compat import shorter_busy_loop
from .runner import CaptureWorker, RecordingRunner
from ...arch import untie_shared_modules

__all__ = ["NNsightCPUWorker", "NNsightCPUModelRunner"]

# This worker's reads of the executor's broadcast: vLLM imports this module (the worker class) before
# it creates the worker's message queues.
shorter_busy_loop()


def bind_threads(world_size: int) -> None:
    """Honour ``VLLM_CPU_OMP_THREADS_BIND`` in a one-rank engine (:func:`nnvllm.engine.cpu.bound_cores`).

    vLLM's CPU backend binds a worker's OpenMP threads only when its multiprocess executor starts the
    worker (it sets ``OMP_PLACES`` and ``OMP_NUM_THREADS`` for the new process); a one-rank engine
    runs its worker inside the engine core, where the variable is then silently ignored and torch
    computes with a thread on every core. Two engines that were each to have one core of the 2-core
    box then ran on both, their OpenMP threads spinning against each other: 128 prompts took 0.7-5.8 s
    a call side by side against 0.45 s alone. Here the worker's process takes the named cores and as
    many torch threads; threads it starts later inherit them.
    """
    import os

    import torch

    from ..cpu import bound_cores

    cores = bound_cores(world_size)
    if cores is not None:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(len(cores))


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
        from ..compat import bind_stores_to_loopback

        bind_stores_to_loopback()  # vLLM's torch.distributed store: loopback only (see there)
        bind_threads(self.parallel_config.world_size)  # before CPUWorker makes torch.set_num_threads a no-op
        CPUWorker.init_device(self)
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op that logs a warning, and its
        # request renderer calls it for every request: in an in-process engine that is a warning per
        # nv.generate in the notebook. The same no-op, silent.
        import torch

        if getattr(torch.set_num_threads, "__name__", "") == "skip_set_num_threads":
            torch.set_num_threads = lambda n: None
        runner = self.model_runner
        if type(runner) is not CPUModelRunner:
            raise NotImplementedError(
                f"nnvllm instruments vLLM's CPUModelRunner, but this worker built "
                f"{type(runner).__module__}.{type(runner).__name__}. "
                "Unset VLLM_USE_V2_MODEL_RUNNER to trace on CPU."
            )
        runner.__class__ = NNsightCPUModelRunner
