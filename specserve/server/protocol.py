"""OpenAI-compatible request/response bodies (msgspec Structs) and the conversions to and from the
engine's types.

Requests decode with ``msgspec.json.decode(body, type=...)``; unknown fields are ignored (OpenAI
clients send extras), wrong types raise ``msgspec.ValidationError`` whose ``$.path`` becomes the
error's ``param`` (see ``validation_param``). Response Structs with ``omit_defaults`` leave out
only the optional extras (``usage``, ``timings``); fields OpenAI always sends (``object``,
``finish_reason: null``, ``logprobs: null``) have no default, or live on Structs that keep them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

from specserve.core.errors import InvalidRequestError
from specserve.core.sampling import TokenLogprob
from specserve.core.sampling_params import SamplingParams, SpeculativeParams
from specserve.engine.outputs import RequestOutput, RequestTimings

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

# ---- requests ---------------------------------------------------------------------------


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class SpeculativeOptions(msgspec.Struct):
    method: str | None = None  # a proposer name or "off"; None keeps the server's
    num_tokens: Annotated[int, Meta(ge=0, le=16)] | None = None  # None keeps the server's k_max


class TextPart(msgspec.Struct, tag_field="type", tag="text"):
    text: str


class Prediction(msgspec.Struct):
    """OpenAI's Predicted Outputs: the text the client expects back (the file it edits). Drafts
    come from it first; the answer is the model's either way (exact speculation)."""

    type: Literal["content"]
    content: str | list[TextPart]

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _Common(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat (OpenAI + vLLM-style extensions)."""

    model: str | None = None
    temperature: Temperature | None = None  # None: 1.0 (OpenAI's default); 0 = greedy
    top_p: TopP | None = None
    top_k: TopK | None = None  # -1 or 0 disables
    seed: int | None = None  # choice i of n uses seed + i
    stop: str | list[str] | None = None
    stop_token_ids: list[NonNegativeInt] | None = None
    n: NumChoices = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: NonNegativeInt = 0
    skip_special_tokens: bool = True
    speculative: SpeculativeOptions | None = None
    prediction: Prediction | None = None  # Predicted Outputs (see Prediction)
    user: str | None = None
    timeout: TimeoutSeconds | None = None  # seconds from arrival; None: --request-timeout


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[int | str]  # text, token ids, or a list of texts (one choice set each)
    max_tokens: PositiveInt | None = 16
    logprobs: NumLogprobs | None = None
    echo: bool = False


class ImageUrl(msgspec.Struct):
    url: str
    detail: str | None = None


class ImageUrlPart(msgspec.Struct, tag_field="type", tag="image_url"):
    """Decoded only to answer it with a clear 400: the served models read text only."""

    image_url: ImageUrl


# OpenAI's chat roles; anything else is a 400 naming messages[i].role.
Role = Literal["system", "developer", "user", "assistant", "tool"]


class ChatMessage(msgspec.Struct):
    role: Role
    content: str | list[TextPart | ImageUrlPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # tool messages carry it; the template may use it


class ChatCompletionRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: PositiveInt | None = None  # None: up to the context window
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: NumLogprobs | None = None


_AT = re.compile(r"at `\$\.?([^`]*)`")
_MISSING = re.compile(r"missing required field `([^`]+)`")


def validation_param(message: str) -> str | None:
    """``Expected `float`, got `str` - at `$.temperature``` -> ``temperature``;
    ``Object missing required field `prompt``` -> ``prompt`` (nested paths keep their dots)."""
    at = _AT.search(message)
    path = at.group(1) if at else ""
    missing = _MISSING.search(message)
    if missing:
        path = f"{path}.{missing.group(1)}" if path else missing.group(1)
    return path or None


_HINTS = {"role": "roles are system, developer, user, assistant and tool",
          "type": "content parts are {\"type\": \"text\", \"text\": ...}"}


def validation_message(message: str, param: str | None) -> str:
    """msgspec's message plus what is allowed where msgspec only says what was wrong."""
    hint = _HINTS.get((param or "").rsplit(".", 1)[-1])
    return f"{message} ({hint})" if hint and "Invalid" in message else message


def _sampling(req: _Common, max_tokens: int, logprobs: int | None, index: int) -> SamplingParams:
    stop = req.stop if isinstance(req.stop, list) else ([req.stop] if req.stop else [])
    top_k = req.top_k or 0
    if top_k == -1:
        top_k = 0
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=top_k,
        seed=None if req.seed is None else req.seed + index,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        min_tokens=req.min_tokens,
        logprobs=logprobs,
        skip_special_tokens=req.skip_special_tokens,
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
    if req.echo:
        raise InvalidRequestError("echo is not supported", param="echo")
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
    if req.max_tokens is None:
        raise InvalidRequestError("max_tokens must be an integer >= 1", param="max_tokens")
    return [_sampling(req, req.max_tokens, req.logprobs, i) for i in range(req.n)]


def chat_params(
    req: ChatCompletionRequest, max_model_len: int
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
    return [_sampling(req, n_max, logprobs, i) for i in range(req.n)], clamp


def chat_messages(req: ChatCompletionRequest) -> list[dict]:
    if not req.messages:
        raise InvalidRequestError("messages must not be empty", param="messages")
    out = []
    for i, m in enumerate(req.messages):
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
        out.append(msg)
    return out


# ---- responses --------------------------------------------------------------------------


class CompletionTokensDetails(msgspec.Struct):
    """Sent for a request with a ``prediction``: its tokens that appear in the completion
    (the longest common subsequence of the two token lists) and the rest
    (specserve/engine/prediction_usage.py)."""

    accepted_prediction_tokens: int
    rejected_prediction_tokens: int


class UsageInfo(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    completion_tokens_details: CompletionTokensDetails | None = None


class CompletionLogprobs(msgspec.Struct):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(msgspec.Struct, omit_defaults=True):
    id: str
    object: str  # "text_completion" (also for stream chunks, as OpenAI does)
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    timings: dict | None = None  # extension: RequestTimings fields (ms, counts)


class TopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatTokenLogprob]


class ChatMessageOut(msgspec.Struct):
    role: str
    content: str


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatChunkChoice(msgspec.Struct):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatResponse(msgspec.Struct, omit_defaults=True):
    id: str
    object: str  # "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    timings: dict | None = None


class ChatChunk(msgspec.Struct, omit_defaults=True):
    id: str
    object: str  # "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    timings: dict | None = None


class ModelCard(msgspec.Struct):
    id: str
    object: str
    created: int
    owned_by: str
    max_model_len: int


class ModelList(msgspec.Struct):
    object: str
    data: list[ModelCard]


class HealthResponse(msgspec.Struct):
    status: str  # ok | warming_up | shutting_down | failed
    kv_blocks_free: int
    kv_blocks_total: int
    num_running: int
    num_waiting: int
    num_in_flight: int


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


def usage_of(outputs: list[RequestOutput]) -> UsageInfo:
    """Prompt tokens count once per distinct prompt request (n choices share a prompt but each
    runs its own sequence, so they are all counted, as vLLM does)."""
    prompt = sum(o.num_prompt_tokens for o in outputs)
    completion = sum(o.num_output_tokens for o in outputs)
    predicted = [o.prediction_usage for o in outputs if o.prediction_usage is not None]
    details = None
    if predicted:
        details = CompletionTokensDetails(sum(p.accepted for p in predicted),
                                          sum(p.rejected for p in predicted))
    return UsageInfo(prompt, completion, prompt + completion, details)


def timings_of(outputs: list[RequestOutput]) -> dict:
    """One request's timings; for several sequences, phase times and counts are summed,
    ttft is the earliest and queue / e2e the longest."""
    rows = [dataclasses.asdict(o.timings) for o in outputs]
    merged: dict = dict(rows[0]) if rows else dataclasses.asdict(RequestTimings())
    for row in rows[1:]:
        for key, value in row.items():
            old = merged.get(key)
            if value is None or old is None:
                merged[key] = old if value is None else value
            elif key == "ttft_ms":
                merged[key] = min(old, value)
            elif key in ("queue_ms", "e2e_ms"):
                merged[key] = max(old, value)
            elif isinstance(value, (int, float)) and isinstance(old, (int, float)):
                merged[key] = old + value  # other kinds (e.g. a method name) keep the first
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in merged.items()}


TokenText = Callable[[int], str]


def completion_logprobs(
    lps: list[TokenLogprob], text: TokenText, offset: int
) -> CompletionLogprobs:
    tokens, values, tops, offsets = [], [], [], []
    pos = offset
    for lp in lps:
        t = text(lp.token_id)
        tokens.append(t)
        values.append(lp.logprob)
        tops.append({text(tid): v for tid, v in lp.top})
        offsets.append(pos)
        pos += len(t)
    return CompletionLogprobs(tokens, values, tops, offsets)


def chat_logprobs(lps: list[TokenLogprob], text: TokenText) -> ChatLogprobs:
    def entry(tid: int, value: float) -> TopLogprob:
        t = text(tid)
        return TopLogprob(t, value, list(t.encode()))

    content = []
    for lp in lps:
        t = text(lp.token_id)
        content.append(ChatTokenLogprob(t, lp.logprob, list(t.encode()),
                                        [entry(tid, v) for tid, v in lp.top]))
    return ChatLogprobs(content)


# ---- WebSocket messages (see README: "WebSocket protocol") ----------------------------------


class WsEnvelope(msgspec.Struct):
    """Every client message: ``type`` request | cancel, the client's ``id``; a request also has
    ``kind`` completion | chat and the fields of that body."""

    type: str
    id: str | None = None
    kind: str = "completion"


class WsToken(msgspec.Struct):
    type: str  # "token"
    id: str
    text: str
    token_ids: list[int]
    # Additive (old clients ignore them): per token of token_ids, whether it was an accepted
    # draft token; `text` as [length in code points, from_draft] runs; the request's running
    # drafted / accepted / verify-step counts (acceptance rate, mean accepted length).
    from_draft: list[bool] = []
    text_spans: list[tuple[int, bool]] = []
    num_drafted: int = 0
    num_accepted: int = 0
    num_verify_steps: int = 0


def ws_token(cid: str, out: RequestOutput) -> WsToken:
    t = out.timings
    return WsToken("token", cid, out.text, out.token_ids, out.new_from_draft,
                   out.delta_spans, t.num_drafted, t.num_accepted, t.num_verify_steps)


class WsDone(msgspec.Struct):
    type: str  # "done"
    id: str
    finish_reason: str | None
    usage: UsageInfo
    timings: dict
    text: str  # the whole completion, for clients that skip the token events


class WsError(msgspec.Struct):
    type: str  # "error"
    id: str | None
    error: ErrorInfo
