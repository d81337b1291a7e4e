"""BlockManager under random scheduler/engine traffic, against a shadow KV cache.

The shadow maps slot -> the whole token prefix whose KV it holds (the KV of position p depends on
tokens[0..p]). After every operation, every computed token of every live sequence must find
exactly its own prefix in its slot; a wrong prefix hit, a block reused while still referenced, or
a write into a shared block shows up there. A second shadow does the same for the draft model's
KV (written only by sequences that run the draft), against the block manager's draft-KV record
(``draft_kv_tokens``): a hit that trusts a block's draft KV must find it written.
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

from specserve.core.sequence import Sequence
from specserve.engine.block_manager import BlockManager
from tests.test_block_manager import make_seq


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
