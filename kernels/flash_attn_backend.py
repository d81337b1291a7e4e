"""Paged attention through flash-attn 2 (the optional ``cuda`` extra; no binary wheel, so it is
never assumed). Same contract as ``TorchPagedAttention.forward``.

- Uniform steps (every sequence has the same number of new tokens: all-decode, or all verifying
  k + 1) call ``flash_attn_with_kvcache(q [B, Q, H, D], cache, cache_seqlens, block_table)``,
  the split-KV decode kernel; it has fixed shapes per (B, Q), so CUDA graphs can capture it.
- Mixed steps call ``flash_attn_varlen_func(..., block_table=...)`` over the flat batch.
Both read K/V straight from the paged cache. flash-attn's ``causal`` aligns the query block to
the END of the keys (bottom-right), which is exactly "new tokens are the last positions";
``window_size=(W - 1, 0)`` is our "q_pos - k_pos < W".

Limits (upstream flash-attn 2.6 - 2.8, ``flash_api.cpp``): the paged KV block size must be a
multiple of 256 ("Paged KV cache block size must be divisible by 256"); fp16 / bf16 only; head
dim <= 256; Ampere or newer. ``unsupported_reason`` lets the registry skip it up front.
"""

from __future__ import annotations

import torch
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache

from specserve.core.errors import ConfigError
from specserve.kernels.metadata import AttentionMetadata
from specserve.kernels.torch_ref import write_kv

PAGE_MULTIPLE = 256


class FlashAttnPagedAttention:
    """flash-attn backend. Stateless; one instance serves every layer."""

    name = "flash_attn"

    @staticmethod
    def unsupported_reason(block_size: int) -> str | None:
        if block_size % PAGE_MULTIPLE:
            return (
                f"block size {block_size} is not supported: flash-attn's paged KV cache needs "
                f"a multiple of {PAGE_MULTIPLE} (use --block-size 256, or "
                f"--attention-backend triton)"
            )
        return None

    def forward(
        self,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        k_cache: torch.Tensor,  # [N, block_size, KVH, D]
        v_cache: torch.Tensor,  # [N, block_size, KVH, D]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [T, H, D]
        has_padding, cu_seqlens_k = meta.plan((self.name,), lambda: self._plan(q, k_cache, meta))
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, has_padding)
        window = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)
        q_lens = meta.query_lens_cpu
        if min(q_lens) == max(q_lens):
            B, Q = len(q_lens), q_lens[0]
            out = flash_attn_with_kvcache(
                q.view(B, Q, *q.shape[1:]), k_cache, v_cache,
                cache_seqlens=meta.context_lens, block_table=meta.block_tables,
                softmax_scale=scale, causal=True, window_size=window,
            )  # [B, Q, H, D]
            return out.view_as(q)
        return flash_attn_varlen_func(
            q, k_cache, v_cache, meta.cu_seqlens_q, cu_seqlens_k, meta.max_query_len,
            meta.max_context_len, softmax_scale=scale, causal=True, window_size=window,
            block_table=meta.block_tables,
        )

    __call__ = forward

    def _plan(
        self, q: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[bool, torch.Tensor]:
        """Checks the limits once per step; returns (has padding slots, cu_seqlens_k [B+1])."""
        reason = self.unsupported_reason(k_cache.shape[1])
        if reason is None and q.dtype not in (torch.float16, torch.bfloat16):
            reason = f"dtype {q.dtype} is not supported: flash-attn needs float16 or bfloat16"
        if reason is None and q.shape[-1] > 256:
            reason = f"head dim {q.shape[-1]} is not supported: flash-attn allows up to 256"
        if reason is not None:
            raise ConfigError(f"attention backend 'flash_attn': {reason}")
        ctx = meta.context_lens
        cu_k = torch.zeros(ctx.shape[0] + 1, dtype=torch.int32, device=ctx.device)
        torch.cumsum(ctx, 0, out=cu_k[1:])
        has_padding = bool(meta.slot_mapping.numel()) and bool((meta.slot_mapping < 0).any())
        return has_padding, cu_k
