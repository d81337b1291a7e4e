"""OpenAI-compatible request bodies (msgspec Structs) and their conversion to the engine's types
(responses are ``responses.py``'s).

Requests decode with ``msgspec.json.decode(body, type=...)``. Every field of OpenAI's chat and
completions requests is declared: the implemented ones with their types and ranges, metadata
(``user``, ``metadata``, ``store``, ``service_tier``, ...) accepted and ignored as OpenAI documents,
and the rest refused with a 400 naming them (the table in ``refusals.py``). A field in neither
OpenAI's documentation nor ours is refused too (``forbid_unknown_fields``): a request is never
answered as if a field it sent had been applied. Wrong types raise ``msgspec.ValidationError``
whose ``$.path`` becomes the error's ``param`` (see ``validation_param``).
The WebSocket's messages are in ``ws_messages.py``.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec
from msgspec import Meta

from specserve.core.errors import InvalidRequestError
from specserve.core.sampling_params import (
    MAX_REPETITION_PENALTY,
    SamplingParams,
    SpeculativeParams,
)
from specserve.server.refusals import check_refused
from specserve.server.structured_fields import (
    REMOVED,
    ResponseFormat,
    StructuredOutputs,
    check_removed,
    structured_spec,
)
from specserve.server.tool_fields import (
    Tool,
    ToolCallIn,
    ToolChoice,
    ToolRequest,
    template_tool_calls,
)

MAX_N = 16
MAX_LOGPROBS = 20

# Bounds that msgspec checks while decoding (and that the OpenAPI document states); the engine's
# SamplingParams.validate checks the same ranges for offline callers.
Temperature = Annotated[float, Meta(ge=0.0, le=100.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=-1)]
PositiveInt = Annotated[int, Meta(ge=1)]
NonNegativeInt = Annotated[int, Meta(ge=0)]
NumChoices = Annotated[int, Meta(ge=1, le=MAX_N)]
NumLogprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
TimeoutSeconds = Annotated[float, Meta(gt=0.0, le=1e6)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0, description="in [-2, 2]; 0 disables it")]
RepetitionPenalty = Annotated[float, Meta(
    gt=0.0, le=MAX_REPETITION_PENALTY,
    description="vLLM's: logits of tokens in the prompt or the output divided (positive) or "
                "multiplied (negative) by it; 1 disables it")]
# OpenAI's logit_bias: {"token id": bias}; the ids must also be below the model's vocabulary size
# (the OpenAPI document states the exact bound of the served model).
TokenIdKey = Annotated[str, Meta(pattern=r"^(0|[1-9][0-9]{0,8})$")]
Bias = Annotated[float, Meta(ge=-100.0, le=100.0)]
LogitBias = Annotated[dict[TokenIdKey, Bias], Meta(
    description="token id -> a value in [-100, 100] added to its logit before sampling "
                "(-100 bans the token, 100 forces it)")]
Refused = Annotated[Any, Meta(description="not implemented: refused with 400 unless null")]
Removed = Annotated[Any, Meta(extra_json_schema={"type": "null", "deprecated": True})]

# ---- requests ---------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # accepted; this server pads no events


class SpeculativeOptions(msgspec.Struct, forbid_unknown_fields=True):
    method: str | None = None  # a proposer name or "off"; None keeps the server's
    num_tokens: Annotated[int, Meta(ge=0, le=16)] | None = None  # None keeps the server's k_max


class TextPart(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class PredictionPart(msgspec.Struct, forbid_unknown_fields=True):
    """A text part of a prediction's content: ``type`` is required (outside a union a tagged
    Struct would accept a part without it)."""

    type: Literal["text"]
    text: str


class Prediction(msgspec.Struct, forbid_unknown_fields=True):
    """OpenAI's Predicted Outputs: the text the client expects back (the file it edits). Drafts
    come from it first; the answer is the model's either way (exact speculation)."""

    type: Literal["content"]
    content: str | list[PredictionPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _Common(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Fields shared by completions and chat (OpenAI + vLLM-style extensions)."""

    model: str | None = None
    temperature: Temperature | None = None  # None: 1.0 (OpenAI's default); 0 = greedy
    top_p: TopP | None = None
    top_k: TopK | None = None  # -1 or 0 disables
    seed: int | None = None  # choice i of n uses seed + i
    stop: str | list[Annotated[str, Meta(min_length=1)]] | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    n: NumChoices = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: NonNegativeInt = 0  # a value above max_tokens counts as max_tokens
    skip_special_tokens: bool = True
    speculative: SpeculativeOptions | None = None
    prediction: Prediction | None = None  # Predicted Outputs (see Prediction)
    timeout: TimeoutSeconds | None = None  # seconds from arrival; None: --request-timeout
    logit_bias: LogitBias | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    # OpenAI's metadata: accepted and ignored (nothing is stored; there are no service tiers)
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # prefix caching needs no key here
    safety_identifier: str | None = None
    # structured outputs (structured_fields.py): OpenAI's and vLLM's current fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # vLLM's removed names: decoded only to answer them with a 400 naming the replacement
    # (the schema says so: only null is valid)
    guided_json: Removed = None
    guided_regex: Removed = None
    guided_choice: Removed = None
    guided_grammar: Removed = None
    guided_decoding_backend: Removed = None
    guided_whitespace_pattern: Removed = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[int | str]  # text, token ids, or a list of texts (one choice set each)
    max_tokens: PositiveInt | None = 16
    logprobs: NumLogprobs | None = None
    echo: bool | None = None  # refused unless false
    best_of: PositiveInt | None = None  # refused unless 1
    suffix: Refused = None


class ImageUrl(msgspec.Struct):
    url: str
    detail: str | None = None


class ImageUrlPart(msgspec.Struct, tag_field="type", tag="image_url"):
    """Decoded only to answer it with a clear 400: the served models read text only."""

    image_url: ImageUrl


# OpenAI's chat roles; anything else is a 400 naming messages[i].role.
Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    role: Role
    content: str | list[TextPart | ImageUrlPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # tool messages carry it; the template may use it
    refusal: str | None = None  # an assistant's earlier refusal; its content says the same
    tool_calls: list[ToolCallIn] | None = None  # an assistant's earlier calls
    function_call: Refused = None
    audio: Refused = None


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: PositiveInt | None = None  # None: up to the context window
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None
    # tool calling (tool_fields.py)
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None  # None: "auto" with tools, "none" without
    parallel_tool_calls: bool | None = None  # None: true
    # Refused (see refusals.py) unless null or the value given there
    functions: Refused = None
    function_call: Refused = None
    audio: Refused = None
    modalities: Refused = None
    reasoning_effort: Refused = None
    verbosity: Refused = None
    web_search_options: Refused = None


_Req = TypeVar("_Req", bound=msgspec.Struct)


def decode_request(body: bytes, type_: type[_Req]) -> _Req:
    """Decodes a request body. JSON Schema (and so the OpenAPI document) counts 424.0 as an
    integer, msgspec does not: a body that fails on a float where an int belongs is decoded
    again with its integral floats as ints (every float field takes an int too), so the server
    accepts exactly what the document allows. Only that failing path pays for the second pass."""
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as exc:
        if "got `float`" not in str(exc):
            raise
    return msgspec.convert(_integral(msgspec.json.decode(body)), type=type_)


def _integral(obj: Any) -> Any:
    if isinstance(obj, float) and obj.is_integer():
        return int(obj)
    if isinstance(obj, list):
        return [_integral(x) for x in obj]
    if isinstance(obj, dict):
        return {k: _integral(v) for k, v in obj.items()}
    return obj


_AT = re.compile(r"(?:at|in) `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")
_UNKNOWN = re.compile(r"unknown field `([^`]+)`")


def validation_param(message: str) -> str | None:
    """``Expected `float`, got `str` - at `$.temperature``` -> ``temperature``;
    ``Object missing required field `prompt``` -> ``prompt`` (nested paths keep their dots);
    a dict's key or value (``at `key` in `$.logit_bias```, ``$.logit_bias[...]``) -> the dict."""
    at = _AT.search(message)
    path = at.group(1).replace("[...]", "") if at else ""  # a dict's key or value: the dict
    named = _MISSING.search(message) or _UNKNOWN.search(message)
    if named:
        path = f"{path}.{named.group(1)}" if path else named.group(1)
    return path or None


_HINTS = {"role": "roles are system, developer, user, assistant and tool",
          "type": "content parts are {\"type\": \"text\", \"text\": ...}"}


def validation_message(message: str, param: str | None) -> str:
    """msgspec's message plus what is allowed where msgspec only says what was wrong."""
    if _UNKNOWN.search(message):
        return (f"unknown field `{param}`: neither an OpenAI request field nor one of this "
                "server's extensions; remove it (GET /openapi.json lists every field)")
    hint = _HINTS.get((param or "").rsplit(".", 1)[-1])
    return f"{message} ({hint})" if hint and "Invalid" in message else message


def _sampling(req: _Common, max_tokens: int, logprobs: int | None, index: int,
              tools: ToolRequest | None = None) -> SamplingParams:
    """``tools``: a chat request's tools (a forced call brings its grammar; a call marker that
    is a special token is kept in the text)."""
    check_removed({name: getattr(req, name) for name in REMOVED})
    structured = structured_spec(req.response_format, req.structured_outputs)
    if tools is not None and tools.structured is not None:
        structured = tools.structured
    stop = req.stop if isinstance(req.stop, list) else ([req.stop] if req.stop else [])
    top_k = req.top_k or 0
    if top_k == -1:
        top_k = 0
    bias = {int(tok): value for tok, value in (req.logit_bias or {}).items()}
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        seed=None if req.seed is None else req.seed + index,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        min_tokens=min(req.min_tokens, max_tokens),
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens and not (
            tools is not None and tools.keep_special_tokens),
        logit_bias=bias,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        structured=structured,
    )


def speculative_params(req: _Common) -> SpeculativeParams | None:
    prediction = None if req.prediction is None else req.prediction.text
    if req.speculative is None:
        return None if prediction is None else SpeculativeParams(prediction=prediction)
    return SpeculativeParams(req.speculative.method, req.speculative.num_tokens,
                             prediction=prediction)


def _check_n(req: _Common) -> None:
    if not 1 <= req.n <= MAX_N:
        raise InvalidRequestError(f"n must be in [1, {MAX_N}] (got {req.n})", param="n")


def completion_prompts(req: CompletionRequest) -> list[str | list[int]]:
    """The prompts a completions body asks for: one string, one token-id list, or several
    strings (choices are numbered prompt-major: prompt p, choice i -> index p * n + i)."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)]  # type: ignore[list-item]
    if all(isinstance(x, str) for x in p):
        return list(p)  # type: ignore[arg-type]
    raise InvalidRequestError("prompt must be a string, a list of strings or a list of token ids",
                              param="prompt")


def completion_params(req: CompletionRequest) -> list[SamplingParams]:
    """One SamplingParams per choice (index i of n)."""
    _check_n(req)
    max_tokens = 16 if req.max_tokens is None else req.max_tokens  # null: OpenAI's default
    return [_sampling(req, max_tokens, req.logprobs, i) for i in range(req.n)]


def chat_params(
    req: ChatCompletionRequest, max_model_len: int, tools: ToolRequest | None = None
) -> tuple[list[SamplingParams], bool]:
    """(one SamplingParams per choice, clamp): with no max_tokens the limit is the context
    window, so the engine clamps it to what the prompt leaves (clamp True)."""
    _check_n(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    max_tokens = req.max_completion_tokens if req.max_tokens is None else req.max_tokens
    clamp = max_tokens is None
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    n_max = max_model_len if max_tokens is None else max_tokens
    return [_sampling(req, n_max, logprobs, i, tools) for i in range(req.n)], clamp


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    if not req.messages:
        raise InvalidRequestError("messages must not be empty", param="messages")
    out = []
    for i, m in enumerate(req.messages):
        check_refused(m, f"messages[{i}].")
        content = m.content
        if isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, ImageUrlPart):
                    raise InvalidRequestError(
                        "images are not supported: the served model reads text only; send "
                        "text content parts", param=f"messages[{i}].content[{j}]")
            content = "".join(part.text for part in content if isinstance(part, TextPart))
        msg = {"role": m.role, "content": content or ""}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            if m.role != "assistant":
                raise InvalidRequestError("only assistant messages carry tool_calls",
                                          param=f"messages[{i}].tool_calls")
            msg["tool_calls"] = template_tool_calls(m.tool_calls)
        out.append(msg)
    return out
