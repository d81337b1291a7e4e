"""Kernel tuner: times the candidate implementations of each projection shape at the row counts
the engine will run, keeps the fastest, and caches the table per machine.

Groups: the model's projections grouped by (kind, format or dtype, N, K); the 30 qkv projections
of a 30-layer model are one group. Each candidate is timed over up to ``modules_per_group``
modules of its group in turn, candidates interleaved, the median of ``repeats`` kept (two
for a shape whose passes take seconds: ``time_candidates``). Every
timed pass meets the weights where a forward does: in memory when the model's weights exceed
the last-level cache (their cache lines flushed first: ``cache_evictor``), else cached.

Candidates: for dense float projections the entries of ``specserve.kernels.linear.DENSE_KERNELS``;
for block-quantized ones every instruction-set form this CPU runs (AVX2, AVX-VNNI, AVX-512 VNNI,
AMX-INT8) times the rows each unpacked weight block is shared by (1, 2, 4, 8; 16 for AVX-512;
16 only for AMX's tiles), named "<isa>/<rows>"; the numbers are identical, only the speed
differs. The table also gives the
measured cost of all projections of one forward per row count (``projection_seconds``), which
the speculation policy uses to price steps it has not measured yet.

Budget: one tuner stops timing after ``budget_s`` seconds of wall time (``DEFAULT_BUDGET_S``), so
a first start on a slow or busy machine ends in bounded time. The work runs in order of value:
the fewest rows first (a decode, then the verifies, then ever larger batches), and within a row
count the smallest group of each form family (kind, format or dtype, K) first. A shape the
budget leaves untimed takes the choice measured at the same row count for a group of its family,
when there is one, else the untuned default (``DEFAULT_CHOICE``: what ``--no-kernel-tuning``
runs). Only the speed may differ: block forms give identical bits, dense candidates agree to
float rounding. The table records which entries were not timed (``GroupResult.fallback``), a
log line says how many, and a later start times them within its own budget.

Sharing a family's choice rests on a measurement, not an assumption: on this project's AVX2 CPU
(AMD EPYC, Zen 3), a choice taken from another group of the same family, judged on an
independent tuning run's timings, cost 1.046x that run's fastest candidate; the group's own
choice 1.043x, the untuned default 1.036x (the ranking there is flat and noisy: 308 comparisons
over two full tables of the default model). CPUs with more forms (VNNI, AVX-512) have not been
measured here: there a same-family choice is a measured guess for the same K and rows, the
default an unmeasured one, and a later start replaces both with the shape's own timing.

Why 60 seconds, and not a figure fitted to one CPU: the budget bounds what a user waits, once
per machine and model shape (the table is cached; a later start finishes the rest), and is set
beside what a first start costs anyway (converting a GGUF, compiling the extension: tens of
seconds). It is a cap, not a target: the default 135M model's 70 shapes took 9-15 s of kernel
calls (plus ~10 s of cache evictions) in three tables recorded on this project's 2-core machine,
while a 0.5B model on a busy one took 4 min. Since the work is ordered by value, whatever the
CPU's speed or load the budget buys the shapes a batch-1 decode and verify run first; a slower
or busier CPU leaves more of the large batches to a later start.

Deadline: an engine also gives its tuners the start's own deadline (specserve/engine/assembly.py),
so that what the start did before them counts: on the first start of a machine the C++ build
(~37 s on 2 cores, beside the model's reading) and the 0.5B file's tuning (~37 s) came one after
the other, 85.8 s to ready against the 60 s a user is promised. Past the deadline a tuner still
times for ``MIN_BUDGET_S``, which buys the decode and verify shapes (1-5 rows: ~5 s on that
file); the larger batches then run a same-family or the default choice (1.046x / 1.036x the
fastest, above) until a later start times them.

Cache: ``$SPECSERVE_CACHE_DIR/tune/<sha of CPU model, torch version, threads, model>.json``,
and beside it every shape's timings (``shapes-<sha of the machine key>.json``: tune_table.py's
``ShapeStore``), so a shape already timed on this machine, for any model or engine
configuration, is read instead of timed (and spends none of the budget).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import nn

from specserve.kernels import quant_ext
from specserve.kernels.linear import DENSE_KERNELS, DenseLinear, RowPlan
from specserve.kernels.quant import P5_MAX_ROWS, BlockQuantLinear
from specserve.kernels.tune_table import FORMAT, GroupResult, ShapeStore, TuneTable

log = logging.getLogger(__name__)

DEFAULT_BUDGET_S = 60.0  # seconds of timing per tuner; the module docstring says why
MIN_BUDGET_S = 5.0  # timing a start's deadline leaves at least (the decode and verify shapes)
# What a shape runs untuned, by kind: every CPU the kernels run on has AVX2.
DEFAULT_CHOICE = {"block": "avx2/4", "dense": "linear"}
# Rounds of a shape whose timed passes already took LONG_SHAPE_S (time_candidates says why).
MIN_REPEATS = 2
LONG_SHAPE_S = 1.0


def cpu_model() -> str:
    """The CPU as the tuner keys its cache and reports name it: the model name plus family, model
    and the widest int8 dot-product unit, since a VM's model name ("AMD EPYC") alone names
    several generations whose fastest kernels differ."""
    try:
        fields: dict[str, str] = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            if key in ("model name", "cpu family", "model", "flags") and key not in fields:
                fields[key] = value.strip()
            if line.strip() == "":
                break  # the first processor is enough
        name = fields.get("model name")
        if name:
            flags = set(fields.get("flags", "").split())
            unit = next((f for f in ("amx_int8", "avx512_vnni", "avx_vnni", "avx2") if f in flags),
                        "no avx2")
            return (f"{name} (family {fields.get('cpu family', '?')}, model "
                    f"{fields.get('model', '?')}, {unit})")
    except OSError:
        pass
    return platform.processor() or platform.machine()


# Above this many rows a step's choice is the largest measured count's: timing 3 candidates at
# hundreds of rows over every shape would take a minute of start-up for little gain.
_MAX_TUNED_ROWS = 128


def default_row_counts(k_max: int, max_num_seqs: int, max_batched: int) -> list[int]:
    """Verify rows 1..k_max+1, then decode/verify batch sizes up to the step's token cap."""
    counts = set(range(1, k_max + 2))
    r = 8
    while r <= min(max_batched, max(max_num_seqs * (k_max + 1), 8), _MAX_TUNED_ROWS):
        counts.update((r, r + r // 2))
        r *= 2
    return sorted(c for c in counts if c <= min(max_batched, _MAX_TUNED_ROWS))


def _signature(module: nn.Module) -> str | None:
    """The module's tuning group; None for what has nothing to choose between (a block layer
    without the C++ kernels runs its one dense fallback)."""
    if isinstance(module, BlockQuantLinear):
        if not module.has_kernel or not quant_ext.supported_isas():
            return None
        fmt = f"{module.fmt}+p5" if module.five_bit else module.fmt  # more candidates
        return f"block:{fmt}:{module.out_features}x{module.in_features}"
    if isinstance(module, DenseLinear):
        n, k = module.weight.shape
        return f"dense:{str(module.weight.dtype).removeprefix('torch.')}:{n}x{k}"
    return None


def form_family(sig: str) -> str:
    """The group's kind, format or dtype and K (``block:q4_1:960x576`` -> ``block:q4_1:576``):
    groups that differ only in N run the same candidates over the same inner loop."""
    head, _, shape = sig.rpartition(":")
    return f"{head}:{shape.partition('x')[2]}"


def _group_size(sig: str) -> int:
    n, _, k = sig.rpartition(":")[2].partition("x")
    return int(n) * int(k)


def work_order(groups: Iterable[str], row_counts: Iterable[int]) -> list[tuple[str, int]]:
    """Every (group, rows) shape in the order the budget spends on them: the fewest rows first;
    within a row count, the smallest group of each form family first (its choice then stands in
    for its family if the budget ends), then the rest, smallest first."""
    by_size = sorted(groups, key=lambda sig: (_group_size(sig), sig))
    firsts: dict[str, str] = {}
    for sig in by_size:
        firsts.setdefault(form_family(sig), sig)
    order = list(firsts.values()) + [sig for sig in by_size if sig not in firsts.values()]
    return [(sig, rows) for rows in sorted(set(row_counts)) for sig in order]


def projection_params(groups: dict[str, list[nn.Module]]) -> int:
    """The weights (elements) of every projection in ``groups``: the model's size as its
    kernels see it."""
    return sum(_group_size(sig) * len(mods) for sig, mods in groups.items())


def shapes_key(groups: dict[str, list[nn.Module]]) -> str:
    """The projection shapes and how many modules of each: what a measurement of this model's
    kernels depends on besides the machine (not the weights)."""
    return ",".join(f"{sig}*{len(mods)}" for sig, mods in sorted(groups.items()))


def model_groups(model: nn.Module) -> dict[str, list[nn.Module]]:
    groups: dict[str, list[nn.Module]] = {}
    for module in model.modules():
        sig = _signature(module)
        if sig is None:
            continue
        device = module.qs.device if isinstance(module, BlockQuantLinear) else module.weight.device
        if device.type == "cpu":
            groups.setdefault(sig, []).append(module)
    return groups


def _candidates(module: nn.Module, x: torch.Tensor) -> dict[str, Callable[[], object]]:
    if isinstance(module, BlockQuantLinear):
        # Q8_F has no AVX-VNNI form of its own (its code runs AVX2's): not timed twice
        isas = quant_ext.supported_isas()
        if module.fmt == "q8_f":
            isas = tuple(i for i in isas if i != "avxvnni")
        if module.five_bit and x.shape[0] <= P5_MAX_ROWS:
            isas = (*isas, quant_ext.FIVE_BIT)
        codes = {f"{isa}/{r}": quant_ext.kernel_code(f"{isa}/{r}")
                 for isa in isas for r in quant_ext.ROWS_PER_PASS[isa]}
        return {n: (lambda c=c: module.run(x, c)) for n, c in codes.items()}
    assert isinstance(module, DenseLinear)
    w, b = module.weight, module.bias
    return {name: (lambda f=f: f(x, w, b)) for name, f in DENSE_KERNELS.items()}


def time_candidates(
    runs: list[dict[str, Callable[[], object]]], repeats: int,
    evict: Callable[[], object] | None = None, clock: Callable[[], float] = time.perf_counter,
    long_s: float = LONG_SHAPE_S,
) -> dict[str, float]:
    """Median seconds of one pass over ``runs`` (one dict of candidates per module), per
    candidate; candidates interleaved so drift on a shared machine hits them alike. ``evict``
    (untimed) runs before every pass: the weights then come from memory, as in a forward.
    Up to ``repeats`` rounds, but no more than ``MIN_REPEATS`` once the timed passes have
    taken ``long_s`` seconds: a pass that long is timed to well under a percent by the clock
    and what noise it has is the machine's, which more rounds of the same length do not
    remove. On the 0.5B file (2-core Zen 3) the shapes from 48 rows up took 31 s of a first
    start's 48 s of tuning, five rounds each."""
    names = list(runs[0])
    samples: dict[str, list[float]] = {n: [] for n in names}
    for run in runs:  # warm-up: first calls allocate
        for n in names:
            run[n]()
    timed = 0.0
    for r in range(repeats):
        if r >= MIN_REPEATS and timed >= long_s:
            break
        for n in names:
            if evict is not None:
                evict()
            t0 = clock()
            for run in runs:
                run[n]()
            samples[n].append(clock() - t0)
            timed += samples[n][-1]
    return {n: statistics.median(s) for n, s in samples.items()}


def last_level_cache_bytes() -> int | None:
    """The largest CPU cache sysfs lists for cpu0 (None where unreadable)."""
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            text = entry.read_text().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=None)


def _weight_bytes(module: nn.Module) -> int:
    if isinstance(module, BlockQuantLinear):
        return sum(t.numel() * t.element_size() for t in module.planes[:3] if t is not None)
    return module.weight.numel() * module.weight.element_size()  # type: ignore[union-attr]


Evictor = Callable[[list[nn.Module]], object]


def _weight_tensors(module: nn.Module) -> list[torch.Tensor]:
    if isinstance(module, BlockQuantLinear):
        return [t for t in (*module.planes[:3], module.qs5) if t is not None]
    return [module.weight]  # type: ignore[list-item]


def cache_evictor(groups: dict[str, list[nn.Module]]) -> Evictor | None:
    """What to run on the modules about to be timed before each timed pass, so it meets the
    cache state of a real forward: when all the weights exceed the last-level cache, a forward
    finds each projection's weights in memory (the other layers' passed through since); when
    they fit (a small model, a CPU with a 300 MB L3), they stay cached: None. Timed hot, the
    tuner picked AVX-512 forms for one row on Zen 5 (32 MB L3, 96 MB of weights) whose model
    pass was 8-10% slower than AVX-VNNI's from memory.

    Evicting: CLFLUSHOPT over the timed modules' own weights where the CPU has it and the C++
    kernels are built, else a read of twice the cache. On a 2-core Xeon whose sysfs lists a
    300 MB L3, the read cost 31 ms before each of a shape's ~90 timed passes, nine tenths of
    the tuning: a first start of the 0.5B file timed 14 of its 84 shapes in its 45 s."""
    llc = last_level_cache_bytes() or 32 << 20
    total = sum(_weight_bytes(m) for mods in groups.values() for m in mods)
    if total <= llc:
        return None
    if "clflushopt" in quant_ext.cpu_flags() and quant_ext.available():
        flush = quant_ext.load().evict_from_cache
        return lambda modules: flush([t for m in modules for t in _weight_tensors(m)])
    buffer = torch.ones(2 * llc // 4)  # float32: a vectorized sum reads it at full bandwidth
    return lambda modules: buffer.sum()


class KernelTuner:
    """Times (or reads the cached table of) every projection group of a model at the row
    counts its engine runs, within ``budget_s`` seconds of timing (None: no limit) and, when
    given, by ``deadline`` (a ``clock`` reading: the start's, see the module docstring) but for
    at least ``MIN_BUDGET_S``, and applies the plan. ``clock`` is what the timings, the budget
    and the deadline are read from."""

    def __init__(
        self, cache_dir: Path | None, model_key: str, *, repeats: int = 5,
        modules_per_group: int = 6, progress: bool = False,
        budget_s: float | None = DEFAULT_BUDGET_S, clock: Callable[[], float] = time.perf_counter,
        deadline: float | None = None,
    ) -> None:
        self.cache_dir = cache_dir
        self.deadline = deadline
        self.model_key = model_key
        self.repeats = repeats
        self.modules_per_group = modules_per_group
        self.progress = progress
        self.budget_s = budget_s
        self.clock = clock

    @staticmethod
    def machine_key() -> str:
        """What any timing here depends on besides the shape: the CPU, torch and its threads,
        the candidates and the kernel build."""
        return "|".join([
            cpu_model(), torch.__version__, str(torch.get_num_threads()), FORMAT,
            ",".join(DENSE_KERNELS), str(quant_ext.ROWS_PER_PASS),
            ",".join(quant_ext.supported_isas()), quant_ext.build_key(),
        ])

    def cache_path(
        self, groups: dict[str, list[nn.Module]], row_counts: Iterable[int]
    ) -> Path | None:
        """The table depends on the machine, the shapes and the row counts, not on the weights,
        so models of the same shapes share it."""
        if self.cache_dir is None:
            return None
        key = "|".join([self.machine_key(), self.model_key, shapes_key(groups),
                        ",".join(map(str, row_counts))])
        return self.cache_dir / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"

    def store_path(self) -> Path | None:
        if self.cache_dir is None:
            return None
        digest = hashlib.sha256(self.machine_key().encode()).hexdigest()[:20]
        return self.cache_dir / f"shapes-{digest}.json"

    def tune(self, model: nn.Module, row_counts: list[int]) -> TuneTable:
        """Measures (or reads from the cache, timing what an earlier budget left untimed) and
        applies the plan to ``model``'s modules."""
        groups = model_groups(model)
        path = self.cache_path(groups, row_counts)
        table = None
        if path is not None and path.is_file():
            try:
                table = TuneTable.from_json(json.loads(path.read_text()))
                if set(table.groups) != set(groups):
                    table = None
            except (ValueError, KeyError, json.JSONDecodeError):
                table = None
            if table is not None:
                log.info("kernel plan read from %s (%d shapes untimed)", path, table.num_untimed)
        if table is None or table.num_untimed:
            table = self.measure(groups, row_counts, table)
            if path is not None:
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    tmp = path.with_suffix(".tmp")
                    tmp.write_text(json.dumps(table.to_json(), indent=1))
                    tmp.replace(path)
                except OSError as exc:
                    log.warning("could not cache the kernel plan at %s: %s", path, exc)
        apply_plan(groups, table)
        return table

    def measure(self, groups: dict[str, list[nn.Module]], row_counts: list[int],
                table: TuneTable | None = None) -> TuneTable:
        """Every shape ``table`` (default: a new one) has not timed, in ``work_order``: read
        from the shape store when this machine timed it before, else timed until the budget is
        spent; the rest fall back (``fill_untimed``)."""
        from tqdm import tqdm

        table = table or TuneTable()
        for sig in groups:
            table.groups.setdefault(sig, GroupResult())
        todo = [(sig, rows) for sig, rows in work_order(groups, row_counts)
                if rows not in table.groups[sig].timings]
        bar = tqdm(total=len(todo), desc=f"tuning kernels ({self.model_key})",
                   disable=not self.progress, unit="shape")
        start = self.clock()
        stop = math.inf if self.budget_s is None else start + self.budget_s
        if self.deadline is not None:
            stop = min(stop, max(self.deadline, start + MIN_BUDGET_S))
        evict = cache_evictor(groups)
        store = ShapeStore(self.store_path())
        last: dict[str, tuple[int, float]] = {}  # group -> (rows, seconds) of its last shape
        untimed: list[tuple[str, int]] = []
        reused = 0
        with torch.inference_mode():
            for sig, rows in todo:
                sampled = len(groups[sig][: self.modules_per_group])
                key = ShapeStore.entry_key(sig, sampled, evict is not None, self.repeats)
                per_call = store.get(key, rows)
                if per_call is not None:
                    record(table.groups[sig], rows, per_call, len(groups[sig]))
                    reused += 1
                    bar.update(1)
                    continue
                left = stop - self.clock()
                # a shape costs about its rows times what the group's last one cost per row
                guess = last[sig][1] * rows / last[sig][0] if sig in last else 0.0
                if left <= 0 or guess > left:
                    untimed.append((sig, rows))
                    continue
                bar.set_postfix_str(f"{sig} x{rows}" + (
                    "" if math.isinf(left) else f", {left:.0f}s left"), refresh=False)
                t0 = self.clock()
                per_call = self._time_shape(groups[sig], rows, evict)
                last[sig] = (rows, self.clock() - t0)
                store.put(key, rows, per_call)
                record(table.groups[sig], rows, per_call, len(groups[sig]))
                bar.update(1)
        store.save()
        fill_untimed(table, untimed)
        bar.set_postfix_str(f"{len(untimed)} untimed" if untimed else "done")
        bar.close()
        elapsed = self.clock() - start
        timed = len(todo) - len(untimed) - reused
        for sig in groups:
            log.info("tuned %s: %s", sig, _summary(table.groups[sig]))
        if untimed:
            shared = sum(not f.startswith("default") for g in table.groups.values()
                         for f in g.fallback.values())
            log.warning(
                "kernel tuning (%s): timed %d of %d shapes in %.1fs, the %.0fs budget (%d read "
                "from earlier timings); %d fell back untimed (%d to a same-family group's "
                "choice, %d to the untuned defaults); a later start times them",
                self.model_key, timed, len(todo), elapsed, stop - start, reused, len(untimed),
                shared, len(untimed) - shared)
        else:
            log.info("kernel tuning (%s): timed %d shapes in %.1fs (%d read from earlier "
                     "timings)", self.model_key, timed, elapsed, reused)
        return table

    def _time_shape(self, modules: list[nn.Module], rows: int,
                    evict: Evictor | None) -> dict[str, float]:
        """Seconds per call of every candidate on ``rows`` rows, over up to
        ``modules_per_group`` of the group's modules."""
        sample = modules[: self.modules_per_group]
        k = sample[0].in_features  # type: ignore[union-attr]
        dtype = torch.float32
        if isinstance(sample[0], DenseLinear):
            dtype = sample[0].weight.dtype
        x = torch.randn(rows, k, dtype=dtype)
        runs = [_candidates(m, x) for m in sample]
        timings = time_candidates(runs, self.repeats,
                                  None if evict is None else lambda: evict(sample), self.clock)
        return {n: t / len(sample) for n, t in timings.items()}


def record(result: GroupResult, rows: int, per_call: dict[str, float], modules: int) -> None:
    """A timed shape into its group's result: the fastest candidate, and its seconds over all
    ``modules`` of the group."""
    best = min(per_call, key=per_call.__getitem__)
    result.choice[rows] = best
    result.timings[rows] = per_call
    result.seconds[rows] = per_call[best] * modules
    result.fallback.pop(rows, None)


def fill_untimed(table: TuneTable, untimed: list[tuple[str, int]]) -> None:
    """Gives each untimed (group, rows) the choice the smallest group of its form family timed
    at those rows (the one ``work_order`` times first), else the untuned default; records where
    it came from. No seconds are recorded for them: the projection interpolates between timed
    counts."""
    for sig, rows in untimed:
        result = table.groups[sig]
        family = form_family(sig)
        donors = [other for other, g in table.groups.items() if other != sig
                  and form_family(other) == family and rows in g.timings]
        donor = min(donors, key=lambda d: (_group_size(d), d), default=None)
        if donor is not None:
            result.choice[rows] = table.groups[donor].choice[rows]
            result.fallback[rows] = donor
        else:
            result.choice[rows] = DEFAULT_CHOICE[sig.partition(":")[0]]
            result.fallback[rows] = "default"


def _summary(result: GroupResult) -> str:
    return ", ".join(f"{r}:{c}" for r, c in sorted(result.choice.items()))


def apply_plan(groups: dict[str, list[nn.Module]], table: TuneTable) -> None:
    for sig, modules in groups.items():
        result = table.groups.get(sig)
        if result is None:
            continue
        plan = RowPlan(DEFAULT_CHOICE[sig.partition(":")[0]])
        for rows, name in result.choice.items():
            plan.set(rows, name)
        for m in modules:
            if sig.startswith("block:"):
                m.rows_plan = plan  # type: ignore[union-attr]
            else:
                m.plan = plan  # type: ignore[union-attr]
