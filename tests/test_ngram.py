"""NgramProposer: the vectorized search against a plain-Python reference, and the matching rules."""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specserve.draft.base import Proposal, ProposalRequest, Proposer
from specserve.draft.ngram import NgramProposer, find_ngram_draft


def reference_continuation(tokens: list[int], min_n: int, max_n: int) -> int | None:
    """Longest n first, latest earlier copy: the index after the copy, written out with loops."""
    length = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        if n > length - 1:
            continue  # no room for a copy that ends before the final position
        suffix = tokens[length - n :]
        # Latest start s whose copy ends before the final position: s + n <= length - 1.
        for s in range(length - 1 - n, -1, -1):
            if tokens[s : s + n] == suffix:
                return s + n
    return None


def reference_draft(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The rule: up to k tokens after the copy; if the last token is new, after the copy of the
    context before it, one token further on (an edit)."""
    begin = reference_continuation(tokens, min_n, max_n)
    if begin is None:
        begin = reference_continuation(tokens[:-1], min_n, max_n)
        if begin is None:
            return []
        begin += 1
    return tokens[begin : begin + k]


def propose_one(tokens: list[int], k: int, min_n: int = 1, max_n: int = 4) -> list[int]:
    proposal = NgramProposer(min_n, max_n).propose([ProposalRequest(0, tokens, k)])
    assert len(proposal.draft_token_ids) == 1
    return proposal.draft_token_ids[0]


def test_reference_matches_on_seeded_random_sequences() -> None:
    rng = random.Random(1234)
    for _ in range(3000):
        alphabet = rng.randint(1, 6)
        tokens = [rng.randrange(alphabet) for _ in range(rng.randint(0, 80))]
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(1, 10)
        got = propose_one(tokens, k, min_n, max_n)
        assert got == reference_draft(tokens, k, min_n, max_n), (tokens, k, min_n, max_n)
        assert len(got) <= k


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=60),
    k=st.integers(1, 8),
    min_n=st.integers(1, 4),
    extra_n=st.integers(0, 3),
)
def test_reference_matches_hypothesis(tokens: list[int], k: int, min_n: int, extra_n: int) -> None:
    max_n = min_n + extra_n
    assert propose_one(tokens, k, min_n, max_n) == reference_draft(tokens, k, min_n, max_n)


def test_module_docstring_example() -> None:
    assert propose_one([5, 1, 2, 3, 1, 2, 9, 1, 2], k=4, max_n=3) == [9, 1, 2]


def test_module_docstring_edit_example() -> None:
    assert propose_one([4, 5, 6, 7, 8, 4, 5, 9], k=3) == [7, 8, 4]


def test_edit_fallback_only_when_the_last_token_is_new() -> None:
    # 2 has an earlier copy: the plain rule applies, no skipping.
    assert propose_one([1, 2, 3, 4, 1, 2], k=2) == [3, 4]
    # 9 is new and so is the token before it: nothing to resume.
    assert propose_one([1, 2, 3, 8, 9], k=2) == []


def test_longest_n_wins_over_a_later_shorter_match() -> None:
    tokens = [1, 2, 3, 4, 3, 5, 1, 2, 3]
    # n = 3: [1, 2, 3] at s = 0, although [3] alone has a later copy at s = 4.
    assert propose_one(tokens, k=4, max_n=3) == [4, 3, 5, 1]
    assert propose_one(tokens, k=4, max_n=1) == [5, 1, 2, 3]


def test_latest_occurrence_wins() -> None:
    tokens = [7, 8, 1, 7, 8, 2, 7, 8]
    assert propose_one(tokens, k=1, max_n=2) == [2]
    assert propose_one(tokens, k=3, max_n=2) == [2, 7, 8]


def test_truncated_at_k() -> None:
    tokens = [1, 2, 10, 11, 12, 13, 14, 1, 2]
    assert propose_one(tokens, k=2) == [10, 11]
    assert propose_one(tokens, k=5) == [10, 11, 12, 13, 14]


def test_truncated_at_end_of_sequence() -> None:
    # The continuation runs into the suffix region and stops at the last known token.
    assert propose_one([1, 2, 1, 2], k=5) == [1, 2]
    # A run of one token: the latest copy of the 4-gram ends one before the end.
    assert propose_one([6] * 6, k=5, max_n=4) == [6]
    assert propose_one([6] * 6, k=5, max_n=1) == [6]


def test_no_match_is_empty() -> None:
    assert propose_one(list(range(50)), k=4) == []
    assert propose_one([], k=4) == []
    assert propose_one([9], k=4) == []
    # Only a 1-gram matches, but min_n = 2 (and the context before the last token has no 2-gram
    # copy either).
    assert propose_one([1, 2, 3, 1], k=4, min_n=2) == []
    assert propose_one([1, 2, 3, 1], k=4, min_n=1) == [2, 3, 1]


def test_suffix_is_never_its_own_match() -> None:
    assert propose_one([1, 2, 3], k=4, min_n=1, max_n=3) == []
    assert propose_one([3, 3], k=4) == [3]
    # max_n longer than the sequence: the whole sequence is not a match of itself.
    assert propose_one([4, 5], k=4, min_n=1, max_n=8) == []


def test_batch_order_probs_and_protocol() -> None:
    proposer = NgramProposer(min_n=1, max_n=3)
    assert isinstance(proposer, Proposer)
    assert proposer.name == "ngram"
    seqs = [[1, 2, 3, 1, 2], list(range(10)), [7, 7, 7]]
    before = [list(s) for s in seqs]
    reqs = [ProposalRequest(seq_id=10 + i, token_ids=s, num_tokens=3) for i, s in enumerate(seqs)]
    proposal = proposer.propose(reqs)
    assert isinstance(proposal, Proposal)
    assert proposal.draft_token_ids == [[3, 1, 2], [], [7]]
    assert all(type(t) is int for d in proposal.draft_token_ids for t in d)
    assert proposal.draft_probs is None
    assert seqs == before  # token_ids are read-only
    assert proposer.propose([]).draft_token_ids == []


def test_large_token_ids() -> None:
    big = 2**40
    assert propose_one([big, big + 1, 5, big], k=2) == [big + 1, 5]


def test_long_sequence_speed() -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32000, size=20_000).tolist()
    tokens += tokens[5000:5003]  # a 3-gram with a copy far back
    proposer = NgramProposer(min_n=1, max_n=4)
    req = ProposalRequest(seq_id=0, token_ids=tokens, num_tokens=5)
    proposer.propose([req])  # warm-up
    t0 = time.perf_counter()
    proposal = proposer.propose([req])
    ms = (time.perf_counter() - t0) * 1e3
    print(f"ngram propose, 20k tokens: {ms:.2f} ms")
    assert proposal.draft_token_ids[0] == reference_draft(tokens, 5, 1, 4)
    assert proposal.draft_token_ids[0] == tokens[5003:5008]


def test_find_ngram_draft_returns_array() -> None:
    draft = find_ngram_draft(np.array([1, 2, 3, 1, 2]), k=2, min_n=1, max_n=2)
    assert draft.tolist() == [3, 1]


@pytest.mark.parametrize(("min_n", "max_n"), [(3, 2), (0, 4), (-1, 1), (0, 0)])
def test_invalid_n_range(min_n: int, max_n: int) -> None:
    with pytest.raises(ValueError, match=rf"min_n must be >= 1 and <= max_n \(got {min_n}, "):
        NgramProposer(min_n, max_n)


def test_invalid_num_tokens() -> None:
    with pytest.raises(ValueError, match="num_tokens must be >= 1"):
        NgramProposer().propose([ProposalRequest(seq_id=0, token_ids=[1, 1], num_tokens=0)])
