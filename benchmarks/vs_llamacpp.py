"""This engine vs llama.cpp (llama-cpp-python) on the same GGUF file, threads and prompts, in one
process, interleaved prompt by prompt. Writes the "## vs llama.cpp" section of RESULTS.md.

    python benchmarks/vs_llamacpp.py [--model PATH.gguf] [--draft-model PATH] [--threads 2]
        [--new-tokens 128] [--repeats 2] [--workloads chat,rewrite,code]
        [--prompts-per-workload 4] [--batch-sizes 8,32] [--no-write]

Needs `pip install -e .[llamacpp]` (llama-cpp-python builds from source: 10+ minutes).

Single stream: for every prompt, in one loop: llama.cpp, then ours with speculation off, n-gram
and draft (one engine, per-request method). Both sides get the same chat-templated token ids.
Two stop rules: "EOS" (both stop at EOS, at most N tokens) and "fixed N" (EOS ignored on both
sides). tok/s = generated tokens / wall seconds including prefill; neither side reuses an earlier
request's KV (llama.cpp is reset, our prefix cache is off). Batch B: our aggregate tok/s over B
concurrent fixed-N requests against llama.cpp's single-stream fixed-N tok/s (llama-cpp-python
serves one stream at a time). Greedy everywhere: a speculative output that differs from our
plain output fails the run (exit 1); differences from llama.cpp's text are only reported.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from benchmarks.ab import run as run_batch  # noqa: E402
from benchmarks.backends import LLAMACPP, EngineBackend, Generation, LlamaCppBackend  # noqa: E402
from benchmarks.report import (  # noqa: E402
    RESULTS_MD,
    BenchError,
    fmt,
    load_workload,
    md_table,
    parse_list,
    results_section,
    run_info,
    write_section,
)
from specserve.core.config import EngineConfig  # noqa: E402
from specserve.core.sampling_params import SamplingParams  # noqa: E402
from specserve.engine.llm_engine import LLMEngine  # noqa: E402

HEADING = "## vs llama.cpp"
STOPS = {"EOS": False, "fixed N": True}  # stop rule -> ignore_eos
Runs = dict[tuple, list[list[Generation]]]  # (workload, stop, mode) -> [repeat][prompt]


def tok_s(gens: list[Generation]) -> float:
    return sum(len(g.token_ids) for g in gens) / sum(g.seconds for g in gens)


def ratio_cell(num: list[float], den: list[float]) -> str:
    """Median of per-repeat ratios (paired: same repeat, same machine state), min..max."""
    r = [a / b for a, b in zip(num, den)]
    spread = f" ({min(r):.2f}..{max(r):.2f})" if len(r) > 1 else ""
    return f"{statistics.median(r):.2f}x{spread}"


def make_backends(engine: LLMEngine, llm, modes: list[str]) -> dict[str, dict]:
    """stop rule -> mode -> backend. llama.cpp with no EOS ids runs on past EOS, as our
    ignore_eos does, so "fixed N" is like for like."""
    k = engine.config.num_speculative_tokens
    eos = sorted(engine.eos_token_ids)
    return {
        stop: {LLAMACPP: LlamaCppBackend(llm, [] if ignore_eos else eos),
               **{m: EngineBackend(engine, m, k, ignore_eos, fresh_cache=True) for m in modes}}
        for stop, ignore_eos in STOPS.items()
    }


def single_stream(backends: dict[str, dict], chats: dict[str, list[list[int]]], new_tokens: int,
                  repeats: int) -> Runs:
    runs: Runs = {}
    for rep in range(repeats):
        for wl, prompts in chats.items():
            for prompt in prompts:
                for stop, by_mode in backends.items():
                    for mode, backend in by_mode.items():
                        if mode == LLAMACPP:
                            # Else llama.cpp reuses the previous call's KV prefix.
                            backend.llm.reset()
                        per_rep = runs.setdefault((wl, stop, mode), [[] for _ in range(repeats)])
                        per_rep[rep].append(backend.generate(prompt, new_tokens))
            print(f"repeat {rep + 1}/{repeats}: {wl} single stream done", flush=True)
    return runs


def batched(engine: LLMEngine, chats: dict[str, list[list[int]]], args) -> dict[tuple, list]:
    """(workload, batch, mode) -> per repeat ab.run's {"tok_s", "ids", ...}; fixed N."""
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    k = engine.config.num_speculative_tokens
    runs: dict[tuple, list] = {}
    for _ in range(args.repeats):
        for wl, prompts in chats.items():
            for bsz in args.batch_sizes:
                wave = [prompts[i % len(prompts)] for i in range(bsz)]
                for m in ("off", "ngram"):
                    result = run_batch(engine, [wave], params, m, k)  # one closed batch
                    runs.setdefault((wl, bsz, m), []).append(result)
    return runs


