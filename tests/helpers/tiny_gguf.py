"""Writes a transformers model as llama.cpp's convert_hf_to_gguf.py would (F32 tensors): the
architecture's metadata keys, its tensor names, the q/k row permutation of Llama and Granite,
Gemma's (1 + w) norms, Llama 3's rope_freqs tensor, Phi-3's fused tensors and longrope factor
tensors, and a byte-level BPE tokenizer of ``GGUF_SPECIALS``. Written from the converter's
conventions, independently of the loader that reads them back."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

GGUF_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
GGUF_VOCAB_SIZE = len(GGUF_SPECIALS) + 256 + 1
_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "phi3": "phi3",
         "granite": "granite", "gemma2": "gemma2", "gemma3_text": "gemma3"}
_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GEMMA_NAMES = {"post_attention_layernorm": "post_attention_norm",
                "pre_feedforward_layernorm": "ffn_norm",
                "post_feedforward_layernorm": "post_ffw_norm"}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half pairs -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def _llama3_rope_factors(rope: dict, head_dim: int) -> np.ndarray:
    """The converter's rope_freqs for a llama3 rope: 1, factor, or the smooth blend between."""
    base, factor = rope["rope_theta"], rope["factor"]
    low, high = rope["low_freq_factor"], rope["high_freq_factor"]
    old = rope["original_max_position_embeddings"]
    freqs = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(model: torch.nn.Module, path: Path) -> None:
    """Writes ``model`` (float32, one of the architectures of ``_ARCH``) at ``path``."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    cfg = model.config
    if cfg.model_type not in _ARCH:
        raise ValueError(f"no GGUF writer for {cfg.model_type}")
    if cfg.vocab_size != GGUF_VOCAB_SIZE:
        raise ValueError(f"a GGUF tiny model's vocabulary is its byte-level tokenizer's: "
                         f"vocab_size must be {GGUF_VOCAB_SIZE} (got {cfg.vocab_size})")
    arch = _ARCH[cfg.model_type]
    gemma = arch.startswith("gemma")
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    rope = dict(cfg.rope_parameters)
    if arch == "gemma3":
        local, rope = rope["sliding_attention"], rope["full_attention"]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rot = int(head_dim * rope.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(rot)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    extra: dict[str, np.ndarray] = {}
    if rope.get("rope_type") == "llama3":
        extra["rope_freqs.weight"] = _llama3_rope_factors(rope, head_dim)
    elif rope.get("rope_type") == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    elif rope.get("rope_type") == "longrope":
        original = rope["original_max_position_embeddings"]
        scale = cfg.max_position_embeddings / original
        w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        w.add_rope_scaling_orig_ctx_len(original)
        extra["rope_factors_long.weight"] = np.array(rope["long_factor"], dtype=np.float32)
        extra["rope_factors_short.weight"] = np.array(rope["short_factor"], dtype=np.float32)
    if getattr(cfg, "sliding_window", None) and arch in ("phi3", "gemma2", "gemma3"):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "gemma3":
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
        w.add_rope_freq_base_swa(float(local["rope_theta"]))
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch == "granite":
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    _add_tokenizer(w, bytes_to_unicode, gguf)
    w.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    names = {**_NAMES, **(_GEMMA_NAMES if gemma else {})}
    for name, t in state.items():
        parts = name.split(".")
        if parts[:2] != ["model", "layers"]:
            continue
        layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
        gguf_name = names[module]
        if arch in ("llama", "granite") and gguf_name in ("attn_q", "attn_k"):
            heads = cfg.num_attention_heads if gguf_name == "attn_q" else cfg.num_key_value_heads
            t = llama_cpp_permute(t, heads)
        if gemma and module.endswith("norm"):
            t = t + 1.0
        w.add_tensor(f"blk.{layer}.{gguf_name}.{kind}", np.ascontiguousarray(t))
    norm = state["model.norm.weight"]
    w.add_tensor("output_norm.weight", norm + 1.0 if gemma else norm)
    if not cfg.tie_word_embeddings:
        w.add_tensor("output.weight", state["lm_head.weight"])
    for name, t in extra.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add_tokenizer(w, bytes_to_unicode, gguf) -> None:
    """Byte-level BPE: the specials, the 256 byte symbols, one merge ("Ġ" + "t")."""
    symbols = list(bytes_to_unicode().values())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([*GGUF_SPECIALS, *symbols, "Ġt"])
    w.add_token_types([gguf.TokenType.CONTROL] * len(GGUF_SPECIALS)
                      + [gguf.TokenType.NORMAL] * 257)
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")
