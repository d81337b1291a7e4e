"""Plain (non-speculative) decode speed: this engine vs transformers `generate()`, same process,
same weights, prompts and dtype. Writes a section of benchmarks/RESULTS.md.

    python benchmarks/plain_decode.py [--model PATH] [--dtype float32] [--new-tokens 128]
        [--batch-sizes 1,8,32] [--repeats 3] [--draft-model none] [--no-write]

Plain means plain: every request of ours runs with ``speculative: off`` (the engine's default is
``auto``, which with EOS ignored drafts the model's repetitive continuations), and every output's
timings must say ``num_drafted == 0`` or the run stops. No draft model is loaded unless
``--draft-model`` names one (a loaded draft slows plain decoding; see RESULTS.md).

Batch 1 is timed for both; for B > 1 this engine runs B concurrent sequences (continuous
batching) and transformers runs one left-padded batch of B. Every configuration generates exactly
`--new-tokens` tokens per sequence (EOS ignored), so tokens/s compare like for like. Greedy batch-1
outputs are checked identical between the two (a mismatch is reported, not hidden).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from benchmarks.report import check_plain, publish, results_section, run_info  # noqa: E402
from specserve.core.config import EngineConfig  # noqa: E402
from specserve.core.sampling_params import SamplingParams, SpeculativeParams  # noqa: E402
from specserve.engine.llm_engine import LLMEngine  # noqa: E402


def hf_reference_model(engine: LLMEngine):
    """transformers' own model class on the very weights our engine loaded."""
    from transformers import AutoModelForCausalLM

    from specserve.target.loader import load_weights

    hf_config, state_dict = load_weights(engine.model_path)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=engine.dtype)
    model.load_state_dict(state_dict, strict=False)
    model.tie_weights()
    model.generation_config.eos_token_id = None  # generate exactly --new-tokens
    model.generation_config.pad_token_id = 0
    return model.eval()


def time_ours(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = engine.generate(prompts, params, SpeculativeParams(method="off"))
    dt = time.perf_counter() - t0
    for o in outs:
        check_plain(o.timings.num_drafted, "plain_decode")
        assert o.num_output_tokens == new_tokens
    return dt, [o.token_ids for o in outs]


@torch.inference_mode()
def time_hf(model, prompts: list[list[int]], new_tokens: int) -> tuple[float, list]:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    out = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
        min_new_tokens=new_tokens, do_sample=False,
    )
    dt = time.perf_counter() - t0
    return dt, out[:, width:].tolist()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", default="auto",
                    help="auto (the GGUF's own 4-bit blocks) | none (the float32 reference path, "
                         "whose greedy tokens must equal transformers') | int4 | int8")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--hf-max-batch", type=int, default=8, help="largest batch run through HF")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft-model", default="none",
                    help="none (default) | a path | default (the shipped draft): loaded, unused")
    ap.add_argument("--threads", type=int, default=None, help="torch threads [default: torch's]")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()

    draft = None if args.draft_model == "default" else args.draft_model
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, draft_model=draft,
                                    quantization=args.quantization, num_threads=args.threads))
    hf = hf_reference_model(engine)
    texts = json.loads((ROOT / "prompts" / "chat.json").read_text())
    chats = [engine.encode(engine.render_chat([{"role": "user", "content": t}])) for t in texts]
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]

    rows = []
    # Warm-up (not measured): first calls pay allocator / thread-pool start-up.
    time_ours(engine, chats[:1], 8)
    time_hf(hf, chats[:1], 8)
    for bsz in batch_sizes:
        prompts = [chats[i % len(chats)] for i in range(bsz)]
        ours, theirs = [], []
        match = None
        for _ in range(args.repeats):
            dt, ours_tokens = time_ours(engine, prompts, args.new_tokens)
            ours.append(bsz * args.new_tokens / dt)
            if bsz <= args.hf_max_batch:
                dt, hf_tokens = time_hf(hf, prompts, args.new_tokens)
                theirs.append(bsz * args.new_tokens / dt)
                if bsz == 1:
                    match = ours_tokens == hf_tokens
        row = {
            "batch": bsz,
            "ours_tok_s": statistics.median(ours),
            "hf_tok_s": statistics.median(theirs) if theirs else None,
            "greedy_identical": match,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)

    base = rows[0]["ours_tok_s"]
    lines = [
        "| batch | specserve tok/s | transformers tok/s | ratio vs transformers | "
        "ratio vs our batch 1 |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        hf_s = f"{r['hf_tok_s']:.1f}" if r["hf_tok_s"] else "not run"
        ratio = f"{r['ours_tok_s'] / r['hf_tok_s']:.2f}x" if r["hf_tok_s"] else "-"
        lines.append(
            f"| {r['batch']} | {r['ours_tok_s']:.1f} | {hf_s} | {ratio} | "
            f"{r['ours_tok_s'] / base:.2f}x |"
        )
    heading = f"## Plain decode, quantization {engine.quantization}"
    section = results_section(
        f"{heading}: specserve vs transformers float32",
        run_info(sys.argv[1:], program="python benchmarks/plain_decode.py"),
        f"Model `{engine.model_path.split('/')[-1]}`, dtype {args.dtype}, quantization "
        f"{engine.quantization} (transformers: float32 on the weights dequantized from the same "
        f"file), "
        f"{args.new_tokens} new tokens per sequence (EOS ignored), speculation off (every "
        f"output's num_drafted 0), draft model {engine.config.draft_model or 'none'}, chat "
        f"prompts from benchmarks/prompts/chat.json, median of {args.repeats} runs. "
        f"Greedy batch-1 tokens identical to transformers: {rows[0]['greedy_identical']}"
        f"{'' if engine.quantization == 'none' else ' (not expected: int8 activations)'}.",
        lines,
    )
    publish(heading, section, write=not args.no_write)
    reference = engine.quantization == "none"
    return 0 if not reference or rows[0]["greedy_identical"] is not False else 1


if __name__ == "__main__":
    sys.exit(main())
