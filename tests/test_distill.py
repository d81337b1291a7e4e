"""`specserve distill` on tiny random models: the KL loss falls, the written folder loads as a
draft whose greedy output equals transformers' on the target, an interrupted run resumes to the
same weights, a reduced-head draft keeps sampling exact, and mismatched drafts are refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specserve.cli import main as cli_main
from specserve.core.errors import ModelLoadError
from specserve.core.sampling_params import SamplingParams, SpeculativeParams
from specserve.distill.data import Prompt, TeacherData
from specserve.distill.evaluate import EvalConfig, measure, paired_speedup, run_eval
from specserve.distill.run import DistillConfig, run_distill
from specserve.distill.student import StudentSpec, build_student, choose_head_vocab, save_student
from specserve.distill.train import TrainConfig, evaluate, head_lookup, make_batches
from specserve.engine.llm_engine import LLMEngine
from specserve.target.loader import load_weights
from tests.helpers.reference import chi_square, exact_second_token_distribution, hf_greedy
from tests.helpers.speculation import make
from tests.helpers.tiny_models import BASE, build_tiny_model, tiny_config


@pytest.fixture(scope="module")
def text_target(text_model):
    """The tiny random Llama with the default model's tokenizer (and its chat template), plus
    the same weights in transformers for reference outputs."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(text_model).float().eval()
    hf.generation_config.eos_token_id = None  # generate exactly max_new_tokens
    hf.generation_config.pad_token_id = 0
    return Path(text_model), hf, None


def write_prompts(path: Path) -> Path:
    words = ["rain", "bread", "a lighthouse", "trains", "owls", "glaciers", "chess", "tea"]
    items = [Prompt(f"p{i}", "chat", "heldout" if i >= 14 else "train",
                    f"Tell me something about {words[i % len(words)]} ({i}).")
             for i in range(16)]
    path.write_text(json.dumps([p.__dict__ for p in items]))
    return path


TINY_TRAIN = TrainConfig(steps=60, lr=5e-3, warmup_steps=2, batch_tokens=256, max_len=64,
                         checkpoint_every=10, eval_every=1000)


def tiny_distill(target: Path, out: Path, prompts: Path, **train_kw) -> Path | None:
    return run_distill(DistillConfig(
        out=out, target=str(target), prompts=prompts, max_new_tokens=24, gen_batch=8,
        num_heldout=2, student=StudentSpec(num_layers=1, init_layers=(0,), head_vocab_size=512),
        train=TrainConfig(**{**TINY_TRAIN.__dict__, **train_kw}),
    ))


