"""Streaming clients of the real API, measuring one request each: SSE over HTTP
(``/v1/chat/completions`` or ``/v1/completions`` with ``stream_options.include_usage``) and the
WebSocket protocol (``/ws``, many requests on one connection).

Per request, client-side: TTFT (send -> first streamed text), ITL (gaps between streamed
chunks), TPOT ((end - TTFT) / (tokens - 1)), end-to-end latency. Token counts come from the
server's usage and are checked against the stream; any disagreement makes the request an error.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp


@dataclass
class RequestResult:
    ok: bool
    error: str | None
    start_s: float  # send time, seconds after the level started
    ttft_s: float | None
    e2e_s: float
    itl_s: list[float]
    tpot_s: float | None
    output_tokens: int  # the server's usage.completion_tokens
    streamed_tokens: int | None  # token ids streamed (WebSocket); SSE streams text only
    chunks: int  # streamed events that carried text
    finish_reason: str | None
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    sent_at: float = 0.0  # time.perf_counter() at send (same-process tracing lines up on it)
    timings: dict = field(default_factory=dict)  # the server's per-phase timings



@dataclass
class Target:
    """Where requests go and what they ask for."""

    url: str
    endpoint: str  # chat | completions
    api_key: str | None
    max_tokens: int
    ignore_eos: bool

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, prompt: str, mode: str) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": self.max_tokens, "temperature": 0.0,
                                "ignore_eos": self.ignore_eos, "speculative": {"method": mode}}
        if self.endpoint == "chat":
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        return body


@dataclass
class _Stream:
    """What a client saw of one streamed request."""

    t0: float
    times: list[float] = field(default_factory=list)  # arrival of each chunk with text
    streamed_tokens: int | None = None
    text: str = ""
    final_text: str | None = None
    usage: dict | None = None
    timings: dict | None = None
    finish_reason: str | None = None
    done: bool = False
    error: str | None = None


def _finish(s: _Stream, target: Target, start_s: float, mode: str) -> RequestResult:
    end = time.perf_counter()
    n = int((s.usage or {}).get("completion_tokens", 0))
    t = s.timings or {}
    error = s.error or _check(s, target, n)
    if error is None and mode == "off" and t.get("num_drafted"):  # plain means plain
        error = f"{t['num_drafted']} tokens drafted with speculation off"
    ttft = (s.times[0] if s.times else end) - s.t0
    return RequestResult(
        ok=error is None, error=error, start_s=start_s, ttft_s=ttft, e2e_s=end - s.t0,
        itl_s=[b - a for a, b in zip(s.times, s.times[1:])],
        tpot_s=(end - s.t0 - ttft) / (n - 1) if n > 1 else None, output_tokens=n,
        streamed_tokens=s.streamed_tokens, chunks=len(s.times), finish_reason=s.finish_reason,
        drafted=int(t.get("num_drafted", 0)), accepted=int(t.get("num_accepted", 0)),
        verify_steps=int(t.get("num_verify_steps", 0)), sent_at=s.t0, timings=t,
    )


def _check(s: _Stream, target: Target, n: int) -> str | None:
    """Token accounting: the usage must agree with what was streamed."""
    if not s.done:
        return "the stream ended before its final event"
    if s.usage is None:
        return "no usage in the stream"
    if len(s.times) > n:
        return f"{len(s.times)} text chunks but usage says {n} tokens"
    if s.streamed_tokens is not None and s.streamed_tokens != n:
        return f"{s.streamed_tokens} token ids streamed but usage says {n}"
    if s.final_text is not None and s.final_text != s.text:
        return "the streamed text differs from the final text"
    if n > target.max_tokens or (target.ignore_eos and n != target.max_tokens):
        return f"{n} tokens for max_tokens {target.max_tokens} (ignore_eos {target.ignore_eos})"
    if s.finish_reason not in ("stop", "length"):
        return f"finish_reason {s.finish_reason!r}"
    return None


async def sse_request(session: aiohttp.ClientSession, target: Target, prompt: str, mode: str,
                      start_s: float = 0.0) -> RequestResult:
    """One streamed request over HTTP (SSE), parsed line by line as it arrives."""
    path = "/v1/chat/completions" if target.endpoint == "chat" else "/v1/completions"
    body = {**target.body(prompt, mode), "stream": True,
            "stream_options": {"include_usage": True}}
    s = _Stream(time.perf_counter())
    try:
        async with session.post(target.url + path, json=body, headers=target.headers()) as resp:
            if resp.status != 200:
                s.error = f"HTTP {resp.status}: {one_line(await resp.text())}"
                return _finish(s, target, start_s, mode)
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    s.done = True
                    break
                _sse_event(s, json.loads(payload), target.endpoint)
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        s.error = f"{type(exc).__name__}: {one_line(str(exc))}"
    return _finish(s, target, start_s, mode)


def _sse_event(s: _Stream, obj: dict, endpoint: str) -> None:
    if "error" in obj:
        s.error = f"error event: {one_line(str(obj['error'].get('message')))}"
        return
    for choice in obj.get("choices") or []:
        text = (choice.get("delta") or {}).get("content") if endpoint == "chat" else (
            choice.get("text"))
        if text:
            s.times.append(time.perf_counter())
            s.text += text
        s.finish_reason = choice.get("finish_reason") or s.finish_reason
    s.usage = obj.get("usage") or s.usage
    s.timings = obj.get("timings") or s.timings


class WsClient:
    """Many concurrent requests multiplexed on one WebSocket (see specserve/server/ws.py)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, target: Target) -> None:
        self.ws, self.target = ws, target
        self.queues: dict[str, asyncio.Queue] = {}
        self.reader = asyncio.ensure_future(self._read())
        self._ids = 0

    async def _read(self) -> None:
        try:
            async for msg in self.ws:
                if msg.type != aiohttp.WSMsgType.TEXT:
                    break
                obj = json.loads(msg.data)
                queue = self.queues.get(obj.get("id"))
                if queue is not None:
                    queue.put_nowait((time.perf_counter(), obj))
        finally:
            for queue in self.queues.values():
                queue.put_nowait((time.perf_counter(), None))

    async def request(self, prompt: str, mode: str, start_s: float = 0.0) -> RequestResult:
        self._ids += 1
        cid = f"r{self._ids}"
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[cid] = queue
        s = _Stream(time.perf_counter(), streamed_tokens=0)
        kind = "chat" if self.target.endpoint == "chat" else "completion"
        try:
            await self.ws.send_str(json.dumps({"type": "request", "id": cid, "kind": kind,
                                               **self.target.body(prompt, mode)}))
            while True:
                t, obj = await queue.get()
                if obj is None:
                    s.error = "the WebSocket closed mid-request"
                    break
                if obj["type"] == "token":
                    s.streamed_tokens = (s.streamed_tokens or 0) + len(obj["token_ids"])
                    s.times.append(t)
                    s.text += obj["text"]
                elif obj["type"] == "done":
                    s.done, s.usage, s.timings = True, obj["usage"], obj["timings"]
                    s.finish_reason, s.final_text = obj["finish_reason"], obj["text"]
                    break
                else:
                    s.error = f"error event: {one_line(str(obj['error'].get('message')))}"
                    break
        except (aiohttp.ClientError, ConnectionError) as exc:
            s.error = f"{type(exc).__name__}: {one_line(str(exc))}"
        finally:
            self.queues.pop(cid, None)
        return _finish(s, self.target, start_s, mode)

    async def close(self) -> None:
        await self.ws.close()
        await self.reader


