"""EAGLE head: the training forward equals the engine's paged drafting chain, the engine's
captured target features equal transformers' hidden states, greedy output with the head equals
transformers' greedy generate() (batching, chunked prefill, preemption, prefix caching), the
sampled distribution equals the target's (chi-square), a head trained on a target's own output
drafts better, as the trainer estimates, and the CLI trains from tokens-only shards, resumes and
evaluates."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest
import torch

from specserve.core.config import EngineConfig
from specserve.core.errors import ConfigError
from specserve.core.sampling_params import SamplingParams, SpeculativeParams
from specserve.distill.data import TeacherData
from specserve.distill.eagle_build import build_head, save_head
from specserve.distill.eagle_train import Batch, EagleTrainConfig, Teacher, train_head
from specserve.distill.eagle_ttt import ttt_forward
from specserve.draft.eagle_head import EagleRunner, default_target_layers
from specserve.engine.llm_engine import LLMEngine
from specserve.kernels.metadata import AttentionMetadata, token_positions
from specserve.kernels.registry import get_attention_backend
from specserve.target.loader import load_weights
from specserve.target.model import FeatureCapture
from tests.helpers.reference import (
    chi_square,
    exact_second_token_distribution,
    hf_greedy,
    prompts,
)
from tests.helpers.tiny_models import BASE, build_tiny_model, tiny_config

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny 4-layer target (so low, middle and high layers differ) and a head for it whose
    weights are the initialization plus noise (it drafts, and is often wrong)."""
    path = tmp_path_factory.mktemp("eagle_target")
    hf = build_tiny_model(path, tiny_config(max_position_embeddings=512, num_hidden_layers=4))
    head_dir = tmp_path_factory.mktemp("eagle_head")
    head = noisy_head(path)
    save_head(head, load_weights(path)[0], head_dir, {"target": "tiny"})
    return str(path), str(head_dir), hf


def noisy_head(path, layers=None):
    hf_config, state = load_weights(path)
    layers = layers or default_target_layers(hf_config.num_hidden_layers)
    head = build_head(hf_config, state, torch.arange(0, hf_config.vocab_size, 2), layers)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return head


def make(path, head, **kw) -> LLMEngine:
    cfg = dict(model=path, draft_model=head, dtype="float32", block_size=4, num_kv_blocks=400,
               adaptive_speculation=False, num_speculative_tokens=4)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def test_training_forward_equals_the_engines_drafting_chain(target):
    """TTT step j at position p must compute what the engine's paged chain computes for the
    j-th draft of a chain started at p - j; and the target features the engine captures must
    be the hidden states the trainer reads from transformers."""
    path, _, _ = target
    hf_config, state = load_weights(path)
    head = noisy_head(path).requires_grad_(False)
    ids = torch.tensor(prompts([14], seed=4)[0])
    L = len(ids)
    teacher = Teacher(hf_config, state, head, torch.device("cpu"))
    feats, _ = teacher(Batch(ids[None], torch.tensor([L]), torch.tensor([1])))
    engine = LLMEngine(EngineConfig(model=path, dtype="float32", block_size=4, num_kv_blocks=200))
    meta = AttentionMetadata.build([L], [L], [list(range(4))], 4, engine.device)
    capture = FeatureCapture(head.meta.target_layers, torch.arange(L))
    engine.runner.forward(ids, torch.arange(L), meta, torch.tensor([L - 1]), capture=capture)
    assert torch.allclose(capture.out, feats[0], atol=1e-5)

    with torch.no_grad():
        outs = ttt_forward(head, ids[None], feats, steps=3)
    runner = EagleRunner(head, num_blocks=16, block_size=4, dtype=torch.float32,
                         device=torch.device("cpu"), backend=get_attention_backend("torch", "cpu"))
    g = torch.cat([torch.zeros((1, head.config.hidden_size)), head.fuse(feats[0])[:-1]])
    for s in (0, 5, 10):
        # step 0 over positions 0..s with target features, then two chained steps
        meta = AttentionMetadata.build([s + 1], [s + 1], [list(range(16))], 4, "cpu")
        out = runner.step(ids[: s + 1], g[: s + 1], token_positions([s + 1], [s + 1]), meta)
        prev = out[-1:]
        assert torch.allclose(prev, outs[0][0, s : s + 1], atol=1e-4)
        for j in (1, 2):
            meta = AttentionMetadata.build([1], [s + j + 1], [list(range(16))], 4, "cpu")
            prev = runner.step(ids[s + j : s + j + 1], prev, torch.tensor([s + j]), meta)
            assert torch.allclose(prev, outs[j][0, s + j : s + j + 1], atol=1e-4), (s, j)


