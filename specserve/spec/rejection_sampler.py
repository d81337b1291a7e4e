"""The speculative-decoding rejection sampler: which draft tokens the target keeps, vectorized
over the batch.

Terminology (one decode row b with k_b draft tokens d_0 .. d_{k_b - 1}):

- **accepted tokens**: the longest prefix of the drafts that passes the test below. Greedy rows
  accept d_j while d_j == argmax of the target at position j. Sampled rows accept d_j with
  probability min(1, p_j(d_j) / q_j(d_j)) (speculative sampling: Leviathan et al. 2023,
  Chen et al. 2023), where p_j is the target's distribution and q_j the draft's, both after the
  same temperature / top-k / top-p processing.
- **recovered token**: at the first rejected position j, a replacement drawn from
  norm(max(0, p_j - q_j)) (greedy: the argmax). Together with the accepted prefix, this makes
  every emitted token follow p exactly.
- **bonus token**: when all k_b drafts pass, the target has already scored position k_b, so one
  more token comes for free, drawn from p_{k_b} (greedy: the argmax).

Each row emits ``num_accepted + 1`` tokens (1 .. k_b + 1): the accepted drafts, then one
recovered-or-bonus token. A row with k_b = 0 is plain decoding and emits exactly one token, the
same one ``specserve.core.sampling.sample`` would (bit for bit, with the same generator state).

Index maths, a worked example. Three rows: A drafts [a0, a1] (k=2), B none (k=0), C drafts
[c0, c1, c2] (k=3). The verify pass feeds each row [last token, drafts...], so:

    target_logits rows:  0   1   2  | 3  | 4   5   6   7        [sum(k_b + 1), V] = [8, V]
    belongs to:          A0  A1  A2 | B0 | C0  C1  C2  C3
    scores the token:    a0  a1  bon| tok| c0  c1  c2  bon      (position j tests draft j)
    draft_probs rows:    0   1      |    | 2   3   4            [sum(k_b), V] = [5, V]
    pos_start = [0, 3, 4]   draft_start = [0, 2, 2]

Internally everything is padded to [B, K + 1] with K = max k_b = 3; padding repeats the row's last
position so every gather stays inside the row:

    pos_idx = [[0, 1, 2, 2], [3, 3, 3, 3], [4, 5, 6, 7]]    draft_valid = j < k_b

Say A accepts a0 and rejects a1, B just samples, C accepts everything. Then
num_accepted = [1, 0, 3] and token_ids = [[a0, r], [t], [c0, c1, c2, bonus]], where r is drawn
from norm(max(0, p[1] - q[1])), t from p[3] and bonus from p[7]. The engine keeps the KV of the
verify inputs up to and including the last accepted draft; the emitted last token (r, t, bonus)
has no KV yet and is fed at the next step.

Randomness: rows without a generator share ``default_generator``: one ``torch.rand`` for all
their drafts, then one batched ``specserve.core.sampling.draw``. A row with a generator (a seeded
request) is verified by sampling instead: position j draws t_j from p_j with one ``draw`` on the
row's generator, the call ``specserve.core.sampling.sample`` makes for that output index, and the
draft d_j is accepted iff t_j == d_j; the row stops at the first mismatch and emits t_j there
(or the bonus t_k). So a seeded request emits exactly the tokens plain decoding
with that seed emits, whatever the drafts, their lengths or the batch (each emitted token costs
one draw, as in plain decoding). Each emitted token still follows p. A deterministic draft
(n-gram, suffix) is accepted with probability p(d_j), as under the test above; a sampled
draft with sum_x q(x) p(x) instead of sum_x min(p(x), q(x)), a little less often: the price
of reproducible seeded output.

Logit bias and penalties (``specserve.core.logits_processors.adjust_logits``) apply after the
min_tokens mask at every position, position j counting the row's drafts d_0 .. d_{j-1} as
generated tokens: exactly what plain decoding would count there had it produced those drafts. The
greedy test and p use the adjusted logits; the draft's q may ignore them (any q stays exact).

min_tokens: position j of a row is output index num_output_tokens + j; while that index is below
``params.min_tokens`` the banned ids (EOS, stop ids) are masked at that position, for greedy and
sampled rows alike, exactly as the plain sampler masks its one position. Logprobs are computed as
the plain sampler computes them (log_softmax of the target logits at the emitted token's position,
after that masking and before temperature/top-k/top-p), so speculative and plain decoding report
identical numbers.

Grammar masks: a row may carry ``grammar_mask`` [k_b + 1, W], one token bitmask per position
(position j: what the grammar allows after drafts 0..j-1, see specserve/spec/grammar.py). The
forbidden tokens' logits become -inf before anything else reads them, so the greedy argmax, the
accept test, the residual, the bonus draw and the logprobs all see the masked distribution,
exactly as plain constrained decoding does at each of those positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.core.logits_processors import adjust_logits
from specserve.core.sampling import (
    SampleRequest,
    TokenLogprob,
    apply_token_bitmask,
    compute_logprobs,
    draw,
    process_logits,
)


@dataclass
class SpecDecodeRow:
    """One decode sequence in a verify step."""

    request: SampleRequest  # num_output_tokens counts the tokens emitted before this step
    draft_token_ids: list[int]  # k >= 0 drafts; k = 0 is plain decoding (one token comes out)
    grammar_mask: torch.Tensor | None = None  # [k + 1, W] int32 token bitmask per position


@dataclass
class SpecDecodeResult:
    """Per row: ``len(token_ids[b]) == num_accepted[b] + 1``, and ``token_ids[b][:-1]`` are the
    row's first ``num_accepted[b]`` drafts."""

    token_ids: list[list[int]]  # accepted drafts + one recovered-or-bonus token (1..k+1 tokens)
    num_accepted: list[int]  # drafts accepted (0..k)
    logprobs: list[list[TokenLogprob | None]]  # per emitted token; None if the request wants none


