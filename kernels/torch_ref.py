"""Paged attention in plain PyTorch: the ground truth every other backend is tested against.

Works on any device. Sequences with few new tokens (decode, speculative verify) are attended in
one padded batch; long prefill chunks run one SDPA call each, so a 500-token prefill never pads
thirty 1-token decodes up to 500 queries.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.metadata import AttentionMetadata

# Sequences with at most this many new tokens are attended together in one padded call.
_BATCHED_MAX_QUERY = 16


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatters the new k/v [T, KVH, D] into the caches [N, block_size, KVH, D] at their slots;
    slot -1 marks a padding token that must not be written."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
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


class TorchPagedAttention:
    """Reference backend. Stateless; one instance serves every layer."""

    name = "torch"

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
    ) -> torch.Tensor:  # [T, H, D]
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        starts = [0]
        for n in meta.query_lens_cpu:
            starts.append(starts[-1] + n)
        short = [b for b, n in enumerate(meta.query_lens_cpu) if n <= _BATCHED_MAX_QUERY]
        for b, n in enumerate(meta.query_lens_cpu):
            if n > _BATCHED_MAX_QUERY:
                sl = slice(starts[b], starts[b + 1])
                out[sl] = self._one_sequence(
                    q[sl], k_cache, v_cache, meta, b, scale, sliding_window
                )
        if short:
            self._batched(q, out, k_cache, v_cache, meta, short, starts, scale, sliding_window)
        return out

    __call__ = forward

    @staticmethod
    def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """cache [N, bs, KVH, D], blocks [..., nb] -> [..., KVH, nb * bs, D]."""
        # index_select, not cache[blocks]: advanced indexing takes a slow generic path on CPU.
        g = cache.index_select(0, blocks.reshape(-1))  # [prod(...) * nb, bs, KVH, D]
        g = g.view(*blocks.shape, *cache.shape[1:]).flatten(-4, -3)  # [..., nb * bs, KVH, D]
        return g.transpose(-3, -2)

    def _one_sequence(
        self,
        q: torch.Tensor,  # [n, H, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        b: int,
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [n, H, D]
        n, ctx = q.shape[0], meta.context_lens_cpu[b]
        num_blocks = -(-ctx // meta.block_size)
        blocks = meta.block_tables[b, :num_blocks].long()
        keys = self._gather(k_cache, blocks)[:, :ctx]  # [KVH, ctx, D]
        values = self._gather(v_cache, blocks)[:, :ctx]
        qt = q.transpose(0, 1)  # [H, n, D]
        mask = None
        if n == ctx and sliding_window is None:
            # Whole sequence is new: plain causal attention, SDPA's fastest path.
            o = F.scaled_dot_product_attention(
                qt, keys.to(q.dtype), values.to(q.dtype), is_causal=True, scale=scale,
                enable_gqa=True,
            )
            return o.transpose(0, 1)
        q_pos = torch.arange(ctx - n, ctx, device=q.device)[:, None]  # [n, 1]
        k_pos = torch.arange(ctx, device=q.device)[None, :]  # [1, ctx]
        mask = _visible(q_pos, k_pos, torch.tensor(ctx, device=q.device), sliding_window)
        o = F.scaled_dot_product_attention(
            qt, keys.to(q.dtype), values.to(q.dtype), attn_mask=mask, scale=scale,
            enable_gqa=True,
        )
        return o.transpose(0, 1)

    def _batched(
        self,
        q: torch.Tensor,  # [T, H, D]
        out: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        rows: list[int],
        starts: list[int],
        scale: float,
        sliding_window: int | None,
    ) -> None:
        device = q.device
        q_lens = [meta.query_lens_cpu[b] for b in rows]
        ctx_lens = [meta.context_lens_cpu[b] for b in rows]
        max_q = max(q_lens)
        num_blocks = -(-max(ctx_lens) // meta.block_size)
        rows_t = torch.tensor(rows, device=device)
        blocks = meta.block_tables[rows_t, :num_blocks].long()  # [R, nb]
        keys = self._gather(k_cache, blocks).to(q.dtype)  # [R, KVH, L, D]
        values = self._gather(v_cache, blocks).to(q.dtype)
        # Token t of the flat batch -> (row r, offset i) in the padded [R, max_q] query grid.
        tok = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in rows]).to(device)
        row_of = torch.repeat_interleave(
            torch.arange(len(rows)), torch.tensor(q_lens)
        ).to(device)
        off = torch.cat([torch.arange(n) for n in q_lens]).to(device)
        q_pad = q.new_zeros(len(rows), max_q, *q.shape[1:])  # [R, max_q, H, D]
        q_pad[row_of, off] = q[tok]
        ctx_t = torch.tensor(ctx_lens, device=device)[:, None, None]  # [R, 1, 1]
        q_len_t = torch.tensor(q_lens, device=device)[:, None, None]
        q_pos = ctx_t - q_len_t + torch.arange(max_q, device=device)[None, :, None]  # [R, Q, 1]
        k_pos = torch.arange(keys.shape[2], device=device)[None, None, :]  # [1, 1, L]
        mask = _visible(q_pos, k_pos, ctx_t, sliding_window)  # [R, Q, L]
        # Padding query rows would see nothing (NaN softmax): let them see key 0; discarded.
        mask[:, :, 0] |= torch.arange(max_q, device=device)[None, :] >= q_len_t[:, :, 0]
        o = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2), keys, values, attn_mask=mask[:, None], scale=scale,
            enable_gqa=True,
        )  # [R, H, Q, D]
        out[tok] = o.transpose(1, 2)[row_of, off]
