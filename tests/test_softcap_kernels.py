"""Gemma's kernels: attention logit soft-capping in the C++ paged attention and the torch
reference (against a float64 dense reference written here, and verify rows bit for bit equal to
decode rows), and the fused GELU-tanh * up and final-logit soft-cap row ops (against float64,
and row i of an M-row call equal to the 1-row call, M = 1..17)."""

from __future__ import annotations

import math

import pytest
import torch

from specserve.kernels.attention_form import supported_forms
from specserve.kernels.metadata import AttentionMetadata

FORMS = supported_forms(16)
CAP = 1.5  # small enough that most scores of the random case are squashed


def _attention_case(seed: int, query_lens: list[int], ctx_lens: list[int], window: int | None):
    """Random queries, new keys/values and a random paged cache (block size 4, shuffled block
    ids) for sequences with these new-token and context lengths."""
    g = torch.Generator().manual_seed(seed)
    bs, H, KVH, D = 4, 4, 2, 16
    blocks_per = [-(-c // bs) for c in ctx_lens]
    perm = torch.randperm(sum(blocks_per) + 3, generator=g).tolist()
    tables, i = [], 0
    for n in blocks_per:
        tables.append(perm[i: i + n])
        i += n
    meta = AttentionMetadata.build(query_lens, ctx_lens, tables, bs)
    kc = torch.randn(len(perm), bs, KVH, D, generator=g)
    vc = torch.randn(len(perm), bs, KVH, D, generator=g)
    T = sum(query_lens)
    q = torch.randn(T, H, D, generator=g)
    k = torch.randn(T, KVH, D, generator=g)
    v = torch.randn(T, KVH, D, generator=g)
    return q, k, v, kc, vc, meta, window


def _dense_capped(q, kc, vc, meta, scale, window, cap):
    """float64: each query row at position p attends its sequence's keys 0..p (p - window + 1
    ..p), scores cap * tanh(s / cap), softmax, weighted values."""
    bs = meta.block_size
    out = torch.empty(q.shape, dtype=torch.float64)
    t = 0
    for b, (n, ctx) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
        table = meta.block_tables[b].tolist()
        slots = [table[j // bs] * bs + j % bs for j in range(ctx)]
        keys = kc.reshape(-1, *kc.shape[2:])[slots].double()  # [ctx, KVH, D]
        vals = vc.reshape(-1, *vc.shape[2:])[slots].double()
        group = q.shape[1] // keys.shape[1]
        keys, vals = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)
        for i in range(n):
            p = ctx - n + i
            lo = 0 if window is None else max(0, p - window + 1)
            s = torch.einsum("hd,lhd->hl", q[t].double(), keys[lo:p + 1]) * scale
            w = torch.softmax(cap * torch.tanh(s / cap), dim=-1)
            out[t] = torch.einsum("hl,lhd->hd", w, vals[lo:p + 1])
            t += 1
    return out


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("window", [None, 5])
def test_capped_attention_matches_float64(window, form):
    from specserve.kernels.cpu_paged import CpuPagedAttention
    from specserve.kernels.torch_ref import TorchPagedAttention

    q, k, v, kc, vc, meta, window = _attention_case(5, [1, 4, 20], [9, 13, 20], window)
    scale = 0.5
    out = CpuPagedAttention(form=form).forward(q, k, v, kc, vc, meta, scale, window,
                                               softcap=CAP)
    ref = _dense_capped(q, kc, vc, meta, scale, window, CAP)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    uncapped = _dense_capped(q, kc, vc, meta, scale, window, 1e9)
    assert (uncapped - ref).abs().max() > 1e-2  # the cap matters in this case
    meta.plan_cache.clear()
    torch_out = TorchPagedAttention().forward(q, k, v, kc, vc, meta, scale, window, softcap=CAP)
    torch.testing.assert_close(torch_out.double(), ref, rtol=1e-5, atol=1e-5)
    meta.plan_cache.clear()
    # the long prefill through the torch path inside the C++ backend: same answer
    mixed = CpuPagedAttention(max_kernel_query=16, form=form).forward(
        q, k, v, kc, vc, meta, scale, window, softcap=CAP)
    torch.testing.assert_close(mixed.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("window", [None, 3])
def test_capped_verify_rows_equal_decode_rows(window, form):
    from specserve.kernels.cpu_paged import CpuPagedAttention

    backend = CpuPagedAttention(form=form)
    q, k, v, kc, vc, meta, _ = _attention_case(9, [5, 1, 3], [12, 7, 10], window)
    verify = backend.forward(q, k, v, kc, vc, meta, 0.3, window, softcap=CAP)  # writes new K/V
    tables = [meta.block_tables[b].tolist() for b in range(len(meta.query_lens_cpu))]
    start = 0
    for b, (n, ctx) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
        for j in range(n):  # each row alone, as a one-token decode at its position
            t = start + j
            one = AttentionMetadata.build([1], [ctx - n + j + 1], [tables[b]], meta.block_size)
            row = backend.forward(q[t: t + 1], k[t: t + 1], v[t: t + 1], kc, vc, one, 0.3,
                                  window, softcap=CAP)
            assert torch.equal(row[0], verify[t]), (b, j)
        start += n


def _ops():
    from specserve.kernels import quant_ext

    return quant_ext.load()


@pytest.mark.parametrize("width", [8, 13, 64])
def test_gelu_tanh_mul_matches_float64_and_is_row_invariant(width):
    g = torch.Generator().manual_seed(width)
    x = torch.randn(17, 2 * width, generator=g) * 3
    got = _ops().gelu_tanh_mul(x)
    gate, up = x.double().split(width, dim=-1)
    u = math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)
    ref = 0.5 * gate * (1 + torch.tanh(u)) * up
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    for m in range(1, 18):
        part = _ops().gelu_tanh_mul(x[:m].contiguous())
        assert torch.equal(part, got[:m]), m


def test_softcap_matches_float64_and_is_row_invariant():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(17, 1000, generator=g) * 40
    got = x.clone()
    _ops().softcap_(got, 30.0)
    torch.testing.assert_close(got.double(), 30.0 * torch.tanh(x.double() / 30.0), rtol=1e-6,
                               atol=1e-5)
    for m in range(1, 18):
        part = x[:m].clone()
        _ops().softcap_(part, 30.0)
        assert torch.equal(part, got[:m]), m
