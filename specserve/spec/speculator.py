"""Speculator: the engine's speculative-decoding hooks, in the order a step calls them.

    choose_k()        before scheduling: each decoding sequence's method and k for this step
    draft_prefill()   after scheduling: model proposers compute KV for this step's prefill chunks
    propose()         draft tokens for every scheduled sequence with num_lookahead > 0
    verify()          rejection sampling of the target's logits against the drafts
    after_verify()    acceptance statistics, proposer-KV bookkeeping
    forget()          the sequence ended: proposers drop its state (and may learn from it)

Proposers come from ``specserve.draft.registry`` by name; nothing here names a particular one.
Proposers without a model (n-gram, suffix) only read tokens, so they draft already in ``choose_k``:
the policy then sees each sequence's real draft length (k never exceeds it) and ``auto`` sees what a
cheap proposer has to offer before it pays for a draft model. ``auto`` picks, per sequence and step,
the method with the best expected goodput: expected tokens per verify over the step's cost (verify
rows, plus the draft model's sequential forwards); the batch policy then cuts k, to 0 when nothing
pays. A model-free draft's expected tokens come from what it says about itself (its match length,
its proposer's per-token probabilities) through hazards learned from earlier verifies
(acceptance_model.py); a draft model's from the sequence's measured acceptance for it.

A model-free proposer's host time is measured per call and priced by the policy. A sequence the
policy keeps at k = 0 does not call its proposer for the next 1, 2, 4, .. 16 steps (``_idle``),
so that speculation that does not pay (a large batch, a low acceptance) does not cost its
proposer's time every step either. A proposal with nothing worth drafting (no match, no method
that pays) backs off too, but at most 4 steps: the next tokens may start a copy.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specserve.core.config import EngineConfig
from specserve.core.sampling import SampleRequest, sampling_probs
from specserve.core.sequence import Sequence
from specserve.draft.base import (
    DraftSampling,
    FinishedSequence,
    PrefillChunk,
    ProposalRequest,
    Proposer,
)
from specserve.draft.registry import AUTO, OFF, REGISTRY, ProposerContext, ProposerRegistry
from specserve.draft.suffix import SuffixOptions
from specserve.engine.scheduler import ScheduledBatch, ScheduledSeq
from specserve.spec.acceptance_model import DraftHints
from specserve.spec.policy import Candidate, SpeculationPolicy, expected_tokens
from specserve.spec.rejection_sampler import SpecDecodeResult, SpecDecodeRow, rejection_sample
from specserve.target.model import FeatureCapture

_AUTO_CHEAP = "suffix"  # auto's model-free candidate (suffix decoding subsumes prompt lookup)
_EAGLE = "eagle"  # the proposer that reads the target's hidden states
_MAX_IDLE = 16  # most steps a sequence kept at k = 0 skips its proposer before trying again
# ... and after proposals with nothing worth drafting (no match; no method that pays): a copy
# can start at any token, so these back off less far.
_MAX_EMPTY_IDLE = 4


def _stats_key(seq: Sequence, method: str) -> str:
    """The name acceptance is tracked under: sampled requests apart from greedy ones (a sample
    matches a draft less often than an argmax, so one rate for both misprices each)."""
    return method if seq.params.greedy else f"{method}:sampled"


@dataclass
class Drafts:
    """Draft tokens of one step, per sequence id, and the draft probabilities of the model
    proposers (one group per proposer, rows ordered like the group's ids)."""

    tokens: dict[int, list[int]] = field(default_factory=dict)
    prob_groups: list[tuple[list[int], torch.Tensor | None]] = field(default_factory=list)
    draft_seconds: float = 0.0


class Speculator:
    def __init__(
        self, config: EngineConfig, draft_runner, generator: torch.Generator,
        projection_seconds: Callable[[int], float | None] | None = None,  # see SpeculationPolicy
        registry: ProposerRegistry = REGISTRY,
        eagle_runner=None,  # specserve.draft.eagle_head.EagleRunner when an EAGLE head is loaded
    ) -> None:
        self.config = config
        self.registry = registry
        ctx = ProposerContext(
            prompt_lookup_min=config.prompt_lookup_min, prompt_lookup_max=config.prompt_lookup_max,
            suffix=SuffixOptions(max_depth=config.suffix_max_depth,
                                 cache_tokens=config.suffix_cache_tokens,
                                 scope=config.suffix_cache_scope,
                                 spec_factor=config.suffix_spec_factor),
            draft_runner=draft_runner, eagle_runner=eagle_runner,
            block_size=config.block_size, seed=config.seed,
            probs_fn=sampling_probs,
        )
        self.proposers: dict[str, Proposer] = registry.build_available(ctx)
        self.policy = SpeculationPolicy(
            adaptive=config.adaptive_speculation, projection_seconds=projection_seconds
        )
        self.generator = generator
        self._early: dict[int, list[int]] = {}  # seq id -> this step's model-free draft
        self._hints: dict[int, tuple[str, DraftHints]] = {}  # seq id -> (method, its hints)
        self._expected_memo: dict[tuple[int, str, int], tuple[float, ...]] = {}
        self._model_proposers: list[str] = []  # names of the proposers that run a model
        self._early_seconds = 0.0
        self._kv_after: dict[int, int] = {}  # seq id -> its proposer's KV after drafting
        # Draft-model tokens per step are bounded like the target's: a prompt whose draft KV is
        # missing (a prefix-cache hit on blocks a non-draft request filled, a long pause with
        # k = 0) is caught up in chunks, never in one unbounded forward.
        self._draft_budget = config.max_num_batched_tokens
        self._catch_up: set[int] = set()  # decoding seq ids whose draft lags past the budget
        self._feature_spans: list[tuple[int, int, int]] = []  # (seq id, first position, rows)
        # seq id -> (steps left without drafting, consecutive k = 0 choices)
        self._idle: dict[int, tuple[int, int]] = {}

    @property
    def draft(self) -> Proposer | None:
        """The draft-model proposer, when a draft model is loaded."""
        return self.proposers.get("draft")

    def feature_capture(self, batch: ScheduledBatch, drafts: dict[int, list[int]],
                        device: torch.device) -> FeatureCapture | None:
        """What the target's forward must return for the EAGLE head: the chosen layers' hidden
        states at every token fed this step for sequences that may use the head (their rows in
        the flattened batch, laid out as ``LLMEngine._prepare`` lays them). None without a
        head, or when no such sequence runs."""
        eagle = self.proposers.get(_EAGLE)
        if eagle is None:
            return None
        rows: list[int] = []
        self._feature_spans = []
        offset = 0
        for s in batch.scheduled:
            fed = s.num_new_tokens + len(drafts.get(s.seq.seq_id, []))
            if s.seq.spec_method in (_EAGLE, AUTO):
                self._feature_spans.append((s.seq.seq_id, s.seq.num_computed_tokens, fed))
                rows.extend(range(offset, offset + fed))
            offset += fed
        if not rows:
            return None
        layers = eagle.target_layers  # type: ignore[attr-defined]
        return FeatureCapture(layers, torch.tensor(rows, dtype=torch.int64, device=device))

    def store_features(self, capture: FeatureCapture | None) -> None:
        """Hands each sequence's rows of ``capture.out`` to the EAGLE proposer (positions from
        the sequence's first fed token; rows of drafts it later rejects are never read)."""
        if capture is None or capture.out is None:
            return
        eagle = self.proposers[_EAGLE]
        eagle.add_feature_spans(self._feature_spans, capture.out)  # type: ignore[attr-defined]

    def available(self, method: str) -> bool:
        return method in (OFF, AUTO) or method in self.proposers

    def clear_caches(self, tenant: str | None = None) -> None:
        """Empties what proposers learned across requests (one tenant's part, or all)."""
        for p in self.proposers.values():
            clear = getattr(p, "clear", None)
            if clear is not None:
                clear(tenant)

    # ---- before scheduling ----------------------------------------------------------------

    def choose_k(self, running: list[Sequence], max_model_len: int) -> None:
        """Sets ``seq.spec_k`` (and ``seq.spec_step_method``) for every running sequence (k 0
        unless it is decoding and speculating); the scheduler cuts k further to the budget."""
        candidates = []
        prefill_tokens = 0
        decoding = 0
        self._early.clear()
        self._hints.clear()
        self._expected_memo.clear()
        # once a step, not per sequence (benchmarks may swap proposers between runs)
        self._model_proposers = [n for n, p in self.proposers.items() if p.uses_model]
        self._catch_up.clear()
        t0 = time.perf_counter()
        for seq in running:
            seq.spec_k = 0
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining != 1:
                prefill_tokens += remaining
                continue
            decoding += 1
            if seq.spec_method == OFF or seq.spec_k_max == 0:
                continue
            # The bonus token is free: never draft past max_tokens or the context window.
            left = min(
                seq.params.max_tokens - seq.num_output_tokens,
                max_model_len - seq.num_tokens,
            ) - 1
            k_max = min(seq.spec_k_max, left)
            if k_max <= 0:
                continue
            idle = self._idle.get(seq.seq_id)
            if idle is not None and idle[0] > 0:  # k = 0 lately: not worth proposing yet
                self._idle[seq.seq_id] = (idle[0] - 1, idle[1])
                continue
            method, k_max = self._pick(seq, k_max)
            seq.spec_step_method = method
            if k_max <= 0:
                self._back_off(seq.seq_id, _MAX_EMPTY_IDLE)
                continue
            if self.proposers[method].uses_model and self._draft_lag(seq) >= self._draft_budget:
                # Drafting would first feed the draft every token it lacks in one forward: catch
                # up in budget-sized chunks beside the next steps' work instead (draft_prefill).
                self._catch_up.add(seq.seq_id)
                continue
            rate = self.policy.acceptance_rate(seq.seq_id, _stats_key(seq, method))
            uses_model = self.proposers[method].uses_model
            host = 0.0 if uses_model else self.policy.proposer_seconds(method)
            candidates.append(Candidate(seq.seq_id, k_max, rate, uses_model, host,
                                        _stats_key(seq, method),
                                        self._expected(seq, method, k_max)))
        self._early_seconds = time.perf_counter() - t0
        if not candidates:
            return
        # Sequences that draft nothing still decode one token in the same step: the policy
        # weighs drafts against the whole step, not the drafting sequences alone.
        ks = self.policy.choose(candidates, prefill_tokens, decoding - len(candidates))
        for seq in running:
            seq.spec_k = ks.get(seq.seq_id, 0)
        for c in candidates:
            if ks[c.key] > 0:
                self._idle.pop(c.key, None)
            else:
                self._back_off(c.key, _MAX_IDLE)

    def _back_off(self, seq_id: int, cap: int) -> None:
        """Skip the sequence's proposers for the next 1, 2, 4, .. ``cap`` steps (doubling while
        its proposals keep coming to nothing): ~60% of a 32-sequence chat batch's proposals
        found nothing to draft, every step, at 3-4% of the step's time."""
        streak = self._idle.get(seq_id, (0, 0))[1]
        self._idle[seq_id] = (min(1 << streak, cap), streak + 1)

    def _cheap_draft(self, proposer: Proposer, seq: Sequence, k: int) -> list[int]:
        req = self._request(seq, k)
        t0 = time.perf_counter()
        proposal = proposer.propose([req])
        self.policy.record_proposer(proposer.name, time.perf_counter() - t0)
        tokens = proposal.draft_token_ids[0]
        self._early[seq.seq_id] = tokens
        self._hints[seq.seq_id] = (proposer.name, DraftHints(
            proposal.match_lengths[0] if proposal.match_lengths is not None else -1,
            tuple(proposal.confidence[0]) if proposal.confidence is not None else ()))
        return tokens

    def _expected(self, seq: Sequence, method: str, k: int) -> tuple[float, ...]:
        """Expected tokens per verify at k = 0..k of this step's model-free draft (empty for
        a draft model: it drafts after the policy chose k, so there is no draft to read yet)."""
        hinted = self._hints.get(seq.seq_id)
        if hinted is None or hinted[0] != method:
            return ()
        key = (seq.seq_id, method, k)  # auto prices the draft, then the policy does again
        if key not in self._expected_memo:
            self._expected_memo[key] = self.policy.expected_by_k(
                seq.seq_id, _stats_key(seq, method), hinted[1], k)
        return self._expected_memo[key]

    def _pick(self, seq: Sequence, k_max: int) -> tuple[str, int]:
        """(method, most drafts worth reserving) for this step."""
        if seq.spec_method != AUTO:
            proposer = self.proposers[seq.spec_method]
            if proposer.uses_model:
                return seq.spec_method, k_max
            return seq.spec_method, len(self._cheap_draft(proposer, seq, k_max))
        # auto: the model-free draft first (it costs only its verify rows), then the draft
        # model if one is loaded; the higher expected goodput wins.
        options: list[tuple[float, str, int]] = []
        cost = self.policy.target_cost
        cheap = self.proposers.get(_AUTO_CHEAP)
        models = self._model_proposers
        if cheap is not None:
            n = len(self._cheap_draft(cheap, seq, k_max))
            if not models:  # nothing to weigh it against: the batch policy cuts it
                return _AUTO_CHEAP, n
            expected = self._expected(seq, _AUTO_CHEAP, n)
            host = self.policy.proposer_seconds(_AUTO_CHEAP)
            # priced at its best cut (the policy may shorten it), not at its whole length
            value = max(expected[j] / (max(cost(1 + j), cost(1)) + host)
                        for j in range(len(expected)))
            options.append((value, _AUTO_CHEAP, n))
        for name in models:
            k = min(k_max, self.config.num_speculative_tokens)
            rate = self.policy.acceptance_rate(seq.seq_id, _stats_key(seq, name))
            seconds = max(cost(1 + k), cost(1)) + k * self.policy.draft_cost(1)
            options.append((expected_tokens(rate, k) / seconds, name, k))
        if not options:
            return OFF, 0
        _, name, k = max(options, key=lambda o: o[0])
        return name, k

    def _request(self, seq: Sequence, k: int, row: SampleRequest | None = None
                 ) -> ProposalRequest:
        sampling = None
        if row is not None:
            sampling = DraftSampling(row.params.greedy, row.params.seed, row.params)
        return ProposalRequest(
            seq.seq_id, seq.token_ids, k, num_prompt_tokens=seq.num_prompt_tokens,
            tenant=seq.spec_tenant, block_table=seq.block_table,
            kv_computed=seq.draft_num_computed, sampling=sampling,
        )

    # ---- after scheduling -----------------------------------------------------------------

    def draft_prefill(self, batch: ScheduledBatch) -> None:
        """Model proposers run beside the target's prompt chunks, at most ``_draft_budget``
        tokens a step. Decode steps that do not draft (k = 0) leave them behind on purpose:
        keeping in step would cost a draft forward per token for nothing when the policy has
        turned speculation off; the next proposal catches up on the tokens the draft lacks
        (see DraftModelProposer), or, when they exceed the budget, chunks here do first."""
        for name, proposer in self.proposers.items():
            if not proposer.uses_model:
                continue
            chunks: list[PrefillChunk] = []
            work: list[Sequence] = []
            budget = self._draft_budget
            for s in batch.scheduled:
                seq = s.seq
                if s.num_lookahead or seq.spec_method not in (name, AUTO) or budget <= 0:
                    continue
                if seq.is_prefill:
                    end = seq.num_computed_tokens + s.num_new_tokens
                elif seq.seq_id in self._catch_up:
                    end = seq.num_tokens - 1  # step 0 of the next proposal feeds the last token
                else:
                    continue
                end = min(end, seq.draft_num_computed + budget)
                if end <= seq.draft_num_computed:
                    continue
                budget -= end - seq.draft_num_computed
                chunks.append(PrefillChunk(seq.seq_id, seq.token_ids, end, seq.block_table,
                                           seq.draft_num_computed))
                work.append(seq)
            if not chunks:
                continue
            # One KV counter per sequence: an engine holds at most one draft model.
            for seq, kv in zip(work, proposer.prefill(chunks)):
                seq.draft_num_computed = kv

    def _draft_lag(self, seq: Sequence) -> int:
        """Tokens a draft model's first forward would feed beyond the last one."""
        return seq.num_tokens - 1 - seq.draft_num_computed

    def propose(self, batch: ScheduledBatch, rows: dict[int, SampleRequest]) -> Drafts:
        out = Drafts(draft_seconds=self._early_seconds)
        self._kv_after.clear()
        groups: dict[str, list[ScheduledSeq]] = {}
        for s in batch.scheduled:
            if s.num_lookahead:
                groups.setdefault(s.seq.spec_step_method, []).append(s)
        for name, group in groups.items():
            proposer = self.proposers[name]
            if not proposer.uses_model:
                for s in group:
                    early = self._early.get(s.seq.seq_id)
                    if early is None:  # not drafted in choose_k (cannot happen in a step)
                        early = self._cheap_draft(proposer, s.seq, s.num_lookahead)
                    out.tokens[s.seq.seq_id] = early[: s.num_lookahead]
                continue
            t0 = time.perf_counter()
            proposal = proposer.propose(
                [self._request(s.seq, s.num_lookahead, rows[s.seq.seq_id]) for s in group]
            )
            out.draft_seconds += time.perf_counter() - t0
            for i, secs in enumerate(proposal.step_seconds):
                active = sum(1 for s in group if s.num_lookahead > i)
                self.policy.record_draft_step(active, secs)
            ids = [s.seq.seq_id for s in group]
            for sid, tokens in zip(ids, proposal.draft_token_ids):
                out.tokens[sid] = tokens
            if proposal.kv_computed is not None:
                self._kv_after.update(zip(ids, proposal.kv_computed))
            out.prob_groups.append((ids, proposal.draft_probs))
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
        grouped = {sid for ids, _ in drafts.prob_groups for sid in ids}
        assert grouped <= set(logits)
        other_ids = [sid for sid in logits if sid not in grouped]
        for ids, probs in [*drafts.prob_groups, (other_ids, None)]:
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
            key = _stats_key(seq, seq.spec_step_method)
            self.policy.record_acceptance(seq.seq_id, key, len(drafts), accepted)
            hinted = self._hints.get(seq.seq_id)
            if hinted is not None and hinted[0] == seq.spec_step_method:
                self.policy.record_draft(key, hinted[1], len(drafts), accepted)
        kv = self._kv_after.get(seq.seq_id)
        if kv is not None:  # the proposer's KV holds only the positions the target kept
            seq.draft_num_computed = min(kv, seq.num_tokens - 1)

    def forget(self, seq: Sequence) -> None:
        self.policy.forget(seq.seq_id)
        self._idle.pop(seq.seq_id, None)
        done = FinishedSequence(
            seq.seq_id, seq.token_ids, seq.num_prompt_tokens, seq.spec_tenant,
            aborted=seq.finish_reason is not None and seq.finish_reason.value == "abort",
            method=seq.spec_method,
        )
        for proposer in self.proposers.values():
            proposer.finish(done)
