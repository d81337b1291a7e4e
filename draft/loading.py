"""Loading what model proposers draft with: a draft language model or an EAGLE head.

The engine names neither. It opens the ``--draft-model`` path with ``open_draft`` before it
resolves its configuration (the pool is sized for the draft's KV too: ``kv_bytes_per_block``),
then builds it beside the loaded target (``build``). Each kind knows its own rules: a draft
model shares the target's embeddings and tokenizer, runs Q8_0 blocks beside a quantized target,
and gets its own ``ModelRunner``; an EAGLE head is checked against the target it was trained
for and gets an ``EagleRunner``. Both keep float32 KV caches (their numbers only move
acceptance), so they run the target's attention form widened to float32 caches. The proposers
that use a kind say so in the registry (``ProposerSpec.needs_draft``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from specserve.kernels.cpu_paged import CpuPagedAttention
from specserve.kernels.registry import AttentionBackend
from specserve.target.config import ModelConfig
from specserve.target.model import CausalLM

DRAFT_MODEL, EAGLE_HEAD, TEXT_DRAFT = "draft_model", "eagle_head", "text_draft"


@dataclass(frozen=True)
class DraftKind:
    what: str  # "a draft model"
    how: str  # how to give one on the command line


DRAFT_KINDS = {
    DRAFT_MODEL: DraftKind("a draft model", "--draft-model PATH, a small LM with the target's "
                                            "tokenizer"),
    EAGLE_HEAD: DraftKind("an EAGLE head", "--draft-model DIR, a head folder written by "
                                           "`specserve distill --method eagle`"),
    TEXT_DRAFT: DraftKind("a draft model with another tokenizer",
                          "--draft-model PATH, a small LM with its own tokenizer (`default`: "
                          "the built-in SmolLM2-135M-Instruct)"),
}


@dataclass(frozen=True)
class DraftTarget:
    """What a draft is built beside: the loaded target and the engine's KV layout."""

    model: CausalLM
    config: ModelConfig
    tokenizer: Any
    tokenizer_of: Callable[[str], Any]  # a model path -> its tokenizer (or None)
    dtype: torch.dtype
    device: torch.device
    quantized: bool  # the target's projections are block-quantized
    num_blocks: int
    block_size: int
    attn_backend: AttentionBackend  # the target's


@dataclass
class LoadedDraft:
    kind: str
    runner: Any  # what its proposers run on (ProposerContext.draft)
    module: nn.Module  # the weights the kernel tuner times
    tune_name: str  # its tuning table's name
    traced: nn.Module | None = None  # each forward is one "draft_forward" span


class DraftSource(Protocol):
    kind: str
    path: str

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int: ...

    def build(self, target: DraftTarget) -> LoadedDraft: ...


def open_draft(path: str, target: ModelConfig | None = None) -> DraftSource:
    """The draft at ``path`` (already located: a local folder or file). A folder written by
    ``specserve distill --method eagle`` is an EAGLE head; anything else a draft model, one
    with another tokenizer when its vocabulary's size differs from ``target``'s (a draft
    distilled for the target, which shares its embeddings, never is)."""
    from specserve.draft.eagle_head import is_eagle_dir

    if is_eagle_dir(path):
        return EagleHeadSource(path)
    source = DraftModelSource(path)
    if target is not None and source.weights.config.vocab_size != target.vocab_size:
        meta = getattr(source.weights.hf_config, "specserve_draft", None) or {}
        if meta.get("embeddings") != "target":
            from specserve.draft.text_source import TextDraftSource, check_has_tokenizer

            check_has_tokenizer(path, source.weights.config.vocab_size, target.vocab_size)
            return TextDraftSource(path, source.weights)
    return source


def draft_backend(target: DraftTarget) -> AttentionBackend:
    backend = target.attn_backend
    return backend.for_float32_caches() if isinstance(backend, CpuPagedAttention) else backend


class DraftModelSource:
    kind = DRAFT_MODEL

    def __init__(self, path: str) -> None:
        from specserve.target.loader import read_weights

        self.path = path
        self.weights = read_weights(path)

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        from specserve.target.model_runner import ModelRunner

        return ModelRunner.bytes_per_block(self.weights.config, block_size, dtype)

    def build(self, target: DraftTarget) -> LoadedDraft:
        from specserve.target.loader import build_model, check_draft_compatible
        from specserve.target.model_runner import ModelRunner
        from specserve.target.quantize import quantize_model

        config, model = build_model(self.weights, target.dtype, target.device,
                                    shared_embeddings=target.model.embed_tokens.weight)
        # A quantized target's draft runs Q8_0 blocks and the same fused kernels: a float32
        # draft step would cost a third of a quantized target step and eat the gain.
        quantize_model(model, "int8" if target.quantized else "none", self.path)
        check_draft_compatible(target.config, config, target.tokenizer,
                               target.tokenizer_of(self.path))
        # Same block ids, separate KV tensors: one block table serves both models. The KV is
        # allocated when the draft first runs: a server whose requests all run with
        # speculation off never commits or touches it.
        runner = ModelRunner(config, model, num_blocks=target.num_blocks,
                             block_size=target.block_size, dtype=target.dtype,
                             device=target.device, attn_backend=draft_backend(target),
                             lazy_kv=True)
        return LoadedDraft(self.kind, runner, model, "draft", traced=model)


class EagleHeadSource:
    kind = EAGLE_HEAD

    def __init__(self, path: str) -> None:
        from specserve.target.loader import load_hf_config

        self.path = path
        self.config = ModelConfig.from_hf(load_hf_config(Path(path)))

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        from specserve.draft.eagle_head import EagleRunner

        return EagleRunner.bytes_per_block(self.config, block_size, dtype)

    def build(self, target: DraftTarget) -> LoadedDraft:
        from specserve.draft.eagle_head import EagleRunner, load_head

        head = load_head(self.path, target.config, target.model.embed_tokens.weight,
                         target.dtype, target.device)
        if target.quantized:
            # As the draft model: Q8_0 blocks and the fused kernels, so a drafting step costs
            # a small fraction of a quantized target step, not a third of it.
            head.quantize("q8_0")
        runner = EagleRunner(head, num_blocks=target.num_blocks, block_size=target.block_size,
                             dtype=target.dtype, device=target.device,
                             backend=draft_backend(target))
        return LoadedDraft(self.kind, runner, head, "eagle")
