"""Soak: minutes of mixed, abusive traffic against a real `specserve serve` process.

Starts the server (the built-in model unless --model), then runs --clients closed-loop clients
for --minutes. Each request is drawn at random (seeded): REST completions or chat, streaming or
not, or WebSocket (1-3 requests per connection, some cancelled after their first token);
speculative or plain (`speculative: {"method": "off"}`) half and half; a quarter of them hang up
mid-request (close the connection); some carry a short `timeout`; some are bad bodies
(malformed JSON, wrong types, unknown roles, image parts); and a few 100k-character prompts
arrive at fixed times (longer than the context window: tokenized, then refused with a 400).

Every request carries an id the client generated (`X-Request-Id` on REST, the message id on the
WebSocket) and gets exactly one terminal outcome in a ledger:
  completed   a finish_reason (stop / length) and nothing after it
  rejected    a 4xx other than 408 (400, 413, 429), or a WebSocket error of those kinds
  aborted     the client hung up or cancelled, or the request passed its deadline (408 / error)
  failed      a 5xx or an error event from the server
  unaccounted the server never gave a terminal answer (dropped connection, stream cut short, a
              WebSocket that ended without "done" / "error" for it), or gave two
After the run the clients stop, the server drains, and the script reads KV blocks in use and
the server's RSS (/proc) at start, after the first minute (warm-up), at the middle and the end.

    python benchmarks/soak.py [--minutes 20] [--clients 8] [--model PATH] [--server-args "..."]
                              [--write-results]

Exit status 0 when 0 unaccounted, 0 KV blocks in use after the drain and RSS growth after
warm-up under 5%; 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from benchmarks.launched_server import LaunchedServer  # noqa: E402
from benchmarks.report import (  # noqa: E402
    BenchError,
    fmt,
    md_table,
    out_dir,
    run_info,
    write_json,
    write_results_section,
)
from benchmarks.stats import percentile  # noqa: E402

HEADING = "## Soak: mixed abusive traffic (benchmarks/soak.py)"
PROMPTS = ["Write a short story about a lighthouse keeper.", "Explain how a hash map works.",
           "List five uses of copper.", "def quicksort(xs):", "The history of Rome in brief:",
           "Summarize: the cat sat on the mat because the mat was warm and the sun was out."]
BAD_BODIES: list[bytes] = [
    b'{"prompt": "unterminated', b'{"prompt": 5}', b'{"prompt": "x", "max_tokens": -3}',
    b'{"prompt": "x", "temperature": "hot"}', b'[]', b'{"prompt": "x", "timeout": 0}',
]
BAD_CHATS: list[dict] = [
    {"messages": [{"role": "wizard", "content": "hi"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                 "image_url": {"url": "http://x/y.png"}}]}]},
    {"messages": "hello"},
]
CATEGORIES = ("completed", "rejected", "aborted", "failed", "unaccounted")


@dataclass
class Ledger:
    """Client-side truth: what was sent and every terminal outcome seen for each id."""

    t0: float
    sent: dict[str, str] = field(default_factory=dict)  # id -> scenario
    outcomes: dict[str, list[str]] = field(default_factory=dict)
    latency: list[tuple[int, float]] = field(default_factory=list)  # (minute, seconds)
    started: Counter = field(default_factory=Counter)  # minute -> requests

    def send(self, scenario: str) -> str:
        rid = uuid.uuid4().hex
        self.sent[rid] = scenario
        self.started[self.minute()] += 1
        return rid

    def minute(self, t: float | None = None) -> int:
        return int(((time.monotonic() if t is None else t) - self.t0) // 60)

    def end(self, rid: str, category: str, t_start: float | None = None) -> None:
        assert category in CATEGORIES, category
        self.outcomes.setdefault(rid, []).append(category)
        if category == "completed" and t_start is not None:
            self.latency.append((self.minute(t_start), time.monotonic() - t_start))

    def category_of(self, rid: str) -> str:
        got = self.outcomes.get(rid, [])
        return got[0] if len(got) == 1 else "unaccounted"


def _error_category(status: int, error_type: str | None = None) -> str:
    if status == 408 or error_type == "timeout_error":
        return "aborted"
    if 400 <= status < 500 or error_type in ("invalid_request_error", "rate_limit_error"):
        return "rejected"
    return "failed"


_STATUS_OF = {"invalid_request_error": 400, "rate_limit_error": 429, "timeout_error": 408}


class Traffic:
    def __init__(self, url: str, ledger: Ledger, seed: int) -> None:
        self.url, self.ledger, self.seed = url, ledger, seed

    def body(self, rng: random.Random, chat: bool) -> dict:
        prompt = rng.choice(PROMPTS)
        body: dict = {"max_tokens": rng.randint(8, 64), "temperature": rng.choice([0.0, 0.8])}
        if rng.random() < 0.5:
            body["speculative"] = {"method": "off"}
        if rng.random() < 0.3:
            body["ignore_eos"] = True
        if rng.random() < 0.08:
            body["timeout"] = round(rng.uniform(0.05, 1.0), 3)
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body

    async def rest(self, s: aiohttp.ClientSession, rng: random.Random, raw: bytes | None = None,
                   chat: bool = False, scenario: str = "rest") -> None:
        stream = raw is None and rng.random() < 0.5
        hang = raw is None and rng.random() < 0.25
        body = raw if raw is not None else json.dumps({**self.body(rng, chat),
                                                       "stream": stream}).encode()
        path = "/v1/chat/completions" if chat else "/v1/completions"
        rid = self.ledger.send(scenario + ("-stream" if stream else "")
                               + ("-hangup" if hang else ""))
        t = time.monotonic()
        headers = {"X-Request-Id": rid, "Content-Type": "application/json"}

        async def exchange() -> None:
            async with s.post(self.url + path, data=body, headers=headers) as r:
                if r.headers.get("X-Request-Id") != rid:
                    return self.ledger.end(rid, "unaccounted")
                if r.status != 200:
                    err = (await r.json())["error"]
                    return self.ledger.end(rid, _error_category(r.status, err["type"]))
                if not stream:
                    out = await r.json()
                    reason = out["choices"][0]["finish_reason"]
                    return self.ledger.end(rid, "completed" if reason in ("stop", "length")
                                           else "aborted", t)
                await self._sse(r, rid, t, hang)

        try:
            if hang and not stream:  # hang up while the answer is being generated
                try:
                    await asyncio.wait_for(exchange(), rng.uniform(0.05, 1.0))
                except asyncio.TimeoutError:
                    self.ledger.end(rid, "aborted")
            else:
                await exchange()
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError, ValueError, KeyError):
            self.ledger.end(rid, "unaccounted")

    async def _sse(self, r: aiohttp.ClientResponse, rid: str, t: float, hang: bool) -> None:
        reasons, errors, done, n = [], [], 0, 0
        async for line in r.content:
            if not line.startswith(b"data: "):
                continue
            n += 1
            if hang and n >= 2:  # hang up after the first chunks
                return self.ledger.end(rid, "aborted")
            data = line[6:].strip()
            if data == b"[DONE]":
                done += 1
                continue
            event = json.loads(data)
            if "error" in event:
                errors.append(event["error"]["type"])
            reasons += [c["finish_reason"] for c in event.get("choices", []) if c["finish_reason"]]
        if done != 1 or len(errors) > 1 or (not errors and len(reasons) != 1):
            return self.ledger.end(rid, "unaccounted")
        if errors:
            return self.ledger.end(rid, _error_category(_STATUS_OF.get(errors[0], 500), errors[0]))
        self.ledger.end(rid, "completed" if reasons[0] in ("stop", "length") else "aborted", t)

    async def websocket(self, s: aiohttp.ClientSession, rng: random.Random) -> None:
        """1-3 requests on one connection; some cancelled, some bad; a quarter of the
        connections hang up after the first token."""
        hang = rng.random() < 0.25
        ids: dict[str, float] = {}
        cancel: set[str] = set()
        try:
            ws = await s.ws_connect(self.url.replace("http", "ws") + "/ws")
        except aiohttp.ClientError:
            rid = self.ledger.send("ws-connect")
            return self.ledger.end(rid, "unaccounted")
        async with ws:
            for _ in range(rng.randint(1, 3)):
                chat = rng.random() < 0.3
                bad = rng.random() < 0.1
                body = ({"kind": "chat", **rng.choice(BAD_CHATS)} if bad and chat else
                        {"prompt": "x", "temperature": "hot"} if bad else
                        {"kind": "chat" if chat else "completion", **self.body(rng, chat)})
                rid = self.ledger.send(f"ws{'-bad' if bad else ''}{'-hangup' if hang else ''}")
                ids[rid] = time.monotonic()
                if rng.random() < 0.15:
                    cancel.add(rid)
                await ws.send_str(json.dumps({"type": "request", "id": rid, **body}))
            open_ids = set(ids)
            try:
                while open_ids:
                    msg = json.loads(await ws.receive_str(timeout=300))
                    rid = msg.get("id")
                    if rid not in ids:
                        continue  # not ours: ledger cannot place it (never expected)
                    if msg["type"] == "token":
                        if hang:
                            break
                        if rid in cancel:
                            cancel.discard(rid)
                            await ws.send_str(json.dumps({"type": "cancel", "id": rid}))
                        continue
                    if msg["type"] == "done":
                        reason = msg["finish_reason"]
                        self.ledger.end(rid, "completed" if reason in ("stop", "length")
                                        else "aborted", ids[rid])
                    else:
                        err = msg["error"]
                        self.ledger.end(rid, _error_category(_STATUS_OF.get(err["type"], 500),
                                                             err["type"]))
                    open_ids.discard(rid)
            except (aiohttp.ClientError, asyncio.TimeoutError, TypeError, ValueError):
                pass
            for rid in open_ids:  # hung up by us, or the server never answered
                self.ledger.end(rid, "aborted" if hang else "unaccounted")

    async def client(self, s: aiohttp.ClientSession, index: int, stop_at: float) -> None:
        rng = random.Random(self.seed * 1000 + index)
        while time.monotonic() < stop_at:
            try:
                await self.one(s, rng)
            except Exception as exc:  # noqa: BLE001  (its id stays without an outcome)
                print(f"client {index}: {exc!r}", file=sys.stderr)

    async def one(self, s: aiohttp.ClientSession, rng: random.Random) -> None:
        """One request (or one WebSocket connection's requests) of the mix."""
        r = rng.random()
        if r < 0.35:
            await self.rest(s, rng)
        elif r < 0.55:
            await self.rest(s, rng, chat=True, scenario="chat")
        elif r < 0.85:
            await self.websocket(s, rng)
        elif r < 0.93:
            await self.rest(s, rng, raw=rng.choice(BAD_BODIES), scenario="bad")
        else:
            raw = json.dumps(rng.choice(BAD_CHATS)).encode()
            await self.rest(s, rng, raw=raw, chat=True, scenario="bad-chat")

    async def big_prompts(self, s: aiohttp.ClientSession, every_s: float, stop_at: float) -> None:
        rng = random.Random(self.seed)
        words = "lorem ipsum dolor sit amet consectetur adipiscing elit".split()
        while True:
            await asyncio.sleep(min(every_s, max(0.0, stop_at - time.monotonic())))
            if time.monotonic() >= stop_at:
                return
            prompt = " ".join(rng.choice(words) for _ in range(20000))[:100_000]
            raw = json.dumps({"prompt": prompt, "max_tokens": 4}).encode()
            await self.rest(s, rng, raw=raw, scenario="100k-prompt")


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


async def health(s: aiohttp.ClientSession, url: str) -> dict:
    async with s.get(url + "/health") as r:
        return await r.json()


async def soak(args: argparse.Namespace, url: str, pid: int) -> dict:
    ledger = Ledger(time.monotonic())
    traffic = Traffic(url, ledger, args.seed)
    duration = args.minutes * 60
    stop_at = ledger.t0 + duration
    rss = {"start": rss_mib(pid)}
    per_minute: list[dict] = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as s:
        tasks = [asyncio.create_task(traffic.client(s, i, stop_at)) for i in range(args.clients)]
        tasks.append(asyncio.create_task(traffic.big_prompts(s, max(60.0, duration / 5), stop_at)))
        for minute in range(int(args.minutes + 0.999)):
            await asyncio.sleep(max(0.0, ledger.t0 + min(duration, (minute + 1) * 60)
                                    - time.monotonic()))
            h = await health(s, url)
            per_minute.append({"minute": minute + 1, "rss_mib": rss_mib(pid),
                               "kv_blocks_used": h["kv_blocks_total"] - h["kv_blocks_free"],
                               "in_flight": h["num_in_flight"]})
            if minute == 0:
                rss["after warm-up (1 min)"] = per_minute[-1]["rss_mib"]
            if minute + 1 == max(1, round(args.minutes / 2)):
                rss["middle"] = per_minute[-1]["rss_mib"]
            print(f"minute {minute + 1}: {ledger.started[minute]} requests started, "
                  f"RSS {per_minute[-1]['rss_mib']:.0f} MiB, in flight {h['num_in_flight']}",
                  flush=True)
        await asyncio.gather(*tasks)  # clients finish their current request, then stop
        drain_deadline = time.monotonic() + 120
        while (h := await health(s, url))["num_in_flight"] and time.monotonic() < drain_deadline:
            await asyncio.sleep(0.2)
        rss["end (drained)"] = rss_mib(pid)
        async with s.get(url + "/metrics") as r:
            metrics = await r.text()
    counts = Counter(ledger.category_of(rid) for rid in ledger.sent)
    duplicated = sum(len(v) > 1 for v in ledger.outcomes.values())
    for row in per_minute:
        lat = [x for m, x in ledger.latency if m == row["minute"] - 1]
        row.update(started=ledger.started[row["minute"] - 1], completed=len(lat),
                   p50_s=percentile(lat, 50) if lat else None,
                   p99_s=percentile(lat, 99) if lat else None)
    return {"sent": len(ledger.sent), "outcomes": {c: counts[c] for c in CATEGORIES},
            "duplicated": duplicated, "scenarios": dict(Counter(ledger.sent.values())),
            "server_counted": server_counted(metrics), "kv_blocks_used_after_drain":
            h["kv_blocks_total"] - h["kv_blocks_free"], "in_flight_after_drain":
            h["num_in_flight"], "rss_mib": rss, "per_minute": per_minute,
            "timeouts_metric": metric_sum(metrics, "specserve_request_timeouts_total")}


_API_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/ws:completion", "/ws:chat")


def metric_sum(text: str, name: str, endpoints: tuple[str, ...] | None = None) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and (endpoints is None or s.labels.get("endpoint") in endpoints))


