"""Adaptive speculation length: choose each sequence's k for the next step from measured costs.

Model. A step that feeds the target ``n`` tokens (every prefill token plus ``1 + k_i`` per
decoding sequence) costs ``T(n)``, plus the draft's cost when a draft model drafts: ``k_max``
sequential draft steps of ``F_d + c_d * n_draft`` each. A sequence whose drafts are accepted
independently with probability ``a`` yields ``E(k) = (1 - a^(k+1)) / (1 - a)`` tokens per verify.
The policy picks the k's that maximize the batch's goodput ``sum_i E_i(k_i) / T``, greedily, one
draft token at a time, while that still pays. ``T`` also holds the host time of the model-free
proposers (n-gram, suffix) of the sequences that draft: measured per call and method, it is what
drafting costs beyond the verify rows, and on a small model at batch 8 it can be a tenth of the
step (a pure-Python suffix trie was ~7.5 ms of a ~55 ms step). The proposer has already run when
the policy decides (the policy reads real draft lengths), but it is priced as if it had not: the
choice is the steady-state one, and the speculator stops calling the proposer of a sequence the
policy keeps at k = 0 (with backoff, see speculator.py), so that cost is really saved.

In the memory-bound regime (small batches) extra rows are nearly free and long drafts pay; once
verification is compute-bound every extra token costs about as much as the token it might save
and k falls to 0, so throughput never drops below plain decoding.

``T(n)`` is measured, not assumed: the median of the recent target forwards that fed exactly
``n`` tokens, and a least-squares line over all recent forwards for counts not yet seen. A real
machine's cost is not linear in ``n`` (on the dev CPU float32 a 4-row forward costs ~1.06x a
1-row one, 5 rows ~1.2x, and 64 rows ~1.7x what 32 do), so a line fitted across batch sizes would
misprice exactly the choices that matter; the table does not. Acceptance ``a`` is tracked per
sequence (accepted / examined drafts, with a prior from the method's global rate); a sequence
the policy keeps at k = 0 drifts back to that prior, so it is tried again later. A model-free
draft (n-gram, suffix) is priced token by token instead (``Candidate.expected_by_k``): hazards by
match length, proposer probability and position, shifted by the sequence's rate
(specserve/spec/acceptance_model.py); geometric pricing from ``a`` alone cut a 16-token match like a
one-token one.

A count not measured yet is priced from the kernel tuner's table, and that table is a guide, not a
measurement of the step: on the 0.5B file (2-core Zen 3) two tuning runs priced 2 rows at 1.56x and
1.00x one row, 5 rows at 2.38x and 1.37x, where the engine's own steps took 1.04x and 1.69x. Priced
above its cost, a draft length is never chosen, so it is never measured, so its price never
corrects: with the 1.56x table suffix decoding drafted 1 token in two 128-token answers, one a
rewrite whose fixed 4-token drafts were all accepted (2.1x plain). So every ``_EXPLORE_EVERY``-th
decision may try a common draft length whose step size has no measurement yet, where that would pay
even if the table overstated the extra rows' cost by 2x (``_StepCost.optimistic``) and where the
table itself puts the loss under 20%; three such steps measure the size, and from then on the
measurement prices it. A cliff the table shows (rows past a kernel's tile costing many times the
ones before) stays above what a draft returns at half its price, so it is not tried.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from specserve.spec.acceptance_model import AcceptanceModel, DraftHints, expected_by_k

_MIN_SAMPLES = 3  # measurements at one token count before the table trusts them
_PRIOR_RATE = 0.6  # acceptance assumed for a method before (and long after) any evidence
# Per idle sequence-step: a method's global evidence halves in ~35 steps at k = 0 (well under
# a second of decoding), so it is tried again; each try brings fresh evidence.
_GLOBAL_RELAX = 0.98
# Decisions between tries of an unmeasured step size (a try costs at most the extra rows of one
# step; ~3 per size over a run's first hundreds of steps)
_EXPLORE_EVERY = 8
# ... and only where the table itself prices the try at no more than this fraction below the
# best choice: a batch of 8 drafting into a steep part of the table would cost ~2x its step
_EXPLORE_FLOOR = 0.8


class _LinearCost:
    """Online fit of time = fixed + per_unit * units over a window of recent measurements."""

    def __init__(self, fixed: float, per_unit: float, window: int = 256) -> None:
        self.samples: deque[tuple[float, float]] = deque(maxlen=window)
        self._fixed, self._per_unit = fixed, per_unit
        self._stale = False

    def add(self, units: float, seconds: float) -> None:
        # Every step records; only a step that prices speculation reads: fit on read (a fit
        # over the window is ~0.1 ms, 1% of a batch-1 decode step).
        self.samples.append((units, seconds))
        self._stale = True

    @property
    def fixed(self) -> float:
        self._fit()
        return self._fixed

    @property
    def per_unit(self) -> float:
        self._fit()
        return self._per_unit

    def _fit(self) -> None:
        if not self._stale:
            return
        self._stale = False
        if len(self.samples) >= 3:
            x = np.array([s[0] for s in self.samples])
            y = np.array([s[1] for s in self.samples])
            if np.ptp(x) > 0:
                slope, intercept = np.polyfit(x, y, 1)
                self._fixed, self._per_unit = max(float(intercept), 0.0), max(float(slope), 0.0)
            else:
                self._fixed = max(float(y.mean()) - self._per_unit * float(x[0]), 0.0)

    def __call__(self, units: float) -> float:
        return self.fixed + self.per_unit * units


class _StepCost:
    """Seconds per target forward by tokens fed: the median of the last ``per_count``
    measurements at that exact count once there are ``_MIN_SAMPLES``. A count not measured yet
    is priced from the kernel tuner's table when there is one (``prior``: seconds of all
    projections at n rows), scaled by measured / prior at the nearest measured count; else
    from the linear fit."""

    def __init__(
        self, fixed: float, per_unit: float, per_count: int = 9,
        prior: Callable[[int], float | None] | None = None,
    ) -> None:
        self.linear = _LinearCost(fixed, per_unit)
        self.prior = prior
        self.per_count = per_count
        self.recent: dict[int, deque[float]] = {}  # one key per step size seen: bounded
        self._median: dict[int, float] = {}
        self._stale: set[int] = set()  # counts whose median changed since it was last read
        self._prior_seen: dict[int, float | None] = {}  # one entry per step size priced
        # Prices since the last measurement: a step's choice reads the same few counts hundreds
        # of times (~5000 reads a step at 32 sequences, 12 ms of a 1.5 s run uncached).
        self._priced: dict[int, float] = {}

    def add(self, units: int, seconds: float) -> None:
        self._priced.clear()
        self.linear.add(units, seconds)
        window = self.recent.setdefault(units, deque(maxlen=self.per_count))
        window.append(seconds)
        if len(window) >= _MIN_SAMPLES:
            self._stale.add(units)

    @property
    def median(self) -> dict[int, float]:
        """Median seconds per measured count, recomputed on read for counts seen since."""
        for units in self._stale:
            # statistics, not numpy: on windows this small numpy's call costs ~20x the sort
            self._median[units] = statistics.median(self.recent[units])
        self._stale.clear()
        return self._median

    def measured(self, units: int) -> bool:
        return units in self.median

    def _prior(self, units: int) -> float | None:
        """The tuner's table is fixed once the engine runs: read each count once."""
        if units not in self._prior_seen:
            assert self.prior is not None
            self._prior_seen[units] = self.prior(units)
        return self._prior_seen[units]

    def __call__(self, units: int) -> float:
        price = self._priced.get(units)
        if price is None:
            price = self._priced[units] = self._price(units)
        return price

    def optimistic(self, units: int) -> float:
        """The price of a count not measured yet, trusting what the table (or the fit) adds
        over the largest measured count below it only by half; a measured count's own."""
        price = self(units)
        median = self.median
        if units in median:
            return price
        below = [c for c in median if c < units]
        if not below:
            return price
        floor = median[max(below)]
        return max(floor, floor + (price - floor) / 2)

    def _price(self, units: int) -> float:
        measured = self.median.get(units)
        if measured is not None:
            return measured
        if self.prior is not None and self.median:
            nearest = min(self.median, key=lambda c: abs(c - units))
            here, there = self._prior(units), self._prior(nearest)
            if here is not None and there is not None and there > 0.0:
                # Scaled, not shifted: what the projections leave out (attention, the output
                # head's sampling rows, host work per row) grows with the rows too. A constant
                # offset priced 32 rows at 2.4x a measured 8-row step where they cost 3.9x
                # (agentic, batch 8), so the policy drafted at a loss.
                return here * self.median[nearest] / there
        return self.linear(units)


