"""What benchmarks/vs_llamacpp.py measured, as RESULTS.md tables: speed ratios single stream and
at N streams, how each speculative kind drafted (from the answers' ``timings``), and the greedy
checks. Pure functions of the recorded answers: no server, no clock.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from benchmarks.report import fmt, md_table
from benchmarks.stats import ratio_cell

STOPS = {"EOS": False, "fixed N": True}  # stop rule -> ignore_eos
PLAIN = "plain"  # llama-server without --spec-type
DEFAULT = "default"  # our request without a speculative field


@dataclass(frozen=True)
class System:
    """Where one kind of request goes: ours in a mode, or one llama-server."""

    name: str  # "ours off", "ours default", "llama plain", "llama ngram-mod", ...
    ours: bool
    mode: str  # our speculative method, or the llama-server kind


@dataclass
class Answer:
    tokens: int
    seconds: float
    text: str
    drafted: int
    accepted: int
    verify_steps: int = 0  # ours only: steps that verified >= 1 draft (llama-server has none)
    draft_ms: float = 0.0  # ours only: time spent drafting, over those steps


# (system, workload, stop rule) -> per repeat, per prompt
Runs = dict[tuple[str, str, str], list[list[Answer]]]


def tok_s(answers: list[Answer]) -> float:
    return sum(a.tokens for a in answers) / sum(a.seconds for a in answers)


def ratio_of(num: list[float], den: list[float]) -> str:
    """num[i] / den[i] (measured side by side in repeat i) as a table cell."""
    return ratio_cell([a / b for a, b in zip(num, den)])


def single_table(runs: Runs, systems: list[System], workloads: list[str]) -> list[str]:
    """Per workload and stop rule: ours against llama.cpp plain and the best llama.cpp kind, and
    our default (auto) against the best other mode of ours (off included: auto must not lose
    to never drafting either). "Best" is chosen after the run, by median tok/s."""
    ours = [s for s in systems if s.ours]
    others = [s for s in ours if s.mode != DEFAULT]
    llama = [s for s in systems if not s.ours]
    headers = ["workload", "stop", "ours off / llama.cpp plain",
               "ours default / llama.cpp plain", "ours default / best llama.cpp",
               "best llama.cpp", "ours default / best other mode of ours",
               "best other mode of ours", *(f"{s.name} tok/s" for s in llama),
               *(f"{s.name} tok/s" for s in ours)]
    rows = []
    for wl in workloads:
        for stop in STOPS:
            per = {s.name: [tok_s(r) for r in runs[(s.name, wl, stop)]] for s in systems}
            best = max(llama, key=lambda s: statistics.median(per[s.name])).name
            plain = per[f"llama {PLAIN}"]
            default = per.get(f"ours {DEFAULT}")
            rival = (max(others, key=lambda s: statistics.median(per[s.name])).name
                     if others and default else None)
            rows.append([
                wl, stop, ratio_of(per["ours off"], plain) if "ours off" in per else "-",
                ratio_of(default, plain) if default else "-",
                ratio_of(default, per[best]) if default else "-", best,
                ratio_of(default, per[rival]) if rival else "-", rival or "-",
                *(fmt(statistics.median(per[s.name])) for s in llama),
                *(fmt(statistics.median(per[s.name])) for s in ours)])
    return md_table(headers, rows)


@dataclass
class Drafting:
    """How one speculative kind drafted over a workload: sums over its answers."""

    answers: int = 0
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    draft_ms: float = 0.0

    def add(self, a: Answer) -> None:
        self.answers += 1
        self.drafted += a.drafted
        self.accepted += a.accepted
        self.verify_steps += a.verify_steps
        self.draft_ms += a.draft_ms

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def drafts_per_verify(self) -> float | None:
        return self.drafted / self.verify_steps if self.verify_steps else None

    @property
    def tokens_per_verify(self) -> float | None:
        """Tokens a verify step emits: its accepted drafts and the target's own next token."""
        return (self.accepted + self.verify_steps) / self.verify_steps if (
            self.verify_steps) else None

    @property
    def draft_ms_per_verify(self) -> float | None:
        return self.draft_ms / self.verify_steps if self.verify_steps else None


