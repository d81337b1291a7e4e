"""Latency attribution: where one request's time goes, from the client's send to its [DONE].

The engine and the real HTTP server run in this process (the server on a free port), so engine
spans (``specserve.engine.tracing``) and the client share one clock. After ``--warmup`` unmeasured
requests, one streamed chat request runs with a recording tracer. The table splits the client's
end-to-end time into: chat template and tokenize, queue (from the request's own timings), the
engine steps phase by phase (schedule, draft prefill, each draft step, n-gram lookup / draft
sampling, target prefill / verify / decode forwards, sampling, output processing with stop
checks and detokenization, step overhead), engine idle time between steps, and what is left:
server and network (HTTP parsing, JSON and SSE encoding, the thread hand-off, loopback TCP).
The Chrome trace (Trace Event Format, for ui.perfetto.dev or chrome://tracing) holds every span.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import plots
from benchmarks.client import RequestResult, Target, sse_request
from benchmarks.report import (
    BenchError,
    RunInfo,
    add_output_args,
    load_workload,
    md_table,
    out_dir,
    run_info,
    write_json,
    write_results_section,
)
from specserve.engine.tracing import SpanEvent, Tracer

HEADING = "## Latency attribution (one request)"
STEP_CHILDREN = ("schedule", "draft_prefill", "propose", "target_forward", "sample", "output")


@dataclass
class Row:
    phase: str
    ms: float
    count: int  # spans summed (0: derived from timings or by difference)
    share: float  # of the client's end-to-end time
    note: str = ""


@dataclass
class AttributionConfig:
    model: str
    draft_model: str | None
    dtype: str
    method: str
    num_speculative_tokens: int
    workload: str
    prompt_index: int
    prompt_tokens: int
    max_tokens: int
    ignore_eos: bool
    warmup: int


@dataclass
class AttributionReport:
    info: RunInfo
    config: AttributionConfig
    client_e2e_ms: float
    client_ttft_ms: float | None
    output_tokens: int
    server_timings: dict
    rows: list[Row]
    trace: str  # path of the Chrome trace
    trace_events: int


def _inside(e: SpanEvent, outer: SpanEvent) -> bool:
    return e.tid == outer.tid and outer.start <= e.start and e.end <= outer.end


def attribute(events: list[SpanEvent], timings: dict, client_e2e_s: float) -> list[Row]:
    """The rows of the table; they add up to the client's end-to-end time (the last row is
    that total)."""
    total_ms = client_e2e_s * 1e3
    by: dict[str, list[SpanEvent]] = defaultdict(list)
    for e in events:
        by[e.name].append(e)

    def ms(spans: list[SpanEvent]) -> float:
        return sum(e.duration for e in spans) * 1e3

    rows: list[Row] = []

    def add(phase: str, value: float, count: int = 0, note: str = "") -> None:
        rows.append(Row(phase, value, count, value / total_ms if total_ms else 0.0, note))

    add("chat template", ms(by["chat_template"]), len(by["chat_template"]), "event loop")
    add("tokenize", ms(by["tokenize"]), len(by["tokenize"]), "engine thread")
    queue_ms = float(timings.get("queue_ms") or 0.0)
    add("queue", queue_ms, 0, "arrival -> first step (request timings)")
    add("schedule", ms(by["schedule"]), len(by["schedule"]), "policy (choose k) + scheduler")
    add("draft prefill", ms(by["draft_prefill"]), len(by["draft_prefill"]),
        "draft model over the prompt")
    per_step: dict[int, list[SpanEvent]] = defaultdict(list)
    in_propose: list[SpanEvent] = []
    for p in by["propose"]:
        inner = sorted((d for d in by["draft_forward"] if _inside(d, p)), key=lambda d: d.start)
        in_propose += inner
        for i, d in enumerate(inner):
            per_step[i].append(d)
    for i in sorted(per_step):
        add(f"draft step {i}", ms(per_step[i]), len(per_step[i]), "draft model forward")
    add("propose other", ms(by["propose"]) - ms(in_propose), len(by["propose"]),
        "n-gram lookup, draft sampling")
    fwd = by["target_forward"]
    prefill = [e for e in fwd if not e.args.get("only_decode")]
    verify = [e for e in fwd if e.args.get("only_decode") and e.args.get("drafts")]
    decode = [e for e in fwd if e.args.get("only_decode") and not e.args.get("drafts")]
    add("target prefill", ms(prefill), len(prefill), "prompt forward (+ first token)")
    add("target verify", ms(verify), len(verify), "last token + k drafts in one forward")
    add("target decode", ms(decode), len(decode), "plain one-token steps")
    add("sampling", ms(by["sample"]), len(by["sample"]), "sampler / rejection sampler")
    detok = float(timings.get("detokenize_ms") or 0.0)
    add("output processing", ms(by["output"]), len(by["output"]),
        f"stop checks, bookkeeping; detokenize {detok:.2f} ms of it")
    step_ms = ms(by["step"])
    children = sum(ms(by[name]) for name in STEP_CHILDREN)
    add("step overhead", step_ms - children, len(by["step"]), "input preparation, Python")
    e2e_ms = float(timings.get("e2e_ms") or 0.0)
    add("engine idle", e2e_ms - queue_ms - step_ms, 0,
        "between steps: command queue, thread hand-off")
    engine_side = ms(by["chat_template"]) + ms(by["tokenize"]) + e2e_ms
    add("server + network", total_ms - engine_side, 0,
        "HTTP, JSON/SSE encoding, event loop, loopback TCP")
    add("total (client end-to-end)", total_ms, 1)
    return rows


def request_spans(result: RequestResult, events: list[SpanEvent], lane: int) -> list[SpanEvent]:
    """Client-side and request-timing spans for the trace's own lane."""
    t0, t = result.sent_at, result.timings
    spans = [SpanEvent("client: request -> [DONE]", t0, t0 + result.e2e_s, lane,
                       {"tokens": result.output_tokens})]
    if result.ttft_s is not None:
        spans.append(SpanEvent("client: time to first token", t0, t0 + result.ttft_s, lane))
    tok = [e for e in events if e.name == "tokenize"]
    if tok and t.get("e2e_ms") is not None:  # arrival follows tokenization at once
        arrival = tok[-1].end
        spans.append(SpanEvent("request: queue", arrival, arrival + t["queue_ms"] / 1e3,
                               lane + 1))
        spans.append(SpanEvent("request: in engine", arrival, arrival + t["e2e_ms"] / 1e3,
                               lane + 1, {k: v for k, v in t.items() if k.endswith("_ms")}))
    return spans


