"""A draft model given as a GGUF file runs the blocks its file holds on the native kernels (each
projection in its tensors' own types, never requantized through float: its weights equal what
transformers' own GGUF loader dequantizes, bit for bit), beside a quantized GGUF target; greedy
speculative output equals plain decoding and the sampled distribution equals the target's
(chi-square). An HF-folder draft beside a quantized target still runs Q8_0 blocks."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve.core.sampling_params import SamplingParams, SpeculativeParams
from specserve.kernels.gguf_blocks import GGUF_TYPES
from specserve.kernels.quant import BlockQuantLinear
from tests.helpers.gguf_blocks import typed_tensors
from tests.helpers.reference import chi_square, exact_second_token_distribution, prompts
from tests.helpers.speculation import make
from tests.helpers.tiny_models import (
    GGUF_VOCAB_SIZE,
    HF_INIT,
    MARGINS,
    build_tiny_model,
    tiny_config,
)

SIZES = dict(vocab_size=GGUF_VOCAB_SIZE, max_position_embeddings=512, tie_word_embeddings=False)
# GGUF tensor name part -> type (first match wins: attn_output before output.)
TARGET_TYPES = {".attn_": "Q8_0", ".ffn_": "Q8_0", "output.": "Q8_0"}
# The target's own weights in lower-bit types: a draft that often agrees with it. Mixed parts of
# one fused projection (q/k/v) run as q8_f; gate/up are both q4_1 blocks.
LOWBIT_TYPES = {".attn_q.": "Q4_0", ".attn_k.": "Q4_1", ".attn_v.": "Q5_0",
                ".attn_output.": "Q5_1", ".ffn_gate.": "Q4_0", ".ffn_up.": "Q4_1",
                ".ffn_down.": "Q5_0", "output.": "Q8_0"}
# Another model in K-quants (random valid blocks: gguf-py has no K-quantizer); K = 256.
KQUANT_TYPES = {".attn_q.": "Q4_K", ".attn_k.": "Q4_K", ".attn_v.": "Q5_K",
                ".attn_output.": "Q6_K", ".ffn_": "Q5_K", "output.": "Q6_K"}
KQUANT_SIZES = dict(hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                    num_attention_heads=4, num_key_value_heads=2)
# our module -> its GGUF parts, in our fused order
PARTS = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
         "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}
HF_PARTS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
            "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
            "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _typed_gguf(path, types, init=MARGINS, seed=0, **sizes) -> str:
    with typed_tensors(types):
        build_tiny_model(path, tiny_config(**{**SIZES, **sizes}), init=init, seed=seed,
                         fmt="gguf")
    return str(path)


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory):
    root = tmp_path_factory.mktemp("draft_gguf")
    return {
        "target": _typed_gguf(root / "target.gguf", TARGET_TYPES),
        "lowbit": _typed_gguf(root / "lowbit.gguf", LOWBIT_TYPES),
        "kquant": _typed_gguf(root / "kquant.gguf", KQUANT_TYPES, init=HF_INIT, seed=1,
                              **KQUANT_SIZES),
    }


def _draft_model(engine):
    return engine.speculator.draft.runner.model


def _file_types(path: str) -> dict[str, str]:
    import gguf

    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}


def _transformers_weights(path: str) -> dict[str, torch.Tensor]:
    """The dense weights transformers' own GGUF loader dequantizes (gguf-py), q/k un-permuted."""
    from pathlib import Path

    p = Path(path)
    return AutoModelForCausalLM.from_pretrained(p.parent, gguf_file=p.name).state_dict()


