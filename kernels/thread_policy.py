"""How the C++ kernels' parallel regions wait, and which way is fastest on this machine.

The kernels run their regions on a pool of their own (kernels/csrc/pool.h): chunks claimed from
an atomic counter, the calling thread working too, a region done when its chunks are. What is
left to choose depends on the machine (cores, SMT, a VM's scheduler, what else runs there), so
it is measured, not fixed:

- ``spin_us``: how long an idle worker polls for the next region before it sleeps. Regions of
  one step come microseconds apart and steps about a millisecond apart; polling longer keeps a
  worker hot across steps but takes a core from whatever else wants it (a server's event loop).
- ``wait_us``: how long the caller polls for chunks still running elsewhere before it sleeps
  until they are done.
- ``openmp``: torch's OpenMP pool (a static split ending at a team barrier) instead: the old
  schedule, kept so that a measurement can compare against it in the same run.
- ``chunks``: the chunks per thread a projection is cut into (finer balance against more
  claims on one shared counter).
- ``threads``: the pool's team (the caller and ``threads - 1`` workers); 0, the default, follows
  ``torch.get_num_threads()``. A team of its own lets an engine run torch's own ops on one
  thread while the kernels run on several: after an elementwise op on a row of logits (49152
  floats: an OpenMP region), torch's workers spin for milliseconds (libgomp's default), taking
  a core from the pool's.

None of these changes a bit of any result; they only move time. ``SPECSERVE_THREAD_POLICY``
(``openmp`` or ``spin_us=N,wait_us=N,threads=N``) sets the policy for a process when the
extension loads, so a server can be run under one without code. Without it (and without
``--num-threads``) an engine chooses its setup at start-up by measurement
(kernels/thread_choice.py, specserve/engine/thread_setup.py); ``benchmarks/thread_policy.py``
measures policies end to end (in process, beside a waking thread, through the server).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from specserve.kernels import quant_ext

log = logging.getLogger(__name__)

ENV = "SPECSERVE_THREAD_POLICY"


@dataclass(frozen=True)
class ThreadPolicy:
    spin_us: int = 200  # an idle worker's poll before it sleeps (-1: never sleeps)
    wait_us: int = 50  # the caller's poll for running chunks before it sleeps (-1: never)
    openmp: bool = False  # torch's OpenMP static split instead of the pool
    threads: int = 0  # the pool's team; 0: torch.get_num_threads()
    chunks: int = 4  # chunks per thread of a projection

    def __post_init__(self) -> None:
        if self.spin_us < -1 or self.wait_us < -1:
            raise ValueError(f"spin_us and wait_us must be >= 0 microseconds or -1 (never "
                             f"sleep); got {self.spin_us}, {self.wait_us}")
        if not 0 <= self.threads <= 1024:
            raise ValueError(f"threads must be in 0..1024 (0: torch's number of threads); got "
                             f"{self.threads}")
        if not 1 <= self.chunks <= 64:
            raise ValueError(f"chunks (per thread) must be in 1..64; got {self.chunks}")

    @property
    def name(self) -> str:
        if self.openmp:
            return "openmp"
        extra = f",chunks={self.chunks}" if self.chunks != ThreadPolicy.chunks else ""
        extra += f",threads={self.threads}" if self.threads else ""
        return f"spin_us={self.spin_us},wait_us={self.wait_us}{extra}"

    @classmethod
    def parse(cls, text: str) -> ThreadPolicy:
        """``openmp`` or ``spin_us=N,wait_us=N,chunks=N,threads=N`` (any may be left out:
        the default)."""
        text = text.strip()
        if text == "openmp":
            return cls(openmp=True)
        fields: dict[str, int] = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            if not sep or key not in ("spin_us", "wait_us", "chunks", "threads"):
                raise ValueError(f"thread policy {text!r}: expected 'openmp' or "
                                 f"'spin_us=N,wait_us=N,threads=N' (got {part!r})")
            try:
                fields[key] = int(value)
            except ValueError:
                raise ValueError(f"thread policy {text!r}: {key} must be an integer "
                                 f"(got {value!r})") from None
        return cls(**fields)


DEFAULT = ThreadPolicy()


def apply(policy: ThreadPolicy) -> None:
    """Sets the policy for every later region of the process (no result changes)."""
    quant_ext.load().set_thread_policy(policy.spin_us, policy.wait_us, policy.openmp,
                                       policy.threads, policy.chunks)


def current() -> ThreadPolicy:
    spin_us, wait_us, openmp, threads, chunks = quant_ext.load().thread_policy()
    return ThreadPolicy(spin_us, wait_us, openmp, threads, chunks)


def in_force() -> ThreadPolicy:
    """``current()`` without loading the extension: before it has loaded, the policy it will
    load with (the environment's, else the default)."""
    if quant_ext.loaded():
        return current()
    try:
        return from_env() or DEFAULT
    except ValueError:
        return DEFAULT


def from_env() -> ThreadPolicy | None:
    """The policy ``SPECSERVE_THREAD_POLICY`` names, None when it is unset."""
    text = os.environ.get(ENV)
    if not text:
        return None
    try:
        return ThreadPolicy.parse(text)
    except ValueError as exc:
        raise ValueError(f"{ENV}: {exc}") from None


@contextlib.contextmanager
def event_loop_stand_in(period_s: float = 0.002, work_us: float = 50.0) -> Iterator[None]:
    """A thread that wakes every ``period_s`` and computes for about ``work_us`` (holding the
    GIL, as a server's event loop does when it sends a token): what a step meets in a server."""
    stop = threading.Event()

    def run() -> None:
        while not stop.wait(period_s):
            end = time.perf_counter() + work_us * 1e-6
            while time.perf_counter() < end:
                pass

    thread = threading.Thread(target=run, name="event-loop-stand-in", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
