"""Suffix decoding's per-step cost (trie update + match + draft walk) at 1, 8 and 64 sequences x
8k context, for the Python trie (the reference) and the C++ one, in the same run. Writes a
section of benchmarks/RESULTS.md.

    python benchmarks/probes/suffix_overhead.py [--batch-sizes 1,8,64] [--impls python,cpp]
        [--context 8192] [--steps 48] [--cache-tokens 262144] [--decode-ms 97.7] [--no-write]

Each sequence's prompt is ``--context`` tokens of code-like text: random spans over a 49k
vocabulary with edited copies of earlier spans (so the trie has real matches, not only misses).
Decoding is simulated: each step every sequence gets the drafts that match its true continuation
(itself an edited copy) plus one token, exactly as accepted tokens would arrive. The global cache
is first filled to ``--cache-tokens`` with outputs of the same kind. Timed: ``propose`` over all
sequences (it extends each trie by the new tokens, matches both tries, walks the drafts), per
step; and, separately, the first proposal of each sequence (its whole prompt enters its trie).
Both tries see the same token streams and give the same drafts (tests/test_suffix_fast.py).

The decode step to compare with is ``--decode-ms``: by default the 8k-context decode step of the
built-in model at batch 1 (benchmarks/RESULTS.md, "Context scaling, native 4-bit"), a LOWER
bound for a step of 8 or 64 sequences at 8k context (which reads 8x / 64x the KV), so the share
printed overstates the suffix share.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: this checkout's packages first

from benchmarks.report import run_info, write_results_section  # noqa: E402
from specserve.draft.base import FinishedSequence, ProposalRequest  # noqa: E402
from specserve.draft.suffix import SuffixOptions, SuffixProposer  # noqa: E402

VOCAB = 49152


def code_like(rng: random.Random, n: int, history: list[int] | None = None) -> list[int]:
    """Random spans and edited copies of earlier spans (of ``history`` or itself)."""
    out: list[int] = []
    while len(out) < n:
        src = history if history and rng.random() < 0.5 else out
        if len(src) > 64 and rng.random() < 0.6:
            start = rng.randrange(len(src) - 32)
            span = list(src[start : start + rng.randint(8, 32)])
            if rng.random() < 0.5:
                span[rng.randrange(len(span))] = rng.randrange(VOCAB)
        else:
            span = [rng.randrange(VOCAB) for _ in range(rng.randint(4, 24))]
        out += span
    return out[:n]


def measure(impl: str, bsz: int, args, rng: random.Random) -> dict:
    prop = SuffixProposer(SuffixOptions(cache_tokens=args.cache_tokens, impl=impl))
    outputs: list[list[int]] = []
    while sum(map(len, outputs)) < args.cache_tokens:
        outputs.append(code_like(rng, 512))
    filled = sum(map(len, outputs))
    t0 = time.perf_counter()
    for out in outputs:
        prop.finish(FinishedSequence(-1, out, 0, tenant="t", method="suffix"))
    fill_s = time.perf_counter() - t0

    seqs = [code_like(rng, args.context) for _ in range(bsz)]
    truth = [code_like(rng, args.steps * (args.k + 1), s) for s in seqs]
    t0 = time.perf_counter()
    prop.propose([ProposalRequest(i, s, args.k, tenant="t") for i, s in enumerate(seqs)])
    prime_s = time.perf_counter() - t0

    step_ms: list[float] = []
    drafted = accepted = 0
    for _ in range(args.steps):
        t0 = time.perf_counter()
        prop_out = prop.propose([ProposalRequest(i, s, args.k, tenant="t")
                                 for i, s in enumerate(seqs)])
        step_ms.append((time.perf_counter() - t0) * 1e3)
        for i, draft in enumerate(prop_out.draft_token_ids):
            done = len(seqs[i]) - args.context
            want = truth[i][done : done + len(draft) + 1]
            a = 0
            while a < len(draft) and draft[a] == want[a]:
                a += 1
            drafted += len(draft)
            accepted += a
            seqs[i] += want[: a + 1]
    return {
        "impl": impl, "batch": bsz, "fill_us": fill_s / filled * 1e6,
        "prime_ms": prime_s / bsz * 1e3, "median": statistics.median(step_ms),
        "p95": sorted(step_ms)[int(0.95 * (len(step_ms) - 1))],
        "drafted": drafted, "accepted": accepted,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--impls", default="python,cpp")
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=48)
    ap.add_argument("--k", type=int, default=16)
    ap.add_argument("--cache-tokens", type=int, default=1 << 18)
    ap.add_argument("--decode-ms", type=float, default=97.7)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    info = run_info(sys.argv[1:], "python benchmarks/probes/suffix_overhead.py")
    rows = [
        "| trie | sequences | per step: median / p95 ms | per sequence us | share of a step "
        "| prompt insert ms (per prompt) | cache fill us per token | drafted / accepted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for bsz in [int(b) for b in args.batch_sizes.split(",")]:
        for impl in args.impls.split(","):
            # The same seed per batch size: both tries see the same streams.
            r = measure(impl, bsz, args, random.Random(bsz))
            rows.append(
                f"| {impl} | {bsz} | {r['median']:.3f} / {r['p95']:.3f} | "
                f"{r['median'] / bsz * 1e3:.0f} | "
                f"{r['median'] / (r['median'] + args.decode_ms) * 100:.2f}% | "
                f"{r['prime_ms']:.1f} | {r['fill_us']:.1f} | {r['drafted']} / {r['accepted']} |"
            )
            print(rows[-1], flush=True)
    intro = (f"Sequences x {args.context}-token context, k = {args.k}, global cache "
             f"{args.cache_tokens} tokens, {args.steps} simulated steps, each trie on the same "
             "token streams. Share: the median step against a decode step of "
             f"{args.decode_ms} ms (the built-in model's 8k-context step at batch 1, section "
             "'Context scaling, native 4-bit': a lower bound for 8 or 64 sequences, so the share "
             "is an upper bound).")
    if not args.no_write:
        write_results_section("## Suffix decoding: per-step cost at 1 / 8 / 64 x 8k", info,
                              intro, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
