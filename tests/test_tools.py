"""Tool calling through the chat endpoint: forced calls (``required`` / a named function) whose
arguments validate with jsonschema against the tool's schema, streamed and not, under every
speculation method, greedy speculation token-identical to speculation off; ``auto`` answers
parsed into ``tool_calls`` (the model's text scripted with a choice constraint); streamed
deltas, read by the openai client, reassembling to exactly the non-streamed calls; tool
messages round-tripping through the SmolLM2 template and a Qwen-style (Hermes) one; and each
refused combination a 400 naming its field.

The Hermes template is tests/fixtures/hermes_template.jinja (written for these tests, in the
shape of Qwen2.5's); the tiny model speaks the default model's tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import openai
import pytest

from specserve.core.config import EngineConfig
from specserve.core.sampling_params import SamplingParams, SpeculativeParams
from specserve.core.structured import StructuredSpec
from specserve.core.tool_syntax import ToolSyntax
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.tokenizer import apply_chat_template
from specserve.server import protocol as P
from specserve.server.server_config import ServerConfig
from specserve.server.tool_parsers import parse
from tests.helpers.servers import KEY, NAME, ServerThread, engine_config, http
from tests.helpers.tiny_models import build_tiny_model, default_tokenizer, tiny_config

HERMES = (Path(__file__).parent / "fixtures" / "hermes_template.jinja").read_text()
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 12},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8},
                                         "h24": {"type": "boolean"}},
        "required": ["zone", "h24"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MSGS = [{"role": "user", "content": "What is the weather in Paris, and the time?"}]
METHODS = ["off", "ngram", "suffix", "auto"]


@pytest.fixture(scope="module")
def hermes_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("hermes_model")
    tok = default_tokenizer()
    tok.chat_template = HERMES
    cfg = tiny_config(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    build_tiny_model(path, cfg, tokenizer=tok)
    return str(path)


@pytest.fixture(scope="module")
def engine(hermes_model):
    return LLMEngine(engine_config(hermes_model, max_model_len=1024, adaptive_speculation=False,
                                   num_speculative_tokens=4))


@pytest.fixture(scope="module")
def server(hermes_model):
    srv = ServerThread(engine_config(hermes_model, max_model_len=1024, speculative_method="auto",
                                     adaptive_speculation=False),
                       ServerConfig(port=0, api_key=KEY, served_model_name=NAME))
    yield srv
    srv.stop()


def _check_calls(calls: list[tuple[str, str]], names: set[str], at_most: int | None = None):
    """Each call names an offered function and its arguments validate against its schema."""
    assert calls, "no tool call"
    assert all(isinstance(c, tuple) and len(c) == 2 for c in calls)
    if at_most is not None:
        assert len(calls) <= at_most
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def _check_forced_end(reason: str, content: str | None, parallel: bool) -> None:
    """A forced answer is calls only; with parallel calls a random tiny model may keep calling
    until max_tokens cuts its last call, which then stays unparsed (content)."""
    if parallel and reason == "length":
        assert content and content.startswith("<tool_call>") and "</tool_call>" not in content
    else:
        assert reason in ("stop", "tool_calls") and not content, (reason, content)


def _forced(tools: list[tuple[str, dict]], parallel: bool) -> StructuredSpec:
    return StructuredSpec("structural_tag",
                          ToolSyntax("hermes").structural_tag(tools, parallel, {}), "tools")


# ---- the engine: forced calls under speculation ---------------------------------------------


@pytest.mark.parametrize("method", METHODS[1:])
def test_forced_calls_identical_with_speculation(engine, method):
    prompt = engine.render_chat(MSGS, TOOLS)
    specs = [_forced([("get_weather", WEATHER), ("get_time", TIME)], True),
             _forced([("get_weather", WEATHER), ("get_time", TIME)], False),
             _forced([("get_time", TIME)], False)]
    params = [SamplingParams(max_tokens=200, temperature=0.0, structured=s) for s in specs]
    plain = engine.generate([prompt] * 3, params, SpeculativeParams(method="off"))
    outs = engine.generate([prompt] * 3, params, SpeculativeParams(method=method))
    for i, (out, ref) in enumerate(zip(outs, plain, strict=True)):
        assert out.token_ids == ref.token_ids, (method, i)
        msg = parse("hermes", out.text)
        _check_forced_end(out.finish_reason, msg.content, i == 0)
        names = {"get_time"} if i == 2 else set(SCHEMAS)
        _check_calls([(c.name, c.arguments) for c in msg.calls], names,
                     None if i == 0 else 1)
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


@pytest.mark.parametrize("syntax", ["mistral", "mistral_args", "llama3"])
def test_forced_calls_in_every_syntax(engine, syntax):
    """The structural tag of each call syntax forces calls that its parser reads back, the
    arguments valid under their schema, greedy identical with speculation (the markers are
    text here: this tokenizer has no special tokens for them)."""
    prompt = engine.render_chat(MSGS, TOOLS)
    fns = [("get_weather", WEATHER), ("get_time", TIME)]
    for parallel in (False, True):
        spec = StructuredSpec("structural_tag",
                              ToolSyntax(syntax).structural_tag(fns, parallel, {}), "tools")
        params = SamplingParams(max_tokens=160, temperature=0.0, structured=spec)
        (plain,) = engine.generate([prompt], params, SpeculativeParams(method="off"))
        (spec_out,) = engine.generate([prompt], params, SpeculativeParams(method="suffix"))
        assert spec_out.token_ids == plain.token_ids, (syntax, parallel)
        msg = parse(syntax, plain.text)
        if parallel and plain.finish_reason == "length":
            assert msg.calls or msg.content  # a random model may call until cut off
            continue
        assert plain.finish_reason == "stop" and not msg.content, (plain.text, msg)
        _check_calls([(c.name, c.arguments) for c in msg.calls], set(SCHEMAS),
                     None if parallel else 1)
    assert engine.block_manager.num_free_blocks == engine.config.num_kv_blocks


# ---- the server -----------------------------------------------------------------------------


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)


def _streamed(chunks) -> tuple[str | None, list[tuple[str, str, str]], str | None]:
    """(content, [(id, name, arguments)], finish_reason) reassembled from openai's chunks."""
    content, calls, reason = "", {}, None
    for c in chunks:
        if not c.choices:
            continue
        delta = c.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.id is not None:  # a call's first delta: id, type, name
                assert tc.type == "function" and tc.function.name
                calls[tc.index] = [tc.id, tc.function.name, tc.function.arguments or ""]
            else:
                calls[tc.index][2] += tc.function.arguments or ""
        reason = c.choices[0].finish_reason or reason
    return content or None, [tuple(calls[i]) for i in sorted(calls)], reason


