"""Speculator: everything speculative about an engine step, behind five calls.

    add() / forget()  a request starts (its method and k_max, checked against the registry) /
                      ends (proposers drop its state, and may learn from its output)
    plan()            before scheduling: each decoding sequence's method and lookahead k
    propose()         after scheduling: model proposers catch up on this step's prompt chunks,
                      then draft for every scheduled sequence with lookahead
    verify()          after the target's forward: rejection sampling of its logits against
                      the drafts (and the target's hidden states to a proposer that reads them)
    commit()          per sequence, once its tokens are appended: acceptance statistics and
                      the draft's KV progress

This follows vLLM v1's split: proposers (specserve/draft/) make drafts, the scheduler reserves
the lookahead slots, the rejection sampler (rejection_sampler.py) decides, the policy
(policy.py) prices. Proposers come from ``specserve.draft.registry`` by name, and what the
speculator must know of one it reads from its ``ProposerSpec``; nothing here names a proposer.
Per-sequence state is a ``SpecState`` (state.py); the draft's KV progress is kept by the block
manager, reached through ``DraftKVLedger``.

Proposers without a model (n-gram, suffix) only read tokens, so they draft already in ``plan``:
the policy then sees each sequence's real draft length (k never exceeds it) and ``auto`` sees
what its model-free candidate has to offer before it pays for a draft model (planning.py).

A model-free proposer's host time is measured per call and priced by the policy. A sequence the
policy keeps at k = 0 does not call its proposer for the next 1, 2, 4, .. 16 steps, so that
speculation that does not pay (a large batch, a low acceptance) does not cost its proposer's
time every step either. A proposal with nothing worth drafting (no match, no method that pays)
backs off too, but at most 4 steps: the next tokens may start a copy.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.core.batch import ScheduledBatch, ScheduledSeq
from specserve.core.config import EngineConfig
from specserve.core.draft_kv import DraftKVLedger
from specserve.core.errors import InvalidRequestError
from specserve.core.sampling import SampleRequest, TokenLogprob, sampling_probs
from specserve.core.sampling_params import SpeculativeParams
from specserve.core.sequence import FinishReason, Sequence
from specserve.draft.base import FinishedSequence, PrefillChunk, Proposer
from specserve.draft.loading import DRAFT_MODEL, LoadedDraft
from specserve.draft.registry import AUTO, OFF, REGISTRY, ProposerContext, ProposerRegistry
from specserve.spec.grammar import GrammarState, GrammarStates
from specserve.spec.planning import Planner, proposal_request, stats_key
from specserve.spec.policy import SpeculationPolicy
from specserve.spec.rejection_sampler import SpecDecodeResult, SpecDecodeRow, rejection_sample
from specserve.spec.state import SpecState
from specserve.target.layout import BatchLayout
from specserve.target.model import FeatureCapture

Span = Callable[..., contextlib.AbstractContextManager[Any]]


def _no_span(name: str, **args: Any) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


@dataclass
class Drafts:
    """Draft tokens of one step, per sequence id, and the draft probabilities of the model
    proposers (one group per proposer, rows ordered like the group's ids)."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    prob_groups: list[tuple[list[int], torch.Tensor | None]] = field(default_factory=list)
    draft_seconds: float = 0.0
    # constrained sequences: one grammar token bitmask per verify row, [k + 1, W] int32
    masks: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(len(d) for d in self.tokens.values())


@dataclass(slots=True)
class Verified:
    """One sampling sequence's outcome: the tokens to append (accepted drafts, then the
    target's own), how many of them are drafts, and the logprobs per token."""

    token_ids: list[int]
    num_accepted: int
    logprobs: list[TokenLogprob | None]
    num_drafts: int  # drafts verified (0: a plain step)


class Speculator:
    def __init__(
        self, settings: EngineConfig, default_method: str, max_model_len: int,
        ledger: DraftKVLedger, generator: torch.Generator, draft: LoadedDraft | None = None,
        projection_seconds: Callable[[int], float | None] | None = None,  # see SpeculationPolicy
        registry: ProposerRegistry = REGISTRY,
    ) -> None:
        self.settings = settings
        self.default_method = default_method
        self.registry = registry
        self.ledger = ledger
        self.generator = generator
        ctx = ProposerContext(settings, None if draft is None else draft.kind,
                              None if draft is None else draft.runner, probs_fn=sampling_probs)
        self.proposers: dict[str, Proposer] = registry.build_available(ctx)
        self.policy = SpeculationPolicy(
            adaptive=settings.adaptive_speculation, projection_seconds=projection_seconds
        )
        self.states: dict[int, SpecState] = {}
        self.grammars = GrammarStates()
        self.planner = Planner(self.proposers, registry, self.policy, self.states, ledger,
                               settings, max_model_len)
        self.planner.forced_draft = self._forced_draft
        # the proposer that reads the target's hidden states, when one is loaded
        self._features = next((n for n in self.proposers
                               if n in registry.specs and registry.specs[n].needs_target_features),
                              None)

    @property
    def draft(self) -> Proposer | None:
        """The proposer that runs a draft language model, when one is loaded."""
        return next((self.proposers[n] for n in self.registry.for_draft(DRAFT_MODEL)
                     if n in self.proposers), None)

    def available(self, method: str) -> bool:
        return method in (OFF, AUTO) or method in self.proposers

    def clear_caches(self, tenant: str | None = None) -> None:
        """Empties what proposers learned across requests (one tenant's part, or all)."""
        for p in self.proposers.values():
            clear = getattr(p, "clear", None)
            if clear is not None:
                clear(tenant)

    # ---- requests ---------------------------------------------------------------------------

    def add(self, seq: Sequence, speculative: SpeculativeParams | None,
            grammar: GrammarState | None = None) -> str:
        """Registers a new request's speculation (and its grammar, when its output is
        constrained); returns its method ("off" when it does not speculate). Raises
        ``InvalidRequestError`` naming ``speculative.method``."""
        method = (speculative.method if speculative else None) or self.default_method
        methods = self.registry.methods()
        if method not in methods:
            raise InvalidRequestError(f"speculative.method must be one of {', '.join(methods)} "
                                      f"(got {method!r})", param="speculative.method")
        k = speculative.num_tokens if speculative and speculative.num_tokens is not None else None
        if k is None:
            k = self.registry.k_max(method, self.settings)
        if not self.available(method):
            # a draft of another kind is loaded: name the methods it runs
            usable = [n for n in self.proposers
                      if n in self.registry.specs and self.registry.specs[n].needs_draft]
            hint = f"; this server's draft runs {', '.join(usable)}" if usable else ""
            raise InvalidRequestError(
                f"speculative.method {method!r} needs a server started with --draft-model "
                f"of its kind{hint}", param="speculative.method",
            )
        if method == OFF or k <= 0:
            method, k = OFF, 0
        prediction = self._prediction(method, speculative)
        if method == self.registry.prediction_method() and prediction is None:
            method, k = OFF, 0  # the server's default method, and this request sent none
        base_k = k
        if prediction is not None and (speculative is None or speculative.num_tokens is None):
            # a prediction drafts longer than the method alone would (its own k_max)
            k = max(k, self.registry.k_max(self.registry.prediction_method() or OFF,
                                           self.settings))
        self.states[seq.seq_id] = SpecState(method, k, speculative.tenant if speculative else "",
                                            prediction, base_k)
        if grammar is not None:
            self.grammars.states[seq.seq_id] = grammar
        if self._reads_features(method):
            self.ledger.require_draft_kv_hits(seq.seq_id)
        return method

    def _prediction(self, method: str, speculative: SpeculativeParams | None) -> list[int] | None:
        """The token ids its proposer drafts from (None: no prediction, or it does not
        speculate). The engine has tokenized the text already."""
        name = self.registry.prediction_method()
        prediction = speculative.prediction if speculative else None
        if prediction is None and speculative is not None and speculative.method == name:
            raise InvalidRequestError(f"speculative.method {name!r} drafts from the request's "
                                      "prediction: send one (prediction: {\"type\": "
                                      "\"content\", \"content\": ...})",
                                      param="speculative.method")
        if prediction is None or method == OFF or name not in self.proposers:
            return None
        assert not isinstance(prediction, str), "the engine tokenizes the prediction first"
        return list(prediction)

    def forget(self, seq: Sequence) -> None:
        state = self.states.pop(seq.seq_id)
        self.grammars.forget(seq.seq_id)
        self.policy.forget(seq.seq_id)
        self.ledger.forget_draft_kv(seq.seq_id)
        done = FinishedSequence(
            seq.seq_id, seq.token_ids, seq.num_prompt_tokens, state.tenant,
            aborted=seq.finish_reason == FinishReason.ABORT, method=state.method,
        )
        for proposer in self.proposers.values():
            proposer.finish(done)

    def _reads_features(self, method: str) -> bool:
        return self._features is not None and method in (self._features, AUTO)

    # ---- the step ---------------------------------------------------------------------------

    def plan(self, running: list[Sequence]) -> None:
        """Sets ``seq.num_lookahead_slots`` for every running sequence (0 unless it is decoding
        and speculation pays); the scheduler may cut it further."""
        self.planner.plan(running)

    def propose(self, batch: ScheduledBatch, rows: dict[int, SampleRequest],
                span: Span = _no_span) -> Drafts:
        """Model proposers catch up on this step's chunks, then every scheduled sequence with
        lookahead gets its drafts (``rows``: the sampling of each sampling sequence)."""
        with span("draft_prefill"):
            self._draft_prefill(batch)
        with span("propose"):
            drafts = self._propose(batch, rows)
        if self.grammars:
            with span("grammar"):
                self._constrain(batch, drafts)
        return drafts

    def _constrain(self, batch: ScheduledBatch, drafts: Drafts) -> None:
        """Each constrained sampling sequence: its drafts cut at the first token its grammar
        rejects, and one mask per verify row (grammar.py); a model proposer's probability rows
        of the cut drafts are dropped with them."""
        cut: dict[int, tuple[int, int]] = {}  # seq id -> (drafts kept, proposed), where cut
        for s in batch.scheduled:
            sid = s.seq.seq_id
            grammar = self.grammars.get(sid)
            if grammar is None or not s.samples:
                continue
            proposed = drafts.tokens.get(sid, [])
            kept, drafts.masks[sid] = grammar.prepare(proposed)
            if kept < len(proposed):
                drafts.tokens[sid] = proposed[:kept]
                cut[sid] = (kept, len(proposed))
        if not cut:
            return
        groups = []
        for ids, probs in drafts.prob_groups:
            if probs is not None and any(sid in cut for sid in ids):
                keep: list[int] = []  # rows of probs [sum k, V] (k as proposed) that stay
                row = 0
                for sid in ids:
                    n = len(drafts.tokens.get(sid, []))
                    keep.extend(range(row, row + n))
                    row += cut[sid][1] if sid in cut else n
                probs = probs[torch.tensor(keep, dtype=torch.long, device=probs.device)]
            groups.append((ids, probs))
        drafts.prob_groups = groups

    def features_wanted(self, batch: ScheduledBatch, layout: BatchLayout
                        ) -> FeatureCapture | None:
        """What the target's forward must also return for a proposer that reads its hidden
        states: the chosen layers at every token fed this step by sequences that may use it
        (their rows of the layout). None without such a proposer, or when none of them runs."""
        chunks = self._feature_chunks(batch)
        if not chunks:
            return None
        layers = self.proposers[self._features].target_layers  # type: ignore[index, attr-defined]
        return FeatureCapture(layers, layout.token_rows(chunks))

    def _feature_chunks(self, batch: ScheduledBatch) -> list[int]:
        if self._features is None:
            return []
        return [b for b, s in enumerate(batch.scheduled)
                if self._reads_features(self.states[s.seq.seq_id].method)]

    def verify(self, batch: ScheduledBatch, layout: BatchLayout, logits: torch.Tensor,
               rows: dict[int, SampleRequest], drafts: Drafts,
               features: FeatureCapture | None = None) -> dict[int, Verified]:
        """Rejection sampling of each sampling sequence's rows of ``logits`` (its last token and
        drafts, laid out by ``layout``) against its drafts; seq id -> outcome. ``features``: the
        captured hidden states, handed to their proposer by sequence and position."""
        if features is not None and features.out is not None:
            # (seq id, first position, rows): every fed row, from the sequence's first fed
            # position (rows of drafts it rejects are never read)
            spans = []
            for b in self._feature_chunks(batch):
                a, e = layout.token_span(b)
                spans.append((batch.scheduled[b].seq.seq_id,
                              batch.scheduled[b].seq.num_computed_tokens, e - a))
            self.proposers[self._features].add_feature_spans(  # type: ignore[index, attr-defined]
                spans, features.out)
        per_seq: dict[int, torch.Tensor] = {}  # seq id -> [k_i + 1, V]
        for b, s in enumerate(batch.scheduled):
            if s.samples:
                lo, hi = layout.logits_span(b)
                per_seq[s.seq.seq_id] = logits[lo:hi]
        results: dict[int, Verified] = {}
        # Every model-drafted sequence is decoding, so it samples: its draft-prob rows line up.
        grouped = {sid for ids, _ in drafts.prob_groups for sid in ids}
        assert grouped <= set(per_seq)
        other_ids = [sid for sid in per_seq if sid not in grouped]
        for ids, probs in [*drafts.prob_groups, (other_ids, None)]:
            if not ids:
                continue
            res: SpecDecodeResult = rejection_sample(
                torch.cat([per_seq[sid] for sid in ids]),
                [SpecDecodeRow(rows[sid], drafts.tokens.get(sid, []), drafts.masks.get(sid))
                 for sid in ids],
                probs,
                self.generator,
            )
            for j, sid in enumerate(ids):
                results[sid] = Verified(res.token_ids[j], res.num_accepted[j], res.logprobs[j],
                                        len(drafts.tokens.get(sid, ())))
        return results

    def _forced_draft(self, seq: Sequence, k: int) -> list[int]:
        grammar = self.grammars.get(seq.seq_id)
        return [] if grammar is None else grammar.forced_tokens(k)

    def grammar_done(self, seq: Sequence) -> bool:
        """Its grammar has consumed its end (a constrained answer is complete)."""
        grammar = self.grammars.get(seq.seq_id)
        return grammar is not None and grammar.terminated

    def record_step(self, num_tokens: int, seconds: float) -> None:
        """The policy prices a step by the tokens fed: the forward plus scoring its rows."""
        self.policy.record_target(num_tokens, seconds)

    def commit(self, seq: Sequence, verified: Verified) -> None:
        """After the sequence's tokens are appended (before its KV blocks are committed)."""
        state = self.states[seq.seq_id]
        grammar = self.grammars.get(seq.seq_id)
        if grammar is not None:
            grammar.commit(verified.token_ids, verified.num_accepted)
        if verified.num_drafts:
            key = stats_key(seq, state.step_method)
            self.policy.record_acceptance(seq.seq_id, key, verified.num_drafts,
                                          verified.num_accepted)
            if state.hints is not None and state.hints[0] == state.step_method:
                self.policy.record_draft(key, state.hints[1], verified.num_drafts,
                                         verified.num_accepted)
        if state.kv_after is not None:  # the proposer's KV holds only the positions kept
            self.ledger.set_draft_kv_tokens(seq.seq_id, min(state.kv_after, seq.num_tokens - 1))

    # ---- proposing --------------------------------------------------------------------------

    def _draft_prefill(self, batch: ScheduledBatch) -> None:
        """Model proposers run beside the target's prompt chunks, at most
        ``max_num_batched_tokens`` tokens a step. Decode steps that do not draft (k = 0) leave
        them behind on purpose: keeping in step would cost a draft forward per token for
        nothing when the policy has turned speculation off; the next proposal catches up on
        the tokens the draft lacks (see DraftModelProposer), or, when they exceed the budget,
        chunks here do first."""
        ledger = self.ledger
        for name, proposer in self.proposers.items():
            if not proposer.uses_model:
                continue
            chunks: list[PrefillChunk] = []
            work: list[Sequence] = []
            budget = self.planner.draft_budget
            for s in batch.scheduled:
                seq = s.seq
                state = self.states[seq.seq_id]
                if s.num_lookahead or state.method not in (name, AUTO) or budget <= 0:
                    continue
                if seq.is_prefill:
                    end = seq.num_computed_tokens + s.num_new_tokens
                elif state.catch_up:
                    end = seq.num_tokens - 1  # step 0 of the next proposal feeds the last token
                else:
                    continue
                kv = ledger.draft_kv_tokens(seq.seq_id)
                end = min(end, kv + budget)
                if end <= kv:
                    continue
                budget -= end - kv
                chunks.append(PrefillChunk(seq.seq_id, seq.token_ids, end, seq.block_table, kv))
                work.append(seq)
            if not chunks:
                continue
            # One KV record per sequence: an engine holds at most one draft.
            for seq, kv in zip(work, proposer.prefill(chunks)):
                ledger.set_draft_kv_tokens(seq.seq_id, kv)

    def _propose(self, batch: ScheduledBatch, rows: dict[int, SampleRequest]) -> Drafts:
        out = Drafts(draft_seconds=self.planner.early_seconds)
        groups: dict[str, list[ScheduledSeq]] = {}
        for s in batch.scheduled:
            if s.num_lookahead:
                groups.setdefault(self.states[s.seq.seq_id].step_method, []).append(s)
        for name, group in groups.items():
            proposer = self.proposers[name]
            if not proposer.uses_model:
                for s in group:
                    early = self.states[s.seq.seq_id].early
                    if early is None:  # not drafted in plan (cannot happen in a step)
                        early = self.planner.cheap_draft(proposer, s.seq, s.num_lookahead)
                    out.tokens[s.seq.seq_id] = early[: s.num_lookahead]
                continue
            t0 = time.perf_counter()
            proposal = proposer.propose([
                proposal_request(s.seq, self.states[s.seq.seq_id], s.num_lookahead,
                                 self.ledger.draft_kv_tokens(s.seq.seq_id), rows[s.seq.seq_id])
                for s in group
            ])
            out.draft_seconds += time.perf_counter() - t0
            for i, secs in enumerate(proposal.step_seconds):
                active = sum(1 for s in group if s.num_lookahead > i)
                self.policy.record_draft_step(active, secs)
            ids = [s.seq.seq_id for s in group]
            for s, tokens in zip(group, proposal.draft_token_ids):
                out.tokens[s.seq.seq_id] = tokens
                if len(tokens) < s.num_lookahead:
                    # A draft it could not make (a draft with another tokenizer holds back a
                    # word that may go on) cost its forwards like one that failed: priced so.
                    self.policy.record_acceptance(s.seq.seq_id, stats_key(s.seq, name),
                                                  s.num_lookahead - len(tokens), 0)
            if proposal.kv_computed is not None:
                for sid, kv in zip(ids, proposal.kv_computed):
                    self.states[sid].kv_after = kv
            out.prob_groups.append((ids, proposal.draft_probs))
        return out
