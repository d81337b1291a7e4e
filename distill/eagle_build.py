"""Building, initializing and saving the EAGLE-3 head ``specserve distill --method eagle``
trains (the model is draft/eagle3_head.py).

Initialization starts near something sensible rather than from noise: the midlayer is a copy of
the target's last layer (its q/k/v read half the embedding and half the hidden), the final norm
the target's, the output head the target's rows for the head vocabulary, and ``fc`` passes the
highest chosen layer through.

The head is saved in the ``speculators`` layout (``Eagle3Speculator``), which vLLM, SGLang's
speculators path and llama.cpp's converter read too: ``config.json`` with
``transformer_layer_config`` (the target's config cut to one layer), ``speculators_config``
(the verifier it was trained for), ``eagle_aux_hidden_state_layer_ids`` (INPUTS of target
layers, so our captured layer i is written as i + 1) and the weights under the published names
(q/k/v and gate/up unfused, ``d2t`` / ``t2d`` when the head vocabulary is reduced). The
target's embedding table is saved too, as speculators itself saves it: its loader leaves a
missing table uninitialized unless it can reach the verifier's files.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from specserve.distill.student import render_card
from specserve.draft.eagle3_head import Eagle3Head
from specserve.draft.eagle_head import EagleMeta, head_config
from specserve.target.config import ModelConfig
from specserve.target.model import _fuse_hf_names

SPECULATORS_VERSION = "0.9.0"  # the config schema written (speculators' Eagle3SpeculatorConfig)


def build_head(
    target_hf_config: Any, target_state: dict[str, torch.Tensor], head_ids: torch.Tensor,
    target_layers: tuple[int, ...], device: torch.device | str = "cpu",
) -> Eagle3Head:
    """A float32 head on ``device`` whose embedding table is the target's (frozen). Head ids
    are kept sorted (the order ``t2d`` implies)."""
    target_cfg = ModelConfig.from_hf(target_hf_config)
    cfg = ModelConfig.from_hf(head_config(target_hf_config))
    hidden, last = cfg.hidden_size, target_cfg.num_layers - 1
    head_ids = torch.sort(head_ids.to(torch.int64)).values
    meta = EagleMeta(tuple(target_layers), target_cfg.num_layers, hidden, target_cfg.vocab_size)
    fused, _ = _fuse_hf_names(target_state, target_cfg)
    embed = fused["embed_tokens.weight"].float().to(device)
    head = Eagle3Head(cfg, meta, head_ids, embed, dtype=torch.float32, device=device)
    layer = {k.removeprefix(f"layers.{last}."): v.float()
             for k, v in fused.items() if k.startswith(f"layers.{last}.")}
    qkv = layer.pop("self_attn.qkv_proj.weight")
    out_rows = fused.get("lm_head.weight", fused["embed_tokens.weight"])  # tied: the embedding
    with torch.no_grad():
        own = head.layer.state_dict()
        for name, value in layer.items():
            if name in own:
                own[name].copy_(value)
        head.layer.hidden_norm.weight.copy_(layer["input_layernorm.weight"])
        head.layer.self_attn.qkv_proj.weight.copy_(0.5 * torch.cat([qkv, qkv], dim=1))
        head.norm.weight.copy_(fused["norm.weight"].float())
        head.lm_head.weight.copy_(out_rows[head_ids].float())
        head.fc.weight.zero_()
        head.fc.weight[:, -hidden:] = torch.eye(hidden)  # the highest layer passes through
    return head


def published_state(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """The head's trained tensors under the speculators names (q/k/v, gate/up unfused)."""
    attn, mlp = head.layer.self_attn, head.layer.mlp
    out: dict[str, torch.Tensor] = {}
    for name, t in head.state_dict().items():
        if "rotary" in name or name == "head_token_ids":
            continue
        if not name.startswith("layer."):
            out[name] = t
            continue
        rest = name.removeprefix("layer.")
        module, _, leaf = rest.rpartition(".")
        if module == "self_attn.qkv_proj":
            q, k, v = t.split([attn.q_size, attn.kv_size, attn.kv_size], dim=0)
            for part, piece in zip("qkv", (q, k, v)):
                out[f"layers.0.self_attn.{part}_proj.{leaf}"] = piece
        elif module == "mlp.gate_up_proj":
            gate, up = t.split(mlp.intermediate, dim=0)
            out[f"layers.0.mlp.gate_proj.{leaf}"], out[f"layers.0.mlp.up_proj.{leaf}"] = gate, up
        else:
            out[f"layers.0.{rest}"] = t
    out["embed_tokens.weight"] = head.embed
    ids = head.head_token_ids.cpu()
    if len(ids) != head.meta.vocab_size:  # speculators keeps the maps only for a reduced vocab
        out["d2t"] = ids - torch.arange(len(ids))
        t2d = torch.zeros(head.meta.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        out["t2d"] = t2d
    return out


def speculators_config(head: Eagle3Head, target_hf_config: Any, target_path: str | None,
                       speculative_tokens: int) -> dict[str, Any]:
    layer = head_config(target_hf_config).to_dict()
    for key in ("architectures", "_name_or_path", "transformers_version", "dtype", "torch_dtype"):
        layer.pop(key, None)
    layer["tie_word_embeddings"] = False
    options = head.options
    return {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer,
        "draft_vocab_size": int(len(head.head_token_ids)),
        "target_hidden_size": head.meta.hidden_size,
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in head.meta.target_layers],
        "norm_before_residual": options.norm_before_residual,
        "norm_before_fc": options.norm_before_fc, "fc_norm": options.fc_norm,
        "norm_output": options.norm_output, "embed_requires_grad": False,
        "tie_word_embeddings": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "accept_tolerance": 0.0,
                                  "speculative_tokens": speculative_tokens,
                                  "verifier_accept_k": 1}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": target_path,
                         "architectures": list(getattr(target_hf_config, "architectures", None)
                                               or [])},
        },
    }


def save_head(head: Eagle3Head, target_hf_config: Any, out: Path, card: dict[str, Any],
              dtype: torch.dtype = torch.bfloat16, *, target_path: str | None = None,
              speculative_tokens: int = 3) -> None:
    """config.json + model.safetensors (bfloat16 by default) in the speculators layout, plus
    card.json/README. ``target_path``: the verifier the config names (a local folder or hub
    id), for readers that load the target's embeddings themselves."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = speculators_config(head, target_hf_config, target_path, speculative_tokens)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {k: (v.detach().to(dtype) if v.is_floating_point() else v).cpu().contiguous()
               for k, v in published_state(head).items()}
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, tmp, metadata={"format": "pt"})
    tmp.rename(out / "model.safetensors")
    (out / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    text = render_card(card).replace("# Draft for", "# EAGLE-3 head for", 1)
    (out / "README.md").write_text(text.replace(
        "Distilled by `specserve distill`.", "Trained by `specserve distill --method eagle`.", 1))
