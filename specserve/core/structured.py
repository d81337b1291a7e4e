"""StructuredSpec: what a request's output must match (a JSON schema, any JSON object, a regex,
one of several strings, or an EBNF grammar), as the request gave it.

The spec is plain data: the grammar engine compiles it (specserve/spec/grammar_compiler.py), and
the compiled grammar is cached by (kind, text), so two requests with the same schema text share
one compilation. ``param`` is the request field it came from, so an error while compiling names
that field (``response_format.json_schema.schema``, ``structured_outputs.regex``, ...).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

from specserve.core.errors import INVALID_STRUCTURED_OUTPUT, InvalidRequestError

Kind = Literal["json_object", "json_schema", "regex", "choice", "grammar", "structural_tag"]
KINDS: tuple[str, ...] = (
    "json_object", "json_schema", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """``text``: the JSON schema (JSON text), the regex, the EBNF grammar (xgrammar's GBNF-style
    EBNF, ``root ::= ...``), for ``choice`` the choices as a JSON list, for ``structural_tag``
    xgrammar's structural tag (JSON text: forced tool calls, see core/tool_syntax.py); "" for
    json_object."""

    kind: Kind
    text: str
    param: str  # the request field, for errors

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(
                f"structured output kind must be one of {', '.join(KINDS)} (got {self.kind!r})",
                param=self.param)

    @property
    def key(self) -> tuple[str, str]:
        """What the compiled grammar is cached by (the tokenizer is the engine's own)."""
        return (self.kind, self.text)

    @staticmethod
    def json_schema(schema: dict | str, param: str) -> StructuredSpec:
        if isinstance(schema, str):
            try:
                parsed = json.loads(schema)
            except ValueError as exc:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {exc}",
                                          param=param, code=INVALID_STRUCTURED_OUTPUT) from exc
        else:
            parsed = schema
        if not isinstance(parsed, dict):
            raise InvalidRequestError("the JSON schema must be a JSON object", param=param,
                                      code=INVALID_STRUCTURED_OUTPUT)
        # key order kept: the grammar emits properties in the order the schema lists them
        return StructuredSpec("json_schema", json.dumps(parsed), param)

    @staticmethod
    def choice(choices: list[str], param: str) -> StructuredSpec:
        if not choices or any(not isinstance(c, str) or c == "" for c in choices):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings",
                                      param=param)
        return StructuredSpec("choice", json.dumps(list(choices)), param)


def choice_grammar(choices_json: str) -> str:
    """The EBNF grammar of "exactly one of these strings" (string literals JSON-escaped)."""
    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(choices_json))
    return f"root ::= ({alternatives})"
