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
        q = torch.tensor(query_lens, dtype=torch.int64)
        ctx = torch.tensor(context_lens, dtype=torch.int64)
        cu = torch.zeros(len(query_lens) + 1, dtype=torch.int64)
        torch.cumsum(q, 0, out=cu[1:])
        # Position of every new token: its sequence's first new position + offset in the chunk.
        seq_idx = torch.repeat_interleave(torch.arange(len(query_lens)), q)  # [T]
        pos = (ctx - q)[seq_idx] + torch.arange(int(cu[-1])) - cu[:-1][seq_idx]  # [T]
        block_ids = tables.long()[seq_idx, pos // block_size] if len(pos) else pos
        slots = block_ids * block_size + pos % block_size  # [T]
        return cls(
            slot_mapping=slots.to(device),
            cu_seqlens_q=cu.to(device=device, dtype=torch.int32),
            context_lens=ctx.to(device=device, dtype=torch.int32),
            block_tables=tables.to(device),
            query_lens_cpu=list(query_lens),
            context_lens_cpu=list(context_lens),
            block_size=block_size,
        )


def token_positions(query_lens: list[int], context_lens: list[int]) -> torch.Tensor:
    """Absolute position of every new token of a flattened batch: [T] int64. Sequence b's new
    tokens sit at context_lens[b] - query_lens[b] .. context_lens[b] - 1."""
    q = torch.tensor(query_lens, dtype=torch.int64)
    ctx = torch.tensor(context_lens, dtype=torch.int64)
    first = torch.repeat_interleave(ctx - q, q)  # [T] each token's sequence's first new position
    seq_start = torch.repeat_interleave(torch.cumsum(q, 0) - q, q)  # [T] its offset in the batch
    return first + torch.arange(int(q.sum())) - seq_start