@pytest.mark.parametrize("engine_kw", [{}, {"max_num_batched_tokens": 9},
                                       {"num_kv_blocks": 30, "max_model_len": 100},
                                       {"enable_prefix_caching": True},
                                       {"speculative_method": "auto"}])
def test_eagle_greedy_identical_to_transformers(target, engine_kw):
    path, head, hf = target
    engine = make(path, head, **engine_kw)
    # detected from the folder (auto may pick the head too)
    assert engine.config.default_speculative_method == engine_kw.get("speculative_method",
                                                                     "eagle")
    base = prompts([3, 11, 29, 50], seed=2)
    batch = base + [base[3][:40] + base[0]]  # shares full blocks with prompt 3
    outs = engine.generate(batch, GREEDY)
    for p, out in zip(batch, outs):
        assert out.token_ids == hf_greedy(hf, p, GREEDY.max_tokens)
    assert sum(o.timings.num_drafted for o in outs) > 0
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks
    assert not engine.speculator.proposers["eagle"].features  # nothing kept after the end


def test_quantized_target_runs_a_quantized_head_and_stays_lossless(target):
    """A block-quantized target (int8, the fused C++ layers): the head's projections become Q8_0
    blocks too and its layer runs the fused path; the target's features come from its decoder
    stack split after the captured layers, equal to the per-layer path's bit for bit; greedy
    output with the head equals the same engine's plain decoding."""
    from specserve.kernels import quant_ext
    from specserve.kernels.quant import BlockQuantLinear

    path, head, _ = target
    engine = make(path, head, quantization="int8", attention_backend="auto")
    eagle = engine.speculator.proposers["eagle"]
    projections = [eagle.head.fc, eagle.head.lm_head,
                   eagle.head.layer.self_attn.qkv_proj, eagle.head.layer.mlp.down_proj]
    assert all(isinstance(m, BlockQuantLinear) and m.fmt == "q8_0" for m in projections)
    if quant_ext.available():
        assert eagle.head.layer.self_attn.fused is not None

        model, layers = engine.runner.model, eagle.target_layers
        ids = torch.tensor(prompts([14], seed=4)[0])
        L = len(ids)

        def features() -> torch.Tensor:
            meta = AttentionMetadata.build([L], [L], [list(range(4))], 4, engine.device)
            capture = FeatureCapture(layers, torch.arange(L))
            engine.runner.forward(ids, torch.arange(L), meta, torch.tensor([L - 1]),
                                  capture=capture)
            return capture.out

        split = features()
        assert model._segments.get(tuple(layers)) is not None  # the stack ran, in segments
        model.use_decoder_stack = False
        per_layer = features()
        model.use_decoder_stack = True
        assert torch.equal(split, per_layer)
    base = prompts([3, 11, 29, 50], seed=2)
    plain = engine.generate(base, GREEDY, SpeculativeParams("off"))
    outs = engine.generate(base, GREEDY, SpeculativeParams("eagle", 4))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert sum(o.timings.num_drafted for o in outs) > 0
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def test_prefix_hits_from_plain_requests_do_not_starve_the_head_of_features(target):
    """A plain request fills the prefix cache with target KV only; the head's KV for those
    blocks can be rebuilt only from the target's hidden states, which a prefix hit skips. So an
    EAGLE request stops its hit at such blocks and drafts exactly as on a cold cache; a later
    EAGLE request does hit the blocks the first one wrote."""
    path, head, hf = target
    prompt = prompts([50], seed=7)[0]
    spec = SpeculativeParams("eagle", 4)
    cold = make(path, head, enable_prefix_caching=False).generate([prompt], GREEDY, spec)[0]
    engine = make(path, head, enable_prefix_caching=True)
    engine.generate([prompt], GREEDY, SpeculativeParams("off"))
    bm = engine.block_manager
    hits_before = bm.prefix_hits
    warm = engine.generate([prompt], GREEDY, spec)[0]
    assert bm.prefix_hits == hits_before  # no hit on blocks without the head's KV
    assert warm.token_ids == cold.token_ids == hf_greedy(hf, prompt, GREEDY.max_tokens)
    assert warm.new_from_draft == cold.new_from_draft  # the same drafts, accepted alike
    again = engine.generate([prompt], GREEDY, spec)[0]
    assert bm.prefix_hits > hits_before and again.token_ids == cold.token_ids