@dataclass
class AcceptanceStats:
    accepted: float = 0.0
    examined: float = 0.0

    def rate(self, prior: float, prior_weight: float = 4.0) -> float:
        return (self.accepted + prior * prior_weight) / (self.examined + prior_weight)

    def relax(self, decay: float = 0.9) -> None:
        """Fade the evidence (toward the prior) while the sequence is not drafting."""
        self.accepted *= decay
        self.examined *= decay

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
    host_seconds: float = 0.0  # its model-free proposer's host time per step (when it drafts)
    method: str = ""  # the proposer it would draft with (its global rate is the prior)
    # Expected tokens per verify at k = 0, 1, .. from its real draft (acceptance_model.py);
    # empty: priced from ``rate`` alone. Past the table's end more drafts add nothing.
    expected_by_k: tuple[float, ...] = ()

    def expected(self, k: int) -> float:
        if not self.expected_by_k:
            return expected_tokens(self.rate, k)
        return self.expected_by_k[min(k, len(self.expected_by_k) - 1)]


class _Median:
    """Median of a window of recent measurements (robust to a one-off: a proposer's first call
    for a sequence also indexes its whole prompt)."""

    def __init__(self, window: int = 64) -> None:
        self.samples: deque[float] = deque(maxlen=window)
        self._value: float | None = None

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)
        self._value = None

    def __call__(self) -> float:
        if self._value is None:
            self._value = statistics.median(self.samples) if self.samples else 0.0
        return self._value


