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
extension loads, so a server can be run under one without code; ``choose`` times the
candidates on a step the caller provides, with and without a thread that wakes every few
milliseconds (the event loop's stand-in), and caches the choice per machine. An engine at
start-up would call ``choose(lambda: <a one-token decode forward of its model>, cache_root() /
"tune", <the model's shape>)`` once its kernels are tuned; ``benchmarks/thread_policy.py``
measures the same choice end to end (in process, beside a waking thread, through the server).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

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
# What ``choose`` times: never sleeping, a short and a long poll, and OpenMP for reference.
CANDIDATES = (
    ThreadPolicy(spin_us=-1, wait_us=-1),
    ThreadPolicy(spin_us=50, wait_us=20),
    DEFAULT,
    ThreadPolicy(spin_us=2000, wait_us=200),
    ThreadPolicy(openmp=True),
)


def apply(policy: ThreadPolicy) -> None:
    """Sets the policy for every later region of the process (no result changes)."""
    quant_ext.load().set_thread_policy(policy.spin_us, policy.wait_us, policy.openmp,
                                       policy.threads, policy.chunks)


def current() -> ThreadPolicy:
    spin_us, wait_us, openmp, threads, chunks = quant_ext.load().thread_policy()
    return ThreadPolicy(spin_us, wait_us, openmp, threads, chunks)


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


def time_policies(step: Callable[[], object], policies: tuple[ThreadPolicy, ...] = CANDIDATES,
                  rounds: int = 5, steps: int = 10, disturbed: bool = True,
                  prune: float = 2.0) -> dict[ThreadPolicy, float]:
    """Per policy, the median seconds of one ``step()`` over ``rounds`` rounds of ``steps``
    steps, the policies taking turns round by round (so drift in the machine's load falls on
    all of them alike); ``disturbed``: with ``event_loop_stand_in`` running. A policy slower
    than ``prune`` times the best in the first timed round is not timed again (an OpenMP
    barrier on a busy machine can cost 10x: its one round says enough). The policy in force
    before is put back."""
    before = current()
    samples: dict[ThreadPolicy, list[float]] = {p: [] for p in policies}
    live = list(policies)
    guard = event_loop_stand_in() if disturbed else contextlib.nullcontext()
    try:
        with guard:
            for rnd in range(rounds + 1):
                for policy in live if rnd % 2 else live[::-1]:
                    apply(policy)
                    step()  # the first step after a switch starts or wakes the workers
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        step()
                    if rnd:  # round 0 warms up
                        samples[policy].append((time.perf_counter() - t0) / steps)
                if rnd == 1:
                    fastest = min(samples[p][0] for p in live)
                    live = [p for p in live if samples[p][0] <= prune * fastest]
    finally:
        apply(before)
    return {p: statistics.median(s) for p, s in samples.items()}


def choose(step: Callable[[], object], cache_dir: Path | None, key: str,
           policies: tuple[ThreadPolicy, ...] = CANDIDATES) -> ThreadPolicy:
    """The policy with the least cost over a quiet and a disturbed timing of ``step`` (each
    relative to its best policy, so both weigh alike), applied and cached under ``cache_dir``
    per CPU, torch threads, extension build and the caller's ``key`` (the model's shape)."""
    from specserve.kernels.tuner import cpu_model

    full_key = "|".join([cpu_model(), str(os.cpu_count()), str(torch.get_num_threads()),
                         quant_ext.build_key(), key])
    path = None
    if cache_dir is not None:
        path = cache_dir / f"threads-{hashlib.sha256(full_key.encode()).hexdigest()[:20]}.json"
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            cached = ThreadPolicy(**json.loads(path.read_text())["policy"])
            apply(cached)
            return cached
    quiet = time_policies(step, policies, disturbed=False)
    busy = time_policies(step, policies, disturbed=True)
    cost = {p: quiet[p] / min(quiet.values()) + busy[p] / min(busy.values()) for p in policies}
    best = min(cost, key=cost.__getitem__)
    log.info("thread policy %s (cost relative to the best, quiet + disturbed: %s)", best.name,
             {p.name: round(c, 3) for p, c in cost.items()})
    apply(best)
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"policy": asdict(best),
                                       "cost": {p.name: c for p, c in cost.items()}}))
            tmp.replace(path)
        except OSError as exc:
            log.warning("could not cache the thread policy at %s: %s", path, exc)
    return best
