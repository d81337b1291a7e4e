"""GET /ws: several concurrent requests on one connection, cancel, errors, close aborts all.

Uses the same tiny model and in-thread server as test_server.py; greedy results are compared with
an offline LLMEngine on the same weights.
"""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest

from specserve.server.server_config import ServerConfig
from tests.helpers.servers import (
    HANG_S,
    KEY,
    NAME,
    ServerThread,
    engine_config,
    http,
    reference,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerThread(engine_config(model_dir),
                       ServerConfig(port=0, api_key=KEY, served_model_name=NAME))
    yield srv
    srv.stop()


async def _connect(session: aiohttp.ClientSession, url: str):
    return await session.ws_connect(url.replace("http", "ws") + "/ws",
                                    headers={"Authorization": f"Bearer {KEY}"})


def _wait_blocks_free(url: str) -> dict:
    deadline = time.monotonic() + HANG_S  # only a hang ends the wait
    while True:
        h = http("GET", url + "/health")[1]
        done = h["kv_blocks_free"] == h["kv_blocks_total"] and h["num_in_flight"] == 0
        if done or time.monotonic() > deadline:
            return h
        time.sleep(0.05)


def test_three_concurrent_one_cancelled(server, offline):
    messages = [{"role": "user", "content": "Tell me a story."}]
    want_a = reference(offline, ["The weather today"], 12, ignore_eos=True)[0]
    want_b = reference(offline, [offline.render_chat(messages)], 10, ignore_eos=True)[0]

    async def run() -> dict:
        async with aiohttp.ClientSession() as s:
            ws = await _connect(s, server.url)
            await ws.send_json({"type": "request", "id": "c", "kind": "completion",
                                "prompt": "Count forever:", "max_tokens": 250,
                                "temperature": 0, "ignore_eos": True})
            await ws.send_json({"type": "request", "id": "a", "kind": "completion",
                                "prompt": "The weather today", "max_tokens": 12,
                                "temperature": 0, "ignore_eos": True})
            await ws.send_json({"type": "request", "id": "b", "kind": "chat", "model": NAME,
                                "messages": messages, "max_tokens": 10, "temperature": 0,
                                "ignore_eos": True})
            events: dict[str, list[dict]] = {"a": [], "b": [], "c": []}
            cancelled = False
            while not all(ev and ev[-1]["type"] in ("done", "error") for ev in events.values()):
                msg = json.loads((await ws.receive(timeout=30)).data)
                events[msg["id"]].append(msg)
                if msg["id"] == "c" and msg["type"] == "token" and not cancelled:
                    await ws.send_json({"type": "cancel", "id": "c"})
                    cancelled = True
            await ws.close()
            return events

    events = asyncio.run(run())
    for cid, want in (("a", want_a), ("b", want_b)):
        ev = events[cid]
        tokens = [e for e in ev if e["type"] == "token"]
        done = ev[-1]
        assert done["type"] == "done" and done["finish_reason"] == "length"
        assert "".join(e["text"] for e in tokens) == want.text == done["text"]
        assert sum((e["token_ids"] for e in tokens), []) == want.token_ids
        assert done["usage"]["completion_tokens"] == len(want.token_ids)
        assert done["usage"]["prompt_tokens"] == want.num_prompt_tokens
        assert done["timings"]["ttft_ms"] > 0
    done_c = events["c"][-1]
    assert done_c["type"] == "done" and done_c["finish_reason"] == "abort"
    assert 0 < done_c["usage"]["completion_tokens"] < 250
    h = _wait_blocks_free(server.url)
    assert h["kv_blocks_free"] == h["kv_blocks_total"], h


def test_errors_keep_connection_usable_and_close_aborts(server):
    async def run() -> list[dict]:
        async with aiohttp.ClientSession() as s:
            ws = await _connect(s, server.url)
            await ws.send_str("{not json")
            await ws.send_json({"type": "request", "id": "x", "prompt": "Hi", "top_p": 2})
            await ws.send_json({"type": "request", "id": "y", "kind": "chat", "messages": []})
            await ws.send_json({"type": "request", "id": "z", "prompt": "Hi", "n": 2})
            await ws.send_json({"type": "bogus", "id": "q"})
            got = [json.loads((await ws.receive(timeout=30)).data) for _ in range(5)]
            await ws.send_json({"type": "request", "id": "ok", "prompt": "Hi", "max_tokens": 3,
                                "temperature": 0, "ignore_eos": True})
            while True:
                msg = json.loads((await ws.receive(timeout=30)).data)
                if msg["type"] == "done":
                    got.append(msg)
                    break
            # Two long requests, then drop the connection: both are aborted.
            for cid in ("l1", "l2"):
                await ws.send_json({"type": "request", "id": cid, "prompt": "Go", "max_tokens":
                                    250, "temperature": 0, "ignore_eos": True})
            seen = set()
            while len(seen) < 2:
                seen.add(json.loads((await ws.receive(timeout=30)).data)["id"])
            h = await asyncio.to_thread(lambda: http("GET", server.url + "/health")[1])
            assert h["num_in_flight"] == 2
            await ws.close()
            return got

    got = asyncio.run(run())
    errors = {e["id"]: e["error"] for e in got if e["type"] == "error"}
    assert errors[None]["code"] == "invalid_json"
    assert errors["x"]["param"] == "top_p"
    assert errors["y"]["param"] == "messages"
    assert errors["z"]["param"] == "n"
    assert errors["q"]["param"] == "type"
    assert got[-1]["id"] == "ok" and got[-1]["usage"]["completion_tokens"] == 3
    h = _wait_blocks_free(server.url)
    assert h["kv_blocks_free"] == h["kv_blocks_total"] and h["num_in_flight"] == 0, h


def test_ws_requires_api_key(server):
    async def run() -> int:
        async with aiohttp.ClientSession() as s:
            try:
                await s.ws_connect(server.url.replace("http", "ws") + "/ws")
            except aiohttp.WSServerHandshakeError as err:
                return err.status
            return 101

    assert asyncio.run(run()) == 401