def greedy_checks(single: Runs, batch: dict, chats: dict, modes: list[str],
                  decode) -> tuple[list[str], list[str]]:
    """(failures, notes). Every repeat of every mode of ours must equal our plain repeat 0,
    token for token; llama.cpp rounds activations differently, so it is only reported."""
    total = sum(len(p) for p in chats.values())
    failures, counts = [], []
    for stop in STOPS:
        for m in modes:
            bad = sum(any(rep[i].token_ids != single[(wl, stop, "off")][0][i].token_ids
                          for rep in single[(wl, stop, m)])
                      for wl, prompts in chats.items() for i in range(len(prompts)))
            counts.append(f"{m} ({stop}) {bad}/{total}")
            if bad:
                failures.append(f"{m} ({stop}): {bad} prompt(s) differ from plain decoding")
    batch_bad = [f"{wl} batch {bsz} {m}" for (wl, bsz, m), reps in batch.items()
                 if any(r["ids"] != batch[(wl, bsz, "off")][0]["ids"] for r in reps)]
    failures += [f"{b}: output differs from plain decoding" for b in batch_bad]
    differ, first = 0, ""
    for wl, prompts in chats.items():
        for i in range(len(prompts)):
            ours = decode(single[(wl, "EOS", "off")][0][i].token_ids)
            theirs = decode(single[(wl, "EOS", LLAMACPP)][0][i].token_ids)
            if ours != theirs:
                differ += 1
                common = len(os.path.commonprefix([ours, theirs]))
                first = first or f" (first: {wl} #{i}, common prefix {common} of {len(ours)} chars)"
    return failures, [
        f"Greedy token ids differing from our plain decoding, prompts: {', '.join(counts)}; "
        f"batch runs: {', '.join(batch_bad) or 'none'}.",
        f"Prompts whose EOS-stopped text differs from llama.cpp's: {differ}/{total}{first}.",
    ]


def single_table(single: Runs, chats: dict, modes: list[str]) -> list[str]:
    headers = ["workload", "stop", *(f"{m} vs llama.cpp" for m in modes), "llama.cpp tok/s",
               *(f"{m} tok/s" for m in modes), "tokens/answer llama.cpp / ours"]
    rows = []
    for wl in chats:
        for stop in STOPS:
            per = {m: [tok_s(r) for r in single[(wl, stop, m)]] for m in (LLAMACPP, *modes)}
            lens = [statistics.mean(len(g.token_ids) for g in single[(wl, stop, m)][0])
                    for m in (LLAMACPP, "off")]
            rows.append([wl, stop, *(ratio_cell(per[m], per[LLAMACPP]) for m in modes),
                         *(fmt(statistics.median(per[m])) for m in (LLAMACPP, *modes)),
                         f"{lens[0]:.1f} / {lens[1]:.1f}"])
    return md_table(headers, rows)


