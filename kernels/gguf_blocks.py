"""GGUF block types -> the planes of ``kernels.quant.BlockQuantWeight``, integer for integer:
the file's codes and scales, never a float round trip through the weights.

    Q4_0, Q4_1      -> q4_1  (Q4_0: w = d (q - 8) = d q + (-8 d), exact)
    Q8_0            -> q8_0
    Q5_0            -> q8_0  (codes q - 16 in -16..15 as int8, the file's d)
    Q5_1            -> q8_f  (codes 0..31, d on both half blocks, the file's m)
    Q4_K, Q5_K      -> q8_f  (sub-block of 32: scale d * sc, min -(dmin * m), both exact in
                              float32; codes 0..15 / 0..31)
    Q6_K            -> q8_f  (sub-block of 16: scale d * sc; codes q - 32 in -32..31)

Each form dequantizes (``BlockQuantWeight.dequantize``) with the very float32 operations gguf's
``dequantize`` uses for the type, so the values are bit-identical to what transformers loads.
The 5-bit and K-quant types take 1 byte a code here (their 5-6 bit packing is not kept): more
bytes read per step than the file's, in exchange for one exact, batch-invariant kernel form.
"""

from __future__ import annotations

import numpy as np
import torch

QK = 32  # weights per block (per sub-block of 32 in the K-quants)
QK_K = 256  # weights per K-quant super-block
# GGUF type -> (our format, bytes per block, weights per block)
GGUF_TYPES: dict[str, tuple[str, int, int]] = {
    "Q4_0": ("q4_1", 18, QK), "Q4_1": ("q4_1", 20, QK), "Q8_0": ("q8_0", 34, QK),
    "Q5_0": ("q8_0", 22, QK), "Q5_1": ("q8_f", 24, QK),
    "Q4_K": ("q8_f", 144, QK_K), "Q5_K": ("q8_f", 176, QK_K), "Q6_K": ("q8_f", 210, QK_K),
}


def _half(b: np.ndarray) -> np.ndarray:
    """2 bytes (little-endian float16) along the last axis -> float32 values."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _low_high(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] nibbles: low nibbles first, then high (Q4/Q5 blocks)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _bits(qh: np.ndarray) -> np.ndarray:
    """[..., 4] bytes (a little-endian uint32) -> [..., 32] bits, bit j at j."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K's 12 scale bytes [..., 12] -> 6-bit scales and mins [..., 8] (the first 4
    in the low 6 bits of bytes 0-3 / 4-7; the last 4 split over bytes 8-11's nibbles and the
    top 2 bits of bytes 0-7)."""
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 0x3F, (hi & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([mid & 0x3F, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return sc, mn


def decode(type_name: str, raw: np.ndarray, n: int, k: int
           ) -> tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The tensor's bytes (uint8 [N, blocks * bytes]) -> (format, codes, d, m):
    q4_1: codes uint8 [N, KB, 16] (the file's nibbles), d, m float32 [N, KB];
    q8_0: codes int8 [N, KB, 32], d float32 [N, KB], m None;
    q8_f: codes int8 [N, KB, 32], d float32 [N, KB, 2] (per half block), m float32 [N, KB]
    or None."""
    fmt, nb, per = GGUF_TYPES[type_name]
    b = np.asarray(raw, dtype=np.uint8).reshape(n, k // per, nb)
    kb = k // QK
    t = torch.from_numpy
    if type_name == "Q8_0":
        return fmt, t(b[..., 2:].copy().view(np.int8)), t(_half(b[..., 0:2])), None
    if type_name in ("Q4_0", "Q4_1"):
        d = _half(b[..., 0:2])
        if type_name == "Q4_0":
            return fmt, t(b[..., 2:].copy()), t(d), t(-8.0 * d)
        return fmt, t(b[..., 4:].copy()), t(d), t(_half(b[..., 2:4]))
    if type_name == "Q5_0":
        q = _low_high(b[..., 6:22]) | (_bits(b[..., 2:6]) << 4)  # [N, KB, 32] in 0..31
        return fmt, t((q.astype(np.int16) - 16).astype(np.int8)), t(_half(b[..., 0:2])), None
    if type_name == "Q5_1":
        q = _low_high(b[..., 8:24]) | (_bits(b[..., 4:8]) << 4)
        d = _half(b[..., 0:2])
        return fmt, t(q.astype(np.int8)), t(np.repeat(d[..., None], 2, -1)), \
            t(_half(b[..., 2:4]))
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = _half(b[..., 0:2]), _half(b[..., 2:4])  # [N, SB]
        sc, mn = _k_scales(b[..., 4:16])  # [N, SB, 8]
        qs = b[..., -128:].reshape(n, -1, 4, 1, 32)  # 4 runs of 32 bytes: sub-blocks 2r, 2r+1
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=3).reshape(n, -1, 8, 32)
        if type_name == "Q5_K":
            qh = b[..., 16:48].reshape(n, -1, 1, 32)  # bit i of byte l: sub-block i, code l
            q = q | (((qh >> np.arange(8, dtype=np.uint8)[:, None]) & 1) << 4)
        scale = d[..., None] * sc.astype(np.float32)  # [N, SB, 8], exact
        low = -(dmin[..., None] * mn.astype(np.float32))
        scale = np.repeat(scale.reshape(n, kb, 1), 2, -1)
        return fmt, t(q.reshape(n, kb, 32).astype(np.int8)), t(scale), t(low.reshape(n, kb))
    if type_name == "Q6_K":
        ql = b[..., 0:128].reshape(n, -1, 2, 1, 64)  # two halves of 128 codes
        low = np.concatenate([ql & 0x0F, ql >> 4], axis=3).reshape(n, -1, 2, 4, 32)
        qh = b[..., 128:192].reshape(n, -1, 2, 1, 32)
        high = (qh >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3  # [N, SB, 2, 4, 32]
        q = (low | (high << 4)).astype(np.int16) - 32  # code j of run r of half h
        sc = b[..., 192:208].copy().view(np.int8).astype(np.float32)  # [N, SB, 16]
        d = _half(b[..., 208:210])
        scale = (d[..., None] * sc).reshape(n, kb, 2)  # per 16 codes, exact
        return fmt, t(q.reshape(n, kb, 32).astype(np.int8)), t(scale), None
    raise AssertionError(type_name)
