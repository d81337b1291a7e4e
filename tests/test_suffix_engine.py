"""Suffix decoding and ``auto`` through the engine: greedy output equals transformers' greedy
output (also with stops inside a multi-token step), the global cache learns across requests
only within a tenant, and the registry rejects unknown methods by name."""

from __future__ import annotations

import pytest

from specserve.core.errors import ConfigError, InvalidRequestError
from specserve.core.sampling_params import SamplingParams, SpeculativeParams
from specserve.draft.base import ProposalRequest
from specserve.draft.registry import REGISTRY, UnknownProposerError
from tests.helpers.reference import hf_greedy, prompts
from tests.helpers.speculation import (
    GREEDY,
    check_greedy,
    copy_prompt,
    make,
    repetitive_prompts,
)


@pytest.mark.parametrize("method", ["suffix", "auto"])
@pytest.mark.parametrize("engine_kw", [{}, {"max_num_batched_tokens": 9},
                                       {"num_kv_blocks": 30, "max_model_len": 100}])
def test_greedy_identical_to_transformers(models, method, engine_kw):
    target, other, hf = models
    engine = make(target, draft_model=other, speculative_method=method, **engine_kw)
    ps = repetitive_prompts(3) + [copy_prompt(1)]
    outs = check_greedy(engine, hf, ps)
    assert sum(o.timings.num_drafted for o in outs) > 0
    # Run again: now the global cache holds these outputs too; still exact.
    check_greedy(engine, hf, ps)


@pytest.mark.parametrize("method", ["suffix", "auto"])
def test_stops_inside_a_multi_token_step(models, method):
    target, other, hf = models
    engine = make(target, draft_model=other, speculative_method=method,
                  suffix_speculative_tokens=16)
    p = copy_prompt(4)
    ref = hf_greedy(hf, p, 24)
    engine.generate([p], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    cuts = [c for c in range(1, 20) if ref[c] not in ref[:c]]
    assert cuts
    for cut in cuts:
        params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=[ref[cut]],
                                logprobs=1)
        (spec,) = engine.generate([p], params)
        (plain,) = engine.generate([p], params, SpeculativeParams(method="off"))
        assert spec.token_ids == plain.token_ids == ref[: cut + 1]
        assert spec.finish_reason == plain.finish_reason == "stop"
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def test_global_cache_learns_across_requests_within_a_tenant_only(models):
    target, _, hf = models
    engine = make(target, speculative_method="suffix", adaptive_speculation=False)
    p = prompts([9], seed=11)[0]  # no repeats inside: drafts can only come from the cache
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run(tenant: str):
        (out,) = engine.generate([p], params, SpeculativeParams(tenant=tenant))
        assert out.token_ids == hf_greedy(hf, p, 24)
        return out.timings

    first_a = run("a")
    second_a = run("a")  # tenant a's own earlier output continues exactly
    first_b = run("b")  # tenant b must not see it: drafts as on a fresh cache
    assert second_a.num_accepted > first_a.num_accepted + 10
    assert (first_b.num_drafted, first_b.num_accepted) == (first_a.num_drafted,
                                                            first_a.num_accepted)
    engine.clear_speculation_caches()
    again = run("a")
    assert (again.num_drafted, again.num_accepted) == (first_a.num_drafted,
                                                       first_a.num_accepted)


def test_speculator_never_drafts_from_another_tenant(models):
    target, _, _ = models
    # spec factor 1: a match of 8 drafts at most 8 tokens
    engine = make(target, speculative_method="suffix", suffix_spec_factor=1.0)
    secret = prompts([30], seed=21)[0]
    suffix = engine.speculator.proposers["suffix"]
    suffix.insert("a", secret)
    for tenant, want in (("a", secret[8:16]), ("b", [])):
        got = suffix.propose([ProposalRequest(1, [7] + secret[:8], 16, tenant=tenant)])
        assert got.draft_token_ids[0] == want


def test_request_scope_engine_learns_nothing_across_requests(models):
    target, _, _ = models
    engine = make(target, speculative_method="suffix", suffix_cache_scope="request")
    p = prompts([9], seed=12)[0]
    engine.generate([p], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert engine.speculator.proposers["suffix"].cached_tokens == 0


def test_registry_names_and_unknown_method_errors(models):
    assert {"draft", "ngram", "suffix"} <= set(REGISTRY.names())
    with pytest.raises(UnknownProposerError,
                       match="known: draft, text_draft, eagle, ngram, suffix, prediction, "
                             "auto, off"):
        REGISTRY.get("medusa")
    target, _, _ = models
    with pytest.raises(ConfigError, match="suffix, prediction, auto, off"):  # the server's flag
        make(target, speculative_method="medusa")
    engine = make(target, speculative_method="suffix")  # no draft model loaded
    assert set(engine.speculator.proposers) == {"ngram", "suffix", "prediction"}
    with pytest.raises(InvalidRequestError) as err:  # a request's field
        engine.add_request("x", [1, 2, 3], GREEDY, SpeculativeParams(method="medusa"))
    assert err.value.param == "speculative.method" and "suffix" in str(err.value)
    with pytest.raises(InvalidRequestError, match="--draft-model"):
        engine.add_request("x", [1, 2, 3], GREEDY, SpeculativeParams(method="draft"))
    assert not engine.has_unfinished() and not engine.speculator.states  # nothing half-added


def test_long_match_drafts_more_than_num_speculative_tokens(models):
    target, _, hf = models
    engine = make(target, speculative_method="suffix", num_speculative_tokens=2,
                  adaptive_speculation=False)
    p = prompts([9], seed=13)[0]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine.generate([p], params)
    (out,) = engine.generate([p], params)  # all from the cache: long matches
    assert out.token_ids == hf_greedy(hf, p, 40)
    assert out.timings.mean_accepted_length > 3  # more than k = 2 could give


def test_proposals_that_find_nothing_back_off(models):
    """A request whose text rarely repeats: most steps' suffix proposals find nothing, and the
    proposer is then not asked again every step (it backs off 1, 2, 4 steps; asked every step,
    this request took 25 calls in 40 steps, with the backoff 10), while the output is still
    transformers' greedy one; a request that copies its prompt still drafts."""
    target, _, hf = models
    engine = make(target, speculative_method="suffix")
    proposer = engine.speculator.proposers["suffix"]
    calls = []
    real = proposer.propose

    def counting(requests):
        calls.append(len(requests))
        return real(requests)

    proposer.propose = counting
    p = prompts([10], seed=7)[0]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    (out,) = engine.generate([p], params)
    assert out.token_ids == hf_greedy(hf, p, 40)
    assert 0 < len(calls) <= 40 // 2, len(calls)
    calls.clear()
    (copied,) = engine.generate([copy_prompt(2)], params)
    assert copied.timings.num_drafted > 0 and calls