@pytest.mark.slow
def test_unused_eagle_head_allocates_no_kv(target):
    """Requests with speculation off never run the head, so its KV pool is never allocated;
    the first request that drafts with it allocates it, and greedy output stays plain."""
    path, head, hf = target
    engine = make(path, head)
    runner = engine.speculator.proposers["eagle"].runner
    base = prompts([7, 20], seed=5)
    off = engine.generate(base, GREEDY, SpeculativeParams(method="off"))
    assert all(o.timings.num_drafted == 0 for o in off) and not runner.kv_allocated
    outs = engine.generate(base, GREEDY, SpeculativeParams(method="eagle"))
    assert sum(o.timings.num_drafted for o in outs) > 0 and runner.kv_allocated
    for p, o, out in zip(base, off, outs):
        assert o.token_ids == out.token_ids == hf_greedy(hf, p, GREEDY.max_tokens)


def test_sampled_distribution_equals_target_with_eagle(target):
    """The second token comes out of a k = 1 verify step: its distribution must equal the
    target's exact float64 marginal."""
    path, head, hf = target
    temperature = 1.5
    prompt = torch.randperm(BASE["vocab_size"], generator=torch.Generator().manual_seed(0))
    prompt = prompt.tolist()
    expected = exact_second_token_distribution(hf, prompt, temperature)
    engine = make(path, head, max_num_seqs=256, max_num_batched_tokens=4096, num_kv_blocks=2000,
                  seed=5)
    params = SamplingParams(max_tokens=3, temperature=temperature, ignore_eos=True)
    counts = torch.zeros_like(expected)
    drafted = 0
    for _ in range(12):
        for o in engine.generate([prompt] * 250, params, SpeculativeParams("eagle", 1)):
            counts[o.token_ids[1]] += 1
            drafted += o.timings.num_drafted
    assert drafted > counts.sum() / 2
    chi2, bound = chi_square(counts, expected)
    assert chi2 < bound, (chi2, bound)


def teacher_data(path, n: int, plen: int, new: int, seed: int) -> TeacherData:
    """Greedy continuations of random prompts by the target itself (tokens only)."""
    engine = LLMEngine(EngineConfig(model=path, dtype="float32", block_size=4,
                                    num_kv_blocks=2000, max_num_seqs=64))
    ps = prompts([plen] * n, seed=seed)
    outs = engine.generate(ps, SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True))
    return TeacherData(tokens=[torch.tensor(p + o.token_ids, dtype=torch.int32)
                               for p, o in zip(ps, outs)],
                       prompt_lens=[plen] * n, ids=[str(i) for i in range(n)])


