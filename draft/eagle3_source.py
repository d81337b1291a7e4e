"""Opening a published EAGLE-3 head folder (``--draft-model DIR``) and building it beside the
target: layout from ``config.json`` (draft/eagle3_layouts.py), weights renamed onto
``Eagle3Head``, checked against the target it must read, run by ``EagleRunner`` for the
``eagle`` proposer (the same KV scheme and drafting chain as our own heads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specserve.core.errors import ModelLoadError
from specserve.draft.eagle3_head import Eagle3Head
from specserve.draft.eagle3_layouts import (
    Eagle3Spec,
    detect_layout,
    draft_to_target,
    map_weights,
    read_spec,
)
from specserve.draft.eagle_head import EagleMeta
from specserve.draft.loading import EAGLE_HEAD, DraftTarget, LoadedDraft, draft_backend
from specserve.target.config import ModelConfig


def read_config(path: str | Path) -> dict[str, Any] | None:
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    try:
        raw = json.loads(config.read_text())
    except json.JSONDecodeError:
        return None
    return raw if isinstance(raw, dict) else None


def is_eagle3_dir(path: str | Path | None) -> bool:
    """True when ``path`` is a folder whose config.json names a published EAGLE-3 layout."""
    raw = None if path is None else read_config(path)
    return raw is not None and detect_layout(raw) is not None


def layer_config(spec: Eagle3Spec) -> ModelConfig:
    """The midlayer's ModelConfig (one decoder layer of the architecture the config names)."""
    from transformers import AutoConfig

    fields = {k: v for k, v in spec.layer_config.items()
              if k not in ("architectures", "model_type", "transformers_version")}
    fields["num_hidden_layers"] = 1
    if fields.get("layer_types"):
        fields["layer_types"] = fields["layer_types"][-1:]
    try:
        hf = AutoConfig.for_model(spec.layer_config["model_type"], **fields)
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"{spec.name} head: cannot read its layer config: {exc}") from exc
    hf.architectures = None  # the model_type decides (check_architecture)
    return ModelConfig.from_hf(hf)


def check_target(spec: Eagle3Spec, folder: Path, target: ModelConfig) -> tuple[int, ...]:
    """The target layers the head reads; ``ModelLoadError`` saying what the head was trained
    for when this target is not it."""
    trained = f"hidden size {spec.target_hidden}, vocabulary {spec.target_vocab}"
    if spec.verifier:
        trained += f" ({spec.verifier})"
    if (spec.target_hidden, spec.target_vocab) != (target.hidden_size, target.vocab_size):
        raise ModelLoadError(
            f"EAGLE-3 head {folder} ({spec.name}) was trained for a target with {trained}; "
            f"this target has hidden size {target.hidden_size}, vocabulary "
            f"{target.vocab_size}: use a head trained for this target (or train one with "
            f"`specserve distill --method eagle`)")
    layers = spec.target_layers(target.num_layers)
    if not all(0 <= i < target.num_layers for i in layers) or len(set(layers)) != len(layers):
        raise ModelLoadError(
            f"EAGLE-3 head {folder} ({spec.name}) reads target layers {list(layers)} (our "
            f"0-based layer outputs), which a {target.num_layers}-layer target lacks; it was "
            f"trained for a deeper target ({trained})")
    return layers


def load_eagle3(path: str | Path, target: ModelConfig, embed: torch.Tensor, dtype: torch.dtype,
                device: torch.device | str) -> Eagle3Head:
    from safetensors.torch import load_file

    folder = Path(path)
    raw = read_config(folder)
    if raw is None:
        raise ModelLoadError(f"{folder}/config.json is missing or not valid JSON")
    spec = read_spec(raw)
    layers = check_target(spec, folder, target)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"EAGLE-3 head {folder} has no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(f))
    weights = map_weights(tensors, spec)
    config = layer_config(spec)
    own_embed = weights.embed
    if own_embed is None and config.hidden_size != target.hidden_size:
        raise ModelLoadError(
            f"EAGLE-3 head {folder} has hidden size {config.hidden_size} and no embed_tokens; "
            f"the target's embeddings are {target.hidden_size} wide")
    meta = EagleMeta(layers, target.num_layers, spec.target_hidden, spec.target_vocab)
    table = (own_embed if own_embed is not None else embed).to(device=device, dtype=dtype)
    head = Eagle3Head(config, meta, draft_to_target(weights, spec), table, spec.options,
                      dtype=dtype, device=device)
    own = {k for k in head.state_dict() if "rotary" not in k and k != "head_token_ids"}
    if own != set(weights.state):
        raise ModelLoadError(
            f"EAGLE-3 head {folder} ({spec.name}): weights {sorted(own ^ set(weights.state))[:6]} "
            f"do not match the head its config describes")
    try:
        head.load_state_dict(weights.state, strict=False)
    except RuntimeError as exc:  # shapes: fc width = number of aux layers x target hidden
        raise ModelLoadError(f"EAGLE-3 head {folder} ({spec.name}): {exc}") from exc
    return head.eval().requires_grad_(False)


class Eagle3HeadSource:
    """A published EAGLE-3 head folder; builds an ``EagleRunner`` like our own head folders."""

    kind = EAGLE_HEAD

    def __init__(self, path: str) -> None:
        raw = read_config(path)
        assert raw is not None  # open_draft checked is_eagle3_dir
        self.path = path
        self.spec = read_spec(raw)
        self.config = layer_config(self.spec)

    def kv_bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        from specserve.draft.eagle_head import EagleRunner

        return EagleRunner.bytes_per_block(self.config, block_size, dtype)

    def build(self, target: DraftTarget) -> LoadedDraft:
        from specserve.draft.eagle_head import EagleRunner

        head = load_eagle3(self.path, target.config, target.model.embed_tokens.weight,
                           target.dtype, target.device)
        if target.quantized:
            head.quantize("q8_0")  # as our own heads: Q8_0 blocks and the fused kernels
        runner = EagleRunner(head, num_blocks=target.num_blocks,  # type: ignore[arg-type]
                             block_size=target.block_size, dtype=target.dtype,
                             device=target.device, backend=draft_backend(target))
        return LoadedDraft(self.kind, runner, head, "eagle")