def rejection_sample(
    target_logits: torch.Tensor,  # [sum(k_b + 1), V] raw target logits, row by row, pos 0..k_b
    rows: list[SpecDecodeRow],
    draft_probs: torch.Tensor | None,  # [sum(k_b), V] processed draft probs q; None = one-hot
    default_generator: torch.Generator | None = None,
) -> SpecDecodeResult:
    """Verifies every row's drafts against the target and returns the emitted tokens.

    ``draft_probs`` must be the draft's probabilities after the same temperature / top-k / top-p
    processing as the target's (rows of greedy requests are ignored). ``None`` means the drafts
    are deterministic (n-gram, ...): q is one-hot on the draft token, so a draft is accepted with
    probability p(x) and a rejection resamples from p with x removed.
    """
    ks = [len(r.draft_token_ids) for r in rows]
    num_rows, num_drafts = len(rows), sum(ks)
    num_pos = num_drafts + num_rows
    if target_logits.dim() != 2 or target_logits.shape[0] != num_pos:
        raise ValueError(
            f"target_logits must be [sum(k + 1), V] = [{num_pos}, V], "
            f"got {tuple(target_logits.shape)}"
        )
    vocab = target_logits.shape[1]
    if draft_probs is not None and tuple(draft_probs.shape) != (num_drafts, vocab):
        raise ValueError(
            f"draft_probs must be [sum(k), V] = [{num_drafts}, {vocab}], "
            f"got {tuple(draft_probs.shape)}"
        )
    if num_rows == 0:
        return SpecDecodeResult([], [], [])
    if any(r.grammar_mask is not None for r in rows):
        target_logits = _mask_grammar(target_logits.float().clone(), rows, ks)
    if all(_plain_greedy(r) for r in rows):
        return _greedy_fast(target_logits, rows)
    device = target_logits.device
    max_k = max(ks)

    # Index maps (see the module docstring's worked example).
    k_t = torch.tensor(ks, device=device)  # [B]
    pos_start = torch.cumsum(k_t + 1, 0) - (k_t + 1)  # [B]
    draft_start = torch.cumsum(k_t, 0) - k_t  # [B]
    j = torch.arange(max_k + 1, device=device)  # [K+1]
    pos_idx = torch.minimum(pos_start[:, None] + j, (pos_start + k_t)[:, None])  # [B, K+1]
    draft_valid = j[None, :max_k] < k_t[:, None]  # [B, K]
    draft_idx = torch.where(draft_valid, draft_start[:, None] + j[:max_k], 0)  # [B, K]
    drafts = torch.zeros(num_rows, max_k, dtype=torch.long, device=device)  # [B, K], 0 = padding
    if num_drafts:
        flat = [t for r in rows for t in r.draft_token_ids]
        drafts[draft_valid] = torch.tensor(flat, dtype=torch.long, device=device)

    logits = _mask_min_tokens(target_logits.float().clone(), rows, ks)  # [T, V]
    scored = adjust_logits(logits, [r.request for r in rows],
                           [r.draft_token_ids for r in rows])  # [T, V] bias and penalties
    num_accepted = torch.zeros(num_rows, dtype=torch.long, device=device)  # [B]
    last_token = torch.zeros(num_rows, dtype=torch.long, device=device)  # [B]

    greedy = [b for b, r in enumerate(rows) if r.request.params.greedy]
    if greedy:
        g = torch.tensor(greedy, device=device)
        target = scored.argmax(dim=-1)[pos_idx[g]]  # [G, K+1] target argmax per position
        match = (drafts[g] == target[:, :max_k]) & draft_valid[g]  # [G, K]
        acc = match.long().cumprod(dim=1).sum(dim=1)  # [G]
        num_accepted[g] = acc
        last_token[g] = target.gather(1, acc[:, None])[:, 0]

    sampled = [b for b, r in enumerate(rows) if not r.request.params.greedy]
    if sampled:
        acc, tok = _sample_rows(
            scored, rows, sampled, ks, pos_idx, draft_idx, draft_valid, drafts, draft_probs,
            default_generator,
        )
        s = torch.tensor(sampled, device=device)
        num_accepted[s] = acc
        last_token[s] = tok

    acc_list, last_list = num_accepted.tolist(), last_token.tolist()
    token_ids = [r.draft_token_ids[:a] + [t] for r, a, t in zip(rows, acc_list, last_list)]
    return SpecDecodeResult(token_ids, acc_list, _logprobs(logits, rows, token_ids, pos_start))


