"""EAGLE-3 heads for tests: random checkpoints written in the published layouts, and a plain
torch forward of the published equations (SafeAILab EAGLE-3 / vLLM / speculators) on a
checkpoint's own tensors, independent of specserve's head."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

DRAFT_IDS = torch.arange(0, 300, 2)  # the tiny target's even token ids: a 150-token draft vocab


def random_tensors(hidden: int, heads: int, kv_heads: int, inter: int, n_aux: int,
                   target_hidden: int, draft_ids: torch.Tensor, vocab: int, seed: int,
                   prefix: str = "midlayer.") -> dict[str, torch.Tensor]:
    """One-layer EAGLE-3 weights under the published names (q/k/v in-features 2H)."""
    g = torch.Generator().manual_seed(seed)
    d = hidden // heads

    def mat(n: int, k: int, std: float = 0.15) -> torch.Tensor:
        return std * torch.randn(n, k, generator=g)

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.3 * torch.randn(n, generator=g)

    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[draft_ids] = True
    layer = {
        "input_layernorm.weight": norm(hidden), "hidden_norm.weight": norm(hidden),
        "post_attention_layernorm.weight": norm(hidden),
        "self_attn.q_proj.weight": mat(heads * d, 2 * hidden),
        "self_attn.k_proj.weight": mat(kv_heads * d, 2 * hidden),
        "self_attn.v_proj.weight": mat(kv_heads * d, 2 * hidden),
        "self_attn.o_proj.weight": mat(hidden, heads * d),
        "mlp.gate_proj.weight": mat(inter, hidden), "mlp.up_proj.weight": mat(inter, hidden),
        "mlp.down_proj.weight": mat(hidden, inter),
    }
    return {
        "fc.weight": mat(hidden, n_aux * target_hidden, 0.1), "norm.weight": norm(hidden),
        "lm_head.weight": mat(len(draft_ids), hidden, 0.5),
        "d2t": draft_ids - torch.arange(len(draft_ids)), "t2d": t2d,
        **{prefix + k: v for k, v in layer.items()},
    }


def write_published(folder: Path, target_config: dict, tensors: dict[str, torch.Tensor],
                    architecture: str, extra: dict | None = None) -> Path:
    """A head folder as EAGLE/SpecForge (``LlamaForCausalLMEagle3``) or vLLM/AngelSlim
    (``Eagle3LlamaForCausalLM``) publish it: the target's config cut to one layer."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = {**target_config, "architectures": [architecture], "num_hidden_layers": 1,
              "draft_vocab_size": int(tensors["lm_head.weight"].shape[0]), **(extra or {})}
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "model.safetensors")
    return folder


