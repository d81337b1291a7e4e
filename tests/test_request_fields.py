"""Every OpenAI request field through the real HTTP server (raw, the openai client, the
WebSocket): refused fields and unknown fields get a 400 naming them, metadata is accepted and
ignored, the sampling controls reach the engine (the server's answers equal the offline
engine's on the same weights), and a 405 names the allowed methods."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from specserve.core.sampling_params import SamplingParams
from specserve.server import protocol as P
from specserve.server.refusals import REFUSED
from specserve.server.server_config import ServerConfig
from tests.helpers.servers import KEY, NAME, ServerThread, engine_config, http

pytestmark = pytest.mark.e2e

CHAT = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
        "temperature": 0}
COMP = {"model": NAME, "prompt": "Hi", "max_tokens": 3, "temperature": 0}

# A value each refused field does not accept (any non-null value but the harmless ones).
BAD_VALUE = {"function_call": "auto", "modalities": ["text", "audio"], "best_of": 2,
             "echo": True, "audio": {"voice": "alloy", "format": "wav"},
             "functions": [{"name": "f"}]}
# The harmless values, accepted.
GOOD_VALUE = {"function_call": "none", "modalities": ["text"], "best_of": 1, "echo": False}


def _cases():
    for field in REFUSED:
        for kind, struct, base in (("chat", P.ChatCompletionRequest, CHAT),
                                   ("completions", P.CompletionRequest, COMP)):
            if field in struct.__struct_fields__:
                yield pytest.param(kind, base, field, id=f"{kind}-{field}")


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerThread(engine_config(model_dir, speculative_method="ngram"),
                       ServerConfig(port=0, api_key=KEY, served_model_name=NAME))
    yield srv
    srv.stop()


def _url(server, kind: str) -> str:
    return server.url + ("/v1/chat/completions" if kind == "chat" else "/v1/completions")


def test_the_table_covers_openai_fields():
    """The fields OpenAI documents and this server does not implement are all in the table."""
    for field in ("audio", "modalities", "functions", "function_call", "suffix", "best_of"):
        assert field in REFUSED
    for field in ("tools", "tool_choice", "parallel_tool_calls", "tool_calls"):  # implemented
        assert field not in REFUSED


@pytest.mark.parametrize("kind,base,field", list(_cases()))
def test_each_refused_field_is_a_400_naming_it(server, kind, base, field):
    status, resp = http("POST", _url(server, kind), {**base, field: BAD_VALUE.get(field, "x")})
    assert status == 400, resp
    err = resp["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error"
    assert field in err["message"] and ":" in err["message"]  # names it, then says what to do
    if field in GOOD_VALUE:  # the harmless value passes
        status, resp = http("POST", _url(server, kind), {**base, field: GOOD_VALUE[field]})
        assert status == 200, resp
    status, resp = http("POST", _url(server, kind), {**base, field: None})  # null: not set
    assert status == 200, resp


@pytest.mark.parametrize("field", ["function_call", "audio", "colour"])
def test_refused_and_unknown_message_fields(server, field):
    msg = {"role": "assistant", "content": "ok", field: [{"id": "c1", "type": "function"}]}
    status, resp = http("POST", _url(server, "chat"),
                        {**CHAT, "messages": [CHAT["messages"][0], msg]})
    assert status == 400 and resp["error"]["param"] == f"messages[1].{field}", resp


@pytest.mark.parametrize("kind,base", [("chat", CHAT), ("completions", COMP)])
def test_unknown_fields_are_a_400_naming_them(server, kind, base):
    for body, param in (({**base, "temprature": 0.5}, "temprature"),
                        ({**base, "stream_options": {"include_usage": True, "x": 1}},
                         "stream_options.x"),
                        ({**base, "speculative": {"method": "off", "k": 2}}, "speculative.k")):
        status, resp = http("POST", _url(server, kind), body)
        assert status == 400, resp
        assert resp["error"]["param"] == param and "unknown field" in resp["error"]["message"]


@pytest.mark.parametrize("kind,base", [("chat", CHAT), ("completions", COMP)])
def test_metadata_is_accepted_and_ignored(server, kind, base):
    meta = {"user": "u1", "metadata": {"k": "v"}, "store": True, "service_tier": "auto",
            "prompt_cache_key": "p", "safety_identifier": "s"}
    plain = http("POST", _url(server, kind), base)
    tagged = http("POST", _url(server, kind), {**base, **meta})
    assert plain[0] == tagged[0] == 200, tagged
    text = "message" if kind == "chat" else "text"
    get = (lambda r: r["choices"][0]["message"]["content"]) if text == "message" else (
        lambda r: r["choices"][0]["text"])
    assert get(plain[1]) == get(tagged[1])


def test_openai_client_gets_the_400(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=NAME, messages=CHAT["messages"], max_tokens=3,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
            tool_choice={"type": "function", "function": {"name": "f"}})
    assert err.value.body["param"] in ("tools", "tool_choice")
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=NAME, prompt="Hi", max_tokens=3,
                                  extra_body={"guided_json": {"type": "object"}})
    assert err.value.body["param"] == "guided_json"


def test_sampling_controls_reach_the_engine(server, offline):
    """logit_bias and the penalties through the openai client answer what the offline engine
    answers with the same SamplingParams (and differ from the unpenalized answer)."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    prompt = "The cat sat on the mat. The cat sat on the"
    kw = dict(presence_penalty=1.5, frequency_penalty=0.7)
    first = offline.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0,
                                                      ignore_eos=True))[0].token_ids[0]
    want = offline.generate([prompt], SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias={first: -100.0},
        repetition_penalty=1.2, **kw))[0]
    got = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=12, temperature=0, logit_bias={str(first): -100},
        extra_body={"ignore_eos": True, "repetition_penalty": 1.2}, **kw)
    assert got.choices[0].text == want.text
    forced = client.completions.create(model=NAME, prompt=prompt, max_tokens=4, temperature=1,
                                       logit_bias={str(first): 100},
                                       extra_body={"ignore_eos": True})
    assert forced.choices[0].text == offline.tokenizer.decode([first] * 4)


