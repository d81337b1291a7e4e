"""EagleHead: a one-layer draft that reads the target's own hidden states (EAGLE-3 style).

At token position p the head takes two inputs: the embedding of token x_p (the target's
embedding table, shared, never stored) and a feature g_{p-1} describing position p - 1. It runs
one decoder layer of the target's architecture over them and predicts x_{p+1}.

    g_{p-1} = fc(concat(target hidden after layers low, mid, high at p - 1))   [target features]
    x       = in_proj(concat(embed(x_p), g_{p-1}))                               [T, hidden]
    out_p   = DecoderLayer(x)      (its own paged KV, same block ids as the target's)
    logits  = lm_head(norm(out_p)) over a reduced vocabulary ``head_token_ids``

While drafting, the head chains on its OWN output: draft step j feeds out_{p} (the previous
step's output, before the final norm) as the feature of the next position, because the target's
hidden state for a drafted token does not exist yet. Training ("training-time test") unrolls the
same chain so later draft positions see what they will see at inference.

Position 0 and positions whose target feature is unknown (a prefix-cache hit the target did not
recompute) get a zero feature; this lowers acceptance there but never changes the output, which
the target verifies.

On disk (``--draft-model DIR``): ``config.json`` (the target's config with one layer, plus
``specserve_eagle``), ``model.safetensors`` (bfloat16, our fused parameter names) and a card.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specserve.core.errors import ModelLoadError
from specserve.kernels.linear import DenseLinear
from specserve.kernels.metadata import AttentionMetadata
from specserve.kernels.registry import AttentionBackend
from specserve.kernels.rotary import RotaryEmbedding
from specserve.target.config import ModelConfig
from specserve.target.layout import BatchLayout
from specserve.target.model import DecoderLayer, KVCache, RMSNorm
from specserve.target.model_runner import zeroed_pool

EAGLE_KEY = "specserve_eagle"
HEAD_IDS = "head_token_ids"


def default_target_layers(num_layers: int) -> tuple[int, ...]:
    """Low, middle and high layer (EAGLE-3's choice: the 2nd, the middle and the 4th from the
    end); every layer of a target with fewer than 8."""
    if num_layers < 8:
        return tuple(range(num_layers))
    return (1, num_layers // 2 - 1, num_layers - 4)


@dataclass(frozen=True)
class EagleMeta:
    """What ``config.json``'s ``specserve_eagle`` records: which target the head belongs to."""

    target_layers: tuple[int, ...]
    target_num_layers: int
    hidden_size: int
    vocab_size: int


def attach_target_tables(head: nn.Module, config: ModelConfig, head_token_ids: torch.Tensor,
                         embed: torch.Tensor, device: torch.device | str | None) -> None:
    """What every EAGLE head keeps of its target: the head's token ids (a buffer, saved with
    it), the target's embedding table (not a Parameter: never registered nor saved) and the
    rotary table (on the CPU while the head is built on meta)."""
    head.register_buffer(HEAD_IDS, head_token_ids.to(torch.int64))
    head.embed = embed.detach()
    rotary_device = "cpu" if device is None or torch.device(device).type == "meta" else device
    head.rotary = RotaryEmbedding(config.hf_config, config.head_dim, rotary_device)


