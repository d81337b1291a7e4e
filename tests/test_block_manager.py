"""BlockManager: allocation, ref counts, LRU reuse, prefix caching, speculative rollback.

The stateful test keeps a shadow KV cache: slot -> the whole token prefix whose KV it holds
(the KV of position p depends on tokens[0..p]). After every operation, every computed token of
every live sequence must find exactly its own prefix in its slot; a wrong prefix hit, a block
reused while still referenced, or a write into a shared block shows up there. A second shadow
does the same for the draft model's KV (written only by sequences that run the draft), against
the block manager's draft-KV record (``draft_kv_tokens``): a hit that trusts a block's draft KV
must find it written.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

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


# ---------------------------------------------------------------------- stateful property test
class BlockManagerMachine(RuleBasedStateMachine):
    """Random scheduler/engine traffic against one BlockManager and a shadow KV cache."""

    seqs = Bundle("seqs")

    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(4, 24),
        caching=st.booleans(),
    )
    def setup(self, block_size: int, num_blocks: int, caching: bool) -> None:
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.bs = block_size
        self.live: dict[int, Sequence] = {}
        self.prompts: list[list[int]] = [[]]
        self.shadow: dict[int, tuple[int, ...]] = {}  # slot -> token prefix its KV was built from
        self.draft_shadow: dict[int, tuple[int, ...]] = {}  # the same for the draft model's KV
        self.needs_draft_kv: set[int] = set()  # sequences under require_draft_kv_hits
        self.next_id = 0

    # -- helpers
    def _slot(self, seq: Sequence, pos: int) -> int:
        return seq.block_table[pos // self.bs] * self.bs + pos % self.bs

    def _run(self, seq: Sequence, tokens: list[int], start: int, shadow: dict | None = None
             ) -> None:
        """Forward pass: write KV for positions start.. of ``tokens`` into their slots."""
        shadow = self.shadow if shadow is None else shadow
        for pos in range(start, len(tokens)):
            shadow[self._slot(seq, pos)] = tuple(tokens[: pos + 1])

    def _ensure_prefix(self, seq: Sequence) -> None:
        """What the scheduler does for a sequence without blocks (new, preempted, rolled back)."""
        if not seq.block_table:
            hit = self.bm.allocate_prefix(seq)
            assert hit % self.bs == 0 and seq.num_computed_tokens == seq.num_cached_tokens == hit
            assert seq.num_tokens - hit >= 1
            self._check_kv(seq)  # the hit blocks hold exactly this sequence's prefix
            draft = self.bm.draft_kv_tokens(seq.seq_id)
            assert draft <= hit and draft % self.bs == 0
            if seq.seq_id in self.needs_draft_kv:  # hits only blocks whose draft KV is written
                assert draft == hit
            if draft:
                event("draft KV reused")
            event("prefix hit" if hit else "prefix miss")

    def _admit(self, seq: Sequence, chunk: int, sampled: int) -> None:
        self._ensure_prefix(seq)
        n = min(chunk, seq.num_tokens - seq.num_computed_tokens)
        free_before = self.bm.num_free_blocks
        if not self.bm.allocate_slots(seq, n):
            assert self.bm.num_free_blocks == free_before
            event("allocation failed")
            self.bm.free(seq)  # scheduler rollback
            return
        self._run(seq, seq.token_ids[: seq.num_computed_tokens + n], seq.num_computed_tokens)
        seq.num_computed_tokens += n
        self.bm.commit_computed(seq)
        if seq.num_computed_tokens == seq.num_tokens:  # prompt done: the step samples a token
            seq.append_token(sampled)

    def _check_kv(self, seq: Sequence) -> None:
        for pos in range(seq.num_computed_tokens):
            assert self.shadow.get(self._slot(seq, pos)) == tuple(seq.token_ids[: pos + 1]), (
                f"seq {seq.seq_id} pos {pos}: wrong KV"
            )
        for pos in range(self.bm.draft_kv_tokens(seq.seq_id)):
            assert self.draft_shadow.get(self._slot(seq, pos)) == tuple(
                seq.token_ids[: pos + 1]), f"seq {seq.seq_id} pos {pos}: wrong draft KV"

    # -- rules
    @rule(
        target=seqs,
        donor=st.integers(0, 1000),
        share=st.integers(0, 12),
        extra=st.lists(st.integers(0, 2), min_size=1, max_size=8),
        from_target=st.booleans(),
    )
    def new_seq(self, donor: int, share: int, extra: list[int], from_target: bool) -> Sequence:
        base = self.prompts[donor % len(self.prompts)]  # fork by prefix of an earlier prompt
        prompt = base[:share] + extra
        self.prompts.append(prompt)
        self.next_id += 1
        seq = make_seq(prompt, seq_id=self.next_id)
        if from_target:  # an EAGLE head's sequence
            self.bm.require_draft_kv_hits(seq.seq_id)
            self.needs_draft_kv.add(seq.seq_id)
        self.live[seq.seq_id] = seq
        return seq

    @rule(seq=seqs, chunk=st.integers(1, 9), sampled=st.integers(0, 2))
    def prefill_chunk(self, seq: Sequence, chunk: int, sampled: int) -> None:
        if seq.seq_id in self.live and seq.num_tokens - seq.num_computed_tokens > 1:
            self._admit(seq, chunk, sampled)

    @rule(seq=seqs, n=st.integers(1, 9))
    def draft_catch_up(self, seq: Sequence, n: int) -> None:
        """The draft model computes KV for up to n tokens it lacks (beside a prefill chunk)."""
        if seq.seq_id not in self.live or not seq.block_table:
            return
        draft = self.bm.draft_kv_tokens(seq.seq_id)
        end = min(seq.num_computed_tokens, draft + n)
        self._run(seq, seq.token_ids[:end], draft, self.draft_shadow)
        self.bm.set_draft_kv_tokens(seq.seq_id, max(draft, end))
        self.bm.commit_computed(seq)

    @rule(seq=seqs, k=st.integers(0, 4), accepted=st.integers(0, 4), drafts=st.data(),
          model_draft=st.booleans())
    def decode(self, seq: Sequence, k: int, accepted: int, drafts: st.DataObject,
               model_draft: bool) -> None:
        if seq.seq_id not in self.live:
            return
        self._ensure_prefix(seq)
        if seq.num_tokens - seq.num_computed_tokens != 1:
            return
        if not self.bm.allocate_slots(seq, 1, num_lookahead=k):
            return
        draft = drafts.draw(st.lists(st.integers(0, 2), min_size=k, max_size=k))
        start = seq.num_computed_tokens
        if model_draft and k:  # the draft model fed what it lacked, then d_1 .. d_{k-1}
            self._run(seq, seq.token_ids + draft[:-1], self.bm.draft_kv_tokens(seq.seq_id),
                      self.draft_shadow)
        self._run(seq, seq.token_ids + draft, start)  # verify pass over last token + k drafts
        a = min(accepted, k)
        for t in draft[:a] + [drafts.draw(st.integers(0, 2))]:  # accepted drafts + bonus token
            seq.append_token(t)
        seq.num_computed_tokens = start + 1 + a
        if model_draft and k:  # what the engine keeps of the draft's KV (speculator)
            self.bm.set_draft_kv_tokens(seq.seq_id, min(start + k, seq.num_tokens - 1))
        self.bm.truncate(seq, seq.num_tokens)
        self.bm.commit_computed(seq)

    @rule(seq=seqs, cut=st.integers(0, 12))
    def rollback(self, seq: Sequence, cut: int) -> None:
        if seq.seq_id not in self.live:
            return
        new_len = max(0, seq.num_tokens - cut)
        if new_len < self.bm.num_committed_tokens(seq):
            table = list(seq.block_table)
            with pytest.raises(ValueError, match="committed"):
                self.bm.truncate(seq, new_len)
            assert seq.block_table == table
            event("truncate refused")
            return
        if new_len < seq.num_prompt_tokens or new_len - 1 < self.bm.num_committed_tokens(seq):
            return  # the engine only rolls back generated, uncommitted tokens
        self.bm.truncate(seq, new_len)
        del seq.token_ids[new_len:]
        # The last kept token is fed again next step, as after a normal decode.
        seq.num_computed_tokens = min(seq.num_computed_tokens, new_len - 1)
        self.bm.set_draft_kv_tokens(seq.seq_id,
                                    min(self.bm.draft_kv_tokens(seq.seq_id), new_len - 1))
        assert len(seq.block_table) <= -(-new_len // self.bs)

    @rule(seq=consumes(seqs))
    def finish(self, seq: Sequence) -> None:
        self.bm.free(seq)
        self.bm.forget_draft_kv(seq.seq_id)
        assert self.bm.draft_kv_tokens(seq.seq_id) == 0
        self.live.pop(seq.seq_id, None)
        self.prompts.append(list(seq.token_ids))

    @rule(seq=seqs)
    def preempt(self, seq: Sequence) -> None:
        if seq.seq_id in self.live:
            self.bm.free(seq)
            seq.reset_for_recompute()

    # -- invariants
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "bm"):
            return
        self.bm.check_invariants()
        refs: dict[int, int] = {}
        for seq in self.live.values():
            assert len(set(seq.block_table)) == len(seq.block_table)
            assert len(seq.block_table) * self.bs >= seq.num_computed_tokens
            for b in seq.block_table:
                refs[b] = refs.get(b, 0) + 1
            self._check_kv(seq)
        for block in self.bm.blocks:
            assert block.ref_count == refs.get(block.block_id, 0)
        assert sum(b.ref_count for b in self.bm.blocks) == sum(refs.values())
        assert self.bm.num_free_blocks + len(refs) == self.bm.num_blocks

    def teardown(self) -> None:
        if not hasattr(self, "bm"):
            return
        for seq in self.live.values():
            self.bm.free(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        self.bm.check_invariants()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_block_manager_machine = BlockManagerMachine.TestCase
