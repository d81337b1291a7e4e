"""specserve.target.loader and specserve.engine.models: error messages, a tiny GGUF written
here (F32 tensors, llama.cpp's q/k row permutation, a byte-level BPE tokenizer) loaded like
transformers loads it, and the GGUF cache (hit, identical tensors, invalidation when the file
changes)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, LlamaConfig

from specserve.core.errors import ModelLoadError, UnsupportedArchitectureError
from specserve.engine.models import load_tokenizer, resolve_model_path
from specserve.target.config import ModelConfig
from specserve.target.loader import build_model, gguf_cache_dir, load_weights
from tests.helpers.tiny_models import GGUF_VOCAB_SIZE, HF_INIT, build_tiny_model, tiny_config

CONFIG = dict(
    vocab_size=GGUF_VOCAB_SIZE, hidden_size=64, intermediate_size=96,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=64, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
)


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))


# ---- errors ---------------------------------------------------------------------------------


def test_missing_path(tmp_path):
    with pytest.raises(ModelLoadError, match="model path not found: .*nope.*hub id"):
        load_weights(tmp_path / "nope")
    with pytest.raises(ModelLoadError, match="model path not found"):
        resolve_model_path(str(tmp_path / "nope"))


def test_folder_without_config_or_weights(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_weights(tmp_path)
    LlamaConfig(**CONFIG).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match=r"no \*.safetensors weights"):
        load_weights(tmp_path)


def test_not_a_model_file(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match="neither a GGUF file nor a folder"):
        load_weights(tmp_path / "weights.bin")


def test_unsupported_architecture(tmp_path):
    GPT2Config(n_layer=1, n_embd=32, n_head=2, architectures=["GPT2LMHeadModel"]).save_pretrained(
        tmp_path
    )
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        load_weights(tmp_path)
    dynamic = LlamaConfig(**CONFIG, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                     "rope_theta": 10000.0})
    with pytest.raises(UnsupportedArchitectureError, match="rope type 'dynamic'"):
        ModelConfig.from_hf(dynamic)


def test_missing_and_unexpected_weights(tmp_path):
    build_tiny_model(tmp_path, tiny_config(**CONFIG), init=HF_INIT)
    hf_config, state_dict = load_weights(tmp_path)
    del state_dict["model.layers.1.self_attn.k_proj.weight"]
    state_dict["model.layers.0.extra.weight"] = torch.zeros(1)
    from specserve.target.model import CausalLM

    model = CausalLM(ModelConfig.from_hf(hf_config), device="meta")
    with pytest.raises(ModelLoadError, match=r"missing weights model\.layers\.1\.self_attn\."
                       r"\{q,k,v\}_proj\.weight.*unexpected weights .*extra\.weight"):
        model.load_hf_state_dict(state_dict)


def test_sharded_folder_and_generation_eos(tmp_path):
    hf = build_tiny_model(tmp_path, tiny_config(**CONFIG), init=HF_INIT, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    _, state_dict = load_weights(tmp_path)
    assert set(state_dict) == set(hf.state_dict())
    model_config, _ = build_model(tmp_path, "float32", "cpu")
    assert model_config.eos_token_ids == (2, 0)


# ---- GGUF -----------------------------------------------------------------------------------


def _write_tiny_gguf(path, tied: bool = False) -> dict[str, torch.Tensor]:
    """Writes a 2-layer Llama as llama.cpp's converter would; returns its HF state dict."""
    cfg = tiny_config(**CONFIG, tie_word_embeddings=tied)
    return build_tiny_model(path, cfg, init=HF_INIT, fmt="gguf").state_dict()


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_matches_transformers_and_original(tmp_path, tied):
    path = tmp_path / "tiny.gguf"
    original = _write_tiny_gguf(path, tied)
    hf_config, state_dict = load_weights(path)
    assert hf_config.model_type == "llama" and hf_config.tie_word_embeddings == tied
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name).state_dict()
    expected = {k for k in reference if not (tied and k == "lm_head.weight")}
    assert set(state_dict) == expected
    for name, tensor in state_dict.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(tensor, original[name], rtol=0, atol=0, msg=name)
    model_config, model = build_model(path, torch.float32, "cpu")
    assert model_config.tie_word_embeddings == tied
    assert (model.lm_head is None) == tied


def test_gguf_cache_hit_and_invalidation(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path)
    _, first = load_weights(path)
    cache = gguf_cache_dir(path)
    assert (cache / "weights" / "model.safetensors").is_file()
    assert not list(cache.parent.glob("*.tmp-*"))  # no half-written folders left behind

    def no_gguf(*args, **kwargs):
        raise AssertionError("the cache should have been used")

    # Import the module first: transformers' lazy loader may not have loaded it yet.
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", no_gguf)
    _, second = load_weights(path)
    assert set(second) == set(first)
    for name in first:
        assert torch.equal(first[name], second[name]), name

    monkeypatch.undo()
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    assert gguf_cache_dir(path) != cache  # a changed file never reads the old cache
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path / "cache"))
    _, third = load_weights(path)
    assert (gguf_cache_dir(path) / "weights" / "model.safetensors").is_file()
    assert all(torch.equal(first[n], third[n]) for n in first)


def test_gguf_tokenizer_cached(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path)
    direct = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    first = load_tokenizer(str(path))
    assert (gguf_cache_dir(path) / "tokenizer").is_dir()
    second = load_tokenizer(str(path))
    text = "the cat <|im_end|> sat"
    assert first.encode(text) == second.encode(text) == direct.encode(text)
    assert second.eos_token_id == 2 and second.chat_template == direct.chat_template


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "phi3_window", "gemma2", "gemma3"])
def test_gguf_tokenizer_is_autotokenizers(tmp_path, arch):
    """Our GGUF tokenizer (the class from our own metadata reader) is what AutoTokenizer builds
    from the same file: the same class and the same saved files."""
    from tests.helpers.arch_cases import arch_config

    path = tmp_path / f"{arch}.gguf"
    cfg = (tiny_config(arch, **CONFIG) if arch in ("llama", "qwen2", "qwen3")
           else arch_config(arch, vocab_size=GGUF_VOCAB_SIZE))
    build_tiny_model(path, cfg, init=HF_INIT, fmt="gguf")
    ours = load_tokenizer(str(path))
    theirs = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    assert type(ours) is type(theirs)
    ours.save_pretrained(tmp_path / "ours")
    theirs.save_pretrained(tmp_path / "theirs")
    files = sorted(f.name for f in (tmp_path / "theirs").iterdir())
    assert sorted(f.name for f in (tmp_path / "ours").iterdir()) == files
    for name in files:
        assert (tmp_path / "ours" / name).read_bytes() == (tmp_path / "theirs" / name).read_bytes()


def test_default_model_path():
    path = resolve_model_path(None)
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    assert resolve_model_path("default") == path
    assert resolve_model_path(path) == path
