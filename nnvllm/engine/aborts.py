"""Calls an isolated engine's client gave up on (Ctrl-C in the notebook): the server cuts them.

The client sends each call with an id (:data:`~nnvllm.engine.procs.CALL_HEADER`); on Ctrl-C it
asks ``/v1/nnvllm/abort`` for that id. A capture or trace waiting for its requests notices (or
notices that the client's connection closed) within a quarter of a second, cancels the requests
(vLLM aborts each) and disarms the worker, as an in-process engine aborts its requests on Ctrl-C.
Standard library only at import.
"""

from __future__ import annotations

import asyncio
import time

from .procs import CALL_HEADER

__all__ = ["Calls", "ClientLeft", "while_client_waits"]


class ClientLeft(RuntimeError):
    """The client gave up on its call (Ctrl-C in the notebook: it asked /v1/nnvllm/abort, or closed
    its connection): the call's requests are cut, as an in-process engine aborts them."""


class Calls:
    """The running calls by the id their client sent (:data:`CALL_HEADER`), and the ids an abort named
    (kept a while: an abort may arrive before its call is under way)."""

    def __init__(self) -> None:
        self.running: dict[str, asyncio.Event] = {}
        self.aborted: dict[str, float] = {}

    def start(self, request) -> asyncio.Event:
        left = asyncio.Event()
        cid = request.headers.get(CALL_HEADER)
        if cid:
            self.running[cid] = left
            if self.aborted.pop(cid, None) is not None:
                left.set()
        return left

    def end(self, request) -> None:
        self.running.pop(request.headers.get(CALL_HEADER) or "", None)

    def abort(self, cid: str) -> bool:
        now = time.monotonic()
        self.aborted = {k: t for k, t in self.aborted.items() if now - t < 60}
        left = self.running.get(cid)
        if left is None:
            self.aborted[cid] = now
            return False
        left.set()
        return True


async def while_client_waits(request, left: asyncio.Event, awaitables) -> None:
    """Wait for ``awaitables`` (tasks or futures), returning at the first error; raise
    :class:`ClientLeft` as soon as the client gives up (``left`` set, or its connection closed;
    checked every 0.25 s), leaving them to the caller to cancel."""
    pending = set(awaitables)
    while pending:
        done, pending = await asyncio.wait(pending, timeout=0.25, return_when=asyncio.FIRST_EXCEPTION)
        if any(not t.cancelled() and t.exception() is not None for t in done):
            return
        if pending and (left.is_set() or await request.is_disconnected()):
            raise ClientLeft("the client gave up on the call")
