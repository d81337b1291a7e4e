"""Span tracing of engine phases, for latency attribution and Chrome / Perfetto traces.

The engine holds a tracer (``LLMEngine.tracer``); by default it is a ``NullTracer`` whose
``span`` returns one shared do-nothing context manager, so instrumented code pays a method call
per span and nothing else. ``benchmarks/attribution.py`` swaps in a recording ``Tracer``.

Events are "complete" events of the Trace Event Format: name, start, duration, thread, args.
Timestamps are ``time.perf_counter()`` seconds, the clock ``SequenceTimings`` uses, so spans
line up with request timings and with a client running in the same process.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpanEvent:
    name: str
    start: float  # perf_counter seconds
    end: float
    tid: int
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def duration(self) -> float:
        return self.end - self.start


class NullTracer:
    """Records nothing; the default."""

    enabled = False

    def __init__(self) -> None:
        self._null = contextlib.nullcontext()

    def span(self, name: str, **args: Any) -> contextlib.AbstractContextManager[None]:
        return self._null

    def begin(self, name: str, **args: Any) -> None:
        pass

    def end(self) -> None:
        pass

    def add(self, name: str, start: float, end: float, **args: Any) -> None:
        pass


class Tracer:
    """Records spans from any thread. ``begin`` / ``end`` pair per thread (a stack), for
    callbacks that cannot wrap the code they time (torch module hooks)."""

    enabled = True

    def __init__(self) -> None:
        self.events: list[SpanEvent] = []  # list.append is atomic: no lock needed
        self._open = threading.local()

    @contextlib.contextmanager
    def span(self, name: str, **args: Any) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, start, time.perf_counter(), **args)

    def begin(self, name: str, **args: Any) -> None:
        stack = getattr(self._open, "stack", None)
        if stack is None:
            stack = self._open.stack = []
        stack.append((name, time.perf_counter(), args))

    def end(self) -> None:
        stack = getattr(self._open, "stack", None)
        if stack:
            name, start, args = stack.pop()
            self.add(name, start, time.perf_counter(), **args)

    def add(self, name: str, start: float, end: float, **args: Any) -> None:
        self.events.append(SpanEvent(name, start, end, threading.get_ident(), args))

    def clear(self) -> None:
        self.events.clear()

    def chrome_trace(
        self, extra: list[SpanEvent] | None = None, thread_names: dict[int, str] | None = None
    ) -> dict[str, Any]:
        """The Trace Event Format document ({"traceEvents": [...]}, microseconds from the first
        event) that chrome://tracing and ui.perfetto.dev open."""
        events = sorted([*self.events, *(extra or [])], key=lambda e: (e.start, -e.end))
        origin = events[0].start if events else 0.0
        pid = os.getpid()
        out: list[dict[str, Any]] = [
            {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": name}}
            for tid, name in (thread_names or {}).items()
        ]
        for e in events:
            out.append({
                "name": e.name, "ph": "X", "pid": pid, "tid": e.tid,
                "ts": round((e.start - origin) * 1e6, 3),
                "dur": round(max(e.duration, 0.0) * 1e6, 3),
                "args": {k: _jsonable(v) for k, v in e.args.items()},
            })
        return {"traceEvents": out, "displayTimeUnit": "ms"}


def _jsonable(value: Any) -> Any:
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)
