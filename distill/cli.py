"""`specserve distill` flags: train a draft (default), or measure one with --eval."""

from __future__ import annotations

import argparse
from pathlib import Path

from specserve.distill.data import PROMPTS_FILE
from specserve.distill.eagle_train import EagleTrainConfig
from specserve.distill.student import StudentSpec
from specserve.distill.train import TrainConfig


def add_distill_parser(sub: argparse._SubParsersAction) -> None:
    s, t, et = StudentSpec(), TrainConfig(), EagleTrainConfig()
    p = sub.add_parser(
        "distill",
        help="distill a draft model for a target (same tokenizer), or --eval one",
        description="Trains a small draft on the target's own outputs (KL to its next-token "
                    "distribution) and writes OUT/draft, a folder for --draft-model; with --method "
                    "eagle, trains a one-layer head on the target's hidden states from teacher "
                    "shards and writes OUT/eagle. Interrupted runs resume. With --eval, "
                    "measures a draft's (and an EAGLE head's) acceptance and speedup.",
    )
    p.add_argument("--method", choices=("model", "eagle"), default="model",
                   help="model: a small standalone draft LM (OUT/draft); eagle: a one-layer "
                        "head on the target's hidden states (OUT/eagle) [default: model]")
    p.add_argument("--target", default=None,
                   help="target model: HF folder, .gguf or hub id (default: built-in SmolLM2)")
    p.add_argument("--out", type=Path, default=None,
                   help="work folder: teacher data, checkpoint, and the draft in OUT/draft")
    p.add_argument("--prompts", type=Path, default=PROMPTS_FILE,
                   help="prompt set JSON (id, category, split, prompt) [default: the repo's]")
    p.add_argument("--num-prompts", type=int, default=None,
                   help="use the first N train prompts (seeded shuffle) [default: all]")
    p.add_argument("--num-heldout", type=int, default=64,
                   help="held-out prompts scored during training [default: 64]")
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="longest target response generated per prompt [default: 256]")
    p.add_argument("--gen-batch", type=int, default=32,
                   help="sequences decoded together while generating data [default: 32]")
    p.add_argument("--data-only", action="store_true",
                   help="only generate (or resume) the teacher data, with the data flags below")
    d = p.add_argument_group("teacher data (--data-only; see distill/datagen.py)")
    d.add_argument("--corpus", action="store_true",
                   help="train split: the large multi-turn corpus of distill/corpus.py "
                        "(~6k conversations) instead of the train prompts of --prompts")
    d.add_argument("--turns", type=int, default=2,
                   help="most user turns per --corpus conversation; the target's own answers "
                        "are fed back between turns [default: 2]")
    d.add_argument("--no-logprobs", dest="logprobs", action="store_false",
                   help="tokens-only shards (no top-20 teacher logprobs): for trainers that "
                        "recompute the target's outputs (--method eagle); ~4 bytes per token")
    d.add_argument("--max-data-tokens", type=int, default=None,
                   help="stop once the train shards hold this many answer tokens")
    d.add_argument("--data-minutes", type=float, default=None,
                   help="start no train shard that would end after this many minutes of "
                        "generation (the engine's start not counted)")
    d.add_argument("--chunk-size", type=int, default=None,
                   help="conversations per shard [default: 4 x --gen-batch with --corpus, "
                        "else 128]")
    p.add_argument("--layers", type=int, default=s.num_layers,
                   help=f"decoder layers in the draft [default: {s.num_layers}]")
    p.add_argument("--init-layers", default=",".join(map(str, s.init_layers)),
                   help="target layers copied into the draft, negative from the end "
                        "[default: 0,-1]")
    p.add_argument("--head-vocab", type=int, default=s.head_vocab_size,
                   help=f"tokens the draft's head scores (most frequent in the target's output) "
                        f"[default: {s.head_vocab_size}]")
    p.add_argument("--steps", type=int, default=None,
                   help=f"[default: {t.steps} (model), {et.steps} (eagle)]")
    p.add_argument("--lr", type=float, default=None,
                   help=f"peak learning rate [default: {t.lr} (model), {et.lr} (eagle)]")
    p.add_argument("--batch-tokens", type=int, default=t.batch_tokens,
                   help=f"padded tokens per batch [default: {t.batch_tokens}]")
    p.add_argument("--max-len", type=int, default=t.max_len,
                   help=f"longest training sequence [default: {t.max_len}]")
    p.add_argument("--checkpoint-every", type=int, default=t.checkpoint_every,
                   help=f"steps between checkpoints [default: {t.checkpoint_every}]")
    p.add_argument("--eval-every", type=int, default=t.eval_every,
                   help=f"steps between held-out scores [default: {t.eval_every}]")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop training (with a checkpoint) after this many minutes")
    p.add_argument("--seed", type=int, default=t.seed, help=f"[default: {t.seed}]")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
    g = p.add_argument_group("EAGLE head (--method eagle)")
    g.add_argument("--data", type=Path, default=None,
                   help="folder of teacher shards (shard-*.pt; only tokens and prompt_lens are "
                        "read) [default: OUT/data/train]; held-out: its sibling heldout/ if it "
                        "has shards, else every 20th sequence")
    g.add_argument("--device", default="cpu",
                   help="where training runs: cpu or cuda (bfloat16 autocast) [default: cpu]")
    g.add_argument("--ttt-steps", type=int, default=et.ttt_steps,
                   help=f"chained draft steps unrolled in training [default: {et.ttt_steps}]")
    g.add_argument("--feature-noise", type=float, default=et.feature_noise,
                   help=f"noise on target features, relative to their std "
                        f"[default: {et.feature_noise}]")
    g.add_argument("--target-layers", default=None,
                   help="target layers whose outputs the head fuses, e.g. 1,14,26 "
                        "[default: 2nd, middle-1, 4th from the end]")
    e = p.add_argument_group("evaluation (--eval)")
    e.add_argument("--eval", action="store_true",
                   help="measure --draft against --target on held-out prompts instead")
    e.add_argument("--draft", default=None,
                   help="draft folder to evaluate [default: OUT/draft; with --method eagle: "
                        "OUT/draft if present, else the built-in target's shipped draft]")
    e.add_argument("--eagle", default=None,
                   help="EAGLE head folder to evaluate [default with --method eagle: OUT/eagle]")
    e.add_argument("--eval-category", default=None,
                   help="only held-out prompts of this category, e.g. chat [default: all]")
    e.add_argument("--eval-batch", type=int, default=None,
                   help="sequences decoded together; 1 measures single-stream speedup "
                        "[default: all prompts at once]")
    e.add_argument("--eval-prompts", type=int, default=32,
                   help="held-out prompts decoded per setting [default: 32]")
    e.add_argument("--eval-tokens", type=int, default=64,
                   help="new tokens per prompt [default: 64]")
    e.add_argument("--ks", default="1,2,3,4,5,6,7,8", help="draft lengths [default: 1..8]")
    e.add_argument("--temperatures", default="0,0.7", help="[default: 0,0.7]")
    e.add_argument("--dtype", default="float32",
                   help="engine dtype for --eval and --data-only [default: float32]")
    p.add_argument("-v", "--verbose", action="store_true", help="log progress details")


