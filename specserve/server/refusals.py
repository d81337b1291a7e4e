"""Request fields the API declares but this server does not implement (yet): each is refused with
a 400 naming it, never silently dropped, because it would change what the answer means.

``REFUSED`` is the one table: field -> why, what to do instead, and which values are harmless
(accepted: they ask for what the server does anyway). A branch that implements a field deletes
its line here and gives the field its real type in ``protocol.py``. Fields OpenAI documents as
metadata (``user``, ``metadata``, ``store``, ``service_tier``, ...) are not here: they are accepted
and ignored, as OpenAI documents. Fields in neither OpenAI's documentation nor ours are refused
while decoding (the request Structs forbid unknown fields).

The OpenAPI document (``openapi.py``) states each refused field with the schema of its accepted
values (null when none), so generated clients and fuzzers see exactly what the server enforces.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from specserve.core.errors import InvalidRequestError

_NULL: dict[str, Any] = {"type": "null"}


@dataclass(frozen=True)
class Refusal:
    """``reason`` says what is missing and what to do; ``accepts`` the harmless values (with
    ``schema``, their JSON Schema, for the OpenAPI document); null is always accepted."""

    reason: str
    accepts: Callable[[Any], bool] = field(default=lambda value: False)
    schema: dict[str, Any] | None = None


_LEGACY = "the deprecated form of {new}, not implemented; send {new} instead"

REFUSED: dict[str, Refusal] = {
    # chat completions
    "functions": Refusal(_LEGACY.format(new="tools")),
    "function_call": Refusal(_LEGACY.format(new="tool_choice") + '; "none" is accepted',
                             lambda v: v == "none", {"const": "none"}),
    "audio": Refusal("the served model reads and writes text only; omit it"),
    "modalities": Refusal("the served model writes text only; send [\"text\"] or omit it",
                          lambda v: v == ["text"],
                          {"type": "array", "items": {"const": "text"}, "minItems": 1,
                           "maxItems": 1}),
    "reasoning_effort": Refusal("the served model is not a reasoning model; omit it"),
    "verbosity": Refusal("not implemented; omit it and ask for a length in the prompt"),
    "web_search_options": Refusal("this server has no web search; omit it"),
    # completions
    "suffix": Refusal("insertion is not implemented; omit it"),
    "best_of": Refusal("only 1 is implemented; omit it and use n for several choices",
                       lambda v: v == 1, {"const": 1}),
    "echo": Refusal("the server does not echo prompts; omit it or send false",
                    lambda v: v is False, {"const": False}),
}


def check_refused(request: object, prefix: str = "") -> None:
    """Raises ``InvalidRequestError`` naming the first refused field the request sets."""
    for name, refusal in REFUSED.items():
        value = getattr(request, name, None)
        if value is not None and not refusal.accepts(value):
            raise InvalidRequestError(
                f"{prefix}{name} is not supported by this server: {refusal.reason}",
                param=prefix + name)


def field_schema(name: str) -> dict[str, Any]:
    """The OpenAPI schema of a refused field: its accepted values, or null."""
    refusal = REFUSED[name]
    accepted = _NULL if refusal.schema is None else {"anyOf": [refusal.schema, _NULL]}
    allowed = "null" if refusal.schema is None else "null or the value given"
    return {**accepted, "description": f"refused with 400 unless {allowed}: {refusal.reason}"}
