"""Distillation loop: the student learns the target's next-token distribution (KL divergence on
the target's top-K log-probs, renormalized over the tokens the student's head can emit).

Resumable: every ``checkpoint_every`` steps (and on Ctrl-C or when the time budget runs out)
the trainable weights, optimizer, scheduler and step go to ``checkpoint.pt``; the batch order
is a pure function of the seed, so a resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specserve.distill.data import TeacherData
from specserve.distill.student import Student

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 3000
    lr: float = 5e-4
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1  # cosine decay to lr * this
    batch_tokens: int = 4096  # padded tokens per batch (B x longest sequence)
    max_len: int = 512  # longer sequences are cut (prompt first, so responses stay aligned)
    checkpoint_every: int = 100
    eval_every: int = 250
    max_minutes: float | None = None  # stop early (with a checkpoint) after this long
    seed: int = 0


@dataclass
class Batch:
    input_ids: torch.Tensor  # int64 [B, L]
    attention_mask: torch.Tensor  # int64 [B, L]
    rows: torch.Tensor  # int64 [N, 2]: (batch, position) of every scored position
    top_idx: torch.Tensor  # int64 [N, K]: head index of each teacher top-K token, -1 if absent
    top_logprobs: torch.Tensor  # float32 [N, K]


@dataclass
class Metrics:
    loss: float  # cross-entropy against the teacher distribution (KL + its entropy)
    kl: float  # KL(teacher || student) over the teacher's top-K, renormalized
    agree: float  # fraction of positions where the student's argmax is the teacher's


def head_lookup(head_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int64 [V]: token id -> row of the student's head, -1 when the head lacks it."""
    table = torch.full((vocab_size,), -1, dtype=torch.int64)
    table[head_ids] = torch.arange(len(head_ids))
    return table


def make_batches(
    data: TeacherData, lookup: torch.Tensor, cfg: TrainConfig, seed: int
) -> list[Batch]:
    """One epoch of batches in an order fixed by ``seed``. Sequences of similar length share a
    batch so padding stays small."""
    order = list(range(len(data)))
    random.Random(seed).shuffle(order)
    batches: list[Batch] = []
    for start in range(0, len(order), 256):  # sort within windows: random across, tidy within
        window = sorted(order[start:start + 256], key=lambda i: len(data.tokens[i]))
        group: list[int] = []
        for i in window:
            length = min(len(data.tokens[i]) - 1, cfg.max_len)
            longest = max([length] + [min(len(data.tokens[j]) - 1, cfg.max_len) for j in group])
            if group and longest * (len(group) + 1) > cfg.batch_tokens:
                batches.append(_collate(data, group, lookup, cfg.max_len))
                group = []
            group.append(i)
        if group:
            batches.append(_collate(data, group, lookup, cfg.max_len))
    random.Random(seed + 1).shuffle(batches)
    return [b for b in batches if len(b.rows)]


def _collate(data: TeacherData, group: list[int], lookup: torch.Tensor, max_len: int) -> Batch:
    seqs = [data.tokens[i][:-1][:max_len].long() for i in group]  # inputs; last token is a label
    width = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.int64)
    mask = torch.zeros((len(seqs), width), dtype=torch.int64)
    rows, top_ids, top_lp = [], [], []
    for b, (i, seq) in enumerate(zip(group, seqs)):
        ids[b, : len(seq)] = seq
        mask[b, : len(seq)] = 1
        p = data.prompt_lens[i]
        n = min(len(data.top_ids[i]), len(seq) - (p - 1))  # response rows that fit
        if n <= 0:
            continue
        rows.append(torch.stack([torch.full((n,), b), torch.arange(p - 1, p - 1 + n)], dim=1))
        top_ids.append(data.top_ids[i][:n].long())
        top_lp.append(data.top_logprobs[i][:n].float())
    if not rows:
        empty = torch.empty((0, 2), dtype=torch.int64)
        return Batch(ids, mask, empty, empty, torch.empty((0, 2)))
    top = torch.cat(top_ids)
    return Batch(ids, mask, torch.cat(rows), lookup[top], torch.cat(top_lp))


def distill_loss(logits: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, Metrics]:
    """logits [N, Vd] -> (mean cross-entropy to the teacher, metrics). Teacher tokens outside
    the head are dropped and the rest renormalized: the student cannot emit them anyway."""
    present = batch.top_idx >= 0  # [N, K]
    keep = present.any(dim=1)
    logits, idx, present = logits[keep], batch.top_idx[keep], present[keep]
    teacher_lp = batch.top_logprobs[keep].masked_fill(~present, float("-inf"))
    p = torch.softmax(teacher_lp, dim=-1)  # [N, K]
    log_q = torch.log_softmax(logits.float(), dim=-1).gather(1, idx.clamp(min=0))  # [N, K]
    cross = -(p * log_q).masked_fill(~present, 0.0).sum(-1)  # [N]
    log_p = torch.log(p.clamp(min=1e-30))
    kl = (p * (log_p - log_q)).masked_fill(~present, 0.0).sum(-1)
    agree = logits.argmax(-1) == idx[:, 0]  # the teacher's top-1 is column 0
    metrics = Metrics(
        loss=cross.detach().mean().item(), kl=kl.detach().mean().item(),
        agree=agree.float().mean().item(),
    )
    return cross.mean(), metrics


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, frac)))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


