"""Tool-call parsing on fixed model outputs, one syntax at a time (several calls, text before and
between, malformed JSON left as text), the syntax read from the template source, and the
streaming parser: fed in every chunking, its deltas reassemble to exactly the final parse."""

from __future__ import annotations

import json
import random

import pytest

from specserve.core.errors import InvalidRequestError
from specserve.core.tool_syntax import ToolSyntax
from specserve.server.tool_parsers import ParsedCall, parse
from specserve.server.tool_stream import ToolCallStream, final_message

WEATHER = ParsedCall("get_weather", '{"city": "Paris"}')
TIME = ParsedCall("get_time", '{"zone": "UTC", "h24": true}')

CASES = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
         None, [WEATHER]),
        ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
         '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC", '
         '"h24": true}}\n</tool_call>', "Let me check.", [WEATHER, TIME]),
        # the closing tag cut off by the end of the answer: still a call
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}', None, [WEATHER]),
        # malformed JSON: the block stays in the content, the good call is parsed
        ('<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>'
         '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC", "h24": true}}'
         '</tool_call>',
         '<tool_call>{"name": "get_weather", "arguments": {"city": }</tool_call>', [TIME]),
        ("No tools needed: 2 < 3 and <tool is not a tag.",
         "No tools needed: 2 < 3 and <tool is not a tag.", []),
        ('<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',  # no name: not a call
         '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>', []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
         '{"name": "get_time", "arguments": {"zone": "UTC", "h24": true}}]', None,
         [WEATHER, TIME]),
        ('Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]',
         "Sure.", [WEATHER]),
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par',
         '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Par', []),
        ("Just text.", "Just text.", []),
    ],
    "mistral_args": [
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', None, [WEATHER]),
        ('Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time'
         '[CALL_ID]a1B2c3D4e[ARGS] {"zone": "UTC", "h24": true}', "Checking.", [WEATHER, TIME]),
        # malformed arguments stay text; the call after them is read
        ('[TOOL_CALLS]get_weather[ARGS]{"city": }[TOOL_CALLS]get_time[ARGS]{"zone": "UTC", '
         '"h24": true}', '[TOOL_CALLS]get_weather[ARGS]{"city": }', [TIME]),
        ('[TOOL_CALLS]get weather[ARGS]{"city": "Paris"}',  # a name with a space: not a call
         '[TOOL_CALLS]get weather[ARGS]{"city": "Paris"}', []),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Par',
         '[TOOL_CALLS]get_weather[ARGS]{"city": "Par', []),
        ("[TOOL_CALLS]get_weath", "[TOOL_CALLS]get_weath", []),
    ],
    "llama3": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, [WEATHER]),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
         '{"name": "get_time", "parameters": {"zone": "UTC", "h24": true}}', None,
         [WEATHER, TIME]),
        ('{"answer": 42}', '{"answer": 42}', []),  # JSON, but not a call
        ('{"name": "get_weather", "parameters": {"city": "Paris"', None, None),  # cut: text
        ("The weather is fine.", "The weather is fine.", []),
    ],
}


def _cases():
    for syntax, cases in CASES.items():
        for i, case in enumerate(cases):
            yield pytest.param(syntax, *case, id=f"{syntax}-{i}")


@pytest.mark.parametrize("syntax,text,content,calls", list(_cases()))
def test_parse_fixed_outputs(syntax, text, content, calls):
    msg = parse(syntax, text)
    if calls is None:  # unfinished JSON: the whole answer is content
        assert msg.calls == [] and msg.content == text
        return
    assert msg.calls == calls
    assert msg.content == (content or "")
    for call in msg.calls:
        assert isinstance(json.loads(call.arguments), dict)


@pytest.mark.parametrize("syntax,text,content,calls", list(_cases()))
def test_stream_reassembles_to_the_final_parse(syntax, text, content, calls):
    """Fed in random chunks (and one character at a time), the content deltas and calls sent
    equal the non-streamed parse, and no partial parse ever sends what the final one lacks."""
    want = final_message(syntax, text)
    rng = random.Random(0)
    chunkings = [[1] * len(text)] + [
        [rng.randint(1, 6) for _ in range(len(text))] for _ in range(5)]
    for sizes in chunkings:
        stream, pos, content_out, calls_out = ToolCallStream(syntax), 0, "", []
        for size in sizes:
            if pos >= len(text):
                break
            piece, pos = text[pos:pos + size], pos + size
            delta, new = stream.feed(piece, final=False)
            content_out += delta
            calls_out += [c for _, _, c in new]
            assert want.content.startswith(content_out)
            assert want.calls[:len(calls_out)] == calls_out
        delta, new = stream.feed("", final=True)
        content_out += delta
        calls_out += [c for _, _, c in new]
        assert content_out == want.content and calls_out == want.calls
        assert len(set(stream.ids)) == len(calls_out)
        assert all(i.startswith("call_") for i in stream.ids)


def test_at_most_one_call_when_not_parallel():
    text = CASES["hermes"][1][0]
    assert final_message("hermes", text, max_calls=1).calls == [WEATHER]
    stream = ToolCallStream("hermes", max_calls=1)
    _, new = stream.feed(text, final=True)
    assert [c for _, _, c in new] == [WEATHER]


HERMES_SRC = "{% for t in tools %}{{ t | tojson }}{% endfor %}<tool_call></tool_call>"


@pytest.mark.parametrize("source,want", [
    (HERMES_SRC, "hermes"),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
     "[TOOL_CALLS]", "mistral"),
    ('{% if tools %}{"name": function name, "parameters": dict}{{ tools }}{% endif %}'
     "<|python_tag|>", "llama3"),
    ("{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
     "[TOOL_CALLS]{{ call.name }}[ARGS]{{ call.arguments | tojson }}", "mistral_args"),
    ({"default": "{{ messages }}", "tool_use": HERMES_SRC}, "hermes"),
])
def test_syntax_from_the_template(source, want):
    assert ToolSyntax.of_template(source).name == want


@pytest.mark.parametrize("source,why", [
    ("{% for m in messages %}{{ m.content }}<tool_call>{% endfor %}", "does not render tools"),
    ("{% for t in tools %}{{ t }}{% endfor %}<function=x>", "does not parse"),
    (None, "no chat template"),
])
def test_templates_without_tool_support_are_refused(source, why):
    with pytest.raises(InvalidRequestError) as err:
        ToolSyntax.of_template(source).check()
    assert err.value.param == "tools" and why in err.value.message
