"""A notebook under nbmake whose kernel dies before it answers gets one more kernel.

tests/conftest.py applies it to the notebooks that ``make test`` runs beside ``tests/``, and
``-p notebook_kernels`` (with ``tests/`` on the path) to a run of the notebooks alone
(scripts/gpu_lane.sh's notebooks stage).

jupyter_client picks a kernel's five TCP ports by binding port 0 and closing the socket, and the
kernel binds them a moment later; in a busy run another process (a test worker's vLLM engine, any
outgoing connection) can take one of them in between, and the kernel exits with ZMQ's "Address
already in use" before any cell has run. A new kernel gets new ports. A kernel that dies at start for
another reason dies again, and the notebook fails as it would have.
"""

from __future__ import annotations

import functools
import warnings

KERNEL_DIED = "Kernel died before replying to kernel_info"  # jupyter_client's words


def a_second_kernel_if_the_first_dies(items) -> None:
    """Wrap each nbmake item's run among ``items`` (pytest's collected items)."""
    for item in items:
        if getattr(item, "nbmake", False):  # nbmake's NotebookItem
            item.runtest = _second_kernel(item.runtest, item.name)


def pytest_collection_modifyitems(items):  # as a plugin: pytest -p notebook_kernels
    a_second_kernel_if_the_first_dies(items)


def _second_kernel(runtest, name: str):
    @functools.wraps(runtest)
    def run():
        try:
            return runtest()
        except RuntimeError as err:
            if KERNEL_DIED not in str(err):
                raise
            warnings.warn(f"{name}: the kernel died before it answered; running the notebook in a new kernel",
                          stacklevel=1)
            return runtest()

    return run
