"""logit_bias, presence / frequency penalties (OpenAI) and repetition_penalty (vLLM): against a
float64 reference written here from their definitions, on the tiny model's own logits
(transformers), with speculation off and on; the bias bans and forces tokens; a chi-square on
one penalized sampled step produced by verification."""

from __future__ import annotations

import pytest
import torch

from specserve.core.errors import InvalidRequestError
from specserve.core.logits_processors import LogitsState, adjust_logits
from specserve.core.sampling import SampleRequest, sample
from specserve.core.sampling_params import SamplingParams, SpeculativeParams
from specserve.spec.rejection_sampler import SpecDecodeRow, rejection_sample
from tests.helpers.reference import chi_square
from tests.helpers.speculation import make, repetitive_prompts
from tests.helpers.tiny_models import BASE


def reference_adjust(logits: torch.Tensor, prompt: list[int], output: list[int],
                     p: SamplingParams) -> torch.Tensor:
    """The definitions, token by token in float64: OpenAI's
    ``mu[j] - c[j] * frequency - (c[j] > 0) * presence`` over the generated tokens, after vLLM's
    repetition penalty over prompt and output (positive logits divided, negative multiplied),
    after the bias."""
    x = logits.double().clone()
    for tok, bias in p.logit_bias.items():
        x[tok] += bias
    for tok in set(prompt) | set(output):
        x[tok] = x[tok] / p.repetition_penalty if x[tok] > 0 else x[tok] * p.repetition_penalty
    for tok in set(output):
        c = output.count(tok)
        x[tok] -= c * p.frequency_penalty + p.presence_penalty
    return x


def hf_adjusted_greedy(hf, prompt: list[int], n: int, p: SamplingParams) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(reference_adjust(logits, prompt, out, p).argmax()))
    return out


def _row(params: SamplingParams, prompt: list[int], output: list[int], vocab: int):
    state = LogitsState.of(params, prompt, vocab, torch.device("cpu"))
    if state is not None:
        state.add(output)
    return SampleRequest(params, len(output), None, [], state)


PENALTIES = [
    SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, presence_penalty=0.6),
    SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, frequency_penalty=0.25),
    SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, presence_penalty=-0.4,
                   frequency_penalty=0.3, repetition_penalty=0.8, logit_bias={5: 3.0, 9: -2.0}),
]


def test_adjust_logits_counts_the_drafts_before_each_position():
    """Position j of a verify row equals the reference with drafts 0..j-1 appended to the
    output; rows without adjustments are untouched; plain rows (no drafts) likewise."""
    g = torch.Generator().manual_seed(0)
    vocab = 40
    params = PENALTIES[3]
    prompt, output = [1, 2, 3, 3], [4, 5, 5]
    drafts = [[5, 7, 5, 4], [], [6, 6]]
    plain = SamplingParams(max_tokens=16)
    rows = [_row(params, prompt, output, vocab), _row(plain, prompt, output, vocab),
            _row(SamplingParams(max_tokens=16, frequency_penalty=-1.5), [8], [9], vocab)]
    logits = torch.randn(sum(len(d) + 1 for d in drafts), vocab, generator=g) * 3
    got = adjust_logits(logits, rows, drafts)
    pos = 0
    for row, d in zip(rows, drafts):
        for j in range(len(d) + 1):
            prompt_b = prompt if row is not rows[2] else [8]
            out_b = (output if row is not rows[2] else [9]) + d[:j]
            want = reference_adjust(logits[pos], prompt_b, out_b, row.params)
            torch.testing.assert_close(got[pos].double(), want, rtol=0, atol=1e-5)
            pos += 1
    assert torch.equal(got[len(drafts[0]) + 1], logits[len(drafts[0]) + 1])  # unadjusted row
    one = logits[:1]
    assert adjust_logits(one, [rows[1]]) is one  # nothing to adjust: no copy
    single = adjust_logits(logits[:1].clone(), [rows[0]])  # plain decoding's one position
    assert torch.equal(single[0], got[0])


@pytest.fixture(scope="module")
def engines(models):
    """One engine per way of drafting: none (n-gram and plain), the target as its own draft,
    an unrelated draft model."""
    target, other, _ = models
    return {"plain": make(target), "self_draft": make(target, draft_model=target),
            "draft": make(target, draft_model=other)}


def _engine(engines, method):
    return engines[method if method in ("self_draft", "draft") else "plain"], SpeculativeParams(
        method if method in ("off", "ngram") else "draft")


@pytest.mark.parametrize("params", PENALTIES, ids=["presence", "frequency", "repetition", "all"])
@pytest.mark.parametrize("method", ["off", "ngram", "self_draft", "draft"])
def test_penalized_greedy_equals_the_reference(models, engines, params, method):
    """Greedy output under penalties equals the float64 reference on transformers' logits,
    token for token, with speculation off and on (n-gram, the target as its own draft, an
    unrelated draft model: drafts that ignore the penalties)."""
    hf = models[2]
    engine, spec = _engine(engines, method)
    prompts = repetitive_prompts(3)[:3]
    outs = engine.generate(prompts, params, spec)
    plain = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0,
                                                    ignore_eos=True), SpeculativeParams("off"))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_adjusted_greedy(hf, prompt, 16, params)
    assert any(o.token_ids != u.token_ids for o, u in zip(outs, plain))  # penalties mattered
    if method in ("self_draft", "ngram"):
        assert sum(o.timings.num_accepted for o in outs) > 0  # verify rows past drafts ran
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