def _plain_greedy(row: SpecDecodeRow) -> bool:
    """Greedy, no logprobs, no min_tokens ban in reach, no bias or penalty: the target's argmax
    alone decides."""
    req = row.request
    params = req.params
    return (
        params.greedy
        and params.logprobs is None
        and req.logits_state is None
        and (not req.banned_until_min_tokens or params.min_tokens <= req.num_output_tokens)
    )


def _greedy_fast(target_logits: torch.Tensor, rows: list[SpecDecodeRow]) -> SpecDecodeResult:
    """The common all-greedy step in one argmax and one host copy: the general path's index
    maps and masks cost ~0.6 ms at batch 1, a twentieth of a decode step. Same tokens: the
    argmax of the same float32 logits, and drafts accepted while they equal it."""
    argmax = target_logits.float().argmax(dim=-1).tolist()  # [sum(k + 1)]
    token_ids: list[list[int]] = []
    num_accepted: list[int] = []
    start = 0
    for r in rows:
        drafts = r.draft_token_ids
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == argmax[start + accepted]:
            accepted += 1
        token_ids.append(drafts[:accepted] + [argmax[start + accepted]])
        num_accepted.append(accepted)
        start += len(drafts) + 1
    return SpecDecodeResult(token_ids, num_accepted, [[None] * len(t) for t in token_ids])


def _mask_min_tokens(
    logits: torch.Tensor, rows: list[SpecDecodeRow], ks: list[int]
) -> torch.Tensor:
    """Bans EOS/stop ids at positions whose output index is still below min_tokens (the
    per-position form of ``specserve.core.sampling.apply_min_tokens``)."""
    start = 0
    for r, k in zip(rows, ks):
        req = r.request
        n = min(k + 1, req.params.min_tokens - req.num_output_tokens)
        if n > 0 and req.banned_until_min_tokens:
            logits[start : start + n, req.banned_until_min_tokens] = float("-inf")
        start += k + 1
    return logits


