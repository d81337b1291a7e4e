"""Fixtures shared by several test modules."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from tests.test_engine import BASE, build_model_dir


@pytest.fixture(scope="session")
def text_model(tmp_path_factory) -> str:
    """A tiny random Llama that speaks the default model's tokenizer (chat template included),
    so stop strings, chat rendering and distillation run on real text."""
    from specserve.engine.models import default_model_path, load_tokenizer

    path = tmp_path_factory.mktemp("text_model")
    tok = load_tokenizer(default_model_path())
    cfg = LlamaConfig(**{**BASE, "max_position_embeddings": 512, "vocab_size": len(tok),
                         "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                         "num_key_value_heads": 2})
    build_model_dir(cfg, path)
    tok.save_pretrained(path)
    return str(path)