@pytest.mark.slow
def test_head_trained_on_the_targets_output_drafts_better_and_as_estimated(tmp_path):
    """A one-layer target and a head (EAGLE-3: q/k/v read the token's embedding, the residual
    is the previous position's target state, so no exact imitation exists) starting from a
    noisy copy of the target's layer learns the target's own greedy output: the trainer's
    held-out estimate of tokens per verify rises, and drafting through the engine gets what
    that estimate says, on held-out prompts and above the untrained estimate on trained ones
    (the training forward and the engine's chain are the same computation)."""
    path = tmp_path / "target"
    hf = build_tiny_model(path, tiny_config(max_position_embeddings=512, num_hidden_layers=1))
    with torch.no_grad():  # a peaked target distribution: clear margins to learn
        hf.lm_head.weight.mul_(4)
    hf.save_pretrained(path)
    hf_config, state = load_weights(path)
    head = build_head(hf_config, state, torch.arange(hf_config.vocab_size), (0,))
    torch.manual_seed(0)
    with torch.no_grad():
        for p in head.layer.parameters():
            p.add_(0.03 * torch.randn_like(p))
    train = teacher_data(str(path), 160, 8, 40, seed=3)
    val = teacher_data(str(path), 16, 8, 40, seed=4)
    cfg = EagleTrainConfig(steps=160, lr=2e-3, warmup_steps=10, batch_tokens=2048,
                           eval_every=1000, checkpoint_every=1000, feature_noise=0.0)
    teacher = Teacher(hf_config, state, head, torch.device("cpu"))
    _, before = train_head(head, teacher, train, val, replace(cfg, steps=0), tmp_path / "a.pt")
    _, after = train_head(head, teacher, train, val, cfg, tmp_path / "ck.pt")
    assert before is not None and after is not None
    # float32: the tiny target's margins are narrower than bfloat16 rounding of the weights
    save_head(head, hf_config, tmp_path / "head", {}, dtype=torch.float32)
    engine = make(str(path), str(tmp_path / "head"))
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)

    def tokens_per_verify(ps: list[list[int]]) -> float:
        outs = engine.generate(ps, greedy, SpeculativeParams("eagle", 3))
        for p, o in zip(ps, outs):
            assert o.token_ids == hf_greedy(hf, p, 40)
        accepted = sum(o.timings.num_accepted for o in outs)
        steps = sum(o.timings.num_verify_steps for o in outs)
        return (accepted + steps) / steps

    trained = tokens_per_verify([t[:8].tolist() for t in train.tokens[:16]])
    heldout = tokens_per_verify(prompts([8] * 16, seed=4))
    assert after.agree[0] > before.agree[0] + 0.05  # measured 0.075 -> 0.147
    assert after.tokens_per_verify > before.tokens_per_verify + 0.08  # 1.13 -> 1.25
    assert trained > before.tokens_per_verify + 0.08  # measured 1.33
    assert abs(heldout - after.tokens_per_verify) < 0.15  # measured 1.15 vs 1.25


@pytest.mark.slow
def test_cli_trains_from_tokens_only_shards_resumes_and_evaluates(text_model, tmp_path):
    from specserve.distill.cli import add_distill_parser, cmd_distill

    data = teacher_data(text_model, 24, 10, 24, seed=7)
    shards = tmp_path / "shards"
    shards.mkdir()
    data.save(shards / "shard-00000.pt")  # top_ids / top_logprobs empty: tokens only
    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps([
        {"id": f"h{i}", "category": "chat", "split": "heldout", "prompt": f"Tell me about {w}."}
        for i, w in enumerate(["owls", "tea"])]))
    parser = argparse.ArgumentParser()
    add_distill_parser(parser.add_subparsers(dest="cmd"))
    out = tmp_path / "run"
    common = ["distill", "--method", "eagle", "--target", text_model, "--out", str(out),
              "--data", str(shards), "--head-vocab", "256", "--batch-tokens", "256",
              "--checkpoint-every", "2", "--eval-every", "2"]
    with pytest.raises(ConfigError):
        cmd_distill(parser.parse_args([*common[:-8], "--data", str(tmp_path / "none")]))
    assert cmd_distill(parser.parse_args([*common, "--steps", "4", "--max-minutes", "1e-9"])) == 0
    assert torch.load(out / "eagle_checkpoint.pt", weights_only=False)["step"] == 1
    assert cmd_distill(parser.parse_args([*common, "--steps", "4"])) == 0
    assert torch.load(out / "eagle_checkpoint.pt", weights_only=False)["step"] == 4
    assert len((out / "eagle_curve.jsonl").read_text().splitlines()) >= 2
    card = json.loads((out / "eagle" / "card.json").read_text())
    assert "0 bytes per token" in card["feature_storage"]
    args = parser.parse_args(["distill", "--method", "eagle", "--eval", "--target", text_model,
                              "--out", str(out), "--prompts", str(prompts_file),
                              "--eval-prompts", "2", "--eval-tokens", "6", "--ks", "1,3"])
    assert cmd_distill(args) == 0
    table = json.loads((out / "eagle" / "card.json").read_text())["acceptance"]
    assert "| 3 |" in table and "predicted" in table


def test_a_head_folder_is_not_a_draft_model(target):
    path, head, _ = target
    with pytest.raises(ConfigError, match="--speculative-method eagle"):
        make(path, head, speculative_method="draft")
    with pytest.raises(ConfigError, match="head folder"):
        make(path, "none", speculative_method="eagle")
