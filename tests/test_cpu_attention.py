"""The C++ paged attention (kernels/csrc/fused.cpp) in both of its forms (AVX2, and AVX-512 where
the CPU has it) and with float32 and float16 caches: against a float64 reference, and verify
rows bit for bit equal to decode rows."""

from __future__ import annotations

import pytest
import torch

from specserve.kernels.attention_form import supported_forms

FORMS = supported_forms(16)  # the tests' head_dim; [] without the extension fails loudly below


def test_the_default_form_runs_everywhere_the_extension_does():
    from specserve.kernels.attention_form import DEFAULT

    assert FORMS[:1] == [DEFAULT]


def _attention_case(seed: int, query_lens: list[int], ctx_lens: list[int], window: int | None,
                    cache_dtype: torch.dtype = torch.float32):
    from specserve.kernels.metadata import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    bs, H, KVH, D = 4, 4, 2, 16
    blocks_per = [-(-c // bs) for c in ctx_lens]
    perm = torch.randperm(sum(blocks_per) + 3, generator=g).tolist()
    tables, i = [], 0
    for n in blocks_per:
        tables.append(perm[i: i + n])
        i += n
    meta = AttentionMetadata.build(query_lens, ctx_lens, tables, bs)
    n_blocks = len(perm)
    k_cache = torch.randn(n_blocks, bs, KVH, D, generator=g).to(cache_dtype)
    v_cache = torch.randn(n_blocks, bs, KVH, D, generator=g).to(cache_dtype)
    T = sum(query_lens)
    q = torch.randn(T, H, D, generator=g)
    k = torch.randn(T, KVH, D, generator=g)
    v = torch.randn(T, KVH, D, generator=g)
    return q, k, v, k_cache, v_cache, meta, window


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 5])
def test_cpu_paged_attention_matches_float64_reference(window, cache_dtype, form):
    """Against the torch reference backend run in float64 on the same inputs (with a float16
    cache: the float16-rounded keys and values, which is what the cache holds); mixed decode,
    verify and a long prefill (which takes the SDPA path) in one step."""
    from specserve.kernels.cpu_paged import CpuPagedAttention
    from specserve.kernels.torch_ref import TorchPagedAttention

    q, k, v, kc, vc, meta, window = _attention_case(5, [1, 4, 20], [9, 13, 20], window,
                                                    cache_dtype)
    out = CpuPagedAttention(max_kernel_query=16, form=form).forward(q, k, v, kc, vc, meta, 0.25,
                                                                     window)
    meta.plan_cache.clear()
    torch.testing.assert_close(
        CpuPagedAttention(form=form).forward(q, k, v, kc, vc, meta, 0.25, window), out, rtol=0,
        atol=2e-6,
    )
    kc64, vc64 = kc.double(), vc.double()
    meta.plan_cache.clear()
    ref = TorchPagedAttention().forward(
        q.double(), k.to(cache_dtype).double(), v.to(cache_dtype).double(), kc64, vc64, meta,
        0.25, window,
    )
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    # written at the slots, rounded to nearest even as torch rounds float32 -> float16
    assert torch.equal(kc.view(-1, *k.shape[1:])[meta.slot_mapping], k.to(cache_dtype))
    assert torch.equal(vc.view(-1, *v.shape[1:])[meta.slot_mapping], v.to(cache_dtype))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("window", [None, 3])
def test_cpu_paged_attention_verify_rows_equal_decode_rows(window, cache_dtype, form):
    """A verify of k+1 tokens gives each row exactly what a one-token decode at that position
    gives (same cache), in a batch of other sequences or alone."""
    from specserve.kernels.cpu_paged import CpuPagedAttention
    from specserve.kernels.metadata import AttentionMetadata

    backend = CpuPagedAttention(form=form)
    q, k, v, kc, vc, meta, _ = _attention_case(9, [5, 1, 3], [12, 7, 10], window, cache_dtype)
    verify = backend.forward(q, k, v, kc, vc, meta, 0.3, window)  # writes all new K/V
    tables = [meta.block_tables[b].tolist() for b in range(3)]
    start = 0
    for b, (n, ctx) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
        for j in range(n):
            t = start + j
            one = AttentionMetadata.build([1], [ctx - n + j + 1], [tables[b]], meta.block_size)
            row = backend.forward(q[t: t + 1], k[t: t + 1], v[t: t + 1], kc, vc, one, 0.3,
                                  window)
            assert torch.equal(row[0], verify[t]), (b, j)
        start += n


def test_attention_form_is_measured_once_and_cached(tmp_path, monkeypatch):
    """Tuning off: AVX2, no timing. On: a form this CPU runs, written to the cache; a second
    engine start reads it back without timing (so restarts keep the same form and bits)."""
    from specserve.kernels import attention_form

    assert attention_form.choose_form(9, 3, 64, tmp_path, measure=False) == attention_form.DEFAULT
    form = attention_form.choose_form(9, 3, 64, tmp_path)
    assert form in attention_form.supported_forms(64)
    if len(attention_form.supported_forms(64)) > 1:
        assert list(tmp_path.glob("attention-*.json"))

        def no_timing(*args, **kwargs):
            raise AssertionError("the cached choice must be read, not re-measured")

        monkeypatch.setattr(attention_form, "time_forms", no_timing)
        assert attention_form.choose_form(9, 3, 64, tmp_path) == form


def test_an_unsupported_attention_form_names_the_forms():
    from specserve.kernels import quant_ext

    q, k, v, kc, vc, meta, _ = _attention_case(3, [1], [5], None)
    with pytest.raises(RuntimeError, match="does not run here"):
        quant_ext.load().paged_attention(q, kc, vc, meta.block_tables,
                                         torch.zeros(1, dtype=torch.int64),
                                         torch.tensor([4]), 0.25, 0, 64 * 5 + 8)
