"""Published EAGLE-3 heads as drafts: checkpoints in the EAGLE/SpecForge, vLLM/AngelSlim and
speculators layouts (the last made by the ``speculators`` package itself), for a tiny 8-layer
target. The head's logits equal a float64 forward of the published equations on the
checkpoint's own tensors (reading the target states each layout's aux-layer convention names,
from transformers' ``hidden_states``); greedy speculative output equals transformers' greedy
output; the sampled distribution equals the target's (chi-square); a head trained for another
target is refused with what it was trained for."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specserve.core.config import EngineConfig
from specserve.core.errors import ModelLoadError
from specserve.core.sampling_params import SamplingParams, SpeculativeParams
from specserve.draft.eagle3_source import load_eagle3
from specserve.draft.eagle_head import EagleRunner
from specserve.engine.llm_engine import LLMEngine
from specserve.kernels.metadata import AttentionMetadata, token_positions
from specserve.kernels.registry import get_attention_backend
from specserve.target.config import ModelConfig
from specserve.target.loader import load_weights
from specserve.target.model import FeatureCapture
from tests.helpers.eagle3_reference import DRAFT_IDS, ReferenceHead, random_tensors, write_published
from tests.helpers.reference import chi_square, exact_second_token_distribution, hf_greedy, prompts
from tests.helpers.tiny_models import BASE, build_tiny_model, tiny_config

LAYERS = 8
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def target_config(**kw):
    return tiny_config(max_position_embeddings=512, num_hidden_layers=LAYERS, **kw)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = tmp_path_factory.mktemp("eagle3_target")
    hf = build_tiny_model(path, target_config())
    return str(path), hf


def speculators_head(folder: Path, target_path: str, aux_ids, seed: int, **options) -> Path:
    """A head made and saved by the speculators package (its config, names and vocab maps);
    weights redrawn from ``seed`` so the head is neither zero nor the init."""
    pytest.importorskip("speculators", reason="the speculators test extra (make test-deps)")
    from speculators import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    config = Eagle3SpeculatorConfig(
        transformer_layer_config=tiny_config(max_position_embeddings=512, num_hidden_layers=1),
        draft_vocab_size=len(DRAFT_IDS), eagle_aux_hidden_state_layer_ids=aux_ids,
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=3)],
            verifier=VerifierConfig.from_pretrained(target_path)),
        **options)
    model = Eagle3DraftModel(config)
    t2d = torch.zeros(BASE["vocab_size"], dtype=torch.bool)
    t2d[DRAFT_IDS] = True
    model.load_vocab_mappings(t2d, DRAFT_IDS - torch.arange(len(DRAFT_IDS)))
    model.load_verifier_weights()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.startswith(("embed_tokens", "verifier_")):
                continue
            if "norm" in name:
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g))
            else:
                p.copy_((0.5 if "lm_head" in name else 0.15) * torch.randn(p.shape, generator=g))
    model.save_pretrained(folder)
    return folder


# layout -> (writer(folder, target path) -> folder, the transformers hidden_states indices the
# head must read, the EAGLE 3.1 / residual options the reference applies)
def _eagle_default(folder, path):
    return write_published(folder, target_config().to_dict(),
                           random_tensors(64, 4, 2, 128, 3, 64, DRAFT_IDS, 300, seed=1),
                           "LlamaForCausalLMEagle3")


def _eagle_ids(folder, path):  # SpecForge's explicit ids: OUTPUTS of layers 0, 3, 6
    return write_published(folder, target_config().to_dict(),
                           random_tensors(64, 4, 2, 128, 3, 64, DRAFT_IDS, 300, seed=2),
                           "LlamaForCausalLMEagle3",
                           {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 3, 6]}})


def _vllm(folder, path):  # vLLM's ids: INPUTS of layers 1, 4, 7; layers.0.* names
    return write_published(folder, target_config().to_dict(),
                           random_tensors(64, 4, 2, 128, 3, 64, DRAFT_IDS, 300, seed=3,
                                          prefix="layers.0."),
                           "Eagle3LlamaForCausalLM",
                           {"eagle_aux_hidden_state_layer_ids": [1, 4, 7],
                            "norm_before_residual": True})


def _speculators(folder, path):  # EAGLE 3.1 options, ids = INPUTS of layers 2, 5, 7
    return speculators_head(folder, path, [2, 5, 7], 4, norm_before_residual=True,
                            fc_norm=True, norm_output=True)


def _speculators_fc(folder, path):  # default ids, one norm before fc
    return speculators_head(folder, path, None, 5, norm_before_fc=True)


LAYOUTS = {
    "eagle": (_eagle_default, [2, 4, 5], {}),
    "eagle-ids": (_eagle_ids, [1, 4, 7], {}),
    "vllm": (_vllm, [1, 4, 7], {"norm_before_residual": True}),
    "speculators": (_speculators, [2, 5, 7],
                    {"norm_before_residual": True, "fc_norm": True, "norm_output": True}),
    "speculators-fc": (_speculators_fc, [2, 4, 5], {"norm_before_fc": True}),
}


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    path, _ = target
    root = tmp_path_factory.mktemp("eagle3_heads")
    made: dict[str, Path] = {}

    def get(layout: str) -> Path:
        if layout not in made:
            made[layout] = LAYOUTS[layout][0](root / layout, path)
        return made[layout]
    return get


def make(path, head, **kw) -> LLMEngine:
    cfg = dict(model=path, draft_model=str(head), dtype="float32", block_size=4,
               num_kv_blocks=400, adaptive_speculation=False, num_speculative_tokens=4)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_head_logits_equal_the_published_equations(target, heads, layout):
    """Step 0 over a prompt, then two chained draft steps: every logit row equals the float64
    reference, which reads transformers' hidden_states at the layout's documented indices."""
    from safetensors.torch import load_file

    path, hf = target
    folder = heads(layout)
    _, hidden_ids, options = LAYOUTS[layout]
    tensors = load_file(folder / "model.safetensors")
    embed = hf.model.embed_tokens.weight.detach()
    ref = ReferenceHead(tensors, embed, 4, 2, hf.config.rms_norm_eps,
                        float(hf.config.rope_parameters["rope_theta"]), **options)
    ids = torch.tensor(prompts([13], seed=4)[0])
    n = len(ids)
    with torch.no_grad():
        states = hf(ids[None], output_hidden_states=True).hidden_states
    aux = torch.cat([states[k][0] for k in hidden_ids], dim=-1)  # [n, 3H]
    expected = ref.draft(ids, aux, steps=3)

    engine = LLMEngine(EngineConfig(model=path, dtype="float32", block_size=4, num_kv_blocks=200))
    head = load_eagle3(folder, ModelConfig.from_hf(load_weights(path)[0]), embed, torch.float32,
                       "cpu")
    meta = AttentionMetadata.build([n], [n], [list(range(8))], 4, "cpu")
    capture = FeatureCapture(head.meta.target_layers, torch.arange(n))
    engine.runner.forward(ids, torch.arange(n), meta, torch.tensor([n - 1]), capture=capture)
    assert torch.allclose(capture.out.double(), aux.double(), atol=1e-4)  # the convention
    runner = EagleRunner(head, num_blocks=16, block_size=4, dtype=torch.float32,
                         device=torch.device("cpu"), backend=get_attention_backend("torch", "cpu"))
    g = torch.cat([torch.zeros((1, 64)), head.fuse(capture.out)[:-1]])
    meta = AttentionMetadata.build([n], [n], [list(range(16))], 4, "cpu")
    out = runner.step(ids, g, token_positions([n], [n]), meta)
    got = [head.logits(out)]
    prev = out[-1:]
    for j in (1, 2):
        token = head.head_token_ids[got[-1][-1].argmax()].view(1)
        meta = AttentionMetadata.build([1], [n + j], [list(range(16))], 4, "cpu")
        prev = runner.step(token, prev, torch.tensor([n - 1 + j]), meta)
        got.append(head.logits(prev))
    for j, (a, b) in enumerate(zip(got, expected)):
        assert torch.allclose(a.double(), b, atol=2e-4, rtol=1e-4), (layout, j)
    assert torch.equal(head.head_token_ids, DRAFT_IDS)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_greedy_with_each_layout_equals_plain(target, heads, layout):
    path, hf = target
    engine = make(path, heads(layout))
    assert engine.config.default_speculative_method == "eagle"
    base = prompts([3, 11, 29, 50], seed=2)
    outs = engine.generate(base, GREEDY)
    for p, out in zip(base, outs):
        assert out.token_ids == hf_greedy(hf, p, GREEDY.max_tokens)
    assert sum(o.timings.num_drafted for o in outs) > 0
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


def test_greedy_with_batching_chunks_and_prefix_hits(target, heads):
    path, hf = target
    engine = make(path, heads("vllm"), max_num_batched_tokens=9, enable_prefix_caching=True)
    base = prompts([7, 33], seed=3)
    batch = base + [base[1][:24] + base[0]]
    for _ in range(2):  # the second round hits the cache
        outs = engine.generate(batch, GREEDY, SpeculativeParams("eagle", 3))
        for p, out in zip(batch, outs):
            assert out.token_ids == hf_greedy(hf, p, GREEDY.max_tokens)


@pytest.mark.parametrize("layout", ["eagle", pytest.param("speculators", marks=pytest.mark.slow)])
def test_sampled_distribution_equals_target(target, heads, layout):
    """The second token comes out of a k = 1 verify step: its distribution must equal the
    target's exact float64 marginal."""
    path, hf = target
    temperature = 1.5
    prompt = torch.randperm(BASE["vocab_size"], generator=torch.Generator().manual_seed(0))
    prompt = prompt.tolist()
    expected = exact_second_token_distribution(hf, prompt, temperature)
    engine = make(path, heads(layout), max_num_seqs=256, max_num_batched_tokens=4096,
                  num_kv_blocks=2000, seed=5)
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


