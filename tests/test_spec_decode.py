"""Speculative decoding end to end: output identical to transformers' greedy generate() with
n-gram and draft-model proposers (under batching, chunked prefill, preemption), the sampled
distribution equal to the target's, exact stops inside multi-token steps, no KV leak."""

from __future__ import annotations

import pytest
import torch

from specserve.core.errors import ModelLoadError
from specserve.core.sampling_params import SamplingParams, SpeculativeParams
from specserve.spec.policy import Candidate, SpeculationPolicy, expected_tokens
from tests.helpers.reference import (
    chi_square,
    exact_second_token_distribution,
    hf_greedy,
    prompts,
)
from tests.helpers.speculation import check_greedy, make, repetitive_prompts
from tests.helpers.tiny_models import BASE, HF_INIT, build_tiny_model, tiny_config


@pytest.mark.parametrize("engine_kw", [{}, {"max_num_batched_tokens": 9},
                                       {"num_kv_blocks": 30, "max_model_len": 100}])
def test_ngram_greedy_identical_to_transformers(models, engine_kw):
    target, _, hf = models
    engine = make(target, speculative_method="ngram", **engine_kw)
    outs = check_greedy(engine, hf, repetitive_prompts())
    assert sum(o.timings.num_drafted for o in outs) > 0


@pytest.mark.parametrize("engine_kw", [{}, {"max_num_batched_tokens": 9},
                                       {"num_kv_blocks": 30, "max_model_len": 100}])
def test_draft_model_greedy_identical_to_transformers(models, engine_kw):
    target, other, hf = models
    engine = make(target, draft_model=other, **engine_kw)
    outs = check_greedy(engine, hf, repetitive_prompts(1))
    drafted = sum(o.timings.num_drafted for o in outs)
    accepted = sum(o.timings.num_accepted for o in outs)
    assert drafted > 0 and accepted / drafted < 0.3  # an unrelated draft is nearly always wrong


@pytest.mark.parametrize("method", ["ngram", "draft", "suffix", "auto"])
def test_adaptive_k_greedy_identical(models, method):
    target, other, hf = models
    engine = make(target, draft_model=other, speculative_method=method,
                  adaptive_speculation=True)
    check_greedy(engine, hf, repetitive_prompts(5))


def test_target_as_its_own_draft_accepts_everything(models):
    target, _, hf = models
    engine = make(target, draft_model=target)
    outs = check_greedy(engine, hf, prompts([5, 12, 30], seed=3))
    for o in outs:
        # 1 token from the prefill, then 3 verify steps of k + 1 = 5 tokens each.
        assert o.timings.num_drafted == 12
        assert o.timings.num_accepted == o.timings.num_drafted
        assert o.timings.mean_accepted_length == 5.0


def test_per_request_override_and_plain_ab(models):
    target, other, hf = models
    engine = make(target, draft_model=other)
    ps = repetitive_prompts(2)
    plain = check_greedy(engine, hf, ps, speculative=SpeculativeParams(method="off"))
    assert all(o.timings.num_drafted == 0 for o in plain)
    ngram = check_greedy(engine, hf, ps, speculative=SpeculativeParams("ngram", 2))
    assert sum(o.timings.num_drafted for o in ngram) > 0


def test_unused_draft_runs_nothing_and_allocates_no_kv(models):
    """A loaded draft that no request uses costs plain decoding nothing: no draft forward (no
    catch-up prefill over the prompt either), no KV pool; the first request that drafts
    allocates it, and its greedy output is still plain decoding's."""
    target, other, hf = models
    engine = make(target, draft_model=other)
    runner = engine.speculator.draft.runner
    forwards = []
    runner.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    ps = repetitive_prompts(3)
    plain = check_greedy(engine, hf, ps, speculative=SpeculativeParams(method="off"))
    assert all(o.timings.num_drafted == 0 for o in plain)
    assert forwards == [] and not runner.kv_allocated
    drafted = check_greedy(engine, hf, ps, speculative=SpeculativeParams("draft", 3))
    assert sum(o.timings.num_drafted for o in drafted) > 0
    assert forwards and runner.kv_allocated
    assert runner.kv_cache.abs().sum() > 0  # the draft wrote its KV into the allocated pool


