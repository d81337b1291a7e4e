"""One-call GPU check: attention backends against the torch reference, then decode speed.

    python benchmarks/gpu_check.py [--batch-sizes 1,8,64] [--new-tokens 64] [--k 4]
        [--block-size 16] [--backend auto] [--skip-decode] [--no-write]

1. Kernels: every attention backend that loads on this GPU (torch, sdpa, triton, flash_attn)
   against the torch reference run in float32 on the same bf16 inputs, on Llama-1B head shapes
   (H 32, KVH 8, D 64): long prefill, chunked prefill + decode + verify mixed, decode-only
   batch 64, verify-only (k+1 = 5) batch 8, sliding window. Relative error = max |out - ref| /
   max |ref|; bf16 passes below 2e-2. flash_attn runs with block size 256 (its paged-KV limit).
2. Step cost: one ModelRunner step of the random ~1B target, batch 1 with 512 cached tokens,
   1 token (decode) vs 5 tokens (verify k = 4), per backend; target ratio <= 1.3x.
3. Decode: tokens/s through LLMEngine, plain vs speculative with the target as its own draft
   (100% acceptance) and with a 2-layer truncated draft (~0.1B of layers), batch 1/8/64.
   Eager only: CUDA graphs are not implemented in the engine yet (the table says so).

Models are random-weight Llama-family ``target.model.CausalLM``s built directly on the GPU in
bf16 (target ~1.1B: hidden 2048, 16 layers, 32 heads, 8 KV heads; no checkpoint on disk): the
engine's ``build_model`` is swapped for a builder keyed by a tiny config-only folder.
Prints a short table last and writes it to benchmarks/RESULTS.md (``--no-write`` skips that).
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

import torch  # noqa: E402

TARGET = dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
              num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=4096,
              tie_word_embeddings=False)
DRAFT_LAYERS = 2
BF16_RTOL = 2e-2


# --- 1. kernels -------------------------------------------------------------------------------


def _case(query_lens, cached_lens, block_size, H=32, KVH=8, D=64, seed=0):
    from specserve.kernels.metadata import AttentionMetadata

    gen = torch.Generator(device="cuda").manual_seed(seed)
    ctx = [c + n for c, n in zip(cached_lens, query_lens)]
    needed = [-(-c // block_size) for c in ctx]
    num_blocks = sum(needed) + 2
    perm = torch.randperm(num_blocks, generator=gen, device="cuda").tolist()
    tables, at = [], 0
    for nb in needed:
        tables.append(perm[at:at + nb])
        at += nb
    meta = AttentionMetadata.build(query_lens, ctx, tables, block_size, "cuda")
    T = sum(query_lens)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)

    return dict(q=randn(T, H, D), k=randn(T, KVH, D), v=randn(T, KVH, D),
                k_cache=randn(num_blocks, block_size, KVH, D),
                v_cache=randn(num_blocks, block_size, KVH, D), meta=meta, D=D)


KERNEL_CASES = {
    "prefill 700": dict(query_lens=[700], cached_lens=[0]),
    "mixed": dict(query_lens=[300, 37, 1, 1, 5, 5], cached_lens=[0, 200, 900, 33, 400, 1]),
    "decode x64": dict(query_lens=[1] * 64, cached_lens=[(37 * i) % 1500 for i in range(64)]),
    "verify5 x8": dict(query_lens=[5] * 8, cached_lens=[(91 * i) % 1200 for i in range(8)]),
    "window 128": dict(query_lens=[200, 1, 5], cached_lens=[300, 600, 50], window=128),
}


def check_kernels(block_size: int) -> list[tuple[str, str, str]]:
    """(backend, case, result) rows; result is the relative error or why it was skipped."""
    from specserve.core.errors import ConfigError
    from specserve.kernels.registry import get_attention_backend
    from specserve.kernels.torch_ref import TorchPagedAttention

    rows = []
    reference = TorchPagedAttention()
    for name in ("torch", "sdpa", "triton", "flash_attn"):
        bs = 256 if name == "flash_attn" else block_size
        try:
            backend = get_attention_backend(name, "cuda", block_size=bs)
        except ConfigError as exc:
            rows.append((name, "-", f"skipped: {exc}"))
            continue
        for case_name, spec in KERNEL_CASES.items():
            spec = dict(spec)
            window = spec.pop("window", None)
            c = _case(block_size=bs, **spec)
            scale = 1 / math.sqrt(c["D"])
            kc, vc = c["k_cache"].float(), c["v_cache"].float()
            ref = reference.forward(c["q"].float(), c["k"].float(), c["v"].float(), kc, vc,
                                    c["meta"], scale, window)
            c["meta"].plan_cache.clear()
            try:
                out = backend.forward(c["q"], c["k"], c["v"], c["k_cache"], c["v_cache"],
                                      c["meta"], scale, window)
                torch.cuda.synchronize()
            except Exception as exc:  # report, keep checking the others
                rows.append((name, case_name, f"FAILED {type(exc).__name__}: {exc}"[:160]))
                continue
            rel = ((out.float() - ref).abs().max() / ref.abs().max()).item()
            written = torch.equal(c["k_cache"].float(), kc)  # new K/V written like the reference
            ok = rel < BF16_RTOL and written
            verdict = "ok" if ok else "FAIL" + ("" if written else " (cache differs)")
            rows.append((name, case_name, f"{rel:.1e} {verdict}"))
    return rows


# --- models -----------------------------------------------------------------------------------


class RandomModels:
    """Stands in for ``specserve.target.loader.build_model``: folder name -> a random CausalLM
    built on the GPU. "target" and "self_draft" are the same weights; "trunc_draft" is the target's
    embedding, first DRAFT_LAYERS layers, final norm and lm_head."""

    def __init__(self, root: Path) -> None:
        from transformers import LlamaConfig

        self.root = root
        self.built: dict = {}
        for name, layers in (("target", TARGET["num_hidden_layers"]), ("self_draft", None),
                             ("trunc_draft", DRAFT_LAYERS)):
            cfg = dict(TARGET, num_hidden_layers=layers or TARGET["num_hidden_layers"])
            LlamaConfig(**cfg, bos_token_id=1, eos_token_id=2).save_pretrained(root / name)

    def __call__(self, path, dtype, device, **_: object):  # shared_embeddings: all own theirs
        from transformers import LlamaConfig

        from specserve.target.config import ModelConfig
        from specserve.target.model import CausalLM

        name = Path(path).name
        if name == "self_draft":
            name = "target"
        if name not in self.built:
            hf = LlamaConfig.from_pretrained(self.root / name)
            mc = ModelConfig.from_hf(hf)
            torch.manual_seed(0)
            model = CausalLM(mc, dtype=torch.bfloat16, device=device).eval()
            if name == "trunc_draft":
                _, target = self("target", dtype, device)
                model.load_state_dict(target.state_dict(), strict=False)  # extra layers ignored
            self.built[name] = (mc, model)
        return self.built[name]


# --- 2. step cost -----------------------------------------------------------------------------


def step_cost(models: RandomModels, backend_name: str, block_size: int, iters: int = 30):
    """ms per target step, batch 1 with 512 cached tokens: (decode 1 token, verify 5 tokens)."""
    from specserve.kernels.metadata import AttentionMetadata
    from specserve.target.model_runner import ModelRunner

    mc, model = models("target", torch.bfloat16, "cuda")
    cached = 512
    n_blocks = -(-(cached + 8) // block_size)
    runner = ModelRunner(mc, model, num_blocks=n_blocks + 1, block_size=block_size,
                         dtype=torch.bfloat16, device="cuda", attn_backend=backend_name)
    table = [list(range(1, n_blocks + 1))]
    times = []
    for n in (1, 5):
        ids = torch.randint(3, 1000, (n,), device="cuda")
        pos = torch.arange(cached, cached + n, device="cuda")
        meta = AttentionMetadata.build([n], [cached + n], table, block_size, "cuda")
        for _ in range(3):
            runner.forward(ids, pos, meta)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(iters):
            meta.plan_cache.clear()  # a real step builds its plan once
            runner.forward(ids, pos, meta)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / iters)
    return times[0], times[1]


# --- 3. decode through the engine -------------------------------------------------------------


def decode_speed(models: RandomModels, args) -> list[tuple]:
    import specserve.engine.llm_engine as engine_mod
    from specserve.core.config import EngineConfig
    from specserve.core.sampling_params import SamplingParams, SpeculativeParams
    from specserve.engine.llm_engine import LLMEngine

    engine_mod.build_model = models  # random weights on the GPU instead of a checkpoint
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for draft in ("self_draft", "trunc_draft"):
        engine = LLMEngine(EngineConfig(
            model=str(models.root / "target"), draft_model=str(models.root / draft),
            dtype="bfloat16", device="cuda", block_size=args.block_size, num_kv_blocks=8192,
            max_num_seqs=max(args.batch_sizes), max_num_batched_tokens=4096,
            attention_backend=args.backend, num_speculative_tokens=args.k,
            adaptive_speculation=False,
        ))
        modes = (["off"] if draft == "self_draft" else []) + ["draft"]
        for batch in args.batch_sizes:
            prompts = [torch.randint(3, 32000, (64,), generator=gen).tolist()
                       for _ in range(batch)]
            for mode in modes:
                spec = SpeculativeParams(method=mode, num_tokens=0 if mode == "off" else args.k)
                # Warm-up at the same batch: Triton compiles per launch shape on first use.
                engine.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), spec)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                outs = engine.generate(prompts, params, spec)
                torch.cuda.synchronize()
                dt = time.perf_counter() - t0
                tokens = sum(o.num_output_tokens for o in outs)
                acc = sum(o.timings.num_accepted for o in outs)
                drafted = sum(o.timings.num_drafted for o in outs)
                label = "plain" if mode == "off" else f"spec k={args.k} {draft}"
                rate = f"{acc / drafted:.0%}" if drafted else "-"
                rows.append((label, batch, tokens / dt, rate, engine.attn_backend.name))
        del engine
        torch.cuda.empty_cache()
    return rows


# --- report -----------------------------------------------------------------------------------


def table(kernel_rows, cost_rows, decode_rows) -> str:
    out = ["### Attention backends vs torch reference (bf16, relative error)", "",
           "| backend | case | result |", "|---|---|---|"]
    out += [f"| {b} | {c} | {r} |" for b, c, r in kernel_rows]
    out += ["", "### Target step, batch 1, 512 cached tokens (eager)", "",
            "| backend | decode 1 tok ms | verify 5 tok ms | ratio (target <= 1.3x) |",
            "|---|---|---|---|"]
    out += [f"| {b} | {d:.2f} | {v:.2f} | {v / d:.2f}x |" if d else f"| {b} | {v} | - | - |"
            for b, d, v in cost_rows]
    if decode_rows:
        out += ["", "### Decode tokens/s (eager only: CUDA graphs not implemented yet)", "",
                "| mode | batch | tok/s | acceptance | backend |", "|---|---|---|---|---|"]
        out += [f"| {m} | {b} | {t:.1f} | {a} | {be} |" for m, b, t, a, be in decode_rows]
    return "\n".join(out) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-sizes", default="1,8,64")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--backend", default="auto", help="engine attention backend for part 3")
    ap.add_argument("--skip-decode", action="store_true", help="only parts 1 and 2")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch "
              f"(torch {torch.__version__}); run it on a GPU machine.", file=sys.stderr)
        return 2
    import logging

    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    gpu = torch.cuda.get_device_name()
    print(f"GPU: {gpu}, torch {torch.__version__}", flush=True)
    kernel_rows = check_kernels(args.block_size)
    print(table(kernel_rows, [], []), flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        models = RandomModels(Path(tmp))
        cost_rows = []
        for name in ("torch", "sdpa", "triton", "flash_attn"):
            bs = 256 if name == "flash_attn" else args.block_size
            try:
                cost_rows.append((name, *step_cost(models, name, bs)))
            except Exception as exc:
                cost_rows.append((name, 0.0, f"skipped: {type(exc).__name__}: {exc}"[:120]))
        decode_rows = [] if args.skip_decode else decode_speed(models, args)
    report = table(kernel_rows, cost_rows, decode_rows)
    failed = any("FAIL" in r for _, _, r in kernel_rows)
    if not args.no_write:
        from benchmarks.report import write_section

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, cwd=ROOT).stdout.strip()
        heading = "## GPU check"
        section = (f"{heading}\n\nGPU {gpu}, torch {torch.__version__}, commit {commit}; random-"
                   f"weight Llama ~1.1B target, {args.new_tokens} new tokens, greedy.\n\n"
                   f"Command: `python benchmarks/gpu_check.py`\n\n{report}")
        write_section(ROOT / "RESULTS.md", heading, section)
    print(report)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
