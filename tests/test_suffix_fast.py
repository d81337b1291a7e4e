"""The C++ suffix trie (draft/csrc/suffix_trie.cpp) against the Python one (draft/suffix_trie.py,
itself checked against a brute-force reference in test_suffix.py): the same drafts, draft
probabilities, match lengths and sources, step by step, on random streams and on real text (the
agentic and templated workloads), with a global cache small enough to evict."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from specserve.draft import suffix_trie_ext
from specserve.draft.base import FinishedSequence, ProposalRequest
from specserve.draft.suffix import SuffixOptions, SuffixProposer
from tests.helpers.reference import random_text

WORKLOADS = Path(__file__).parents[1] / "benchmarks" / "workloads"


def test_the_cpp_trie_builds_here():
    """CI runs on a clean machine with a compiler: the fast trie must build there (the proposer
    would silently fall back to the Python one otherwise)."""
    assert suffix_trie_ext.available()


def replay(streams: list[list[int]], prompt_len: int, opts: dict, seed: int) -> None:
    """Decodes every stream with both proposers side by side: each step the true continuation
    grows by the accepted part of the draft plus one token, as in the engine; a finished
    stream's output feeds both global caches."""
    rng = random.Random(seed)
    py = SuffixProposer(SuffixOptions(impl="python", **opts))
    cc = SuffixProposer(SuffixOptions(impl="cpp", **opts))
    for sid, text in enumerate(streams):
        tenant = rng.choice("ab")
        done = min(prompt_len, len(text) - 1)
        while done < len(text):
            k = rng.choice([1, 4, 16])
            req = ProposalRequest(sid, text[:done], k, tenant=tenant)
            a, b = py.draft(req), cc.draft(req)
            assert (a.tokens, a.match_length, a.source) == (b.tokens, b.match_length, b.source)
            assert a.probs == b.probs  # the same float operations in the same order
            accepted = 0
            while accepted < len(a.tokens) and done + accepted < len(text) \
                    and a.tokens[accepted] == text[done + accepted]:
                accepted += 1
            done += accepted + 1
        for p in (py, cc):
            p.finish(FinishedSequence(sid, text, prompt_len, tenant=tenant, method="suffix"))
        assert py.cached_tokens == cc.cached_tokens


@pytest.mark.parametrize("seed", range(4))
def test_same_drafts_as_the_python_trie_on_random_streams(seed):
    rng = random.Random(seed)
    for _ in range(6):
        depth = rng.randint(2, 12)
        streams = [random_text(rng, rng.randint(2, 120)) for _ in range(8)]
        opts = dict(max_depth=depth, cache_tokens=rng.randint(30, 300),
                    spec_factor=rng.choice([0.5, 1.0, 2.0]), min_prob=rng.choice([0.0, 0.1, 0.4]))
        replay(streams, rng.randint(1, 40), opts, seed)


@pytest.mark.parametrize("workload", ["agentic", "templated"])
def test_same_drafts_as_the_python_trie_on_real_text(workload):
    """The workloads' chats as UTF-8 bytes: real repetition (JSON tool calls, templates)."""
    chats = json.loads((WORKLOADS / f"{workload}.json").read_text())
    streams = [list("\n".join(m["content"] for m in chat).encode())[:700] for chat in chats[:6]]
    replay(streams, 200, dict(max_depth=32, cache_tokens=1500), 0)
