"""Injected engine faults: an exception inside one step's forward pass ends the requests of that
step with an error (a 500 in OpenAI's shape, or an SSE error event before [DONE]), frees their KV
blocks, is counted in /metrics, and the server goes on serving everyone else correctly.

The fault is injected by the test itself (the model runner's forward is wrapped to raise once when
armed); the server has no fault code of its own.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import aiohttp
import pytest

from specserve.server.server_config import ServerConfig
from tests.helpers.servers import (
    HANG_S,
    NAME,
    PROMPTS,
    ServerThread,
    engine_config,
    http,
    reference,
    wait_healthy,
)

pytestmark = pytest.mark.e2e


def test_forward_exception_fails_that_step_and_serving_goes_on(model_dir, offline):
    srv = ServerThread(engine_config(model_dir, speculative_method="ngram"),
                       ServerConfig(port=0, served_model_name=NAME))
    runner = srv.engine.engine.runner
    forward, armed, fired = runner.forward, threading.Event(), threading.Event()

    def faulty_forward(*a, **kw):
        if armed.is_set():
            armed.clear()
            fired.set()
            raise RuntimeError("injected fault")
        return forward(*a, **kw)

    runner.forward = faulty_forward
    body = {"prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "temperature": 0}

    async def run() -> tuple[list[dict], tuple[int, dict], str]:
        async with aiohttp.ClientSession() as s:
            plain = asyncio.create_task(s.post(srv.url + "/v1/completions", json=body))
            events: list[dict | str] = []
            async with s.post(srv.url + "/v1/completions", json={**body, "stream": True}) as r:
                async for line in r.content:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip().decode()
                    events.append(data if data == "[DONE]" else json.loads(data))
                    h = await asyncio.to_thread(lambda: http("GET", srv.url + "/health")[1])
                    if len(events) >= 3 and not (armed.is_set() or fired.is_set()) \
                            and h["num_running"] == 2:
                        armed.set()  # both requests are in the next step
            resp = await plain
            plain_out = (resp.status, await resp.json())
            metrics = await (await s.get(srv.url + "/metrics")).text()
            return events, plain_out, metrics

    try:
        events, (status, plain_body), metrics = asyncio.run(run())
        assert fired.is_set()
        # The stream: some tokens, then an error event in OpenAI's shape, then [DONE].
        assert events[-1] == "[DONE]" and "error" in events[-2], events[-3:]
        err = events[-2]["error"]
        assert err["code"] == "engine_step_failed" and "injected fault" in err["message"]
        assert all("choices" in e for e in events[:-2]) and len(events) < 200
        # The non-streaming request of the same step: a 500 with an OpenAI error body.
        assert status == 500 and plain_body["error"]["type"] == "internal_error"
        assert "specserve_engine_step_failures_total 1.0" in metrics
        # Blocks freed, nothing in flight, and the next requests are served exactly.
        deadline = time.monotonic() + HANG_S  # only a hang ends the wait
        while (h := http("GET", srv.url + "/health")[1])["num_in_flight"] and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        assert h["status"] == "ok" and h["kv_blocks_free"] == h["kv_blocks_total"], h
        want = reference(offline, PROMPTS[:2], 8)
        for prompt, w in zip(PROMPTS[:2], want):
            status, out = http("POST", srv.url + "/v1/completions",
                               {"prompt": prompt, "max_tokens": 8, "temperature": 0})
            assert status == 200 and out["choices"][0]["text"] == w.text
    finally:
        runner.forward = forward
        srv.stop()


_DYING_SERVER = """
import sys
from specserve import cli
from specserve.engine.llm_engine import LLMEngine
from specserve.server import app

# The test reads /health between the engine's death and the exit: a grace of 1 s, which a
# client stalled on a loaded machine can miss; 10 s only a hang misses.
app._exit_when_engine_dies.__defaults__ = (10.0,)

class EngineThreadDeath(BaseException):  # not an Exception: nothing on the way catches it
    pass

step, calls = LLMEngine.step, [0]

def dying_step(self):
    calls[0] += 1
    if calls[0] == 6:
        raise EngineThreadDeath("injected: the engine thread dies")
    return step(self)

