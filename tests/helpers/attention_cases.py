"""Random paged-attention batches and their float64 dense reference: what every query token of
every sequence must see (causal inside the new tokens, sliding window, grouped-query heads),
shared by every attention backend's tests (the SDPA one in-process, the Triton kernel in its
interpreter subprocess)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch

from specserve.kernels.metadata import AttentionMetadata


@dataclass
class Case:
    q: torch.Tensor  # [T, H, D]
    k_new: torch.Tensor  # [T, KVH, D]
    v_new: torch.Tensor
    k_cache: torch.Tensor  # [N, bs, KVH, D], cached part pre-written
    v_cache: torch.Tensor
    tables: list[list[int]]
    query_lens: list[int]
    cached_lens: list[int]
    block_size: int
    sliding_window: int | None
    expected: torch.Tensor  # [T, H, D] float64

    def meta(self, device: str = "cpu") -> AttentionMetadata:
        ctx = [c + n for c, n in zip(self.cached_lens, self.query_lens)]
        return AttentionMetadata.build(self.query_lens, ctx, self.tables, self.block_size, device)


def _dense(q, keys, values, q_pos, sliding_window):
    """q [n, H, D], keys/values [L, KVH, D] -> [n, H, D] float64 (causal, window, GQA)."""
    group = q.shape[1] // keys.shape[1]
    kh = keys.double().repeat_interleave(group, 1)  # [L, H, D]
    vh = values.double().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), kh) / math.sqrt(q.shape[-1])
    k_pos = torch.arange(keys.shape[0])
    visible = k_pos[None, :] <= q_pos[:, None]
    if sliding_window is not None:
        visible &= q_pos[:, None] - k_pos[None, :] < sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", torch.softmax(scores, -1), vh)


def make_case(seed, query_lens, cached_lens, H, KVH, D, block_size, sliding_window=None,
              dtype=torch.float32) -> Case:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    ctx_lens = [c + n for c, n in zip(cached_lens, query_lens)]
    needed = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(needed) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)  # non-contiguous block tables
    it = iter(ids)
    tables = [[next(it) for _ in range(nb)] for nb in needed]
    k_cache = torch.randn(num_blocks, block_size, KVH, D, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, KVH, D, generator=gen).to(dtype)
    full_k = [torch.randn(c, KVH, D, generator=gen).to(dtype) for c in ctx_lens]
    full_v = [torch.randn(c, KVH, D, generator=gen).to(dtype) for c in ctx_lens]
    for b, table in enumerate(tables):
        for pos in range(cached_lens[b]):
            k_cache[table[pos // block_size], pos % block_size] = full_k[b][pos]
            v_cache[table[pos // block_size], pos % block_size] = full_v[b][pos]
    q = torch.randn(sum(query_lens), H, D, generator=gen).to(dtype)
    expected, start = [], 0
    for b, n in enumerate(query_lens):
        q_pos = torch.arange(cached_lens[b], ctx_lens[b])
        expected.append(_dense(q[start:start + n], full_k[b], full_v[b], q_pos, sliding_window))
        start += n
    return Case(
        q=q,
        k_new=torch.cat([full_k[b][cached_lens[b]:] for b in range(len(query_lens))]),
        v_new=torch.cat([full_v[b][cached_lens[b]:] for b in range(len(query_lens))]),
        k_cache=k_cache, v_cache=v_cache, tables=tables, query_lens=list(query_lens),
        cached_lens=list(cached_lens), block_size=block_size, sliding_window=sliding_window,
        expected=torch.cat(expected),
    )


def run_backend(backend, case: Case, device: str = "cpu") -> tuple[float, bool]:
    """Runs ``backend`` on a fresh copy of the case; returns (max abs error vs float64, whether
    the new tokens' K/V landed at their slots)."""
    k_cache, v_cache = case.k_cache.clone().to(device), case.v_cache.clone().to(device)
    D = case.q.shape[-1]
    out = backend.forward(
        case.q.to(device), case.k_new.to(device), case.v_new.to(device), k_cache, v_cache,
        case.meta(device), 1 / math.sqrt(D), case.sliding_window,
    )
    err = (out.double().cpu() - case.expected).abs().max().item()
    written, start = True, 0
    for b, n in enumerate(case.query_lens):
        for i in range(n):
            pos = case.cached_lens[b] + i
            blk, off = case.tables[b][pos // case.block_size], pos % case.block_size
            written &= torch.equal(k_cache[blk, off].cpu(), case.k_new[start + i])
            written &= torch.equal(v_cache[blk, off].cpu(), case.v_new[start + i])
        start += n
    return err, written


def tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}[dtype]


# The cases every backend runs: (name, make_case kwargs).
CASES = {
    # fresh prefill, chunked prefill continuing, decodes, a 5-token verify, block crossings
    "mixed_gqa_bs4": dict(query_lens=[19, 7, 1, 1, 5, 3], cached_lens=[0, 13, 40, 15, 31, 0],
                          H=8, KVH=2, D=16, block_size=4),
    "mixed_bs16": dict(query_lens=[5, 1, 20, 2], cached_lens=[30, 17, 0, 14], H=6, KVH=3,
                       D=32, block_size=16),
    "window": dict(query_lens=[22, 1, 4], cached_lens=[10, 25, 9], H=4, KVH=2, D=8,
                   block_size=4, sliding_window=7),
    "decode_only": dict(query_lens=[1, 1, 1, 1], cached_lens=[0, 16, 33, 7], H=4, KVH=1, D=8,
                        block_size=16),
    "single_decode": dict(query_lens=[1], cached_lens=[21], H=6, KVH=2, D=16, block_size=16),
    "verify_only": dict(query_lens=[5, 5, 5], cached_lens=[3, 16, 40], H=4, KVH=4, D=16,
                        block_size=4),
}
