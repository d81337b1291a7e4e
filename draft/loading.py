"""Loading what model proposers draft with: a draft language model or an EAGLE head.

The engine names neither. It opens the ``--draft-model`` path with ``open_draft`` before it
resolves its configuration (the pool is sized for the draft's KV too: ``kv_bytes_per_block``),
then builds it beside the loaded target (``build``).

What ``--draft-model`` accepts is the table ``DRAFT_KINDS``: each kind says how it is recognised
(``detect``, from the path alone), what it is and how to give one (for messages), which runner
its proposers use (``runs_as``: a key of ``RUNS_AS``, what ``ProposerSpec.needs_draft`` names)
and how it is opened. ``open_draft`` takes the first kind that recognises the path, so a kind
recognised by a marker inside a folder (an EAGLE head's config key) comes before the plain
folder it would also pass for. A new kind of draft is one entry here and its ``DraftSource``.

Each source knows its own rules: a draft model shares the target's tokenizer (and a distilled
one its embeddings), runs its GGUF file's own blocks or, from a Hugging Face folder beside a
quantized target, Q8_0 blocks, and gets its own ``ModelRunner``; an EAGLE head is
checked against the target it was trained for and gets an ``EagleRunner``. Both keep float32
KV caches (their numbers only move acceptance), so they run the target's attention form
widened to float32 caches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from specserve.core.errors import ModelLoadError
from specserve.kernels.cpu_paged import CpuPagedAttention
from specserve.kernels.registry import AttentionBackend
from specserve.target.config import ModelConfig
from specserve.target.model import CausalLM

# What a loaded draft runs as: the runner its proposers drive (``ProposerSpec.needs_draft``).
DRAFT_MODEL, EAGLE_HEAD, TEXT_DRAFT = "draft_model", "eagle_head", "text_draft"
RUNS_AS = {DRAFT_MODEL: "a draft model", EAGLE_HEAD: "an EAGLE head",
           TEXT_DRAFT: "a draft model with another tokenizer"}


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
    kind: str  # what it runs as: a key of RUNS_AS
    path: str

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int: ...

    def build(self, target: DraftTarget) -> LoadedDraft: ...


@dataclass(frozen=True)
class DraftKind:
    """One kind of file or folder ``--draft-model`` accepts."""

    name: str  # "gguf"
    runs_as: str  # a key of RUNS_AS
    what: str  # "a draft model in a GGUF file"
    how: str  # how to give one on the command line
    detect: Callable[[Path], bool]  # recognises the kind from the path alone, reading little
    open: Callable[[str], DraftSource]


def _is_eagle_head(path: Path) -> bool:
    from specserve.draft.eagle_head import is_eagle_dir

    return is_eagle_dir(path)


def _is_gguf(path: Path) -> bool:
    from specserve.target.loader import is_gguf

    return is_gguf(path)


def _is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file()


def _open_draft_model(path: str) -> DraftSource:
    return DraftModelSource(path)


def _open_eagle_head(path: str) -> DraftSource:
    return EagleHeadSource(path)


def _is_eagle3_head(path: Path) -> bool:
    from specserve.draft.eagle3_source import is_eagle3_dir

    return is_eagle3_dir(str(path))


def _open_eagle3_head(path: str) -> DraftSource:
    from specserve.draft.eagle3_source import Eagle3HeadSource

    return Eagle3HeadSource(path)


# Detected in this order, first match wins: specific markers before the folder they sit in.
DRAFT_KINDS: tuple[DraftKind, ...] = (
    DraftKind("eagle3_head", EAGLE_HEAD, "a published EAGLE-3 head",
              "--draft-model DIR, an EAGLE-3 head folder in the EAGLE/SpecForge, vLLM/AngelSlim "
              "or speculators layout (what `specserve distill --method eagle` writes)",
              _is_eagle3_head, _open_eagle3_head),
    DraftKind("eagle_head", EAGLE_HEAD, "an EAGLE head",
              "--draft-model DIR, a head folder written by `specserve distill --method eagle`",
              _is_eagle_head, _open_eagle_head),
    DraftKind("gguf", DRAFT_MODEL, "a draft model in a GGUF file",
              "--draft-model FILE.gguf, a small LM with the target's tokenizer",
              _is_gguf, _open_draft_model),
    DraftKind("hf_folder", DRAFT_MODEL, "a draft model folder",
              "--draft-model DIR, a Hugging Face folder (config.json + *.safetensors) of a small "
              "LM with the target's tokenizer", _is_hf_folder, _open_draft_model),
)


# A draft model whose vocabulary differs from the target's runs as a text draft: decided when
# the target is known (``open_draft``), not by the path.
_TEXT_DRAFT_HOW = ("--draft-model PATH, a small LM with its own tokenizer, a GGUF file or an HF "
                   "folder (`default`: the built-in SmolLM2-135M-Instruct)")


def how_to_give(runs_as: str) -> str:
    """How to give a draft that runs as ``runs_as``, every kind that does: for messages."""
    if runs_as == TEXT_DRAFT:
        return _TEXT_DRAFT_HOW
    return "; or ".join(k.how for k in DRAFT_KINDS if k.runs_as == runs_as)


def detect_kind(path: str) -> DraftKind:
    """The kind of draft at ``path`` (already located: a local folder or file). Raises
    ``ModelLoadError`` naming what is accepted when no kind recognises it."""
    p = Path(path)
    for kind in DRAFT_KINDS:
        if kind.detect(p):
            return kind
    ggufs = sorted(p.glob("*.gguf")) if p.is_dir() else []
    hint = f" (to load {ggufs[0].name}, pass the file itself)" if ggufs else ""
    accepted = "; ".join(f"{k.what}: {k.how}" for k in DRAFT_KINDS)
    raise ModelLoadError(f"draft {path} is none of the drafts --draft-model accepts{hint}; "
                         f"give {accepted}")


def open_draft(path: str, target: ModelConfig | None = None, *,
               same_tokens: Callable[[str], bool] | None = None,
               cross_tokenizer: bool = True) -> DraftSource:
    """The draft at ``path``, opened (read, not built) as the kind ``detect_kind`` finds. A
    draft model with another tokenizer than ``target``'s (another vocabulary size, or the same
    size where ``same_tokens(path)`` says its token -> id table is not the target's) runs as a
    text draft when ``cross_tokenizer``; otherwise it is refused here. One distilled for the
    target, which shares its embeddings, never runs as a text draft."""
    source = detect_kind(path).open(path)
    if target is None or not isinstance(source, DraftModelSource):
        return source
    draft = source.weights.config
    meta = getattr(source.weights.hf_config, "specserve_draft", None) or {}
    if meta.get("embeddings") == "target":
        return source  # checked at build, with the distilled draft's message
    if draft.vocab_size == target.vocab_size:
        if same_tokens is None or same_tokens(path):
            return source
        differs = "the same size with other token ids"
    else:
        differs = f"{draft.vocab_size} tokens against the target's {target.vocab_size}"
    if not cross_tokenizer:
        raise ModelLoadError(
            f"draft {path} has another tokenizer than the target ({differs}) and cross-"
            f"tokenizer drafting is off (--no-cross-tokenizer-draft): drop that flag to run "
            f"it as text_draft, or give a draft with the target's tokenizer (`specserve "
            f"distill` makes one)")
    from specserve.draft.text_source import TextDraftSource, check_has_tokenizer

    check_has_tokenizer(path, draft.vocab_size, target.vocab_size)
    return TextDraftSource(path, source.weights)


def draft_backend(target: DraftTarget) -> AttentionBackend:
    backend = target.attn_backend
    return backend.for_float32_caches() if isinstance(backend, CpuPagedAttention) else backend


class DraftModelSource:
    """A draft language model with the target's tokenizer: a Hugging Face folder or a GGUF
    file (the target's loader reads both)."""

    kind = DRAFT_MODEL

    def __init__(self, path: str) -> None:
        from specserve.target.loader import is_gguf, read_weights

        self.path = path
        self.gguf = is_gguf(path)
        with _about_draft(path):
            self.weights = read_weights(path)

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        from specserve.target.model_runner import ModelRunner

        return ModelRunner.bytes_per_block(self.weights.config, block_size, dtype)

    def blocks(self, target: DraftTarget) -> str:
        """The ``quantize_model`` mode of the draft's projections beside ``target``."""
        if self.gguf:
            # A GGUF draft runs the blocks its file holds, as a GGUF target does (each tensor
            # of a type with a kernel as stored, never requantized through float; others
            # dense), wherever those kernels run: on CPU, in float32. A tensor without a
            # batch-invariant kernel needs no caveat here: the draft's numbers only move
            # acceptance, and the target verifies every token.
            cpu_float32 = target.device.type == "cpu" and target.dtype == torch.float32
            return "gguf" if cpu_float32 else "none"
        # A quantized target's draft runs Q8_0 blocks and the same fused kernels: a float32
        # draft step would cost a third of a quantized target step and eat the gain.
        return "int8" if target.quantized else "none"

    def build(self, target: DraftTarget) -> LoadedDraft:
        from specserve.target.loader import build_model, check_draft_compatible
        from specserve.target.model_runner import ModelRunner
        from specserve.target.quantize import quantize_model

        blocks = self.blocks(target)
        with _about_draft(self.path):  # a distilled draft says first if it is another's
            # only a distilled draft shares the table (and a block table is dequantized whole
            # when read as a float tensor: 545 MB for Qwen2.5's)
            meta = getattr(self.weights.hf_config, "specserve_draft", None) or {}
            shared = target.model.embed_tokens.weight if meta.get("embeddings") == "target" \
                else None
            config, model = build_model(self.weights, target.dtype, target.device,
                                        shared_embeddings=shared, native_blocks=blocks == "gguf")
            check_draft_compatible(target.config, config, target.tokenizer,
                                   target.tokenizer_of(self.path))
        quantize_model(model, blocks, self.path)
        # Same block ids, separate KV tensors: one block table serves both models. The KV is
        # allocated when the draft first runs: a server whose requests all run with
        # speculation off never commits or touches it.
        runner = ModelRunner(config, model, num_blocks=target.num_blocks,
                             block_size=target.block_size, dtype=target.dtype,
                             device=target.device, attn_backend=draft_backend(target),
                             lazy_kv=True)
        return LoadedDraft(self.kind, runner, model, "draft", traced=model)


@contextlib.contextmanager
def _about_draft(path: str) -> Iterator[None]:
    """A model error raised while reading or checking a draft names the draft: the same loader
    reads the target, and its messages alone would not say which model was refused."""
    try:
        yield
    except ModelLoadError as exc:
        raise type(exc)(f"draft {path}: {exc}") from None


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
