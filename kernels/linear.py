"""Dense projections whose kernel per row count is chosen by measurement, not by constants.

Which way of computing a float [M, K] x [N, K]^T product is fastest depends on the CPU, the
shape and M: on one AMD EPYC, MKL's ``x @ W^T`` for a few rows was 2-3x slower than
``(W @ x^T)^T``; on an Intel Xeon with AMX the same trick was 2x slower than ``F.linear``. So
``DenseLinear`` holds a ``RowPlan`` filled by the tuner (kernels/tuner.py) on the machine that
runs; with no plan it is plain ``F.linear``.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

DenseKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


def _mm_t(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """(W @ x^T)^T: streams W once like a matrix-vector product."""
    out = torch.mm(w, x.t()).t().contiguous()
    return out if b is None else out.add_(b)


def _mm_t_even(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """(W @ x^T)^T with an odd row count padded by one copied row (some BLAS builds stream a
    weight slower for one column or odd widths); the extra output row is dropped."""
    rows = x.shape[0]
    if rows % 2 == 0:
        return _mm_t(x, w, b)
    return _mm_t(torch.cat([x, x[-1:]]), w, b)[:rows]


# Candidate implementations of the same product, as the tuner sees them.
DENSE_KERNELS: dict[str, DenseKernel] = {
    "linear": F.linear,
    "mm_t": _mm_t,
    "mm_t_even": _mm_t_even,
}


class RowPlan:
    """Choice per row count: measured at some counts; a count in between takes the choice of
    the nearest measured count below it (above the largest, the largest's). Lookups are a
    bisect over a handful of counts."""

    def __init__(self, default: str) -> None:
        self.default = default
        self.rows: list[int] = []
        self.names: list[str] = []

    def set(self, rows: int, name: str) -> None:
        i = bisect.bisect_left(self.rows, rows)
        if i < len(self.rows) and self.rows[i] == rows:
            self.names[i] = name
        else:
            self.rows.insert(i, rows)
            self.names.insert(i, name)

    def get(self, rows: int) -> str:
        i = bisect.bisect_right(self.rows, rows) - 1
        return self.default if i < 0 and not self.names else self.names[max(i, 0)]


class DenseLinear(nn.Linear):
    """``nn.Linear`` whose product runs the kernel its ``plan`` names for the row count."""

    plan: RowPlan | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.apply(x, self.weight, self.bias, self.plan)

    @staticmethod
    def apply(
        x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
        plan: RowPlan | None = None,
    ) -> torch.Tensor:
        """x: [M, K], weight: [N, K], bias: [N] -> [M, N], like ``F.linear``."""
        if plan is None or x.dim() != 2 or x.device.type != "cpu":
            return F.linear(x, weight, bias)
        return DENSE_KERNELS[plan.get(x.shape[0])](x, weight, bias)
