"""How many tokens per target step the n-gram proposer earns, without timing noise.

    python benchmarks/probes/ngram_replay.py [--model PATH] [--workloads rewrite,summarize,code]
        [--new-tokens 128] [--k 2,3,4,6,8] [--no-write]

The target generates each prompt's greedy output once (plain decoding). Then single-stream
speculation is replayed over it: at each step the proposer drafts from the tokens known so far,
the drafts agreeing with the real continuation are accepted, and one more token (the target's
own) is emitted. Greedy speculation emits exactly these tokens, so the count of target steps is
exact; it depends only on the proposal rule and k, never on the machine's speed. The table shows
tokens per target step with the rule as shipped and with the edit fallback turned off (no draft
when the last token matches nothing), so the fallback's gain is judged on its own. Speed still needs
benchmarks/ab.py, since a verify of k + 1 rows costs more than a plain step on most machines.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: this checkout's packages first

from benchmarks.report import load_workload, publish, results_section, run_info  # noqa: E402
from specserve.core.config import EngineConfig  # noqa: E402
from specserve.core.sampling_params import SamplingParams, SpeculativeParams  # noqa: E402
from specserve.draft.ngram import find_ngram_draft  # noqa: E402
from specserve.engine.llm_engine import LLMEngine  # noqa: E402


def no_edit_fallback(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> np.ndarray:
    """The rule without the edit fallback: an empty draft when the last token is new."""
    return find_ngram_draft(tokens, k, min_n, max_n, edit_fallback=False)


def replay(prompt: list[int], output: list[int], k: int, rule, min_n: int, max_n: int) -> int:
    """Target steps single-stream speculation takes to emit ``output`` after ``prompt``."""
    seq = np.asarray(prompt + output, dtype=np.int64)
    start, i, steps = len(prompt), 0, 0
    while i < len(output):
        budget = min(k, len(output) - i - 1)  # never draft past the last token
        draft = rule(seq[: start + i], budget, min_n, max_n) if budget > 0 else seq[:0]
        accepted = 0
        while accepted < len(draft) and draft[accepted] == output[i + accepted]:
            accepted += 1
        i += accepted + 1
        steps += 1
    return steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--workloads", default="rewrite,summarize,code")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--k", default="2,3,4,6,8")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    engine = LLMEngine(EngineConfig(model=args.model, draft_model="none"))
    min_n, max_n = engine.config.prompt_lookup_min, engine.config.prompt_lookup_max
    ks = [int(k) for k in args.k.split(",")]
    rules = {"shipped": find_ngram_draft, "no edit fallback": no_edit_fallback}
    lines = ["| workload | tokens | rule | " + " | ".join(f"k={k}" for k in ks) + " |",
             "|---|---|---|" + "---|" * len(ks)]
    for name in args.workloads.split(","):
        texts = load_workload(name)
        prompts = [engine.encode(engine.render_chat([{"role": "user", "content": t}]))
                   for t in texts]
        outs = engine.generate(prompts, SamplingParams(max_tokens=args.new_tokens,
                                                       temperature=0.0),
                               SpeculativeParams(method="off"))
        pairs = [(p, o.token_ids) for p, o in zip(prompts, outs)]
        total = sum(len(o) for _, o in pairs)
        for label, rule in rules.items():
            per_k = [total / sum(replay(p, o, k, rule, min_n, max_n) for p, o in pairs)
                     for k in ks]
            lines.append(f"| {name} | {total} | {label} | "
                         + " | ".join(f"{v:.2f}" for v in per_k) + " |")
            print(lines[-1], flush=True)
    section = results_section(
        "## N-gram proposer: tokens per target step (replay)",
        run_info(sys.argv[1:], program="python benchmarks/probes/ngram_replay.py"),
        f"Model `{engine.model_path.split('/')[-1]}`, greedy outputs of up to {args.new_tokens} "
        f"tokens per prompt, single stream, n from {max_n} down to {min_n}; exact counts, no "
        f"timing (see the script's docstring).",
        lines,
    )
    publish("## N-gram proposer: tokens per target step", section, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
