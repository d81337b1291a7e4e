"""RMSNorm, matching Hugging Face's Llama/Qwen semantics bit for bit in float32."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden]; weight: [hidden]. Normalizes in float32 (small models overflow/underflow
    the variance in bf16), casts back to x's dtype, then scales, in the same order as transformers
    so float32 outputs are identical."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)