def layer_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The midlayer's tensors under short names, whatever the layout's prefix."""
    out = {}
    for k, v in tensors.items():
        for p in ("model.layers.0.", "layers.0.", "midlayer."):
            if k.startswith(p):
                out[k[len(p):]] = v
    return out


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double())


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [T, heads, D] rotated by position (the rotate-half convention of Llama)."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos.double()[:, None] * inv[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class ReferenceHead:
    """The published EAGLE-3 forward in float64 on a checkpoint's tensors (published names).

    ``options``: norm_before_residual, norm_before_fc, fc_norm, norm_output (EAGLE 3.1)."""

    def __init__(self, tensors: dict[str, torch.Tensor], embed: torch.Tensor, heads: int,
                 kv_heads: int, eps: float, theta: float, **options: bool) -> None:
        self.t = {k: v.double() if v.is_floating_point() else v for k, v in tensors.items()}
        self.layer = layer_tensors(self.t)
        self.embed = self.t.get("embed_tokens.weight", embed.double())
        self.heads, self.kv_heads, self.eps, self.theta = heads, kv_heads, eps, theta
        self.o = options
        self.ids = torch.arange(len(self.t["d2t"])) + self.t["d2t"]

    def fc(self, aux: torch.Tensor) -> torch.Tensor:  # [T, n * Ht] -> [T, H]
        a = aux.double()
        if self.o.get("norm_before_fc"):
            a = _rms(a, self.t["input_norm.weight"], self.eps)
        if self.o.get("fc_norm"):
            n = sum(1 for k in self.t if k.startswith("fc_norm."))
            a = torch.cat([_rms(c, self.t[f"fc_norm.{i}.weight"], self.eps)
                           for i, c in enumerate(a.chunk(n, dim=-1))], -1)
        return a @ self.t["fc.weight"].T

    def qkv_out(self, tokens: torch.Tensor, hidden: torch.Tensor, pos: torch.Tensor):
        L = self.layer
        e = _rms(self.embed[tokens], L["input_layernorm.weight"], self.eps)
        hn = _rms(hidden, L["hidden_norm.weight"], self.eps)
        residual = hn if self.o.get("norm_before_residual") else hidden
        x = torch.cat([e, hn], -1)
        d = L["self_attn.q_proj.weight"].shape[0] // self.heads
        q = (x @ L["self_attn.q_proj.weight"].T).view(-1, self.heads, d)
        k = (x @ L["self_attn.k_proj.weight"].T).view(-1, self.kv_heads, d)
        v = (x @ L["self_attn.v_proj.weight"].T).view(-1, self.kv_heads, d)
        return _rope(q, pos, self.theta), _rope(k, pos, self.theta), v, residual

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        L = self.layer
        h = residual + attn.reshape(attn.shape[0], -1) @ L["self_attn.o_proj.weight"].T
        m = _rms(h, L["post_attention_layernorm.weight"], self.eps)
        m = F.silu(m @ L["mlp.gate_proj.weight"].T) * (m @ L["mlp.up_proj.weight"].T)
        return h + m @ L["mlp.down_proj.weight"].T

    def attend(self, q, k, v, causal_from: int) -> torch.Tensor:
        """q [Tq, H, D] at key positions causal_from.. of k, v [Tk, KVH, D]."""
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        s = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
        qi = torch.arange(q.shape[0])[:, None] + causal_from
        s = s.masked_fill(torch.arange(k.shape[0])[None, :] > qi, float("-inf"))
        return torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """The midlayer's output -> lm_head(norm(out)) (norm_output changes only the chain)."""
        return _rms(out, self.t["norm.weight"], self.eps) @ self.t["lm_head.weight"].T

    def chain(self, out: torch.Tensor) -> torch.Tensor:
        return _rms(out, self.t["norm.weight"], self.eps) if self.o.get("norm_output") else out

    def draft(self, tokens: torch.Tensor, aux: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """tokens [n], aux [n, n_aux * Ht] (the target's states at each position). Position p
        reads embed(x_p) and fc(aux[p - 1]) (zeros at p = 0). Returns the step-0 logits of
        every position [n, Vd], then one [1, Vd] row per chained greedy draft step."""
        n = len(tokens)
        g = torch.cat([torch.zeros(1, self.t["fc.weight"].shape[0], dtype=torch.float64),
                       self.fc(aux)[:-1]])
        pos = torch.arange(n)
        q, k, v, res = self.qkv_out(tokens, g, pos)
        out = self.finish(self.attend(q, k, v, 0), res)
        rows = [self.logits(out)]
        ks, vs, prev = k, v, self.chain(out[-1:])
        token = self.ids[rows[-1][-1].argmax()].view(1)
        for j in range(1, steps):
            q, k, v, res = self.qkv_out(token, prev, torch.tensor([n - 1 + j]))
            ks, vs = torch.cat([ks, k]), torch.cat([vs, v])
            out = self.finish(self.attend(q, ks, vs, n - 1 + j), res)
            rows.append(self.logits(out))
            prev = self.chain(out)
            token = self.ids[rows[-1][-1].argmax()].view(1)
        return rows