@pytest.mark.e2e
@pytest.mark.parametrize("method", METHODS)
def test_server_forced_calls_validate(server, method):
    client = _client(server)
    for choice, names, at_most in (
            ("required", set(SCHEMAS), None),
            ({"type": "function", "function": {"name": "get_weather"}}, {"get_weather"}, 1)):
        for parallel in (True, False):
            kw = dict(model=NAME, messages=MSGS, tools=TOOLS, tool_choice=choice,
                      parallel_tool_calls=parallel, max_tokens=200, temperature=0,
                      extra_body={"speculative": {"method": method}})
            got = client.chat.completions.create(**kw)
            choice0 = got.choices[0]
            msg = choice0.message
            cut = parallel and at_most is None
            _check_forced_end(choice0.finish_reason, msg.content, cut)
            calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls]
            _check_calls(calls, names, at_most if parallel else 1)
            assert all(c.id.startswith("call_") and c.type == "function"
                       for c in msg.tool_calls)
            content, streamed, reason = _streamed(client.chat.completions.create(
                **kw, stream=True))
            assert (content, reason) == (msg.content, choice0.finish_reason)
            assert [(n, a) for _, n, a in streamed] == calls  # greedy: the same calls
            assert len({i for i, _, _ in streamed}) == len(streamed)


