"""`specserve distill --method eagle`: teacher shards -> head vocabulary -> EAGLE head -> training
-> OUT/eagle (a folder for --draft-model, in the speculators
layout vLLM and llama.cpp read too).

    DATA (default OUT/data/train)  teacher shards (specserve.distill.data.TeacherData; only
                                   tokens and prompt_lens are read). Missing: generated first, as
                                   `specserve distill --data-only` would.
    held-out                       shards in DATA's sibling folder ``heldout`` when it has any,
                                   else every 20th sequence of DATA (never trained on)
    OUT/eagle_checkpoint.pt        resumable training state
    OUT/eagle_curve.jsonl          held-out metrics against response tokens trained on
    OUT/eagle/                     the finished head
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from specserve.core.errors import ConfigError
from specserve.distill.data import TeacherData
from specserve.distill.eagle_train import EagleTrainConfig

log = logging.getLogger(__name__)

_HELDOUT_EVERY = 20


@dataclass(frozen=True)
class EagleConfig:
    out: Path
    target: str | None = None  # None: the built-in default model
    data: Path | None = None  # None: OUT/data/train
    head_vocab_size: int = 8192
    target_layers: tuple[int, ...] | None = None  # None: low, middle, high (default_...)
    max_heldout_sequences: int = 64
    train: EagleTrainConfig = field(default_factory=EagleTrainConfig)


def split_data(data_dir: Path) -> tuple[TeacherData, TeacherData]:
    """(train, held-out) teacher data from ``data_dir`` and its sibling ``heldout``."""
    data = TeacherData.load_dir(data_dir)
    heldout_dir = data_dir.parent / "heldout"
    if heldout_dir != data_dir and any(heldout_dir.glob("shard-*.pt")):
        return data, TeacherData.load_dir(heldout_dir)
    train, val = TeacherData(), TeacherData()
    for i in range(len(data)):
        part = val if i % _HELDOUT_EVERY == _HELDOUT_EVERY - 1 else train
        part.tokens.append(data.tokens[i])
        part.prompt_lens.append(data.prompt_lens[i])
        part.ids.append(data.ids[i] if i < len(data.ids) else str(i))
    return train, val


def _cap(data: TeacherData, n: int) -> TeacherData:
    return TeacherData(tokens=data.tokens[:n], prompt_lens=data.prompt_lens[:n],
                       ids=data.ids[:n])


def run_eagle(cfg: EagleConfig) -> Path:
    """Trains (or resumes training) an EAGLE head; returns the head folder."""
    from specserve.distill.eagle_build import build_head, save_head
    from specserve.distill.eagle_train import Teacher, train_head
    from specserve.distill.student import choose_head_vocab
    from specserve.draft.eagle_head import default_target_layers
    from specserve.engine.models import resolve_model_path
    from specserve.target.loader import load_weights

    data_dir = cfg.data or cfg.out / "data" / "train"
    if not any(Path(data_dir).glob("shard-*.pt")):
        raise ConfigError(f"no teacher shards (shard-*.pt) in {data_dir}: pass --data DIR, or "
                          f"make them first with `specserve distill --data-only --out {cfg.out}`")
    device = torch.device(cfg.train.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: this machine has no CUDA device (use --device cpu)")
    cfg.out.mkdir(parents=True, exist_ok=True)
    train_data, val_data = split_data(Path(data_dir))
    val_data = _cap(val_data, cfg.max_heldout_sequences)
    model_path = resolve_model_path(cfg.target)
    hf_config, state = load_weights(model_path)
    layers = cfg.target_layers or default_target_layers(hf_config.num_hidden_layers)
    checkpoint = cfg.out / "eagle_checkpoint.pt"
    if checkpoint.exists():  # the vocabulary the run started with, even if the data grew since
        saved = torch.load(checkpoint, weights_only=False, map_location="cpu")
        head_ids = saved["head"]["head_token_ids"]
    else:
        responses = [t[p:] for t, p in zip(train_data.tokens, train_data.prompt_lens)]
        top = [t for t in train_data.top_ids if len(t)]
        head_ids = choose_head_vocab(responses, top, hf_config.vocab_size, cfg.head_vocab_size)
    head = build_head(hf_config, state, head_ids, tuple(layers), device)
    teacher = Teacher(hf_config, state, head, device)
    del state
    response_tokens = sum(len(t) - p for t, p in zip(train_data.tokens, train_data.prompt_lens))
    log.info("eagle: %d train sequences (%d response tokens), %d held-out; layers %s; device %s",
             len(train_data), response_tokens, len(val_data), layers, device)
    t0 = time.monotonic()
    steps, val = train_head(head, teacher, train_data, val_data, cfg.train, checkpoint,
                            cfg.out / "eagle_curve.jsonl")
    params = sum(p.numel() for p in head.saved_state().values() if p.is_floating_point())
    card = {
        "target": str(model_path),
        "architecture": f"EAGLE-3 head (speculators layout): fc over the outputs of target "
                        f"layers {list(layers)} + 1 x decoder layer of the target's "
                        f"architecture with q/k/v over [token embedding, hidden] (hidden "
                        f"{hf_config.hidden_size}) + norm + head over {len(head_ids)} tokens; "
                        f"target embeddings shared; {params / 1e6:.1f}M parameters "
                        f"({2 * params / 2**20:.1f} MiB in bfloat16)",
        "data": f"{len(train_data)} target responses ({response_tokens} tokens) from "
                f"{data_dir}; {len(val_data)} held-out responses never trained on",
        "training": f"{steps} steps of {asdict(replace(cfg.train, max_minutes=None))}",
        "feature_storage": "0 bytes per token (target features recomputed online per batch)",
        "held_out": (f"agreement per TTT step {[round(a, 4) for a in val.agree]}, est. "
                     f"tokens/verify at k={cfg.train.ttt_steps} {val.tokens_per_verify:.3f}"
                     if val else "n/a"),
        "minutes": f"training {(time.monotonic() - t0) / 60:.1f} on {device}",
    }
    out = cfg.out / "eagle"
    save_head(head, hf_config, out, card, target_path=str(model_path),
              speculative_tokens=cfg.train.ttt_steps)
    return out