def cmd_distill(args: argparse.Namespace) -> int:
    from specserve.core.errors import ConfigError

    if args.eval:
        from specserve.distill.evaluate import EvalConfig, run_eval

        draft, eagle = _eval_folders(args)
        if draft is None and eagle is None:
            raise ConfigError("--eval needs --draft DIR and/or --eagle DIR (or --out DIR "
                              "holding OUT/draft or OUT/eagle)")
        report = run_eval(EvalConfig(
            target=args.target, draft=draft, eagle=eagle, prompts=args.prompts,
            num_prompts=args.eval_prompts, max_tokens=args.eval_tokens,
            ks=_ints(args.ks, "--ks"), temperatures=_floats(args.temperatures),
            dtype=args.dtype, num_threads=args.num_threads, max_num_seqs=args.eval_batch,
            category=args.eval_category,
        ))
        print(report)
        return 0

    if args.out is None:
        raise ConfigError("distill needs --out DIR (where data, checkpoint and draft go)")
    if args.data_only:
        from specserve.distill.datagen import DataGenConfig, run_datagen

        run_datagen(DataGenConfig(
            out=args.out, target=args.target, prompts=args.prompts, corpus=args.corpus,
            turns=args.turns, num_prompts=args.num_prompts, num_heldout=args.num_heldout,
            max_new_tokens=args.max_new_tokens, gen_batch=args.gen_batch,
            chunk_size=args.chunk_size, logprobs=args.logprobs,
            max_data_tokens=args.max_data_tokens, data_minutes=args.data_minutes,
            dtype=args.dtype, num_threads=args.num_threads,
        ))
        print(f"teacher data in {args.out / 'data'}")
        return 0
    if args.method == "eagle":
        return _cmd_eagle(args)

    from specserve.distill.run import DistillConfig, run_distill

    cfg = DistillConfig(
        out=args.out, target=args.target, prompts=args.prompts, num_prompts=args.num_prompts,
        num_heldout=args.num_heldout, max_new_tokens=args.max_new_tokens,
        gen_batch=args.gen_batch, num_threads=args.num_threads, data_only=args.data_only,
        student=StudentSpec(
            num_layers=args.layers, init_layers=tuple(_ints(args.init_layers, "--init-layers")),
            head_vocab_size=args.head_vocab,
        ),
        train=TrainConfig(
            steps=args.steps or TrainConfig.steps, lr=args.lr or TrainConfig.lr,
            batch_tokens=args.batch_tokens, max_len=args.max_len,
            checkpoint_every=args.checkpoint_every, eval_every=args.eval_every,
            max_minutes=args.max_minutes, seed=args.seed,
        ),
    )
    out = run_distill(cfg)
    print(f"draft written to {out}" if out else f"teacher data in {args.out / 'data'}")
    return 0


