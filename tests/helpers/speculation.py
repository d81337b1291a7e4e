"""Engines and inputs for the speculative-decoding tests: a test engine with a fixed k, the
greedy check against transformers, prompts that repeat (so proposers find matches), and a
policy fed a given step cost."""

from __future__ import annotations

from specserve.core.config import EngineConfig
from specserve.core.sampling_params import SamplingParams
from specserve.engine.llm_engine import LLMEngine
from specserve.spec.policy import SpeculationPolicy
from tests.helpers.reference import hf_greedy, prompts

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def make(path, **kw) -> LLMEngine:
    """A test engine; with a draft model and no method named, requests speculate with the
    draft (these tests are about it; the server's default is auto)."""
    cfg = dict(model=path, dtype="float32", block_size=4, num_kv_blocks=400,
               adaptive_speculation=False, num_speculative_tokens=4)
    cfg.update(kw)
    if cfg.get("draft_model") not in (None, "none") and "speculative_method" not in cfg:
        cfg["speculative_method"] = "draft"
    return LLMEngine(EngineConfig(**cfg))


def check_greedy(engine, hf, prompt_list, params=GREEDY, speculative=None):
    """Every output equals transformers' greedy continuation; every KV block is back."""
    outs = engine.generate(prompt_list, params, speculative)
    for p, out in zip(prompt_list, outs):
        assert out.token_ids == hf_greedy(hf, p, params.max_tokens)
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks
    return outs


def repetitive_prompts(seed=0):
    """Prompts with repeats, so prompt lookup finds matches."""
    base = prompts([6, 9, 4], seed=seed)
    return [b * 4 + b[:3] for b in base] + prompts([17], seed=seed + 1)


def copy_prompt(seed: int) -> list[int]:
    """A block that repeats: the continuation copies it, so long suffix matches exist."""
    block = prompts([12], seed=seed)[0]
    return block * 3 + block[:4]


def with_fixed_costs(engine: LLMEngine, fixed: float = 0.010,
                     per_token: float = 0.002) -> LLMEngine:
    """The engine's adaptive policy priced from steps costing ``fixed + per_token * n`` seconds,
    with nothing it times recorded (target steps, draft steps, proposer host time): what it
    drafts then depends on acceptance alone, never on how busy the machine is."""
    policy = engine.speculator.policy
    policy.target_cost = policy_with_step_cost(fixed, per_token).target_cost
    policy.record_target = lambda num_tokens, seconds: None
    policy.record_draft_step = lambda num_seqs, seconds: None
    policy.record_proposer = lambda method, seconds: None
    return engine


def policy_with_step_cost(fixed: float, per_token: float) -> SpeculationPolicy:
    """A policy that has measured steps costing ``fixed + per_token * n`` seconds."""
    policy = SpeculationPolicy()
    for n in range(1, 200):
        for _ in range(3):
            policy.record_target(n, fixed + per_token * n)
    return policy
