"""The one builder of tiny random models: a transformers model made from a small config, its
weights drawn from a fixed seed, written where a user's model would be (a Hugging Face folder,
or a GGUF file as llama.cpp's converter writes it), and returned for reference outputs.

Parametrized by architecture and sizes (``tiny_config``), by how the weights are drawn
(``WeightInit``), by tokenizer (none, or the default model's real one, chat template included)
and by file format. The same arguments always give the same weights, bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

# The sizes most tests run: 300 tokens, 2 layers of width 64, grouped-query attention.
BASE = dict(
    vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    bos_token_id=1, eos_token_id=2,
)
CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config,
    "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig, "phi3": Phi3Config,
    "granite": GraniteConfig,
}
# Control tokens of the GGUF variant's byte-level BPE tokenizer (then the 256 byte symbols and
# one merge): a GGUF model's vocabulary is exactly these 260 tokens.
GGUF_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
GGUF_VOCAB_SIZE = len(GGUF_SPECIALS) + 256 + 1


@dataclass(frozen=True)
class WeightInit:
    """How weights are drawn after transformers' own initialization (in parameter order, from
    the builder's seed). ``matrix_std`` None keeps transformers' init untouched; otherwise
    every non-norm parameter is redrawn N(0, matrix_std) (matrices) or N(0, vector_std)
    (biases), and norms become 1 + N(0, norm_std) when ``norm_std`` is set."""

    matrix_std: float | None = None
    vector_std: float = 0.0
    norm_std: float | None = None


HF_INIT = WeightInit()
# Larger than the default init: clear argmax margins, so greedy outputs are stable references.
MARGINS = WeightInit(0.12, 0.3)
# Larger still, norms perturbed: attention far from uniform, so a wrong mask, window or rotary
# shows in the logits.
SHARP = WeightInit(0.15, 0.5, 0.3)


def tiny_config(arch: str = "llama", **overrides) -> PretrainedConfig:
    """A config of ``arch`` with ``BASE``'s sizes, ``overrides`` on top."""
    if arch not in CONFIG_CLASSES:
        raise ValueError(f"unknown tiny architecture {arch!r}: expected one of "
                         f"{', '.join(CONFIG_CLASSES)}")
    return CONFIG_CLASSES[arch](**{**BASE, **overrides})


def default_tokenizer():
    """The built-in default model's tokenizer (49152 tokens, its chat template)."""
    from specserve.engine.models import default_model_path, load_tokenizer

    return load_tokenizer(default_model_path())


def random_model(config: PretrainedConfig, init: WeightInit = MARGINS, seed: int = 0,
                 attn_implementation: str | None = None) -> torch.nn.Module:
    """The float32 transformers model of ``config`` in eval mode, weights drawn as ``init``
    says from ``seed``."""
    torch.manual_seed(seed)
    kw = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = AutoModelForCausalLM.from_config(config, **kw).float().eval()
    if init.matrix_std is not None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    if init.norm_std is not None:
                        p.copy_(1.0 + init.norm_std * torch.randn_like(p))
                else:
                    p.normal_(0.0, init.matrix_std if p.dim() > 1 else init.vector_std)
    return model


def build_tiny_model(path: str | Path, config: PretrainedConfig, *, init: WeightInit = MARGINS,
                     seed: int = 0, tokenizer=None, fmt: str = "hf",
                     max_shard_size: str | None = None,
                     attn_implementation: str | None = None) -> torch.nn.Module:
    """Writes a random model of ``config`` at ``path`` and returns it (set up as a reference:
    its ``generate`` runs exactly ``max_new_tokens``, no EOS stop).

    fmt "hf": a folder as ``save_pretrained`` writes it (sharded at ``max_shard_size``), with
    ``tokenizer`` saved beside it when given. fmt "gguf": ``path`` is the file, F32 tensors and
    llama.cpp's q/k row permutation, with the byte-level BPE tokenizer of ``GGUF_SPECIALS``
    (Llama only; the vocabulary must be ``GGUF_VOCAB_SIZE``)."""
    model = random_model(config, init, seed, attn_implementation)
    if fmt == "hf":
        kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(path, **kw)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
    elif fmt == "gguf":
        if tokenizer is not None:
            raise ValueError("a GGUF tiny model carries its own byte-level tokenizer")
        write_gguf(model, Path(path))
    else:
        raise ValueError(f"fmt must be 'hf' or 'gguf' (got {fmt!r})")
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    model.generation_config.pad_token_id = 0
    return model


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half pairs -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def write_gguf(model: torch.nn.Module, path: Path) -> None:
    """Writes a transformers Llama as llama.cpp's converter would (F32)."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    cfg = model.config
    if cfg.model_type != "llama":
        raise ValueError(f"the GGUF tiny model is a Llama (got {cfg.model_type})")
    if cfg.vocab_size != GGUF_VOCAB_SIZE:
        raise ValueError(f"a GGUF tiny model's vocabulary is its byte-level tokenizer's: "
                         f"vocab_size must be {GGUF_VOCAB_SIZE} (got {cfg.vocab_size})")
    state = model.state_dict()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    # Byte-level BPE: the specials, the 256 byte symbols, one merge ("Ġ" + "t").
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
    w.add_tensor("token_embd.weight", state["model.embed_tokens.weight"].numpy())
    for i in range(cfg.num_hidden_layers):
        for hf_name, gguf_name in _GGUF_NAMES.items():
            t = state[f"model.layers.{i}.{hf_name}.weight"].numpy()
            if gguf_name == "attn_q":
                t = llama_cpp_permute(t, cfg.num_attention_heads)
            elif gguf_name == "attn_k":
                t = llama_cpp_permute(t, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gguf_name}.weight", np.ascontiguousarray(t))
    w.add_tensor("output_norm.weight", state["model.norm.weight"].numpy())
    if not cfg.tie_word_embeddings:
        w.add_tensor("output.weight", state["lm_head.weight"].numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
