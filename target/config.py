"""ModelConfig: the numbers our decoder needs, distilled from a HF config.

Each field is derived exactly the way transformers 5 builds the same architecture (the family
table is in ``target/arch.py``), so a model we build from a ``ModelConfig`` computes what
``AutoModelForCausalLM`` computes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from specserve.core.errors import UnsupportedArchitectureError
from specserve.target.arch import (
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_ROPE_TYPES,
    check_architecture,
    family_traits,
    layer_types,
    unsupported,
)

__all__ = ["SUPPORTED_ARCHITECTURES", "SUPPORTED_ROPE_TYPES", "ModelConfig", "check_architecture"]
log = logging.getLogger(__name__)


def _token_ids(value: Any) -> tuple[int, ...]:
    """An int, a list of ints or None -> a tuple of ints."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def rope_keys(hf_config: Any, types: tuple[str, ...]) -> tuple[str | None, ...]:
    """Per layer, the key of its own rope parameters when the config keys them by layer type
    (Gemma 3: "sliding_attention" local base, "full_attention" global base), else None."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    if set(types) <= set(params) and all(isinstance(params[t], dict) for t in types):
        return tuple(types)
    return (None,) * len(types)


def _rope_params(hf_config: Any, key: str | None) -> dict:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    params = dict(params or {})
    return dict(params[key]) if key is not None else params


def _rope_type(params: dict) -> str:
    return str(params.get("rope_type", params.get("type", "default")))


@dataclass(frozen=True)
class ModelConfig:
    """Architecture numbers of one decoder-only model.

    Invariants: ``num_heads % num_kv_heads == 0``; ``len(layer_sliding_windows) ==
    len(layer_rope_keys) == num_layers``; ``sliding_window`` is the window of the layers that
    have one (None when no layer does); ``rotary_dim <= head_dim`` (even). ``hf_config`` is kept
    for the rotary embedding, which reads its rope parameters directly. The fields after it
    default to Llama's behaviour (see ``target/arch.py`` for who sets them).
    """

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    sliding_window: int | None
    layer_sliding_windows: tuple[int | None, ...]
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str | None  # the checkpoint's declared dtype ("bfloat16", ...), if any
    hf_config: Any = field(repr=False, compare=False)
    rotary_dim: int = 0  # 0: head_dim
    layer_rope_keys: tuple[str | None, ...] = ()  # (): every layer the config's one rope
    activation: str = "silu"
    norm_unit_offset: bool = False
    sandwich_norms: bool = False
    embed_scale: float | None = None
    residual_scale: float | None = None
    attn_scale: float | None = None  # None: head_dim^-1/2
    attn_softcap: float | None = None
    final_softcap: float | None = None
    logits_divisor: float | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def llama_shaped(self) -> bool:
        """True when every layer is the plain Llama block (what the fused C++ decoder layer and
        the fused rotary compute): SiLU MLP, x * w RMSNorm before attention and MLP only, no
        multipliers or soft-capping, full rotary, the default query scale."""
        return (
            self.activation == "silu" and not self.norm_unit_offset and not self.sandwich_norms
            and self.embed_scale is None and self.residual_scale is None
            and self.attn_scale is None and self.attn_softcap is None
            and self.final_softcap is None and self.logits_divisor is None
            and self.rotary_dim in (0, self.head_dim)
        )

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Distills a transformers ``PretrainedConfig``. Raises ``UnsupportedArchitectureError``
        for architectures, activations and rope types we cannot reproduce exactly."""
        model_type = str(getattr(hf_config, "model_type", ""))
        arch = check_architecture(getattr(hf_config, "architectures", None), model_type)
        c = hf_config
        traits = family_traits(c, model_type)
        num_heads = int(c.num_attention_heads)
        num_kv_heads = int(getattr(c, "num_key_value_heads", None) or num_heads)
        if num_heads % num_kv_heads:
            raise UnsupportedArchitectureError(
                f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads "
                f"{num_kv_heads}"
            )
        head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // num_heads)
        types = layer_types(c, model_type)
        keys = rope_keys(c, types)
        max_positions = int(getattr(c, "max_position_embeddings", 2048))
        partials = set()
        for key in dict.fromkeys(keys):
            params = _rope_params(c, key)
            rope_type = _rope_type(params)
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise unsupported(f"unsupported rope type {rope_type!r}")
            partials.add(float(params.get("partial_rotary_factor",
                                          getattr(c, "partial_rotary_factor", None) or 1.0)))
            if rope_type == "longrope":
                original = int(params.get("original_max_position_embeddings") or max_positions)
                if original < max_positions:
                    log.warning(
                        "longrope: serving the short factors, so the context is capped at "
                        "original_max_position_embeddings %d (the config allows %d; past that "
                        "transformers switches to the long factors for the whole sequence, "
                        "which a paged cache cannot follow)", original, max_positions)
                    max_positions = original
        if model_type != "phi3" and partials != {1.0}:  # only Phi-3's rope reads the factor
            raise unsupported(f"unsupported partial_rotary_factor {partials} for {model_type}")
        if len(partials) != 1:
            raise unsupported(f"rope layers with different partial_rotary_factor {partials}")
        rotary_dim = int(head_dim * partials.pop())
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise unsupported(f"unsupported rotary dimension {rotary_dim} of head_dim {head_dim}")
        window = getattr(c, "sliding_window", None)
        windows = tuple(window if t == "sliding_attention" else None for t in types)
        dtype = getattr(c, "dtype", None)  # transformers >= 4.56 (torch_dtype is deprecated)
        return cls(
            architecture=arch,
            model_type=model_type,
            vocab_size=int(c.vocab_size),
            hidden_size=int(c.hidden_size),
            intermediate_size=int(c.intermediate_size),
            num_layers=int(c.num_hidden_layers),
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(c.rms_norm_eps),
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            qkv_bias=traits.qkv_bias,
            o_bias=traits.o_bias,
            mlp_bias=traits.mlp_bias,
            qk_norm=traits.qk_norm,
            sliding_window=next((w for w in windows if w is not None), None),
            layer_sliding_windows=windows,
            max_position_embeddings=max_positions,
            bos_token_id=getattr(c, "bos_token_id", None),
            eos_token_ids=_token_ids(getattr(c, "eos_token_id", None)),
            torch_dtype=str(dtype).removeprefix("torch.") if dtype is not None else None,
            hf_config=c,
            rotary_dim=rotary_dim,
            layer_rope_keys=keys if any(k is not None for k in keys) else (),
            activation=traits.activation,
            norm_unit_offset=traits.norm_unit_offset,
            sandwich_norms=traits.sandwich_norms,
            embed_scale=traits.embed_scale,
            residual_scale=traits.residual_scale,
            attn_scale=traits.attn_scale,
            attn_softcap=traits.attn_softcap,
            final_softcap=traits.final_softcap,
            logits_divisor=traits.logits_divisor,
        )
