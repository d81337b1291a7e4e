"""Tool calls of one choice as it streams: the text so far is parsed again at each delta
(``tool_parsers.parse`` with ``final`` False), and what is new since the last delta is sent.

A partial parse is a prefix of the final one (see tool_parsers.py), so the content deltas and
calls sent reassemble to exactly the non-streamed message. A call is sent once it is complete,
as OpenAI shapes it: one delta with its index, id, type and name and empty arguments, then one
with the arguments.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from specserve.core.tool_syntax import SyntaxName
from specserve.server.tool_parsers import ParsedCall, ParsedMessage, parse


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCallStream:
    syntax: SyntaxName
    max_calls: int | None = None  # parallel_tool_calls false: 1 (later calls are dropped)
    text: str = ""
    sent_content: int = 0  # characters of content sent
    sent_calls: int = 0
    ids: list[str] = field(default_factory=list)

    def feed(self, delta: str, final: bool) -> tuple[str, list[tuple[int, str, ParsedCall]]]:
        """(new content, new calls as (index, id, call)) after ``delta``; ``final``: the
        answer has ended."""
        self.text += delta
        msg = final_message(self.syntax, self.text, self.max_calls, final)
        content = msg.content[self.sent_content:]
        self.sent_content = len(msg.content)
        new = []
        for i, call in enumerate(msg.calls[self.sent_calls:], start=self.sent_calls):
            self.ids.append(call_id())
            new.append((i, self.ids[i], call))
        self.sent_calls = len(msg.calls)
        return content, new


def final_message(syntax: SyntaxName, text: str, max_calls: int | None = None,
                  final: bool = True) -> ParsedMessage:
    msg = parse(syntax, text, final)
    if max_calls is not None and len(msg.calls) > max_calls:
        return ParsedMessage(msg.content, msg.calls[:max_calls])
    return msg
