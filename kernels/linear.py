"""Linear layer dispatch for the model's projections.

On CPU with few rows (decode, speculative verify, small batches), MKL's x @ W^T path for a
skinny x is 2-3x slower than the same product computed as (W @ x^T)^T, which streams the weight
once like a matrix-vector product. Measured on the 2-core dev CPU, SmolLM2-135M's 120 layer
matmuls: M=5 rows 127 ms -> 61 ms, M=8 143 -> 74 ms, M=32 181 -> 106 ms, M=1 66 -> 61 ms. With
every weight cold, as in a real forward (121 projections, F.linear -> this path): M=33 239 ->
183 ms, 48 271 -> 197, 64 358 -> 259, 96 419 -> 362, 128 even (492 / 491), 192 638 <- 701, 512
1429 <- 1784. So the path covers up to 128 rows: decode batches of 48 and 64 sequences measured
~90 -> 123 and ~107 -> 143 tok/s against a 32-row limit. A 4-token verify costs ~1.06x a 1-token
decode (5 tokens ~1.2x), which is what speculative decoding needs. float32 only: for bf16 the
plain path is faster.

Some row counts are dearer than the next one up: MKL streams the weight slower for a single
column (a gemv) and for odd narrow widths. All 121 projections of SmolLM2-135M, cold, median of
25 interleaved runs: M=1 78.6 ms, 2 57.4, 3 72.3, 4 63.5, 5 75.7, 6 93.5, 7 110.0, 8 104.3. So
1, 3 and 7 rows are padded to 2, 4 and 8 (the extra row is a copy, its output dropped): a plain
decode step measured 106.5 -> 90.1 ms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Largest row count that takes the weight-streaming path (see module docstring).
_SKINNY_MAX_ROWS = 128
# Row counts that run faster padded to the next even count (see module docstring).
_PAD_TO = {1: 2, 3: 4, 7: 8}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K], weight: [N, K], bias: [N] -> [M, N], like ``F.linear``."""
    if (
        x.device.type == "cpu"
        and x.dtype == torch.float32  # bf16 measured no faster this way (M=5: 73 -> 106 ms)
        and x.dim() == 2
        and x.shape[0] <= _SKINNY_MAX_ROWS
    ):
        rows = x.shape[0]
        padded = _PAD_TO.get(rows)
        if padded is not None:
            x = torch.cat([x, x[-1:].expand(padded - rows, -1)])
        out = torch.mm(weight, x.t()).t()[:rows].contiguous()  # [M, N]
        if bias is not None:
            out += bias
        return out
    return F.linear(x, weight, bias)


# Verify rows past which extra drafts measured not to pay on CPU float32: from 32 rows on every
# row adds ~3.3 ms to a projection pass (all 121, cold), and n-gram speculation at 32 concurrent
# sequences measured 0.84x plain when drafts could take a step to 128 rows, 0.96x when capped here
# (benchmarks/ab.py, rewrite prompts).
_CPU_VERIFY_ROW_BUDGET = 32


def verify_row_budget(device: torch.device, dtype: torch.dtype) -> int | None:
    """Rows a step whose plain rows fit under it may grow to with drafts (None: no cap known)."""
    return _CPU_VERIFY_ROW_BUDGET if device.type == "cpu" and dtype == torch.float32 else None
