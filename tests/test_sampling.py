"""Sampler against independent float64 computations and a statistical test."""

from __future__ import annotations

import math

import pytest
import torch

from specserve.core.errors import InvalidRequestError
from specserve.core.sampling import SampleRequest, process_logits, sample
from specserve.core.sampling_params import SamplingParams
from tests.helpers.reference import expected_distribution


def row(params: SamplingParams, generator=None) -> SampleRequest:
    return SampleRequest(params, 0, generator, [])


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 0.8), (1.3, 5, 1.0), (0.9, 6, 0.7)]
)
def test_sampled_frequencies_match_reference(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(12) * 2
    expected = expected_distribution(logits, temperature, top_k, top_p)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=1)
    n_rows, n_rounds = 2000, 15
    gen = torch.Generator().manual_seed(123)
    counts = torch.zeros(12, dtype=torch.float64)
    batch = logits.repeat(n_rows, 1)
    for _ in range(n_rounds):
        tokens, _ = sample(batch, [row(params)] * n_rows, gen)
        counts += torch.bincount(torch.tensor(tokens), minlength=12).double()
    n = n_rows * n_rounds
    freq = counts / n
    # Tokens outside the reference support never appear; the rest lie within 5 sigma.
    assert torch.all(counts[expected == 0] == 0)
    sigma = torch.sqrt(expected * (1 - expected) / n)
    assert torch.all((freq - expected).abs() <= 5 * sigma + 1e-12), (freq, expected)
    # And a chi-square statistic well within its distribution (df = support - 1).
    support = expected > 0
    chi2 = float((((counts - n * expected) ** 2)[support] / (n * expected[support])).sum())
    df = int(support.sum()) - 1
    assert chi2 < df + 6 * math.sqrt(2 * max(df, 1)), chi2


def test_process_logits_matches_reference_support():
    torch.manual_seed(1)
    logits = torch.randn(3, 50)
    out = process_logits(
        logits,
        torch.tensor([0.5, 1.0, 2.0]),
        torch.tensor([0, 7, 3]),
        torch.tensor([0.9, 1.0, 0.5]),
    )
    for i, (t, k, p) in enumerate([(0.5, 0, 0.9), (1.0, 7, 1.0), (2.0, 3, 0.5)]):
        ref = expected_distribution(logits[i], t, k, p)
        got = torch.softmax(out[i].double(), dim=-1)
        torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("scale", [4.0, 0.05, None])
def test_top_p_on_a_real_vocabulary_matches_the_reference(scale):
    """A 49152-token vocabulary: top-k / top-p filter the best 256 candidates first, then the
    best 4096 (None: 1500 likely tokens, a nucleus of ~1000), and sort the whole row when the
    nucleus is wider still (scale 0.05: a flat row, tens of thousands of tokens in it). Rows with
    and without filters share the batch; every row equals the float64 reference."""
    torch.manual_seed(2)
    if scale is None:
        logits = torch.randn(4, 49152) * 0.1 - 8.0
        logits[:, :1500] += 12.0
    else:
        logits = torch.randn(4, 49152) * scale
    cases = [(0.7, 0, 0.95), (1.0, 0, 1.0), (1.2, 40, 0.9), (0.9, 300, 1.0)]
    out = process_logits(logits, torch.tensor([c[0] for c in cases]),
                         torch.tensor([c[1] for c in cases]), torch.tensor([c[2] for c in cases]))
    for i, (t, k, p) in enumerate(cases):
        # top_p 1 filters nothing (the reference's running float sum may reach 1.0 early)
        ref = expected_distribution(logits[i], t, k, p if p < 1.0 else math.inf)
        got = torch.softmax(out[i].double(), dim=-1)
        assert torch.equal(got > 0, ref > 0), i  # the same support, token for token
        torch.testing.assert_close(got, ref, atol=1e-9, rtol=1e-5)


