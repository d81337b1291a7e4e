"""The resolver: one EngineConfig (never written) -> one immutable ResolvedConfig; each default
decided by one rule; the CLI's flags generated from the same table; method names checked where
the proposer registry is known; a new proposer is one registry entry."""

from __future__ import annotations

import argparse
import dataclasses
from types import SimpleNamespace

import msgspec
import pytest
import torch

from specserve.cli import add_engine_args, engine_config_from_args
from specserve.core.config import EngineConfig
from specserve.core.errors import ConfigError
from specserve.core.sampling_params import SamplingParams, SpeculativeParams
from specserve.core.settings import describe
from specserve.draft.base import Proposal, ProposalRequest, StatelessProposer
from specserve.draft.loading import DRAFT_MODEL, EAGLE_HEAD
from specserve.draft.registry import REGISTRY, ProposerSpec, default_registry
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.resolve import (
    resolve_dtype,
    resolve_kv_dtype,
    resolve_limits,
    resolve_speculative_method,
)
from specserve.kernels.registry import available_backends
from specserve.target.loader import read_weights
from tests.helpers.reference import prompts
from tests.helpers.tiny_models import BASE, build_tiny_model, tiny_config

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_tiny_model(path, tiny_config())
    return str(path)


def test_one_config_builds_two_engines_and_is_never_written(tiny):
    config = EngineConfig(model=tiny, dtype="float32", block_size=4, kv_cache_memory=1 << 20,
                          draft_model="none")
    before = msgspec.structs.asdict(config)
    a, b = LLMEngine(config), LLMEngine(config)
    assert msgspec.structs.asdict(config) == before
    assert config.num_kv_blocks is None and config.max_model_len is None
    assert a.config == b.config and a.config.asked is config
    # the derived values, from the model's own numbers: 2 (k, v) x layers x block x KV heads x
    # head dim x 4 bytes per block; the context is the model's (256, under the 8192 cap)
    head_dim = BASE["hidden_size"] // BASE["num_attention_heads"]
    per_block = 2 * BASE["num_hidden_layers"] * 4 * BASE["num_key_value_heads"] * head_dim * 4
    assert a.config.num_kv_blocks == (1 << 20) // per_block
    assert a.config.max_model_len == BASE["max_position_embeddings"]
    assert (a.config.dtype, a.config.device.type, a.config.quantization) == (
        torch.float32, "cpu", "none")
    assert a.config.default_speculative_method == "auto" and a.config.draft is None
    ps = prompts([5, 13])
    assert ([o.token_ids for o in a.generate(ps, GREEDY)]
            == [o.token_ids for o in b.generate(ps, GREEDY)])
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.config.num_kv_blocks = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        config.block_size = 8  # type: ignore[misc]


def test_resolved_config_reads_unresolved_settings_through(tiny):
    config = EngineConfig(model=tiny, dtype="float32", block_size=4, num_kv_blocks=128,
                          max_num_seqs=3, prompt_lookup_max=3)
    resolved = LLMEngine(config).config
    assert (resolved.block_size, resolved.max_num_seqs, resolved.prompt_lookup_max) == (4, 3, 3)
    assert resolved.num_kv_blocks == 128
    with pytest.raises(AttributeError):  # decided by the resolver: read it resolved, or asked
        resolved.speculative_method  # noqa: B018


def test_dtype_and_kv_dtype_rules():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_dtype("auto", cpu) == torch.float32
    assert resolve_dtype("auto", cuda) == torch.bfloat16
    assert resolve_dtype("float16", cpu) == torch.float16
    assert resolve_dtype("auto", cpu, quantized=True) == torch.float32
    with pytest.raises(ConfigError, match="compute in float32"):
        resolve_dtype("bfloat16", cpu, quantized=True)
    assert resolve_kv_dtype("auto", torch.float32, "cpu_paged", cpu, True) == torch.bfloat16
    assert resolve_kv_dtype("auto", torch.float32, "cpu_paged", cpu, False) == torch.float32
    assert resolve_kv_dtype("auto", torch.float32, "torch", cpu, True) == torch.float32
    assert resolve_kv_dtype("float16", torch.float32, "cpu_paged", cpu, False) == torch.float16
    with pytest.raises(ConfigError, match="needs the C[+][+] CPU attention"):
        resolve_kv_dtype("bfloat16", torch.float32, "torch", cpu, True)


