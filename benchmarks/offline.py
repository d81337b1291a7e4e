"""Offline A/B in one process: the same prompts, weights and dtype, greedy, one request at a time.

Modes: this engine with speculation off / n-gram / draft model, transformers ``generate()``
plain, with ``assistant_model=`` (the same draft) and with ``prompt_lookup_num_tokens=``, and
llama.cpp on the same GGUF when ``llama_cpp`` is importable.

Method. Every backend runs one cold request first (reported on its own as cold start), then
``--warmup`` unmeasured requests; measured requests interleave the modes per prompt, in an order
that rotates each repeat, so machine drift hits all modes alike. Each request yields tokens/s =
output tokens / wall seconds; a mode's figure is the mean over requests with a bootstrap 95%
interval, and a speed ratio is the ratio of means, bootstrapped over (prompt, repeat) pairs.
A ratio whose interval holds 1.0 is reported as "within noise". Greedy token ids must be
identical across every checked mode, cold runs included: a mismatch is listed and makes the
exit code 1, it is never averaged away.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks import plots
from benchmarks.backends import (
    LLAMACPP,
    Backend,
    EngineBackend,
    Generation,
    HFBackend,
    hf_model,
    llamacpp_backend,
)
from benchmarks.report import (
    BenchError,
    RunInfo,
    add_output_args,
    fmt,
    load_workload,
    md_table,
    out_dir,
    parse_list,
    run_info,
    write_json,
    write_results_section,
)
from benchmarks.stats import Interval, bootstrap_mean, bootstrap_ratio, verdict, welch

OURS = ("off", "ngram", "draft")
HF, HF_ASSISTED, HF_LOOKUP = "hf", "hf-assisted", "hf-lookup"
ALL_MODES = (*OURS, HF, HF_ASSISTED, HF_LOOKUP, LLAMACPP)
HEADING = "## Offline A/B: specserve vs transformers"


# ---- results ------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    mode: str
    workload: str
    prompt_index: int
    repeat: int  # -1: the cold-start request
    prompt_tokens: int
    output_tokens: int
    seconds: float
    tok_s: float
    ttft_ms: float | None
    drafted: int
    accepted: int
    verify_steps: int
    token_ids: list[int] = field(repr=False, default_factory=list)


@dataclass
class Mismatch:
    mode: str
    reference_mode: str
    workload: str
    prompt_index: int
    repeat: int
    position: int  # first differing output position
    expected: list[int]  # up to 8 token ids from `position`
    got: list[int]

    def describe(self) -> str:
        run = "cold run" if self.repeat < 0 else f"repeat {self.repeat}"
        return (f"{self.mode} differs from {self.reference_mode} on {self.workload}"
                f"[{self.prompt_index}] ({run}) at output token {self.position}: expected "
                f"{self.expected}, got {self.got}")


@dataclass
class ColdStart:
    mode: str
    load_s: float  # loading the backend (our modes share one engine load)
    first_request_s: float
    first_ttft_ms: float | None
    output_tokens: int


@dataclass
class ModeSummary:
    workload: str  # a workload name, or "all"
    mode: str
    requests: int
    tok_s: Interval  # mean of per-request tokens/s with its bootstrap 95% interval
    ttft_ms_mean: float | None
    acceptance: float | None  # accepted / drafted
    mean_accepted_length: float | None  # tokens per verify step


@dataclass
class RatioSummary:
    workload: str
    mode: str
    baseline: str
    ratio: Interval  # mean tok/s of mode / of baseline, paired bootstrap 95%
    verdict: str  # faster | slower | within noise | one run (no interval)
    welch_diff_tok_s: Interval | None  # Welch's 95% interval of the tok/s difference


@dataclass
class OfflineConfig:
    model: str
    draft_model: str | None
    dtype: str
    workloads: list[str]
    num_prompts: int
    new_tokens: int
    num_speculative_tokens: int
    repeats: int
    warmup: int
    ignore_eos: bool
    modes: list[str]
    prompt_lookup_num_tokens: int


@dataclass
class OfflineReport:
    info: RunInfo
    config: OfflineConfig
    cold_start: list[ColdStart]
    summaries: list[ModeSummary]
    ratios: list[RatioSummary]
    mismatches: list[Mismatch]
    outputs_identical: bool
    unchecked: dict[str, str]  # mode -> why its ids are not compared
    skipped: dict[str, str]  # mode -> why `auto` left it out
    records: list[RequestRecord]

    @property
    def exit_code(self) -> int:
        return 1 if self.mismatches else 0


# ---- analysis (pure functions, unit-tested) -----------------------------------------------


def find_mismatches(records: list[RequestRecord], checked: set[str]) -> list[Mismatch]:
    """Every checked record against the first checked record of the same prompt."""
    reference: dict[tuple[str, int], RequestRecord] = {}
    found = []
    for r in records:
        if r.mode not in checked:
            continue
        key = (r.workload, r.prompt_index)
        ref = reference.setdefault(key, r)
        if r is ref or r.token_ids == ref.token_ids:
            continue
        pos = next((i for i, (a, b) in enumerate(zip(ref.token_ids, r.token_ids)) if a != b),
                   min(len(ref.token_ids), len(r.token_ids)))
        found.append(Mismatch(r.mode, ref.mode, r.workload, r.prompt_index, r.repeat, pos,
                              ref.token_ids[pos:pos + 8], r.token_ids[pos:pos + 8]))
    return found


def summarize(records: list[RequestRecord], modes: list[str], workloads: list[str]
              ) -> tuple[list[ModeSummary], list[RatioSummary]]:
    measured = [r for r in records if r.repeat >= 0]
    summaries, ratios = [], []
    for wl in [*workloads, "all"] if len(workloads) > 1 else workloads:
        rows = [r for r in measured if wl in ("all", r.workload)]
        by_mode: dict[str, dict[tuple[str, int, int], RequestRecord]] = defaultdict(dict)
        for r in rows:
            by_mode[r.mode][(r.workload, r.prompt_index, r.repeat)] = r
        for m in modes:
            recs = list(by_mode[m].values())
            if not recs:
                continue
            drafted = sum(r.drafted for r in recs)
            steps = sum(r.verify_steps for r in recs)
            accepted = sum(r.accepted for r in recs)
            ttfts = [r.ttft_ms for r in recs if r.ttft_ms is not None]
            summaries.append(ModeSummary(
                wl, m, len(recs), bootstrap_mean([r.tok_s for r in recs]),
                sum(ttfts) / len(ttfts) if ttfts else None,
                accepted / drafted if drafted else None,
                (accepted + steps) / steps if steps else None,
            ))
        for mode, base in ratio_pairs(modes):
            keys = sorted(set(by_mode[mode]) & set(by_mode[base]))
            if not keys:
                continue
            a = [by_mode[mode][k].tok_s for k in keys]
            b = [by_mode[base][k].tok_s for k in keys]
            ratio = bootstrap_ratio(a, b, paired=True)
            w = welch(a, b).diff if len(keys) >= 2 else None
            ratios.append(RatioSummary(wl, mode, base, ratio, verdict(ratio, len(keys)), w))
    return summaries, ratios


def ratio_pairs(modes: list[str]) -> list[tuple[str, str]]:
    """Each mode against transformers plain and our plain decoding, and each speculative
    method against transformers' version of it."""
    pairs = [(m, b) for b in (HF, "off") if b in modes for m in modes if m != b]
    pairs += [(m, b) for m, b in (("draft", HF_ASSISTED), ("ngram", HF_LOOKUP))
              if m in modes and b in modes]
    return list(dict.fromkeys(pairs))


