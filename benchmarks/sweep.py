"""Online load sweep against a live server, through the real streaming API.

The server is started here (``specserve serve`` on a free port, with the engine flags given,
ready once /health says 200) or named with ``--url``. One server serves every mode: each request
carries ``speculative: {"method": MODE}``. For each concurrency level (closed loop: N workers,
each sending its next request when the previous one ends) and each Poisson arrival rate (open
loop), the modes run one after the other in a rotating order; one more level runs through the
WebSocket endpoint.

Per request, client-side: TTFT (send -> first streamed text), ITL (gaps between streamed
chunks; with speculation one chunk may carry several tokens), TPOT ((end - TTFT) / (tokens - 1)),
end-to-end latency. Token counts come from the server's usage (``stream_options.include_usage``)
and are checked against the stream: never fewer tokens than text chunks, exactly the streamed
token ids over the WebSocket, exactly max_tokens when EOS is ignored. Any HTTP error, error
event, missing usage or count mismatch is an error; errors make the exit code 1.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import numpy as np
from tqdm import tqdm

from benchmarks import plots
from benchmarks.client import RequestResult, Target, WsClient, has_draft, one_line, sse_request
from benchmarks.launched_server import LaunchedServer, health_ok
from benchmarks.report import (
    BenchError,
    RunInfo,
    add_output_args,
    fmt,
    load_workload,
    md_table,
    out_dir,
    parse_list,
    run_info,
    write_json,
    write_results_section,
)
from benchmarks.stats import Distribution, distribution

HEADING = "## Online load sweep"
MODES = ("off", "ngram", "draft")


# ---- results ------------------------------------------------------------------------------


@dataclass
class LevelResult:
    transport: str  # sse | ws
    mode: str
    concurrency: int | None  # closed loop
    rate: float | None  # open loop, requests/s
    requests: int
    errors: int
    error_samples: list[str]
    duration_s: float
    output_tok_s: float
    req_s: float
    goodput_req_s: float  # requests/s that met both SLOs
    slo_attainment: float  # fraction of requests that met both SLOs
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2e_ms: Distribution
    acceptance: float | None
    mean_accepted_length: float | None
    results: list[RequestResult] = field(repr=False)

    @property
    def load(self) -> str:
        return f"c={self.concurrency}" if self.concurrency is not None else f"{self.rate:g} req/s"


@dataclass
class SweepConfig:
    url: str
    launched: bool
    server_command: list[str] | None
    endpoint: str
    workloads: list[str]
    max_tokens: int
    ignore_eos: bool
    modes: list[str]
    concurrency: list[int]
    rates: list[float]
    num_requests: int | None
    warmup: int
    ws_concurrency: int
    slo_ttft_ms: float
    slo_tpot_ms: float
    seed: int


@dataclass
class SweepReport:
    info: RunInfo
    config: SweepConfig
    levels: list[LevelResult]
    total_requests: int
    total_errors: int

    @property
    def exit_code(self) -> int:
        return 1 if self.total_errors else 0


def level_result(transport: str, mode: str, concurrency: int | None, rate: float | None,
                 results: list[RequestResult], duration: float, slo_ttft_ms: float,
                 slo_tpot_ms: float) -> LevelResult:
    ok = [r for r in results if r.ok]
    good = [r for r in ok if (r.ttft_s or 0.0) * 1e3 <= slo_ttft_ms
            and (r.tpot_s is None or r.tpot_s * 1e3 <= slo_tpot_ms)]
    drafted = sum(r.drafted for r in ok)
    steps = sum(r.verify_steps for r in ok)
    accepted = sum(r.accepted for r in ok)
    dur = max(duration, 1e-9)
    return LevelResult(
        transport=transport, mode=mode, concurrency=concurrency, rate=rate,
        requests=len(results), errors=len(results) - len(ok),
        error_samples=list(dict.fromkeys(r.error for r in results if r.error))[:5],
        duration_s=duration, output_tok_s=sum(r.output_tokens for r in ok) / dur,
        req_s=len(ok) / dur, goodput_req_s=len(good) / dur,
        slo_attainment=len(good) / len(results) if results else 0.0,
        ttft_ms=distribution([r.ttft_s * 1e3 for r in ok if r.ttft_s is not None]),
        tpot_ms=distribution([r.tpot_s * 1e3 for r in ok if r.tpot_s is not None]),
        itl_ms=distribution([x * 1e3 for r in ok for x in r.itl_s]),
        e2e_ms=distribution([r.e2e_s * 1e3 for r in ok]),
        acceptance=accepted / drafted if drafted else None,
        mean_accepted_length=(accepted + steps) / steps if steps else None,
        results=results,
    )


# ---- load generation ----------------------------------------------------------------------

Send = Callable[[str, float], Awaitable[RequestResult]]


async def closed_loop(send: Send, prompts: list[str], n: int, concurrency: int,
                      bar: tqdm) -> tuple[list[RequestResult], float]:
    """``concurrency`` workers; each sends its next request when its previous one ends."""
    results: list[RequestResult] = []
    next_index = iter(range(n))
    t0 = time.perf_counter()

    async def worker() -> None:
        for i in next_index:
            results.append(await send(prompts[i % len(prompts)], time.perf_counter() - t0))
            bar.update()

    await asyncio.gather(*(worker() for _ in range(min(concurrency, n))))
    return results, time.perf_counter() - t0


async def open_loop(send: Send, prompts: list[str], n: int, rate: float, seed: int,
                    bar: tqdm) -> tuple[list[RequestResult], float]:
    """Poisson arrivals at ``rate`` requests/s (exponential gaps from a seeded generator),
    whatever is still in flight."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    arrivals = np.cumsum(gaps) - gaps[0]
    t0 = time.perf_counter()

    async def one(i: int) -> RequestResult:
        await asyncio.sleep(max(0.0, t0 + float(arrivals[i]) - time.perf_counter()))
        result = await send(prompts[i % len(prompts)], time.perf_counter() - t0)
        bar.update()
        return result

    results = await asyncio.gather(*(one(i) for i in range(n)))
    return list(results), time.perf_counter() - t0


