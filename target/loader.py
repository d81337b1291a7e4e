"""Weight loading: a local Hugging Face folder (config.json + safetensors) or a GGUF file.

A GGUF file's metadata decides its architecture and config as llama.cpp's loader reads it
(``target/gguf_arch.py``, over the one-pass reader ``target/gguf_file.py``). Served with its own
block types (``--quantization auto`` on CPU: ``build_model(native_blocks=True)``), each
projection and the embedding table are built from the file's blocks and only the rest is
dequantized; the built layers are cached per file (``target/block_cache.py``). On the float
path (``--quantization none``, ``int4``, ``int8``) every tensor is dequantized to float32 under
Hugging Face names (q/k rows un-permuted); the first such load writes what it produced into a
cache folder, an ordinary HF folder that later loads take in about a second:

    $SPECSERVE_CACHE_DIR (default ~/.cache/specserve)/gguf-<sha256(abs path, size, mtime,
        transformers and gguf versions)>/
        weights/    config.json + model.safetensors (float32, exactly as dequantized)
        blocks-N/   the built block layers (target/block_cache.py)
        tokenizer/  tokenizer files (written by specserve.engine.models.load_tokenizer)

Any change to the GGUF file (size or mtime) or to the converting libraries gives a new key, so
a stale cache is never read. Each subfolder is written to a temporary name and renamed into
place, so a crash or a concurrent loader never leaves a half-written cache behind.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specserve.core.config import DTYPES
from specserve.core.errors import ModelLoadError
from specserve.core.paths import cache_root
from specserve.target.config import ModelConfig, check_architecture
from specserve.target.model import CausalLM

if TYPE_CHECKING:
    from specserve.target.gguf_file import GGUFFile

log = logging.getLogger(__name__)

_CACHE_FORMAT = "2"  # 2: configs from the GGUF metadata (target/gguf_arch.py)


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """True for an existing file that starts with the GGUF magic bytes."""
    p = Path(path)
    if not p.is_file():
        return False
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def gguf_cache_dir(path: str | os.PathLike[str]) -> Path:
    """The cache folder of one GGUF file; its name changes whenever the file does."""
    import gguf
    import transformers

    p = Path(path).resolve()
    st = p.stat()
    key = (
        f"{p}|{st.st_size}|{st.st_mtime_ns}|format {_CACHE_FORMAT}"
        f"|transformers {transformers.__version__}|gguf {_version(gguf)}"
    )
    return cache_root() / f"gguf-{hashlib.sha256(key.encode()).hexdigest()[:24]}"


def write_dir_atomically(final: Path, fill: Callable[[Path], None]) -> bool:
    """Runs ``fill(tmp)`` on a fresh temporary folder next to ``final`` and renames it to
    ``final``. Best effort: a failure (read-only or full disk, a concurrent writer that won) is
    logged and returns False; the caller goes on with what it has in memory."""
    tmp: Path | None = None
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f"{final.name}.tmp-", dir=final.parent))
        fill(tmp)
        os.rename(tmp, final)
        return True
    except Exception as exc:  # the cache is an optimization: never fail a load because of it
        log.warning("could not write cache folder %s: %s", final, exc)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return False


def load_weights(path: str | os.PathLike[str]) -> tuple[Any, dict[str, torch.Tensor]]:
    """Returns (transformers config, state dict with Hugging Face names) for a local HF folder
    or a GGUF file. Raises ``ModelLoadError`` (or its subclass ``UnsupportedArchitectureError``)
    with a message saying what to pass instead."""
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(
            f"model path not found: {path}; pass a local HF folder, a .gguf file, or a hub id"
        )
    if p.is_file():
        if not is_gguf(p):
            raise ModelLoadError(
                f"{path} is neither a GGUF file nor a folder; pass a local HF folder "
                f"(config.json + *.safetensors) or a .gguf file"
            )
        return _load_gguf(p)
    return _load_folder(p)


def load_hf_config(folder: Path) -> Any:
    """The transformers config of a local HF folder, checked against what we support."""
    from transformers import AutoConfig

    config_file = folder / "config.json"
    if not config_file.is_file():
        ggufs = sorted(folder.glob("*.gguf"))
        hint = f" (to load {ggufs[0].name}, pass the file itself)" if ggufs else ""
        raise ModelLoadError(f"no config.json in model folder {folder}{hint}")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"{config_file} is not valid JSON: {exc}") from exc
    check_architecture(raw.get("architectures"), str(raw.get("model_type", "")))
    try:
        hf_config = AutoConfig.from_pretrained(folder)
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"cannot read {config_file}: {exc}") from exc
    ModelConfig.from_hf(hf_config)
    return hf_config


def _load_folder(folder: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    hf_config = load_hf_config(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shard_names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        shards = [folder / name for name in shard_names]
        absent = [s.name for s in shards if not s.is_file()]
        if absent:
            raise ModelLoadError(f"{index} names missing shard files: {', '.join(absent)}")
    else:
        shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise ModelLoadError(
            f"no *.safetensors weights in model folder {folder} (pytorch_model.bin checkpoints "
            f"are not supported: re-save them with save_pretrained(safe_serialization=True))"
        )
    state_dict: dict[str, torch.Tensor] = {}
    for shard in shards:
        state_dict.update(load_file(shard))
    return hf_config, state_dict


def _load_gguf(path: Path) -> tuple[Any, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file, save_file

    weights_dir = gguf_cache_dir(path) / "weights"
    if (weights_dir / "model.safetensors").is_file():
        t0 = time.perf_counter()
        hf_config = load_hf_config(weights_dir)
        state_dict = load_file(weights_dir / "model.safetensors")
        log.info("loaded %s from cache %s in %.1fs", path, weights_dir, time.perf_counter() - t0)
        return hf_config, state_dict

    from specserve.target.gguf_arch import gguf_state_dict, hf_config_from_gguf
    from specserve.target.gguf_file import GGUFFile

    t0 = time.perf_counter()
    reader = GGUFFile(path)
    hf_config = hf_config_from_gguf(reader)  # general.architecture and its keys decide
    ModelConfig.from_hf(hf_config)  # refuse unsupported models before dequantizing anything
    state_dict = gguf_state_dict(reader, hf_config)
    log.info("dequantized %s in %.1fs", path, time.perf_counter() - t0)

    def fill(tmp: Path) -> None:
        hf_config.save_pretrained(tmp)
        save_file(state_dict, tmp / "model.safetensors", metadata={"format": "pt"})

    if write_dir_atomically(weights_dir, fill):
        (weights_dir.parent / "source.txt").write_text(f"{path.resolve()}\n")
    return hf_config, state_dict


@dataclass
class Weights:
    """A model's files opened, not yet built: the transformers config, and the state dict with
    Hugging Face names once read (``tensors``). A GGUF file is opened without reading its
    tensors (``gguf``): ``build_model`` takes its projections as blocks, or dequantizes them
    all when the model runs dense. ``config`` is what the resolver reads (context length, KV
    shape); ``build_model`` consumes the tensors."""

    path: Path
    hf_config: Any
    tensors: dict[str, torch.Tensor] | None = None
    gguf: GGUFFile | None = None

    @functools.cached_property
    def config(self) -> ModelConfig:
        return ModelConfig.from_hf(self.hf_config)

    def take_state_dict(self) -> dict[str, torch.Tensor]:
        """Every tensor, dequantized to float (a GGUF through the float cache); the model owns
        them from here on."""
        tensors = self.tensors if self.tensors is not None else _load_gguf(self.path)[1]
        self.tensors = {}
        return tensors


def read_weights(path: str | os.PathLike[str]) -> Weights:
    p = Path(path)
    if p.is_file() and is_gguf(p):
        from specserve.target.gguf_arch import hf_config_from_gguf
        from specserve.target.gguf_file import GGUFFile

        file = GGUFFile(p)
        hf_config = hf_config_from_gguf(file)  # general.architecture and its keys decide
        weights = Weights(p, hf_config, None, file)
        _ = weights.config  # refuse unsupported models before anything else
        return weights
    hf_config, state_dict = load_weights(path)
    return Weights(p, hf_config, state_dict)


def model_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A dtype or one of ``DTYPES``' names. ``auto`` is the resolver's to decide
    (specserve/engine/resolve.py), not the loader's."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r}; choose {', '.join(DTYPES)} (the engine's "
                             f"resolver decides auto)")
    return DTYPES[dtype]


# Distilled drafts (``specserve distill``) store the target token id of each row of their
# reduced output head under this name, and may leave out the embeddings they share with the
# target (config.json: "specserve_draft": {"embeddings": "target", ...}).
HEAD_IDS_KEY = "specserve.head_token_ids"


def build_model(
    source: str | os.PathLike[str] | Weights,
    dtype: torch.dtype | str,
    device: torch.device | str,
    shared_embeddings: torch.Tensor | None = None,
    *,
    native_blocks: bool = False,
) -> tuple[ModelConfig, CausalLM]:
    """Loads a path (or weights already read, which this consumes) into our ``CausalLM`` in
    ``dtype`` on ``device`` (eval mode, no grads). ``ModelConfig.eos_token_ids`` also holds the
    folder's generation_config.json EOS ids. ``shared_embeddings``: the target's embedding
    table, for drafts that share it. ``native_blocks`` (a GGUF, ``--quantization auto`` on
    CPU): each projection of a type with a block kernel is built from the file's blocks,
    never dequantized; the rest (norms, embeddings, projections of other types) as float."""
    weights = source if isinstance(source, Weights) else read_weights(source)
    path, hf_config = weights.path, weights.hf_config
    model_config = weights.config
    extra_eos = _generation_eos_ids(Path(path))
    if extra_eos:
        merged = tuple(dict.fromkeys(model_config.eos_token_ids + extra_eos))
        model_config = dataclasses.replace(model_config, eos_token_ids=merged)
    blocks: dict[str, Any] = {}
    native = native_blocks and weights.gguf is not None
    if native:
        from specserve.target import block_cache

        cached = block_cache.load(path, model_config, model_dtype(dtype))
        if cached is not None:
            weights.tensors = {}
            return model_config, cached.to(device).eval()
        from specserve.target.gguf_arch import gguf_state_dict
        from specserve.target.quantize import file_block_weights

        t0 = time.perf_counter()
        untied = not model_config.tie_word_embeddings
        blocks, consumed = file_block_weights(weights.gguf, model_config, untied)
        state_dict = gguf_state_dict(weights.gguf, hf_config, skip=frozenset(consumed))
        weights.tensors = {}
        log.info("read %s: %d projections as the file's blocks, %d tensors dequantized, in "
                 "%.1fs", path, len(blocks), len(state_dict), time.perf_counter() - t0)
    else:
        state_dict = weights.take_state_dict()
    head_ids = state_dict.pop(HEAD_IDS_KEY, None)
    if head_ids is not None and (
        head_ids.dim() != 1 or int(head_ids.min()) < 0
        or int(head_ids.max()) >= model_config.vocab_size
    ):
        raise ModelLoadError(f"{path}: {HEAD_IDS_KEY} must be token ids of the vocabulary")
    draft_meta = getattr(hf_config, "specserve_draft", None) or {}
    if draft_meta.get("embeddings") == "target":
        want = (model_config.vocab_size, model_config.hidden_size)
        if shared_embeddings is None:
            raise ModelLoadError(
                f"{path} is a distilled draft that shares its target's embeddings; load it as "
                f"--draft-model next to its target"
            )
        if tuple(shared_embeddings.shape) != want:
            raise ModelLoadError(
                f"draft {path} was distilled for a target with a vocabulary of {want[0]} tokens "
                f"and hidden size {want[1]}, this target has {tuple(shared_embeddings.shape)}; "
                f"distill a draft for this target (`specserve distill`)"
            )
        state_dict["model.embed_tokens.weight"] = shared_embeddings
    model = CausalLM(model_config, dtype=model_dtype(dtype), device="meta",
                     head_token_ids=head_ids)
    # block weights fill these; the tied table heads a tied model and is no parameter
    elsewhere = frozenset(f"{name}.weight" for name in blocks
                          if name != "lm_head" or model.lm_head is not None)
    model.load_hf_state_dict(state_dict, elsewhere)
    del state_dict
    if blocks:
        from specserve.target.quantize import install_blocks

        install_blocks(model, blocks)
    if native:
        block_cache.store(path, model)
    model.to(device).eval()
    return model_config, model


def _generation_eos_ids(path: Path) -> tuple[int, ...]:
    gen = path / "generation_config.json"
    if not gen.is_file():
        return ()
    value = json.loads(gen.read_text()).get("eos_token_id")
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(int(v) for v in value)


def _version(module: Any) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(module.__name__)
    except PackageNotFoundError:
        return "unknown"



def check_draft_compatible(
    target: ModelConfig, draft: ModelConfig, target_tokenizer: Any, draft_tokenizer: Any
) -> None:
    """A draft model must speak the target's vocabulary: same vocab size and, when both ship a
    tokenizer, the same token -> id table. Anything else would verify meaningless ids."""
    fix = ("give a draft with the target's tokenizer (`specserve distill` makes one), or a "
           "small model that is not distilled for another target: it runs as text_draft")
    if draft.vocab_size != target.vocab_size:
        raise ModelLoadError(
            f"the draft model's vocabulary ({draft.vocab_size} tokens) differs from the "
            f"target's ({target.vocab_size}): it has another tokenizer; {fix}"
        )
    if target_tokenizer is not None and draft_tokenizer is not None:
        if target_tokenizer.get_vocab() != draft_tokenizer.get_vocab():
            raise ModelLoadError(
                f"the draft model's tokenizer differs from the target's (same size, different "
                f"token ids); {fix}"
            )
