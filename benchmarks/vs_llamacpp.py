"""This engine's server against llama.cpp's own server, both over HTTP: the same GGUF, threads,
prompts and stop rules, interleaved prompt by prompt. Writes the "## vs llama.cpp" section of
benchmarks/RESULTS.md.

    python benchmarks/vs_llamacpp.py [--model PATH.gguf] [--draft-model PATH] [--threads 2]
        [--new-tokens 128] [--repeats 2] [--workloads chat,rewrite,code]
        [--prompts-per-workload 4] [--streams 8] [--modes off,ngram,suffix,default,draft,text_draft]
        [--spec-types ngram-mod,ngram-simple,ngram-map-k] [--llama-draft PATH.gguf] [--no-write]

Needs llama.cpp's server, built once: `make llama-server` (benchmarks/llama_server.py).

Ours: one `specserve serve --num-threads T --no-enable-prefix-caching [--draft-model PATH]`;
each request names its mode (``speculative.method``; "default" sends none, so the server's
default, ``auto``, runs, with the draft model among its candidates when one is loaded). A mode
that needs a draft model (draft: the target's tokenizer; text_draft: another one) is asked once
before the run; one the server refuses (400: no such draft loaded) is left out, and the section
says why. llama.cpp: one `llama-server -np 1` per kind: plain (no --spec-type) and each
--spec-types entry, and draft-simple when --llama-draft names a draft GGUF. llama-server drafts
only with a draft of the target's vocabulary: it is started once with that draft first, and a
refusal in its log ("draft model vocab type must match target model", which 0.3.36 logs before
serving on without speculation) is quoted in the section and draft-simple left out, so "best
llama.cpp" is the best kind it can run. Each prompt goes, in one loop, to every mode of ours and
every llama-server. The same chat-templated prompt text goes to both ``/v1/completions``
(greedy). Two stop rules: "EOS" (both stop at EOS, at most N tokens) and "fixed N" (EOS ignored
on both sides: ``ignore_eos``, and ``n_predict`` for llama-server). Neither side reuses an
earlier request's KV: our prefix cache is off, llama-server gets ``cache_prompt: false``.

What speculation learns across requests starts empty in every (repeat, stop rule) block: ours
gives each (mode, repeat, stop rule) its own API key, hence its own suffix-cache tenant (never
the answer to the same prompt from an earlier block); the llama-servers are restarted for each
block. Within a block both may learn from the workload's earlier prompts.

tok/s = generated tokens / client wall seconds (prefill and HTTP included), over a workload's
prompts; ratios are medians of per-repeat ratios (min..max). "best llama.cpp" is, per workload
and stop rule, the llama-server kind with the highest median tok/s (chosen after the run, so in
llama.cpp's favour); "best other mode of ours" likewise, against our default. Drafting, per
workload and speculative kind, from the answers' ``timings``: drafted and accepted tokens (both
servers), and on ours verify steps, tokens per verify ((accepted + steps) / steps) and the
draft's milliseconds per verify step; acceptance per draft position is not in either server's
timings (benchmarks/text_draft.py measures it in process). Streams: N concurrent fixed-N
requests, ours (off, default) against `llama-server -np N` plain. Plain is asserted: ours "off"
answers carry num_drafted 0, plain llama-server answers no draft_n. Our speculative answers must
equal our plain answers text for text (greedy); a difference fails the run (exit 1); llama.cpp's
differences are only reported.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from contextlib import ExitStack
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from benchmarks.client import Completion, complete, completion_body, one_line  # noqa: E402
from benchmarks.launched_server import LaunchedServer  # noqa: E402
from benchmarks.llama_server import (  # noqa: E402
    DRAFT_SPEC_TYPE,
    NGRAM_SPEC_TYPES,
    DraftRefused,
    LlamaCpp,
    LlamaServer,
)
from benchmarks.report import (  # noqa: E402
    BenchError,
    load_workload,
    lscpu_summary,
    out_dir,
    parse_list,
    publish,
    results_section,
    run_info,
)
from benchmarks.vs_llamacpp_tables import (  # noqa: E402
    DEFAULT,
    PLAIN,
    STOPS,
    Answer,
    Runs,
    System,
    drafting_table,
    greedy_checks,
    single_table,
    streams_table,
)

HEADING = "## vs llama.cpp"
MODEL_MODES = ("draft", "text_draft", "eagle")  # our methods that need a --draft-model kind


class Ours:
    """Our server and its API keys: one per (mode, repeat, stop rule), hence one tenant each."""

    def __init__(self, args, folder: Path) -> None:
        self.keys = {(m, r, s): f"bench-{m}-{r}-{s.replace(' ', '')}" for m in args.modes
                     for r in range(args.repeats) for s in [*STOPS, "streams"]}
        # warm-up and probes draft into tenants no measured request reads
        self.keys.update({(m, -1, "warm-up"): f"bench-{m}-warm-up" for m in args.modes})
        flags = ["--num-threads", str(args.threads), "--no-enable-prefix-caching",
                 *(["--model", args.model] if args.model else []),
                 *(["--draft-model", args.draft_model] if args.draft_model else []),
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
    return Answer(done.output_tokens, done.seconds, done.text, done.drafted, done.accepted,
                  done.verify_steps, done.draft_ms)


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
    ap.add_argument("--draft-model", default=None,
                    help="passed to our server's --draft-model (a path, or `default` for the "
                         "built-in SmolLM2-135M): another tokenizer than the target's runs as "
                         "text_draft [default: the server's own]")
    ap.add_argument("--modes", default=f"off,ngram,suffix,{DEFAULT},draft,text_draft",
                    help="our speculative methods (default: none sent, the server's own); one "
                         "needing a draft the server has not loaded is left out")
    ap.add_argument("--spec-types", default=",".join(NGRAM_SPEC_TYPES),
                    help="llama-server --spec-type values run beside its plain decoding")
    ap.add_argument("--llama-draft", default=None,
                    help="a draft .gguf for llama-server's draft-simple (left out, with "
                         "llama-server's refusal quoted, when its vocabulary differs)")
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
    refusal = (llama_draft_refusal(args, model, folder)
               if DRAFT_SPEC_TYPE in args.spec_types else None)
    spec_types = [t for t in args.spec_types if not (t == DRAFT_SPEC_TYPE and refusal)]
    reference = llama_bench(llama, model, args.threads, args.new_tokens)
    ours = Ours(args, folder)
    with ours.server:
        missing = asyncio.run(_refused_modes(ours, [m for m in args.modes if m in MODEL_MODES],
                                             next(iter(prompts.values()))[0]))
        systems = [*(System(f"ours {m}", True, m) for m in args.modes if m not in missing),
                   System(f"llama {PLAIN}", False, PLAIN),
                   *(System(f"llama {t}", False, t) for t in spec_types)]
        runs, agg = asyncio.run(_measure(args, ours, prompts, systems, model, folder))
    failures, notes = greedy_checks(runs, systems, args.workloads)
    body = [*left_out(refusal, missing, spec_types), "Single stream:", "",
            *single_table(runs, systems, args.workloads), "",
            "Drafting, per workload over both stop rules and every repeat (from the answers' "
            "timings; tokens per verify = (accepted + verify steps) / verify steps, over the "
            "steps that verified drafts). Acceptance per draft position is not in the "
            "timings (they count drafted, accepted and verify steps per request): "
            "`python benchmarks/text_draft.py` measures it in process.", "",
            *drafting_table(runs, systems, args.workloads)]
    if agg:
        body += ["", f"{args.streams} concurrent streams (fixed N):", "",
                 *streams_table(agg, args.workloads, args.streams)]
    body += ["", f"llama-bench tg{args.new_tokens} (llama.cpp without a server, same file and "
             f"threads): {reference}.", "", *notes]
    if not args.llama_draft:
        draft = "no draft-simple (no draft GGUF given)"
    else:
        draft = (f"draft-simple with `{Path(args.llama_draft).name}`"
                 f"{' refused by llama-server (below)' if refusal else ''}")
    if args.draft_model:
        draft += f"; ours with `--draft-model {Path(args.draft_model).name}`"
    # each (model, draft) its own section (a rerun on one keeps the others' in place)
    heading = HEADING if args.model is None else f"{HEADING}, {Path(model).name}"
    if args.draft_model:
        heading += f", draft {Path(args.draft_model).name}"
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


def llama_draft_refusal(args, model: str, folder: Path) -> str | None:
    """llama-server's own line refusing ``--llama-draft`` for ``model``, or None when it
    starts drafting with it (one start, before anything is timed)."""
    try:
        with LlamaServer(model, args.threads, 1, spec_type=DRAFT_SPEC_TYPE,
                         draft_model=args.llama_draft, log_path=folder / "llama-draft-probe.log"):
            return None
    except DraftRefused as exc:
        print(exc, flush=True)
        return exc.line


def left_out(refusal: str | None, missing: dict[str, str], spec_types: list[str]) -> list[str]:
    """The section's lines on what did not run, and why, in each server's own words."""
    lines = []
    if refusal:
        kinds = ", ".join([PLAIN, *spec_types])
        lines.append(f"llama-server refused this draft: \"{refusal}\"; best llama.cpp is "
                     f"the best of the kinds it can run ({kinds}).")
    lines += [f"Ours {mode} not run: the server answered {why}." for mode, why in
              missing.items()]
    return [*lines, ""] if lines else []


async def _refused_modes(ours: Ours, modes: list[str], prompt: str) -> dict[str, str]:
    """mode -> our server's refusal, for each mode that needs a draft it has not loaded (a
    one-token request gets 200 where it runs, 400 where it does not)."""
    missing = {}
    async with aiohttp.ClientSession() as session:
        for mode in modes:
            async with session.post(ours.server.url + "/v1/completions",
                                    json=ours.body(prompt, mode, 1, False),
                                    headers=ours.headers(mode, -1, "warm-up")) as resp:
                text = await resp.text()
                if resp.status != 200:
                    missing[mode] = f"HTTP {resp.status}: {_error_message(text)}"
    return missing


def _error_message(body: str) -> str:
    try:
        return one_line(str(json.loads(body)["error"]["message"]))
    except (ValueError, KeyError, TypeError):
        return one_line(body)


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
