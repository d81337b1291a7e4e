"""Paged attention in plain PyTorch: the ground truth every other backend is tested against.

Works on any device. Sequences with few new tokens (decode, speculative verify) are attended in
one padded batch; long prefill chunks run one SDPA call each, so a 500-token prefill never pads
thirty 1-token decodes up to 500 queries. Index maps and masks depend only on the step, not the
layer, so they are built once per step (``_Plan``) and reused by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.kernels.metadata import AttentionMetadata

# Sequences with at most this many new tokens are attended together in one padded call.
_BATCHED_MAX_QUERY = 16


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    has_padding: bool = True,
) -> None:
    """Scatters the new k/v [T, KVH, D] into the caches [N, block_size, KVH, D] at their slots;
    slot -1 marks a padding token that must not be written (``has_padding`` says whether to
    look for it, so the common case costs no device sync)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    if has_padding:
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def _visible(
    q_pos: torch.Tensor, k_pos: torch.Tensor, ctx_len: torch.Tensor, sliding_window: int | None
) -> torch.Tensor:
    """Boolean mask: query at absolute position q_pos may see key at k_pos (causal, inside the
    sequence, and within the sliding window when there is one)."""
    mask = (k_pos <= q_pos) & (k_pos < ctx_len)
    if sliding_window is not None:
        mask &= q_pos - k_pos < sliding_window
    return mask


@dataclass
class _LongSeq:
    """One prefill chunk attended on its own."""

    tokens: slice  # its rows in the flat batch
    blocks: torch.Tensor  # [nb] block ids covering its context
    ctx: int
    mask: torch.Tensor | None  # [n, ctx]; None = plain causal over the whole (all-new) context


@dataclass
class _Batched:
    """Short query runs (decode / verify) attended together, padded to [R, max_q]."""

    blocks: torch.Tensor  # [R, nb]
    tok: torch.Tensor  # [S] flat-batch rows of the short sequences' tokens
    row_of: torch.Tensor  # [S] which padded row each token goes to
    off: torch.Tensor  # [S] its offset in that row
    num_rows: int
    max_q: int
    key_len: int  # L: keys are cut to this length
    mask: torch.Tensor | None  # [R, 1, max_q, L]; None when nothing needs masking


@dataclass
class _Plan:
    long: list[_LongSeq]
    batched: _Batched | None
    has_padding_slots: bool


