"""Weight-only block quantization of a loaded ``CausalLM``: which projections become
``BlockQuantLinear`` and where their blocks come from.

``--quantization``:
  - ``none``: every projection stays dense in the model dtype (the reference path);
  - ``int4`` / ``int8``: projections and the lm_head in Q4_1 / Q8_0 blocks. From a GGUF file,
    tensors already in a 4-bit (Q4_0, Q4_1) or 8-bit (Q8_0) block type are taken as the file
    holds them; others are quantized from their float values;
  - ``auto``: a GGUF file keeps its own formats (each tensor of a type with a kernel, Q4_0..Q8_0
    and Q4_K/Q5_K/Q6_K, as stored: kernels/gguf_blocks.py; other types dense, and then
    speculation is off by default: ``dense_projection_tensors``); an HF folder stays dense.
    On CUDA: ``none`` (the kernels are CPU kernels).

A quantized model also runs its norms, rotary, SiLU*mul and residual adds through the fused
float32 ops of kernels/csrc/fused.cpp (``CausalLM.enable_fused_ops``).

The embedding lookup stays dense (a gather costs nothing to keep exact); with tied embeddings the
lm_head gets its own block copy of the table, as llama.cpp computes it.
"""

from __future__ import annotations

import logging
import typing
from pathlib import Path

import torch
from torch import nn

from specserve.core.config import Quantization
from specserve.core.errors import ConfigError
from specserve.kernels import quant_ext
from specserve.kernels.quant import (
    BlockEmbedding,
    BlockQuantLinear,
    BlockQuantWeight,
    from_gguf_blocks,
    gguf_format,
)
from specserve.kernels.quant import quantize as quantize_blocks
from specserve.target.config import ModelConfig
from specserve.target.gguf_arch import PERMUTED_QK
from specserve.target.model import CausalLM, set_fused_ops

if typing.TYPE_CHECKING:
    from specserve.target.gguf_file import GGUFFile

log = logging.getLogger(__name__)

QUANTIZATION_CHOICES: tuple[str, ...] = typing.get_args(Quantization)  # --quantization's values
_FORMAT_OF = {"int4": "q4_1", "int8": "q8_0"}
# GGUF projection names (llama family) -> (our fused module, its part, part order)
_GGUF_PARTS = {
    "attn_q": ("self_attn.qkv_proj", 0),
    "attn_k": ("self_attn.qkv_proj", 1),
    "attn_v": ("self_attn.qkv_proj", 2),
    "attn_output": ("self_attn.o_proj", 0),
    "ffn_gate": ("mlp.gate_up_proj", 0),
    "ffn_up": ("mlp.gate_up_proj", 1),
    "ffn_down": ("mlp.down_proj", 0),
}


def resolve_quantization(choice: str, model_path: str, device: torch.device) -> str:
    """``auto`` -> ``gguf`` (a GGUF's own formats) on CPU, else ``none``; others as given
    (the resolver's rule for ``--quantization``, specserve/engine/resolve.py)."""
    if choice not in QUANTIZATION_CHOICES:
        raise ConfigError(
            f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)} (got {choice!r})"
        )
    if choice != "auto":
        if choice != "none" and device.type != "cpu":
            raise ConfigError(f"quantization {choice} runs CPU kernels; use --quantization none "
                              f"on {device.type}")
        return choice
    from specserve.target.loader import is_gguf

    return "gguf" if device.type == "cpu" and is_gguf(model_path) else "none"


def dense_projection_tensors(mode: str, model_path: str | Path, config: ModelConfig
                             ) -> dict[str, str]:
    """The projections a quantized model (``mode`` gguf / int4 / int8) would run as dense float
    matmuls, whose sums depend on the row count (torch picks its reduction by shape): tensor
    name -> why. Empty when every projection runs a batch-invariant block kernel, and for
    ``none`` (the dense reference path, chosen by the user). Read from the file's tensor types
    and the model's shapes, without building the model, by the same rules ``quantize_model``
    applies."""
    if mode == "none":
        return {}
    if not quant_ext.available():
        return {"every projection": "the C++ block kernels cannot be built on this machine"}
    if mode == "gguf":
        from specserve.target.gguf_file import GGUFFile

        names = {t.name: t.tensor_type.name for t in GGUFFile(model_path).tensors}
        out = {}
        for name, type_name in names.items():
            pieces = name.split(".")
            projection = (len(pieces) == 4 and pieces[0] == "blk" and pieces[2] in _GGUF_PARTS
                          and pieces[3] == "weight"  # biases are added in float32 exactly
                          or name == "output.weight"
                          or name == "token_embd.weight" and "output.weight" not in names
                          and config.tie_word_embeddings)
            if projection and gguf_format(type_name) is None:
                out[name] = f"{type_name} has no block kernel"
        return out
    shapes = {"q/k/v, gate/up projections and lm_head": config.hidden_size,
              "o_proj": config.q_size, "down_proj": config.intermediate_size}
    return {name: f"K={k} is not a multiple of 32" for name, k in shapes.items() if k % 32}


