"""The draft being distilled ("student"): a few decoder layers of the target's own architecture,
the target's (frozen) token embeddings, and an output head over a reduced vocabulary.

Why this shape (measured on SmolLM2-135M): at this size the draft's cost decides
the gain, and a head over all 49k tokens costs as much as two decoder layers. A head over the
most frequent tokens of the target's own output covers almost every token it emits; sampling
stays exact because tokens the draft never proposes are covered by the rejection sampler's
residual distribution (the draft's q is zero there). Layers start as copies of target layers
(the first and the last work best: the first reads embeddings, the last writes into the head's
space) so training starts from a draft that already predicts something.

Training runs transformers' own implementation of the architecture (causal attention over
padded batches); the saved folder is read by ``specserve.target.loader`` like any other model,
with the embeddings taken from the target at load time (``specserve_draft.embeddings == "target"``).
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specserve.target.loader import HEAD_IDS_KEY


@dataclass(frozen=True)
class StudentSpec:
    num_layers: int = 2
    init_layers: tuple[int, ...] = (0, -1)  # target layers copied in (negative: from the end)
    head_vocab_size: int = 8192


def choose_head_vocab(
    responses: list[torch.Tensor], top_ids: list[torch.Tensor], vocab_size: int, size: int
) -> torch.Tensor:
    """The ``size`` token ids the target emits most: counted over its responses, ties broken by
    how often a token is in its top-K (tokens it could emit when sampling). int64 [size]."""
    counts: Counter[int] = Counter()
    for r in responses:
        counts.update(r.tolist())
    soft: Counter[int] = Counter()
    for t in top_ids:
        soft.update(t.flatten().tolist())
    ranked = sorted(range(vocab_size), key=lambda i: (-counts[i], -soft[i], i))
    return torch.tensor(sorted(ranked[: min(size, vocab_size)]), dtype=torch.int64)


class Student(nn.Module):
    """transformers' base model of the target's architecture with ``num_layers`` layers, plus a
    reduced-vocabulary head. ``forward`` returns head logits [N, Vd] at the selected rows."""

    def __init__(self, base: nn.Module, head_ids: torch.Tensor) -> None:
        super().__init__()
        self.base = base
        self.register_buffer("head_ids", head_ids, persistent=False)
        hidden = base.config.hidden_size
        self.head = nn.Linear(hidden, len(head_ids), bias=False)
        with torch.no_grad():  # tied-embedding targets: start from the embedding rows
            self.head.weight.copy_(base.embed_tokens.weight[head_ids])

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, rows: torch.Tensor
    ) -> torch.Tensor:
        """input_ids/attention_mask [B, L]; rows [N, 2] (batch, position) -> logits [N, Vd]."""
        hidden = self.base(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden[rows[:, 0], rows[:, 1]])


def build_student(
    target_hf_config: Any, target_state: dict[str, torch.Tensor], spec: StudentSpec,
    head_ids: torch.Tensor,
) -> Student:
    """A Student whose layers, final norm and embeddings are copied from the target."""
    from transformers import AutoModel

    n_target = target_hf_config.num_hidden_layers
    sources = [i % n_target for i in spec.init_layers]
    sources += [sources[-1]] * (spec.num_layers - len(sources))  # more layers than init ids
    config = copy.deepcopy(target_hf_config)
    config.num_hidden_layers = spec.num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = [config.layer_types[s] for s in sources[: spec.num_layers]]
    base = AutoModel.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    state: dict[str, torch.Tensor] = {}
    for name, tensor in target_state.items():
        name = name.removeprefix("model.")
        if name.startswith("layers."):
            _, idx, rest = name.split(".", 2)
            for new, src in enumerate(sources[: spec.num_layers]):
                if int(idx) == src:
                    state[f"layers.{new}.{rest}"] = tensor.float()
        elif name in ("embed_tokens.weight", "norm.weight"):
            state[name] = tensor.float()
    missing, unexpected = base.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("rotary_emb.inv_freq")]
    if missing or unexpected:
        raise ValueError(f"student init: missing {missing}, unexpected {unexpected}")
    base.embed_tokens.weight.requires_grad_(False)  # shared with the target, never stored
    return Student(base, head_ids)


def save_student(
    student: Student, target_hf_config: Any, out: Path, *, tokenizer: Any | None,
    card: dict[str, Any], spec: StudentSpec,
) -> None:
    """Writes a folder ``specserve.target.loader`` reads: config.json, model.safetensors
    (bfloat16: the draft is an approximation anyway, and it halves the size), tokenizer files,
    card."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(target_hf_config)
    config.num_hidden_layers = spec.num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[: spec.num_layers]
    config.tie_word_embeddings = False
    config.specserve_draft = {
        "embeddings": "target",
        "head_vocab_size": int(len(student.head_ids)),
        "init_layers": list(spec.init_layers),
    }
    config.save_pretrained(out)
    tensors = {
        f"model.{k}": v.detach().to(torch.bfloat16).contiguous()
        for k, v in student.base.state_dict().items()
        if not k.startswith("embed_tokens") and "rotary_emb" not in k
    }
    tensors["lm_head.weight"] = student.head.weight.detach().to(torch.bfloat16).contiguous()
    tensors[HEAD_IDS_KEY] = student.head_ids.to(torch.int64).contiguous()
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, tmp, metadata={"format": "pt"})
    tmp.rename(out / "model.safetensors")
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    (out / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    (out / "README.md").write_text(render_card(card))


def render_card(card: dict[str, Any]) -> str:
    lines = [
        f"# Draft for {card.get('target', '?')}",
        "",
        "Distilled by `specserve distill`. Load it with `--draft-model` next to its target: it",
        "has no embedding weights of its own (it shares the target's at load time).",
        "",
    ]
    for key, value in card.items():
        if key != "acceptance":
            lines.append(f"- **{key}**: {value}")
    acc = card.get("acceptance")
    if acc:
        lines += ["", "## Measured acceptance (held-out prompts)", "", acc]
    return "\n".join(lines) + "\n"
