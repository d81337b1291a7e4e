"""Block-quantized weights: llama.cpp's Q4_1 and Q8_0 formats (32 weights per block), held as
planes of the file's own numbers, and the linear layer that computes with them.

    Q4_1: w = d * q + m, q in 0..15, one scale d and one min m per 32 weights ("int4")
    Q8_0: w = d * q,     q in -127..127, one scale d per 32 weights        ("int8")

GGUF Q4_0 (w = d * (q - 8)) loads as Q4_1 with m = -8 d, which is the same number exactly.
``from_gguf_blocks`` reads the file's block bytes without a round trip through float;
``quantize`` makes the same formats from float weights (an HF folder with --quantization).
``dequantize`` computes d * q + m in float32, as the gguf package (and so transformers) does, so
the values are bit-identical to transformers' GGUF loading.

``BlockQuantLinear`` runs kernels/csrc/qgemm.cpp (int8 activations per block of 32, as llama.cpp
does; batch-invariant). Where that extension cannot be built it dequantizes the weight once and
uses the dense path: slower, same weights.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from specserve.kernels import quant_ext
from specserve.kernels.linear import RowPlan

BLOCK = 32
FORMATS = ("q4_1", "q8_0")
# GGUF tensor type -> (our format, bytes per block of 32 weights)
_GGUF_TYPES = {"Q4_0": ("q4_1", 18), "Q4_1": ("q4_1", 20), "Q8_0": ("q8_0", 34)}


@dataclass
class BlockQuantWeight:
    """A [N, K] weight in blocks of 32 along K. Planes (KB = K // 32):
    qs: uint8 [N, KB, 16] for q4_1 (byte j: q[j] low nibble, q[j+16] high nibble), int8
    [N, KB, 32] for q8_0; d, m: float32 [N, KB] (m is None for q8_0)."""

    fmt: str
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return self.qs.shape[0], self.qs.shape[1] * BLOCK

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qs, self.d, self.m) if t is not None)

    def codes(self) -> torch.Tensor:
        """The integer codes q as int32 [N, K] in weight order."""
        if self.fmt == "q8_0":
            return self.qs.to(torch.int32).flatten(1)
        lo, hi = self.qs & 0x0F, self.qs >> 4  # [N, KB, 16] each
        return torch.cat([lo, hi], dim=-1).to(torch.int32).flatten(1)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: d * q (+ m), exactly as the gguf package computes it."""
        q = self.codes().to(torch.float32).view(*self.d.shape, BLOCK)  # [N, KB, 32]
        w = self.d[..., None] * q
        if self.m is not None:
            w = w + self.m[..., None]
        return w.flatten(1)

    def rows(self, index: torch.Tensor) -> BlockQuantWeight:
        """The weight with its rows reordered/selected by ``index`` (blocks run along K, so
        whole rows move as they are)."""
        pick = lambda t: None if t is None else t.index_select(0, index).contiguous()
        return BlockQuantWeight(self.fmt, pick(self.qs), pick(self.d), pick(self.m))

    @staticmethod
    def cat(parts: list[BlockQuantWeight]) -> BlockQuantWeight:
        """Stacks weights along N (fused q|k|v, gate|up)."""
        fmts = {p.fmt for p in parts}
        if len(fmts) != 1:
            raise ValueError(f"cannot fuse weights of different formats {sorted(fmts)}")
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])  # type: ignore[misc]
        return BlockQuantWeight(
            parts[0].fmt, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m
        )


def gguf_format(type_name: str) -> str | None:
    """Our format for a GGUF tensor type name (Q4_0, Q4_1, Q8_0), None if we keep it float."""
    entry = _GGUF_TYPES.get(type_name)
    return None if entry is None else entry[0]


def from_gguf_blocks(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> BlockQuantWeight:
    """raw: the tensor's bytes as uint8 [N, KB * bytes_per_block], as gguf.GGUFReader maps them;
    shape: (N, K) in PyTorch order."""
    if type_name not in _GGUF_TYPES:
        raise ValueError(f"GGUF type {type_name} has no packed form here (use Q4_0, Q4_1, Q8_0)")
    fmt, nb = _GGUF_TYPES[type_name]
    n, k = shape
    if k % BLOCK:
        raise ValueError(f"a {type_name} tensor needs K divisible by {BLOCK} (got {shape})")
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(n, k // BLOCK, nb))
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].to(torch.float32)
    if type_name == "Q8_0":
        qs = blocks[..., 2:].contiguous().view(torch.int8)
        return BlockQuantWeight(fmt, qs, d.contiguous(), None)
    if type_name == "Q4_1":
        m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].to(torch.float32)
        return BlockQuantWeight(fmt, blocks[..., 4:].contiguous(), d.contiguous(), m.contiguous())
    # Q4_0: w = d (q - 8) = d q + (-8 d); both forms are exact in float32.
    return BlockQuantWeight(fmt, blocks[..., 2:].contiguous(), d.contiguous(), (-8.0 * d))


