"""Statistics for benchmark figures: percentiles, bootstrap confidence intervals of means and of
ratios of means, and Welch's t interval for a difference of means. numpy only (no scipy).

Every interval is 95%. Resampling uses its own seeded ``numpy.random.Generator``, so a report is
reproducible from its raw figures.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

LEVEL = 0.95
_Z975 = 1.959963984540054  # standard normal quantile at 0.975
# Student t quantiles at 0.975 for 1..10 degrees of freedom; above 10 the Cornish-Fisher
# expansion below is exact to 1e-5.
_T975 = [12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281]


@dataclass(frozen=True)
class Interval:
    """A point estimate with its 95% confidence interval."""

    point: float
    low: float
    high: float

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high


@dataclass(frozen=True)
class Distribution:
    """Summary of a latency (or any) sample."""

    n: int
    mean: float
    p50: float
    p95: float
    p99: float
    min: float
    max: float


@dataclass(frozen=True)
class WelchResult:
    """Difference of means a - b with Welch's 95% interval (unequal variances)."""

    diff: Interval
    dof: float
    t: float


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between order statistics, the
    definition numpy uses by default."""
    if not values:
        raise ValueError("percentile of an empty sample")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> Distribution:
    if not values:
        nan = float("nan")
        return Distribution(0, nan, nan, nan, nan, nan, nan)
    return Distribution(
        n=len(values), mean=float(np.mean(values)), p50=percentile(values, 50),
        p95=percentile(values, 95), p99=percentile(values, 99), min=float(min(values)),
        max=float(max(values)),
    )


def bootstrap_mean(values: Sequence[float], resamples: int = 2000, seed: int = 0) -> Interval:
    """Mean with a percentile-bootstrap 95% interval (a single value: a zero-width one)."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        raise ValueError("bootstrap of an empty sample")
    point = float(x.mean())
    if x.size == 1:
        return Interval(point, point, point)
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    low, high = np.quantile(means, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return Interval(point, min(float(low), point), max(float(high), point))


def bootstrap_ratio(
    num: Sequence[float], den: Sequence[float], paired: bool = True, resamples: int = 2000,
    seed: int = 0,
) -> Interval:
    """mean(num) / mean(den) with a percentile-bootstrap 95% interval.

    ``paired``: num[i] and den[i] were measured on the same prompt in the same repeat, so they
    are resampled together (machine drift then cancels within a pair)."""
    a, b = np.asarray(num, dtype=float), np.asarray(den, dtype=float)
    if a.size == 0 or b.size == 0:
        raise ValueError("ratio of an empty sample")
    if paired and a.size != b.size:
        raise ValueError("paired samples must have the same length")
    point = float(a.mean() / b.mean())
    if a.size == 1 and (paired or b.size == 1):
        return Interval(point, point, point)
    rng = np.random.default_rng(seed)
    if paired:
        idx = rng.integers(0, a.size, size=(resamples, a.size))
        ratios = a[idx].mean(axis=1) / b[idx].mean(axis=1)
    else:
        ratios = (a[rng.integers(0, a.size, size=(resamples, a.size))].mean(axis=1)
                  / b[rng.integers(0, b.size, size=(resamples, b.size))].mean(axis=1))
    low, high = np.quantile(ratios, [(1 - LEVEL) / 2, (1 + LEVEL) / 2])
    return Interval(point, min(float(low), point), max(float(high), point))


def t_quantile_975(dof: float) -> float:
    """Student t quantile at 0.975 (two-sided 95%): a table up to 10 degrees of freedom
    (interpolated in 1/dof), the Cornish-Fisher expansion in the normal quantile above."""
    if not dof > 0:
        raise ValueError(f"degrees of freedom must be positive (got {dof})")
    if math.isinf(dof):
        return _Z975
    if dof <= 1:
        return _T975[0]
    if dof < 10:
        lo = math.floor(dof)
        if lo == dof:
            return _T975[lo - 1]
        w = (1 / lo - 1 / dof) / (1 / lo - 1 / (lo + 1))
        return _T975[lo - 1] + w * (_T975[lo] - _T975[lo - 1])
    z, v = _Z975, dof
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / v + g2 / v**2 + g3 / v**3 + g4 / v**4


def welch(a: Sequence[float], b: Sequence[float]) -> WelchResult:
    """Welch's t interval for mean(a) - mean(b); needs two values in each sample."""
    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.size < 2 or y.size < 2:
        raise ValueError("Welch's test needs at least two values per sample")
    diff = float(x.mean() - y.mean())
    va, vb = float(x.var(ddof=1)) / x.size, float(y.var(ddof=1)) / y.size
    se = math.sqrt(va + vb)
    if se == 0:
        return WelchResult(Interval(diff, diff, diff), math.inf, math.inf if diff else 0.0)
    dof = float((va + vb) ** 2 / (va**2 / (x.size - 1) + vb**2 / (y.size - 1)))
    half = t_quantile_975(dof) * se
    return WelchResult(Interval(diff, diff - half, diff + half), dof, diff / se)


def ratio_cell(ratios: Sequence[float]) -> str:
    """Ratios measured round by round, as a table cell: their median and range ("1.23x
    (1.10..1.30)"); one ratio alone has no range."""
    spread = f" ({min(ratios):.2f}..{max(ratios):.2f})" if len(ratios) > 1 else ""
    return f"{statistics.median(ratios):.2f}x{spread}"


def verdict(ratio: Interval, n: int = 2) -> str:
    """How a speed ratio reads: a difference whose interval holds 1.0 is inside the noise; one
    pair of runs has no interval at all."""
    if n < 2:
        return "one run"
    if ratio.contains(1.0):
        return "within noise"
    return "faster" if ratio.low > 1.0 else "slower"
