"""The C++ paged attention (kernels/csrc/fused.cpp) in all of its forms (AVX2, and AVX-512 and
AVX-512 BF16 products where the CPU has them; tiles; key segments) and with float32, float16 and
bfloat16 caches: against a float64 reference, and verify rows bit for bit equal to decode rows."""

from __future__ import annotations

import pytest
import torch

from specserve.kernels.attention_form import supported_forms

FORMS = supported_forms(16)  # the tests' head_dim; [] without the extension fails loudly below
# bfloat16 caches at head_dim 32 (the bfloat16-product form needs a multiple of 32)
BF16_FORMS = supported_forms(32, torch.bfloat16)
DOT_FORMS = [f for f in BF16_FORMS if f % 1024 // 64 == 2]


def test_the_default_form_runs_everywhere_the_extension_does():
    from specserve.kernels.attention_form import DEFAULT

    assert FORMS[:1] == [DEFAULT]


def _attention_case(seed: int, query_lens: list[int], ctx_lens: list[int], window: int | None,
                    cache_dtype: torch.dtype = torch.float32, head_dim: int = 16):
    from specserve.kernels.metadata import AttentionMetadata

    g = torch.Generator().manual_seed(seed)
    bs, H, KVH, D = 4, 4, 2, head_dim
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

    backend = CpuPagedAttention(form=form)
    case = _attention_case(9, [5, 1, 3], [12, 7, 10], window, cache_dtype)
    q, k, v, kc, vc, meta, _ = case
    verify = backend.forward(q, k, v, kc, vc, meta, 0.3, window)  # writes all new K/V
    _assert_each_row_equals_its_decode(backend, case, verify, 0.3)


def _assert_each_row_equals_its_decode(backend, case, batch: torch.Tensor, scale: float) -> None:
    """Every row of ``batch`` (a call over ``case``) equals a one-row call at its position."""
    from specserve.kernels.metadata import AttentionMetadata

    q, k, v, kc, vc, meta, window = case
    tables = [meta.block_tables[b].tolist() for b in range(len(meta.query_lens_cpu))]
    start = 0
    for b, (n, ctx) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
        for j in range(n):
            t = start + j
            one = AttentionMetadata.build([1], [ctx - n + j + 1], [tables[b]], meta.block_size)
            row = backend.forward(q[t: t + 1], k[t: t + 1], v[t: t + 1], kc, vc, one, scale,
                                  window)
            assert torch.equal(row[0], batch[t]), (b, j)
        start += n


@pytest.mark.parametrize("form", [f for f in FORMS if f >= 1024])
@pytest.mark.parametrize("window", [None, 200])
def test_key_segments_fold_to_the_same_bits_in_any_call(window, form):
    """Forms with key segments (128 to 512 positions): contexts of 300-700 keys, rows straddling
    segment boundaries. Each row equals the float64 reference, and equals itself computed alone
    (a decode row: its segments split over the threads, then folded) and inside a batch of 9
    sequences (enough items that each item folds its own segments as it goes)."""
    from specserve.kernels.cpu_paged import CpuPagedAttention
    from specserve.kernels.torch_ref import TorchPagedAttention

    backend = CpuPagedAttention(form=form)
    ctx = [260, 300, 513, 700, 129, 640, 384, 385, 200]
    qlen = [5, 1, 3, 17, 2, 1, 4, 1, 1]
    case = _attention_case(11, qlen, ctx, window)
    q, k, v, kc, vc, meta, _ = case
    batch = backend.forward(q, k, v, kc, vc, meta, 0.2, window)
    meta.plan_cache.clear()
    ref = TorchPagedAttention().forward(q.double(), k.double(), v.double(), kc.double(),
                                        vc.double(), meta, 0.2, window)
    torch.testing.assert_close(batch.double(), ref, rtol=1e-5, atol=1e-5)
    _assert_each_row_equals_its_decode(backend, case, batch, 0.2)


@pytest.mark.slow
def test_attention_form_is_measured_once_and_cached(tmp_path, monkeypatch):
    """Tuning off: the numerics' first tile, no timing. On: one of the candidates, written to
    the cache; a second engine start reads it back without timing."""
    from specserve.kernels import attention_form

    candidates = attention_form.candidate_forms(64)
    assert attention_form.choose_form(9, 3, 64, tmp_path, measure=False) == candidates[0]
    form = attention_form.choose_form(9, 3, 64, tmp_path)
    assert form in candidates
    if len(candidates) > 1:
        assert list(tmp_path.glob("attention-*.json"))

        def no_timing(*args, **kwargs):
            raise AssertionError("the cached choice must be read, not re-measured")

        monkeypatch.setattr(attention_form, "time_forms", no_timing)
        assert attention_form.choose_form(9, 3, 64, tmp_path) == form


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_what_timing_chooses_never_changes_a_bit(tmp_path, monkeypatch, cache_dtype):
    """Whichever candidate the timing favours (each in turn, and tuning off), the form has the
    process's numerics, and a long prefill, a decode row and a verify through it give the
    same bits as through every other candidate; a cached record of a form outside the
    numerics (written before they were fixed) is timed again, not run."""
    import json

    from specserve.kernels import attention_form
    from specserve.kernels.cpu_paged import CpuPagedAttention

    candidates = attention_form.candidate_forms(16, cache_dtype)
    isa, seg = attention_form.numerics(16, cache_dtype)
    assert candidates and all(f // 1024 == seg and f % 1024 // 64 == isa for f in candidates)
    assert attention_form.choose_form(4, 2, 16, None, measure=False,
                                      cache_dtype=cache_dtype) in candidates
    for favoured in candidates:
        def timing(*args, favoured=favoured, **kwargs):
            return {f: 1.0 if f == favoured else 2.0 for f in args[3]}, 1

        monkeypatch.setattr(attention_form, "time_forms", timing)
        assert attention_form.choose_form(4, 2, 16, None, cache_dtype=cache_dtype) == favoured
    other = next(f for f in attention_form.supported_forms(16, cache_dtype)
                 if f not in candidates)
    attention_form.choose_form(4, 2, 16, tmp_path, cache_dtype=cache_dtype)
    (record,) = tmp_path.glob("attention-*.json")
    record.write_text(json.dumps({"form": other}))
    assert attention_form.choose_form(4, 2, 16, tmp_path, cache_dtype=cache_dtype) in candidates
    # a context of 600 keys: several segments, a 300-row prefill chunk, a verify, a decode row
    q, k, v, kc, vc, meta, _ = _attention_case(11, [300, 5, 1], [600, 600, 600], None,
                                               cache_dtype)
    outs = [CpuPagedAttention(form=f).forward(q, k, v, kc.clone(), vc.clone(), meta, 0.25, None)
            for f in candidates]
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_an_unsupported_attention_form_names_the_forms():
    from specserve.kernels import quant_ext

    q, k, v, kc, vc, meta, _ = _attention_case(3, [1], [5], None)
    with pytest.raises(RuntimeError, match="does not run here"):
        quant_ext.load().paged_attention(q, kc, vc, meta.block_tables,
                                         torch.zeros(1, dtype=torch.int64),
                                         torch.tensor([4]), 0.25, 0, 64 * 5 + 8)


def _bf16_reference(case, scale: float, dot: bool) -> torch.Tensor:
    """float64 attention over the bfloat16 cache (and, for the bfloat16-product form, the
    bfloat16-rounded queries: the weights' rounding is left out, so compare loosely)."""
    from specserve.kernels.torch_ref import TorchPagedAttention

    q, k, v, kc, vc, meta, window = case
    meta.plan_cache.clear()
    q64 = (q.to(torch.bfloat16) if dot else q).double()
    return TorchPagedAttention().forward(
        q64, k.to(torch.bfloat16).double(), v.to(torch.bfloat16).double(), kc.double(),
        vc.double(), meta, scale, window)


@pytest.mark.parametrize("form", BF16_FORMS)
@pytest.mark.parametrize("window", [None, 7])
def test_bfloat16_cache_matches_float64_reference(window, form):
    """A bfloat16 cache: written rounded to nearest even as torch rounds, then read by every form.
    The widening forms compute exactly as with a float16 cache (tight); the bfloat16-product
    form rounds queries and weights to bfloat16 (loose: a weight's rounding moves an output by
    ~2^-9 of a value). Decodes, verifies and a 40-token prefill at odd and even positions."""
    from specserve.kernels.cpu_paged import CpuPagedAttention

    case = _attention_case(21, [1, 4, 40, 3], [9, 14, 40, 77], window, torch.bfloat16, 32)
    q, k, v, kc, vc, meta, _ = case
    out = CpuPagedAttention(form=form).forward(q, k, v, kc, vc, meta, 0.2, window)
    assert torch.equal(kc.view(-1, *k.shape[1:])[meta.slot_mapping], k.to(torch.bfloat16))
    assert torch.equal(vc.view(-1, *v.shape[1:])[meta.slot_mapping], v.to(torch.bfloat16))
    dot = form in DOT_FORMS
    ref = _bf16_reference(case, 0.2, dot)
    tol = 1e-2 if dot else 1e-5
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("form", DOT_FORMS)
def test_bfloat16_products_pair_every_key_with_its_own_value(form):
    """Keys all zero: every weight is exactly 1, so each row's output is the plain mean of its
    visible values, to float32 rounding. Rows start and end at odd and even positions (a sliding
    window of 5 and 6, contexts of 1 to 300), so a key pair's missing half, chunk and segment
    boundaries and the value dims' interleaving are all checked without the weights' rounding."""
    from specserve.kernels.cpu_paged import CpuPagedAttention
    from specserve.kernels.torch_ref import TorchPagedAttention

    for window in (None, 5, 6):
        case = _attention_case(23, [1, 2, 5, 1, 17], [1, 6, 131, 300, 200], window,
                               torch.bfloat16, 32)
        q, k, v, kc, vc, meta, _ = case
        kc.zero_()
        k = torch.zeros_like(k)
        out = CpuPagedAttention(form=form).forward(q, k, v, kc, vc, meta, 0.3, window)
        meta.plan_cache.clear()
        ref = TorchPagedAttention().forward(q.double(), k.double(), v.to(torch.bfloat16).double(),
                                            kc.double(), vc.double(), meta, 0.3, window)
        torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("form", BF16_FORMS)
@pytest.mark.parametrize("window", [None, 3, 200])
def test_bfloat16_cache_verify_rows_equal_decode_rows(window, form):
    """With a bfloat16 cache, every form (the bfloat16-product one included: its key pairs go
    by absolute position) gives a verify row exactly the bits of a decode row at its position,
    across segment boundaries and in a batch of 9 sequences or alone."""
    from specserve.kernels.cpu_paged import CpuPagedAttention

    backend = CpuPagedAttention(form=form)
    ctx = [260, 301, 513, 700, 129, 640, 384, 385, 12]
    qlen = [5, 1, 3, 17, 2, 1, 4, 1, 5]
    case = _attention_case(25, qlen, ctx, window, torch.bfloat16, 32)
    q, k, v, kc, vc, meta, _ = case
    batch = backend.forward(q, k, v, kc, vc, meta, 0.2, window)
    _assert_each_row_equals_its_decode(backend, case, batch, 0.2)
