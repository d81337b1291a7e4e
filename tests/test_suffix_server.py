"""Suffix decoding and ``auto`` over HTTP: greedy text equals plain decoding, two API keys are two
tenants (key B never gets drafts built from key A's outputs), an unknown method is a 400 that
names ``speculative.method`` and lists the known methods."""

from __future__ import annotations

import pytest

from specserve.server.server_config import ServerConfig
from tests.helpers.servers import NAME, ServerThread, engine_config, http

pytestmark = pytest.mark.e2e

KEY_A, KEY_B = "key-a", "key-b"


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerThread(
        engine_config(model_dir, speculative_method="suffix", adaptive_speculation=False),
        ServerConfig(port=0, api_key=[KEY_A, KEY_B], served_model_name=NAME),
    )
    yield srv
    srv.stop()


def complete(server, key: str, prompt, method: str | None = None, max_tokens: int = 40):
    body = {"model": NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True}
    if method is not None:
        body["speculative"] = {"method": method}
    status, resp = http("POST", server.url + "/v1/completions", body, key=key)
    assert status == 200, resp
    return resp["choices"][0]["text"], resp["timings"]


@pytest.mark.parametrize("method", ["suffix", "auto"])
def test_greedy_text_equals_plain(server, method):
    prompt = "x = [1, 2, 3]\ny = [1, 2, 3]\nz = [1, 2,"
    plain, _ = complete(server, KEY_A, prompt, "off")
    for _ in range(2):  # the second run also drafts from the global cache
        text, timings = complete(server, KEY_A, prompt, method)
        assert text == plain
    assert timings["num_drafted"] > 0


def test_two_api_keys_are_two_tenants(server):
    prompt = [101, 2002, 3003, 4004, 5005, 6006, 7007]  # no repeats: drafts need the cache
    _, first_a = complete(server, KEY_A, prompt)
    text_a, second_a = complete(server, KEY_A, prompt)  # A's own earlier output is cached
    text_b, first_b = complete(server, KEY_B, prompt)  # B must not draft from it
    assert text_a == text_b
    assert second_a["num_accepted"] > first_a["num_accepted"] + 10
    assert (first_b["num_drafted"], first_b["num_accepted"]) == (first_a["num_drafted"],
                                                                 first_a["num_accepted"])
    status, _ = http("POST", server.url + "/v1/completions",
                     {"model": NAME, "prompt": "Hi", "max_tokens": 2}, key="key-c")
    assert status == 401


def test_unknown_method_is_a_400_naming_the_field(server):
    status, resp = http("POST", server.url + "/v1/completions",
                        {"model": NAME, "prompt": "Hi", "max_tokens": 2,
                         "speculative": {"method": "medusa"}}, key=KEY_B)
    assert status == 400
    assert resp["error"]["param"] == "speculative.method"
    assert "suffix" in resp["error"]["message"] and "auto" in resp["error"]["message"]
