"""A GGUF served with its own block types (``--quantization auto`` on CPU) is built straight from
the file's blocks (target/loader.py, ``native_blocks``), never through a float copy of the
projections, and a second build reads the cached built layers (target/block_cache.py). Both give
bit for bit the model of the reference path: every tensor dequantized to float, then the file's
blocks swapped in (``quantize_model``)."""

from __future__ import annotations

import pytest
import torch

from specserve.kernels.quant import BlockEmbedding, BlockQuantLinear
from specserve.target import block_cache, quantize
from specserve.target.loader import build_model, gguf_cache_dir, read_weights
from specserve.target.quantize import quantize_model
from tests.helpers.gguf_blocks import typed_tensors
from tests.helpers.tiny_models import GGUF_VOCAB_SIZE, HF_INIT, build_tiny_model, tiny_config

CFG = dict(vocab_size=GGUF_VOCAB_SIZE, hidden_size=256, intermediate_size=512,
           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           max_position_embeddings=256)
# A Q4_K_M-like mix with one projection of a type without a kernel (F16: kept dense)
MIXES = {
    "llama-untied": ("llama", False, {"attn_v": "Q6_K", "attn_": "Q5_0", "ffn_down": "F16",
                                      "ffn_": "Q4_K", "output.": "Q8_0", "token_embd": "Q6_K"}),
    "qwen2-tied": ("qwen2", True, {"attn_": "Q8_0", "ffn_": "Q4_0", "token_embd": "Q5_0"}),
}


def _file(tmp_path, case: str) -> str:
    arch, tied, types = MIXES[case]
    path = tmp_path / f"{case}.gguf"
    with typed_tensors(types):
        build_tiny_model(path, tiny_config(arch, **CFG, tie_word_embeddings=tied), init=HF_INIT,
                         fmt="gguf")
    return str(path)


def _native(path: str):
    _, model = build_model(read_weights(path), torch.float32, "cpu", native_blocks=True)
    quantize_model(model, "gguf", path)  # what the engine runs after: nothing left to do
    return model


def _reference(path: str):
    _, model = build_model(read_weights(path), torch.float32, "cpu")
    quantize_model(model, "gguf", path)
    return model


def _assert_same_model(a, b) -> None:
    """``a`` (built from blocks) computes what ``b`` (the reference) does: the same tensors bit
    for bit, except that a block embedding table's rows equal the reference's float table."""
    if isinstance(a.embed_tokens, BlockEmbedding):
        ids = torch.arange(a.config.vocab_size).flip(0)
        assert torch.equal(a.embed_tokens.weight, b.embed_tokens.weight)
        assert torch.equal(a.embed(ids), b.embed(ids))
    sa, sb = ({k: v for k, v in m.state_dict().items() if not k.startswith("embed_tokens.")
               or not isinstance(a.embed_tokens, BlockEmbedding)} for m in (a, b))
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k
    blocks = lambda m: {n: x.fmt for n, x in m.named_modules() if isinstance(x, BlockQuantLinear)}
    assert blocks(a) == blocks(b) and blocks(a)


@pytest.mark.parametrize("case", sorted(MIXES))
def test_native_and_cached_builds_equal_the_float_path(tmp_path, monkeypatch, case):
    path = _file(tmp_path, case)
    native = _native(path)
    # no float copy of the file was written (the reference path's cache folder)
    assert not (gguf_cache_dir(path) / "weights").exists()
    reference = _reference(path)
    _assert_same_model(native, reference)
    if case == "llama-untied":  # the F16 projection stayed dense on both paths
        assert not isinstance(native.layers[0].mlp.down_proj, BlockQuantLinear)
    assert isinstance(native.embed_tokens, BlockEmbedding)  # Q6_K / Q5_0 tables stay blocks

    def no_decoding(*a, **k):
        raise AssertionError("the second build decoded the file's blocks again")

    monkeypatch.setattr(quantize, "file_block_weights", no_decoding)
    cached = _native(path)
    _assert_same_model(cached, reference)
    hidden = torch.randn(3, CFG["hidden_size"], generator=torch.Generator().manual_seed(0))
    for model in (native, cached):  # the head and a fused projection compute the same bits
        assert torch.equal(model.compute_logits(hidden), reference.compute_logits(hidden))
        assert isinstance(model.embed_tokens, BlockEmbedding)
        qkv = model.layers[1].self_attn.qkv_proj
        assert torch.equal(qkv(hidden), reference.layers[1].self_attn.qkv_proj(hidden))


def test_a_cache_that_does_not_fit_is_ignored(tmp_path):
    """Planes cached for another model (here: another file's, copied over) never load: the
    model is built from the file again, and equals the reference."""
    import shutil

    path, other = _file(tmp_path, "qwen2-tied"), _file(tmp_path, "llama-untied")
    _native(other)
    target = block_cache._file(path)
    target.parent.mkdir(parents=True)
    shutil.copy(block_cache._file(other), target)
    _assert_same_model(_native(path), _reference(path))
