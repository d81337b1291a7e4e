"""schemathesis hooks for this API (``SCHEMATHESIS_HOOKS=benchmarks.schemathesis_hooks``), used
by the suite's quick run (tests/test_api_schema.py) and benchmarks/fuzz_api.py.

One check, ``positive_data_acceptance_beyond_schema``, stands in for schemathesis's
``positive_data_acceptance`` (every body the document allows is answered 2xx): it is that check,
except for the answers that depend on more than a body's shape, which no JSON Schema can
state, each recognised by OpenAI's error code:

- 400 ``context_length_exceeded``: the prompt's tokens (plus max_tokens) do not fit the context
  window; how many tokens a text is depends on the tokenizer;
- 408 ``request_timeout``: the request's own ``timeout`` passed before it finished; how long a
  generation takes depends on the machine;
- 400 ``invalid_structured_output``: a JSON schema, regex or EBNF grammar (a string or object by
  the document) that does not compile; whether a text is a valid grammar is beyond JSON Schema.
- 400 ``invalid_tools``: a named ``tool_choice`` function missing from the tools, or two tools
  with one name; a reference between array items is beyond JSON Schema.

Every other 4xx on a body the document allows is still a failure (ST202).
"""

from __future__ import annotations

import json

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

BEYOND_SCHEMA = {(400, "context_length_exceeded"), (408, "request_timeout"),
                 (400, "invalid_structured_output"), (400, "invalid_tools")}
REPLACED_CHECK = "positive_data_acceptance"


def error_code(body: bytes) -> str | None:
    try:
        return json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


@schemathesis.check
def positive_data_acceptance_beyond_schema(ctx, response, case):
    if (response.status_code, error_code(response.content)) in BEYOND_SCHEMA:
        return None
    return positive_data_acceptance(ctx, response, case)
