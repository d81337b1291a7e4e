"""A draft model with another tokenizer (``text_draft``) against plain decoding, single stream,
in one process: tok/s ratio, tokens per verify, draft cost per step, acceptance per position.

    python benchmarks/text_draft.py [--model QWEN.gguf] [--draft-model default]
        [--workloads code chat] [--prompts 4] [--max-tokens 128] [--modes off text_draft auto]
        [--temperature 0.0] [--rounds 1] [--json out.json]

The default pair is the built-in SmolLM2-135M-Instruct (49,152 tokens) drafting for
Qwen2.5-Coder-0.5B-Instruct Q4_K_M (151,936 tokens), the file benchmarks/fetch_qwen.py
fetches. The engine runs its defaults plus ``--draft-model``; each request names its mode as
``speculative.method`` (``off`` is plain decoding), so every mode runs on the same engine. A
mode ``text_draft:slem`` / ``text_draft:tli`` / ``text_draft:auto`` runs the text draft with
that cross-tokenizer method (the proposer's ``method``, what ``--cross-tokenizer-method``
sets); plain ``text_draft`` keeps the engine's. Prompts: benchmarks/prompts/<workload>.json
rendered with the target's chat template, up to --max-tokens tokens (EOS ends an answer),
greedy unless --temperature (sampled answers differ between modes; tokens per verify compares
them). Greedy, every mode must give the same tokens per prompt (speculation is exact): a
difference fails the run.

Per mode: tok/s = output tokens / wall seconds over the prompts, one after another; tokens per
verify = (accepted + verify steps) / verify steps; draft ms per verify step (the draft's
forwards and the text re-alignment); acceptance at draft position j = verifies that accepted j
drafts / verifies that reached position j (had >= j drafts and accepted the j - 1 before).
Timing runs go through ``flock /tmp/specserve-bench.lock``; numbers on a shared machine are
indicative.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from benchmarks.fetch_qwen import DEFAULT_DEST as QWEN  # noqa: E402  (fetch_qwen.py writes it)


@dataclass
class ModeStats:
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    draft_ms: float = 0.0
    reached: Counter = field(default_factory=Counter)  # position -> verifies that reached it
    passed: Counter = field(default_factory=Counter)  # position -> verifies that accepted it

    def summary(self) -> dict:
        steps = self.verify_steps
        positions = sorted(self.reached)
        return {
            "tok_s": self.tokens / self.seconds if self.seconds else 0.0,
            "tokens": self.tokens, "seconds": self.seconds,
            "drafted": self.drafted, "accepted": self.accepted, "verify_steps": steps,
            "tokens_per_verify": (self.accepted + steps) / steps if steps else None,
            "draft_ms_per_verify": self.draft_ms / steps if steps else None,
            "acceptance_by_position": {j: self.passed[j] / self.reached[j] for j in positions},
        }


def _record_positions(engine, stats: dict[str, ModeStats], current: list[str]) -> None:
    """Wraps the speculator's verify to count, per draft position, how often it was reached
    and accepted."""
    spec = engine.speculator
    real = spec.verify

    def verify(*args, **kwargs):
        results = real(*args, **kwargs)
        st = stats[current[0]]
        for v in results.values():
            for j in range(1, v.num_drafts + 1):
                if v.num_accepted >= j - 1:
                    st.reached[j] += 1
                if v.num_accepted >= j:
                    st.passed[j] += 1
        return results

    spec.verify = verify


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(QWEN))
    ap.add_argument("--draft-model", default="default")
    ap.add_argument("--workloads", nargs="+", default=["code", "chat"])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--modes", nargs="+", default=["off", "text_draft"])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--fixed-k", type=int, default=0,
                    help="turn the adaptive policy off and draft this many tokens every step "
                         "(0: the engine's default, adaptive)")
    args = ap.parse_args(argv)

    from specserve.core.config import EngineConfig
    from specserve.core.sampling_params import SamplingParams, SpeculativeParams
    from specserve.engine.llm_engine import LLMEngine

    t0 = time.perf_counter()
    fixed = ({"adaptive_speculation": False, "num_speculative_tokens": args.fixed_k}
             if args.fixed_k else {})
    engine = LLMEngine(EngineConfig(model=args.model, draft_model=args.draft_model, **fixed))
    print(f"engine ready in {time.perf_counter() - t0:.0f} s; caveat: "
          f"{engine.config.speculation_caveat}", flush=True)
    tok = engine.tokenizer
    text_draft = engine.speculator.proposers.get("text_draft")
    engine_method = getattr(text_draft, "method", None)
    report: dict = {"model": args.model, "draft_model": args.draft_model, "fixed_k": args.fixed_k,
                    "max_tokens": args.max_tokens, "temperature": args.temperature,
                    "workloads": {}}
    for workload in args.workloads:
        raw = json.loads((ROOT / "prompts" / f"{workload}.json").read_text())[: args.prompts]
        prompts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                           add_generation_prompt=True) for p in raw]
        stats = {m: ModeStats() for m in [*args.modes, "warm-up"]}
        current = ["warm-up"]
        _record_positions(engine, stats, current)
        answers: dict[int, list[int]] = {}  # prompt -> the first mode's tokens
        engine.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0))
        del stats["warm-up"]
        for r in range(args.rounds):
            order = args.modes[r % len(args.modes):] + args.modes[: r % len(args.modes)]
            for mode in order:
                current[0] = mode
                st = stats[mode]
                method, _, cross = mode.partition(":")
                if text_draft is not None:
                    text_draft.method = cross or engine_method
                for i, p in enumerate(prompts):
                    # suffix decoding (in auto) would otherwise copy this prompt's answer from
                    # an earlier mode's or round's run of it
                    engine.clear_speculation_caches()
                    t = time.perf_counter()
                    # no per-request seed: a seeded request accepts a draft only where its own
                    # draw equals it, not by min(1, p/q), which is what the methods differ in
                    params = SamplingParams(max_tokens=args.max_tokens,
                                            temperature=args.temperature)
                    (out,) = engine.generate([p], params, SpeculativeParams(method))
                    st.seconds += time.perf_counter() - t
                    st.tokens += len(out.token_ids)
                    st.drafted += out.timings.num_drafted
                    st.accepted += out.timings.num_accepted
                    st.verify_steps += out.timings.num_verify_steps
                    st.draft_ms += out.timings.draft_ms
                    ref = answers.setdefault(i, out.token_ids)
                    if out.token_ids != ref and not args.temperature:
                        print(f"MISMATCH {workload} prompt {i}: {mode} differs from the first "
                              f"mode run", flush=True)
                        return 1
        summary = {m: s.summary() for m, s in stats.items()}
        base = summary.get("off", {}).get("tok_s")
        for m, s in summary.items():
            s["ratio_vs_off"] = s["tok_s"] / base if base else None
            acc = ", ".join(f"{j}:{a:.2f}" for j, a in s["acceptance_by_position"].items())
            tpv = s["tokens_per_verify"]
            dms = s["draft_ms_per_verify"]
            print(f"{workload:6s} {m:15s} {s['tok_s']:6.2f} tok/s  x{s['ratio_vs_off'] or 0:.2f}"
                  f"  tokens/verify {tpv or 0:.2f}  draft ms/verify {dms or 0:.1f}"
                  f"  ({s['accepted']}/{s['drafted']} accepted; by position {acc})", flush=True)
        report["workloads"][workload] = summary
        engine.speculator.verify = type(engine.speculator).verify.__get__(engine.speculator)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
