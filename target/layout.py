"""BatchLayout: one flattened model step, built once from per-sequence chunks.

Every forward of the engine (the target's step, a draft model's prefill and draft steps, an
EAGLE head's) runs several sequences as one flat token axis. Each sequence contributes a
``Chunk``: the tokens it feeds, the position of the first, its KV block table, and how many of
its last tokens need logits. ``build_layout`` turns the chunks into what the model reads (ids,
positions, ``AttentionMetadata``, the logits rows) and records where each chunk landed, so
whoever reads the outputs (the rejection sampler, feature capture, a proposer) takes its rows
from the layout and never re-derives them.

Worked example, two chunks: a decoding sequence at position 9 verifying two drafts
(``Chunk([t9, d1, d2], start=9, table, num_logits=3)``) and a prefill chunk of four tokens that
does not reach the prompt's end (``num_logits=0``)::

    input_ids  = [t9, d1, d2, p0, p1, p2, p3]          positions = [9, 10, 11, 0, 1, 2, 3]
    token_starts  = [0, 3, 7]   (chunk b's tokens are rows token_starts[b]:token_starts[b+1])
    logits_indices = [0, 1, 2]  logits_starts = [0, 3, 3]

Host work is one pass over the fed tokens (the same lists ``AttentionMetadata.build`` needs),
linear in the batch's tokens and independent of context length.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from specserve.kernels.metadata import AttentionMetadata, token_positions


@dataclass(frozen=True, slots=True)
class Chunk:
    """One sequence's part of a step: ``token_ids`` fed at positions ``start ..``, attending to
    the sequence's KV before ``start`` (through ``block_table``); logits for the last
    ``num_logits`` of them."""

    token_ids: Sequence[int]
    start: int
    block_table: Sequence[int]
    num_logits: int = 0


@dataclass
class BatchLayout:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [N] int64: rows of the token axis that get logits
    token_starts: list[int]  # [B + 1]
    logits_starts: list[int]  # [B + 1]

    @property
    def num_tokens(self) -> int:
        return self.token_starts[-1]

    @property
    def num_chunks(self) -> int:
        return len(self.token_starts) - 1

    def token_span(self, b: int) -> tuple[int, int]:
        """Chunk b's rows of the token axis (input ids, hidden states)."""
        return self.token_starts[b], self.token_starts[b + 1]

    def logits_span(self, b: int) -> tuple[int, int]:
        """Chunk b's rows of the logits (``num_logits`` of them)."""
        return self.logits_starts[b], self.logits_starts[b + 1]

    def token_rows(self, chunks: Iterable[int]) -> torch.Tensor:
        """[R] int64: the token-axis rows of the given chunks, in order."""
        rows = [r for b in chunks for r in range(self.token_starts[b], self.token_starts[b + 1])]
        return torch.tensor(rows, dtype=torch.int64, device=self.input_ids.device)


def build_layout(chunks: Sequence[Chunk], block_size: int, device: torch.device | str
                 ) -> BatchLayout:
    ids: list[int] = []
    query_lens, context_lens, tables = [], [], []
    logits_idx: list[int] = []
    logits_starts = [0]
    for c in chunks:
        n = len(c.token_ids)
        assert 0 <= c.num_logits <= n, "a chunk's logits rows are among its own tokens"
        ids.extend(c.token_ids)
        query_lens.append(n)
        context_lens.append(c.start + n)
        tables.append(c.block_table if isinstance(c.block_table, list) else list(c.block_table))
        if c.num_logits:
            logits_idx.extend(range(len(ids) - c.num_logits, len(ids)))
        logits_starts.append(len(logits_idx))
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size, device)
    return BatchLayout(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=token_positions(query_lens, context_lens).to(device),
        meta=meta,
        logits_indices=torch.tensor(logits_idx, dtype=torch.int64, device=device),
        token_starts=[0, *itertools.accumulate(query_lens)],
        logits_starts=logits_starts,
    )
