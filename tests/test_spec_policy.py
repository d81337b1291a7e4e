"""The speculation policy prices a model-free proposer's host time (decision logic only: costs
are given, never measured here)."""

from __future__ import annotations

from specserve.spec.policy import Candidate, SpeculationPolicy, expected_tokens
from tests.helpers.speculation import policy_with_step_cost


def test_a_proposer_slower_than_what_its_drafts_save_is_not_used():
    """8 sequences, rows nearly free (10 ms + 0.5 ms per token): 4-token drafts accepted at 0.8
    pay when the proposer is free, and not when it costs 10 ms per sequence (80 ms on a 14 ms
    step: 8 x 3.36 expected tokens in 110 ms is less than 8 tokens in 14 ms)."""
    policy = policy_with_step_cost(0.010, 0.0005)
    free = [Candidate(i, 4, 0.8, False, host_seconds=0.0001) for i in range(8)]
    slow = [Candidate(i, 4, 0.8, False, host_seconds=0.010) for i in range(8)]
    assert all(k > 0 for k in policy.choose(free, 0).values())
    assert all(k == 0 for k in policy.choose(slow, 0).values())


def test_per_method_cost_keeps_the_cheap_proposer_and_drops_the_expensive_one():
    """Two sequences, same acceptance (0.7): one drafts with a 20 us proposer, the other with a
    4 ms one. Rows cost 1 ms each on a 10 ms step. Both drafting 4 tokens gives
    (2 x 2.77) / (20 ms + 4.02 ms) = 230.6 tokens/s; the cheap one alone
    (1 + 2.77) / 16.02 ms = 235.3: the expensive proposer's draft is dropped, although
    shortening it by one token at a time would never show it (its cost is paid per draft)."""
    policy = policy_with_step_cost(0.010, 0.001)
    cheap = Candidate(0, 4, 0.7, False, host_seconds=0.00002)
    dear = Candidate(1, 4, 0.7, False, host_seconds=0.004)
    both = (2 * expected_tokens(0.7, 4)) / (0.020 + 0.00402)
    alone = (1 + expected_tokens(0.7, 4)) / (0.016 + 0.00002)
    assert alone > both  # the premise of the test, from the same model the policy uses
    assert policy.choose([cheap, dear], 0) == {0: 4, 1: 0}
    # Without the host time both draft (3 tokens each: 2 x 2.53 / 18 ms = 281 tokens/s).
    free = Candidate(1, 4, 0.7, False)
    assert all(k > 0 for k in policy.choose([cheap, free], 0).values())


def test_proposer_cost_is_the_median_of_recent_calls():
    """A proposer's first call for a sequence also indexes its prompt: a one-off, not the
    per-step cost."""
    policy = SpeculationPolicy()
    assert policy.proposer_seconds("suffix") == 0.0
    for seconds in (0.050, 0.001, 0.0012, 0.0009, 0.001):
        policy.record_proposer("suffix", seconds)
    assert policy.proposer_seconds("suffix") == 0.001
    assert policy.proposer_seconds("ngram") == 0.0


def test_batch_of_64_choice_matches_a_full_recount():
    """The incremental totals give the k's a from-scratch evaluation of every trial would:
    check the chosen ks are a local optimum of the same goodput computed directly."""
    policy = policy_with_step_cost(0.010, 0.0004)
    cands = [Candidate(i, 16, 0.3 + 0.01 * i, i % 3 == 0, host_seconds=0.0001 * (i % 5))
             for i in range(64)]
    for n in range(1, 65):
        policy.record_draft_step(n, 0.002 + 0.0001 * n)
    ks = policy.choose(cands, 0)

    def goodput(ks):
        gain = sum(expected_tokens(c.rate, ks[c.key]) for c in cands)
        tokens = 64 + sum(ks.values())
        model = [c for c in cands if c.uses_draft_model and ks[c.key] > 0]
        draft = max((ks[c.key] for c in model), default=0) * policy.draft_cost(len(model)) \
            if model else 0.0
        host = sum(c.host_seconds for c in cands if ks[c.key] > 0)
        target = max(policy.target_cost(tokens), policy.target_cost(64))
        return gain / (target + draft + host)

    best = goodput(ks)
    for c in cands:
        for k in {ks[c.key] - 1, ks[c.key] + 1, 0}:
            if 0 <= k <= c.k_max and k != ks[c.key]:
                assert goodput({**ks, c.key: k}) <= best * 1.0001 + 1e-9


def _run_batch_of_one(policy: SpeculationPolicy, step_seconds, rate: float, steps: int
                      ) -> list[int]:
    """``steps`` decisions for one sequence drafting up to 4 tokens at acceptance ``rate``,
    each step recorded at ``step_seconds(tokens fed)``: the k chosen at each."""
    ks = []
    for _ in range(steps):
        k = policy.choose([Candidate(0, 4, rate, False)], 0)[0]
        policy.record_target(1 + k, step_seconds(1 + k))
        ks.append(k)
    return ks


def _overpriced_table(n: int) -> float:
    """Tuner prices like a noisy table of the 0.5B file: 2 rows 1.56x one, 5 rows 2.38x."""
    return {1: 0.0241, 2: 0.0378, 3: 0.0481, 4: 0.0529, 5: 0.0576}[n]


def test_policy_measures_a_step_size_the_kernel_table_overprices():
    """Real steps: 2 rows 1.04x one, 5 rows 1.69x (the engine's own on that file). Drafts
    accepted at 0.5 pay there (1.5 tokens for 1.04x a step), but not at the table's prices,
    so a policy that only trusted the table would keep k = 0 and never see otherwise; it tries
    the sizes it has not measured and, once they are, drafts on every step."""
    real = {1: 0.0208, 2: 0.0217, 3: 0.0257, 4: 0.0260, 5: 0.0352}
    policy = SpeculationPolicy(projection_seconds=_overpriced_table)
    for _ in range(3):
        policy.record_target(1, real[1])
    ks = _run_batch_of_one(policy, real.__getitem__, 0.5, 200)
    assert ks[0] == 0  # the premise: at the table's prices drafting does not pay
    assert all(k > 0 for k in ks[-50:])
    best = max(range(5), key=lambda k: expected_tokens(0.5, k) / real[1 + k])
    assert ks[-1] == best


def test_policy_stops_drafting_once_the_sizes_it_tried_measure_as_dear():
    """Steps really as dear as the table says (each row 0.7 of a step): the tries measure it,
    then the policy stays at k = 0 (acceptance 0.6: 1.6 tokens for 1.7x a step's time)."""
    def dear(n: int) -> float:
        return 0.0208 * (1 + 0.7 * (n - 1))

    policy = SpeculationPolicy(projection_seconds=_overpriced_table)
    for _ in range(3):
        policy.record_target(1, dear(1))
    ks = _run_batch_of_one(policy, dear, 0.6, 200)
    assert any(k > 0 for k in ks[:100])  # tried: at half the table's extra cost it would pay
    assert all(k == 0 for k in ks[-100:])


def test_policy_does_not_try_a_step_size_past_a_cliff_in_the_table():
    """32 decoders; the table shows 33+ rows costing 20x a row before: no decision tries it."""
    def table(n: int) -> float:
        return 0.040 + (0.0002 * n if n <= 32 else 0.0002 * 32 + 0.004 * (n - 32))

    policy = SpeculationPolicy(projection_seconds=table)
    for _ in range(3):
        policy.record_target(32, table(32) + 0.010)
    cands = [Candidate(i, 4, 0.9, False) for i in range(32)]
    assert all(k == 0 for _ in range(40) for k in policy.choose(cands, 0).values())
