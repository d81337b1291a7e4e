"""A real server in the test process (its own event-loop thread, a free port), raw HTTP, and the
engine settings the server tests share.

Waits here only catch hangs: they are sized far above what the work takes on a loaded machine,
and never decide whether a test passes.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from aiohttp import web

from specserve.core.config import EngineConfig
from specserve.core.sampling_params import SamplingParams
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.llm_engine import LLMEngine
from specserve.server.app import create_app
from specserve.server.server_config import ServerConfig

KEY = "test-key"
NAME = "tiny"
PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "Once upon a"]
GOOD = {"model": NAME, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
HANG_S = 300  # no step of the tiny model comes near this, however busy the machine


def engine_config(path: str, **kw) -> EngineConfig:
    cfg = dict(model=path, dtype="float32", block_size=4, num_kv_blocks=1024, max_model_len=256)
    cfg.update(kw)
    return EngineConfig(**cfg)


class ServerThread:
    """A real server on its own event loop thread (so sync clients can call it from the test)."""

    def __init__(self, engine_cfg: EngineConfig, server_cfg: ServerConfig,
                 async_engine_cls: type[AsyncEngine] = AsyncEngine, wait: bool = True) -> None:
        self.engine = async_engine_cls(LLMEngine(engine_cfg), server_cfg.max_queue_len)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        app = create_app(self.engine, server_cfg, engine_cfg.model)
        self.runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=5)
        self._call(self._start(server_cfg.host))
        if wait:
            self._call(self.engine.wait_ready(HANG_S), HANG_S + 10)

    async def _start(self, host: str) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://{host}:{port}"

    def _call(self, coro, timeout: float = HANG_S):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self._call(self.runner.cleanup())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def http(method: str, url: str, body: object = None, raw: bytes | None = None,
         key: str | None = KEY) -> tuple[int, dict | str]:
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=HANG_S) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def wait_healthy(url: str, timeout: float = HANG_S) -> None:
    """Polls a server in another process until /health answers 200."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if http("GET", url + "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.2)
    pytest.fail("server never became ready")


def reference(engine: LLMEngine, prompts, max_tokens: int, **kw) -> list:
    """The offline engine's greedy outputs: what the server must answer."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)
    return engine.generate(prompts, params)
