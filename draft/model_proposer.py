"""DraftModelProposer: a small causal LM drafts k tokens for every decoding sequence, batched.

The draft is run by the same ``target.ModelRunner`` code as the target, with its own KV tensors
indexed by the SAME block ids (one block table per sequence serves both models; the pool was
sized for both). ``ProposalRequest.kv_computed`` counts the tokens the draft has KV for (the
block manager keeps it per sequence, see core/draft_kv.py; the proposal returns the new count).

Per step, for the decoding sequences that speculate (k_i >= 1):
    draft step 0 feeds every token the draft has no KV for yet: normally just the last token, or
        two after a step where every draft passed (the last draft and the bonus token were never
        run through the draft), or a whole prompt after a prefix-cache hit on blocks whose draft
        KV is missing; it samples d_1.
    draft step j (1 .. k_i - 1) feeds d_j and samples d_{j+1}; sequences with smaller k drop out.
Worked example, a sequence of n0 = 10 tokens, k = 3: step 0 feeds position 9 (and anything
before it the draft lacks) -> d1; step 1 feeds d1 at position 10 -> d2; step 2 feeds d2 at 11
-> d3. The draft now has KV for positions < 12 = n0 + k - 1; after the target accepts a drafts,
the engine keeps ``min(n0 + k - 1, tokens - 1) = n0 + min(a, k - 1)``.

Sampled requests draw drafts from q = softmax(process_logits(draft logits)) with the request's
own temperature / top-k / top-p, and q is returned for the rejection sampler; greedy requests
take the draft's argmax (their q is never read).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from specserve.draft.base import (
    FinishedSequence,
    PrefillChunk,
    Proposal,
    ProposalRequest,
)
from specserve.draft.draft_sampler import GREEDY as _GREEDY
from specserve.draft.draft_sampler import DraftSampler
from specserve.target.layout import Chunk, build_layout
from specserve.target.model_runner import ModelRunner


class DraftModelProposer:
    name = "draft"
    uses_model = True

    def __init__(
        self, runner: ModelRunner, block_size: int,
        probs_fn: Callable[[torch.Tensor, list[Any]], torch.Tensor] | None = None, seed: int = 0,
    ) -> None:
        """``probs_fn(logits [N, V], params per row) -> q [N, V]``: the engine's logits
        processing (temperature, top-k, top-p), so q is processed exactly like the target's p.
        Needed only for sampled requests."""
        self.runner = runner
        self.block_size = block_size
        self.probs_fn = probs_fn
        self.device = runner.device
        # A distilled draft's reduced head scores only its head_token_ids (None: all tokens).
        self.sampler = DraftSampler(runner.model.head_token_ids,
                                    runner.model_config.vocab_size, probs_fn, seed)

    def finish(self, done: FinishedSequence) -> None:
        self.sampler.forget(done.seq_id)

    def clear(self, tenant: str | None = None) -> None:
        return None  # nothing learned across requests

    # ---- keeping the draft's KV in step with the target -----------------------------------

    def prefill(self, chunks: list[PrefillChunk]) -> list[int]:
        """Runs the draft over this step's chunks: each catches up on tokens [kv_computed, end).
        Returns the tokens the draft's KV holds per chunk afterwards. ``kv_computed`` counts
        only prefix-cache blocks whose draft KV was written (the block manager tracks it): a
        block filled by a request that did not run the draft is recomputed. Rewriting a shared
        block is safe: the draft computes the same values for the same tokens at the same
        positions."""
        work = [c for c in chunks if c.kv_computed < c.end]
        if work:
            # logits for nothing: no logits rows skip the draft's lm_head entirely.
            self.runner.run(build_layout(
                [Chunk(c.token_ids[c.kv_computed : c.end], c.kv_computed, c.block_table)
                 for c in work], self.block_size, self.device))
        return [max(c.kv_computed, c.end) for c in chunks]

    # ---- drafting -----------------------------------------------------------------------

    def propose(self, requests: list[ProposalRequest]) -> Proposal:
        """Drafts ``num_tokens`` tokens per request. The proposal's draft probs are row-ordered
        by request, then position; ``kv_computed`` is what the draft's KV holds afterwards;
        ``step_seconds`` what each sequential draft forward took."""
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        samplings = [r.sampling or _GREEDY for r in requests]
        kv = [r.kv_computed for r in requests]
        # All-greedy batches need only the argmax: no q (None means one-hot to the sampler).
        greedy = all(s.greedy for s in samplings)
        step_seconds: list[float] = []
        active = [i for i, r in enumerate(requests) if r.num_tokens > 0]
        step = 0
        while active:
            t0 = time.perf_counter()
            chunks: list[Chunk] = []
            for i in active:
                req = requests[i]
                n = len(req.token_ids)
                if step == 0:  # everything the draft has no KV for, up to the last token
                    start = min(req.kv_computed, n - 1)
                    chunks.append(Chunk(req.token_ids[start:], start, req.block_table, 1))
                else:  # d_step at position n - 1 + step
                    chunks.append(Chunk([drafts[i][-1]], n - 1 + step, req.block_table, 1))
            logits = self.runner.run(build_layout(chunks, self.block_size, self.device))  # [A, V]
            if greedy:
                tokens = self.sampler.greedy(logits)
            else:
                tokens, q = self.sampler.sample(
                    logits, [samplings[i] for i in active], [requests[i].seq_id for i in active]
                )
            for j, i in enumerate(active):
                drafts[i].append(tokens[j])
                if not greedy:
                    probs[i].append(q[j])
                kv[i] = len(requests[i].token_ids) + step  # fed up to this position
            step += 1
            active = [i for i in active if len(drafts[i]) < requests[i].num_tokens]
            step_seconds.append(time.perf_counter() - t0)
        flat = [p for per_seq in probs for p in per_seq]
        draft_probs = torch.stack(flat) if flat else None
        return Proposal(draft_token_ids=drafts, draft_probs=draft_probs, kv_computed=kv,
                        step_seconds=step_seconds)
