"""Validation of request bodies, the OpenAPI document at /openapi.json, and a schemathesis run.

The document is checked by openapi-spec-validator; real requests and responses are checked
against its schemas with jsonschema (an implementation independent of msgspec, which generated
them); schemathesis (the real CLI, as a subprocess) then fuzzes every operation in a bounded
quick mode with every check: no 5xx, every response in its documented status and shape (4xx in
OpenAI's error shape), every body the document allows answered 2xx and every body it forbids
4xx (but for what no schema can state: benchmarks/schemathesis_hooks.py), 405s with an Allow
header; afterwards the server is alive with every KV block free.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jsonschema
import pytest
from openapi_spec_validator import validate

from benchmarks.schemathesis_hooks import REPLACED_CHECK
from specserve.server.server_config import ServerConfig
from tests.helpers.servers import HANG_S, KEY, NAME, ServerThread, engine_config, http

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerThread(engine_config(model_dir, speculative_method="ngram"),
                       ServerConfig(port=0, api_key=KEY, served_model_name=NAME))
    yield srv
    srv.stop()


def _schema(doc: dict, name: str) -> jsonschema.Draft202012Validator:
    root = {"$ref": f"#/components/schemas/{name}", "components": doc["components"]}
    return jsonschema.Draft202012Validator(root)


CHAT = {"messages": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Hi "},
                                                  {"type": "text", "text": "there"}]}],
        "max_tokens": 5, "temperature": 0}


@pytest.mark.parametrize("messages,param,words", [
    ([{"role": "wizard", "content": "x"}], "messages[0].role", "developer"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://a/b.png"}}]}],
     "messages[0].content[0]", "images are not supported"),
    ([{"role": "user", "content": [{"type": "audio"}]}], "messages[0].content[0].type", "text"),
    ([{"role": "user", "content": 5}], "messages[0].content", "str"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text", "text"),
])
def test_chat_validation_400_names_the_field(server, messages, param, words):
    status, resp = http("POST", server.url + "/v1/chat/completions",
                        {"messages": messages, "max_tokens": 2})
    assert status == 400, resp
    assert resp["error"]["param"] == param and words in resp["error"]["message"]
    assert resp["error"]["type"] == "invalid_request_error"


def test_every_openai_role_is_accepted(server):
    messages = [{"role": r, "content": "x"} for r in ("system", "developer", "user")]
    messages += [{"role": "assistant", "content": None}, {"role": "tool", "content": "42",
                                                          "tool_call_id": "t1"},
                 {"role": "user", "content": "ok"}]
    status, resp = http("POST", server.url + "/v1/chat/completions",
                        {"messages": messages, "max_tokens": 2})
    # The model's own template decides what it renders; the API accepts every OpenAI role.
    assert status == 200 or resp["error"]["param"] == "messages", resp


def test_openapi_document_is_valid_and_real_traffic_conforms(server):
    status, doc = http("GET", server.url + "/openapi.json", key=None)
    assert status == 200
    validate(doc)  # OpenAPI 3.1 structure, every $ref resolvable
    assert doc["security"] == [{"bearer": []}]  # this server has an API key
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health"):
        assert path in doc["paths"]

    comp = {"prompt": "Hello", "max_tokens": 4, "temperature": 0, "logprobs": 1}
    _schema(doc, "CompletionRequest").validate(comp)
    _schema(doc, "ChatCompletionRequest").validate(CHAT)
    _schema(doc, "ChatCompletionRequest").validate({**CHAT, "stream": True})
    checks = [
        (http("POST", server.url + "/v1/completions", comp), 200, "CompletionResponse"),
        (http("POST", server.url + "/v1/chat/completions", CHAT), 200, "ChatResponse"),
        (http("GET", server.url + "/v1/models"), 200, "ModelList"),
        (http("GET", server.url + "/health", key=None), 200, "HealthResponse"),
        (http("POST", server.url + "/v1/completions", {"prompt": 3}), 400, "ErrorResponse"),
        (http("POST", server.url + "/v1/completions", comp, key="no"), 401, "ErrorResponse"),
    ]
    for (status, body), want, name in checks:
        assert status == want, body
        _schema(doc, name).validate(body)
    # A streamed chat: every SSE event is a ChatChunk.
    import urllib.request

    req = urllib.request.Request(server.url + "/v1/chat/completions", method="POST",
                                 data=json.dumps({**CHAT, "stream": True, "stream_options": {
                                     "include_usage": True}}).encode(),
                                 headers={"Authorization": f"Bearer {KEY}",
                                          "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        events = [line[6:] for line in resp.read().decode().splitlines()
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 3
    for event in events[:-1]:
        _schema(doc, "ChatChunk").validate(json.loads(event))


def test_schemathesis_quick_run(model_dir, tmp_path):
    """schemathesis fuzzes every operation (examples, coverage and fuzzing phases, bounded by
    --max-examples) against a server without an API key."""
    srv = ServerThread(engine_config(model_dir, speculative_method="ngram"),
                       ServerConfig(port=0, served_model_name=NAME))
    try:
        cmd = [os.path.join(os.path.dirname(sys.executable), "schemathesis"), "run",
               srv.url + "/openapi.json", "--max-examples", "12", "--seed", "1", "--workers", "1",
               "--checks", "all", "--exclude-checks", REPLACED_CHECK,  # by its stand-in
               "--request-timeout", str(HANG_S),
               "--max-response-time", str(HANG_S),  # only a hang counts as too slow
               "--no-color", "--generation-database", "none",
               "--suppress-health-check", "all", "--report", "json",
               "--report-json-path", str(tmp_path / "report.json")]
        env = {**os.environ, "SCHEMATHESIS_HOOKS": "benchmarks.schemathesis_hooks",
               "PYTHONPATH": str(ROOT)}
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=6 * HANG_S,
                             cwd=tmp_path, env=env)  # only a hang stops it
        assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
        report = json.loads((tmp_path / "report.json").read_text())
        ops = report["operations"]
        assert ops["tested"] == ops["total"] >= 5 and not ops["errored"], ops
        assert report["test_cases"]["generated"] >= 100 and not report["failures"]
        # Afterwards: alive, nothing in flight, every KV block back in the pool.
        deadline = time.monotonic() + HANG_S  # only a hang ends the wait
        while True:
            status, h = http("GET", srv.url + "/health", key=None)
            if h["num_in_flight"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert status == 200 and h["num_in_flight"] == 0
        assert h["kv_blocks_free"] == h["kv_blocks_total"], h
    finally:
        srv.stop()


def test_vanishing_top_p_and_temperature_are_served(server):
    """schemathesis's first finding (benchmarks/fuzz_api.py): top_p = 5e-324 failed the engine
    step with NaN probabilities (a 500, and every request in that step with it)."""
    for extra in ({"top_p": 5e-324}, {"temperature": 5e-324}):
        status, resp = http("POST", server.url + "/v1/chat/completions",
                            {"messages": [{"role": "developer"}], "max_tokens": 3, **extra})
        assert status == 200, resp