@pytest.mark.parametrize("draft", ["lowbit", "kquant"])
def test_gguf_draft_runs_its_files_own_blocks(ggufs, draft):
    engine = make(ggufs["target"], draft_model=ggufs[draft])
    assert engine.config.quantization == "gguf"  # the target runs its Q8_0 blocks
    types, dense = _file_types(ggufs[draft]), _transformers_weights(ggufs[draft])
    model = _draft_model(engine)
    layers = model.config.num_layers
    want = {"lm_head": (GGUF_TYPES[types["output.weight"]][0], dense["lm_head.weight"])}
    for i in range(layers):
        for module, parts in PARTS.items():
            fmts = {GGUF_TYPES[types[f"blk.{i}.{p}.weight"]][0] for p in parts}
            weight = torch.cat([dense[f"model.layers.{i}.{HF_PARTS[p]}.weight"] for p in parts])
            want[f"layers.{i}.{module}"] = (fmts.pop() if len(fmts) == 1 else "q8_f", weight)
    got = {name: m for name, m in model.named_modules() if isinstance(m, BlockQuantLinear)}
    assert sorted(got) == sorted(want)
    for name, (fmt, weight) in want.items():
        assert got[name].fmt == fmt, name
        # the file's codes and scales: exactly the values gguf-py dequantizes, not a requantization
        torch.testing.assert_close(got[name].weight.dequantize(), weight, rtol=0, atol=0,
                                   msg=name)


def test_hf_folder_draft_beside_a_quantized_target_runs_q8_0(ggufs, tmp_path):
    build_tiny_model(tmp_path, tiny_config(**SIZES, num_hidden_layers=1), init=HF_INIT, seed=2)
    engine = make(ggufs["target"], draft_model=str(tmp_path))
    fmts = {m.fmt for m in _draft_model(engine).modules() if isinstance(m, BlockQuantLinear)}
    assert fmts == {"q8_0"}


@pytest.mark.parametrize("draft", ["lowbit", "kquant"])
def test_greedy_with_a_gguf_draft_equals_plain(ggufs, draft):
    engine = make(ggufs["target"], draft_model=ggufs[draft])
    ps = prompts([5, 11, 23, 40], seed=4, vocab=GGUF_VOCAB_SIZE)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in engine.generate(ps, params, SpeculativeParams("off"))]
    spec = engine.generate(ps, params)
    assert [o.token_ids for o in spec] == plain
    assert sum(o.timings.num_drafted for o in spec) > 0
    if draft == "lowbit":  # the target's own weights in 4-5 bits agree with it
        assert sum(o.timings.num_accepted for o in spec) > 0
    alone = [engine.generate([p], params)[0].token_ids for p in ps[:2]]
    assert alone == plain[:2]
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


@pytest.mark.slow
def test_sampled_distribution_with_a_gguf_draft_equals_target(ggufs):
    """The second token comes from a k = 1 verify against the GGUF draft's q; its distribution
    must be the target's exact marginal. The target runs dense (``quantization none``: the
    float32 values transformers dequantizes from the same file, the reference); the draft still
    runs its own blocks."""
    temperature = 1.5
    prompt = torch.randperm(GGUF_VOCAB_SIZE, generator=torch.Generator().manual_seed(0)).tolist()
    from pathlib import Path

    target = Path(ggufs["target"])
    hf = AutoModelForCausalLM.from_pretrained(target.parent, gguf_file=target.name).eval()
    expected = exact_second_token_distribution(hf, prompt, temperature)
    engine = make(str(target), draft_model=ggufs["lowbit"], quantization="none",
                  max_num_seqs=256, max_num_batched_tokens=4096, num_kv_blocks=2000, seed=5)
    assert any(isinstance(m, BlockQuantLinear) for m in _draft_model(engine).modules())
    params = SamplingParams(max_tokens=3, temperature=temperature, ignore_eos=True)
    counts, drafted = torch.zeros_like(expected), 0
    for _ in range(8):
        for o in engine.generate([prompt] * 250, params, SpeculativeParams("draft", 1)):
            counts[o.token_ids[1]] += 1
            drafted += o.timings.num_drafted
    assert drafted > counts.sum() / 2  # most second tokens really went through verification
    chi2, bound = chi_square(counts, expected)
    assert chi2 < bound, (chi2, bound)
