"""Paged attention through PyTorch SDPA over gathered blocks: the CUDA fallback that needs no
extension (no flash-attn, no Triton). Also runs on CPU, where it is tested.

What it does differently from the torch reference (same results):
- Every index map and mask of a step is built on the host from the ``*_cpu`` lists and copied
  to the device without waiting (``_Plan``, built on the first layer, reused by the others);
  the only device->host sync per step is the padding-slot check below.
- GQA without ``enable_gqa``: the GROUP query heads sharing a KV head are folded into the query
  axis ([R, KVH, GROUP * Q, D] against [R, KVH, L, D]), so the masked SDPA paths (memory-
  efficient kernel on CUDA) never fall back to the math kernel and K/V are never repeated.
- Uniform steps (all decode, or every sequence verifying the same k + 1 tokens) need no
  scatter: the flat [T, H, D] batch is viewed as [B, Q, H, D] directly.
- The k/v write checks for padding slots (-1) once per step, not per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specserve.kernels.metadata import AttentionMetadata
from specserve.kernels.torch_ref import _gather, write_kv

# Sequences with at most this many new tokens are attended together in one padded call.
_BATCHED_MAX_QUERY = 16


@dataclass
class _Long:
    """One long prefill chunk attended on its own."""

    start: int  # its rows in the flat batch: start .. start + n
    n: int
    ctx: int
    blocks: torch.Tensor  # [nb] block ids covering its context
    mask: torch.Tensor | None  # [n, ctx] bool; None = plain causal (all-new context, no window)


@dataclass
class _Short:
    """Decode / verify runs attended together in a padded [R, Q] query grid."""

    blocks: torch.Tensor  # [R, nb]
    key_len: int  # L = nb * block_size (or the exact context for one unmasked decode row)
    max_q: int
    mask: torch.Tensor | None  # [R, 1, Q, L] bool; None when nothing needs masking
    uniform: bool  # rows are the whole flat batch in order, each exactly max_q tokens
    tok: torch.Tensor | None  # [S] flat rows of the short tokens (when not uniform)
    grid_idx: torch.Tensor | None  # [S] their index in the flattened [R * Q] grid


@dataclass
class _Plan:
    long: list[_Long]
    short: _Short | None
    has_padding_slots: bool


def _visible(q_pos, k_pos, ctx, window):
    mask = (k_pos <= q_pos) & (k_pos < ctx)
    if window is not None:
        mask &= q_pos - k_pos < window
    return mask


def _build_plan(meta: AttentionMetadata, window: int | None) -> _Plan:
    device = meta.block_tables.device
    bs = meta.block_size
    q_lens, ctx_lens = meta.query_lens_cpu, meta.context_lens_cpu
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    # Host tensors first, one transfer at the end.
    host: dict[str, torch.Tensor] = {}
    long_specs = []
    rows = []
    for b, (n, ctx) in enumerate(zip(q_lens, ctx_lens)):
        if n <= _BATCHED_MAX_QUERY:
            rows.append(b)
            continue
        if not (n == ctx and window is None):
            q_pos = torch.arange(ctx - n, ctx)[:, None]
            host[f"mask{b}"] = _visible(q_pos, torch.arange(ctx)[None, :], ctx, window)
        long_specs.append(b)
    short = None
    if rows:
        sq = [q_lens[b] for b in rows]
        sc = [ctx_lens[b] for b in rows]
        max_q = max(sq)
        nb = -(-max(sc) // bs)
        key_len = nb * bs
        host["rows"] = torch.tensor(rows)
        uniform = len(rows) == len(q_lens) and min(sq) == max_q
        if not uniform:
            host["tok"] = torch.cat([torch.arange(starts[b], starts[b + 1]) for b in rows])
            host["grid"] = torch.cat([r * max_q + torch.arange(n) for r, n in enumerate(sq)])
        needs_mask = not (max_q == 1 and window is None and len(rows) == 1)
        if needs_mask:
            ctx_t = torch.tensor(sc)[:, None, None]  # [R, 1, 1]
            qlen_t = torch.tensor(sq)[:, None, None]
            q_pos = ctx_t - qlen_t + torch.arange(max_q)[None, :, None]  # [R, Q, 1]
            m = _visible(q_pos, torch.arange(key_len)[None, None, :], ctx_t, window)  # [R, Q, L]
            # Padding query rows would see nothing (NaN softmax): let them see key 0; dropped.
            m[:, :, 0] |= torch.arange(max_q)[None, :] >= qlen_t[:, :, 0]
            host["short_mask"] = m[:, None]
        else:
            key_len = sc[0]
        short = (max_q, nb, key_len, uniform, needs_mask)
    moved = {}
    if host:
        # Host tensors are pageable, so non_blocking only overlaps the copies with each other.
        moved = {name: t.to(device, non_blocking=True) for name, t in host.items()}
    tables = meta.block_tables
    long = []
    for b in long_specs:
        n, ctx = q_lens[b], ctx_lens[b]
        blocks = tables[b, : -(-ctx // bs)].long()
        long.append(_Long(starts[b], n, ctx, blocks, moved.get(f"mask{b}")))
    short_plan = None
    if short is not None:
        max_q, nb, key_len, uniform, needs_mask = short
        blocks = tables[moved["rows"], :nb].long() if not uniform else tables[:, :nb].long()
        short_plan = _Short(
            blocks=blocks, key_len=key_len, max_q=max_q,
            mask=moved.get("short_mask") if needs_mask else None, uniform=uniform,
            tok=moved.get("tok"), grid_idx=moved.get("grid"),
        )
    has_padding = bool(meta.slot_mapping.numel()) and bool((meta.slot_mapping < 0).any())
    return _Plan(long, short_plan, has_padding)


def _fold_gqa(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """q [R, Q, H, D] -> [R, KVH, G * Q, D], row g * Q + i = query i of head kvh * G + g."""
    R, Q, H, D = q.shape
    g = H // num_kv_heads
    q = q.view(R, Q, num_kv_heads, g, D).permute(0, 2, 3, 1, 4)  # [R, KVH, G, Q, D]
    return q.reshape(R, num_kv_heads, g * Q, D)


def _unfold_gqa(o: torch.Tensor, Q: int) -> torch.Tensor:
    """[R, KVH, G * Q, D] -> [R, Q, H, D]."""
    R, kvh, gq, D = o.shape
    g = gq // Q
    return o.view(R, kvh, g, Q, D).permute(0, 3, 1, 2, 4).reshape(R, Q, kvh * g, D)


class SdpaPagedAttention:
    """SDPA backend. Stateless; one instance serves every layer."""

    name = "sdpa"

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
        plan = meta.plan((self.name, sliding_window), lambda: _build_plan(meta, sliding_window))
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, plan.has_padding_slots)
        kvh = k_cache.shape[2]
        group = q.shape[1] // kvh
        out = torch.empty_like(q)
        for seq in plan.long:
            keys = _gather(k_cache, seq.blocks)[:, : seq.ctx].to(q.dtype)  # [KVH, ctx, D]
            values = _gather(v_cache, seq.blocks)[:, : seq.ctx].to(q.dtype)
            rows = slice(seq.start, seq.start + seq.n)
            if seq.mask is None:  # plain causal prefill: SDPA's own GQA keeps the flash path
                o = F.scaled_dot_product_attention(
                    q[rows].transpose(0, 1), keys, values, is_causal=True, scale=scale,
                    enable_gqa=group > 1,
                )  # [H, n, D]
                out[rows] = o.transpose(0, 1)
                continue
            qf = _fold_gqa(q[rows][None], kvh)[0]  # [KVH, G * n, D]
            mask = seq.mask.repeat(group, 1)  # [G * n, ctx]
            o = F.scaled_dot_product_attention(qf, keys, values, attn_mask=mask, scale=scale)
            out[rows] = _unfold_gqa(o[None], seq.n)[0]
        sp = plan.short
        if sp is not None:
            keys = _gather(k_cache, sp.blocks)[..., : sp.key_len, :].to(q.dtype)  # [R, KVH, L, D]
            values = _gather(v_cache, sp.blocks)[..., : sp.key_len, :].to(q.dtype)
            R = sp.blocks.shape[0]
            if sp.uniform:
                q_grid = q.view(R, sp.max_q, *q.shape[1:])  # [R, Q, H, D], no copy
            else:
                q_grid = q.new_zeros(R * sp.max_q, *q.shape[1:])
                q_grid[sp.grid_idx] = q[sp.tok]
                q_grid = q_grid.view(R, sp.max_q, *q.shape[1:])
            mask = sp.mask
            if mask is not None and group > 1:
                mask = mask.repeat(1, 1, group, 1)  # [R, 1, G * Q, L]
            o = F.scaled_dot_product_attention(
                _fold_gqa(q_grid, kvh), keys, values, attn_mask=mask, scale=scale
            )  # [R, KVH, G * Q, D]
            o = _unfold_gqa(o, sp.max_q)  # [R, Q, H, D]
            if sp.uniform:
                out.view(R, sp.max_q, *q.shape[1:]).copy_(o)
            else:
                out[sp.tok] = o.reshape(R * sp.max_q, *q.shape[1:])[sp.grid_idx]
        return out

    __call__ = forward
