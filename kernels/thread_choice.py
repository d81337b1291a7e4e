"""The thread setup the kernels run fastest under on this machine, measured on a step the caller
provides and cached: torch's thread count and the kernels' pool policy (team, wait times).

Why measure: the best setup differs per machine (cores, SMT, a VM's scheduler, what else runs
there) and per model, and through a server the step shares the cores with the event loop. On a
2-core VM, plain decoding through ``specserve serve`` ran twice as fast on one thread as on two
while the kernels' team waited at OpenMP barriers; the pool removes the barrier, but whether a
second thread then pays still depends on the machine.

Candidates (``candidates``), in the order the budget spends on them (the likeliest first):

- every core the process may run on as the pool's team, torch's own ops on one thread (the
  pool's team knob exists for this: torch's OpenMP workers, woken by an op on a vocabulary of
  logits, spin for milliseconds beside the pool's), the pool's default waits;
- the same team with torch's ops on it too (what an engine ran before this choice);
- one thread: no team, nothing to wait for (a machine whose cores are all taken by others);
- half the cores (4 or more): leaves a core to the event loop and SMT siblings unpaired;
- the full team with shorter (spin 50 us, wait 20 us) and longer (2 ms, 200 us) polls.

Not candidates: a worker that never sleeps (``spin_us=-1``) keeps a core busy for as long as a
server idles, whatever it measures; OpenMP's static split measured 5-10x slower beside a waking
thread on a shared 2-core VM (``benchmarks/thread_policy.py`` keeps it for comparison).

No pinning. Pinning the caller and each pool worker to a core of their own (sched_setaffinity
on their thread ids) measured no faster on this project's 2-core VM: 30.4 vs 30.4 ms a decode
step quiet, 30.2 vs 29.8 ms beside the waking thread (the machine loaded by other jobs), and
it can only lose where the cores are shared: a pinned worker cannot move off a core another
process (or the event loop) holds, and the pool already lets whichever thread runs take the
chunks. A VM's vCPUs are not fixed hardware cores either. So no candidate pins.

Timing: after two first steps on the first candidate (the first allocates, the second gives
the step's cost), rounds in which
every live candidate takes a turn (the order reversed every other round, so drift in the
machine's load falls on all alike) with one sample quiet and one beside
``thread_policy.event_loop_stand_in`` (a thread waking every 2 ms: the event loop's
stand-in), each ``steps`` steps after an untimed one (the first step after a switch wakes or
starts workers, and warms what that setup touches first). After the first round a candidate
slower than ``prune`` times the best (in either condition) is dropped. The cost of a
candidate is its quiet seconds over the best quiet plus its disturbed seconds over the best
disturbed (both weigh alike); the least cost wins. No setup changes a bit of any result
(pool.h), only time.

Budget: ``budget_s`` seconds of ``clock`` over the whole measurement (``DEFAULT_BUDGET_S``),
the tuner's rule (kernels/tuner.py): bounded start-up, work in order of value. Two first
steps (untimed by the budget: a step longer than the budget overruns it by those two) give the
step's cost, which sets ``steps`` so the planned rounds fit; a sample that would pass the
budget is not started. A choice from fewer rounds than planned is applied but not cached, so
a later start measures again within its own budget.

What the stand-in misses: through a server, each token also wakes the event loop, the
detokenizing thread and (in a benchmark) a client on the same cores, each for a few hundred
microseconds right after a step. On this project's 2-core VM, loaded by other jobs, the setup
chosen here (a team of 2, torch's ops on 1) ran plain decoding through ``specserve serve`` at
1.5x the old default (2 torch threads) but below ``--num-threads 1``; timing candidates on the
server's own step loop is the next step where that matters.

A team the user fixed (``--num-threads N``): the candidates of that team only
(``team_candidates``), so where torch's own ops run and the pool's waits are still measured.

A machine shared that moment: the measurement reads, from /proc, how much CPU other processes
(and a VM's steal) took while it ran. Above ``BUSY_CORES`` on average the choice is applied but
not cached: a choice cached under other jobs' load stayed after they ended (one thread, where
the quiet machine runs a team of two at 1.4x its speed).

Cache: ``<cache_dir>/threads-<sha of CPU, usable cores, torch, kernel build, the candidates and
the caller's key>.json``, beside the kernel table; a start that finds it applies it untimed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.kernels import quant_ext, thread_policy
from specserve.kernels.thread_policy import DEFAULT, ThreadPolicy, event_loop_stand_in

log = logging.getLogger(__name__)

DEFAULT_BUDGET_S = 4.0  # seconds of measuring at a first start; the module docstring says why
ROUNDS = 3  # timed rounds
MAX_STEPS = 10  # steps per sample at most (a fast step needs no more to rise above the clock)
_CONDITIONS = ("quiet", "busy")  # alone, and beside the event loop's stand-in


@dataclass(frozen=True)
class ThreadSetup:
    """torch's own thread count and the kernels' pool policy (``policy.threads`` 0: the pool's
    team is ``torch_threads``)."""

    torch_threads: int
    policy: ThreadPolicy = DEFAULT

    @property
    def team(self) -> int:
        return self.torch_threads if self.policy.openmp else (
            self.policy.threads or self.torch_threads)

    @property
    def name(self) -> str:
        """``threads 2, pool spin_us=200,wait_us=50`` (``(torch ops on 1)`` when torch's own
        ops run on fewer threads than the kernels' team)."""
        text = f"threads {self.team}"
        if self.team == 1:
            return text
        if self.torch_threads != self.team:
            text += f" (torch ops on {self.torch_threads})"
        return f"{text}, pool {dataclasses.replace(self.policy, threads=0).name}"

    def apply(self) -> None:
        """Sets torch's threads and, where the kernels' extension runs here, the pool's
        policy (a machine without it runs torch's kernels only)."""
        torch.set_num_threads(self.torch_threads)
        if quant_ext.available():
            thread_policy.apply(self.policy)

    @classmethod
    def current(cls) -> ThreadSetup:
        """The setup in force (loads nothing: see ``thread_policy.in_force``)."""
        return cls(torch.get_num_threads(), thread_policy.in_force())

    def to_json(self) -> dict:
        return {"torch_threads": self.torch_threads, "policy": dataclasses.asdict(self.policy)}

    @classmethod
    def from_json(cls, data: dict) -> ThreadSetup:
        return cls(int(data["torch_threads"]), ThreadPolicy(**data["policy"]))


@dataclass(frozen=True)
class ThreadChoice:
    """The setup an engine runs under and how it came to be (for the start-up log)."""

    setup: ThreadSetup
    how: str  # "chosen by measurement (cached)", "fixed by --num-threads 2", ...

    def describe(self) -> str:
        return f"{self.setup.name}, {self.how}"


def usable_cores() -> int:
    """The CPUs this process may run on (a container's or taskset's share, not the machine's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def candidates(cores: int) -> tuple[ThreadSetup, ...]:
    """What ``choose`` times on ``cores`` usable cores, the likeliest first (module docstring)."""
    if cores <= 1:
        return (ThreadSetup(1),)

    def team(n: int, **waits: int) -> ThreadSetup:
        return ThreadSetup(1, ThreadPolicy(threads=n, **waits))

    out = [team(cores), ThreadSetup(cores), ThreadSetup(1)]
    if cores >= 4:
        out.append(team(cores // 2))
    out += [team(cores, spin_us=50, wait_us=20), team(cores, spin_us=2000, wait_us=200)]
    return tuple(out)


def team_candidates(team: int) -> tuple[ThreadSetup, ...]:
    """The candidates of ``candidates`` whose team is ``team`` threads: where the user fixed
    the count (``--num-threads``), what is left to measure is where torch's own ops run (on
    one thread, or on the team) and the pool's waits."""
    if team <= 1:
        return (ThreadSetup(1),)
    return tuple(s for s in candidates(team) if s.team == team)


