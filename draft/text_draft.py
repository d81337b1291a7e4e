"""TextDraftProposer: a small LM with ANOTHER tokenizer drafts; the target verifies. Two lossless
methods for heterogeneous vocabularies (Timor et al., ICML 2025), chosen per request by
``cross_tokenizer_method``:

String-level exact match (SLEM). The draft drafts greedily on its own tokenization of the
sequence's text, and its text is turned into target tokens (text_align.py). The proposal carries
no draft distribution for these rows (one-hot q), so draft token d is accepted with probability
p(d) and on rejection the token is drawn from p with d removed, renormalized. Every emitted token
then follows p exactly, whatever d was, as long as d is fixed before the target's draw (P(d) =
p(d); P(y != d) = (1 - p(d)) p(y) / (1 - p(d)) = p(y)); greedy requests accept d iff it is the
target's argmax. Drafting greedily maximizes p(d) for a draft that agrees with the target.

Token-level intersection (TLI). The intersection I holds the tokens both vocabularies have as
the same byte string (``VocabIntersection``, built at load). The draft's logits restricted to I
are read as logits over the target's vocabulary (-inf outside I), q = the engine's processing
of them (the request's temperature / top-k / top-p, ``DraftSampler``), and the draft token is
drawn from q: it IS a target token (no re-tokenization), and the next draft step feeds its draft
id. The proposal's q rows go to the rejection sampler (accept min(1, p/q), residual max(0, p -
q) renormalized), which keeps p exactly for any q, whatever I is; greedy rows take the argmax
over I, accepted iff it is the target's argmax.

Which one runs: ``slem`` and ``tli`` force it, except that a TLI request whose target has
emitted only part of a character drafts that step by SLEM (a TLI draft continues the draft's
text, which then ends before the target's last token; SLEM's continuation completes the
character). ``auto`` runs SLEM for greedy and sampled requests alike (``AUTO_GREEDY``,
``AUTO_SAMPLED``): it accepted as much or more. Tokens per verify, Qwen2.5-Coder-0.5B Q4_K_M
with SmolLM2-135M drafting, k = 4, 8 code and 8 chat prompts, 64 tokens (benchmarks/text_draft.py,
benchmarks/RESULTS.md): greedy SLEM 2.59, TLI 2.38; temperature 0.7 SLEM 2.48, TLI 2.27;
temperature 1.0 both 2.14 (sampled, TLI is ahead on chat, 2.36 against 2.28 and 1.98 against
1.78, and behind on code, 2.18 against 2.62 and 2.27 against 2.58). SLEM proposes the target's
own tokenization of the draft's argmax text, accepted with p(d), high where the two models
agree; TLI's acceptance is sum min(p, q), q the small draft's distribution over I, and its
tokens may split a word where the target would not. A batch may mix both methods: the
proposal's ``draft_probs`` then has a row per drafted token, one-hot for SLEM's.

The draft's KV is its own: its own ``ModelRunner`` (pool sized beside the target's, see
``TextDraftSource``) and a block allocation per sequence, freed in ``finish``. Its tokens follow
the accepted text (under either method: a TLI draft's text is its tokens' text): after a verify,
the drafted tokens whose text the target accepted are kept (their KV is valid), the last kept
token is re-tokenized together with the new text (so a word cut at the boundary merges again),
and KV past the kept tokens is recomputed. The work per step is the new text plus a few tokens,
whatever the context length. A sequence whose draft cannot get blocks, or would pass the draft's
context window, simply drafts nothing.

Counting in target tokens for the engine: ``kv_computed`` (Proposal and ``prefill``) says how
many target tokens' text the draft has read, so the planner's catch-up (a long pause at k = 0)
feeds the draft in bounded chunks; the draft's own KV bookkeeping stays here.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specserve.draft.base import (
    DraftSampling,
    FinishedSequence,
    PrefillChunk,
    Proposal,
    ProposalRequest,
)
from specserve.draft.draft_sampler import GREEDY, DraftSampler
from specserve.draft.text_align import (
    TargetText,
    common_prefix,
    decode,
    encode,
    target_continuation,
)
from specserve.draft.vocab_intersection import VocabIntersection
from specserve.target.layout import Chunk, build_layout
from specserve.target.model_runner import ModelRunner

_REPLACEMENT = "\ufffd"
# Text kept per sequence: from this many tokens back (a re-tokenization starts at most a
# character's bytes before the last context token).
_KEEP_TOKENS = 8
AUTO, SLEM, TLI = "auto", "slem", "tli"
# What ``auto`` runs for greedy and for sampled requests: the method that accepted more in each
# (measured, see the module's docstring).
AUTO_GREEDY, AUTO_SAMPLED = SLEM, SLEM


@dataclass
class TextDraft:
    """What the proposer runs on: the draft's runner (its own KV pool) and both tokenizers."""

    runner: ModelRunner
    tokenizer: Any  # the draft's
    target_tokenizer: Any
    eos_token_ids: frozenset[int]  # the draft's
    draft_vocab_size: int  # the draft's logits width
    target_vocab_size: int  # the target's logits width: q rows are over it

    @functools.cached_property
    def shared(self) -> VocabIntersection:
        """The tokens both vocabularies share (TLI drafts only these): found on first use,
        since only TLI reads them (1.6 s for SmolLM2 against Qwen's 152k tokens)."""
        return VocabIntersection.of(self.tokenizer, self.target_tokenizer,
                                    self.draft_vocab_size, self.target_vocab_size)

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


