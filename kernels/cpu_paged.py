"""Paged attention in C++ for CPU float32 (kernels/csrc/fused.cpp), batch-invariant.

Every query row is attended on its own, in key order, straight from the paged cache: no
gathered copy of the context, and a row's result is the same whether it is a one-token decode,
one of k+1 verify rows, or a row of a prefill chunk of any length, whatever else shares the step.
That includes prefix-cache hits: a prompt whose first blocks are cached prefills only its tail,
and must get the same numbers as when it prefilled whole.

``max_kernel_query`` (None: no limit) sends sequences with more new tokens than that to the torch
reference's SDPA path instead: faster for long prompts (the C++ loop is O(n * ctx) per head with
no key reuse across queries) but no longer invariant to chunking and prefix caching.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from specserve.kernels import quant_ext
from specserve.kernels.attention_form import for_float32_caches
from specserve.kernels.metadata import AttentionMetadata
from specserve.kernels.torch_ref import TorchPagedAttention, write_kv

# float32, or float16 / bfloat16 rows widened as they are read (bfloat16 also has a form with
# bfloat16 products: kernels/attention_form.py)
_CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class _Plan:
    rows: torch.Tensor | None  # [S] flat-batch rows taken by the kernel; None = all
    seq_of: torch.Tensor  # [S] int64 sequence index of each
    pos_of: torch.Tensor  # [S] int64 absolute position of each
    long_meta: AttentionMetadata | None  # the long prefill chunks, for the SDPA path
    long_rows: torch.Tensor | None
    has_padding: bool


def _build_plan(meta: AttentionMetadata, max_kernel_query: int | None) -> _Plan:
    seq_of, pos_of, rows, long_rows, long_seqs = [], [], [], [], []
    start = 0
    for b, (n, ctx) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
        if max_kernel_query is None or n <= max_kernel_query:
            seq_of += [b] * n
            pos_of += range(ctx - n, ctx)
            rows += range(start, start + n)
        else:
            long_rows += range(start, start + n)
            long_seqs.append(b)
        start += n
    long_meta = None
    if long_seqs:
        long_meta = AttentionMetadata(
            slot_mapping=meta.slot_mapping[torch.tensor(long_rows)],
            cu_seqlens_q=meta.cu_seqlens_q,  # unused by the torch path
            context_lens=meta.context_lens[long_seqs],
            block_tables=meta.block_tables[long_seqs],
            query_lens_cpu=[meta.query_lens_cpu[b] for b in long_seqs],
            context_lens_cpu=[meta.context_lens_cpu[b] for b in long_seqs],
            block_size=meta.block_size,
        )
    has_padding = bool(meta.slot_mapping.numel()) and bool((meta.slot_mapping < 0).any())
    return _Plan(
        None if not long_seqs else torch.tensor(rows, dtype=torch.int64),
        torch.tensor(seq_of, dtype=torch.int64),
        torch.tensor(pos_of, dtype=torch.int64),
        long_meta,
        None if not long_seqs else torch.tensor(long_rows, dtype=torch.int64),
        has_padding,
    )


class CpuPagedAttention:
    """Stateless; one instance serves every layer. float32, float16 or bfloat16 CPU caches
    (float16 and bfloat16 rows are widened exactly as they are read and sums stay float32,
    except in the bfloat16-product form, which also rounds queries and weights to bfloat16)."""

    name = "cpu_paged"
    supports_softcap = True  # Gemma 2's attention logit soft-capping, per score in the kernel

    def __init__(self, max_kernel_query: int | None = None, form: int = 8) -> None:
        self._ext = quant_ext.load()
        self.max_kernel_query = max_kernel_query
        # The C++ attention's form (1024 * seg + 64 * isa + tile; 8: AVX2, tiles of 8, no key
        # segments): one for every call of the process, so verify rows equal decode rows; the
        # engine sets the measured one (attention_form.py) before its first step.
        self.form = form
        self._long = TorchPagedAttention()

    def for_float32_caches(self) -> CpuPagedAttention:
        """This backend for float32 caches beside this one's (a draft model's or an EAGLE
        head's, whose numbers only move acceptance): the bfloat16-product form widened."""
        other = copy.copy(self)
        other.form = for_float32_caches(self.form)
        return other

    def kernel_plan(self, meta: AttentionMetadata) -> _Plan | None:
        """The step's plan when every row goes through the C++ kernel (what a fused decoder
        layer needs: seq_of, pos_of), else None."""
        plan: _Plan = meta.plan(self.name, lambda: _build_plan(meta, self.max_kernel_query))
        return plan if plan.rows is None else None

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
        softcap: float | None = None,
    ) -> torch.Tensor:  # [T, H, D]
        if q.dtype != torch.float32 or k_cache.dtype not in _CACHE_DTYPES:
            return self._long.forward(q, k, v, k_cache, v_cache, meta, scale, sliding_window,
                                      softcap)
        plan: _Plan = meta.plan(self.name, lambda: _build_plan(meta, self.max_kernel_query))
        if k.stride(-1) == 1 and k.stride(-2) == k.shape[-1] and v.stride(-2) == v.shape[-1]:
            self._ext.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)  # one call, no copies
        else:
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping, plan.has_padding)
        window = sliding_window or 0
        if softcap is None:
            attend = self._ext.paged_attention
        else:
            def attend(*args):  # noqa: E306
                return self._ext.paged_attention_capped(*args, softcap)
        if plan.rows is None:
            return attend(
                q.contiguous(), k_cache, v_cache, meta.block_tables, plan.seq_of, plan.pos_of,
                scale, window, self.form,
            )
        out = torch.empty_like(q)
        if plan.rows.numel():
            out[plan.rows] = attend(
                q[plan.rows].contiguous(), k_cache, v_cache, meta.block_tables, plan.seq_of,
                plan.pos_of, scale, window, self.form,
            )
        assert plan.long_meta is not None and plan.long_rows is not None
        # K/V are written already; the torch path rewrites the same slots with the same values.
        out[plan.long_rows] = self._long.forward(
            q[plan.long_rows], k[plan.long_rows], v[plan.long_rows], k_cache, v_cache,
            plan.long_meta, scale, sliding_window, softcap,
        )
        return out

    __call__ = forward
