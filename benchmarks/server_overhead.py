"""What the server costs: plain decoding's tok/s in process, through `specserve serve` (JSON and
SSE) and through llama.cpp's `llama-server` on the same GGUF, at 1 stream and at N concurrent
streams, in one run. Writes the "## Server overhead" section of benchmarks/RESULTS.md.

    python benchmarks/server_overhead.py [--model PATH.gguf] [--threads 2] [--new-tokens 128]
        [--streams 8] [--rounds 3] [--prompts 4] [--workload chat] [--serve-flags "..."]
        [--no-llama-server] [--no-write]

Plain everywhere: ours with ``speculative: off`` (every answer's timings must say num_drafted 0,
in process as over HTTP), llama-server without ``--spec-type`` (no ``draft_n`` in its timings).
Greedy, EOS ignored (``ignore_eos``; llama-server also ``n_predict``), exactly --new-tokens per
answer. Every side gets the same prompt text: the workload's prompts through the model's chat
template, sent to ``/v1/completions`` (in process: that text's token ids), so both servers
tokenize one string (the prompt token counts they report are compared).

All servers are started first and stay up (an idle one takes no CPU): ours with its defaults
(the shipped draft loaded; --serve-flags adds flags), llama-server ``-np 1`` and ``-np N``. Each
round runs, at 1 stream and then at N streams, every system in turn, the order rotating by
round. At 1 stream the prompts go one after another; at N streams N requests go at once (the
prompts repeated). tok/s = output tokens / wall seconds of the batch. Ratios are taken within a
round (same machine state) and reported as median (min..max) over the rounds. Our three paths
must give the same text for the same prompt (greedy); a difference fails the run (exit 1).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from benchmarks.client import Completion, complete, completion_body  # noqa: E402
from benchmarks.launched_server import LaunchedServer  # noqa: E402
from benchmarks.llama_server import LlamaCpp, LlamaServer  # noqa: E402
from benchmarks.report import (  # noqa: E402
    BenchError,
    fmt,
    load_workload,
    lscpu_summary,
    md_table,
    out_dir,
    publish,
    results_section,
    run_info,
    write_json,
)
from benchmarks.stats import ratio_cell  # noqa: E402
from specserve.core.config import EngineConfig  # noqa: E402
from specserve.core.sampling_params import SamplingParams, SpeculativeParams  # noqa: E402
from specserve.engine.llm_engine import LLMEngine  # noqa: E402

HEADING = "## Server overhead: in process, specserve serve, llama-server"
IN_PROCESS, OURS_JSON, OURS_SSE = "in process", "serve JSON", "serve SSE"
LLAMA_JSON, LLAMA_SSE = "llama-server JSON", "llama-server SSE"
OURS = (IN_PROCESS, OURS_JSON, OURS_SSE)
RATIOS = ((OURS_JSON, IN_PROCESS), (OURS_SSE, IN_PROCESS), (OURS_JSON, LLAMA_JSON),
          (OURS_SSE, LLAMA_SSE))


@dataclass
class Batch:
    """One system's run of the prompts at one width, in one round."""

    tokens: int
    seconds: float
    texts: list[str]
    prompt_tokens: list[int] = field(default_factory=list)

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


def waves(items: list, width: int) -> list[list]:
    return [items[i:i + width] for i in range(0, len(items), width)]


def run_in_process(engine: LLMEngine, prompts: list[list[int]], width: int,
                   new_tokens: int) -> Batch:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    off = SpeculativeParams(method="off")
    texts: list[str] = []
    t0 = time.perf_counter()
    for wave in waves(prompts, width):
        outs = engine.generate(wave, params, off)
        for o in outs:
            if o.timings.num_drafted or o.num_output_tokens != new_tokens:
                raise BenchError(f"in process: {o.timings.num_drafted} drafted, "
                                 f"{o.num_output_tokens} tokens (want 0 and {new_tokens})")
        texts += [o.text for o in outs]
    return Batch(len(texts) * new_tokens, time.perf_counter() - t0, texts,
                 [len(p) for p in prompts])


