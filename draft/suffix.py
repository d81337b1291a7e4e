"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): draft what followed a match of the
sequence's suffix, in its own text and in earlier requests' outputs.

Two kinds of ``SuffixTrie`` (draft/suffix_trie.py, or its C++ twin draft/csrc/suffix_trie.cpp
when it builds: the same drafts at a fraction of the cost):
    * one per running sequence over its prompt + output, grown by the tokens that arrived since
      its last proposal (O(new tokens x max_depth) per step, never O(context));
    * a global one per tenant over the outputs of finished sequences, bounded by
      ``cache_tokens`` over all tenants together; the oldest outputs are evicted first.
``scope="request"`` keeps only the first kind (nothing outlives its request).

Tenants: a sequence's drafts come only from its own text and from its tenant's cache (the
engine passes the API key's tenant id), so one API key never gets speculation built from another
key's outputs (the output is the target's either way, but acceptance would leak through timing).

Per step, each trie scores a candidate per match length ``m`` (longest first, as the paper's
reference implementation does): the most frequent continuation, token by token, while the
estimated probability (the product of the chosen continuations' frequencies) stays >=
``min_prob``, and at most ``spec_factor * m`` tokens (a long match earns a long draft, up to the
request's k, so up to 16). A candidate's score is its expected number of accepted tokens (the
sum of those probabilities); the best over both tries wins. A shorter match wins when its
continuation is less ambiguous (a long match whose next token split 50/50 stops early, while a
shorter, more frequent pattern may still be sure).
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass
from typing import Any

from specserve.core.config import EngineConfig
from specserve.core.settings import setting
from specserve.draft import suffix_trie_ext
from specserve.draft.base import FinishedSequence, Proposal, ProposalRequest, StatelessProposer
from specserve.draft.suffix_trie import SuffixTrie

Trie = Any  # specserve.draft.suffix_trie.SuffixTrie or its C++ twin (the same methods)

_OWN = 0  # the document id of a sequence's own text in its trie


# The user-facing options are EngineConfig's settings: defaults and bounds come from its table.
_SETTINGS = {"max_depth": "suffix_max_depth", "cache_tokens": "suffix_cache_tokens",
             "scope": "suffix_cache_scope", "spec_factor": "suffix_spec_factor"}


def _default(name: str):
    return setting(EngineConfig, _SETTINGS[name]).default


@dataclass
class SuffixOptions:
    max_depth: int = _default("max_depth")  # longest substring counted (match + continuation)
    cache_tokens: int = _default("cache_tokens")  # global cache bound, output tokens, all tenants
    scope: str = _default("scope")  # request | global
    # Draft at most spec_factor * match length tokens. The paper's reference code uses 1; on
    # our agentic and templated workloads 4 gave the most tokens per verify at k 16 (3.67 and
    # 3.13 against 3.13 and 2.69 at 1: benchmarks/RESULTS.md, "tokens per target step by
    # setting"); the policy still cuts drafts whose rows do not pay.
    spec_factor: float = _default("spec_factor")
    min_prob: float = 0.1  # stop drafting where the estimated probability falls below
    impl: str = "auto"  # cpp | python | auto (C++ when it builds here: same drafts, faster)

    def __post_init__(self) -> None:
        for name, config_name in _SETTINGS.items():
            setting(EngineConfig, config_name).check(getattr(self, name))
        if self.impl not in ("cpp", "python", "auto"):
            raise ValueError(f"suffix trie impl must be cpp, python or auto (got {self.impl!r})")

    @classmethod
    def from_config(cls, config: EngineConfig) -> SuffixOptions:
        return cls(**{name: getattr(config, c) for name, c in _SETTINGS.items()})


@dataclass
class SuffixDraft:
    tokens: list[int]
    probs: list[float]
    match_length: int
    source: str  # "request" | "global" | "none"

    @property
    def score(self) -> float:
        """Expected accepted tokens, by the trie's own frequencies."""
        return sum(self.probs)


class _Tenant:
    def __init__(self, trie: Trie, version: int) -> None:
        self.trie = trie
        self.version = version  # a new proposer-wide number on every insert / eviction


class SuffixProposer(StatelessProposer):
    name = "suffix"
    uses_model = False

    def __init__(self, options: SuffixOptions | None = None) -> None:
        self.options = options or SuffixOptions()
        self.own: dict[int, Trie] = {}
        self.tenants: dict[str, _Tenant] = {}
        self._fifo: deque[tuple[str, int, int]] = deque()  # (tenant, doc, tokens), oldest first
        self._doc_ids = itertools.count(1)
        self._versions = itertools.count(1)
        self.cached_tokens = 0
        # seq id -> (tenant version, global match length) at its last proposal: a match can
        # grow by at most the new tokens while the tenant's trie is unchanged.
        self._last: dict[int, tuple[int, int]] = {}
        # C++ tries when they can be had: decided (and the module loaded) here, at engine
        # start, not inside the first request that drafts.
        impl = self.options.impl
        self._fast = impl == "cpp" or (impl == "auto" and suffix_trie_ext.available())

    # ---- drafting ---------------------------------------------------------------------------

    def propose(self, requests: list[ProposalRequest]) -> Proposal:
        drafts = [self.draft(r) for r in requests]
        return Proposal(
            draft_token_ids=[d.tokens for d in drafts],
            confidence=[d.probs for d in drafts],
            match_lengths=[d.match_length for d in drafts],
        )

    def draft(self, req: ProposalRequest) -> SuffixDraft:
        if req.num_tokens < 1:
            raise ValueError(f"num_tokens must be >= 1 (got {req.num_tokens} for seq {req.seq_id})")
        opts = self.options
        trie = self.own.get(req.seq_id)
        if trie is None:
            trie = self.own[req.seq_id] = self._new_trie()
            trie.extend(_OWN, [])
        seen = trie.doc_length(_OWN)
        new = len(req.token_ids) - seen
        if new:
            trie.extend(_OWN, list(req.token_ids[seen:]))
        tokens, probs, length = trie.speculate_own(_OWN, req.num_tokens, opts.spec_factor,
                                                   opts.min_prob)
        best = SuffixDraft(tokens, probs, length, "request" if tokens else "none")
        tenant = self.tenants.get(req.tenant) if opts.scope == "global" else None
        if tenant is not None:
            cand = self._global_draft(req, tenant, new)
            if cand.score > best.score:
                best = cand
        return best

    def _global_draft(self, req: ProposalRequest, tenant: _Tenant, new: int) -> SuffixDraft:
        trie, top = tenant.trie, self.options.max_depth - 1
        longest = top
        last = self._last.get(req.seq_id)
        if last is not None and last[0] == tenant.version:
            longest = min(top, last[1] + new)  # same trie: the match grows by <= new tokens
        context = list(req.token_ids[-top:])
        tokens, probs, length, longest_hit = trie.speculate(
            context, longest, req.num_tokens, self.options.spec_factor, self.options.min_prob)
        self._last[req.seq_id] = (tenant.version, longest_hit)
        return SuffixDraft(tokens, probs, length, "global" if tokens else "none")

    def _new_trie(self) -> Trie:
        if self._fast:
            return suffix_trie_ext.load().SuffixTrie(self.options.max_depth)
        return SuffixTrie(self.options.max_depth)

    # ---- learning and forgetting ----------------------------------------------------------

    def finish(self, done: FinishedSequence) -> None:
        self.own.pop(done.seq_id, None)
        self._last.pop(done.seq_id, None)
        output = list(done.token_ids[done.num_prompt_tokens :])
        # Learn only from requests that asked for suffix decoding (directly or through auto):
        # a server that never uses it keeps no cache, and A/B runs of other methods do not
        # feed it.
        if self.options.scope == "global" and output and done.method in ("suffix", "auto"):
            self.insert(done.tenant, output)

    def insert(self, tenant_id: str, tokens: list[int]) -> None:
        """Adds one finished output to ``tenant_id``'s cache, evicting the oldest outputs (of
        any tenant) past the token bound. An output larger than the whole bound is skipped."""
        bound = self.options.cache_tokens
        if len(tokens) > bound:
            return
        tenant = self.tenants.get(tenant_id)
        if tenant is None:
            tenant = self.tenants[tenant_id] = _Tenant(self._new_trie(), 0)
        doc = next(self._doc_ids)
        tenant.trie.extend(doc, tokens)
        tenant.trie.close(doc)
        tenant.version = next(self._versions)
        self._fifo.append((tenant_id, doc, len(tokens)))
        self.cached_tokens += len(tokens)
        while self.cached_tokens > bound:
            old_tenant, old_doc, n = self._fifo.popleft()
            holder = self.tenants[old_tenant]
            holder.trie.remove(old_doc)
            holder.version = next(self._versions)
            self.cached_tokens -= n
            if not holder.trie.num_docs:
                del self.tenants[old_tenant]

    def clear(self, tenant: str | None = None) -> None:
        """Empties the global cache: one tenant's part, or all of it (None)."""
        drop = set(self.tenants) if tenant is None else {tenant}
        for t in drop & set(self.tenants):
            del self.tenants[t]
        kept = [e for e in self._fifo if e[0] not in drop]
        self._fifo = deque(kept)
        self.cached_tokens = sum(e[2] for e in kept)

    def __repr__(self) -> str:
        return f"SuffixProposer({self.options})"
