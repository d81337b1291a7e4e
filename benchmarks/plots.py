"""PNG plots of benchmark results, drawn with matplotlib's object API (``Figure``, no pyplot), so
nothing global (backends, current figure) is touched."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from benchmarks.report import BenchError
from benchmarks.stats import Interval


def _figure(width: float, height: float, rows: int = 1, cols: int = 1) -> tuple[Any, Any]:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise BenchError("plots need matplotlib: pip install -e '.[bench]' "
                         "(or pass --no-plots)") from exc
    fig = Figure(figsize=(width, height), layout="constrained")
    return fig, fig.subplots(rows, cols, squeeze=False)


def bars_with_ci(
    path: Path, groups: list[str], series: dict[str, list[Interval | None]], ylabel: str,
    title: str,
) -> None:
    """Grouped bars (one group per entry of ``groups``, one bar per series) with 95% whiskers;
    a missing value leaves a gap."""
    fig, axes = _figure(max(6.0, 1.2 * len(groups) * max(len(series), 1) / 2), 4.0)
    ax = axes[0][0]
    width = 0.8 / max(len(series), 1)
    for s, (name, values) in enumerate(series.items()):
        xs, heights, err_lo, err_hi = [], [], [], []
        for g, v in enumerate(values):
            if v is None:
                continue
            xs.append(g + (s - (len(series) - 1) / 2) * width)
            heights.append(v.point)
            err_lo.append(max(v.point - v.low, 0.0))
            err_hi.append(max(v.high - v.point, 0.0))
        ax.bar(xs, heights, width, yerr=[err_lo, err_hi], capsize=3, label=name)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize="small")
    ax.grid(axis="y", alpha=0.3)
    fig.savefig(path, dpi=120)


def lines(
    path: Path, xs: list[float], panels: list[tuple[str, dict[str, list[float]]]], xlabel: str,
    title: str, log_x: bool = True,
) -> None:
    """One panel per (y label, {series: ys}) side by side, sharing the x axis."""
    fig, axes = _figure(5.0 * len(panels), 4.0, 1, len(panels))
    for ax, (ylabel, series) in zip(axes[0], panels):
        for name, ys in series.items():
            ax.plot(xs, ys, marker="o", label=name)
        if log_x and len(xs) > 1 and min(xs) > 0:
            ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [f"{x:g}" for x in xs])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.savefig(path, dpi=120)


def cdfs(
    path: Path, grid: list[list[tuple[str, dict[str, list[float]]]]], xlabel_of_row: list[str],
    title: str,
) -> None:
    """Empirical CDFs: ``grid[row][col]`` = (panel title, {series: sample})."""
    rows, cols = len(grid), max(len(r) for r in grid)
    fig, axes = _figure(3.6 * cols, 3.0 * rows, rows, cols)
    for r, row in enumerate(grid):
        for c in range(cols):
            ax = axes[r][c]
            if c >= len(row):
                ax.set_visible(False)
                continue
            panel_title, series = row[c]
            for name, sample in series.items():
                xs = sorted(sample)
                if xs:
                    ys = [(i + 1) / len(xs) for i in range(len(xs))]
                    ax.step(xs, ys, where="post", label=name)
            ax.set_title(panel_title, fontsize="small")
            ax.set_xlabel(xlabel_of_row[r])
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
            if c == 0:
                ax.set_ylabel("fraction of requests")
                ax.legend(fontsize="small")
    fig.suptitle(title)
    fig.savefig(path, dpi=120)


def hbars(path: Path, labels: list[str], values: list[float], xlabel: str, title: str) -> None:
    """Horizontal bars, first label on top."""
    fig, axes = _figure(8.0, 0.45 * len(labels) + 1.5)
    ax = axes[0][0]
    ax.barh(range(len(labels)), values)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.grid(axis="x", alpha=0.3)
    fig.savefig(path, dpi=120)
