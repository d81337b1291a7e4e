"""Block-quantized weights: llama.cpp's Q4_1 and Q8_0 formats (32 weights per block), and Q8_F
(int8 codes with float32 scales), held as planes of the file's own numbers, and the linear layer
that computes with them.

    Q4_1: w = d * q + m, q in 0..15, one scale d and one min m per 32 weights ("int4")
    Q8_0: w = d * q,     q in -127..127, one scale d per 32 weights        ("int8")
    Q8_F: w = d_h * q (+ m), q int8, a float32 scale d_h per 16 weights (h: the block's half),
          an optional float32 min m per 32: the K-quants and Q5_1 (kernels/gguf_blocks.py)

GGUF Q4_0 (w = d * (q - 8)) loads as Q4_1 with m = -8 d, and Q5_0 (w = d * (q - 16)) as Q8_0
with codes q - 16: the same numbers exactly (kernels/gguf_blocks.py maps every type).
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
from specserve.kernels.gguf_blocks import GGUF_TYPES, decode
from specserve.kernels.linear import RowPlan

BLOCK = 32
FORMATS = ("q4_1", "q8_0")  # what ``quantize`` makes from float weights


@dataclass
class BlockQuantWeight:
    """A [N, K] weight in blocks of 32 along K. Planes (KB = K // 32):
    qs: uint8 [N, KB, 16] for q4_1 (byte j: q[j] low nibble, q[j+16] high nibble), int8
    [N, KB, 32] for q8_0 and q8_f; d, m: float32 [N, KB] (m is None for q8_0), except q8_f's
    d: float32 [N, KB, 2], one scale per half block (m [N, KB] or None)."""

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
        if self.fmt in ("q8_0", "q8_f"):
            return self.qs.to(torch.int32).flatten(1)
        lo, hi = self.qs & 0x0F, self.qs >> 4  # [N, KB, 16] each
        return torch.cat([lo, hi], dim=-1).to(torch.int32).flatten(1)

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K]: d * q (+ m), exactly as the gguf package computes it."""
        n, kb = self.qs.shape[:2]
        if self.fmt == "q8_f":  # a scale per half block
            q = self.codes().to(torch.float32).view(n, kb, 2, BLOCK // 2)
            w = (self.d[..., None] * q).view(n, kb, BLOCK)
        else:
            q = self.codes().to(torch.float32).view(n, kb, BLOCK)
            w = self.d[..., None] * q
        if self.m is not None:
            w = w + self.m[..., None]
        return w.flatten(1)

    def rows(self, index: torch.Tensor) -> BlockQuantWeight:
        """The weight with its rows reordered/selected by ``index`` (blocks run along K, so
        whole rows move as they are)."""
        pick = lambda t: None if t is None else t.index_select(0, index).contiguous()
        return BlockQuantWeight(self.fmt, pick(self.qs), pick(self.d), pick(self.m))

    def as_q8f(self) -> BlockQuantWeight:
        """The same numbers as Q8_F (the form any two formats fuse in): codes as int8, the
        scale on both half blocks. Exact: float16 scales and mins are float32 values."""
        if self.fmt == "q8_f":
            return self
        d = self.d[..., None].expand(*self.d.shape, 2).contiguous()
        return BlockQuantWeight("q8_f", self.codes().to(torch.int8).view(*self.d.shape, BLOCK),
                                d, self.m)

    @staticmethod
    def cat(parts: list[BlockQuantWeight]) -> BlockQuantWeight:
        """Stacks weights along N (fused q|k|v, gate|up); parts of different formats fuse as
        Q8_F (a file may keep q/k in Q5_0 and v in Q6_K)."""
        if len({p.fmt for p in parts}) != 1:
            parts = [p.as_q8f() for p in parts]
        if any(p.m is None for p in parts) and any(p.m is not None for p in parts):
            if parts[0].fmt != "q8_f":
                parts = [p.as_q8f() for p in parts]
            parts = [p if p.m is not None else BlockQuantWeight(
                p.fmt, p.qs, p.d, p.d.new_zeros(p.d.shape[:2])) for p in parts]
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])  # type: ignore[misc]
        return BlockQuantWeight(
            parts[0].fmt, torch.cat([p.qs for p in parts]), torch.cat([p.d for p in parts]), m
        )


