"""Decode step time against context length at batch 1, and prefill time, for one engine config.
Writes (or prints) a section of benchmarks/RESULTS.md.

    python benchmarks/probes/context_scaling.py [--model PATH] [--quantization auto]
        [--dtype float32] [--contexts 512,2048,8000] [--steps 32] [--kv-cache-dtypes auto]
        [--repeats 1] [--label NAME] [--no-write]

For each context length: one prompt of that many tokens (a repeated paragraph, so the prefix
cache is off to time the whole prefill), then ``--steps`` greedy decode steps. Reports the
prefill seconds and the median decode step in ms. Run it for two configurations (or two
commits, with ``--label``) in one sitting to compare them: each run writes its own section.
``--kv-cache-dtypes auto,float16`` builds one engine per KV cache dtype and measures them in
turn at each context (``--repeats`` rounds, order alternating, best of the rounds kept), with
the decode-step ratio against the first.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: this checkout's packages first

from benchmarks.report import check_plain, publish, results_section, run_info  # noqa: E402
from specserve.core.config import EngineConfig  # noqa: E402
from specserve.core.sampling_params import SamplingParams, SpeculativeParams  # noqa: E402
from specserve.engine.llm_engine import LLMEngine  # noqa: E402

PARAGRAPH = ("The committee met on Tuesday to review the budget, the schedule and the open "
             "questions about the new library. ")


def measure(engine: LLMEngine, context: int, steps: int) -> tuple[float, float]:
    """(prefill seconds, median decode step seconds) for one prompt of ``context`` tokens."""
    ids = (engine.encode(PARAGRAPH) * (context // 10 + 1))[:context]
    rid = f"ctx-{context}"
    # Speculation off: the repeated paragraph is what n-gram and suffix drafts feed on, and a
    # multi-token verify step is not the decode step this measures (auto is the default method).
    engine.add_request(rid, ids, SamplingParams(max_tokens=steps + 1, temperature=0.0,
                                                ignore_eos=True),
                       SpeculativeParams(method="off"))
    times: list[float] = []
    first = None
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()  # (a prefill chunk short of the prompt's end returns none)
        dt = time.perf_counter() - t0
        for out in outs:
            check_plain(out.timings.num_drafted, "context_scaling")
        if first is None:
            first = dt  # the prefill step (with the prompt split in chunks: their sum)
        else:
            times.append(dt)
    # A chunked prefill spreads over several steps: count those in the prefill, not decode.
    chunks = -(-context // engine.config.max_num_batched_tokens)
    prefill = (first or 0.0) + sum(times[: chunks - 1])
    return prefill, statistics.median(times[chunks - 1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--contexts", default="512,2048,8000")  # 8k less room for steps
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--kv-cache-dtypes", default="auto", help="comma-separated, one engine each")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--label", default=None, help="name of this configuration in the heading")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    kv_dtypes = [d for d in args.kv_cache_dtypes.split(",") if d]
    engines = {d: LLMEngine(EngineConfig(
        model=args.model, quantization=args.quantization, dtype=args.dtype, draft_model="none",
        enable_prefix_caching=False, max_model_len=max(contexts) + args.steps + 8,
        kv_cache_dtype=d, kv_cache_memory=1 << 30,
    )) for d in kv_dtypes}
    for engine in engines.values():
        measure(engine, 64, 4)  # warm-up
    if len(engines) == 1:
        lines = ["| context | prefill s | decode ms/step |", "|---|---|---|"]
    else:
        headers = ["context", *[f"prefill s, KV {d}" for d in kv_dtypes],
                   *[f"decode ms/step, KV {d}" for d in kv_dtypes],
                   *[f"decode {kv_dtypes[0]} / {d}" for d in kv_dtypes[1:]]]
        lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for c in contexts:
        best: dict[str, tuple[float, float]] = {}
        for rep in range(args.repeats):
            order = kv_dtypes if rep % 2 == 0 else kv_dtypes[::-1]
            for d in order:
                prefill, step = measure(engines[d], c, args.steps)
                old = best.get(d)
                best[d] = (prefill, step) if old is None else (min(old[0], prefill),
                                                               min(old[1], step))
        if len(engines) == 1:
            prefill, step = best[kv_dtypes[0]]
            lines.append(f"| {c} | {prefill:.2f} | {step * 1e3:.1f} |")
        else:
            first = best[kv_dtypes[0]][1]
            cells = [str(c), *[f"{best[d][0]:.2f}" for d in kv_dtypes],
                     *[f"{best[d][1] * 1e3:.1f}" for d in kv_dtypes],
                     *[f"{first / best[d][1]:.2f}x" for d in kv_dtypes[1:]]]
            lines.append("| " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    engine = engines[kv_dtypes[0]]
    label = args.label or f"quantization {engine.quantization}" + (
        f", KV {' vs '.join(kv_dtypes)}" if len(engines) > 1 else "")
    heading = f"## Context scaling, {label}"
    section = results_section(
        heading, run_info(sys.argv[1:], program="python benchmarks/probes/context_scaling.py"),
        f"Batch 1, greedy, prefix cache off, {args.steps} decode steps per context (median)"
        + ("." if len(engines) == 1 else
           f"; one engine per KV cache dtype, {args.repeats} alternating rounds, the best kept."),
        lines,
    )
    publish(heading, section, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