LLMEngine.step = dying_step
sys.exit(cli.main(sys.argv[1:]))
"""


def test_dead_engine_thread_fails_streams_and_the_process_exits_1(model_dir, tmp_path):
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    script = tmp_path / "dying_server.py"
    script.write_text(_DYING_SERVER)
    proc = subprocess.Popen(
        [sys.executable, str(script), "serve", "--model", model_dir, "--port", str(port),
         "--dtype", "float32", "--num-kv-blocks", "256", "--block-size", "4",
         "--max-model-len", "256", "--served-model-name", NAME, "--no-warmup"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=os.getcwd(),
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.getcwd()})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)
        events: list[str] = []

        async def run() -> tuple[int, str]:
            async with aiohttp.ClientSession() as s:
                async with s.post(url + "/v1/completions", json={
                        "prompt": PROMPTS[0], "max_tokens": 100, "ignore_eos": True,
                        "stream": True}) as r:
                    async for line in r.content:
                        if line.startswith(b"data: "):
                            events.append(line[6:].strip().decode())
                async with s.get(url + "/health") as h:  # within the grace
                    return h.status, (await h.json())["status"]

        health = asyncio.run(run())
        assert events[-1] == "[DONE]" and "engine failed" in events[-2], events[-3:]
        assert health == (503, "failed")
        _, err = proc.communicate(timeout=HANG_S)
        assert proc.returncode == 1, err.decode()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _metric(text: str, name: str, **labels: str) -> float:
    """One sample of the Prometheus text (0 when the series does not exist yet)."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


async def _rest(s: aiohttp.ClientSession, url: str, rid: str, body: dict | bytes) -> str:
    """One REST request carrying the client's id; returns its one terminal outcome."""
    headers = {"X-Request-Id": rid, "Content-Type": "application/json"}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with s.post(url + "/v1/completions", data=data, headers=headers) as r:
        assert r.headers.get("X-Request-Id") == rid  # the answer is this request's, not another's
        if r.status != 200 or not (isinstance(body, dict) and body.get("stream")):
            out = await r.json()
            if r.status != 200:
                return f"{r.status}:{out['error']['code']}"
            return f"200:{out['choices'][0]['finish_reason']}:{out['choices'][0]['text']}"
        events = [line[6:].strip().decode() async for line in r.content
                  if line.startswith(b"data: ")]
    assert events.count("[DONE]") == 1 and events[-1] == "[DONE]", events[-3:]
    parsed = [json.loads(e) for e in events[:-1]]
    errors = [e["error"]["code"] for e in parsed if "error" in e]
    reasons = [e["choices"][0]["finish_reason"] for e in parsed
               if "choices" in e and e["choices"][0]["finish_reason"]]
    if errors:
        assert len(errors) == 1 and "error" in parsed[-1], events[-3:]
        return f"sse_error:{errors[0]}"
    assert len(reasons) == 1, events[-3:]
    return f"sse:{reasons[0]}"


async def _websocket(s: aiohttp.ClientSession, url: str,
                     bodies: dict[str, dict], cancel: set[str]) -> dict[str, list[str]]:
    """All ``bodies`` on one connection (ids are the keys), ``cancel`` cancelled after their
    first token; every terminal message is recorded under its id (two would be a duplicate)."""
    ws = await s.ws_connect(url.replace("http", "ws") + "/ws")
    seen: dict[str, list[str]] = {}
    for rid, body in bodies.items():
        await ws.send_json({"type": "request", "id": rid, **body})
    while sum(len(v) for v in seen.values()) < len(bodies):
        msg = await ws.receive_json(timeout=120)
        rid = msg["id"]
        assert rid in bodies, msg  # never an answer to an id nobody sent
        if msg["type"] == "token":
            if rid in cancel:
                cancel.discard(rid)
                await ws.send_json({"type": "cancel", "id": rid})
        elif msg["type"] == "done":
            seen.setdefault(rid, []).append(f"ws:{msg['finish_reason']}")
        else:
            seen.setdefault(rid, []).append(f"ws_error:{msg['error']['code']}")
    await ws.close()
    return seen


