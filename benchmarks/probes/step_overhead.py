"""Per-step overhead at batch 1: a decode step's time minus the time of its projections alone.

    python benchmarks/probes/step_overhead.py [--model PATH] [--quantization auto] [--steps 64]

The step time is the median engine.step() of one greedy decode (a chat prompt, ~100 tokens of
context). The projection time runs every projection of the model (lm_head included) once on a
1-row input, in layer order, the way a step runs them, median of 15. What is left is everything
else: norms, rotary, attention, residual adds, sampling, the engine's own bookkeeping. Prints one
JSON line; RESULTS.md quotes it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: this checkout's packages first

from benchmarks.report import check_plain, load_workload  # noqa: E402
from specserve.core.config import EngineConfig  # noqa: E402
from specserve.core.sampling_params import SamplingParams, SpeculativeParams  # noqa: E402
from specserve.engine.llm_engine import LLMEngine  # noqa: E402


def step_seconds(engine: LLMEngine, steps: int) -> float:
    text = load_workload("chat")[0]
    ids = engine.encode(engine.render_chat([{"role": "user", "content": text}]))
    # Plain decode steps: the default (auto) would make some of them multi-row verifies.
    engine.add_request("overhead", ids, SamplingParams(max_tokens=steps + 1, temperature=0.0,
                                                       ignore_eos=True),
                       SpeculativeParams(method="off"))
    times = []
    engine.step()  # prefill
    while engine.has_unfinished():
        t0 = time.perf_counter()
        (out,) = engine.step()
        times.append(time.perf_counter() - t0)
    check_plain(out.timings.num_drafted, "step_overhead")
    return statistics.median(times)


@torch.inference_mode()
def projection_seconds(model: torch.nn.Module) -> float:
    modules = [m for name, m in model.named_modules()
               if name.startswith("layers.") and hasattr(m, "in_features")]
    head = getattr(model, "lm_head", None)
    calls = [(m, torch.randn(1, m.in_features)) for m in modules]
    if head is not None:
        calls.append((head, torch.randn(1, head.in_features)))
    else:  # tied dense head: the embedding table
        w = model.embed_tokens.weight
        calls.append((lambda x, w=w: torch.nn.functional.linear(x, w), torch.randn(1, w.shape[1])))
    # the code before the tuner computed dense projections through specserve.kernels.linear.linear
    try:
        from specserve.kernels.linear import linear as old_linear
    except ImportError:
        old_linear = None
    runs = []
    for _ in range(15):
        t0 = time.perf_counter()
        for m, x in calls:
            if old_linear is not None and isinstance(m, torch.nn.Linear):
                old_linear(x, m.weight, m.bias)
            else:
                m(x)
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs[3:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--steps", type=int, default=64)
    args = ap.parse_args()
    fields = {"model": args.model, "draft_model": "none", "dtype": "float32"}
    if "quantization" in EngineConfig.__struct_fields__:
        fields["quantization"] = args.quantization
    engine = LLMEngine(EngineConfig(**fields))
    step = step_seconds(engine, args.steps)
    proj = projection_seconds(engine.runner.model)
    print(json.dumps({
        "quantization": getattr(engine, "quantization", "none (before --quantization)"),
        "step_ms": round(step * 1e3, 2), "projections_ms": round(proj * 1e3, 2),
        "overhead_ms": round((step - proj) * 1e3, 2), "threads": torch.get_num_threads(),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
