"""AsyncEngine: drives the synchronous ``LLMEngine`` from one dedicated thread for asyncio callers.

Threading contract (``LLMEngine`` is not thread-safe):
  - only the engine thread calls ``add_request`` / ``step`` / ``abort``; the event loop hands it
    commands through a ``queue.Queue`` that it drains before every step;
  - text work that is neither the loop's nor the step's (chat templates, tokenizing prompts of up
    to --max-body-bytes) runs on one "specserve-text" worker thread: the engine thread only ever
    receives token ids, so a huge prompt never stalls the other streams' steps, and the loop
    stays free. The tokenizer releases the GIL while it encodes. One worker serialises every
    encode; the engine thread only decodes (read-only on the tokenizer);
  - the engine thread wakes the event loop only when a client has something to read. A
    streaming request's outputs are handed over after every step; a non-streaming one's are
    merged on the engine thread and handed over once, when it finishes (or fails). What a step
    makes readable goes into one mailbox, and the loop is woken by one
    ``loop.call_soon_threadsafe`` per step at most, none when nothing is readable, none while
    an earlier wake-up is still pending (the loop then takes both steps' items at once). An
    item is a ``RequestOutput``, the ``_ACCEPTED`` acknowledgement of an add, or the exception
    the add raised;
  - the per-request stream registry lives on the event loop only, so no dict is shared.

Why the loop is woken so rarely: on a machine whose cores all run the kernels' threads, every
wake-up of the loop (and of the handler tasks it resumes) takes a core from a forward pass in
flight and the GIL from the engine thread, and the kernels' other threads then wait for the
preempted one at their next barrier. A non-streaming request needs nothing before its end, so
it costs the forward passes nothing until then; a streaming one costs one wake-up per step, shared
by every stream that step fed.

One OpenMP team in the process: the constructor hands back the calling thread's OpenMP team
(``openmp_team.release_openmp_team``; why: see there), so the engine thread's team is the only
one and spins at its barriers as an in-process ``LLMEngine.generate``'s does. The constructing
thread must not run torch ops afterwards (that would make a new team); the event loop and the
text worker run none.

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
from dataclasses import dataclass, replace
from typing import Any

from specserve.core.errors import InvalidRequestError
from specserve.core.sampling_params import SamplingParams, SpeculativeParams
from specserve.core.structured import StructuredSpec
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.openmp_team import release_openmp_team
from specserve.engine.outputs import OutputMerger, RequestOutput
from specserve.engine.request_stream import ACCEPTED as _ACCEPTED
from specserve.engine.request_stream import RequestStream

log = logging.getLogger(__name__)

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
    stream: bool  # False: hand over one merged output at the end (see the module docstring)


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
        # Non-streaming requests' outputs, merged until they finish (engine thread only).
        self._held: dict[str, OutputMerger] = {}
        # Items for the loop, and whether a wake-up to take them is already on its way.
        self._mail: list[tuple[str, Any]] = []
        self._mail_posted = False
        self._mail_lock = threading.Lock()
        self._stopped = asyncio.Event()  # set on the loop once the thread has ended
        self._text_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specserve-text")
        # structured outputs' grammars compile here, never on the engine thread (a large schema
        # takes tens of ms; the tokenizer's first set-up ~0.3 s)
        self._grammar_pool = ThreadPoolExecutor(max_workers=1,
                                                thread_name_prefix="specserve-grammar")
        if engine.tokenizer is not None:
            # The first encode may configure the tokenizer (truncation/padding state); do it
            # here, before any other thread uses it, so later encodes and decodes only read it.
            engine.encode("warm-up")
        if engine.device.type == "cpu":
            release_openmp_team()  # the engine thread's team is to be the only one

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

    async def wait_stopped(self) -> None:
        """Returns once the engine thread has ended (shut down, or died: see ``error``)."""
        await self._stopped.wait()

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
        self._grammar_pool.shutdown(wait=False, cancel_futures=True)

    # ---- requests (event loop) ----------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        speculative: SpeculativeParams | None = None,
        *,
        clamp_max_tokens: bool = False,
        stream: bool = True,
    ) -> RequestStream:
        """Submits a request and waits until the engine thread has accepted it.

        ``stream`` False: the stream yields one output, the whole answer, when it finishes
        (nothing wakes the event loop before that). Raises ``InvalidRequestError`` (bad prompt,
        prompt + max_tokens beyond the context window unless ``clamp_max_tokens`` lowers
        max_tokens to fit), ``QueueFullError`` or ``EngineUnavailableError``.
        """
        return (await self.add_requests([(request_id, prompt, params, speculative)],
                                        clamp_max_tokens=clamp_max_tokens, stream=stream))[0]

    async def add_requests(
        self,
        requests: list[tuple[str, str | list[int], SamplingParams, SpeculativeParams | None]],
        *,
        clamp_max_tokens: bool = False,
        stream: bool = True,
    ) -> list[RequestStream]:
        """Admits several requests all-or-nothing against the queue bound (n > 1, batched
        prompts); if one is rejected the others are aborted and the error is raised. Text
        prompts are tokenized on the text worker first (each distinct prompt object once).
        ``stream``: as in ``add_request``."""
        if not self.ready:
            raise EngineUnavailableError(f"the engine is not ready ({self.state})")
        encoded: dict[int, list[int]] = {}
        for _, prompt, _, _ in requests:
            if id(prompt) not in encoded:
                encoded[id(prompt)] = await self.encode(prompt)
        specs: dict[int, SpeculativeParams | None] = {}  # a prediction's text, tokenized too
        for _, _, _, spec in requests:
            if id(spec) not in specs:
                specs[id(spec)] = spec
                if spec is not None and isinstance(spec.prediction, str):
                    specs[id(spec)] = replace(spec, prediction=await self.encode(spec.prediction))
        requests = [(rid, encoded[id(prompt)], params, specs[id(spec)])
                    for rid, prompt, params, spec in requests]
        for spec_ in {p.structured for _, _, p, _ in requests if p.structured is not None}:
            await self.compile_grammar(spec_)  # raises InvalidRequestError for a bad one
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
            rs = RequestStream(self, rid)
            self._streams[rid] = rs
            streams.append(rs)
            self._commands.put(("add", _Add(rid, prompt, params, spec, clamp_max_tokens,
                                            stream)))
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

    async def compile_grammar(self, spec: StructuredSpec) -> None:
        """Compiles a structured output's grammar off the engine thread (into the engine's
        cache, where ``LLMEngine.add_request`` finds it)."""
        await asyncio.get_running_loop().run_in_executor(
            self._grammar_pool, self.engine.grammar_compiler.compile, spec)

    async def render_chat(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        """The chat template, rendered on the text worker (templates are arbitrary Jinja);
        ``tools``: OpenAI's tool definitions, for the template's ``tools`` argument."""
        return await asyncio.get_running_loop().run_in_executor(
            self._text_pool, self.engine.render_chat, messages, tools)

    def abort(self, request_id: str) -> None:
        """Asks the engine to abort; the stream still receives the final "abort" output."""
        if request_id in self._streams:
            self._commands.put(("abort", request_id))

    def _release(self, request_id: str, abort: bool) -> None:
        self._streams.pop(request_id, None)
        if abort:
            self._commands.put(("abort", request_id))

    def _deliver(self) -> None:
        """Loop side of the mailbox: everything the engine thread has posted since the last
        wake-up, in order."""
        with self._mail_lock:
            items, self._mail, self._mail_posted = self._mail, [], False
        for rid, item in items:
            stream = self._streams.get(rid)
            if stream is not None:
                stream._put(item)

    def _set_ready(self) -> None:
        self._ready = True

    def _fail_all(self) -> None:
        """The thread has exited: whoever still waits gets an error instead of hanging."""
        self._deliver()  # what the last steps posted comes first
        reason = f"engine failed: {self.error!r}" if self.error else "the engine has stopped"
        for stream in list(self._streams.values()):
            stream._put(EngineUnavailableError(reason))
        self._stopped.set()

    # ---- the engine thread --------------------------------------------------------------

    def _post(self, items: list[tuple[str, Any]]) -> None:
        """Puts a step's readable items in the mailbox; wakes the loop unless a wake-up is
        already pending (it will take these too)."""
        if not items:
            return
        with self._mail_lock:
            self._mail.extend(items)
            if self._mail_posted:
                return
            self._mail_posted = True
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._deliver)

    def _emit(self, items: list[tuple[str, Any]], out: RequestOutput) -> None:
        """A step's (or an abort's) output for one request: a streaming request's goes to the
        loop now; a non-streaming one's is merged and goes when it is the last."""
        rid = out.request_id
        held = self._held.get(rid)
        if held is None:
            items.append((rid, self._snapshot(out)))
            return
        held.add(out)
        if out.finished:
            del self._held[rid]
            merged = held.take()
            assert merged is not None
            items.append((rid, self._snapshot(merged)))

    def _release_held(self, items: list[tuple[str, Any]], rid: str) -> None:
        """What a non-streaming request holds goes to the loop before its error."""
        held = self._held.pop(rid, None)
        merged = held.take() if held is not None else None
        if merged is not None:
            items.append((rid, self._snapshot(merged)))

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
                        self._emit(items, out)
            elif engine.has_unfinished():
                try:
                    outs = engine.step()
                except Exception as exc:  # a fault in this step: fail its requests, go on
                    items.extend(self._fail_step(exc))
                else:
                    for out in outs:
                        self._emit(items, out)
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
            self._release_held(items, seq.request_id)
            items.append((seq.request_id, error))
        return items

    def _apply(self, cmd: tuple[str, Any]) -> list[tuple[str, Any]]:
        kind, arg = cmd
        items: list[tuple[str, Any]] = []
        if kind == "abort":
            out = self.engine.abort(arg)
            if out is not None:
                self._emit(items, out)
            return items
        assert kind == "add"
        try:
            self._add(arg)
        except Exception as exc:  # InvalidRequestError and friends go back to the caller
            return [(arg.request_id, exc)]
        if not arg.stream:
            self._held[arg.request_id] = OutputMerger()
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
                    param="max_tokens", code="context_length_exceeded",
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
