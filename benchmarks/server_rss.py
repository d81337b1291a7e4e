"""Server memory after many requests: ``specserve serve --model FILE`` with its defaults, a mix
of requests, and the server's RSS against a bound of the file's size plus its KV pool.

    python tools/checkout.py . benchmarks/server_rss.py [--models default,qwen]
        [--requests 100] [--concurrency 4] [--max-tokens 64] [--headroom-mb 300]
        [--out DIR] [--no-write]

Per file, one server (this checkout's code, benchmarks/launched_server.py) gets ``--requests``
requests, ``--concurrency`` at a time, in a fixed cycle over: chat and code prompts
(benchmarks/prompts/), the chat and completions endpoints, streamed (SSE) and not, the server's
default speculation and ``speculative: off``; ``max_tokens`` 64, greedy. The server's VmRSS
(/proc) is read when it is ready and after 10, 50 and all requests, the queue drained each time.

The bound: the GGUF's size on disk + the KV pool + ``--headroom-mb`` (300 MB, 10^6 bytes). The
KV pool's bytes are its blocks times the bytes of one block (target and draft K and V, every
layer): nothing the server reports gives the block bytes (``/health`` gives the block count),
so this script resolves the server's configuration the way the engine does
(``ModelFiles.open`` and ``resolve_config`` on the flags ``serve --model FILE`` parses to) and
checks its block count against the running server's ``/health``; run it through
tools/checkout.py so the resolving code is this checkout's, as the server's is. The draft model
a default server loads is inside the headroom, not the bound.

Exit status 0: every file's final RSS is within its bound, no request failed, and the KV pool is
all free at the end (``/health``); 1 otherwise; 2 a bad flag or a server that does not start.
``qwen`` (benchmarks/fetch_qwen.py's file) is skipped with a message where it is missing.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.client import sse_request  # noqa: E402
from benchmarks.compare_commits import Prompt, _Target, answer, mode_name  # noqa: E402
from benchmarks.launched_server import LaunchedServer  # noqa: E402
from benchmarks.report import (  # noqa: E402
    BenchError,
    load_workload,
    md_table,
    out_dir,
    publish,
    results_section,
    run_info,
    stage_log,
    write_json,
)
from benchmarks.scale_check import Model, models_to_measure  # noqa: E402
from benchmarks.soak import health  # noqa: E402

HEADING = "## Server RSS after 100 requests, per GGUF file"
MB = 10**6


@dataclass(frozen=True)
class Request:
    prompt: Prompt
    stream: bool
    mode: str | None  # None: the server's default speculation


@dataclass(frozen=True)
class Bound:
    gguf_bytes: int
    kv_blocks: int
    kv_block_bytes: int
    headroom_bytes: int

    @property
    def kv_bytes(self) -> int:
        return self.kv_blocks * self.kv_block_bytes

    @property
    def total_bytes(self) -> int:
        return self.gguf_bytes + self.kv_bytes + self.headroom_bytes

    def met(self, rss_bytes: float) -> bool:
        return rss_bytes <= self.total_bytes


@dataclass
class FileResult:
    model: Model
    bound: Bound
    rss_mb: dict[str, float] = field(default_factory=dict)  # "ready", "after 10", ...
    errors: list[str] = field(default_factory=list)
    kv_blocks_used_end: int = 0
    engine: str = ""
    anon_file_mb_end: tuple[float, float] = (0.0, 0.0)  # RssAnon, RssFile at the end
    kv_resident_mb_end: float | None = None  # the pool's resident pages at the end (smaps)
    draft: tuple[str, float] | None = None  # the default draft's name and MB on disk

    @property
    def final_rss_bytes(self) -> float:
        return list(self.rss_mb.values())[-1] * MB

    @property
    def ok(self) -> bool:
        return (self.bound.met(self.final_rss_bytes) and not self.errors
                and self.kv_blocks_used_end == 0)


def request_plan(n: int, chat: list[str], code: list[str]) -> list[Request]:
    """n requests cycling through every combination of workload, endpoint, streaming and
    speculation (16 kinds), each workload's prompts in turn."""
    out = []
    for i in range(n):
        kind = i % 16
        pool, workload = (chat, "chat") if kind & 1 == 0 else (code, "code")
        endpoint = "chat" if kind & 2 == 0 else "completions"
        text = pool[(i // 2) % len(pool)]
        out.append(Request(Prompt(endpoint, workload, text), stream=kind & 4 == 0,
                           mode=None if kind & 8 == 0 else "off"))
    return out


def checkpoints(n: int) -> list[int]:
    """Request counts after which RSS is read: 10, 50 and n (those below n)."""
    return sorted({c for c in (10, 50) if c < n} | {n})


def memory_mb(pid: int) -> dict[str, float]:
    """VmRSS and its anonymous and file-backed parts (the mapped GGUF is file-backed, the KV
    pool anonymous) of process ``pid``, in MB."""
    keys = ("VmRSS", "RssAnon", "RssFile")
    got = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in keys:
            got[key] = int(value.split()[0]) * 1024 / MB  # kB
    if "VmRSS" not in got:
        raise BenchError(f"/proc/{pid}/status has no VmRSS: the server is gone")
    return got


@dataclass(frozen=True)
class Served:
    """What ``specserve serve --model FILE`` resolves to, as far as the bound needs it."""

    kv_blocks: int
    kv_block_bytes: int  # target + draft, every layer, K and V
    draft_path: str | None
    summary: str


def kv_resident_mb(pid: int, kv_bytes: int) -> float | None:
    """Resident MB of the mapping that holds the KV pool: the one anonymous mapping of the pool's
    size (plus at most 4 MiB of allocator header and alignment) in /proc/PID/smaps. The pool's
    pages are committed as blocks are written (target/model_runner.py::zeroed_pool), so this
    is what requests have used of it; None where no mapping matches (then nothing is split)."""
    size = rss = None
    found: list[float] = []
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        key, _, value = line.partition(":")
        if key == "Size":
            size = int(value.split()[0]) * 1024
        elif key == "Rss" and size is not None:
            rss = int(value.split()[0]) * 1024
            if kv_bytes <= size <= kv_bytes + (4 << 20):
                found.append(rss / MB)
            size = None
    return found[0] if len(found) == 1 else None


def served_config(model: Path) -> Served:
    """``specserve serve --model FILE``'s engine configuration, resolved as the engine
    resolves it (the same parser, ``ModelFiles.open`` and ``resolve_config``)."""
    from specserve.cli import build_parser, engine_config_from_args
    from specserve.engine.resolve import ModelFiles, resolve_config

    asked = engine_config_from_args(build_parser().parse_args(["serve", "--model", str(model)]))
    config = resolve_config(asked, ModelFiles.open(asked))
    return Served(config.num_kv_blocks, config.kv_bytes_per_block, config.draft_model,
                  config.summary())


def disk_bytes(path: str | None) -> int:
    """Bytes of a file, or of every file under a folder; 0 for None."""
    if path is None:
        return 0
    p = Path(path)
    return p.stat().st_size if p.is_file() else sum(
        f.stat().st_size for f in p.rglob("*") if f.is_file())


async def one(session: aiohttp.ClientSession, url: str, req: Request,
              max_tokens: int) -> str | None:
    """Sends one request; its error, or None."""
    if req.stream:
        target = _Target(url, req.prompt.endpoint, None, max_tokens, ignore_eos=False)
        result = await sse_request(session, target, req.prompt.text, req.mode)
        return None if result.ok else result.error or "failed"
    got = await answer(session, url, req.prompt, req.mode, max_tokens)
    return got.error


async def send_all(session: aiohttp.ClientSession, url: str, todo: list[tuple[int, Request]],
                   args: argparse.Namespace, errors: list[str]) -> None:
    """The requests ``todo``, ``--concurrency`` at a time; failures appended to ``errors``."""
    async def worker() -> None:
        while todo:
            i, req = todo.pop(0)
            err = await one(session, url, req, args.max_tokens)
            if err is not None:
                errors.append(f"request {i} ({req.prompt.endpoint}, {req.prompt.workload}, "
                              f"stream {req.stream}, {mode_name(req.mode)}): {err}")

    await asyncio.gather(*(worker() for _ in range(args.concurrency)))


async def drive(url: str, pid: int, plan: list[Request], args: argparse.Namespace,
                res: FileResult, log) -> None:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        res.rss_mb["ready"] = memory_mb(pid)["VmRSS"]
        done = 0
        for stop in checkpoints(len(plan)):
            await send_all(session, url, list(enumerate(plan[done:stop], start=done)), args,
                           res.errors)
            h = await drained(session, url)
            done = stop
            mem = memory_mb(pid)
            res.rss_mb[f"after {stop}"] = mem["VmRSS"]
            res.anon_file_mb_end = (mem.get("RssAnon", float("nan")),
                                    mem.get("RssFile", float("nan")))
            res.kv_blocks_used_end = h["kv_blocks_total"] - h["kv_blocks_free"]
            res.kv_resident_mb_end = kv_resident_mb(pid, res.bound.kv_bytes)
            log(f"{res.model.name}: {stop} requests, RSS {res.rss_mb[f'after {stop}']:.0f} MB, "
                f"{len(res.errors)} failed, KV blocks in use {res.kv_blocks_used_end}")


async def drained(session: aiohttp.ClientSession, url: str, wait_s: float = 60.0) -> dict:
    """/health once nothing is in flight (or after ``wait_s``)."""
    deadline = time.monotonic() + wait_s
    while (h := await health(session, url))["num_in_flight"] and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return h


def measure_file(model: Model, args: argparse.Namespace, out: Path, log) -> FileResult:
    served = served_config(model.path)
    blocks = served.kv_blocks
    bound = Bound(model.path.stat().st_size, blocks, served.kv_block_bytes,
                  args.headroom_mb * MB)
    res = FileResult(model, bound, engine=served.summary,
                     draft=(Path(served.draft_path).name, disk_bytes(served.draft_path) / MB)
                     if served.draft_path else None)
    plan = request_plan(args.requests, load_workload("chat"), load_workload("code"))
    log_path = out / f"server-{model.path.stem}.log"
    with LaunchedServer(["--model", str(model.path)], log_path, args.startup_timeout,
                        root=REPO, stop_timeout=60) as server:
        h = asyncio.run(_health(server.url))
        if h["kv_blocks_total"] != blocks:
            raise BenchError(f"the server's KV pool has {h['kv_blocks_total']} blocks, the one "
                             f"resolved here {blocks}: run this script through "
                             "`python tools/checkout.py . benchmarks/server_rss.py` so both "
                             "resolve with this checkout's code")
        asyncio.run(drive(server.url, server.proc.pid, plan, args, res, log))
    return res


async def _health(url: str) -> dict:
    async with aiohttp.ClientSession() as session:
        return await health(session, url)


def rows(results: list[FileResult]) -> tuple[list[str], list[str]]:
    """The table of every file, and one met / missed line per file."""
    marks = list(dict.fromkeys(k for r in results for k in r.rss_mb))  # "ready", "after 10"..
    table = md_table(
        ["file", "GGUF MB", "KV pool MB (blocks x bytes)", "bound MB", "draft (MB on disk)",
         *(f"RSS {m} MB" for m in marks), "anon / file at end MB",
         "KV pool resident at end MB", "failed",
         "KV blocks in use at end"],
        [[r.model.path.name, f"{r.bound.gguf_bytes / MB:.0f}",
          f"{r.bound.kv_bytes / MB:.0f} ({r.bound.kv_blocks} x {r.bound.kv_block_bytes})",
          f"{r.bound.total_bytes / MB:.0f}",
          f"{r.draft[0]} ({r.draft[1]:.0f})" if r.draft else "none",
          *(f"{r.rss_mb[m]:.0f}" if m in r.rss_mb else "-" for m in marks),
          f"{r.anon_file_mb_end[0]:.0f} / {r.anon_file_mb_end[1]:.0f}",
          "-" if r.kv_resident_mb_end is None else f"{r.kv_resident_mb_end:.0f}",
          str(len(r.errors)), str(r.kv_blocks_used_end)] for r in results])
    lines = [f"- {r.model.path.name}: " + ("**met**" if r.ok else "**missed**") + f", RSS "
             f"{r.final_rss_bytes / MB:.0f} MB against {r.bound.total_bytes / MB:.0f} MB "
             f"({(r.final_rss_bytes - r.bound.total_bytes) / MB:+.0f} MB)"
             + ("" if not r.errors else f"; {len(r.errors)} request(s) failed")
             + ("" if not r.kv_blocks_used_end else
                f"; {r.kv_blocks_used_end} KV blocks still in use") for r in results]
    lines += [outside_pool_line(r) for r in results if r.kv_resident_mb_end is not None]
    return table, lines


def outside_pool_line(r: FileResult) -> str:
    """The stricter reading: memory outside the KV pool against the file + headroom, so a pool
    that requests have touched only in part does not hide what the rest costs."""
    outside = r.final_rss_bytes / MB - r.kv_resident_mb_end
    limit = (r.bound.gguf_bytes + r.bound.headroom_bytes) / MB
    verdict = "within" if outside <= limit else "over"
    return (f"- {r.model.path.name}: outside the KV pool {outside:.0f} MB, {verdict} the GGUF "
            f"+ headroom ({limit:.0f} MB, {outside - limit:+.0f} MB); with the whole pool "
            f"resident the RSS would be {outside + r.bound.kv_bytes / MB:.0f} MB")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python benchmarks/server_rss.py",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="default,qwen",
                    help="default (built-in 135M), qwen (fetch_qwen.py's file) or GGUF paths")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=4, help="requests in flight at once")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--headroom-mb", type=int, default=300,
                    help="MB (10^6 bytes) over GGUF + KV pool the RSS may take")
    ap.add_argument("--startup-timeout", type=float, default=1800)
    ap.add_argument("--out", default=None,
                    help="folder for server logs and JSON [default: benchmarks/results/rss]")
    ap.add_argument("--no-write", action="store_true", help="print, leave RESULTS.md alone")
    return ap


