"""The most a proposer can gain on this machine: its real drafts, cut to the tokens the target
accepts, run through the real engine, against plain decoding and the proposer as it runs.

    python benchmarks/probes/spec_ceiling.py [--model PATH] [--prompts agentic] [--num-prompts N]
        [--new-tokens 96] [--methods ngram,suffix] [--k 4] [--suffix-k 16] [--repeats 2]
        [--num-threads N] [--no-write]

An "oracle" run wraps a proposer (n-gram or suffix) and truncates each of its drafts to the
prefix that matches the greedy output (known from the plain run): every verified row is then
accepted, no row is spent on a rejected draft, and the step still costs what the engine's verify
of that many rows costs here. No policy choosing k for that proposer can emit more tokens per
step, or pay fewer rows for them, so ``oracle / off`` bounds ``proposer / off`` on this machine
(up to noise and the policy's own choice to cut a long draft whose rows cost more than they
save). The section also gives the measured target step cost by tokens fed (the engine's own
table, ``T(n) / T(1)``): where extra rows are not nearly free, long drafts cannot pay in full.

Greedy outputs of every run must equal plain decoding (exit code 1 otherwise).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: this checkout's packages first

from benchmarks.ab import load_chats, run  # noqa: E402
from benchmarks.report import RESULTS_MD, results_section, run_info, write_section  # noqa: E402
from specserve.core.config import EngineConfig  # noqa: E402
from specserve.core.sampling_params import SamplingParams, SpeculativeParams  # noqa: E402
from specserve.draft.base import (  # noqa: E402
    FinishedSequence,
    PrefillChunk,
    Proposal,
    ProposalRequest,
    Proposer,
)
from specserve.engine.llm_engine import LLMEngine  # noqa: E402


class OracleProposer:
    """``inner``'s drafts cut to the prefix the target's greedy output agrees with."""

    def __init__(self, inner: Proposer, reference: dict[tuple[int, ...], list[int]]) -> None:
        self.inner = inner
        self.reference = reference  # prompt ids -> the greedy output of plain decoding
        self.name = inner.name
        self.uses_model = inner.uses_model

    def propose(self, requests: list[ProposalRequest]) -> Proposal:
        out = self.inner.propose(requests)
        drafts, confidence = [], []
        for i, (req, draft) in enumerate(zip(requests, out.draft_token_ids)):
            prompt = tuple(req.token_ids[: req.num_prompt_tokens])
            done = len(req.token_ids) - req.num_prompt_tokens
            truth = self.reference[prompt][done: done + len(draft)]
            n = 0
            while n < len(truth) and draft[n] == truth[n]:
                n += 1
            drafts.append(list(draft[:n]))
            if out.confidence is not None:
                confidence.append(out.confidence[i][:n])
        return replace(out, draft_token_ids=drafts,
                       confidence=confidence if out.confidence is not None else None)

    def prefill(self, chunks: list[PrefillChunk]) -> list[int]:
        return self.inner.prefill(chunks)

    def finish(self, done: FinishedSequence) -> None:
        self.inner.finish(done)

    def clear(self, tenant: str | None = None) -> None:
        self.inner.clear(tenant)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--prompts", default="agentic")
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--methods", default="ngram,suffix")
    ap.add_argument("--k", type=int, default=4, help="k_max of n-gram")
    ap.add_argument("--suffix-k", type=int, default=16, help="k_max of suffix")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    engine = LLMEngine(EngineConfig(
        model=args.model, num_speculative_tokens=args.k, suffix_speculative_tokens=args.suffix_k,
        num_threads=args.num_threads, draft_model="none",
    ))
    source, chats = load_chats(engine, args.prompts, args.num_prompts)
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0)
    waves = [[c] for c in chats]  # single stream: every prompt alone, in order
    methods = args.methods.split(",")
    for m in ["off", *methods]:  # warm-up, not measured
        engine.generate(chats[:1], SamplingParams(max_tokens=8), SpeculativeParams(method=m))
    reference_run = run(engine, waves, params, "off", None)
    reference = {tuple(c): list(ids) for c, ids in zip(chats, reference_run["ids"])}

    real = dict(engine.speculator.proposers)
    oracles = {m: OracleProposer(real[m], reference) for m in methods}
    modes = ["off"] + [x for m in methods for x in (m, f"oracle {m}")]
    results: dict[str, list[dict]] = {m: [] for m in modes}
    for _ in range(args.repeats):
        for mode in modes:
            method = mode.removeprefix("oracle ")
            engine.speculator.proposers.update(real)
            if mode.startswith("oracle "):
                engine.speculator.proposers[method] = oracles[method]
            results[mode].append(run(engine, waves, params, method, None))
    engine.speculator.proposers.update(real)

    failures = [m for m in modes if any(r["ids"] != reference_run["ids"] for r in results[m])]
    lines = ["| mode | tok/s | vs off (median, min..max) | tokens per verify |",
             "|---|---|---|---|"]
    base = [r["tok_s"] for r in results["off"]]
    for mode in modes:
        ratios = [r["tok_s"] / b for r, b in zip(results[mode], base)]
        mal = results[mode][-1]["mean_accepted_len"]
        lines.append(f"| {mode} | {statistics.median(r['tok_s'] for r in results[mode]):.1f} | "
                     f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}..{max(ratios):.2f}) | "
                     f"{f'{mal:.2f}' if mal else '-'} |")
        print(lines[-1], flush=True)
    table = engine.speculator.policy.target_cost.median
    one = table.get(1)
    costs = ", ".join(f"{n}: {t / one:.2f}" for n, t in sorted(table.items()) if one) or "-"
    heading = f"## Speculation ceiling on this machine ({args.prompts} prompts)"
    section = results_section(
        heading, run_info(sys.argv[1:], program="python benchmarks/probes/spec_ceiling.py"),
        f"Model `{engine.model_path.split('/')[-1]}` ({engine.quantization}), greedy, "
        f"{args.new_tokens} new tokens, {len(chats)} prompts of {source.relative_to(REPO)}"
        f" one after another, k_max n-gram {args.k}, suffix {args.suffix_k}, adaptive k, "
        f"{args.repeats} interleaved repeats. `oracle X`: X's drafts cut to the accepted prefix "
        f"(see the script's docstring). Outputs identical to plain decoding: {not failures}. "
        f"Target step cost by tokens fed, T(n) / T(1), median of this run's steps: {costs}.",
        lines)
    print(section)
    for m in failures:
        print(f"FAILURE: {m} output differs from plain decoding", file=sys.stderr)
    if not args.no_write:
        write_section(RESULTS_MD, heading, section)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