@pytest.mark.parametrize("method", ["off", "ngram", "self_draft"])
def test_logit_bias_bans_and_forces(models, engines, method):
    """-100 bans a token: the one greedy decoding would emit first never appears, greedy or
    sampled; +100 forces it at every position."""
    engine, spec = _engine(engines, method)
    prompt = repetitive_prompts(4)[0]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    (first,) = engine.generate([prompt], greedy, SpeculativeParams("off"))
    banned_tok = first.token_ids[0]
    for temperature in (0.0, 1.0):
        ban = SamplingParams(max_tokens=12, temperature=temperature, ignore_eos=True,
                             logit_bias={banned_tok: -100.0})
        outs = engine.generate([prompt] * (1 if temperature == 0 else 24), ban, spec)
        assert all(banned_tok not in o.token_ids for o in outs)
        force = SamplingParams(max_tokens=12, temperature=temperature, ignore_eos=True,
                               logit_bias={banned_tok: 100.0})
        for o in engine.generate([prompt] * 4, force, spec):
            assert o.token_ids == [banned_tok] * 12
    # The banned greedy run equals the reference (the bias is a logit shift, not a mask).
    ban = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                         logit_bias={banned_tok: -100.0})
    (out,) = engine.generate([prompt], ban, spec)
    assert out.token_ids == hf_adjusted_greedy(models[2], prompt, 12, ban)


def test_plain_sampler_and_rejection_sampler_agree_on_adjusted_rows():
    """A k = 0 verify row and the plain sampler choose the same greedy token and report the
    same (unadjusted) logprobs."""
    vocab = 50
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(2))
    params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=2, presence_penalty=2.0,
                            logit_bias={int(logits.argmax()): -5.0})
    row = _row(params, [1], [int(logits.argmax())], vocab)
    toks, lps = sample(logits, [row])
    res = rejection_sample(logits, [SpecDecodeRow(row, [])], None)
    assert res.token_ids[0] == toks and toks[0] != int(logits.argmax())
    want = torch.log_softmax(logits[0].double(), -1)[toks[0]]
    assert abs(lps[0].logprob - float(want)) < 1e-5
    assert res.logprobs[0][0].logprob == lps[0].logprob


@pytest.mark.parametrize("bad,param", [
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={3: 100.5}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
])
def test_out_of_range_values_are_refused(bad, param):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**bad)
    assert err.value.param == param


def test_logit_bias_past_the_vocabulary_is_refused(engines):
    engine = engines["plain"]
    with pytest.raises(InvalidRequestError) as err:
        engine.generate([[5, 6]], SamplingParams(logit_bias={BASE["vocab_size"]: 1.0}))
    assert err.value.param == "logit_bias" and "300" in err.value.message


@pytest.mark.slow
@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_penalized_sampling_follows_the_penalized_distribution(models, method):
    """The second token (a verify step with k = 1 after the first) is drawn from the penalized
    distribution: P(t2) = sum_t1 p(t1) p_pen(t2 | t1), where the penalty counts t1, in float64
    from transformers; chi-square against it."""
    target, other, hf = models
    temperature, presence, frequency = 1.0, 2.0, 1.5
    prompt = torch.randperm(BASE["vocab_size"], generator=torch.Generator().manual_seed(0))
    prompt = prompt.tolist()
    with torch.no_grad():
        first = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1].double() / temperature,
                              -1)
        vocab = first.shape[0]
        second = hf(torch.tensor([prompt + [t] for t in range(vocab)])).logits[:, -1].double()
    penalized = torch.softmax(
        (second - torch.eye(vocab, dtype=torch.float64) * (presence + frequency)) / temperature,
        -1)  # [t1, t2]: the second step sees t1 once among the generated tokens
    expected = first @ penalized
    engine = make(target, draft_model=other, max_num_seqs=256, max_num_batched_tokens=4096,
                  num_kv_blocks=2000, seed=5)
    params = SamplingParams(max_tokens=3, temperature=temperature, ignore_eos=True,
                            presence_penalty=presence, frequency_penalty=frequency)
    counts = torch.zeros_like(expected)
    drafted = repeats = 0
    for _ in range(10):
        for o in engine.generate([prompt] * 250, params, SpeculativeParams(method, 1)):
            counts[o.token_ids[1]] += 1
            repeats += o.token_ids[1] == o.token_ids[0]
            drafted += o.timings.num_drafted
    assert drafted > counts.sum() / 2
    chi2, bound = chi_square(counts, expected)
    assert chi2 < bound, (chi2, bound)
    # The penalty's own mark: t2 == t1 is rare, as under the penalized law; unpenalized it would
    # be several times likelier than this bound (so the count could tell the two apart).
    n = float(counts.sum())
    p_repeat = float((first * penalized.diagonal()).sum())
    u_repeat = float((first * torch.softmax(second / temperature, -1).diagonal()).sum())
    upper = n * p_repeat + 4 * (n * p_repeat) ** 0.5 + 2
    assert repeats <= upper < n * u_repeat, (repeats, upper, n * u_repeat)
