"""Every GGUF block type with a kernel (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K), from
random valid blocks built here (random code and scale bytes, finite float16 scale fields):
dequantization equals gguf's own bit for bit; the kernel's product is within the activation
rounding of a float64 product of the same blocks; row i of an M-row call equals the 1-row call
bit for bit for M = 1..17, every kernel form and 1, 2 or 3 threads."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch

from specserve.kernels import quant_ext, thread_policy
from specserve.kernels.gguf_blocks import GGUF_TYPES
from specserve.kernels.quant import (
    BlockQuantLinear,
    BlockQuantWeight,
    code_class,
    from_gguf_blocks,
)
from specserve.kernels.thread_policy import ThreadPolicy
from tests.helpers.gguf_blocks import random_blocks

ext = quant_ext.load()

TYPES = list(GGUF_TYPES)
def _gguf_reference(type_name: str, raw: np.ndarray, n: int, k: int) -> torch.Tensor:
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    return torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k))


@pytest.mark.parametrize("type_name", TYPES)
def test_dequantize_equals_gguf_bit_for_bit(type_name):
    n, k = 24, 512
    raw = random_blocks(type_name, n, k, 1)
    ours = from_gguf_blocks(type_name, raw, (n, k)).dequantize()
    ref = _gguf_reference(type_name, raw, n, k)
    assert ours.dtype == ref.dtype == torch.float32
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("type_name", TYPES)
def test_kernel_layout_round_trips(type_name):
    """The kernel's packed planes give the file's numbers back (N not a multiple of 8)."""
    n, k = 21, 256
    weight = from_gguf_blocks(type_name, random_blocks(type_name, n, k, 2), (n, k))
    back = BlockQuantLinear(weight).weight
    assert back.fmt == weight.fmt and torch.equal(back.dequantize(), weight.dequantize())


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", [1, 5, 17])
def test_kernel_within_activation_rounding_of_float64(type_name, rows):
    """The kernel rounds activations to int8 per block of 32 (scale amax/127, as llama.cpp's
    Q8_0 activations); the weights are used exactly. So per output
    |y - x @ W^T| <= sum over blocks b of (amax_b / 254) * sum |w| over the block
    (half a code step of x times the weights it meets), plus float32 rounding of the
    accumulation, bounded by 1e-5 * (|x| @ |W|^T + 1) (at most ~60 float32 adds and products per
    output here, each within 2^-24 relative). Checked for every output."""
    n, k = 40, 768
    w = from_gguf_blocks(type_name, random_blocks(type_name, n, k, 3), (n, k))
    dense = w.dequantize().double()
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g)
    y = BlockQuantLinear(w, bias)(x).double()
    ref = x.double() @ dense.T + bias.double()
    step = x.abs().view(rows, -1, 32).amax(-1).double() / 254.0  # [M, KB]
    bound = torch.einsum("mb,nbk->mn", step, dense.abs().view(n, -1, 32))
    bound += 1e-5 * (x.double().abs() @ dense.abs().T + 1.0)
    err = (y - ref).abs()
    assert (err <= bound).all(), float((err - bound).max())
    assert err.max() > 0  # the rounding is real: the bound is not vacuous


@contextlib.contextmanager
def _threads(n: int):
    before_policy, before = thread_policy.current(), torch.get_num_threads()
    thread_policy.apply(ThreadPolicy())  # the team follows torch's count
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
        thread_policy.apply(before_policy)


def _forms() -> list[int]:
    return [quant_ext.kernel_code(f"{isa}/{r}") for isa in quant_ext.supported_isas()
            for r in quant_ext.ROWS_PER_PASS[isa]]


@pytest.mark.parametrize("type_name", TYPES)
def test_rows_equal_the_one_row_call_bit_for_bit(type_name):
    n, k = 200, 512  # 25 groups of 8 features: an odd count, split unevenly over threads
    w = from_gguf_blocks(type_name, random_blocks(type_name, n, k, 4), (n, k))
    lin = BlockQuantLinear(w, torch.randn(n))
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(5))
    with _threads(1):
        single = torch.cat([lin.run(x[i: i + 1], quant_ext.kernel_code("avx2/1"))
                            for i in range(17)])
    for threads in (1, 2, 3):
        with _threads(threads):
            for code in _forms():
                for rows in range(1, 18):
                    got = lin.run(x[:rows], code)
                    assert torch.equal(got, single[:rows]), (threads, code, rows)


# The kernels' code class each type's codes fall in (kernels/quant.py, qgemm.cpp): the offset
# forms for the small-range codes, the sign form for Q8_0 and Q4_1's packed nibbles.
EXPECTED_CLASS = {"Q4_0": 0, "Q4_1": 0, "Q8_0": 0, "Q5_0": 2, "Q5_1": 1, "Q4_K": 1, "Q5_K": 1,
                  "Q6_K": 3}


@pytest.mark.parametrize("type_name", TYPES)
def test_code_class_forms_equal_the_sign_form_bit_for_bit(type_name):
    """Every row count, rows per pass and thread count: the layer's offset form (u = q + off,
    16-bit sums of pair products) gives the sign form's bits, since both integer dots are exact."""
    n, k = 200, 512
    w = from_gguf_blocks(type_name, random_blocks(type_name, n, k, 11), (n, k))
    lin = BlockQuantLinear(w, torch.randn(n), five_bit=False)  # int8 codes run every class
    cls = code_class(lin.qs)
    assert cls == EXPECTED_CLASS[type_name]
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(12))
    for threads in (1, 2):
        with _threads(threads):
            for code in (quant_ext.kernel_code(f"avx2/{r}") for r in (1, 2, 4, 8)):
                for rows in range(1, 18):
                    sign = ext.block_linear(x[:rows], *lin.planes, code)
                    offset = ext.block_linear(x[:rows], *lin.planes, code | 256 * cls)
                    assert torch.equal(sign, offset), (threads, code, rows)


