"""One GGUF file in process: start time, plain decode speed, greedy speculative == plain, RSS.

    python benchmarks/gguf_file.py --model FILE [--new-tokens 64] [--repeats 3] [--threads 2]
        [--method ngram] [--speculative-tokens 128]

Prints one JSON object: ``start_s`` (LLMEngine built, kernel tuning included: a first start on
cold caches, or a second one that reuses them), the projections per block format, the default
speculative method and its caveat, plain decode tok/s at batch 1 (``speculative: off``, EOS
ignored, median of ``--repeats`` after a warm-up), greedy text of three prompts with
``--method`` against plain (``identical``), and the process's RSS. Run it under another
checkout's code with ``python tools/checkout.py ROOT benchmarks/gguf_file.py ...`` to compare
commits in one script run.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Rewrite in the past tense: The team ships the release on Friday. The team tests every "
    "build. The team writes the notes.",
    "Explain what a hash map is in three sentences.",
]


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--method", default="ngram", help="speculation checked against plain")
    ap.add_argument("--speculative-tokens", type=int, default=128)
    args = ap.parse_args()

    from specserve.core.config import EngineConfig
    from specserve.core.sampling_params import SamplingParams, SpeculativeParams
    from specserve.engine.llm_engine import LLMEngine
    from specserve.kernels.quant import BlockQuantLinear

    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=args.model, draft_model="none",
                                    num_threads=args.threads))
    start_s = time.perf_counter() - t0
    formats: dict[str, int] = {}
    for module in engine.runner.model.modules():
        if isinstance(module, BlockQuantLinear):
            formats[module.fmt] = formats.get(module.fmt, 0) + 1
        elif type(module).__name__ in ("Linear", "DenseLinear"):
            formats["dense"] = formats.get("dense", 0) + 1
    chats = [engine.encode(engine.render_chat([{"role": "user", "content": p}]))
             for p in PROMPTS]

    plain = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    engine.generate(chats[:1], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                    SpeculativeParams(method="off"))  # warm-up
    speeds = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        out = engine.generate(chats[:1], plain, SpeculativeParams(method="off"))[0]
        speeds.append(out.num_output_tokens / (time.perf_counter() - t))
        assert out.timings.num_drafted == 0

    greedy = SamplingParams(max_tokens=args.speculative_tokens, temperature=0.0)
    same = []
    for chat in chats:
        off = engine.generate([chat], greedy, SpeculativeParams(method="off"))[0]
        spec = engine.generate([chat], greedy, SpeculativeParams(method=args.method))[0]
        same.append({"identical": off.token_ids == spec.token_ids,
                     "tokens": len(off.token_ids), "drafted": spec.timings.num_drafted,
                     "accepted": spec.timings.num_accepted})
    config = engine.config
    print(json.dumps({
        "model": args.model, "start_s": round(start_s, 1), "formats": formats,
        "default_speculative_method": config.default_speculative_method,
        "speculation_caveat": getattr(config, "speculation_caveat", None),
        "plain_tok_s": round(statistics.median(speeds), 2),
        "plain_tok_s_all": [round(s, 2) for s in speeds],
        "speculative_vs_plain": same,
        "rss_mb": round(rss_mb(), 0),
        "max_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 0),
    }), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