def server_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags that differ from the engine's defaults, as `specserve serve` flags."""
    import msgspec

    from specserve.cli import engine_config_from_args
    from specserve.core.config import EngineConfig

    chosen = msgspec.structs.asdict(engine_config_from_args(args))
    defaults = msgspec.structs.asdict(EngineConfig())
    flags: list[str] = []
    for name, value in chosen.items():
        if value == defaults[name]:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        else:
            flags += [flag, str(value)]
    return flags + shlex.split(args.server_args)


# ---- the run ------------------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from specserve.cli import add_engine_args

    ap.add_argument("--url", default=None,
                    help="a running server (e.g. http://127.0.0.1:8000); default: start "
                         "`specserve serve` with the engine flags below on a free port")
    ap.add_argument("--api-key", default=None, help="bearer key for --url servers")
    ap.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                    help="chat: /v1/chat/completions, completions: /v1/completions "
                         "[default: %(default)s]")
    ap.add_argument("--workloads", default="chat",
                    help="prompt files under benchmarks/prompts, comma-separated "
                         "[default: %(default)s]")
    ap.add_argument("--max-tokens", type=int, default=64,
                    help="max_tokens per request [default: %(default)s]")
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                    help="fixed-length outputs, so every level does the same work "
                         "[default: %(default)s]")
    ap.add_argument("--modes", default="auto",
                    help="speculative methods to compare, comma-separated (off, ngram, draft); "
                         "auto: off,ngram, and draft when the server has a draft model "
                         "[default: %(default)s]")
    ap.add_argument("--concurrency", default="1,4,16,64",
                    help="closed-loop concurrency levels; '' for none [default: %(default)s]")
    ap.add_argument("--rates", default="",
                    help="Poisson arrival rates in requests/s, e.g. 0.5,1,2 [default: none]")
    ap.add_argument("--num-requests", type=int, default=None,
                    help="requests per level and mode [default: max(8, 2 x concurrency); "
                         "16 per rate]")
    ap.add_argument("--warmup", type=int, default=2,
                    help="unmeasured requests per mode before the sweep [default: %(default)s]")
    ap.add_argument("--ws-concurrency", type=int, default=4,
                    help="concurrency of the WebSocket level; 0 skips it [default: %(default)s]")
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0,
                    help="goodput SLO on time to first token [default: %(default)s]")
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0,
                    help="goodput SLO on time per output token [default: %(default)s]")
    ap.add_argument("--arrival-seed", type=int, default=0,
                    help="seed of the Poisson arrival times [default: %(default)s]")
    ap.add_argument("--request-timeout", type=float, default=600.0,
                    help="seconds before a request counts as an error [default: %(default)s]")
    ap.add_argument("--startup-timeout", type=float, default=600.0,
                    help="seconds to wait for a started server's /health [default: %(default)s]")
    ap.add_argument("--server-args", default="",
                    help="extra `specserve serve` flags for the started server, one string "
                         "(e.g. '--max-queue-len 512')")
    add_output_args(ap)
    add_engine_args(ap)
    ap.set_defaults(dtype="float32")


