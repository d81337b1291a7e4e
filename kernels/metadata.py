"""The one description of a flattened batch that every attention backend reads.

A step runs B sequences together. Sequence b contributes ``query_lens[b]`` new tokens (a prefill
chunk, one decode token, or ``1 + k`` verify tokens); they are laid out back to back in one flat
token axis of length T = sum(query_lens). Every new token's K/V is written into the paged cache at
``slot_mapping[t]`` (``block_id * block_size + offset``; ``-1`` means "padding, do not write"), and
every new token attends to all of its sequence's cached tokens before it plus the new tokens up to
and including itself.

Worked example, block_size 4, two sequences:
    seq 0: 6 tokens already cached, 2 new  -> positions 6, 7; context_len 8
    seq 1: 0 cached, 3 new (prefill)        -> positions 0, 1, 2; context_len 3
    query_lens   = [2, 3]        cu_seqlens_q = [0, 2, 5]
    context_lens = [8, 3]        block_tables = [[7, 2], [5, 0]]  (row 1 padded with 0)
    slot_mapping = [2*4+2, 2*4+3, 5*4+0, 5*4+1, 5*4+2] = [10, 11, 20, 21, 22]
    query token t=1 (seq 0, position 7) sees keys at positions 0..7 of seq 0.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    """Per-step attention inputs. Tensors live on the model's device; the ``*_cpu`` lists are
    host copies so CPU-side backends and graph-bucket selection never need a device sync.

    Invariants: ``len(query_lens_cpu) == len(context_lens_cpu) == B``; for every b,
    ``1 <= query_lens_cpu[b] <= context_lens_cpu[b]``; ``block_tables[b]`` covers
    ``context_lens_cpu[b]`` tokens.
    """

    slot_mapping: torch.Tensor  # [T] int64, -1 = do not write
    cu_seqlens_q: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32, cached + new tokens per sequence
    block_tables: torch.Tensor  # [B, max_blocks] int32, padded with 0
    query_lens_cpu: list[int]
    context_lens_cpu: list[int]
    block_size: int
    # Per-step derived tensors a backend builds on the first layer and reuses in the others
    # (index maps, masks), keyed by the backend's choice (e.g. its name and the sliding window).
    plan_cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    def plan(self, key: Any, build: Callable[[], Any]) -> Any:
        """The per-step derived object for ``key``, built on the first layer's call only."""
        value = self.plan_cache.get(key)
        if value is None:
            value = self.plan_cache[key] = build()
        return value

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu, default=0)

    @property
    def max_context_len(self) -> int:
        return max(self.context_lens_cpu, default=0)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Builds the metadata (including the slot mapping) from plain host lists."""
        if not (len(query_lens) == len(context_lens) == len(block_tables)):
            raise ValueError(
                f"query_lens, context_lens and block_tables must have one entry per sequence "
                f"(got {len(query_lens)}, {len(context_lens)}, {len(block_tables)})"
            )
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        tables = torch.tensor(padded, dtype=torch.int32).reshape(len(block_tables), max_blocks)
        # Host lists, then one tensor each: a decode step has a handful of rows, and a dozen
        # tiny torch ops cost ~150 us where this costs ~10 (the work is O(new tokens), like
        # the step's input ids).
        slots = [
            table[p // block_size] * block_size + p % block_size
            for q, c, table in zip(query_lens, context_lens, block_tables)
            for p in range(c - q, c)
        ]
        cu = [0, *itertools.accumulate(query_lens)]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
            block_tables=tables.to(device),
            query_lens_cpu=list(query_lens),
            context_lens_cpu=list(context_lens),
            block_size=block_size,
        )


def token_positions(query_lens: list[int], context_lens: list[int]) -> torch.Tensor:
    """Absolute position of every new token of a flattened batch: [T] int64. Sequence b's new
    tokens sit at context_lens[b] - query_lens[b] .. context_lens[b] - 1."""
    return torch.tensor(
        [p for q, c in zip(query_lens, context_lens) for p in range(c - q, c)], dtype=torch.int64
    )
