"""Text work runs off the hot threads: chat templates and prompt tokenization run on the engine's
text worker, never on the event loop or the engine thread, so a huge prompt being tokenized does
not stall the other streams.

Deterministic by construction (no timing thresholds): the tokenizer is held inside a big prompt's
encode until another stream has finished completely, which can only happen if the engine kept
stepping meanwhile. The latency effect is measured in benchmarks/probes/big_prompt_itl.py.
"""

from __future__ import annotations

import asyncio
import json
import threading

import aiohttp
import pytest

from specserve.server.server_config import ServerConfig
from tests.helpers.servers import NAME, ServerThread, engine_config

pytestmark = pytest.mark.e2e


def test_big_prompt_tokenizes_off_the_engine_thread_while_streams_run(model_dir):
    srv = ServerThread(engine_config(model_dir),
                       ServerConfig(port=0, served_model_name=NAME, max_body_bytes=2 << 20))
    tok = srv.engine.engine.tokenizer
    threads: dict[str, set[str]] = {"encode": set(), "template": set()}
    inside_big, release = threading.Event(), threading.Event()
    encode, template = tok.encode, tok.apply_chat_template
    big = "lorem ipsum " * ((1 << 20) // 12)  # ~1 MiB

    def traced_encode(text, *a, **kw):
        threads["encode"].add(threading.current_thread().name)
        if len(text) > 500_000:
            inside_big.set()
            assert release.wait(120), "the other stream never finished"
        return encode(text, *a, **kw)

    def traced_template(*a, **kw):
        threads["template"].add(threading.current_thread().name)
        return template(*a, **kw)

    tok.encode, tok.apply_chat_template = traced_encode, traced_template
    # Hold the engine after a few steps of the chat stream until the big encode has begun, so
    # the stream is provably mid-flight when the big prompt arrives.
    engine = srv.engine.engine
    step, steps = engine.step, [0]

    def gated_step():
        steps[0] += 1
        if steps[0] == 4:
            assert inside_big.wait(60), "the big prompt never reached the tokenizer"
        return step()

    engine.step = gated_step

    async def run() -> tuple[int, str, str, int]:
        async with aiohttp.ClientSession() as s:
            text, reason, after = "", "", 0
            async with s.post(srv.url + "/v1/chat/completions", json={
                    "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 40,
                    "ignore_eos": True, "stream": True}) as resp:
                big_req = asyncio.create_task(s.post(srv.url + "/v1/completions", json={
                    "prompt": big, "max_tokens": 4}))
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        choice = json.loads(line[6:])["choices"][0]
                        text += choice["delta"].get("content") or ""
                        reason = choice["finish_reason"] or reason
                        after += inside_big.is_set()
            # The stream finished while the big prompt's encode was still held.
            release.set()
            big_resp = await big_req
            return big_resp.status, reason, text, after

    try:
        status, reason, text, after = asyncio.run(run())
    finally:
        release.set()
        tok.encode, tok.apply_chat_template = encode, template
        engine.step = step
        srv.stop()
    assert reason == "length" and text and after > 10  # chunks that came during the big encode
    assert status == 400  # ~260k tokens do not fit the tiny model's 256-token window
    loop_thread = srv.thread.name
    for kind, names in threads.items():
        assert names and all(n.startswith("specserve-text") for n in names), (kind, names)
        assert loop_thread not in names and "specserve-engine" not in names
