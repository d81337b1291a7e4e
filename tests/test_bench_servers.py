"""The server benchmarks' parts: the OpenAI-completions client both servers are driven by
(against a real specserve server on the tiny model), llama.cpp's build layout, the tables and
ratios of server_overhead.py and vs_llamacpp.py, and "plain" meaning speculation off.

The tiny random Llama serves as its own draft, so under the default method (auto) every step
could draft: a benchmark that forgot ``speculative: off`` would draft here and fail.
"""

from __future__ import annotations

import asyncio
import os
import stat

import aiohttp
import pytest

from benchmarks import llama_server, plain_decode, server_overhead, vs_llamacpp
from benchmarks.client import complete, completion_body
from benchmarks.report import BenchError, lscpu_summary
from specserve.core.sampling_params import SamplingParams
from specserve.engine.llm_engine import LLMEngine
from specserve.server.server_config import ServerConfig
from tests.helpers.servers import PROMPTS, ServerThread, engine_config


@pytest.fixture(scope="module")
def tiny(model_dir) -> str:
    return model_dir


@pytest.fixture(scope="module")
def live(tiny):
    srv = ServerThread(engine_config(tiny, draft_model=tiny, num_threads=1), ServerConfig(port=0))
    yield srv
    srv.stop()


def test_complete_reads_json_and_sse_alike(live, tiny):
    offline = LLMEngine(engine_config(tiny, num_threads=1))
    want = offline.generate(PROMPTS[:2], SamplingParams(max_tokens=10, temperature=0.0,
                                                        ignore_eos=True))

    async def run():
        async with aiohttp.ClientSession() as session:
            return [await complete(session, live.url,
                                   completion_body(p, 10, server="specserve"), stream)
                    for p in PROMPTS[:2] for stream in (False, True)]

    got = asyncio.run(run())
    for i, w in enumerate(want):
        for done in got[2 * i: 2 * i + 2]:
            assert done.text == w.text
            assert done.output_tokens == 10 and done.prompt_tokens == w.num_prompt_tokens
            assert done.drafted == 0  # speculative: off
            assert done.finish_reason == "length" and done.seconds > 0


def test_complete_raises_on_http_errors(live):
    async def run():
        async with aiohttp.ClientSession() as session:
            await complete(session, live.url, {"prompt": "Hi", "max_tokens": -1})

    with pytest.raises(RuntimeError, match="HTTP 400"):
        asyncio.run(run())


def test_completion_bodies():
    ours = completion_body("Hi", 5, server="specserve", mode="ngram", ignore_eos=False)
    assert ours == {"prompt": "Hi", "max_tokens": 5, "temperature": 0.0, "ignore_eos": False,
                    "speculative": {"method": "ngram"}}
    theirs = completion_body("Hi", 5, server="llama")
    assert theirs["n_predict"] == 5 and theirs["ignore_eos"] and "speculative" not in theirs
    with pytest.raises(ValueError):
        completion_body("Hi", 5, server="vllm")


def test_plain_decode_runs_speculation_off(tiny):
    """The tiny engine drafts with itself under auto (its default); plain_decode's timing
    function must still see num_drafted 0 (it stops the run otherwise)."""
    engine = LLMEngine(engine_config(tiny, draft_model=tiny, num_threads=1,
                                     adaptive_speculation=False))
    assert engine.config.default_speculative_method == "auto"
    ids = [engine.encode(p) for p in PROMPTS[:2]]
    auto = engine.generate(ids, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    assert sum(o.timings.num_drafted for o in auto) > 0  # the default does draft here
    _, tokens = plain_decode.time_ours(engine, ids, 24)
    assert tokens == [o.token_ids for o in auto]  # the same greedy answers, without drafts


def _fake_binary(path, rc: int = 0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\nexit {rc}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_llama_cpp_layout_is_reused_when_it_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    llama = llama_server.LlamaCpp.at("9.9.9")
    assert llama.src == tmp_path / "llama.cpp" / "src-9.9.9"
    assert llama.server == tmp_path / "llama.cpp" / "build-9.9.9" / "bin" / "llama-server"
    assert not llama.ready()
    _fake_binary(llama.server)
    _fake_binary(llama.bench, rc=1)  # present but broken: not ready
    assert not llama.ready()
    _fake_binary(llama.bench)
    assert llama.ready()

    def no_build(*_):
        raise AssertionError("a ready build must not be rebuilt")

    monkeypatch.setattr(llama_server, "build", no_build)
    monkeypatch.setattr(llama_server, "fetch_source", no_build)
    assert llama_server.ensure_built(llama) == llama
    with pytest.raises(BenchError, match="draft GGUF"):
        llama_server.LlamaServer("m.gguf", 2, spec_type="draft-simple", llama=llama)


def test_llama_server_refuses_without_a_build(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    with pytest.raises(BenchError, match="make llama-server"):
        llama_server.LlamaServer("m.gguf", 2)


def test_server_overhead_ratios_are_taken_within_rounds():
    B = server_overhead.Batch
    runs = {(1, "in process"): [B(100, 1.0, ["a"]), B(100, 2.0, ["a"])],
            (1, "serve JSON"): [B(90, 1.0, ["a"]), B(50, 1.0, ["a"])],
            (1, "serve SSE"): [B(80, 1.0, ["a"]), B(40, 1.0, ["a"])]}
    text = "\n".join(server_overhead.tables(runs, [1], ["in process", "serve JSON",
                                                        "serve SSE"]))
    # round 1: 90/100, round 2: 50/50 -> median 0.95 (0.90..1.00); SSE 0.80 and 0.80
    assert "| 1 | 0.95x (0.90..1.00) | 0.80x (0.80..0.80) |" in text
    failures, _ = server_overhead.greedy_notes(runs, [1], ["in process", "serve JSON",
                                                           "serve SSE"])
    assert not failures
    runs[(1, "serve SSE")][1].texts = ["b"]
    failures, _ = server_overhead.greedy_notes(runs, [1], ["in process", "serve JSON",
                                                           "serve SSE"])
    assert failures == ["serve SSE at 1 streams: 1 answer(s) differ from in process"]


def test_vs_llamacpp_tables_pick_the_best_llama_kind_and_check_greedy():
    A = vs_llamacpp.Answer
    S = vs_llamacpp.System
    systems = [S("ours off", True, "off"), S("ours default", True, "default"),
               S("llama plain", False, "plain"), S("llama ngram-mod", False, "ngram-mod")]
    speed = {"ours off": 200.0, "ours default": 400.0, "llama plain": 100.0,
             "llama ngram-mod": 160.0}
    runs = {(s.name, "chat", stop): [[A(100, 100 / speed[s.name], "x", 0, 0)]]
            for s in systems for stop in vs_llamacpp.STOPS}
    table = "\n".join(vs_llamacpp.single_table(runs, systems, ["chat"]))
    assert "| chat | EOS | 2.00x | 4.00x | 2.50x | llama ngram-mod |" in table
    failures, _ = vs_llamacpp.greedy_checks(runs, systems, ["chat"])
    assert not failures
    runs[("ours default", "chat", "EOS")][0][0].text = "y"
    failures, _ = vs_llamacpp.greedy_checks(runs, systems, ["chat"])
    assert failures == ["ours default (EOS): 1 answer(s) differ from plain"]


def test_lscpu_summary_names_the_cpu():
    summary = lscpu_summary()
    if os.path.exists("/usr/bin/lscpu") or os.path.exists("/bin/lscpu"):
        assert "CPU(s)" in summary
    else:
        assert summary == ""
