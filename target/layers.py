"""The blocks of one decoder layer: RMSNorm, attention, MLP and the layer that joins them, for
every family of ``target/arch.py``.

Projections are fused (q|k|v in one matmul, gate|up in another). The reference ops follow
transformers op for op (same residual order, RMSNorm in float32, rotary in the model dtype), so
float32 results match ``AutoModelForCausalLM``. With the fused float32 ops set (the quantized
path), norms, rotary, SiLU*mul and residual adds run in kernels/csrc/fused.cpp, whose row
reductions never change order with the row count; a Llama-shaped layer whose projections are all
block-quantized runs as one ``decoder_layer_`` call.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specserve.core.errors import UnsupportedArchitectureError
from specserve.kernels.linear import DenseLinear
from specserve.kernels.metadata import AttentionMetadata
from specserve.kernels.norm import rms_norm
from specserve.kernels.registry import AttentionBackend
from specserve.kernels.rotary import apply_rotary
from specserve.target.config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]  # k, v: [num_blocks, block_size, KVH, D]
# The fused float32 CPU ops of kernels/csrc/fused.cpp (specserve.kernels.quant_ext.load()), or None.
FusedOps = Any


class RMSNorm(nn.Module):
    """x / rms(x) * w, or with ``unit_offset`` Gemma's x / rms(x) * (1 + w) computed in float32
    (``weight`` holds the checkpoint's w either way)."""

    fused: FusedOps | None = None

    def __init__(self, size: int, eps: float, unit_offset: bool = False,
                 **factory: object) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, **factory))  # type: ignore[arg-type]
        self.eps = eps
        self.unit_offset = unit_offset
        self._scale: tuple[int, torch.Tensor] | None = None  # (weight's data_ptr, 1 + w)

    def scale(self) -> torch.Tensor:
        """The per-channel factor the fused op multiplies by: w, or 1 + w in float32."""
        if not self.unit_offset:
            return self.weight
        if self._scale is None or self._scale[0] != self.weight.data_ptr():
            self._scale = (self.weight.data_ptr(), 1.0 + self.weight.float())
        return self._scale[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., size] -> [..., size]
        if self.fused is not None and x.dtype == torch.float32 and (
                x.dim() == 2 or self.unit_offset):
            # torch's row reduction may change order with the row count; this one never does
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            return self.fused.rms_norm(rows, self.scale(), self.eps).view(x.shape)
        if self.unit_offset:
            h = x.float()
            h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
            return (h * (1.0 + self.weight.float())).type_as(x)
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Self-attention of one layer: fused qkv projection, optional per-head q/k RMSNorm (Qwen3,
    Gemma 3; applied before rotary), rotary (maybe partial), paged attention (with Gemma 2's
    score soft-capping), output projection."""

    fused: FusedOps | None = None

    def __init__(self, cfg: ModelConfig, layer_idx: int, **factory: object) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.rotary_dim = cfg.rotary_dim or cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim**-0.5
        self.softcap = cfg.attn_softcap
        self.sliding_window = cfg.layer_sliding_windows[layer_idx]
        self.qkv_proj = DenseLinear(
            cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias, **factory
        )
        self.o_proj = DenseLinear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias, **factory)
        norm = (lambda: RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_unit_offset, **factory))
        self.q_norm = norm() if cfg.qk_norm else None
        self.k_norm = norm() if cfg.qk_norm else None

    def _attend(self, backend: AttentionBackend, q: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        if self.softcap is None:
            return backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,
                                   self.sliding_window)
        if not getattr(backend, "supports_softcap", False):
            raise UnsupportedArchitectureError(
                f"attention backend {backend.name!r} has no attention logit soft-capping "
                f"(attn_logit_softcapping {self.softcap}, Gemma 2); use --attention-backend "
                f"torch or cpu_paged"
            )
        return backend.forward(q, k, v, kv_cache[0], kv_cache[1], meta, self.scale,  # type: ignore[call-arg]
                               self.sliding_window, softcap=self.softcap)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        x: torch.Tensor,  # [T, hidden]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, R] (R: the rotary dim)
    ) -> torch.Tensor:  # [T, hidden]
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q + 2 kv]
        if (self.fused is not None and self.q_norm is None and qkv.dtype == torch.float32
                and self.rotary_dim == self.head_dim):
            # rope[0], rope[1]: contiguous [T, D] float32 (CausalLM.forward)
            self.fused.rotary_qkv_(qkv, *rope, self.num_heads, self.num_kv_heads, self.head_dim)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            o = self._attend(
                backend, q.view(T, self.num_heads, self.head_dim),
                k.view(T, self.num_kv_heads, self.head_dim),
                v.view(T, self.num_kv_heads, self.head_dim), kv_cache, meta,
            )  # [T, H, D]
            return self.o_proj(o.reshape(T, self.q_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(T, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        v = v.view(T, self.num_kv_heads, self.head_dim)  # [T, KVH, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, rope[0][:, None], rope[1][:, None])
        o = self._attend(backend, q, k, v, kv_cache, meta)  # [T, H, D]
        return self.o_proj(o.reshape(T, self.q_size))


class MLP(nn.Module):
    """down(act(gate(x)) * up(x)) with gate and up fused into one matmul; act is SiLU or
    GELU-tanh (Gemma)."""

    fused: FusedOps | None = None

    def __init__(self, cfg: ModelConfig, **factory: object) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.activation = cfg.activation
        self.gate_up_proj = DenseLinear(
            cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias, **factory
        )
        self.down_proj = DenseLinear(
            cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias, **factory
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        if self.activation == "gelu_tanh":
            if self.fused is not None and gate_up.dtype == torch.float32:
                return self.down_proj(self.fused.gelu_tanh_mul(gate_up))
            gate, up = gate_up.split(self.intermediate, dim=-1)  # [T, I] each
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        if self.fused is not None and gate_up.dtype == torch.float32:
            return self.down_proj(self.fused.silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """h += attn(norm(h)); h += mlp(norm(h)). Gemma also normalizes each block's output before
    its residual add (``sandwich_norms``; the names are transformers': post_attention_layernorm
    is then the post-attention norm and pre_feedforward_layernorm the pre-MLP one); Granite
    scales each block's output by ``residual_scale``."""

    fused: FusedOps | None = None
    _layer_args: tuple | None = None  # cached by _whole_layer_args

    def __init__(self, cfg: ModelConfig, layer_idx: int, **factory: object) -> None:
        super().__init__()
        norm = (lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset,
                                **factory))
        self.llama_shaped = cfg.llama_shaped
        self.residual_scale = cfg.residual_scale
        self.sandwich = cfg.sandwich_norms
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg, layer_idx, **factory)
        self.post_attention_layernorm = norm()
        if cfg.sandwich_norms:
            self.pre_feedforward_layernorm = norm()
            self.post_feedforward_layernorm = norm()
        self.mlp = MLP(cfg, **factory)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        h: torch.Tensor,  # [T, hidden]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:  # [T, hidden]
        if not self.llama_shaped:
            return self._forward_general(positions, h, kv_cache, meta, backend, rope)
        if self.fused is not None and h.dtype == torch.float32:
            whole = self._whole_layer_args(backend, meta)
            if whole is not None:  # the same kernels in one C++ call (kernels/csrc/fused.cpp)
                attn = self.self_attn
                rows = h.shape[0]
                rpp = [p.kernel(rows) for p in whole[1]]
                ln1, ln2, eps, *planes = whole[0]
                self.fused.decoder_layer_(
                    h, ln1, ln2, eps, planes, rpp, rope[0], rope[1], attn.num_heads,
                    attn.num_kv_heads,
                    attn.head_dim, kv_cache[0], kv_cache[1], meta.block_tables, whole[2].seq_of,
                    whole[2].pos_of, meta.slot_mapping, attn.scale, attn.sliding_window or 0,
                    backend.form,
                )
                return h
            # The same sums, fused: h += attn(norm1(h)) in place, norm2 from the new h.
            ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
            a = self.self_attn(
                positions, self.fused.rms_norm(h, ln1.weight, ln1.eps), kv_cache, meta,
                backend, rope,
            )
            x = self.fused.add_rms_norm_(a, h, ln2.weight, ln2.eps)
            return h.add_(self.mlp(x))
        # Same order of additions as transformers, so float32 results match bit for bit.
        h = h + self.self_attn(positions, self.input_layernorm(h), kv_cache, meta, backend, rope)
        return h + self.mlp(self.post_attention_layernorm(h))

    def _forward_general(self, positions: torch.Tensor, h: torch.Tensor, kv_cache: KVCache,
                         meta: AttentionMetadata, backend: AttentionBackend,
                         rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Every other family, op for op as transformers (elementwise ops and the norms, which
        take the fused per-row op when set, so rows stay independent of the batch)."""
        a = self.self_attn(positions, self.input_layernorm(h), kv_cache, meta, backend, rope)
        if self.sandwich:
            a = self.post_attention_layernorm(a)
        h = h + (a if self.residual_scale is None else a * self.residual_scale)
        pre_mlp = self.pre_feedforward_layernorm if self.sandwich else self.post_attention_layernorm
        m = self.mlp(pre_mlp(h))
        if self.sandwich:
            m = self.post_feedforward_layernorm(m)
        return h + (m if self.residual_scale is None else m * self.residual_scale)

    def _whole_layer_args(self, backend: AttentionBackend, meta: AttentionMetadata
                          ) -> tuple[tuple, list, Any] | None:
        """(tensor args, projections, attention plan) for ``decoder_layer_`` when this layer
        can run as one C++ call: a Llama-shaped layer, every projection block-quantized with N
        a multiple of 8 (the kernel's output needs no cut), no q/k norm, and the C++
        attention taking every row of the step. None otherwise."""
        if not self.llama_shaped:
            return None
        kernel_plan = getattr(backend, "kernel_plan", None)
        plan = None if kernel_plan is None else kernel_plan(meta)
        if plan is None:
            return None
        if self._layer_args is None:
            from specserve.kernels.quant import BlockQuantLinear

            a, m = self.self_attn, self.mlp
            ln1, ln2 = self.input_layernorm, self.post_attention_layernorm
            projections = [a.qkv_proj, a.o_proj, m.gate_up_proj, m.down_proj]
            runs_whole = (
                a.q_norm is None and ln1.eps == ln2.eps
                and all(isinstance(p, BlockQuantLinear) and p.has_kernel and not p.padded
                        for p in projections)
            )
            # (qs, d, m, bias, qs5) per projection, as fused.cpp's projections_of takes them
            planes = ([t for p in projections for t in (*p.planes, p.qs5)] if runs_whole
                      else [])
            self._layer_args = (
                ((ln1.weight, ln2.weight, ln1.eps, *planes), projections) if runs_whole else ()
            )
        if not self._layer_args:
            return None
        return (*self._layer_args, plan)
