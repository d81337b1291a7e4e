"""Deadlines: a request's ``timeout`` field and ``--request-timeout``.

Deterministic by construction, with no wall-clock bounds: a deadline of a microsecond has always
passed by the time the engine could answer 200 tokens (ignore_eos), whichever phase it strikes
in; and the mid-stream cases move the deadline to "now" right after admission while the engine's
forward is held until the deadline's abort has been sent, so the stream cannot finish first.
Each case checks the outcome the client sees, that every KV block is back in the block manager's
pool, and the timeout counter in /metrics.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import aiohttp
import pytest

from specserve.server.app import APP_KEY
from specserve.server.server_config import ServerConfig
from tests.helpers.servers import NAME, PROMPTS, ServerThread, engine_config, http, reference

LONG = {"prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerThread(engine_config(model_dir, speculative_method="ngram"),
                       ServerConfig(port=0, served_model_name=NAME))
    yield srv
    srv.stop()


def _timeouts(srv: ServerThread) -> float:
    text = http("GET", srv.url + "/metrics", key=None)[1]
    line = next(x for x in text.splitlines() if x.startswith("specserve_request_timeouts_total"))
    return float(line.split()[-1])


def _drained(srv: ServerThread) -> dict:
    """/health once nothing is in flight; every KV block must be free in the block manager."""
    deadline = time.monotonic() + 30
    while (h := http("GET", srv.url + "/health", key=None)[1])["num_in_flight"] and \
            time.monotonic() < deadline:
        time.sleep(0.02)
    assert h["num_in_flight"] == 0, h
    bm = srv.engine.engine.block_manager
    while bm.num_free_blocks != bm.num_blocks and time.monotonic() < deadline:
        time.sleep(0.02)  # the engine thread applies the last abort before its next wait
    assert bm.num_free_blocks == bm.num_blocks, (bm.num_free_blocks, bm.num_blocks)
    return h


class _MidStream:
    """Makes the next request's deadline pass right after its admission, and holds the engine's
    forward passes (after the first ``free_forwards``) until that deadline's abort was sent."""

    def __init__(self, srv: ServerThread, free_forwards: int = 2) -> None:
        self.srv, self.server = srv, srv.runner.app[APP_KEY]
        self.aborted = threading.Event()
        self.runner = srv.engine.engine.runner
        self._admit, self._forward = self.server.admit, self.runner.forward
        self._abort = srv.engine.abort
        calls = [0]

        async def admit(job, tenant=""):
            streams = await self._admit(job, tenant)
            job.deadline.at = asyncio.get_running_loop().time()  # passes now, mid-stream
            return streams

        def abort(request_id: str) -> None:
            self.aborted.set()
            self._abort(request_id)

        def forward(*a, **kw):
            calls[0] += 1
            if calls[0] > free_forwards:
                assert self.aborted.wait(60), "the deadline never aborted the request"
            return self._forward(*a, **kw)

        self.server.admit, srv.engine.abort, self.runner.forward = admit, abort, forward

    def __enter__(self) -> _MidStream:
        return self

    def __exit__(self, *exc: object) -> None:
        del self.server.admit, self.srv.engine.abort
        self.runner.forward = self._forward


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", LONG),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200,
                              "ignore_eos": True}),
])
@pytest.mark.e2e
def test_tiny_timeout_is_a_408_and_frees_blocks(server, path, body):
    before = _timeouts(server)
    status, resp = http("POST", server.url + path, {**body, "timeout": 1e-6})
    assert status == 408, resp
    err = resp["error"]
    assert err["code"] == "request_timeout" and err["param"] == "timeout"
    assert err["type"] == "timeout_error" and "abort" in err["message"]
    _drained(server)
    assert _timeouts(server) == before + 1


@pytest.mark.e2e
def test_streaming_deadline_ends_with_abort_then_an_error_event(server):
    before = _timeouts(server)

    async def run() -> list:
        events: list = []
        async with aiohttp.ClientSession() as s:
            with _MidStream(server):
                async with s.post(server.url + "/v1/completions",
                                  json={**LONG, "stream": True, "timeout": 600}) as r:
                    assert r.status == 200
                    async for line in r.content:
                        if line.startswith(b"data: "):
                            data = line[6:].strip().decode()
                            events.append(data if data == "[DONE]" else json.loads(data))
        return events

    events = asyncio.run(run())
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert err["code"] == "request_timeout" and err["type"] == "timeout_error"
    chunks = events[:-2]
    assert chunks and chunks[-1]["choices"][0]["finish_reason"] == "abort"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) < 200
    _drained(server)
    assert _timeouts(server) == before + 1
    metrics = http("GET", server.url + "/metrics", key=None)[1]
    assert 'specserve_sequences_finished_total{finish_reason="abort"}' in metrics


@pytest.mark.e2e
def test_websocket_deadline_ends_with_one_error_and_no_done(server):
    before = _timeouts(server)

    async def run() -> list[dict]:
        async with aiohttp.ClientSession() as s:
            ws = await s.ws_connect(server.url.replace("http", "ws") + "/ws")
            msgs: list[dict] = []
            with _MidStream(server):
                await ws.send_json({"type": "request", "id": "a", **LONG, "timeout": 600})
                while not msgs or msgs[-1]["type"] == "token":
                    msgs.append(await ws.receive_json(timeout=60))
            # the connection stays usable: a request with a roomy timeout completes
            await ws.send_json({"type": "request", "id": "b", **LONG, "max_tokens": 4,
                                "timeout": 600})
            while msgs[-1]["id"] != "b" or msgs[-1]["type"] == "token":
                msgs.append(await ws.receive_json(timeout=60))
            await ws.close()
            return msgs

    msgs = asyncio.run(run())
    a = [m for m in msgs if m["id"] == "a"]
    assert [m["type"] for m in a if m["type"] != "token"] == ["error"], a
    assert a[-1]["error"]["code"] == "request_timeout"
    b = [m for m in msgs if m["id"] == "b"]
    assert b[-1]["type"] == "done" and b[-1]["finish_reason"] == "length"
    _drained(server)
    assert _timeouts(server) == before + 1


@pytest.mark.parametrize("value", [0, -1, "soon", 1e7])
@pytest.mark.e2e
def test_timeout_field_is_validated(server, value):
    status, resp = http("POST", server.url + "/v1/completions", {**LONG, "timeout": value})
    assert status == 400 and resp["error"]["param"] == "timeout", resp


@pytest.mark.e2e
def test_server_request_timeout_and_the_field_overrides_it(model_dir, offline):
    srv = ServerThread(engine_config(model_dir), ServerConfig(port=0, served_model_name=NAME,
                                                              request_timeout=1e-6))
    try:
        status, resp = http("POST", srv.url + "/v1/completions", LONG)
        assert status == 408 and resp["error"]["code"] == "request_timeout", resp
        want = reference(offline, [PROMPTS[0]], 8)[0]
        status, resp = http("POST", srv.url + "/v1/completions",
                            {**LONG, "max_tokens": 8, "ignore_eos": False, "timeout": 600})
        assert status == 200 and resp["choices"][0]["text"] == want.text, resp
        _drained(srv)
        assert _timeouts(srv) == 1
    finally:
        srv.stop()


@pytest.mark.parametrize("value", ["0", "-5"])
def test_cli_request_timeout_must_be_positive(value, capsys):
    from specserve import cli

    assert cli.main(["serve", "--request-timeout", value]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: request-timeout must be in (0, 1e6]"), err
