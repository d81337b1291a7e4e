"""Continuous batching: which sequences run this step, and how many tokens each feeds.

Like vLLM v1, the scheduler only counts tokens. A running sequence needs
``num_tokens - num_computed_tokens`` more tokens fed (1 while decoding, the rest of its prompt
while prefilling); a step packs running sequences first (FCFS), then admits waiting ones, until the
token budget ``max_num_batched_tokens`` or ``max_num_seqs`` is reached. A prompt larger than the
remaining budget is fed in chunks over several steps (chunked prefill), mixed with decodes.

A decoding sequence also verifies ``seq.num_lookahead_slots`` draft tokens (set by the
speculator before each schedule, as vLLM v1's scheduler reserves lookahead slots): its chunk is
``1 + k`` tokens, with ``k`` cut to what the budget still allows.

When the KV pool runs dry, speculation yields first: the sequence's own lookahead (k) drops to 0,
then the lookahead of the sequences already scheduled this step is returned. Only then is the
newest running sequence preempted by recompute: its blocks are
freed and it returns to the front of the waiting queue with its outputs so far, to be prefilled
again later (a prefix-cache hit usually makes that cheap). A sequence is always in exactly one of
``waiting`` / ``running`` until it finishes, so no request is lost or duplicated.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from specserve.core.batch import ScheduledBatch, ScheduledSeq
from specserve.core.config import EngineConfig
from specserve.core.sequence import Sequence, SequenceStatus
from specserve.engine.block_manager import BlockManager

if TYPE_CHECKING:
    from specserve.engine.resolve import ResolvedConfig


class Scheduler:
    def __init__(self, config: EngineConfig | ResolvedConfig, block_manager: BlockManager
                 ) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens

        # 1. Running sequences, oldest first. Preempt from the newest end when blocks run out.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            decoding = seq.num_tokens - seq.num_computed_tokens == 1
            k = min(seq.num_lookahead_slots, budget - n) if decoding else 0
            while not self.block_manager.allocate_slots(seq, n, k):
                if k:  # drop this sequence's drafts before preempting anyone for their slots
                    k = 0
                    continue
                if self._drop_lookahead(batch):  # then the drafts of those already scheduled
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.scheduled.append(ScheduledSeq(seq, n, k))
                budget -= n + k
                i += 1

        # 2. Admit waiting sequences (FCFS) while there is room; not after a preemption, which
        # would only thrash the pool.
        while (
            self.waiting
            and budget > 0
            and not batch.preempted
            and len(self.running) < self.max_num_seqs
        ):
            seq = self.waiting[0]
            if not seq.block_table:
                self.block_manager.allocate_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.allocate_slots(seq, n):
                # Undo the prefix hit so the blocks stay evictable while it waits.
                self.block_manager.free(seq)
                seq.num_computed_tokens = seq.num_cached_tokens = 0
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        return batch

    def _drop_lookahead(self, batch: ScheduledBatch) -> bool:
        """Speculation yields before anyone is preempted: returns the lookahead blocks of the
        sequences already scheduled (their k becomes 0 this step). False if there were none."""
        dropped = False
        for s in batch.scheduled:
            if s.num_lookahead:
                seq = s.seq
                self.block_manager.truncate(seq, seq.num_computed_tokens + s.num_new_tokens)
                s.num_lookahead = 0
                dropped = True
        return dropped

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.reset_for_recompute()
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        """Removes a finished (or aborted) sequence from whichever queue holds it and frees its
        KV blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