# ---- the run ------------------------------------------------------------------------------


def add_arguments(ap: argparse.ArgumentParser) -> None:
    from specserve.cli import add_engine_args

    ap.add_argument("--workloads", default="chat,rewrite,code,summarize",
                    help="prompt files under benchmarks/prompts (or .json paths), comma-separated "
                         "[default: %(default)s]")
    ap.add_argument("--num-prompts", type=int, default=3,
                    help="prompts taken from each workload [default: %(default)s]")
    ap.add_argument("--new-tokens", type=int, default=64,
                    help="max tokens per request [default: %(default)s]")
    ap.add_argument("--repeats", type=int, default=3,
                    help="measured passes over the prompts [default: %(default)s]")
    ap.add_argument("--warmup", type=int, default=1,
                    help="unmeasured requests per mode after its cold request "
                         "[default: %(default)s]")
    ap.add_argument("--modes", default="auto",
                    help=f"comma-separated subset of {', '.join(ALL_MODES)}; auto: every one "
                         "available (draft modes need --draft-model, llama.cpp llama_cpp) "
                         "[default: %(default)s]")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="generate exactly --new-tokens in every mode")
    ap.add_argument("--prompt-lookup-num-tokens", type=int, default=10,
                    help="transformers' prompt_lookup_num_tokens (its documented default 10)")
    add_output_args(ap)
    add_engine_args(ap)
    ap.set_defaults(dtype="float32")  # one dtype for every backend; the README's numbers