class SpeculationPolicy:
    def __init__(
        self, adaptive: bool = True,
        projection_seconds: Callable[[int], float | None] | None = None,
    ) -> None:
        """``projection_seconds``: the kernel tuner's measured cost of all projections of one
        forward at n rows (kernels/tuner.py). It prices the many step sizes not measured yet
        (a cliff in the matmul cost at some row count shows there before a step crosses it)."""
        self.adaptive = adaptive
        # Priors until measured: a memory-bound CPU step (~tens of ms fixed, ~1 ms per token).
        self.target_cost = _StepCost(fixed=0.05, per_unit=0.001, prior=projection_seconds)
        self.draft_cost = _LinearCost(fixed=0.01, per_unit=0.0005)
        self.proposer_cost: dict[str, _Median] = {}  # method -> host seconds per sequence
        self.global_stats: dict[str, AcceptanceStats] = {}
        self.acceptance = AcceptanceModel()  # per-token hazards of model-free drafts
        # seq id -> method -> its acceptance (a sequence under `auto` tries several methods)
        self.seq_stats: dict[int, dict[str, AcceptanceStats]] = {}
        self._decisions = 0  # choices made (every _EXPLORE_EVERY-th may try a new step size)

    # ---- measurements -------------------------------------------------------------------

    def record_target(self, num_tokens: int, seconds: float) -> None:
        self.target_cost.add(num_tokens, seconds)

    def record_draft_step(self, num_seqs: int, seconds: float) -> None:
        self.draft_cost.add(num_seqs, seconds)

    def record_proposer(self, method: str, seconds: float) -> None:
        """Host time of one call of a model-free proposer for one sequence."""
        self.proposer_cost.setdefault(method, _Median()).add(seconds)

    def proposer_seconds(self, method: str) -> float:
        """Typical host seconds per sequence of ``method``'s proposer (0 before measured)."""
        cost = self.proposer_cost.get(method)
        return cost() if cost is not None else 0.0

    def record_acceptance(self, seq_id: int, method: str, drafts: int, accepted: int) -> None:
        if drafts <= 0:
            return
        per_method = self.seq_stats.setdefault(seq_id, {})
        per_method.setdefault(method, AcceptanceStats()).update(drafts, accepted)
        self.global_stats.setdefault(method, AcceptanceStats()).update(drafts, accepted, 0.99)

    def forget(self, seq_id: int) -> None:
        self.seq_stats.pop(seq_id, None)

    def acceptance_rate(self, seq_id: int, method: str) -> float:
        stats = self.seq_stats.get(seq_id, {}).get(method)
        return (stats or AcceptanceStats()).rate(self.method_rate(method))

    def method_rate(self, method: str) -> float:
        return self.global_stats.get(method, AcceptanceStats()).rate(_PRIOR_RATE)

    def expected_by_k(self, seq_id: int, method: str, hints: DraftHints, k: int
                      ) -> tuple[float, ...]:
        """Expected tokens per verify of the first 0..k tokens of a real draft (see
        acceptance_model.py): a model-free draft is priced by what it says about itself."""
        return expected_by_k(self.acceptance.survival(
            method, hints, k, self.acceptance_rate(seq_id, method), self.method_rate(method)))

    def record_draft(self, method: str, hints: DraftHints, drafts: int, accepted: int) -> None:
        """Per-token outcome of a verified model-free draft, for the hazard bins."""
        if drafts > 0:
            self.acceptance.record(method, hints, drafts, accepted)

    # ---- decision -----------------------------------------------------------------------

    def choose(self, candidates: list[Candidate], num_other_tokens: int,
               num_other_decodes: int = 0) -> dict[int, int]:
        """k per candidate key. ``num_other_tokens``: prefill tokens also in the step;
        ``num_other_decodes``: sequences decoding one token in it without drafts."""
        if not self.adaptive:
            return {c.key: c.k_max for c in candidates}
        self._decisions += 1
        ks = self._model_choice(candidates, num_other_tokens, num_other_decodes)
        for c in candidates:
            if ks[c.key] == 0:
                for stats in self.seq_stats.get(c.key, {}).values():
                    stats.relax()
                # The method's global rate fades toward the starting prior too: it only
                # learns from drafts, so a few rejected ones (a warm-up, an unlucky first
                # request) would otherwise keep every later sequence at k = 0 for good.
                glob = self.global_stats.get(c.method)
                if glob is not None:
                    glob.relax(_GLOBAL_RELAX)
        return ks

    def _model_choice(self, candidates: list[Candidate], num_other_tokens: int,
                      num_other_decodes: int = 0) -> dict[int, int]:
        """Greedy search over the k's. A refining trial changes one sequence's k, so the step's
        totals are updated, not recomputed (see ``_StepTotals``)."""
        n_base = num_other_tokens + num_other_decodes + len(candidates)
        k_top = max(c.k_max for c in candidates)

        def totals(ks: dict[int, int]) -> _StepTotals:
            return _StepTotals(self, candidates, ks, n_base, num_other_decodes, k_top)

        # 1. The best common k (the draft's per-step cost is shared by every sequence, so one
        # sequence alone may not pay for a step that the whole batch does).
        best_ks = {c.key: 0 for c in candidates}
        best = totals(best_ks).value()
        for level in range(1, k_top + 1):
            ks = {c.key: min(level, c.k_max) for c in candidates}
            value = totals(ks).value()
            if value > best * 1.0001:
                best, best_ks = value, ks
        if self._decisions % _EXPLORE_EVERY == 0:
            trial = self._worth_measuring(candidates, totals, best, k_top)
            if trial is not None:
                return trial
        step = totals(best_ks)
        # 2. Drop whole drafts that do not pay: a proposer's host time is paid once a sequence
        # drafts at all, so one token less may not pay where no draft at all does.
        for c in sorted(candidates, key=lambda c: c.rate):
            k_old = step.ks[c.key]
            if k_old == 0 or c.host_seconds <= 0.0:
                continue
            step.move(c, 0)
            value = step.value()
            if value > best * 1.0001:
                best = value
            else:
                step.move(c, k_old)
        # 3. Refine per sequence: shorten drafts that do not pay, lengthen those that do.
        for delta in (-1, 1):
            for c in sorted(candidates, key=lambda c: c.rate):
                while 0 <= step.ks[c.key] + delta <= c.k_max:
                    k_old = step.ks[c.key]
                    step.move(c, k_old + delta)
                    value = step.value()
                    if value <= best * 1.0001:
                        step.move(c, k_old)
                        break
                    best = value
        return step.ks


    def _worth_measuring(self, candidates: list[Candidate],
                         totals: Callable[[dict[int, int]], _StepTotals], best: float,
                         k_top: int) -> dict[int, int] | None:
        """The smallest common k whose step size has no measurement yet, that beats
        ``best`` at its optimistic price and loses at most ``1 - _EXPLORE_FLOOR`` of it at the
        table's, or None. The smallest: a try of the longest draft the optimistic price favours
        spent 16 rows at ~4x a step's cost, 15% of a code answer's time, on the 0.5B file."""
        trial_value = best * 1.0001
        for level in range(1, k_top + 1):
            ks = {c.key: min(level, c.k_max) for c in candidates}
            step = totals(ks)
            if self.target_cost.measured(step.tokens):
                continue
            if step.value() < _EXPLORE_FLOOR * best:
                continue
            if step.value(optimistic=True) > trial_value:
                return ks
        return None


