"""RequestStream: one request's outputs as the event loop sees them (see ``AsyncEngine``).

Items the engine thread hands over for a request: a ``RequestOutput`` (merged into what the
reader has not taken yet), ``ACCEPTED`` (the engine took the add), or an exception (the add
failed, or the engine failed afterwards).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from specserve.engine.outputs import OutputMerger, RequestOutput

if TYPE_CHECKING:
    from specserve.engine.async_engine import AsyncEngine

ACCEPTED = object()  # item: the engine thread took the request


class RequestStream:
    """Async iterator over one request's outputs (deltas); the last one has ``finished`` set.

    The engine's deltas are merged while they wait (``OutputMerger``), so a reader that falls
    behind gets one output carrying everything it has not read yet: what the stream holds is
    bounded by what its client has not taken, never one queued object per engine step.

    Use it as ``async with stream:``; leaving the block (normally, by an exception or by task
    cancellation) before the final output aborts the request.
    """

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.request_id = request_id
        self._engine = engine
        self._pending = OutputMerger()
        self._error: BaseException | None = None
        self._wake = asyncio.Event()
        self._accepted_fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.finished = False
        self._closed = False

    @property
    def buffered_tokens(self) -> int:
        """Output tokens delivered by the engine and not yet read."""
        return self._pending.num_tokens

    def _put(self, item: Any) -> None:
        """Event loop only: an output (merged into what is pending), the acknowledgement of the
        add, or an exception (the add failed, or the engine failed afterwards)."""
        if item is ACCEPTED:
            if not self._accepted_fut.done():
                self._accepted_fut.set_result(None)
            return
        if isinstance(item, BaseException):
            if not self._accepted_fut.done():
                self._accepted_fut.set_exception(item)
            elif self._error is None:
                self._error = item
        else:
            self._pending.add(item)
        self._wake.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self._pending and self._error is None:
            self._wake.clear()
            await self._wake.wait()
        out = self._pending.take()
        if out is None:  # what was delivered has been read; then the error
            self.finished = True
            self.close()
            assert self._error is not None
            raise self._error
        if out.finished:
            self.finished = True
            self.close()
        return out

    async def _accepted(self) -> None:
        try:
            await self._accepted_fut
        except BaseException:
            self.finished = True
            self.close()
            raise

    def _forget_acceptance(self) -> None:
        """The add as a whole failed: nobody will await this acknowledgement any more."""
        fut = self._accepted_fut
        if fut.done():
            fut.exception()  # marks a failure as retrieved
        else:
            fut.cancel()

    def close(self) -> None:
        """Idempotent; aborts the request in the engine if it has not finished."""
        if self._closed:
            return
        self._closed = True
        self._engine._release(self.request_id, abort=not self.finished)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