def resolve_modes(text: str, has_draft: bool, has_llamacpp: bool) -> list[str]:
    available = [m for m in ALL_MODES
                 if (has_draft or m not in ("draft", HF_ASSISTED))
                 and (has_llamacpp or m != LLAMACPP)]
    if text == "auto":
        return available
    modes = parse_list(text, str, "--modes")
    for m in modes:
        if m not in ALL_MODES:
            raise BenchError(f"unknown mode {m!r}; modes: {', '.join(ALL_MODES)}")
        if m not in available:
            need = "--draft-model" if m in ("draft", HF_ASSISTED) else "llama-cpp-python"
            raise BenchError(f"mode {m} needs {need}")
    if not modes:
        raise BenchError("--modes is empty")
    return list(dict.fromkeys(modes))


def run(args: argparse.Namespace, argv: list[str]) -> int:
    report = run_offline(args, argv)
    folder = out_dir(args.out, "offline")
    write_json(folder / "offline.json", report)
    if not args.no_plots:
        plot(report, folder)
    body = tables(report)
    print("\n".join(body))
    for m in report.mismatches:
        print(f"FAILURE: {m.describe()}")
    if args.write_results:
        write_results_section(HEADING, report.info, intro(report), body)
    print(f"results: {folder / 'offline.json'}")
    return report.exit_code


def run_offline(args: argparse.Namespace, argv: list[str]) -> OfflineReport:
    from transformers.utils import logging as hf_logging

    from specserve.cli import engine_config_from_args
    from specserve.engine.llm_engine import LLMEngine

    for name in ("num_prompts", "new_tokens", "repeats"):
        if getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0:
        raise BenchError("--warmup must be >= 0")
    workloads = {wl: load_workload(wl)[:args.num_prompts]  # bad names fail before loading
                 for wl in parse_list(args.workloads, str, "--workloads")}
    hf_logging.set_verbosity_error()  # generate() warns per call about config it was given
    t0 = time.perf_counter()
    engine = LLMEngine(engine_config_from_args(args))
    setup = build_backends(args, engine, time.perf_counter() - t0)
    prompts = encode_prompts(engine, workloads, args.new_tokens)
    records, cold = measure(setup, prompts, args)
    modes = setup.modes
    checked = {m for m in modes if setup.backends[m].checked}
    mismatches = find_mismatches(records, checked)
    summaries, ratios = summarize(records, modes, list(dict.fromkeys(p[0] for p in prompts)))
    config = OfflineConfig(
        model=engine.model_path, draft_model=engine.config.draft_model, dtype=str(engine.dtype),
        workloads=list(workloads), num_prompts=args.num_prompts, new_tokens=args.new_tokens,
        num_speculative_tokens=args.num_speculative_tokens, repeats=args.repeats,
        warmup=args.warmup, ignore_eos=args.ignore_eos, modes=modes,
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
    )
    unchecked = {m: "its own quantized kernels on the GGUF: greedy ids may legitimately differ"
                 for m in modes if m not in checked}
    return OfflineReport(run_info(argv), config, cold, summaries, ratios, mismatches,
                         not mismatches, unchecked, setup.skipped, records)


@dataclass
class Setup:
    modes: list[str]
    backends: dict[str, Backend]
    load_s: dict[str, float]  # each mode's load time (our modes share one engine)
    skipped: dict[str, str]


