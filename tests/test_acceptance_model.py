"""Per-token acceptance of model-free drafts (specserve/spec/acceptance_model.py): the hazards it
learns against the ones that generated the outcomes, and what the policy does with them."""

from __future__ import annotations

import random

import numpy as np
import pytest

from specserve.core.sampling_params import SamplingParams
from specserve.draft.base import ProposalRequest
from specserve.draft.ngram import NgramProposer, find_ngram_match
from specserve.draft.suffix import SuffixProposer
from specserve.spec.acceptance_model import AcceptanceModel, DraftHints, expected_by_k
from specserve.spec.policy import Candidate
from tests.helpers.speculation import (
    check_greedy,
    copy_prompt,
    make,
    policy_with_step_cost,
    with_fixed_costs,
)


def _simulate(model: AcceptanceModel, hazard, rng: random.Random, drafts: int,
              cut: bool) -> None:
    """Drafts of 8 tokens with match lengths 1 or 12; token i is accepted with probability
    hazard(match, i) once the tokens before it were. ``cut``: the verify examines a random
    prefix (the policy's cut), as the engine does."""
    for _ in range(drafts):
        match = rng.choice((1, 12))
        hints = DraftHints(match, ())
        examined = rng.randint(1, 8) if cut else 8
        accepted = 0
        while accepted < examined and rng.random() < hazard(match, accepted):
            accepted += 1
        model.record("suffix", hints, examined, accepted)


def test_learned_hazards_match_the_generating_ones_even_when_drafts_are_cut():
    """Long matches accepted 0.95 per token, one-token matches 0.3 at position 0 and 0.6 after:
    from 6000 drafts (half of them cut short at random) the learned per-position hazard of an
    8-token draft is within 0.05 of the generating one at every position, for both kinds (the
    bins remember ~500 examined tokens each: the standard error is ~0.01-0.02)."""
    def hazard(match: int, i: int) -> float:
        return 0.95 if match > 1 else (0.3 if i == 0 else 0.6)

    model = AcceptanceModel()
    rng = random.Random(0)
    _simulate(model, hazard, rng, 3000, cut=False)
    _simulate(model, hazard, rng, 3000, cut=True)
    for match in (1, 12):
        alive = model.survival("suffix", DraftHints(match, ()), 8, 0.5, 0.5)
        learned = np.array(alive) / np.array([1.0, *alive[:-1]])
        exact = np.array([hazard(match, i) for i in range(len(alive))])
        assert len(alive) == 8
        assert np.max(np.abs(learned - exact)) < 0.05, (match, learned, exact)


def test_the_proposers_own_probability_separates_drafts():
    """The same match length, the draft's conditional probability 0.5 vs 1: tokens the trie was
    unsure of are accepted 0.2 of the time, sure ones 0.9; the model learns both."""
    model = AcceptanceModel()
    rng = random.Random(1)
    for _ in range(4000):
        unsure = rng.random() < 0.5
        hints = DraftHints(6, (0.5,) if unsure else (1.0,))
        accepted = int(rng.random() < (0.2 if unsure else 0.9))
        model.record("ngram", hints, 1, accepted)
    low = model.survival("ngram", DraftHints(6, (0.5,)), 1, 0.5, 0.5)[0]
    high = model.survival("ngram", DraftHints(6, (1.0,)), 1, 0.5, 0.5)[0]
    assert abs(low - 0.2) < 0.04 and abs(high - 0.9) < 0.04


def test_a_sequence_above_its_method_shifts_its_hazards_up():
    model = AcceptanceModel()
    hints = DraftHints(3, ())
    plain = model.survival("suffix", hints, 4, 0.6, 0.6)
    better = model.survival("suffix", hints, 4, 0.9, 0.6)
    worse = model.survival("suffix", hints, 4, 0.3, 0.6)
    assert all(w < p < b for w, p, b in zip(worse, plain, better))
    # no evidence at all: the method's rate per token, as the geometric model has it
    assert plain == pytest.approx([0.6 ** (i + 1) for i in range(4)])


