"""Structured outputs on the built-in model, in one process: (1) the grammar's cost, constrained
vs unconstrained plain decoding per output token, at 1 and 8 concurrent streams; (2)
speculation under a JSON schema vs constrained plain decoding on a tool-call-like workload.
Writes a section of benchmarks/RESULTS.md.

    python benchmarks/structured.py [--rounds 3] [--methods suffix,ngram,draft,auto] [--no-write]
                                    [--workload schema|tools]

Workload: chat prompts asking for a function call (weather, calendar, e-mail, search), each
answered under one JSON schema of the kind tool calls use ({"name": enum, "arguments": {...}}),
greedy. (1) Constrained: each prompt under the schema; unconstrained: the same prompt with
``ignore_eos`` and ``max_tokens`` = the constrained answer's length, so both time the same number
of decode steps; the figure is the ratio of decode time per output token. (2) The same prompts,
constrained, with speculation ``off`` and each method; the answers must be token-identical
(checked), the figure is wall time per round, plain / method; ``M-noforced`` is method M without
the grammar's forced drafts (specserve/spec/grammar.py, ``forced_tokens``). Rounds alternate
the modes; the median round counts. The suffix cache and the policy warm up in round 0, which
is not counted.

``--workload tools``: the same asks as chat requests with ``tools`` (the four functions, each with
its own arguments schema) and ``tool_choice: "required"``, one call: the prompt rendered by a
Hermes/Qwen-style template with the tools (the built-in model's own template renders none:
tests/fixtures/hermes_template.jinja stands in), the answer under the forced-call grammar the
server uses (core/tool_syntax.py, an xgrammar structural tag), its own RESULTS.md section.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script: this checkout's packages first

from benchmarks.report import lscpu_summary, run_info, write_results_section  # noqa: E402
from specserve.core.config import EngineConfig  # noqa: E402
from specserve.core.sampling_params import SamplingParams, SpeculativeParams  # noqa: E402
from specserve.core.structured import StructuredSpec  # noqa: E402
from specserve.core.tool_syntax import ToolSyntax  # noqa: E402
from specserve.engine.llm_engine import LLMEngine  # noqa: E402

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"enum": ["get_weather", "create_event", "send_email", "web_search"]},
        "arguments": {
            "type": "object",
            "properties": {
                "query": {"type": "string", "maxLength": 40},
                "location": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["query", "location", "unit", "days"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
ASKS = [
    "What's the weather in Paris for the next 3 days?",
    "Is it going to rain in Tokyo this week? Use fahrenheit.",
    "Book a meeting with Anna tomorrow at 10 in Berlin.",
    "Send an email to Bob saying I will be late, I'm in London.",
    "Search the web for the best pizza in Naples.",
    "How cold will it be in Oslo over the next 5 days?",
    "Find hiking trails near Denver for this weekend.",
    "Weather forecast for Madrid for a week, in celsius.",
]
SYSTEM = ("You call tools. Answer only with a JSON object {\"name\": ..., \"arguments\": {...}} "
          "choosing one of get_weather, create_event, send_email, web_search.")


def _prompts(engine: LLMEngine) -> list[str]:
    return [engine.render_chat([{"role": "system", "content": SYSTEM},
                                {"role": "user", "content": a}]) for a in ASKS]


def _tools() -> list[dict]:
    """The four functions of TOOL_SCHEMA as OpenAI tools, each with its own arguments."""
    args = TOOL_SCHEMA["properties"]["arguments"]["properties"]

    def params(*keys: str) -> dict:
        return {"type": "object", "properties": {k: args[k] for k in keys},
                "required": list(keys), "additionalProperties": False}

    fns = {"get_weather": params("location", "unit", "days"),
           "create_event": params("query", "location", "days"),
           "send_email": params("query", "location"), "web_search": params("query")}
    return [{"type": "function", "function": {"name": n, "parameters": p}}
            for n, p in fns.items()]


def _tool_workload(engine: LLMEngine) -> tuple[list[str], StructuredSpec]:
    """Prompts rendered with the tools, and the forced-call grammar (tool_choice required)."""
    engine.tokenizer.chat_template = (REPO / "tests" / "fixtures" /
                                      "hermes_template.jinja").read_text()
    tools = _tools()
    prompts = [engine.render_chat([{"role": "user", "content": a}], tools) for a in ASKS]
    fns = [(t["function"]["name"], t["function"]["parameters"]) for t in tools]
    return prompts, StructuredSpec("structural_tag",
                                   ToolSyntax("hermes").structural_tag(fns, False, {}), "tools")


def _run(engine, prompts, params, method, concurrent: bool):
    """(seconds, outputs); concurrent: all prompts in one batch, else one after another.
    ``method`` "M-noforced": M without the grammar's forced drafts (the A/B of what they buy)."""
    forced = not method.endswith("-noforced")
    method = method.removesuffix("-noforced")
    planner = engine.speculator.planner
    planner.forced_draft = engine.speculator._forced_draft if forced else None
    spec = SpeculativeParams(method=method)
    t0 = time.perf_counter()
    if concurrent:
        outs = engine.generate(prompts, params, spec)
    else:
        outs = [engine.generate([p], q, spec)[0] for p, q in zip(prompts, params)]
    return time.perf_counter() - t0, outs