@pytest.mark.slow
def test_distill_lowers_kl_and_writes_a_draft_that_loads(text_target, tmp_path):
    target, hf, _ = text_target
    prompts = write_prompts(tmp_path / "prompts.json")
    draft_dir = tiny_distill(target, tmp_path / "run", prompts)
    assert draft_dir is not None
    data = TeacherData.load_dir(tmp_path / "run" / "data" / "train")
    assert len(data) == 14 and data.num_response_tokens > 14 * 5
    for tokens, p, top in zip(data.tokens, data.prompt_lens, data.top_ids):
        # the recorded teacher distribution is the one its own (greedy) token came from
        assert torch.equal(top[:, 0], tokens[p:].to(top.dtype))

    # KL before (the student as initialized) vs after training, on the training batches
    hf_config, state = load_weights(target)
    vocab = hf_config.vocab_size
    card = json.loads((draft_dir / "card.json").read_text())
    head = choose_head_vocab([t[p:] for t, p in zip(data.tokens, data.prompt_lens)],
                             data.top_ids, vocab, 512)
    fresh = build_student(hf_config, state, StudentSpec(1, (0,), 512), head)
    batches = make_batches(data, head_lookup(head, vocab), TINY_TRAIN, seed=0)
    before = evaluate(fresh, batches)
    trained = build_student(hf_config, state, StudentSpec(1, (0,), 512), head)
    ckpt = torch.load(tmp_path / "run" / "checkpoint.pt", weights_only=False)
    trained.load_state_dict(ckpt["student"], strict=False)
    after = evaluate(trained, batches)
    assert ckpt["step"] == TINY_TRAIN.steps
    assert after.kl < 0.8 * before.kl and after.agree > before.agree, (before, after)
    assert "top-1 agreement" in card["held_out"]

    # the folder loads as a draft: no embedding weights stored, a 512-row head, exact output
    from safetensors.torch import load_file

    stored = load_file(draft_dir / "model.safetensors")
    assert not any("embed_tokens" in k for k in stored)
    assert stored["lm_head.weight"].shape == (512, 32)
    engine = make(str(target), draft_model=str(draft_dir), num_kv_blocks=300)
    prompt = data.tokens[0][: data.prompt_lens[0]].tolist()
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    (out,) = engine.generate([prompt], params, SpeculativeParams("draft", 3))
    assert out.timings.num_drafted > 0
    assert out.token_ids == hf_greedy(hf, prompt, 12)
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks

    # --eval measures acceptance through the engine and writes it into the card
    cfg = EvalConfig(draft=str(draft_dir), target=str(target), prompts=prompts, num_prompts=2,
                     max_tokens=8, ks=[1, 3], temperatures=[0.0, 0.7])
    clock = StepClock()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LLMEngine, "step", clock.wrap(LLMEngine.step))
        rows, cost = measure(cfg, clock=clock)
    assert [(r.temperature, r.k) for r in rows] == [(0.0, 1), (0.0, 3), (0.7, 1), (0.7, 3)]
    for r in rows:
        assert 0.0 <= r.acceptance <= 1.0 and 1.0 <= r.mean_accepted_length <= r.k + 1
        assert r.tokens == 2 * 8
        if r.temperature == 0.0:
            # same greedy tokens as the paired plain run; timed in engine steps, speculation
            # saves at most k of every k + 1 steps, so the engine's one-off first step must
            # not land on one side only
            assert r.plain_tokens == r.tokens and r.greedy_mismatches == 0
            assert 1.0 <= r.measured_speedup <= r.k + 1
    assert 0 < cost < 2  # one draft layer vs two target layers, both tiny
    table = run_eval(cfg)
    assert "| 3 |" in table and table in (draft_dir / "README.md").read_text()
    assert json.loads((draft_dir / "card.json").read_text())["acceptance"] == table


class StepClock:
    """A clock that counts engine steps (one unit each), charging the engine's first step as
    a one-off start-up cost (as a real first step pays for allocations and caches)."""

    def __init__(self, one_off: float = 1e6) -> None:
        self.now, self.one_off = 0.0, one_off

    def __call__(self) -> float:
        return self.now

    def wrap(self, step):
        def counted(engine):
            self.now += 1.0 + self.one_off
            self.one_off = 0.0
            return step(engine)
        return counted


def test_paired_speedup_is_tokens_per_second_of_runs_timed_back_to_back():
    """A machine whose load drops 10x after a slow start: each speculative run is compared with
    the plain run just before it, so the ratio is that of the per-token costs (2x here)."""
    from types import SimpleNamespace

    clock = StepClock(one_off=0.0)
    cost = [10.0]  # per token, falls to 1 after the first pair

    def runner(factor: float, tokens: int):
        def run() -> list:
            clock.now += cost[0] * factor * tokens
            return [SimpleNamespace(num_output_tokens=tokens)]
        return run

    first, base, spec = paired_speedup(runner(1.0, 64), runner(0.5, 64), clock)
    cost[0] = 1.0
    second, _, _ = paired_speedup(runner(1.0, 64), runner(0.5, 64), clock)
    assert first == second == pytest.approx(2.0)
    assert base.tokens == spec.tokens == 64 and base.seconds == 2 * spec.seconds
    # a run that stops early is not faster: tokens per second, not wall time, are compared
    assert paired_speedup(runner(1.0, 64), runner(1.0, 16), clock)[0] == pytest.approx(1.0)
    with pytest.raises(RuntimeError, match="nothing to time"):
        paired_speedup(runner(1.0, 64), lambda: [], clock)


@pytest.mark.slow
def test_interrupted_training_resumes_to_the_same_weights(text_target, tmp_path):
    target, _, _ = text_target
    prompts = write_prompts(tmp_path / "prompts.json")
    tiny_distill(target, tmp_path / "a", prompts, steps=12, checkpoint_every=4)
    # the same run stopped by its time budget after its first step, then resumed
    stopped = tiny_distill(target, tmp_path / "b", prompts, steps=12, checkpoint_every=4,
                           max_minutes=1e-9)
    assert stopped is not None
    assert torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)["step"] == 1
    tiny_distill(target, tmp_path / "b", prompts, steps=12, checkpoint_every=4)
    a = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)
    b = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=False)
    assert a["step"] == b["step"] == 12
    for name, tensor in a["student"].items():
        torch.testing.assert_close(b["student"][name], tensor, rtol=1e-4, atol=1e-5)

    with pytest.raises(ValueError, match="other training settings"):
        tiny_distill(target, tmp_path / "b", prompts, steps=12, lr=1e-2)


