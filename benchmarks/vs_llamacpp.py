"""This engine's server against llama.cpp's own server, both over HTTP: the same GGUF, threads,
prompts and stop rules, interleaved prompt by prompt. Writes the "## vs llama.cpp" section of
benchmarks/RESULTS.md.

    python benchmarks/vs_llamacpp.py [--model PATH.gguf] [--threads 2] [--new-tokens 128]
        [--repeats 2] [--workloads chat,rewrite,code] [--prompts-per-workload 4] [--streams 8]
        [--modes off,ngram,suffix,default,draft] [--spec-types ngram-mod,ngram-simple,ngram-map-k]
        [--llama-draft PATH.gguf] [--no-write]

Needs llama.cpp's server, built once: `make llama-server` (benchmarks/llama_server.py).

Ours: one `specserve serve --num-threads T --no-enable-prefix-caching`; each request names its
mode (``speculative.method``; "default" sends none, so the server's default, ``auto``, runs).
llama.cpp: one `llama-server -np 1` per kind: plain (no --spec-type) and each --spec-types
entry (draft-simple too when --llama-draft names a draft GGUF with the target's vocabulary; our
shipped draft has no GGUF form). Each prompt goes, in one loop, to every mode of ours and every
llama-server. The same chat-templated prompt text goes to both ``/v1/completions`` (greedy).
Two stop rules: "EOS" (both stop at EOS, at most N tokens) and "fixed N" (EOS ignored on both
sides: ``ignore_eos``, and ``n_predict`` for llama-server). Neither side reuses an earlier
request's KV: our prefix cache is off, llama-server gets ``cache_prompt: false``.

What speculation learns across requests starts empty in every (repeat, stop rule) block: ours
gives each (mode, repeat, stop rule) its own API key, hence its own suffix-cache tenant (never
the answer to the same prompt from an earlier block); the llama-servers are restarted for each
block. Within a block both may learn from the workload's earlier prompts.

tok/s = generated tokens / client wall seconds (prefill and HTTP included), over a workload's
prompts; ratios are medians of per-repeat ratios (min..max). "best llama.cpp" is, per workload
and stop rule, the llama-server kind with the highest median tok/s (chosen after the run, so
in llama.cpp's favour). Streams: N concurrent fixed-N requests, ours (off, default) against
`llama-server -np N` plain. Plain is asserted: ours "off" answers carry num_drafted 0, plain
llama-server answers no draft_n. Our speculative answers must equal our plain answers text for
text (greedy); a difference fails the run (exit 1); llama.cpp's differences are only reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from benchmarks.client import Completion, complete, completion_body  # noqa: E402
from benchmarks.launched_server import LaunchedServer  # noqa: E402
from benchmarks.llama_server import (  # noqa: E402
    DRAFT_SPEC_TYPE,
    NGRAM_SPEC_TYPES,
    LlamaCpp,
    LlamaServer,
)
from benchmarks.report import (  # noqa: E402
    BenchError,
    fmt,
    load_workload,
    lscpu_summary,
    md_table,
    out_dir,
    parse_list,
    publish,
    results_section,
    run_info,
)
from benchmarks.stats import ratio_cell  # noqa: E402

HEADING = "## vs llama.cpp"
STOPS = {"EOS": False, "fixed N": True}  # stop rule -> ignore_eos
PLAIN = "plain"  # llama-server without --spec-type
DEFAULT = "default"  # our request without a speculative field


@dataclass(frozen=True)
class System:
    """Where one kind of request goes: ours in a mode, or one llama-server."""

    name: str  # "ours off", "ours default", "llama plain", "llama ngram-mod", ...
    ours: bool
    mode: str  # our speculative method, or the llama-server kind


@dataclass
class Answer:
    tokens: int
    seconds: float
    text: str
    drafted: int
    accepted: int


# (system, workload, stop rule) -> per repeat, per prompt
Runs = dict[tuple[str, str, str], list[list[Answer]]]


def tok_s(answers: list[Answer]) -> float:
    return sum(a.tokens for a in answers) / sum(a.seconds for a in answers)


def ratio_of(num: list[float], den: list[float]) -> str:
    """num[i] / den[i] (measured side by side in repeat i) as a table cell."""
    return ratio_cell([a / b for a, b in zip(num, den)])


class Ours:
    """Our server and its API keys: one per (mode, repeat, stop rule), hence one tenant each."""

    def __init__(self, args, folder: Path) -> None:
        self.keys = {(m, r, s): f"bench-{m}-{r}-{s.replace(' ', '')}" for m in args.modes
                     for r in range(args.repeats) for s in [*STOPS, "streams"]}
        # warm-up and probes draft into tenants no measured request reads
        self.keys.update({(m, -1, "warm-up"): f"bench-{m}-warm-up" for m in args.modes})
        flags = ["--num-threads", str(args.threads), "--no-enable-prefix-caching",
                 *(["--model", args.model] if args.model else []),
                 *(f for k in self.keys.values() for f in ("--api-key", k))]
        self.server = LaunchedServer(flags, folder / "serve.log", args.startup_timeout)

    def body(self, prompt: str, mode: str, max_tokens: int, ignore_eos: bool) -> dict:
        body = completion_body(prompt, max_tokens, server="specserve", mode=mode,
                               ignore_eos=ignore_eos)
        if mode == DEFAULT:
            del body["speculative"]
        return body

    def headers(self, mode: str, rep: int, block: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[(mode, rep, block)]}"}


def llama_body(prompt: str, max_tokens: int, ignore_eos: bool) -> dict:
    return {**completion_body(prompt, max_tokens, server="llama", ignore_eos=ignore_eos),
            "cache_prompt": False}


def check(system: System, done: Completion, max_tokens: int, ignore_eos: bool) -> Answer:
    if done.output_tokens > max_tokens or (ignore_eos and done.output_tokens != max_tokens):
        raise BenchError(f"{system.name}: {done.output_tokens} tokens for max {max_tokens} "
                         f"(ignore_eos {ignore_eos})")
    if done.drafted and system.mode in ("off", PLAIN):
        raise BenchError(f"{system.name} drafted {done.drafted} tokens: not plain decoding")
    return Answer(done.output_tokens, done.seconds, done.text, done.drafted, done.accepted)


def llama_servers(stack: ExitStack, args, model: str, kinds: list[str], slots: int,
                  folder: Path, tag: str) -> dict[str, str]:
    """kind -> URL of a freshly started llama-server (stopped when ``stack`` closes)."""
    urls = {}
    for kind in kinds:
        server = LlamaServer(
            model, args.threads, slots, spec_type=None if kind == PLAIN else kind,
            draft_model=args.llama_draft if kind == DRAFT_SPEC_TYPE else None,
            log_path=folder / f"llama-{kind}-np{slots}-{tag}.log")
        urls[kind] = stack.enter_context(server).url
    return urls


async def single_stream(session, args, ours: Ours, prompts: dict[str, list[str]],
                        systems: list[System], model: str, folder: Path) -> Runs:
    runs: Runs = {}
    kinds = [s.mode for s in systems if not s.ours]
    for rep in range(args.repeats):
        for stop, ignore_eos in STOPS.items():
            with ExitStack() as stack:
                urls = llama_servers(stack, args, model, kinds, 1, folder,
                                     f"r{rep}-{stop.replace(' ', '')}")
                for wl, texts in prompts.items():
                    for i, prompt in enumerate(texts):
                        turn = rep + i  # who goes first rotates
                        for system in systems[turn % len(systems):] + systems[:turn % len(
                                systems)]:
                            if system.ours:
                                done = await complete(
                                    session, ours.server.url,
                                    ours.body(prompt, system.mode, args.new_tokens, ignore_eos),
                                    headers=ours.headers(system.mode, rep, stop))
                            else:
                                done = await complete(session, urls[system.mode], llama_body(
                                    prompt, args.new_tokens, ignore_eos))
                            per_rep = runs.setdefault((system.name, wl, stop),
                                                      [[] for _ in range(args.repeats)])
                            per_rep[rep].append(check(system, done, args.new_tokens, ignore_eos))
                    print(f"repeat {rep + 1}/{args.repeats}, {stop}: {wl} done", flush=True)
    return runs


async def streams(session, args, ours: Ours, prompts: dict[str, list[str]], model: str,
                  folder: Path) -> dict[tuple[str, str], list[float]]:
    """(system, workload) -> per repeat aggregate tok/s of N concurrent fixed-N requests."""
    out: dict[tuple[str, str], list[float]] = {}
    n, width = args.new_tokens, args.streams
    modes = [m for m in ("off", DEFAULT) if m in args.modes]
    for rep in range(args.repeats):
        with ExitStack() as stack:
            url = llama_servers(stack, args, model, [PLAIN], width, folder, f"r{rep}")[PLAIN]
            for wl, texts in prompts.items():
                wave = [texts[i % len(texts)] for i in range(width)]
                jobs = {f"ours {m}": [(ours.server.url, ours.body(p, m, n, True),
                                       ours.headers(m, rep, "streams"), m) for p in wave]
                        for m in modes}
                jobs[f"llama {PLAIN} -np {width}"] = [(url, llama_body(p, n, True), None, PLAIN)
                                                     for p in wave]
                for name, reqs in jobs.items():
                    t0 = asyncio.get_running_loop().time()
                    answers = await asyncio.gather(*(complete(session, u, b, headers=h)
                                                     for u, b, h, _ in reqs))
                    seconds = asyncio.get_running_loop().time() - t0
                    for (_, _, _, mode), a in zip(reqs, answers):
                        check(System(name, name.startswith("ours"), mode), a, n, True)
                    out.setdefault((name, wl), []).append(
                        sum(a.output_tokens for a in answers) / seconds)
        print(f"repeat {rep + 1}/{args.repeats}: {width} streams done", flush=True)
    return out


def single_table(runs: Runs, systems: list[System], workloads: list[str]) -> list[str]:
    ours = [s for s in systems if s.ours]
    llama = [s for s in systems if not s.ours]
    headers = ["workload", "stop", "ours off / llama.cpp plain",
               "ours default / llama.cpp plain", "ours default / best llama.cpp",
               "best llama.cpp", *(f"{s.name} tok/s" for s in llama),
               *(f"{s.name} tok/s" for s in ours)]
    rows = []
    for wl in workloads:
        for stop in STOPS:
            per = {s.name: [tok_s(r) for r in runs[(s.name, wl, stop)]] for s in systems}
            best = max(llama, key=lambda s: statistics.median(per[s.name])).name
            plain = per[f"llama {PLAIN}"]
            default = per.get(f"ours {DEFAULT}")
            rows.append([
                wl, stop, ratio_of(per["ours off"], plain) if "ours off" in per else "-",
                ratio_of(default, plain) if default else "-",
                ratio_of(default, per[best]) if default else "-", best,
                *(fmt(statistics.median(per[s.name])) for s in llama),
                *(fmt(statistics.median(per[s.name])) for s in ours)])
    return md_table(headers, rows)


def streams_table(agg: dict[tuple[str, str], list[float]], workloads: list[str],
                  width: int) -> list[str]:
    llama = f"llama {PLAIN} -np {width}"
    names = [n for n in ("ours off", f"ours {DEFAULT}") if (n, workloads[0]) in agg]
    headers = ["workload", *(f"{n} / {llama}" for n in names), f"{llama} tok/s",
               *(f"{n} tok/s" for n in names)]
    rows = [[wl, *(ratio_of(agg[(n, wl)], agg[(llama, wl)]) for n in names),
             fmt(statistics.median(agg[(llama, wl)])),
             *(fmt(statistics.median(agg[(n, wl)])) for n in names)] for wl in workloads]
    return md_table(headers, rows)


def greedy_checks(runs: Runs, systems: list[System], workloads: list[str]
                  ) -> tuple[list[str], list[str]]:
    """(failures, notes): every answer of ours equals our plain answer to the same prompt."""
    failures, counts, differ, total = [], [], 0, 0
    for s in systems:
        if not s.ours or s.mode == "off":
            continue
        for stop in STOPS:
            bad = sum(a.text != b.text for wl in workloads
                      for rep in runs[(s.name, wl, stop)]
                      for a, b in zip(rep, runs[("ours off", wl, stop)][0]))
            counts.append(f"{s.mode} ({stop}) {bad}")
            if bad:
                failures.append(f"{s.name} ({stop}): {bad} answer(s) differ from plain")
    for wl in workloads:
        for a, b in zip(runs[(f"llama {PLAIN}", wl, "EOS")][0], runs[("ours off", wl, "EOS")][0]):
            total += 1
            differ += a.text != b.text
    return failures, [
        f"Our answers differing from our plain answers: {', '.join(counts) or 'none run'}.",
        f"EOS-stopped answers whose text differs between llama.cpp plain and ours: "
        f"{differ}/{total} (llama.cpp rounds activations its own way)."]


def llama_bench(llama: LlamaCpp, model: str, threads: int, n: int) -> str:
    """llama-bench tg<n> (llama.cpp's decode without a server), for reference."""
    done = subprocess.run([str(llama.bench), "-m", model, "-t", str(threads), "-p", "0",
                           "-n", str(n), "-o", "json"], capture_output=True, text=True,
                          timeout=900)
    try:
        rows = json.loads(done.stdout)
        return f"{rows[0]['avg_ts']:.1f} tok/s (+- {rows[0]['stddev_ts']:.1f})"
    except (ValueError, KeyError, IndexError):
        return f"not measured (exit {done.returncode})"


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file [default: the built-in model]")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workloads", default="chat,rewrite,code")
    ap.add_argument("--prompts-per-workload", type=int, default=4)
    ap.add_argument("--streams", type=int, default=8, help="concurrent width; 0 skips it")
    ap.add_argument("--modes", default=f"off,ngram,suffix,{DEFAULT},draft",
                    help="our speculative methods (default: none sent, the server's own)")
    ap.add_argument("--spec-types", default=",".join(NGRAM_SPEC_TYPES),
                    help="llama-server --spec-type values run beside its plain decoding")
    ap.add_argument("--llama-draft", default=None,
                    help="a draft .gguf with the target's vocabulary: adds draft-simple")
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    args.workloads = parse_list(args.workloads, str, "--workloads")
    args.modes = parse_list(args.modes, str, "--modes")
    args.spec_types = parse_list(args.spec_types, str, "--spec-types")
    if "off" not in args.modes:
        raise BenchError("--modes must include off (the plain baseline)")
    if args.llama_draft:
        args.spec_types.append(DRAFT_SPEC_TYPE)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    llama = LlamaCpp.at()
    if not llama.ready():
        raise BenchError("llama-server is not built: run `make llama-server`")
    from specserve.engine.models import default_model_path, load_tokenizer
    from specserve.engine.tokenizer import apply_chat_template

    model = args.model or default_model_path()
    if not model.endswith(".gguf"):
        raise BenchError(f"llama-server needs a .gguf model (got {model})")
    tok = load_tokenizer(model)
    prompts = {wl: [apply_chat_template(tok, [{"role": "user", "content": t}])
                    for t in load_workload(wl)[: args.prompts_per_workload]]
               for wl in args.workloads}
    folder = out_dir(None, "vs_llamacpp")
    systems = [*(System(f"ours {m}", True, m) for m in args.modes),
               System(f"llama {PLAIN}", False, PLAIN),
               *(System(f"llama {t}", False, t) for t in args.spec_types)]
    reference = llama_bench(llama, model, args.threads, args.new_tokens)
    ours = Ours(args, folder)
    with ours.server:
        if "draft" in args.modes and not _has_draft(ours, prompts):
            systems = [s for s in systems if s.mode != "draft"]
        runs, agg = asyncio.run(_measure(args, ours, prompts, systems, model, folder))
    failures, notes = greedy_checks(runs, systems, args.workloads)
    body = ["Single stream:", "", *single_table(runs, systems, args.workloads)]
    if agg:
        body += ["", f"{args.streams} concurrent streams (fixed N):", "",
                 *streams_table(agg, args.workloads, args.streams)]
    body += ["", f"llama-bench tg{args.new_tokens} (llama.cpp without a server, same file and "
             f"threads): {reference}.", "", *notes]
    draft = ("draft-simple with `" + Path(args.llama_draft).name + "`" if args.llama_draft else
             "no draft-simple (no same-vocabulary draft GGUF given)")
    # each model its own section (a rerun on one model keeps the other's in place)
    heading = HEADING if args.model is None else f"{HEADING}, {Path(model).name}"
    section = results_section(
        heading, run_info(argv, program="python benchmarks/vs_llamacpp.py"),
        f"Model `{Path(model).name}` on both sides, {args.threads} threads each, greedy, the "
        f"same chat-templated prompt text to both servers' /v1/completions, at most "
        f"{args.new_tokens} new tokens, {args.prompts_per_workload} prompts per workload, "
        f"{args.repeats} repeats, interleaved prompt by prompt; llama.cpp's server from the "
        f"llama-cpp-python {llama.version} sdist's vendored tree; {draft}. No KV reuse across "
        "requests (our prefix cache off, llama-server cache_prompt false); speculation state "
        "fresh per (repeat, stop rule): an API-key tenant per mode and block on ours, "
        "restarted llama-servers. See the script's docstring. Indicative where other work "
        f"shared the machine. lscpu: {lscpu_summary()}.", body)
    publish(heading, section, write=not args.no_write)
    for f in failures:
        print("FAILURE:", f, file=sys.stderr)
    return 1 if failures else 0


