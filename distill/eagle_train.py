"""Training loop of the EAGLE-3 head: features recomputed online, training-time test, resumable.

Per batch of teacher sequences (``TeacherData``: only ``tokens`` and ``prompt_lens`` are read):
  1. the target runs once, without gradients (transformers' implementation of its
     architecture), giving its hidden states at the head's layers and its distribution over the
     head vocabulary at every position; nothing is stored, so features cost 0 bytes per token
     on disk (the price is one target forward per batch);
  2. the head unrolls ``ttt_steps`` chained draft steps (distill/eagle_ttt.py) on noisy target
     features; step j's loss is the cross-entropy from the target's distribution to the head's,
     over positions whose chain starts inside the response, weighted ``step_decay ** j``.

On CUDA (``device="cuda"``) both run under bfloat16 autocast. Checkpoints (head, optimizer,
step, head ids) go to ``checkpoint`` every ``checkpoint_every`` steps and on exit; the batch
order is a pure function of the seed and the data, so a resumed run continues where it stopped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from specserve.distill.data import TeacherData
from specserve.distill.eagle_ttt import ttt_forward
from specserve.draft.eagle3_head import Eagle3Head

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EagleTrainConfig:
    steps: int = 2000
    lr: float = 1e-3
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    batch_tokens: int = 4096  # padded tokens per batch (B x longest sequence)
    max_len: int = 512  # longer sequences are cut at the end
    ttt_steps: int = 3  # chained draft steps unrolled in training (>= 1)
    step_decay: float = 0.8  # loss weight of TTT step j: step_decay ** j
    feature_noise: float = 0.05  # Gaussian noise on target features, relative to their std
    checkpoint_every: int = 50
    eval_every: int = 100
    max_minutes: float | None = None
    seed: int = 0
    device: str = "cpu"


# Settings that may change when a run resumes (they do not change what is learned per step).
_RESUMABLE = ("max_minutes", "device", "checkpoint_every", "eval_every")


@dataclass
class Batch:
    input_ids: torch.Tensor  # int64 [B, L] (0 past each sequence's end)
    lengths: torch.Tensor  # int64 [B]
    prompt_lens: torch.Tensor  # int64 [B]

    def rows(self, j: int) -> torch.Tensor:
        """bool [B, L]: positions p scored at TTT step j: the chain starts at p - j inside the
        response (p - j >= prompt_len - 1) and p has a next token."""
        pos = torch.arange(self.input_ids.shape[1], device=self.input_ids.device)[None, :]
        return (pos - j >= self.prompt_lens[:, None] - 1) & (pos + 1 < self.lengths[:, None])

    def to(self, device: torch.device) -> Batch:
        return Batch(self.input_ids.to(device), self.lengths.to(device),
                     self.prompt_lens.to(device))


@dataclass
class EvalMetrics:
    loss: float
    agree: list[float]  # per TTT step: head argmax == the teacher's next token
    tokens_per_verify: float  # greedy chain estimate at k = ttt_steps (1 + accepted drafts)


def make_batches(data: TeacherData, cfg: EagleTrainConfig, seed: int) -> list[Batch]:
    """One epoch, order fixed by ``seed``; similar lengths share a batch (little padding)."""
    order = [i for i in range(len(data)) if len(data.tokens[i]) > data.prompt_lens[i]]
    random.Random(seed).shuffle(order)
    batches: list[Batch] = []
    for start in range(0, len(order), 256):
        window = sorted(order[start:start + 256], key=lambda i: len(data.tokens[i]))
        group: list[int] = []
        for i in window:
            longest = min(len(data.tokens[i]), cfg.max_len)
            if group and longest * (len(group) + 1) > cfg.batch_tokens:
                batches.append(_collate(data, group, cfg.max_len))
                group = []
            group.append(i)
        if group:
            batches.append(_collate(data, group, cfg.max_len))
    random.Random(seed + 1).shuffle(batches)
    return batches


def _collate(data: TeacherData, group: list[int], max_len: int) -> Batch:
    seqs = [data.tokens[i][:max_len].long() for i in group]
    ids = torch.zeros((len(seqs), max(len(s) for s in seqs)), dtype=torch.int64)
    for b, s in enumerate(seqs):
        ids[b, : len(s)] = s
    return Batch(ids, torch.tensor([len(s) for s in seqs]),
                 torch.tensor([data.prompt_lens[i] for i in group]))


class Teacher:
    """The frozen target: hidden states of the head's layers and log-probs over the head's
    vocabulary, for a padded batch."""

    def __init__(self, hf_config: Any, state: dict[str, torch.Tensor], head: Eagle3Head,
                 device: torch.device) -> None:
        from transformers import AutoModel

        base = AutoModel.from_config(hf_config, attn_implementation="sdpa", dtype=torch.float32)
        own = {k.removeprefix("model."): v for k, v in state.items()
               if not k.startswith("lm_head")}
        missing, unexpected = base.load_state_dict(own, strict=False)
        missing = [m for m in missing if "rotary" not in m]
        if missing or unexpected:
            raise ValueError(f"teacher: missing {missing}, unexpected {unexpected}")
        self.model = base.to(device).eval().requires_grad_(False)
        rows = state.get("lm_head.weight", state.get("model.embed_tokens.weight"))
        assert rows is not None
        self.out_rows = rows[head.head_token_ids.cpu()].float().to(device)  # [Vd, hidden]
        self.layers = head.meta.target_layers
        self._taken: dict[int, torch.Tensor] = {}
        for i in self.layers:  # hooks: each layer's own output (before any final norm)
            self.model.layers[i].register_forward_hook(self._keep(i))

    def _keep(self, i: int):
        def hook(_module, _args, output) -> None:
            self._taken[i] = output[0] if isinstance(output, tuple) else output
        return hook

    @torch.no_grad()
    def __call__(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (features [B, L, len(layers) * hidden], log-probs over the head vocab [B, L, Vd])"""
        L = batch.input_ids.shape[1]
        mask = (torch.arange(L, device=batch.input_ids.device)[None, :]
                < batch.lengths[:, None]).long()
        out = self.model(input_ids=batch.input_ids, attention_mask=mask)
        feats = torch.cat([self._taken[i] for i in self.layers], dim=-1)
        logits = out.last_hidden_state @ self.out_rows.to(out.last_hidden_state.dtype).T
        self._taken.clear()
        return feats, torch.log_softmax(logits.float(), dim=-1)