class EagleHead(nn.Module):
    """The head's parameters and its two forward paths: ``step`` on the engine's paged KV, and
    the dense training path in ``distill.eagle_train`` (which reuses these modules).

    ``embed`` is the target's embedding table (a plain attribute, not a parameter or buffer, so
    it is neither trained nor saved)."""

    def __init__(
        self, config: ModelConfig, meta: EagleMeta, head_token_ids: torch.Tensor,
        embed: torch.Tensor, *, dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        if config.num_layers != 1:
            raise ValueError("an EAGLE head has one decoder layer")
        factory: dict[str, object] = {"dtype": dtype, "device": device}
        hidden = config.hidden_size
        self.config, self.meta = config, meta
        # The dtype features and activations are kept in (the projections' own weights may be
        # block-quantized later, see ``quantize``).
        self.dtype = dtype or torch.get_default_dtype()
        self.fc = DenseLinear(len(meta.target_layers) * hidden, hidden, bias=False, **factory)
        self.in_proj = DenseLinear(2 * hidden, hidden, bias=False, **factory)
        self.layer = DecoderLayer(config, 0, **factory)
        self.norm = RMSNorm(hidden, config.rms_norm_eps, **factory)
        self.lm_head = DenseLinear(hidden, len(head_token_ids), bias=False, **factory)
        self.head_token_ids: torch.Tensor
        attach_target_tables(self, config, head_token_ids, embed, device)

    def fuse(self, layer_feats: torch.Tensor) -> torch.Tensor:
        """[T, len(target_layers) * hidden] target hidden states -> features g [T, hidden]."""
        return self.fc(layer_feats.to(self.dtype))

    def inputs(self, input_ids: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
        """input_ids [...], feats g_{p-1} [..., hidden] -> the layer's input [..., hidden]."""
        emb = nn.functional.embedding(input_ids, self.embed).to(feats.dtype)
        return self.in_proj(torch.cat([emb, feats], dim=-1))

    def step(
        self,
        input_ids: torch.Tensor,  # [T]
        feats: torch.Tensor,  # [T, hidden]: g_{p-1} for each token p
        positions: torch.Tensor,  # [T]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [T, hidden]: out_p, the next position's feature
        if self.rotary.inv_freq.device != positions.device:
            self.rotary.inv_freq = self.rotary.inv_freq.to(positions.device)
        x = self.inputs(input_ids, feats)
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        rope = (cos[:, 0].contiguous(), sin[:, 0].contiguous())
        return self.layer(positions, x, kv_cache, meta, backend, rope)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """out [N, hidden] -> float32 logits [N, len(head_token_ids)]."""
        return self.lm_head(self.norm(out)).float()

    def quantize(self, fmt: str = "q8_0") -> dict[str, str]:
        """Inference only: fc, in_proj, the layer's projections and the lm_head become block-
        quantized (``kernels.quant``, float32 activations) and the layer runs the fused C++
        ops, as a quantized target's draft model does. Returns module name -> format."""
        from specserve.target.quantize import quantize_linears

        if self.dtype != torch.float32:
            raise ValueError(f"block-quantized projections compute in float32, not {self.dtype}")
        return quantize_linears(self, fmt)

    def saved_state(self) -> dict[str, torch.Tensor]:
        """Trainable tensors plus the head ids (rotary tables and embeddings excluded)."""
        return {k: v for k, v in self.state_dict().items() if "rotary" not in k}


def head_config(target_hf_config: Any) -> Any:
    """The target's transformers config cut to one layer (the head's decoder layer)."""
    config = copy.deepcopy(target_hf_config)
    config.num_hidden_layers = 1
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[-1:]
    return config


def is_eagle_dir(path: str | Path | None) -> bool:
    """True when ``path`` is a folder written by ``specserve distill --method eagle``."""
    if path is None:
        return False
    config = Path(path) / "config.json"
    if not config.is_file():
        return False
    try:
        return EAGLE_KEY in json.loads(config.read_text())
    except json.JSONDecodeError:
        return False


def load_head(
    path: str | Path, target: ModelConfig, embed: torch.Tensor, dtype: torch.dtype,
    device: torch.device | str,
) -> EagleHead:
    """Loads a head folder for ``target`` (whose embedding table is ``embed``). Raises
    ``ModelLoadError`` saying what to do when the head was trained for another target."""
    from safetensors.torch import load_file

    from specserve.target.loader import load_hf_config

    folder = Path(path)
    hf_config = load_hf_config(folder)
    raw = getattr(hf_config, EAGLE_KEY, None) or {}
    meta = EagleMeta(tuple(raw.get("target_layers", ())), int(raw.get("target_num_layers", 0)),
                     int(raw.get("hidden_size", 0)), int(raw.get("vocab_size", 0)))
    want = (target.num_layers, target.hidden_size, target.vocab_size)
    if (meta.target_num_layers, meta.hidden_size, meta.vocab_size) != want or not all(
        0 <= i < target.num_layers for i in meta.target_layers
    ):
        raise ModelLoadError(
            f"EAGLE head {folder} was trained for a target with (layers, hidden, vocab) = "
            f"{(meta.target_num_layers, meta.hidden_size, meta.vocab_size)}, this target has "
            f"{want}; train a head for it (`specserve distill --method eagle`)"
        )
    state = load_file(folder / "model.safetensors")
    if HEAD_IDS not in state:
        raise ModelLoadError(f"{folder}/model.safetensors has no {HEAD_IDS}")
    head = EagleHead(ModelConfig.from_hf(hf_config), meta, state[HEAD_IDS], embed,
                     dtype=dtype, device=device)
    own = head.saved_state()
    if set(own) != set(state):
        raise ModelLoadError(
            f"{folder}: weights {sorted(set(own) ^ set(state))} do not match an EAGLE head"
        )
    head.load_state_dict(state, strict=False)
    return head.eval().requires_grad_(False)


class EagleRunner:
    """The head plus its one layer's paged KV ([2, num_blocks, block_size, KVH, D], indexed by
    the target's block ids), so one block table per sequence serves target and head."""

    def __init__(self, head: EagleHead, *, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, backend: AttentionBackend) -> None:
        self.head, self.block_size, self.device, self.backend = head, block_size, device, backend
        self.num_blocks, self.dtype = num_blocks, dtype
        # Allocated on the first step: a head no request runs commits no KV memory.
        self._kv: torch.Tensor | None = None  # [2, num_blocks, block_size, KVH, D]
        self.target_layers = head.meta.target_layers

    @property
    def kv_allocated(self) -> bool:
        return self._kv is not None

    @property
    def kv_cache(self) -> torch.Tensor:
        """[2, num_blocks, block_size, KVH, D], zeroed when first read."""
        if self._kv is None:
            mc = self.head.config
            self._kv = zeroed_pool((2, self.num_blocks, self.block_size, mc.num_kv_heads,
                                    mc.head_dim), self.dtype, torch.device(self.device))
        return self._kv

    @staticmethod
    def bytes_per_block(head_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * block_size * head_config.num_kv_heads * head_config.head_dim * element

    def run(self, layout: BatchLayout, feats: torch.Tensor) -> torch.Tensor:
        """The head over a layout; ``feats`` [T, hidden] is g_{p-1} of every fed token p.
        Returns out_p [T, hidden] (every row: the next step chains on them)."""
        return self.step(layout.input_ids, feats, layout.positions, layout.meta)

    def step(self, input_ids: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor,
             meta: AttentionMetadata) -> torch.Tensor:
        with torch.inference_mode():
            kv = (self.kv_cache[0], self.kv_cache[1])
            return self.head.step(input_ids.to(self.device), feats, positions.to(self.device),
                                  kv, meta, self.backend)
