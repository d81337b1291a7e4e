"""EagleProposer: an EAGLE head (draft/eagle_head.py) drafts k tokens per decoding sequence,
chaining on its own predicted features.

Target features arrive after each target forward (``add_features``): the target's hidden states
of the chosen layers at every position it computed for a sequence that may use the head
(prefill chunks, the last token of a decode step, the k + 1 rows of a verify). They are fused
(``fc``) at once and kept per sequence by position until the head consumes them; rows of
rejected drafts are dropped because only positions < len(tokens) - 1 are ever read.

The head's KV (``ProposalRequest.kv_computed``) holds positions whose input was a TARGET
feature. Per step, for the sequences that draft:
    step 0 feeds every position the head has no KV for, up to the last token n - 1, each with
        the target feature of the position before it (n - 1's is the last verify's accepted
        row); it samples d_1 from its output at n - 1.
    step j (1 .. k - 1) feeds d_j at position n - 1 + j with the head's own output at the
        previous position as its feature, and samples d_{j+1}.
The proposal reports ``kv_computed = n``: the drafted positions' KV was computed from the head's
own features, so after the target accepts some of them they are recomputed from the target's
features in the next step 0 (worked example: n = 10, k = 3, 2 accepted + bonus: the next step 0
feeds positions 10, 11, 12 with target features of 9, 10, 11).

Prefill runs the head one chunk behind the target (a chunk's features come only after the
target's forward); step 0 feeds the rest. The engine never lets an EAGLE sequence hit
prefix-cache blocks whose head KV is not written (``DraftKVLedger.require_draft_kv_hits``): the
target recomputes them and so hands over their features. Where a feature is still missing (the
sequence's features were dropped, e.g. a gap), the head uses zeros: that costs acceptance,
never correctness.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from specserve.draft.base import FinishedSequence, PrefillChunk, Proposal, ProposalRequest
from specserve.draft.draft_sampler import GREEDY, DraftSampler
from specserve.draft.eagle_head import EagleRunner
from specserve.target.layout import Chunk, build_layout


class FeatureRun:
    """Fused target features g of consecutive positions [first, first + len)."""

    def __init__(self, first: int, rows: torch.Tensor) -> None:
        self.first = first
        self.rows = rows  # [m, hidden]

    @property
    def end(self) -> int:
        return self.first + self.rows.shape[0]

    def put(self, start: int, rows: torch.Tensor) -> FeatureRun:
        """Writes rows for positions [start, start + len): later positions are dropped (they
        belonged to rejected drafts or an older life of the sequence); a gap starts anew."""
        if start < self.first or start > self.end:
            return FeatureRun(start, rows)
        return FeatureRun(self.first, torch.cat([self.rows[: start - self.first], rows]))

    def take(self, lo: int, hi: int, width: int) -> torch.Tensor:
        """Features of positions [lo, hi) ([hi - lo, width]); zeros where none is known."""
        out = self.rows.new_zeros((hi - lo, width))
        a, b = max(lo, self.first), min(hi, self.end)
        if a < b:
            out[a - lo : b - lo] = self.rows[a - self.first : b - self.first]
        return out


class EagleProposer:
    name = "eagle"
    uses_model = True

    def __init__(
        self, runner: EagleRunner,
        probs_fn: Callable[[torch.Tensor, list[Any]], torch.Tensor] | None = None, seed: int = 0,
    ) -> None:
        self.runner = runner
        self.head = runner.head
        self.device = runner.device
        self.hidden = self.head.config.hidden_size
        self.sampler = DraftSampler(self.head.head_token_ids, self.head.meta.vocab_size,
                                    probs_fn, seed)
        self.features: dict[int, FeatureRun] = {}

    @property
    def target_layers(self) -> tuple[int, ...]:
        return self.runner.target_layers

    # ---- target features ------------------------------------------------------------------

    def add_features(self, seq_id: int, start: int, layer_feats: torch.Tensor) -> None:
        """The target's hidden states ([m, len(target_layers) * hidden]) at positions
        [start, start + m) of one sequence, from the forward that just ran."""
        self.add_feature_spans([(seq_id, start, layer_feats.shape[0])], layer_feats)

    def add_feature_spans(self, spans: list[tuple[int, int, int]],
                          layer_feats: torch.Tensor) -> None:
        """Several sequences' hidden states laid back to back: ``spans`` holds (seq id, first
        position, rows) in the order of ``layer_feats``' rows. One ``fc`` for all of them."""
        with torch.inference_mode():
            fused = self.head.fuse(layer_feats)  # [sum rows, hidden]
        at = 0
        for seq_id, start, m in spans:
            rows = fused[at : at + m]
            at += m
            run = self.features.get(seq_id)
            self.features[seq_id] = (FeatureRun(start, rows) if run is None
                                     else run.put(start, rows))

    def prefill(self, chunks: list[PrefillChunk]) -> list[int]:
        """Catches the head's KV up on ``[kv_computed, end)`` as far as target features exist:
        position p needs g_{p-1}, and this step's chunk gets its features only after the
        target's forward, so the head runs one chunk behind the target (the next step 0, or the
        next chunk, takes the rest). Positions the target skipped (prefix-cache hits) have no
        features: zeros, as in ``propose``."""
        fed: list[Chunk] = []
        feats = []
        done = [c.kv_computed for c in chunks]
        for n, c in enumerate(chunks):
            run = self.features.get(c.seq_id)
            hi = min(c.end, run.end + 1) if run is not None else c.kv_computed
            if hi <= c.kv_computed:
                continue
            fed.append(Chunk(c.token_ids[c.kv_computed : hi], c.kv_computed, c.block_table))
            feats.append(self._target_features(c.seq_id, c.kv_computed - 1, hi - 1))
            done[n] = hi
        if fed:
            self.runner.run(build_layout(fed, self.runner.block_size, self.device),
                            torch.cat(feats))
        return done

    def finish(self, done: FinishedSequence) -> None:
        self.sampler.forget(done.seq_id)
        self.features.pop(done.seq_id, None)

    def clear(self, tenant: str | None = None) -> None:
        return None  # nothing learned across requests

    # ---- drafting -------------------------------------------------------------------------

    def propose(self, requests: list[ProposalRequest]) -> Proposal:
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        samplings = [r.sampling or GREEDY for r in requests]
        kv = [r.kv_computed for r in requests]
        greedy = all(s.greedy for s in samplings)
        step_seconds: list[float] = []
        active = [i for i, r in enumerate(requests) if r.num_tokens > 0]
        prev: torch.Tensor | None = None  # [len(active), hidden]: last output per active row
        step = 0
        while active:
            t0 = time.perf_counter()
            chunks: list[Chunk] = []
            feats = []
            for i in active:
                req = requests[i]
                n = len(req.token_ids)
                if step == 0:  # positions the head lacks, each with the target feature before it
                    start = min(req.kv_computed, n - 1)
                    chunks.append(Chunk(req.token_ids[start:], start, req.block_table, 1))
                    feats.append(self._target_features(req.seq_id, start - 1, n - 1))
                else:  # d_step at position n - 1 + step
                    chunks.append(Chunk([drafts[i][-1]], n - 1 + step, req.block_table, 1))
            layout = build_layout(chunks, self.runner.block_size, self.device)
            if step == 0:
                out = self.runner.run(layout, torch.cat(feats))[layout.logits_indices]
            else:  # one row per active sequence, fed the previous step's outputs in order
                assert prev is not None
                out = self.runner.run(layout, prev)  # [A, hidden]
            with torch.inference_mode():
                logits = self.head.logits(out)  # [A, Vd]
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
                if step == 0:  # positions < n hold target-feature KV; drafts' KV is redone
                    kv[i] = len(requests[i].token_ids)
                    self.features.pop(requests[i].seq_id, None)  # all consumed
            keep = [j for j, i in enumerate(active) if len(drafts[i]) < requests[i].num_tokens]
            if len(keep) < len(active):
                out = out[keep]
                active = [active[j] for j in keep]
            prev = out
            step += 1
            step_seconds.append(time.perf_counter() - t0)
        flat = [p for per_seq in probs for p in per_seq]
        return Proposal(draft_token_ids=drafts, draft_probs=torch.stack(flat) if flat else None,
                        kv_computed=kv, step_seconds=step_seconds)

    def _target_features(self, seq_id: int, lo: int, hi: int) -> torch.Tensor:
        """g of positions [lo, hi) ([hi - lo, hidden]); position -1 and unknown ones are 0."""
        run = self.features.get(seq_id)
        if run is None:
            return torch.zeros((hi - lo, self.hidden), dtype=self.head.dtype,
                               device=self.device)
        return run.take(lo, hi, self.hidden)