def test_five_bit_codes_give_the_int8_codes_bits():
    """Q5_0's codes held again five bits a weight (160 bytes a block of 8 features against 256):
    the five-bit form gives the int8 forms' bits for every row count, rows per pass and thread
    count; the whole-layer path picks them by the same kernel bit; codes outside -16..15 get
    none; and the bit without five-bit planes is refused with the fix."""
    n, k = 200, 512
    w = from_gguf_blocks("Q5_0", random_blocks("Q5_0", n, k, 13), (n, k))
    lin = BlockQuantLinear(w, torch.randn(n), five_bit=True)
    assert lin.five_bit and code_class(lin.qs) == 2
    assert lin.qs5.numel() * 256 == lin.qs.numel() * 160
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(14))
    five = [quant_ext.kernel_code(f"{quant_ext.FIVE_BIT}/{r}") for r in (1, 2, 4, 8)]
    for threads in (1, 2, 3):
        with _threads(threads):
            for code in five:
                for rows in range(1, 18):
                    ref = lin.run(x[:rows], quant_ext.kernel_code("avx2/1"))
                    assert torch.equal(lin.run(x[:rows], code), ref), (threads, code, rows)
    full = from_gguf_blocks("Q8_0", random_blocks("Q8_0", n, k, 15), (n, k))
    assert not BlockQuantLinear(full, five_bit=True).five_bit
    assert not BlockQuantLinear(w, five_bit=False).five_bit
    with pytest.raises(RuntimeError, match="pass qs5"):
        ext.block_linear(x[:1], *lin.planes, five[0] | 512)
    with pytest.raises(RuntimeError, match="five-bit codes"):  # they hold class 2 only
        ext.block_linear(x[:1], *lin.planes, five[0], lin.qs5)


def test_code_class_holds_for_every_code():
    """A class is chosen only when every code lies in its range: one code outside (Q5_0's
    range plus a 16, a Q6_K range plus a -33, a 32) falls back to a wider class or the sign form."""
    def q(*codes: int) -> torch.Tensor:
        return torch.tensor(codes, dtype=torch.int8)

    assert code_class(q(0, 31)) == 1
    assert code_class(q(-16, 15)) == 2
    assert code_class(q(-16, 16)) == 3
    assert code_class(q(-32, 31)) == 3
    assert code_class(q(-33, 0)) == 0
    assert code_class(q(0, 32)) == 0  # above class 1 and class 3 ranges
    assert code_class(q(0, 127)) == 0
    assert code_class(torch.zeros(4, dtype=torch.uint8)) == 0  # Q4_1's packed nibbles


def test_mixed_formats_fuse_exactly():
    """q (Q5_0 -> q8_0), k (Q4_K -> q8_f, with mins) and v (Q8_0) of one layer fuse as Q8_F
    with the same numbers, and the fused kernel equals the parts' kernels bit for bit."""
    k = 256
    parts = [from_gguf_blocks(t, random_blocks(t, n, k, 6 + i), (n, k))
             for i, (t, n) in enumerate([("Q5_0", 16), ("Q4_K", 8), ("Q8_0", 8)])]
    fused = BlockQuantWeight.cat(parts)
    assert fused.fmt == "q8_f"
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(9))
    y = BlockQuantLinear(fused)(x)
    y_q = BlockQuantLinear(parts[0].as_q8f())(x)
    assert torch.equal(y[:, :16], y_q)