def test_stops_inside_a_multi_token_step(models):
    target, _, hf = models
    engine = make(target, draft_model=target)  # full acceptance: 5 tokens per step
    p = prompts([11], seed=4)[0]
    ref = hf_greedy(hf, p, 16)
    for cut in (1, 2, 3, 6, 7):
        if ref[cut] in ref[:cut]:
            continue
        params = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[ref[cut]],
                                logprobs=2)
        (spec,) = engine.generate([p], params)
        (plain,) = engine.generate([p], params, SpeculativeParams(method="off"))
        assert spec.token_ids == plain.token_ids == ref[: cut + 1]
        assert spec.finish_reason == plain.finish_reason == "stop"
        assert [lp.token_id for lp in spec.logprobs] == spec.token_ids
        for a, b in zip(spec.logprobs, plain.logprobs):
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4)
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    for n in (1, 3, 6):
        (spec,) = engine.generate([p], SamplingParams(max_tokens=n, temperature=0.0,
                                                      ignore_eos=True))
        assert spec.token_ids == ref[:n] and spec.finish_reason == "length"
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def second_token_counts(models, method: str, rounds: int, seeded: bool = False):
    """Samples (prompt -> 3 tokens) 250 x rounds times with k = 1 speculation; returns the
    counts of the second token (the one a verify step produces), the exact float64 target
    marginal of that token, and how many drafts were verified. ``seeded``: every request has
    its own seed (verified by sampling, not by the accept test)."""
    target, other, hf = models
    temperature = 1.5  # flatten the tiny model's distribution so many tokens occur
    # Every token id occurs in the prompt, so prompt lookup always has a match to propose.
    prompt = torch.randperm(BASE["vocab_size"], generator=torch.Generator().manual_seed(0))
    prompt = prompt.tolist()
    expected = exact_second_token_distribution(hf, prompt, temperature)
    engine = make(target, draft_model=other, max_num_seqs=256, max_num_batched_tokens=4096,
                  num_kv_blocks=2000, seed=5)
    params = SamplingParams(max_tokens=3, temperature=temperature, ignore_eos=True)
    counts = torch.zeros_like(expected)
    drafted = 0
    for r in range(rounds):
        per = [SamplingParams(max_tokens=3, temperature=temperature, ignore_eos=True,
                              seed=1000 * r + i) for i in range(250)] if seeded else params
        for o in engine.generate([prompt] * 250, per, SpeculativeParams(method, 1)):
            counts[o.token_ids[1]] += 1
            drafted += o.timings.num_drafted
    return counts, expected, drafted


@pytest.mark.parametrize("method", ["draft", "ngram", "suffix", "auto"])
@pytest.mark.slow
def test_sampled_distribution_equals_target(models, method):
    """The second token is produced by a verify step (k = 1 draft), so its distribution is the
    rejection sampler's output; it must equal the target's exact marginal."""
    counts, expected, drafted = second_token_counts(models, method, rounds=12)
    assert drafted > counts.sum() / 2  # most second tokens really went through verification
    chi2, bound = chi_square(counts, expected)
    assert chi2 < bound, (chi2, bound)


