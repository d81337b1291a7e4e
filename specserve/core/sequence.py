"""Sequence: one request's tokens, KV bookkeeping and timings, as plain counters.

The scheduler and block manager reason only with integers on this object:
``num_tokens`` (prompt + output so far), ``num_computed_tokens`` (tokens whose K/V are in the
cache and valid) and ``num_cached_tokens`` (of those, how many came from a prefix-cache hit).
``num_tokens - num_computed_tokens`` is what the next step still has to feed the model: the whole
prompt (or the rest of it) while prefilling, exactly 1 while decoding. ``num_lookahead_slots`` is
the one speculative fact they need: how many draft tokens the speculator would verify after that
token next step, i.e. how many extra KV slots to reserve (the scheduler may grant fewer). Every
other speculation fact lives in the speculator (``specserve/spec/state.py``), and what the block
manager knows of the draft's KV in the block manager (``specserve/core/draft_kv.py``).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from specserve.core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context window
    ABORT = "abort"  # cancelled by the client / server shutdown


@dataclass
class SequenceTimings:
    """Wall-clock marks (time.perf_counter seconds); the per-phase costs a request reports are
    accumulated in its ``RequestTimings`` (specserve/engine/outputs.py)."""

    arrival: float = field(default_factory=time.perf_counter)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    num_preemptions: int = 0


@dataclass(eq=False)  # identity semantics: queues find sequences with `is`
class Sequence:
    """Invariants: ``len(block_table) * block_size >= num_computed_tokens`` and
    ``num_cached_tokens <= num_computed_tokens <= num_tokens``. ``token_ids`` only grows, except
    through ``truncate_tokens`` (speculative rollback)."""

    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    # draft tokens to verify after the next fed token (set by the speculator before each
    # schedule; 0 while prefilling or not speculating)
    num_lookahead_slots: int = 0
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    timings: SequenceTimings = field(default_factory=SequenceTimings)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        """True while more than one token is still missing from the cache."""
        return self.num_tokens - self.num_computed_tokens > 1

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: all KV is dropped; prompt + outputs are prefilled again."""
        self.block_table = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_lookahead_slots = 0
        self.status = SequenceStatus.WAITING
        self.timings.num_preemptions += 1
