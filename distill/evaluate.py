"""`specserve distill --eval`: how good is a draft (a standalone draft LM, an EAGLE head) for its
target, measured through the engine.

On held-out prompts (never trained on), for each temperature and each fixed k, the engine
decodes with the draft (adaptive k off) and reports:
- acceptance per position i = 1..k: the fraction of verify steps whose first i drafts were all
  accepted (read from each output token's ``from_draft`` flag);
- tokens per verify (accepted drafts + the target's own token);
- draft cost: one batch-1 draft step over one batch-1 target decode step, timed on the same
  runners; verify cost v(k): a batch-1 target step over k + 1 tokens over one over 1 token;
- predicted speedup tokens_per_verify / (k x draft cost + v(k)) (single stream) and measured
  speedup: output tokens per second with speculation over without, same prompts, same run and
  batch (``max_num_seqs``; default all prompts at once, so the measured number is the batched
  one unless ``--eval-batch 1``).

How the measured speedup is timed (``paired_speedup``): one untimed warm-up of each side first
(the first run of an engine pays one-off costs), then the plain run is repeated right before
each speculative run rather than timed once per temperature, so a change of machine load
between the two (other jobs on a shared CPU) cannot turn into a ratio of 10x or more. Greedy
runs must give the plain run's tokens exactly (speculation is lossless); a row counts the
prompts where they differ (``greedy_mismatches``, always 0 unless the engine has a bug).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specserve.distill.data import PROMPTS_FILE, load_prompts


@dataclass(frozen=True)
class EvalConfig:
    draft: str | None  # a standalone draft folder (None: not measured)
    target: str | None = None
    prompts: Path = PROMPTS_FILE
    num_prompts: int = 32
    max_tokens: int = 64
    ks: list[int] = field(default_factory=lambda: list(range(1, 9)))
    temperatures: list[float] = field(default_factory=lambda: [0.0, 0.7])
    dtype: str = "float32"
    num_threads: int | None = None
    eagle: str | None = None  # an EAGLE head folder (None: not measured)
    max_num_seqs: int | None = None  # sequences decoded together (None: every prompt)
    category: str | None = None  # only held-out prompts of this category (None: all)


@dataclass(frozen=True)
class EvalRow:
    temperature: float
    k: int
    acceptance: float
    mean_accepted_length: float
    tokens: int
    per_position: tuple[float, ...] = ()
    predicted_speedup: float = 0.0
    measured_speedup: float = 0.0
    plain_tokens: int = 0  # output tokens of the paired plain run
    prompts: int = 0  # prompts decoded (fewer than asked when the held-out set has fewer)
    greedy_mismatches: int = 0  # greedy prompts whose speculative tokens differ from plain's


@dataclass(frozen=True)
class Costs:
    draft: float  # one draft step / one target decode step (batch 1)
    verify: dict[int, float]  # k -> target step over k + 1 tokens / over 1 token


def median_seconds(fn, repeats: int = 20) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _costs(engine, ks: list[int]) -> Costs:
    from specserve.kernels.metadata import AttentionMetadata, token_positions

    ctx, bs, dev = 64, engine.config.block_size, engine.device
    table = list(range((ctx + max(ks) + bs) // bs + 1))

    def target_step(n: int) -> float:
        meta = AttentionMetadata.build([n], [ctx + n], [table], bs, dev)
        pos = token_positions([n], [ctx + n]).to(dev)
        ids = torch.full((n,), 42, device=dev)
        last = torch.arange(n, device=dev)
        return median_seconds(lambda: engine.runner.forward(ids, pos, meta, last))

    meta = AttentionMetadata.build([1], [ctx], [table], bs, dev)
    ids, pos, last = (torch.tensor([v], device=dev) for v in (42, ctx - 1, 0))
    spec = engine.speculator
    if "eagle" in spec.proposers:
        runner = spec.proposers["eagle"].runner
        feat = torch.zeros((1, runner.head.config.hidden_size), device=dev,
                           dtype=runner.head.dtype)

        def draft() -> None:
            out = runner.step(ids, feat, pos, meta)
            with torch.inference_mode():
                runner.head.logits(out)
    else:
        draft_runner = spec.draft.runner

        def draft() -> None:
            draft_runner.forward(ids, pos, meta, last)
    one = target_step(1)
    return Costs(median_seconds(draft) / one, {k: target_step(k + 1) / one for k in ks})


@dataclass(frozen=True)
class TimedRun:
    outputs: list
    seconds: float
    tokens: int  # output tokens over all prompts


def paired_speedup(plain: Callable[[], list], spec: Callable[[], list],
                   clock: Callable[[], float] = time.perf_counter,
                   ) -> tuple[float, TimedRun, TimedRun]:
    """Output tokens per second of ``spec()`` over ``plain()`` (each returns complete outputs),
    each run timed right after the other, so both see the same machine load. The caller warms
    both up first. Returns (speedup, plain run, speculative run)."""

    def timed(fn: Callable[[], list]) -> TimedRun:
        t0 = clock()
        outs = fn()
        seconds = clock() - t0
        return TimedRun(outs, seconds, sum(o.num_output_tokens for o in outs))

    base, run = timed(plain), timed(spec)
    if base.tokens == 0 or run.tokens == 0 or base.seconds <= 0 or run.seconds <= 0:
        raise RuntimeError(f"an eval run produced nothing to time: plain {base.tokens} tokens "
                           f"in {base.seconds:.3f}s, speculative {run.tokens} in "
                           f"{run.seconds:.3f}s")
    return (run.tokens / run.seconds) / (base.tokens / base.seconds), base, run


def _per_position(outs, k: int) -> tuple[float, ...]:
    """P(first i drafts all accepted), i = 1..k, over verify steps: each step emits a run of
    accepted drafts then the target's own token."""
    runs: list[int] = []
    for o in outs:
        flags = o.new_from_draft[1:]  # the first token comes from the prefill
        run = 0
        for f in flags:
            if f:
                run += 1
            else:
                runs.append(run)
                run = 0
    if not runs:
        return tuple(0.0 for _ in range(k))
    return tuple(sum(r >= i for r in runs) / len(runs) for i in range(1, k + 1))


