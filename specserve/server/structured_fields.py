"""The request fields that constrain the output, and what they become (a ``StructuredSpec``).

- OpenAI's ``response_format``: ``{"type": "text"}`` (no constraint), ``{"type":
  "json_object"}`` (any JSON object), ``{"type": "json_schema", "json_schema": {"name": ...,
  "schema": {...}, "strict": true}}``. The schema is always enforced (``strict`` false too: a
  schema the server was given is never ignored).
- vLLM's ``structured_outputs``: exactly one of ``json`` (a schema, as an object or JSON text),
  ``regex``, ``choice`` (a list of strings), ``grammar`` (EBNF, xgrammar's GBNF-style dialect),
  ``json_object`` (true). Its other keys (``structural_tag``, ``whitespace_pattern``, ...) are a
  400: we do not implement them.
- vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` /
  ``guided_decoding_backend`` were removed from vLLM (its docs list them as removed in 0.12):
  they are a 400 that names the field and its replacement, never silently dropped.

One constraint per request: ``response_format`` (other than text) together with
``structured_outputs`` is a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from specserve.core.errors import InvalidRequestError
from specserve.core.structured import StructuredSpec


class JsonSchemaFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    name: str = "response"
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: Annotated[list[Annotated[str, msgspec.Meta(min_length=1)]],
                      msgspec.Meta(min_length=1)] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# removed vLLM names -> what replaces them
REMOVED = {
    "guided_json": "structured_outputs.json",
    "guided_regex": "structured_outputs.regex",
    "guided_choice": "structured_outputs.choice",
    "guided_grammar": "structured_outputs.grammar",
    "guided_decoding_backend": "nothing (the server's engine is xgrammar)",
    "guided_whitespace_pattern": "nothing (JSON is written compactly)",
}


def check_removed(values: dict[str, Any]) -> None:
    """``values``: the removed fields as the request gave them (None when absent)."""
    for name, value in values.items():
        if value is not None:
            raise InvalidRequestError(
                f"{name} is not supported (vLLM removed it): use {REMOVED[name]}", param=name)


def structured_spec(response_format: ResponseFormat | None,
                    structured: StructuredOutputs | None) -> StructuredSpec | None:
    from_format = _from_response_format(response_format)
    from_vllm = _from_structured_outputs(structured)
    if from_format is not None and from_vllm is not None:
        raise InvalidRequestError(
            "give one of response_format and structured_outputs, not both",
            param="structured_outputs")
    return from_format or from_vllm


def _from_response_format(rf: ResponseFormat | None) -> StructuredSpec | None:
    if rf is None or rf.type == "text":
        return None
    if rf.type == "json_object":
        return StructuredSpec("json_object", "", "response_format")
    if rf.json_schema is None or rf.json_schema.schema is None:
        raise InvalidRequestError(
            'response_format type "json_schema" needs json_schema.schema (a JSON schema object)',
            param="response_format.json_schema.schema")
    return StructuredSpec.json_schema(rf.json_schema.schema, "response_format.json_schema.schema")


def _from_structured_outputs(so: StructuredOutputs | None) -> StructuredSpec | None:
    if so is None:
        return None
    given = [k for k in ("json", "regex", "choice", "grammar") if getattr(so, k) is not None]
    if so.json_object:
        given.append("json_object")
    if len(given) > 1:
        raise InvalidRequestError(
            f"structured_outputs takes one of json, regex, choice, grammar, json_object "
            f"(got {', '.join(given)})", param="structured_outputs")
    if not given:
        return None
    key = given[0]
    param = f"structured_outputs.{key}"
    if key == "json":
        return StructuredSpec.json_schema(so.json, param)  # type: ignore[arg-type]
    if key == "choice":
        return StructuredSpec.choice(so.choice, param)  # type: ignore[arg-type]
    if key == "json_object":
        return StructuredSpec("json_object", "", param)
    text = getattr(so, key)
    if not text:
        raise InvalidRequestError(f"{param} must not be empty", param=param)
    return StructuredSpec(key, text, param)  # type: ignore[arg-type]