@dataclass
class Completion:
    """One ``/v1/completions`` answer as a client saw it, from either server: specserve's
    (drafts counted in ``timings.num_drafted``) or llama-server's (``timings.draft_n``, absent
    when nothing was drafted)."""

    text: str
    prompt_tokens: int
    output_tokens: int
    drafted: int
    accepted: int
    seconds: float  # send -> the whole answer (the last SSE event)
    finish_reason: str | None
    verify_steps: int = 0  # specserve's timings.num_verify_steps (llama-server has no count)
    draft_ms: float = 0.0  # specserve's timings.draft_ms


def completion_body(prompt: str, max_tokens: int, *, server: str, mode: str = "off",
                    ignore_eos: bool = True) -> dict[str, Any]:
    """A greedy ``/v1/completions`` body. ``server`` "specserve": ``mode`` is its per-request
    ``speculative.method`` (its suffix-cache tenant comes from the API key the request sends);
    "llama": llama-server runs what its flags say (``--spec-type``) and takes ``ignore_eos``
    and ``n_predict`` as ours takes ``ignore_eos`` and ``max_tokens``."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "ignore_eos": ignore_eos}
    if server == "specserve":
        body["speculative"] = {"method": mode}
    elif server == "llama":
        body["n_predict"] = max_tokens
    else:
        raise ValueError(f"server must be specserve or llama (got {server!r})")
    return body


async def complete(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                   stream: bool = False, headers: dict[str, str] | None = None) -> Completion:
    """POST /v1/completions as JSON or SSE (``stream``); raises ``RuntimeError`` on an HTTP
    error, an error event or a stream without its usage."""
    body = {**body, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    t0 = time.perf_counter()
    parts: list[str] = []
    last: dict = {}
    reason = None
    async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {one_line(await resp.text())}")
        if not stream:
            last = await resp.json()
            parts = [c.get("text", "") for c in last.get("choices", [])]
            reason = (last.get("choices") or [{}])[0].get("finish_reason")
        else:
            async for line in resp.content:
                if not line.startswith(b"data: "):
                    continue
                payload = line[6:].strip()
                if payload == b"[DONE]":
                    break
                obj = json.loads(payload)
                if "error" in obj:
                    raise RuntimeError(f"error event: {one_line(str(obj['error']))}")
                for choice in obj.get("choices") or []:
                    parts.append(choice.get("text") or "")
                    reason = choice.get("finish_reason") or reason
                last = {"usage": obj.get("usage") or last.get("usage"),
                        "timings": obj.get("timings") or last.get("timings")}
    return completion_of("".join(parts), last.get("usage"), last.get("timings") or {},
                         time.perf_counter() - t0, reason)


def completion_of(text: str, usage: dict | None, timings: dict, seconds: float,
                  reason: str | None) -> Completion:
    """An answer's counts from its ``usage`` and ``timings``, in either server's names."""
    if not usage:
        raise RuntimeError("the answer carries no usage")
    return Completion(
        text, int(usage.get("prompt_tokens", 0)), int(usage.get("completion_tokens", 0)),
        int(timings.get("num_drafted", timings.get("draft_n", 0))),
        int(timings.get("num_accepted", timings.get("draft_n_accepted", 0))), seconds, reason,
        int(timings.get("num_verify_steps", 0)), float(timings.get("draft_ms", 0.0)))


def one_line(text: str) -> str:
    return " ".join(text.split())[:200]


async def has_draft(session: aiohttp.ClientSession, target: Target) -> bool:
    """Whether the server runs a draft model: a one-token request asking for it gets 200
    (without one, 400)."""
    path = "/v1/chat/completions" if target.endpoint == "chat" else "/v1/completions"
    body = {**target.body("Hi", "draft"), "max_tokens": 1}
    async with session.post(target.url + path, json=body, headers=target.headers()) as resp:
        await resp.read()
        return resp.status == 200