@torch.no_grad()
def evaluate(student: Student, batches: list[Batch]) -> Metrics:
    student.eval()
    total, weights = Metrics(0.0, 0.0, 0.0), 0
    for batch in batches:
        _, m = distill_loss(student(batch.input_ids, batch.attention_mask, batch.rows), batch)
        n = len(batch.rows)
        total = Metrics(total.loss + m.loss * n, total.kl + m.kl * n, total.agree + m.agree * n)
        weights += n
    student.train()
    w = max(weights, 1)
    return Metrics(total.loss / w, total.kl / w, total.agree / w)


def train(
    student: Student, train_data: TeacherData, val_data: TeacherData, cfg: TrainConfig,
    checkpoint: Path, vocab_size: int,
) -> tuple[int, Metrics | None]:
    """Trains ``student`` in place (resuming from ``checkpoint`` when it exists). Returns the
    step reached and the last validation metrics."""
    torch.manual_seed(cfg.seed)
    lookup = head_lookup(student.head_ids, vocab_size)
    params = [p for p in student.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.98))
    step = 0
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        if state["train"] != asdict(cfg) | {"max_minutes": state["train"]["max_minutes"]}:
            raise ValueError(
                f"{checkpoint} was written with other training settings ({state['train']}); "
                f"pass the same flags to resume, or delete it to start over"
            )
        student.load_state_dict(state["student"], strict=False)
        optim.load_state_dict(state["optim"])
        step = state["step"]
    val_batches = make_batches(val_data, lookup, cfg, seed=cfg.seed) if len(val_data) else []
    last_val: Metrics | None = None
    # Epoch e's batches use seed + e; epoch 0's also fix how many steps an epoch has.
    epoch, epoch_batches = 0, make_batches(train_data, lookup, cfg, seed=cfg.seed)
    per_epoch = max(1, len(epoch_batches))
    started = time.monotonic()

    def save() -> None:
        trainable = {k: v for k, v in student.state_dict().items() if "embed_tokens" not in k}
        tmp = checkpoint.with_suffix(".tmp")
        torch.save(
            {"student": trainable, "optim": optim.state_dict(), "step": step,
             "train": asdict(cfg)}, tmp,
        )
        tmp.rename(checkpoint)

    # Small data sets overfit with many epochs: the weights with the lowest held-out KL are kept
    # beside the checkpoint and are what the run returns.
    best_file = checkpoint.with_name("best.pt")

    def keep_if_best(m: Metrics) -> None:
        previous = torch.load(best_file, weights_only=False)["kl"] if best_file.exists() else None
        if previous is None or m.kl < previous:
            trainable = {k: v for k, v in student.state_dict().items() if "embed_tokens" not in k}
            torch.save({"student": trainable, "kl": m.kl, "step": step}, best_file)

    bar = tqdm(total=cfg.steps, initial=step, desc="distill", unit="step", dynamic_ncols=True)
    student.train()
    try:
        while step < cfg.steps:
            if step // per_epoch != epoch:
                epoch = step // per_epoch
                epoch_batches = make_batches(train_data, lookup, cfg, seed=cfg.seed + epoch)
            batch = epoch_batches[step % per_epoch % len(epoch_batches)]
            for group in optim.param_groups:
                group["lr"] = lr_at(step, cfg)
            logits = student(batch.input_ids, batch.attention_mask, batch.rows)
            loss, m = distill_loss(logits, batch)
            optim.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optim.step()
            step += 1
            bar.update(1)
            bar.set_postfix(loss=f"{m.loss:.3f}", kl=f"{m.kl:.3f}", agree=f"{m.agree:.2f}",
                            val=f"{last_val.agree:.3f}" if last_val else "-")
            if step % cfg.checkpoint_every == 0:
                save()
            if val_batches and step % cfg.eval_every == 0:
                last_val = evaluate(student, val_batches)
                bar.write(f"step {step}: held-out loss {last_val.loss:.4f} kl {last_val.kl:.4f} "
                          f"top-1 agreement {last_val.agree:.4f}")
                keep_if_best(last_val)
            if cfg.max_minutes and time.monotonic() - started > cfg.max_minutes * 60:
                bar.write(f"time budget of {cfg.max_minutes} min reached at step {step}")
                break
    finally:  # Ctrl-C or an error: keep what was learned
        save()
        bar.close()
    if val_batches:
        last_val = evaluate(student, val_batches)
        keep_if_best(last_val)
        best = torch.load(best_file, weights_only=False)
        if best["kl"] < last_val.kl:
            student.load_state_dict(best["student"], strict=False)
            last_val = evaluate(student, val_batches)
            log.info("kept the weights of step %d (lowest held-out KL)", best["step"])
    return step, last_val