@pytest.mark.parametrize("method", ["draft", "suffix"])
@pytest.mark.slow
def test_seeded_sampled_distribution_equals_target(models, method):
    """The same with a seed per request: seeded rows are verified by sampling each position
    (rejection_sampler.py), and their second tokens still follow the target's marginal."""
    counts, expected, drafted = second_token_counts(models, method, rounds=12, seeded=True)
    assert drafted > counts.sum() / 2
    chi2, bound = chi_square(counts, expected)
    assert chi2 < bound, (chi2, bound)


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft", "auto"])
def test_seeded_sampling_emits_plain_decodings_tokens(models, method):
    """A seeded sampled request emits exactly what plain decoding emits with that seed: with
    any proposer, alone or beside other requests (whose drafts change the step's k choices),
    while drafts are still accepted."""
    target, _, _ = models
    engine = make(target, draft_model=target)  # a draft that is the target: drafts often match
    ps = repetitive_prompts(2)[:3]
    seeded = [SamplingParams(max_tokens=24, temperature=0.3, top_p=0.95, seed=7 + i,
                             ignore_eos=True) for i in range(len(ps))]
    plain = [o.token_ids for o in engine.generate(ps, seeded, SpeculativeParams("off"))]
    alone = [engine.generate([p], [sp], SpeculativeParams(method))[0] for p, sp in zip(ps, seeded)]
    busy = SamplingParams(max_tokens=24, temperature=1.0, ignore_eos=True)
    together = engine.generate(ps + ps, seeded + [busy] * len(ps), SpeculativeParams(method))
    assert [o.token_ids for o in alone] == plain
    assert [o.token_ids for o in together[:len(ps)]] == plain
    assert sum(o.timings.num_accepted for o in alone + together[:len(ps)]) > 0


@pytest.mark.slow
def test_distribution_test_catches_a_broken_accept_rule(models, monkeypatch):
    """Negative control: accept every draft (ignoring p/q) and the same test must fail."""
    import specserve.spec.speculator as speculator_mod
    from specserve.spec.rejection_sampler import SpecDecodeResult

    real = speculator_mod.rejection_sample

    def accept_all(target_logits, rows, draft_probs, generator=None):
        res = real(target_logits, rows, draft_probs, generator)
        tokens = [list(r.draft_token_ids) + [t[-1]] for r, t in zip(rows, res.token_ids)]
        accepted = [len(r.draft_token_ids) for r in rows]
        logprobs = [lp + [lp[-1]] * (len(t) - len(lp)) for lp, t in zip(res.logprobs, tokens)]
        return SpecDecodeResult(tokens, accepted, logprobs)

    monkeypatch.setattr(speculator_mod, "rejection_sample", accept_all)
    counts, expected, _ = second_token_counts(models, "draft", rounds=4)
    chi2, bound = chi_square(counts, expected)
    assert chi2 > bound, (chi2, bound)


def test_draft_with_other_vocabulary_is_refused(models, tmp_path):
    target, _, _ = models
    build_tiny_model(tmp_path, tiny_config(vocab_size=301), init=HF_INIT)
    with pytest.raises(ModelLoadError, match="vocabulary"):
        make(target, draft_model=str(tmp_path))


def test_policy_turns_speculation_off_when_compute_bound():
    policy = SpeculationPolicy()
    # Memory-bound: 50 ms per forward, 0.2 ms per extra token, cheap draft steps.
    for n in (1, 8, 16, 32):
        policy.record_target(n, 0.050 + 0.0002 * n)
        policy.record_draft_step(n, 0.004 + 0.0001 * n)
    cands = [Candidate(i, 6, 0.8, True) for i in range(4)]
    ks = policy.choose(cands, 0)
    assert all(k >= 3 for k in ks.values())
    # Compute-bound: every token costs as much as the fixed part of a small batch.
    policy = SpeculationPolicy()
    for n in (16, 32, 64, 128):
        policy.record_target(n, 0.001 + 0.002 * n)
        policy.record_draft_step(n, 0.004 + 0.0001 * n)
    ks = policy.choose([Candidate(i, 6, 0.8, True) for i in range(64)], 0)
    assert all(k == 0 for k in ks.values())
    # Drafts that are never accepted are never worth verifying.
    policy = SpeculationPolicy()
    ks = policy.choose([Candidate(0, 6, 0.0, False)], 0)
    assert ks[0] == 0


