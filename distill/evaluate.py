"""`specserve distill --eval`: how good is a draft for its target, measured through the engine.

On held-out prompts (never trained on), for each temperature and each fixed k, the engine
decodes with the draft (adaptive k off) and reports acceptance (accepted / drafted) and the
mean accepted length per verify step (accepted drafts + the target's own token). The draft's
cost relative to the target is one batch-1 decode step of each, timed on the same runners.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from distill.data import PROMPTS_FILE, load_prompts


@dataclass(frozen=True)
class EvalConfig:
    draft: str
    target: str | None = None
    prompts: Path = PROMPTS_FILE
    num_prompts: int = 32
    max_tokens: int = 64
    ks: list[int] = field(default_factory=lambda: list(range(1, 9)))
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7])
    dtype: str = "float32"
    num_threads: int | None = None


@dataclass(frozen=True)
class EvalRow:
    temperature: float
    k: int
    acceptance: float
    mean_accepted_length: float
    tokens: int


def _cost_ratio(engine, repeats: int = 30) -> float:
    """Median time of one batch-1 decode step of the draft / of the target (same context)."""
    from kernels.metadata import AttentionMetadata

    draft_runner = engine.speculator.draft.runner
    ctx = 64
    table = list(range((ctx + engine.config.block_size - 1) // engine.config.block_size))
    meta = AttentionMetadata.build([1], [ctx], [table], engine.config.block_size, engine.device)
    ids = torch.tensor([42], device=engine.device)
    pos = torch.tensor([ctx - 1], device=engine.device)
    last = torch.tensor([0], device=engine.device)

    def timed(runner) -> float:
        runner.forward(ids, pos, meta, last)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            runner.forward(ids, pos, meta, last)
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return timed(draft_runner) / timed(engine.runner)


def measure(cfg: EvalConfig) -> tuple[list[EvalRow], float]:
    from specserve.config import EngineConfig
    from specserve.engine import LLMEngine
    from specserve.sampling_params import SamplingParams, SpeculativeParams

    engine = LLMEngine(EngineConfig(
        model=cfg.target, draft_model=cfg.draft, dtype=cfg.dtype, adaptive_speculation=False,
        num_threads=cfg.num_threads, kv_cache_memory=512 << 20,
    ))
    prompts = load_prompts(cfg.prompts, "heldout")[: cfg.num_prompts]
    chats = [engine.encode(engine.render_chat([{"role": "user", "content": p.prompt}]))
             for p in prompts]
    rows = []
    for temp in cfg.temperatures:
        params = [SamplingParams(max_tokens=cfg.max_tokens, temperature=temp, seed=i)
                  for i in range(len(chats))]
        for k in cfg.ks:
            outs = engine.generate(chats, params, SpeculativeParams(method="draft", num_tokens=k))
            drafted = sum(o.timings.num_drafted for o in outs)
            accepted = sum(o.timings.num_accepted for o in outs)
            steps = sum(o.timings.num_verify_steps for o in outs)
            rows.append(EvalRow(
                temperature=temp, k=k, acceptance=accepted / max(drafted, 1),
                mean_accepted_length=(accepted + steps) / max(steps, 1),
                tokens=sum(o.num_output_tokens for o in outs),
            ))
            print(f"temperature {temp} k {k}: acceptance {rows[-1].acceptance:.3f}, "
                  f"mean accepted length {rows[-1].mean_accepted_length:.2f}", flush=True)
    return rows, _cost_ratio(engine)


def render(rows: list[EvalRow], cost: float, cfg: EvalConfig) -> str:
    temps = sorted({r.temperature for r in rows})
    head = "| k | " + " | ".join(
        f"T={t:g} acceptance | T={t:g} tokens/verify" for t in temps) + " |"
    lines = [head, "|---|" + "---|" * (2 * len(temps))]
    for k in sorted({r.k for r in rows}):
        cells = []
        for t in temps:
            r = next(r for r in rows if r.k == k and r.temperature == t)
            cells += [f"{r.acceptance:.3f}", f"{r.mean_accepted_length:.2f}"]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    lines += [
        "",
        f"{cfg.num_prompts} held-out prompts of {cfg.prompts.name}, {cfg.max_tokens} new tokens "
        f"each, fixed k, dtype {cfg.dtype}. Draft decode step costs {cost:.3f}x a target step "
        f"(batch 1).",
    ]
    return "\n".join(lines)


def run_eval(cfg: EvalConfig) -> str:
    """Measures, writes the table into the draft's card (when the draft folder has one), and
    returns the table."""
    import json

    from distill.student import render_card

    rows, cost = measure(cfg)
    table = render(rows, cost, cfg)
    card_file = Path(cfg.draft) / "card.json"
    if card_file.is_file():
        card = json.loads(card_file.read_text())
        card["acceptance"] = table
        card["draft_cost_vs_target"] = round(cost, 4)
        card_file.write_text(json.dumps(card, indent=2) + "\n")
        (Path(cfg.draft) / "README.md").write_text(render_card(card))
    return table
