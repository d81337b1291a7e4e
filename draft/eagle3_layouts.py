"""The three published on-disk layouts of an EAGLE-3 head, read into one description.

    layout        config.json says                         weights
    ------------  ---------------------------------------  ----------------------------------
    eagle         architectures ["LlamaForCausalLMEagle3"]  fc, midlayer.*, norm, lm_head,
                  (SafeAILab EAGLE, SpecForge / SGLang)     d2t, t2d, optional embed_tokens
    vllm          architectures ["Eagle3LlamaForCausalLM"]  the same names, or layers.0.* /
                  (vLLM, AngelSlim, ModelOpt exports)       model.layers.0.*
    speculators   speculators_model_type "eagle3",          fc, layers.0.*, norm, lm_head,
                  architectures ["Eagle3Speculator"]        d2t, t2d, embed_tokens, EAGLE 3.1
                                                            input_norm / fc_norm.{i}

Which target hidden states the head reads (the aux layers) is where the trainers differ. We
capture the OUTPUT of decoder layer i (0-based, before the final norm); the ids in a config map
onto that as follows:

    speculators  ``eagle_aux_hidden_state_layer_ids`` k = transformers' ``hidden_states[k]`` =
                 the INPUT of layer k = our output of layer k - 1 (k = num_layers: the last
                 layer's output). Absent: [2, L // 2, L - 3].
    vllm         ``eagle_aux_hidden_state_layer_ids`` (top level, or in ``eagle_config``) k =
                 the INPUT of layer k (vLLM records the residual stream before calling layer
                 k) = our output of layer k - 1. Absent: (2, L // 2, L - 3).
    eagle        ``eagle_config.eagle_aux_hidden_state_layer_ids`` k = the OUTPUT of layer k
                 (SGLang adds one to reach its before-layer capture point) = our layer k.
                 Absent: the inputs of layers 2, L // 2, L - 3 (SafeAILab's
                 ``modeling_llama_kv``), our outputs of 1, L // 2 - 1, L - 4.

So all three defaults read the same states: our outputs of layers 1, L // 2 - 1 and L - 4.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from specserve.core.errors import ModelLoadError
from specserve.draft.eagle3_head import Eagle3Options

EAGLE, VLLM, SPECULATORS = "eagle", "vllm", "speculators"
_ARCHITECTURES = {"LlamaForCausalLMEagle3": EAGLE, "Eagle3LlamaForCausalLM": VLLM,
                  "Eagle3Speculator": SPECULATORS}
_LAYOUT_NAMES = {EAGLE: "EAGLE/SpecForge LlamaForCausalLMEagle3",
                 VLLM: "vLLM/AngelSlim Eagle3LlamaForCausalLM",
                 SPECULATORS: "speculators Eagle3Speculator"}


def detect_layout(raw: dict[str, Any]) -> str | None:
    """The layout a parsed ``config.json`` names, or None when it is no EAGLE-3 head."""
    if raw.get("speculators_model_type") == "eagle3":
        return SPECULATORS
    return next((_ARCHITECTURES[a] for a in raw.get("architectures") or []
                 if a in _ARCHITECTURES), None)


@dataclass(frozen=True)
class Eagle3Spec:
    """What a head's config.json says, in one shape for every layout."""

    layout: str
    layer_config: dict[str, Any]  # a transformers config dict of the midlayer's architecture
    options: Eagle3Options
    aux_ids: tuple[int, ...] | None  # as written (the layout's convention); None: default
    target_hidden: int
    target_vocab: int
    draft_vocab: int
    verifier: str | None  # the target the head names, if any

    @property
    def name(self) -> str:
        return _LAYOUT_NAMES[self.layout]

    def target_layers(self, num_layers: int) -> tuple[int, ...]:
        """Our captured layer outputs (see the module table) for a target of ``num_layers``."""
        if self.aux_ids is None:
            return (1, num_layers // 2 - 1, num_layers - 4)
        if self.layout == EAGLE:
            return self.aux_ids
        if 0 in self.aux_ids:
            raise ModelLoadError(
                f"{self.name} head reads the target's embeddings (aux layer id 0); this server "
                f"captures decoder layer outputs only")
        return tuple(k - 1 for k in self.aux_ids)


def read_spec(raw: dict[str, Any]) -> Eagle3Spec:
    layout = detect_layout(raw)
    if layout is None:
        raise ModelLoadError("config.json names no EAGLE-3 head layout")
    eagle_config = raw.get("eagle_config") or {}
    if layout == SPECULATORS:
        layer = dict(raw.get("transformer_layer_config") or {})
        if not layer:
            raise ModelLoadError("speculators config.json has no transformer_layer_config")
        aux = raw.get("eagle_aux_hidden_state_layer_ids")
        verifier = ((raw.get("speculators_config") or {}).get("verifier") or {})
        named = verifier.get("name_or_path")
        options = Eagle3Options(bool(raw.get("norm_before_residual", False)),
                                bool(raw.get("norm_before_fc", False)),
                                bool(raw.get("fc_norm", False)),
                                bool(raw.get("norm_output", False)))
    else:
        layer = {k: v for k, v in raw.items() if k not in ("eagle_config", "architectures")}
        aux = (eagle_config.get("eagle_aux_hidden_state_layer_ids") if layout == EAGLE else
               raw.get("eagle_aux_hidden_state_layer_ids")
               or eagle_config.get("eagle_aux_hidden_state_layer_ids"))
        named = raw.get("base_model_name_or_path") or raw.get("_name_or_path") or None
        options = Eagle3Options(norm_before_residual=bool(raw.get("norm_before_residual", False)))
    layer.setdefault("model_type", "llama")
    if "hidden_size" not in layer or "vocab_size" not in layer:
        raise ModelLoadError(f"{_LAYOUT_NAMES[layout]} config has no hidden_size / vocab_size")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise ModelLoadError(
            f"{_LAYOUT_NAMES[layout]} head has {layer['num_hidden_layers']} decoder layers; "
            f"only one-layer EAGLE-3 heads are supported")
    return Eagle3Spec(
        layout=layout, layer_config=layer, options=options,
        aux_ids=tuple(int(k) for k in aux) if aux else None,
        target_hidden=int(raw.get("target_hidden_size") or layer["hidden_size"]),
        target_vocab=int(layer["vocab_size"]),
        draft_vocab=int(raw.get("draft_vocab_size") or layer["vocab_size"]),
        verifier=str(named) if named else None,
    )


_PREFIX = re.compile(r"^(midlayer|layers\.0)\.")
_QKV, _GATE_UP = "self_attn.qkv_proj", "mlp.gate_up_proj"
_FUSED = {"self_attn.q_proj": (_QKV, 0), "self_attn.k_proj": (_QKV, 1),
          "self_attn.v_proj": (_QKV, 2), "mlp.gate_proj": (_GATE_UP, 0),
          "mlp.up_proj": (_GATE_UP, 1)}
_IGNORED = ("verifier_lm_head.", "verifier_norm.", "rotary_emb.")


@dataclass
class Eagle3Weights:
    """A checkpoint's tensors under our module names (``Eagle3Head.state_dict`` keys)."""

    state: dict[str, torch.Tensor]
    embed: torch.Tensor | None  # embed_tokens.weight, when the checkpoint has its own
    d2t: torch.Tensor | None
    t2d: torch.Tensor | None


def map_weights(tensors: dict[str, torch.Tensor], spec: Eagle3Spec) -> Eagle3Weights:
    """Renames a checkpoint's tensors to ours: midlayer / layers.0 -> layer, q|k|v and gate|up
    fused in that order. Raises ``ModelLoadError`` naming what does not belong to a head."""
    state: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    out = Eagle3Weights({}, None, None, None)
    unknown = []
    for name, t in tensors.items():
        name = name.removeprefix("model.")
        if any(name.startswith(p) for p in _IGNORED):
            continue
        if name in ("d2t", "t2d"):
            setattr(out, name, t)
            continue
        if name == "embed_tokens.weight":
            out.embed = t
            continue
        m = _PREFIX.match(name)
        if m is None:
            if re.match(r"^layers\.\d+\.", name):
                unknown.append(name)  # a second decoder layer
            elif name in ("fc.weight", "norm.weight", "lm_head.weight", "input_norm.weight") \
                    or re.fullmatch(r"fc_norm\.\d+\.weight", name):
                state[name] = t
            else:
                unknown.append(name)
            continue
        rest = name[m.end():]
        module, _, leaf = rest.rpartition(".")
        if module in _FUSED:
            fused, index = _FUSED[module]
            parts.setdefault(f"layer.{fused}.{leaf}", {})[index] = t
        else:
            state[f"layer.{rest}"] = t
    if unknown:
        raise ModelLoadError(f"{spec.name} checkpoint has weights no one-layer EAGLE-3 head "
                             f"has: {sorted(unknown)[:6]}")
    for name, pieces in parts.items():
        want = 3 if "qkv" in name else 2
        if sorted(pieces) != list(range(want)):
            raise ModelLoadError(f"{spec.name} checkpoint lacks part of {name}")
        state[name] = torch.cat([pieces[i] for i in range(want)], dim=0)
    out.state = state
    return out


def draft_to_target(weights: Eagle3Weights, spec: Eagle3Spec) -> torch.Tensor:
    """The target id of every draft id (int64 [Vd]): d + d2t[d]; the identity for a head over
    the whole vocabulary. Checks t2d agrees when the checkpoint has both."""
    if weights.d2t is None:
        if spec.draft_vocab != spec.target_vocab:
            raise ModelLoadError(f"{spec.name} head has a {spec.draft_vocab}-token draft "
                                 f"vocabulary but no d2t map to the target's {spec.target_vocab}")
        return torch.arange(spec.draft_vocab, dtype=torch.int64)
    d2t = weights.d2t.to(torch.int64)
    if d2t.shape != (spec.draft_vocab,):
        raise ModelLoadError(f"{spec.name} d2t has shape {tuple(d2t.shape)}, the config's "
                             f"draft_vocab_size is {spec.draft_vocab}")
    ids = torch.arange(spec.draft_vocab, dtype=torch.int64) + d2t
    if int(ids.min()) < 0 or int(ids.max()) >= spec.target_vocab:
        raise ModelLoadError(f"{spec.name} d2t maps draft ids outside the target's "
                             f"{spec.target_vocab}-token vocabulary")
    if weights.t2d is not None:
        chosen = weights.t2d.to(torch.bool).nonzero().flatten()
        if not torch.equal(chosen, torch.sort(ids).values):
            raise ModelLoadError(f"{spec.name} t2d and d2t name different draft vocabularies")
    return ids
