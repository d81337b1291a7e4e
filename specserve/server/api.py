"""Request handling shared by every transport: the REST routes (server.py) and the WebSocket
(ws.py) parse, admit and stream through the same ``Server``, and map errors the same way.

Kept apart from server.py so that ws.py builds on it without importing the REST module (no
import cycle), and so that another front end (the Ray Serve ingress in
specserve/scale/ray_serve.py) can reuse it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import structlog
from aiohttp import web

from specserve.core.errors import InvalidRequestError
from specserve.core.sampling_params import SamplingParams, SpeculativeParams
from specserve.core.tool_syntax import ToolSyntax
from specserve.engine.async_engine import (
    AsyncEngine,
    EngineStepError,
    EngineUnavailableError,
    QueueFullError,
)
from specserve.engine.outputs import RequestOutput
from specserve.engine.request_stream import RequestStream
from specserve.server import protocol as P
from specserve.server import responses as R
from specserve.server.deadlines import Deadline, DeadlineTimer, RequestTimeoutError, before_deadline
from specserve.server.metrics import ServerMetrics
from specserve.server.refusals import check_refused
from specserve.server.server_config import ServerConfig
from specserve.server.structured_fields import structured_spec
from specserve.server.tool_fields import ToolRequest, tool_request
from specserve.server.ws_messages import WsChatRequest, WsCompletionRequest

log = structlog.get_logger("specserve.server.app")


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.info = status, R.ErrorInfo(message, type_, param, code)


def error_of(exc: BaseException) -> tuple[int, R.ErrorInfo]:
    """Maps any exception to (HTTP status, OpenAI error); unknown ones are 500."""
    if isinstance(exc, ApiError):
        return exc.status, exc.info
    if isinstance(exc, InvalidRequestError):
        return 400, R.ErrorInfo(exc.message, "invalid_request_error", exc.param, exc.code)
    if isinstance(exc, msgspec.ValidationError):
        param = P.validation_param(str(exc))
        return 400, R.ErrorInfo(P.validation_message(str(exc), param), "invalid_request_error",
                                param)
    if isinstance(exc, msgspec.DecodeError):
        return 400, R.ErrorInfo(f"the body is not valid JSON: {exc}", "invalid_request_error",
                                code="invalid_json")
    if isinstance(exc, QueueFullError):
        return 429, R.ErrorInfo(str(exc), "rate_limit_error", code="queue_full")
    if isinstance(exc, EngineUnavailableError):
        return 503, R.ErrorInfo(str(exc), "service_unavailable", code="not_ready")
    if isinstance(exc, RequestTimeoutError):
        return 408, R.ErrorInfo(str(exc), "timeout_error", "timeout", "request_timeout")
    if isinstance(exc, EngineStepError):
        return 500, R.ErrorInfo(str(exc), "internal_error", code="engine_step_failed")
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return 413, R.ErrorInfo("the request body is too large (see --max-body-bytes)",
                                "invalid_request_error", code="body_too_large")
    if isinstance(exc, web.HTTPException):
        return exc.status, R.ErrorInfo(exc.reason, "invalid_request_error")
    return 500, R.ErrorInfo(f"internal error: {exc!r}", "internal_error")


@dataclass
class Job:
    """One parsed API request: a sequence per (prompt, choice), numbered prompt-major."""

    kind: str  # "completion" | "chat"
    id: str
    model: str
    seqs: list[tuple[str | list[int], SamplingParams]]
    spec: SpeculativeParams | None
    clamp: bool
    stream: bool
    include_usage: bool
    logprobs: bool
    created: int = field(default_factory=lambda: int(time.time()))
    deadline: Deadline | None = None  # its timeout, or --request-timeout
    tools: ToolRequest | None = None  # a chat request's tools: its answers are parsed for calls


class Server:
    """Per-app state (stored on the app, no globals): engine, config, metrics, open sockets."""

    def __init__(self, engine: AsyncEngine, config: ServerConfig, model: str | None) -> None:
        self.engine, self.config = engine, config
        self.model_name = config.model_name(model)
        self.aliases = {self.model_name, *([model] if model else [])}
        self.metrics = ServerMetrics(lambda: engine.stats, lambda: engine.num_unfinished)
        self.websockets: set[web.WebSocketResponse] = set()
        self.started = int(time.time())
        self._token_text: dict[int, str] = {}
        self.openapi: bytes | None = None  # GET /openapi.json, built on first request
        self._tool_syntax: tuple[ToolSyntax, dict[str, int]] | None = None

    def tool_syntax(self) -> tuple[ToolSyntax, dict[str, int]]:
        """The model's call syntax (from its chat template) and the call markers its tokenizer
        holds as one special token (marker -> token id)."""
        if self._tool_syntax is None:
            tok = self.engine.engine.tokenizer
            syntax = ToolSyntax.of_template(getattr(tok, "chat_template", None))
            special: dict[str, int] = {}
            for marker in syntax.markers:
                ids = tok.encode(marker, add_special_tokens=False)
                if len(ids) == 1 and tok.decode(ids, skip_special_tokens=True) == "":
                    special[marker] = ids[0]
            self._tool_syntax = (syntax, special)
        return self._tool_syntax

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            tok = self.engine.engine.tokenizer
            text = tok.decode([token_id]) if tok is not None else str(token_id)
            self._token_text[token_id] = text
        return text

    async def parse(self, kind: str, body: bytes, stream: bool | None = None,
                    arrival: float | None = None, websocket: bool = False) -> Job:
        """Decodes and validates a completions / chat body (the chat template renders on the
        engine's text worker, not on the loop); raises 400/404-class errors, a field the
        server does not implement included (refusals.py). ``arrival`` (loop time, default now)
        starts the request's deadline; ``websocket``: the body also carries the WebSocket
        envelope's fields."""
        arrival = asyncio.get_running_loop().time() if arrival is None else arrival
        deadline: Deadline | None = None
        tools: ToolRequest | None = None
        if kind == "chat":
            chat = P.decode_request(
                body, WsChatRequest if websocket else P.ChatCompletionRequest)
            check_refused(chat)
            deadline = Deadline.of(chat.timeout, self.config.request_timeout, arrival)
            if chat.tools or chat.tool_choice not in (None, "none"):
                if websocket:
                    raise InvalidRequestError(
                        "tools are not supported over the WebSocket (it streams raw tokens); "
                        "use POST /v1/chat/completions", param="tools")
                constrained = structured_spec(chat.response_format,
                                              chat.structured_outputs) is not None
                tools = tool_request(chat.tools, chat.tool_choice, chat.parallel_tool_calls,
                                     chat.n, constrained, *self.tool_syntax())
            messages = P.chat_messages(chat)
            try:
                prompt: str | list[int] = await before_deadline(
                    deadline, self.engine.render_chat(messages, tools and tools.tools),
                    self.metrics.observe_timeout)
            except (InvalidRequestError, RequestTimeoutError):
                raise
            except Exception as exc:  # the model's template rejected the conversation
                raise InvalidRequestError(f"chat template failed: {exc}", "messages") from exc
            params, clamp = P.chat_params(chat, self.engine.max_model_len, tools)
            seqs = [(prompt, p) for p in params]
            req: P._Common = chat
            logprobs = chat.logprobs
        elif kind == "completion":
            comp = P.decode_request(
                body, WsCompletionRequest if websocket else P.CompletionRequest)
            check_refused(comp)
            deadline = Deadline.of(comp.timeout, self.config.request_timeout, arrival)
            params, clamp = P.completion_params(comp), False
            seqs = [(prompt, p) for prompt in P.completion_prompts(comp) for p in params]
            req, logprobs = comp, comp.logprobs is not None
        else:
            raise InvalidRequestError("kind must be completion or chat", param="kind")
        if req.model is not None and req.model not in self.aliases:
            raise ApiError(404, f"model {req.model!r} is not served here; this server serves "
                           f"{self.model_name!r} (GET /v1/models)", "invalid_request_error",
                           "model", "model_not_found")
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        return Job(kind, f"{prefix}-{uuid.uuid4().hex}", self.model_name, seqs,
                   P.speculative_params(req), clamp, req.stream if stream is None else stream,
                   bool(req.stream_options and req.stream_options.include_usage), logprobs,
                   deadline=deadline, tools=tools)

    async def admit(self, job: Job, tenant: str = "") -> list[RequestStream]:
        """``tenant``: the caller's API-key tenant (``tenant_of``); speculation drafts only
        from that tenant's cached outputs. A non-streaming job's streams yield one output
        each, at its end (the engine does not wake the event loop before)."""
        spec = replace(job.spec or SpeculativeParams(), tenant=tenant)
        reqs = [(f"{job.id}-{i}", prompt, params, spec)
                for i, (prompt, params) in enumerate(job.seqs)]
        return await before_deadline(
            job.deadline,
            self.engine.add_requests(reqs, clamp_max_tokens=job.clamp, stream=job.stream),
            self.metrics.observe_timeout)

    async def outputs(
        self, streams: list[RequestStream], deadline: Deadline | None = None
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Merges the streams as (choice index, output), feeding the latency metrics; closing
        it (or cancelling its consumer) aborts every unfinished stream. At the ``deadline``
        the unfinished streams are aborted; after their final ("abort") outputs it raises
        ``RequestTimeoutError``. One stream (the usual case) is read directly, without a
        task per output."""
        last = [time.perf_counter()] * len(streams)
        pending: dict[asyncio.Future, int] = {}
        timer = DeadlineTimer(deadline, lambda: [self.engine.abort(s.request_id)
                                                 for s in streams])
        cut = False

        def seen(i: int, out: RequestOutput) -> None:
            nonlocal cut
            now = time.perf_counter()
            if out.timings.ttft_ms is not None and out.num_output_tokens > len(out.token_ids):
                self.metrics.observe_gap(now - last[i], len(out.token_ids))
            last[i] = now
            if out.finished:
                self.metrics.observe_finished(out)
                cut |= deadline is not None and deadline.cut(out)

        try:
            if len(streams) == 1:
                async for out in streams[0]:
                    seen(0, out)
                    yield 0, out
            else:
                pending.update({asyncio.ensure_future(s.__anext__()): i
                                for i, s in enumerate(streams)})
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in sorted(done, key=pending.__getitem__):
                    i = pending.pop(fut)
                    out = fut.result()
                    seen(i, out)
                    if not out.finished:
                        pending[asyncio.ensure_future(streams[i].__anext__())] = i
                    yield i, out
            if cut:
                assert deadline is not None
                self.metrics.observe_timeout()
                raise deadline.error()
        finally:
            timer.cancel()
            for fut in pending:
                fut.cancel()
            for s in streams:
                s.close()


APP_KEY = web.AppKey("specserve", Server)
# The caller's tenant, set by the middleware from the API key.
TENANT_KEY: Any = (web.RequestKey("specserve_tenant", str) if hasattr(web, "RequestKey")
                   else "tenant")


def tenant_of(request: web.Request) -> str:
    """The request's tenant: a digest of its API key ("" when the server has no keys). Caches
    keep the digest, never the key."""
    return request.get(TENANT_KEY, "")
