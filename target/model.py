"""CausalLM: one decoder-only model for every family of ``target/arch.py`` (Llama, Mistral,
Qwen2/3, SmolLM, Phi-3, Granite, Gemma 2/3); its layers are in ``target/layers.py``.

The model reads a flattened batch: T tokens from B sequences laid back to back (prefill chunks,
decode tokens and speculative verify runs alike); ``AttentionMetadata`` says which tokens belong
to which sequence and where their K/V live in the paged cache. Projections are fused (q|k|v in
one matmul, gate|up in another); ``load_hf_state_dict`` fuses the Hugging Face tensors into them.

Numerics follow transformers op for op (same residual order, RMSNorm in float32, rotary in the
model dtype), so float32 logits agree with ``AutoModelForCausalLM`` to ~1e-5.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specserve.core.errors import ModelLoadError
from specserve.kernels.linear import DenseLinear
from specserve.kernels.metadata import AttentionMetadata
from specserve.kernels.registry import AttentionBackend
from specserve.kernels.rotary import RotaryEmbedding
from specserve.target.config import ModelConfig
from specserve.target.layers import MLP, Attention, DecoderLayer, FusedOps, KVCache, RMSNorm

__all__ = ["MLP", "Attention", "CausalLM", "DecoderLayer", "FeatureCapture", "KVCache",
           "RMSNorm", "set_fused_ops"]



@dataclass
class FeatureCapture:
    """Asks ``CausalLM.forward`` for hidden states (an EAGLE head's input): the output of each
    layer in ``layers`` at the flat rows ``rows``, concatenated into ``out``
    [len(rows), len(layers) * hidden]. Only built while an EAGLE head is loaded."""

    layers: tuple[int, ...]
    rows: torch.Tensor  # [R] int64 rows of the flattened batch
    out: torch.Tensor | None = None


class CausalLM(nn.Module):
    """Embedding -> N decoder layers -> final RMSNorm -> lm_head (tied to the embedding or not).

    Parameters are created with ``dtype``/``device`` (use ``device="meta"`` to skip random init
    before ``load_hf_state_dict``). The rotary table is not a parameter; it stays float32 and
    follows ``.to(device)`` (and ``forward`` moves it if ``positions`` live elsewhere).
    """

    fused_ops: FusedOps | None = None  # set by enable_fused_ops
    use_decoder_stack: bool = True  # False: one Python call per layer (tests compare the two)
    _stack: Any = None  # kernels' DecoderStack, built on the first step that can use it
    _stack_form: int = 8  # the C++ attention form the stack was built with
    # captured layers -> [(DecoderStack of layers [a, b), a, b)]: the same layers split after
    # each captured one, so a step that returns features still runs a few C++ calls, not 30
    _segments: dict[tuple[int, ...], list[tuple[Any, int, int]]] = {}
    _kv_flat: tuple[Any, list[torch.Tensor]] = (None, [])  # (kv_caches, its 2L tensors)

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        head_token_ids: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        factory: dict[str, object] = {"dtype": dtype, "device": device}
        # On the meta device (every load) no random init: nn.Embedding's normal_ on meta imports
        # torch._dynamo, 7 s of a start on 2 cores.
        table = (torch.empty(config.vocab_size, config.hidden_size, **factory)  # type: ignore[arg-type]
                 if device is not None and torch.device(device).type == "meta" else None)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=table,
                                         **factory)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, **factory) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_unit_offset,
                            **factory)
        # A reduced head (distilled drafts) scores only ``head_token_ids``: row i of its logits
        # is token head_token_ids[i]; callers map rows back to token ids.
        self.head_token_ids: torch.Tensor | None
        self.register_buffer("head_token_ids", head_token_ids, persistent=False)
        head_rows = config.vocab_size if head_token_ids is None else len(head_token_ids)
        self.lm_head = (
            None
            if config.tie_word_embeddings and head_token_ids is None
            else DenseLinear(config.hidden_size, head_rows, bias=False, **factory)
        )
        rotary_device = "cpu" if device is None or torch.device(device).type == "meta" else device
        # One rotary table per rope setting (Gemma 3: local and global layers have their own);
        # layer i uses rotaries[layer_rope[i]].
        self.layer_rope: tuple[str | None, ...] = (
            config.layer_rope_keys or (None,) * config.num_layers
        )
        self.rotaries = {
            key: RotaryEmbedding(config.hf_config, config.head_dim, rotary_device,
                                 rotary_dim=config.rotary_dim or None, layer_type=key)
            for key in dict.fromkeys(self.layer_rope)
        }
        self.rotary = self.rotaries[self.layer_rope[0]]

    def _apply(self, fn: Any, recurse: bool = True) -> CausalLM:
        """``.to(device)`` / ``.cuda()`` also move the rotary table (kept in float32)."""
        super()._apply(fn, recurse)
        self._stack = None  # it holds the old weight tensors
        self._segments = {}
        device = self.norm.weight.device  # the embedding may be blocks (kernels.quant)
        if device.type != "meta":
            for rotary in self.rotaries.values():
                rotary.inv_freq = rotary.inv_freq.to(device)
        return self

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        """The embedding rows, times the family's embedding scale (Gemma rounds its scale to the
        model dtype first, as transformers does; Granite multiplies by the float)."""
        h = self.embed_tokens(input_ids)
        scale = self.config.embed_scale
        if scale is None:
            return h
        if self.config.norm_unit_offset:  # Gemma
            return h * torch.tensor(scale, dtype=h.dtype, device=h.device)
        return h * scale

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[KVCache],  # one (k, v) per layer
        meta: AttentionMetadata,
        attn_backend: AttentionBackend,
        logits_indices: torch.Tensor | None = None,  # [N] rows of T to score; None: all
        capture: FeatureCapture | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (logits [N, vocab] float32, final-norm hidden states [N, hidden]) for the rows
        in ``logits_indices``. The lm_head only runs on those rows. Writes every token's K/V into
        ``kv_caches`` at ``meta.slot_mapping``. With ``capture``, also fills ``capture.out``
        (a C++ stack then runs as a few segments split after the captured layers)."""
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"need {len(self.layers)} kv caches, got {len(kv_caches)}")
        h = self.embed(input_ids)  # [T, hidden]
        ropes = {}  # once per step and rope setting, for all layers
        for key, rotary in self.rotaries.items():
            if rotary.inv_freq.device != positions.device:
                rotary.inv_freq = rotary.inv_freq.to(positions.device)
            cos, sin = rotary.cos_sin(positions, h.dtype)
            ropes[key] = (cos[:, 0].contiguous(), sin[:, 0].contiguous())  # [T, R] each
        rope = ropes[self.layer_rope[0]]
        stack = self._decoder_stack(attn_backend, meta)
        if stack is not None:  # every layer in one C++ call (kernels/csrc/fused.cpp)
            run, projections, plan = stack
            rows = h.shape[0]
            if self._kv_flat[0] is not kv_caches:
                self._kv_flat = (kv_caches, [t for kv in kv_caches for t in kv])
            rpp = [p.kernel(rows) for p in projections]
            # with a capture: one call per run of layers up to each captured layer
            segments = [(run, 0, len(self.layers))] if capture is None else \
                self._stack_segments(capture.layers)
            picked = {}
            for seg, a, b in segments:
                seg.forward_(h, rpp, rope[0], rope[1], self._kv_flat[1][2 * a : 2 * b],
                             meta.block_tables, plan.seq_of, plan.pos_of, meta.slot_mapping)
                if capture is not None and b - 1 in capture.layers:
                    picked[b - 1] = h[capture.rows]  # a copy: the next segment updates h
            if capture is not None:
                capture.out = torch.cat([picked[i] for i in capture.layers], dim=-1)
        else:
            picked: dict[int, torch.Tensor] = {}
            for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
                h = layer(positions, h, kv_cache, meta, attn_backend, ropes[self.layer_rope[i]])
                if capture is not None and i in capture.layers:
                    picked[i] = h[capture.rows]  # a copy: fused layers update h in place
            if capture is not None:
                capture.out = torch.cat([picked[i] for i in capture.layers], dim=-1)
        if logits_indices is not None:
            h = h[logits_indices]  # [N, hidden]
        h = self.norm(h)  # [N, hidden]; RMSNorm is per row, so selecting first is exact
        return self.compute_logits(h), h

    def _decoder_stack(self, backend: AttentionBackend, meta: AttentionMetadata
                       ) -> tuple[Any, list, Any] | None:
        """(DecoderStack, layer 0's projections, attention plan) when every layer can run as
        one ``decoder_layer_`` call (see DecoderLayer._whole_layer_args), else None. The stack
        holds the weights from the first such step on; it runs the same per-layer arithmetic,
        so it is a pure saving of Python work (``use_decoder_stack = False`` turns it off)."""
        if not self.use_decoder_stack or self.fused_ops is None:
            return None
        whole = [layer._whole_layer_args(backend, meta) for layer in self.layers[:1]]
        if whole[0] is None:
            return None
        if self._stack is None:
            whole = [layer._whole_layer_args(backend, meta) for layer in self.layers]
            if any(w is None for w in whole):
                self.use_decoder_stack = False  # mixed layers: keep the per-layer calls
                return None
            attn = self.layers[0].self_attn
            self._stack_form = backend.form  # the C++ attention's form, fixed per process
            stack = self.fused_ops.DecoderStack(
                attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale, self._stack_form
            )
            for layer, (args, _, _) in zip(self.layers, whole):
                ln1, ln2, eps, *planes = args
                stack.add_layer(ln1, ln2, eps, planes, layer.self_attn.sliding_window or 0)
            self._stack = stack
        return self._stack, whole[0][1], whole[0][2]

    def _stack_segments(self, captured: tuple[int, ...]) -> list[tuple[Any, int, int]]:
        """DecoderStacks over runs of layers ending after each layer in ``captured`` (and one
        for the rest). Built once per set of layers from the layers' cached arguments (the
        weights are shared, not copied); the arithmetic is the whole stack's."""
        got = self._segments.get(captured)
        if got is None:
            ends = sorted({i + 1 for i in captured} | {len(self.layers)})
            attn = self.layers[0].self_attn
            got, start = [], 0
            for end in ends:
                stack = self.fused_ops.DecoderStack(
                    attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
                    self._stack_form,
                )
                for layer in self.layers[start:end]:
                    ln1, ln2, eps, *planes = layer._layer_args[0]
                    stack.add_layer(ln1, ln2, eps, planes, layer.self_attn.sliding_window or 0)
                got.append((stack, start, end))
                start = end
            self._segments = {**self._segments, captured: got}
        return got

    def enable_fused_ops(self, ops: FusedOps | None) -> None:
        """Routes norms, rotary, SiLU*mul and residual adds through the fused float32 CPU ops
        (the quantized path); None restores the reference ops, which follow transformers."""
        set_fused_ops(self, ops)
        self.fused_ops = ops
        self._stack = None
        self._segments = {}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] (after the final norm) -> logits [N, vocab] float32 ([N, len(
        head_token_ids)] for a reduced head), computed in the model dtype like transformers,
        then divided (Granite) and soft-capped (Gemma 2) as the family does."""
        if self.lm_head is None:  # tied and dense
            logits = DenseLinear.apply(hidden, self.embed_tokens.weight)
        else:
            logits = self.lm_head(hidden)
        cfg = self.config
        if cfg.logits_divisor is not None:
            logits = logits / cfg.logits_divisor
        if cfg.final_softcap is not None:
            if self.fused_ops is not None and logits.dtype == torch.float32 and logits.dim() == 2:
                logits = logits.contiguous()
                self.fused_ops.softcap_(logits, cfg.final_softcap)  # rows batch-invariant
            else:
                logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits.float()

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor],
                           elsewhere: frozenset[str] = frozenset()) -> None:
        """Loads Hugging Face tensors (``model.layers.N.self_attn.q_proj.weight``...) into the
        fused parameters, casting to each parameter's dtype. Parameters on the meta device are
        replaced by the loaded tensors (on their device); others are copied in place.
        ``elsewhere``: our parameter names the caller fills otherwise (block weights), left as
        they are. Raises ``ModelLoadError`` listing every missing or unexpected weight."""
        fused, unexpected = _fuse_hf_names(state_dict, self.config)
        own = {n: p for n, p in self.named_parameters() if n not in elsewhere}
        missing = [_hf_name(n) for n in sorted(set(own) - set(fused))]
        unexpected += sorted(_hf_name(n) for n in set(fused) - set(own))
        if missing or unexpected:
            raise ModelLoadError(
                f"checkpoint does not match the {self.config.architecture} config: "
                f"missing weights {_short(missing)}; unexpected weights {_short(unexpected)}"
            )
        for name, tensor in fused.items():
            if tuple(tensor.shape) != tuple(own[name].shape):
                raise ModelLoadError(
                    f"weight {name} has shape {tuple(tensor.shape)}, the config implies "
                    f"{tuple(own[name].shape)}"
                )
        for name, param in own.items():
            tensor = fused[name].to(param.dtype)
            if param.device.type == "meta":
                module_name, _, attr = name.rpartition(".")
                new = nn.Parameter(tensor, requires_grad=False)
                setattr(self.get_submodule(module_name), attr, new)
            else:
                with torch.no_grad():
                    param.copy_(tensor)
        self.requires_grad_(False)


def set_fused_ops(root: nn.Module, ops: FusedOps | None) -> None:
    """Sets the fused ops on every layer, attention, MLP and norm under ``root`` (a model, or
    an EAGLE head's one layer); None: the reference ops."""
    for module in root.modules():
        if isinstance(module, (Attention, MLP, DecoderLayer, RMSNorm)):
            module.fused = ops
        if isinstance(module, DecoderLayer):
            module._layer_args = None


_LAYER_RE = re.compile(r"^layers\.(\d+)\.(self_attn|mlp)\.(q|k|v|gate|up)_proj\.(weight|bias)$")
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def _fuse_hf_names(
    state_dict: dict[str, torch.Tensor], cfg: ModelConfig
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """HF names -> our names; q/k/v and gate/up are concatenated along the output dim.
    Returns (our state dict, HF names that fit nowhere)."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    unexpected: list[str] = []
    for hf_name, tensor in state_dict.items():
        name = hf_name.removeprefix("model.")
        if _IGNORED.search(name):
            continue
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: the embedding is the head (transformers ignores this copy too)
        m = _LAYER_RE.match(name)
        if m is None:
            out[name] = tensor
            continue
        layer, block, proj, kind = m.groups()
        fused = "qkv_proj" if block == "self_attn" else "gate_up_proj"
        parts.setdefault(f"layers.{layer}.{block}.{fused}.{kind}", {})[proj] = tensor
    for name, pieces in parts.items():
        order = ("q", "k", "v") if ".qkv_proj." in name else ("gate", "up")
        if set(pieces) != set(order):
            have = "+".join(p for p in order if p in pieces)
            unexpected.append(f"{_hf_name(name)} (only {have})")
            continue
        out[name] = torch.cat([pieces[p] for p in order], dim=0)
    return out, unexpected


def _hf_name(name: str) -> str:
    """Our parameter name -> the Hugging Face name(s) it is loaded from, for error messages."""
    name = name.replace("qkv_proj", "{q,k,v}_proj").replace("gate_up_proj", "{gate,up}_proj")
    return name if name.startswith("lm_head") else f"model.{name}"


def _short(names: list[str], limit: int = 8) -> str:
    if not names:
        return "none"
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