@dataclass
class _Job:
    """One sequence's drafting this step: at most ``steps`` draft forwards, ``tokens`` the
    draft's ids. Under TLI ``targets`` are the same tokens as target ids and ``q`` their rows
    of the draft distribution (sampled requests only)."""

    index: int  # of the request
    seq_id: int
    st: _SeqDraft
    steps: int
    tli: bool
    sampling: DraftSampling
    tokens: list[int] = field(default_factory=list)
    targets: list[int] = field(default_factory=list)
    q: list[torch.Tensor] = field(default_factory=list)  # [V_target] each


class TextDraftProposer:
    name = "text_draft"
    uses_model = True

    def __init__(
        self, draft: TextDraft, block_size: int, method: str = AUTO,
        probs_fn: Callable[[torch.Tensor, list[Any]], torch.Tensor] | None = None, seed: int = 0,
    ) -> None:
        """``method``: auto | slem | tli (``cross_tokenizer_method``); ``probs_fn``: the
        engine's logits processing, for TLI's q of sampled requests."""
        if method not in (AUTO, SLEM, TLI):
            raise ValueError(f"cross_tokenizer_method must be auto, slem or tli (got {method!r})")
        self.draft = draft
        self.method = method
        self.runner = draft.runner
        self.block_size = block_size
        self.device = draft.runner.device
        self.max_positions = draft.runner.model_config.max_position_embeddings
        self.free_blocks = list(range(draft.runner.num_blocks - 1, -1, -1))
        self.seqs: dict[int, _SeqDraft] = {}
        self.target_special = draft.target_special_ids
        self.probs_fn = probs_fn
        self.seed = seed
        # target tokens per draft token, measured: how many draft steps k target tokens need
        self.ratio = 1.0

    # ---- what TLI drafts with: built when a request first drafts by TLI ---------------------

    @functools.cached_property
    def shared(self) -> VocabIntersection:
        return self.draft.shared

    @functools.cached_property
    def shared_draft_ids(self) -> torch.Tensor:
        return self.shared.draft_ids.to(self.device)

    @functools.cached_property
    def sampler(self) -> DraftSampler:
        return DraftSampler(self.shared.target_ids, self.draft.target_vocab_size,
                            self.probs_fn, self.seed)

    # ---- the protocol -----------------------------------------------------------------------

    def finish(self, done: FinishedSequence) -> None:
        if "sampler" in self.__dict__:  # a seeded TLI request's generator
            self.sampler.forget(done.seq_id)
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
        jobs: list[_Job] = []
        for i, r in enumerate(requests):
            st = self.seqs.setdefault(r.seq_id, _SeqDraft())
            self._sync(st, r.token_ids, len(r.token_ids))
            if r.num_tokens <= 0 or st.num_context == 0:
                continue
            sampling = r.sampling or GREEDY
            tli = self._runs_tli(sampling, st, len(r.token_ids))
            # TLI: one target token per draft step; SLEM: as many steps as the measured
            # target tokens per draft token say k needs
            steps = r.num_tokens if tli else max(
                2, min(2 * r.num_tokens + 1, math.ceil(r.num_tokens / self.ratio) + 1))
            if st.num_context + steps > self.max_positions:
                continue
            if not self._reserve(st, st.num_context + steps - 1):
                continue
            jobs.append(_Job(i, r.seq_id, st, steps, tli, sampling))
        self._run_draft(jobs)
        for job in jobs:
            drafts[job.index] = (job.targets[: requests[job.index].num_tokens] if job.tli else
                                 self._to_target(requests[job.index], job.st, job.tokens))
        total = time.perf_counter() - t0
        k = max((r.num_tokens for r in requests), default=0)
        # Priced like a draft model's k sequential steps: what drafting k target tokens cost.
        step_seconds = [total / k] * k if jobs and k else []
        return Proposal(draft_token_ids=drafts, draft_probs=self._draft_probs(jobs, drafts),
                        kv_computed=[n + len(d) for n, d in zip(kv, drafts)],
                        step_seconds=step_seconds)

    def method_for(self, sampling: DraftSampling) -> str:
        """The method a request of this kind runs (``auto`` resolved)."""
        if self.method != AUTO:
            return self.method
        return AUTO_GREEDY if sampling.greedy else AUTO_SAMPLED

    def _runs_tli(self, sampling: DraftSampling, st: _SeqDraft, num_tokens: int) -> bool:
        """Whether this request drafts by TLI this step, else by SLEM."""
        # A TLI draft continues the draft's text, which must then end at the target's last
        # token: not so while the target has emitted only part of a character (SLEM's target
        # continuation completes it).
        return (self.method_for(sampling) == TLI and len(self.shared) > 0
                and st.target.read == num_tokens)

    def _draft_probs(self, jobs: list[_Job], drafts: list[list[int]]) -> torch.Tensor | None:
        """q [sum(len(d) for d in drafts), V_target] when a sampled request drafted by TLI
        (None: every draft's q is one-hot, or its request greedy): TLI rows of sampled requests
        are their q, the others one-hot on the draft (SLEM's q)."""
        if not any(j.q and drafts[j.index] for j in jobs):
            return None
        rows = {j.index: j for j in jobs}
        probs = torch.zeros(sum(len(d) for d in drafts), self.draft.target_vocab_size)
        at = 0
        for i, d in enumerate(drafts):
            job = rows.get(i)
            if job is not None and job.tli and job.q:
                probs[at : at + len(d)] = torch.stack(job.q[: len(d)])
            elif d:
                probs[torch.arange(at, at + len(d)), torch.tensor(d)] = 1.0
            at += len(d)
        return probs

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

    def _run_draft(self, jobs: list[_Job]) -> list[list[int]]:
        """Draft tokens per job (the draft's ids, also in ``job.tokens``), batched: step 0
        feeds every context token without KV (at least the last), step j the draft of step
        j - 1; a job stops at its step count or the draft's EOS. SLEM jobs take the argmax,
        TLI jobs draw from q over the shared tokens. Afterwards each state holds its drafts
        and their text."""
        active = list(range(len(jobs)))
        step = 0
        eos = self.draft.eos_token_ids
        while active:
            chunks = []
            for j in active:
                st = jobs[j].st
                if step == 0:
                    start = min(st.kv, st.num_context - 1)
                    chunks.append(Chunk(st.ids[start : st.num_context], start, st.blocks, 1))
                else:
                    chunks.append(Chunk([jobs[j].tokens[-1]], st.num_context + step - 1,
                                        st.blocks, 1))
            logits = self.runner.run(build_layout(chunks, self.block_size, self.device))  # [A, Vd]
            slem = [n for n, j in enumerate(active) if not jobs[j].tli]
            tli = [n for n, j in enumerate(active) if jobs[j].tli]
            if slem:
                best = logits[slem].argmax(dim=-1).tolist()
                for n, t in zip(slem, best):
                    jobs[active[n]].tokens.append(t)
            if tli:
                self._draw_shared(logits[tli], [jobs[active[n]] for n in tli])
            step += 1
            active = [j for j in active
                      if len(jobs[j].tokens) < jobs[j].steps and jobs[j].tokens[-1] not in eos]
        for job in jobs:
            job.st.kv = job.st.num_context + len(job.tokens) - 1
            self._record_drafts(job.st, job.tokens)
        return [job.tokens for job in jobs]

    def _draw_shared(self, logits: torch.Tensor, jobs: list[_Job]) -> None:
        """TLI: draft logits [A, Vd] restricted to the shared tokens, seen as logits over the
        target's vocabulary; each job's token is drawn from q (greedy: the argmax over them)."""
        shared = logits[:, self.shared_draft_ids]  # [A, N]
        if all(j.sampling.greedy for j in jobs):
            targets, q = self.sampler.greedy(shared), None
        else:
            targets, q = self.sampler.sample(shared, [j.sampling for j in jobs],
                                             [j.seq_id for j in jobs])  # q [A, V_target]
        ids = self.shared.to_draft[torch.tensor(targets)].tolist()
        for n, job in enumerate(jobs):
            job.targets.append(targets[n])
            job.tokens.append(ids[n])
            if q is not None and not job.sampling.greedy:
                job.q.append(q[n])

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
