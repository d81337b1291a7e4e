"""Request deadlines: ``--request-timeout`` (server) and a request's own ``timeout`` field.

A request's deadline is its arrival time (the body read, or the WebSocket message received) plus
its ``timeout`` (seconds), or ``--request-timeout`` when the request names none. It covers every
phase: chat templating and tokenization, admission, queueing and generation.

- Before its sequences are admitted (``before_deadline``) the wait is cancelled, which aborts
  whatever was already handed to the engine; the client gets a 408 in OpenAI's error shape.
- Once they run (``DeadlineTimer``), a loop timer aborts them in the engine, so their KV blocks
  return to the pool at the engine's next step even if the client is not reading. Each stream
  still ends with its final output (``finish_reason: "abort"``); then the consumer raises
  ``RequestTimeoutError``: a 408 for a non-streaming request, an error event before ``[DONE]``
  on SSE, an "error" message on the WebSocket.

The timer runs on the event loop (``loop.call_at``), so it needs no engine-thread code.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from specserve.engine.outputs import RequestOutput

T = TypeVar("T")


class RequestTimeoutError(RuntimeError):
    """The request passed its deadline and was aborted (HTTP 408, code ``request_timeout``)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            f"the request passed its deadline of {timeout_s:g} s and was aborted "
            "(finish_reason \"abort\"); send a larger `timeout` or raise --request-timeout")
        self.timeout_s = timeout_s


class Deadline:
    """A loop-time deadline (``loop.time()`` is monotonic) with the timeout it came from."""

    def __init__(self, timeout_s: float, arrival: float | None = None) -> None:
        loop = asyncio.get_running_loop()
        self.timeout_s = timeout_s
        self.at = (loop.time() if arrival is None else arrival) + timeout_s
        self.expired = False

    @staticmethod
    def of(request_timeout: float | None, server_timeout: float | None,
           arrival: float) -> Deadline | None:
        """The request's own timeout wins over the server's; None when neither is set."""
        timeout = request_timeout if request_timeout is not None else server_timeout
        return None if timeout is None else Deadline(timeout, arrival)

    def cut(self, out: RequestOutput) -> bool:
        """Whether this final output was cut short by the deadline (not finished on its own
        while the abort was on its way)."""
        return self.expired and out.finish_reason == "abort"

    def error(self) -> RequestTimeoutError:
        return RequestTimeoutError(self.timeout_s)


async def before_deadline(deadline: Deadline | None, work: Awaitable[T],
                          on_expiry: Callable[[], None]) -> T:
    """Awaits ``work``; past the deadline it is cancelled (its own cleanup aborts what it
    started), ``on_expiry`` runs once and ``RequestTimeoutError`` is raised."""
    if deadline is None:
        return await work
    try:
        async with asyncio.timeout_at(deadline.at):
            return await work
    except TimeoutError:
        if not deadline.expired:
            deadline.expired = True
            on_expiry()
        raise deadline.error() from None


class DeadlineTimer:
    """Calls ``abort`` once at the deadline unless ``cancel`` comes first.
    ``fired`` says the deadline passed while the streams ran; whether it cut anything short is
    for the caller to read from the final outputs (a stream may finish on its own meanwhile)."""

    def __init__(self, deadline: Deadline | None, abort: Callable[[], object]) -> None:
        self.deadline = deadline
        self._abort = abort
        self._handle: asyncio.TimerHandle | None = None
        if deadline is not None:
            self._handle = asyncio.get_running_loop().call_at(deadline.at, self._fire)

    @property
    def fired(self) -> bool:
        return self.deadline is not None and self.deadline.expired

    def _fire(self) -> None:
        assert self.deadline is not None
        self.deadline.expired = True
        self._abort()

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
