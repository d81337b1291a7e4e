"""DraftSampler: how model proposers (a draft LM, an EAGLE head) turn draft logits into draft
tokens and the draft distribution q the rejection sampler needs.

Greedy rows take the argmax; sampled rows draw from q = probs_fn(logits) (the engine's own
logits processing: temperature, top-k, top-p), so q is processed exactly like the target's p.
A reduced head scores only ``head_ids``: its rows are mapped back to token ids, and tokens
outside it get q = 0 (the draft never proposes them; the rejection sampler's residual
max(0, p - q) covers them exactly).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from specserve.draft.base import DraftSampling

GREEDY = DraftSampling(greedy=True)


class DraftSampler:
    def __init__(
        self, head_ids: torch.Tensor | None, vocab_size: int,
        probs_fn: Callable[[torch.Tensor, list[Any]], torch.Tensor] | None, seed: int,
    ) -> None:
        self.head_ids = None if head_ids is None else head_ids.cpu()
        self.vocab_size = vocab_size
        self.probs_fn = probs_fn
        self.generator = torch.Generator().manual_seed(seed + 0x5EED)
        # Per-request draft RNGs for seeded requests, so their drafts are reproducible too.
        self.seeded: dict[int, torch.Generator] = {}

    def forget(self, seq_id: int) -> None:
        self.seeded.pop(seq_id, None)

    def greedy(self, logits: torch.Tensor) -> list[int]:
        """logits [A, V or Vd] -> the argmax token id per row."""
        best = logits.argmax(dim=-1).cpu()
        return (best if self.head_ids is None else self.head_ids[best]).tolist()

    def sample(
        self, logits: torch.Tensor, rows: list[DraftSampling], seq_ids: list[int]
    ) -> tuple[list[int], torch.Tensor]:
        """logits [A, V] (or [A, Vd] from a reduced head) -> one draft token per row and its
        distribution q [A, V]."""
        logits = logits.cpu()
        if self.head_ids is not None:
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            full[:, self.head_ids] = logits
            logits = full
        tokens = logits.argmax(dim=-1)
        q = torch.zeros_like(logits)
        q[torch.arange(len(rows)), tokens] = 1.0  # greedy rows: one-hot (never read)
        sampled = [j for j, r in enumerate(rows) if not r.greedy]
        if sampled:
            if self.probs_fn is None:
                raise ValueError("a model proposer needs probs_fn to draft sampled requests")
            idx = torch.tensor(sampled)
            q_s = self.probs_fn(logits[idx], [rows[j].params for j in sampled])
            q[idx] = q_s
            for n, j in enumerate(sampled):
                gen = self._generator_for(seq_ids[j], rows[j].seed)
                tokens[j] = torch.multinomial(q_s[n], 1, generator=gen)[0]
        return tokens.tolist(), q

    def _generator_for(self, seq_id: int, seed: int | None) -> torch.Generator:
        if seed is None:
            return self.generator
        gen = self.seeded.get(seq_id)
        if gen is None:
            gen = self.seeded[seq_id] = torch.Generator().manual_seed(seed + 1)
        return gen
