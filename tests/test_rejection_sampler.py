"""Rejection sampler: greedy exactness, the output distribution against float64 references
(chi-square and per-token 5-sigma bounds, computed without scipy), acceptance rates, seeds,
min_tokens and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from specserve.core.sampling import SampleRequest, process_logits, sample
from specserve.core.sampling_params import SamplingParams
from specserve.spec.rejection_sampler import SpecDecodeRow, rejection_sample
from tests.helpers.reference import expected_distribution

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def req(params: SamplingParams, generator=None, num_output=0, banned=()) -> SampleRequest:
    return SampleRequest(params, num_output, generator, list(banned))


def assert_distribution(tokens: torch.Tensor, expected: torch.Tensor) -> None:
    """Frequencies of `tokens` match `expected` (float64): nothing outside the support, every
    token within 5 sigma, and a chi-square statistic below df + 6 sqrt(2 df)."""
    n = tokens.numel()
    assert n > 1000
    counts = torch.bincount(tokens, minlength=expected.numel()).double()
    assert torch.all(counts[expected == 0] == 0), (counts, expected)
    freq = counts / n
    sigma = torch.sqrt(expected * (1 - expected) / n)
    assert torch.all((freq - expected).abs() <= 5 * sigma + 1e-12), (freq, expected)
    support = expected > 0
    chi2 = float((((counts - n * expected) ** 2)[support] / (n * expected[support])).sum())
    df = int(support.sum()) - 1
    assert chi2 < df + 6 * math.sqrt(2 * max(df, 1)), (chi2, freq, expected)


# --------------------------------------------------------------------------- greedy


def greedy_case(k: int, agree: int, vocab: int, gen: torch.Generator):
    """Random logits for k+1 positions and drafts equal to the argmax for the first `agree`
    positions, then different."""
    logits = torch.randn(k + 1, vocab, generator=gen)
    argmax = logits.argmax(-1).tolist()
    drafts = argmax[:k]
    if agree < k:
        drafts[agree] = (argmax[agree] + 1) % vocab
        for j in range(agree + 1, k):  # later drafts: anything, even matching
            drafts[j] = int(torch.randint(vocab, (1,), generator=gen))
    return logits, drafts, argmax


@pytest.mark.parametrize("k", [1, 2, 5])
def test_greedy_cuts_after_first_mismatch_and_adds_bonus(k):
    gen = torch.Generator().manual_seed(k)
    for agree in range(k + 1):
        logits, drafts, argmax = greedy_case(k, agree, 50, gen)
        out = rejection_sample(logits, [SpecDecodeRow(req(GREEDY), drafts)], None)
        assert out.num_accepted == [agree]
        # Accepted drafts, then the argmax at the first mismatch (or the bonus at position k).
        assert out.token_ids == [argmax[: agree + 1]]
        assert out.logprobs == [[None] * (agree + 1)]


def test_greedy_k0_is_plain_argmax():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(0))
    rows = [SpecDecodeRow(req(GREEDY), []) for _ in range(4)]
    out = rejection_sample(logits, rows, None)
    plain, _ = sample(logits, [r.request for r in rows])
    assert out.token_ids == [[t] for t in plain]
    assert out.num_accepted == [0] * 4


def test_greedy_mixed_k_batch_equals_rows_alone():
    gen = torch.Generator().manual_seed(1)
    cases = [greedy_case(k, a, 40, gen) for k, a in [(3, 1), (0, 0), (4, 4), (2, 0), (1, 1)]]
    logits = torch.cat([c[0] for c in cases])
    rows = [SpecDecodeRow(req(GREEDY), c[1]) for c in cases]
    out = rejection_sample(logits, rows, None)
    assert out.num_accepted == [1, 0, 4, 0, 1]
    assert out.token_ids == [c[2][: a + 1] for c, a in zip(cases, out.num_accepted)]



def test_greedy_fast_path_equals_general_path():
    """All-greedy steps without logprobs take a short path (one argmax); asking for logprobs
    forces the general path, which must pick the same tokens on the same logits."""
    gen = torch.Generator().manual_seed(7)
    cases = [greedy_case(k, a, 64, gen) for k, a in [(4, 2), (0, 0), (5, 5), (3, 0), (2, 1)]]
    logits = torch.cat([c[0] for c in cases])
    fast = rejection_sample(logits, [SpecDecodeRow(req(GREEDY), c[1]) for c in cases], None)
    with_logprobs = SamplingParams(temperature=0.0, max_tokens=64, logprobs=0)
    general = rejection_sample(
        logits, [SpecDecodeRow(req(with_logprobs), c[1]) for c in cases], None
    )
    assert fast.token_ids == general.token_ids
    assert fast.num_accepted == general.num_accepted == [2, 0, 5, 0, 1]
    assert all(lp is None for row in fast.logprobs for lp in row)


# --------------------------------------------------------------------------- distribution

VOCAB = 6
K = 3


def position_logits() -> torch.Tensor:
    """Target logits per position [K+1, V]: they do not depend on the prefix, so each emitted
    token at position j is distributed as p_j whatever happened before it."""
    gen = torch.Generator().manual_seed(10)
    return torch.randn(K + 1, VOCAB, generator=gen) * 1.5


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, 0, 1.0), (1.3, 0, 0.8), (0.7, 4, 0.9)]
)
@pytest.mark.parametrize("stochastic_draft", [True, False])
def test_emitted_tokens_follow_target_distribution(temperature, top_k, top_p, stochastic_draft):
    n_rows = 30_000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=64)
    pos_logits = position_logits()  # [K+1, V]
    expected = [expected_distribution(pos_logits[j], temperature, top_k, top_p)
                for j in range(K + 1)]
    draft_gen = torch.Generator().manual_seed(20)
    if stochastic_draft:
        # A draft distribution unlike p (one token it never proposes), drafts sampled from it.
        q = torch.rand(K, VOCAB, generator=draft_gen) ** 2
        q[:, 2] = 0.0
        q = q / q.sum(-1, keepdim=True)  # [K, V]
        drafts = torch.stack(
            [torch.multinomial(q[j], n_rows, replacement=True, generator=draft_gen)
             for j in range(K)], dim=1)  # [N, K]
        draft_probs = q.repeat(n_rows, 1)  # [N*K, V]
    else:
        # Deterministic drafts from an arbitrary rule (row and position dependent).
        rows_idx = torch.arange(n_rows)[:, None]
        drafts = (rows_idx * 5 + torch.arange(K) * 2 + rows_idx // 7) % VOCAB  # [N, K]
        draft_probs = None
    request = req(params)  # unseeded: all rows share default_generator
    rows = [SpecDecodeRow(request, d) for d in drafts.tolist()]
    logits = pos_logits.repeat(n_rows, 1)  # [N*(K+1), V]
    out = rejection_sample(logits, rows, draft_probs, torch.Generator().manual_seed(30))

    acc = torch.tensor(out.num_accepted)
    for toks, a, d in zip(out.token_ids[:200], out.num_accepted[:200], drafts.tolist()):
        assert len(toks) == a + 1 and toks[:a] == d[:a]
    first = torch.tensor([t[0] for t in out.token_ids])
    assert_distribution(first, expected[0])
    # Given draft 0 was accepted, the second token is a fresh speculative step at position 1.
    second = torch.tensor([t[1] for t in out.token_ids if len(t) > 1])
    assert_distribution(second, expected[1])
    # Given all drafts were accepted, the bonus token comes from p_K.
    bonus = torch.tensor([t[K] for t in out.token_ids if len(t) == K + 1])
    if bonus.numel() > 1000:
        assert_distribution(bonus, expected[K])
    # The acceptance rate of draft 0 is sum_x min(p(x), q(x)) (one-hot q: E[p(draft)]).
    if stochastic_draft:
        rate = float(torch.minimum(expected[0], q[0].double()).sum())
    else:
        rate = float(expected[0][drafts[:, 0]].mean())
    got = float((acc > 0).double().mean())
    assert abs(got - rate) <= 5 * math.sqrt(rate * (1 - rate) / n_rows) + 1e-9, (got, rate)


def test_k0_sampled_rows_follow_target_distribution():
    n_rows = 20_000
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8)
    pos_logits = position_logits()[:1]
    out = rejection_sample(pos_logits.repeat(n_rows, 1), [SpecDecodeRow(req(params), [])] * n_rows,
                           None, torch.Generator().manual_seed(3))
    assert out.num_accepted == [0] * n_rows
    assert_distribution(torch.tensor([t[0] for t in out.token_ids]),
                        expected_distribution(pos_logits[0], 0.8, 0, 0.9))


# --------------------------------------------------------------------------- acceptance rate


def processed_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    n = logits.shape[0]
    return process_logits(
        logits,
        torch.full((n,), params.temperature),
        torch.full((n,), params.top_k, dtype=torch.int64),
        torch.full((n,), params.top_p),
    ).softmax(-1)


def test_draft_equal_to_target_is_always_accepted():
    n_rows, vocab = 2000, 20
    params = SamplingParams(temperature=0.9, top_k=12, top_p=0.95, max_tokens=64)
    logits = torch.randn(K + 1, vocab, generator=torch.Generator().manual_seed(4)).repeat(n_rows, 1)
    p = processed_probs(logits.view(n_rows, K + 1, vocab)[:, :K].reshape(-1, vocab), params)
    drafts = torch.multinomial(p, 1, generator=torch.Generator().manual_seed(5)).view(n_rows, K)
    rows = [SpecDecodeRow(req(params), d) for d in drafts.tolist()]
    out = rejection_sample(logits, rows, p, torch.Generator().manual_seed(6))
    assert out.num_accepted == [K] * n_rows


@pytest.mark.parametrize("stochastic_draft", [True, False])
def test_disjoint_supports_never_accept(stochastic_draft):
    n_rows, vocab = 2000, 8
    params = SamplingParams(temperature=1.0, max_tokens=64)
    logits = torch.randn(n_rows * (K + 1), vocab, generator=torch.Generator().manual_seed(7))
    logits[:, 4:] = float("-inf")  # the target lives on {0..3}, the draft on {4..7}
    q = torch.zeros(n_rows * K, vocab)
    q[:, 4:] = torch.rand(n_rows * K, 4, generator=torch.Generator().manual_seed(8)) + 0.1
    q = q / q.sum(-1, keepdim=True)
    drafts = torch.multinomial(q, 1, generator=torch.Generator().manual_seed(9)).view(n_rows, K)
    rows = [SpecDecodeRow(req(params), d) for d in drafts.tolist()]
    out = rejection_sample(logits, rows, q if stochastic_draft else None,
                           torch.Generator().manual_seed(10))
    assert out.num_accepted == [0] * n_rows
    assert all(len(t) == 1 and t[0] < 4 for t in out.token_ids)


# --------------------------------------------------------------------------- seeds


def test_seeded_row_is_independent_of_batch_composition():
    vocab = 30
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=11, max_tokens=64)
    mine_logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(12))
    mine_q = torch.softmax(torch.randn(3, vocab, generator=torch.Generator().manual_seed(13)), -1)
    mine_drafts = [3, 7, 7]

    def run(others: int, step_seed: int) -> list[list[int]]:
        gen = torch.Generator().manual_seed(11)
        got = []
        for step in range(15):
            other_gen = torch.Generator().manual_seed(100 + step)
            rows, logits, q = [], [], []
            for i in range(others):  # unseeded, seeded, greedy, various k
                k = i % 3
                p = SamplingParams(temperature=0.0 if i % 4 == 3 else 1.2, max_tokens=64)
                rows.append(SpecDecodeRow(req(p, other_gen if i % 2 else None), [1] * k))
                logits.append(torch.randn(k + 1, vocab, generator=other_gen))
                q.append(torch.softmax(torch.randn(k, vocab, generator=other_gen), -1))
            pos = others // 2  # our row sits in the middle of the batch
            rows.insert(pos, SpecDecodeRow(req(params, gen), mine_drafts))
            logits.insert(pos, mine_logits)
            q.insert(pos, mine_q)
            out = rejection_sample(torch.cat(logits), rows, torch.cat(q),
                                   torch.Generator().manual_seed(step_seed + step))
            got.append(out.token_ids[pos])
        return got

    alone = run(0, 0)
    assert alone == run(7, 1000) == run(3, 2000)
    assert len({tuple(t) for t in alone}) > 1  # it really samples


def test_k0_seeded_row_matches_plain_sampler():
    logits = torch.randn(3, 25, generator=torch.Generator().manual_seed(14))
    params = [SamplingParams(temperature=0.7, top_k=10, seed=1),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.1, top_p=0.8, seed=2, min_tokens=1)]
    gens_a = [torch.Generator().manual_seed(s) for s in (1, 0, 2)]
    gens_b = [torch.Generator().manual_seed(s) for s in (1, 0, 2)]
    for step in range(10):
        reqs_a = [req(p, g if p.seed is not None else None, banned=[4])
                  for p, g in zip(params, gens_a)]
        reqs_b = [req(p, g if p.seed is not None else None, banned=[4])
                  for p, g in zip(params, gens_b)]
        plain, plain_lp = sample(logits, reqs_a)
        if step % 2:  # alone
            out = rejection_sample(logits, [SpecDecodeRow(r, []) for r in reqs_b], None)
        else:  # beside a seeded row that drafts (its uniforms and draws are its own)
            extra = req(SamplingParams(temperature=0.9, seed=3), torch.Generator().manual_seed(3))
            more = torch.randn(3, 25, generator=torch.Generator().manual_seed(step))
            both = torch.cat([logits, more])
            out = rejection_sample(both, [*(SpecDecodeRow(r, []) for r in reqs_b),
                                          SpecDecodeRow(extra, [5, 6])], None)
            out.token_ids = out.token_ids[:3]
        assert out.token_ids == [[t] for t in plain]


# --------------------------------------------------------------------------- min_tokens


def test_min_tokens_bans_eos_at_early_positions_greedy():
    eos, vocab = 5, 10
    logits = torch.zeros(4, vocab)
    logits[:, eos] = 10.0  # the target wants EOS everywhere
    logits[:, 2] = 5.0  # second choice
    params = SamplingParams(temperature=0.0, min_tokens=3, max_tokens=10)
    # Already 1 output token: positions 0, 1 are output indexes 1, 2 (< 3, banned); 2, 3 are not.
    row = SpecDecodeRow(req(params, num_output=1, banned=[eos]), [2, 2, eos])
    out = rejection_sample(logits, [row], None)
    assert out.token_ids == [[2, 2, eos, eos]] and out.num_accepted == [3]
    # The draft proposes EOS at a banned position: rejected, and the recovered token is not EOS.
    row = SpecDecodeRow(req(params, num_output=1, banned=[eos]), [eos, eos, eos])
    out = rejection_sample(logits, [row], None)
    assert out.token_ids == [[2]] and out.num_accepted == [0]


@pytest.mark.parametrize("stochastic_draft", [True, False])
def test_min_tokens_bans_eos_at_early_positions_sampled(stochastic_draft):
    eos, vocab, n_rows = 5, 8, 3000
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(15))
    logits[:, eos] = 6.0  # EOS very likely where it is allowed
    params = SamplingParams(temperature=1.0, min_tokens=2, max_tokens=10)
    q = torch.full((3, vocab), 0.5 / (vocab - 1))
    q[:, eos] = 0.5
    rows = [SpecDecodeRow(req(params, num_output=0, banned=[eos]), [eos, eos, eos])] * n_rows
    out = rejection_sample(logits.repeat(n_rows, 1), rows,
                           q.repeat(n_rows, 1) if stochastic_draft else None,
                           torch.Generator().manual_seed(16))
    # Output indexes 0 and 1 are banned: draft 0 is always rejected, never emitted.
    assert out.num_accepted == [0] * n_rows
    assert all(len(t) == 1 and t[0] != eos for t in out.token_ids)
    # Past min_tokens, EOS is allowed and accepted: start at output index 2.
    rows = [SpecDecodeRow(req(params, num_output=2, banned=[eos]), [eos, eos, eos])] * 200
    out = rejection_sample(logits.repeat(200, 1), rows, None, torch.Generator().manual_seed(17))
    assert sum(out.num_accepted) > 0


# --------------------------------------------------------------------------- logprobs


def test_logprobs_are_raw_log_softmax_at_each_position():
    vocab = 40
    gen = torch.Generator().manual_seed(18)
    logits = torch.randn(4 + 1 + 4, vocab, generator=gen) * 2
    argmax = logits.argmax(-1).tolist()
    rows = [
        SpecDecodeRow(req(SamplingParams(temperature=0.0, logprobs=3)), argmax[0:2] + [0]),
        SpecDecodeRow(req(SamplingParams(temperature=0.0)), []),
        SpecDecodeRow(req(SamplingParams(temperature=0.7, top_k=5, logprobs=0), gen), [1, 2, 3]),
    ]
    out = rejection_sample(logits, rows, None)
    ref = torch.log_softmax(logits.double(), -1)
    assert out.logprobs[1] == [None]
    for b, start in [(0, 0), (2, 5)]:
        assert len(out.logprobs[b]) == len(out.token_ids[b])
        for j, (tok, lp) in enumerate(zip(out.token_ids[b], out.logprobs[b])):
            assert lp.token_id == tok
            assert abs(lp.logprob - float(ref[start + j, tok])) < 1e-5
            n = rows[b].request.params.logprobs
            assert [t for t, _ in lp.top] == torch.argsort(ref[start + j], descending=True)[
                :n].tolist()


def test_shape_errors():
    row = SpecDecodeRow(req(GREEDY), [1, 2])
    with pytest.raises(ValueError, match="target_logits"):
        rejection_sample(torch.zeros(2, 5), [row], None)
    with pytest.raises(ValueError, match="draft_probs"):
        rejection_sample(torch.zeros(3, 5), [row], torch.zeros(3, 5))
    assert rejection_sample(torch.zeros(0, 5), [], None).token_ids == []
