"""Predicted Outputs: the proposer's index against a brute-force search, its alignment after
edits, the usage counts against a dynamic-programming LCS, and the engine's output with a
prediction against plain decoding (greedy: the same tokens; sampled: the same distribution)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specserve.core.errors import InvalidRequestError
from specserve.core.sampling_params import SamplingParams, SpeculativeParams
from specserve.draft.base import FinishedSequence, ProposalRequest
from specserve.draft.prediction import PredictionIndex, PredictionProposer
from specserve.draft.registry import REGISTRY
from specserve.engine.outputs import OutputMerger
from specserve.engine.prediction_usage import PredictionUsage, lcs_length
from tests.helpers.reference import (
    chi_square,
    exact_second_token_distribution,
    hf_greedy,
    prompts,
)
from tests.helpers.speculation import make
from tests.helpers.tiny_models import BASE

# ---- references -------------------------------------------------------------------------


def reference_find(pred: list[int], suffix: list[int], at_least: int, max_n: int
                   ) -> tuple[int, int] | None:
    """Longest n first; the occurrences that leave a token after them; the first whose draft
    starts at or after ``at_least``, else the latest. Written out with loops."""
    m = len(pred)
    for n in range(min(max_n, len(suffix)), 0, -1):
        want = suffix[len(suffix) - n :]
        ends = [e for e in range(n - 1, m - 1) if pred[e - n + 1 : e + 1] == want]
        if ends:
            after = [e for e in ends if e + 1 >= at_least]
            return (after[0] if after else ends[-1]), n
    return None


def reference_lcs(a: list[int], b: list[int]) -> int:
    """The textbook O(len(a) * len(b)) dynamic programme."""
    row = [0] * (len(b) + 1)
    for x in a:
        prev_diag = 0
        for j, y in enumerate(b, 1):
            keep = row[j]
            row[j] = prev_diag + 1 if x == y else max(row[j], row[j - 1])
            prev_diag = keep
    return row[-1]


# ---- the index and the usage counts -------------------------------------------------------


def test_index_find_matches_brute_force_on_random_inputs() -> None:
    rng = random.Random(7)
    for _ in range(1500):
        alphabet = rng.randint(1, 6)
        pred = [rng.randrange(alphabet) for _ in range(rng.randint(0, 60))]
        suffix = [rng.randrange(alphabet) for _ in range(rng.randint(0, 10))]
        max_n = rng.randint(1, 8)
        at_least = rng.randint(0, len(pred) + 1)
        got = PredictionIndex(pred, max_n).find(suffix, at_least)
        assert got == reference_find(pred, suffix, at_least, max_n), (pred, suffix, at_least)


def test_lcs_matches_the_dynamic_programme() -> None:
    rng = random.Random(3)
    for _ in range(400):
        alphabet = rng.randint(1, 8)
        a = [rng.randrange(alphabet) for _ in range(rng.randint(0, 90))]
        b = [rng.randrange(alphabet) for _ in range(rng.randint(0, 90))]
        assert lcs_length(a, b) == reference_lcs(a, b), (a, b)
    usage = PredictionUsage.of([1, 2, 3, 4, 5], [1, 2, 9, 4, 5, 6])
    assert usage == PredictionUsage(accepted=4, rejected=1)


# ---- the proposer ---------------------------------------------------------------------------


def drive(pred: list[int], output: list[int], k: int = 4, prompt: list[int] | None = None
          ) -> list[list[int]]:
    """The drafts proposed before each output token arrives (one token per step)."""
    prompt = prompt if prompt is not None else [900, 901]
    prop = PredictionProposer()
    drafts = []
    for i in range(len(output) + 1):
        tokens = prompt + output[:i]
        proposal = prop.propose([ProposalRequest(0, tokens, k, len(prompt), prediction=pred)])
        drafts.append(proposal.draft_token_ids[0])
    prop.finish(FinishedSequence(0, prompt + output, len(prompt)))
    assert not prop.alignments
    return drafts


def test_aligned_output_drafts_the_rest_of_the_prediction() -> None:
    pred = list(range(10, 30))
    drafts = drive(pred, pred)
    for i, d in enumerate(drafts):
        assert d == pred[i : i + 4]


def test_a_substituted_token_resumes_right_after_it() -> None:
    pred = list(range(10, 30))
    out = pred[:6] + [99] + pred[7:]
    drafts = drive(pred, out)
    assert drafts[7] == pred[7:11]  # after the 99 that replaced pred[6]: the next ones


@pytest.mark.parametrize("edit", ["insert", "delete"])
def test_an_inserted_or_deleted_line_realigns(edit: str) -> None:
    # "lines" of 5 tokens; a line repeated further on must not pull the alignment there
    lines = [[1, 2, 3, 4, 0], [5, 6, 7, 8, 0], [40, 41, 42, 43, 0], [50, 51, 52, 53, 0],
             [5, 6, 7, 8, 0], [60, 61, 62, 63, 0]]
    pred = [t for line in lines for t in line]
    if edit == "insert":
        out = [t for line in lines[:2] + [[70, 71, 72, 73, 0]] + lines[2:] for t in line]
        resume = 15  # out index where the original text resumes: lines[2]
    else:
        out = [t for line in lines[:2] + lines[3:] for t in line]
        resume = 10  # lines[3] follows lines[1]
    drafts = drive(pred, out)
    # within a few tokens of the resumed text, every draft is the rest of the prediction
    hits = [i for i in range(resume, len(out) - 4) if drafts[i] == out[i : i + 4]]
    assert hits and hits[0] <= resume + 2, (hits, drafts)
    assert hits == list(range(hits[0], len(out) - 4))


def test_per_step_work_does_not_read_the_whole_prediction(monkeypatch) -> None:
    """A re-find is a few binary searches over the index, never a scan of the prediction: a
    million-token prediction (index built once) answers with as many searches as a 100-token
    one, each over the few occurrences of one n-gram at most."""
    import specserve.draft.prediction as mod

    rng = np.random.default_rng(0)
    small = rng.integers(0, 50, 100).tolist()
    big = small + rng.integers(0, 50, 1_000_000).tolist()
    real = np.searchsorted
    for pred in (small, big):
        index = PredictionIndex(pred, 8)
        calls = []

        def counting(a, v, side="left", calls=calls):
            calls.append(len(a))
            return real(a, v, side)

        monkeypatch.setattr(mod.np, "searchsorted", counting)
        assert index.find(small[40:48], 0) is not None
        assert index.find([77, 78, 79], 0) is None  # nothing matches: every n is tried
        monkeypatch.setattr(mod.np, "searchsorted", real)
        # 2 searches per n tried, + 1 within the occurrences of the n that matched
        assert len(calls) == 2 + 1 + 2 * 3


def test_registry_names_the_prediction_proposer() -> None:
    assert REGISTRY.prediction_method() == "prediction"
    assert "prediction" in REGISTRY.methods()


# ---- through the engine ---------------------------------------------------------------------


def edited(ref: list[int], edit: str) -> list[int]:
    """The greedy answer with one edit, as a client's stale file would differ from it."""
    if edit == "none":
        return list(ref)
    if edit == "substitute":
        return ref[:20] + [5] + ref[21:]
    if edit == "insert":
        return ref[:20] + [7, 8, 9] + ref[20:]
    return ref[:20] + ref[26:]  # delete