def run(args: argparse.Namespace, argv: list[str]) -> int:
    folder = out_dir(args.out, "sweep")
    prompts = [p for wl in parse_list(args.workloads, str, "--workloads")
               for p in load_workload(wl)]
    if args.max_tokens < 1:
        raise BenchError("--max-tokens must be >= 1")
    modes = [] if args.modes == "auto" else parse_list(args.modes, str, "--modes")
    for m in modes:
        if m not in MODES:
            raise BenchError(f"unknown mode {m!r}; modes: {', '.join(MODES)}")
    concurrency = parse_list(args.concurrency, int, "--concurrency")
    rates = parse_list(args.rates, float, "--rates")
    if any(c < 1 for c in concurrency) or any(r <= 0 for r in rates):
        raise BenchError("concurrency levels must be >= 1 and rates > 0")
    if not (concurrency or rates or args.ws_concurrency):
        raise BenchError("nothing to run: give --concurrency, --rates or --ws-concurrency")
    config = SweepConfig(
        url=args.url or "", launched=args.url is None, server_command=None,
        endpoint=args.endpoint, workloads=parse_list(args.workloads, str, "--workloads"),
        max_tokens=args.max_tokens, ignore_eos=args.ignore_eos, modes=modes,
        concurrency=concurrency, rates=rates, num_requests=args.num_requests,
        warmup=args.warmup, ws_concurrency=args.ws_concurrency, slo_ttft_ms=args.slo_ttft_ms,
        slo_tpot_ms=args.slo_tpot_ms, seed=args.arrival_seed,
    )
    if args.url:
        if not health_ok(args.url.rstrip("/")):
            raise BenchError(f"{args.url}/health does not answer 200: is the server up?")
        config.url = args.url.rstrip("/")
        levels = asyncio.run(sweep(config, prompts, args.api_key, args.request_timeout))
    else:
        with LaunchedServer(server_flags(args), folder / "server.log",
                            args.startup_timeout) as server:
            config.url, config.server_command = server.url, server.command
            levels = asyncio.run(sweep(config, prompts, None, args.request_timeout))
    report = SweepReport(run_info(argv), config, levels, sum(lv.requests for lv in levels),
                         sum(lv.errors for lv in levels))
    write_json(folder / "sweep.json", report)
    if not args.no_plots:
        plot(report, folder)
    body = tables(report)
    print("\n".join(body))
    if args.write_results:
        write_results_section(HEADING, report.info, intro(report), body)
    print(f"results: {folder / 'sweep.json'}")
    return report.exit_code