@pytest.mark.e2e
@pytest.mark.parametrize("method", ["off", "ngram", "suffix"])
def test_server_forced_greedy_equals_speculation_off(server, method):
    body = {"model": NAME, "messages": MSGS, "tools": TOOLS, "tool_choice": "required",
            "max_tokens": 200, "temperature": 0, "logprobs": True}
    answers = []
    for m in ("off", method):
        status, reply = http("POST", server.url + "/v1/chat/completions",
                             {**body, "speculative": {"method": m}})
        assert status == 200, reply
        answers.append(reply["choices"][0])
    tokens = [[t["token"] for t in a["logprobs"]["content"]] for a in answers]
    assert tokens[0] == tokens[1]
    calls = [[(c["function"]["name"], c["function"]["arguments"])
              for c in a["message"]["tool_calls"]] for a in answers]
    assert calls[0] == calls[1]


SCRIPTED = {
    "call": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
             '"unit": "celsius"}}\n</tool_call>'),
    "text_then_calls": ('Checking now.\n<tool_call>\n{"name": "get_weather", "arguments": '
                        '{"city": "Paris", "unit": "celsius"}}\n</tool_call>\n<tool_call>\n'
                        '{"name": "get_time", "arguments": {"zone": "CET", "h24": true}}\n'
                        "</tool_call>"),
    "malformed": '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>',
    "text": "It is sunny in Paris.",
}


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(SCRIPTED))
@pytest.mark.parametrize("method", ["off", "suffix"])
def test_server_auto_parses_the_answer(server, case, method):
    """The model's answer is scripted (a choice constraint of one string), so the parser sees
    known text through the whole server; streamed and not give the same message."""
    text = SCRIPTED[case]
    ref = parse("hermes", text)
    client = _client(server)
    kw = dict(model=NAME, messages=MSGS, tools=TOOLS, max_tokens=200, temperature=0,
              extra_body={"structured_outputs": {"choice": [text]},
                          "speculative": {"method": method}})
    got = client.chat.completions.create(**kw).choices[0]
    want_calls = [(c.name, c.arguments) for c in ref.calls]
    calls = [(c.function.name, c.function.arguments) for c in got.message.tool_calls or []]
    assert calls == want_calls
    assert got.finish_reason == ("tool_calls" if want_calls else "stop")
    assert got.message.content == (ref.content or None if want_calls else text)
    if case == "text_then_calls":
        assert got.message.content == "Checking now." and len(calls) == 2
    content, streamed, reason = _streamed(client.chat.completions.create(**kw, stream=True))
    assert (content, reason) == (got.message.content, got.finish_reason)
    assert [(n, a) for _, n, a in streamed] == calls
    # parallel_tool_calls false: the first call only
    one = client.chat.completions.create(**kw, parallel_tool_calls=False).choices[0]
    assert [(c.function.name, c.function.arguments)
            for c in one.message.tool_calls or []] == want_calls[:1]


@pytest.mark.e2e
def test_tool_choice_none_renders_no_tools(server, engine):
    client = _client(server)
    got = client.chat.completions.create(model=NAME, messages=MSGS, tools=TOOLS,
                                         tool_choice="none", max_tokens=5, temperature=0)
    plain = client.chat.completions.create(model=NAME, messages=MSGS, max_tokens=5,
                                           temperature=0)
    assert got.choices[0].message.tool_calls is None
    assert got.usage.prompt_tokens == plain.usage.prompt_tokens
    with_tools = client.chat.completions.create(model=NAME, messages=MSGS, tools=TOOLS,
                                                max_tokens=5, temperature=0)
    prompt = engine.render_chat(MSGS, TOOLS)
    assert with_tools.usage.prompt_tokens == len(engine.encode(prompt))


# ---- tool messages into the template --------------------------------------------------------

CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
]


def _messages(conversation) -> list[dict]:
    req = P.decode_request(json.dumps({"messages": conversation, "tools": TOOLS}).encode(),
                           P.ChatCompletionRequest)
    return P.chat_messages(req)


