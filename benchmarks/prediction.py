"""Predicted Outputs on a code-edit workload, through HTTP: tok/s with the file as the request's
``prediction`` against plain decoding and against suffix decoding without the prediction, at 1
stream and at N concurrent streams. Writes the "## Predicted Outputs" section of
benchmarks/RESULTS.md.

    python benchmarks/prediction.py [--model PATH] [--threads 2] [--max-tokens 256]
        [--streams 8] [--rounds 2] [--prompts 4] [--serve-flags "..."] [--no-write]

The workload: each snippet of benchmarks/prompts/code.json (the code after its instruction)
with one edit asked of it, a rename of its first function-like name, "return the whole code
and nothing else"; the prediction is the snippet as it was (what an editor sends: the file
before the edit). Chat requests, greedy, up to --max-tokens tokens (EOS ends an answer).

Modes, one server (`specserve serve` with its defaults, --serve-flags added): ``plain``
(``speculative: off``), ``suffix`` (``speculative.method`` suffix, no prediction) and
``prediction`` (the server's default method, auto, with the prediction). All three must give
the same text for the same prompt (greedy speculation is exact); a difference fails the run.
Each round runs every mode, in rotating order, at 1 stream (the prompts one after another)
and then at N streams (N requests at once, the prompts repeated). tok/s = completion tokens /
wall seconds of the batch; ratios are taken within a round and reported as median (min..max).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shlex
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from benchmarks.launched_server import LaunchedServer  # noqa: E402
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

HEADING = "## Predicted Outputs: code edits with the file as the prediction"
MODES = ("plain", "suffix", "prediction")
_NAME = re.compile(r"\b([A-Za-z_]\w{3,})\s*\(")


@dataclass
class EditTask:
    instruction: str  # the user message
    prediction: str  # the code before the edit


def edit_tasks(snippets: list[str]) -> list[EditTask]:
    """One rename per snippet of a code workload ("instruction\\n\\ncode")."""
    tasks = []
    for text in snippets:
        code = text.split("\n\n", 1)[-1]
        m = _NAME.search(code)
        if m is None:
            continue
        old = m.group(1)
        tasks.append(EditTask(
            f"Rename `{old}` to `{old}_v2` everywhere in this code. Return the whole code and "
            f"nothing else.\n\n{code}", code))
    if not tasks:
        raise BenchError("no snippet of the workload has a function-like name to rename")
    return tasks


@dataclass
class Answer:
    text: str
    tokens: int
    drafted: int
    accepted: int
    details: dict


def body(task: EditTask, mode: str, max_tokens: int) -> dict:
    out: dict = {"messages": [{"role": "user", "content": task.instruction}],
                 "max_tokens": max_tokens, "temperature": 0.0}
    if mode == "plain":
        out["speculative"] = {"method": "off"}
    elif mode == "suffix":
        out["speculative"] = {"method": "suffix"}
    else:
        out["prediction"] = {"type": "content", "content": task.prediction}
    return out


async def ask(session: aiohttp.ClientSession, url: str, payload: dict) -> Answer:
    async with session.post(url + "/v1/chat/completions", json=payload) as resp:
        text = await resp.text()
        if resp.status != 200:
            raise BenchError(f"HTTP {resp.status}: {text[:300]}")
    obj = json.loads(text)
    usage, timings = obj["usage"], obj.get("timings", {})
    return Answer(obj["choices"][0]["message"]["content"], usage["completion_tokens"],
                  timings.get("num_drafted", 0), timings.get("num_accepted", 0),
                  usage.get("completion_tokens_details") or {})


@dataclass
class Batch:
    tokens: int
    seconds: float
    answers: list[Answer]

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds


async def run_batch(session, url: str, tasks: list[EditTask], mode: str, width: int,
                    max_tokens: int) -> Batch:
    answers: list[Answer] = []
    t0 = time.perf_counter()
    for i in range(0, len(tasks), width):
        answers += await asyncio.gather(*(ask(session, url, body(t, mode, max_tokens))
                                          for t in tasks[i:i + width]))
    seconds = time.perf_counter() - t0
    if mode == "plain" and any(a.drafted for a in answers):
        raise BenchError("a plain answer drafted tokens: speculative off was not honoured")
    return Batch(sum(a.tokens for a in answers), seconds, answers)


async def measure(args, url: str, tasks: list[EditTask]) -> dict[tuple[int, str], list[Batch]]:
    runs: dict[tuple[int, str], list[Batch]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=7200)) as session:
        for mode in MODES:  # warm-up
            await run_batch(session, url, tasks[:1], mode, 1, 8)
        for rnd in range(args.rounds):
            order = MODES[rnd % 3:] + MODES[:rnd % 3]
            for width in (1, args.streams):
                batch_tasks = tasks if width == 1 else [tasks[i % len(tasks)]
                                                        for i in range(width)]
                for mode in order:
                    batch = await run_batch(session, url, batch_tasks, mode, width,
                                            args.max_tokens)
                    runs.setdefault((width, mode), []).append(batch)
                    print(f"round {rnd + 1}/{args.rounds}, {width} stream(s), {mode}: "
                          f"{batch.tok_s:.1f} tok/s", flush=True)
    return runs


def _ratio(runs, width: int, mode: str, base: str) -> str:
    values = [a.tok_s / b.tok_s for a, b in zip(runs[(width, mode)], runs[(width, base)])]
    return (f"{statistics.median(values):.2f}x ({min(values):.2f}..{max(values):.2f})"
            if len(values) > 1 else f"{values[0]:.2f}x")


def tables(runs, widths: list[int]) -> list[str]:
    rows = []
    for w in widths:
        for mode in MODES:
            batches = runs[(w, mode)]
            answers = [a for b in batches for a in b.answers]
            drafted = sum(a.drafted for a in answers)
            accepted = sum(a.accepted for a in answers)
            pred = [a.details for a in answers if a.details]
            rows.append([
                str(w), mode, fmt(statistics.median(b.tok_s for b in batches)),
                "1.00x" if mode == "plain" else _ratio(runs, w, mode, "plain"),
                _ratio(runs, w, mode, "suffix") if mode == "prediction" else "",
                fmt(accepted / drafted if drafted else None, 2) if drafted else "-",
                (f"{sum(d['accepted_prediction_tokens'] for d in pred)} / "
                 f"{sum(d['rejected_prediction_tokens'] for d in pred)}") if pred else "",
            ])
    return md_table(["streams", "mode", "tok/s", "vs plain", "vs suffix", "acceptance",
                     "accepted / rejected prediction tokens"], rows)


def check_same_text(runs, widths: list[int]) -> list[str]:
    failures = []
    for w in widths:
        for r, plain in enumerate(runs[(w, "plain")]):
            for mode in MODES[1:]:
                other = runs[(w, mode)][r]
                for i, (a, b) in enumerate(zip(plain.answers, other.answers)):
                    if a.text != b.text:
                        failures.append(f"{w} stream(s), round {r + 1}, prompt {i}: {mode} "
                                        f"differs from plain")
    return failures


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="the target [default: the built-in model]")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--streams", type=int, default=8, help="the concurrent width")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=4, help="edit tasks run at 1 stream")
    ap.add_argument("--workload", default="code", help="snippets: instruction, blank line, code")
    ap.add_argument("--serve-flags", default="", help="more `specserve serve` flags")
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    if args.streams < 2 or args.rounds < 1 or args.prompts < 1 or args.max_tokens < 1:
        raise BenchError("--streams must be >= 2; --rounds, --prompts, --max-tokens >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    tasks = edit_tasks(load_workload(args.workload))[: args.prompts]
    folder = out_dir(None, "prediction")
    flags = ["--num-threads", str(args.threads), *shlex.split(args.serve_flags),
             *(["--model", args.model] if args.model else [])]
    with LaunchedServer(flags, folder / "serve.log", args.startup_timeout,
                        root=ROOT.parent) as server:  # this checkout's code
        runs = asyncio.run(measure(args, server.url, tasks))
    widths = [1, args.streams]
    write_json(folder / "runs.json", {f"{w} {m}": [b.tok_s for b in v]
                                      for (w, m), v in runs.items()})
    failures = check_same_text(runs, widths)
    info = run_info(argv, program="python benchmarks/prediction.py")
    intro = (
        f"Code edits: {len(tasks)} snippets of `{args.workload}`, each with one rename asked "
        f"(\"return the whole code and nothing else\"), the snippet before the edit as the "
        f"`prediction`. `specserve serve --num-threads {args.threads}"
        f"{' ' + args.serve_flags if args.serve_flags else ''}` (defaults otherwise), chat over "
        f"HTTP, greedy, up to {args.max_tokens} tokens. Modes: plain (`speculative: off`), "
        f"suffix (`speculative.method: suffix`, no prediction), prediction (the default "
        f"method with the prediction). Same text in all modes: "
        f"{'yes' if not failures else 'NO'}. {args.rounds} round(s), modes in rotating order; "
        f"1 stream: the tasks one after another; {args.streams} streams: {args.streams} at "
        f"once. Indicative where other work shared the machine. lscpu: {lscpu_summary()}.")
    # one section per model: a run on another file never replaces the built-in model's
    heading = HEADING if args.model is None else f"{HEADING}, {Path(args.model).name}"
    section = results_section(heading, info, intro, tables(runs, widths))
    publish(heading, section, write=not args.no_write)
    for f in failures:
        print("FAILURE:", f, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
