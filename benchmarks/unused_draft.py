"""What a loaded but unused draft costs plain decoding: the built-in model with the shipped draft
loaded (every request ``speculative: off``) against the same model with ``--draft-model none``.
Writes a section of benchmarks/RESULTS.md.

    python benchmarks/unused_draft.py [--rounds 4] [--repeats 3] [--new-tokens 128]
        [--threads N] [--no-write]

Each round starts one process per configuration, in alternating order (round 1: without the
draft first, round 2: with it first, ...), so drift of a shared machine falls on both sides alike.
A process loads its engine, warms up, then times ``--repeats`` greedy batch-1 generations of
``--new-tokens`` tokens (EOS ignored) in process and reports the median tokens/s. Every output
must say ``num_drafted == 0`` (else the run stops: it would time the wrong thing), and the
process also reports whether the draft's KV cache was ever allocated (a draft no request uses
should not touch one). The figure is the per-round ratio with / without the draft; the target is
>= 0.98x.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from benchmarks.report import (  # noqa: E402
    BenchError,
    check_plain,
    lscpu_summary,
    md_table,
    publish,
    results_section,
    run_info,
)

CONFIGS = ("none", "shipped")  # --draft-model none | the engine's default (the shipped draft)


def worker(config: str, new_tokens: int, repeats: int, threads: int | None) -> dict:
    """One process's measurement (run as ``--worker CONFIG``)."""
    import torch

    from specserve.core.config import EngineConfig
    from specserve.core.sampling_params import SamplingParams, SpeculativeParams
    from specserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(draft_model="none" if config == "none" else None,
                                    num_threads=threads))
    if config == "shipped" and engine.config.draft is None:
        raise BenchError("the shipped draft did not load: is specserve/drafts/ complete?")
    text = json.loads((ROOT / "prompts" / "chat.json").read_text())[0]
    prompt = engine.encode(engine.render_chat([{"role": "user", "content": text}]))
    off = SpeculativeParams(method="off")
    engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), off)
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        (out,) = engine.generate([prompt], params, off)
        dt = time.perf_counter() - t0
        check_plain(out.timings.num_drafted, "unused_draft")
        if out.num_output_tokens != new_tokens:
            raise BenchError(f"asked {new_tokens} tokens, got {out.num_output_tokens}")
        rates.append(new_tokens / dt)
    draft = engine.speculator.draft
    runner = getattr(draft, "runner", None)
    return {
        "config": config, "tok_s": rates, "num_kv_blocks": engine.config.num_kv_blocks,
        "threads": torch.get_num_threads(),
        "draft_kv_allocated": None if runner is None else runner.kv_allocated,
    }


def run_worker(config: str, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", config,
           "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT.parent)
    if proc.returncode != 0:
        raise BenchError(f"worker {config} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3, help="timed generations per process")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="torch threads [default: torch's]")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    try:
        if args.worker:
            print(json.dumps(worker(args.worker, args.new_tokens, args.repeats, args.threads)))
            return 0
        return report(args)
    except BenchError as exc:
        print(f"unused_draft: {exc}", file=sys.stderr)
        return 2


def report(args: argparse.Namespace) -> int:
    rows, ratios = [], []
    seen: dict[str, dict] = {}
    for r in range(args.rounds):
        order = CONFIGS if r % 2 == 0 else CONFIGS[::-1]
        got = {c: run_worker(c, args) for c in order}
        med = {c: statistics.median(got[c]["tok_s"]) for c in CONFIGS}
        ratio = med["shipped"] / med["none"]
        ratios.append(ratio)
        seen.update(got)
        rows.append([str(r + 1), " then ".join(order), f"{med['none']:.1f}",
                     f"{med['shipped']:.1f}", f"{ratio:.3f}x"])
        print(json.dumps({"round": r + 1, "order": order, "tok_s": med, "ratio": ratio}),
              flush=True)
    allocated = seen["shipped"]["draft_kv_allocated"]
    heading = "## A loaded, unused draft: plain decoding with and without the shipped draft"
    intro = (
        f"Built-in model (SmolLM2-135M-Instruct Q4_1 GGUF), greedy batch 1, {args.new_tokens} "
        f"new tokens (EOS ignored), every request `speculative: off` (num_drafted 0 checked), "
        f"one chat prompt, {seen['none']['threads']} torch threads per process; "
        f"{args.rounds} rounds, each one process per configuration in "
        f"alternating order, tok/s the median of {args.repeats} in-process runs. KV blocks: "
        f"{seen['none']['num_kv_blocks']} without the draft, "
        f"{seen['shipped']['num_kv_blocks']} with it (the pool is sized for both models' KV); "
        f"the draft's KV cache allocated after the runs: {allocated}. Ratio with / without: "
        f"median {statistics.median(ratios):.3f}x (min {min(ratios):.3f}x, max "
        f"{max(ratios):.3f}x); target >= 0.98x. CPU: {lscpu_summary() or 'lscpu not found'}."
    )
    body = md_table(["round", "order", "no draft tok/s", "shipped draft (unused) tok/s",
                     "ratio"], rows)
    info = run_info(sys.argv[1:], program="python benchmarks/unused_draft.py")
    publish(heading, results_section(heading, info, intro, body), write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
