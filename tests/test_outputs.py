"""Delta outputs: each engine step emits only what is new; a reader that falls behind gets the
deltas merged, so what a stream holds is what its client has not read (never one queued object
per step, never cumulative copies)."""

from __future__ import annotations

import asyncio

import pytest

from specserve.core.config import EngineConfig
from specserve.core.sampling import TokenLogprob
from specserve.core.sampling_params import SamplingParams
from specserve.engine.async_engine import AsyncEngine
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.outputs import OutputMerger, RequestOutput
from tests.helpers.reference import prompts
from tests.helpers.tiny_models import build_tiny_model, tiny_config

LONG = 4100  # output tokens of the slow-reader test: an answer of more than 4k tokens
SLOW_READ = 256  # tokens the slow reader lets pile up before each read


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("long_ctx")
    build_tiny_model(path, tiny_config(max_position_embeddings=8192, hidden_size=32,
                                       intermediate_size=64))
    return str(path)


def _cfg(path: str, **kw) -> EngineConfig:
    return EngineConfig(**{"model": path, "dtype": "float32", "block_size": 16,
                           "num_kv_blocks": 1024, "max_model_len": 8192, "num_threads": 1,
                           "attention_backend": "cpu_paged", **kw})


def test_merger_folds_deltas_in_order():
    lp = [TokenLogprob(i, -0.5 * i, []) for i in range(5)]
    parts = [RequestOutput("r", [1, 2], "He", [7], [lp[0]], 1),
             RequestOutput("r", [1, 2], "llo", [8, 9], lp[1:3], 3),
             RequestOutput("r", [1, 2], "", [10], [lp[3]], 4, True, "stop", 10)]
    m = OutputMerger()
    assert not m and m.take() is None
    for p in parts:
        m.add(p)
    assert m.num_tokens == 4 and m.num_chars == 5
    out = m.take()
    assert out is not None and not m
    assert (out.text, out.token_ids, out.logprobs) == ("Hello", [7, 8, 9, 10], lp[:4])
    assert (out.num_output_tokens, out.finished, out.finish_reason, out.stop_reason) == (
        4, True, "stop", 10)


def test_each_step_emits_only_what_is_new(long_model):
    """Per-step outputs are deltas (one token a step without speculation), and they add up to
    generate()."""
    engine = LLMEngine(_cfg(long_model, speculative_method="off"))
    prompt = prompts([20], seed=3)[0]
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True, logprobs=1)
    (whole,) = engine.generate([prompt], params)
    engine.add_request("d", prompt, params)
    ids: list[int] = []
    n_lp = 0
    while engine.has_unfinished():
        for out in engine.step():
            assert len(out.token_ids) <= 1  # plain decoding: one new token per step
            ids += out.token_ids
            n_lp += len(out.logprobs or [])
            assert out.num_output_tokens == len(ids)
    assert ids == whole.token_ids and len(ids) == 200 and n_lp == 200
    assert len(whole.logprobs or []) == 200


@pytest.mark.slow
def test_slow_reader_holds_only_what_it_has_not_read(long_model):
    """A 4k-token answer read only once 256 tokens wait for it (the slow client: it waits on
    the stream's count, not on a clock, so the machine's speed changes nothing), beside a
    reader that keeps up with the same greedy request: every slow read returns one merged
    output with exactly the tokens not yet read; the stream never holds more than that (one
    pending object, not one per step), and its pieces add up to the fast reader's answer."""
    engine = LLMEngine(_cfg(long_model))
    prompt = prompts([12], seed=5)[0]

    def params() -> SamplingParams:
        return SamplingParams(max_tokens=LONG, temperature=0.0, ignore_eos=True)

    async def fast(aengine: AsyncEngine) -> list[int]:
        return [t async for out in aengine.generate("fast", prompt, params())
                for t in out.token_ids]

    async def run() -> tuple[list[int], list[int], list[int], int]:
        aengine = AsyncEngine(engine, warmup=False)
        aengine.start()
        await aengine.wait_ready(30)
        fast_task = asyncio.create_task(fast(aengine))
        stream = await aengine.add_request("slow", prompt, params())
        got: list[int] = []
        held: list[int] = []
        reads = 0
        async with stream:
            while not stream.finished:
                while stream.buffered_tokens < min(SLOW_READ, LONG - len(got)):
                    await asyncio.sleep(0.01)  # the slow client lets tokens pile up
                held.append(stream.buffered_tokens)
                out = await stream.__anext__()
                reads += 1
                # One merged output carries everything delivered and not yet read.
                assert len(out.token_ids) >= held[-1]
                got += out.token_ids
                assert out.num_output_tokens == len(got)
        want = await fast_task
        await aengine.shutdown()
        return want, got, held, reads

    want, got, held, reads = asyncio.run(run())
    assert got == want and len(got) == LONG
    assert reads < LONG / 10  # merged: far fewer reads than engine steps
    assert sum(held) <= LONG  # each token held once, until its read: nothing duplicated
