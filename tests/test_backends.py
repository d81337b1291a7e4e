"""Attention backends other than the torch reference, and how the registry picks them.

``make_case`` / ``check_backend`` are shared with tests/test_triton_kernel.py: a random paged
batch and a float64 dense computation of what every query token must see.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass

import pytest
import torch

from specserve.core.errors import ConfigError
from specserve.kernels import registry
from specserve.kernels.metadata import AttentionMetadata
from specserve.kernels.registry import get_attention_backend


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


@pytest.mark.parametrize("name", sorted(CASES))
def test_sdpa_matches_dense(name):
    err, written = run_backend(get_attention_backend("sdpa", "cpu"), make_case(0, **CASES[name]))
    assert written
    assert err < tolerance(torch.float32), err


@pytest.mark.parametrize("seed", range(8))
def test_sdpa_random_shapes(seed):
    rng = random.Random(2000 + seed)
    B = rng.randint(1, 6)
    kvh = rng.choice([1, 2, 4])
    case = make_case(
        seed, [rng.choice([1, 1, 2, 5, rng.randint(1, 40)]) for _ in range(B)],
        [rng.randint(0, 50) for _ in range(B)], H=kvh * rng.choice([1, 2, 3]), KVH=kvh,
        D=rng.choice([8, 16, 32]), block_size=rng.choice([1, 4, 16]),
        sliding_window=rng.choice([None, None, rng.randint(1, 20)]),
    )
    err, written = run_backend(get_attention_backend("sdpa", "cpu"), case)
    assert written and err < tolerance(torch.float32), err


def test_sdpa_bfloat16():
    case = make_case(1, [9, 1, 5], [5, 20, 2], H=4, KVH=2, D=16, block_size=8,
                     dtype=torch.bfloat16)
    err, written = run_backend(get_attention_backend("sdpa", "cpu"), case)
    assert written and err < tolerance(torch.bfloat16), err


def test_sdpa_padding_slot_is_not_written():
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.zeros(2, 4, 1, 2)
    meta = AttentionMetadata.build([2], [2], [[1]], 4)
    meta.slot_mapping[1] = -1
    k = torch.ones(2, 1, 2)
    get_attention_backend("sdpa", "cpu").forward(torch.randn(2, 1, 2), k, k, k_cache, v_cache,
                                                 meta, 1.0)
    assert k_cache[1, 0].sum() == 2 and k_cache[1, 1].sum() == 0


# --- registry ---------------------------------------------------------------------------------


def test_auto_on_cpu_is_torch():
    assert get_attention_backend("auto", "cpu").name == "torch"


def test_every_backend_is_listed():
    assert set(registry.available_backends()) >= {"auto", "torch", "sdpa", "triton", "flash_attn"}


@pytest.mark.parametrize("name", ["triton", "flash_attn"])
def test_cuda_only_backend_on_cpu_is_a_config_error(name):
    with pytest.raises(ConfigError, match=f"attention backend '{name}' does not run on cpu"):
        get_attention_backend(name, "cpu")


def test_missing_package_is_a_config_error_naming_the_fix(monkeypatch):
    def fail(name):
        raise ImportError("No module named 'flash_attn'")

    monkeypatch.setattr(registry.importlib, "import_module", fail)
    with pytest.raises(ConfigError, match=r"needs the flash-attn package: pip install"):
        get_attention_backend("flash_attn", "cuda")
    with pytest.raises(ConfigError, match=r"needs the triton package: pip install"):
        get_attention_backend("triton", "cuda")


def test_auto_on_cuda_falls_back_with_one_line_per_skip(monkeypatch, caplog):
    """No CUDA here: pretend the device is CUDA and that neither flash-attn nor triton import."""
    real = registry.importlib.import_module

    def fake_import(module):
        if module in ("specserve.kernels.flash_attn_backend", "specserve.kernels.triton_paged"):
            raise ImportError(f"No module named {module.split('.')[-1]!r}")
        return real(module)

    monkeypatch.setattr(registry.importlib, "import_module", fake_import)
    with caplog.at_level(logging.INFO, logger="specserve.kernels.registry"):
        backend = get_attention_backend("auto", "cuda", block_size=256)
    assert backend.name == "sdpa"
    lines = [r.getMessage() for r in caplog.records]
    assert any("'flash_attn' skipped" in m and "pip install" in m for m in lines), lines
    assert any("'triton' skipped" in m for m in lines), lines
    assert any("attention backend: sdpa (auto, device cuda)" in m for m in lines), lines


def test_auto_skips_flash_attn_for_an_unsupported_block_size(monkeypatch, caplog):
    import types

    fake = types.ModuleType("specserve.kernels.flash_attn_backend")

    class Fake:
        name = "flash_attn"

        @staticmethod
        def unsupported_reason(block_size):
            return None if block_size % 256 == 0 else f"block size {block_size} not supported"

    fake.FlashAttnPagedAttention = Fake
    real = registry.importlib.import_module
    monkeypatch.setattr(
        registry.importlib, "import_module",
        lambda m: fake if m == "specserve.kernels.flash_attn_backend" else real(m),
    )
    with caplog.at_level(logging.INFO, logger="specserve.kernels.registry"):
        backend = get_attention_backend("auto", "cuda", block_size=16)
    assert backend.name in ("triton", "sdpa")
    assert any("block size 16" in r.getMessage() for r in caplog.records)
    assert get_attention_backend("auto", "cuda", block_size=512).name == "flash_attn"
    with pytest.raises(ConfigError, match="block size 16"):
        get_attention_backend("flash_attn", "cuda", block_size=16)