def gguf_format(type_name: str) -> str | None:
    """Our format for a GGUF tensor type name (kernels/gguf_blocks.py's table), None if we keep
    it float."""
    entry = GGUF_TYPES.get(type_name)
    return None if entry is None else entry[0]


def from_gguf_blocks(type_name: str, raw: np.ndarray, shape: tuple[int, int]) -> BlockQuantWeight:
    """raw: the tensor's bytes as uint8 [N, blocks * bytes_per_block], as gguf.GGUFReader maps
    them; shape: (N, K) in PyTorch order."""
    if type_name not in GGUF_TYPES:
        raise ValueError(f"GGUF type {type_name} has no packed form here (use one of "
                         f"{', '.join(GGUF_TYPES)})")
    _, nb, per = GGUF_TYPES[type_name]
    n, k = shape
    if k % per or np.asarray(raw).size != n * (k // per) * nb:
        raise ValueError(f"a {type_name} tensor needs K divisible by {per} and {nb} bytes per "
                         f"{per} weights (got shape {shape}, {np.asarray(raw).size} bytes)")
    return BlockQuantWeight(*decode(type_name, raw, n, k))


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
# The version of ``pack``'s layout: cached planes (target/block_cache.py) are kept under it, so
# change it whenever ``pack`` (or the kernels' reading of its planes) changes.
PACKED_LAYOUT = "2"
# A kernel argument's bit (above block_linear's) that runs a layer's five-bit planes (``qs5``)
P5_FORM = 1 << 10
# Five-bit forms are candidates up to this many rows: one row waits on memory, where 5.5 bits
# a weight beat 8.5 (Qwen2.5-0.5B's projections, Zen 3: 1.16x at 1 row, 1.20x at 2); from 4 rows
# the unpack, shared by fewer rows than its cost, made them 0.90-0.94x (up to 17 rows).
P5_MAX_ROWS = 4


def pack(weight: BlockQuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The planes in the C++ kernel's layout: 8 output features interleaved, N padded with zero
    features to a multiple of 8, scales and mins float16 (the file's own width: a 1-row step
    reads every weight byte once, so 4-byte scales cost it 17% more memory traffic). Returns
    (qs [G, KB, 128 | 256], d [G, KB, 8], m [G, KB, 8] or None). Q8_F keeps float32 scales:
    d [G, KB, 2, 8] (half blocks), m [G, KB, 8] or None."""
    if weight.fmt == "q8_f":
        return _pack_q8f(weight)
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


def pack_five_bit(qs: torch.Tensor) -> torch.Tensor | None:
    """Q8_0's int8 planes [G, KB, 256] -> the five-bit planes [G, KB, 160] of u = q + 16
    (qgemm.cpp's P5 layout), or None when a code lies outside -16..15 (code class 2: Q5_0's).
    Vector v < 4, byte 4c+t: vector v's u low, vector v + 4's u high (4 bits each, Q4_1's
    order); then byte 4c+t holds bit 4 of vector j's u at bit j."""
    if code_class(qs) != 2:
        return None
    g, kb, _ = qs.shape
    u = (qs.to(torch.int16) + 16).view(g, kb, 8, 32)  # vector v, byte 4c+t
    nib = (u[:, :, :4] & 0x0F) | ((u[:, :, 4:] & 0x0F) << 4)  # [G, KB, 4, 32]
    weights = (1 << torch.arange(8, dtype=torch.int16)).view(1, 1, 8, 1)
    fifth = (((u >> 4) & 1) * weights).sum(2)  # [G, KB, 32]
    return torch.cat([nib.reshape(g, kb, 128), fifth], dim=2).to(torch.uint8).contiguous()


def _interleave_q8(codes: torch.Tensor) -> torch.Tensor:
    """int codes [G * 8, KB, 32] -> Q8_0's kernel layout [G, KB, 256]: vector v, byte
    4 * feature + t holds code 4 v + t."""
    n, kb, _ = codes.shape
    c = codes.view(n // LANES, LANES, kb, 8, 4).permute(0, 2, 3, 1, 4)
    return c.reshape(n // LANES, kb, 256).to(torch.int8).contiguous()


def _pack_q8f(weight: BlockQuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    n, kb = weight.qs.shape[:2]
    g = -(-n // LANES)
    pad = g * LANES - n
    codes, d, m = weight.qs, weight.d, weight.m
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad, kb, BLOCK)])
        d = torch.cat([d, d.new_zeros(pad, kb, 2)])
        m = None if m is None else torch.cat([m, m.new_zeros(pad, kb)])
    dp = d.view(g, LANES, kb, 2).permute(0, 2, 3, 1).to(torch.float32).contiguous()
    mp = None if m is None else m.view(g, LANES, kb).permute(0, 2, 1).to(torch.float32)
    return _interleave_q8(codes), dp, None if mp is None else mp.contiguous()


def unpack(fmt: str, n: int, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None
           ) -> BlockQuantWeight:
    """``pack``'s inverse: the planes of the first ``n`` features in the file's layout."""
    g, kb, _ = qs.shape
    if fmt == "q8_f":
        codes = qs.view(g, kb, 8, LANES, 4).permute(0, 3, 1, 2, 4).reshape(g * LANES, kb, BLOCK)
        dd = d.permute(0, 3, 1, 2).reshape(g * LANES, kb, 2)[:n].contiguous()
        mm = None if m is None else m.permute(0, 2, 1).reshape(g * LANES, kb)[:n].contiguous()
        return BlockQuantWeight(fmt, codes[:n].contiguous(), dd, mm)
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
# The C++ kernels' code classes (qgemm.cpp): (lowest, highest) int8 code of each class 1-3. A
# tensor whose codes all fall in a class's range runs the offset form (no sign instructions:
# same bits, fewer instructions a row); class 0 holds for any codes.
_CODE_CLASSES = {1: (0, 31), 2: (-16, 15), 3: (-32, 31)}


def code_class(qs: torch.Tensor) -> int:
    """The block kernels' code class of int8 planes (0 for Q4_1's packed nibbles, or codes
    outside every class's range), read off the codes themselves, so it holds by construction."""
    if qs.dtype != torch.int8 or qs.numel() == 0:
        return 0
    lo, hi = (int(v) for v in torch.aminmax(qs))  # one pass over the codes
    return next((c for c, (a, b) in _CODE_CLASSES.items() if a <= lo and hi <= b), 0)
_kernel_codes = functools.cache(quant_ext.kernel_code)


class BlockQuantLinear(nn.Module):
    """y = x @ W^T (+ bias) with W block-quantized. Float32 in, float32 out. The planes are
    buffers in the kernel's layout (``pack``: 8 features interleaved, N padded to a multiple of
    8), so ``.to()`` and ``state_dict`` see them; ``weight`` gives the file's layout back."""

    def __init__(self, weight: BlockQuantWeight, bias: torch.Tensor | None = None,
                 five_bit: bool | None = None) -> None:
        """``five_bit``: also hold Q5_0's codes five bits a weight (``pack_five_bit``), for the
        tuner's five-bit forms; None: where the C++ kernels run."""
        super().__init__()
        qs, d, m = pack(weight)
        if bias is not None:  # padded like the planes: the kernel adds 8 features at a time
            bias = bias.to(torch.float32)
            bias = torch.cat([bias, bias.new_zeros(qs.shape[0] * LANES - bias.numel())])
        if five_bit is None:
            five_bit = quant_ext.available()
        qs5 = pack_five_bit(qs) if five_bit and weight.fmt == "q8_0" else None
        self._setup(weight.fmt, *weight.shape, (qs, d, m, bias, qs5))

    @classmethod
    def from_packed(cls, fmt: str, out_features: int, in_features: int,
                    planes: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                  torch.Tensor | None, torch.Tensor | None]
                  ) -> BlockQuantLinear:
        """A layer from planes already in the kernel's layout (``planes``: qs, d, m, bias,
        qs5 as this class's buffers hold them), as a cache of built layers stores them."""
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer._setup(fmt, out_features, in_features, planes)
        return layer

    def _setup(self, fmt: str, out_features: int, in_features: int, planes: tuple) -> None:
        self.fmt = fmt
        self.out_features, self.in_features = out_features, in_features
        # qs5: the codes again as five-bit planes (or None), read by the P5_FORM kernels only:
        # a 1-row step reads 35% fewer bytes of the layer, a verify's rows share int8 codes'
        # cheaper unpack; the tuner picks per row count.
        for name, plane in zip(("qs", "d", "m", "bias", "qs5"), planes, strict=True):
            self.register_buffer(name, plane)
        # Kernel per row count ("<isa>/<rows sharing each unpacked weight block>"): numerically
        # irrelevant (every form gives the same bits, batch-invariant), so the tuner
        # (kernels/tuner.py) picks by speed alone.
        self.rows_plan: RowPlan | None = None
        self._dense: torch.Tensor | None = None
        self._ext = quant_ext.load() if quant_ext.available() else None
        self._planes = self._plain_planes()
        self._class_bits = 256 * code_class(self.qs)  # or'ed into every kernel argument
        assert self.qs5 is None or self._class_bits == 512, "five-bit planes hold class 2"

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
    def five_bit(self) -> bool:
        """True when the layer also holds five-bit planes (the P5_FORM kernels' operands)."""
        return self.qs5 is not None

    @property
    def padded(self) -> bool:
        """True when N is not a multiple of 8: the kernel's output has zero features to cut."""
        return self.out_features % LANES != 0

    def kernel(self, rows: int) -> int:
        """block_linear's kernel argument for ``rows`` rows (256 * code class + 32 * isa + rows
        per pass)."""
        plan = self.rows_plan
        return self._class_bits | (_DEFAULT_KERNEL if plan is None
                                   else _kernel_codes(plan.get(rows)))

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
        """y for x with block_linear's ``kernel`` (32 * isa + rows per pass; this layer's code
        class is added; the dense fallback ignores it)."""
        ext = self._ext
        if ext is not None and x.device.type == "cpu":
            if x.dtype != torch.float32 or not x.is_contiguous():
                x = x.to(torch.float32).contiguous()
            # kernel | P5_FORM reads qs5 instead of qs: the same bits, fewer bytes
            y = ext.block_linear(x, *self._planes, kernel | self._class_bits, self.qs5)
            return y[:, : self.out_features].contiguous() if self.padded else y
        if self._dense is None or self._dense.device != x.device:
            self._dense = self.weight.dequantize().to(x.device)
        bias = None if self.bias is None else self.bias[: self.out_features]
        return nn.functional.linear(x.to(torch.float32), self._dense, bias)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.fmt}"


class BlockEmbedding(nn.Module):
    """An embedding table kept in its file's blocks: a lookup dequantizes the rows it reads,
    with the float32 operations ``BlockQuantWeight.dequantize`` shares with gguf's
    ``dequantize``, so each row has the bits a float table loaded from the file has. A 151,936 x
    896 Q5_0 table takes 153 MB here against 545 MB as float32. The planes are buffers in the
    file's row layout (``BlockQuantWeight``), so ``.to()`` and ``state_dict`` see them."""

    def __init__(self, weight: BlockQuantWeight) -> None:
        super().__init__()
        self.fmt = weight.fmt
        self.num_embeddings, self.embedding_dim = weight.shape
        self.register_buffer("qs", weight.qs)
        self.register_buffer("d", weight.d)
        self.register_buffer("m", weight.m)
        self._table: torch.Tensor | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, dim] float32
        flat = ids.reshape(-1)
        pick = lambda t: None if t is None else t.index_select(0, flat)
        rows = BlockQuantWeight(self.fmt, pick(self.qs), pick(self.d), pick(self.m))
        return rows.dequantize().view(*ids.shape, self.embedding_dim)

    @property
    def weight(self) -> torch.Tensor:
        """The whole table as float32 (built on first use, for drafts that share it)."""
        if self._table is None or self._table.device != self.qs.device:
            self._table = BlockQuantWeight(self.fmt, self.qs, self.d, self.m).dequantize()
        return self._table

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.fmt}"