def _eval_folders(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(draft, eagle) folders to evaluate: given ones, else what OUT holds."""
    def in_out(name: str) -> str | None:
        return str(args.out / name) if args.out and (args.out / name).is_dir() else None

    if args.method != "eagle":
        return args.draft or (str(args.out / "draft") if args.out else None), args.eagle
    draft = args.draft or in_out("draft")
    if draft is None and args.target is None:
        from specserve.engine.models import resolve_draft

        draft = resolve_draft(None, None)
    return draft, args.eagle or in_out("eagle")


def _cmd_eagle(args: argparse.Namespace) -> int:
    from specserve.distill.eagle_run import EagleConfig, run_eagle

    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    et = EagleTrainConfig()
    layers = _ints(args.target_layers, "--target-layers") if args.target_layers else None
    out = run_eagle(EagleConfig(
        out=args.out, target=args.target, data=args.data, head_vocab_size=args.head_vocab,
        target_layers=tuple(layers) if layers else None,
        train=EagleTrainConfig(
            steps=args.steps or et.steps, lr=args.lr or et.lr, batch_tokens=args.batch_tokens,
            max_len=args.max_len, ttt_steps=args.ttt_steps, feature_noise=args.feature_noise,
            checkpoint_every=args.checkpoint_every, eval_every=args.eval_every,
            max_minutes=args.max_minutes, seed=args.seed, device=args.device,
        ),
    ))
    print(f"EAGLE head written to {out}")
    return 0


def _ints(text: str, flag: str) -> list[int]:
    from specserve.core.errors import ConfigError

    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise ConfigError(f"{flag} takes comma-separated integers (got {text!r})") from exc


def _floats(text: str) -> list[float]:
    from specserve.core.errors import ConfigError

    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise ConfigError(f"--temperatures takes comma-separated numbers (got {text!r})") from exc