def drafting(runs: Runs, systems: list[System], workloads: list[str]
             ) -> dict[tuple[str, str], Drafting]:
    """(system, workload) -> its drafting over both stop rules and every repeat, for each kind
    that speculates (ours but off, llama.cpp's but plain)."""
    out: dict[tuple[str, str], Drafting] = {}
    for s in systems:
        if s.mode in ("off", PLAIN):
            continue
        for wl in workloads:
            d = out.setdefault((s.name, wl), Drafting())
            for stop in STOPS:
                for rep in runs[(s.name, wl, stop)]:
                    for a in rep:
                        d.add(a)
    return out


def drafting_table(runs: Runs, systems: list[System], workloads: list[str]) -> list[str]:
    """Per workload and speculative kind: drafted, accepted, verify steps, tokens per verify and
    the draft's milliseconds per verify step, from the answers' timings. llama-server's timings
    count drafted and accepted tokens only, so its verify columns stay "-"."""
    headers = ["workload", "kind", "answers", "drafted", "accepted", "accepted / drafted",
               "verify steps", "drafts per verify", "tokens per verify",
               "draft ms per verify"]
    table = drafting(runs, systems, workloads)
    rows = []
    for wl in workloads:
        for s in systems:
            d = table.get((s.name, wl))
            if d is None:
                continue
            steps = str(d.verify_steps) if s.ours else "-"
            rows.append([wl, s.name, str(d.answers), str(d.drafted), str(d.accepted),
                         fmt(d.acceptance, 2), steps, fmt(d.drafts_per_verify, 2),
                         fmt(d.tokens_per_verify, 2), fmt(d.draft_ms_per_verify, 1)])
    return md_table(headers, rows)


def streams_table(agg: dict[tuple[str, str], list[float]], workloads: list[str],
                  width: int) -> list[str]:
    llama = f"llama {PLAIN} -np {width}"
    names = [n for n in ("ours off", f"ours {DEFAULT}") if (n, workloads[0]) in agg]
    headers = ["workload", *(f"{n} / {llama}" for n in names), f"{llama} tok/s",
               *(f"{n} tok/s" for n in names)]
    rows = [[wl, *(ratio_of(agg[(n, wl)], agg[(llama, wl)]) for n in names),
             fmt(statistics.median(agg[(llama, wl)])),
             *(fmt(statistics.median(agg[(n, wl)])) for n in names)] for wl in workloads]
    return md_table(headers, rows)


def greedy_checks(runs: Runs, systems: list[System], workloads: list[str]
                  ) -> tuple[list[str], list[str]]:
    """(failures, notes): every answer of ours equals our plain answer to the same prompt."""
    failures, counts, differ, total = [], [], 0, 0
    for s in systems:
        if not s.ours or s.mode == "off":
            continue
        for stop in STOPS:
            bad = sum(a.text != b.text for wl in workloads
                      for rep in runs[(s.name, wl, stop)]
                      for a, b in zip(rep, runs[("ours off", wl, stop)][0]))
            counts.append(f"{s.mode} ({stop}) {bad}")
            if bad:
                failures.append(f"{s.name} ({stop}): {bad} answer(s) differ from plain")
    for wl in workloads:
        for a, b in zip(runs[(f"llama {PLAIN}", wl, "EOS")][0], runs[("ours off", wl, "EOS")][0]):
            total += 1
            differ += a.text != b.text
    return failures, [
        f"Our answers differing from our plain answers: {', '.join(counts) or 'none run'}.",
        f"EOS-stopped answers whose text differs between llama.cpp plain and ours: "
        f"{differ}/{total} (llama.cpp rounds activations its own way)."]
