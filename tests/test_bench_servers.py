"""The server benchmarks' parts: the OpenAI-completions client both servers are driven by
(against a real specserve server on the tiny model), llama.cpp's build layout and how its server
refuses a draft, the tables and ratios of server_overhead.py and vs_llamacpp.py, and "plain"
meaning speculation off.

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
from benchmarks import vs_llamacpp_tables as tables
from benchmarks.client import complete, completion_body, completion_of
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


def test_completion_counts_read_either_servers_timings():
    ours = completion_of("x", {"prompt_tokens": 5, "completion_tokens": 16},
                         {"num_drafted": 12, "num_accepted": 7, "num_verify_steps": 4,
                          "draft_ms": 3.5, "speculative_method": "text_draft"}, 0.5, "length")
    assert (ours.drafted, ours.accepted, ours.verify_steps, ours.draft_ms) == (12, 7, 4, 3.5)
    assert (ours.prompt_tokens, ours.output_tokens, ours.finish_reason) == (5, 16, "length")
    # llama-server's names; it counts no verify steps
    theirs = completion_of("x", {"prompt_tokens": 5, "completion_tokens": 16},
                           {"draft_n": 9, "draft_n_accepted": 3}, 0.5, "stop")
    assert (theirs.drafted, theirs.accepted, theirs.verify_steps) == (9, 3, 0)
    plain = completion_of("x", {"completion_tokens": 16}, {}, 0.5, "stop")
    assert (plain.drafted, plain.accepted, plain.verify_steps, plain.draft_ms) == (0, 0, 0, 0.0)
    with pytest.raises(RuntimeError, match="no usage"):
        completion_of("x", None, {}, 0.5, "stop")


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


def _fake_binary(path, rc: int = 0, body: str | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + (body or f"exit {rc}\n"))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_llama_cpp_layout_is_reused_when_it_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(llama_server, "_has_amx", lambda: True)  # built apart, without AMX
    assert llama_server.LlamaCpp.at("9.9.9").build == tmp_path / "llama.cpp" / "build-9.9.9-noamx"
    monkeypatch.setattr(llama_server, "_has_amx", lambda: False)
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
    A = tables.Answer
    S = tables.System
    systems = [S("ours off", True, "off"), S("ours default", True, "default"),
               S("ours text_draft", True, "text_draft"),
               S("llama plain", False, "plain"), S("llama ngram-mod", False, "ngram-mod")]
    speed = {"ours off": 200.0, "ours default": 400.0, "ours text_draft": 320.0,
             "llama plain": 100.0, "llama ngram-mod": 160.0}
    runs = {(s.name, "chat", stop): [[A(100, 100 / speed[s.name], "x", 0, 0)]]
            for s in systems for stop in tables.STOPS}
    table = "\n".join(tables.single_table(runs, systems, ["chat"]))
    # 200/100, 400/100, 400/160; default against its best rival, text_draft: 400/320
    assert "| chat | EOS | 2.00x | 4.00x | 2.50x | llama ngram-mod | 1.25x | ours text_draft |" \
        in table
    failures, _ = tables.greedy_checks(runs, systems, ["chat"])
    assert not failures
    runs[("ours default", "chat", "EOS")][0][0].text = "y"
    failures, _ = tables.greedy_checks(runs, systems, ["chat"])
    assert failures == ["ours default (EOS): 1 answer(s) differ from plain"]


def test_vs_llamacpp_drafting_sums_answers_and_divides_by_verify_steps():
    A = tables.Answer
    systems = [tables.System("ours off", True, "off"),
               tables.System("ours text_draft", True, "text_draft"),
               tables.System("llama plain", False, "plain"),
               tables.System("llama ngram-mod", False, "ngram-mod")]
    runs = {
        ("ours off", "code", "EOS"): [[A(10, 1.0, "x", 0, 0)]],
        ("ours off", "code", "fixed N"): [[A(10, 1.0, "x", 0, 0)]],
        # 12 drafted over 4 steps, 6 accepted, 20 ms drafting; then 8 over 2, 6 accepted, 10 ms
        ("ours text_draft", "code", "EOS"): [[A(10, 1.0, "x", 12, 6, 4, 20.0)]],
        ("ours text_draft", "code", "fixed N"): [[A(10, 1.0, "x", 8, 6, 2, 10.0)]],
        ("llama plain", "code", "EOS"): [[A(10, 1.0, "x", 0, 0)]],
        ("llama plain", "code", "fixed N"): [[A(10, 1.0, "x", 0, 0)]],
        ("llama ngram-mod", "code", "EOS"): [[A(10, 1.0, "x", 10, 4)]],
        ("llama ngram-mod", "code", "fixed N"): [[A(10, 1.0, "x", 0, 0)]],
    }
    d = tables.drafting(runs, systems, ["code"])
    assert set(d) == {("ours text_draft", "code"), ("llama ngram-mod", "code")}  # plain: none
    ours = d[("ours text_draft", "code")]
    assert (ours.drafted, ours.accepted, ours.verify_steps) == (20, 12, 6)
    assert ours.acceptance == pytest.approx(0.6)
    assert ours.tokens_per_verify == pytest.approx((12 + 6) / 6)
    assert ours.drafts_per_verify == pytest.approx(20 / 6)
    assert ours.draft_ms_per_verify == pytest.approx(5.0)
    text = "\n".join(tables.drafting_table(runs, systems, ["code"]))
    assert "| code | ours text_draft | 2 | 20 | 12 | 0.60 | 6 | 3.33 | 3.00 | 5.0 |" in text
    # llama-server counts no verify steps: nothing is divided by them
    assert "| code | llama ngram-mod | 2 | 10 | 4 | 0.40 | - | - | - | - |" in text


# What llama-server 0.3.36 logs for a draft GGUF of another vocabulary (SmolLM2-135M target,
# Qwen2.5 draft), before it serves on without speculation.
REFUSAL_LOG = """\
0.01.086.098 I common_speculative_init_result: loading draft model 'qwen.gguf'
0.01.927.195 I srv    load_model: initializing, n_slots = 1, n_ctx_slot = 2048, kv_unified = 'false'
0.01.927.326 E spec common_specu: the target and draft vocabs are not compatible
0.01.927.582 E srv    load_model: failed to initialize speculative decoding context: draft model \
vocab type must match target model to use speculation
0.02.121.464 I srv  llama_server: model loaded
"""


def test_draft_refusal_quotes_llama_servers_own_line():
    assert llama_server.draft_refusal(REFUSAL_LOG) == (
        "srv load_model: failed to initialize speculative decoding context: draft model vocab "
        "type must match target model to use speculation")
    # a version that only throws: its exception's words
    assert llama_server.draft_refusal(
        "terminate called: draft model vocab type must match target model to use speculation"
    ) == "terminate called: draft model vocab type must match target model to use speculation"
    assert llama_server.draft_refusal(REFUSAL_LOG.replace(" E ", " I ").replace(
        "failed to initialize speculative decoding context: ", "").replace(
        "vocab type must match", "").replace("vocabs are not compatible", "")) is None


def test_llama_server_that_refuses_its_draft_raises_draft_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECSERVE_CACHE_DIR", str(tmp_path))
    llama = llama_server.LlamaCpp.at("9.9.9")
    _fake_binary(llama.bench)
    refusing = REFUSAL_LOG.replace("'", "").replace("\\\n", "")
    _fake_binary(llama.server, body=f'[ "$1" = --help ] && exit 0\necho "{refusing}"\nexit 1\n')
    server = llama_server.LlamaServer("m.gguf", 2, spec_type="draft-simple",
                                      draft_model="qwen.gguf", llama=llama,
                                      log_path=tmp_path / "llama.log")
    with pytest.raises(llama_server.DraftRefused) as err:
        server.__enter__()
    assert err.value.line.startswith("srv load_model: failed to initialize speculative")
    plain = llama_server.LlamaServer("m.gguf", 2, llama=llama, log_path=tmp_path / "p.log")
    with pytest.raises(BenchError, match="exited with code 1") as err:
        plain.__enter__()  # no draft asked for: the same log is a plain failure to start
    assert not isinstance(err.value, llama_server.DraftRefused)


def test_vs_llamacpp_says_what_was_left_out_and_why():
    lines = vs_llamacpp.left_out("srv load_model: failed", {"text_draft": "HTTP 400: no draft"},
                                 ["ngram-mod"])
    assert lines == [
        'llama-server refused this draft: "srv load_model: failed"; best llama.cpp is the best '
        "of the kinds it can run (plain, ngram-mod).",
        "Ours text_draft not run: the server answered HTTP 400: no draft.", ""]
    assert vs_llamacpp.left_out(None, {}, ["ngram-mod"]) == []


def test_lscpu_summary_names_the_cpu():
    summary = lscpu_summary()
    if os.path.exists("/usr/bin/lscpu") or os.path.exists("/bin/lscpu"):
        assert "CPU(s)" in summary
    else:
        assert summary == ""
