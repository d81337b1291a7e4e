"""Speculator: the engine's speculative-decoding hooks, in the order a step calls them.

    choose_k()        before scheduling: each decoding sequence's k for this step (policy)
    draft_prefill()   after scheduling: the draft model computes KV for this step's prefill chunks
    propose()         draft tokens for every scheduled sequence with num_lookahead > 0
    verify()          rejection sampling of the target's logits against the drafts
    after_verify()    acceptance statistics, draft-KV bookkeeping

The engine stays one straight-line step; everything specific to drafting lives here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from draft.base import ProposalRequest
from draft.model_proposer import DraftModelProposer
from draft.ngram import NgramProposer
from specserve.config import EngineConfig
from specserve.rejection_sampler import SpecDecodeResult, SpecDecodeRow, rejection_sample
from specserve.sampling import SampleRequest
from specserve.scheduler import ScheduledBatch, ScheduledSeq
from specserve.sequence import Sequence
from specserve.spec_policy import Candidate, SpeculationPolicy


@dataclass
class Drafts:
    """Draft tokens of one step, per sequence id, and the draft probabilities of the model
    drafts (row-ordered like ``model_order``)."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    model_order: list[int] = field(default_factory=list)
    model_probs: torch.Tensor | None = None
    draft_seconds: float = 0.0


class Speculator:
    def __init__(
        self, config: EngineConfig, draft: DraftModelProposer | None, generator: torch.Generator,
        projection_seconds: Callable[[int], float | None] | None = None,  # see SpeculationPolicy
    ) -> None:
        self.config = config
        self.draft = draft
        self.ngram = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.policy = SpeculationPolicy(
            adaptive=config.adaptive_speculation, projection_seconds=projection_seconds
        )
        self.generator = generator

    # ---- before scheduling ----------------------------------------------------------------

    def choose_k(self, running: list[Sequence], max_model_len: int) -> None:
        """Sets ``seq.spec_k`` for every running sequence (0 unless it is decoding and
        speculating); the scheduler cuts it further to the token budget."""
        candidates = []
        prefill_tokens = 0
        for seq in running:
            seq.spec_k = 0
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining != 1:
                prefill_tokens += remaining
                continue
            if seq.spec_method == "off" or seq.spec_k_max == 0:
                continue
            # The bonus token is free: never draft past max_tokens or the context window.
            left = min(
                seq.params.max_tokens - seq.num_output_tokens,
                max_model_len - seq.num_tokens,
            ) - 1
            k_max = min(seq.spec_k_max, left)
            if k_max <= 0:
                continue
            rate = self.policy.acceptance_rate(seq.seq_id, seq.spec_method)
            candidates.append(Candidate(seq.seq_id, k_max, rate, seq.spec_method == "draft"))
        if not candidates:
            return
        ks = self.policy.choose(candidates, prefill_tokens)
        for seq in running:
            seq.spec_k = ks.get(seq.seq_id, 0)

    # ---- after scheduling -----------------------------------------------------------------

    def draft_prefill(self, batch: ScheduledBatch) -> None:
        """The draft runs beside the target's prompt chunks. Decode steps that do not draft
        (k = 0) leave the draft behind on purpose: keeping it in step would cost a draft forward
        per token for nothing when the policy has turned speculation off; the next proposal
        catches up on every token the draft lacks (see DraftModelProposer)."""
        if self.draft is None:
            return
        chunks = [
            (s.seq, s.seq.num_computed_tokens + s.num_new_tokens)
            for s in batch.scheduled
            if s.seq.spec_method == "draft" and s.num_lookahead == 0 and s.seq.is_prefill
        ]
        self.draft.prefill(chunks)

    def propose(self, batch: ScheduledBatch, rows: dict[int, SampleRequest]) -> Drafts:
        out = Drafts()
        ngram = [s for s in batch.scheduled if s.num_lookahead and s.seq.spec_method == "ngram"]
        model = [s for s in batch.scheduled if s.num_lookahead and s.seq.spec_method == "draft"]
        if ngram:
            proposal = self.ngram.propose(
                [ProposalRequest(s.seq.seq_id, s.seq.token_ids, s.num_lookahead) for s in ngram]
            )
            for s, tokens in zip(ngram, proposal.draft_token_ids):
                out.tokens[s.seq.seq_id] = tokens
        if model and self.draft is not None:
            t0 = time.perf_counter()
            proposal, step_seconds = self.draft.propose(
                [s.seq for s in model],
                [s.num_lookahead for s in model],
                [rows[s.seq.seq_id] for s in model],
            )
            out.draft_seconds = time.perf_counter() - t0
            for i, secs in enumerate(step_seconds):
                active = sum(1 for s in model if s.num_lookahead > i)
                self.policy.record_draft_step(active, secs)
            for s, tokens in zip(model, proposal.draft_token_ids):
                out.tokens[s.seq.seq_id] = tokens
                out.model_order.append(s.seq.seq_id)
            out.model_probs = proposal.draft_probs
        return out

    # ---- verify ---------------------------------------------------------------------------

    def verify(
        self,
        logits: dict[int, torch.Tensor],  # seq id -> [k_i + 1, V] target logits
        rows: dict[int, SampleRequest],
        drafts: Drafts,
    ) -> dict[int, tuple[list[int], int, list]]:
        """seq id -> (emitted tokens, number of accepted drafts, logprobs per emitted token)."""
        results: dict[int, tuple[list[int], int, list]] = {}
        # Every model-drafted sequence is decoding, so it samples: its draft-prob rows line up.
        model_ids = drafts.model_order
        assert all(sid in logits for sid in model_ids)
        drafted = set(model_ids)
        other_ids = [sid for sid in logits if sid not in drafted]
        for ids, probs in ((model_ids, drafts.model_probs), (other_ids, None)):
            if not ids:
                continue
            res: SpecDecodeResult = rejection_sample(
                torch.cat([logits[sid] for sid in ids]),
                [SpecDecodeRow(rows[sid], drafts.tokens.get(sid, [])) for sid in ids],
                probs,
                self.generator,
            )
            for j, sid in enumerate(ids):
                results[sid] = (res.token_ids[j], res.num_accepted[j], res.logprobs[j])
        return results

    def after_verify(
        self, s: ScheduledSeq, n_before: int, drafts: list[int], accepted: int
    ) -> None:
        seq = s.seq
        if drafts:
            self.policy.record_acceptance(seq.seq_id, seq.spec_method, len(drafts), accepted)
        if seq.spec_method == "draft" and drafts:
            # The draft ran on the last token and drafts 1..k-1 (see DraftModelProposer).
            seq.draft_num_computed = n_before + min(accepted, len(drafts) - 1)

    def forget(self, seq: Sequence) -> None:
        self.policy.forget(seq.seq_id)
        if self.draft is not None:
            self.draft.forget(seq.seq_id)