async def sweep(config: SweepConfig, prompts: list[str], api_key: str | None,
                timeout: float) -> list[LevelResult]:
    target = Target(config.url, config.endpoint, api_key, config.max_tokens, config.ignore_eos)
    conn = aiohttp.TCPConnector(limit=0)  # no client-side cap on concurrent connections
    levels: list[LevelResult] = []
    async with aiohttp.ClientSession(
        connector=conn, timeout=aiohttp.ClientTimeout(total=timeout)
    ) as session:
        if not config.modes:  # auto
            config.modes = ["off", "ngram"] + (["draft"] if await has_draft(session, target)
                                               else [])
        for m in config.modes:  # warm-up: not measured
            for i in range(config.warmup):
                await sse_request(session, target, prompts[i % len(prompts)], m)
        plan: list[tuple[str, int | None, float | None]] = [
            *(("sse", c, None) for c in config.concurrency),
            *(("sse", None, r) for r in config.rates),
            *((("ws", config.ws_concurrency, None),) if config.ws_concurrency else ()),
        ]
        for li, (transport, c, rate) in enumerate(plan):
            rot = li % len(config.modes)
            for mode in config.modes[rot:] + config.modes[:rot]:
                levels.append(await _level(session, target, transport, mode, c, rate,
                                           prompts, config))
    levels.sort(key=lambda lv: (lv.transport == "ws", lv.rate is not None,
                                lv.concurrency or lv.rate or 0, config.modes.index(lv.mode)))
    return levels


async def _level(session: aiohttp.ClientSession, target: Target, transport: str, mode: str,
                 c: int | None, rate: float | None, prompts: list[str],
                 config: SweepConfig) -> LevelResult:
    n = config.num_requests or (max(8, 2 * c) if c else 16)
    load = f"c={c}" if c is not None else f"{rate:g}/s"
    ws_client = None
    if transport == "ws":
        try:
            ws = await session.ws_connect(target.url + "/ws", headers=target.headers())
        except aiohttp.ClientError as exc:
            raise BenchError(f"cannot open {target.url}/ws: {one_line(str(exc))}") from exc
        ws_client = WsClient(ws, target)

    async def send(prompt: str, start_s: float) -> RequestResult:
        if ws_client is not None:
            return await ws_client.request(prompt, mode, start_s)
        return await sse_request(session, target, prompt, mode, start_s)

    with tqdm(total=n, desc=f"{transport} {mode} {load}", unit="req", leave=False) as bar:
        try:
            if c is not None:
                results, duration = await closed_loop(send, prompts, n, c, bar)
            else:
                assert rate is not None
                results, duration = await open_loop(send, prompts, n, rate, config.seed, bar)
        finally:
            if ws_client is not None:
                await ws_client.close()
    lv = level_result(transport, mode, c, rate, results, duration, config.slo_ttft_ms,
                      config.slo_tpot_ms)
    tqdm.write(f"{transport} {mode:5s} {load:>8s}: {lv.output_tok_s:7.1f} tok/s, TTFT p50 "
               f"{lv.ttft_ms.p50:.0f} ms, TPOT p50 {lv.tpot_ms.p50:.1f} ms, errors {lv.errors}")
    return lv


# ---- presentation -------------------------------------------------------------------------


def _pcts(d: Distribution) -> str:
    return "-" if not d.n else f"{d.p50:.0f} / {d.p95:.0f} / {d.p99:.0f}"