def _build_plan(meta: AttentionMetadata, sliding_window: int | None) -> _Plan:
    device = meta.block_tables.device
    bs = meta.block_size
    starts = [0]
    for n in meta.query_lens_cpu:
        starts.append(starts[-1] + n)
    has_padding = bool(meta.slot_mapping.numel()) and bool((meta.slot_mapping < 0).any())
    long: list[_LongSeq] = []
    rows: list[int] = []
    for b, (n, ctx) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
        if n <= _BATCHED_MAX_QUERY:
            rows.append(b)
            continue
        blocks = meta.block_tables[b, : -(-ctx // bs)].long()
        mask = None
        if not (n == ctx and sliding_window is None):
            q_pos = torch.arange(ctx - n, ctx, device=device)[:, None]  # [n, 1]
            k_pos = torch.arange(ctx, device=device)[None, :]  # [1, ctx]
            mask = _visible(q_pos, k_pos, torch.tensor(ctx, device=device), sliding_window)
        long.append(_LongSeq(slice(starts[b], starts[b + 1]), blocks, ctx, mask))
    if not rows:
        return _Plan(long, None, has_padding)
    q_lens = [meta.query_lens_cpu[b] for b in rows]
    ctx_lens = [meta.context_lens_cpu[b] for b in rows]
    max_q = max(q_lens)
    num_blocks = -(-max(ctx_lens) // bs)
    blocks = meta.block_tables[torch.tensor(rows, device=device), :num_blocks].long()  # [R, nb]
    # Token t of the flat batch -> (row r, offset i) in the padded [R, max_q] query grid.
    tok = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in rows]).to(device)
    row_of = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(q_lens)).to(device)
    off = torch.cat([torch.arange(n) for n in q_lens]).to(device)
    key_len = num_blocks * bs
    mask = None
    if max_q == 1 and sliding_window is None and len(rows) == 1:
        key_len = ctx_lens[0]  # one decode token sees its whole context: no mask at all
    else:
        ctx_t = torch.tensor(ctx_lens, device=device)[:, None, None]  # [R, 1, 1]
        q_len_t = torch.tensor(q_lens, device=device)[:, None, None]
        q_pos = ctx_t - q_len_t + torch.arange(max_q, device=device)[None, :, None]  # [R, Q, 1]
        k_pos = torch.arange(key_len, device=device)[None, None, :]  # [1, 1, L]
        mask = _visible(q_pos, k_pos, ctx_t, sliding_window)  # [R, Q, L]
        # Padding query rows would see nothing (NaN softmax): let them see key 0; discarded.
        mask[:, :, 0] |= torch.arange(max_q, device=device)[None, :] >= q_len_t[:, :, 0]
        mask = mask[:, None]  # [R, 1, Q, L], broadcast over heads
    batched = _Batched(blocks, tok, row_of, off, len(rows), max_q, key_len, mask)
    return _Plan(long, batched, has_padding)


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """cache [N, bs, KVH, D], blocks [..., nb] -> [..., KVH, nb * bs, D]."""
    # index_select, not cache[blocks]: advanced indexing takes a slow generic path on CPU.
    g = cache.index_select(0, blocks.reshape(-1))  # [prod(...) * nb, bs, KVH, D]
    g = g.view(*blocks.shape, *cache.shape[1:]).flatten(-4, -3)  # [..., nb * bs, KVH, D]
    return g.transpose(-3, -2)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          causal: bool, scale: float, softcap: float | None) -> torch.Tensor:
    """SDPA over [..., H, n, D] queries and [..., KVH, L, D] keys/values (``mask`` [..., n, L]
    boolean; None: ``causal`` (n == L) or every key visible). With ``softcap`` the scores become
    cap * tanh(s / cap) before the mask, as Gemma 2 computes them (eager; SDPA has no cap)."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=scale, enable_gqa=True)
    group = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [..., H, n, L]
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        n, length = scores.shape[-2:]
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


class TorchPagedAttention:
    """Reference backend. Stateless; one instance serves every layer."""

    name = "torch"
    supports_softcap = True

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        k_cache: torch.Tensor,  # [N, block_size, KVH, D]
        v_cache: torch.Tensor,  # [N, block_size, KVH, D]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:  # [T, H, D]
        plan = meta.plan((self.name, sliding_window), lambda: _build_plan(meta, sliding_window))
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, plan.has_padding_slots)
        out = torch.empty_like(q)
        for seq in plan.long:
            keys = _gather(k_cache, seq.blocks)[:, : seq.ctx].to(q.dtype)  # [KVH, ctx, D]
            values = _gather(v_cache, seq.blocks)[:, : seq.ctx].to(q.dtype)
            o = _sdpa(q[seq.tokens].transpose(0, 1), keys, values, seq.mask, seq.mask is None,
                      scale, softcap)  # [H, n, D]
            out[seq.tokens] = o.transpose(0, 1)
        bp = plan.batched
        if bp is not None:
            keys = _gather(k_cache, bp.blocks)[..., : bp.key_len, :].to(q.dtype)  # [R, KVH, L, D]
            values = _gather(v_cache, bp.blocks)[..., : bp.key_len, :].to(q.dtype)
            decode_only = bp.max_q == 1 and bp.tok.numel() == q.shape[0]
            if decode_only:
                q_pad = q[:, None]  # [R, 1, H, D]: rows are the tokens, in order
            else:
                q_pad = q.new_zeros(bp.num_rows, bp.max_q, *q.shape[1:])  # [R, Q, H, D]
                q_pad[bp.row_of, bp.off] = q[bp.tok]
            o = _sdpa(q_pad.transpose(1, 2), keys, values, bp.mask, False, scale,
                      softcap)  # [R, H, Q, D]
            if decode_only:
                return o[:, :, 0]  # [T, H, D], no scatter needed
            out[bp.tok] = o.transpose(1, 2)[bp.row_of, bp.off]
        return out

    __call__ = forward