def _has_draft(ours: Ours, prompts: dict[str, list[str]]) -> bool:
    """Whether our server runs a draft model (a draft request gets 200, else 400)."""

    async def probe() -> bool:
        body = ours.body(next(iter(prompts.values()))[0], "draft", 1, False)
        async with aiohttp.ClientSession() as session, session.post(
                ours.server.url + "/v1/completions", json=body,
                headers=ours.headers("draft", -1, "warm-up")) as resp:
            await resp.read()
            return resp.status == 200

    return asyncio.run(probe())


async def _measure(args, ours: Ours, prompts, systems, model, folder):
    timeout = aiohttp.ClientTimeout(total=3600)
    # A fresh connection per request: the llama-servers restart between blocks, and a kept-alive
    # connection to the one before failed a run with "Server disconnected".
    connector = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        first = next(iter(prompts.values()))[0]
        for s in systems:  # warm-up of ours (first requests of each mode)
            if s.ours:
                await complete(session, ours.server.url, ours.body(first, s.mode, 8, True),
                               headers=ours.headers(s.mode, -1, "warm-up"))
        runs = await single_stream(session, args, ours, prompts, systems, model, folder)
        agg = (await streams(session, args, ours, prompts, model, folder)
               if args.streams > 1 else {})
    return runs, agg


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        sys.exit(130)