async def measure(engine: Any, target: Target, prompt: str, method: str, warmup: int,
                  startup_timeout: float) -> tuple[RequestResult, Tracer]:
    """Serves ``engine`` on a free port in this process and times one request through it."""
    import aiohttp
    from aiohttp import web

    from specserve.engine.async_engine import AsyncEngine
    from specserve.engine.tracing import NullTracer
    from specserve.server.app import create_app
    from specserve.server.server_config import ServerConfig

    aengine = AsyncEngine(engine, max_queue_len=16, warmup=True)
    runner = web.AppRunner(create_app(aengine, ServerConfig(port=0)), handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        target.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        await aengine.wait_ready(startup_timeout)
        async with aiohttp.ClientSession() as session:
            for _ in range(warmup):
                _checked(await sse_request(session, target, prompt, method))
            tracer = Tracer()
            engine.tracer = tracer  # the engine thread is idle: no step is running
            try:
                result = _checked(await sse_request(session, target, prompt, method))
            finally:
                engine.tracer = NullTracer()
    finally:
        await runner.cleanup()
    return result, tracer


def _checked(result: RequestResult) -> RequestResult:
    if not result.ok:
        raise BenchError(f"the request failed: {result.error}")
    return result


# ---- the run ------------------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from specserve.cli import add_engine_args

    ap.add_argument("--workload", default="rewrite",
                    help="prompt file under benchmarks/prompts [default: %(default)s]")
    ap.add_argument("--prompt-index", type=int, default=0,
                    help="which prompt of the workload [default: %(default)s]")
    ap.add_argument("--max-tokens", type=int, default=64, help="[default: %(default)s]")
    ap.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens")
    ap.add_argument("--method", choices=("off", "ngram", "draft"), default=None,
                    help="the request's speculative method [default: draft with "
                         "--draft-model, else ngram]")
    ap.add_argument("--warmup", type=int, default=2,
                    help="unmeasured requests before the traced one [default: %(default)s]")
    ap.add_argument("--trace", default=None,
                    help="Chrome-trace JSON path [default: OUT/trace.json]")
    ap.add_argument("--startup-timeout", type=float, default=600.0,
                    help="seconds to wait for the engine's warm-up [default: %(default)s]")
    add_output_args(ap)
    add_engine_args(ap)
    ap.set_defaults(dtype="float32")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    from specserve.cli import engine_config_from_args
    from specserve.engine.llm_engine import LLMEngine

    prompts = load_workload(args.workload)
    if not 0 <= args.prompt_index < len(prompts):
        raise BenchError(f"--prompt-index must be in [0, {len(prompts)}) for {args.workload}")
    if args.max_tokens < 1 or args.warmup < 0:
        raise BenchError("--max-tokens must be >= 1 and --warmup >= 0")
    folder = out_dir(args.out, "attribution")
    trace_path = Path(args.trace) if args.trace else folder / "trace.json"
    engine = LLMEngine(engine_config_from_args(args))
    method = args.method or ("draft" if engine.speculator.draft is not None else "ngram")
    if method == "draft" and engine.speculator.draft is None:
        raise BenchError("--method draft needs --draft-model")
    prompt = prompts[args.prompt_index]
    prompt_tokens = len(engine.encode(engine.render_chat([{"role": "user", "content": prompt}])))
    target = Target("", "chat", None, args.max_tokens, args.ignore_eos)
    loop_tid = threading.get_ident()
    result, tracer = asyncio.run(measure(engine, target, prompt, method, args.warmup,
                                         args.startup_timeout))
    rows = attribute(tracer.events, result.timings, result.e2e_s)
    engine_tids = {e.tid for e in tracer.events if e.name == "step"}
    names = {loop_tid: "event loop (server + client)", 1: "client", 2: "request timings",
             **{tid: "engine thread" for tid in engine_tids}}
    doc = tracer.chrome_trace(request_spans(result, tracer.events, 1), names)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    trace_path.write_text(json.dumps(doc))
    config = AttributionConfig(
        model=engine.model_path, draft_model=engine.config.draft_model, dtype=str(engine.dtype),
        method=method, num_speculative_tokens=args.num_speculative_tokens,
        workload=args.workload, prompt_index=args.prompt_index, prompt_tokens=prompt_tokens,
        max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, warmup=args.warmup,
    )
    report = AttributionReport(
        run_info(argv), config, result.e2e_s * 1e3,
        result.ttft_s * 1e3 if result.ttft_s is not None else None, result.output_tokens,
        result.timings, rows, str(trace_path), len(doc["traceEvents"]),
    )
    write_json(folder / "attribution.json", report)
    if not args.no_plots:
        shown = rows[:-1]
        plots.hbars(folder / "attribution.png", [r.phase for r in shown],
                    [r.ms for r in shown], "milliseconds",
                    f"One {method} request: {report.client_e2e_ms:.0f} ms end to end, "
                    f"{report.output_tokens} tokens")
    body = tables(report)
    print("\n".join(body))
    if args.write_results:
        write_results_section(HEADING, report.info, intro(report), body)
    print(f"results: {folder / 'attribution.json'}; trace: {trace_path} (open in "
          f"https://ui.perfetto.dev)")
    return 0


def tables(report: AttributionReport) -> list[str]:
    rows = [[r.phase, f"{r.ms:.2f}", f"{100 * r.share:.1f}%", str(r.count) if r.count else "-",
             r.note] for r in report.rows]
    return md_table(["phase", "ms", "share", "spans", "what"], rows)


def intro(report: AttributionReport) -> str:
    c = report.config
    draft = f", draft `{Path(c.draft_model).name}`" if c.draft_model else ""
    ttft = f"{report.client_ttft_ms:.0f}" if report.client_ttft_ms is not None else "-"
    return (f"Model `{Path(c.model).name}`{draft}, {c.dtype}; one streamed chat request "
            f"(`{c.workload}` prompt {c.prompt_index}, {c.prompt_tokens} prompt tokens, "
            f"{report.output_tokens} output tokens, speculative method {c.method}, k_max "
            f"{c.num_speculative_tokens}) to an idle in-process server after {c.warmup} "
            f"warm-up request(s): {report.client_e2e_ms:.0f} ms end to end, TTFT {ttft} ms. "
            f"Chrome trace: `{Path(report.trace).name}`.")
