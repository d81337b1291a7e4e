"""Offline A/B of speculative decoding in one process: this engine with speculation off vs each
proposer, on the same model, prompts, dtype and greedy settings. Writes a RESULTS.md section.

    python benchmarks/ab.py [--model PATH] [--draft-model PATH] [--prompts rewrite]
        [--num-prompts N] [--new-tokens 96] [--k 4] [--suffix-k 16] [--batch-sizes 1,8]
        [--repeats 3] [--modes off,ngram,suffix,auto] [--fixed-k] [--num-threads N]
        [--kv-cache-dtype auto] [--stream-requests N] [--no-write]

``--k`` is k_max of n-gram and draft-model speculation; suffix and auto get their own k_max,
``--suffix-k`` (the server's ``--suffix-speculative-tokens``): a long suffix match drafts long.

``--prompts`` names benchmarks/prompts/<name>.json (user messages) or
benchmarks/workloads/<name>.json (whole chats, e.g. agentic, templated). Every mode run starts
with an empty suffix cache (so no mode drafts from another mode's or repeat's outputs; within a
run, later requests do learn from earlier ones, as a server would).

Batch 1 runs every prompt alone, one after another; batch B runs one closed batch of B requests
cycling through the prompts, or with ``--stream-requests N`` B streams over B x N requests: a
request that ends frees its slot for the next at once (what a server under B client streams
sees; in a closed wave a sequence that speculation finishes early frees nothing).

Before measuring, every mode runs once on the first prompt and every prompt is prefilled once,
so first-use costs and cold prefix-cache prefills fall on no mode's first repeat.

Modes are interleaved within each repeat (off, ngram, draft, off, ngram, ...), so machine noise
hits every mode alike; each mode's figure is the median over repeats, and the ratio's spread is
reported as the min..max of per-repeat ratios. Greedy outputs must be identical across modes:
a mismatch is reported as a failure (exit code 1), never averaged away.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from benchmarks.report import (  # noqa: E402
    RESULTS_MD,
    check_plain,
    results_section,
    run_info,
    write_section,
)
from specserve.core.config import EngineConfig  # noqa: E402
from specserve.core.sampling_params import SamplingParams, SpeculativeParams  # noqa: E402
from specserve.engine.llm_engine import LLMEngine  # noqa: E402
from specserve.engine.outputs import OutputMerger  # noqa: E402


def load_chats(engine, name: str, limit: int | None = None) -> tuple[Path, list[list[int]]]:
    """benchmarks/prompts/<name>.json (user messages) or benchmarks/workloads/<name>.json
    (whole chats), the first ``limit``, chat-templated and encoded; and the file read."""
    source = ROOT / "prompts" / f"{name}.json"
    if not source.exists():
        source = ROOT / "workloads" / f"{name}.json"
    texts = json.loads(source.read_text())[:limit]
    return source, [engine.encode(engine.render_chat(
        t if isinstance(t, list) else [{"role": "user", "content": t}])) for t in texts]


def run(engine, waves, params, method, k):
    """Each wave is one closed batch, run to completion before the next; tok/s over them all.
    ``k`` None: the engine's k_max for the method."""
    engine.clear_speculation_caches()
    t0 = time.perf_counter()
    outs = []
    for prompts in waves:
        outs += engine.generate(prompts, params, SpeculativeParams(method=method, num_tokens=k))
    return _summary(outs, time.perf_counter() - t0, method)


def run_streams(engine, prompts, streams, params, method, k):
    """``streams`` requests in flight until ``prompts`` run out: a finished request's slot takes
    the next prompt at once, as a server under that many client streams sees it."""
    engine.clear_speculation_caches()
    spec = SpeculativeParams(method=method, num_tokens=k)
    pending = list(prompts)
    merged: dict[str, OutputMerger] = {}

    def submit() -> None:
        rid = f"ab-stream-{len(merged)}"
        merged[rid] = OutputMerger()
        engine.add_request(rid, pending.pop(0), params, spec)

    t0 = time.perf_counter()
    while pending and len(merged) < streams:
        submit()
    while engine.has_unfinished():
        for out in engine.step():
            merged[out.request_id].add(out)
            if out.finished and pending:
                submit()
    return _summary([m.take() for m in merged.values()], time.perf_counter() - t0, method)


