"""GET /ws: streaming over a WebSocket, several cancellable requests per connection.

It builds on api.py, the request plumbing the REST routes (server.py) share
(``Server.parse`` / ``admit`` / ``outputs``, ``error_of``), and does not import server.py.
"""

from __future__ import annotations

import asyncio
import uuid

import msgspec
from aiohttp import web

from specserve.core.errors import InvalidRequestError
from specserve.engine.async_engine import EngineUnavailableError
from specserve.server import responses as R
from specserve.server import ws_messages as W
from specserve.server.api import APP_KEY, error_of, log, tenant_of
from specserve.server.playground import WS_KEY_PROTOCOL

_enc = msgspec.json.Encoder()


async def websocket_handler(request: web.Request) -> web.StreamResponse:
    """WebSocket protocol (all messages JSON text frames, all tagged with the client's id):

    client -> {"type": "request", "id": ID, "kind": "completion" | "chat", ...body fields}
              {"type": "cancel", "id": ID}
    server -> {"type": "token", "id", "text", "token_ids", "from_draft", "text_spans",
               "num_drafted", "num_accepted", "num_verify_steps"}   (as tokens are accepted)
              {"type": "done", "id", "finish_reason", "usage", "timings", "text"}
              {"type": "error", "id", "error": {"message", "type", "param", "code"}}

    Requests run concurrently; ``n`` must be 1 and ``stream`` is implied. A cancelled request
    ends with a "done" event whose finish_reason is "abort". Closing the connection aborts all
    of its requests.
    """
    server = request.app[APP_KEY]
    if not server.engine.ready:
        raise EngineUnavailableError(f"the engine is not ready ({server.engine.state})")
    # Echo the page's key subprotocol (see playground.py), as browsers require.
    offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",")]
    ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=server.config.max_body_bytes,
                               protocols=[p for p in offered if p.startswith(WS_KEY_PROTOCOL)])
    await ws.prepare(request)
    server.websockets.add(ws)
    conn = uuid.uuid4().hex[:12]
    tasks: dict[str, asyncio.Task] = {}
    cancelled: set[str] = set()  # cancels that may arrive before their request is admitted
    lock = asyncio.Lock()

    async def send(obj: object) -> None:
        if not ws.closed:
            async with lock:
                await ws.send_str(_enc.encode(obj).decode())

    async def run(cid: str, kind: str, data: bytes, arrival: float) -> None:
        status: int | str = 200
        try:
            job = await server.parse(kind, data, stream=True, arrival=arrival, websocket=True)
            if len(job.seqs) != 1:
                raise InvalidRequestError("n must be 1 (and prompt a single one) over the "
                                          "WebSocket; open one request per choice", param="n")
            job.id = f"ws-{conn}-{cid}"
            streams = await server.admit(job, tenant_of(request))
            if cid in cancelled:
                server.engine.abort(streams[0].request_id)
            parts: list[str] = []  # the "done" event repeats the whole text
            async for _, out in server.outputs(streams, job.deadline):
                if out.text or out.token_ids:
                    parts.append(out.text)
                    await send(W.ws_token(cid, out))
                if out.finished and not (job.deadline and job.deadline.cut(out)):
                    # (cut by its deadline: outputs() raises next, and "error" is the end)
                    await send(W.WsDone("done", cid, out.finish_reason, R.usage_of([out]),
                                        R.timings_of([out]), "".join(parts)))
                    log.info("request", endpoint="/ws", request_id=job.id, status=200,
                             finish_reason=out.finish_reason,
                             prompt_tokens=out.num_prompt_tokens,
                             completion_tokens=out.num_output_tokens,
                             timings=R.timings_of([out]))
        except asyncio.CancelledError:
            status = "disconnected"
            raise
        except Exception as exc:
            status, info = error_of(exc)
            await send(W.WsError("error", cid, info))
        finally:
            tasks.pop(cid, None)
            cancelled.discard(cid)
            server.metrics.observe_request(f"/ws:{kind}", status)

    try:
        async for msg in ws:
            if msg.type not in (web.WSMsgType.TEXT, web.WSMsgType.BINARY):
                break
            data = msg.data.encode() if isinstance(msg.data, str) else msg.data
            try:
                env = msgspec.json.decode(data, type=W.WsEnvelope)
                if env.id is None or env.id == "":
                    raise InvalidRequestError("every message needs a non-empty id", param="id")
            except Exception as exc:
                await send(W.WsError("error", None, error_of(exc)[1]))
                continue
            cid = env.id
            if env.type == "cancel":
                if cid in tasks:
                    cancelled.add(cid)
                    server.engine.abort(f"ws-{conn}-{cid}-0")
            elif env.type != "request":
                await send(W.WsError("error", cid, R.ErrorInfo(
                    f"unknown message type {env.type!r}: use request or cancel",
                    "invalid_request_error", "type")))
            elif cid in tasks:
                await send(W.WsError("error", cid, R.ErrorInfo(
                    f"id {cid!r} is already running on this connection",
                    "invalid_request_error", "id")))
            else:
                arrival = asyncio.get_running_loop().time()  # starts its deadline
                tasks[cid] = asyncio.create_task(run(cid, env.kind, data, arrival))
    finally:
        pending = list(tasks.values())
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        server.websockets.discard(ws)
    return ws