async def run_http(session: aiohttp.ClientSession, url: str, server: str, stream: bool,
                   prompts: list[str], width: int, new_tokens: int) -> Batch:
    answers: list[Completion] = []
    t0 = time.perf_counter()
    for wave in waves(prompts, width):
        answers += await asyncio.gather(*(
            complete(session, url, completion_body(p, new_tokens, server=server), stream)
            for p in wave))
    seconds = time.perf_counter() - t0
    for a in answers:
        if a.drafted or a.output_tokens != new_tokens:
            raise BenchError(f"{server} at {url}: {a.drafted} drafted, {a.output_tokens} "
                             f"tokens (want 0 and {new_tokens}): not plain decoding")
    return Batch(sum(a.output_tokens for a in answers), seconds, [a.text for a in answers],
                 [a.prompt_tokens for a in answers])


def tables(runs: dict[tuple[int, str], list[Batch]], widths: list[int],
           systems: list[str]) -> list[str]:
    speed = md_table(
        ["streams", *(f"{s} tok/s" for s in systems)],
        [[str(w), *(_speed_cell([b.tok_s for b in runs[(w, s)]]) for s in systems)]
         for w in widths])
    pairs = [(a, b) for a, b in RATIOS if a in systems and b in systems]
    ratios = md_table(
        ["streams", *(f"{a} / {b}" for a, b in pairs)],
        [[str(w), *(ratio_cell([x.tok_s / y.tok_s for x, y in zip(runs[(w, a)], runs[(w, b)])])
                    for a, b in pairs)] for w in widths])
    return ["tok/s, median over rounds (min..max):", "", *speed, "",
            "Ratios within each round, median (min..max):", "", *ratios]


def _speed_cell(values: list[float]) -> str:
    return (f"{fmt(statistics.median(values))} ({fmt(min(values))}..{fmt(max(values))})"
            if len(values) > 1 else fmt(values[0]))


def greedy_notes(runs: dict[tuple[int, str], list[Batch]], widths: list[int],
                 systems: list[str]) -> tuple[list[str], list[str]]:
    """(failures, notes): our paths must agree text for text; llama-server's differences (it
    rounds activations its own way) and prompt token counts are only reported."""
    failures, notes = [], []
    for w in widths:
        ref = runs[(w, IN_PROCESS)][0].texts
        for s in OURS:
            bad = sum(t != r for b in runs[(w, s)] for t, r in zip(b.texts, ref))
            if bad:
                failures.append(f"{s} at {w} streams: {bad} answer(s) differ from in process")
        if LLAMA_JSON in systems:
            theirs = runs[(w, LLAMA_JSON)][0]
            differ = sum(t != r for t, r in zip(theirs.texts, ref))
            ours_n = runs[(w, OURS_JSON)][0].prompt_tokens
            same = "equal" if ours_n == theirs.prompt_tokens else (
                f"differ (ours {ours_n}, llama-server {theirs.prompt_tokens})")
            notes.append(f"{w} stream(s): {differ}/{len(ref)} llama-server answers differ in "
                         f"text from ours; prompt token counts {same}.")
    return failures, notes