def _mask_grammar(
    logits: torch.Tensor, rows: list[SpecDecodeRow], ks: list[int]
) -> torch.Tensor:
    """Masks each constrained row's positions with its grammar's bitmasks (one tensor op for
    the whole batch; unconstrained positions get an all-allowed row)."""
    width = next(r.grammar_mask for r in rows if r.grammar_mask is not None).shape[1]
    full = torch.full((logits.shape[0], width), -1, dtype=torch.int32)  # [T, W]
    start = 0
    for r, k in zip(rows, ks):
        if r.grammar_mask is not None:
            assert r.grammar_mask.shape[0] == k + 1, "one grammar mask row per position"
            full[start : start + k + 1] = r.grammar_mask
        start += k + 1
    return apply_token_bitmask(logits, full)


def _sample_rows(
    logits: torch.Tensor,  # [T, V] min_tokens-masked, biased and penalized target logits
    rows: list[SpecDecodeRow],
    sampled: list[int],  # the S non-greedy rows
    ks: list[int],
    pos_idx: torch.Tensor,  # [B, K+1]
    draft_idx: torch.Tensor,  # [B, K]
    draft_valid: torch.Tensor,  # [B, K]
    drafts: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor | None,  # [sum k, V]
    default_generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:  # num_accepted [S], recovered-or-bonus token [S]
    device = logits.device
    max_k = draft_valid.shape[1]
    s = torch.tensor(sampled, device=device)

    # p for every position of every sampled row, in one processing + softmax call.
    k_s = torch.tensor([ks[b] for b in sampled], device=device)  # [S]
    pos_valid = torch.arange(max_k + 1, device=device) <= k_s[:, None]  # [S, K+1]
    sel = pos_idx[s][pos_valid]  # [Ts] positions of sampled rows, row by row
    params = [rows[b].request.params for b in sampled]

    def per_position(values: list, dtype: torch.dtype) -> torch.Tensor:  # [S] -> [Ts]
        t = torch.tensor(values, dtype=dtype, device=device)
        return t[:, None].expand(-1, max_k + 1)[pos_valid]

    probs = process_logits(
        logits[sel],
        per_position([p.temperature for p in params], torch.float32),
        per_position([p.top_k for p in params], torch.int64),
        per_position([p.top_p for p in params], torch.float32),
    ).softmax(dim=-1)  # [Ts, V]
    slot = torch.full((logits.shape[0],), -1, dtype=torch.long, device=device)
    slot[sel] = torch.arange(sel.numel(), device=device)  # position -> row of probs
    p_slot = slot[pos_idx[s]]  # [S, K+1]
    num_accepted = torch.zeros(len(sampled), dtype=torch.long, device=device)
    dist = probs[p_slot[:, 0]]  # [S, V] final distribution; k = 0 rows: p_0
    if max_k:
        valid, dr, d_idx = draft_valid[s], drafts[s], draft_idx[s]  # [S, K]
        p_x = probs[p_slot[:, :max_k], dr]  # [S, K] p_j(d_j)
        if draft_probs is not None:
            q = draft_probs.to(device=device, dtype=torch.float32)  # [sum k, V]
            q_x = q[d_idx, dr]  # [S, K] q_j(d_j)
        else:
            q_x = torch.ones_like(p_x)
        u = _uniforms(rows, sampled, ks, valid, default_generator)  # [S, K]
        # Accept d_j iff u < min(1, p/q), written without the division (q may be 0).
        accept = (u * q_x < p_x) & valid
        num_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # [S]
        dist = probs[p_slot.gather(1, num_accepted[:, None])[:, 0]]  # [S, V] p at stop position
        rejected = num_accepted < k_s  # [S]
        if bool(rejected.any()):
            at = num_accepted.clamp(max=max_k - 1)[:, None]  # [S, 1] the rejected draft's index
            if draft_probs is not None:
                residual = (dist - q[d_idx.gather(1, at)[:, 0]]).clamp(min=0)  # [S, V]
            else:  # q one-hot on x: max(0, p - q) is p with x removed
                residual = dist.scatter(1, dr.gather(1, at), 0.0)
            # An all-zero residual (p == q up to rounding) falls back to p.
            use = rejected & (residual.sum(dim=-1) > 0)
            dist = torch.where(use[:, None], residual, dist)
    tokens = _draw(dist, rows, sampled, default_generator)
    for i, b in enumerate(sampled):  # seeded rows: sample each position, keep matching drafts
        gen = rows[b].request.generator
        if gen is None:
            continue
        acc = 0
        while True:
            slot = int(p_slot[i, acc])
            t = int(draw(probs[slot: slot + 1], gen)[0])
            if acc == ks[b] or t != int(drafts[b, acc]):
                break
            acc += 1
        num_accepted[i], tokens[i] = acc, t
    return num_accepted, tokens


def _uniforms(
    rows: list[SpecDecodeRow],
    sampled: list[int],
    ks: list[int],
    valid: torch.Tensor,  # [S, K]
    default_generator: torch.Generator | None,
) -> torch.Tensor:  # [S, K] U[0, 1), 0 in the padding
    """One uniform per draft of the rows without a generator, from default_generator (one call
    for all of them); seeded rows are verified by sampling (see the module docstring)."""
    device = valid.device
    u = torch.zeros(valid.shape, device=device)
    shared = [i for i, b in enumerate(sampled) if rows[b].request.generator is None]
    if shared:
        idx = torch.tensor(shared, device=device)
        block = torch.zeros(len(shared), valid.shape[1], device=device)  # [S_shared, K]
        n = int(valid[idx].sum())
        block[valid[idx]] = _rand(n, default_generator, device)
        u[idx] = block
    return u


def _rand(n: int, gen: torch.Generator | None, device: torch.device) -> torch.Tensor:
    where = gen.device if gen is not None else device
    return torch.rand(n, generator=gen, device=where).to(device)


def _draw(
    dist: torch.Tensor,  # [S, V] unnormalized, non-negative
    rows: list[SpecDecodeRow],
    sampled: list[int],
    default_generator: torch.Generator | None,
) -> torch.Tensor:  # [S]
    """One categorical draw per row without a generator, the call ``specserve.core.sampling.sample``
    makes (seeded rows draw in ``_sample_rows``). Draws happen on the generator's device."""
    out = torch.zeros(len(sampled), dtype=torch.long, device=dist.device)
    shared = [i for i, b in enumerate(sampled) if rows[b].request.generator is None]
    if shared:
        out[shared] = draw(dist[shared], default_generator).to(dist.device)
    return out


def _logprobs(
    logits: torch.Tensor,  # [T, V] min_tokens-masked target logits
    rows: list[SpecDecodeRow],
    token_ids: list[list[int]],
    pos_start: torch.Tensor,  # [B]
) -> list[list[TokenLogprob | None]]:
    """Logprobs of each emitted token at its own position, via the plain sampler's code."""
    out: list[list[TokenLogprob | None]] = [[None] * len(t) for t in token_ids]
    wanted = [b for b, r in enumerate(rows) if r.request.params.logprobs is not None]
    if not wanted:
        return out
    starts = pos_start.tolist()
    positions: list[int] = []
    tokens: list[int] = []
    reqs: list[SampleRequest] = []
    for b in wanted:
        n = len(token_ids[b])
        positions.extend(range(starts[b], starts[b] + n))
        tokens.extend(token_ids[b])
        reqs.extend([rows[b].request] * n)
    flat = compute_logprobs(logits[torch.tensor(positions, device=logits.device)], tokens, reqs)
    i = 0
    for b in wanted:
        n = len(token_ids[b])
        out[b] = flat[i : i + n]
        i += n
    return out