def test_tool_messages_render_through_the_hermes_template():
    tok = default_tokenizer()
    tok.chat_template = HERMES
    rendered = apply_chat_template(tok, _messages(CONVERSATION), tools=TOOLS)
    # the reference: the same template on the messages as transformers documents them
    # (arguments as an object), rendered by transformers directly
    ref_msgs = json.loads(json.dumps(CONVERSATION))
    ref_msgs[1]["content"] = ""
    ref_msgs[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "unit": "celsius"}
    assert rendered == tok.apply_chat_template(ref_msgs, tools=TOOLS, tokenize=False,
                                               add_generation_prompt=True)
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
            '"celsius"}}\n</tool_call>') in rendered
    assert '<tool_response>\n{"temp": 21}\n</tool_response>' in rendered
    assert json.dumps(TOOLS[0]) in rendered  # the tools, as the template writes them


def test_tool_messages_render_through_the_smollm2_template():
    """SmolLM2's template knows no tools, yet a conversation with tool messages still renders
    (each message's content, in order)."""
    tok = default_tokenizer()
    rendered = apply_chat_template(tok, _messages(CONVERSATION))
    assert "<|im_start|>tool\n{\"temp\": 21}<|im_end|>" in rendered
    assert "<|im_start|>assistant\n<|im_end|>" in rendered


@pytest.mark.e2e
def test_server_round_trip_conversation(server, engine):
    status, reply = http("POST", server.url + "/v1/chat/completions",
                         {"model": NAME, "messages": CONVERSATION, "tools": TOOLS,
                          "max_tokens": 4, "temperature": 0})
    assert status == 200, reply
    prompt = engine.render_chat(_messages(CONVERSATION), TOOLS)
    assert reply["usage"]["prompt_tokens"] == len(engine.encode(prompt))


# ---- 400s -----------------------------------------------------------------------------------


@pytest.mark.e2e
@pytest.mark.parametrize("fields,param", [
    ({"tools": TOOLS, "n": 2}, "n"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools[2].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f",
                                                  "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"function_call": "auto"}, "function_call"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": CONVERSATION[1]["tool_calls"]}]},
     "messages[0].tool_calls"),
])
def test_refused_tool_requests_400(server, fields, param):
    body = {"model": NAME, "messages": MSGS, "max_tokens": 4, **fields}
    status, reply = http("POST", server.url + "/v1/chat/completions", body)
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply


@pytest.mark.e2e
def test_template_without_tools_is_a_400(model_dir):
    """The default model's template (SmolLM2's) renders no tools: a request with tools is a 400
    naming tools and saying why; without tools, tool messages are fine."""
    srv = ServerThread(engine_config(model_dir),
                       ServerConfig(port=0, api_key=KEY, served_model_name=NAME))
    try:
        status, reply = http("POST", srv.url + "/v1/chat/completions",
                             {"model": NAME, "messages": MSGS, "tools": TOOLS, "max_tokens": 4})
        assert status == 400 and reply["error"]["param"] == "tools", reply
        assert "does not render tools" in reply["error"]["message"]
        status, reply = http("POST", srv.url + "/v1/chat/completions",
                             {"model": NAME, "messages": CONVERSATION, "max_tokens": 4})
        assert status == 200, reply
    finally:
        srv.stop()


@pytest.mark.e2e
def test_chat_template_flag_gives_a_model_tools(model_dir):
    """--chat-template replaces the model's template: the same model whose own template renders
    no tools serves a forced call once given the Hermes template file."""
    template = Path(__file__).parent / "fixtures" / "hermes_template.jinja"
    srv = ServerThread(engine_config(model_dir, max_model_len=512, chat_template=str(template)),
                       ServerConfig(port=0, api_key=KEY, served_model_name=NAME))
    try:
        assert srv.engine.engine.tokenizer.chat_template == HERMES
        prompt = srv.engine.engine.render_chat(MSGS, TOOLS)
        assert "<tools>" in prompt and "get_weather" in prompt  # the file's tool block
        body = {"model": NAME, "messages": MSGS, "tools": TOOLS, "max_tokens": 120,
                "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
        status, reply = http("POST", srv.url + "/v1/chat/completions", body)
        assert status == 200, reply
        message = reply["choices"][0]["message"]
        if reply["choices"][0]["finish_reason"] == "tool_calls":
            (call,) = message["tool_calls"]
            assert call["function"]["name"] == "get_time"
            jsonschema.validate(json.loads(call["function"]["arguments"]), TIME)
        else:  # a random tiny model may run out of tokens inside the forced call
            assert reply["choices"][0]["finish_reason"] == "length", reply
    finally:
        srv.stop()


def test_chat_template_file_must_exist(model_dir, tmp_path):
    from specserve.core.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="chat template file not found"):
        LLMEngine(engine_config(model_dir, chat_template=str(tmp_path / "missing.jinja")))