def test_a_head_for_another_target_is_refused(target, heads, tmp_path):
    path, _ = target
    head = heads("eagle-ids")
    narrow = tmp_path / "narrow"
    build_tiny_model(narrow, tiny_config(num_hidden_layers=LAYERS, hidden_size=32))
    with pytest.raises(ModelLoadError, match="trained for a target with hidden size 64, "
                                             "vocabulary 300"):
        make(str(narrow), head)
    shallow = tmp_path / "shallow"
    build_tiny_model(shallow, tiny_config(num_hidden_layers=4))
    with pytest.raises(ModelLoadError, match=r"reads target layers \[0, 3, 6\]"):
        make(str(shallow), head)


def test_unsupported_heads_are_refused_by_name(target, heads, tmp_path):
    path, _ = target
    src = heads("eagle")
    deep = tmp_path / "deep"
    deep.mkdir()
    config = json.loads((src / "config.json").read_text())
    (deep / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 2}))
    (deep / "model.safetensors").write_bytes((src / "model.safetensors").read_bytes())
    with pytest.raises(ModelLoadError, match="2 decoder layers"):
        make(path, deep)
    nomap = tmp_path / "nomap"
    from safetensors.torch import load_file, save_file

    tensors = {k: v for k, v in load_file(src / "model.safetensors").items()
               if k not in ("d2t", "t2d")}
    nomap.mkdir()
    (nomap / "config.json").write_text(json.dumps(config))
    save_file(tensors, nomap / "model.safetensors")
    with pytest.raises(ModelLoadError, match="no d2t map"):
        make(path, nomap)