def test_expected_by_k_adds_the_bonus_token():
    assert expected_by_k([0.9, 0.5]) == pytest.approx((1.0, 1.9, 2.4))
    assert expected_by_k([]) == (1.0,)


def test_the_policy_drafts_what_the_draft_is_sure_of():
    """Two sequences with the same acceptance rate (0.6) and 8-token drafts; each row costs
    a fifth of a one-row step. A draft whose tokens survive 0.95 each is taken whole, one whose
    first token survives 0.1 is not drafted at all; the rate alone prices both at k = 2."""
    policy = policy_with_step_cost(0.010, 0.002)
    sure = expected_by_k(list(np.cumprod([0.95] * 8)))
    unsure = expected_by_k(list(np.cumprod([0.1] + [0.5] * 7)))
    ks = policy.choose([Candidate(0, 8, 0.6, False, method="suffix", expected_by_k=sure),
                        Candidate(1, 8, 0.6, False, method="suffix", expected_by_k=unsure)], 0)
    assert ks == {0: 8, 1: 0}
    by_rate = policy.choose([Candidate(0, 8, 0.6, False), Candidate(1, 8, 0.6, False)], 0)
    assert by_rate == {0: 2, 1: 2}


def test_ngram_and_suffix_report_their_match_length():
    tokens = np.array([5, 1, 2, 3, 1, 2, 9, 1, 2])
    draft, n = find_ngram_match(tokens, 4, 1, 3)
    assert draft.tolist() == [9, 1, 2] and n == 2
    # the edit fallback: the last token is new, its draft copies past the edit
    draft, n = find_ngram_match(np.array([4, 5, 6, 7, 8, 4, 5, 9]), 3, 1, 3)
    assert draft.tolist() == [7, 8, 4] and n == 0
    assert find_ngram_match(np.array([1, 2, 3]), 2, 1, 3)[0].size == 0
    req = ProposalRequest(0, tokens.tolist(), 4)
    assert NgramProposer(1, 3).propose([req]).match_lengths == [2]
    prop = SuffixProposer().propose([ProposalRequest(0, [7, 8, 9, 1, 2, 3, 7, 8, 9], 4)])
    assert prop.draft_token_ids == [[1, 2, 3, 7]] and prop.match_lengths == [3]


def test_the_engine_learns_hazards_from_verified_drafts(models):
    """Adaptive suffix decoding through the engine: greedy output equals transformers', and
    the verified draft tokens land in the suffix bins (at least the accepted ones, at most the
    drafted ones: the examined tokens lie between, less the bins' slow decay)."""
    target, _, hf = models
    engine = with_fixed_costs(make(target, speculative_method="suffix",
                                   adaptive_speculation=True, suffix_speculative_tokens=8))
    outs = check_greedy(engine, hf, [copy_prompt(2), copy_prompt(3)])
    drafted = sum(o.timings.num_drafted for o in outs)
    accepted = sum(o.timings.num_accepted for o in outs)
    bins = engine.speculator.policy.acceptance.bins
    examined = sum(b.examined for key, b in bins.items() if key[0] == "suffix")
    assert drafted > 0
    assert 0.9 * accepted <= examined <= drafted


def test_sampled_requests_keep_their_own_acceptance(models):
    """Greedy and sampled requests over the same repetitive prompts: the speculator tracks their
    acceptance under separate names (a sample matches a draft less often than an argmax), and
    both kinds' verified draft tokens reach their own hazard bins."""
    target, _, hf = models
    engine = with_fixed_costs(make(target, speculative_method="suffix",
                                   adaptive_speculation=True, suffix_speculative_tokens=8))
    prompts = [copy_prompt(4), copy_prompt(5)]
    check_greedy(engine, hf, prompts)
    engine.generate(prompts, SamplingParams(max_tokens=24, temperature=1.5, ignore_eos=True))
    policy = engine.speculator.policy
    assert {"suffix", "suffix:sampled"} <= set(policy.global_stats)
    methods = {key[0] for key in policy.acceptance.bins}
    assert {"suffix", "suffix:sampled"} <= methods
    assert policy.method_rate("suffix:sampled") < policy.method_rate("suffix")
