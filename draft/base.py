"""The proposer protocol shared by every draft method (n-gram, draft model, ...).

One engine step asks the proposer for up to ``k_i`` draft tokens for each decoding sequence; the
target then scores ``[last token] + drafts`` in one pass and the rejection sampler keeps the
longest prefix it agrees with. A proposer may return fewer than ``k_i`` tokens (even none): the
verify pass simply has fewer positions for that sequence.

``draft_probs`` is the draft distribution q, needed by the accept test ``min(1, p(x) / q(x))``
when sampling. Deterministic proposers (n-gram) return ``None``; the rejection sampler then
treats each draft as a one-hot q (as vLLM does with ``draft_probs=None``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@dataclass
class ProposalRequest:
    """One sequence to draft for. ``token_ids`` is read-only to proposers."""

    seq_id: int
    token_ids: list[int]  # the sequence's prompt + output tokens so far
    num_tokens: int  # k: how many draft tokens to propose at most (>= 1)


@dataclass
class Proposal:
    """Drafts for a batch of requests, in request order.

    Invariant: ``draft_probs`` is ``None`` or has ``sum(len(d) for d in draft_token_ids)`` rows,
    the requests' drafts flattened in order (request 0's tokens first).
    """

    draft_token_ids: list[list[int]]  # per request, 0..k tokens
    # [sum(len(d) for d in draft_token_ids), V] draft distribution q (after sampling
    # processing); None for deterministic proposers.
    draft_probs: torch.Tensor | None = None


@runtime_checkable
class Proposer(Protocol):
    """Anything that turns ``ProposalRequest``s into a ``Proposal`` (one entry per request)."""

    name: str

    def propose(self, requests: list[ProposalRequest]) -> Proposal: ...
