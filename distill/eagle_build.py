"""Building, initializing and saving an EAGLE head (the model is draft/eagle_head.py).

Initialization starts near something sensible rather than from noise: the decoder layer is a
copy of the target's last layer, the final norm the target's, the output head the target's
rows for the head vocabulary, ``fc`` passes the highest chosen layer through, and ``in_proj``
adds the token embedding to that feature (the residual stream a target layer reads).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specserve.distill.student import render_card
from specserve.draft.eagle_head import EAGLE_KEY, HEAD_IDS, EagleHead, EagleMeta, head_config
from specserve.target.config import ModelConfig
from specserve.target.model import _fuse_hf_names


def build_head(
    target_hf_config: Any, target_state: dict[str, torch.Tensor], head_ids: torch.Tensor,
    target_layers: tuple[int, ...], device: torch.device | str = "cpu",
) -> EagleHead:
    """A float32 head on ``device`` whose embedding table is the target's (frozen)."""
    target_cfg = ModelConfig.from_hf(target_hf_config)
    cfg = ModelConfig.from_hf(head_config(target_hf_config))
    hidden, last = cfg.hidden_size, target_cfg.num_layers - 1
    meta = EagleMeta(tuple(target_layers), target_cfg.num_layers, hidden, target_cfg.vocab_size)
    fused, _ = _fuse_hf_names(target_state, target_cfg)
    embed = fused["embed_tokens.weight"].float().to(device)
    head = EagleHead(cfg, meta, head_ids, embed, dtype=torch.float32, device=device)
    layer_state = {k.removeprefix(f"layers.{last}."): v.float()
                   for k, v in fused.items() if k.startswith(f"layers.{last}.")}
    head.layer.load_state_dict(layer_state)
    out_rows = fused.get("lm_head.weight", fused["embed_tokens.weight"])  # tied: the embedding
    with torch.no_grad():
        head.norm.weight.copy_(fused["norm.weight"].float())
        head.lm_head.weight.copy_(out_rows[head_ids].float())
        eye = torch.eye(hidden)
        head.fc.weight.zero_()
        head.fc.weight[:, -hidden:] = eye  # the highest layer passes through
        head.in_proj.weight.copy_(torch.cat([eye, eye], dim=1))  # embedding + feature
    return head


def save_head(head: EagleHead, target_hf_config: Any, out: Path, card: dict[str, Any],
              dtype: torch.dtype = torch.bfloat16) -> None:
    """config.json + model.safetensors (bfloat16 by default, ~2 bytes per parameter) +
    card.json/README."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = head_config(target_hf_config)
    config.tie_word_embeddings = False
    setattr(config, EAGLE_KEY, {
        "target_layers": list(head.meta.target_layers),
        "target_num_layers": head.meta.target_num_layers,
        "hidden_size": head.meta.hidden_size, "vocab_size": head.meta.vocab_size,
        "head_vocab_size": int(len(head.head_token_ids)), "embeddings": "target",
    })
    config.save_pretrained(out)
    tensors = {
        k: (v if k == HEAD_IDS else v.detach().to(dtype)).cpu().contiguous()
        for k, v in head.saved_state().items()
    }
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, tmp, metadata={"format": "pt"})
    tmp.rename(out / "model.safetensors")
    (out / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    text = render_card(card).replace("# Draft for", "# EAGLE head for", 1)
    (out / "README.md").write_text(text.replace(
        "Distilled by `specserve distill`.", "Trained by `specserve distill --method eagle`.", 1))