def build_backends(args: argparse.Namespace, engine: Any, engine_load: float) -> Setup:
    from specserve.engine.models import resolve_model_path

    eos = None if args.ignore_eos else sorted(engine.eos_token_ids)
    llama, llama_load = None, 0.0
    if args.modes == "auto" or LLAMACPP in parse_list(args.modes, str, "--modes"):
        llama, llama_load = _timed(lambda: llamacpp_backend(
            engine.model_path, engine.config.max_model_len, sorted(engine.eos_token_ids)))
    modes = resolve_modes(args.modes, engine.speculator.draft is not None, llama is not None)
    setup = Setup(modes, {}, {}, {})
    for m in OURS:
        if m in modes:
            setup.backends[m] = EngineBackend(engine, m, args.num_speculative_tokens,
                                              args.ignore_eos)
            setup.load_s[m] = engine_load
    if llama is not None and LLAMACPP in modes:
        setup.backends[LLAMACPP], setup.load_s[LLAMACPP] = llama, llama_load
    if not any(m in modes for m in (HF, HF_ASSISTED, HF_LOOKUP)):
        return setup
    target, t_load = _timed(lambda: hf_model(engine.model_path, engine.dtype, eos))
    for m, extra in ((HF, {}), (HF_LOOKUP, {"prompt_lookup_num_tokens":
                                            args.prompt_lookup_num_tokens})):
        if m in modes:
            setup.backends[m], setup.load_s[m] = HFBackend(m, target, eos or [], **extra), t_load
    if HF_ASSISTED in modes:
        draft_path = resolve_model_path(engine.config.draft_model)
        embed = target.get_input_embeddings().weight.detach()
        try:
            draft, d_load = _timed(lambda: hf_model(draft_path, engine.dtype, eos, embed))
        except BenchError as exc:
            if args.modes != "auto":
                raise
            modes.remove(HF_ASSISTED)
            setup.skipped[HF_ASSISTED] = str(exc)
        else:
            setup.backends[HF_ASSISTED] = HFBackend(HF_ASSISTED, target, eos or [],
                                                    assistant_model=draft)
            setup.load_s[HF_ASSISTED] = t_load + d_load
    return setup


def measure(setup: Setup, prompts: list[tuple[str, int, list[int]]], args: argparse.Namespace
            ) -> tuple[list[RequestRecord], list[ColdStart]]:
    """Cold request per mode, warm-up, then interleaved measured passes."""
    modes, backends = setup.modes, setup.backends
    records: list[RequestRecord] = []
    cold: list[ColdStart] = []
    wl0, i0, ids0 = prompts[0]
    for m in modes:  # cold start: each backend's very first request
        g = backends[m].generate(ids0, args.new_tokens)
        records.append(_record(m, wl0, i0, -1, ids0, g))
        cold.append(ColdStart(m, setup.load_s[m], g.seconds, g.ttft_ms, len(g.token_ids)))
    for w in range(args.warmup):
        for m in modes:
            backends[m].generate(prompts[w % len(prompts)][2], min(args.new_tokens, 16))
    with tqdm(total=args.repeats * len(prompts) * len(modes), desc="offline", unit="req") as bar:
        for rep in range(args.repeats):
            order = modes[rep % len(modes):] + modes[:rep % len(modes)]
            for wl, idx, ids in prompts:
                for m in order:
                    g = backends[m].generate(ids, args.new_tokens)
                    records.append(_record(m, wl, idx, rep, ids, g))
                    bar.update()
    return records, cold


