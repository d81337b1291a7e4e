"""Does a 1 MiB prompt arriving mid-stream slow the other streams down?

Runs S concurrent streams of N tokens against an in-process server twice in the same process:
once alone (baseline) and once with a ~1 MiB completion prompt posted after the streams have
started. Inter-token latency (ITL) is measured on the client, per SSE chunk divided by the tokens
it carried. Prints p50 / p99 ITL of both runs and their ratio (same run, so machine noise
largely cancels). Tokenizing 1 MiB takes seconds; if it ran on the engine thread the streams
would stall for that long and p99 would grow by orders of magnitude; on the text worker the
ratio stays near 1 (bounded by CPU contention on small machines: the encode still uses a core).

    python benchmarks/probes/big_prompt_itl.py [--model PATH] [--streams 4] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp
from aiohttp import web

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: this checkout's packages first

from benchmarks.stats import percentile  # noqa: E402
from specserve.core.config import EngineConfig  # noqa: E402
from specserve.engine.async_engine import AsyncEngine  # noqa: E402
from specserve.engine.llm_engine import LLMEngine  # noqa: E402
from specserve.server.app import create_app  # noqa: E402
from specserve.server.server_config import ServerConfig  # noqa: E402


async def stream(session: aiohttp.ClientSession, url: str, tokens: int) -> list[float]:
    gaps: list[float] = []
    body = {"prompt": "Write a long story about a lighthouse keeper.", "max_tokens": tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}
    async with session.post(url + "/v1/completions", json=body) as resp:
        last = None
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            now = time.perf_counter()
            if last is not None and json.loads(line[6:])["choices"]:
                gaps.append(now - last)
            last = now
    return gaps


async def run_once(url: str, streams: int, tokens: int, big: str | None) -> list[float]:
    async with aiohttp.ClientSession() as s:
        tasks = [asyncio.create_task(stream(s, url, tokens)) for _ in range(streams)]
        if big is not None:
            await asyncio.sleep(0.5)  # mid-stream
            async with s.post(url + "/v1/completions", json={"prompt": big, "max_tokens": 1}):
                pass
        return [g for gaps in await asyncio.gather(*tasks) for g in gaps]


async def main_async(args: argparse.Namespace) -> None:
    engine = AsyncEngine(LLMEngine(EngineConfig(model=args.model)))
    app = create_app(engine, ServerConfig(port=0, max_body_bytes=2 << 20), args.model)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    await engine.wait_ready(600)
    big = "lorem ipsum dolor sit amet " * ((1 << 20) // 27)
    await run_once(url, args.streams, 8, None)  # warm
    base = await run_once(url, args.streams, args.tokens, None)
    loaded = await run_once(url, args.streams, args.tokens, big)
    await runner.cleanup()
    for name, xs in (("alone", base), ("with 1 MiB prompt", loaded)):
        print(f"{name:>18}: ITL p50 {percentile(xs, 50) * 1e3:7.1f} ms  "
              f"p99 {percentile(xs, 99) * 1e3:7.1f} ms  ({len(xs)} gaps)")
    print(f"p99 ratio (with / alone): {percentile(loaded, 99) / percentile(base, 99):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the built-in model")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=64)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
