"""What the block manager knows of a sequence's draft KV, and the interface the speculator uses
to tell it.

A draft's KV (a draft model's, an EAGLE head's) lives in tensors indexed by the target's block
ids, so a prefix-cache hit restores it together with the target's, but only for blocks whose
draft KV was written. The block manager marks that per block and keeps, per sequence, how many
leading tokens of draft KV are valid. The record lives there, not on ``Sequence`` and not in the
speculator, because every rule that changes it is a block operation: a hit restores it, ``free``
drops it, a block handed out again loses its mark. The speculator, which runs the draft,
reports progress and reads it back through ``DraftKVLedger``, so ``spec/`` never imports the
engine and the block manager never learns what a proposer is.
"""

from __future__ import annotations

from typing import Protocol


class DraftKVLedger(Protocol):
    def draft_kv_tokens(self, seq_id: int) -> int:
        """Leading tokens of the sequence whose draft KV is written (0 without blocks)."""
        ...

    def set_draft_kv_tokens(self, seq_id: int, num_tokens: int) -> None:
        """The draft's KV now holds the sequence's first ``num_tokens`` tokens."""
        ...

    def require_draft_kv_hits(self, seq_id: int) -> None:
        """Prefix hits of this sequence stop at the first block whose draft KV is not written:
        its draft can rebuild KV only from the target's forward (an EAGLE head reads the
        target's hidden states), which a hit skips. Call before the sequence is scheduled."""
        ...

    def forget_draft_kv(self, seq_id: int) -> None:
        """The sequence has ended: drop what is kept for it."""
        ...
