"""What the scheduler hands to one engine step: which sequences run and how many tokens each
feeds. Shared types, so the speculator (``specserve/spec/``) reads a batch without importing the
engine."""

from __future__ import annotations

from dataclasses import dataclass, field

from specserve.core.sequence import Sequence


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens fed this step, starting at seq.num_computed_tokens
    num_lookahead: int = 0  # speculative draft tokens verified after them (KV slots reserved)
    # True if this chunk reaches the end of the known tokens, so the step samples one. Fixed at
    # scheduling time (the engine advances num_computed_tokens afterwards).
    samples: bool = field(init=False)

    def __post_init__(self) -> None:
        self.samples = self.seq.num_computed_tokens + self.num_new_tokens == self.seq.num_tokens


@dataclass
class ScheduledBatch:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens + s.num_lookahead for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def is_decode_only(self) -> bool:
        """Every scheduled sequence feeds exactly its last token (plus drafts)."""
        return all(s.seq.num_tokens - s.seq.num_computed_tokens == 1 for s in self.scheduled)
