"""Paged attention as one Triton launch for prefill chunks, decode and speculative verify alike.

Same contract as ``TorchPagedAttention.forward``. Two kernels per call: a store kernel writes the
new k/v at ``slot_mapping`` (slot -1 is skipped inside the kernel, so no host sync), then one
attention kernel over a grid of (query tiles, KV heads).

Query tiles. Program row m of a tile holds query token ``m // GROUP`` of the tile and query head
``kv_head * GROUP + m % GROUP``: the GROUP query heads that share a KV head share every K/V load
(GQA costs nothing extra). A tile covers BLOCK_Q = BLOCK_M // GROUP tokens of ONE sequence.
Sequence b owns the tile slots ``[cu_q[b] // BLOCK_Q + b, cu_q[b + 1] // BLOCK_Q + b + 1)``,
which is at least ceil(q_len / BLOCK_Q) slots; surplus programs exit at once. So the grid,
``T // BLOCK_Q + B`` tiles, depends only on T and B (fixed under a CUDA graph bucket), and a
program finds its sequence by binary search over ``cu_seqlens_q``: nothing is built on the host.

Worked example, BLOCK_Q 4, query_lens [6, 1, 3] -> cu_q [0, 6, 7, 10], grid 10 // 4 + 3 = 5:
    seq 0 starts at 0 // 4 + 0 = 0 -> tiles 0 (tokens 0-3), 1 (tokens 4-5)
    seq 1 starts at 6 // 4 + 1 = 2 -> tile 2 (token 6)
    seq 2 starts at 7 // 4 + 2 = 3 -> tile 3 (tokens 7-9); tile 4 finds seq 2, local tile 1,
    and 1 * 4 >= 3, so it exits.

Each program walks its sequence's keys [kv_start, kv_end) in BLOCK_N tiles through the block
table (a tile may span several cache blocks), with an online softmax in fp32: kv_end is one past
the tile's last query position (causal), kv_start the first key the window lets its first query
see. Requires Triton (>= 3.0); on CPU only its interpreter (``TRITON_INTERPRET=1``) runs it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.metadata import AttentionMetadata

_LOG2E = 1.4426950408889634


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr,  # [T, KVH, D]
    k_cache_ptr, v_cache_ptr,  # [N, block_size, KVH, D]
    slot_ptr,  # [T] int64, -1 = skip
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    BLOCK_SIZE: tl.constexpr, KVH: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < KVH) & (d < HEAD_DIM)
        k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
        k_dst = k_cache_ptr + blk * stride_kcb + off * stride_kcs + h * stride_kch + d
        v_dst = v_cache_ptr + blk * stride_vcb + off * stride_vcs + h * stride_vch + d
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, H, D]
    q_ptr,  # [T, H, D]
    k_cache_ptr, v_cache_ptr,  # [N, block_size, KVH, D]
    block_tables_ptr,  # [B, max_blocks] int32
    cu_q_ptr,  # [B + 1] int32
    ctx_ptr,  # [B] int32
    scale_log2,  # softmax scale * log2(e): scores go through exp2
    window,  # sliding window (used when USE_WINDOW)
    num_seqs,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_bt,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    # The sequence of this tile: the last b with cu_q[b] // BLOCK_Q + b <= tile.
    lo = tl.full([], 0, tl.int32)  # typed scalars: loop-carried values may not be constexpr
    hi = tl.full([], 0, tl.int32) + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_q_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(cu_q_ptr + seq)
    q_len = tl.load(cu_q_ptr + seq + 1) - q_start
    local = tile - (q_start // BLOCK_Q + seq)  # this tile's index inside its sequence
    if local * BLOCK_Q < q_len:
        ctx = tl.load(ctx_ptr + seq)
        first_pos = ctx - q_len  # absolute position of the sequence's first new token
        offs_m = tl.arange(0, BLOCK_M)
        qi = local * BLOCK_Q + offs_m // GROUP  # [M] query index inside the sequence
        head = kv_head * GROUP + offs_m % GROUP  # [M] query head
        row_ok = (offs_m < BLOCK_Q * GROUP) & (qi < q_len)
        q_pos = first_pos + qi  # [M]
        tok = (q_start + qi).to(tl.int64)  # [M] row in the flat batch
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        q = tl.load(
            q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :], other=0.0,
        )  # [M, D]
        if UPCAST_DOT:  # the CPU interpreter multiplies bfloat16 wrongly: test in fp32
            q = q.to(tl.float32)
        kv_end = first_pos + tl.minimum(local * BLOCK_Q + BLOCK_Q, q_len)
        kv_start = 0
        if USE_WINDOW:
            kv_start = tl.maximum(first_pos + local * BLOCK_Q - window + 1, 0)
        # A finite floor (not -inf) keeps exp2(m_i - m_new) defined for fully masked rows.
        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        offs_n = tl.arange(0, BLOCK_N)
        table = block_tables_ptr + seq.to(tl.int64) * stride_bt
        for n0 in range(kv_start, kv_end, BLOCK_N):
            k_pos = n0 + offs_n  # [N]
            k_ok = k_pos < kv_end
            blk = tl.load(table + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
            in_blk = k_pos % BLOCK_SIZE
            k_off = blk * stride_kcb + in_blk * stride_kcs + kv_head * stride_kch  # [N]
            v_off = blk * stride_vcb + in_blk * stride_vcs + kv_head * stride_vch
            kt = tl.load(
                k_cache_ptr + k_off[None, :] + offs_d[:, None],
                mask=k_ok[None, :] & d_ok[:, None], other=0.0,
            )  # [D, N]
            s = tl.dot(q, kt.to(q.dtype), input_precision=DOT_PRECISION) * scale_log2  # [M, N]
            visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
            if USE_WINDOW:
                visible = visible & (q_pos[:, None] - k_pos[None, :] < window)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                v_cache_ptr + v_off[:, None] + offs_d[None, :],
                mask=k_ok[:, None] & d_ok[None, :], other=0.0,
            )  # [N, D]
            acc = acc * alpha[:, None] + tl.dot(
                p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION
            )
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(
            out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
        )


# Under TRITON_INTERPRET=1 (tests on CPU) triton.jit returns an interpreted function instead.
_INTERPRETED = not isinstance(_paged_attention_kernel, triton.runtime.JITFunction)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


class TritonPagedAttention:
    """Triton backend. Stateless apart from its tile size; one instance serves every layer.

    ``kv_tile`` is BLOCK_N, the keys one loop iteration loads (a power of two >= 16). Launch
    shapes depend only on (T, B, H, KVH, D, block_size, max query length), never on data.
    """

    name = "triton"

    def __init__(self, kv_tile: int = 64, num_warps: int = 4) -> None:
        if kv_tile < 16 or kv_tile & (kv_tile - 1):
            raise ValueError(f"kv_tile must be a power of two >= 16, got {kv_tile}")
        self.kv_tile = kv_tile
        self.num_warps = num_warps

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
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        block_size = k_cache.shape[1]
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        assert block_size == meta.block_size, (block_size, meta.block_size)
        q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
        assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
        block_d = max(16, triton.next_power_of_2(head_dim))
        if num_tokens == 0:
            return torch.empty_like(q)

        _store_kv_kernel[(num_tokens,)](
            k, v, k_cache, v_cache, meta.slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            BLOCK_SIZE=block_size, KVH=num_kv_heads, HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        )

        group = num_heads // num_kv_heads
        # Rows per tile: enough for the longest query run's heads, 16..64 (tl.dot needs >= 16).
        block_m = min(64, max(16, triton.next_power_of_2(meta.max_query_len * group)))
        block_m = max(block_m, triton.next_power_of_2(group))
        block_q = block_m // group
        num_seqs = meta.num_seqs
        grid = (num_tokens // block_q + num_seqs, num_kv_heads)
        upcast = _INTERPRETED and q.dtype == torch.bfloat16
        out = torch.empty_like(q)
        _paged_attention_kernel[grid](
            out, q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
            scale * _LOG2E, sliding_window or 0, num_seqs,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
            meta.block_tables.stride(0),
            BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=self.kv_tile,
            USE_WINDOW=sliding_window is not None,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else None,
            UPCAST_DOT=upcast,
            num_warps=self.num_warps,
        )
        return out

    __call__ = forward

