"""The chat request's tool fields (``tools``, ``tool_choice``, ``parallel_tool_calls``, an
assistant message's ``tool_calls``) and what they become (a ``ToolRequest``).

- ``tools``: function tools as OpenAI sends them; the chat template renders them (its ``tools``
  argument). A model whose template does not render tools answers a 400 naming ``tools``.
- ``tool_choice``: ``none`` (the tools are not rendered and nothing is parsed), ``auto`` (the
  default with tools: the model writes text or calls, which are parsed), ``required`` (one or
  more calls) or ``{"type": "function", "function": {"name": ..}}`` (one call of it). The last
  two are generated under a grammar of the model's call syntax with each function's
  ``parameters`` schema, so the arguments always validate.
- ``parallel_tool_calls``: false means at most one call (forced choices stop after one; under
  ``auto`` only the first call is kept and later ones are dropped from the answer).

Refused with a 400 naming the field: ``n`` > 1 with tools, a tool choice that forces calls
together with ``response_format`` / ``structured_outputs``, a forced choice without tools, a
named function that is not among the tools, two tools with one name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from specserve.core.errors import INVALID_TOOLS, InvalidRequestError
from specserve.core.structured import StructuredSpec
from specserve.core.tool_syntax import SyntaxName, ToolSyntax

FunctionName = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$",
                                           description="letters, digits, _ . -; at most 64")]
# OpenAI: a function without parameters takes none
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {},
                                  "additionalProperties": False}


class FunctionDefinition(msgspec.Struct, kw_only=True, forbid_unknown_fields=True,
                         omit_defaults=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; None: no parameters
    strict: bool | None = None  # forced calls always follow the schema; auto ones are parsed


class Tool(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: ChosenFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str  # JSON text, as the server answered it


class ToolCallIn(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """An assistant message's earlier call, sent back with the conversation."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """The tools a chat request offers, resolved against the model's call syntax."""

    syntax: SyntaxName
    tools: list[dict[str, Any]]  # for the chat template
    mode: Literal["auto", "required", "named"]
    parallel: bool
    structured: StructuredSpec | None  # the forced calls' grammar (required / named)
    keep_special_tokens: bool  # a call marker is a special token: keep it in the text


def tool_request(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None,
                 n: int, constrained: bool, syntax: ToolSyntax, special: dict[str, int]
                 ) -> ToolRequest | None:
    """None when the request offers no tools (or ``tool_choice`` "none"). ``constrained``: the
    request has a structured output; ``special``: call markers held as one special token."""
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if not tools:
        if forced:
            raise InvalidRequestError("tool_choice forces a tool call, but the request has no "
                                      "tools: send tools, or omit tool_choice",
                                      param="tool_choice")
        return None
    if choice == "none":
        return None
    names = [t.function.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidRequestError(f"two tools are named {name!r}: tool names must be unique",
                                      param=f"tools[{i}].function.name",
                                      code=INVALID_TOOLS)
    name_of = syntax.check()
    if n > 1:
        raise InvalidRequestError("n > 1 is not supported with tools: send n 1 (or several "
                                  "requests)", param="n")
    functions = [(t.function.name, t.function.parameters or _NO_PARAMETERS) for t in tools]
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise InvalidRequestError(
                f"tool_choice names {choice.function.name!r}, which is not among the tools "
                f"({', '.join(names)})", param="tool_choice.function.name",
                code=INVALID_TOOLS)
        functions = [f for f in functions if f[0] == choice.function.name]
    if forced and constrained:
        raise InvalidRequestError("a tool_choice that forces a call already constrains the "
                                  "output: omit response_format / structured_outputs, or send "
                                  'tool_choice "auto"', param="tool_choice")
    allow_many = parallel is not False and not isinstance(choice, NamedToolChoice)
    structured = None
    if forced:
        structured = StructuredSpec("structural_tag",
                                    syntax.structural_tag(functions, allow_many, special),
                                    "tools")
    mode: Literal["auto", "required", "named"] = (
        "named" if isinstance(choice, NamedToolChoice) else
        "required" if choice == "required" else "auto")
    rendered = [msgspec.to_builtins(t) for t in tools]  # None fields left out
    return ToolRequest(name_of, rendered, mode, allow_many, structured,
                       any(m in special for m in syntax.markers))


def template_tool_calls(calls: list[ToolCallIn]) -> list[dict[str, Any]]:
    """An assistant's earlier calls for the chat template: arguments as an object where they
    are JSON (templates write ``arguments | tojson``), as sent otherwise."""
    out = []
    for c in calls:
        try:
            args: Any = json.loads(c.function.arguments)
        except ValueError:
            args = c.function.arguments
        out.append({"id": c.id, "type": c.type,
                    "function": {"name": c.function.name, "arguments": args}})
    return out