@pytest.fixture(scope="module")
def small_vocab_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("small_vocab_target")
    hf = build_tiny_model(path, tiny_config(max_position_embeddings=512))
    return path, hf


def reduced_head_draft(target: Path, out: Path, head_size: int) -> Path:
    """A 1-layer student of ``target`` with a head over ``head_size`` tokens, untrained."""
    hf_config, state = load_weights(target)
    head = torch.arange(0, BASE["vocab_size"], BASE["vocab_size"] // head_size)[:head_size]
    student = build_student(hf_config, state, StudentSpec(1, (0,), head_size), head)
    save_student(student, hf_config, out, tokenizer=None, card={"target": "tiny"},
                 spec=StudentSpec(1, (0,), head_size))
    return out


@pytest.mark.slow
def test_reduced_head_draft_keeps_sampling_exact(small_vocab_target, tmp_path):
    """The draft never proposes tokens outside its head (q = 0 there); the residual
    distribution must still give the target's exact marginal for the verified token."""
    target, hf = small_vocab_target
    draft = reduced_head_draft(target, tmp_path / "draft", head_size=60)
    temperature = 1.5
    prompt = torch.randperm(BASE["vocab_size"], generator=torch.Generator().manual_seed(0))
    prompt = prompt[:40].tolist()
    expected = exact_second_token_distribution(hf, prompt, temperature)
    engine = make(str(target), draft_model=str(draft), max_num_seqs=256,
                  max_num_batched_tokens=4096, num_kv_blocks=3000, seed=3)
    params = SamplingParams(max_tokens=3, temperature=temperature, ignore_eos=True)
    counts = torch.zeros_like(expected)
    drafted = 0
    for _ in range(10):
        for o in engine.generate([prompt] * 250, params, SpeculativeParams("draft", 1)):
            counts[o.token_ids[1]] += 1
            drafted += o.timings.num_drafted
            assert all(t in range(BASE["vocab_size"]) for t in o.token_ids)
    assert drafted > counts.sum() / 2
    # the head misses most of the vocabulary, yet those tokens still occur as often as they must
    outside = torch.ones_like(expected, dtype=torch.bool)
    outside[torch.arange(0, BASE["vocab_size"], 5)] = False
    assert counts[outside].sum() > 0
    chi2, bound = chi_square(counts, expected)
    assert chi2 < bound, (chi2, bound)


def test_draft_for_another_target_is_refused(small_vocab_target, text_target, tmp_path):
    target, _ = small_vocab_target
    other_target, _, _ = text_target
    draft = reduced_head_draft(target, tmp_path / "draft", head_size=30)
    with pytest.raises(ModelLoadError, match="vocabulary"):
        make(str(other_target), draft_model=str(draft))
    with pytest.raises(ModelLoadError, match="shares its target's embeddings"):
        make(str(draft))


def test_distill_cli_errors_are_one_line(capsys):
    assert cli_main(["distill"]) == 2
    assert "error: distill needs --out DIR" in capsys.readouterr().err
    assert cli_main(["distill", "--eval"]) == 2
    assert "error: --eval needs --draft DIR" in capsys.readouterr().err
    assert cli_main(["distill", "--out", "x", "--init-layers", "a,b"]) == 2
    assert "--init-layers takes comma-separated integers" in capsys.readouterr().err


def test_default_draft_resolution(tmp_path):
    from specserve.engine.models import DEFAULT_DRAFT_DIR, resolve_draft

    assert (DEFAULT_DRAFT_DIR / "config.json").is_file()  # the distilled draft ships in the repo
    assert resolve_draft(None, None) == str(DEFAULT_DRAFT_DIR)
    assert resolve_draft("default", None) == str(DEFAULT_DRAFT_DIR)
    assert resolve_draft(None, "none") is None
    assert resolve_draft(str(tmp_path), None) is None  # another target: no default draft
    assert resolve_draft(str(tmp_path), "x/y") == "x/y"