def batch_table(single: Runs, batch: dict, chats: dict, batch_sizes: list[int]) -> list[str]:
    headers = ["workload", "batch", "off vs llama.cpp", "ngram vs llama.cpp",
               "llama.cpp 1-stream tok/s", "off tok/s", "ngram tok/s"]
    rows = []
    for wl in chats:
        ref = [tok_s(r) for r in single[(wl, "fixed N", LLAMACPP)]]
        for bsz in batch_sizes:
            off, ngram = ([r["tok_s"] for r in batch[(wl, bsz, m)]] for m in ("off", "ngram"))
            rows.append([wl, str(bsz), ratio_cell(off, ref), ratio_cell(ngram, ref),
                         fmt(statistics.median(ref)), fmt(statistics.median(off)),
                         fmt(statistics.median(ngram))])
    return md_table(headers, rows)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a .gguf file [default: the built-in model]")
    ap.add_argument("--draft-model", default=None, help="[default: the shipped draft]")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workloads", default="chat,rewrite,code")
    ap.add_argument("--prompts-per-workload", type=int, default=4)
    ap.add_argument("--batch-sizes", default="8,32")
    ap.add_argument("--modes", default="off,ngram,suffix,auto,draft",
                    help="our speculative methods, single stream (draft needs a draft model)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    args.batch_sizes = parse_list(args.batch_sizes, int, "--batch-sizes")
    args.workloads = parse_list(args.workloads, str, "--workloads")
    return args


def main() -> int:
    args = parse_args()
    try:
        import llama_cpp
    except ImportError as exc:
        raise BenchError("llama-cpp-python is missing: pip install -e .[llamacpp]") from exc
    texts = {wl: load_workload(wl)[: args.prompts_per_workload] for wl in args.workloads}
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=args.model, draft_model=args.draft_model,
                                    num_threads=args.threads, enable_prefix_caching=False))
    if not engine.model_path.endswith(".gguf"):
        raise BenchError(f"llama.cpp needs a .gguf model (got {engine.model_path})")
    llm = llama_cpp.Llama(model_path=engine.model_path, n_threads=args.threads,
                          n_threads_batch=args.threads, n_ctx=4096, verbose=False, seed=0)
    modes = [m for m in args.modes.split(",")
             if m != "draft" or engine.speculator.draft is not None]
    # The instruct model's chat template on every workload; the same ids go to both sides.
    chats = {wl: [engine.encode(engine.render_chat([{"role": "user", "content": t}]))
                  for t in ts] for wl, ts in texts.items()}
    backends = make_backends(engine, llm, modes)
    first = next(iter(chats.values()))[0]
    for backend in backends["fixed N"].values():  # warm-up: thread pools, first calls
        backend.generate(first, 8)

    single = single_stream(backends, chats, args.new_tokens, args.repeats)
    batch = batched(engine, chats, args)
    failures, notes = greedy_checks(
        single, batch, chats, modes, lambda ids: engine.tokenizer.decode(
            ids, skip_special_tokens=True))

    draft = f", draft `{Path(engine.config.draft_model).name}`" if "draft" in modes else ""
    section = results_section(
        HEADING,
        run_info(sys.argv[1:], program="python benchmarks/vs_llamacpp.py"),
        f"Model `{Path(engine.model_path).name}` (the same file both sides; ours quantization "
        f"{engine.quantization}){draft}, k_max {engine.config.num_speculative_tokens}, "
        f"{args.threads} threads each, llama-cpp-python {llama_cpp.__version__}. Greedy, the "
        f"same chat-templated prompt ids, at most {args.new_tokens} new tokens, "
        f"{args.prompts_per_workload} prompts per workload, {args.repeats} repeats, interleaved "
        "prompt by prompt. tok/s = generated tokens / wall seconds including prefill (no KV "
        "reuse across requests on either side); ratios vs llama.cpp are medians of per-repeat "
        "ratios (min..max). EOS: both stop at EOS; fixed N: both ignore it. The suffix cache "
        "is emptied before each request (suffix and auto draft from the request's own text "
        "only, never from an earlier answer to the same prompt). Batch rows: our "
        "aggregate tok/s over B concurrent fixed-N requests vs llama.cpp's single-stream fixed-N "
        "tok/s (llama-cpp-python serves one stream at a time).",
        ["Single stream:", "", *single_table(single, chats, modes), "",
         "Batched (ours) vs llama.cpp single stream:", "",
         *batch_table(single, batch, chats, args.batch_sizes), "", *notes],
    )
    print(section)
    for f in failures:
        print("FAILURE:", f, file=sys.stderr)
    if not args.no_write:
        write_section(RESULTS_MD, HEADING, section)
    return 1 if failures else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
