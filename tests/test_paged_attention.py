"""paged_attention (torch reference backend) against a dense float64 computation."""

from __future__ import annotations

import math
import random

import pytest
import torch

from specserve.core.errors import ConfigError
from specserve.kernels.metadata import AttentionMetadata
from specserve.kernels.registry import get_attention_backend


def dense_reference(q, keys, values, q_positions, sliding_window):
    """q [n, H, D], keys/values [L, KVH, D] (a sequence's full context), float64, explicit loops
    over nothing but heads: softmax(q k^T * scale + mask) v."""
    n, H, D = q.shape
    KVH = keys.shape[1]
    group = H // KVH
    out = torch.empty(n, H, D, dtype=torch.float64)
    k_pos = torch.arange(keys.shape[0])
    for h in range(H):
        kh, vh = keys[:, h // group].double(), values[:, h // group].double()
        scores = q[:, h].double() @ kh.T / math.sqrt(D)  # [n, L]
        visible = k_pos[None, :] <= q_positions[:, None]
        if sliding_window is not None:
            visible &= q_positions[:, None] - k_pos[None, :] < sliding_window
        scores = scores.masked_fill(~visible, float("-inf"))
        out[:, h] = torch.softmax(scores, dim=-1) @ vh
    return out


def run_case(seed, query_lens, cached_lens, H, KVH, D, block_size, sliding_window=None,
             dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    B = len(query_lens)
    ctx_lens = [c + n for c, n in zip(cached_lens, query_lens)]
    blocks_needed = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(blocks_needed) + 3
    ids = list(range(num_blocks))
    rng.shuffle(ids)  # non-contiguous block tables
    tables, it = [], iter(ids)
    for nb in blocks_needed:
        tables.append([next(it) for _ in range(nb)])
    k_cache = torch.randn(num_blocks, block_size, KVH, D, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, KVH, D, generator=gen).to(dtype)
    # Full per-sequence contexts; the cached part is pre-written into the paged cache.
    full_k = [torch.randn(c, KVH, D, generator=gen).to(dtype) for c in ctx_lens]
    full_v = [torch.randn(c, KVH, D, generator=gen).to(dtype) for c in ctx_lens]
    for b in range(B):
        for pos in range(cached_lens[b]):
            blk, off = tables[b][pos // block_size], pos % block_size
            k_cache[blk, off] = full_k[b][pos]
            v_cache[blk, off] = full_v[b][pos]
    T = sum(query_lens)
    q = torch.randn(T, H, D, generator=gen).to(dtype)
    k_new = torch.cat([full_k[b][cached_lens[b]:] for b in range(B)])
    v_new = torch.cat([full_v[b][cached_lens[b]:] for b in range(B)])
    meta = AttentionMetadata.build(query_lens, ctx_lens, tables, block_size)
    backend = get_attention_backend("torch", "cpu")
    out = backend.forward(q, k_new, v_new, k_cache, v_cache, meta, 1 / math.sqrt(D),
                          sliding_window)
    start = 0
    for b in range(B):
        n = query_lens[b]
        q_pos = torch.arange(cached_lens[b], ctx_lens[b])
        ref = dense_reference(q[start:start + n], full_k[b], full_v[b], q_pos, sliding_window)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out[start:start + n].double(), ref, atol=tol, rtol=tol)
        start += n
    # The new tokens' K/V landed in the cache at their slots.
    for b in range(B):
        for pos in range(cached_lens[b], ctx_lens[b]):
            blk, off = tables[b][pos // block_size], pos % block_size
            assert torch.equal(k_cache[blk, off], full_k[b][pos])
            assert torch.equal(v_cache[blk, off], full_v[b][pos])


@pytest.mark.parametrize("seed", range(4))
def test_mixed_prefill_decode_verify(seed):
    # A fresh prefill, a chunked prefill continuing, decodes, a 5-token verify, a block crossing.
    run_case(seed, query_lens=[37, 20, 1, 1, 5, 3], cached_lens=[0, 13, 40, 15, 31, 0],
             H=8, KVH=2, D=16, block_size=4)


@pytest.mark.parametrize("seed", range(10))
def test_random_shapes(seed):
    rng = random.Random(1000 + seed)
    B = rng.randint(1, 6)
    kvh = rng.choice([1, 2, 4])
    H = kvh * rng.choice([1, 2, 3])
    query_lens = [rng.choice([1, 1, 2, 5, rng.randint(1, 40)]) for _ in range(B)]
    cached = [rng.randint(0, 50) for _ in range(B)]
    run_case(seed, query_lens, cached, H=H, KVH=kvh, D=rng.choice([8, 16, 32]),
             block_size=rng.choice([1, 4, 16]))


@pytest.mark.parametrize("seed", range(3))
def test_sliding_window(seed):
    run_case(seed, query_lens=[30, 1, 4], cached_lens=[10, 25, 9], H=4, KVH=2, D=8,
             block_size=4, sliding_window=7)


def test_bfloat16_close_to_float64():
    run_case(0, query_lens=[9, 1, 3], cached_lens=[5, 20, 2], H=4, KVH=2, D=16, block_size=8,
             dtype=torch.bfloat16)


def test_padding_slot_is_not_written():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros(2, 4, 1, 2)
    meta = AttentionMetadata.build([2], [2], [[1]], 4)
    meta.slot_mapping[1] = -1
    q = torch.randn(2, 1, 2)
    k = torch.ones(2, 1, 2)
    get_attention_backend("torch", "cpu").forward(q, k, k, k_cache, v_cache, meta, 1.0)
    assert k_cache[1, 0].sum() == 2 and k_cache[1, 1].sum() == 0


def test_unknown_backend_is_a_clear_error():
    with pytest.raises(ConfigError, match="unknown attention backend 'nope'; choose one of"):
        get_attention_backend("nope", "cpu")
    assert get_attention_backend("auto", "cpu").name == "torch"


@pytest.mark.parametrize("cached", [0, 3, 15, 21])
def test_single_decode_token(cached):
    # The unmasked fast path: one sequence, one new token (context may end mid-block).
    run_case(cached, query_lens=[1], cached_lens=[cached], H=6, KVH=3, D=16, block_size=16)


def test_decode_only_batch():
    run_case(5, query_lens=[1, 1, 1, 1], cached_lens=[0, 16, 33, 7], H=4, KVH=1, D=8,
             block_size=8)