def quantize(weight: torch.Tensor, fmt: str) -> BlockQuantWeight:
    """float [N, K] -> blocks (round to nearest; q4_1 spans each block's [min, max] as
    llama.cpp's reference quantizer does, q8_0 scales by the block's absolute max; scales and
    mins float16 as in the file format)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown block format {fmt!r}; choose one of {', '.join(FORMATS)}")
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"quantizing needs K divisible by {BLOCK} (got {tuple(weight.shape)})")
    w = weight.detach().to(torch.float32).reshape(n, k // BLOCK, BLOCK)
    if fmt == "q8_0":
        d = w.abs().amax(-1) / 127.0  # [N, KB]
        inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
        q = torch.round(w * inv[..., None]).clamp(-127, 127).to(torch.int8)
        return BlockQuantWeight(fmt, q.contiguous(), _half_exact(d), None)
    lo, hi = w.amin(-1), w.amax(-1)
    d = (hi - lo) / 15.0
    inv = torch.where(d > 0, 1.0 / d, torch.zeros_like(d))
    q = torch.round((w - lo[..., None]) * inv[..., None]).clamp(0, 15).to(torch.uint8)
    qs = q[..., :16] | (q[..., 16:] << 4)
    return BlockQuantWeight(fmt, qs.contiguous(), _half_exact(d), _half_exact(lo))


def _half_exact(t: torch.Tensor) -> torch.Tensor:
    """The block's scale or min as the format stores it: float16 (codes are rounded with the
    unrounded scale, as llama.cpp's quantizers do), held as float32."""
    return t.to(torch.float16).to(torch.float32).contiguous()


LANES = 8  # output features interleaved per group in the kernel's layout (kernels/csrc/qgemm.cpp)


