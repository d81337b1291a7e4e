"""Reading tool calls out of a model's text, one parser per call syntax (``tool_syntax.py``).

``parse(syntax, text, final)`` splits the text into content pieces and calls, in order. With
``final`` False (a stream, text still arriving) it returns only what later text cannot change:
an unfinished call, and text that may be the start of one (a prefix of ``<tool_call>``), are
held back, and so is trailing whitespace (it is dropped where a call follows). What a partial
parse returns is always a prefix of the final parse (its content a prefix of the final content,
its calls the first of the final calls), so a stream's deltas reassemble to exactly the
non-streamed message.

The rules, the same in every syntax:
- a call is a complete block whose JSON parses as ``{"name": str, "arguments"|"parameters":
  ...}``; its ``arguments`` are re-encoded as JSON text (a string value is kept as sent);
- a block that is not a call (malformed JSON, no name, unclosed at the end) stays in the
  content as the model wrote it;
- whitespace between content and a call is dropped.

Hermes/Qwen: ``<tool_call>{json}</tool_call>`` blocks anywhere in the text (the closing tag may
be missing at the very end). Mistral: ``[TOOL_CALLS]`` then a JSON array of calls, or (the newer
form) ``[TOOL_CALLS]name[ARGS]{arguments}`` for each call. Llama 3.x: the
whole answer is calls (``{"name": .., "parameters": ..}`` objects split by ``;``, optionally after
``<|python_tag|>``); an answer that does not start that way is content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from specserve.core.tool_syntax import (
    HERMES_BEGIN,
    HERMES_END,
    MISTRAL_ARGS,
    MISTRAL_BEGIN,
    PYTHON_TAG,
    SyntaxName,
)

_decoder = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text


Item = str | ParsedCall


@dataclass(frozen=True, slots=True)
class ParsedMessage:
    content: str  # the text outside calls ("" when none)
    calls: list[ParsedCall]


def parse(syntax: SyntaxName, text: str, final: bool = True) -> ParsedMessage:
    items = _llama3(text, final) if syntax == "llama3" else _blocks(syntax, text, final)
    return ParsedMessage("".join(i for i in items if isinstance(i, str)),
                         [i for i in items if isinstance(i, ParsedCall)])


def call_of(obj: object) -> ParsedCall | None:
    """A decoded JSON value as a call, or None when it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return ParsedCall(obj["name"], args)
    return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _held_prefix(text: str, markers: tuple[str, ...]) -> int:
    """Where the longest suffix of ``text`` that is a proper prefix of a marker begins
    (len(text) when none)."""
    for start in range(max(0, len(text) - max(len(m) for m in markers) + 1), len(text)):
        if any(m.startswith(text[start:]) for m in markers):
            return start
    return len(text)


class _Items:
    """Content pieces and calls, with the whitespace rule: a piece loses its leading
    whitespace after a call and its trailing whitespace before one."""

    def __init__(self) -> None:
        self.items: list[Item] = []
        self.after_call = False

    def text(self, piece: str, before_call: bool) -> None:
        if self.after_call:
            piece = piece.lstrip()
        if before_call:
            piece = piece.rstrip()
        if piece:
            self.items.append(piece)
            self.after_call = False

    def call(self, call: ParsedCall) -> None:
        self.items.append(call)
        self.after_call = True


def _blocks(syntax: SyntaxName, text: str, final: bool) -> list[Item]:
    begin = HERMES_BEGIN if syntax == "hermes" else MISTRAL_BEGIN
    out = _Items()
    pos = 0
    while True:
        start = text.find(begin, pos)
        if start == -1:
            tail = text[pos:]
            if not final:  # may still become a marker, or whitespace before one
                tail = tail[:_held_prefix(tail, (begin,))].rstrip()
            out.text(tail, before_call=False)
            return out.items
        block = _BLOCK_READERS[syntax](text, start, final)
        if block is None:  # unfinished: nothing from here on is known yet
            out.text(text[pos:start], before_call=True)
            return out.items
        end, calls = block
        if calls is None:  # not a call: the model's text
            out.text(text[pos:end], before_call=False)
        else:
            out.text(text[pos:start], before_call=True)
            for c in calls:
                out.call(c)
        pos = end


