"""Planning a step's speculation: for every decoding sequence, which proposer drafts and how
many lookahead slots to ask the scheduler for (``Sequence.num_lookahead_slots``).

Model-free proposers (n-gram, suffix) draft right here, so the policy prices each sequence's
real draft. ``auto`` picks, per sequence and step, the method with the best expected goodput:
expected tokens per verify over the step's cost (verify rows, plus the draft model's sequential
forwards). Its model-free candidate (the registry spec flagged ``auto_candidate``) drafts first,
priced by what the draft says of itself (its match length, its proposer's per-token
probabilities) through hazards learned from earlier verifies (acceptance_model.py); each model
proposer is priced by the sequence's measured acceptance for it. The batch policy then cuts k,
to 0 when nothing pays.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from specserve.core.config import EngineConfig
from specserve.core.draft_kv import DraftKVLedger
from specserve.core.sampling import SampleRequest
from specserve.core.sequence import Sequence
from specserve.draft.base import DraftSampling, ProposalRequest, Proposer
from specserve.draft.registry import AUTO, OFF, ProposerRegistry
from specserve.spec.acceptance_model import DraftHints
from specserve.spec.policy import Candidate, SpeculationPolicy, expected_tokens
from specserve.spec.state import SpecState

_MAX_IDLE = 16  # most steps a sequence kept at k = 0 skips its proposer before trying again
# ... and after proposals with nothing worth drafting (no match; no method that pays): a copy
# can start at any token, so these back off less far.
_MAX_EMPTY_IDLE = 4


def stats_key(seq: Sequence, method: str) -> str:
    """The name acceptance is tracked under: sampled requests apart from greedy ones (a sample
    matches a draft less often than an argmax, so one rate for both misprices each)."""
    return method if seq.params.greedy else f"{method}:sampled"


def proposal_request(seq: Sequence, state: SpecState, k: int, kv_computed: int,
                     row: SampleRequest | None = None) -> ProposalRequest:
    sampling = None
    if row is not None:
        sampling = DraftSampling(row.params.greedy, row.params.seed, row.params)
    return ProposalRequest(
        seq.seq_id, seq.token_ids, k, num_prompt_tokens=seq.num_prompt_tokens,
        tenant=state.tenant, block_table=seq.block_table, kv_computed=kv_computed,
        sampling=sampling, prediction=state.prediction,
    )


class Planner:
    """Shares the speculator's proposers, policy and per-sequence states."""

    def __init__(self, proposers: dict[str, Proposer], registry: ProposerRegistry,
                 policy: SpeculationPolicy, states: dict[int, SpecState], ledger: DraftKVLedger,
                 settings: EngineConfig, max_model_len: int) -> None:
        self.proposers, self.registry, self.policy = proposers, registry, policy
        self.states, self.ledger = states, ledger
        self.num_speculative_tokens = settings.num_speculative_tokens
        self.max_model_len = max_model_len
        # Draft-model tokens per step are bounded like the target's: a prompt whose draft KV is
        # missing (a prefix-cache hit on blocks a non-draft request filled, a long pause with
        # k = 0) is caught up in chunks, never in one unbounded forward.
        self.draft_budget = settings.max_num_batched_tokens
        candidate = registry.auto_candidate()
        self.auto_candidate = None if candidate is None else candidate.name
        self.prediction_method = registry.prediction_method()
        self.early_seconds = 0.0  # this step's model-free drafting, counted as draft time
        self._planned: list[SpecState] = []  # states this step wrote: cleared at the next
        self._model_proposers: list[str] = []
        # seq -> (k -> the tokens its grammar forces next): a constrained sequence whose
        # model-free proposer finds nothing drafts those instead (the speculator sets it)
        self.forced_draft: Callable[[Sequence, int], list[int]] | None = None

    def plan(self, running: list[Sequence]) -> None:
        for state in self._planned:
            state.new_step()
        self._planned = []
        candidates = []
        prefill_tokens = 0
        decoding = 0
        # once a step, not per sequence (benchmarks may swap proposers between runs)
        self._model_proposers = [n for n, p in self.proposers.items() if p.uses_model]
        t0 = time.perf_counter()
        for seq in running:
            seq.num_lookahead_slots = 0
            remaining = seq.num_tokens - seq.num_computed_tokens
            if remaining != 1:
                prefill_tokens += remaining
                continue
            decoding += 1
            state = self.states[seq.seq_id]
            if state.method == OFF or state.k_max == 0:
                continue
            # The bonus token is free: never draft past max_tokens or the context window.
            left = min(
                seq.params.max_tokens - seq.num_output_tokens,
                self.max_model_len - seq.num_tokens,
            ) - 1
            k_max = min(state.k_max, left)
            if k_max <= 0:
                continue
            if state.idle_left > 0:  # k = 0 lately: not worth proposing yet
                state.idle_left -= 1
                continue
            self._planned.append(state)
            method, k_max = self._pick(seq, state, k_max)
            state.step_method = method
            if k_max <= 0:
                state.back_off(_MAX_EMPTY_IDLE)
                continue
            uses_model = self.proposers[method].uses_model
            if uses_model and self._draft_lag(seq) >= self.draft_budget:
                # Drafting would first feed the draft every token it lacks in one forward: catch
                # up in budget-sized chunks beside the next steps' work instead (draft prefill).
                state.catch_up = True
                continue
            key = stats_key(seq, method)
            rate = self.policy.acceptance_rate(seq.seq_id, key)
            host = 0.0 if uses_model else self.policy.proposer_seconds(method)
            candidates.append(Candidate(seq.seq_id, k_max, rate, uses_model, host, key,
                                        self._expected(seq, state, method, k_max)))
        self.early_seconds = time.perf_counter() - t0
        if not candidates:
            return
        # Sequences that draft nothing still decode one token in the same step: the policy
        # weighs drafts against the whole step, not the drafting sequences alone.
        ks = self.policy.choose(candidates, prefill_tokens, decoding - len(candidates))
        for seq in running:
            seq.num_lookahead_slots = ks.get(seq.seq_id, 0)
        for c in candidates:
            if ks[c.key] > 0:
                self.states[c.key].keep_proposing()
            else:
                # ~60% of a 32-sequence chat batch's proposals found nothing to draft, every
                # step, at 3-4% of the step's time: back off
                self.states[c.key].back_off(_MAX_IDLE)

    def _draft_lag(self, seq: Sequence) -> int:
        """Tokens a draft model's first forward would feed beyond the last one."""
        return seq.num_tokens - 1 - self.ledger.draft_kv_tokens(seq.seq_id)

    def cheap_draft(self, proposer: Proposer, seq: Sequence, k: int) -> list[int]:
        state = self.states[seq.seq_id]
        req = proposal_request(seq, state, k, self.ledger.draft_kv_tokens(seq.seq_id))
        t0 = time.perf_counter()
        proposal = proposer.propose([req])
        self.policy.record_proposer(proposer.name, time.perf_counter() - t0)
        tokens = proposal.draft_token_ids[0]
        hints = DraftHints(
            proposal.match_lengths[0] if proposal.match_lengths is not None else -1,
            tuple(proposal.confidence[0]) if proposal.confidence is not None else ())
        if not tokens and self.forced_draft is not None:
            tokens = self.forced_draft(seq, k)
            if tokens:  # no match to speak of: priced by the sequence's acceptance alone
                hints = DraftHints()
        state.early = tokens
        state.hints = (proposer.name, hints)
        return tokens

    def _expected(self, seq: Sequence, state: SpecState, method: str, k: int
                  ) -> tuple[float, ...]:
        """Expected tokens per verify at k = 0..k of this step's model-free draft (empty for
        a draft model: it drafts after the policy chose k, so there is no draft to read yet)."""
        if state.hints is None or state.hints[0] != method:
            return ()
        key = (method, k)  # auto prices the draft, then the policy does again
        if key not in state.expected:
            state.expected[key] = self.policy.expected_by_k(
                seq.seq_id, stats_key(seq, method), state.hints[1], k)
        return state.expected[key]

    def _pick(self, seq: Sequence, state: SpecState, k_max: int) -> tuple[str, int]:
        """(method, most drafts worth reserving) for this step. A request with a predicted
        output drafts from it first. Under a named method, the prediction's draft is taken
        whenever there is one, else the method's (at its own k_max); under auto, the
        prediction's draft is one more option, priced like auto's model-free candidate (by
        what the draft says of itself: an aligned prediction prices high, a short re-found
        match low) and preferred on a tie."""
        predicted = self.prediction_method
        drafted: list[_Drafted] = []
        if state.prediction is not None and predicted in self.proposers:
            n = len(self.cheap_draft(self.proposers[predicted], seq, k_max))
            if state.method == predicted or (n and state.method != AUTO):
                return predicted, n
            if n:
                drafted.append(_Drafted(self._value(seq, state, predicted, n), predicted, n,
                                        state.early, state.hints))
            k_max = min(k_max, state.base_k)
            if k_max <= 0:
                return (predicted, n) if n else (OFF, 0)
        if state.method != AUTO:
            proposer = self.proposers[state.method]
            if proposer.uses_model:
                return state.method, k_max
            return state.method, len(self.cheap_draft(proposer, seq, k_max))
        return self._auto(seq, state, k_max, drafted)

    def _value(self, seq: Sequence, state: SpecState, method: str, n: int) -> float:
        """Expected tokens per second of this step's model-free draft of ``method``, priced at
        its best cut (the policy may shorten it), not at its whole length."""
        cost = self.policy.target_cost
        expected = self._expected(seq, state, method, n) or (1.0,)
        host = self.policy.proposer_seconds(method)
        return max(expected[j] / (max(cost(1 + j), cost(1)) + host)
                   for j in range(len(expected)))

    def _auto(self, seq: Sequence, state: SpecState, k_max: int, drafted: list[_Drafted]
              ) -> tuple[str, int]:
        """auto: the model-free draft first (it costs only its verify rows), then the draft
        model if one is loaded; the higher expected goodput wins (the first on a tie)."""
        options: list[tuple[float, str, int]] = [(d.value, d.method, d.n) for d in drafted]
        cost = self.policy.target_cost
        cheap = self.auto_candidate
        models = self._model_proposers
        if cheap is not None and cheap in self.proposers:
            n = len(self.cheap_draft(self.proposers[cheap], seq, k_max))
            if not models and not drafted:  # nothing to weigh it against: the policy cuts it
                return cheap, n
            options.append((self._value(seq, state, cheap, n), cheap, n))
        for model in models:
            k = min(k_max, self.num_speculative_tokens)
            rate = self.policy.acceptance_rate(seq.seq_id, stats_key(seq, model))
            seconds = max(cost(1 + k), cost(1)) + k * self.policy.draft_cost(1)
            options.append((expected_tokens(rate, k) / seconds, model, k))
        if not options:
            return OFF, 0
        _, best, k = max(options, key=lambda o: o[0])
        for d in drafted:  # its draft was made first: it is this step's draft again
            if d.method == best:
                state.early, state.hints = d.early, d.hints
        return best, k


@dataclass(frozen=True)
class _Drafted:
    """A model-free draft made before auto's own candidate (which overwrites the state's)."""

    value: float
    method: str
    n: int
    early: list[int] | None
    hints: tuple[str, DraftHints] | None
