"""ModelRunner: a loaded CausalLM plus its paged KV cache, run on one flattened batch per step.

The runner owns the KV tensors; the block manager (specserve.engine.block_manager) owns which block
ids are in use. Block ids index the same rows of every layer's cache, so one block table per
sequence addresses the whole model (and, with the same ids, the draft model's own runner).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from specserve.kernels.metadata import AttentionMetadata
from specserve.kernels.registry import AttentionBackend, get_attention_backend
from specserve.target.config import ModelConfig
from specserve.target.layout import BatchLayout
from specserve.target.model import CausalLM, FeatureCapture, KVCache

_PAGE = 4096


def zeroed_pool(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose pages a CPU process commits only as they are written: numpy's zeros
    is calloc, which takes a large block as fresh zero pages from the OS instead of writing
    them (torch.zeros writes every byte). A KV pool sized for the worst case then costs resident
    memory for the blocks requests have used, not for all of it; the values are zeros either
    way."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    # calloc's block starts 16 bytes into a page: slice from a page boundary, so rows keep the
    # 64-byte alignment torch's allocator gives (a misaligned pool slowed attention ~10-20%)
    raw = np.zeros(nbytes + _PAGE, dtype=np.uint8)
    start = -raw.ctypes.data % _PAGE
    return torch.from_numpy(raw[start: start + nbytes]).view(dtype).view(shape)

class ModelRunner:
    """Runs ``model`` over paged KV caches of ``num_blocks`` blocks of ``block_size`` tokens.

    Invariants: ``kv_cache`` is one tensor [num_layers, 2, num_blocks, block_size, KVH, D];
    ``kv_caches[i]`` are views of layer i's (k, v) slices, so the pool is allocated once. The
    cache starts zeroed: attention may read (masked-out) slots never written, and a finite 0
    times a zero softmax weight stays 0, where uninitialized memory could hold NaN.
    ``lazy_kv``: the pool is allocated on first use (the first forward, or a read of
    ``kv_cache``), not at construction: a draft model that no request runs then commits no KV
    memory and zeroes no pages (``kv_allocated`` says whether it has).
    """

    def __init__(
        self,
        model_config: ModelConfig,
        model: CausalLM,
        *,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        attn_backend: AttentionBackend | str = "auto",
        kv_dtype: torch.dtype | None = None,
        lazy_kv: bool = False,
    ) -> None:
        """``kv_dtype``: the cache's element type (None: ``dtype``)."""
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be > 0")
        self.model_config = model_config
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.attn_backend = (
            get_attention_backend(attn_backend, self.device)
            if isinstance(attn_backend, str)
            else attn_backend
        )
        self.kv_dtype = kv_dtype or dtype
        self._kv: torch.Tensor | None = None  # [L, 2, N, block_size, KVH, D]
        self._kv_views: list[KVCache] = []
        if not lazy_kv:
            self._allocate_kv()

    def _allocate_kv(self) -> None:
        mc = self.model_config
        shape = (mc.num_layers, 2, self.num_blocks, self.block_size, mc.num_kv_heads, mc.head_dim)
        self._kv = zeroed_pool(shape, self.kv_dtype, self.device)
        self._kv_views = [(self._kv[i, 0], self._kv[i, 1]) for i in range(mc.num_layers)]

    @property
    def kv_allocated(self) -> bool:
        return self._kv is not None

    @property
    def kv_cache(self) -> torch.Tensor:
        """[num_layers, 2, num_blocks, block_size, KVH, D]"""
        if self._kv is None:
            self._allocate_kv()
        return self._kv  # type: ignore[return-value]

    @property
    def kv_caches(self) -> list[KVCache]:
        """One (k, v) view per layer, each [num_blocks, block_size, KVH, D]."""
        if self._kv is None:
            self._allocate_kv()
        return self._kv_views

    @staticmethod
    def bytes_per_block(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """KV bytes one block takes across all layers (k and v)."""
        mc = model_config
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * mc.num_layers * block_size * mc.num_kv_heads * mc.head_dim * element

    def run(self, layout: BatchLayout, capture: FeatureCapture | None = None) -> torch.Tensor:
        """One step over a layout: logits [N, vocab] float32 for ``layout.logits_indices``
        (none: the lm_head is skipped). Goes through ``forward``."""
        logits, _ = self.forward(layout.input_ids, layout.positions, layout.meta,
                                 layout.logits_indices, capture=capture)
        return logits

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,  # [N]; None: every token
        return_hidden: bool = False,
        capture: FeatureCapture | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One model step. Returns (logits [N, vocab] float32, final hidden [N, hidden] when
        ``return_hidden`` else None). Writes the K/V of all T tokens at ``meta.slot_mapping``.
        ``capture``: also collect hidden states of some layers and rows (an EAGLE head's
        input), see ``target.model.FeatureCapture``."""
        if input_ids.shape != positions.shape or input_ids.dim() != 1:
            raise ValueError(
                f"input_ids {tuple(input_ids.shape)} and positions {tuple(positions.shape)} "
                f"must both be [T]"
            )
        with torch.inference_mode():
            logits, hidden = self.model(
                input_ids.to(self.device),
                positions.to(self.device),
                self.kv_caches,
                meta,
                self.attn_backend,
                None if logits_indices is None else logits_indices.to(self.device),
                capture,
            )
        return logits, hidden if return_hidden else None
