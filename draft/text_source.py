"""Loading a draft model with another tokenizer (the ``text_draft`` kind of
``specserve.draft.loading``): its own embeddings, its own tokenizer and its own KV.

It cannot share the target's block table (the same text is a different number of tokens to
it), so its ``ModelRunner`` gets a pool of its own with as many blocks as the target's; the
resolver sizes the memory budget for both (``kv_bytes_per_block``). ``TextDraftProposer``
hands the blocks out per sequence. The KV is allocated when the draft first runs. The tokens
both vocabularies share (``VocabIntersection``, for token-level intersection drafting) are
found when a request first drafts that way.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specserve.core.errors import ModelLoadError
from specserve.draft.loading import TEXT_DRAFT, DraftTarget, LoadedDraft, draft_backend
from specserve.target.loader import Weights, is_gguf

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_has_tokenizer(path: str, draft_vocab: int, target_vocab: int) -> None:
    """A draft with another vocabulary drafts text: without a tokenizer it cannot."""
    p = Path(path)
    if is_gguf(p):
        from specserve.target.gguf_file import GGUFFile

        found = "tokenizer.ggml.model" in GGUFFile(p).fields
    else:
        found = any((p / n).is_file() for n in _TOKENIZER_FILES)
    if not found:
        raise ModelLoadError(
            f"draft model vocabulary ({draft_vocab} tokens) differs from the target's "
            f"({target_vocab}) and {path} carries no tokenizer: a draft with another "
            f"vocabulary drafts text, so it needs its own tokenizer (or use a draft trained "
            f"with the target's tokenizer: `specserve distill` makes one)")


class TextDraftSource:
    kind = TEXT_DRAFT

    def __init__(self, path: str, weights: Weights) -> None:
        self.path = path
        self.weights = weights

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        from specserve.target.model_runner import ModelRunner

        return ModelRunner.bytes_per_block(self.weights.config, block_size, dtype)

    def build(self, target: DraftTarget) -> LoadedDraft:
        from specserve.draft.text_draft import TextDraft
        from specserve.target.loader import build_model
        from specserve.target.model_runner import ModelRunner
        from specserve.target.quantize import quantize_model

        vocab = (self.weights.config.vocab_size, target.config.vocab_size)
        tokenizer = target.tokenizer_of(self.path)
        if tokenizer is None or target.tokenizer is None:
            whose = "the draft" if tokenizer is None else "the target"
            raise ModelLoadError(
                f"draft model {self.path}: its vocabulary ({vocab[0]} tokens) differs from the "
                f"target's ({vocab[1]}), and {whose} carries no tokenizer: a draft with another "
                f"vocabulary drafts text, so both models need their tokenizer (or use a draft "
                f"trained with the target's tokenizer: `specserve distill` makes one)")
        # Beside a quantized target the draft runs blocks too: its own GGUF blocks when it is
        # one (built from them, never through float), else Q8_0, on the same fused kernels.
        own_blocks = target.quantized and is_gguf(self.path)
        config, model = build_model(self.weights, target.dtype, target.device,
                                    native_blocks=own_blocks)
        if target.quantized:
            quantize_model(model, "gguf" if own_blocks else "int8", self.path)
        runner = ModelRunner(config, model, num_blocks=target.num_blocks,
                             block_size=target.block_size, dtype=target.dtype,
                             device=target.device, attn_backend=draft_backend(target),
                             lazy_kv=True)
        draft = TextDraft(runner, tokenizer, target.tokenizer,
                          frozenset(config.eos_token_ids) | _tokenizer_eos(tokenizer),
                          config.vocab_size, target.config.vocab_size)
        return LoadedDraft(self.kind, draft, model, "text_draft", traced=model)


def _tokenizer_eos(tokenizer: object) -> frozenset[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return frozenset() if eos is None else frozenset({int(eos)})
