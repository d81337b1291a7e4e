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

from tests.helpers.tiny_gguf import (  # noqa: F401  (re-exported for the tests)
    GGUF_SPECIALS,
    GGUF_VOCAB_SIZE,
    llama_cpp_permute,
    write_gguf,
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
# GGUF_SPECIALS: control tokens of the GGUF variant's byte-level BPE tokenizer (then the 256
# byte symbols and one merge): a GGUF model's vocabulary is exactly these GGUF_VOCAB_SIZE tokens.


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
    ``tokenizer`` saved beside it when given. fmt "gguf": ``path`` is the file as llama.cpp's
    converter writes it (``tests/helpers/tiny_gguf.py``: F32 tensors, the architecture's
    metadata and tensor conventions, the byte-level BPE tokenizer of ``GGUF_SPECIALS``; the
    vocabulary must be ``GGUF_VOCAB_SIZE``)."""
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
