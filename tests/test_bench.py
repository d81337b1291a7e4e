"""Benchmarks (`python -m benchmarks` / `specserve bench`): each mode end to end in a tiny
configuration, result files checked for schema and consistency, plus the statistics helpers and
the tracer.

The tiny random Llama (hidden 32, 2 layers, the default model's real tokenizer) also serves as
its own draft, so every draft is accepted: the speculative paths run in full and acceptance is
exactly 1. Torch runs on one thread here (the benches are latency-bound; on a shared 2-core
machine two threads only contend).
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import backends, offline, report, stats, sweep
from benchmarks.__main__ import main as bench_main
from benchmarks.attribution import attribute
from specserve.engine.tracing import NullTracer, SpanEvent, Tracer
from tests.helpers.servers import ServerThread, engine_config

ENGINE_FLAGS = ["--num-kv-blocks", "1024", "--block-size", "4", "--max-model-len", "512",
                "--num-threads", "1", "--no-adaptive-speculation"]


@pytest.fixture(scope="module")
def tiny(model_dir) -> str:
    """The server tests' tiny model (tests/fixtures/models.py); torch's thread count that the
    benches set is restored after each test (tests/conftest.py)."""
    return model_dir


def _load(path) -> dict:
    return json.loads(path.read_text())


def _check_interval(iv: dict) -> None:
    assert all(math.isfinite(iv[k]) for k in ("point", "low", "high")), iv
    assert iv["low"] <= iv["point"] <= iv["high"], iv


def _check_distribution(d: dict) -> None:
    assert d["n"] > 0
    assert d["min"] <= d["p50"] <= d["p95"] <= d["p99"] <= d["max"], d


# ---- offline ------------------------------------------------------------------------------


def test_offline_all_modes_identical_greedy(tiny, tmp_path, monkeypatch):
    results_md = tmp_path / "RESULTS.md"
    monkeypatch.setattr(report, "RESULTS_MD", results_md)
    out = tmp_path / "offline"
    rc = bench_main(["offline", "--model", tiny, "--draft-model", tiny, "--workloads", "code",
                     "--num-prompts", "2", "--new-tokens", "6", "--repeats", "2", "--warmup", "1",
                     "--ignore-eos", "--out", str(out), "--write-results", *ENGINE_FLAGS])
    assert rc == 0
    data = _load(out / "offline.json")
    modes = ["off", "ngram", "draft", "hf", "hf-assisted", "hf-lookup"]
    assert data["config"]["modes"] == modes  # llama_cpp is not installed here
    assert data["outputs_identical"] is True and data["mismatches"] == []
    assert {"machine", "cpu", "commit", "command", "torch"} <= set(data["info"])
    assert data["info"]["command"].startswith("python -m benchmarks offline")
    # Cold start on its own, then 2 repeats x 2 prompts per mode.
    assert [c["mode"] for c in data["cold_start"]] == modes
    assert all(c["first_request_s"] > 0 and c["load_s"] > 0 for c in data["cold_start"])
    for m in modes:
        recs = [r for r in data["records"] if r["mode"] == m]
        assert sorted(r["repeat"] for r in recs) == [-1, 0, 0, 1, 1]
        assert all(r["output_tokens"] == 6 == len(r["token_ids"]) for r in recs)
        assert all(r["tok_s"] == pytest.approx(6 / r["seconds"]) for r in recs)
    summaries = {s["mode"]: s for s in data["summaries"]}
    assert set(summaries) == set(modes)
    for s in summaries.values():
        _check_interval(s["tok_s"])
        assert s["requests"] == 4
    assert summaries["draft"]["acceptance"] == 1.0  # the draft is the target itself
    assert summaries["draft"]["mean_accepted_length"] > 1.0
    assert summaries["hf"]["acceptance"] is None
    pairs = {(r["mode"], r["baseline"]) for r in data["ratios"]}
    assert {("draft", "hf"), ("draft", "off"), ("draft", "hf-assisted"), ("ngram", "hf-lookup"),
            ("off", "hf")} <= pairs
    for r in data["ratios"]:
        _check_interval(r["ratio"])
        assert r["verdict"] in ("faster", "slower", "within noise")  # 4 pairs each
        assert r["verdict"] == "within noise" or not r["ratio"]["low"] <= 1 <= r["ratio"]["high"]
    assert (out / "offline_tok_s.png").stat().st_size > 0
    section = results_md.read_text()
    assert offline.HEADING in section and "Command: `python -m benchmarks offline" in section


def test_offline_mismatch_is_a_failure(tiny, tmp_path, monkeypatch, capsys):
    real = backends.HFBackend.generate

    def corrupted(self, prompt, max_new_tokens):
        g = real(self, prompt, max_new_tokens)
        g.token_ids[-1] = (g.token_ids[-1] + 1) % 1000  # what a wrong kernel would do
        return g

    monkeypatch.setattr(backends.HFBackend, "generate", corrupted)
    out = tmp_path / "mismatch"
    rc = bench_main(["offline", "--model", tiny, "--modes", "off,hf", "--workloads", "chat",
                     "--num-prompts", "1", "--new-tokens", "4", "--repeats", "1", "--warmup", "0",
                     "--ignore-eos", "--no-plots", "--out", str(out), *ENGINE_FLAGS])
    assert rc == 1
    data = _load(out / "offline.json")
    assert data["outputs_identical"] is False
    assert len(data["mismatches"]) == 2  # the cold run and the measured one
    assert all(m["mode"] == "hf" and m["position"] == 3 for m in data["mismatches"])
    assert "FAILURE: hf differs from off" in capsys.readouterr().out


def _rec(mode: str, ids: list[int], repeat: int = 0) -> offline.RequestRecord:
    return offline.RequestRecord(mode, "w", 0, repeat, 3, len(ids), 1.0, float(len(ids)), None,
                                 0, 0, 0, ids)


def test_find_mismatches_reports_first_differing_position():
    recs = [_rec("off", [1, 2, 3, 4]), _rec("ngram", [1, 2, 3, 4]), _rec("hf", [1, 2, 9, 4]),
            _rec("llama.cpp", [7, 7, 7, 7]), _rec("draft", [1, 2, 3])]
    found = offline.find_mismatches(recs, checked={"off", "ngram", "hf", "draft"})
    assert [(m.mode, m.position, m.expected, m.got) for m in found] == [
        ("hf", 2, [3, 4], [9, 4]), ("draft", 3, [4], [])]
    assert "hf differs from off on w[0] (repeat 0) at output token 2" in found[0].describe()


def test_transformers_reference_of_a_distilled_draft(tiny, tmp_path):
    """A draft in `specserve distill`'s format (no embeddings, reduced head + its token ids)
    loads into transformers with the target's embeddings: on head tokens it computes exactly
    the full model's logits, elsewhere the lowest logit (our reduced head's q = 0)."""
    from safetensors.torch import load_file, save_file

    from specserve.target.loader import HEAD_IDS_KEY

    src = load_file(f"{tiny}/model.safetensors")
    head_ids = torch.arange(3, 4000, 37)
    tensors = {k: v for k, v in src.items() if not k.endswith(("embed_tokens.weight",
                                                                 "lm_head.weight"))}
    tensors["lm_head.weight"] = src["lm_head.weight"][head_ids].contiguous()
    tensors[HEAD_IDS_KEY] = head_ids
    folder = tmp_path / "distilled"
    folder.mkdir()
    save_file(tensors, folder / "model.safetensors")
    cfg = json.loads((Path(tiny) / "config.json").read_text())
    cfg["specserve_draft"] = {"embeddings": "target", "head_vocab_size": len(head_ids)}
    (folder / "config.json").write_text(json.dumps(cfg))
    target = backends.hf_model(tiny, torch.float32, None)
    embed = target.get_input_embeddings().weight.detach()
    draft = backends.hf_model(str(folder), torch.float32, None, embed)
    ids = torch.tensor([[5, 60, 700, 8000, 11]])
    with torch.no_grad():
        full, part = target(ids).logits, draft(ids).logits  # [1, 5, V]
    assert torch.allclose(part[..., head_ids], full[..., head_ids], atol=1e-5)
    rest = torch.ones(full.shape[-1], dtype=torch.bool)
    rest[head_ids] = False
    assert (part[..., rest] == torch.finfo(torch.float32).min).all()
    with pytest.raises(report.BenchError, match="shares its target's embeddings"):
        backends.hf_model(str(folder), torch.float32, None)


def test_resolve_modes():
    assert offline.resolve_modes("auto", False, False) == ["off", "ngram", "hf", "hf-lookup"]
    assert "hf-assisted" in offline.resolve_modes("auto", True, False)
    with pytest.raises(report.BenchError, match="needs --draft-model"):
        offline.resolve_modes("off,draft", False, False)
    with pytest.raises(report.BenchError, match="unknown mode"):
        offline.resolve_modes("off,fast", True, True)


# ---- sweep --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def live(tiny):
    from specserve.server.server_config import ServerConfig

    srv = ServerThread(engine_config(tiny, draft_model=tiny, adaptive_speculation=False,
                                     num_threads=1), ServerConfig(port=0))
    yield srv
    srv.stop()


@pytest.mark.e2e
def test_sweep_against_live_server(live, tmp_path):
    out = tmp_path / "sweep"
    rc = bench_main(["sweep", "--url", live.url, "--modes", "auto",  # the probe finds the draft
                     "--concurrency", "1,3", "--rates", "40", "--num-requests", "4",
                     "--max-tokens", "6", "--warmup", "1", "--ws-concurrency", "2",
                     "--out", str(out)])
    assert rc == 0
    data = _load(out / "sweep.json")
    assert data["total_errors"] == 0 and data["total_requests"] == 4 * 3 * 4
    assert data["config"]["modes"] == ["off", "ngram", "draft"]
    levels = data["levels"]
    loads = {(lv["transport"], lv["concurrency"], lv["rate"]) for lv in levels}
    assert loads == {("sse", 1, None), ("sse", 3, None), ("sse", None, 40.0), ("ws", 2, None)}
    for lv in levels:
        assert lv["requests"] == 4 and lv["errors"] == 0 and lv["error_samples"] == []
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            _check_distribution(lv[key])
        assert lv["ttft_ms"]["p50"] <= lv["e2e_ms"]["p50"]
        assert 0 <= lv["goodput_req_s"] <= lv["req_s"] and lv["output_tok_s"] > 0
        assert lv["output_tok_s"] == pytest.approx(6 * lv["req_s"])
        assert 0 <= lv["slo_attainment"] <= 1
        for r in lv["results"]:
            assert r["ok"] and r["output_tokens"] == 6 and r["finish_reason"] == "length"
            assert 1 <= r["chunks"] <= r["output_tokens"]
            assert len(r["itl_s"]) == r["chunks"] - 1
            if lv["transport"] == "ws":
                assert r["streamed_tokens"] == r["output_tokens"]
            assert r["timings"]["speculative_method"] == lv["mode"]
        if lv["mode"] == "off":
            assert lv["acceptance"] is None
        elif lv["mode"] == "draft":
            assert lv["acceptance"] == 1.0 and lv["mean_accepted_length"] > 1
    for name in ("sweep_throughput.png", "sweep_latency_cdf.png", "sweep_rates.png"):
        assert (out / name).stat().st_size > 0


@pytest.mark.e2e
def test_sweep_errors_make_the_exit_code_nonzero(live, tmp_path):
    out = tmp_path / "errors"
    # 5000 tokens do not fit the 256-token context: every request is refused with a 400.
    rc = bench_main(["sweep", "--url", live.url, "--modes", "off", "--concurrency", "1",
                     "--num-requests", "2", "--max-tokens", "5000", "--warmup", "0",
                     "--ws-concurrency", "0", "--no-plots", "--out", str(out)])
    assert rc == 1
    data = _load(out / "sweep.json")
    assert data["total_errors"] == 2
    assert data["levels"][0]["error_samples"][0].startswith("HTTP 400")


def test_server_flags_forward_engine_flags():
    from benchmarks.__main__ import build_parser

    args = build_parser().parse_args(
        ["sweep", "--model", "m", "--draft-model", "d", "--num-kv-blocks", "64",
         "--no-enable-prefix-caching", "--server-args", "--max-queue-len 512"])
    flags = sweep.server_flags(args)
    text = " ".join(flags)
    for part in ("--model m", "--draft-model d", "--num-kv-blocks 64", "--dtype float32",
                 "--no-enable-prefix-caching", "--max-queue-len 512"):
        assert part in text
    assert "--block-size" not in text  # defaults are left to the server


def test_specserve_bench_forwards_its_arguments():
    from specserve.cli import build_parser

    args = build_parser().parse_args(["bench", "sweep", "--url", "http://x", "--rates", "1"])
    assert args.command == "bench"
    assert args.bench_args == ["sweep", "--url", "http://x", "--rates", "1"]


# ---- attribution --------------------------------------------------------------------------


def test_attribution_table_and_chrome_trace(tiny, tmp_path):
    out, trace = tmp_path / "attr", tmp_path / "trace.json"
    rc = bench_main(["attribution", "--model", tiny, "--draft-model", tiny, "--max-tokens", "10",
                     "--ignore-eos", "--warmup", "1", "--trace", str(trace), "--out", str(out),
                     *ENGINE_FLAGS])
    assert rc == 0
    doc = json.loads(trace.read_text())
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert spans and all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)
    assert all({"name", "ts", "dur", "pid", "tid", "args"} <= set(e) for e in spans)
    names = {e["name"] for e in spans}
    assert {"tokenize", "chat_template", "schedule", "draft_prefill", "propose", "draft_forward",
            "target_forward", "sample", "output", "step"} <= names
    data = _load(out / "attribution.json")
    assert data["config"]["method"] == "draft"
    assert data["output_tokens"] == 10 and data["trace_events"] == len(doc["traceEvents"])
    rows = {r["phase"]: r for r in data["rows"]}
    total = rows.pop("total (client end-to-end)")["ms"]
    assert total == pytest.approx(data["client_e2e_ms"])
    assert sum(r["ms"] for r in rows.values()) == pytest.approx(total)  # nothing unaccounted
    assert rows["draft step 0"]["count"] >= 1 and rows["target verify"]["count"] >= 1
    assert rows["target prefill"]["ms"] > 0 and rows["sampling"]["ms"] > 0
    assert (out / "attribution.png").stat().st_size > 0


def test_attribute_splits_steps_and_draft_steps():
    ev = [
        SpanEvent("step", 0.0, 1.0, 1),
        SpanEvent("schedule", 0.0, 0.1, 1),
        SpanEvent("propose", 0.1, 0.4, 1),
        SpanEvent("draft_forward", 0.1, 0.2, 1), SpanEvent("draft_forward", 0.2, 0.35, 1),
        SpanEvent("target_forward", 0.4, 0.8, 1, {"only_decode": True, "drafts": 2}),
        SpanEvent("sample", 0.8, 0.9, 1), SpanEvent("output", 0.9, 0.95, 1),
    ]
    rows = {r.phase: r.ms for r in attribute(ev, {"queue_ms": 5.0, "e2e_ms": 1100.0}, 1.2)}
    assert rows["draft step 0"] == pytest.approx(100) and rows["draft step 1"] == pytest.approx(150)
    assert rows["propose other"] == pytest.approx(50)
    assert rows["target verify"] == pytest.approx(400) and rows["target prefill"] == 0
    assert rows["step overhead"] == pytest.approx(50)
    assert rows["engine idle"] == pytest.approx(95)
    assert rows["server + network"] == pytest.approx(100)


# ---- tracer -------------------------------------------------------------------------------


def test_tracer_records_nested_spans_and_null_tracer_does_nothing():
    null = NullTracer()
    with null.span("x", a=1):
        null.begin("y")
        null.end()
    tr = Tracer()
    with tr.span("outer", k=3):
        tr.begin("inner")
        tr.end()
    tr.end()  # unmatched end: ignored
    assert [e.name for e in tr.events] == ["inner", "outer"]
    inner, outer = tr.events
    assert outer.start <= inner.start <= inner.end <= outer.end
    doc = tr.chrome_trace(thread_names={outer.tid: "main"})
    assert doc["traceEvents"][0]["ph"] == "M"
    x = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in x] == ["outer", "inner"] and x[0]["args"] == {"k": 3}
    assert json.loads(json.dumps(doc)) == doc


# ---- statistics ---------------------------------------------------------------------------


def test_percentile_matches_numpy():
    rng = np.random.default_rng(1)
    for n in (1, 2, 5, 17, 100):
        xs = rng.exponential(3.0, size=n).tolist()
        for q in (0, 1, 25, 50, 90, 95, 99, 100):
            assert stats.percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    d = stats.distribution([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (d.n, d.mean, d.p50, d.min, d.max) == (5, 3.0, 3.0, 1.0, 5.0)


def test_ratio_cell_gives_the_median_and_range_of_per_round_ratios():
    """Worked by hand: the median of an even count is the mean of the middle two; one ratio
    has no range to show."""
    assert stats.ratio_cell([1.30, 1.10, 1.25, 1.20]) == "1.23x (1.10..1.30)"
    assert stats.ratio_cell([0.987]) == "0.99x"


def test_bootstrap_mean_ci_covers_the_true_mean():
    rng = np.random.default_rng(0)
    sample = rng.normal(10.0, 2.0, size=200).tolist()  # a fixed sample; coverage is below
    iv = stats.bootstrap_mean(sample)
    assert iv.contains(10.0) and iv.low < iv.point < iv.high
    assert iv.point == pytest.approx(statistics.fmean(sample))
    covered = sum(stats.bootstrap_mean(rng.normal(5.0, 1.0, 30).tolist(), 400, seed=i)
                  .contains(5.0) for i in range(100))
    assert covered >= 85  # nominal 95%
    assert stats.bootstrap_mean([4.0]) == stats.Interval(4.0, 4.0, 4.0)


def test_bootstrap_ratio_and_welch():
    b = [10.0, 12.0, 11.0, 9.0, 13.0]
    exact = stats.bootstrap_ratio([2 * x for x in b], b)
    assert exact.point == pytest.approx(2.0) and exact.low == pytest.approx(2.0)
    assert exact.high == pytest.approx(2.0)
    assert stats.verdict(exact) == "faster"
    noisy = stats.bootstrap_ratio([10.0, 12.0, 9.0, 11.0], [11.0, 10.0, 12.0, 9.0])
    assert noisy.contains(1.0) and stats.verdict(noisy) == "within noise"
    w = stats.welch([10.0, 11.0, 12.0, 13.0], [1.0, 2.0, 3.0, 4.0])
    assert w.diff.point == pytest.approx(9.0) and w.dof == pytest.approx(6.0)
    # se = sqrt(2 * (5/3) / 4); t(0.975, 6) = 2.4469
    assert w.diff.high - w.diff.point == pytest.approx(2.4469 * math.sqrt(5 / 6), rel=1e-4)


def test_t_quantiles():
    assert stats.t_quantile_975(1) == pytest.approx(12.7062)
    assert stats.t_quantile_975(30) == pytest.approx(2.0423, abs=1e-4)
    assert stats.t_quantile_975(120) == pytest.approx(1.9799, abs=1e-4)
    assert stats.t_quantile_975(math.inf) == pytest.approx(1.95996, abs=1e-5)
    assert 2.5706 > stats.t_quantile_975(5.5) > 2.4469


# ---- workloads ----------------------------------------------------------------------------


def test_workload_files():
    for name in ("chat", "rewrite", "code", "summarize"):
        prompts = report.load_workload(name)
        assert prompts and all(isinstance(p, str) and p.strip() for p in prompts)
    for p in report.load_workload("summarize"):
        passage = p.split("\n\n", 1)[1]
        assert 300 <= len(passage.split()) <= 600
    assert all("\n" in p and any(s in p for s in ("def ", "{", "SELECT", "class "))
               for p in report.load_workload("code"))
    with pytest.raises(report.BenchError, match="not found"):
        report.load_workload("nope")


def test_ngram_replay_counts_target_steps_exactly():
    """The replay's step count against cases worked by hand: a rule that drafts the true
    continuation takes ceil(L / (k + 1)) steps (the last step never drafts past the end), an
    empty rule takes L, and an output that copies its prompt after one new token takes two
    undrafted steps, then one step per k + 1 tokens."""
    from benchmarks.probes.ngram_replay import no_edit_fallback, replay

    prompt, output = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16, 17]
    full = prompt + output

    def oracle(tokens, k, min_n, max_n):
        return np.asarray(full[len(tokens) : len(tokens) + k])

    def empty(tokens, k, min_n, max_n):
        return tokens[:0]

    assert replay(prompt, output, 3, oracle, 1, 4) == math.ceil(7 / 4)
    assert replay(prompt, output, 3, empty, 1, 4) == 7
    # Steps 1 and 2 draft nothing (10 has no earlier copy, then 0 is new and so is the 10
    # before it); from the known 1 on, each step copies k tokens and the target adds one.
    from specserve.draft.ngram import find_ngram_draft

    copy_out = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    for rule in (no_edit_fallback, find_ngram_draft):
        assert replay(prompt, copy_out, 4, rule, 1, 4) == 2 + math.ceil(8 / 5)
    # An edit (7 replaced by 70): only the fallback resumes the copy right after it.
    edit_out = [0, 1, 2, 3, 4, 5, 6, 70, 8, 9]
    assert replay(prompt, edit_out, 4, find_ngram_draft, 1, 4) < replay(
        prompt, edit_out, 4, no_edit_fallback, 1, 4)


def test_oracle_proposer_cuts_drafts_to_the_accepted_prefix(tiny):
    """benchmarks/probes/spec_ceiling.py's oracle: cut by hand-worked cases, then through the
    engine, where every cut draft must be accepted and the output stay plain decoding's."""
    from benchmarks.probes.spec_ceiling import OracleProposer
    from specserve.core.sampling_params import SamplingParams, SpeculativeParams
    from specserve.draft.base import Proposal, ProposalRequest, StatelessProposer
    from specserve.engine.llm_engine import LLMEngine

    class Fixed(StatelessProposer):
        name = "fixed"

        def propose(self, requests):
            n = len(requests)
            return Proposal([[7, 8, 9, 5]] * n, confidence=[[1.0] * 4] * n)

    oracle = OracleProposer(Fixed(), {(1, 2): [3, 7, 8, 4, 6]})
    out = oracle.propose([ProposalRequest(0, [1, 2, 3], 4, num_prompt_tokens=2),
                          ProposalRequest(1, [1, 2], 4, num_prompt_tokens=2)])
    assert out.draft_token_ids == [[7, 8], []]
    assert out.confidence == [[1.0, 1.0], []]

    engine = LLMEngine(engine_config(tiny, speculative_method="ngram",
                                     adaptive_speculation=False))  # every draft verified
    prompt = engine.encode("a b c a b c a b c a b c a b")
    params = SamplingParams(max_tokens=24, temperature=0.0)
    plain = engine.generate([prompt], params, SpeculativeParams(method="off"))[0]
    truth = list(plain.token_ids)

    class HalfRight(StatelessProposer):  # the true next tokens, the last one always wrong
        name = "ngram"

        def propose(self, requests):
            drafts = []
            for r in requests:
                done = len(r.token_ids) - r.num_prompt_tokens
                right = truth[done: done + r.num_tokens]
                drafts.append(right[:-1] + [(right[-1] + 1) % 50] if right else [])
            return Proposal(drafts)

    engine.speculator.proposers["ngram"] = OracleProposer(HalfRight(), {tuple(prompt): truth})
    spec = engine.generate([prompt], params, SpeculativeParams(method="ngram"))[0]
    assert spec.token_ids == plain.token_ids
    assert spec.timings.num_drafted > 0
    assert spec.timings.num_accepted == spec.timings.num_drafted


def test_a_rerun_keeps_the_earlier_section_under_its_date(tmp_path):
    path = tmp_path / "RESULTS.md"
    path.write_text("# Benchmark results\n\n## Speed\n\nRun started 2026-01-01T00:00:00+0000.\n\n"
                    "| a |\n\n## Speed, another heading it prefixes\n\nkept as is\n")
    new = "## Speed\n\nRun started 2026-02-02T00:00:00+0000.\n\n| b |\n"
    report.write_section(path, "## Speed", new)
    text = path.read_text()
    assert text.index("| b |") < text.index("## Speed (earlier run, 2026-01-01T00:00:00+0000)")
    assert text.index("| a |") > text.index("(earlier run")
    assert text.count("## Speed, another heading it prefixes\n\nkept as is") == 1
    report.write_section(path, "## Speed", new)  # the same text again adds nothing
    assert path.read_text() == text
    report.write_section(path, "## Elsewhere", "## Elsewhere\n\nx\n")
    assert path.read_text().endswith("## Elsewhere\n\nx\n")
