"""Every architecture family end to end, against transformers on the same random weights: tiny
models of Gemma 2/3, Phi-3 (longrope with partial rotary; sliding window), Granite and Llama 3.2
(tests/helpers/arch_cases.py), loaded from a Hugging Face folder and from a GGUF written as
llama.cpp's converter writes it. Prompts are longer than the sliding windows and share
prefixes (so prefix-cache hits cross windowed layers). The float32 path's greedy tokens equal
transformers' generate; the quantized path's greedy speculative tokens (n-gram, suffix) equal
its own plain decoding; what we do not run is refused by name."""

from __future__ import annotations

import json

import pytest
from transformers import AutoConfig

from specserve.core.errors import ConfigError, UnsupportedArchitectureError
from specserve.core.sampling_params import SamplingParams, SpeculativeParams
from specserve.target.loader import load_weights
from tests.helpers.arch_cases import ARCH_CASES, WINDOW, arch_config
from tests.helpers.reference import hf_greedy, prompts
from tests.helpers.speculation import copy_prompt, make, repetitive_prompts
from tests.helpers.tiny_models import GGUF_VOCAB_SIZE, SHARP, build_tiny_model, tiny_config

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _build(tmp_path, case: str, fmt: str):
    """(model path, transformers reference) of ``case`` written as ``fmt``."""
    if fmt == "hf":
        path, cfg = tmp_path / case, arch_config(case)
    else:
        path, cfg = tmp_path / f"{case}.gguf", arch_config(case, vocab_size=GGUF_VOCAB_SIZE)
        if hasattr(cfg, "query_pre_attn_scalar"):
            # a GGUF carries no query scale: llama.cpp's rule gives head_dim at these shapes
            cfg.query_pre_attn_scalar = cfg.head_dim
    hf = build_tiny_model(path, cfg, init=SHARP, fmt=fmt, attn_implementation="eager")
    return str(path), hf


def _window_prompts(vocab: int) -> list[list[int]]:
    base = prompts([3 * WINDOW + 5, 2 * WINDOW, 5], seed=4, vocab=vocab)
    return [*base, base[0][:2 * WINDOW] + base[1][:7]]  # the last shares the first's prefix


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("case", ARCH_CASES)
def test_float32_greedy_equals_transformers(tmp_path, case, fmt):
    path, hf = _build(tmp_path, case, fmt)
    engine = make(path, quantization="none", attention_backend="torch",
                  enable_prefix_caching=True)
    vocab = GGUF_VOCAB_SIZE if fmt == "gguf" else 300
    batch = _window_prompts(vocab)
    for round_ in range(2):  # the second round hits the prefix cache
        outs = engine.generate(batch, GREEDY)
        for p, out in zip(batch, outs):
            assert out.token_ids == hf_greedy(hf, p, GREEDY.max_tokens), (case, fmt, round_)
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("case", ARCH_CASES)
def test_quantized_speculative_equals_plain(tmp_path, case, quantization):
    path, _ = _build(tmp_path, case, "hf")
    engine = make(path, quantization=quantization)
    batch = repetitive_prompts() + [copy_prompt(3)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in engine.generate(batch, params, SpeculativeParams(method="off"))]
    for method in ("ngram", "suffix"):
        outs = engine.generate(batch, params, SpeculativeParams(method=method))
        assert [o.token_ids for o in outs] == plain, (case, quantization, method)
        assert sum(o.timings.num_drafted for o in outs) > 0  # speculation did run
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def _edit_config(folder, **changes) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    raw.update(changes)
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize("changes, named", [
    ({"architectures": ["FalconForCausalLM"], "model_type": "falcon"}, "FalconForCausalLM"),
    ({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"},
     "Gemma3ForConditionalGeneration"),
    ({"hidden_activation": "gelu"}, "'gelu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
])
def test_unsupported_hf_options_are_refused_by_name(tmp_path, changes, named):
    build_tiny_model(tmp_path, arch_config("gemma3"), init=SHARP)
    _edit_config(tmp_path, **changes)
    with pytest.raises(UnsupportedArchitectureError, match=named.replace("(", r"\(")):
        load_weights(tmp_path)


def test_length_dependent_rope_is_refused(tmp_path):
    cfg = tiny_config("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                "rope_theta": 10000.0})
    build_tiny_model(tmp_path, cfg)
    with pytest.raises(UnsupportedArchitectureError, match="'dynamic'"):
        load_weights(tmp_path)


def test_longrope_caps_the_context_where_its_short_factors_hold(tmp_path):
    path, _ = _build(tmp_path, "phi3_longrope", "hf")
    assert AutoConfig.from_pretrained(path).max_position_embeddings == 256
    assert make(path, quantization="none").config.max_model_len == 96
    with pytest.raises(ConfigError, match="max_position_embeddings 96"):
        make(path, quantization="none", max_model_len=200)


def test_unsupported_gguf_architecture_is_refused_by_name(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitectureError, match="'falcon'"):
        load_weights(path)