def tables(report: SweepReport) -> list[str]:
    rows = []
    for lv in report.levels:
        rows.append([
            lv.transport, lv.mode, lv.load, str(lv.requests), str(lv.errors),
            f"{lv.output_tok_s:.1f}", f"{lv.req_s:.2f}", f"{lv.goodput_req_s:.2f}",
            _pcts(lv.ttft_ms), _pcts(lv.tpot_ms), _pcts(lv.itl_ms), _pcts(lv.e2e_ms),
            fmt(lv.acceptance, 2), fmt(lv.mean_accepted_length, 2),
        ])
    headers = ["transport", "mode", "load", "requests", "errors", "output tok/s", "req/s",
               "goodput req/s", "TTFT ms p50/95/99", "TPOT ms p50/95/99", "ITL ms p50/95/99",
               "E2E ms p50/95/99", "acceptance", "tokens/verify"]
    return [*md_table(headers, rows), "",
            f"Errors: {report.total_errors} of {report.total_requests} requests."
            + (" First: " + "; ".join(e for lv in report.levels for e in lv.error_samples)[:300]
               if report.total_errors else "")]


def intro(report: SweepReport) -> str:
    c = report.config
    server = (f"started by the tool: `{shlex.join(['specserve', *c.server_command[3:]])}`"
              if c.server_command else f"at {c.url}")
    return (f"Server {server}. Streaming {c.endpoint} requests, prompts from "
            f"{', '.join(c.workloads)}, max_tokens {c.max_tokens}"
            f"{' (EOS ignored)' if c.ignore_eos else ''}, greedy; modes {', '.join(c.modes)} "
            f"through the per-request `speculative` field; {c.warmup} warm-up request(s) per "
            f"mode. Goodput SLO: TTFT <= {c.slo_ttft_ms:g} ms and TPOT <= {c.slo_tpot_ms:g} ms. "
            f"ITL is per streamed chunk (a speculative chunk may carry several tokens).")


def plot(report: SweepReport, folder: Path) -> None:
    modes = report.config.modes
    closed = [lv for lv in report.levels if lv.transport == "sse" and lv.concurrency]
    cs = sorted({lv.concurrency for lv in closed if lv.concurrency})
    by = {(lv.mode, lv.concurrency): lv for lv in closed}

    def series(metric: Callable[[LevelResult], float]) -> dict[str, list[float]]:
        return {m: [metric(by[(m, c)]) if (m, c) in by else float("nan") for c in cs]
                for m in modes}

    if cs:
        plots.lines(folder / "sweep_throughput.png", [float(c) for c in cs], [
            ("output tokens/s", series(lambda lv: lv.output_tok_s)),
            ("goodput requests/s", series(lambda lv: lv.goodput_req_s)),
            ("TPOT p50 ms", series(lambda lv: lv.tpot_ms.p50)),
        ], "concurrent requests", "Speculative vs plain under load")
        grid = []
        for metric, pick in (("TTFT ms", lambda r: [r.ttft_s * 1e3] if r.ttft_s else []),
                             ("TPOT ms", lambda r: [r.tpot_s * 1e3] if r.tpot_s else []),
                             ("E2E ms", lambda r: [r.e2e_s * 1e3])):
            grid.append([(f"{metric}, concurrency {c}",
                          {m: [x for r in by[(m, c)].results if r.ok for x in pick(r)]
                           for m in modes if (m, c) in by}) for c in cs])
        plots.cdfs(folder / "sweep_latency_cdf.png", grid, ["TTFT ms", "TPOT ms", "E2E ms"],
                   "Latency CDFs per concurrency level")
    opened = [lv for lv in report.levels if lv.rate is not None]
    if opened:
        rs = sorted({lv.rate for lv in opened if lv.rate is not None})
        by_rate = {(lv.mode, lv.rate): lv for lv in opened}
        plots.lines(folder / "sweep_rates.png", rs, [
            (label, {m: [f(by_rate[(m, r)]) if (m, r) in by_rate else float("nan") for r in rs]
                     for m in modes})
            for label, f in (("output tokens/s", lambda lv: lv.output_tok_s),
                             ("TTFT p50 ms", lambda lv: lv.ttft_ms.p50),
                             ("TPOT p50 ms", lambda lv: lv.tpot_ms.p50))
        ], "arrival rate (requests/s)", "Speculative vs plain, Poisson arrivals", log_x=False)
