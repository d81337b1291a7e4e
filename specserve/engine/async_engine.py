"""AsyncEngine: drives the synchronous ``LLMEngine`` from one dedicated thread for asyncio callers.

Threading contract (``LLMEngine`` is not thread-safe):
  - only the engine thread calls ``add_request`` / ``step`` / ``abort``; the event loop hands it
    commands through a ``queue.Queue`` that it drains before every step;
  - text work that is neither the loop's nor the step's (chat templates, tokenizing prompts of up
    to --max-body-bytes) runs on one "specserve-text" worker thread: the engine thread only ever
    receives token ids, so a huge prompt never stalls the other streams' steps, and the loop
    stays free. The tokenizer releases the GIL while it encodes. One worker serialises every
    encode; the engine thread only decodes (read-only on the tokenizer);
  - the engine thread hands results back with ``loop.call_soon_threadsafe``: one call per step
    carrying every (request id, item) pair, where an item is a ``RequestOutput``, the
    ``_ACCEPTED`` acknowledgement of an add, or the exception the add raised;
  - the per-request stream registry lives on the event loop only, so no dict is shared.

Invariant: every request the engine thread accepted gets exactly one finished output (done,
aborted by a client, or aborted at shutdown); a consumer that stops early aborts its request, and
the engine frees its KV blocks before its next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from specserve.core.errors import InvalidRequestError
from specserve.core.sampling_params import SamplingParams, SpeculativeParams
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.outputs import OutputMerger, RequestOutput

log = logging.getLogger(__name__)

_ACCEPTED = object()  # item: the engine thread took the request
_STOP = object()  # command: abort everything and leave the loop


class EngineUnavailableError(RuntimeError):
    """The engine is warming up, shutting down or has failed (HTTP 503)."""


class EngineStepError(RuntimeError):
    """An engine step raised; the requests in it were ended and their KV blocks freed, and the
    engine goes on serving the others (HTTP 500 / an SSE or WebSocket error event)."""


class QueueFullError(RuntimeError):
    """Admitting the request would exceed max_num_seqs + max_queue_len (HTTP 429)."""


@dataclass(frozen=True)
class EngineStats:
    """A snapshot the engine thread publishes after each step (read by /health and /metrics)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_total: int = 0
    kv_blocks_free: int = 0
    kv_blocks_cached: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    step_failures: int = 0  # engine steps that raised (each failed its running requests)
    version: int = 0  # bumps on every publish


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    speculative: SpeculativeParams | None
    clamp_max_tokens: bool


class RequestStream:
    """Async iterator over one request's outputs (deltas); the last one has ``finished`` set.

    The engine's deltas are merged while they wait (``OutputMerger``), so a reader that falls
    behind gets one output carrying everything it has not read yet: what the stream holds is
    bounded by what its client has not taken, never one queued object per engine step.

    Use it as ``async with stream:``; leaving the block (normally, by an exception or by task
    cancellation) before the final output aborts the request.
    """

    def __init__(self, engine: AsyncEngine, request_id: str) -> None:
        self.request_id = request_id
        self._engine = engine
        self._pending = OutputMerger()
        self._error: BaseException | None = None
        self._wake = asyncio.Event()
        self._accepted_fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.finished = False
        self._closed = False

    @property
    def buffered_tokens(self) -> int:
        """Output tokens delivered by the engine and not yet read."""
        return self._pending.num_tokens

    def _put(self, item: Any) -> None:
        """Event loop only: an output (merged into what is pending), the acknowledgement of the
        add, or an exception (the add failed, or the engine failed afterwards)."""
        if item is _ACCEPTED:
            if not self._accepted_fut.done():
                self._accepted_fut.set_result(None)
            return
        if isinstance(item, BaseException):
            if not self._accepted_fut.done():
                self._accepted_fut.set_exception(item)
            elif self._error is None:
                self._error = item
        else:
            self._pending.add(item)
        self._wake.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        while not self._pending and self._error is None:
            self._wake.clear()
            await self._wake.wait()
        out = self._pending.take()
        if out is None:  # what was delivered has been read; then the error
            self.finished = True
            self.close()
            assert self._error is not None
            raise self._error
        if out.finished:
            self.finished = True
            self.close()
        return out

    async def _accepted(self) -> None:
        try:
            await self._accepted_fut
        except BaseException:
            self.finished = True
            self.close()
            raise

    def _forget_acceptance(self) -> None:
        """The add as a whole failed: nobody will await this acknowledgement any more."""
        fut = self._accepted_fut
        if fut.done():
            fut.exception()  # marks a failure as retrieved
        else:
            fut.cancel()

    def close(self) -> None:
        """Idempotent; aborts the request in the engine if it has not finished."""
        if self._closed:
            return
        self._closed = True
        self._engine._release(self.request_id, abort=not self.finished)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