def test_policy_prices_unmeasured_counts_from_the_kernel_table():
    """Steps measured only at plain sizes; the tuner's table shows a cliff in the matmul cost
    past 32 rows. 32 decoders must not draft over it; one decoder far below it drafts fully."""
    def table(n: int) -> float:
        return 0.040 + (0.0002 * n if n <= 32 else 0.0002 * 32 + 0.004 * (n - 32))

    def policy() -> SpeculationPolicy:
        p = SpeculationPolicy(projection_seconds=table)
        for n in (1, 8, 32):
            for _ in range(3):
                p.record_target(n, table(n) + 0.010)  # the rest of the forward: 10 ms
        return p

    ks = policy().choose([Candidate(i, 4, 0.9, False) for i in range(32)], 0)
    assert all(k == 0 for k in ks.values())
    ks = policy().choose([Candidate(0, 4, 0.9, False)], 0)
    assert ks[0] == 4  # one sequence: 5 rows, far from the cliff
    # Without the table the linear fit over 1..32 rows sees no cliff and drafts at 32.
    p = SpeculationPolicy()
    for n in (1, 8, 32):
        for _ in range(3):
            p.record_target(n, table(n) + 0.010)
    ks = p.choose([Candidate(i, 4, 0.9, False) for i in range(32)], 0)
    assert sum(ks.values()) > 0


def test_expected_tokens():
    assert expected_tokens(1.0, 4) == 5
    assert expected_tokens(0.0, 4) == 1
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_long_random_workload_returns_every_block(models):
    import random

    target, other, _ = models
    rng = random.Random(0)
    engine = make(target, draft_model=other, num_kv_blocks=60, max_model_len=120,
                  max_num_batched_tokens=24, adaptive_speculation=True)
    methods = ["off", "ngram", "draft", "suffix", "auto"]
    live: list[str] = []
    for i in range(60):
        p = prompts([rng.randint(1, 40)], seed=100 + i)[0]
        params = SamplingParams(max_tokens=rng.randint(1, 30), temperature=rng.choice([0, 0.8]),
                                seed=rng.choice([None, i]), ignore_eos=rng.random() < 0.5)
        engine.add_request(f"w{i}", p, params,
                           SpeculativeParams(rng.choice(methods), rng.randint(0, 6)))
        live.append(f"w{i}")
        for _ in range(rng.randint(0, 3)):
            engine.step()
        if rng.random() < 0.15:
            engine.abort(rng.choice(live))
    while engine.has_unfinished():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks
    assert not engine.requests


@pytest.mark.slow
def test_random_stops_identical_with_and_without_speculation(text_model):
    """Self-draft: every verify step accepts k + 1 tokens, so stops land inside multi-token
    steps; text, token ids, finish reason and logprobs must be byte-identical to plain."""
    import random

    rng = random.Random(0)
    engine = make(text_model, draft_model=text_model, num_kv_blocks=600)
    texts = ["The weather today is", "def add(a, b):", "Once upon a time, in a land",
             "1, 2, 3, 4,", "Les gens disent que"]
    base = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=1)
    plain = engine.generate(texts, base, SpeculativeParams(method="off"))
    cases = 0
    for text, ref in zip(texts, plain):
        for _ in range(4):
            kind = rng.choice(["string", "id", "max"])
            kw: dict = {}
            if kind == "string" and len(ref.text) > 4:
                a = rng.randrange(1, len(ref.text) - 2)
                kw["stop"] = [ref.text[a : a + rng.randint(1, 3)]]
            elif kind == "id":
                kw["stop_token_ids"] = [ref.token_ids[rng.randrange(1, len(ref.token_ids))]]
            else:
                kw["max_tokens"] = rng.randint(1, 40)
            params = SamplingParams(**{**base.__dict__, **kw})
            (a,) = engine.generate([text], params, SpeculativeParams(method="off"))
            (b,) = engine.generate([text], params)
            assert (a.text, a.token_ids, a.finish_reason, a.stop_reason) == (
                b.text, b.token_ids, b.finish_reason, b.stop_reason), (kind, kw)
            assert [x.token_id for x in a.logprobs] == [x.token_id for x in b.logprobs]
            assert [x.logprob for x in a.logprobs] == pytest.approx(
                [x.logprob for x in b.logprobs], abs=1e-4)
            assert b.timings.num_drafted == 0 or b.timings.num_accepted == b.timings.num_drafted
            cases += 1
    assert cases == 20
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def test_policy_prices_steps_from_measured_costs_per_token_count():
    """A machine whose cost is flat up to 5 tokens and doubles past it (a line fitted through
    those points would price 6-9 tokens between the two): one sequence with good acceptance
    drafts exactly 4, the most that stays on the flat part; with costs flat all the way it
    drafts its k_max of 8."""
    def measured(cost) -> SpeculationPolicy:
        policy = SpeculationPolicy()
        for _ in range(5):
            for n in range(1, 10):
                policy.record_target(n, cost(n))
        return policy

    cand = [Candidate(0, 8, 0.7, False)]
    assert measured(lambda n: 0.100 if n <= 5 else 0.200).choose(cand, 0)[0] == 4
    assert measured(lambda n: 0.100).choose(cand, 0)[0] == 8
    # Noise that makes a bigger step look cheaper than the plain one does not make a draft
    # that is never accepted look free.
    noisy = measured(lambda n: 0.100 if n == 1 else 0.095)
    assert noisy.choose([Candidate(1, 8, 0.0, False)], 0)[1] == 0


