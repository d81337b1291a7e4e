"""Typed errors. Each message says what was wrong and how to fix it.

All user-facing errors derive from ``SpecServeError`` (a ``ValueError``), so the CLI can print
them as one line and the server can map them to an OpenAI-style 400 body.
"""

from __future__ import annotations


class SpecServeError(ValueError):
    """Base class for errors caused by user input or configuration."""


class ConfigError(SpecServeError):
    """An engine/server setting is invalid or inconsistent."""


class ModelLoadError(SpecServeError):
    """A model path or file could not be used."""


class UnsupportedArchitectureError(ModelLoadError):
    """The model's architecture is not one we implement."""


# The error code of a schema, regex or grammar that does not compile (valid by the API's types:
# whether it compiles is beyond what its JSON Schema can state).
INVALID_STRUCTURED_OUTPUT = "invalid_structured_output"
# a named function missing from the tools, or two tools with one name
INVALID_TOOLS = "invalid_tools"


class InvalidRequestError(SpecServeError):
    """A request field is invalid. ``param`` names the offending field (OpenAI's ``param``);
    ``code``, where OpenAI has one for the case (``context_length_exceeded``)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
