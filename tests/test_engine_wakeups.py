"""The engine thread wakes the event loop only when a client has something to read: a
non-streaming request once, at its end; streaming requests at most once per step between them
all. Counted, not timed: each wake-up is one call of ``AsyncEngine._deliver`` on the loop, each
step one call of ``LLMEngine.step``; the answers are checked against the offline engine."""

from __future__ import annotations

import asyncio
import threading

from specserve.core.sampling_params import SamplingParams
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.llm_engine import LLMEngine
from tests.helpers.servers import PROMPTS, engine_config, reference

N = 24  # tokens per answer


class CountingEngine(AsyncEngine):
    """Counts the loop's wake-ups and the engine's steps; ``pause_after`` holds the engine
    thread after that many steps until ``go`` is set."""

    def __init__(self, engine: LLMEngine, pause_after: int | None = None) -> None:
        super().__init__(engine, warmup=False)
        self.wakes = 0
        self.steps = 0
        self.paused, self.go = threading.Event(), threading.Event()
        step = engine.step

        def counted():
            out = step()
            self.steps += 1
            if pause_after is not None and self.steps == pause_after:
                self.paused.set()
                self.go.wait(30)
            return out

        engine.step = counted  # type: ignore[method-assign]

    def _deliver(self) -> None:
        self.wakes += 1
        super()._deliver()


async def drain(stream) -> list:
    return [o async for o in stream]


def params() -> SamplingParams:
    return SamplingParams(max_tokens=N, temperature=0.0, ignore_eos=True)


async def started(engine: CountingEngine) -> CountingEngine:
    engine.start()
    await engine.wait_ready(30)
    await asyncio.sleep(0)
    engine.wakes = engine.steps = 0
    return engine


def test_non_streaming_requests_wake_the_loop_once_each_at_their_end(model_dir, offline):  # noqa: F811
    want = [o.token_ids for o in reference(offline, PROMPTS[:3], N, ignore_eos=True)]

    async def run():
        aengine = await started(CountingEngine(LLMEngine(engine_config(model_dir))))
        streams = await aengine.add_requests(
            [(f"r{i}", p, params(), None) for i, p in enumerate(PROMPTS[:3])], stream=False)
        outs = [await drain(s) for s in streams]
        await aengine.shutdown()
        return aengine, outs

    aengine, outs = asyncio.run(run())
    assert [len(o) for o in outs] == [1, 1, 1]  # the whole answer in one output
    assert [o[0].token_ids for o in outs] == want
    assert all(o[0].finished and o[0].num_output_tokens == N for o in outs)
    assert aengine.steps >= N
    # Acknowledging the three adds (one wake-up, or up to three if a step ran between them)
    # and the three answers; none per step.
    assert aengine.wakes <= 6, (aengine.wakes, aengine.steps)


def test_streams_share_one_wake_up_per_step(model_dir, offline):  # noqa: F811
    want = [o.token_ids for o in reference(offline, PROMPTS, N, ignore_eos=True)]

    async def run():
        aengine = await started(CountingEngine(LLMEngine(engine_config(model_dir))))
        streams = await aengine.add_requests(
            [(f"r{i}", p, params(), None) for i, p in enumerate(PROMPTS)])
        got = [[t for o in await drain(s) for t in o.token_ids] for s in streams]
        await aengine.shutdown()
        return aengine, got

    aengine, got = asyncio.run(run())
    assert got == want
    # Four streams fed by every step: one wake-up per step for all of them (plus the adds'
    # acknowledgements), not one per stream and step.
    assert aengine.wakes <= aengine.steps + len(PROMPTS), (aengine.wakes, aengine.steps)
    assert aengine.steps >= N


def test_aborted_non_streaming_request_gets_what_it_had(model_dir, offline):  # noqa: F811
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    want = reference(offline, PROMPTS[:1], 200, ignore_eos=True)[0].token_ids

    async def run():
        engine = LLMEngine(engine_config(model_dir))
        aengine = await started(CountingEngine(engine, pause_after=6))
        stream = await aengine.add_request("r", PROMPTS[0], long, stream=False)
        aengine.wakes = 0  # (the add's acknowledgement)
        await asyncio.to_thread(aengine.paused.wait, 30)
        wakes_while_running = aengine.wakes
        aengine.abort("r")
        aengine.go.set()
        outs = await drain(stream)
        await aengine.shutdown()
        return outs, wakes_while_running, engine

    outs, wakes, engine = asyncio.run(run())
    assert wakes == 0  # six steps ran, the loop slept through them
    assert len(outs) == 1 and outs[0].finish_reason == "abort"
    tokens = outs[0].token_ids
    assert 6 <= len(tokens) < 200 and tokens == want[: len(tokens)]
    assert outs[0].num_output_tokens == len(tokens)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