@pytest.fixture(scope="module")
def engine(models):
    """One engine for the module (k fixed at its k_max: whether drafts pay on a busy machine
    must not decide what these tests see)."""
    return make(models[0])


@pytest.mark.parametrize("method", [None, "prediction", "ngram"])
@pytest.mark.parametrize("edit", ["none", "substitute", "insert", "delete"])
def test_greedy_with_a_prediction_equals_plain(models, engine, method, edit):
    _, _, hf = models
    p = prompts([20], seed=3)[0]
    ref = hf_greedy(hf, p, 60)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    pred = edited(ref, edit)
    (plain,) = engine.generate([p], params, SpeculativeParams(method="off"))
    (out,) = engine.generate([p], params, SpeculativeParams(method=method, prediction=pred))
    assert plain.token_ids == out.token_ids == ref
    # the counts equal the reference LCS of the prediction and the answer
    want = reference_lcs(pred, ref)
    assert out.prediction_usage == PredictionUsage(want, len(pred) - want)
    assert plain.prediction_usage is None
    # drafts were accepted after the edit: the proposer found its place again
    assert sum(out.new_from_draft[30:]) > 0
    assert out.timings.num_accepted >= 40
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def test_adaptive_policy_and_a_batch_stay_exact(models):
    """Under the adaptive policy (k chosen from measured costs) and beside other requests
    (auto, with and without predictions), every answer is plain decoding's."""
    target, _, hf = models
    engine = make(target, adaptive_speculation=True)
    ps = prompts([20, 9, 14], seed=8)
    refs = [hf_greedy(hf, p, 40) for p in ps]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    merged: dict[str, OutputMerger] = {}
    for i, (p, ref) in enumerate(zip(ps, refs)):
        for j, spec in enumerate([SpeculativeParams("auto", prediction=edited(ref, "insert")),
                                  SpeculativeParams("auto"),
                                  SpeculativeParams(prediction=edited(ref, "delete"))]):
            engine.add_request(f"{i}-{j}", p, params, spec)
            merged[f"{i}-{j}"] = OutputMerger()
    while engine.has_unfinished():
        for out in engine.step():
            merged[out.request_id].add(out)
    for rid, m in merged.items():
        assert m.take().token_ids == refs[int(rid.split("-")[0])], rid
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def test_off_still_reports_the_counts(models, engine):
    _, _, hf = models
    p = prompts([12], seed=5)[0]
    ref = hf_greedy(hf, p, 20)
    pred = ref[:10] + [3, 4] + ref[10:15]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    (out,) = engine.generate([p], params, SpeculativeParams(method="off", prediction=pred))
    assert out.timings.num_drafted == 0 and out.token_ids == ref
    assert out.prediction_usage == PredictionUsage(15, 2)


