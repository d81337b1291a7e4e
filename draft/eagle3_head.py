"""Eagle3Head: a published-style EAGLE-3 draft head on our paged KV.

The equations (SafeAILab EAGLE-3, vLLM's ``llama_eagle3``, the ``speculators`` Eagle3 model), at
token position p with the target's hidden states a_1..a_n of the aux layers at p - 1:

    g        = fc(concat(a_1, .., a_n))          [n * H_target -> H]   (the "hidden", p - 1)
               EAGLE 3.1: fc(norm(concat(..)))   (norm_before_fc) or
                          fc(concat(norm_i(a_i))) (fc_norm)
    x        = concat(input_layernorm(embed(x_p)), hidden_norm(g))       [2H]
    r        = g, or hidden_norm(g) with ``norm_before_residual``
    h        = r + o_proj(attention(q/k/v = W_qkv x))                    (q/k/v in-features 2H)
    out_p    = h + mlp(post_attention_layernorm(h))
    logits   = lm_head(norm(out_p))                  over the draft vocabulary
    target id of draft id d = d + d2t[d]

Chained drafting feeds the head's own output as the next position's ``g`` (the published code
passes the pre-norm ``out_p``; with EAGLE 3.1's ``norm_output`` it passes ``norm(out_p)``, and
the logits are ``lm_head`` of that). The embedding table is the target's unless the checkpoint
has its own (a plain attribute, never a parameter).

The head keeps its own one-layer KV indexed by the target's block ids (``EagleRunner``) and is
driven by ``EagleProposer``: both only use ``fuse``, ``step``, ``logits``, ``head_token_ids``,
``config`` and ``meta``, the same as our older ``EagleHead``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specserve.draft.eagle_head import EagleMeta, attach_target_tables
from specserve.kernels.linear import DenseLinear
from specserve.kernels.metadata import AttentionMetadata
from specserve.kernels.registry import AttentionBackend
from specserve.target.config import ModelConfig
from specserve.target.layers import MLP, Attention, KVCache, RMSNorm


@dataclass(frozen=True)
class Eagle3Options:
    """The switches the published variants differ by (all False: plain EAGLE-3)."""

    norm_before_residual: bool = False
    norm_before_fc: bool = False  # one RMSNorm over the concatenated aux states
    fc_norm: bool = False  # one RMSNorm per aux state
    norm_output: bool = False  # chain on norm(out) instead of out


class Eagle3Layer(nn.Module):
    """The midlayer: attention over [input_layernorm(embeds), hidden_norm(hidden)] (2H wide),
    residual from the hidden, then the usual MLP block."""

    def __init__(self, cfg: ModelConfig, norm_before_residual: bool, **factory: object) -> None:
        super().__init__()
        hidden = cfg.hidden_size

        def norm() -> RMSNorm:
            return RMSNorm(hidden, cfg.rms_norm_eps, **factory)

        self.norm_before_residual = norm_before_residual
        self.input_layernorm, self.hidden_norm, self.post_attention_layernorm = (
            norm(), norm(), norm())
        self.self_attn = Attention(cfg, 0, **factory)
        self.self_attn.qkv_proj = DenseLinear(2 * hidden, cfg.q_size + 2 * cfg.kv_size,
                                              bias=cfg.qkv_bias, **factory)
        self.mlp = MLP(cfg, **factory)

    def attn_input(self, embeds: torch.Tensor, hidden: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """embeds, hidden [..., H] -> (attention input [..., 2H], residual [..., H])."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        return torch.cat([self.input_layernorm(embeds), normed], dim=-1), residual

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata, backend: AttentionBackend,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:  # [T, H]
        x, residual = self.attn_input(embeds, hidden)
        h = residual + self.self_attn(positions, x, kv_cache, meta, backend, rope)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """fc (+ EAGLE 3.1's optional norms), the midlayer, the final norm and the draft-vocabulary
    lm_head. ``head_token_ids`` [Vd] holds the target id of each draft id (d + d2t[d]).

    ``config`` is the midlayer's ModelConfig (one layer, the draft's hidden size H); ``meta``
    records the target it reads (``target_layers``: which of OUR captured layer outputs, in
    the order fc concatenates them; ``hidden_size``: the target's width)."""

    def __init__(
        self, config: ModelConfig, meta: EagleMeta, head_token_ids: torch.Tensor,
        embed: torch.Tensor, options: Eagle3Options = Eagle3Options(), *,
        dtype: torch.dtype | None = None, device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        factory: dict[str, object] = {"dtype": dtype, "device": device}
        hidden, n_aux = config.hidden_size, len(meta.target_layers)
        self.config, self.meta, self.options = config, meta, options
        self.dtype = dtype or torch.get_default_dtype()
        eps = config.rms_norm_eps
        self.input_norm = (RMSNorm(n_aux * meta.hidden_size, eps, **factory)
                           if options.norm_before_fc else None)
        self.fc_norm = (nn.ModuleList(RMSNorm(meta.hidden_size, eps, **factory)
                                      for _ in range(n_aux)) if options.fc_norm else None)
        self.fc = DenseLinear(n_aux * meta.hidden_size, hidden, bias=False, **factory)
        self.layer = Eagle3Layer(config, options.norm_before_residual, **factory)
        self.norm = RMSNorm(hidden, eps, **factory)
        self.lm_head = DenseLinear(hidden, len(head_token_ids), bias=False, **factory)
        self.head_token_ids: torch.Tensor
        attach_target_tables(self, config, head_token_ids, embed, device)

    def fuse(self, layer_feats: torch.Tensor) -> torch.Tensor:
        """[T, n_aux * H_target] target hidden states -> g [T, H]."""
        a = layer_feats.to(self.dtype)
        if self.input_norm is not None:
            a = self.input_norm(a)
        if self.fc_norm is not None:
            parts = a.chunk(len(self.fc_norm), dim=-1)
            a = torch.cat([n(p) for n, p in zip(self.fc_norm, parts)], dim=-1)
        return self.fc(a)

    def embeds(self, input_ids: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(input_ids, self.embed).to(like.dtype)

    def chained(self, out: torch.Tensor) -> torch.Tensor:
        """The midlayer's output -> what the next draft position reads as its hidden."""
        return self.norm(out) if self.options.norm_output else out

    def step(
        self,
        input_ids: torch.Tensor,  # [T]
        feats: torch.Tensor,  # [T, H]: g of position p - 1 for each token p
        positions: torch.Tensor,  # [T]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:  # [T, H]: the next position's hidden
        if self.rotary.inv_freq.device != positions.device:
            self.rotary.inv_freq = self.rotary.inv_freq.to(positions.device)
        cos, sin = self.rotary.cos_sin(positions, feats.dtype)
        rope = (cos[:, 0].contiguous(), sin[:, 0].contiguous())
        out = self.layer(positions, self.embeds(input_ids, feats), feats, kv_cache, meta,
                         backend, rope)
        return self.chained(out)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """A chained hidden [N, H] -> float32 logits [N, Vd]."""
        return self.lm_head(hidden if self.options.norm_output else self.norm(hidden)).float()

    def saved_state(self) -> dict[str, torch.Tensor]:
        """Trainable tensors plus the head ids (rotary tables and embeddings excluded)."""
        return {k: v for k, v in self.state_dict().items() if "rotary" not in k}

    def quantize(self, fmt: str = "q8_0") -> dict[str, str]:
        """Inference only: the projections become block-quantized (``kernels.quant``) and the
        norms, rotary and MLP run the fused float32 ops, as a quantized target's draft does."""
        from specserve.target.quantize import quantize_linears

        if self.dtype != torch.float32:
            raise ValueError(f"block-quantized projections compute in float32, not {self.dtype}")
        return quantize_linears(self, fmt)
