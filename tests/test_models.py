"""Our CausalLM against transformers: tiny random models of every family saved with
save_pretrained, loaded through specserve.target.loader, run over a paged KV cache (block size 4,
shuffled block ids) in flattened mixed batches; every logits row must match transformers'
forward."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve.kernels.metadata import AttentionMetadata
from specserve.kernels.registry import get_attention_backend
from specserve.target.loader import build_model, load_weights
from specserve.target.model_runner import ModelRunner
from tests.helpers.arch_cases import ARCH_CASES, arch_config
from tests.helpers.tiny_models import SHARP, build_tiny_model, tiny_config

BLOCK_SIZE = 4
NUM_BLOCKS = 40
BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
)


def _llama3_rope() -> dict:
    return {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}


CASES = {
    "llama": lambda: tiny_config("llama", **BASE),
    "llama_tied_llama3": lambda: tiny_config(
        "llama", **BASE, tie_word_embeddings=True, rope_parameters=_llama3_rope()
    ),
    "llama_linear_bias": lambda: tiny_config(
        "llama", **BASE, attention_bias=True, mlp_bias=True,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    ),
    "llama_yarn": lambda: tiny_config(
        "llama", **BASE, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0,
                                          "factor": 4.0, "original_max_position_embeddings": 32},
    ),
    "mistral_window": lambda: tiny_config("mistral", **BASE, sliding_window=4),
    # layer 0 full attention, layer 1 windowed (max_window_layers=1)
    "qwen2_window": lambda: tiny_config(
        "qwen2", **BASE, use_sliding_window=True, sliding_window=4, max_window_layers=1
    ),
    "qwen3_tied": lambda: tiny_config("qwen3", **BASE, head_dim=16, tie_word_embeddings=True),
    **{name: (lambda name=name: arch_config(name, **BASE)) for name in ARCH_CASES},
}


def _hf_logits(model, seq: list[int]) -> torch.Tensor:  # [L, V]
    with torch.no_grad():
        return model(input_ids=torch.tensor([seq])).logits[0].float()


class Driver:
    """Runs steps on a ModelRunner: each step is a list of (seq index, start, end) chunks;
    sequences own shuffled block ids, so every sequence crosses non-adjacent blocks."""

    def __init__(self, runner: ModelRunner, seqs: list[list[int]], seed: int = 0) -> None:
        self.runner, self.seqs = runner, seqs
        ids = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(ids)
        per_seq = NUM_BLOCKS // len(seqs)
        self.tables = [ids[i * per_seq:(i + 1) * per_seq] for i in range(len(seqs))]

    def step(self, chunks: list[tuple[int, int, int]], logits_rows: list[int] | None = None):
        tokens = [t for s, a, b in chunks for t in self.seqs[s][a:b]]
        positions = [p for _, a, b in chunks for p in range(a, b)]
        needed = [-(-b // BLOCK_SIZE) for _, _, b in chunks]
        meta = AttentionMetadata.build(
            [b - a for _, a, b in chunks], [b for _, _, b in chunks],
            [self.tables[s][:n] for (s, _, _), n in zip(chunks, needed)], BLOCK_SIZE,
        )
        idx = None if logits_rows is None else torch.tensor(logits_rows)
        logits, hidden = self.runner.forward(
            torch.tensor(tokens), torch.tensor(positions), meta, idx, return_hidden=True
        )
        assert hidden is not None and hidden.shape == (logits.shape[0], 64)
        assert logits.dtype == torch.float32
        return logits


def _load(tmp_path, config):
    # SHARP weights: attention far from uniform, so a wrong mask, window or rotary shows
    hf = build_tiny_model(tmp_path, config, init=SHARP, attn_implementation="eager")
    model_config, model = build_model(tmp_path, torch.float32, "cpu")
    runner = ModelRunner(
        model_config, model, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
        dtype=torch.float32, device="cpu", attn_backend=get_attention_backend("torch", "cpu"),
    )
    return hf, model_config, runner


@pytest.mark.parametrize("case", list(CASES))
def test_batched_prefill_then_decode_matches_transformers(tmp_path, case):
    hf, model_config, runner = _load(tmp_path, CASES[case]())
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (5, 11, 7)]
    prompt_lens = [len(s) for s in seqs]
    driver = Driver(runner, seqs)
    ours: dict[tuple[int, int], torch.Tensor] = {}  # (seq, position) -> logits row

    logits = driver.step([(i, 0, n) for i, n in enumerate(prompt_lens)])
    row = 0
    for i, n in enumerate(prompt_lens):
        for p in range(n):
            ours[(i, p)] = logits[row]
            row += 1
    for _ in range(4):  # decode all three together, each feeding its own argmax
        for i, seq in enumerate(seqs):
            seq.append(int(ours[(i, len(seq) - 1)].argmax()))
        logits = driver.step([(i, len(s) - 1, len(s)) for i, s in enumerate(seqs)])
        for i, seq in enumerate(seqs):
            ours[(i, len(seq) - 1)] = logits[i]

    for i, seq in enumerate(seqs):
        ref = _hf_logits(hf, seq)
        got = torch.stack([ours[(i, p)] for p in range(len(seq))])
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4, msg=f"{case} seq {i}")

    if model_config.sliding_window is not None:
        # The window must matter here, or this test would not be testing it.
        unwindowed = CASES[case]()
        unwindowed.sliding_window = 4096  # wider than any test sequence (Gemma needs one)
        unwindowed.layer_types = ["full_attention"] * unwindowed.num_hidden_layers
        plain = AutoModelForCausalLM.from_config(unwindowed, attn_implementation="eager").eval()
        plain.load_state_dict(hf.state_dict())
        assert (_hf_logits(plain, seqs[1]) - _hf_logits(hf, seqs[1])).abs().max() > 1e-2
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(hf.config, cap, None) is not None:
            # each soft-cap must matter here too
            uncapped = CASES[case]()
            setattr(uncapped, cap, None)
            plain = AutoModelForCausalLM.from_config(uncapped, attn_implementation="eager").eval()
            plain.load_state_dict(hf.state_dict())
            assert (_hf_logits(plain, seqs[1]) - _hf_logits(hf, seqs[1])).abs().max() > 1e-2


@pytest.mark.parametrize("case", ["llama", "mistral_window", "qwen3_tied", "gemma2", "gemma3"])
def test_chunked_prefill_mixed_with_decode(tmp_path, case):
    hf, _, runner = _load(tmp_path, CASES[case]())
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(3, 256, (13,), generator=gen).tolist()
    b = torch.randint(3, 256, (6,), generator=gen).tolist()
    driver = Driver(runner, [a, b], seed=3)
    ours: dict[tuple[int, int], torch.Tensor] = {}

    # step 1: a[0:3] and all of b, every row scored
    logits = driver.step([(0, 0, 3), (1, 0, 6)])
    for p in range(3):
        ours[(0, p)] = logits[p]
    for p in range(6):
        ours[(1, p)] = logits[3 + p]
    # steps 2, 3: next chunks of a next to one decode token of b; only the last rows scored
    for start, end in ((3, 8), (8, 13)):
        b.append(int(ours[(1, len(b) - 1)].argmax()))
        n = end - start
        logits = driver.step([(0, start, end), (1, len(b) - 1, len(b))], [n - 1, n])
        ours[(0, end - 1)] = logits[0]
        ours[(1, len(b) - 1)] = logits[1]

    ref_a, ref_b = _hf_logits(hf, a), _hf_logits(hf, b)
    for (s, p), row in ours.items():
        ref = (ref_a if s == 0 else ref_b)[p]
        torch.testing.assert_close(row, ref, atol=1e-4, rtol=1e-4, msg=f"{case} seq {s} pos {p}")


def test_bytes_per_block(tmp_path):
    _, model_config, runner = _load(tmp_path, CASES["llama"]())
    per_block = ModelRunner.bytes_per_block(model_config, BLOCK_SIZE, torch.float32)
    assert per_block == 2 * 2 * BLOCK_SIZE * 2 * 16 * 4
    assert runner.kv_cache.numel() * 4 == per_block * NUM_BLOCKS
    assert runner.kv_caches[1][0].data_ptr() != runner.kv_caches[0][0].data_ptr()


@pytest.mark.slow
def test_default_model_matches_transformers():
    """SmolLM2-135M (dequantized GGUF; cached after the first run): our logits for a prompt and
    8 greedy decode steps equal transformers' LlamaForCausalLM built from the same config and
    weights. Greedy decoding is checked by teacher forcing: HF's argmax at every decoded
    position, from one forward over prompt + our tokens, must be the token we chose."""
    from transformers import LlamaForCausalLM
    from transformers.initialization import no_init_weights

    from specserve.engine.models import resolve_model_path
    from specserve.target.config import ModelConfig
    from specserve.target.model import CausalLM

    hf_config, state_dict = load_weights(resolve_model_path(None))
    with no_init_weights():  # skip 135M random inits; every weight is loaded below
        hf = LlamaForCausalLM(hf_config).float().eval()
    hf.load_state_dict(state_dict, strict=False)  # lm_head is tied to the embedding
    hf.tie_weights()
    assert hf.lm_head.weight is hf.model.embed_tokens.weight
    model_config = ModelConfig.from_hf(hf_config)
    model = CausalLM(model_config, dtype=torch.float32, device="meta")
    model.load_hf_state_dict(state_dict)
    runner = ModelRunner(model_config, model, num_blocks=8, block_size=16,
                         dtype=torch.float32, device="cpu", attn_backend="torch")
    # "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    prompt = [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    tables = [[5, 2]]
    seq = list(prompt)
    meta = AttentionMetadata.build([len(seq)], [len(seq)], tables, 16)
    logits, _ = runner.forward(torch.tensor(seq), torch.arange(len(seq)), meta)
    rows = [logits]
    for _ in range(8):
        seq.append(int(rows[-1][-1].argmax()))
        meta = AttentionMetadata.build([1], [len(seq)], tables, 16)
        rows.append(runner.forward(torch.tensor(seq[-1:]), torch.tensor([len(seq) - 1]), meta)[0])
    ours = torch.cat(rows)[: len(seq) - 1]  # [L - 1, V]: the last decode row predicts past seq
    ref = _hf_logits(hf, seq)[: len(seq) - 1]
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-3)
    assert ref[len(prompt) - 1:].argmax(-1).tolist() == seq[len(prompt):]


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 32, 33, 100, 128, 129])
def test_dense_kernels_match_float64(rows):
    """Every candidate the tuner may choose computes the same product."""
    from specserve.kernels.linear import DENSE_KERNELS

    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 48, generator=g)
    w = torch.randn(80, 48, generator=g)
    b = torch.randn(80, generator=g)
    ref = x.double() @ w.double().T + b.double()
    for kernel in DENSE_KERNELS.values():
        torch.testing.assert_close(kernel(x, w, b).double(), ref, atol=1e-4, rtol=1e-5)
        out = kernel(x, w, None)
        torch.testing.assert_close(out.double(), ref - b.double(), atol=1e-4, rtol=1e-5)
        assert out.is_contiguous() and out.shape == (rows, 80)