def test_a_prediction_longer_than_the_context_is_refused(models):
    target, _, _ = models
    engine = make(target, max_model_len=64)
    p = prompts([20], seed=1)[0]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("r", p, params, SpeculativeParams(prediction=[5] * 45))
    assert err.value.param == "prediction" and "45 tokens" in err.value.message
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("r", p, params, SpeculativeParams(prediction=[10**7]))
    assert err.value.param == "prediction"
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("r", p, params, SpeculativeParams(method="prediction"))
    assert err.value.param == "speculative.method"
    assert not engine.has_unfinished()


@pytest.mark.slow
def test_sampled_distribution_with_a_prediction_equals_target(models):
    """The second token comes from a verify step whose draft is the prediction's (k = 1):
    its distribution must be the target's exact marginal."""
    target, _, hf = models
    temperature = 1.5
    prompt = torch.randperm(BASE["vocab_size"], generator=torch.Generator().manual_seed(0))
    prompt = prompt.tolist()
    expected = exact_second_token_distribution(hf, prompt, temperature)
    pred = hf_greedy(hf, prompt, 3)  # the likeliest answer: drafts are accepted, or not
    engine = make(target, max_num_seqs=256, max_num_batched_tokens=4096, num_kv_blocks=2000,
                  seed=5)
    params = SamplingParams(max_tokens=3, temperature=temperature, ignore_eos=True)
    counts = torch.zeros_like(expected)
    drafted = accepted = 0
    for _ in range(12):
        outs = engine.generate([prompt] * 250, params,
                               SpeculativeParams("prediction", 1, prediction=pred))
        for o in outs:
            counts[o.token_ids[1]] += 1
            drafted += o.timings.num_drafted
            accepted += o.timings.num_accepted
    assert drafted > counts.sum() / 2 and accepted > 0
    chi2, bound = chi_square(counts, expected)
    assert chi2 < bound, (chi2, bound)


CODE = '''def first_repeats(items):
    seen = set()
    repeats = []
    for item in items:
        if item in seen and item not in repeats:
            repeats.append(item)
        seen.add(item)
    return repeats
'''


@pytest.mark.slow
def test_default_model_code_edit_with_a_prediction_equals_plain():
    """The built-in model (its default quantized path, where speculation is bit-exact) asked
    for a code edit, the file with one change as the prediction: the answer is plain
    decoding's, drafts from the prediction are accepted, and the counts are the LCS."""
    from specserve.core.config import EngineConfig
    from specserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(kv_cache_memory=256 << 20, max_model_len=2048,
                                    adaptive_speculation=False))
    ask = ("Rename `first_repeats` to `find_repeats` in this code. Return the whole code and "
           f"nothing else.\n\n{CODE}")
    prompt = engine.render_chat([{"role": "user", "content": ask}])
    prediction = CODE.replace("def first_repeats", "def find_repeats")  # the file, one change
    params = SamplingParams(max_tokens=120, temperature=0.0)
    (plain,) = engine.generate([prompt], params, SpeculativeParams(method="off"))
    for method in (None, "prediction"):
        (out,) = engine.generate([prompt], params,
                                 SpeculativeParams(method=method, prediction=prediction))
        assert out.token_ids == plain.token_ids and out.text == plain.text
        assert out.timings.num_accepted > 0
        pred_ids = engine.encode(prediction)
        want = reference_lcs(pred_ids, out.token_ids)
        assert out.prediction_usage == PredictionUsage(want, len(pred_ids) - want)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
