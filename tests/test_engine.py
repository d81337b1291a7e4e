"""LLMEngine end to end against transformers' own generate() on the same weights (float32).

Tiny random Llama / Mistral / Qwen2 / Qwen3 models (tests/helpers/tiny_models.py) are saved
with save_pretrained; our engine loads them from disk like any user model. Every test compares token
ids with transformers' greedy generate() run one prompt at a time: continuous batching, chunked
prefill, prefix-cache hits and preemption must not change a single token.
"""

from __future__ import annotations

import pytest

from specserve.core.config import EngineConfig
from specserve.core.errors import ConfigError, InvalidRequestError
from specserve.core.sampling_params import SamplingParams
from specserve.engine.llm_engine import LLMEngine
from tests.helpers.reference import hf_greedy, prompts
from tests.helpers.tiny_models import build_tiny_model, tiny_config

ARCHS = {
    "llama": lambda: tiny_config("llama"),
    "mistral": lambda: tiny_config("mistral", sliding_window=12),
    "qwen2": lambda: tiny_config("qwen2"),
    "qwen3": lambda: tiny_config("qwen3", head_dim=16, tie_word_embeddings=True),
}
PROMPT_LENS = [3, 11, 29, 50]


@pytest.fixture(scope="module", params=list(ARCHS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return str(path), build_tiny_model(path, ARCHS[request.param]())


def engine_for(path, **kw) -> LLMEngine:
    cfg = dict(model=path, dtype="float32", block_size=4, num_kv_blocks=256)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def assert_matches_hf(engine, hf, prompt_list, params=GREEDY):
    outs = engine.generate(prompt_list, params)
    for p, out in zip(prompt_list, outs):
        assert out.token_ids == hf_greedy(hf, p, params.max_tokens), f"prompt len {len(p)}"
        assert out.finish_reason == "length"
    # Nothing leaks: every block is back in the pool.
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks
    return outs


def test_batched_greedy_matches_transformers(tiny):
    path, hf = tiny
    assert_matches_hf(engine_for(path), hf, prompts(PROMPT_LENS))


def test_chunked_prefill_matches_transformers(tiny):
    path, hf = tiny
    engine = engine_for(path, max_num_batched_tokens=7)
    assert_matches_hf(engine, hf, prompts(PROMPT_LENS, seed=1))


def test_prefix_cache_hits_match_transformers(tiny):
    path, hf = tiny
    engine = engine_for(path)
    shared = prompts([24], seed=2)[0]
    tails = prompts([1, 5, 9], seed=3)
    first = [shared + tails[0]]
    assert_matches_hf(engine, hf, first)
    hits_before = engine.block_manager.prefix_hits
    rest = [shared + t for t in tails[1:]] + first
    assert_matches_hf(engine, hf, rest)
    # 24 shared tokens = 6 full blocks of 4, reused by each of the three later prompts.
    assert engine.block_manager.prefix_hits - hits_before >= 3 * 24


def test_request_ending_on_its_first_step_leaves_its_prompt_cached(tiny):
    """A max_tokens=1 request finishes in the step that prefills it; its full prompt blocks
    still enter the prefix cache, and the next request's timings report the hit."""
    path, hf = tiny
    engine = engine_for(path)
    p = prompts([26], seed=9)[0]  # 6 full blocks of 4
    (first,) = engine.generate([p], SamplingParams(max_tokens=1, temperature=0.0))
    assert first.timings.num_cached_prompt_tokens == 0
    (out,) = assert_matches_hf(engine, hf, [p])
    assert out.timings.num_cached_prompt_tokens == 24


def test_preemption_matches_transformers(tiny):
    path, hf = tiny
    # 24 blocks x 4 = 96 KV slots for 5 sequences needing 22..62 slots each.
    engine = engine_for(path, num_kv_blocks=24, max_model_len=96, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = assert_matches_hf(engine, hf, prompts([10, 20, 30, 40, 50], seed=4), params)
    assert sum(o.timings.num_preemptions for o in outs) > 0, "the pool was meant to preempt"


def test_stop_token_id_cuts_exactly(tiny):
    path, hf = tiny
    p = prompts([9], seed=5)[0]
    ref = hf_greedy(hf, p, 12)
    stop_at = next(i for i in range(3, 12) if ref[i] not in ref[:i])
    engine = engine_for(path)
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[ref[stop_at]])
    (out,) = engine.generate([p], params)
    assert out.token_ids == ref[: stop_at + 1]  # the stop token counts, nothing after it
    assert out.finish_reason == "stop" and out.stop_reason == ref[stop_at]


def test_seeded_sampling_is_reproducible_across_batches(tiny):
    path, _ = tiny
    engine = engine_for(path)
    p = prompts([7, 13, 21], seed=6)
    seeded = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True)
    alone = engine.generate([p[0]], seeded)[0].token_ids
    other = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    together = engine.generate(p, [seeded, other, other])[0].token_ids
    assert alone == together


def test_abort_frees_blocks(tiny):
    path, _ = tiny
    engine = engine_for(path)
    for i, p in enumerate(prompts([30, 40], seed=7)):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    out = engine.abort("r0")
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert engine.abort("r0") is None  # already gone: no double free
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def test_context_window_ends_with_length(tiny):
    path, _ = tiny
    engine = engine_for(path, max_model_len=20)
    (out,) = engine.generate([prompts([15])[0]], GREEDY)
    assert len(out.token_ids) == 5 and out.finish_reason == "length"


def test_bad_requests_are_clear_errors(tiny):
    path, _ = tiny
    engine = engine_for(path, max_model_len=32)
    with pytest.raises(InvalidRequestError, match="context window") as info:
        engine.add_request("a", list(range(3, 40)), SamplingParams())
    assert info.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="token ids must be in"):
        engine.add_request("b", [5, 999999], SamplingParams())
    with pytest.raises(InvalidRequestError, match="empty"):
        engine.add_request("c", [], SamplingParams())
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        engine.add_request("d", "text needs a tokenizer", SamplingParams())
    assert not engine.has_unfinished()


def test_kv_pool_smaller_than_context_is_refused(tiny):
    path, _ = tiny
    with pytest.raises(ConfigError, match="fewer than max-model-len"):
        engine_for(path, num_kv_blocks=4, max_model_len=64)
