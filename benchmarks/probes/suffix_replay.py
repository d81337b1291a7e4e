"""Tokens per target step of suffix decoding (and n-gram) by setting, without timing noise.

    python benchmarks/probes/suffix_replay.py [--model PATH]
        [--workloads agentic,templated,chat,rewrite] [--new-tokens 96] [--factors 1,2,4]
        [--min-probs 0,0.1,0.3] [--ks 4,8,16] [--no-write]

The target generates each prompt's greedy output once (plain decoding, all prompts in one batch).
Then single-stream speculation is replayed over the prompts in order, as benchmarks/ab.py runs
them at batch 1: at each step the proposer drafts up to k tokens from the tokens known so far,
the drafts agreeing with the real continuation are accepted, and one more token (the target's
own) is emitted; a finished output enters the suffix cache before the next prompt. Greedy
speculation emits exactly these tokens, so tokens per step are exact and depend only on the rule
and its settings (spec_factor: a match of m tokens drafts at most factor x m; min_prob: the
estimated probability below which a draft stops; k). Every draft is verified in full here; the
engine's policy may cut k where rows are dear, so speed still needs benchmarks/ab.py.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: this checkout's packages first

from benchmarks.ab import load_chats  # noqa: E402
from benchmarks.report import publish, results_section, run_info  # noqa: E402
from specserve.core.config import EngineConfig  # noqa: E402
from specserve.core.sampling_params import SamplingParams, SpeculativeParams  # noqa: E402
from specserve.draft.base import FinishedSequence, ProposalRequest  # noqa: E402
from specserve.draft.ngram import find_ngram_draft  # noqa: E402
from specserve.draft.suffix import SuffixOptions, SuffixProposer  # noqa: E402
from specserve.engine.llm_engine import LLMEngine  # noqa: E402


def replay(prompts: list[list[int]], outputs: list[list[int]], k: int, draft_fn,
           finish_fn=None) -> tuple[int, int]:
    """(tokens emitted, target steps) over every prompt in order."""
    tokens = steps = 0
    for sid, (prompt, output) in enumerate(zip(prompts, outputs)):
        seq = prompt + output
        i = 0
        while i < len(output):
            budget = min(k, len(output) - i - 1)  # never draft past the last token
            draft = draft_fn(sid, seq[: len(prompt) + i], budget) if budget > 0 else []
            accepted = 0
            while accepted < len(draft) and draft[accepted] == output[i + accepted]:
                accepted += 1
            i += accepted + 1
            steps += 1
        tokens += len(output)
        if finish_fn is not None:
            finish_fn(sid, seq, len(prompt))
    return tokens, steps


def suffix_rate(prompts, outputs, k: int, factor: float, min_prob: float) -> float:
    prop = SuffixProposer(SuffixOptions(spec_factor=factor, min_prob=min_prob))

    def draft(sid, known, budget):
        return prop.draft(ProposalRequest(sid, known, budget)).tokens

    def finish(sid, seq, n_prompt):
        prop.finish(FinishedSequence(sid, seq, n_prompt, method="suffix"))

    tokens, steps = replay(prompts, outputs, k, draft, finish)
    return tokens / steps


def ngram_rate(prompts, outputs, k: int) -> float:
    def draft(sid, known, budget):
        return find_ngram_draft(np.asarray(known, dtype=np.int64), budget, 1, 4).tolist()

    tokens, steps = replay(prompts, outputs, k, draft)
    return tokens / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--workloads", default="agentic,templated,chat,rewrite")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--factors", default="1,2,4")
    ap.add_argument("--min-probs", default="0,0.1,0.3")
    ap.add_argument("--ks", default="4,8,16")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, dtype="float32", draft_model="none"))
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0)
    ks = [int(k) for k in args.ks.split(",")]
    factors = [float(f) for f in args.factors.split(",")]
    min_probs = [float(p) for p in args.min_probs.split(",")]
    lines = ["| workload | proposer | k | spec_factor | min_prob | tokens per step |",
             "|---|---|---|---|---|---|"]
    for name in args.workloads.split(","):
        prompts = load_chats(engine, name)[1]
        outs = engine.generate(prompts, params, SpeculativeParams(method="off"))
        outputs = [list(o.token_ids) for o in outs]
        for k in ks:
            lines.append(f"| {name} | ngram | {k} | - | - | "
                         f"{ngram_rate(prompts, outputs, k):.2f} |")
            print(lines[-1], flush=True)
        for k, factor, min_prob in itertools.product(ks, factors, min_probs):
            rate = suffix_rate(prompts, outputs, k, factor, min_prob)
            lines.append(f"| {name} | suffix | {k} | {factor:g} | {min_prob:g} | {rate:.2f} |")
            print(lines[-1], flush=True)
    heading = "## Suffix decoding: tokens per target step by setting (replay)"
    section = results_section(
        heading, run_info(sys.argv[1:], program="python benchmarks/probes/suffix_replay.py"),
        f"Model `{engine.model_path.split('/')[-1]}`, greedy outputs of {args.new_tokens} tokens "
        "per prompt, prompts replayed in order (each output enters the suffix cache before the "
        "next prompt, as in benchmarks/ab.py at batch 1); n-gram: n from 4 down to 1. Exact "
        "counts, no timing (see the script's docstring).", lines)
    publish(heading, section, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
