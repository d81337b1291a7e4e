"""Rotary position embedding (rotate-half layout, as in Hugging Face Llama/Qwen checkpoints).

Frequencies come from transformers' own rope initializers, so every scaling variant the config
names (linear, llama3, yarn, ...) is computed exactly as the reference implementation does.
Variants whose frequencies depend on the current sequence length ("dynamic") cannot be served
from a shared paged cache and are refused.
"""

from __future__ import annotations

import torch

from specserve.core.errors import UnsupportedArchitectureError

# rope types whose frequencies depend on the running sequence length: keys cached at one length
# would be wrong at another, so a paged KV cache cannot serve them exactly.
# ("longrope" switches factors at original_max_position_embeddings; we serve its short factors and
# the model config caps the context there, see target/config.py.)
_LENGTH_DEPENDENT_ROPE = ("dynamic",)


def rope_parameters(hf_config: object, layer_type: str | None = None) -> dict:
    """The config's rope settings as one dict (transformers 5 `rope_parameters`, or the older
    `rope_theta` + `rope_scaling` pair); ``layer_type``: the settings of that layer type, for
    configs that key them by it (Gemma 3)."""
    params = getattr(hf_config, "rope_parameters", None)
    if layer_type is not None and params is not None:
        params = params[layer_type]
    if params is None:
        params = dict(getattr(hf_config, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    params = dict(params)
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    return params


class RotaryEmbedding:
    """Applies RoPE to q and k given each token's absolute position. ``rotary_dim``: how many
    leading dims of a head rotate (partial rotary; None: all of ``head_dim``); ``layer_type``:
    which of a per-layer-type rope config's settings to use."""

    def __init__(self, hf_config: object, head_dim: int, device: torch.device | str = "cpu",
                 *, rotary_dim: int | None = None, layer_type: str | None = None):
        params = rope_parameters(hf_config, layer_type)
        dim = rotary_dim or head_dim
        rope_type = params["rope_type"]
        if rope_type in _LENGTH_DEPENDENT_ROPE:
            raise UnsupportedArchitectureError(
                f"rope_type {rope_type!r} changes frequencies with sequence length and is not "
                f"supported; supported: default, linear, llama3, yarn, longrope"
            )
        if rope_type == "default":
            base = float(params["rope_theta"])
            inv_freq = 1.0 / (
                base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
            )
            scaling = 1.0
            factors = getattr(hf_config, "rope_freq_factors", None)
            if factors is not None:  # a GGUF's rope_freqs (Llama 3), as llama.cpp applies them
                inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
        elif getattr(hf_config, "rope_freq_factors", None) is not None:
            raise UnsupportedArchitectureError(
                f"rope_freq_factors with rope_type {rope_type!r} is not supported")
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            if rope_type not in ROPE_INIT_FUNCTIONS:
                raise UnsupportedArchitectureError(f"unknown rope_type {rope_type!r}")
            kw = {} if layer_type is None else {"layer_type": layer_type}
            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu", **kw)
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)  # [D/2]
        self.attention_scaling = float(scaling)
        self.head_dim = head_dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """positions: [T] -> cos, sin: [T, 1, R] in `dtype` (computed in float32 first; R is the
        rotary dim)."""
        freqs = positions[:, None].to(torch.float32) * self.inv_freq[None, :]  # [T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
        cos = (emb.cos() * self.attention_scaling).to(dtype)
        sin = (emb.sin() * self.attention_scaling).to(dtype)
        return cos[:, None, :], sin[:, None, :]

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [T]; q: [T, H, D]; k: [T, KVH, D] -> rotated (q, k), same shapes."""
        cos, sin = self.cos_sin(positions, q.dtype)
        return apply_rotary(q, k, cos, sin)

    __call__ = forward


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, KVH, D], cos/sin: [T, 1, R] (from ``cos_sin``, computed once per step
    and shared by every layer). R < D: only the first R dims of each head rotate (partial
    rotary, as transformers' Phi-3), the rest pass through."""
    rot = cos.shape[-1]
    if rot < q.shape[-1]:
        q_rot, k_rot = apply_rotary(q[..., :rot], k[..., :rot], cos, sin)
        return (torch.cat((q_rot, q[..., rot:]), dim=-1),
                torch.cat((k_rot, k[..., rot:]), dim=-1))
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
