"""`specserve distill --data-only`: teacher data for the train and held-out splits, and its speed.

    OUT/data/train/     shards of the train conversations (resumable, see specserve.distill.data)
    OUT/data/heldout/   shards of the held-out conversations (never trained on)
    OUT/data/gen_log.jsonl  one line per run: what it generated, how fast, on what

The train split is either the train prompts of a prompt set (``--prompts``, single turn) or, with
``--corpus``, the large multi-turn corpus of ``specserve.distill.corpus``; the held-out split is the
prompt set's held-out prompts (as conversations of up to ``--turns`` turns with ``--corpus``). The
engine decodes plainly (no speculation: at these batch sizes it costs more than it saves) in big
continuous batches of ``--gen-batch`` sequences.
"""

from __future__ import annotations

import json
import logging
import platform
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.core.errors import ConfigError
from specserve.distill.data import PROMPTS_FILE, Conversation, generate_teacher_data, load_prompts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataGenConfig:
    out: Path
    target: str | None = None  # None: the built-in default model
    prompts: Path = PROMPTS_FILE
    # train on specserve.distill.corpus (multi-turn) instead of the prompt set's train split
    corpus: bool = False
    turns: int = 2  # most user turns per conversation (corpus and its held-out split)
    num_prompts: int | None = None  # first N train conversations (None: all)
    num_heldout: int = 64
    max_new_tokens: int = 256
    gen_batch: int = 32  # sequences decoded together
    chunk_size: int | None = None  # conversations per shard; None: 4 x gen_batch (corpus) or 128
    logprobs: bool = True  # False: tokens-only shards
    max_data_tokens: int | None = None  # stop once the train shards hold this many answer tokens
    # start no train shard that would end after this many minutes of generation
    data_minutes: float | None = None
    device: str = "auto"  # auto: cuda when torch sees a GPU
    attention_backend: str = "auto"
    dtype: str = "float32"
    num_threads: int | None = None
    kv_cache_memory: int | None = None  # None: the engine's default (2 GiB CPU, 90% GPU)


def conversations(cfg: DataGenConfig) -> tuple[list[Conversation], list[Conversation]]:
    """(train, held-out) conversations for ``cfg``, train in a seeded order (any prefix mixes
    every category; a shorter run's shards are the first shards of a longer one)."""
    heldout_prompts = load_prompts(cfg.prompts, "heldout")[: cfg.num_heldout]
    if cfg.corpus:
        from specserve.distill.corpus import build_train_corpus, heldout_conversations

        train = build_train_corpus(max_turns=cfg.turns)
        heldout = heldout_conversations(heldout_prompts, max_turns=cfg.turns)
    else:
        prompts = load_prompts(cfg.prompts, "train")
        random.Random(0).shuffle(prompts)  # the same order as specserve.distill.run's
        train = [Conversation.from_prompt(p) for p in prompts]
        heldout = [Conversation.from_prompt(p) for p in heldout_prompts]
    train = train[: cfg.num_prompts]
    if not train:
        raise ConfigError(f"no train prompts in {cfg.prompts}")
    return train, heldout


def run_datagen(cfg: DataGenConfig) -> dict:
    """Generates (or resumes) both splits; returns (and logs to gen_log.jsonl) the speeds."""
    from specserve.core.config import EngineConfig
    from specserve.engine.llm_engine import LLMEngine

    if cfg.turns < 1:
        raise ConfigError(f"--turns must be >= 1 (got {cfg.turns})")
    if cfg.num_threads:
        torch.set_num_threads(cfg.num_threads)
    train, heldout = conversations(cfg)
    chunk = cfg.chunk_size or (4 * cfg.gen_batch if cfg.corpus else 128)
    t_start = time.monotonic()
    engine = LLMEngine(EngineConfig(
        model=cfg.target, device=cfg.device, dtype=cfg.dtype, speculative_method="off",
        draft_model="none", max_num_seqs=cfg.gen_batch,
        max_num_batched_tokens=max(2048, 32 * cfg.gen_batch), enable_prefix_caching=True,
        num_threads=cfg.num_threads, kv_cache_memory=cfg.kv_cache_memory,
        attention_backend=cfg.attention_backend,
    ))
    load_seconds = time.monotonic() - t_start
    # the generation's own clock: the engine's start (minutes on a busy CPU) does not count
    deadline = time.monotonic() + 60 * cfg.data_minutes if cfg.data_minutes else None
    data = cfg.out / "data"
    common = dict(max_tokens=cfg.max_new_tokens, chunk_size=chunk, logprobs=cfg.logprobs)
    train_stats: dict = {}
    train_data = generate_teacher_data(
        engine, train, data / "train", max_response_tokens=cfg.max_data_tokens,
        deadline=deadline, stats=train_stats, **common,
    )
    heldout_stats: dict = {}
    generate_teacher_data(engine, heldout, data / "heldout", stats=heldout_stats, **common)
    record = {
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": _device_name(engine.device),
        "target": str(engine.model_path), "dtype": cfg.dtype, "gen_batch": cfg.gen_batch,
        "chunk_size": chunk, "max_new_tokens": cfg.max_new_tokens, "logprobs": cfg.logprobs,
        "corpus": cfg.corpus, "turns": cfg.turns, "load_seconds": round(load_seconds, 1),
        "train": _speed(train_stats), "heldout": _speed(heldout_stats),
        "train_total": {"sequences": len(train_data),
                        "response_tokens": train_data.num_response_tokens,
                        "bytes": sum(p.stat().st_size for p in (data / "train").glob("*.pt"))},
    }
    with open(data / "gen_log.jsonl", "a") as f:
        f.write(json.dumps(record) + "\n")
    log.info("teacher data: %s", record)
    return record


def _speed(stats: dict) -> dict:
    secs = stats.get("seconds", 0.0)
    out = dict(stats, seconds=round(secs, 1))
    out["response_tok_s"] = round(stats["response_tokens"] / secs, 1) if secs else None
    return out


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    try:  # lscpu's "Model name"
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"cpu ({line.split(':', 1)[1].strip()}, {torch.get_num_threads()} threads)"
    except OSError:
        pass
    return f"cpu ({platform.machine()})"