def speculation_caveat(dense: dict[str, str]) -> str | None:
    """Why speculation is off by default on a model with ``dense`` projections (None: it is
    lossless there). Greedy speculation is exact only when a k+1-row verify computes each row
    with the bits a one-row step would."""
    if not dense:
        return None
    why: dict[str, list[str]] = {}
    for name, reason in dense.items():
        why.setdefault(reason, []).append(name)
    parts = "; ".join(f"{len(names)} tensor{'s' if len(names) > 1 else ''} ({names[0]}"
                      f"{', ...' if len(names) > 1 else ''}): {reason}"
                      for reason, names in why.items())
    return (f"speculation is off by default: some projections run dense float matmuls, whose "
            f"sums depend on the row count, so a speculative verify could pick other tokens than "
            f"plain decoding ({parts}); a request (or --speculative-method) that asks for "
            f"speculation gets it, with this warning in its timings")


def projection_modules(model: CausalLM) -> dict[str, nn.Linear]:
    """Our module names -> the dense projections that may be quantized (lm_head included)."""
    out = {
        name: mod for name, mod in model.named_modules()
        if isinstance(mod, nn.Linear) and name.startswith("layers.")
    }
    if model.lm_head is not None and isinstance(model.lm_head, nn.Linear):
        out["lm_head"] = model.lm_head
    return out


def gguf_block_weights(path: str | Path, model: CausalLM) -> dict[str, BlockQuantWeight]:
    """The GGUF's projection tensors of types with a kernel as block weights under our module
    names (``file_block_weights``), for a model already built."""
    from specserve.target.gguf_file import GGUFFile

    untied_head = model.lm_head is not None and model.head_token_ids is None
    return file_block_weights(GGUFFile(path), model.config, untied_head)[0]


def file_block_weights(reader: GGUFFile, cfg: ModelConfig, untied_head: bool
                       ) -> tuple[dict[str, BlockQuantWeight], set[str]]:
    """The file's projection tensors of types with a kernel as block weights under our module
    names, q/k rows un-permuted as transformers does (llama.cpp stores them permuted for its
    rotary), parts fused in our order (parts of different formats as Q8_F), and the names of
    the file's tensors they hold. A module some of whose parts are of a type without a kernel
    is left out. ``untied_head``: the model has its own lm_head (else a tied table heads it)."""
    arch = reader.fields["general.architecture"]
    permuted = arch in PERMUTED_QK  # the converter permutes these (target/gguf_arch.py)
    parts: dict[str, dict[int, tuple[str, BlockQuantWeight | None]]] = {}
    head: BlockQuantWeight | None = None
    tied_table: BlockQuantWeight | None = None
    for t in reader.tensors:
        pieces = t.name.split(".")
        layer_part = len(pieces) == 4 and pieces[0] == "blk" and pieces[2] in _GGUF_PARTS \
            and pieces[3] == "weight"
        if not layer_part and t.name not in ("output.weight", "token_embd.weight"):
            continue
        fmt = gguf_format(t.tensor_type.name)
        shape = (int(t.shape[1]), int(t.shape[0])) if len(t.shape) == 2 else None
        weight = None
        if fmt is not None and shape is not None:
            weight = from_gguf_blocks(t.tensor_type.name, t.data, shape)
        if t.name == "output.weight":
            head = weight
            continue
        if t.name == "token_embd.weight":
            tied_table = weight
            continue
        module, index = _GGUF_PARTS[pieces[2]]
        if weight is not None and permuted and pieces[2] in ("attn_q", "attn_k"):
            heads = cfg.num_heads if pieces[2] == "attn_q" else cfg.num_kv_heads
            weight = weight.rows(_unpermute_index(weight.shape[0], heads))
        parts.setdefault(f"layers.{pieces[1]}.{module}", {})[index] = (t.name, weight)
    out: dict[str, BlockQuantWeight] = {}
    consumed: set[str] = set()
    for name, got in parts.items():
        if got and all(w is not None for _, w in got.values()):
            out[name] = BlockQuantWeight.cat([got[i][1] for i in sorted(got)])  # type: ignore[misc]
            consumed.update(n for n, _ in got.values())
    if untied_head:
        if head is not None:
            out["lm_head"] = head
            consumed.add("output.weight")
    elif cfg.tie_word_embeddings and tied_table is not None:
        out["lm_head"] = tied_table
    if tied_table is not None:  # looked up in its blocks (BlockEmbedding)
        out["embed_tokens"] = tied_table
        consumed.add("token_embd.weight")
    return out, consumed


