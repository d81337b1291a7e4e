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
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import msgspec
import structlog
from aiohttp import web

from specserve.engine.async_engine import (
    AsyncEngine,
    EngineUnavailableError,
)
from specserve.server import responses as R
from specserve.server.api import (  # noqa: F401  (APP_KEY, Job, Server: re-exported for callers)
    APP_KEY,
    TENANT_KEY,
    ApiError,
    Job,
    Server,
    error_of,
    log,
    tenant_of,
)
from specserve.server.metrics import CONTENT_TYPE
from specserve.server.openapi import openapi_document
from specserve.server.playground import WS_KEY_PROTOCOL
from specserve.server.playground import add_routes as add_playground
from specserve.server.replies import SSE_HEADERS, open_reply
from specserve.server.server_config import ServerConfig
from specserve.server.ws import websocket_handler

_enc = msgspec.json.Encoder()


# The one log line's fields, filled by the handler, written by the middleware.
LOG_KEY: Any = web.RequestKey("specserve_log", dict) if hasattr(web, "RequestKey") else "log"


_AUTH_PATHS = ("/ws", "/playground/info")


def bearer_token(request: web.Request) -> str | None:
    """The API key from `Authorization: Bearer KEY`, or, on a WebSocket handshake (browsers
    cannot set its headers), from the offered subprotocol `specserve.bearer.KEY`."""
    auth = request.headers.get("Authorization", "")
    if auth.startswith("Bearer "):
        return auth[len("Bearer "):]
    for proto in request.headers.get("Sec-WebSocket-Protocol", "").split(","):
        if proto.strip().startswith(WS_KEY_PROTOCOL):
            return proto.strip()[len(WS_KEY_PROTOCOL):]
    return None


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(body=_enc.encode(obj), status=status, content_type="application/json")


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
        resp = _json(R.ErrorResponse(info), status)
        if isinstance(exc, web.HTTPMethodNotAllowed):  # RFC 9110: a 405 names what is allowed
            resp.headers["Allow"] = exc.headers["Allow"]
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


async def _api(request: web.Request, kind: str) -> web.StreamResponse:
    server = request.app[APP_KEY]
    arrival = asyncio.get_running_loop().time()
    reply = await open_reply(server, kind, await _body(request), tenant_of(request), arrival)
    try:
        if not reply.job.stream:
            body = await reply.json()
            request[LOG_KEY] = reply.log_fields
            return web.Response(body=body, content_type="application/json")
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        async with aclosing(reply.sse()) as frames:
            async for frame in frames:
                await resp.write(frame)
        if reply.finals:
            request[LOG_KEY] = reply.log_fields
        await resp.write_eof()
        return resp
    finally:
        reply.close()


async def completions(request: web.Request) -> web.StreamResponse:
    return await _api(request, "completion")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _api(request, "chat")


async def models(request: web.Request) -> web.Response:
    s = request.app[APP_KEY]
    config = s.engine.engine.config
    card = R.ModelCard(s.model_name, "model", s.started, "specserve", s.engine.max_model_len,
                       config.default_speculative_method, config.speculation_caveat)
    return _json(R.ModelList("list", [card]))


async def health(request: web.Request) -> web.Response:
    engine = request.app[APP_KEY].engine
    st = engine.stats
    body = R.HealthResponse(engine.state, st.kv_blocks_free, st.kv_blocks_total,
                            st.num_running, st.num_waiting, engine.num_unfinished)
    return _json(body, 200 if engine.ready else 503)


async def openapi(request: web.Request) -> web.Response:
    server = request.app[APP_KEY]
    if server.openapi is None:
        engine = server.engine.engine
        spec = engine.speculator
        methods = [m for m in spec.registry.methods() if spec.available(m)]
        syntax = server.tool_syntax()[0]
        server.openapi = _enc.encode(openapi_document(
            bool(server.config.api_key), engine.model_config.vocab_size, methods,
            server.engine.max_model_len, None if syntax.name else syntax.reason))
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
    the server as SIGTERM would; ``specserve serve`` then exits 1 so a supervisor restarts it.
    It sleeps until the thread ends (no polling: the loop stays asleep between requests)."""
    await engine.wait_stopped()
    if engine.error is None:  # a clean shutdown
        return
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

    app.router.add_get("/ws", websocket_handler)
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
    inner = engine.engine
    log.info("listening", host=config.host, port=config.port, model=app[APP_KEY].model_name,
             engine=inner.config.summary(),
             attention_form=getattr(inner.attn_backend, "form", None),
             threads=inner.threads.describe())
    web.run_app(app, host=config.host, port=config.port, print=None, access_log=None,
                handler_cancellation=True, shutdown_timeout=config.shutdown_timeout)
    log.info("stopped")
