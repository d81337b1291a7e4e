"""Kernel tuner: times the candidate implementations of each projection shape at the row counts
the engine will run, keeps the fastest, and caches the table per machine.

Groups: the model's projections grouped by (kind, format or dtype, N, K); the 30 qkv projections
of a 30-layer model are one group. Each candidate is timed over up to ``modules_per_group``
modules of its group in turn, candidates interleaved, the median of ``repeats`` kept. Every
timed pass meets the weights where a forward does: in memory when the model's weights exceed
the last-level cache (a read of twice that cache evicts them first), else cached.

Candidates: for dense float projections the entries of ``specserve.kernels.linear.DENSE_KERNELS``;
for block-quantized ones every instruction-set form this CPU runs (AVX2, AVX-VNNI, AVX-512 VNNI)
times the rows each unpacked weight block is shared by (1, 2, 4, 8; 16 for AVX-512), named
"<isa>/<rows>"; the numbers are identical, only the speed differs. The table also gives the
measured cost of all projections of one forward per row count (``projection_seconds``), which
the speculation policy uses to price steps it has not measured yet.

Cache: ``$SPECSERVE_CACHE_DIR/tune/<sha of CPU model, torch version, threads, model>.json``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import platform
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from specserve.kernels import quant_ext
from specserve.kernels.linear import DENSE_KERNELS, DenseLinear, RowPlan
from specserve.kernels.quant import BlockQuantLinear

log = logging.getLogger(__name__)

_FORMAT = "3"  # 3: timed from memory when the weights exceed the last-level cache


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


def interpolate(points: dict[int, float], x: int) -> float:
    """``points`` (count -> seconds) at ``x``: linear between the neighbours, the smallest
    count's value below it, proportional to ``x`` above the largest."""
    counts = sorted(points)
    if x <= counts[0]:
        return points[counts[0]]
    if x >= counts[-1]:
        return points[counts[-1]] * x / counts[-1]
    hi = next(c for c in counts if c >= x)
    lo = max(c for c in counts if c <= x)
    if hi == lo:
        return points[lo]
    return points[lo] + (points[hi] - points[lo]) * (x - lo) / (hi - lo)


@dataclass
class GroupResult:
    choice: dict[int, str] = field(default_factory=dict)  # rows -> candidate
    seconds: dict[int, float] = field(default_factory=dict)  # rows -> chosen, all modules
    timings: dict[int, dict[str, float]] = field(default_factory=dict)  # rows -> cand -> s/call


@dataclass
class TuneTable:
    groups: dict[str, GroupResult] = field(default_factory=dict)

    def projection_seconds(self, rows: int) -> float | None:
        """Measured seconds of every tuned projection of one forward at ``rows`` rows: linear
        between the measured counts around it, proportional beyond the largest (None when
        nothing was measured). Taking the count below instead priced the rows between two
        measured counts as free (9 rows as 8), so the policy saw extra verify rows at no cost
        exactly where a batch of 8 decides whether to draft."""
        if not self.groups:
            return None
        total = 0.0
        for g in self.groups.values():
            if not g.seconds:
                return None
            total += interpolate(g.seconds, rows)
        return total

    def to_json(self) -> dict:
        return {
            "format": _FORMAT,
            "groups": {
                k: {"choice": g.choice, "seconds": g.seconds, "timings": g.timings}
                for k, g in self.groups.items()
            },
        }

    @staticmethod
    def from_json(data: dict) -> TuneTable:
        if data.get("format") != _FORMAT:
            raise ValueError("old tune table format")
        table = TuneTable()
        for k, g in data["groups"].items():
            table.groups[k] = GroupResult(
                {int(r): c for r, c in g["choice"].items()},
                {int(r): s for r, s in g["seconds"].items()},
                {int(r): t for r, t in g["timings"].items()},
            )
        return table


def _signature(module: nn.Module) -> str | None:
    if isinstance(module, BlockQuantLinear):
        return f"block:{module.fmt}:{module.out_features}x{module.in_features}"
    if isinstance(module, DenseLinear):
        n, k = module.weight.shape
        return f"dense:{str(module.weight.dtype).removeprefix('torch.')}:{n}x{k}"
    return None


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
        codes = {f"{isa}/{r}": quant_ext.kernel_code(f"{isa}/{r}")
                 for isa in quant_ext.supported_isas() for r in quant_ext.ROWS_PER_PASS[isa]}
        return {n: (lambda c=c: module.run(x, c)) for n, c in codes.items()}
    assert isinstance(module, DenseLinear)
    w, b = module.weight, module.bias
    return {name: (lambda f=f: f(x, w, b)) for name, f in DENSE_KERNELS.items()}


