"""pytest's set-up for the notebooks under nbmake (``pytest --nbmake notebooks/``; ``make test`` runs them
beside ``tests/``).

A notebook whose kernel dies before it answers gets one more kernel. jupyter_client picks a kernel's
five TCP ports by binding port 0 and closing the socket, and the kernel binds them a moment later; in
a busy run another process (a test worker's vLLM engine, any outgoing connection) can take one of them
in between, and the kernel exits with ZMQ's "Address already in use" before any cell has run. A new
kernel gets new ports. A kernel that dies at start for another reason dies again, and the notebook
fails as it would have.
"""

from __future__ import annotations

import functools
import warnings

KERNEL_DIED = "Kernel died before replying to kernel_info"  # jupyter_client's words


def pytest_collection_modifyitems(items):
    for item in items:
        if getattr(item, "nbmake", False):  # nbmake's NotebookItem
            item.runtest = _a_second_kernel_if_the_first_dies(item.runtest, item.name)


def _a_second_kernel_if_the_first_dies(runtest, name: str):
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