@dataclass(frozen=True)
class CpuSnapshot:
    """The machine's busy CPU time and this process's own, at one moment (``cpu_snapshot``)."""

    wall: float  # time.monotonic() seconds
    busy: float  # CPU seconds every process (and a VM's steal) has used since boot
    own: float  # CPU seconds this process has used


def cpu_snapshot() -> CpuSnapshot | None:
    """Now's ``CpuSnapshot`` from /proc, None where there is none to read."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user .. steal
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    idle = ticks[3] + ticks[4]  # idle, iowait
    own = int(fields[11]) + int(fields[12])  # utime, stime
    return CpuSnapshot(time.monotonic(), (sum(ticks) - idle) / hz, own / hz)


def others_cores(before: CpuSnapshot | None, after: CpuSnapshot | None) -> float | None:
    """Cores' worth of CPU that other processes (and the hypervisor's steal) took between two
    snapshots, on average; None when that cannot be told (no /proc, or under half a second,
    too short for the kernel's ticks)."""
    if before is None or after is None or after.wall - before.wall < 0.5:
        return None
    others = (after.busy - before.busy) - (after.own - before.own)
    return max(0.0, others / (after.wall - before.wall))


# A measurement during which other processes took more than this many cores' worth of CPU on
# average is applied but not cached: it chose for a machine shared that moment (a cached
# choice made under other agents' test runs picked one thread, 15.8 ms a decode step, where
# the quiet machine runs a team of two with torch's ops on one at 11 ms).
BUSY_CORES = 0.25


@dataclass
class Measurement:
    """Median seconds of one step per setup, quiet and disturbed (setups left out were pruned
    or never reached), and whether every planned round ran."""

    quiet: dict[ThreadSetup, float]
    busy: dict[ThreadSetup, float]
    complete: bool
    seconds: float  # of ``clock``, the whole measurement
    others: float | None = None  # cores other processes took meanwhile (``others_cores``)

    def costs(self) -> dict[ThreadSetup, float]:
        both = [s for s in self.quiet if s in self.busy]
        if not both:
            return {}
        q, b = min(self.quiet[s] for s in both), min(self.busy[s] for s in both)
        return {s: self.quiet[s] / q + self.busy[s] / b for s in both}


def measure(step: Callable[[], object], setups: tuple[ThreadSetup, ...], *,
            budget_s: float = DEFAULT_BUDGET_S, clock: Callable[[], float] = time.perf_counter,
            disturb: Callable[[], AbstractContextManager] = event_loop_stand_in,
            rounds: int = ROUNDS, prune: float = 2.0) -> Measurement:
    """Times ``step`` under every setup, quiet and within ``disturb()``, in ``budget_s`` seconds
    of ``clock`` (module docstring). The setup in force before is put back."""
    before = ThreadSetup.current()
    load_before = cpu_snapshot()
    start = clock()
    samples: dict[str, dict[ThreadSetup, list[float]]] = {c: {} for c in _CONDITIONS}
    live = list(setups)
    complete = True
    try:
        live[0].apply()
        step()  # first calls allocate
        t0 = clock()
        step()
        per_step = max(clock() - t0, 1e-9)
        planned = len(_CONDITIONS) * len(live) * rounds
        left = budget_s - (clock() - start)
        steps = int(min(MAX_STEPS, max(1, left / (planned * per_step) - 1)))
        for rnd in range(rounds):
            turns = [(s, c) for s in (live if rnd % 2 else live[::-1]) for c in _CONDITIONS]
            for setup, cond in turns:
                if clock() - start + (steps + 1) * per_step > budget_s:
                    complete = False
                    break
                setup.apply()
                with disturb() if cond == "busy" else contextlib.nullcontext():
                    step()  # the first step after a switch starts or wakes the workers
                    t0 = clock()
                    for _ in range(steps):
                        step()
                    per_step = max((clock() - t0) / steps, 1e-9)
                samples[cond].setdefault(setup, []).append(per_step)
            if not complete:
                break
            if rnd == 0:
                best = {c: min(v[0] for v in samples[c].values()) for c in _CONDITIONS}
                live = [s for s in live if all(samples[c][s][0] <= prune * best[c]
                                               for c in _CONDITIONS)]
    finally:
        before.apply()
    return Measurement({s: statistics.median(v) for s, v in samples["quiet"].items()},
                       {s: statistics.median(v) for s, v in samples["busy"].items()},
                       complete, clock() - start, others_cores(load_before, cpu_snapshot()))


def cache_path(cache_dir: Path, key: str, setups: tuple[ThreadSetup, ...]) -> Path:
    """Where the choice for ``key`` (the caller's model shape) among ``setups`` is kept on this
    machine."""
    from specserve.kernels.tuner import cpu_model

    full = "|".join([cpu_model(), str(usable_cores()), torch.__version__, quant_ext.build_key(),
                     ";".join(s.name for s in setups), key])
    return cache_dir / f"threads-{hashlib.sha256(full.encode()).hexdigest()[:20]}.json"


def choose(step: Callable[[], object], path: Path | None, setups: tuple[ThreadSetup, ...], *,
           budget_s: float = DEFAULT_BUDGET_S, clock: Callable[[], float] = time.perf_counter,
           disturb: Callable[[], AbstractContextManager] = event_loop_stand_in) -> ThreadChoice:
    """The cached choice at ``path`` if there is one, else the least-cost setup as measured
    (cached when the measurement completed); applied either way."""
    if path is not None:
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            cached = ThreadSetup.from_json(json.loads(path.read_text())["setup"])
            if cached in setups:
                cached.apply()
                return ThreadChoice(cached, "chosen by measurement (cached)")
    if len(setups) == 1:
        setups[0].apply()
        return ThreadChoice(setups[0], "the only candidate (1 usable core)")
    m = measure(step, setups, budget_s=budget_s, clock=clock, disturb=disturb)
    costs = m.costs()
    if not costs:  # the budget ran out before one candidate was timed both ways
        setups[0].apply()
        return ThreadChoice(setups[0], f"untimed: a {budget_s:g}s budget is less than a step "
                                       f"takes here (not cached)")
    best = min(costs, key=costs.__getitem__)
    best.apply()
    log.info("thread setups (cost relative to the best, quiet + disturbed): %s",
             {s.name: round(c, 3) for s, c in costs.items()})
    how = f"{len(costs)} of {len(setups)} candidates in {m.seconds:.1f}s"
    if not m.complete:
        return ThreadChoice(best, f"chosen by measurement ({how}, budget spent: not cached)")
    if m.others is not None and m.others > BUSY_CORES:
        return ThreadChoice(best, f"chosen by measurement ({how}; other processes took "
                                  f"{m.others:.2f} cores meanwhile: not cached)")
    if path is not None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps({
                "setup": best.to_json(), "seconds": m.seconds,
                "quiet": {s.name: t for s, t in m.quiet.items()},
                "busy": {s.name: t for s, t in m.busy.items()}}, indent=1))
            tmp.replace(path)
        except OSError as exc:
            log.warning("could not cache the thread setup at %s: %s", path, exc)
    return ThreadChoice(best, f"chosen by measurement ({how})")
