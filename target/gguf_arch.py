"""A GGUF file's architecture, as llama.cpp's loader reads it: ``general.architecture`` and that
architecture's metadata keys decide the model, turned into the transformers config and the
Hugging Face tensor names our loader takes from a folder.

    general.architecture  config               read beyond the common keys
    llama                 LlamaForCausalLM     rope_freqs tensor (Llama 3 rope factors),
                                               rope.scaling linear
    qwen2 / qwen3         Qwen2/3ForCausalLM   (q/k norms are tensors)
    phi3                  Phi3ForCausalLM      rope.dimension_count (partial rotary),
                                               attention.sliding_window, longrope from
                                               rope.scaling.* and rope_factors_long/short
    granite               GraniteForCausalLM   embedding_scale, residual_scale,
                                               attention.scale, logit_scale
    gemma2                Gemma2ForCausalLM    attn/final_logit_softcapping,
                                               attention.sliding_window (every other layer)
    gemma3                Gemma3ForCausalLM    attention.sliding_window(_pattern, default 6),
                                               rope.freq_base (global) / freq_base_swa (local,
                                               default 10k), rope.scaling linear (global only)

As llama.cpp does: a "llama" file is a Llama whatever its name says (llama.cpp keeps no
sliding window for it); the query scale of Gemma is head_dim^-1/2 except for the 27B shapes
(46 layers for Gemma 2, 62 for Gemma 3), which scale by (hidden / heads)^-1/2; the converter's
q/k row permutation (llama, granite) and Gemma's stored (1 + w) norms are undone. Any other
architecture, and any rope scaling not listed, is refused by name.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from specserve.core.errors import UnsupportedArchitectureError

GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "phi3", "granite", "gemma2", "gemma3")
PERMUTED_QK = ("llama", "granite")  # the converter permutes q/k rows for llama.cpp's rope
_CONFIG_CLASS = {
    "llama": "LlamaConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
    "phi3": "Phi3Config", "granite": "GraniteConfig", "gemma2": "Gemma2Config",
    "gemma3": "Gemma3TextConfig",
}
_ARCH_NAME = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM", "granite": "GraniteForCausalLM",
    "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_qkv": "self_attn.qkv_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GEMMA_LAYER_TENSORS = {  # Gemma norms around each block
    "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_CONFIG_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value as Python (a string, a number, or a list of them)."""
    return reader.fields.get(key, default)


def architecture(reader: Any) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF architecture {arch!r} is not supported; specserve serves GGUF architectures "
            f"{', '.join(GGUF_ARCHITECTURES)}"
        )
    return arch