def test_limits_rule(tiny):
    model = read_weights(tiny).config  # max_position_embeddings 256
    cpu = torch.device("cpu")
    assert resolve_limits(EngineConfig(block_size=4), model, 1000, cpu) == (256, (2 << 30) // 1000)
    assert resolve_limits(EngineConfig(max_model_len=64, num_kv_blocks=16, block_size=4), model,
                          1000, cpu) == (64, 16)
    with pytest.raises(ConfigError, match="exceeds the model's max_position_embeddings 256"):
        resolve_limits(EngineConfig(max_model_len=300), model, 1000, cpu)
    with pytest.raises(ConfigError, match="fewer than max-model-len 64"):
        resolve_limits(EngineConfig(max_model_len=64, num_kv_blocks=15, block_size=4), model,
                       1000, cpu)


def test_speculative_method_names_and_drafts():
    head = SimpleNamespace(kind=EAGLE_HEAD, path="/heads/h")
    lm = SimpleNamespace(kind=DRAFT_MODEL, path="/drafts/d")
    assert resolve_speculative_method(None, None, REGISTRY) == "auto"
    assert resolve_speculative_method(None, lm, REGISTRY) == "auto"
    assert resolve_speculative_method(None, head, REGISTRY) == "eagle"  # the head implies it
    assert resolve_speculative_method("auto", head, REGISTRY) == "auto"
    assert resolve_speculative_method("ngram", None, REGISTRY) == "ngram"
    with pytest.raises(ConfigError,
                       match="must be one of draft, text_draft, eagle, ngram, suffix, "
                             "prediction, auto, off"):
        resolve_speculative_method("medusa", None, REGISTRY)
    with pytest.raises(ConfigError, match="draft needs --draft-model FILE.gguf"):
        resolve_speculative_method("draft", None, REGISTRY)
    with pytest.raises(ConfigError, match="is an EAGLE head, not a draft model: use "
                                          "--speculative-method eagle"):
        resolve_speculative_method("draft", head, REGISTRY)
    with pytest.raises(ConfigError, match="is a draft model, not an EAGLE head: use "
                                          "--speculative-method draft"):
        resolve_speculative_method("eagle", lm, REGISTRY)


def test_cli_flags_are_the_config_table():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    actions = {a.dest: a for a in parser._actions if a.dest != "help"}
    table = {s.name: s for s in describe(EngineConfig)}
    assert set(actions) == set(table)
    assert engine_config_from_args(parser.parse_args([])) == EngineConfig()
    for name, s in table.items():
        assert actions[name].default == s.default, name
        assert s.help and actions[name].help.startswith(s.help.replace("%", "%%")), name
        if s.choices is not None:
            assert list(actions[name].choices) == list(s.choices), name
    assert list(actions["speculative_method"].choices) == REGISTRY.methods()
    assert list(actions["attention_backend"].choices) == available_backends()
    assert "cpu_paged" in actions["attention_backend"].choices
    args = parser.parse_args(["--block-size", "8", "--no-enable-prefix-caching",
                              "--speculative-method", "ngram", "--max-model-len", "64"])
    assert engine_config_from_args(args) == EngineConfig(
        block_size=8, enable_prefix_caching=False, speculative_method="ngram", max_model_len=64)


@pytest.mark.parametrize("kwargs,message", [
    ({"block_size": 0}, "block-size must be >= 1 (got 0)"),
    ({"num_speculative_tokens": 17}, "num-speculative-tokens must be in [0, 16] (got 17)"),
    ({"suffix_max_depth": 1}, "suffix-max-depth must be in [2, 256] (got 1)"),
    ({"suffix_spec_factor": 0.0}, "suffix-spec-factor must be > 0 (got 0.0)"),
    ({"kv_cache_dtype": "fp8"}, "kv-cache-dtype must be auto, float32, float16 or bfloat16"),
    ({"device": "tpu"}, "device must be auto, cpu or cuda[:N] (got 'tpu')"),
    ({"max_model_len": 1}, "max-model-len must be >= 2 (got 1)"),
    ({"block_size": "4"}, "block-size must be an integer (got '4')"),
    ({"prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt-lookup-min <= prompt-lookup-max"),
])
def test_settings_are_checked_against_the_table(kwargs, message):
    with pytest.raises(ConfigError) as err:
        EngineConfig(**kwargs)
    assert message in str(err.value)


class _EchoProposer(StatelessProposer):
    """Drafts the request's last tokens again (a made-up method)."""

    name = "echo"

    def propose(self, requests: list[ProposalRequest]) -> Proposal:
        return Proposal([list(r.token_ids[-r.num_tokens:]) for r in requests])


def test_a_new_proposer_is_one_registry_entry(tiny):
    registry = default_registry()
    registry.register(ProposerSpec("echo", lambda ctx: _EchoProposer()))
    engine = LLMEngine(EngineConfig(model=tiny, dtype="float32", block_size=4, num_kv_blocks=256,
                                    adaptive_speculation=False), registry=registry)
    assert "echo" in engine.speculator.proposers
    ps = [p * 3 for p in prompts([4, 7], seed=3)]
    plain = engine.generate(ps, GREEDY, SpeculativeParams("off"))
    echo = engine.generate(ps, GREEDY, SpeculativeParams("echo", 3))
    assert [o.token_ids for o in echo] == [o.token_ids for o in plain]
    assert all(o.timings.num_drafted > 0 and o.timings.speculative_method == "echo" for o in echo)
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks
