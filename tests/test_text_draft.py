"""A draft model with another tokenizer (``text_draft``): greedy output identical to plain
decoding and to transformers, the sampled distribution equal to the target's, stops and UTF-8
characters split across token edges, the draft's KV following the accepted text, and how such a
draft is recognized and refused."""

from __future__ import annotations

import codecs

import pytest
import torch

from specserve.core.errors import ConfigError, InvalidRequestError, ModelLoadError
from specserve.core.sampling_params import SamplingParams, SpeculativeParams
from specserve.draft.loading import TEXT_DRAFT, open_draft
from specserve.draft.text_align import TargetText, decode, target_continuation
from specserve.draft.text_draft import TextDraftProposer
from specserve.draft.vocab_intersection import token_bytes
from tests.helpers.reference import chi_square, exact_second_token_distribution, hf_greedy
from tests.helpers.speculation import make
from tests.helpers.text_pair import (
    CYCLE,
    DRAFT_CYCLE,
    SPECIALS,
    bigram_model,
    small_bpe_tokenizer,
)
from tests.helpers.tiny_models import MARGINS, build_tiny_model, default_tokenizer, tiny_config

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target dir, draft dir, target's transformers model, target tokenizer, draft dir of a
    random draft whose attention matters): the target speaks a small BPE, the drafts the
    default model's tokenizer."""
    root = tmp_path_factory.mktemp("text_pair")
    target_tok = small_bpe_tokenizer()
    hf = bigram_model(root / "target", target_tok, CYCLE)
    bigram_model(root / "draft", default_tokenizer(), DRAFT_CYCLE, seed=1)
    tok = default_tokenizer()
    cfg = tiny_config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)
    draft_hf = build_tiny_model(root / "random_draft", cfg, init=MARGINS, tokenizer=tok, seed=3)
    return (str(root / "target"), str(root / "draft"), hf, target_tok,
            str(root / "random_draft"), draft_hf)


def _engine(pair, draft=None, **kw):
    target, bigram_draft, *_ = pair
    kw.setdefault("speculative_method", "text_draft")
    return make(target, draft_model=draft or bigram_draft, kernel_tuning=False, **kw)


def _prompts(tok) -> list[list[int]]:
    """Prompts that end at every kind of edge: a word, mid-word, and inside the emoji's and
    the CJK characters' bytes (the target's tokens split them)."""
    ids = tok(CYCLE * 3, add_special_tokens=False)["input_ids"]
    period = len(ids) // 3
    emoji = period + CYCLE.index("😀") + 2  # a token index inside the emoji's 4 bytes
    return [ids[: period + 3], ids[: period + 7], ids[: emoji], ids[: emoji + 6],
            ids[: 2 * period + 14]]


def test_text_draft_is_recognized_and_its_methods_named(pair):
    target, draft, *_ = pair
    from specserve.target.loader import read_weights

    source = open_draft(draft, read_weights(target).config)
    assert source.kind == TEXT_DRAFT
    with pytest.raises(ConfigError, match="text_draft"):
        make(target, draft_model=draft, speculative_method="draft", kernel_tuning=False)
    engine = _engine(pair)
    with pytest.raises(InvalidRequestError, match="this server's draft runs text_draft"):
        engine.generate([[5, 6]], GREEDY, SpeculativeParams("draft"))


@pytest.mark.parametrize("engine_kw", [{}, {"max_num_batched_tokens": 7},
                                       {"num_speculative_tokens": 2}])
def test_greedy_identical_to_transformers_and_plain(pair, engine_kw):
    *_, hf, tok, _, _ = pair
    engine = _engine(pair, **engine_kw)
    ps = _prompts(tok)
    outs = engine.generate(ps, GREEDY)
    plain = engine.generate(ps, GREEDY, SpeculativeParams("off"))
    for p, o, q in zip(ps, outs, plain):
        assert o.token_ids == q.token_ids == hf_greedy(hf, p, GREEDY.max_tokens)
        assert o.text == q.text
    drafted = sum(o.timings.num_drafted for o in outs)
    accepted = sum(o.timings.num_accepted for o in outs)
    # the draft follows the cycle's text except at one word: most drafts pass, some do not
    assert 0 < accepted < drafted and accepted > drafted / 3, (accepted, drafted)
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks
    proposer = engine.speculator.proposers["text_draft"]
    assert not proposer.seqs  # every sequence's draft state and blocks are back
    assert len(proposer.free_blocks) == proposer.runner.num_blocks


def test_stop_strings_across_token_edges_identical_to_plain(pair):
    *_, tok, _, _ = pair
    engine = _engine(pair)
    p = _prompts(tok)[0]
    for stop in ["中", "😀", "文*", "urn", "y\nd", "😀+中"]:
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop])
        (a,) = engine.generate([p], params, SpeculativeParams("off"))
        (b,) = engine.generate([p], params)
        assert (a.text, a.token_ids, a.finish_reason) == (b.text, b.token_ids, b.finish_reason)
        assert a.finish_reason == "stop" and stop not in a.text
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def test_draft_kv_holds_the_accepted_texts_tokens(pair, monkeypatch):
    """Each time the draft drafts, the tokens it runs on are its tokenizer's tokens of exactly
    the target's text so far (whatever was rejected before), and what it drafts from its KV
    equals transformers' greedy run of the draft model over those tokens from scratch: no
    KV of a rejected draft survives."""
    *_, tok, random_dir, draft_hf = pair
    engine = _engine(pair, draft=random_dir)
    proposer: TextDraftProposer = engine.speculator.proposers["text_draft"]
    draft_tok = proposer.draft.tokenizer
    real = proposer._run_draft
    checked = []

    def checked_run(jobs):
        contexts = [list(job.st.ids[: job.st.num_context]) for job in jobs]
        out = real(jobs)
        for ctx, tokens in zip(contexts, out):
            checked.append((ctx, tokens))
        return out

    monkeypatch.setattr(proposer, "_run_draft", checked_run)
    texts = {}
    real_propose = proposer.propose

    def propose(requests):
        for r in requests:
            full = decode(tok, r.token_ids)
            texts[len(checked)] = full.rstrip("\ufffd")
        return real_propose(requests)

    monkeypatch.setattr(proposer, "propose", propose)
    ps = _prompts(tok)[1:3]
    for p in ps:
        (out,) = engine.generate([p], GREEDY)
        assert out.timings.num_drafted > out.timings.num_accepted  # rejections happened
    assert len(checked) > 10
    for i, (ctx, tokens) in enumerate(checked):
        assert decode(draft_tok, ctx) == texts[i]
        assert tokens == hf_greedy(draft_hf, ctx, len(tokens)), i


def test_target_continuation_edges():
    """The draft's text as target tokens: the boundary token is kept only when final, the
    target's own tokens before it must be reproduced, a character the target has only begun
    is completed by the continuation."""
    tok = small_bpe_tokenizer()
    ids = tok("def(x): ret", add_special_tokens=False)["input_ids"]
    specials = frozenset(tok.all_special_ids)
    cont = target_continuation(tok, ids, "urn 😀+", final=False, special_ids=specials)
    assert decode(tok, ids + cont) == "def(x): return 😀"[: len(decode(tok, ids + cont))]
    whole = tok("def(x): return 😀+", add_special_tokens=False)["input_ids"]
    assert ids + cont == whole[: len(ids) + len(cont)] and len(cont) < len(whole) - len(ids)
    final = target_continuation(tok, ids, "urn 😀+", final=True, special_ids=specials)
    assert ids + final == whole
    emoji = tok("x 😀", add_special_tokens=False)["input_ids"]
    begun = emoji[:-2]  # the target emitted the emoji's first two bytes
    rest = target_continuation(tok, begun, "😀+", final=True, special_ids=specials)
    assert begun + rest == tok("x 😀+", add_special_tokens=False)["input_ids"]
    eos = target_continuation(tok, ids, "urn<|endoftext|>", final=False, special_ids=specials)
    assert eos[-1] == tok.eos_token_id  # a special token never merges: it stays


def test_target_text_holds_back_unfinished_characters():
    tok = small_bpe_tokenizer()
    ids = tok("ab 😀中c", add_special_tokens=False)["input_ids"]
    reader = TargetText()
    text = "".join(reader.advance(tok, ids, end) for end in range(1, len(ids) + 1))
    assert text == "ab 😀中c"
    partial = TargetText()
    first = partial.advance(tok, ids, len(ids) - 2)  # inside 中's bytes
    assert "\ufffd" not in first and "ab 😀".startswith(first)


def test_draft_without_tokenizer_is_refused(pair, tmp_path):
    target, *_ = pair
    build_tiny_model(tmp_path, tiny_config(vocab_size=301))
    with pytest.raises(ModelLoadError, match="vocabulary.*no tokenizer"):
        make(target, draft_model=str(tmp_path), kernel_tuning=False)


def test_cross_tokenizer_off_refuses_such_a_draft(pair):
    target, draft, *_ = pair
    with pytest.raises(ModelLoadError, match=r"another tokenizer.*49152 tokens.*target.s 320.*"
                                             r"--no-cross-tokenizer-draft"):
        make(target, draft_model=draft, kernel_tuning=False, cross_tokenizer_draft=False)


def test_same_size_other_ids_runs_as_text_draft(pair, tmp_path):
    """A draft tokenizer of the target's size whose ids differ (the special tokens reordered)
    is another tokenizer: it runs as a text draft, exact; refused when that is off."""
    target, *_, hf, tok, _, _ = pair
    other = small_bpe_tokenizer(SPECIALS[::-1])
    assert len(other) == len(tok) and other.get_vocab() != tok.get_vocab()
    bigram_model(tmp_path / "d", other, CYCLE, seed=2)
    engine = make(target, draft_model=str(tmp_path / "d"), kernel_tuning=False,
                  speculative_method="text_draft")
    assert engine.config.draft.kind == TEXT_DRAFT
    ps = _prompts(tok)
    outs = engine.generate(ps, GREEDY, SpeculativeParams("text_draft"))
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(hf, p, GREEDY.max_tokens)
    assert sum(o.timings.num_accepted for o in outs) > 0
    with pytest.raises(ModelLoadError, match="same size with other token ids"):
        make(target, draft_model=str(tmp_path / "d"), kernel_tuning=False,
             cross_tokenizer_draft=False)


@pytest.mark.slow
@pytest.mark.parametrize("method, rounds, seed", [("slem", 12, 5), ("tli", 6, 7)])
def test_sampled_distribution_equals_target(pair, method, rounds, seed):
    """The second token comes out of a verify step of text drafts (k = 1), drafted by string-
    level exact match or by token-level intersection; its distribution must equal the target's
    exact float64 marginal."""
    *_, hf, tok, _, _ = pair
    prompt = _prompts(tok)[0]
    temperature = 1.0
    expected = exact_second_token_distribution(hf, prompt, temperature)
    engine = _engine(pair, max_num_seqs=256, max_num_batched_tokens=4096, num_kv_blocks=3000,
                     seed=seed, cross_tokenizer_method=method)
    proposer = engine.speculator.proposers["text_draft"]
    calls: list[int] = []
    real = proposer._draw_shared
    proposer._draw_shared = lambda logits, jobs: calls.append(len(jobs)) or real(logits, jobs)
    params = SamplingParams(max_tokens=3, temperature=temperature, ignore_eos=True)
    counts = torch.zeros_like(expected)
    drafted = accepted = 0
    for _ in range(rounds):
        for o in engine.generate([prompt] * 250, params, SpeculativeParams("text_draft", 1)):
            counts[o.token_ids[1]] += 1
            drafted += o.timings.num_drafted
            accepted += o.timings.num_accepted
    if method == "tli":  # most first verifies by TLI (the rest by SLEM: inside a character)
        assert sum(calls) > counts.sum() / 2 and accepted < drafted, (accepted, drafted)
    else:
        assert not calls
    assert drafted > counts.sum() / 2 and accepted > 0
    chi2, bound = chi_square(counts, expected)
    assert chi2 < bound, (chi2, bound)


def test_auto_prices_and_picks_the_text_draft(pair, monkeypatch):
    """Under auto, the text draft is one more model proposer the policy prices (uses_model):
    with draft steps a tenth of a target step's cost, from a prompt the suffix cache has
    never seen, it drafts, and the answer stays exact."""
    from specserve.spec.policy import _LinearCost
    from tests.helpers.speculation import with_fixed_costs

    *_, hf, tok, _, _ = pair
    engine = with_fixed_costs(_engine(pair, speculative_method="auto",
                                      adaptive_speculation=True))
    engine.speculator.policy.draft_cost = _LinearCost(fixed=0.001, per_unit=0.0)
    proposer = engine.speculator.proposers["text_draft"]
    assert proposer.uses_model
    calls = []
    real = proposer.propose
    monkeypatch.setattr(proposer, "propose", lambda reqs: calls.append(len(reqs)) or real(reqs))
    p = tok(CYCLE, add_special_tokens=False)["input_ids"][:10]  # less than a cycle: no repeat
    (out,) = engine.generate([p], GREEDY)
    assert out.token_ids == hf_greedy(hf, p, GREEDY.max_tokens)
    assert calls and out.timings.num_accepted > 0


# ---- token-level intersection (TLI) and the choice of method ----------------------------------

SAMPLED = SamplingParams(max_tokens=24, temperature=0.7, top_k=50, ignore_eos=True)


def _proposals(monkeypatch, proposer):
    """Records each proposal with the requests it answered, and each TLI draw's rows."""
    # (requests, proposal, each request's tokens then: the engine's lists grow afterwards)
    seen: list[tuple[list, object, list[list[int]]]] = []
    draws: list[int] = []
    real_propose, real_draw = proposer.propose, proposer._draw_shared

    def propose(requests):
        tokens = [list(r.token_ids) for r in requests]
        out = real_propose(requests)
        seen.append((requests, out, tokens))
        return out

    def draw(logits, jobs):
        draws.append(len(jobs))
        return real_draw(logits, jobs)

    monkeypatch.setattr(proposer, "propose", propose)
    monkeypatch.setattr(proposer, "_draw_shared", draw)
    return seen, draws


def test_tli_greedy_identical_to_transformers_and_plain(pair, monkeypatch):
    """Forced TLI drafts the argmax over the shared tokens as target tokens: the answer stays
    the target's greedy one, and shared tokens the target agrees with are accepted."""
    *_, hf, tok, _, _ = pair
    engine = _engine(pair, cross_tokenizer_method="tli")
    proposer: TextDraftProposer = engine.speculator.proposers["text_draft"]
    seen, draws = _proposals(monkeypatch, proposer)
    ps = _prompts(tok)
    outs = engine.generate(ps, GREEDY)
    plain = engine.generate(ps, GREEDY, SpeculativeParams("off"))
    for p, o, q in zip(ps, outs, plain):
        assert o.token_ids == q.token_ids == hf_greedy(hf, p, GREEDY.max_tokens)
    assert draws and sum(o.timings.num_accepted for o in outs) > 0
    shared = set(proposer.shared.target_ids.tolist())
    for _, proposal, _ in seen:
        assert proposal.draft_probs is None  # greedy: the drafts are the argmax
        assert all(t in shared for d in proposal.draft_token_ids for t in d)
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks
    assert not proposer.seqs and len(proposer.free_blocks) == proposer.runner.num_blocks


def test_tli_q_is_the_drafts_processed_distribution_over_the_shared_tokens(pair, monkeypatch):
    """Each TLI draft row of a sampled request is q = the request's processing (temperature,
    top-k) of the draft model's own logits (transformers, on the draft's tokens of the text)
    at the shared tokens, 0 elsewhere; the drafted token is shared, with q > 0; the proposal
    has a row per drafted token."""
    from specserve.draft.vocab_intersection import VocabIntersection
    from tests.helpers.reference import expected_distribution

    *_, tok, random_dir, draft_hf = pair
    engine = _engine(pair, draft=random_dir, cross_tokenizer_method="tli")
    proposer: TextDraftProposer = engine.speculator.proposers["text_draft"]
    shared: VocabIntersection = proposer.shared
    jobs_of: list[dict[int, tuple[bool, list[int]]]] = []  # per propose: seq -> (tli, context)
    real_run = proposer._run_draft

    def run(jobs):
        jobs_of.append({j.seq_id: (j.tli, list(j.st.ids[: j.st.num_context])) for j in jobs})
        return real_run(jobs)

    monkeypatch.setattr(proposer, "_run_draft", run)
    seen, draws = _proposals(monkeypatch, proposer)
    outs = engine.generate(_prompts(tok)[:2], SAMPLED)
    assert draws and all(o.timings.num_drafted > 0 for o in outs)
    assert len(jobs_of) == len(seen)
    checked = 0
    outside = torch.ones(len(tok), dtype=torch.bool)
    outside[shared.target_ids] = False
    for (requests, proposal, _), jobs in zip(seen, jobs_of):
        drafts = proposal.draft_token_ids
        if not any(drafts):
            continue
        q = proposal.draft_probs
        assert q is not None and q.shape == (sum(map(len, drafts)), len(tok))
        assert torch.allclose(q.sum(-1), torch.ones(len(q)), atol=1e-5)
        row = 0
        for r, d in zip(requests, drafts):
            rows = q[row : row + len(d)]
            row += len(d)
            if not d:
                continue
            tli, ctx = jobs[r.seq_id]
            if not tli:  # the target stopped inside a character: SLEM, one-hot
                assert all(rows[n, t] == 1.0 for n, t in enumerate(d))
                continue
            assert float(rows[:, outside].abs().max()) == 0.0
            for n, t in enumerate(d):
                assert not outside[t] and rows[n, t] > 0
            with torch.no_grad():
                logits = draft_hf(torch.tensor([ctx])).logits[0, -1]
            ref = torch.zeros(len(tok), dtype=torch.float64)
            ref[shared.target_ids] = expected_distribution(
                logits[shared.draft_ids], SAMPLED.temperature, SAMPLED.top_k, 1.0)
            assert torch.allclose(rows[0].double(), ref, atol=1e-4), float(
                (rows[0].double() - ref).abs().max())
            checked += 1
    assert checked > 5


def _inside_a_character(target_bytes: dict[int, bytes], ids) -> bool:
    """Whether the tokens' bytes end with an unfinished UTF-8 character (a reference apart
    from the tokenizer's decode)."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(b"".join(target_bytes[i] for i in ids))
    return bool(decoder.getstate()[0])


def test_method_choice(pair, monkeypatch):
    """slem never draws from the shared tokens' q (no q rows at all); tli draws for greedy and
    sampled requests, except for a sampled request the target left inside a character: that
    step it drafts by SLEM, in the same proposal as TLI rows, with one-hot rows; auto runs
    AUTO_GREEDY's method for greedy requests and AUTO_SAMPLED's for sampled ones."""
    from specserve.draft.base import DraftSampling
    from specserve.draft.text_draft import AUTO_GREEDY, AUTO_SAMPLED, TLI

    *_, hf, tok, _, _ = pair
    target_bytes = token_bytes(tok)
    ids = tok(CYCLE * 3, add_special_tokens=False)["input_ids"]
    period = len(ids) // 3
    inside = next(n for n in range(period, len(ids)) if _inside_a_character(target_bytes, ids[:n]))
    ps = [_prompts(tok)[0], ids[:inside]]  # at a word's end; inside the emoji's bytes
    assert len(ps[0]) != len(ps[1])
    engine = _engine(pair, cross_tokenizer_method="slem")
    proposer = engine.speculator.proposers["text_draft"]
    seen, draws = _proposals(monkeypatch, proposer)
    outs = engine.generate(ps, SAMPLED)
    assert sum(o.timings.num_drafted for o in outs) > 0
    assert not draws and all(p.draft_probs is None for _, p, _ in seen)

    engine = _engine(pair, cross_tokenizer_method="tli")
    proposer = engine.speculator.proposers["text_draft"]
    seen, draws = _proposals(monkeypatch, proposer)
    (out,) = engine.generate(ps[:1], GREEDY)
    assert draws and out.token_ids == hf_greedy(hf, ps[0], GREEDY.max_tokens)
    draws.clear()
    ran: list[dict[int, bool]] = []  # per propose: seq -> drafted by TLI
    real_run = proposer._run_draft
    monkeypatch.setattr(proposer, "_run_draft", lambda jobs: ran.append(
        {j.seq_id: j.tli for j in jobs}) or real_run(jobs))
    seen.clear()
    engine.generate(ps, SAMPLED)
    assert draws and len(ran) == len(seen)
    for r in seen[0][0]:  # the first step: the prompt inside the emoji by SLEM, the other TLI
        assert ran[0][r.seq_id] == (r.num_prompt_tokens == len(ps[0]))
    outside = torch.ones(len(tok), dtype=torch.bool)
    outside[proposer.shared.target_ids] = False
    mixed = 0
    for (requests, proposal, tokens), tli in zip(seen, ran):
        if proposal.draft_probs is None:
            continue
        row = 0
        kinds = set()
        for r, ids, d in zip(requests, tokens, proposal.draft_token_ids):
            rows = proposal.draft_probs[row : row + len(d)]
            row += len(d)
            if not d:
                continue
            kinds.add(tli[r.seq_id])
            if not tli[r.seq_id]:  # SLEM: one-hot rows, and only while the text is unfinished
                assert all(rows[n, t] == 1.0 for n, t in enumerate(d)) and rows.sum() == len(d)
                assert decode(tok, ids).endswith("\ufffd")
            else:
                assert float(rows[:, outside].abs().max()) == 0.0
        assert row == len(proposal.draft_probs)
        mixed += kinds == {True, False}
    assert mixed

    engine = _engine(pair)
    assert engine.config.cross_tokenizer_method == "auto"
    proposer = engine.speculator.proposers["text_draft"]
    assert proposer.method_for(DraftSampling(True)) == AUTO_GREEDY
    assert proposer.method_for(DraftSampling(False)) == AUTO_SAMPLED
    seen, draws = _proposals(monkeypatch, proposer)
    outs = engine.generate(ps, [GREEDY, SAMPLED])
    assert outs[0].token_ids == hf_greedy(hf, ps[0], GREEDY.max_tokens)
    assert sum(o.timings.num_drafted for o in outs) > 0
    assert bool(draws) == (TLI in (AUTO_GREEDY, AUTO_SAMPLED))


def test_invalid_cross_tokenizer_method_is_a_config_error(pair):
    target, draft, *_ = pair
    with pytest.raises(ConfigError, match="cross-tokenizer-method must be auto, slem or tli"):
        make(target, draft_model=draft, kernel_tuning=False, cross_tokenizer_method="exact")
