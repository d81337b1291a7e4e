"""What the kernel tuner keeps (kernels/tuner.py): the table of one model's plan, and the store
of per-shape timings every table on a machine shares.

The table (``TuneTable``): per projection group, the chosen candidate, the seconds and every
candidate's timing at each tuned row count, and which entries a time budget left untimed.
It also prices projections at row counts between the tuned ones (``projection_seconds``).

The store (``ShapeStore``): the candidates' timings of one (group, rows) shape do not depend
on which model the group belongs to, only on the machine (the tuner's machine key: CPU, torch,
threads, kernel build), the shape, how many modules a pass runs, whether passes meet the
weights in memory or in cache, and the repeats. So a shape timed for one model (or one engine
configuration: another token cap asks for other row counts) is not timed again for the next:
the draft, a second server, a benchmark with another batch size only time what is new.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

FORMAT = "4"  # 4: the entries a budget left untimed are recorded (``fallback``)


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
    # rows the budget left untimed -> where their choice came from: "default", or the group of
    # the same form family whose timing at those rows it shares
    fallback: dict[int, str] = field(default_factory=dict)


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

    @property
    def num_untimed(self) -> int:
        """Shapes on a fallback choice (0: every shape was timed)."""
        return sum(len(g.fallback) for g in self.groups.values())

    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "groups": {
                k: {"choice": g.choice, "seconds": g.seconds, "timings": g.timings,
                    "fallback": g.fallback}
                for k, g in self.groups.items()
            },
        }

    @staticmethod
    def from_json(data: dict) -> TuneTable:
        if data.get("format") != FORMAT:
            raise ValueError("old tune table format")
        table = TuneTable()
        for k, g in data["groups"].items():
            table.groups[k] = GroupResult(
                {int(r): c for r, c in g["choice"].items()},
                {int(r): s for r, s in g["seconds"].items()},
                {int(r): t for r, t in g["timings"].items()},
                {int(r): f for r, f in g["fallback"].items()},
            )
        return table


class ShapeStore:
    """Per-shape candidate timings (seconds per call) of one machine, in one JSON file; entries
    are keyed by ``entry_key`` and then by row count. Writes merge with what the file holds by
    then (another process may have added shapes), through a temporary file, so a reader never
    sees half a file; a lost write only means a shape is timed again."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.entries = self._read()
        self.added: dict[str, dict[int, dict[str, float]]] = {}

    @staticmethod
    def entry_key(sig: str, sampled: int, from_memory: bool, repeats: int) -> str:
        return f"{sig}|{sampled}|{'memory' if from_memory else 'cached'}|{repeats}"

    def _read(self) -> dict[str, dict[int, dict[str, float]]]:
        if self.path is None or not self.path.is_file():
            return {}
        try:
            data = json.loads(self.path.read_text())
            if data.get("format") != FORMAT:
                return {}
            return {k: {int(r): dict(t) for r, t in rows.items()}
                    for k, rows in data["shapes"].items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return {}

    def get(self, key: str, rows: int) -> dict[str, float] | None:
        return self.entries.get(key, {}).get(rows)

    def put(self, key: str, rows: int, per_call: dict[str, float]) -> None:
        self.entries.setdefault(key, {})[rows] = per_call
        self.added.setdefault(key, {})[rows] = per_call

    def save(self) -> None:
        if self.path is None or not self.added:
            return
        merged = self._read()
        for key, rows in self.added.items():
            merged.setdefault(key, {}).update(rows)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".tmp-{id(self)}")
            tmp.write_text(json.dumps({"format": FORMAT, "shapes": merged}))
            tmp.replace(self.path)
            self.added = {}
        except OSError as exc:
            log.warning("could not store the kernel timings at %s: %s", self.path, exc)
