"""Predicted Outputs over HTTP: the ``prediction`` field on chat and completions (the official
``openai`` client's own argument), the answer equal to plain decoding's, the usage counts
(non-streaming and in the final streamed chunk) equal to an LCS computed here, and 400s that
name the field."""

from __future__ import annotations

import json
import urllib.request

import openai
import pytest

from specserve.server.server_config import ServerConfig
from tests.helpers.servers import HANG_S, KEY, NAME, ServerThread, engine_config, http, reference
from tests.test_prediction import reference_lcs

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def server(model_dir):
    srv = ServerThread(engine_config(model_dir),
                       ServerConfig(port=0, api_key=KEY, served_model_name=NAME))
    yield srv
    srv.stop()


def _edited(text: str) -> str:
    """The answer with a word inserted in its middle (a stale file)."""
    words = text.split(" ")
    mid = len(words) // 2
    return " ".join(words[:mid] + ["inserted"] + words[mid:])


def _details(offline, prediction: str, completion_ids: list[int]) -> dict:
    pred = offline.encode(prediction)
    accepted = reference_lcs(pred, completion_ids)
    return {"accepted_prediction_tokens": accepted,
            "rejected_prediction_tokens": len(pred) - accepted}


def _sse(url: str, body: dict) -> list[dict]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {KEY}")
    with urllib.request.urlopen(req, timeout=HANG_S) as resp:
        lines = resp.read().decode().splitlines()
    return [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]


def test_chat_with_a_prediction_answers_as_plain_and_reports_counts(server, offline):
    messages = [{"role": "user", "content": "Rewrite the file."}]
    want = reference(offline, [offline.render_chat(messages)], 40, ignore_eos=True)[0]
    prediction = _edited(want.text)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    got = client.chat.completions.create(
        model=NAME, messages=messages, max_tokens=40, temperature=0,
        prediction={"type": "content", "content": prediction}, extra_body={"ignore_eos": True})
    assert got.choices[0].message.content == want.text
    details = got.usage.completion_tokens_details
    assert details.model_dump(exclude_none=True) == _details(offline, prediction, want.token_ids)
    assert details.accepted_prediction_tokens > 0
    assert got.model_extra["timings"]["num_accepted"] > 0  # the prediction's drafts were used
    # content as text parts; streamed: the counts come in the final usage chunk
    body = {"model": NAME, "messages": messages, "max_tokens": 40, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "prediction": {"type": "content", "content": [
                {"type": "text", "text": prediction[:10]}, {"type": "text",
                                                            "text": prediction[10:]}]}}
    chunks = _sse(server.url + "/v1/chat/completions", body)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == want.text
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens_details"] == _details(
        offline, prediction, want.token_ids)
    # without a prediction there are no prediction counts
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=4,
                                           temperature=0)
    assert plain.usage.completion_tokens_details is None


def test_completions_with_a_prediction(server, offline):
    prompt = "def fibonacci(n):"
    want = reference(offline, [prompt], 30, ignore_eos=True)[0]
    prediction = want.text
    status, body = http("POST", server.url + "/v1/completions", {
        "model": NAME, "prompt": prompt, "max_tokens": 30, "temperature": 0, "ignore_eos": True,
        "n": 2, "prediction": {"type": "content", "content": prediction},
        "speculative": {"method": "prediction"}})
    assert status == 200, body
    assert [c["text"] for c in body["choices"]] == [want.text] * 2
    one = _details(offline, prediction, want.token_ids)
    assert body["usage"]["completion_tokens_details"] == {k: 2 * v for k, v in one.items()}


@pytest.mark.parametrize("prediction, param", [
    ({"type": "file", "content": "x"}, "prediction.type"),
    ({"content": "x"}, "prediction.type"),
    ({"type": "content", "content": 5}, "prediction.content"),
    ({"type": "content", "content": [{"type": "image_url", "image_url": {"url": "u"}}]},
     "prediction.content[0].type"),
    ("some text", "prediction"),
    ({"type": "content", "content": "word " * 400}, "prediction"),  # longer than the context
])
def test_bad_predictions_are_400_naming_the_field(server, prediction, param):
    for path, body in (("/v1/chat/completions",
                        {"messages": [{"role": "user", "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        status, err = http("POST", server.url + path,
                           {"model": NAME, "max_tokens": 4, "prediction": prediction, **body})
        assert status == 400, err
        assert err["error"]["param"] == param, err
    status, err = http("POST", server.url + "/v1/completions", {
        "model": NAME, "prompt": "hi", "speculative": {"method": "prediction"}})
    assert status == 400 and err["error"]["param"] == "speculative.method", err