def time_candidates(
    runs: list[dict[str, Callable[[], object]]], repeats: int,
    evict: Callable[[], object] | None = None,
) -> dict[str, float]:
    """Median seconds of one pass over ``runs`` (one dict of candidates per module), per
    candidate; candidates interleaved so drift on a shared machine hits them alike. ``evict``
    (untimed) runs before every pass: the weights then come from memory, as in a forward."""
    names = list(runs[0])
    samples: dict[str, list[float]] = {n: [] for n in names}
    for run in runs:  # warm-up: first calls allocate
        for n in names:
            run[n]()
    for _ in range(repeats):
        for n in names:
            if evict is not None:
                evict()
            t0 = time.perf_counter()
            for run in runs:
                run[n]()
            samples[n].append(time.perf_counter() - t0)
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


def cache_evictor(groups: dict[str, list[nn.Module]]) -> Callable[[], object] | None:
    """What to run before each timed pass so it meets the cache state of a real forward: when
    all the weights exceed the last-level cache, a forward finds each projection's weights in
    memory (the other layers' passed through since), so a read of twice that cache evicts
    them; when they fit (a small model, a CPU with a 300 MB L3), they stay cached: None.
    Timed hot, the tuner picked AVX-512 forms for one row on Zen 5 (32 MB L3, 96 MB of
    weights) whose model pass was 8-10% slower than AVX-VNNI's from memory."""
    llc = last_level_cache_bytes() or 32 << 20
    total = sum(_weight_bytes(m) for mods in groups.values() for m in mods)
    if total <= llc:
        return None
    buffer = torch.ones(2 * llc // 4)  # float32: a vectorized sum reads it at full bandwidth
    return buffer.sum


class KernelTuner:
    def __init__(
        self, cache_dir: Path | None, model_key: str, *, repeats: int = 5,
        modules_per_group: int = 6, progress: bool = False,
    ) -> None:
        self.cache_dir = cache_dir
        self.model_key = model_key
        self.repeats = repeats
        self.modules_per_group = modules_per_group
        self.progress = progress

    def cache_path(
        self, groups: dict[str, list[nn.Module]], row_counts: Iterable[int]
    ) -> Path | None:
        """The table depends on the machine, the shapes and the row counts, not on the weights,
        so models of the same shapes share it."""
        if self.cache_dir is None:
            return None
        shapes = ",".join(f"{sig}*{len(mods)}" for sig, mods in sorted(groups.items()))
        key = "|".join([
            cpu_model(), torch.__version__, str(torch.get_num_threads()), self.model_key, shapes,
            ",".join(map(str, row_counts)), _FORMAT,
            ",".join(DENSE_KERNELS), str(quant_ext.ROWS_PER_PASS),
            ",".join(quant_ext.supported_isas()),
            quant_ext.build_key(),
        ])
        return self.cache_dir / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"

    def tune(self, model: nn.Module, row_counts: list[int]) -> TuneTable:
        """Measures (or reads from the cache) and applies the plan to ``model``'s modules."""
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
                log.info("kernel plan read from %s", path)
        if table is None:
            table = self.measure(groups, row_counts)
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

    def measure(self, groups: dict[str, list[nn.Module]], row_counts: list[int]) -> TuneTable:
        from tqdm import tqdm

        table = TuneTable()
        total = len(groups) * len(row_counts)
        bar = tqdm(total=total, desc="tuning kernels", disable=not self.progress, unit="shape")
        t0 = time.perf_counter()
        evict = cache_evictor(groups)
        with torch.inference_mode():
            for sig, modules in groups.items():
                result = GroupResult()
                sample = modules[: self.modules_per_group]
                k = sample[0].in_features  # type: ignore[union-attr]
                dtype = torch.float32
                if isinstance(sample[0], DenseLinear):
                    dtype = sample[0].weight.dtype
                for rows in row_counts:
                    x = torch.randn(rows, k, dtype=dtype)
                    runs = [_candidates(m, x) for m in sample]
                    timings = time_candidates(runs, self.repeats, evict)
                    best = min(timings, key=timings.__getitem__)
                    per_call = {n: t / len(sample) for n, t in timings.items()}
                    result.choice[rows] = best
                    result.timings[rows] = per_call
                    result.seconds[rows] = per_call[best] * len(modules)
                    bar.update(1)
                table.groups[sig] = result
                log.info("tuned %s: %s", sig, _summary(result))
        bar.close()
        log.info("kernel tuning took %.1fs", time.perf_counter() - t0)
        return table


def _summary(result: GroupResult) -> str:
    return ", ".join(f"{r}:{c}" for r, c in sorted(result.choice.items()))


def apply_plan(groups: dict[str, list[nn.Module]], table: TuneTable) -> None:
    for sig, modules in groups.items():
        result = table.groups.get(sig)
        if result is None:
            continue
        if sig.startswith("block:"):
            plan = RowPlan("avx2/4")
            for rows, name in result.choice.items():
                plan.set(rows, name)
            for m in modules:
                m.rows_plan = plan  # type: ignore[union-attr]
        else:
            plan = RowPlan("linear")
            for rows, name in result.choice.items():
                plan.set(rows, name)
            for m in modules:
                m.plan = plan  # type: ignore[union-attr]
