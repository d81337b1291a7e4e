"""ModelConfig: the few numbers our Llama-family model needs, distilled from a HF config.

Each field is derived exactly the way transformers 5 builds the same architecture, so a model we
build from a ``ModelConfig`` computes what ``AutoModelForCausalLM`` computes:

    field                 Llama            Mistral          Qwen2              Qwen3
    qkv_bias              attention_bias   False            True               attention_bias
    o_bias                attention_bias   False            False              attention_bias
    mlp_bias              mlp_bias         False            False              False
    qk_norm               no               no               no                 yes (per head)
    sliding window        never            every layer      layers marked "sliding_attention" in
                                           (sliding_window) layer_types (from use_sliding_window
                                                            and max_window_layers by default)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specserve.core.errors import UnsupportedArchitectureError

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
# Rope variants whose frequencies depend only on the position (never on the current sequence
# length), so keys cached at one step stay valid at the next. "dynamic" and "longrope" rescale
# with the running length inside transformers' forward and cannot be served from a paged cache.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def _unsupported(what: str) -> UnsupportedArchitectureError:
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
        raise _unsupported(f"unsupported model architecture {named}")
    return arch


def _token_ids(value: Any) -> tuple[int, ...]:
    """An int, a list of ints or None -> a tuple of ints."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_type(hf_config: Any) -> str:
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None)
    params = params or {}
    return str(params.get("rope_type", params.get("type", "default")))


@dataclass(frozen=True)
class ModelConfig:
    """Architecture numbers of one decoder-only model.

    Invariants: ``num_heads % num_kv_heads == 0``; ``len(layer_sliding_windows) == num_layers``;
    ``sliding_window`` is the window of the layers that have one (None when no layer does).
    ``hf_config`` is kept for the rotary embedding, which reads its rope parameters directly.
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

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Distills a transformers ``PretrainedConfig``. Raises ``UnsupportedArchitectureError``
        for architectures, activations and rope types we cannot reproduce exactly."""
        model_type = str(getattr(hf_config, "model_type", ""))
        arch = check_architecture(getattr(hf_config, "architectures", None), model_type)
        c = hf_config
        act = getattr(c, "hidden_act", "silu")
        if act != "silu":
            raise _unsupported(f"unsupported activation {act!r} (only silu)")
        rope_type = _rope_type(c)
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise _unsupported(f"unsupported rope type {rope_type!r}")
        rope_params = getattr(c, "rope_parameters", None) or {}
        partial = rope_params.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0))
        if partial not in (None, 1, 1.0):
            raise _unsupported(f"unsupported partial_rotary_factor {partial}")

        num_heads = int(c.num_attention_heads)
        num_kv_heads = int(getattr(c, "num_key_value_heads", None) or num_heads)
        if num_heads % num_kv_heads:
            raise UnsupportedArchitectureError(
                f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads "
                f"{num_kv_heads}"
            )
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // num_heads
        attention_bias = bool(getattr(c, "attention_bias", False))
        windows = _layer_sliding_windows(c, model_type)
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
            head_dim=int(head_dim),
            rms_norm_eps=float(c.rms_norm_eps),
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            qkv_bias={"qwen2": True, "mistral": False}.get(model_type, attention_bias),
            o_bias=attention_bias if model_type in ("llama", "qwen3") else False,
            mlp_bias=bool(getattr(c, "mlp_bias", False)) if model_type == "llama" else False,
            qk_norm=model_type == "qwen3",
            sliding_window=next((w for w in windows if w is not None), None),
            layer_sliding_windows=windows,
            max_position_embeddings=int(getattr(c, "max_position_embeddings", 2048)),
            bos_token_id=getattr(c, "bos_token_id", None),
            eos_token_ids=_token_ids(getattr(c, "eos_token_id", None)),
            torch_dtype=str(dtype).removeprefix("torch.") if dtype is not None else None,
            hf_config=c,
        )


def _layer_sliding_windows(c: Any, model_type: str) -> tuple[int | None, ...]:
    """The attention window of every layer, as transformers 5 applies it.

    Mistral masks every layer with ``config.sliding_window`` (it ignores ``layer_types``). Qwen2
    and Qwen3 window the layers whose ``layer_types`` entry is "sliding_attention"; by default
    those are the layers ``i >= max_window_layers`` when ``use_sliding_window`` is set (the config
    clears ``sliding_window`` otherwise). Llama never windows.
    """
    n = int(c.num_hidden_layers)
    window = getattr(c, "sliding_window", None)
    if model_type == "mistral":
        return (window,) * n
    if model_type in ("qwen2", "qwen3"):
        layer_types = list(getattr(c, "layer_types", None) or ["full_attention"] * n)
        if len(layer_types) != n:
            raise UnsupportedArchitectureError(
                f"layer_types has {len(layer_types)} entries for {n} layers"
            )
        unknown = set(layer_types) - {"full_attention", "sliding_attention"}
        if unknown:
            raise UnsupportedArchitectureError(f"unsupported layer types {sorted(unknown)}")
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (None,) * n