def install_blocks(model: CausalLM, blocks: dict[str, BlockQuantWeight]) -> None:
    """Puts ``BlockQuantLinear``s of ``blocks`` in place of the named projections (which may
    still be on the meta device: their weights were never read), keeping each one's bias, and
    a ``BlockEmbedding`` for ``embed_tokens``."""
    for name, weight in blocks.items():
        if name == "embed_tokens":
            model.embed_tokens = BlockEmbedding(weight)
            continue
        module = model.lm_head if name == "lm_head" else model.get_submodule(name)
        bias = None if module is None else module.bias
        _set_module(model, name, BlockQuantLinear(weight, bias))


def _unpermute_index(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation: per head, rows (2i, 2i+1) of the file
    came from rows (i, i + dim/2) of the original."""
    dim = rows // heads // 2
    idx = torch.arange(rows).view(heads, dim, 2).transpose(1, 2).reshape(rows)
    return idx


def quantize_model(model: CausalLM, mode: str, model_path: str) -> dict[str, str]:
    """Swaps the model's projections for ``BlockQuantLinear`` per ``mode`` (``gguf``, ``int4``,
    ``int8``; ``none`` does nothing). Returns module name -> format, for the log and tests."""
    if mode == "none":
        return {}
    from specserve.target.loader import is_gguf

    want = _FORMAT_OF.get(mode)  # None: the file's own formats
    chosen = {name: m.fmt for name, m in model.named_modules() if isinstance(m, BlockQuantLinear)}
    # built from the file's blocks already (build_model, native_blocks): what is left dense has
    # no kernel for its type
    native = gguf_block_weights(model_path, model) if is_gguf(model_path) and not (
        chosen and want is None) else {}
    dense = projection_modules(model)
    if model.lm_head is None and model.config.tie_word_embeddings:
        dense["lm_head"] = None  # type: ignore[assignment]  # tied: quantize a copy of the table
    for name, module in dense.items():
        weight = native.get(name)
        if weight is not None and want is not None and weight.fmt != want:
            weight = None  # the file has another format: requantize from float
        if weight is None and want is not None:
            source = model.embed_tokens.weight if module is None else module.weight
            if source.shape[1] % 32:
                log.warning("%s: K=%d is not a multiple of 32; kept dense", name, source.shape[1])
                continue
            weight = quantize_blocks(source, want)
        if weight is None:
            continue  # auto on a GGUF tensor of another type: dense, as loaded
        bias = None if module is None else module.bias
        _set_module(model, name, BlockQuantLinear(weight, bias))
        chosen[name] = weight.fmt
    if chosen and quant_ext.available():
        model.enable_fused_ops(quant_ext.load())
    counts = {f: sum(1 for v in chosen.values() if v == f) for f in set(chosen.values())}
    log.info("quantization %s: %s projections in blocks %s", mode, len(chosen), counts)
    return chosen


def quantize_linears(root: nn.Module, fmt: str) -> dict[str, str]:
    """Swaps every dense projection under ``root`` whose K is a multiple of 32 for a
    ``BlockQuantLinear`` in ``fmt`` (q4_1 / q8_0), quantized from its float weight, and turns on
    the fused float32 ops when the kernels load. Returns module name -> format."""
    chosen: dict[str, str] = {}
    for name, module in list(root.named_modules()):
        if not isinstance(module, nn.Linear) or module.in_features % 32:
            continue
        _set_module(root, name, BlockQuantLinear(quantize_blocks(module.weight, fmt), module.bias))
        chosen[name] = fmt
    if chosen and quant_ext.available():
        set_fused_ops(root, quant_ext.load())
    return chosen


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)
