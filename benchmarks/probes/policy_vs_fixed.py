"""The adaptive policy against fixed draft lengths, one method, in process: does the policy find
the k that pays on this machine, and what does a verify of n rows cost here?

    python benchmarks/probes/policy_vs_fixed.py [--model PATH] [--method suffix] [--k 1,2,4,8]
        [--new-tokens 96] [--no-write]

Three prompts (a rewrite whose answer repeats itself, a code prompt, a chat question), raw text
(no chat template), greedy, EOS ignored. For each: plain decoding, the method under the
adaptive policy, and the method at each fixed k (``--no-adaptive-speculation``, a fresh engine
of the same model in the same process), each run its own tenant (suffix decoding drafts from
a tenant's earlier answers only: a run must not draft the previous run's answer). Reports
tokens per second, drafted and accepted tokens, and the engine's own step table (median
seconds of the target forwards by tokens fed, ``T(n)``) from the fixed runs, which feed
every n from 1 to k + 1. Every speculative answer must equal plain decoding's (exit code 1
otherwise).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: this checkout's packages first

from benchmarks.report import (  # noqa: E402
    RESULTS_MD,
    lscpu_summary,
    md_table,
    results_section,
    run_info,
    write_section,
)
from specserve.core.config import EngineConfig  # noqa: E402
from specserve.core.sampling_params import SamplingParams, SpeculativeParams  # noqa: E402
from specserve.engine.llm_engine import LLMEngine  # noqa: E402

_CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
PROMPTS = {
    "rewrite": "Rewrite this sentence more formally: the cat sat on the mat and it was happy "
               "about it.",
    "code": "Copy this code exactly, then add a mul function:\n" + _CODE + "\n" + _CODE,
    "chat": "Explain what a hash map is, in detail.",
}


def _run(engine: LLMEngine, prompt: str, params: SamplingParams, spec: SpeculativeParams
         ) -> tuple[float, list[int], int, int]:
    t0 = time.perf_counter()
    out = engine.generate([prompt], params, spec)[0]
    seconds = time.perf_counter() - t0
    return (len(out.token_ids) / seconds, out.token_ids, out.timings.num_drafted,
            out.timings.num_accepted)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file [default: the built-in model]")
    ap.add_argument("--method", default="suffix")
    ap.add_argument("--k", default="1,2,4,8", help="fixed draft lengths, comma-separated")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    ks = [int(k) for k in args.k.split(",")]
    model = {} if args.model is None else {"model": args.model}
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    warm = SamplingParams(max_tokens=8, temperature=0.0)
    off = SpeculativeParams(method="off")
    rows: dict[str, dict[str, tuple[float, int, int]]] = {name: {} for name in PROMPTS}
    plain: dict[str, list[int]] = {}
    differ = 0
    adaptive = LLMEngine(EngineConfig(**model, draft_model="none"))
    adaptive.generate(["warm up"], warm, off)
    for name, prompt in PROMPTS.items():
        tps, ids, _, _ = _run(adaptive, prompt, params, off)
        plain[name], rows[name]["off"] = ids, (tps, 0, 0)
        tps, ids, drafted, accepted = _run(adaptive, prompt, params, SpeculativeParams(
            method=args.method, tenant=f"{name}-adaptive"))
        rows[name]["adaptive"] = (tps, drafted, accepted)
        differ += ids != plain[name]
    model_path = adaptive.model_path
    del adaptive
    fixed = LLMEngine(EngineConfig(**model, draft_model="none", adaptive_speculation=False))
    fixed.generate(["warm up"], warm, off)
    for name, prompt in PROMPTS.items():
        for k in ks:
            tps, ids, drafted, accepted = _run(
                fixed, prompt, params,
                SpeculativeParams(method=args.method, num_tokens=k, tenant=f"{name}-{k}"))
            rows[name][f"k={k}"] = (tps, drafted, accepted)
            differ += ids != plain[name]
    table = fixed.speculator.policy.target_cost.median
    labels = ["off", "adaptive", *(f"k={k}" for k in ks)]
    body = md_table(
        ["prompt", *(f"{label} tok/s (drafted / accepted)" for label in labels)],
        [[name, *(f"{r[label][0]:.1f} ({r[label][1]} / {r[label][2]})" for label in labels)]
         for name, r in rows.items()])
    t1 = table.get(1)
    body += ["", "The engine's step table (fixed runs), median ms by tokens fed: " + ", ".join(
        f"T({n}) {table[n] * 1e3:.1f}" + (f" ({table[n] / t1:.2f} T(1))" if t1 and n > 1 else "")
        for n in sorted(table) if n <= max(ks) + 1) + ".",
        "", f"Speculative answers differing from plain: {differ}."]
    print("\n".join(body))
    heading = f"## Adaptive policy vs fixed k, {args.method}, {Path(model_path).name}"
    intro = (f"`{Path(model_path).name}` in process, greedy, {args.new_tokens} tokens, EOS "
             f"ignored, raw prompts (benchmarks/probes/policy_vs_fixed.py's), `draft_model=none`; "
             f"plain and the adaptive policy in one engine, fixed k in a second one of the same "
             f"process. lscpu: {lscpu_summary()}.")
    if not args.no_write:
        write_section(RESULTS_MD, heading, results_section(
            heading, run_info(sys.argv[1:], program="python benchmarks/probes/policy_vs_fixed.py"),
            intro, body))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
