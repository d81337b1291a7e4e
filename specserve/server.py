"""The HTTP/WebSocket front door: an aiohttp app over one ``AsyncEngine``.

Routes: POST /v1/completions, POST /v1/chat/completions (``stream: true`` -> SSE ending with
``data: [DONE]``), GET /v1/models, GET /ws (WebSocket streaming; protocol below and in the README),
GET /health (503 until warm-up is done), GET /metrics (Prometheus text), GET /openapi.json
(the OpenAPI 3.1 document generated from protocol.py's types), GET / and /playground (the A/B
playground page, see playground.py).

Invariants: the event loop never runs a forward pass (the engine thread does); every admitted
sequence is closed by the handler that admitted it (``finally``), so a client that goes away,
a cancelled handler or an exception aborts its sequences and frees their KV blocks; every error
reaches the client as ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec
import structlog
from aiohttp import web

from specserve import protocol as P
from specserve.async_engine import (
    AsyncEngine,
    EngineStepError,
    EngineUnavailableError,
    QueueFullError,
    RequestStream,
)
from specserve.deadlines import Deadline, DeadlineTimer, RequestTimeoutError, before_deadline
from specserve.errors import InvalidRequestError
from specserve.metrics import CONTENT_TYPE, ServerMetrics
from specserve.openapi import openapi_document
from specserve.outputs import OutputMerger, RequestOutput
from specserve.sampling_params import SamplingParams, SpeculativeParams
from specserve.server_config import ServerConfig

log = structlog.get_logger("specserve.server")
_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"}
_DONE = b"data: [DONE]\n\n"
_enc = msgspec.json.Encoder()


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.info = status, P.ErrorInfo(message, type_, param, code)


def error_of(exc: BaseException) -> tuple[int, P.ErrorInfo]:
    """Maps any exception to (HTTP status, OpenAI error); unknown ones are 500."""
    if isinstance(exc, ApiError):
        return exc.status, exc.info
    if isinstance(exc, InvalidRequestError):
        return 400, P.ErrorInfo(exc.message, "invalid_request_error", exc.param)
    if isinstance(exc, msgspec.ValidationError):
        param = P.validation_param(str(exc))
        return 400, P.ErrorInfo(P.validation_message(str(exc), param), "invalid_request_error",
                                param)
    if isinstance(exc, msgspec.DecodeError):
        return 400, P.ErrorInfo(f"the body is not valid JSON: {exc}", "invalid_request_error",
                                code="invalid_json")
    if isinstance(exc, QueueFullError):
        return 429, P.ErrorInfo(str(exc), "rate_limit_error", code="queue_full")
    if isinstance(exc, EngineUnavailableError):
        return 503, P.ErrorInfo(str(exc), "service_unavailable", code="not_ready")
    if isinstance(exc, RequestTimeoutError):
        return 408, P.ErrorInfo(str(exc), "timeout_error", "timeout", "request_timeout")
    if isinstance(exc, EngineStepError):
        return 500, P.ErrorInfo(str(exc), "internal_error", code="engine_step_failed")
    if isinstance(exc, web.HTTPRequestEntityTooLarge):
        return 413, P.ErrorInfo("the request body is too large (see --max-body-bytes)",
                                "invalid_request_error", code="body_too_large")
    if isinstance(exc, web.HTTPException):
        return exc.status, P.ErrorInfo(exc.reason, "invalid_request_error")
    return 500, P.ErrorInfo(f"internal error: {exc!r}", "internal_error")


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

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            tok = self.engine.engine.tokenizer
            text = tok.decode([token_id]) if tok is not None else str(token_id)
            self._token_text[token_id] = text
        return text

    async def parse(self, kind: str, body: bytes, stream: bool | None = None,
                    arrival: float | None = None) -> Job:
        """Decodes and validates a completions / chat body (the chat template renders on the
        engine's text worker, not on the loop); raises 400/404-class errors. ``arrival``
        (loop time, default now) starts the request's deadline."""
        arrival = asyncio.get_running_loop().time() if arrival is None else arrival
        deadline: Deadline | None = None
        if kind == "chat":
            chat = msgspec.json.decode(body, type=P.ChatCompletionRequest)
            deadline = Deadline.of(chat.timeout, self.config.request_timeout, arrival)
            messages = P.chat_messages(chat)
            try:
                prompt: str | list[int] = await before_deadline(
                    deadline, self.engine.render_chat(messages), self.metrics.observe_timeout)
            except (InvalidRequestError, RequestTimeoutError):
                raise
            except Exception as exc:  # the model's template rejected the conversation
                raise InvalidRequestError(f"chat template failed: {exc}", "messages") from exc
            params, clamp = P.chat_params(chat, self.engine.max_model_len)
            seqs = [(prompt, p) for p in params]
            req: P._Common = chat
            logprobs = chat.logprobs
        elif kind == "completion":
            comp = msgspec.json.decode(body, type=P.CompletionRequest)
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
                   deadline=deadline)

    async def admit(self, job: Job, tenant: str = "") -> list[RequestStream]:
        """``tenant``: the caller's API-key tenant (``tenant_of``); speculation drafts only
        from that tenant's cached outputs."""
        spec = replace(job.spec or SpeculativeParams(), tenant=tenant)
        reqs = [(f"{job.id}-{i}", prompt, params, spec)
                for i, (prompt, params) in enumerate(job.seqs)]
        return await before_deadline(
            job.deadline, self.engine.add_requests(reqs, clamp_max_tokens=job.clamp),
            self.metrics.observe_timeout)

    async def outputs(
        self, streams: list[RequestStream], deadline: Deadline | None = None
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Merges the streams as (choice index, output), feeding the latency metrics; closing
        it (or cancelling its consumer) aborts every unfinished stream. At the ``deadline``
        the unfinished streams are aborted; after their final ("abort") outputs it raises
        ``RequestTimeoutError``."""
        last = [time.perf_counter()] * len(streams)
        pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
        timer = DeadlineTimer(deadline, lambda: [self.engine.abort(s.request_id)
                                                 for s in streams])
        cut = False
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in sorted(done, key=pending.__getitem__):
                    i = pending.pop(fut)
                    out = fut.result()
                    now = time.perf_counter()
                    if out.timings.ttft_ms is not None and out.num_output_tokens > len(
                        out.token_ids
                    ):
                        self.metrics.observe_gap(now - last[i], len(out.token_ids))
                    last[i] = now
                    if out.finished:
                        self.metrics.observe_finished(out)
                        cut |= deadline is not None and deadline.cut(out)
                    else:
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
# The one log line's fields, filled by the handler, written by the middleware.
LOG_KEY: Any = web.RequestKey("specserve_log", dict) if hasattr(web, "RequestKey") else "log"
# The caller's tenant, set by the middleware from the API key.
TENANT_KEY: Any = (web.RequestKey("specserve_tenant", str) if hasattr(web, "RequestKey")
                   else "tenant")


def tenant_of(request: web.Request) -> str:
    """The request's tenant: a digest of its API key ("" when the server has no keys). Caches
    keep the digest, never the key."""
    return request.get(TENANT_KEY, "")


_AUTH_PATHS = ("/ws", "/playground/info")


def bearer_token(request: web.Request) -> str | None:
    """The API key from `Authorization: Bearer KEY`, or, on a WebSocket handshake (browsers
    cannot set its headers), from the offered subprotocol `specserve.bearer.KEY`."""
    from specserve.playground import WS_KEY_PROTOCOL

    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        return auth[len("Bearer "):]
    for proto in request.headers.get("Sec-WebSocket-Protocol", "").split(","):
        if proto.strip().startswith(WS_KEY_PROTOCOL):
            return proto.strip()[len(WS_KEY_PROTOCOL):]
    return None


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=_enc.encode(obj), status=status, content_type="application/json")


def _sse(obj: object) -> bytes:
    return b"data: " + _enc.encode(obj) + b"\n\n"


@web.middleware
async def _middleware(request: web.Request, handler) -> web.StreamResponse:
    server = request.app[APP_KEY]
    route = request.match_info.route.resource
    endpoint = route.canonical if route is not None else "unmatched"
    t0 = time.perf_counter()
    try:
        keys = server.config.tenants
        if keys and (request.path.startswith("/v1/") or request.path in _AUTH_PATHS):
            token = bearer_token(request)
            tenant = keys.get(token) if token is not None else None
            if tenant is None:
                raise ApiError(401, "missing or wrong API key: send `Authorization: Bearer KEY`",
                               "authentication_error", code="invalid_api_key")
            request[TENANT_KEY] = tenant
        resp = await handler(request)
    except (asyncio.CancelledError, ConnectionResetError):
        server.metrics.observe_request(endpoint, "disconnected")
        raise
    except Exception as exc:
        status, info = error_of(exc)
        if status >= 500 and not isinstance(exc, (EngineUnavailableError, ApiError)):
            log.exception("request_failed", endpoint=endpoint)
        resp = _json(P.ErrorResponse(info), status)
        request[LOG_KEY] = {**request.get(LOG_KEY, {}), "error": info.message, "param": info.param}
    server.metrics.observe_request(endpoint, resp.status)
    if request.path.startswith("/v1/") and request.method == "POST":
        log.info("request", endpoint=endpoint, status=resp.status,
                 ms=round((time.perf_counter() - t0) * 1e3, 2), **request.get(LOG_KEY, {}))
    return resp


async def _body(request: web.Request) -> bytes:
    limit = request.app[APP_KEY].config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    return await request.read()


def _finish_log(request: web.Request, job: Job, outs: list[RequestOutput]) -> None:
    usage = P.usage_of(outs)
    request[LOG_KEY] = {"request_id": job.id, "finish_reasons": [o.finish_reason for o in outs],
                      "prompt_tokens": usage.prompt_tokens,
                      "completion_tokens": usage.completion_tokens,
                      "timings": P.timings_of(outs)}


async def _api(request: web.Request, kind: str) -> web.StreamResponse:
    server = request.app[APP_KEY]
    arrival = asyncio.get_running_loop().time()
    if not server.engine.ready:  # cheap early answer; add_requests checks again
        raise EngineUnavailableError(f"the engine is not ready ({server.engine.state})")
    job = await server.parse(kind, await _body(request), arrival=arrival)
    streams = await server.admit(job, tenant_of(request))
    finals: list[RequestOutput | None] = [None] * len(streams)
    if not job.stream:  # the deltas of each choice merged into its whole answer
        merged = [OutputMerger() for _ in streams]
        async for i, out in server.outputs(streams, job.deadline):
            merged[i].add(out)
        outs = [o for o in (m.take() for m in merged) if o is not None]
        _finish_log(request, job, outs)
        return _json(_response(server, job, outs))
    resp = web.StreamResponse(headers=_SSE_HEADERS)
    await resp.prepare(request)
    sent_chars = [0] * len(streams)
    try:
        if kind == "chat":
            for i in range(len(streams)):
                await resp.write(_sse(_chat_chunk(job, i, P.ChatDelta("assistant", ""))))
        async for i, out in server.outputs(streams, job.deadline):
            lps = (out.logprobs or []) if job.logprobs else []
            if not (out.text or out.finished or lps):
                continue
            reason = out.finish_reason if out.finished else None
            timings = P.timings_of([out]) if out.finished else None
            if kind == "chat":
                lp = P.chat_logprobs(lps, server.token_text) if job.logprobs else None
                delta = P.ChatDelta(content=out.text or None)
                chunk: object = _chat_chunk(job, i, delta, lp, reason, timings)
            else:
                lp2 = (P.completion_logprobs(lps, server.token_text, sent_chars[i])
                       if job.logprobs else None)
                choice = P.CompletionChoice(i, out.text, lp2, reason)
                chunk = P.CompletionResponse(job.id, "text_completion", job.created, job.model,
                                             [choice], timings=timings)
            sent_chars[i] += len(out.text)
            await resp.write(_sse(chunk))
            if out.finished:
                finals[i] = out
        outs = [o for o in finals if o is not None]
        if job.include_usage:
            usage, timings = P.usage_of(outs), P.timings_of(outs)
            final: object = (_chat_chunk(job, None, None, usage=usage, timings=timings)
                             if kind == "chat" else
                             P.CompletionResponse(job.id, "text_completion", job.created,
                                                  job.model, [], usage, timings))
            await resp.write(_sse(final))
        _finish_log(request, job, outs)
    except (EngineUnavailableError, EngineStepError, RequestTimeoutError) as exc:  # mid-stream
        await resp.write(_sse(P.ErrorResponse(error_of(exc)[1])))
    await resp.write(_DONE)
    await resp.write_eof()
    return resp


def _chat_chunk(job: Job, index: int | None, delta: P.ChatDelta | None,
                lp: P.ChatLogprobs | None = None, reason: str | None = None,
                timings: dict | None = None, usage: P.UsageInfo | None = None) -> P.ChatChunk:
    choices = [] if index is None or delta is None else [
        P.ChatChunkChoice(index, delta, lp, reason)]
    return P.ChatChunk(job.id, "chat.completion.chunk", job.created, job.model, choices, usage,
                       timings)


def _response(server: Server, job: Job, outs: list[RequestOutput]) -> object:
    usage, timings = P.usage_of(outs), P.timings_of(outs)
    text = server.token_text
    if job.kind == "chat":
        chat_choices = [
            P.ChatChoice(i, P.ChatMessageOut("assistant", o.text),
                         P.chat_logprobs(o.logprobs or [], text) if job.logprobs else None,
                         o.finish_reason)
            for i, o in enumerate(outs)]
        return P.ChatResponse(job.id, "chat.completion", job.created, job.model, chat_choices,
                              usage, timings)
    choices = [
        P.CompletionChoice(i, o.text,
                           P.completion_logprobs(o.logprobs or [], text, 0) if job.logprobs
                           else None, o.finish_reason)
        for i, o in enumerate(outs)]
    return P.CompletionResponse(job.id, "text_completion", job.created, job.model, choices,
                                usage, timings)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _api(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _api(request, "chat")


async def models(request: web.Request) -> web.Response:
    s = request.app[APP_KEY]
    card = P.ModelCard(s.model_name, "model", s.started, "specserve", s.engine.max_model_len)
    return _json(P.ModelList("list", [card]))


async def health(request: web.Request) -> web.Response:
    engine = request.app[APP_KEY].engine
    st = engine.stats
    body = P.HealthResponse(engine.state, st.kv_blocks_free, st.kv_blocks_total,
                            st.num_running, st.num_waiting, engine.num_unfinished)
    return _json(body, 200 if engine.ready else 503)


async def openapi(request: web.Request) -> web.Response:
    server = request.app[APP_KEY]
    if server.openapi is None:
        server.openapi = _enc.encode(openapi_document(bool(server.config.api_key)))
    return web.Response(body=server.openapi, content_type="application/json")


async def metrics(request: web.Request) -> web.Response:
    body = request.app[APP_KEY].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """A client's ``X-Request-Id`` comes back on its response, so it can match every answer
    to the request it sent (no answer lost, none duplicated or crossed)."""
    rid = request.headers.get("X-Request-Id")
    if rid is not None and len(rid) <= 200:
        response.headers["X-Request-Id"] = rid


async def _on_startup(app: web.Application) -> None:
    app[APP_KEY].engine.start()


async def _exit_when_engine_dies(engine: AsyncEngine, grace_s: float = 1.0) -> None:
    """``run_server`` only: once the engine thread has died (``/health`` is 503 and in-flight
    requests got their error), wait ``grace_s`` for handlers to write those errors, then stop
    the server as SIGTERM would; ``specserve serve`` then exits 1 so a supervisor restarts it."""
    while engine.error is None:
        await asyncio.sleep(0.1)
    log.error("engine_dead", error=repr(engine.error))
    await asyncio.sleep(grace_s)
    os.kill(os.getpid(), signal.SIGTERM)


async def _on_shutdown(app: web.Application) -> None:
    """SIGTERM / cleanup: refuse new work, abort in-flight sequences (their clients get a final
    event with finish_reason "abort"), give the handlers time to write it, close sockets."""
    server = app[APP_KEY]
    server.engine.begin_shutdown()
    deadline = time.monotonic() + server.config.shutdown_timeout
    while server.engine.num_unfinished and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    for ws in list(server.websockets):
        await ws.close(code=1001, message=b"server shutting down")


async def _on_cleanup(app: web.Application) -> None:
    await app[APP_KEY].engine.shutdown()


def create_app(engine: AsyncEngine, config: ServerConfig, model: str | None = None
               ) -> web.Application:
    """The app; starting it (AppRunner / run_app) starts the engine thread and its warm-up.
    ``model`` is the --model value, accepted as an alias of the served name."""
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=[_middleware])
    app[APP_KEY] = Server(engine, config, model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    from specserve.ws import websocket_handler  # ws.py builds on this module's helpers

    app.router.add_get("/ws", websocket_handler)
    from specserve.playground import add_routes as add_playground

    add_playground(app)  # GET / and /playground: the A/B page
    app.on_response_prepare.append(_echo_request_id)
    app.on_startup.append(_on_startup)
    app.on_shutdown.append(_on_shutdown)
    app.on_cleanup.append(_on_cleanup)
    return app


def configure_logging() -> None:
    """structlog -> one JSON object per line on stdout (request lines; never per token)."""
    structlog.configure(
        processors=[structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.JSONRenderer()],
        logger_factory=structlog.PrintLoggerFactory(),
        cache_logger_on_first_use=True,
    )


def run_server(engine: AsyncEngine, config: ServerConfig, model: str | None = None) -> None:
    """Serves until SIGINT/SIGTERM, then shuts down cleanly (see ``_on_shutdown``) and returns.
    The caller picks the event loop policy (uvloop in ``specserve serve``)."""
    app = create_app(engine, config, model)

    async def watchdog(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(_exit_when_engine_dies(engine))
        yield
        task.cancel()

    app.cleanup_ctx.append(watchdog)
    log.info("listening", host=config.host, port=config.port, model=app[APP_KEY].model_name)
    web.run_app(app, host=config.host, port=config.port, print=None, access_log=None,
                handler_cancellation=True, shutdown_timeout=config.shutdown_timeout)
    log.info("stopped")
