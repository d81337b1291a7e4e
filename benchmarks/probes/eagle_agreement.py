"""Why does an EAGLE head accept less through the engine than its trainer's held-out score says?
Teacher-forced agreement of the head on the same prompts, with the target's features and
greedy tokens from the float32 reference target or from the engine's quantized one, next to
the engine's own first-position acceptance.

    python benchmarks/probes/eagle_agreement.py --eagle DIR [--prompts 16] [--tokens 64]
        [--category chat] [--num-threads 1]

- texts: each prompt's greedy continuation by the quantized target (the engine's default, Q4_1
  blocks, int8 activations) and by the float32 reference (the same GGUF dequantized);
- teacher-forced agreement per TTT step 1..3 (the trainer's definition: the head's argmax at
  position p, chained j steps on its own outputs, equals the text's token p + 1, over response
  positions), with features from either target, on either text;
- engine: first-position acceptance at k = 1 (greedy) through the quantized engine, once on a
  cold prefix cache and once after a plain run of the same prompts filled it (the head then has
  no target features for the cached prompt blocks).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script: this checkout's packages first

from specserve.core.config import EngineConfig  # noqa: E402
from specserve.core.sampling_params import SamplingParams, SpeculativeParams  # noqa: E402
from specserve.distill.data import PROMPTS_FILE, load_prompts  # noqa: E402
from specserve.distill.eagle_ttt import ttt_forward  # noqa: E402
from specserve.distill.evaluate import _per_position  # noqa: E402
from specserve.draft.eagle3_head import Eagle3Head  # noqa: E402
from specserve.draft.eagle3_source import load_eagle3  # noqa: E402
from specserve.engine.llm_engine import LLMEngine  # noqa: E402
from specserve.kernels.metadata import AttentionMetadata  # noqa: E402
from specserve.target.model import FeatureCapture  # noqa: E402

STEPS = 3


def engine(eagle: str, quantization: str, threads: int, caching: bool = True) -> LLMEngine:
    return LLMEngine(EngineConfig(draft_model=eagle, quantization=quantization, dtype="float32",
                                  num_threads=threads, adaptive_speculation=False,
                                  max_model_len=1024, kv_cache_memory=1 << 30,
                                  enable_prefix_caching=caching))


def features(eng: LLMEngine, ids: list[int], layers: tuple[int, ...]) -> torch.Tensor:
    """The target's hidden states at ``layers`` for every position of ``ids`` (one prefill on
    blocks 0.., so call it after the engine's generate runs: it overwrites their KV)."""
    bs, n = eng.config.block_size, len(ids)
    meta = AttentionMetadata.build([n], [n], [list(range((n + bs - 1) // bs))], bs, eng.device)
    capture = FeatureCapture(layers, torch.arange(n))
    eng.runner.forward(torch.tensor(ids), torch.arange(n), meta, torch.tensor([n - 1]),
                       capture=capture)
    assert capture.out is not None
    return capture.out


@torch.no_grad()
def agreement(head: Eagle3Head, seqs: list[tuple[list[int], int]], feats: list[torch.Tensor],
              span: tuple[int, int] = (0, 1 << 30)) -> list[float]:
    """Per TTT step j: head argmax at p (chain started at p - j inside the response) == token
    p + 1, over all sequences; only chains starting ``span`` tokens into the response."""
    hits, total = [0] * STEPS, [0] * STEPS
    for (ids, plen), f in zip(seqs, feats):
        x = torch.tensor(ids)[None]
        outs = ttt_forward(head, x, f[None].float(), STEPS)
        for j, out in enumerate(outs):
            pred = head.head_token_ids[head.logits(out[0]).argmax(-1)]  # [L]
            p = torch.arange(len(ids))
            start = p - j - (plen - 1)  # the chain's start, in tokens into the response
            rows = (start >= span[0]) & (start < span[1]) & (p + 1 < len(ids))
            nxt = torch.tensor(ids[1:] + [-1])
            hits[j] += int((pred[rows] == nxt[rows]).sum())
            total[j] += int(rows.sum())
    return [round(h / max(t, 1), 4) for h, t in zip(hits, total)]


def acceptance(eng: LLMEngine, chats: list[list[int]], tokens: int, warm_plain: bool) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0)
    if warm_plain:
        eng.generate(chats, params, SpeculativeParams(method="off"))
    outs = eng.generate(chats, params, SpeculativeParams(method="eagle", num_tokens=1))
    return round(_per_position(outs, 1)[0], 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eagle", required=True)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--category", default="chat")
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--quantized-only", action="store_true",
                    help="only the quantized target's text and features, no engine runs "
                         "(with agreement by depth into the response)")
    args = ap.parse_args()
    torch.set_num_threads(args.num_threads)
    quant = engine(args.eagle, "auto", args.num_threads)
    ref = engine(args.eagle, "none", args.num_threads)
    prompts = [p for p in load_prompts(PROMPTS_FILE, "heldout")
               if args.category in (None, "", p.category)][: args.prompts]
    chats = [quant.encode(quant.render_chat([{"role": "user", "content": p.prompt}]))
             for p in prompts]
    greedy = SamplingParams(max_tokens=args.tokens, temperature=0.0)
    off = SpeculativeParams(method="off")
    texts = {"quantized": [(c + o.token_ids, len(c)) for c, o in
                           zip(chats, quant.generate(chats, greedy, off))]}
    if args.quantized_only:
        head = load_eagle3(args.eagle, ref.model_config, ref.runner.model.embed_tokens.weight,
                           torch.float32, "cpu")
        seqs = texts["quantized"]
        feats = [features(quant, ids, head.meta.target_layers) for ids, _ in seqs]
        by_depth = {f"{a}-{b - 1}": agreement(head, seqs, feats, (a, b))
                    for a, b in ((0, 16), (16, 64), (64, 128), (128, 256), (256, 1 << 30))}
        print(json.dumps({"prompts": len(chats), "tokens": args.tokens,
                          "category": args.category or "all",
                          "all": agreement(head, seqs, feats), "by_depth": by_depth}))
        return
    texts["float32"] = [(c + o.token_ids, len(c)) for c, o in
                        zip(chats, ref.generate(chats, greedy, off))]
    same = sum(a == b for a, b in zip(texts["quantized"], texts["float32"]))
    out: dict[str, object] = {"prompts": len(chats), "tokens": args.tokens,
                              "identical_texts": same}
    out["engine_first_position_cold_cache"] = acceptance(
        engine(args.eagle, "auto", args.num_threads, caching=False), chats, args.tokens, False)
    out["engine_first_position_after_plain_run"] = acceptance(quant, chats, args.tokens, True)
    head = load_eagle3(args.eagle, ref.model_config, ref.runner.model.embed_tokens.weight,
                       torch.float32, "cpu")
    layers = head.meta.target_layers
    for text_name, seqs in texts.items():
        for feat_name, eng in (("quantized", quant), ("float32", ref)):
            feats = [features(eng, ids, layers) for ids, _ in seqs]
            out[f"text {text_name}, features {feat_name}"] = agreement(head, seqs, feats)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
