"""The body of a completions / chat answer, whatever carries it: one JSON document, or SSE frames
ending with ``data: [DONE]``. Transport-neutral (bytes out), so the aiohttp server (server.py)
and the Ray Serve replicas (ray_serve.py) write the same bodies.

Errors before the first byte (bad body, queue full, not ready) are raised by ``open_reply`` and
mapped by the caller with ``api.error_of``; errors after the SSE stream has begun (the engine
died, the deadline passed) become one ``data: {"error": ...}`` event before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec

from specserve.engine.async_engine import EngineStepError, EngineUnavailableError
from specserve.engine.outputs import OutputMerger, RequestOutput
from specserve.engine.request_stream import RequestStream
from specserve.server import responses as R
from specserve.server.api import Job, Server, error_of
from specserve.server.deadlines import RequestTimeoutError
from specserve.server.tool_parsers import ParsedCall
from specserve.server.tool_stream import ToolCallStream, call_id, final_message

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}
SSE_DONE = b"data: [DONE]\n\n"
_enc = msgspec.json.Encoder()


def sse_frame(obj: object) -> bytes:
    return b"data: " + _enc.encode(obj) + b"\n\n"


def error_body(exc: BaseException) -> tuple[int, bytes]:
    """(HTTP status, OpenAI error JSON) of any exception."""
    status, info = error_of(exc)
    return status, _enc.encode(R.ErrorResponse(info))


@dataclass
class Reply:
    """One admitted request. Read it once, with ``json()`` (non-streaming) or ``sse()``; either
    closes its streams when done or abandoned (so the engine aborts what is unfinished)."""

    server: Server
    job: Job
    streams: list[RequestStream]
    finals: list[RequestOutput] = field(default_factory=list)  # each choice's last output

    @property
    def log_fields(self) -> dict:
        """The request's one log line (after the reply was read)."""
        usage = R.usage_of(self.finals)
        return {"request_id": self.job.id,
                "finish_reasons": [o.finish_reason for o in self.finals],
                "prompt_tokens": usage.prompt_tokens,
                "completion_tokens": usage.completion_tokens,
                "timings": R.timings_of(self.finals)}

    def close(self) -> None:
        for s in self.streams:
            s.close()

    async def json(self) -> bytes:
        """The whole answer: the deltas of each choice merged."""
        merged = [OutputMerger() for _ in self.streams]
        async for i, out in self.server.outputs(self.streams, self.job.deadline):
            merged[i].add(out)
        self.finals = [o for o in (m.take() for m in merged) if o is not None]
        return _enc.encode(_response(self.server, self.job, self.finals))

    async def sse(self) -> AsyncIterator[bytes]:
        """SSE frames (one per output with something new), then ``[DONE]``."""
        job, server, n = self.job, self.server, len(self.streams)
        sent_chars = [0] * n
        finals: list[RequestOutput | None] = [None] * n
        calls = ([ToolCallStream(job.tools.syntax, None if job.tools.parallel else 1)
                  for _ in range(n)] if job.tools is not None else None)
        try:
            if job.kind == "chat":
                for i in range(n):
                    yield sse_frame(_chat_chunk(job, i, R.ChatDelta("assistant", "")))
            async for i, out in server.outputs(self.streams, job.deadline):
                lps = (out.logprobs or []) if job.logprobs else []
                if not (out.text or out.finished or lps):
                    continue
                reason = out.finish_reason if out.finished else None
                timings = R.timings_of([out]) if out.finished else None
                if job.kind == "chat" and calls is not None:
                    lp = R.chat_logprobs(lps, server.token_text) if job.logprobs else None
                    for chunk in _tool_chunks(job, i, calls[i], out, lp, reason, timings):
                        yield sse_frame(chunk)
                    if out.finished:
                        finals[i] = out
                    continue
                if job.kind == "chat":
                    lp = R.chat_logprobs(lps, server.token_text) if job.logprobs else None
                    delta = R.ChatDelta(content=out.text or None)
                    chunk: object = _chat_chunk(job, i, delta, lp, reason, timings)
                else:
                    lp2 = (R.completion_logprobs(lps, server.token_text, sent_chars[i])
                           if job.logprobs else None)
                    choice = R.CompletionChoice(i, out.text, lp2, reason)
                    chunk = R.CompletionResponse(job.id, "text_completion", job.created,
                                                 job.model, [choice], timings=timings)
                sent_chars[i] += len(out.text)
                yield sse_frame(chunk)
                if out.finished:
                    finals[i] = out
            self.finals = [o for o in finals if o is not None]
            if job.include_usage:
                usage, timings = R.usage_of(self.finals), R.timings_of(self.finals)
                final: object = (_chat_chunk(job, None, None, usage=usage, timings=timings)
                                 if job.kind == "chat" else
                                 R.CompletionResponse(job.id, "text_completion", job.created,
                                                      job.model, [], usage, timings))
                yield sse_frame(final)
        except (EngineUnavailableError, EngineStepError, RequestTimeoutError) as exc:
            yield sse_frame(R.ErrorResponse(error_of(exc)[1]))  # mid-stream: an error event
        finally:
            self.close()
        yield SSE_DONE


