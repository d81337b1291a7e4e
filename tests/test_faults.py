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

from specserve.server_config import ServerConfig
from tests.test_server import (  # noqa: F401  (model_dir / offline are fixtures)
    NAME,
    PROMPTS,
    ServerThread,
    engine_config,
    http,
    model_dir,
    offline,
    reference,
    wait_healthy,
)


def test_forward_exception_fails_that_step_and_serving_goes_on(model_dir, offline):  # noqa: F811
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
        deadline = time.monotonic() + 10
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
from specserve.engine import LLMEngine

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


def test_dead_engine_thread_fails_streams_and_the_process_exits_1(model_dir, tmp_path):  # noqa: F811
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
                async with s.get(url + "/health") as h:  # within the 1 s grace
                    return h.status, (await h.json())["status"]

        health = asyncio.run(run())
        assert events[-1] == "[DONE]" and "engine failed" in events[-2], events[-3:]
        assert health == (503, "failed")
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 1, err.decode()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
