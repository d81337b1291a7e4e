"""The server end to end: a real aiohttp server on 127.0.0.1 and a free port, driven by the official
``openai`` client (sync and async) and raw HTTP, on a tiny random Llama saved with the default
model's real tokenizer (vocab 49152, hidden 32, 2 layers: fast on 2 CPU cores).

Greedy outputs are compared with an offline ``LLMEngine`` on the same weights.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time

import aiohttp
import openai
import pytest

from specserve.engine.async_engine import AsyncEngine
from specserve.server.server_config import ServerConfig
from tests.helpers.servers import (
    GOOD,
    HANG_S,
    KEY,
    NAME,
    PROMPTS,
    ServerThread,
    engine_config,
    http,
    reference,
    wait_healthy,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerThread(
        engine_config(model_dir, speculative_method="ngram", adaptive_speculation=False),
        ServerConfig(port=0, api_key=KEY, served_model_name=NAME, max_body_bytes=32 * 1024),
    )
    yield srv
    srv.stop()


def test_openai_sync_completions(server, offline):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    ref = reference(offline, PROMPTS[:2], 12, ignore_eos=True)
    for prompt, want in zip(PROMPTS[:2], ref):
        got = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0,
                                        extra_body={"ignore_eos": True})
        assert got.choices[0].text == want.text
        assert got.choices[0].finish_reason == "length"
        assert got.usage.prompt_tokens == want.num_prompt_tokens
        assert got.usage.completion_tokens == 12
        assert got.model == NAME and got.object == "text_completion"
        assert got.model_extra["timings"]["ttft_ms"] > 0

        chunks = list(client.completions.create(
            model=NAME, prompt=prompt, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        body, usage = chunks[:-1], chunks[-1]
        assert all(c.id == body[0].id and c.object == "text_completion" and c.created
                   and c.model == NAME for c in chunks)
        assert "".join(c.choices[0].text for c in body) == want.text
        assert [c.choices[0].finish_reason for c in body][-1] == "length"
        assert all(c.choices[0].finish_reason is None for c in body[:-1])
        assert usage.choices == [] and usage.usage.completion_tokens == 12
        assert usage.usage.prompt_tokens == want.num_prompt_tokens
    # token-id prompts and n > 1 (distinct sequences; greedy, so equal)
    ids = offline.encode(PROMPTS[0])
    got = client.completions.create(model=NAME, prompt=ids, max_tokens=12, temperature=0, n=2,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in got.choices] == [ref[0].text] * 2
    assert got.usage.completion_tokens == 24


def test_openai_async_chat(server, offline):
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    prompt = offline.render_chat(messages)
    want = reference(offline, [prompt], 10, ignore_eos=True)[0]

    async def run() -> None:
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY)
        got = await client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=10, temperature=0,
            extra_body={"ignore_eos": True})
        assert got.choices[0].message.content == want.text
        assert got.choices[0].message.role == "assistant"
        assert got.usage.prompt_tokens == want.num_prompt_tokens
        stream = await client.chat.completions.create(
            model=NAME, messages=messages, max_completion_tokens=10, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            logprobs=True, top_logprobs=2)
        chunks = [c async for c in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == want.text
        finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
        assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
        n_lp = sum(len(c.choices[0].logprobs.content) for c in chunks
                   if c.choices and c.choices[0].logprobs)
        assert n_lp == 10
        assert chunks[-1].usage.total_tokens == want.num_prompt_tokens + 10
        await client.close()

    asyncio.run(run())


async def _stream_text(session, url: str, body: dict, key: str = KEY,
                       on_first=None) -> tuple[str, str]:
    """The streamed text and finish reason; ``on_first()`` runs when the first chunk arrives."""
    headers = {"Authorization": f"Bearer {key}"}
    text, reason = [], None
    async with session.post(url + "/v1/completions", json={**body, "stream": True},
                            headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            if on_first is not None and not text:
                on_first()
            text.append(choice["text"])
            reason = choice["finish_reason"] or reason
    return "".join(text), reason


def test_32_concurrent_streams_exact(server, offline):
    prompts = [f"{PROMPTS[i % 4]} {i}" for i in range(32)]
    want = reference(offline, prompts, 8, ignore_eos=True)

    async def run():
        async with aiohttp.ClientSession() as s:
            return await asyncio.gather(*[
                _stream_text(s, server.url, {"prompt": p, "max_tokens": 8, "temperature": 0,
                                             "ignore_eos": True}) for p in prompts])

    got = asyncio.run(run())
    assert [g[0] for g in got] == [w.text for w in want]
    assert all(g[1] == "length" for g in got)


def test_speculative_ab_same_greedy_text(server):
    body = {"model": NAME, "prompt": "a b c a b c a b", "max_tokens": 48, "temperature": 0,
            "ignore_eos": True}
    texts = {}
    for method in ("off", "ngram"):
        status, resp = http("POST", server.url + "/v1/completions",
                            {**body, "speculative": {"method": method, "num_tokens": 3}})
        assert status == 200, resp
        texts[method] = resp["choices"][0]["text"]
        if method == "ngram":
            assert resp["timings"]["num_drafted"] > 0
    assert texts["off"] == texts["ngram"]


BAD = [
    ({"model": NAME, "max_tokens": 2}, "prompt"),
    ({**GOOD, "max_tokens": 0}, "max_tokens"),
    ({**GOOD, "max_tokens": -1}, "max_tokens"),
    ({**GOOD, "top_p": 2}, "top_p"),
    ({**GOOD, "temperature": -0.5}, "temperature"),
    ({**GOOD, "temperature": "hot"}, "temperature"),
    ({**GOOD, "speculative": {"method": "magic"}}, "speculative.method"),
    ({**GOOD, "speculative": {"method": "draft"}}, "speculative.method"),
    ({**GOOD, "prompt": "word " * 300}, "prompt"),
    ({**GOOD, "prompt": "Hi", "max_tokens": 256}, "max_tokens"),
    ({**GOOD, "n": 0}, "n"),
    ({**GOOD, "echo": True}, "echo"),
    ({**GOOD, "prompt": [1, 99999999]}, "prompt"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_completion_inputs_400(server, body, param):
    status, resp = http("POST", server.url + "/v1/completions", body)
    assert status == 400, resp
    err = resp["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert http("POST", server.url + "/v1/completions", GOOD)[0] == 200


def test_other_errors_and_recovery(server):
    url = server.url
    cases = [
        (http("POST", url + "/v1/completions", raw=b'{"prompt": "x",'), 400, None),
        (http("POST", url + "/v1/chat/completions", {"model": NAME, "messages": []}), 400,
         "messages"),
        (http("POST", url + "/v1/chat/completions", {"messages": [{"content": "x"}]}), 400,
         "messages[0].role"),
        (http("POST", url + "/v1/completions", {**GOOD, "model": "gpt-9"}), 404, "model"),
        (http("POST", url + "/v1/completions", GOOD, key=None), 401, None),
        (http("POST", url + "/v1/completions", GOOD, key="wrong"), 401, None),
        (http("POST", url + "/v1/completions", {**GOOD, "prompt": "x" * 40000}), 413, None),
        (http("GET", url + "/v1/nothing"), 404, None),
    ]
    for (status, resp), want_status, param in cases:
        assert status == want_status, resp
        assert resp["error"]["message"] and resp["error"]["param"] == param
    status, resp = http("POST", url + "/v1/completions", GOOD)
    assert status == 200 and resp["choices"][0]["finish_reason"] in ("length", "stop")


def _health(url: str) -> dict:
    return http("GET", url + "/health", key=None)[1]


def test_disconnect_mid_stream_frees_blocks(server):
    async def run() -> None:
        async with aiohttp.ClientSession() as s:
            resp = await s.post(server.url + "/v1/completions", headers={
                "Authorization": f"Bearer {KEY}"}, json={**GOOD, "max_tokens": 200,
                                                          "stream": True, "ignore_eos": True})
            n = 0
            async for line in resp.content:
                n += line.startswith(b"data: ")
                if n == 3:
                    break
            h = await asyncio.to_thread(_health, server.url)
            assert h["num_in_flight"] == 1 and h["kv_blocks_free"] < h["kv_blocks_total"]
            resp.close()  # drop the connection mid-stream

    asyncio.run(run())
    deadline = time.monotonic() + HANG_S  # only a hang ends the wait
    while time.monotonic() < deadline:
        h = _health(server.url)
        if h["kv_blocks_free"] == h["kv_blocks_total"] and h["num_in_flight"] == 0:
            break
        time.sleep(0.05)
    assert h["kv_blocks_free"] == h["kv_blocks_total"], h
    assert h["num_in_flight"] == 0 and h["num_running"] == 0


def test_models_health_metrics(server):
    status, models = http("GET", server.url + "/v1/models")
    assert status == 200 and models["data"][0]["id"] == NAME
    assert openai.OpenAI(base_url=server.url + "/v1", api_key=KEY).models.list().data[0].id == NAME
    status, h = http("GET", server.url + "/health", key=None)
    assert status == 200 and h["status"] == "ok" and h["kv_blocks_total"] == 1024
    http("POST", server.url + "/v1/completions", GOOD)
    status, text = http("GET", server.url + "/metrics", key=None)
    assert status == 200
    for series in ("specserve_requests_total", "specserve_time_to_first_token_seconds_bucket",
                   "specserve_inter_token_latency_seconds_bucket",
                   "specserve_time_per_output_token_seconds_bucket",
                   "specserve_e2e_request_latency_seconds_bucket",
                   "specserve_num_requests_waiting", "specserve_num_requests_running",
                   "specserve_kv_blocks_used", "specserve_kv_blocks_free",
                   "specserve_prefix_cache_hit_rate", "specserve_spec_decode_draft_tokens_total",
                   "specserve_spec_decode_accepted_tokens_total"):
        assert series in text, series
    assert 'specserve_requests_total{endpoint="/v1/completions",status="200"}' in text
    assert 'status="400"' in text


class GatedEngine(AsyncEngine):
    """Warm-up waits for the test to open the gate (to observe /health before ready)."""

    gate = threading.Event()

    def _warmup(self) -> None:
        self.gate.wait(HANG_S)
        super()._warmup()


def test_health_503_until_warm_and_queue_full_429(model_dir):
    srv = ServerThread(engine_config(model_dir, max_num_seqs=1),
                       ServerConfig(port=0, max_queue_len=1, served_model_name=NAME),
                       GatedEngine, wait=False)
    try:
        status, h = http("GET", srv.url + "/health")
        assert status == 503 and h["status"] == "warming_up"
        status, resp = http("POST", srv.url + "/v1/completions", GOOD, key=None)
        assert status == 503 and resp["error"]["code"] == "not_ready"
        GatedEngine.gate.set()
        srv._call(srv.engine.wait_ready(HANG_S), HANG_S + 10)
        assert http("GET", srv.url + "/health")[0] == 200

        async def run():
            async with aiohttp.ClientSession() as s:
                long = {**GOOD, "model": None, "max_tokens": 150, "ignore_eos": True}
                tasks = [asyncio.create_task(s.post(srv.url + "/v1/completions", json=long))
                         for _ in range(2)]
                while srv.engine.num_unfinished < 2:
                    await asyncio.sleep(0.01)
                async with s.post(srv.url + "/v1/completions", json=GOOD) as r:
                    third = r.status, await r.json()
                firsts = [await t for t in tasks]
                return third, [r.status for r in firsts]

        (status, resp), firsts = asyncio.run(run())
        assert status == 429 and resp["error"]["code"] == "queue_full", resp
        assert firsts == [200, 200]
        assert http("POST", srv.url + "/v1/completions", GOOD)[0] == 200
    finally:
        GatedEngine.gate.set()
        srv.stop()


def test_cli_serve_sigterm_aborts_in_flight_and_exits_0(model_dir, unused_tcp_port):
    port = unused_tcp_port
    cmd = [sys.executable, "-m", "specserve", "serve", "--model", model_dir, "--port", str(port),
           "--dtype", "float32", "--num-kv-blocks", "256", "--block-size", "4",
           "--max-model-len", "256", "--served-model-name", NAME]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url)

        async def run() -> tuple[str, str]:
            async with aiohttp.ClientSession() as s:
                # SIGTERM on the first chunk: a fixed sleep let a fast CPU finish all 240
                # tokens first
                return await _stream_text(s, url, {**GOOD, "max_tokens": 240, "ignore_eos": True},
                                          on_first=lambda: proc.send_signal(signal.SIGTERM))

        text, reason = asyncio.run(run())
        assert reason == "abort" and text
        out, err = proc.communicate(timeout=HANG_S)
        assert proc.returncode == 0, err.decode()
        lines = [json.loads(x) for x in out.decode().splitlines() if x.startswith("{")]
        done = [x for x in lines if x.get("event") == "request"]
        assert len(done) == 1 and done[0]["finish_reasons"] == ["abort"]
        assert done[0]["completion_tokens"] > 0 and "ttft_ms" in done[0]["timings"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def unused_tcp_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_n_streaming_logprobs_and_default_chat_length(server, offline):
    want = reference(offline, [PROMPTS[2]], 6, ignore_eos=True)[0]

    async def run() -> list[dict]:
        async with aiohttp.ClientSession() as s:
            async with s.post(server.url + "/v1/completions", headers={
                    "Authorization": f"Bearer {KEY}"}, json={
                    "prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0, "n": 2,
                    "stream": True, "ignore_eos": True, "logprobs": 2}) as resp:
                return [json.loads(line[6:]) async for line in resp.content
                        if line.startswith(b"data: {")]

    chunks = asyncio.run(run())
    for i in range(2):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == want.text
        assert mine[-1]["finish_reason"] == "length"
        tokens = sum((c["logprobs"]["tokens"] for c in mine if c["logprobs"]), [])
        assert len(tokens) == 6
        assert all(len(c["logprobs"]["top_logprobs"][0]) <= 2 for c in mine if c["logprobs"]
                   and c["logprobs"]["tokens"])
    # Chat without max_tokens runs to the end of the context window, not past it.
    status, resp = http("POST", server.url + "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Hi"}], "temperature": 0, "ignore_eos": True})
    assert status == 200, resp
    assert resp["usage"]["total_tokens"] == 256 and resp["choices"][0]["finish_reason"] == "length"


class BrokenEngine(AsyncEngine):
    """The engine thread dies (an error no step handler catches): requests must fail with 503,
    not hang. (An ordinary exception in a step fails only that step: see test_faults.py.)"""

    def _loop_body(self) -> None:
        def step():
            raise SystemExit("boom")

        self.engine.step = step
        super()._loop_body()


def test_engine_failure_fails_requests_instead_of_hanging(model_dir):
    srv = ServerThread(engine_config(model_dir), ServerConfig(port=0, served_model_name=NAME),
                       BrokenEngine)
    try:
        status, resp = http("POST", srv.url + "/v1/completions", GOOD)
        assert status == 503 and "boom" in resp["error"]["message"]
        status, h = http("GET", srv.url + "/health")
        assert status == 503 and h["status"] == "failed"
    finally:
        srv.stop()
