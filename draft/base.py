"""The proposer protocol shared by every draft method (n-gram, suffix, draft model, ...).

One engine step asks the proposer for up to ``k_i`` draft tokens for each decoding sequence; the
target then scores ``[last token] + drafts`` in one pass and the rejection sampler keeps the
longest prefix it agrees with. A proposer may return fewer than ``k_i`` tokens (even none): the
verify pass simply has fewer positions for that sequence.

Proposers see plain data only (token ids, KV block ids, counters): nothing in ``draft/`` imports
the engine's ``Sequence`` or sampler. The life of a sequence, as the engine's speculator calls it:

    prefill(chunks)     KV-holding proposers compute their KV beside the target's prompt chunks
    propose(requests)   drafts for this step's decoding sequences
    finish(done)        the sequence ended (or was aborted): drop its state, learn from its output

``draft_probs`` is the draft distribution q, needed by the accept test ``min(1, p(x) / q(x))``
when sampling. Deterministic proposers (n-gram, suffix) return ``None``; the rejection sampler
then treats each draft as a one-hot q (as vLLM does with ``draft_probs=None``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch


@dataclass
class DraftSampling:
    """How a model proposer draws a sampled request's drafts: ``params`` is opaque to
    ``draft/`` and goes to the ``probs_fn`` the proposer was built with (the engine's logits
    processing), so q matches the target's processing."""

    greedy: bool
    seed: int | None = None
    params: Any = None


@dataclass
class ProposalRequest:
    """One sequence to draft for. ``token_ids`` is read-only to proposers."""

    seq_id: int
    token_ids: Sequence[int]  # the sequence's prompt + output tokens so far
    num_tokens: int  # k: how many draft tokens to propose at most (>= 1)
    num_prompt_tokens: int = 0
    tenant: str = ""  # drafts may come only from this tenant's (or this request's) text
    block_table: Sequence[int] = ()  # KV block ids (proposers with a KV cache)
    kv_computed: int = 0  # tokens the proposer's KV already holds for this sequence
    sampling: DraftSampling | None = None  # None: greedy
    # the request's predicted output (OpenAI's ``prediction``) as token ids, None: none sent
    prediction: Sequence[int] | None = None


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
    # Per request, the tokens the proposer's KV now holds (None: the proposer keeps no KV).
    # Only positions the target accepts stay valid: the engine keeps min(this, tokens - 1).
    kv_computed: list[int] | None = None
    step_seconds: list[float] = field(default_factory=list)  # per sequential draft forward
    # Per request, the proposer's estimate of each draft token's chance to be accepted
    # (cumulative: that it and every token before it are right).
    confidence: list[list[float]] | None = None
    # Per request, how many tokens of context the draft's match covers (model-free proposers):
    # the policy prices drafts by it (specserve/spec/acceptance_model.py).
    match_lengths: list[int] | None = None


@dataclass
class PrefillChunk:
    """Tokens a KV-holding proposer must catch up on this step: ``token_ids[kv_computed:end]``
    (a prompt chunk the target computes now, or a bounded chunk of a decoding sequence's lag)."""

    seq_id: int
    token_ids: Sequence[int]
    end: int
    block_table: Sequence[int]
    kv_computed: int


@dataclass
class FinishedSequence:
    seq_id: int
    token_ids: Sequence[int]  # prompt + output
    num_prompt_tokens: int
    tenant: str = ""
    aborted: bool = False
    method: str = ""  # the speculative method the request asked for (may be "auto" / "off")


@runtime_checkable
class Proposer(Protocol):
    """Anything that turns ``ProposalRequest``s into a ``Proposal`` (one entry per request).
    ``uses_model``: drafting runs sequential forwards (the policy prices them as draft steps)."""

    name: str
    uses_model: bool

    def propose(self, requests: list[ProposalRequest]) -> Proposal: ...

    def prefill(self, chunks: list[PrefillChunk]) -> list[int]: ...

    def finish(self, done: FinishedSequence) -> None: ...

    def clear(self, tenant: str | None = None) -> None: ...


class StatelessProposer:
    """Defaults for proposers without KV or per-sequence state."""

    name = "stateless"
    uses_model = False

    def prefill(self, chunks: list[PrefillChunk]) -> list[int]:
        return [c.kv_computed for c in chunks]

    def finish(self, done: FinishedSequence) -> None:
        return None

    def clear(self, tenant: str | None = None) -> None:
        """Forget what was learned across requests (one tenant's part, or all)."""
        return None