def test_policy_retries_a_sequence_it_stopped_speculating_for():
    """A sequence whose drafts all failed gets k = 0; while it does not draft its evidence fades
    toward the method's prior, so once the method does well elsewhere it is tried again."""
    policy = SpeculationPolicy()
    for _ in range(5):
        for n in range(1, 6):
            policy.record_target(n, 0.100 + 0.050 * n)  # a draft token costs a third of a step
    for _ in range(10):
        policy.record_acceptance(7, "ngram", 4, 0)
    for other in range(20):  # other sequences accept most of their n-gram drafts
        policy.record_acceptance(100 + other, "ngram", 4, 3)

    def k_now() -> int:
        return policy.choose([Candidate(7, 4, policy.acceptance_rate(7, "ngram"), False)], 0)[7]

    ks = [k_now() for _ in range(40)]
    assert ks[0] == 0 and ks[-1] > 0


def test_policy_tries_a_method_again_after_its_first_drafts_failed():
    """A method whose only evidence is a few rejected drafts (a warm-up request, an unlucky
    first one) starts every later sequence below break-even. Its global rate fades toward the
    starting prior while nothing drafts, so a later sequence drafts again instead of that
    method staying off for good."""
    policy = SpeculationPolicy()
    for _ in range(5):
        for n in range(1, 6):
            policy.record_target(n, 0.100 + 0.050 * n)  # a draft token costs a third of a step
    for _ in range(8):
        policy.record_acceptance(1, "suffix", 4, 0)
    policy.forget(1)

    def k_now(seq: int) -> int:
        rate = policy.acceptance_rate(seq, "suffix")
        return policy.choose([Candidate(seq, 4, rate, False, 0.0, "suffix")], 0)[seq]

    start = policy.acceptance_rate(2, "suffix")
    assert k_now(2) == 0
    ks = [k_now(3 + i) for i in range(200)]  # new sequences, none of them drafting yet
    assert ks[-1] > 0
    assert policy.acceptance_rate(999, "suffix") > start


def test_policy_weighs_drafts_against_the_whole_step():
    """Sequences that draft nothing this step still decode in it: a draft that pays for its
    own sequence alone must not slow seven plain decoders down (per-token cost 3 ms, 10 ms
    fixed: 1.6 expected tokens for one extra row pay alone, not in an 8-row step)."""
    policy = SpeculationPolicy()
    for n in range(1, 40):
        for _ in range(3):
            policy.record_target(n, 0.010 + 0.003 * n)
    assert policy.choose([Candidate(0, 4, 0.6, False)], 0)[0] > 0
    assert policy.choose([Candidate(0, 4, 0.6, False)], 0, num_other_decodes=7)[0] == 0