def test_mixed_traffic_with_faults_loses_and_duplicates_no_request(model_dir, offline):
    """Step faults injected while REST (streaming or not) and WebSocket requests run, mixed with
    bad bodies, past-deadline requests and cancels: every id the clients generated gets exactly
    one terminal outcome, the REST answers carry their own id back, completed greedy answers are
    exact, and /metrics counts the same failures the clients saw."""
    import uuid

    # 4 running at a time: a fault fails the running ones, the waiting ones run on after it.
    srv = ServerThread(engine_config(model_dir, speculative_method="ngram", max_num_seqs=4),
                       ServerConfig(port=0, served_model_name=NAME))
    runner = srv.engine.engine.runner
    forward, calls, fired = runner.forward, [0], [0]
    fault_at = {6, 14, 30}  # forward calls (after warm-up) that raise

    def faulty_forward(*a, **kw):
        calls[0] += 1
        if calls[0] in fault_at:
            fired[0] += 1
            raise RuntimeError("injected fault")
        return forward(*a, **kw)

    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(24)]
    want = {p: w.text for p, w in zip(prompts, reference(offline, prompts, 24, ignore_eos=True))}
    kinds: dict[str, str] = {}
    rest: dict[str, dict | bytes] = {}
    ws_bodies: dict[str, dict] = {}
    for i, prompt in enumerate(prompts):
        rid = uuid.uuid4().hex
        body: dict = {"prompt": prompt, "max_tokens": 24, "ignore_eos": True, "temperature": 0}
        kind = ("plain", "stream", "ws", "ws_cancel", "timeout", "bad")[i % 6]
        kinds[rid] = kind
        if kind == "bad":
            rest[rid] = b'{"prompt": "unterminated'
        elif kind == "timeout":
            rest[rid] = {**body, "timeout": 1e-6, "stream": i % 4 == 0}
        elif kind.startswith("ws"):
            ws_bodies[rid] = body
        else:
            rest[rid] = {**body, "stream": kind == "stream"}
    cancel = {rid for rid, k in kinds.items() if k == "ws_cancel"}

    async def run() -> tuple[dict[str, list[str]], str]:
        async with aiohttp.ClientSession() as s:
            ids = list(rest)
            results = await asyncio.gather(
                _websocket(s, srv.url, ws_bodies, cancel),
                *[_rest(s, srv.url, rid, rest[rid]) for rid in ids])
            outcomes = results[0]
            for rid, outcome in zip(ids, results[1:]):
                outcomes.setdefault(rid, []).append(outcome)
            return outcomes, await (await s.get(srv.url + "/metrics")).text()

    runner.forward = faulty_forward
    try:
        outcomes, metrics = asyncio.run(run())
    finally:
        runner.forward = forward
    try:
        # Nothing lost, nothing duplicated: one terminal outcome per id the clients sent.
        assert set(outcomes) == set(kinds)
        assert all(len(v) == 1 for v in outcomes.values()), outcomes
        got = {rid: v[0] for rid, v in outcomes.items()}
        assert fired[0] >= 1
        text_of = {rid: (rest.get(rid) or ws_bodies[rid]) for rid in kinds if kinds[rid] != "bad"}
        for rid, kind in kinds.items():
            outcome = got[rid]
            if kind == "bad":
                assert outcome == "400:invalid_json"
            elif kind == "timeout":
                assert outcome in ("408:request_timeout", "sse_error:request_timeout")
            elif outcome.startswith("200:length:"):  # completed: exact despite the faults
                assert outcome == "200:length:" + want[text_of[rid]["prompt"]]
            else:
                allowed = {"plain": {"500:engine_step_failed"},
                           "stream": {"sse:length", "sse_error:engine_step_failed"},
                           "ws": {"ws:length", "ws_error:engine_step_failed"},
                           "ws_cancel": {"ws:length", "ws:abort",
                                         "ws_error:engine_step_failed"}}[kind]
                assert outcome in allowed, (kind, outcome)
        # /metrics counts what the clients saw.
        count = {o: sum(v == o for v in got.values()) for o in set(got.values())}
        step_errors = sum(n for o, n in count.items() if o.endswith("engine_step_failed"))
        assert step_errors >= 1  # a fault failed someone's step (not only idle forwards)
        assert _metric(metrics, "specserve_engine_step_failures_total") == fired[0]
        assert _metric(metrics, "specserve_requests_total", endpoint="/v1/completions",
                       status="500") == count.get("500:engine_step_failed", 0)
        assert _metric(metrics, "specserve_requests_total", endpoint="/ws:completion",
                       status="500") == count.get("ws_error:engine_step_failed", 0)
        assert _metric(metrics, "specserve_requests_total", endpoint="/v1/completions",
                       status="400") == count["400:invalid_json"]
        assert _metric(metrics, "specserve_request_timeouts_total") == \
            sum(k == "timeout" for k in kinds.values())
        # Afterwards: nothing in flight, every KV block free.
        deadline = time.monotonic() + HANG_S  # only a hang ends the wait
        while (h := http("GET", srv.url + "/health")[1])["num_in_flight"] and \
                time.monotonic() < deadline:
            time.sleep(0.05)
        assert h["status"] == "ok" and h["kv_blocks_free"] == h["kv_blocks_total"], h
    finally:
        srv.stop()
