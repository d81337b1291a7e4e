"""TextDraftProposer: a small LM with ANOTHER tokenizer drafts text; the target verifies its own
tokens of that text.

Lossless by string-level exact match (SLEM, Timor et al., ICML 2025). The draft runs on its own
tokenization of the sequence's text, drafts greedily, and its text is turned into target tokens
(text_align.py). The proposal carries no draft distribution, so the rejection sampler verifies
it as one-hot q: draft token d is accepted with probability p(d) and on rejection the token is
drawn from p with d removed, renormalized. Every emitted token then follows p exactly, whatever d
was, as long as d is fixed before the target's draw (P(d) = p(d); P(y != d) = (1 - p(d)) p(y) /
(1 - p(d)) = p(y)); greedy requests accept d iff it is the target's argmax. So neither the
draft's numbers nor how the two tokenizers align can change an answer, only how many drafts are
accepted. Drafting greedily maximizes p(d) for a draft that agrees with the target, which is why
sampled requests draft greedily too (a sampled d would be accepted with E_q[p(d)] <= max p).
Token-level intersection (the draft's q restricted to the shared tokens) is not run.

The draft's KV is its own: its own ``ModelRunner`` (pool sized beside the target's, see
``TextDraftSource``) and a block allocation per sequence, freed in ``finish``. Its tokens follow
the accepted text: after a verify, the drafted tokens whose text the target accepted are kept
(their KV is valid), the last kept token is re-tokenized together with the new text (so a word
cut at the boundary merges again), and KV past the kept tokens is recomputed. The work per step
is the new text plus a few tokens, whatever the context length. A sequence whose draft cannot get
blocks, or would pass the draft's context window, simply drafts nothing.

Counting in target tokens for the engine: ``kv_computed`` (Proposal and ``prefill``) says how
many target tokens' text the draft has read, so the planner's catch-up (a long pause at k = 0)
feeds the draft in bounded chunks; the draft's own KV bookkeeping stays here.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.draft.base import FinishedSequence, PrefillChunk, Proposal, ProposalRequest
from specserve.draft.text_align import (
    TargetText,
    common_prefix,
    decode,
    encode,
    target_continuation,
)
from specserve.target.layout import Chunk, build_layout
from specserve.target.model_runner import ModelRunner

_REPLACEMENT = "\ufffd"
# Text kept per sequence: from this many tokens back (a re-tokenization starts at most a
# character's bytes before the last context token).
_KEEP_TOKENS = 8


@dataclass
class TextDraft:
    """What the proposer runs on: the draft's runner (its own KV pool) and both tokenizers."""

    runner: ModelRunner
    tokenizer: Any  # the draft's
    target_tokenizer: Any
    eos_token_ids: frozenset[int]  # the draft's

    @property
    def target_special_ids(self) -> frozenset[int]:
        return frozenset(getattr(self.target_tokenizer, "all_special_ids", ()) or ())


@dataclass
class _SeqDraft:
    """One sequence as the draft sees it. ``ids[:num_context]`` tokenize the sequence's text
    (``text`` holds it from offset ``base`` on), ``ids[num_context:]`` are the last step's
    drafts (their text ``drafted``, from the text's end on); ``ends`` are absolute character
    ends; the KV holds ``ids[:kv]``."""

    target: TargetText = field(default_factory=TargetText)
    text: str = ""
    base: int = 0
    ids: list[int] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)
    num_context: int = 0
    drafted: str = ""
    kv: int = 0
    blocks: list[int] = field(default_factory=list)

    @property
    def text_end(self) -> int:
        return self.base + len(self.text)


