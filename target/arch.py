"""The architectures we run and what sets each family apart from Llama, read from a transformers
config exactly as transformers 5 builds the same model.

    family    norms                        MLP        extras
    llama     pre-attn, pre-MLP            SiLU       (Llama 3.2: tied head, llama3 rope)
    mistral   as llama                     SiLU       every layer windowed
    qwen2/3   as llama                     SiLU       windowed layers from layer_types; Qwen3
                                                      per-head q/k norm
    phi3      as llama                     SiLU       fused qkv / gate_up in the checkpoint;
                                                      partial rotary; longrope (short factors)
    granite   as llama                     SiLU       embedding / residual / attention / logits
                                                      multipliers
    gemma2    (1 + w) RMSNorm, pre and     GELU-tanh  embedding x sqrt(hidden); query scale
              post around attn and MLP                query_pre_attn_scalar^-1/2; attention and
                                                      final logit soft-capping; interleaved
                                                      sliding / global layers
    gemma3    as gemma2, plus per-head     GELU-tanh  as gemma2 without soft-capping (unless
              q/k norm                                the config sets it); its own rope for
                                                      sliding and for global layers

Anything a config sets that we would compute differently is refused by name
(``UnsupportedArchitectureError``), never approximated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from specserve.core.errors import UnsupportedArchitectureError

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Phi3ForCausalLM": "phi3",
    "GraniteForCausalLM": "granite",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
}
# Rope variants whose frequencies depend only on the position, so keys cached at one step stay
# valid at the next. "longrope" switches factors with the running length in transformers; we
# serve it with its short factors and cap the context at original_max_position_embeddings, where
# the two agree. "dynamic" rescales with every length and cannot be served from a paged cache.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
GEMMA = ("gemma2", "gemma3_text")
_REFUSED_HINTS = {
    "Gemma3ForConditionalGeneration": "the multimodal Gemma 3 checkpoint; serve its GGUF text "
    "weights, or a Gemma3ForCausalLM (text-only) folder",
}


def unsupported(what: str) -> UnsupportedArchitectureError:
    return UnsupportedArchitectureError(
        f"{what}; specserve serves {', '.join(SUPPORTED_ARCHITECTURES)} "
        f"with rope types {', '.join(SUPPORTED_ROPE_TYPES)}"
    )


def check_architecture(architectures: list[str] | None, model_type: str) -> str:
    """The supported architecture a config names (GGUF-derived configs name none; their
    model_type decides). Raises ``UnsupportedArchitectureError`` otherwise."""
    archs = list(architectures or [])
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None and not archs:
        arch = next((a for a, t in SUPPORTED_ARCHITECTURES.items() if t == model_type), None)
    if arch is None or SUPPORTED_ARCHITECTURES[arch] != model_type:
        named = ", ".join(archs) or f"model_type {model_type!r}"
        hint = next((f" ({h})" for a, h in _REFUSED_HINTS.items() if a in archs), "")
        raise unsupported(f"unsupported model architecture {named}{hint}")
    return arch


@dataclass(frozen=True)
class FamilyTraits:
    """What one family computes differently from Llama (see the module table)."""

    activation: str = "silu"  # "silu" | "gelu_tanh"
    norm_unit_offset: bool = False  # RMSNorm scales by (1 + weight), in float32 (Gemma)
    sandwich_norms: bool = False  # norms after attention and MLP too (Gemma)
    embed_scale: float | None = None  # embeddings x this (Gemma sqrt(hidden), Granite)
    residual_scale: float | None = None  # h = residual + scale * block(h) (Granite)
    attn_scale: float | None = None  # None: head_dim^-1/2
    attn_softcap: float | None = None  # scores = cap * tanh(scores / cap) (Gemma 2)
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2)
    logits_divisor: float | None = None  # logits / this (Granite)
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False


def family_traits(c: Any, model_type: str) -> FamilyTraits:
    """The traits of ``model_type`` from config ``c``; raises ``UnsupportedArchitectureError``
    for options of the family we do not reproduce."""
    attention_bias = bool(getattr(c, "attention_bias", False))
    if model_type in GEMMA:
        act = getattr(c, "hidden_activation", None) or getattr(c, "hidden_act", None)
        if act != "gelu_pytorch_tanh":
            raise unsupported(f"unsupported activation {act!r} for {model_type} "
                              f"(only gelu_pytorch_tanh)")
        if getattr(c, "use_bidirectional_attention", None):
            raise unsupported(f"{model_type} with use_bidirectional_attention")
        return FamilyTraits(
            activation="gelu_tanh", norm_unit_offset=True, sandwich_norms=True,
            embed_scale=float(c.hidden_size) ** 0.5,
            attn_scale=float(c.query_pre_attn_scalar) ** -0.5,
            attn_softcap=_optional_float(getattr(c, "attn_logit_softcapping", None)),
            final_softcap=_optional_float(getattr(c, "final_logit_softcapping", None)),
            qk_norm=model_type == "gemma3_text", qkv_bias=attention_bias, o_bias=attention_bias,
        )
    act = getattr(c, "hidden_act", "silu")
    if act != "silu":
        raise unsupported(f"unsupported activation {act!r} for {model_type} (only silu)")
    if model_type == "granite":
        return FamilyTraits(
            embed_scale=float(c.embedding_multiplier), residual_scale=float(
                c.residual_multiplier), attn_scale=float(c.attention_multiplier),
            logits_divisor=float(c.logits_scaling), qkv_bias=attention_bias,
            o_bias=attention_bias, mlp_bias=bool(getattr(c, "mlp_bias", False)),
        )
    if model_type == "phi3":
        return FamilyTraits()
    return FamilyTraits(
        qk_norm=model_type == "qwen3",
        qkv_bias={"qwen2": True, "mistral": False}.get(model_type, attention_bias),
        o_bias=attention_bias if model_type in ("llama", "qwen3") else False,
        mlp_bias=bool(getattr(c, "mlp_bias", False)) if model_type == "llama" else False,
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def layer_types(c: Any, model_type: str) -> tuple[str, ...]:
    """Every layer's attention type ("full_attention" / "sliding_attention") as transformers 5
    masks it. Mistral windows every layer with ``sliding_window`` (it ignores layer_types), and
    so does Phi-3 when it sets one; Qwen2/3 and Gemma follow ``layer_types`` (their configs fill
    it: Qwen from use_sliding_window and max_window_layers, Gemma 2 every other layer, Gemma 3
    from sliding_window_pattern); Llama and Granite never window."""
    n = int(c.num_hidden_layers)
    window = getattr(c, "sliding_window", None)
    if model_type in ("mistral", "phi3"):
        return ("sliding_attention" if window else "full_attention",) * n
    if model_type in ("qwen2", "qwen3", *GEMMA):
        types = tuple(getattr(c, "layer_types", None) or ("full_attention",) * n)
        if len(types) != n:
            raise UnsupportedArchitectureError(f"layer_types has {len(types)} entries for {n} "
                                               f"layers")
        unknown = set(types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise UnsupportedArchitectureError(f"unsupported layer types {sorted(unknown)}")
        return types
    return ("full_attention",) * n