async def measure(args, engine: LLMEngine, ids: list[list[int]], texts: list[str],
                  urls: dict[tuple[int, str], tuple[str, str, bool]]
                  ) -> dict[tuple[int, str], list[Batch]]:
    systems = [IN_PROCESS, *(s for (w, s) in urls if w == 1)]
    runs: dict[tuple[int, str], list[Batch]] = {}
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for (_, _), (url, server, stream) in urls.items():  # warm-up: first requests
            await run_http(session, url, server, stream, texts[:1], 1, 8)
        run_in_process(engine, ids[:1], 1, 8)
        for rnd in range(args.rounds):
            order = systems[rnd % len(systems):] + systems[:rnd % len(systems)]
            for width in (1, args.streams):
                wide_ids = [ids[i % len(ids)] for i in range(width if width > 1 else len(ids))]
                wide_texts = [texts[i % len(texts)] for i in range(len(wide_ids))]
                for system in order:
                    if system == IN_PROCESS:
                        batch = run_in_process(engine, wide_ids, width, args.new_tokens)
                    else:
                        url, server, stream = urls[(width, system)]
                        batch = await run_http(session, url, server, stream, wide_texts,
                                               width, args.new_tokens)
                    runs.setdefault((width, system), []).append(batch)
                    print(f"round {rnd + 1}/{args.rounds}, {width} stream(s), {system}: "
                          f"{batch.tok_s:.1f} tok/s", flush=True)
    return runs


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf [default: the built-in model]")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--streams", type=int, default=8, help="the concurrent width")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4, help="prompts run at 1 stream per round")
    ap.add_argument("--workload", default="chat")
    ap.add_argument("--serve-flags", default="", help="more `specserve serve` flags, e.g. "
                    "\"--draft-model none\" (also applied to the in-process engine's config "
                    "where they name EngineConfig fields: --draft-model only)")
    ap.add_argument("--no-llama-server", action="store_true")
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    if args.streams < 2 or args.rounds < 1 or args.prompts < 1 or args.new_tokens < 1:
        raise BenchError("--streams must be >= 2; --rounds, --prompts, --new-tokens >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    serve_flags = shlex.split(args.serve_flags)
    draft = serve_flags[serve_flags.index("--draft-model") + 1] if (
        "--draft-model" in serve_flags) else None
    engine = LLMEngine(EngineConfig(model=args.model, draft_model=draft,
                                    num_threads=args.threads))
    if not engine.model_path.endswith(".gguf"):
        raise BenchError(f"llama-server needs a .gguf model (got {engine.model_path})")
    chats = [engine.render_chat([{"role": "user", "content": t}])
             for t in load_workload(args.workload)[: args.prompts]]
    ids = [engine.encode(t) for t in chats]
    folder = out_dir(None, "server_overhead")
    flags = ["--num-threads", str(args.threads), *serve_flags,
             *(["--model", args.model] if args.model else [])]
    use_llama = not args.no_llama_server
    if use_llama and not LlamaCpp.at().ready():
        raise BenchError("llama-server is not built: run `make llama-server`, or pass "
                         "--no-llama-server")
    with LaunchedServer(flags, folder / "serve.log", args.startup_timeout) as ours:
        urls = {(w, s): (ours.url, "specserve", s == OURS_SSE)
                for w in (1, args.streams) for s in (OURS_JSON, OURS_SSE)}
        if use_llama:
            with LlamaServer(engine.model_path, args.threads, 1,
                             log_path=folder / "llama-np1.log") as one, \
                    LlamaServer(engine.model_path, args.threads, args.streams,
                                log_path=folder / f"llama-np{args.streams}.log") as many:
                for w, srv in ((1, one), (args.streams, many)):
                    urls[(w, LLAMA_JSON)] = (srv.url, "llama", False)
                    urls[(w, LLAMA_SSE)] = (srv.url, "llama", True)
                runs = asyncio.run(measure(args, engine, ids, chats, urls))
        else:
            runs = asyncio.run(measure(args, engine, ids, chats, urls))
    widths = [1, args.streams]
    systems = [IN_PROCESS, OURS_JSON, OURS_SSE, *((LLAMA_JSON, LLAMA_SSE) if use_llama else ())]
    write_json(folder / "runs.json", {f"{w} {s}": [b.tok_s for b in v]
                                      for (w, s), v in runs.items()})
    failures, notes = greedy_notes(runs, widths, systems)
    info = run_info(argv, program="python benchmarks/server_overhead.py")
    intro = (
        f"Model `{Path(engine.model_path).name}` (quantization {engine.quantization}), plain "
        f"decoding everywhere (ours `speculative: off`, every answer's num_drafted 0; "
        f"llama-server without --spec-type), greedy, {args.new_tokens} tokens per answer, EOS "
        f"ignored, {args.threads} threads each. Ours: `specserve serve --num-threads "
        f"{args.threads}{' ' + args.serve_flags if args.serve_flags else ''}` (defaults "
        f"otherwise{', the shipped draft loaded' if draft is None else ''}); in process: the "
        f"same engine config through `LLMEngine.generate`. llama-server `-np 1` for 1 stream, "
        f"`-np {args.streams}` for {args.streams}. The same {len(chats)} `{args.workload}` "
        f"prompts (chat-templated text to /v1/completions); 1 stream: one after another; "
        f"{args.streams} streams: {args.streams} requests at once. {args.rounds} rounds, "
        f"systems alternating in rotating order. Indicative where other work shared the "
        f"machine. lscpu: {lscpu_summary()}.")
    section = results_section(HEADING, info, intro, [*tables(runs, widths, systems), "",
                                                     *notes])
    publish(HEADING, section, write=not args.no_write)
    for f in failures:
        print("FAILURE:", f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
