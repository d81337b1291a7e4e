"""Linear layer dispatch for the model's projections.

On CPU with few rows (decode, speculative verify, small batches), MKL's x @ W^T path for a
skinny x is 2-3x slower than the same product computed as (W @ x^T)^T, which streams the weight
once like a matrix-vector product. Measured on the 2-core dev CPU, SmolLM2-135M's 120 layer
matmuls: M=5 rows 127 ms -> 61 ms, M=8 143 -> 74 ms, M=32 181 -> 106 ms, M=1 66 -> 61 ms; from
~64 rows on, F.linear is faster again. So a 5-token verify costs about what a 1-token decode does,
which is what speculative decoding needs. float32 only: for bf16 the plain path is faster.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Largest row count that takes the weight-streaming path (see module docstring).
_SKINNY_MAX_ROWS = 32


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], weight: [N, K], bias: [N] -> [M, N], like ``F.linear``."""
    if (
        x.device.type == "cpu"
        and x.dtype == torch.float32  # bf16 measured no faster this way (M=5: 73 -> 106 ms)
        and x.dim() == 2
        and x.shape[0] <= _SKINNY_MAX_ROWS
    ):
        out = torch.mm(weight, x.t()).t().contiguous()  # [M, N]
        if bias is not None:
            out += bias
        return out
    return F.linear(x, weight, bias)


def skinny_row_limit(device: torch.device, dtype: torch.dtype) -> int | None:
    """Rows up to which ``linear`` takes the cheaper weight-streaming path on this device and
    dtype (None: there is no such path, and no cliff past it)."""
    return _SKINNY_MAX_ROWS if device.type == "cpu" and dtype == torch.float32 else None