@pytest.mark.parametrize("body,param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),  # the tiny model's vocabulary is 49152
])
def test_out_of_range_controls_400(server, body, param):
    status, resp = http("POST", _url(server, "completions"), {**COMP, **body})
    assert status == 400 and resp["error"]["param"] == param, resp


def test_websocket_refuses_the_same_fields(server):
    async def run() -> list[dict]:
        async with aiohttp.ClientSession() as s, s.ws_connect(
                server.url.replace("http", "ws") + "/ws",
                headers={"Authorization": f"Bearer {KEY}"}) as ws:
            out = []
            tools = [{"type": "function", "function": {"name": "f"}}]
            for i, extra in enumerate(({"tools": tools},
                                       {"wat": 1}, {"presence_penalty": 0.5})):
                await ws.send_str(json.dumps({"type": "request", "id": str(i), "kind": "chat",
                                              **CHAT, **extra}))
                while True:
                    msg = json.loads((await ws.receive()).data)
                    if msg["type"] in ("error", "done"):
                        out.append(msg)
                        break
            return out

    refused, unknown, ok = asyncio.run(run())
    assert refused["type"] == "error" and refused["error"]["param"] == "tools"
    assert "WebSocket" in refused["error"]["message"]
    assert unknown["type"] == "error" and unknown["error"]["param"] == "wat"
    assert ok["type"] == "done"


def test_405_names_the_allowed_methods(server):
    status, _ = http("DELETE", server.url + "/v1/completions")
    import urllib.error
    import urllib.request

    req = urllib.request.Request(server.url + "/v1/models", method="POST", data=b"{}",
                                 headers={"Authorization": f"Bearer {KEY}"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=60)
    assert status == 405 and err.value.code == 405
    assert "GET" in err.value.headers["Allow"]
