"""`specserve distill`: teacher data -> head vocabulary -> student -> training -> draft folder.

    OUT/data/train/, OUT/data/heldout/   teacher data shards (resumable: specserve.distill.data)
    OUT/checkpoint.pt                    training checkpoint (resumable: specserve.distill.train)
    OUT/draft/                           the finished draft: --draft-model OUT/draft
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from specserve.core.errors import ConfigError
from specserve.distill.data import PROMPTS_FILE, generate_teacher_data, load_prompts
from specserve.distill.student import StudentSpec, build_student, choose_head_vocab, save_student
from specserve.distill.train import TrainConfig, train

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DistillConfig:
    out: Path
    target: str | None = None  # None: the built-in default model
    prompts: Path = PROMPTS_FILE
    num_prompts: int | None = None  # first N train prompts (None: all)
    num_heldout: int = 64  # held-out prompts whose teacher data measures held-out KL
    max_new_tokens: int = 256
    gen_batch: int = 32  # sequences decoded together while making teacher data
    student: StudentSpec = field(default_factory=StudentSpec)
    train: TrainConfig = field(default_factory=TrainConfig)
    num_threads: int | None = None
    data_only: bool = False  # stop after generating the teacher data


def run_distill(cfg: DistillConfig) -> Path | None:
    """Runs (or resumes) every stage; returns the draft folder (None with ``data_only``)."""
    from specserve.core.config import EngineConfig
    from specserve.engine.llm_engine import LLMEngine
    from specserve.target.loader import load_weights

    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    train_prompts = load_prompts(cfg.prompts, "train")
    # Seeded shuffle: any prefix (--num-prompts, or data cut short) mixes every category, and
    # the shards of a shorter run are the first shards of a longer one.
    random.Random(0).shuffle(train_prompts)
    train_prompts = train_prompts[: cfg.num_prompts]
    heldout_prompts = load_prompts(cfg.prompts, "heldout")[: cfg.num_heldout]
    if not train_prompts:
        raise ConfigError(f"no train prompts in {cfg.prompts}")
    cfg.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    engine = LLMEngine(EngineConfig(
        model=cfg.target, dtype="float32", max_num_seqs=cfg.gen_batch,
        max_num_batched_tokens=2048, enable_prefix_caching=True, num_threads=cfg.num_threads,
        kv_cache_memory=1536 << 20,  # gen_batch x (prompt + max_new_tokens) without preemption
    ))
    tokenizer, model_path = engine.tokenizer, engine.model_path
    train_data = generate_teacher_data(
        engine, train_prompts, cfg.out / "data" / "train", max_tokens=cfg.max_new_tokens
    )
    val_data = generate_teacher_data(
        engine, heldout_prompts, cfg.out / "data" / "heldout", max_tokens=cfg.max_new_tokens
    )
    del engine  # frees the KV pool before training
    if cfg.data_only:
        return None
    gen_minutes = (time.monotonic() - t0) / 60
    log.info("teacher data: %d sequences, %d response tokens (%.1f min)",
             len(train_data), train_data.num_response_tokens, gen_minutes)

    hf_config, target_state = load_weights(model_path)
    vocab = hf_config.vocab_size
    responses = [t[p:] for t, p in zip(train_data.tokens, train_data.prompt_lens)]
    head_ids = choose_head_vocab(responses, train_data.top_ids, vocab, cfg.student.head_vocab_size)
    coverage = _coverage(responses, head_ids)
    student = build_student(hf_config, target_state, cfg.student, head_ids)
    del target_state
    t1 = time.monotonic()
    steps, val = train(student, train_data, val_data, cfg.train, cfg.out / "checkpoint.pt", vocab)
    card = {
        "target": str(model_path),
        "architecture": f"{cfg.student.num_layers} x {type(student.base.layers[0]).__name__} "
                        f"(hidden {hf_config.hidden_size}), initialized from target layers "
                        f"{list(cfg.student.init_layers)}; target embeddings (frozen, shared)",
        "head_vocab": f"{len(head_ids)} most frequent target tokens "
                      f"({coverage:.1%} of the target's training responses)",
        "data": f"{len(train_data)} target responses ({train_data.num_response_tokens} tokens, "
                f"greedy, top-20 teacher logprobs) for the train split of {cfg.prompts.name}; "
                f"{len(val_data)} held-out responses never trained on",
        "training": f"{steps} steps of {asdict(cfg.train)}",
        "held_out": (f"loss {val.loss:.4f}, KL {val.kl:.4f}, top-1 agreement {val.agree:.4f}"
                     if val else "n/a"),
        "minutes": f"data {gen_minutes:.1f}, training {(time.monotonic() - t1) / 60:.1f}",
    }
    draft_dir = cfg.out / "draft"
    save_student(student, hf_config, draft_dir, tokenizer=tokenizer, card=card, spec=cfg.student)
    return draft_dir


def _coverage(responses: list[torch.Tensor], head_ids: torch.Tensor) -> float:
    allowed = set(head_ids.tolist())
    total = sum(len(r) for r in responses)
    hit = sum(sum(1 for t in r.tolist() if t in allowed) for r in responses)
    return hit / max(total, 1)