def measure(cfg: EvalConfig, folder: str | None = None, method: str = "draft",
            clock: Callable[[], float] | None = None) -> tuple[list[EvalRow], float]:
    """Rows per (temperature, k) for the draft at ``folder`` (default ``cfg.draft``) used as
    ``method`` (draft | eagle), and its draft cost relative to a target step. ``clock`` times
    the end-to-end runs (default ``time.perf_counter``; tests pass a counter)."""
    from specserve.core.config import EngineConfig
    from specserve.core.sampling_params import GREEDY_BELOW, SamplingParams, SpeculativeParams
    from specserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(
        model=cfg.target, draft_model=folder or cfg.draft, dtype=cfg.dtype,
        adaptive_speculation=False, num_threads=cfg.num_threads, kv_cache_memory=512 << 20,
        max_num_seqs=cfg.max_num_seqs or max(cfg.num_prompts, 1),
    ))
    prompts = [p for p in load_prompts(cfg.prompts, "heldout")
               if cfg.category is None or p.category == cfg.category][: cfg.num_prompts]
    chats = [engine.encode(engine.render_chat([{"role": "user", "content": p.prompt}]))
             for p in prompts]
    costs = _costs(engine, cfg.ks)
    rows = []
    for temp in cfg.temperatures:
        params = [SamplingParams(max_tokens=cfg.max_tokens, temperature=temp, seed=i)
                  for i in range(len(chats))]

        def run(spec: SpeculativeParams, params: list = params) -> list:
            return engine.generate(chats, params, spec)

        plain = SpeculativeParams(method="off")

        def run_plain(run=run, plain: SpeculativeParams = plain) -> list:
            return run(plain)

        # Warm-up, untimed: an engine's first runs pay one-off costs (allocations, caches).
        run(plain)
        run(SpeculativeParams(method=method, num_tokens=max(cfg.ks)))
        for k in cfg.ks:
            speedup, base, timed = paired_speedup(
                run_plain, lambda k=k: run(SpeculativeParams(method=method, num_tokens=k)),
                clock or time.perf_counter)
            outs = timed.outputs
            drafted = sum(o.timings.num_drafted for o in outs)
            accepted = sum(o.timings.num_accepted for o in outs)
            steps = sum(o.timings.num_verify_steps for o in outs)
            tpv = (accepted + steps) / max(steps, 1)
            mismatches = 0
            if temp < GREEDY_BELOW:
                mismatches = sum(a.token_ids != b.token_ids for a, b in zip(base.outputs, outs))
            rows.append(EvalRow(
                temperature=temp, k=k, acceptance=accepted / max(drafted, 1),
                mean_accepted_length=tpv, tokens=timed.tokens,
                per_position=_per_position(outs, k),
                predicted_speedup=tpv / (k * costs.draft + costs.verify[k]),
                measured_speedup=speedup, plain_tokens=base.tokens,
                greedy_mismatches=mismatches, prompts=len(chats),
            ))
            print(f"{method} temperature {temp} k {k}: acceptance {rows[-1].acceptance:.3f}, "
                  f"tokens/verify {tpv:.2f}, speedup predicted "
                  f"{rows[-1].predicted_speedup:.2f} measured {speedup:.2f} (plain "
                  f"{base.tokens} tokens in {base.seconds:.2f}s, speculative {timed.tokens} in "
                  f"{timed.seconds:.2f}s)" + (f"; {mismatches} GREEDY MISMATCHES" if mismatches
                                              else ""), flush=True)
    return rows, costs.draft


