"""Grammar engines compared: time to fill the token bitmask (and advance the matcher) per
generated token, xgrammar vs llguidance, with the built-in model's tokenizer, at batch 1 and 32.
Writes a section of benchmarks/RESULTS.md.

    python benchmarks/probes/grammar_mask_cost.py [--batch-sizes 1,32] [--repeats 3] [--no-write]

Workload: a tool-call-like JSON schema (an object with a name, an enum, a number, an array of
strings and a nested object). A fixed valid document is tokenized once; each measured step
fills every matcher's mask for the next token, then feeds that token (batch 32: 32 matchers at
staggered offsets into the same document, so they sit in different grammar states). Also
timed: compiling the schema (cold, per engine) and the tokenizer set-up. Mask fill is the part
on the step's critical path; applying the bitmask to the logits is the same torch code for both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: this checkout's packages first

from benchmarks.report import run_info, write_results_section  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit", "kelvin"]},
        "days": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "location": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
            "required": ["city", "country"],
        },
    },
    "required": ["name", "unit", "days", "tags", "location"],
    "additionalProperties": False,
}
DOC = {
    "name": "get_weather_forecast", "unit": "celsius", "days": 5,
    "tags": ["outdoor", "weekend trip", "hiking"],
    "location": {"city": "San Francisco", "country": "United States"},
}


def _tokenizer():
    from specserve.engine.models import default_model_path, load_tokenizer

    return load_tokenizer(default_model_path())


def _time_steps(fill, advance, tokens: list[int], batch: int) -> list[float]:
    """Seconds per step: fill all masks, then each matcher takes its next token."""
    n = len(tokens)
    offsets = [(i * (n // 2)) // batch for i in range(batch)]  # the last half is timed
    # matchers begin at their offset: advance them there first (not timed)
    for b, off in enumerate(offsets):
        for t in tokens[:off]:
            advance(b, t)
    pos = list(offsets)
    out = []
    for _ in range(n - max(offsets) - 1):
        t0 = time.perf_counter()
        fill()
        out.append(time.perf_counter() - t0)
        for b in range(batch):
            advance(b, tokens[pos[b]])
            pos[b] += 1
    return out


def xgrammar_run(tok, vocab: int, tokens: list[int], batch: int) -> dict:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    setup = time.perf_counter() - t0
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), strict_mode=True)
    compile_s = time.perf_counter() - t0
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = xgr.allocate_token_bitmask(batch, vocab)
    batched = xgr.BatchGrammarMatcher() if batch > 1 else None

    def fill():
        if batched is None:
            matchers[0].fill_next_token_bitmask(bitmask, 0)
        else:
            batched.batch_fill_next_token_bitmask(matchers, bitmask)

    def advance(b, t):
        assert matchers[b].accept_token(t), "document rejected"

    return {"setup_s": setup, "compile_s": compile_s,
            "steps": _time_steps(fill, advance, tokens, batch)}


def llguidance_run(tok, vocab: int, tokens: list[int], batch: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    setup = time.perf_counter() - t0
    t0 = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matchers = [llguidance.LLMatcher(lltok, grammar) for _ in range(batch)]
    compile_s = (time.perf_counter() - t0) / batch
    bitmask = llt.allocate_token_bitmask(batch, vocab)
    executor = llguidance.LLExecutor()

    def fill():
        if batch == 1:
            llt.fill_next_token_bitmask(matchers[0], bitmask, 0)
        else:
            llt.fill_next_token_bitmask_par(executor, [(m, i) for i, m in enumerate(matchers)],
                                            bitmask)

    def advance(b, t):
        assert matchers[b].consume_token(t), matchers[b].get_error()

    return {"setup_s": setup, "compile_s": compile_s,
            "steps": _time_steps(fill, advance, tokens, batch)}


ENGINES = {"xgrammar": xgrammar_run, "llguidance": llguidance_run}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-sizes", default="1,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    tok = _tokenizer()
    vocab = len(tok)
    tokens = tok.encode(json.dumps(DOC), add_special_tokens=False)
    rows = []
    for bsz in [int(x) for x in args.batch_sizes.split(",")]:
        for name, fn in ENGINES.items():
            steps: list[float] = []
            compile_s = setup_s = 0.0
            for _ in range(args.repeats):
                r = fn(tok, vocab, tokens, bsz)
                steps += r["steps"]
                compile_s, setup_s = r["compile_s"], r["setup_s"]
            med = statistics.median(steps) * 1e3
            p90 = sorted(steps)[int(0.9 * len(steps))] * 1e3
            rows.append((name, bsz, med, p90, med / bsz, compile_s * 1e3, setup_s * 1e3))
            print(f"{name:10s} batch {bsz:2d}: mask fill median {med:.3f} ms/step "
                  f"(p90 {p90:.3f}), {med / bsz:.4f} ms/token; compile {compile_s * 1e3:.1f} ms;"
                  f" tokenizer set-up {setup_s * 1e3:.0f} ms", flush=True)
    intro = (f"{len(tokens)}-token document of a tool-call-like schema, vocabulary {vocab} "
             "(SmolLM2); per step every matcher's mask is filled (batch > 1: each engine's "
             "parallel batch call), then each matcher takes its next token. Mask fill only: "
             "applying the bitmask to the logits is the same torch code for both engines.")
    lines = [
        "| engine | batch | mask fill ms/step (median) | p90 | ms per sequence | "
        "compile ms | tokenizer set-up ms |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [f"| {n} | {b} | {m:.3f} | {p:.3f} | {pt:.4f} | {c:.1f} | {s:.0f} |"
              for n, b, m, p, pt, c, s in rows]
    if not args.no_write:
        write_results_section("## Grammar engines: mask time per token", run_info(
            sys.argv[1:], "python benchmarks/probes/grammar_mask_cost.py"), intro, lines)


if __name__ == "__main__":
    main()