class _StepTotals:
    """One choice of ks and the step's sums under it: expected tokens, tokens fed, proposer host
    time, draft-model sequences per k. ``move`` changes one sequence's k in O(k_max), so the
    search costs O(B * k_max) per step instead of O(B^2 * k_max) (~100 ms of Python at 64
    sequences and k_max 16)."""

    def __init__(self, policy: SpeculationPolicy, candidates: list[Candidate],
                 ks: dict[int, int], n_base: int, num_other_decodes: int, k_top: int) -> None:
        self.policy = policy
        self.ks = dict(ks)
        self.plain = policy.target_cost(n_base)
        self.gain = num_other_decodes + sum(c.expected(ks[c.key]) for c in candidates)
        self.tokens = n_base + sum(ks.values())
        self.host = sum(c.host_seconds for c in candidates if ks[c.key] > 0)
        self.model_ks = [0] * (k_top + 1)  # k -> draft-model sequences drafting k tokens
        for c in candidates:
            if c.uses_draft_model and ks[c.key] > 0:
                self.model_ks[ks[c.key]] += 1

    def value(self, optimistic: bool = False) -> float:
        """Expected tokens per second of the step (``optimistic``: an unmeasured step size at
        ``_StepCost.optimistic``)."""
        n_model = sum(self.model_ks)
        k_draft = max((k for k, n in enumerate(self.model_ks) if n), default=0)
        draft = k_draft * self.policy.draft_cost(n_model) if n_model else 0.0
        cost = self.policy.target_cost
        # More tokens never cost less: a noisy table must not make drafting look free.
        target = max(cost.optimistic(self.tokens) if optimistic else cost(self.tokens),
                     self.plain)
        return self.gain / (target + draft + self.host)

    def move(self, c: Candidate, k: int) -> None:
        old = self.ks[c.key]
        self.gain += c.expected(k) - c.expected(old)
        self.tokens += k - old
        self.host += c.host_seconds * ((k > 0) - (old > 0))
        if c.uses_draft_model:
            if old > 0:
                self.model_ks[old] -= 1
            if k > 0:
                self.model_ks[k] += 1
        self.ks[c.key] = k