def test_draw_follows_the_distribution():
    """Inverse-CDF draws (one uniform a row) against the probabilities, unnormalized input,
    zero-probability tokens never drawn."""
    probs = torch.tensor([0.0, 3.0, 1.0, 0.0, 4.0, 2.0]).repeat(40000, 1)
    from specserve.core.sampling import draw

    tokens = draw(probs, torch.Generator().manual_seed(9))
    counts = torch.bincount(tokens, minlength=6).double()
    expected = torch.tensor([0.0, 0.3, 0.1, 0.0, 0.4, 0.2]) * 40000
    assert counts[0] == 0 and counts[3] == 0
    keep = expected > 0
    chi2 = float((((counts - expected) ** 2)[keep] / expected[keep]).sum())
    assert chi2 < 3 + 6 * math.sqrt(6), chi2


def test_greedy_is_argmax_and_ignores_other_filters():
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, -1.0, 4.0]])
    tokens, _ = sample(logits, [row(SamplingParams(temperature=0.0, top_k=1))] * 2)
    assert tokens == [1, 0]


def test_seeded_row_is_independent_of_batch_composition():
    torch.manual_seed(2)
    logits = torch.randn(5, 40)
    params = SamplingParams(temperature=1.0, seed=7)

    def draws(batch_rows: int) -> list[int]:
        gen = torch.Generator().manual_seed(7)
        others = [row(SamplingParams(temperature=1.0)) for _ in range(batch_rows - 1)]
        got = []
        for _ in range(20):
            tokens, _ = sample(logits[:batch_rows], [row(params, gen), *others],
                               torch.Generator().manual_seed(len(got)))
            got.append(tokens[0])
        return got

    assert draws(1) == draws(5)


def test_min_tokens_bans_eos():
    logits = torch.tensor([[0.0, 10.0, 0.0]])
    req = SampleRequest(SamplingParams(temperature=0.0, min_tokens=2, max_tokens=4), 0, None, [1])
    tokens, _ = sample(logits, [req])
    assert tokens == [2] or tokens == [0]


def test_logprobs_are_raw_log_softmax():
    torch.manual_seed(3)
    logits = torch.randn(2, 30)
    reqs = [row(SamplingParams(temperature=0.0, logprobs=3)), row(SamplingParams(temperature=0))]
    tokens, lps = sample(logits, reqs)
    ref = torch.log_softmax(logits[0].double(), -1)
    assert lps[1] is None
    assert lps[0].token_id == tokens[0]
    assert abs(lps[0].logprob - float(ref[tokens[0]])) < 1e-5
    top_ids = torch.argsort(ref, descending=True)[:3].tolist()
    assert [t for t, _ in lps[0].top] == top_ids


@pytest.mark.parametrize(
    "kwargs,param",
    [({"max_tokens": 0}, "max_tokens"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
     ({"temperature": -1.0}, "temperature"), ({"top_k": -2}, "top_k"),
     ({"stop": [""]}, "stop")],
)
def test_invalid_params_name_the_field(kwargs, param):
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_vanishing_top_p_and_temperature_keep_the_argmax():
    """Found by schemathesis: top_p = 5e-324 underflows to 0 in float32 and once emptied the row
    (NaN probabilities, a failed engine step); a temperature that small overflowed the logits.
    Both now leave exactly the argmax, as their limit does."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.9], [3.0, 0.0, 0.1, -2.0]])
    out = process_logits(logits, torch.ones(2), torch.zeros(2, dtype=torch.int64),
                         torch.tensor([5e-324, 5e-324]))
    assert torch.isfinite(out).sum(dim=1).tolist() == [1, 1]
    assert out.argmax(dim=1).tolist() == logits.argmax(dim=1).tolist()
    assert SamplingParams(temperature=1e-300).greedy and not SamplingParams(temperature=1e-4).greedy
    rows = [SampleRequest(SamplingParams(temperature=1e-300), 0, None, []),
            SampleRequest(SamplingParams(temperature=1.0, top_p=5e-324), 0,
                          torch.Generator().manual_seed(3), [])]
    tokens, _ = sample(logits, rows)
    assert tokens == logits.argmax(dim=1).tolist()
