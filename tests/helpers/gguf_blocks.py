"""Random valid GGUF blocks of every type with a kernel, built in the test (no download), and
GGUF files written with typed (quantized) tensors."""

from __future__ import annotations

import contextlib

import numpy as np

from specserve.kernels.gguf_blocks import GGUF_TYPES

# byte offsets of each type's float16 fields within a block (the rest is codes / 6-bit scales)
_HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2),
           "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(type_name: str, n: int, k: int, seed: int) -> np.ndarray:
    """uint8 [N, blocks * bytes]: random bytes, the float16 fields set to random finite values
    of either sign around 1e-3 (K-quant scales multiply 6-8 bit sub-scales)."""
    _, nb, per = GGUF_TYPES[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // per, nb), dtype=np.uint8)
    for off in _HALVES[type_name]:
        scale = rng.uniform(0.2e-3, 2e-3, size=(n, k // per)) * rng.choice([-1, 1], (n, k // per))
        raw[..., off: off + 2] = scale.astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)


@contextlib.contextmanager
def typed_tensors(types: dict[str, str]):
    """While open, GGUFWriter.add_tensor stores the float tensors whose name contains a key of
    ``types`` in that GGUF type (gguf's own quantizer; random valid blocks for the K-quants),
    the rest as given (F32)."""
    import gguf

    original = gguf.GGUFWriter.add_tensor

    def add_tensor(self, name, tensor, *args, **kwargs):
        for part, type_name in types.items():
            if part in name and tensor.ndim == 2:
                qtype = gguf.GGMLQuantizationType[type_name]
                if type_name.endswith("_K"):  # gguf-py has no K-quantizer: random blocks
                    raw = random_blocks(type_name, tensor.shape[0], tensor.shape[1],
                                        len(name))
                    return original(self, name, raw, raw_shape=raw.shape, raw_dtype=qtype)
                if qtype == gguf.GGMLQuantizationType.F16:
                    return original(self, name, tensor.astype(np.float16))
                raw = gguf.quants.quantize(tensor.astype(np.float32), qtype)
                return original(self, name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        return original(self, name, tensor, *args, **kwargs)

    gguf.GGUFWriter.add_tensor = add_tensor
    try:
        yield
    finally:
        gguf.GGUFWriter.add_tensor = original
