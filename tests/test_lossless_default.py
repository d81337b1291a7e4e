"""Speculation stays lossless by default on every file: a GGUF with a projection whose type has
no batch-invariant block kernel (here F16, which runs as a dense float matmul) defaults to plain
decoding, says why at start-up and in GET /v1/models, and a request that asks for speculation
gets it with the warning in its timings. A GGUF whose projections all have kernels keeps the
registry's default."""

from __future__ import annotations

import numpy as np
import pytest

from specserve.core.config import EngineConfig
from tests.helpers.gguf_blocks import typed_tensors
from tests.helpers.tiny_models import GGUF_VOCAB_SIZE, HF_INIT, build_tiny_model, tiny_config

CFG = dict(vocab_size=GGUF_VOCAB_SIZE, hidden_size=64, intermediate_size=96,
           num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
           max_position_embeddings=256, tie_word_embeddings=False)


def _gguf(path, down_type: str) -> str:
    """A tiny Llama GGUF: every projection and the lm_head Q8_0, ffn_down in ``down_type``."""
    types = {"ffn_down": down_type, "attn_": "Q8_0", "ffn_": "Q8_0", "output.": "Q8_0"}
    with typed_tensors(types):
        build_tiny_model(path, tiny_config("llama", **CFG), init=HF_INIT, fmt="gguf")
    return str(path)


def _engine_config(path: str, **kw) -> EngineConfig:
    return EngineConfig(model=path, draft_model="none", kv_cache_memory=16 << 20,
                        max_model_len=256, adaptive_speculation=False, **kw)


def _resolve(cfg: EngineConfig):
    from specserve.engine.resolve import ModelFiles, resolve_config

    return resolve_config(cfg, ModelFiles.open(cfg))


def test_every_projection_native_keeps_the_default(tmp_path):
    from specserve.draft.registry import REGISTRY

    resolved = _resolve(_engine_config(_gguf(tmp_path / "q8.gguf", "Q8_0")))
    assert resolved.quantization == "gguf"
    assert resolved.speculation_caveat is None
    assert resolved.default_speculative_method == REGISTRY.default_method(None) != "off"


def test_a_dense_projection_turns_default_speculation_off(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        resolved = _resolve(_engine_config(_gguf(tmp_path / "f16.gguf", "F16")))
    assert resolved.default_speculative_method == "off"
    caveat = resolved.speculation_caveat
    assert caveat is not None and "blk.0.ffn_down.weight" in caveat and "F16" in caveat
    assert caveat in caplog.text
    # Asked for explicitly, the user's method stands (with the same caveat on record).
    asked = _resolve(_engine_config(resolved.model_path, speculative_method="ngram"))
    assert asked.default_speculative_method == "ngram" and asked.speculation_caveat == caveat


@pytest.mark.slow
def test_server_says_why_and_warns_requests_that_speculate(tmp_path):
    from specserve.server.server_config import ServerConfig
    from tests.helpers.servers import KEY, NAME, ServerThread, http

    path = _gguf(tmp_path / "f16.gguf", "F16")
    srv = ServerThread(_engine_config(path), ServerConfig(port=0, api_key=KEY,
                                                          served_model_name=NAME))
    try:
        status, cards = http("GET", srv.url + "/v1/models")
        assert status == 200, cards
        card = cards["data"][0]
        assert card["default_speculative_method"] == "off"
        assert "blk.0.ffn_down.weight" in card["speculation_caveat"]
        body = {"model": NAME, "prompt": "ab ab ab ab", "max_tokens": 8, "temperature": 0}
        status, plain = http("POST", srv.url + "/v1/completions", body)
        assert status == 200, plain
        assert plain["timings"]["speculative_method"] == "off"
        assert plain["timings"]["warning"] is None
        status, spec = http("POST", srv.url + "/v1/completions",
                            {**body, "speculative": {"method": "ngram", "num_tokens": 3}})
        assert status == 200, spec
        assert spec["timings"]["speculative_method"] == "ngram"
        assert spec["timings"]["warning"] == card["speculation_caveat"]
    finally:
        srv.stop()


@pytest.mark.slow
def test_k_quant_file_speculates_by_default_and_greedy_equals_plain(tmp_path):
    """A Q4_K_M-like mix (q/k Q5_0, v Q6_K, gate/up Q4_K, down Q6_K, lm_head Q8_0): every
    projection runs a block kernel, so the registry's default stands, and greedy speculation
    gives plain decoding's tokens."""
    from specserve.core.sampling_params import SamplingParams, SpeculativeParams
    from specserve.engine.llm_engine import LLMEngine
    from specserve.kernels.quant import BlockQuantLinear

    types = {"attn_v": "Q6_K", "attn_": "Q5_0", "ffn_down": "Q6_K", "ffn_": "Q4_K",
             "output.": "Q8_0"}
    cfg = {**CFG, "hidden_size": 256, "intermediate_size": 512}
    with typed_tensors(types):
        build_tiny_model(tmp_path / "k.gguf", tiny_config("llama", **cfg), init=HF_INIT,
                         fmt="gguf")
    engine = LLMEngine(_engine_config(str(tmp_path / "k.gguf")))
    assert engine.config.speculation_caveat is None
    assert engine.config.default_speculative_method != "off"
    formats = {m.fmt for m in engine.runner.model.modules() if isinstance(m, BlockQuantLinear)}
    assert formats == {"q8_f", "q8_0"}  # fused q|k|v and gate|up as Q8_F, o_proj Q5_0 as Q8_0
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [40, 41, 42, 43], [100, 3, 100, 3, 100]]
    plain = engine.generate(prompts, params, SpeculativeParams(method="off"))
    spec = engine.generate(prompts, params, SpeculativeParams(method="ngram", num_tokens=4))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.timings.num_drafted for o in spec) > 0  # speculation really ran


def test_biases_and_norms_are_not_projections(tmp_path):
    """Qwen2's q/k/v biases and the norms are F32 tensors in every GGUF: they are added or
    multiplied in float32 row by row (no reduction over rows), so they never count."""
    import types

    import gguf

    from specserve.target.quantize import dense_projection_tensors

    path = tmp_path / "b.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    q8 = gguf.quants.quantize(np.ones((8, 32), np.float32), gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.weight", q8, raw_shape=q8.shape,
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_q.bias", np.ones(8, np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(32, np.float32))
    w.add_tensor("blk.0.ffn_down.weight", np.ones((8, 32), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    config = types.SimpleNamespace(tie_word_embeddings=False)
    dense = dense_projection_tensors("gguf", path, config)  # type: ignore[arg-type]
    assert dense == {"blk.0.ffn_down.weight": "F16 has no block kernel"}