def pack(weight: BlockQuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The planes in the C++ kernel's layout: 8 output features interleaved, N padded with zero
    features to a multiple of 8, scales and mins float16 (the file's own width: a 1-row step
    reads every weight byte once, so 4-byte scales cost it 17% more memory traffic). Returns
    (qs [G, KB, 128 | 256], d [G, KB, 8], m [G, KB, 8] or None)."""
    for plane in (weight.d, weight.m):
        if plane is not None and not torch.equal(plane.to(torch.float16).to(plane.dtype), plane):
            raise ValueError("block scales and mins must be float16 values (GGUF's own, or "
                             "kernels.quant.quantize's)")
    n, kb = weight.d.shape
    g = -(-n // LANES)
    pad = g * LANES - n
    codes = weight.codes().view(n, kb, BLOCK)
    d, m = weight.d, weight.m
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad, kb, BLOCK)])
        d = torch.cat([d, d.new_zeros(pad, kb)])
        m = None if m is None else torch.cat([m, m.new_zeros(pad, kb)])
    lanes = lambda t: t.view(g, LANES, kb).permute(0, 2, 1).to(torch.float16).contiguous()
    c = codes.view(g, LANES, kb, BLOCK).permute(0, 2, 1, 3)  # [G, KB, feature, code]
    if weight.fmt == "q8_0":
        # vector v, byte 4 * feature + t: code 4 v + t
        qs = c.reshape(g, kb, LANES, 8, 4).permute(0, 1, 3, 2, 4).reshape(g, kb, 256)
        return qs.to(torch.int8).contiguous(), lanes(d), None
    # vector v, byte 4 * feature + t: code 4 v + t (low nibble), 16 + 4 v + t (high nibble)
    c = c.reshape(g, kb, LANES, 2, 4, 4)
    qs = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).permute(0, 1, 3, 2, 4).reshape(g, kb, 128)
    assert m is not None
    return qs.to(torch.uint8).contiguous(), lanes(d), lanes(m)


def unpack(fmt: str, n: int, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None
           ) -> BlockQuantWeight:
    """``pack``'s inverse: the planes of the first ``n`` features in the file's layout."""
    g, kb, _ = qs.shape
    rows = lambda t: t.permute(0, 2, 1).reshape(g * LANES, kb)[:n].to(torch.float32).contiguous()
    if fmt == "q8_0":
        codes = qs.view(g, kb, 8, LANES, 4).permute(0, 3, 1, 2, 4).reshape(g * LANES, kb, BLOCK)
        return BlockQuantWeight(fmt, codes[:n].contiguous(), rows(d), None)
    nib = qs.view(g, kb, 4, LANES, 4).permute(0, 3, 1, 2, 4)  # [G, feature, KB, v, t]
    q = torch.stack([nib & 0x0F, nib >> 4], dim=3)  # [G, feature, KB, half, v, t]
    q = q.reshape(g * LANES, kb, BLOCK)[:n]
    file_qs = q[..., :16] | (q[..., 16:] << 4)
    assert m is not None
    return BlockQuantWeight(fmt, file_qs.to(torch.uint8).contiguous(), rows(d), rows(m))


_DEFAULT_KERNEL = 4  # AVX2, 4 rows per pass: runs on every CPU the extension builds for
_kernel_codes = functools.cache(quant_ext.kernel_code)


class BlockQuantLinear(nn.Module):
    """y = x @ W^T (+ bias) with W block-quantized. Float32 in, float32 out. The planes are
    buffers in the kernel's layout (``pack``: 8 features interleaved, N padded to a multiple of
    8), so ``.to()`` and ``state_dict`` see them; ``weight`` gives the file's layout back."""

    def __init__(self, weight: BlockQuantWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.fmt = weight.fmt
        self.out_features, self.in_features = weight.shape
        qs, d, m = pack(weight)
        self.register_buffer("qs", qs)
        self.register_buffer("d", d)
        self.register_buffer("m", m)
        if bias is not None:  # padded like the planes: the kernel adds 8 features at a time
            bias = bias.to(torch.float32)
            bias = torch.cat([bias, bias.new_zeros(qs.shape[0] * LANES - bias.numel())])
        self.register_buffer("bias", bias)
        # Kernel per row count ("<isa>/<rows sharing each unpacked weight block>"): numerically
        # irrelevant (every form gives the same bits, batch-invariant), so the tuner
        # (kernels/tuner.py) picks by speed alone.
        self.rows_plan: RowPlan | None = None
        self._dense: torch.Tensor | None = None
        self._ext = quant_ext.load() if quant_ext.available() else None
        self._planes = self._plain_planes()

    def _plain_planes(self) -> tuple:
        """The buffers as plain attributes: a decode step makes 121 of these calls, and reading
        buffers through nn.Module.__getattr__ cost ~1 us each."""
        return (self.qs, self.d, self.m, self.bias)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        out = super()._apply(fn, recurse)
        self._planes = self._plain_planes()
        return out

    @property
    def weight(self) -> BlockQuantWeight:
        """The weight in the file's layout (unpacked on each call: for tests and fallbacks)."""
        return unpack(self.fmt, self.out_features, self.qs, self.d, self.m)

    @property
    def padded(self) -> bool:
        """True when N is not a multiple of 8: the kernel's output has zero features to cut."""
        return self.out_features % LANES != 0

    def kernel(self, rows: int) -> int:
        """block_linear's kernel argument for ``rows`` rows (32 * isa + rows per pass)."""
        plan = self.rows_plan
        return _DEFAULT_KERNEL if plan is None else _kernel_codes(plan.get(rows))

    @property
    def has_kernel(self) -> bool:
        """True when the C++ block kernels run this layer (else: dequantized, dense)."""
        return self._ext is not None

    @property
    def planes(self) -> tuple:
        """(qs, d, m or None, bias or None), as the C++ kernels take them."""
        return self._planes

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        return self.run(x, self.kernel(x.shape[0]))

    def run(self, x: torch.Tensor, kernel: int = _DEFAULT_KERNEL) -> torch.Tensor:
        """y for x with block_linear's ``kernel`` (32 * isa + rows per pass; the dense fallback
        ignores it)."""
        ext = self._ext
        if ext is not None and x.device.type == "cpu":
            if x.dtype != torch.float32 or not x.is_contiguous():
                x = x.to(torch.float32).contiguous()
            y = ext.block_linear(x, *self._planes, kernel)
            return y[:, : self.out_features].contiguous() if self.padded else y
        if self._dense is None or self._dense.device != x.device:
            self._dense = self.weight.dequantize().to(x.device)
        bias = None if self.bias is None else self.bias[: self.out_features]
        return nn.functional.linear(x.to(torch.float32), self._dense, bias)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fmt}"
