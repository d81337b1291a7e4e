"""Speculation under memory pressure: in a KV pool too small for the sequences' lookahead slots,
n-gram speculation drops its drafts instead of preempting (the scheduler that preempted first
preempted once here), and its greedy output equals transformers' generate. The deterministic
proof of the rule is in test_scheduler.py; this runs it through the whole engine."""

from __future__ import annotations

import pytest

from specserve.core.config import EngineConfig
from specserve.core.sampling_params import SamplingParams
from specserve.engine.llm_engine import LLMEngine
from tests.helpers.reference import hf_greedy, prompts
from tests.helpers.tiny_models import build_tiny_model, tiny_config


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("pressure")
    return str(path), build_tiny_model(path, tiny_config())


def test_tiny_pool_drops_drafts_instead_of_preempting(model):
    path, hf = model
    base = prompts([5, 7, 6, 4], seed=11)
    ps = [b * 2 for b in base]  # repeats: prompt lookup proposes drafts
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    # The four end at 9 + 10 + 9 + 8 = 36 blocks of 4; 34 leave no room for 4 lookahead slots
    # each near the ends of the sequences.
    cfg = EngineConfig(model=path, dtype="float32", block_size=4, num_kv_blocks=34,
                       max_model_len=64, enable_prefix_caching=False,
                       speculative_method="ngram", num_speculative_tokens=4,
                       adaptive_speculation=False)
    engine = LLMEngine(cfg)
    outs = engine.generate(ps, params)
    assert sum(o.timings.num_preemptions for o in outs) == 0
    assert sum(o.timings.num_drafted for o in outs) > 0  # speculation did run
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(hf, p, 24)
    assert engine.block_manager.num_free_blocks == 34