def _hermes_block(text: str, start: int, final: bool
                  ) -> tuple[int, list[ParsedCall] | None] | None:
    """(end of the block, its call or None when it is not one), or None while unfinished."""
    body_at = start + len(HERMES_BEGIN)
    close = text.find(HERMES_END, body_at)
    if close == -1:
        if not final:
            return None
        end, body = len(text), text[body_at:]  # the answer ended before the closing tag
    else:
        end, body = close + len(HERMES_END), text[body_at:close]
    try:
        call = call_of(json.loads(body))
    except ValueError:
        call = None
    return end, None if call is None else [call]


def _mistral_block(text: str, start: int, final: bool
                   ) -> tuple[int, list[ParsedCall] | None] | None:
    at = start + len(MISTRAL_BEGIN)
    at += len(text[at:]) - len(text[at:].lstrip())
    try:
        value, end = _decoder.raw_decode(text, at)
    except ValueError:
        if not final:
            return None
        return len(text), None
    values = value if isinstance(value, list) else [value]
    calls = [call_of(v) for v in values]
    if not values or any(c is None for c in calls):
        return end, None
    return end, calls  # type: ignore[return-value]


_NAME = re.compile(r"[A-Za-z0-9_.:-]+")
_CALL_ID = "[CALL_ID]"  # some Mistral templates put an id between the name and [ARGS]


def _mistral_args_block(text: str, start: int, final: bool
                        ) -> tuple[int, list[ParsedCall] | None] | None:
    """``[TOOL_CALLS]name[ARGS]{json}`` (or ``name[CALL_ID]id[ARGS]{json}``) at ``start``."""
    at = start + len(MISTRAL_BEGIN)
    args = text.find(MISTRAL_ARGS, at)
    if args == -1:  # the name and [ARGS] may still be arriving
        if final or not _may_become_call(text[at:]):
            return (len(text) if final else at), None
        return None
    head = text[at:args]
    name = head.split(_CALL_ID, 1)[0]
    if not _NAME.fullmatch(name) or not (head == name or head.startswith(name + _CALL_ID)):
        return at, None  # not a call: the marker is the model's text
    body = args + len(MISTRAL_ARGS)
    try:
        value, end = _decoder.raw_decode(text, body + len(text[body:]) - len(text[body:].lstrip()))
    except ValueError:
        if not final:
            return None  # unfinished (or malformed: known at the end)
        return body, None  # the rest may hold further calls
    call = call_of({"name": name, "arguments": value})
    return end, None if call is None else [call]


def _may_become_call(head: str) -> bool:
    """Whether text after [TOOL_CALLS] can still grow into ``name[ARGS]`` or
    ``name[CALL_ID]id[ARGS]``."""
    name, bracket, rest = head.partition("[")
    if name and not _NAME.fullmatch(name):
        return False
    rest = bracket + rest
    if not rest or MISTRAL_ARGS.startswith(rest) or _CALL_ID.startswith(rest):
        return True
    if not rest.startswith(_CALL_ID):
        return False
    tail = rest[len(_CALL_ID):]
    return "[" not in tail or MISTRAL_ARGS.startswith(tail[tail.index("["):])


_BLOCK_READERS = {"hermes": _hermes_block, "mistral": _mistral_block,
                  "mistral_args": _mistral_args_block}


def _llama3(text: str, final: bool) -> list[Item]:
    body = text.lstrip()
    if body.startswith(PYTHON_TAG):
        body = body[len(PYTHON_TAG):]
    elif not body.startswith("{"):
        if not final and PYTHON_TAG.startswith(body):
            return []  # may still become the tag
        return [text if final else text.rstrip()] if body else []
    offset = len(text) - len(body)
    out = _Items()
    pos = offset
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] == ";"):
            pos += 1
        if pos == len(text):
            return out.items
        try:
            value, end = _decoder.raw_decode(text, pos)
        except ValueError:
            value, end = None, -1
        call = call_of(value) if end != -1 else None
        if call is None:
            if end == -1 and not final:
                return out.items  # unfinished, or not JSON: known at the end
            # not a call: the rest is content (before any call, the whole answer as written)
            out.text(text if not out.items else text[pos:], before_call=False)
            return out.items
        out.call(call)
        pos = end
