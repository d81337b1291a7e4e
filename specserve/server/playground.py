"""The A/B playground: one static page (specserve/server/static/playground/) served by the server.

Routes: GET / and GET /playground (the page), GET /playground/static/* (its CSS and JS),
GET /playground/info (what the page needs to build its form: the served model name, the
speculation methods this server can run, its defaults). The page talks to the server only
through the public WebSocket API (GET /ws); nothing is fetched from the network at run time.
"""

from __future__ import annotations

from pathlib import Path

import msgspec
from aiohttp import web

from specserve.server.api import APP_KEY

STATIC_DIR = Path(__file__).parent / "static" / "playground"
# Browsers cannot set headers on a WebSocket, so the page offers its API key as the subprotocol
# "specserve.bearer.KEY"; the server's auth accepts it there (server.bearer_token).
WS_KEY_PROTOCOL = "specserve.bearer."


class PlaygroundInfo(msgspec.Struct):
    model: str
    # every speculative method this server can run for the page's requests, "off" included
    # (not the one that drafts from a request's prediction: the page sends none)
    methods: list[str]
    default_method: str
    num_speculative_tokens: int
    max_model_len: int


async def _page(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC_DIR / "index.html",
                            headers={"Cache-Control": "no-cache"})


async def _info(request: web.Request) -> web.Response:
    server = request.app[APP_KEY]
    engine = server.engine.engine
    spec = engine.speculator
    info = PlaygroundInfo(
        model=server.model_name,
        methods=[m for m in spec.registry.methods()
                 if spec.available(m) and m != spec.registry.prediction_method()],
        default_method=engine.config.default_speculative_method,
        num_speculative_tokens=engine.config.num_speculative_tokens,
        max_model_len=server.engine.max_model_len,
    )
    return web.Response(body=msgspec.json.encode(info), content_type="application/json")


def add_routes(app: web.Application) -> None:
    app.router.add_get("/", _page)
    app.router.add_get("/playground", _page)
    app.router.add_get("/playground/info", _info)
    app.router.add_static("/playground/static", STATIC_DIR, append_version=False)
