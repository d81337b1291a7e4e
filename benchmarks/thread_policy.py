"""Which thread policy runs the C++ kernels fastest on this machine: plain greedy decoding of
the built-in model at batch 1, in process, in process beside a thread that wakes every 2 ms (a
server's event loop), and through ``specserve serve``.

    python benchmarks/thread_policy.py [--num-threads N] [--tokens 128] [--rounds 5]
        [--policies "openmp;spin_us=-1,wait_us=-1;spin_us=200,wait_us=50"]
        [--omp default,passive,active] [--server] [--server-requests 4] [--no-in-process]
        [--no-write]

A policy (kernels/thread_policy.py) is ``openmp`` (torch's OpenMP pool: a static split and a
team barrier per region) or the kernels' own pool's ``spin_us=N,wait_us=N`` (how long an idle
worker polls before it sleeps, how long the caller polls for running chunks before it sleeps;
-1: never), optionally with ``,threads=N``: the pool's team is N while torch's own ops run on
one thread (``--num-threads 1`` for the server), so no OpenMP worker is left to spin beside the
pool's. ``--omp`` names the OpenMP settings the process starts with (they only take effect at
start): ``default`` (none), ``passive`` (OMP_WAIT_POLICY=PASSIVE), ``active``
(OMP_WAIT_POLICY=ACTIVE), or VAR=value entries joined by ``+`` (``GOMP_SPINCOUNT=10000``); they
still govern torch's own ops in the pool's runs.

Each OpenMP setting runs in a process of its own, in turn, and inside it the policies take turns
round by round; the server is started once per (setting, policy), in turn. Every number is the
median tokens/s of its runs, and every ratio is against ``openmp`` under ``default`` in the same
run (torch's pool with OpenMP's own defaults). No policy changes a result: the generated tokens
are compared too.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from benchmarks.report import (  # noqa: E402
    BenchError,
    fmt,
    md_table,
    parse_list,
    publish,
    results_section,
    run_info,
)
from specserve.kernels.thread_policy import ENV, ThreadPolicy  # noqa: E402

OMP_PRESETS = {"default": {}, "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
               "active": {"OMP_WAIT_POLICY": "ACTIVE"}}
BASELINE = ("default", "openmp")  # (OpenMP setting, policy) every ratio is against
SCENARIOS = ("in process", "event loop stand-in", "server")


def omp_env(name: str) -> dict[str, str]:
    if name in OMP_PRESETS:
        return OMP_PRESETS[name]
    env = {}
    for part in name.split("+"):
        key, sep, value = part.partition("=")
        if not sep or not key.isidentifier():
            raise BenchError(f"--omp takes default, passive, active or VAR=value entries joined "
                             f"by '+' (got {name!r})")
        env[key] = value
    return env


def parse_policies(text: str) -> list[ThreadPolicy]:
    try:
        policies = [ThreadPolicy.parse(p) for p in text.split(";") if p.strip()]
    except ValueError as exc:
        raise BenchError(f"--policies: {exc}") from None
    if not policies:
        raise BenchError("--policies names no policy")
    return policies


def prompt_text() -> str:
    return json.loads((ROOT / "prompts" / "chat.json").read_text())[0]


# ---- one OpenMP setting, in process (a child process) ------------------------------------


def child(args: argparse.Namespace) -> int:
    import torch

    from specserve.core.config import EngineConfig
    from specserve.core.sampling_params import SamplingParams
    from specserve.engine.llm_engine import LLMEngine
    from specserve.kernels import thread_policy

    policies = parse_policies(args.policies)
    torch_threads = args.num_threads or torch.get_num_threads()  # before the engine's choice
    engine = LLMEngine(EngineConfig(draft_model="none", num_threads=args.num_threads))
    ids = engine.encode(prompt_text())
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)

    def tok_s() -> tuple[float, list[int]]:
        t0 = time.perf_counter()
        out = engine.generate([ids], params)[0]
        return len(out.token_ids) / (time.perf_counter() - t0), out.token_ids

    results = {p.name: {s: [] for s in SCENARIOS[:2]} for p in policies}
    tokens: dict[str, list[int]] = {}
    for rnd in range(args.rounds + 1):
        for p in policies if rnd % 2 else policies[::-1]:
            thread_policy.apply(p)
            torch.set_num_threads(1 if p.threads else torch_threads)
            for scenario in SCENARIOS[:2]:
                if scenario == "in process":
                    rate, toks = tok_s()
                else:
                    with thread_policy.event_loop_stand_in(0.002, 50.0):
                        rate, toks = tok_s()
                tokens[p.name] = toks
                if rnd:  # round 0 warms up
                    results[p.name][scenario].append(rate)
    same = len({tuple(t) for t in tokens.values()}) == 1
    print(json.dumps({"results": results, "same_tokens": same}))
    return 0


def run_child(args: argparse.Namespace, omp: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT",
                                                             ENV)}
    env.update(omp_env(omp))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--policies", args.policies,
           "--tokens", str(args.tokens), "--rounds", str(args.rounds)]
    if args.num_threads:
        cmd += ["--num-threads", str(args.num_threads)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError(f"the in-process run under --omp {omp} failed: "
                         f"{proc.stderr.strip().splitlines()[-1:] or proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- through the server ------------------------------------------------------------------


async def server_rates(url: str, args: argparse.Namespace) -> list[float]:
    import aiohttp

    from benchmarks.client import Target, sse_request

    target = Target(url=url, endpoint="completions", api_key=None, max_tokens=args.tokens,
                    ignore_eos=True)
    rates = []
    async with aiohttp.ClientSession() as session:
        for i in range(args.server_requests + 1):
            r = await sse_request(session, target, prompt_text(), "off")
            if not r.ok:
                raise BenchError(f"server request failed: {r.error}")
            if i:  # the first warms up
                rates.append(r.output_tokens / r.e2e_s)
    return rates


def run_server(args: argparse.Namespace, omp: str, policy: ThreadPolicy) -> list[float]:
    from benchmarks.launched_server import LaunchedServer

    flags = ["--draft-model", "none"]
    if policy.threads:
        flags += ["--num-threads", "1"]
    elif args.num_threads:
        flags += ["--num-threads", str(args.num_threads)]
    saved = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", ENV)}
    for k in saved:
        os.environ.pop(k, None)
    os.environ.update(omp_env(omp))
    os.environ[ENV] = policy.name
    try:
        with tempfile.TemporaryDirectory() as tmp:
            with LaunchedServer(flags, Path(tmp) / "server.log", timeout=600) as srv:
                rates = asyncio.run(server_rates(srv.url, args))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return rates


# ---- the parent: every setting in turn, the table ------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-threads", type=int, default=None,
                    help="torch threads (the engine's --num-threads) [default: torch's choice]")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per generation")
    ap.add_argument("--rounds", type=int, default=5, help="timed rounds per policy")
    ap.add_argument("--policies", default="openmp;spin_us=-1,wait_us=-1;spin_us=50,wait_us=20;"
                    "spin_us=200,wait_us=50;spin_us=2000,wait_us=200;"
                    "spin_us=200,wait_us=50,threads=2",
                    help="';'-separated thread policies (openmp | spin_us=N,wait_us=N[,threads=N])")
    ap.add_argument("--omp", default="default,passive,active",
                    help="OpenMP settings: default | passive | active | VAR=value+VAR=value")
    ap.add_argument("--repeats", type=int, default=2,
                    help="times each OpenMP setting's process runs, in turn with the others")
    ap.add_argument("--server", action="store_true", help="also time through specserve serve")
    ap.add_argument("--server-requests", type=int, default=4, help="timed requests per server")
    ap.add_argument("--no-in-process", action="store_true",
                    help="only the server (with --server)")
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    try:
        policies = parse_policies(args.policies)
        omps = parse_list(args.omp, str, "--omp")
        for o in omps:
            omp_env(o)
        for name, value in (("--tokens", args.tokens), ("--rounds", args.rounds),
                            ("--repeats", args.repeats),
                            ("--server-requests", args.server_requests)):
            if value < 1:
                raise BenchError(f"{name} must be >= 1 (got {value})")
        if args.num_threads is not None and args.num_threads < 1:
            raise BenchError(f"--num-threads must be >= 1 (got {args.num_threads})")
        if args.no_in_process and not args.server:
            raise BenchError("--no-in-process leaves nothing to time without --server")
        if args.child:
            return child(args)
        return report(args, policies, omps)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def report(args: argparse.Namespace, policies: list[ThreadPolicy], omps: list[str]) -> int:
    rates: dict[tuple[str, str, str], list[float]] = {}  # (scenario, omp, policy) -> tok/s
    same = True
    for rep in range(args.repeats):
        for omp in [] if args.no_in_process else omps if rep % 2 == 0 else omps[::-1]:
            out = run_child(args, omp)
            same &= out["same_tokens"]
            for name, per in out["results"].items():
                for scenario, values in per.items():
                    rates.setdefault((scenario, omp, name), []).extend(values)
            print(f"in process, --omp {omp}: " + ", ".join(
                f"{n} {statistics.median(v['in process']):.1f}/"
                f"{statistics.median(v['event loop stand-in']):.1f}"
                for n, v in out["results"].items()), flush=True)
        if args.server:
            combos = [(o, p) for o in omps for p in policies]
            for omp, p in combos if rep % 2 == 0 else combos[::-1]:
                values = run_server(args, omp, p)
                rates.setdefault(("server", omp, p.name), []).extend(values)
                print(f"server, --omp {omp}, {p.name}: {statistics.median(values):.1f} tok/s",
                      flush=True)
    scenarios = [s for s in SCENARIOS if any(k[0] == s for k in rates)]
    headers = ["OpenMP setting", "policy"] + [f"{s} tok/s (ratio)" for s in scenarios]
    rows, best = [], {}
    for omp in omps:
        for p in policies:
            row = [omp, f"`{p.name}`"]
            for s in scenarios:
                v = rates.get((s, omp, p.name))
                base = rates.get((s, *BASELINE))
                if not v:
                    row.append("-")
                    continue
                med = statistics.median(v)
                ratio = f" ({med / statistics.median(base):.2f}x)" if base else ""
                row.append(f"{fmt(med)}{ratio}")
                if med > best.get(s, (0.0, ""))[0]:
                    best[s] = (med, f"`{p.name}` under {omp}")
            rows.append(row)
    info = run_info(sys.argv[1:], program="python benchmarks/thread_policy.py")
    verdict = "; ".join(f"{s}: {b[1]}" for s, b in best.items())
    heading = "## Thread policy of the C++ kernels"
    section = results_section(
        heading, info,
        f"Plain greedy decoding of the built-in model at batch 1, {args.tokens} tokens (EOS "
        f"ignored), {args.num_threads or 'default'} torch threads. Median tokens/s per cell: "
        f"in process, {args.rounds} rounds x {args.repeats} processes (the event loop "
        f"stand-in is a thread waking every 2 ms for 50 us); server, {args.server_requests} "
        f"streamed /v1/completions requests (speculation off) x {args.repeats} server starts. "
        f"Ratios against `openmp` under default OpenMP settings in the same run. Generated "
        f"tokens identical under every policy in process: "
        f"{same if not args.no_in_process else 'not compared'}. Fastest here: {verdict}.",
        md_table(headers, rows),
    )
    publish(heading, section, write=not args.no_write)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
