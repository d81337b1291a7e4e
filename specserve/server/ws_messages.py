"""The WebSocket's messages (GET /ws; see README: "WebSocket protocol"): a request is a REST
body plus the envelope's fields; the server answers with token, done and error events."""

from __future__ import annotations

import msgspec

from specserve.engine.outputs import RequestOutput
from specserve.server.protocol import ChatCompletionRequest, CompletionRequest
from specserve.server.responses import ErrorInfo, UsageInfo


# A WebSocket request is its body's fields plus the envelope's (WsEnvelope).
class WsCompletionRequest(CompletionRequest, kw_only=True):
    type: str = "request"
    id: str | None = None
    kind: str = "completion"


class WsChatRequest(ChatCompletionRequest, kw_only=True):
    type: str = "request"
    id: str | None = None
    kind: str = "chat"


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