def server_counted(text: str) -> int:
    """API requests the server's /metrics counted (REST, and each WebSocket request)."""
    return int(metric_sum(text, "specserve_requests_total", _API_ENDPOINTS))


def report(res: dict, args: argparse.Namespace) -> tuple[list[str], bool]:
    o, rss = res["outcomes"], res["rss_mib"]
    warm = rss["after warm-up (1 min)"]
    growth = (rss["end (drained)"] - warm) / warm * 100
    ok = (o["unaccounted"] == 0 and res["duplicated"] == 0
          and res["kv_blocks_used_after_drain"] == 0 and growth < 5.0)
    accounted = o["completed"] + o["rejected"] + o["aborted"] + o["failed"]
    lines = md_table(["requests sent", "completed", "rejected", "aborted", "failed",
                      "unaccounted", "duplicated", "server counted"],
                     [[str(res["sent"]), *(str(o[c]) for c in CATEGORIES[:4]),
                       str(res["sent"] - accounted), str(res["duplicated"]),
                       str(res["server_counted"])]])
    lines += ["", *md_table(["RSS (MiB)", *rss], [["server", *(fmt(v) for v in rss.values())]]),
              "", f"RSS growth after warm-up (1 min -> end): {growth:+.1f}% (goal < 5%). "
              f"KV blocks in use after the drain: {res['kv_blocks_used_after_drain']}; "
              f"in flight: {res['in_flight_after_drain']}; requests timed out (server "
              f"metric): {int(res['timeouts_metric'])}.", ""]
    lines += md_table(["minute", "started", "completed", "p50 latency (s)", "p99 latency (s)",
                       "RSS (MiB)", "KV blocks used"],
                      [[str(r["minute"]), str(r["started"]), str(r["completed"]),
                        fmt(r["p50_s"], 2), fmt(r["p99_s"], 2), fmt(r["rss_mib"]),
                        str(r["kv_blocks_used"])] for r in res["per_minute"]])
    lines += ["", "Scenarios sent: " + ", ".join(f"{k} {v}" for k, v in
                                                  sorted(res["scenarios"].items())) + "."]
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0, help="traffic duration [default: 20]")
    ap.add_argument("--clients", type=int, default=8, help="concurrent clients [default: 8]")
    ap.add_argument("--model", default=None, help="--model for the server [default: built-in]")
    ap.add_argument("--server-args", default="", help="extra `specserve serve` flags")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--out", default=None, help="folder for soak.json and the server log")
    ap.add_argument("--write-results", action="store_true",
                    help="replace the soak section of benchmarks/RESULTS.md")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = ap.parse_args(argv)
    if args.minutes < 1:
        ap.error("--minutes must be >= 1 (the first minute is the warm-up)")
    out = out_dir(args.out, "soak")
    info = run_info(argv, "python benchmarks/soak.py")
    flags = [*(["--model", args.model] if args.model else []), *shlex.split(args.server_args)]
    with LaunchedServer(flags, out / "server.log", args.startup_timeout, root=REPO,
                        stop_timeout=60) as server:
        res = asyncio.run(soak(args, server.url, server.proc.pid))
    res["server_exit_code"] = server.proc.returncode
    write_json(out / "soak.json", {"info": info, **res})
    lines, ok = report(res, args)
    print("\n".join(lines))
    if args.write_results:
        serve = " ".join(["specserve serve", *(["--model", args.model] if args.model else []),
                          args.server_args]).strip()
        intro = (f"{args.minutes:g} minutes, {args.clients} closed-loop clients against "
                 f"`{serve}` (the mix and the ledger: the docstring of benchmarks/soak.py). "
                 "Each request id the clients generated must get exactly one terminal outcome; "
                 f"any other is unaccounted. Verdict: {'pass' if ok else 'FAIL'}.")
        write_results_section(HEADING, info, intro, lines)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:  # the server would not start
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