def _summary(outs, dt: float, method: str) -> dict:
    tokens = sum(o.num_output_tokens for o in outs)
    drafted = sum(o.timings.num_drafted for o in outs)
    if method == "off":
        check_plain(drafted, "ab.py off")
    accepted = sum(o.timings.num_accepted for o in outs)
    steps = sum(o.timings.num_verify_steps for o in outs)
    return {
        "tok_s": tokens / dt,
        "ids": [o.token_ids for o in outs],
        "drafted": drafted,
        "accepted": accepted,
        "mean_accepted_len": (accepted + steps) / steps if steps else None,
        # proposer time per verify step (n-gram / suffix drafting, draft-model forwards)
        "propose_ms": sum(o.timings.draft_ms for o in outs) / steps if steps else None,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--prompts", default="rewrite", help="benchmarks/prompts/<name>.json")
    ap.add_argument("--num-prompts", type=int, default=None, help="the first N (default all)")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--suffix-k", type=int, default=16, help="k_max of suffix and auto")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--fixed-k", action="store_true", help="turn adaptive speculation off")
    ap.add_argument("--modes", default=None,
                    help="comma list of off, ngram, suffix, auto, draft (default: off, ngram "
                         "and draft when a draft model is given)")
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--kv-cache-dtype", default="auto", help="the server's --kv-cache-dtype")
    ap.add_argument("--stream-requests", type=int, default=0,
                    help="batch B > 1 as B streams over B x N requests (N = this), each slot "
                         "refilled as its request ends; 0: one closed wave of B")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    engine = LLMEngine(EngineConfig(
        model=args.model, dtype=args.dtype,
        adaptive_speculation=not args.fixed_k, num_speculative_tokens=args.k,
        suffix_speculative_tokens=args.suffix_k,
        num_threads=args.num_threads, draft_model=args.draft_model or "none",
        kv_cache_dtype=args.kv_cache_dtype,
    ))
    source, chats = load_chats(engine, args.prompts, args.num_prompts)
    modes = ["off", "ngram"] + (["draft"] if args.draft_model else [])
    if args.modes:
        modes = args.modes.split(",")
        assert modes[0] == "off", "the first mode is the baseline: off"
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0)
    for m in modes:  # warm-up, not measured: first-use costs of every mode stay out
        engine.generate(chats[:1], SamplingParams(max_tokens=8), SpeculativeParams(method=m))
    # Every prompt's KV enters the prefix cache before any measured run, so the first mode of
    # the first repeat (off) does not pay the prefills that every later run skips.
    engine.generate(chats, SamplingParams(max_tokens=1))

    table, failures = [], []
    for bsz in [int(b) for b in args.batch_sizes.split(",")]:
        # Single stream: every prompt alone, one after another. A batch: one closed batch of
        # bsz requests cycling through the prompts.
        waves = [[c] for c in chats] if bsz == 1 else [[chats[i % len(chats)] for i in range(bsz)]]
        streamed = [chats[i % len(chats)] for i in range(bsz * args.stream_requests)]
        per_mode: dict[str, list[dict]] = {m: [] for m in modes}
        for _ in range(args.repeats):
            for m in modes:
                if bsz > 1 and streamed:
                    per_mode[m].append(run_streams(engine, streamed, bsz, params, m, None))
                else:
                    per_mode[m].append(run(engine, waves, params, m, None))
        ref = per_mode["off"][0]["ids"]
        for m in modes:
            if any(r["ids"] != ref for r in per_mode[m]):
                failures.append(f"batch {bsz}: {m} output differs from plain decoding")
            base = [r["tok_s"] for r in per_mode["off"]]
            ratios = [r["tok_s"] / b for r, b in zip(per_mode[m], base)]
            last = per_mode[m][-1]
            row = {
                "batch": bsz, "mode": m,
                "tok_s": statistics.median(r["tok_s"] for r in per_mode[m]),
                "ratio": statistics.median(ratios), "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "acceptance": last["accepted"] / last["drafted"] if last["drafted"] else None,
                "mean_accepted_len": last["mean_accepted_len"],
                "propose_ms": last["propose_ms"],
            }
            table.append(row)
            print(json.dumps(row), flush=True)

    lines = ["| batch | mode | tok/s | vs off (median, min..max) | acceptance | "
             "tokens per verify | proposer ms per verify |", "|---|---|---|---|---|---|---|"]
    for r in table:
        acc = f"{r['acceptance']:.2f}" if r["acceptance"] is not None else "-"
        mal = f"{r['mean_accepted_len']:.2f}" if r["mean_accepted_len"] else "-"
        pms = f"{r['propose_ms']:.2f}" if r["propose_ms"] is not None else "-"
        lines.append(
            f"| {r['batch']} | {r['mode']} | {r['tok_s']:.1f} | {r['ratio']:.2f}x "
            f"({r['ratio_min']:.2f}..{r['ratio_max']:.2f}) | {acc} | {mal} | {pms} |"
        )
    heading = f"## Speculative decoding: offline A/B ({args.prompts} prompts)"
    section = results_section(
        heading,
        run_info(sys.argv[1:], program="python benchmarks/ab.py"),
        f"Model `{engine.model_path.split('/')[-1]}`"
        + (f", draft `{args.draft_model}`" if args.draft_model else "")
        + f", dtype {args.dtype}, KV cache {str(engine.kv_dtype).removeprefix('torch.')}"
        f", greedy, {args.new_tokens} new tokens, prompts "
        f"{source.relative_to(ROOT.parent)} ({len(chats)} prompts), k_max {args.k} "
        f"(suffix and auto {args.suffix_k}), "
        f"adaptive k {not args.fixed_k}, {args.repeats} interleaved repeats"
        + (f"; batch B as B streams over B x {args.stream_requests} requests (each slot "
           "refilled as its request ends)" if args.stream_requests else
           "; batch B as one closed wave of B requests")
        + ". "
        f"Outputs identical to plain decoding: {not failures}.",
        lines,
    )
    print(section)
    for f in failures:
        print("FAILURE:", f, file=sys.stderr)
    if not args.no_write:
        write_section(RESULTS_MD, heading, section)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