@pytest.mark.filterwarnings("ignore:flex_attention called without")
def test_a_distilled_head_loads_back_through_the_speculators_package(target, tmp_path):
    """``specserve distill --method eagle`` saves the speculators layout: the speculators
    package's own loader reads it (config schema, names, vocab maps, aux ids in its input-of-
    layer convention), and its forward drafts what ours does on the same inputs."""
    pytest.importorskip("speculators", reason="the speculators test extra (make test-deps)")
    from speculators import SpeculatorModel

    from specserve.distill.eagle_build import build_head, save_head

    path, hf = target
    hf_config, state = load_weights(path)
    head = build_head(hf_config, state, DRAFT_IDS, (1, 3, 4))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    folder = tmp_path / "head"
    save_head(head, hf_config, folder, {}, dtype=torch.float32, target_path=path)
    theirs = SpeculatorModel.from_pretrained(str(folder))
    assert list(theirs.config.eagle_aux_hidden_state_layer_ids) == [2, 4, 5]
    assert theirs.config.draft_vocab_size == len(DRAFT_IDS)
    assert torch.equal(theirs.d2t + torch.arange(len(DRAFT_IDS)), DRAFT_IDS)
    assert torch.equal(theirs.t2d.nonzero().flatten(), DRAFT_IDS)
    assert torch.equal(theirs.fc.weight, head.fc.weight)
    assert torch.equal(theirs.embed_tokens.weight, hf.model.embed_tokens.weight)

    ours = load_eagle3(folder, ModelConfig.from_hf(hf_config), hf.model.embed_tokens.weight,
                       torch.float32, "cpu")
    assert ours.meta.target_layers == (1, 3, 4)
    n = 12
    ids = torch.tensor(prompts([n], seed=6)[0])
    aux = torch.randn(n, 3 * 64, generator=g)
    shifted = torch.cat([torch.zeros(1, 3 * 64), aux[:-1]])  # position p reads p - 1's states
    with torch.no_grad():
        drafted = theirs(hidden_states=shifted[None], input_ids=ids[None],
                         document_ids=torch.zeros(1, n, dtype=torch.long), ttt_steps=1)[0]
    runner = EagleRunner(ours, num_blocks=16, block_size=4, dtype=torch.float32,
                         device=torch.device("cpu"), backend=get_attention_backend("torch", "cpu"))
    meta = AttentionMetadata.build([n], [n], [list(range(16))], 4, "cpu")
    out = runner.step(ids, ours.fuse(shifted), token_positions([n], [n]), meta)
    assert torch.equal(ours.logits(out).argmax(-1), drafted[0])
