"""BlockManager: allocation, ref counts, LRU reuse, prefix caching, speculative rollback, one
behaviour per test (the random-traffic property test is tests/test_block_manager_stateful.py)."""

from __future__ import annotations

import pytest

from specserve.core.errors import ConfigError
from specserve.core.sampling_params import SamplingParams
from specserve.core.sequence import Sequence
from specserve.engine import block_manager as bm_mod
from specserve.engine.block_manager import BlockManager

_next_id = [0]


def make_seq(tokens: list[int], seq_id: int | None = None) -> Sequence:
    if seq_id is None:
        _next_id[0] += 1
        seq_id = _next_id[0]
    return Sequence(
        seq_id=seq_id,
        request_id=str(seq_id),
        prompt_token_ids=list(tokens),
        params=SamplingParams(),
    )


def prefill(bm: BlockManager, seq: Sequence) -> int:
    """Prefix hits + one chunk for the whole rest of the prompt + commit; returns hit tokens."""
    hit = bm.allocate_prefix(seq)
    assert bm.allocate_slots(seq, seq.num_tokens - seq.num_computed_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_computed(seq)
    return hit


# ---------------------------------------------------------------------- construction
@pytest.mark.parametrize("kwargs", [{"num_blocks": 0}, {"num_blocks": 4, "block_size": 0}])
def test_bad_config_is_a_typed_error(kwargs: dict) -> None:
    with pytest.raises(ConfigError, match=">= 1"):
        BlockManager(**kwargs)


def test_block_size_error_message() -> None:
    with pytest.raises(ValueError, match=r"block_size must be an integer >= 1 \(got 0\)"):
        BlockManager(4, block_size=0)


# ---------------------------------------------------------------------- allocation
def test_allocate_and_append_across_block_boundaries() -> None:
    bm = BlockManager(8, block_size=4)
    seq = make_seq([1, 2, 3, 4, 5])
    assert bm.allocate_prefix(seq) == 0
    assert bm.num_blocks_needed(seq, 5) == 2
    assert bm.allocate_slots(seq, 5)
    assert len(seq.block_table) == 2 and bm.num_used_blocks == 2
    seq.num_computed_tokens = 5
    for n in range(6, 10):  # decode: tokens 6..9 fill block 1, token 9 needs block 2
        seq.append_token(n)
        assert bm.allocate_slots(seq, 1)
        seq.num_computed_tokens += 1
        assert len(seq.block_table) == -(-seq.num_computed_tokens // 4)
    assert len(seq.block_table) == 3
    assert len(set(seq.block_table)) == 3
    assert bm.usage == pytest.approx(3 / 8)
    bm.check_invariants()


def test_lookahead_slots() -> None:
    bm = BlockManager(8, block_size=4)
    seq = make_seq([1, 2, 3])
    bm.allocate_prefix(seq)
    seq.num_computed_tokens = 0
    assert bm.allocate_slots(seq, 3)
    seq.num_computed_tokens = 2  # last token not computed: decode step with k = 5 drafts
    assert bm.num_blocks_needed(seq, 1, 5) == 1  # 2 + 1 + 5 = 8 tokens -> 2 blocks
    assert bm.allocate_slots(seq, 1, num_lookahead=5)
    assert len(seq.block_table) == 2
    assert bm.allocate_slots(seq, 1, num_lookahead=6)  # 9 tokens -> 3 blocks
    assert len(seq.block_table) == 3
    with pytest.raises(ValueError, match=">= 0"):
        bm.allocate_slots(seq, -1)


def test_allocation_is_all_or_nothing() -> None:
    bm = BlockManager(3, block_size=4)
    a, b = make_seq([1] * 8), make_seq([2] * 8)
    prefill(bm, a)
    assert bm.num_free_blocks == 1
    bm.allocate_prefix(b)
    assert not bm.can_allocate(bm.num_blocks_needed(b, 8))
    assert not bm.allocate_slots(b, 8)
    assert b.block_table == [] and bm.num_free_blocks == 1
    assert bm.allocate_slots(b, 4)  # a smaller chunk fits
    bm.check_invariants()


def test_free_returns_everything() -> None:
    bm = BlockManager(16, block_size=2)
    seqs = [make_seq(list(range(i, i + 7))) for i in range(3)]
    for s in seqs:
        prefill(bm, s)
    assert bm.num_free_blocks == 16 - 3 * 4
    for s in seqs:
        bm.free(s)
        assert s.block_table == []
    bm.free(seqs[0])  # twice is harmless
    assert bm.num_free_blocks == 16 and bm.num_used_blocks == 0 and bm.usage == 0.0
    bm.check_invariants()


# ---------------------------------------------------------------------- prefix caching
def test_prefix_hit_shares_block_ids() -> None:
    bm = BlockManager(16, block_size=4)
    a = make_seq(list(range(10)))  # blocks 0-3, 4-7 full, 8-9 partial
    prefill(bm, a)
    b = make_seq(list(range(8)) + [99, 98, 97])
    assert bm.lookup_prefix(b) == 8
    assert bm.allocate_prefix(b) == 8
    assert b.block_table == a.block_table[:2]
    assert b.num_cached_tokens == b.num_computed_tokens == 8
    assert bm.blocks[a.block_table[0]].ref_count == 2
    assert bm.allocate_slots(b, b.num_tokens - 8)
    assert b.block_table[2] not in a.block_table
    assert (bm.prefix_queries, bm.prefix_hits) == (10 + 11, 8)
    bm.check_invariants()


def test_prefix_hit_leaves_one_token_to_compute() -> None:
    bm = BlockManager(16, block_size=4)
    a = make_seq(list(range(9)))
    prefill(bm, a)
    same = make_seq(list(range(8)))  # exactly two full blocks cached, but only one may hit
    assert bm.allocate_prefix(same) == 4
    assert same.num_tokens - same.num_computed_tokens >= 1
    one_more = make_seq(list(range(9)))
    assert bm.allocate_prefix(one_more) == 8


def test_hit_after_free_revives_blocks_from_free_queue() -> None:
    bm = BlockManager(6, block_size=4)
    a = make_seq(list(range(13)))
    prefill(bm, a)
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 6 and bm.num_cached_blocks == 3
    b = make_seq(list(range(12)) + [50])
    assert bm.allocate_prefix(b) == 12
    assert b.block_table == table[:3]
    assert bm.num_free_blocks == 3  # revived blocks left the free queue
    bm.check_invariants()


def test_failed_allocation_rollback_keeps_hits_cached() -> None:
    bm = BlockManager(4, block_size=4)
    a = make_seq(list(range(9)))
    prefill(bm, a)  # 3 blocks, 2 cached
    b = make_seq(list(range(8)) + [7] * 12)
    assert bm.allocate_prefix(b) == 8
    assert not bm.allocate_slots(b, 12)  # needs 3 more, only 1 free
    bm.free(b)
    assert [bm.blocks[i].ref_count for i in a.block_table] == [1, 1, 1]
    bm.free(a)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 2
    assert bm.allocate_prefix(b) == 8 and b.num_computed_tokens == 8
    bm.check_invariants()


def test_lru_eviction_order() -> None:
    bm = BlockManager(4, block_size=2)
    a, b = make_seq([1, 1, 1, 1, 9]), make_seq([2, 2, 2, 2, 9])
    prefill(bm, a)  # 3 blocks: 2 cached + 1 partial (uncached)
    a_table = list(a.block_table)
    bm.free(a)
    # Uncached partial block is reused first, then a's tail block before its head block.
    prefill(bm, b)
    assert b.block_table == [a_table[2], 3, a_table[1]]
    assert bm.lookup_prefix(make_seq([1, 1, 1, 1, 9])) == 2  # head block still cached
    assert bm.lookup_prefix(make_seq([2, 2, 2, 2, 9])) == 4
    bm.check_invariants()


def test_least_recently_freed_is_reused_first() -> None:
    bm = BlockManager(4, block_size=2)
    a, b = make_seq([1, 1, 5]), make_seq([2, 2, 5])
    prefill(bm, a)
    prefill(bm, b)
    bm.free(a)  # a's cached block enters the queue before b's
    bm.free(b)
    c = make_seq([3, 3, 3, 3])
    bm.allocate_prefix(c)
    assert bm.allocate_slots(c, 4)  # takes the 2 uncached blocks; then nothing cached is gone
    assert bm.lookup_prefix(make_seq([1, 1, 5])) == 2
    d = make_seq([4, 4])
    bm.allocate_prefix(d)
    assert bm.allocate_slots(d, 2)  # evicts a's block (freed first), keeps b's
    assert bm.lookup_prefix(make_seq([1, 1, 5])) == 0
    assert bm.lookup_prefix(make_seq([2, 2, 5])) == 2
    bm.check_invariants()


def test_hash_collision_never_returns_wrong_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bm_mod, "hash_block_tokens", lambda parent, tokens: 0)
    bm = BlockManager(16, block_size=4)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    prefill(bm, a)
    assert bm.num_cached_blocks == 1  # block 1 collides with block 0: kept out of the cache
    assert bm.allocate_prefix(make_seq([5, 6, 7, 8, 0])) == 0  # same hash, other tokens
    # Same tokens as cached block 0 but at block position 1 (another parent): no hit either.
    c = make_seq([1, 2, 3, 4, 1, 2, 3, 4, 0])
    assert bm.allocate_prefix(c) == 4
    assert c.block_table == a.block_table[:1]
    bm.check_invariants()


def test_duplicate_content_keeps_first_cache_entry() -> None:
    bm = BlockManager(16, block_size=2)
    a, b = make_seq([1, 2, 3, 4, 5]), make_seq([1, 2, 3, 4, 5])
    for s in (a, b):  # both prefill before either commits: no hits, duplicate blocks
        assert bm.allocate_prefix(s) == 0
        assert bm.allocate_slots(s, 5)
        s.num_computed_tokens = 5
    bm.commit_computed(a)
    bm.commit_computed(b)
    assert bm.num_cached_blocks == 2
    c = make_seq([1, 2, 3, 4, 6])
    assert bm.allocate_prefix(c) == 4 and c.block_table == a.block_table[:2]
    bm.free(a)
    bm.free(b)  # b's duplicates are unhashed and simply free
    bm.check_invariants()


def test_prefix_caching_disabled() -> None:
    bm = BlockManager(8, block_size=2, enable_prefix_caching=False)
    a = make_seq([1, 2, 3, 4, 5])
    prefill(bm, a)
    assert bm.allocate_prefix(make_seq([1, 2, 3, 4, 5])) == 0
    assert bm.num_cached_blocks == 0 and bm.prefix_queries == 0


# ---------------------------------------------------------------------- rollback
def test_truncate_frees_blocks_past_the_end() -> None:
    bm = BlockManager(8, block_size=4)
    seq = make_seq([1, 2, 3, 4, 5])
    prefill(bm, seq)  # block 0 committed, block 1 holds token 5
    seq.num_computed_tokens = 4
    assert bm.allocate_slots(seq, 1, num_lookahead=7)  # 12 tokens -> 3 blocks
    table = list(seq.block_table)
    seq.num_computed_tokens = 6  # one draft accepted
    bm.truncate(seq, 6)
    assert seq.block_table == table[:2] and bm.num_used_blocks == 2
    assert bm.num_free_blocks == 6
    bm.truncate(seq, 5)
    assert seq.block_table == table[:2] and seq.num_computed_tokens == 5
    bm.truncate(seq, 4)
    assert seq.block_table == table[:1]
    bm.check_invariants()


def test_truncate_refuses_to_cut_a_committed_block() -> None:
    bm = BlockManager(8, block_size=4)
    seq = make_seq(list(range(9)))
    prefill(bm, seq)
    assert bm.num_committed_tokens(seq) == 8
    with pytest.raises(ValueError, match="committed"):
        bm.truncate(seq, 7)
    assert len(seq.block_table) == 3 and seq.num_computed_tokens == 9
    other = make_seq(list(range(8)) + [42])
    bm.allocate_prefix(other)  # shares seq's two blocks
    with pytest.raises(ValueError, match="committed"):
        bm.truncate(other, 3)
    bm.check_invariants()


def test_preempt_then_reallocate_hits_own_blocks() -> None:
    bm = BlockManager(8, block_size=2)
    seq = make_seq([1, 2, 3, 4, 5, 6, 7])
    prefill(bm, seq)
    table = list(seq.block_table)
    bm.free(seq)  # before reset_for_recompute, which clears the table
    seq.reset_for_recompute()
    assert bm.allocate_prefix(seq) == 6 and seq.block_table == table[:3]