def _timed(make: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    value = make()
    return value, time.perf_counter() - t0


def encode_prompts(engine: Any, workloads: dict[str, list[str]], new_tokens: int
                   ) -> list[tuple[str, int, list[int]]]:
    """(workload, index, chat-templated token ids) for every prompt of every workload."""
    out = []
    for wl, texts in workloads.items():
        for i, text in enumerate(texts):
            ids = engine.encode(engine.render_chat([{"role": "user", "content": text}]))
            if len(ids) + new_tokens > engine.config.max_model_len:
                raise BenchError(f"{wl}[{i}] is {len(ids)} tokens: with --new-tokens "
                                 f"{new_tokens} it exceeds max-model-len "
                                 f"{engine.config.max_model_len}")
            out.append((Path(wl).stem, i, ids))
    if not out:
        raise BenchError("no prompts: check --workloads")
    return out


def _record(mode: str, wl: str, idx: int, rep: int, ids: list[int], g: Generation
            ) -> RequestRecord:
    n = len(g.token_ids)
    return RequestRecord(mode, wl, idx, rep, len(ids), n, g.seconds,
                         n / g.seconds if g.seconds > 0 else 0.0, g.ttft_ms, g.drafted,
                         g.accepted, g.verify_steps, g.token_ids)


# ---- presentation -------------------------------------------------------------------------


def tables(report: OfflineReport) -> list[str]:
    modes = report.config.modes
    ratio = {(r.workload, r.mode, r.baseline): r for r in report.ratios}
    bases = [b for b in (HF, "off") if b in modes]
    own = {"draft": HF_ASSISTED, "ngram": HF_LOOKUP}
    lines: list[str] = []
    workloads = list(dict.fromkeys(s.workload for s in report.summaries))
    for wl in workloads:
        rows = []
        for s in (s for s in report.summaries if s.workload == wl):
            cells = [s.mode, f"{s.tok_s.point:.1f} [{s.tok_s.low:.1f}, {s.tok_s.high:.1f}]"]
            for b in [*bases, "theirs"]:
                r = ratio.get((wl, s.mode, own.get(s.mode, "") if b == "theirs" else b))
                cells.append(_ratio_cell(r))
            cells += [fmt(s.acceptance, 2), fmt(s.mean_accepted_length, 2),
                      fmt(s.ttft_ms_mean, 0), str(s.requests)]
            rows.append(cells)
        headers = ["mode", "tok/s (mean, 95% CI)", *(f"vs {b}" for b in bases),
                   "vs transformers' same method", "acceptance", "tokens/verify",
                   "TTFT ms", "requests"]
        lines += [f"Workload **{wl}**:", "", *md_table(headers, rows), ""]
    cold_rows = [[c.mode, f"{c.load_s:.1f}", f"{c.first_request_s * 1e3:.0f}",
                  fmt(c.first_ttft_ms, 0), str(c.output_tokens)] for c in report.cold_start]
    lines += ["Cold start (each backend's first request, before warm-up):", "",
              *md_table(["mode", "load s", "first request ms", "first TTFT ms", "tokens"],
                        cold_rows), ""]
    checked = [m for m in modes if m not in report.unchecked]
    lines.append(f"Greedy outputs identical across {', '.join(checked)}: "
                 f"{report.outputs_identical}" + (f" ({len(report.mismatches)} mismatches)"
                                                  if report.mismatches else "") + ".")
    for m, why in report.unchecked.items():
        lines.append(f"{m} outputs not compared: {why}.")
    for m, why in report.skipped.items():
        lines.append(f"{m} not run: {why}.")
    return lines


def _ratio_cell(r: RatioSummary | None) -> str:
    if r is None:
        return "-"
    noise = {"within noise": " (noise)", "one run": " (1 run)"}.get(r.verdict, "")
    return f"{r.ratio.point:.2f}x [{r.ratio.low:.2f}, {r.ratio.high:.2f}]{noise}"


def intro(report: OfflineReport) -> str:
    c = report.config
    draft = f", draft `{Path(c.draft_model).name}`" if c.draft_model else ""
    return (f"Model `{Path(c.model).name}`{draft}, {c.dtype}, greedy, batch 1, up to "
            f"{c.new_tokens} new tokens{' (EOS ignored)' if c.ignore_eos else ''}, "
            f"{c.num_prompts} prompts from each of {', '.join(c.workloads)}, k_max "
            f"{c.num_speculative_tokens}, transformers prompt_lookup_num_tokens "
            f"{c.prompt_lookup_num_tokens}; {c.warmup} warm-up request(s) per mode, then "
            f"{c.repeats} interleaved repeats. tok/s is the mean over requests with a bootstrap "
            f"95% interval; ratios are ratios of means with a paired bootstrap 95% interval, "
            f"\"(noise)\" where it holds 1.0.")


def plot(report: OfflineReport, folder: Path) -> None:
    workloads = list(dict.fromkeys(s.workload for s in report.summaries))
    by = {(s.workload, s.mode): s.tok_s for s in report.summaries}
    series = {m: [by.get((wl, m)) for wl in workloads] for m in report.config.modes}
    plots.bars_with_ci(folder / "offline_tok_s.png", workloads, series, "tokens/s per request",
                       "Offline, batch 1: mean tok/s with 95% CI")

