"""specserve.target.loader and specserve.engine.models: error messages, a tiny GGUF written
here (F32 tensors, llama.cpp's q/k row permutation, a byte-level BPE tokenizer) loaded like
transformers loads it, and the GGUF cache (hit, identical tensors, invalidation when the file
changes)."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2Config, LlamaConfig
from transformers.convert_slow_tokenizer import bytes_to_unicode

from specserve.core.errors import ModelLoadError, UnsupportedArchitectureError
from specserve.engine.models import load_tokenizer, resolve_model_path
from specserve.target.config import ModelConfig
from specserve.target.loader import build_model, gguf_cache_dir, load_weights

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CONFIG = dict(
    vocab_size=len(SPECIALS) + 256 + 1, hidden_size=64, intermediate_size=96,
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
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))
    hf.save_pretrained(tmp_path)
    hf_config, state_dict = load_weights(tmp_path)
    del state_dict["model.layers.1.self_attn.k_proj.weight"]
    state_dict["model.layers.0.extra.weight"] = torch.zeros(1)
    from specserve.target.model import CausalLM

    model = CausalLM(ModelConfig.from_hf(hf_config), device="meta")
    with pytest.raises(ModelLoadError, match=r"missing weights model\.layers\.1\.self_attn\."
                       r"\{q,k,v\}_proj\.weight.*unexpected weights .*extra\.weight"):
        model.load_hf_state_dict(state_dict)


def test_sharded_folder_and_generation_eos(tmp_path):
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG))
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    _, state_dict = load_weights(tmp_path)
    assert set(state_dict) == set(hf.state_dict())
    model_config, _ = build_model(tmp_path, "float32", "cpu")
    assert model_config.eos_token_ids == (2, 0)


# ---- GGUF -----------------------------------------------------------------------------------


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: rotate-half pairs -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape
    )


def _write_tiny_gguf(path, tied: bool = False) -> dict[str, torch.Tensor]:
    """Writes a 2-layer Llama as llama.cpp's converter would; returns its HF state dict."""
    torch.manual_seed(0)
    cfg = LlamaConfig(**CONFIG, tie_word_embeddings=tied)
    hf_state = AutoModelForCausalLM.from_config(cfg).state_dict()
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
    # Byte-level BPE: 3 specials, the 256 byte symbols, one merge ("Ġ" + "t").
    symbols = list(bytes_to_unicode().values())
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(SPECIALS + symbols + ["Ġt"])
    w.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * 257)
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m.content }}<|im_end|>{% endfor %}")
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj":
             "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
             "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
             "post_attention_layernorm": "ffn_norm"}
    w.add_tensor("token_embd.weight", hf_state["model.embed_tokens.weight"].numpy())
    for i in range(cfg.num_hidden_layers):
        for hf_name, gguf_name in names.items():
            t = hf_state[f"model.layers.{i}.{hf_name}.weight"].numpy()
            if gguf_name == "attn_q":
                t = _llama_cpp_permute(t, cfg.num_attention_heads)
            elif gguf_name == "attn_k":
                t = _llama_cpp_permute(t, cfg.num_key_value_heads)
            w.add_tensor(f"blk.{i}.{gguf_name}.weight", np.ascontiguousarray(t))
    w.add_tensor("output_norm.weight", hf_state["model.norm.weight"].numpy())
    if not tied:
        w.add_tensor("output.weight", hf_state["lm_head.weight"].numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf_state


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


def test_default_model_path():
    path = resolve_model_path(None)
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.isfile(path)
    assert resolve_model_path("default") == path
    assert resolve_model_path(path) == path
