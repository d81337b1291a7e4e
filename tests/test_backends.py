"""Attention backends other than the torch reference, and how the registry picks them.

The random paged batches and their float64 dense reference are in tests/helpers/attention_cases.py
(the Triton kernel's tests run the same cases).
"""

from __future__ import annotations

import logging
import random

import pytest
import torch

from specserve.core.errors import ConfigError
from specserve.kernels import registry
from specserve.kernels.metadata import AttentionMetadata
from specserve.kernels.registry import get_attention_backend
from tests.helpers.attention_cases import CASES, make_case, run_backend, tolerance


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
