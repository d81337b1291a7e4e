"""The model's tool-call syntax, read from its chat template, and the grammar of a forced call.

A template shows the model how to call a tool, so the same text tells us how to read its calls:

    ``<tool_call>`` in the source          -> "hermes" (Hermes, Qwen2/2.5/3):
                                              <tool_call>{"name": .., "arguments": ..}</tool_call>
    ``[TOOL_CALLS]`` and ``[ARGS]``        -> "mistral_args" (Mistral Small 3.2, Magistral,
                                              Devstral): [TOOL_CALLS]name[ARGS]{..} a call
    ``[TOOL_CALLS]``                       -> "mistral": [TOOL_CALLS][{"name": .., "arguments": ..}]
    ``<|python_tag|>`` or ``"parameters"`` -> "llama3" (Llama 3.x): {"name": .., "parameters": ..},
                                              optionally after <|python_tag|>, calls split by ";"

checked in that order (a Hermes template may mention "parameters" in its tool schemas). A
template that never reads the ``tools`` variable cannot show the model its tools: a request with
tools is then a 400 (``ToolSyntax.check``), never answered as if the model had seen them.

``ToolSyntax.structural_tag`` builds the xgrammar structural tag that forces calls in this syntax
(``tool_choice`` "required" or a named function), each call's arguments under its function's
``parameters`` schema; the structured-output path compiles and enforces it like any grammar,
under speculation too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from specserve.core.errors import InvalidRequestError

SyntaxName = Literal["hermes", "mistral", "mistral_args", "llama3"]
HERMES_BEGIN, HERMES_END = "<tool_call>", "</tool_call>"
MISTRAL_BEGIN = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"  # between a call's name and its arguments (the newer form)
PYTHON_TAG = "<|python_tag|>"
# JSON whitespace allowed in a forced call's arguments: the model's own ", " and ": " pass, a
# run of blank lines (a small model's way to fill its budget) does not
_MAX_WHITESPACE = 1


@dataclass(frozen=True, slots=True)
class ToolSyntax:
    """``name``: the syntax (None: the template reads no tools); ``reason``: why there is none
    (for the 400)."""

    name: SyntaxName | None
    reason: str = ""

    @staticmethod
    def of_template(template: str | dict | list | None) -> ToolSyntax:
        source = _template_source(template)
        if not source:
            return ToolSyntax(None, "this model's tokenizer has no chat template")
        if not _reads_tools(source):
            return ToolSyntax(None, "this model's chat template does not render tools (its "
                                    "source never reads `tools`), so the model would never "
                                    "see them; describe the tools in the prompt instead")
        if HERMES_BEGIN in source:
            return ToolSyntax("hermes")
        if MISTRAL_BEGIN in source:
            return ToolSyntax("mistral_args" if MISTRAL_ARGS in source else "mistral")
        if PYTHON_TAG in source or '"parameters"' in source:
            return ToolSyntax("llama3")
        return ToolSyntax(None, "this model's chat template renders tools, but in a call syntax "
                                "this server does not parse (it reads Hermes/Qwen <tool_call>, "
                                "Llama 3.x JSON and Mistral [TOOL_CALLS], both forms)")

    def check(self) -> SyntaxName:
        if self.name is None:
            raise InvalidRequestError(f"tools are not supported for this model: {self.reason}",
                                      param="tools")
        return self.name

    @property
    def markers(self) -> tuple[str, ...]:
        """The strings that open a call (a tokenizer may hold them as special tokens, which
        decoding would drop: the request then keeps special tokens in its text)."""
        return {"hermes": (HERMES_BEGIN,), "mistral": (MISTRAL_BEGIN,),
                "mistral_args": (MISTRAL_BEGIN, MISTRAL_ARGS),
                "llama3": (PYTHON_TAG,)}.get(self.name or "", ())

    def structural_tag(self, functions: list[tuple[str, dict[str, Any]]], parallel: bool,
                       special: dict[str, int]) -> str:
        """The structural tag (JSON text) of one or more calls (just one unless ``parallel``)
        of ``functions`` [(name, parameters schema)], nothing else. ``special``: marker -> its
        token id where the tokenizer holds the marker as one special token."""
        name = self.check()

        def tag(begin: str, args_key: str, end: str, fn: tuple[str, dict]) -> dict:
            return {"type": "tag", "begin": f'{begin}{{"name": {json.dumps(fn[0])}, '
                                              f'"{args_key}": ',
                    "content": {"type": "json_schema", "json_schema": fn[1],
                                "max_whitespace_cnt": _MAX_WHITESPACE},
                    "end": "}" + end}

        def calls(begin: str, args_key: str, end: str, separator: str) -> dict:
            return {"type": "tags_with_separator", "separator": separator,
                    "at_least_one": True, "stop_after_first": not parallel,
                    "tags": [tag(begin, args_key, end, fn) for fn in functions]}

        def marker(text: str) -> dict[str, Any]:
            """The marker as its special token where the tokenizer has one, else as text."""
            return ({"type": "token", "token": special[text]} if text in special
                    else {"type": "const_string", "value": text})

        if name == "hermes":
            fmt = calls(HERMES_BEGIN + "\n", "arguments", "\n" + HERMES_END, "\n")
        elif name == "llama3":
            fmt = calls("", "parameters", "", "; ")
        elif name == "mistral_args":  # each call its own [TOOL_CALLS]name[ARGS]{..}
            one: dict[str, Any] = {"type": "or", "elements": [
                {"type": "sequence", "elements": [
                    marker(MISTRAL_BEGIN), {"type": "const_string", "value": fn_name},
                    marker(MISTRAL_ARGS),
                    {"type": "json_schema", "json_schema": schema,
                     "max_whitespace_cnt": _MAX_WHITESPACE}]}
                for fn_name, schema in functions]}
            fmt = {"type": "plus", "content": one} if parallel else one
        else:
            fmt = {"type": "sequence", "elements": [
                marker(MISTRAL_BEGIN), {"type": "const_string", "value": "["},
                calls("", "arguments", "", ", "), {"type": "const_string", "value": "]"}]}
        return json.dumps({"type": "structural_tag", "format": fmt})


def _template_source(template: str | dict | list | None) -> str:
    """All of a tokenizer's templates (transformers keeps named ones, e.g. "tool_use", as a
    dict or a list of {"name", "template"})."""
    if template is None:
        return ""
    if isinstance(template, str):
        return template
    if isinstance(template, dict):
        return "\n".join(str(t) for t in template.values())
    return "\n".join(str(t.get("template", "")) if isinstance(t, dict) else str(t)
                     for t in template)


def _reads_tools(source: str) -> bool:
    import jinja2
    from jinja2 import meta

    try:
        parsed = jinja2.Environment().parse(source)
    except jinja2.TemplateSyntaxError:
        return "tools" in source
    return "tools" in meta.find_undeclared_variables(parsed)
