"""The block-quantized projections of a model under every instruction-set form of the C++
kernel this CPU runs (AVX2, AVX-VNNI, AVX-512 VNNI), by row count.

    python benchmarks/probes/kernel_forms.py [--model PATH] [--rows 1,2,4,8,16,32] [--repeats 7]
        [--num-threads N] [--no-write]

Every projection of the model (the lm head included) runs once per pass on an [rows, K] input,
in model order, as a forward runs them; each form at each rows-per-pass (1, 2, 4, 8), passes
interleaved, the median of ``--repeats`` kept, and the best rows-per-pass shown per form. All
forms give the same bits (tests/test_quant.py): only the time differs, which is why the kernel
tuner picks among them on each machine. One row reads every weight byte once, so its time
against the machine's memory bandwidth (torch's own sum over 256 MB, also printed) tells how
far a kernel can still move a plain decode step.

Where layers run a small-range code class (kernels/quant.py::code_class: Q5_0, Q5_1 and the
K-quants), the AVX2 form also runs with every layer taken as class 0 (signed codes, the form
before the classes), in the same interleaved rounds. Where layers hold five-bit codes too
(Q5_0's, kernels/quant.py::pack_five_bit), ``avx2p5`` is the AVX2 form on those (the other
layers in their int8 codes), a candidate the tuner times up to P5_MAX_ROWS rows.
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
from specserve.kernels import quant_ext  # noqa: E402
from specserve.kernels.quant import P5_FORM, BlockQuantLinear, code_class  # noqa: E402

SIGN = "avx2 class 0"  # the AVX2 form with every layer's codes taken as signed (class 0)


def load_projections(path: str) -> list[BlockQuantLinear]:
    from specserve.target.loader import build_model
    from specserve.target.quantize import quantize_model, resolve_quantization

    _, model = build_model(path, "float32", "cpu")
    quantize_model(model, resolve_quantization("auto", path, torch.device("cpu")), path)
    mods = [m for m in model.modules() if isinstance(m, BlockQuantLinear)]
    if not mods:
        raise BenchError(f"{path} has no block-quantized projections (see kernels/gguf_blocks.py)")
    return mods


def time_form(mods: list[BlockQuantLinear], xs: dict[int, torch.Tensor], code: int,
              repeats: int, sign_form: bool = False) -> list[float]:
    """Seconds per pass over ``mods`` with kernel ``code``; ``sign_form`` runs every layer as
    code class 0 (the signed-code instructions) instead of its own class: the same bits."""
    def call(m: BlockQuantLinear) -> None:
        if sign_form:
            m._ext.block_linear(xs[m.in_features], *m.planes, code)
        else:  # the five-bit form runs the layers that hold five-bit planes; the rest as int8
            m.run(xs[m.in_features], code if m.five_bit else code & ~P5_FORM)

    for m in mods:  # warm-up
        call(m)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for m in mods:
            call(m)
        samples.append(time.perf_counter() - t0)
    return samples


def bandwidth_gb_s(repeats: int) -> float:
    x = torch.ones(64 << 20)  # 256 MB of float32
    x.sum()
    t0 = time.perf_counter()
    for _ in range(repeats):
        x.sum()
    return x.numel() * 4 * repeats / (time.perf_counter() - t0) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF (default: the built-in model)")
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--num-threads", type=int, default=None)
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    try:
        rows_list = parse_list(args.rows, int, "--rows")
        if not quant_ext.available():
            raise BenchError("the C++ block kernels are not available on this machine")
        if args.num_threads:
            torch.set_num_threads(args.num_threads)
        from specserve.engine.models import default_model_path

        path = args.model or default_model_path()
        mods = load_projections(path)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    forms = quant_ext.supported_isas()
    if any(m.five_bit for m in mods):
        forms = (*forms, quant_ext.FIVE_BIT)
    weight_mb = sum(m.qs.numel() + 2 * (m.d.numel() + (m.m.numel() if m.m is not None else 0))
                    for m in mods) / 1e6
    # bytes a pass of the avx2p5 form reads fewer (its layers' five-bit codes, not int8)
    saved_mb = sum(m.qs.numel() - m.qs5.numel() for m in mods if m.five_bit) / 1e6
    headers = ["rows", *[f"{f} ms (rows per pass)" for f in forms]]
    if "avx2" in forms and len(forms) > 1:
        headers.append(f"avx2 / {forms[-1]}")
    # Layers of a small-range code class (kernels/quant.py::code_class) also run as class 0,
    # the form they ran before the classes: same bits, so only the time differs.
    classed = any(code_class(m.qs) for m in mods)
    if classed:
        headers += ["avx2 as code class 0 ms (rows per pass)", "class 0 / own classes"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    with torch.inference_mode():
        for rows in rows_list:
            xs = {k: torch.randn(rows, k) for k in {m.in_features for m in mods}}
            best: dict[str, tuple[float, int]] = {}
            samples: dict[tuple[str, int], list[float]] = {
                (f, r): [] for f in forms for r in quant_ext.ROWS_PER_PASS[f]}
            if classed:
                samples.update({(SIGN, r): [] for r in quant_ext.ROWS_PER_PASS["avx2"]})
            for _ in range(2):  # two interleaved rounds: drift hits every form alike
                for f, r in samples:
                    isa = "avx2" if f == SIGN else f
                    samples[(f, r)] += time_form(mods, xs, quant_ext.kernel_code(f"{isa}/{r}"),
                                                 args.repeats, sign_form=f == SIGN)
            for (f, r), s in samples.items():
                ms = statistics.median(s) * 1e3
                if f not in best or ms < best[f][0]:
                    best[f] = (ms, r)
            cells = [str(rows), *[f"{best[f][0]:.2f} ({best[f][1]})" for f in forms]]
            if "avx2" in forms and len(forms) > 1:
                cells.append(f"{best['avx2'][0] / best[forms[-1]][0]:.2f}x")
            if classed:
                cells += [f"{best[SIGN][0]:.2f} ({best[SIGN][1]})",
                          f"{best[SIGN][0] / best['avx2'][0]:.2f}x"]
            lines.append("| " + " | ".join(cells) + " |")
            print(lines[-1], flush=True)
    gb_s = bandwidth_gb_s(10)
    heading = "## Block kernel forms by row count" + (f", {Path(path).name}" if args.model else "")
    section = results_section(
        heading, run_info(sys.argv[1:], program="python benchmarks/probes/kernel_forms.py"),
        f"Model `{Path(path).name}`: {len(mods)} block-quantized projections, {weight_mb:.0f} MB "
        f"of codes and scales, all run once per pass on a [rows, K] input; median of "
        f"{args.repeats} x 2 interleaved passes; the best rows per pass of each form in "
        f"parentheses. Every form gives the same bits"
        + (" (the code-class columns too: each layer in its own small-range class, or every "
           "layer as class 0, the signed-code form)" if classed else "")
        + (f"; {quant_ext.FIVE_BIT} reads {saved_mb:.0f} MB fewer (five-bit codes)"
           if saved_mb else "")
        + ". Memory bandwidth (torch sum over 256 MB): "
        f"{gb_s:.1f} GB/s, so one pass over the weights costs at least "
        f"{weight_mb / gb_s:.2f} ms"
        + (f" ({(weight_mb - saved_mb) / gb_s:.2f} ms five-bit)" if saved_mb else "") + ".",
        lines)
    publish(heading, section, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())
