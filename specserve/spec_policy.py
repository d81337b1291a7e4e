"""Adaptive speculation length: choose each sequence's k for the next step from measured costs.

Model. One step costs ``T = F + c * n_target + D(k_max)``: ``F`` the fixed cost of a target
forward, ``c`` the cost per token in it (``n_target`` = every prefill token plus ``1 + k_i`` per
decode sequence), and ``D`` the draft's cost, ``k_max`` sequential draft steps of
``F_d + c_d * n_draft`` each. A sequence whose drafts are accepted independently with
probability ``a`` yields ``E(k) = (1 - a^(k+1)) / (1 - a)`` tokens per verify. The policy picks
the k's that maximize the batch's goodput ``sum_i E_i(k_i) / T``, greedily, one draft token at a
time, while that still pays. In the memory-bound regime (small batches) ``c`` is tiny next to
``F`` and long drafts pay; once verification is compute-bound (``c * B`` dominates ``F``), every
extra token costs about as much as the token it might save and k falls to 0, so throughput never
drops below plain decoding.

Costs are fitted online (least squares over recent steps) from timings the engine reports.
Acceptance ``a`` is tracked per sequence (accepted / examined drafts, with a prior from the
method's global rate).

The linear cost model cannot see every cliff of a real machine (on the dev CPU a matmul gets 2x
dearer past 32 rows), so the model's choice is checked against what speculation really delivers:
for each batch-size bucket the policy keeps the measured decode tokens per second of steps that
speculated and of steps that did not, and speculates in that bucket only while the speculative
rate is at least the plain one. Every ``_EXPLORE_EVERY``-th decision in a bucket tries the other
mode, so both figures stay current.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np


class _LinearCost:
    """Online fit of time = fixed + per_unit * units over a window of recent measurements."""

    def __init__(self, fixed: float, per_unit: float, window: int = 256) -> None:
        self.samples: deque[tuple[float, float]] = deque(maxlen=window)
        self.fixed, self.per_unit = fixed, per_unit

    def add(self, units: float, seconds: float) -> None:
        self.samples.append((units, seconds))
        if len(self.samples) >= 3:
            x = np.array([s[0] for s in self.samples])
            y = np.array([s[1] for s in self.samples])
            if np.ptp(x) > 0:
                slope, intercept = np.polyfit(x, y, 1)
                self.fixed, self.per_unit = max(float(intercept), 0.0), max(float(slope), 0.0)
            else:
                self.fixed = max(float(y.mean()) - self.per_unit * float(x[0]), 0.0)

    def __call__(self, units: float) -> float:
        return self.fixed + self.per_unit * units


@dataclass
class AcceptanceStats:
    accepted: float = 0.0
    examined: float = 0.0

    def rate(self, prior: float, prior_weight: float = 4.0) -> float:
        return (self.accepted + prior * prior_weight) / (self.examined + prior_weight)

    def update(self, num_drafts: int, num_accepted: int, decay: float = 0.9) -> None:
        # Drafts are examined until the first rejection.
        examined = min(num_accepted + 1, num_drafts)
        self.accepted = self.accepted * decay + num_accepted
        self.examined = self.examined * decay + examined


def expected_tokens(rate: float, k: int) -> float:
    """Tokens emitted by one verify of k drafts each accepted with probability ``rate``."""
    if rate >= 1.0:
        return k + 1.0
    return (1.0 - rate ** (k + 1)) / (1.0 - rate)


@dataclass
class Candidate:
    key: int  # the sequence's id
    k_max: int  # the most drafts it may take (request limit, tokens left, context left)
    rate: float  # its acceptance estimate
    uses_draft_model: bool


_EXPLORE_EVERY = 12
_MIN_SAMPLES = 3


@dataclass
class _Rate:
    """Exponential moving average of decode tokens per second over steps of one kind."""

    value: float = 0.0
    samples: int = 0

    def add(self, tokens_per_s: float, alpha: float = 0.25) -> None:
        self.value = tokens_per_s if self.samples == 0 else (
            (1 - alpha) * self.value + alpha * tokens_per_s
        )
        self.samples += 1


@dataclass
class _BucketRates:
    spec: _Rate = field(default_factory=_Rate)
    plain: _Rate = field(default_factory=_Rate)
    decisions: int = 0


def _bucket(num_decoding: int) -> int:
    """Power-of-two batch-size bucket: 1, 2, 4, 8, ..."""
    return 1 << max(num_decoding - 1, 0).bit_length()


class SpeculationPolicy:
    def __init__(self, adaptive: bool = True, cheap_rows: int | None = None) -> None:
        """``cheap_rows``: a step-size cliff the linear cost model cannot see (on CPU float32,
        projections of up to this many rows take a weight-streaming path that is 2-3x cheaper
        per row than the next size up; see kernels/linear.py). A step whose plain rows fit under
        it is never pushed over it by drafts."""
        self.adaptive = adaptive
        self.cheap_rows = cheap_rows
        # Priors until measured: a memory-bound CPU step (~tens of ms fixed, ~1 ms per token).
        self.target_cost = _LinearCost(fixed=0.05, per_unit=0.001)
        self.draft_cost = _LinearCost(fixed=0.01, per_unit=0.0005)
        self.global_stats: dict[str, AcceptanceStats] = {}
        self.seq_stats: dict[int, AcceptanceStats] = {}
        self.buckets: dict[int, _BucketRates] = {}

    # ---- measurements -------------------------------------------------------------------

    def record_target(self, num_tokens: int, seconds: float) -> None:
        self.target_cost.add(num_tokens, seconds)

    def record_draft_step(self, num_seqs: int, seconds: float) -> None:
        self.draft_cost.add(num_seqs, seconds)

    def record_decode_step(
        self, num_decoding: int, tokens: int, seconds: float, speculated: bool
    ) -> None:
        """A step that only decoded (no prefill): its realized decode tokens per second."""
        if num_decoding <= 0 or seconds <= 0:
            return
        rates = self.buckets.setdefault(_bucket(num_decoding), _BucketRates())
        (rates.spec if speculated else rates.plain).add(tokens / seconds)

    def record_acceptance(self, seq_id: int, method: str, drafts: int, accepted: int) -> None:
        if drafts <= 0:
            return
        self.seq_stats.setdefault(seq_id, AcceptanceStats()).update(drafts, accepted)
        self.global_stats.setdefault(method, AcceptanceStats()).update(drafts, accepted, 0.99)

    def forget(self, seq_id: int) -> None:
        self.seq_stats.pop(seq_id, None)

    def acceptance_rate(self, seq_id: int, method: str) -> float:
        prior = self.global_stats.get(method, AcceptanceStats()).rate(0.6)
        return self.seq_stats.get(seq_id, AcceptanceStats()).rate(prior)

    # ---- decision -----------------------------------------------------------------------

    def choose(self, candidates: list[Candidate], num_other_tokens: int) -> dict[int, int]:
        """k per candidate key. ``num_other_tokens``: prefill tokens also in the step."""
        if not self.adaptive:
            return {c.key: c.k_max for c in candidates}
        off = {c.key: 0 for c in candidates}
        rates = self.buckets.setdefault(_bucket(len(candidates)), _BucketRates())
        rates.decisions += 1
        explore = rates.decisions % _EXPLORE_EVERY == 0
        measured = min(rates.spec.samples, rates.plain.samples) >= _MIN_SAMPLES
        if measured and rates.spec.value < rates.plain.value and not explore:
            return off  # speculation measured slower at this batch size
        if explore and (rates.plain.samples < rates.spec.samples or measured
                        and rates.spec.value >= rates.plain.value):
            return off  # refresh the plain figure
        ks = self._model_choice(candidates, num_other_tokens)
        return ks

    def _model_choice(self, candidates: list[Candidate], num_other_tokens: int) -> dict[int, int]:
        n_base = num_other_tokens + len(candidates)

        def goodput(ks: dict[int, int]) -> float:
            gain = sum(expected_tokens(c.rate, ks[c.key]) for c in candidates)
            n_tok = n_base + sum(ks.values())
            if self.cheap_rows is not None and n_base <= self.cheap_rows < n_tok:
                return 0.0  # measured: crossing the cliff costs more than drafts return
            drafting = [c for c in candidates if c.uses_draft_model and ks[c.key] > 0]
            k_draft = max((ks[c.key] for c in drafting), default=0)
            draft = k_draft * self.draft_cost(len(drafting)) if drafting else 0.0
            return gain / (self.target_cost(n_tok) + draft)

        # 1. The best common k (the draft's per-step cost is shared by every sequence, so one
        # sequence alone may not pay for a step that the whole batch does).
        best_ks = {c.key: 0 for c in candidates}
        best = goodput(best_ks)
        for level in range(1, max(c.k_max for c in candidates) + 1):
            ks = {c.key: min(level, c.k_max) for c in candidates}
            value = goodput(ks)
            if value > best * 1.0001:
                best, best_ks = value, ks
        # 2. Refine per sequence: shorten drafts that do not pay, lengthen those that do.
        for delta in (-1, 1):
            for c in sorted(candidates, key=lambda c: c.rate):
                while 0 <= best_ks[c.key] + delta <= c.k_max:
                    trial = {**best_ks, c.key: best_ks[c.key] + delta}
                    value = goodput(trial)
                    if value <= best * 1.0001:
                        break
                    best, best_ks = value, trial
        return best_ks
