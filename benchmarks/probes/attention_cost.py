"""The C++ paged attention of a model's shape by context length and query rows per sequence.

    python benchmarks/probes/attention_cost.py [--model PATH] [--contexts 500,1000,2000]
        [--rows 1,8,17] [--repeats 7] [--num-threads N] [--form N] [--baseline-key KEY]
        [--kv-cache-dtypes float32,bfloat16] [--no-write]

One sequence, ``rows`` query rows at the last positions of a ``context``-token cache (a decode
step is 1 row, a k-draft verify k + 1), every layer's attention once per pass with its own
random cache (as cold as in a real forward), median of ``--repeats``. A verify's extra rows cost
what this shows on top of the projections' (``benchmarks/probes/kernel_forms.py``).

``--kv-cache-dtypes A,B``: the same caches stored in each dtype, each read by the form the
engine measures for it (bfloat16 may take the bfloat16-product form), passes alternating; the
table gives each dtype's time and its speedup over the first.

``--baseline-key KEY``: also time the extension an earlier checkout built (its
``specserve.kernels.quant_ext.build_key()``; the build is cached under
``$SPECSERVE_CACHE_DIR/ext/qgemm-KEY``), passes alternating with this checkout's, so a noisy
machine's drift hits both alike; the table then gives both times and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: this checkout's packages first

from benchmarks.report import (  # noqa: E402
    BenchError,
    parse_list,
    publish,
    results_section,
    run_info,
)
from specserve.core.config import DTYPES  # noqa: E402
from specserve.core.paths import cache_root  # noqa: E402
from specserve.kernels import quant_ext  # noqa: E402
from specserve.kernels.cpp_build import load_extension  # noqa: E402


def cached_extension(key: str):
    """The qgemm extension an earlier checkout built and cached (never builds)."""
    built = cache_root() / "ext" / f"qgemm-{key}" / f"specserve_qgemm_{key}.so"
    if not built.exists():
        raise BenchError(f"no cached build {built}: run the earlier checkout once to build it")
    return load_extension(f"specserve_qgemm_{key}", [], built.parent, [])


def _baseline_call(base, form: int):
    """An earlier build's paged_attention over this build's arguments: builds with attention
    forms take the form last (this run's form, so both sides run the same arithmetic); older
    ones, 8 arguments, chose theirs by the CPU."""
    signature = (base.paged_attention.__doc__ or "").split("\n", 1)[0]
    if signature.count("arg") <= 8:
        return base.paged_attention
    return lambda *a: base.paged_attention(*a, form)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _compare_dtypes(args, path: str, ext, shape: tuple[int, int, int, int, int],
                    dtypes: list[torch.dtype], contexts: list[int], rows_list: list[int]) -> int:
    """One table row per (context, rows): each dtype's time with its own measured form, passes
    alternating, and its speedup over the first dtype."""
    from specserve.kernels.attention_form import choose_form, query_rows, synthetic_caches

    H, KVH, D, L, bs = shape
    forms = {d: choose_form(H, KVH, D, cache_root() / "tune", cache_dtype=d) for d in dtypes}
    headers = ["context", "rows", *[f"{_name(d)} ms (form {forms[d]})" for d in dtypes],
               *[f"{_name(d)} speedup" for d in dtypes[1:]]]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    with torch.inference_mode():
        for ctx in contexts:
            caches, table = synthetic_caches(KVH, D, L, ctx, bs)
            stored = {d: [(k.to(d), v.to(d)) for k, v in caches] for d in dtypes}
            for rows in rows_list:
                q, seq_of, pos_of = query_rows(H, D, ctx, rows)
                samples: dict[torch.dtype, list[float]] = {d: [] for d in dtypes}
                for rep in range(args.repeats + 1):
                    for d in dtypes if rep % 2 else dtypes[::-1]:
                        t0 = time.perf_counter()
                        for k, v in stored[d]:
                            ext.paged_attention(q, k, v, table, seq_of, pos_of, D ** -0.5, 0,
                                                forms[d])
                        if rep:  # the first pass warms up
                            samples[d].append(time.perf_counter() - t0)
                ms = {d: statistics.median(samples[d]) * 1e3 for d in dtypes}
                cells = [str(ctx), str(rows), *[f"{ms[d]:.2f}" for d in dtypes],
                         *[f"{ms[dtypes[0]] / ms[d]:.2f}x" for d in dtypes[1:]]]
                lines.append("| " + " | ".join(cells) + " |")
                print(lines[-1], flush=True)
    heading = "## Paged attention cost by KV cache dtype"
    section = results_section(
        heading, run_info(sys.argv[1:], program="python benchmarks/probes/attention_cost.py"),
        f"Model `{Path(path).name}`: {L} layers, {H} query heads, {KVH} KV heads, head_dim {D}, "
        f"block size {bs}; the same random caches stored as {', '.join(map(_name, dtypes))}, "
        "each read by the attention form the engine measures for it; one sequence, its rows at "
        f"the last positions; all layers once per pass, median of {args.repeats}, passes "
        "alternating between the dtypes.",
        lines)
    publish(heading, section, write=not args.no_write)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF or HF folder (default: built-in)")
    ap.add_argument("--contexts", default="500,1000,2000")
    ap.add_argument("--rows", default="1,8,17")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--baseline-key", default=None, help="an earlier build's key (see above)")
    ap.add_argument("--form", type=int, default=None,
                    help="attention form, 64 * isa + tile (default: the engine's measured one)")
    ap.add_argument("--kv-cache-dtypes", default="float32",
                    help="cache element types to compare (float32, float16, bfloat16)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    try:
        contexts = parse_list(args.contexts, int, "--contexts")
        rows_list = parse_list(args.rows, int, "--rows")
        if any(r > c for r in rows_list for c in contexts):
            raise BenchError("every --rows value must be <= every --contexts value")
        if not quant_ext.available():
            raise BenchError("the C++ kernels are not available on this machine")
        base = cached_extension(args.baseline_key) if args.baseline_key else None
        dtypes = [DTYPES.get(d) for d in parse_list(args.kv_cache_dtypes, str,
                                                     "--kv-cache-dtypes")]
        if None in dtypes:
            raise BenchError(f"--kv-cache-dtypes takes {', '.join(DTYPES)} "
                             f"(got {args.kv_cache_dtypes!r})")
        if len(dtypes) > 1 and (base is not None or args.form is not None):
            raise BenchError("--kv-cache-dtypes with several dtypes uses each one's measured "
                             "form: drop --form and --baseline-key")
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    from specserve.engine.models import default_model_path
    from specserve.target.config import ModelConfig
    from specserve.target.loader import load_weights

    path = args.model or default_model_path()
    cfg = ModelConfig.from_hf(load_weights(path)[0])
    H, KVH, D, L, bs = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers, \
        args.block_size
    ext = quant_ext.load()
    from specserve.kernels.attention_form import (
        choose_form,
        query_rows,
        supported_forms,
        synthetic_caches,
    )

    if len(dtypes) > 1:
        return _compare_dtypes(args, path, ext, (H, KVH, D, L, bs), dtypes, contexts, rows_list)
    form = choose_form(H, KVH, D, cache_root() / "tune", cache_dtype=dtypes[0]) \
        if args.form is None else args.form
    if form not in supported_forms(D, dtypes[0]):
        print(f"error: --form {form} does not run here (supported: "
              f"{supported_forms(D, dtypes[0])})", file=sys.stderr)
        return 2

    def this(*a: object) -> None:
        ext.paged_attention(*a, form)

    runs = {"this": this}
    if base is not None:
        runs["baseline"] = _baseline_call(base, form)
    if base is None:
        headers = ["context", *[f"{r} rows ms" for r in rows_list]]
        if 1 in rows_list:
            headers.append(f"{rows_list[-1]} rows / 1 row")
    else:
        headers = ["context", *[f"{r} rows ms baseline -> this (speedup)" for r in rows_list]]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    with torch.inference_mode():
        for ctx in contexts:
            caches, table = synthetic_caches(KVH, D, L, ctx, bs, dtype=dtypes[0])
            ms: dict[str, dict[int, float]] = {name: {} for name in runs}
            for rows in rows_list:
                q, seq_of, pos_of = query_rows(H, D, ctx, rows)
                samples: dict[str, list[float]] = {name: [] for name in runs}
                for rep in range(args.repeats + 1):
                    order = list(runs.items())
                    for name, attend in order if rep % 2 else order[::-1]:
                        t0 = time.perf_counter()
                        for k, v in caches:
                            attend(q, k, v, table, seq_of, pos_of, D ** -0.5, 0)
                        if rep:  # the first pass warms up
                            samples[name].append(time.perf_counter() - t0)
                for name in runs:
                    ms[name][rows] = statistics.median(samples[name]) * 1e3
            this = ms["this"]
            if base is None:
                cells = [str(ctx), *[f"{this[r]:.2f}" for r in rows_list]]
                if 1 in rows_list:
                    cells.append(f"{this[rows_list[-1]] / this[1]:.2f}x")
            else:
                old = ms["baseline"]
                cells = [str(ctx), *[f"{old[r]:.2f} -> {this[r]:.2f} ({old[r] / this[r]:.2f}x)"
                                     for r in rows_list]]
            lines.append("| " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    heading = ("## Paged attention cost by context and rows" if base is None
               else "## Paged attention: this build against an earlier one")
    section = results_section(
        heading, run_info(sys.argv[1:], program="python benchmarks/probes/attention_cost.py"),
        f"Model `{Path(path).name}`: {L} layers, {H} query heads, {KVH} KV heads, head_dim {D}, "
        f"{_name(dtypes[0])} paged cache (block size {bs}), attention form {form}; one "
        f"sequence, its rows "
        f"at the last positions; "
        f"all layers once per pass, median of {args.repeats}"
        + ("." if base is None else f"; baseline: build {args.baseline_key}, passes alternating "
           "with this checkout's."),
        lines)
    publish(heading, section, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