def check_args(args: argparse.Namespace) -> None:
    if min(args.requests, args.concurrency, args.max_tokens) < 1:
        raise BenchError("--requests, --concurrency and --max-tokens must be >= 1")
    if args.headroom_mb < 0:
        raise BenchError(f"--headroom-mb must be >= 0 (got {args.headroom_mb})")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    log = stage_log("rss")

    try:
        check_args(args)
        models, skipped = models_to_measure([m for m in args.models.split(",") if m])
        out = out_dir(args.out, "rss")
        info = run_info(argv, "python tools/checkout.py . benchmarks/server_rss.py")
        results = [measure_file(m, args, out, log) for m in models]
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    table, verdicts = rows(results)
    intro = (f"`specserve serve --model FILE` with its defaults; {args.requests} requests, "
             f"{args.concurrency} at a time, max_tokens {args.max_tokens}, greedy, cycling over "
             "chat / code prompts, chat / completions endpoints, streamed or not, default "
             "speculation or off (benchmarks/server_rss.py). VmRSS of the server process, MB = "
             "10^6 bytes, read with the queue drained. Bound: GGUF size + KV pool (blocks x "
             "bytes per block, resolved as the engine resolves it; the block count checked "
             f"against /health) + {args.headroom_mb} MB.")
    body = [*table, "", *verdicts]
    skipped_lines = [f"- skipped {line}" for line in skipped]
    body += ["", *skipped_lines] if skipped_lines else []
    errors = [e for r in results for e in r.errors]
    body += ["", f"{len(errors)} failed request(s):", "", *(f"- {e}" for e in errors[:20])
             ] if errors else []
    write_json(out / "server_rss.json", {"info": info, "skipped": skipped, "files": [
        {"file": str(r.model.path), "bound": r.bound, "rss_mb": r.rss_mb, "errors": r.errors,
         "kv_blocks_used_end": r.kv_blocks_used_end, "engine": r.engine, "ok": r.ok}
        for r in results]})
    publish(HEADING, results_section(HEADING, info, intro, body), write=not args.no_write)
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
