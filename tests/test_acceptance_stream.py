"""Acceptance in the stream: which tokens and characters came from accepted drafts.

The WebSocket ``token`` message carries ``from_draft`` (per token), ``text_spans`` (runs over its
text) and the running drafted / accepted / verify-step counts. Checked against the request's
own final ``timings`` and text, on the tiny model with the target as its own draft (greedy:
every draft is accepted, so drafts must show up) and with ngram, plus ``TextSources`` alone.
"""

from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest

from specserve.engine.text_sources import TextSources
from specserve.server.server_config import ServerConfig
from tests.helpers.servers import KEY, ServerThread, engine_config


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerThread(
        engine_config(model_dir, draft_model=model_dir, speculative_method="draft",
                      adaptive_speculation=False, num_speculative_tokens=3),
        ServerConfig(port=0, api_key=KEY))
    yield srv
    srv.stop()


def _run(url: str, requests: dict[str, dict], protocols: tuple[str, ...] = ()) -> dict:
    async def go() -> dict[str, list[dict]]:
        headers = {} if protocols else {"Authorization": f"Bearer {KEY}"}
        async with aiohttp.ClientSession() as s:
            ws = await s.ws_connect(url.replace("http", "ws") + "/ws", headers=headers,
                                    protocols=protocols)
            for cid, body in requests.items():
                await ws.send_json({"type": "request", "id": cid, **body})
            events: dict[str, list[dict]] = {cid: [] for cid in requests}
            while not all(e and e[-1]["type"] in ("done", "error") for e in events.values()):
                msg = json.loads((await ws.receive(timeout=60)).data)
                events[msg["id"]].append(msg)
            await ws.close()
            return events

    return asyncio.run(go())


def _check_stream(events: list[dict]) -> tuple[int, str]:
    """Per message: flags align with token ids and spans cover the text exactly; the running
    counts never go down. Returns (tokens flagged as drafts, concatenated text)."""
    tokens = [e for e in events if e["type"] == "token"]
    flagged, text, last = 0, "", (0, 0, 0)
    for e in tokens:
        assert len(e["from_draft"]) == len(e["token_ids"])
        assert sum(n for n, _ in e["text_spans"]) == len(e["text"])
        assert all(n > 0 for n, _ in e["text_spans"])
        counts = (e["num_drafted"], e["num_accepted"], e["num_verify_steps"])
        assert all(a >= b for a, b in zip(counts, last))
        last = counts
        flagged += sum(e["from_draft"])
        text += e["text"]
    return flagged, text


@pytest.mark.e2e
def test_flags_match_timings_draft_vs_plain(server):
    body = {"kind": "completion", "prompt": "The river bends", "max_tokens": 40,
            "temperature": 0, "ignore_eos": True}
    events = _run(server.url, {"spec": {**body, "speculative": {"method": "draft"}},
                               "plain": {**body, "speculative": {"method": "off"}}})
    spec_done, plain_done = events["spec"][-1], events["plain"][-1]
    assert spec_done["type"] == plain_done["type"] == "done"
    flagged, text = _check_stream(events["spec"])
    assert text == spec_done["text"] == plain_done["text"]  # lossless, and fully streamed
    t = spec_done["timings"]
    # No stop cut the output (ignore_eos, length): every accepted draft is a flagged token.
    assert flagged == t["num_accepted"] > 0
    assert t["num_accepted"] == t["num_drafted"]  # the target is its own draft
    assert any(f for e in events["spec"][:-1] for _, f in e["text_spans"])
    plain_flagged, plain_text = _check_stream(events["plain"])
    assert plain_flagged == 0 and plain_text == plain_done["text"]
    assert not any(f for e in events["plain"][:-1] for _, f in e["text_spans"])


@pytest.mark.e2e
def test_spans_survive_a_stop_string(server):
    # Take a stop string from the middle of the plain greedy text: the output is cut inside a
    # verify step's accepted run, and the spans must still cover exactly the text kept.
    base = {"kind": "completion", "prompt": "Once upon a", "max_tokens": 40, "temperature": 0,
            "ignore_eos": True}
    full = _run(server.url, {"p": {**base, "speculative": {"method": "off"}}})["p"][-1]["text"]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), full
    events = _run(server.url, {"s": {**base, "stop": [stop],
                                     "speculative": {"method": "draft"}}})["s"]
    done = events[-1]
    assert done["finish_reason"] == "stop"
    flagged, text = _check_stream(events)
    assert text == done["text"] == full[: full.index(stop)]
    assert flagged <= done["timings"]["num_accepted"]


@pytest.mark.e2e
def test_key_as_websocket_subprotocol(server):
    """Browsers cannot set headers on a WebSocket: the key rides as a subprotocol."""
    body = {"kind": "completion", "prompt": "Hi", "max_tokens": 3, "temperature": 0}
    ok = _run(server.url, {"x": body}, protocols=(f"specserve.bearer.{KEY}",))
    assert ok["x"][-1]["type"] == "done"

    async def wrong() -> int:
        async with aiohttp.ClientSession() as s:
            try:
                await s.ws_connect(server.url.replace("http", "ws") + "/ws",
                                   protocols=("specserve.bearer.nope",))
            except aiohttp.WSServerHandshakeError as exc:
                return exc.status
            return 101

    assert asyncio.run(wrong()) == 401


@pytest.mark.e2e
def test_playground_routes(server):
    import urllib.error
    import urllib.request

    for path in ("/", "/playground"):
        with urllib.request.urlopen(server.url + path, timeout=10) as resp:
            page = resp.read().decode()
        assert resp.headers["Content-Type"].startswith("text/html")
        assert "/playground/static/playground.js" in page
        assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing from the network
    with urllib.request.urlopen(server.url + "/playground/static/playground.js") as resp:
        assert b"WebSocket" in resp.read()
    with pytest.raises(urllib.error.HTTPError) as err:  # the info needs the key like /v1
        urllib.request.urlopen(server.url + "/playground/info", timeout=10)
    assert err.value.code == 401
    req = urllib.request.Request(server.url + "/playground/info",
                                 headers={"Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        info = json.loads(resp.read())
    assert info["methods"] == ["draft", "ngram", "suffix", "auto", "off"]
    assert info["default_method"] == "draft" and info["num_speculative_tokens"] == 3


@pytest.mark.parametrize("steps", [
    [(5, False), (9, True), (12, False)],
    [(4, True), (4, True), (10, False)],
])
def test_text_sources_runs(steps):
    src, expect = TextSources(), []
    for end, flag in steps:
        src.extend(end, flag)
        expect += [flag] * (end - len(expect))
    total = len(expect)
    for a in range(total + 1):
        for b in range(a, total + 1):
            got = [f for n, f in src.spans(a, b) for _ in range(n)]
            assert got == expect[a:b]
    for cut in range(total, -1, -1):
        src.truncate(cut)
        assert [f for n, f in src.spans(0, cut) for _ in range(n)] == expect[:cut]
        assert src.length == cut