def _decode_ms_per_token(outs) -> float:
    ms = sum(o.timings.decode_ms + o.timings.sample_ms for o in outs)
    toks = sum(o.num_output_tokens - 1 for o in outs)  # the first token comes from prefill
    return ms / max(toks, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--methods", default="suffix,suffix-noforced,ngram,ngram-noforced,draft,"
                    "auto,auto-noforced")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--workload", choices=["schema", "tools"], default="schema")
    args = ap.parse_args()
    info = run_info(sys.argv[1:], "python benchmarks/structured.py")
    engine = LLMEngine(EngineConfig())
    if args.workload == "tools":
        prompts, spec = _tool_workload(engine)
    else:
        prompts = _prompts(engine)
        spec = StructuredSpec.json_schema(TOOL_SCHEMA, "response_format.json_schema.schema")
    constrained = [SamplingParams(max_tokens=args.max_tokens, temperature=0.0, structured=spec)
                   for _ in prompts]
    _, ref = _run(engine, prompts, constrained, "off", False)  # warm-up; the reference answers
    free = [SamplingParams(max_tokens=o.num_output_tokens, temperature=0.0, ignore_eos=True)
            for o in ref]
    rows = []
    # (1) overhead: per output token, constrained vs unconstrained plain decoding
    for streams in (1, 8):
        ratios = []
        for _ in range(args.rounds):
            _, c = _run(engine, prompts, constrained, "off", streams > 1)
            _, u = _run(engine, prompts, free, "off", streams > 1)
            ratios.append((_decode_ms_per_token(c), _decode_ms_per_token(u)))
        med_c = statistics.median(r[0] for r in ratios)
        med_u = statistics.median(r[1] for r in ratios)
        rows.append(f"| grammar overhead, {streams} stream(s) | {med_u:.2f} ms/token "
                    f"unconstrained | {med_c:.2f} ms/token constrained | "
                    f"{(med_c / med_u - 1) * 100:+.1f}% |")
        print(rows[-1], flush=True)
    # (2) speculation under the schema vs constrained plain decoding, one stream
    methods = [m for m in args.methods.split(",") if m]
    for method in methods:
        _run(engine, prompts, constrained, method, False)  # round 0: caches / policy warm up
    times: dict[str, list[float]] = {m: [] for m in ["off", *methods]}
    accept: dict[str, tuple[int, int]] = {}
    for _ in range(args.rounds):
        for method in times:
            secs, outs = _run(engine, prompts, constrained, method, False)
            assert [o.token_ids for o in outs] == [o.token_ids for o in ref], method
            times[method].append(secs)
            accept[method] = (sum(o.timings.num_drafted for o in outs),
                              sum(o.timings.num_accepted for o in outs))
    plain = statistics.median(times["off"])
    ntok = sum(o.num_output_tokens for o in ref)
    for method in methods:
        t = statistics.median(times[method])
        d, a = accept[method]
        rows.append(f"| speculation `{method}` under the schema, 1 stream | {plain:.2f} s plain "
                    f"| {t:.2f} s ({ntok / t:.1f} tok/s; drafted {d}, accepted {a}) | "
                    f"{plain / t:.2f}x |")
        print(rows[-1], flush=True)
    what = ("under one JSON schema (enum name, object of 4 arguments)" if args.workload ==
            "schema" else "as chat requests with 4 tools and tool_choice \"required\" (one "
            "Hermes call, its arguments under its function's schema)")
    intro = (f"{len(prompts)} tool-call prompts {what}, greedy, {ntok} output tokens per "
             f"round, median of {args.rounds} rounds; speculative answers checked "
             "token-identical to plain. Overhead: decode + sample ms per output token, "
             "constrained vs unconstrained (same prompts, same "
             f"token counts). lscpu: {lscpu_summary()}. Indicative: other jobs shared the CPU.")
    body = ["| what | baseline | with | ratio |", "|---|---|---|---|", *rows]
    if not args.no_write:
        title = ("## Structured outputs: grammar overhead and speculation under a schema"
                 if args.workload == "schema" else
                 "## Tool calls: grammar overhead and speculation under tool_choice required")
        write_results_section(title, info, intro, body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
