"""How close the CPU kernels run to this machine's limits: the projections (int8 dot products)
and the paged attention (float32 FMAs over a float32 cache; bfloat16 products over a bfloat16
cache where the CPU has them) of a verify step, against the fastest the CPU could issue their
instructions and the fastest memory could feed them.

    python benchmarks/probes/cpu_roofline.py [--model PATH] [--rows 1,5,9,17]
        [--contexts 500,1000] [--repeats 7] [--num-threads N] [--no-write]

Peaks are measured, not looked up: a small C++ loop (benchmarks/probes/csrc/peak_ops.cpp) issues
each instruction on 16 independent chains per thread on every torch thread at once, so the rate it
reaches is what this CPU (and this VM's share of it) sustains: some CPUs split a 512-bit
instruction in two, and a datasheet would not say what a KVM guest gets. A kernel's bound is
its count of those instructions (the projections' ``vpdpbusd``, 64 int8 products each at 512
bits; the attention's FMAs, 16 lanes at 512 bits, for the scores and for the weighted values,
or its ``vdpbf16ps``, 32 bfloat16 products each)
over that rate, and its bytes over the memory bandwidth (torch's sum over 256 MB). Measured /
bound near 1 means no rewrite of that kernel's loop can make it much faster here: only fewer
or cheaper instructions (narrower types, other instructions) or another machine can.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: this checkout's packages first

from benchmarks.probes.kernel_forms import bandwidth_gb_s, load_projections, time_form  # noqa: E402
from benchmarks.report import (  # noqa: E402
    BenchError,
    parse_list,
    publish,
    results_section,
    run_info,
)
from specserve.core.paths import cache_root  # noqa: E402
from specserve.kernels import quant_ext  # noqa: E402
from specserve.kernels.cpp_build import load_extension  # noqa: E402

KINDS = ("fma256", "fma512", "dpbusd256", "dpbusd512", "dpbf16_512")
PEAK_SOURCE = Path(__file__).resolve().parent / "csrc" / "peak_ops.cpp"


def peak_extension():
    flags = ["-O2", "-fopenmp"]  # at::parallel_for is OpenMP pragmas: serial without it
    key = hashlib.sha256(PEAK_SOURCE.read_bytes() + torch.__version__.encode()
                         + " ".join(flags).encode()).hexdigest()[:16]
    return load_extension(f"specserve_peak_{key}", [PEAK_SOURCE],
                          cache_root() / "ext" / f"peak-{key}", flags, ["-fopenmp"])


def peak_rates(ext) -> dict[str, float]:
    """Instructions per second over all torch threads, per supported kind (best of 3 runs of
    ~0.2 s each)."""
    rates = {}
    for kind in KINDS:
        if not ext.supported(kind):
            continue
        iters = 1 << 16
        while True:  # size a run to ~0.2 s
            t0 = time.perf_counter()
            ext.run(kind, iters)
            if time.perf_counter() - t0 > 0.05:
                break
            iters *= 4
        best = 0.0
        for _ in range(3):
            t0 = time.perf_counter()
            ext.run(kind, iters * 4)
            dt = time.perf_counter() - t0
            best = max(best, torch.get_num_threads() * iters * 4 * ext.chains / dt)
        rates[kind] = best
    return rates


def time_attention(ext, form: int, shape: tuple[int, int, int, int], ctx: int, rows: int,
                   repeats: int, block_size: int = 16,
                   cache_dtype: torch.dtype = torch.float32) -> float:
    """Median seconds of all layers' paged attention for ``rows`` rows at the end of a
    ``ctx``-token cache (each layer its own cache, as cold as in a forward)."""
    from specserve.kernels.attention_form import query_rows, synthetic_caches

    H, KVH, D, L = shape
    caches, table = synthetic_caches(KVH, D, L, ctx, block_size, dtype=cache_dtype)
    q, seq_of, pos_of = query_rows(H, D, ctx, rows)
    samples = []
    for rep in range(repeats + 1):
        t0 = time.perf_counter()
        for k, v in caches:
            ext.paged_attention(q, k, v, table, seq_of, pos_of, D ** -0.5, 0, form)
        if rep:
            samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: the built-in model)")
    ap.add_argument("--rows", default="1,5,9,17")
    ap.add_argument("--contexts", default="500,1000")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    try:
        rows_list = parse_list(args.rows, int, "--rows")
        contexts = parse_list(args.contexts, int, "--contexts")
        if any(r > c for r in rows_list for c in contexts):
            raise BenchError("every --rows value must be <= every --contexts value")
        if not quant_ext.available():
            raise BenchError("the C++ kernels are not available on this machine")
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        from specserve.engine.models import default_model_path

        path = args.model or default_model_path()
        mods = load_projections(path)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from specserve.kernels.attention_form import BF16_DOT, choose_form, has_bf16_products
    from specserve.target.config import ModelConfig
    from specserve.target.loader import load_weights

    rates = peak_rates(peak_extension())
    gb_s = bandwidth_gb_s(10)
    cfg = ModelConfig.from_hf(load_weights(path)[0])
    shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers)
    H, KVH, D, L = shape
    ext = quant_ext.load()
    form = choose_form(H, KVH, D, cache_root() / "tune", cache_dtype=torch.float32)
    # the bfloat16 cache's form, when it has bfloat16 products here (the engine's default then)
    bf16_form = None
    if has_bf16_products(D):
        bf16_form = choose_form(H, KVH, D, cache_root() / "tune", cache_dtype=torch.bfloat16)
        if bf16_form % 1024 // 64 != BF16_DOT:
            bf16_form = None  # the tuner preferred a widening form: nothing new to bound
    isa = quant_ext.supported_isas()[-1]  # the widest form: the one the tuner picks at 8+ rows
    # products per dot instruction of that form (the AVX2 form has no single one: no bound)
    dot = {"avx512vnni": ("dpbusd512", 64), "avxvnni": ("dpbusd256", 32)}.get(isa)
    macs = sum(m.in_features * m.out_features for m in mods)  # per row
    weight_bytes = sum(m.qs.numel() + 2 * (m.d.numel() + (m.m.numel() if m.m is not None else 0))
                       for m in mods)
    fma, lanes = ("fma512", 16) if form % 1024 // 64 == 1 else ("fma256", 8)

    lines = ["| part | rows | context | measured ms | instruction bound ms | memory bound ms | "
             "measured / bound |", "|---|---|---|---|---|---|---|"]

    def row(part: str, rows: int, ctx: str, ms: float, instr_ms: float | None, mem_ms: float
            ) -> None:
        bound = max(instr_ms or 0.0, mem_ms)
        lines.append(f"| {part} | {rows} | {ctx} | {ms:.2f} | "
                     f"{'-' if instr_ms is None else f'{instr_ms:.2f}'} | {mem_ms:.2f} | "
                     f"{ms / bound:.2f}x |")
        print(lines[-1], flush=True)

    with torch.inference_mode():
        for rows in rows_list:
            xs = {k: torch.randn(rows, k) for k in {m.in_features for m in mods}}
            ms = min(statistics.median(time_form(mods, xs, quant_ext.kernel_code(f"{isa}/{r}"),
                                                 args.repeats))
                     for r in quant_ext.ROWS_PER_PASS[isa]) * 1e3
            instr = rows * macs / dot[1] / rates[dot[0]] * 1e3 if dot else None
            row(f"projections ({isa})", rows, "-", ms, instr, weight_bytes / gb_s / 1e6)
        for ctx in contexts:
            kv_bytes = 2 * ctx * KVH * D * 4 * L
            for rows in rows_list:
                ms = time_attention(ext, form, shape, ctx, rows, args.repeats) * 1e3
                keys = sum(ctx - rows + r + 1 for r in range(rows))  # causal: row r's keys
                fmas = 2 * keys * H * (D // lanes) * L  # scores and weighted values
                row(f"attention (form {form})", rows, str(ctx), ms, fmas / rates[fma] * 1e3,
                    kv_bytes / gb_s / 1e6)
                if bf16_form is not None:
                    ms = time_attention(ext, bf16_form, shape, ctx, rows, args.repeats,
                                        cache_dtype=torch.bfloat16) * 1e3
                    dots = 2 * keys * H * (D // 32) * L  # 32 bfloat16 products each
                    row(f"attention, bfloat16 cache (form {bf16_form})", rows, str(ctx), ms,
                        dots / rates["dpbf16_512"] * 1e3, kv_bytes / 2 / gb_s / 1e6)
    peaks = ", ".join(f"{k} {v / 1e9:.2f} G/s" for k, v in rates.items())
    heading = ("## CPU roofline: kernels against this machine's instruction and memory limits"
               + (f", {Path(path).name}" if args.model else ""))
    section = results_section(
        heading, run_info(sys.argv[1:], program="python benchmarks/probes/cpu_roofline.py"),
        f"Model `{Path(path).name}`. Peak issue rates over {torch.get_num_threads()} threads "
        f"(16 independent chains each): {peaks}. Memory bandwidth (torch sum over 256 MB): "
        f"{gb_s:.1f} GB/s. Projections: all {len(mods)} block-quantized projections once, "
        f"{macs / 1e6:.0f}M int8 products per row, {weight_bytes / 1e6:.0f} MB of weights; "
        f"bound = products / {dot[1] if dot else '-'} per {dot[0] if dot else '-'} at its peak. "
        f"Attention: all {L} layers, float32 KV; bound = FMAs ({lanes} lanes, scores and "
        f"weighted values) at the {fma} peak"
        + ("; bfloat16 KV (the default cache here): bound = vdpbf16ps (32 products) at the "
           "dpbf16_512 peak" if bf16_form is not None else "")
        + f". Medians of {args.repeats}.",
        lines)
    publish(heading, section, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
