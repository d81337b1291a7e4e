"""A GGUF model's built tensors, cached per file: a second start reads the block layers' planes
in the kernels' layout (and the few float tensors) instead of decoding and repacking the file's
blocks, which costs tens of seconds for a 0.5B model on 2 cores.

    <the file's cache folder, target/loader.py::gguf_cache_dir>/blocks-<PACKED_LAYOUT>/
        model.safetensors   the model's state dict under our names (a BlockQuantLinear's
                            planes as ``<module>.qs|d|m|bias``); metadata ``layers``: each
                            block layer's format and shape

The folder's name holds ``kernels.quant.PACKED_LAYOUT``, so a change of the kernels' layout never
reads old planes, and the file's key (size, mtime) changes with the file. A cache that does not
fit the model (missing or unexpected tensors) is ignored and the model is built from the file.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch

from specserve.kernels.quant import (
    PACKED_LAYOUT,
    BlockEmbedding,
    BlockQuantLinear,
    BlockQuantWeight,
)
from specserve.target.config import ModelConfig
from specserve.target.model import CausalLM

log = logging.getLogger(__name__)

_PLANES = ("qs", "d", "m", "bias", "qs5")


def _file(gguf_path: Path) -> Path:
    from specserve.target.loader import gguf_cache_dir

    return gguf_cache_dir(gguf_path) / f"blocks-{PACKED_LAYOUT}" / "model.safetensors"


def load(gguf_path: Path, config: ModelConfig, dtype: torch.dtype) -> CausalLM | None:
    """The model as ``store`` saved it (on the CPU), or None when nothing usable is cached."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    file = _file(gguf_path)
    if not file.is_file():
        return None
    t0 = time.perf_counter()
    with safe_open(file, framework="pt") as f:
        meta = f.metadata() or {}
    layers = json.loads(meta.get("layers", "{}"))
    embedding = meta.get("embedding")  # its block format, or none: a float table
    tensors = load_file(file)
    model = CausalLM(config, dtype=dtype, device="meta")
    why = _misfit(model, layers, embedding, tensors)
    if why is not None:  # another model's (or an older build's): rebuild from the file
        log.warning("ignoring the cached blocks in %s: %s", file.parent, why)
        return None
    for name, (fmt, out_features, in_features) in layers.items():
        planes = tuple(tensors.get(f"{name}.{p}") for p in _PLANES)
        layer = BlockQuantLinear.from_packed(fmt, out_features, in_features, planes)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, layer)
    if embedding is not None:
        model.embed_tokens = BlockEmbedding(BlockQuantWeight(
            embedding, *(tensors.get(f"embed_tokens.{p}") for p in ("qs", "d", "m"))))
    model.load_state_dict(tensors, strict=True, assign=True)
    model.requires_grad_(False)
    log.info("loaded %d block layers of %s from cache %s in %.1fs", len(layers), gguf_path,
             file.parent, time.perf_counter() - t0)
    return model


def _misfit(model: CausalLM, layers: dict, embedding: str | None,
            tensors: dict[str, torch.Tensor]) -> str | None:
    """Why the cached tensors are not this model's (None: they are): each block layer must
    replace a projection of its shape (and bias), a block embedding the table of its shape, the
    rest match the model's tensors by name and shape."""
    expect = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if embedding is not None:
        table = expect.pop("embed_tokens.weight")
        qs = tensors.get("embed_tokens.qs")
        if qs is None or qs.shape[0] != table[0] or qs.shape[1] * 32 != table[1]:
            return "the embedding blocks' shape"
        layers = {**layers, "embed_tokens": None}  # its planes are not compared below
    for name, shape in layers.items():
        if shape is None:
            continue
        _, out_features, in_features = shape
        if name == "lm_head" and model.lm_head is None and model.config.tie_word_embeddings:
            has_bias = False  # the tied table's block copy
        else:
            try:
                module = model.get_submodule(name)
            except AttributeError:
                return f"no projection {name}"
            if not isinstance(module, torch.nn.Linear) or (
                    module.out_features, module.in_features) != (out_features, in_features):
                return f"{name} is not a {out_features}x{in_features} projection here"
            has_bias = module.bias is not None
        if has_bias != (f"{name}.bias" in tensors):
            return f"{name}'s bias"
        for suffix in ("weight", "bias"):
            expect.pop(f"{name}.{suffix}", None)
    rest = {n: tuple(t.shape) for n, t in tensors.items()
            if n.rpartition(".")[0] not in layers}
    if rest != expect:
        diff = sorted(set(rest.items()) ^ set(expect.items()))[:3]
        return f"tensors differ from the model's: {diff}"
    return None


def store(gguf_path: Path, model: CausalLM) -> None:
    """Saves the built model for the next start (best effort: a full disk only logs)."""
    from safetensors.torch import save_file

    from specserve.target.loader import write_dir_atomically

    layers = {name: (m.fmt, m.out_features, m.in_features) for name, m in model.named_modules()
              if isinstance(m, BlockQuantLinear)}
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    meta = {"format": "pt", "layers": json.dumps(layers)}
    if isinstance(model.embed_tokens, BlockEmbedding):
        meta["embedding"] = model.embed_tokens.fmt
    file = _file(gguf_path)
    try:
        write_dir_atomically(file.parent, lambda tmp: save_file(tensors, tmp / file.name, meta))
    except OSError as e:
        log.warning("could not cache the built blocks of %s in %s: %s", gguf_path,
                    file.parent, e)