def batch_loss(
    head: Eagle3Head, teacher: Teacher, batch: Batch, cfg: EagleTrainConfig, train: bool,
    autocast: contextlib.AbstractContextManager,
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """(weighted loss, per step: bool [N_j] head argmax == teacher's next token, per step the
    row masks [B, L])."""
    rows = [batch.rows(j).to(batch.input_ids.device) for j in range(cfg.ttt_steps)]
    with autocast:
        feats, target_lp = teacher(batch)
        outs = ttt_forward(head, batch.input_ids, feats, cfg.ttt_steps,
                           cfg.feature_noise if train else 0.0, rows)
        losses, hits = [], []
        nxt = torch.cat([batch.input_ids[:, 1:], batch.input_ids[:, :1]], dim=1)  # x_{p+1}
        for j, (out, r) in enumerate(zip(outs, rows)):
            if out.shape[0] == 0:
                continue
            log_q = torch.log_softmax(head.logits(out), dim=-1)  # [N, Vd]
            p = target_lp[r].exp()
            losses.append(cfg.step_decay**j * -(p * log_q).sum(-1).mean())
            hits.append(head.head_token_ids.to(log_q.device)[log_q.argmax(-1)] == nxt[r])
    loss = torch.stack(losses).sum() if losses else torch.zeros((), requires_grad=train)
    return loss, hits, rows


def chain_tokens_per_verify(hits: list[torch.Tensor], rows: list[torch.Tensor]) -> float:
    """Greedy estimate: per chain start s with all k = len(hits) steps scored, 1 + the number of
    leading steps whose draft matched."""
    k = len(hits)
    B, L = rows[0].shape
    full = []
    for j in range(k):
        grid = torch.zeros((B, L), dtype=torch.bool, device=rows[j].device)
        grid[rows[j]] = hits[j]
        full.append(shift_left(grid, j))  # indexed by chain start s = p - j
    ok = shift_left(rows[k - 1], k - 1)  # starts whose last step is scored
    run = torch.ones_like(ok)
    accepted = torch.zeros((B, L), dtype=torch.float32, device=ok.device)
    for j in range(k):
        run = run & full[j]
        accepted += run.float()
    return 1.0 + float(accepted[ok].mean()) if bool(ok.any()) else 1.0


def shift_left(x: torch.Tensor, by: int) -> torch.Tensor:
    """x [B, L] -> y with y[:, s] = x[:, s + by] (False past the end)."""
    if by == 0:
        return x
    return torch.cat([x[:, by:], torch.zeros_like(x[:, :by])], dim=1)


def lr_at(step: int, cfg: EagleTrainConfig) -> float:
    """Linear warm-up (at most a tenth of the run), then cosine decay to lr * min_lr_ratio."""
    warmup = max(1, min(cfg.warmup_steps, cfg.steps // 10))
    if step < warmup:
        return cfg.lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, cfg.steps - warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def evaluate(head: Eagle3Head, teacher: Teacher, batches: list[Batch], cfg: EagleTrainConfig,
             autocast: contextlib.AbstractContextManager, device: torch.device) -> EvalMetrics:
    head.eval()
    loss, n = 0.0, 0
    agree = [[0, 0] for _ in range(cfg.ttt_steps)]
    tpv, chains = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            batch = batch.to(device)
            value, hits, rows = batch_loss(head, teacher, batch, cfg, False, autocast)
            loss, n = loss + float(value), n + 1
            for j, h in enumerate(hits):
                agree[j][0] += int(h.sum())
                agree[j][1] += h.numel()
            if len(hits) == cfg.ttt_steps:
                tpv, chains = tpv + chain_tokens_per_verify(hits, rows), chains + 1
    head.train()
    return EvalMetrics(loss / max(n, 1), [a / max(t, 1) for a, t in agree],
                       tpv / max(chains, 1))


def train_head(
    head: Eagle3Head, teacher: Teacher, train_data: TeacherData, val_data: TeacherData,
    cfg: EagleTrainConfig, checkpoint: Path, curve: Path | None = None,
) -> tuple[int, EvalMetrics | None]:
    """Trains ``head`` in place (resuming from ``checkpoint``). Appends one JSON line per
    held-out evaluation to ``curve`` (step, response tokens trained on, metrics)."""
    device = torch.device(cfg.device)
    autocast: contextlib.AbstractContextManager = (
        torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
        else contextlib.nullcontext()
    )
    torch.manual_seed(cfg.seed)
    params = [p for p in head.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    step, seen = 0, 0
    comparable = {k: v for k, v in asdict(cfg).items() if k not in _RESUMABLE}
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False, map_location=device)
        if state["train"] != comparable:
            raise ValueError(f"{checkpoint} was written with other training settings "
                             f"({state['train']}); pass the same flags to resume, or delete it")
        head.load_state_dict(state["head"], strict=False)
        optim.load_state_dict(state["optim"])
        step, seen = state["step"], state.get("tokens", 0)
    val_batches = make_batches(val_data, cfg, cfg.seed) if len(val_data) else []
    epoch, epoch_batches = 0, make_batches(train_data, cfg, cfg.seed)
    if not epoch_batches:
        raise ValueError("no teacher sequence has a response to train on")
    per_epoch = len(epoch_batches)

    def save() -> None:
        tmp = checkpoint.with_suffix(".tmp")
        torch.save({"head": head.saved_state(), "optim": optim.state_dict(), "step": step,
                    "tokens": seen, "train": comparable}, tmp)
        tmp.rename(checkpoint)

    last: EvalMetrics | None = None
    started = time.monotonic()
    bar = tqdm(total=cfg.steps, initial=step, desc="eagle", unit="step", dynamic_ncols=True)
    head.train()
    try:
        while step < cfg.steps:
            if step // per_epoch != epoch:
                epoch = step // per_epoch
                epoch_batches = make_batches(train_data, cfg, cfg.seed + epoch)
            batch = epoch_batches[step % per_epoch % len(epoch_batches)].to(device)
            for group in optim.param_groups:
                group["lr"] = lr_at(step, cfg)
            loss, hits, _ = batch_loss(head, teacher, batch, cfg, True, autocast)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optim.step()
            step += 1
            seen += int((batch.lengths - batch.prompt_lens).sum())
            bar.update(1)
            bar.set_postfix(loss=f"{float(loss.detach()):.3f}",
                            agree="/".join(f"{float(h.float().mean()):.2f}" for h in hits))
            if step % cfg.checkpoint_every == 0:
                save()
            if val_batches and step % cfg.eval_every == 0:
                last = evaluate(head, teacher, val_batches, cfg, autocast, device)
                _report(bar, curve, step, seen, last)
            if cfg.max_minutes and time.monotonic() - started > cfg.max_minutes * 60:
                bar.write(f"time budget of {cfg.max_minutes} min reached at step {step}")
                break
    finally:
        save()
        bar.close()
    if val_batches and (last is None or step % cfg.eval_every):
        last = evaluate(head, teacher, val_batches, cfg, autocast, device)
        _report(None, curve, step, seen, last)
    return step, last


def _report(bar: tqdm | None, curve: Path | None, step: int, seen: int, m: EvalMetrics) -> None:
    line = (f"step {step} ({seen} response tokens): held-out loss {m.loss:.4f}, agreement per "
            f"TTT step {[round(a, 4) for a in m.agree]}, est. tokens/verify at k="
            f"{len(m.agree)} {m.tokens_per_verify:.3f}")
    (bar.write if bar is not None else log.info)(line)
    if curve is not None:
        with curve.open("a") as f:
            f.write(json.dumps({"step": step, "tokens": seen, **asdict(m)}) + "\n")