def hf_config_from_gguf(reader: Any) -> Any:
    """The transformers config of the file's model (``architectures`` set), from its metadata
    and its few config tensors. Raises ``UnsupportedArchitectureError`` naming what it cannot
    reproduce."""
    import transformers

    arch = architecture(reader)

    def key(name: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{name}", default)

    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise UnsupportedArchitectureError(f"{arch}: per-layer head_count_kv is not supported")
    head_dim = int(key("attention.key_length", hidden // heads))
    layers = int(key("block_count"))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = key("vocab_size") or (len(tokens) if tokens is not None else None)
    if vocab is None:
        vocab = int(_tensor(reader, "token_embd.weight").shape[0])
    kw: dict[str, Any] = dict(
        vocab_size=int(vocab), hidden_size=hidden, intermediate_size=int(key(
            "feed_forward_length")), num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=int(kv_heads), head_dim=head_dim,
        max_position_embeddings=int(key("context_length", 2048)),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)),
        tie_word_embeddings=all(t.name != "output.weight" for t in reader.tensors),
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        pad_token_id=_field(reader, "tokenizer.ggml.padding_token_id"),
    )
    rope = {"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))}
    scaling = key("rope.scaling.type", "none")
    if scaling == "linear" and arch != "phi3":
        rope.update(rope_type="linear", factor=float(key("rope.scaling.factor")))
    elif scaling not in ("none", "linear") and arch != "phi3":
        raise UnsupportedArchitectureError(f"{arch}: GGUF rope scaling {scaling!r} is not "
                                           f"supported (none, linear)")
    if arch == "llama":
        factors = _tensor(reader, "rope_freqs.weight")
        if factors is not None:  # Llama 3: inv_freq / factor, as llama.cpp's freq_factors
            kw["rope_freq_factors"] = [float(f) for f in factors.reshape(-1)]
        kw["rope_parameters"] = rope
    elif arch in ("qwen2", "qwen3"):
        kw.update(rope_parameters=rope, use_sliding_window=False, sliding_window=None)
    elif arch == "phi3":
        kw.update(_phi3(reader, key, rope, head_dim, kw["max_position_embeddings"]))
    elif arch == "granite":
        kw.update(rope_parameters=rope, embedding_multiplier=float(key("embedding_scale", 1.0)),
                  residual_multiplier=float(key("residual_scale", 1.0)),
                  attention_multiplier=float(key("attention.scale", head_dim**-0.5)),
                  logits_scaling=float(key("logit_scale", 1.0)),
                  attention_bias=any(t.name.endswith("attn_q.bias") for t in reader.tensors))
    else:
        kw.update(_gemma(reader, arch, key, rope, hidden, heads, head_dim, layers))
    config = getattr(transformers, _CONFIG_CLASS[arch])(**kw)
    config.architectures = [_ARCH_NAME[arch]]
    return config


def _phi3(reader: Any, key: Any, rope: dict, head_dim: int, context: int) -> dict:
    rot = int(key("rope.dimension_count", head_dim))
    rope = {**rope, "rope_type": "default"}
    if rot != head_dim:
        rope["partial_rotary_factor"] = rot / head_dim
    long, short = (_tensor(reader, f"rope_factors_{k}.weight") for k in ("long", "short"))
    original = key("rope.scaling.original_context_length")
    if long is not None and short is not None:
        rope.update(rope_type="longrope", long_factor=[float(x) for x in long.reshape(-1)],
                    short_factor=[float(x) for x in short.reshape(-1)],
                    original_max_position_embeddings=int(original or context))
        attn = key("rope.scaling.attn_factor")
        if attn is not None:
            rope["attention_factor"] = float(attn)
    elif key("rope.scaling.type", "none") not in ("none",):
        raise UnsupportedArchitectureError(
            f"phi3: GGUF rope scaling {key('rope.scaling.type')!r} without rope_factors tensors "
            f"is not supported")
    out = dict(rope_parameters=rope, sliding_window=key("attention.sliding_window") or None)
    if original is not None:
        out["original_max_position_embeddings"] = int(original)
    return out


def _gemma(reader: Any, arch: str, key: Any, rope: dict, hidden: int, heads: int,
           head_dim: int, layers: int) -> dict:
    is_27b = layers == (46 if arch == "gemma2" else 62)
    out: dict[str, Any] = dict(
        hidden_activation="gelu_pytorch_tanh",
        query_pre_attn_scalar=hidden // heads if is_27b else head_dim,
        sliding_window=int(key("attention.sliding_window", 4096)),
        attn_logit_softcapping=key("attn_logit_softcapping"),
        final_logit_softcapping=key("final_logit_softcapping"),
    )
    if arch == "gemma2":
        out["rope_parameters"] = rope
        return out
    pattern = key("attention.sliding_window_pattern", 6)
    if isinstance(pattern, list):  # one flag per layer: True = sliding
        types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        types = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention"
                 for i in range(layers)]
    local = {"rope_type": "default", "rope_theta": float(key("rope.freq_base_swa", 10000.0))}
    out.update(layer_types=types, rope_parameters={"full_attention": rope,
                                                   "sliding_attention": local})
    return out


def _tensor(reader: Any, name: str) -> np.ndarray | None:
    from gguf import dequantize

    for t in reader.tensors:
        if t.name == name:
            return dequantize(t.data, t.tensor_type)
    return None


def gguf_state_dict(reader: Any, config: Any, skip: frozenset[str] = frozenset()
                    ) -> dict[str, torch.Tensor]:
    """Every model tensor of the file but those named in ``skip`` (the file's names: tensors
    the model takes as blocks), dequantized to float32, under Hugging Face names (q/k rows
    un-permuted, Gemma norms back to w). Raises ``UnsupportedArchitectureError`` for a tensor
    no architecture we run has."""
    from gguf import dequantize

    arch = architecture(reader)
    gemma = arch in ("gemma2", "gemma3")
    layer_names = {**_LAYER_TENSORS, **(_GEMMA_LAYER_TENSORS if gemma else {})}
    if arch == "phi3":
        layer_names["ffn_up"] = "mlp.gate_up_proj"  # phi3's ffn_up holds gate and up
    out: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    for t in reader.tensors:
        if t.name in _CONFIG_TENSORS or t.name in skip:
            continue
        m = _BLK.match(t.name)
        if m is not None and m.group(2) in layer_names:
            layer, part, kind = m.groups()
            hf = f"model.layers.{layer}.{layer_names[part]}.{kind}"
        elif t.name in _GLOBAL_TENSORS:
            hf, part = _GLOBAL_TENSORS[t.name], ""
        else:
            unknown.append(t.name)
            continue
        # a copy: the reader's arrays are read-only views of the memory-mapped file
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        if arch in PERMUTED_QK and part in ("attn_q", "attn_k"):
            n = config.num_attention_heads if part == "attn_q" else config.num_key_value_heads
            w = _unpermute(w, n)
        if gemma and hf.endswith("norm.weight"):
            w = w - 1.0
        out[hf] = w
    if unknown:
        more = f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        raise UnsupportedArchitectureError(
            f"GGUF {arch} file has tensors no supported model has: {', '.join(unknown[:5])}{more}"
        )
    return out


def _unpermute(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Undoes convert_hf_to_gguf's q/k permutation: per head, rows (2i, 2i + 1) of the file
    came from rows (i, i + dim / 2) of the checkpoint (weights [rows, K] and biases [rows])."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
