"""What one drafting step costs next to one target decode step, for the draft model and for an
EAGLE head, at batch 1 and batch 8 (same process, same run).

    python benchmarks/probes/draft_step_cost.py --eagle DIR [--draft DIR] [--batches 1,8] [--k 4]
        [--num-threads 1] [--profile]

For each batch size B, B sequences of ~64 tokens of context (distinct block tables):
- target: one decode step (B rows, 1 token each), ``ModelRunner.forward`` plus scoring, median;
- target+features: the same step asked for the EAGLE head's features (``FeatureCapture``);
- draft / eagle: one ``propose`` of k tokens per sequence in steady state (the proposer's KV
  two tokens behind, as after a verify that accepted one draft; the head also gets its target
  features), divided by k: the cost of one drafting step with all its host work.
Prints one JSON line with the seconds and the ratios (draft step / target step).
``--profile`` prints cProfile's top entries of the EAGLE propose at each batch size.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: this checkout's packages first

from specserve.core.config import EngineConfig  # noqa: E402
from specserve.distill.evaluate import median_seconds  # noqa: E402
from specserve.draft.base import ProposalRequest  # noqa: E402
from specserve.engine.llm_engine import LLMEngine  # noqa: E402
from specserve.kernels.metadata import AttentionMetadata, token_positions  # noqa: E402
from specserve.target.model import FeatureCapture  # noqa: E402

CONTEXT = 64


def tables(engine: LLMEngine, batch: int) -> list[list[int]]:
    per = (CONTEXT + 16) // engine.config.block_size + 2
    return [list(range(b * per, (b + 1) * per)) for b in range(batch)]


def target_step(engine: LLMEngine, batch: int, capture_layers: tuple[int, ...] | None,
                repeats: int) -> float:
    bs, dev = engine.config.block_size, engine.device
    meta = AttentionMetadata.build([1] * batch, [CONTEXT] * batch, tables(engine, batch), bs, dev)
    pos = token_positions([1] * batch, [CONTEXT] * batch)
    ids = torch.full((batch,), 42)
    rows = torch.arange(batch)

    def run() -> None:
        capture = None if capture_layers is None else FeatureCapture(capture_layers, rows)
        engine.runner.forward(ids, pos, meta, rows, capture=capture)

    return median_seconds(run, repeats)


def requests(engine: LLMEngine, batch: int, k: int) -> list[ProposalRequest]:
    return [ProposalRequest(seq_id=b, token_ids=[42 + b] * CONTEXT, num_tokens=k,
                            block_table=t, kv_computed=CONTEXT - 2)
            for b, t in enumerate(tables(engine, batch))]


def eagle_propose(engine: LLMEngine, batch: int, k: int):
    proposer = engine.speculator.proposers["eagle"]
    width = len(proposer.target_layers) * engine.model_config.hidden_size
    reqs = requests(engine, batch, k)
    feats = torch.randn(2 * batch, width)
    # the last verify's two accepted rows of each sequence, as the speculator hands them over
    spans = [(r.seq_id, CONTEXT - 3, 2) for r in reqs]

    def run() -> None:
        proposer.add_feature_spans(spans, feats)
        proposer.propose(reqs)

    return run


def draft_propose(engine: LLMEngine, batch: int, k: int):
    proposer = engine.speculator.proposers["draft"]
    reqs = requests(engine, batch, k)
    return lambda: proposer.propose(reqs)


def engine_for(draft: str, threads: int, batch: int) -> LLMEngine:
    return LLMEngine(EngineConfig(draft_model=draft, num_threads=threads, max_num_seqs=batch,
                                  max_model_len=1024, kv_cache_memory=256 << 20))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eagle", required=True, help="EAGLE head folder")
    ap.add_argument("--draft", default="specserve/drafts/smollm2-135m-instruct")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    eagle = engine_for(args.eagle, args.num_threads, max(batches))
    draft = engine_for(args.draft, args.num_threads, max(batches))
    layers = eagle.speculator.proposers["eagle"].target_layers
    out: dict[str, object] = {"k": args.k, "threads": args.num_threads}
    for b in batches:
        target = target_step(eagle, b, None, args.repeats)
        with_feats = target_step(eagle, b, layers, args.repeats)
        e = median_seconds(eagle_propose(eagle, b, args.k), args.repeats) / args.k
        d = median_seconds(draft_propose(draft, b, args.k), args.repeats) / args.k
        out[f"batch{b}"] = {
            "target_step_s": round(target, 6), "target_with_features_s": round(with_feats, 6),
            "eagle_step_s": round(e, 6), "draft_step_s": round(d, 6),
            "eagle_vs_target": round(e / target, 4), "draft_vs_target": round(d / target, 4),
            "features_overhead": round(with_feats / target - 1, 4),
        }
        if args.profile:
            run = eagle_propose(eagle, b, args.k)
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.repeats):
                run()
            prof.disable()
            print(f"--- eagle propose, batch {b}, k {args.k}, {args.repeats} calls")
            pstats.Stats(prof).sort_stats("tottime").print_stats(18)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
