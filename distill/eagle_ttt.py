"""The EAGLE-3 head's training forward: "training-time test" (TTT) over padded batches.

Drafting at inference runs the head S times in a chain: step 0 at the last real position reads
the TARGET's feature of the position before; step j >= 1 reads the head's OWN output of step
j - 1. Training unrolls the same chain for every position at once: at TTT step j, position p
plays the j-th draft of a chain that started at s = p - j. Its attention then sees exactly what
the engine's paged KV holds at that moment:

    keys of step 0 at positions <= s            (computed from target features)
    keys of step i at position s + i, 1 <= i <= j  (the chain's own drafted positions)

so the scores are a causal block shifted by j plus j shifted diagonals (worked example, j = 2,
p = 10: step-0 keys 0..8, the step-1 key at 9, the step-2 key at 10 (itself)). Tokens are the
teacher's (the target's own output), so every step is scored against the target distribution at
p, which is what a draft at p must match to be accepted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.draft.eagle3_head import Eagle3Head
from specserve.kernels.rotary import apply_rotary


def shift_right(x: torch.Tensor, by: int = 1) -> torch.Tensor:
    """x [B, L, ...] -> y with y[:, p] = x[:, p - by] (zeros for p < by)."""
    if by == 0:
        return x
    pad = torch.zeros_like(x[:, :by])
    return torch.cat([pad, x[:, :-by]], dim=1)


def ttt_attention(q: torch.Tensor, ks: list[torch.Tensor], vs: list[torch.Tensor],
                  scale: float) -> torch.Tensor:
    """q [B, L, H, D] of step j = len(ks) - 1; ks/vs: per step 0..j, [B, L, KVH, D].
    Returns [B, L, H, D]."""
    j = len(ks) - 1
    B, L, H, D = q.shape
    rep = H // ks[0].shape[2]

    def heads(t: torch.Tensor) -> torch.Tensor:  # [B, L, KVH, D] -> [B, H, L, D]
        return t.repeat_interleave(rep, dim=2).transpose(1, 2)

    qh = q.transpose(1, 2)  # [B, H, L, D]
    idx = torch.arange(L, device=q.device)
    s0 = (qh @ heads(ks[0]).transpose(-1, -2)) * scale  # [B, H, L, L]
    s0 = s0.masked_fill(idx[None, :] > idx[:, None] - j, float("-inf"))  # key <= p - j
    cols, shifted_v = [s0], []
    for i in range(1, j + 1):
        ki, vi = heads(shift_right(ks[i], j - i)), heads(shift_right(vs[i], j - i))
        d = (qh * ki).sum(-1, keepdim=True) * scale  # [B, H, L, 1]
        cols.append(d.masked_fill((idx < j - i)[:, None], float("-inf")))
        shifted_v.append(vi)
    w = torch.softmax(torch.cat(cols, dim=-1).float(), dim=-1).to(q.dtype)  # [B, H, L, L + j]
    out = w[..., :L] @ heads(vs[0])  # [B, H, L, D]
    for i, vi in enumerate(shifted_v):
        out = out + w[..., L + i : L + i + 1] * vi
    return out.transpose(1, 2)  # [B, L, H, D]


def ttt_forward(
    head: Eagle3Head, input_ids: torch.Tensor, target_feats: torch.Tensor, steps: int,
    noise: float = 0.0, rows: list[torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """input_ids [B, L]; target_feats [B, L, len(layers) * hidden] (the target's hidden states
    at each position). Returns per TTT step j the head's output out_j [B, L, hidden] (or, with
    ``rows`` (one bool mask [B, L] per step), only the selected rows [N_j, hidden]).

    ``noise``: Gaussian noise (relative to the features' std) added to the target features, so
    the head learns to read imperfect features, as its own are."""
    layer, attn = head.layer, head.layer.self_attn
    B, L = input_ids.shape
    g = head.fuse(target_feats)  # [B, L, hidden]
    if noise > 0:
        g = g + noise * g.detach().std() * torch.randn_like(g)
    feats = shift_right(g)  # position p reads g_{p-1}
    emb = F.embedding(input_ids, head.embed).to(g.dtype)
    positions = torch.arange(L, device=input_ids.device)
    if head.rotary.inv_freq.device != positions.device:
        head.rotary.inv_freq = head.rotary.inv_freq.to(positions.device)
    cos, sin = head.rotary.cos_sin(positions, g.dtype)  # [L, 1, D]
    ks: list[torch.Tensor] = []
    vs: list[torch.Tensor] = []
    outs: list[torch.Tensor] = []
    for j in range(steps):
        x, residual = layer.attn_input(emb, feats)  # [B, L, 2 * hidden], [B, L, hidden]
        qkv = attn.qkv_proj(x)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.view(B, L, attn.num_heads, attn.head_dim)
        k = k.view(B, L, attn.num_kv_heads, attn.head_dim)
        v = v.view(B, L, attn.num_kv_heads, attn.head_dim)
        if attn.q_norm is not None and attn.k_norm is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary(q, k, cos, sin)
        ks.append(k)
        vs.append(v)
        o = ttt_attention(q, ks, vs, attn.scale).reshape(B, L, attn.q_size)
        h = residual + attn.o_proj(o)
        out = head.chained(h + layer.mlp(layer.post_attention_layernorm(h)))  # [B, L, hidden]
        outs.append(out if rows is None else out[rows[j]])
        feats = shift_right(out)  # the next step reads this step's output at p - 1
    return outs