class AsyncEngine:
    """Owns an ``LLMEngine`` and the one thread allowed to touch it."""

    def __init__(self, engine: LLMEngine, max_queue_len: int = 256, warmup: bool = True) -> None:
        self.engine = engine
        self.max_model_len: int = engine.config.max_model_len or 0
        self.capacity = engine.config.max_num_seqs + max_queue_len
        self._do_warmup = warmup
        self._commands: queue.Queue[Any] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}  # event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = False
        self._accepting = True
        self.error: BaseException | None = None
        self.stats = EngineStats()
        self._step_failures = 0  # engine thread only
        self._text_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-text")
        if engine.tokenizer is not None:
            # The first encode may configure the tokenizer (truncation/padding state); do it
            # here, before any other thread uses it, so later encodes and decodes only read it.
            engine.encode("warm-up")

    # ---- lifecycle (event loop) ---------------------------------------------------------

    @property
    def ready(self) -> bool:
        return self._ready and self._accepting and self.error is None

    @property
    def state(self) -> str:
        if self.error is not None:
            return "failed"
        if not self._accepting:
            return "shutting_down"
        return "ok" if self._ready else "warming_up"

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def start(self) -> None:
        """Starts the engine thread (warm-up first, then the step loop). Call on the loop."""
        assert self._thread is None, "start() twice"
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="specserve-engine", daemon=True)
        self._thread.start()

    async def wait_ready(self, timeout: float | None = None) -> None:
        async def poll() -> None:
            while not self._ready:
                if self.error is not None:
                    raise EngineUnavailableError(f"engine failed: {self.error}")
                await asyncio.sleep(0.02)

        await asyncio.wait_for(poll(), timeout)

    def begin_shutdown(self) -> None:
        """Stops admitting and aborts every in-flight request (each stream gets a final output
        with finish_reason "abort"). The thread keeps running until ``shutdown``."""
        self._accepting = False
        for rid in list(self._streams):
            self._commands.put(("abort", rid))

    async def shutdown(self) -> None:
        """Aborts what is left, stops the thread and joins it. Idempotent."""
        self.begin_shutdown()
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._commands.put(_STOP)
            await asyncio.to_thread(thread.join)
        self._text_pool.shutdown(wait=False, cancel_futures=True)

    # ---- requests (event loop) ----------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        speculative: SpeculativeParams | None = None,
        *,
        clamp_max_tokens: bool = False,
    ) -> RequestStream:
        """Submits a request and waits until the engine thread has accepted it.

        Raises ``InvalidRequestError`` (bad prompt, prompt + max_tokens beyond the context window
        unless ``clamp_max_tokens`` lowers max_tokens to fit), ``QueueFullError`` or
        ``EngineUnavailableError``.
        """
        return (await self.add_requests([(request_id, prompt, params, speculative)],
                                        clamp_max_tokens=clamp_max_tokens))[0]

    async def add_requests(
        self,
        requests: list[tuple[str, str | list[int], SamplingParams, SpeculativeParams | None]],
        *,
        clamp_max_tokens: bool = False,
    ) -> list[RequestStream]:
        """Admits several requests all-or-nothing against the queue bound (n > 1, batched
        prompts); if one is rejected the others are aborted and the error is raised. Text
        prompts are tokenized on the text worker first (each distinct prompt object once)."""
        if not self.ready:
            raise EngineUnavailableError(f"the engine is not ready ({self.state})")
        encoded: dict[int, list[int]] = {}
        for _, prompt, _, _ in requests:
            if id(prompt) not in encoded:
                encoded[id(prompt)] = await self.encode(prompt)
        requests = [(rid, encoded[id(prompt)], params, spec)
                    for rid, prompt, params, spec in requests]
        if not self.ready:
            raise EngineUnavailableError(f"the engine is not ready ({self.state})")
        if self.num_unfinished + len(requests) > self.capacity:
            raise QueueFullError(
                f"the server is at capacity ({self.num_unfinished} sequences in flight, limit "
                f"{self.capacity}); retry later"
            )
        streams: list[RequestStream] = []
        for rid, prompt, params, spec in requests:
            if rid in self._streams:
                for s in streams:
                    s.close()
                raise InvalidRequestError(f"request id {rid!r} is already running", param="id")
            stream = RequestStream(self, rid)
            self._streams[rid] = stream
            streams.append(stream)
            self._commands.put(("add", _Add(rid, prompt, params, spec, clamp_max_tokens)))
        try:
            for s in streams:
                await s._accepted()
        except BaseException:
            for s in streams:
                s._forget_acceptance()
                s.close()
            raise
        return streams

    async def generate(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        speculative: SpeculativeParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields the request's outputs until the finished one; closing early aborts it."""
        stream = await self.add_request(request_id, prompt, params, speculative)
        async with stream:
            async for out in stream:
                yield out

    async def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt, tokenized off the event loop and off the engine thread."""
        if not isinstance(prompt, str):
            return list(prompt)
        return await asyncio.get_running_loop().run_in_executor(
            self._text_pool, self.engine.encode, prompt)

    async def render_chat(self, messages: list[dict]) -> str:
        """The chat template, rendered on the text worker (templates are arbitrary Jinja)."""
        return await asyncio.get_running_loop().run_in_executor(
            self._text_pool, self.engine.render_chat, messages)

    def abort(self, request_id: str) -> None:
        """Asks the engine to abort; the stream still receives the final "abort" output."""
        if request_id in self._streams:
            self._commands.put(("abort", request_id))

    def _release(self, request_id: str, abort: bool) -> None:
        self._streams.pop(request_id, None)
        if abort:
            self._commands.put(("abort", request_id))

    def _deliver(self, items: list[tuple[str, Any]]) -> None:
        for rid, item in items:
            stream = self._streams.get(rid)
            if stream is not None:
                stream._put(item)

    def _set_ready(self) -> None:
        self._ready = True

    def _fail_all(self) -> None:
        """The thread has exited: whoever still waits gets an error instead of hanging."""
        reason = f"engine failed: {self.error!r}" if self.error else "the engine has stopped"
        for stream in list(self._streams.values()):
            stream._put(EngineUnavailableError(reason))

    # ---- the engine thread --------------------------------------------------------------

    def _post(self, items: list[tuple[str, Any]]) -> None:
        if items and self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._deliver, items)

    def _run(self) -> None:
        try:
            if self._do_warmup:
                self._warmup()
            self._publish_stats()
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._set_ready)
            self._loop_body()
        except BaseException as exc:  # a bug in the engine: fail every request, stay down
            log.exception("engine thread failed")
            self.error = exc
        finally:
            if self._loop is not None and not self._loop.is_closed():
                self._loop.call_soon_threadsafe(self._fail_all)

    def _loop_body(self) -> None:
        engine = self.engine
        stop = False
        while not stop:
            items: list[tuple[str, Any]] = []
            block = not engine.has_unfinished()
            while True:
                try:
                    cmd = self._commands.get(block=block)
                except queue.Empty:
                    break
                block = False
                if cmd is _STOP:
                    stop = True
                    break
                items.extend(self._apply(cmd))
            if stop:
                for rid in list(engine.requests):
                    out = engine.abort(rid)
                    if out is not None:
                        items.append((rid, self._snapshot(out)))
            elif engine.has_unfinished():
                try:
                    outs = engine.step()
                except Exception as exc:  # a fault in this step: fail its requests, go on
                    items.extend(self._fail_step(exc))
                else:
                    items.extend((o.request_id, self._snapshot(o)) for o in outs)
            self._publish_stats()
            self._post(items)

    def _fail_step(self, exc: Exception) -> list[tuple[str, Any]]:
        """Ends every request of the failed step (the running ones: their state may be half
        updated) with an error and frees their blocks; waiting requests are untouched."""
        log.exception("engine step failed; failing its requests and serving on")
        self._step_failures += 1
        error = EngineStepError(f"the engine step running this request failed: {exc!r}")
        items: list[tuple[str, Any]] = []
        for seq in list(self.engine.scheduler.running):
            self.engine.abort(seq.request_id)
            items.append((seq.request_id, error))
        return items

    def _apply(self, cmd: tuple[str, Any]) -> list[tuple[str, Any]]:
        kind, arg = cmd
        if kind == "abort":
            out = self.engine.abort(arg)
            return [] if out is None else [(arg, self._snapshot(out))]
        assert kind == "add"
        try:
            self._add(arg)
        except Exception as exc:  # InvalidRequestError and friends go back to the caller
            return [(arg.request_id, exc)]
        return [(arg.request_id, _ACCEPTED)]

    def _add(self, req: _Add) -> None:
        engine = self.engine
        ids = engine.encode(req.prompt)
        limit = self.max_model_len
        if ids and len(ids) < limit and len(ids) + req.params.max_tokens > limit:
            if not req.clamp_max_tokens:
                raise InvalidRequestError(
                    f"prompt ({len(ids)} tokens) + max_tokens ({req.params.max_tokens}) exceeds "
                    f"the context window of {limit} tokens: lower max_tokens to at most "
                    f"{limit - len(ids)} or shorten the prompt",
                    param="max_tokens",
                )
            req.params.max_tokens = limit - len(ids)
            req.params.min_tokens = min(req.params.min_tokens, req.params.max_tokens)
        engine.add_request(req.request_id, ids, req.params, req.speculative)

    @staticmethod
    def _snapshot(out: RequestOutput) -> RequestOutput:
        # The engine keeps mutating the request's timings object; hand the loop a copy.
        out.timings = dataclasses.replace(out.timings)
        return out

    def _publish_stats(self) -> None:
        e = self.engine
        bm = e.block_manager
        self.stats = EngineStats(
            num_running=len(e.scheduler.running),
            num_waiting=len(e.scheduler.waiting),
            kv_blocks_total=bm.num_blocks,
            kv_blocks_free=bm.num_free_blocks,
            kv_blocks_cached=bm.num_cached_blocks,
            prefix_query_tokens=bm.prefix_queries,
            prefix_hit_tokens=bm.prefix_hits,
            step_failures=self._step_failures,
            version=self.stats.version + 1,
        )

    def _warmup(self) -> None:
        """Real forward passes of each step shape before traffic: a prefill alone, a prefill
        mixed with a decode, plain decodes, and speculative verify steps if speculation is on."""
        engine = self.engine
        vocab = engine.model_config.vocab_size
        n = max(1, min(8, self.max_model_len // 4))
        prompt = [(5 + i) % vocab for i in range(n)]
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        spec_on = engine.config.default_speculative_method != "off"
        engine.add_request("warmup-0", prompt, params, SpeculativeParams(method="off"))
        engine.step()  # prefill only
        engine.add_request("warmup-1", prompt[::-1], params, None)  # mixed prefill + decode
        if spec_on:
            engine.add_request("warmup-2", prompt * 2, params, None)
        while engine.has_unfinished():
            engine.step()
        log.info("warm-up done (speculation %s)", "on" if spec_on else "off")
