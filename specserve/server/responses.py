"""OpenAI-compatible response bodies (msgspec Structs) and their construction from the engine's
outputs (usage, timings, logprobs). Requests are ``protocol.py``'s.

Structs with ``omit_defaults`` leave out only the optional extras (``usage``, ``timings``);
fields OpenAI always sends (``object``, ``finish_reason: null``, ``logprobs: null``) have no
default, or live on Structs that keep them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import msgspec

from specserve.core.sampling import TokenLogprob
from specserve.engine.outputs import RequestOutput, RequestTimings


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


class FunctionCallOut(msgspec.Struct):
    name: str
    arguments: str  # JSON text


class ToolCallOut(msgspec.Struct):
    id: str  # call_...
    type: str  # "function"
    function: FunctionCallOut


class ChatMessageOut(msgspec.Struct, omit_defaults=True):
    role: str
    content: str | None  # None: the answer is only tool calls
    tool_calls: list[ToolCallOut] | None = None


class FunctionCallDelta(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(msgspec.Struct, omit_defaults=True):
    """A call's first delta has its index, id, type and name (arguments ""), the next ones
    its index and argument text."""

    index: int
    id: str | None = None
    type: str | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


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
    # Extensions: the method of requests that name none, and why it is off where speculation
    # could change greedy answers on this model (None: it cannot).
    default_speculative_method: str = "off"
    speculation_caveat: str | None = None


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