def render(rows: list[EvalRow], cost: float, cfg: EvalConfig) -> str:
    temps = sorted({r.temperature for r in rows})
    cols = ("acceptance per position", "tokens/verify", "predicted", "measured")
    head = "| k | " + " | ".join(f"T={t:g} {c}" for t in temps for c in cols) + " |"
    lines = [head, "|---|" + "---|" * (len(cols) * len(temps))]
    for k in sorted({r.k for r in rows}):
        cells = []
        for t in temps:
            r = next(r for r in rows if r.k == k and r.temperature == t)
            cells += [" ".join(f"{a:.2f}" for a in r.per_position), f"{r.mean_accepted_length:.2f}",
                      f"{r.predicted_speedup:.2f}x", f"{r.measured_speedup:.2f}x"]
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    num_prompts = rows[0].prompts if rows else cfg.num_prompts
    batch = min(cfg.max_num_seqs or num_prompts, num_prompts)
    lines += [
        "",
        f"{num_prompts} held-out {cfg.category + ' ' if cfg.category else ''}prompts of "
        f"{cfg.prompts.name}, {cfg.max_tokens} new tokens "
        f"each, fixed k, dtype {cfg.dtype}, batch {batch}. Draft step costs {cost:.3f}x a "
        f"target step (batch 1). Predicted: single stream, from tokens/verify and measured step "
        f"costs; measured: output tokens/s with / without speculation, same run and batch, "
        f"each speculative run timed right after its own plain run (both warmed up).",
    ]
    bad = sum(r.greedy_mismatches for r in rows)
    if bad:
        lines.append(f"WARNING: {bad} greedy outputs differed from plain decoding.")
    return "\n".join(lines)


def run_eval(cfg: EvalConfig) -> str:
    """Measures the draft and/or the EAGLE head, writes each table into its folder's card
    (when it has one), and returns the tables."""
    tables = []
    for folder, method in ((cfg.draft, "draft"), (cfg.eagle, "eagle")):
        if folder is None:
            continue
        rows, cost = measure(cfg, folder, method)
        table = render(rows, cost, cfg)
        _write_card(Path(folder), table, cost, method)
        tables.append(table if len(tables) == 0 and cfg.eagle is None
                      else f"### {method}: {folder}\n\n{table}")
    return "\n\n".join(tables)


def _write_card(folder: Path, table: str, cost: float, method: str) -> None:
    import json

    from specserve.distill.student import render_card

    card_file = folder / "card.json"
    if not card_file.is_file():
        return
    card = json.loads(card_file.read_text())
    card["acceptance"] = table
    card["draft_cost_vs_target"] = round(cost, 4)
    card_file.write_text(json.dumps(card, indent=2) + "\n")
    text = render_card(card)
    if method == "eagle":
        text = text.replace("# Draft for", "# EAGLE head for", 1)
    (folder / "README.md").write_text(text)