# ---- the default model ----------------------------------------------------------------------


@pytest.mark.slow
def test_default_model_forced_calls_validate():
    """The default model with a Hermes template: forced calls validate, and greedy speculation
    gives the same tokens as speculation off."""
    engine = LLMEngine(EngineConfig(dtype="float32", max_model_len=1024))
    engine.tokenizer.chat_template = HERMES
    prompt = engine.render_chat(MSGS, TOOLS)
    specs = [_forced([("get_weather", WEATHER), ("get_time", TIME)], True),
             _forced([("get_time", TIME)], False)]
    params = [SamplingParams(max_tokens=120, temperature=0.0, structured=s) for s in specs]
    plain = engine.generate([prompt] * 2, params, SpeculativeParams(method="off"))
    for i, out in enumerate(plain):
        assert out.finish_reason == "stop", out.text
        msg = parse("hermes", out.text)
        _check_calls([(c.name, c.arguments) for c in msg.calls],
                     set(SCHEMAS) if i == 0 else {"get_time"})
    for method in ("ngram", "suffix", "draft", "auto"):
        outs = engine.generate([prompt] * 2, params, SpeculativeParams(method=method))
        assert [o.token_ids for o in outs] == [o.token_ids for o in plain], method


@pytest.mark.e2e
def test_openapi_states_the_tool_rules(server):
    """The document of a server whose template takes tools: valid, a forced-call body and a
    round-trip conversation valid by it, the bodies the server refuses invalid by it (n > 1
    with tools, a forced choice without tools or beside response_format, tool_calls on a user
    message); real answers, streamed and not, conform."""
    from openapi_spec_validator import validate

    status, doc = http("GET", server.url + "/openapi.json")
    assert status == 200
    validate(doc)
    root = {"components": doc["components"]}

    def schema(name):
        return jsonschema.Draft202012Validator(
            {"$ref": f"#/components/schemas/{name}", **root})

    req = schema("ChatCompletionRequest")
    forced = {"messages": MSGS, "tools": TOOLS, "tool_choice": "required", "max_tokens": 200,
              "parallel_tool_calls": False}
    req.validate(forced)
    req.validate({"messages": CONVERSATION, "tools": TOOLS, "n": 2, "tool_choice": "none"})
    for bad in ({**forced, "n": 2}, {"messages": MSGS, "tool_choice": "required"},
                {**forced, "response_format": {"type": "json_object"}},
                {"messages": [{"role": "user", "content": "x",
                               "tool_calls": CONVERSATION[1]["tool_calls"]}]}):
        assert not req.is_valid(bad), bad
        status, reply = http("POST", server.url + "/v1/chat/completions", bad)
        assert status == 400, reply
    status, reply = http("POST", server.url + "/v1/chat/completions",
                         {**forced, "temperature": 0})
    assert status == 200 and reply["choices"][0]["message"]["tool_calls"], reply
    schema("ChatResponse").validate(reply)
    import urllib.request

    body = json.dumps({**forced, "temperature": 0, "stream": True}).encode()
    r = urllib.request.Request(server.url + "/v1/chat/completions", data=body, method="POST",
                               headers={"Authorization": f"Bearer {KEY}",
                                        "Content-Type": "application/json"})
    with urllib.request.urlopen(r, timeout=120) as resp:
        events = [line[6:] for line in resp.read().decode().splitlines()
                  if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    for chunk in chunks:
        schema("ChatChunk").validate(chunk)
    assert any(c["choices"] and c["choices"][0]["delta"].get("tool_calls") for c in chunks)