async def open_reply(server: Server, kind: str, body: bytes, tenant: str = "",
                     arrival: float | None = None) -> Reply:
    """Parses and admits one request (raises for a 4xx/5xx answer before any byte is sent).
    ``arrival``: loop time the request arrived (its deadline starts there)."""
    arrival = asyncio.get_running_loop().time() if arrival is None else arrival
    if not server.engine.ready:  # cheap early answer; add_requests checks again
        raise EngineUnavailableError(f"the engine is not ready ({server.engine.state})")
    job = await server.parse(kind, body, arrival=arrival)
    return Reply(server, job, await server.admit(job, tenant))


def _with_logprobs(message: tuple[R.ChatMessageOut, str | None], job: Job, out: RequestOutput,
                   text: R.TokenText) -> tuple:
    lp = R.chat_logprobs(out.logprobs or [], text) if job.logprobs else None
    return message[0], lp, message[1]


def _chat_chunk(job: Job, index: int | None, delta: R.ChatDelta | None,
                lp: R.ChatLogprobs | None = None, reason: str | None = None,
                timings: dict | None = None, usage: R.UsageInfo | None = None) -> R.ChatChunk:
    choices = [] if index is None or delta is None else [
        R.ChatChunkChoice(index, delta, lp, reason)]
    return R.ChatChunk(job.id, "chat.completion.chunk", job.created, job.model, choices, usage,
                       timings)


def _tool_chunks(job: Job, i: int, calls: ToolCallStream, out: RequestOutput,
                 lp: R.ChatLogprobs | None, reason: str | None, timings: dict | None
                 ) -> list[R.ChatChunk]:
    """A tools request's chunks for one output: its new content (and logprobs), then each
    call completed by it (a delta with its id, type and name, then one with its arguments),
    then the finish reason ("tool_calls" where the answer called a tool and stopped)."""
    content, new = calls.feed(out.text, out.finished)
    chunks = []
    if content or lp is not None:
        chunks.append(_chat_chunk(job, i, R.ChatDelta(content=content or None), lp))
    for index, id_, call in new:
        head = R.ToolCallDelta(index, id_, "function", R.FunctionCallDelta(call.name, ""))
        args = R.ToolCallDelta(index, function=R.FunctionCallDelta(arguments=call.arguments))
        chunks += [_chat_chunk(job, i, R.ChatDelta(tool_calls=[head])),
                   _chat_chunk(job, i, R.ChatDelta(tool_calls=[args]))]
    if out.finished:
        if reason == "stop" and calls.sent_calls:
            reason = "tool_calls"
        chunks.append(_chat_chunk(job, i, R.ChatDelta(), None, reason, timings))
    return chunks


def _tool_call(call: ParsedCall) -> R.ToolCallOut:
    return R.ToolCallOut(call_id(), "function", R.FunctionCallOut(call.name, call.arguments))


def _chat_message(job: Job, out: RequestOutput) -> tuple[R.ChatMessageOut, str | None]:
    """The message and finish reason of one choice (its calls parsed out when it had tools)."""
    if job.tools is None:
        return R.ChatMessageOut("assistant", out.text), out.finish_reason
    msg = final_message(job.tools.syntax, out.text, None if job.tools.parallel else 1)
    if not msg.calls:
        return R.ChatMessageOut("assistant", out.text), out.finish_reason
    reason = "tool_calls" if out.finish_reason == "stop" else out.finish_reason
    return (R.ChatMessageOut("assistant", msg.content or None,
                             [_tool_call(c) for c in msg.calls]), reason)


def _response(server: Server, job: Job, outs: list[RequestOutput]) -> object:
    usage, timings = R.usage_of(outs), R.timings_of(outs)
    text = server.token_text
    if job.kind == "chat":
        chat_choices = [
            R.ChatChoice(i, *_with_logprobs(_chat_message(job, o), job, o, text))
            for i, o in enumerate(outs)]
        return R.ChatResponse(job.id, "chat.completion", job.created, job.model, chat_choices,
                              usage, timings)
    choices = [
        R.CompletionChoice(i, o.text,
                           R.completion_logprobs(o.logprobs or [], text, 0) if job.logprobs
                           else None, o.finish_reason)
        for i, o in enumerate(outs)]
    return R.CompletionResponse(job.id, "text_completion", job.created, job.model, choices,
                                usage, timings)
