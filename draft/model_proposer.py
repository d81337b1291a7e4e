"""DraftModelProposer: a small causal LM drafts k tokens for every decoding sequence, batched.

The draft is run by the same ``target.ModelRunner`` code as the target, with its own KV tensors
indexed by the SAME block ids (one block table per sequence serves both models; the pool was
sized for both). ``ProposalRequest.kv_computed`` counts the tokens the draft has KV for (the
engine keeps it per sequence; the proposal returns the new count).

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

from draft.base import (
    DraftSampling,
    FinishedSequence,
    PrefillChunk,
    Proposal,
    ProposalRequest,
)
from kernels.metadata import AttentionMetadata, token_positions
from target.model_runner import ModelRunner

_GREEDY = DraftSampling(greedy=True)


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
        # A distilled draft's reduced head scores only these token ids (None: the whole vocab).
        ids = runner.model.head_token_ids
        self.head_ids: torch.Tensor | None = None if ids is None else ids.cpu()
        self.vocab_size = runner.model_config.vocab_size
        self.device = runner.device
        self.generator = torch.Generator().manual_seed(seed + 0x5EED)
        # Per-request draft RNGs for seeded requests, so their drafts are reproducible too.
        self.seeded: dict[int, torch.Generator] = {}

    def finish(self, done: FinishedSequence) -> None:
        self.seeded.pop(done.seq_id, None)

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
            ids, q_lens, ctx_lens = [], [], []
            for c in work:
                ids.extend(c.token_ids[c.kv_computed : c.end])
                q_lens.append(c.end - c.kv_computed)
                ctx_lens.append(c.end)
            meta = AttentionMetadata.build(q_lens, ctx_lens, [list(c.block_table) for c in work],
                                           self.block_size, self.device)
            positions = token_positions(q_lens, ctx_lens)
            # logits for nothing: an empty index set skips the draft's lm_head entirely.
            self.runner.forward(
                torch.tensor(ids, device=self.device), positions.to(self.device), meta,
                torch.empty(0, dtype=torch.int64, device=self.device),
            )
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
            ids, q_lens, ctx_lens, tables = [], [], [], []
            for i in active:
                req = requests[i]
                n = len(req.token_ids)
                if step == 0:
                    start = min(req.kv_computed, n - 1)
                    ids.extend(req.token_ids[start:])
                    q_lens.append(n - start)
                    ctx_lens.append(n)
                else:
                    ids.append(drafts[i][-1])
                    q_lens.append(1)
                    ctx_lens.append(n + step)
                tables.append(list(req.block_table))
            meta = AttentionMetadata.build(q_lens, ctx_lens, tables, self.block_size, self.device)
            positions = token_positions(q_lens, ctx_lens)
            last = torch.cumsum(torch.tensor(q_lens), 0) - 1
            logits, _ = self.runner.forward(
                torch.tensor(ids, device=self.device), positions.to(self.device), meta,
                last.to(self.device),
            )  # [A, V]
            if greedy:
                best = logits.argmax(dim=-1).cpu()
                tokens = (best if self.head_ids is None else self.head_ids[best]).tolist()
            else:
                tokens, q = self._sample(
                    logits.cpu(), [samplings[i] for i in active], [requests[i].seq_id
                                                                   for i in active]
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

    def _sample(
        self, logits: torch.Tensor, rows: list[DraftSampling], seq_ids: list[int]
    ) -> tuple[list[int], torch.Tensor]:
        """logits [A, V] (or [A, Vd] from a reduced head) -> one draft token per row and its
        distribution q [A, V]. Tokens outside a reduced head get q = 0: the draft never proposes
        them, and the rejection sampler's residual max(0, p - q) covers them exactly."""
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
                raise ValueError("DraftModelProposer needs probs_fn to draft sampled requests")
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