class TextDraftProposer:
    name = "text_draft"
    uses_model = True

    def __init__(self, draft: TextDraft, block_size: int) -> None:
        self.draft = draft
        self.runner = draft.runner
        self.block_size = block_size
        self.device = draft.runner.device
        self.max_positions = draft.runner.model_config.max_position_embeddings
        self.free_blocks = list(range(draft.runner.num_blocks - 1, -1, -1))
        self.seqs: dict[int, _SeqDraft] = {}
        self.target_special = draft.target_special_ids
        # target tokens per draft token, measured: how many draft steps k target tokens need
        self.ratio = 1.0

    # ---- the protocol -----------------------------------------------------------------------

    def finish(self, done: FinishedSequence) -> None:
        st = self.seqs.pop(done.seq_id, None)
        if st is not None:
            self.free_blocks.extend(st.blocks)

    def clear(self, tenant: str | None = None) -> None:
        return None  # nothing learned across requests

    def draft_token_ids(self, seq_id: int) -> list[int]:
        """The draft's tokens with KV for a sequence (for tests and tracing)."""
        st = self.seqs.get(seq_id)
        return [] if st is None else st.ids[: st.kv]

    def prefill(self, chunks: list[PrefillChunk]) -> list[int]:
        """Reads the text of ``token_ids[:end]`` per chunk and runs the draft over its tokens
        of it; returns ``end`` for each (the target tokens whose text the draft has read)."""
        work: list[Chunk] = []
        for c in chunks:
            st = self.seqs.setdefault(c.seq_id, _SeqDraft())
            self._sync(st, c.token_ids, c.end)
            if st.kv < st.num_context and self._reserve(st, st.num_context):
                work.append(Chunk(st.ids[st.kv : st.num_context], st.kv, st.blocks))
                st.kv = st.num_context
        if work:
            self.runner.run(build_layout(work, self.block_size, self.device))
        return [c.end for c in chunks]

    def propose(self, requests: list[ProposalRequest]) -> Proposal:
        t0 = time.perf_counter()
        drafts: list[list[int]] = [[] for _ in requests]
        kv = [max(len(r.token_ids) - 1, 0) for r in requests]
        jobs: list[tuple[int, _SeqDraft, int]] = []  # (request index, state, draft steps)
        for i, r in enumerate(requests):
            st = self.seqs.setdefault(r.seq_id, _SeqDraft())
            self._sync(st, r.token_ids, len(r.token_ids))
            if r.num_tokens <= 0 or st.num_context == 0:
                continue
            steps = max(2, min(2 * r.num_tokens + 1, math.ceil(r.num_tokens / self.ratio) + 1))
            if st.num_context + steps > self.max_positions:
                continue
            if not self._reserve(st, st.num_context + steps - 1):
                continue
            jobs.append((i, st, steps))
        made = self._run_draft(jobs)
        for (i, st, _), tokens in zip(jobs, made):
            drafts[i] = self._to_target(requests[i], st, tokens)
        total = time.perf_counter() - t0
        k = max((r.num_tokens for r in requests), default=0)
        # Priced like a draft model's k sequential steps: what drafting k target tokens cost.
        step_seconds = [total / k] * k if jobs and k else []
        return Proposal(draft_token_ids=drafts, draft_probs=None, kv_computed=[
            n + len(d) for n, d in zip(kv, drafts)], step_seconds=step_seconds)

    # ---- the draft's tokens follow the text -------------------------------------------------

    def _sync(self, st: _SeqDraft, token_ids: Sequence[int], end: int) -> None:
        """Brings ``st`` to the text of ``token_ids[:end]``: the drafts whose text was
        accepted stay, the last token kept is re-tokenized with the new text."""
        tok = self.draft.tokenizer
        old_end = st.text_end
        delta = st.target.advance(self.draft.target_tokenizer, token_ids, end)
        if not delta and not st.drafted and st.num_context == len(st.ids):
            return
        st.text += delta
        keep = st.num_context
        if st.drafted:  # drafts consistent with the accepted text
            agreed = old_end + common_prefix(st.drafted, st.text[old_end - st.base:])
            while keep < len(st.ids) and st.ends[keep] <= agreed:
                keep += 1
        keep = max(keep - 1, 0)
        while 0 < keep < len(st.ids) and st.ends[keep - 1] == st.ends[keep]:
            keep -= 1  # never cut between the bytes of one character
        cut = st.ends[keep - 1] if keep else st.base
        new_ids, new_ends = encode(tok, st.text[cut - st.base:])
        del st.ids[keep:], st.ends[keep:]  # in place: no copy of the whole context
        st.ids.extend(new_ids)
        st.ends.extend(cut + e for e in new_ends)
        st.num_context = len(st.ids)
        st.kv = min(st.kv, keep)
        st.drafted = ""
        if len(st.ids) > _KEEP_TOKENS:
            base = st.ends[len(st.ids) - _KEEP_TOKENS]
            if base > st.base:
                st.text, st.base = st.text[base - st.base:], base

    def _reserve(self, st: _SeqDraft, num_tokens: int) -> bool:
        """Blocks for ``num_tokens`` draft positions; False (nothing taken) if the pool has
        too few free."""
        need = -(-num_tokens // self.block_size) - len(st.blocks)
        if need <= 0:
            return True
        if need > len(self.free_blocks):
            return False
        for _ in range(need):
            st.blocks.append(self.free_blocks.pop())
        return True

    # ---- drafting ---------------------------------------------------------------------------

    def _run_draft(self, jobs: list[tuple[int, _SeqDraft, int]]) -> list[list[int]]:
        """Greedy draft tokens per job, batched: step 0 feeds every context token without KV
        (at least the last), step j the draft of step j - 1; a job stops at its step count or
        the draft's EOS. Afterwards each state holds its drafts and their text."""
        out: list[list[int]] = [[] for _ in jobs]
        active = list(range(len(jobs)))
        step = 0
        eos = self.draft.eos_token_ids
        while active:
            chunks = []
            for j in active:
                _, st, _ = jobs[j]
                if step == 0:
                    start = min(st.kv, st.num_context - 1)
                    chunks.append(Chunk(st.ids[start : st.num_context], start, st.blocks, 1))
                else:
                    chunks.append(Chunk([out[j][-1]], st.num_context + step - 1, st.blocks, 1))
            logits = self.runner.run(build_layout(chunks, self.block_size, self.device))
            tokens = torch.argmax(logits, dim=-1).tolist()
            for j, t in zip(active, tokens):
                out[j].append(t)
            step += 1
            active = [j for j in active if len(out[j]) < jobs[j][2] and out[j][-1] not in eos]
        for (_, st, _), tokens in zip(jobs, out):
            st.kv = st.num_context + len(tokens) - 1
            self._record_drafts(st, tokens)
        return out

    def _record_drafts(self, st: _SeqDraft, tokens: list[int]) -> None:
        """Appends the drafts to ``st.ids`` with their text and character ends."""
        tok = self.draft.tokenizer
        left = st.ids[max(0, st.num_context - 2) : st.num_context]
        base = decode(tok, left)
        text = base
        for t in tokens:
            st.ids.append(t)
            full = decode(tok, left + st.ids[st.num_context:])
            text = full if full.startswith(base) else text
            st.ends.append(st.text_end + len(text) - len(base))
        st.drafted = text[len(base):]

    def _to_target(self, req: ProposalRequest, st: _SeqDraft, tokens: list[int]) -> list[int]:
        """The target tokens of the drafted text, at most ``req.num_tokens``."""
        text = st.drafted
        bad = text.find(_REPLACEMENT)
        final = bool(tokens) and tokens[-1] in self.draft.eos_token_ids
        if bad >= 0:  # an unfinished (or invalid) character: only the text before it counts
            text, final = text[:bad], False
        if not text:
            return []
        out = target_continuation(self.draft.target_tokenizer, req.token_ids, text,
                                  final=final, special_ids=self.target_special)
        if tokens:
            seen = (len(out) + (0 if final else 1)) / len(tokens)
            self.ratio = min(4.0, max(0.25, 0.9 * self.ratio + 0.1 * seen))
        return out[: req.num_tokens]
