"""Scale check of two commits on GGUF files: plain decode tok/s by batch size and the decode step
time by context length, new against old, in one run.

    python benchmarks/scale_check.py --old REV [--new REV] [--models default,qwen]
        [--batch-sizes 1,8,32] [--contexts 512,2048,8000] [--new-tokens 64] [--steps 32]
        [--rounds 3] [--num-threads N] [--out DIR] [--no-write]

Each commit runs in its own checkout (``--old`` a temporary ``git worktree``, removed at the end;
``--new`` this working tree as it is, unless named), its code imported through
tools/checkout.py, the measuring code this file's in both. One child process per (round, model,
commit) builds one engine on the file (speculation off, no draft, prefix cache off, 1 GiB of KV,
a context window for the longest context) and measures, after a warm-up:

- plain decode tok/s at each ``--batch-sizes`` B: B chat prompts (benchmarks/prompts/chat.json)
  decoding ``--new-tokens`` tokens each, EOS ignored, prefill included
  (benchmarks/plain_decode.py's ``time_ours``; every output must have drafted nothing);
- at each ``--contexts`` C: the prefill of one C-token prompt and the median of ``--steps``
  decode steps after it, batch 1 (benchmarks/probes/context_scaling.py's ``measure``).

Rounds alternate the commit that goes first (old, new; then new, old), so drift on the machine
hits both alike. Every cell's ratio is new speed / old speed (tok/s new / old; for times
old / new), per round; the verdict is the median over rounds. Models: ``default`` is the
built-in SmolLM2-135M Q4_1, ``qwen`` Qwen2.5-Coder-0.5B-Instruct Q4_K_M where
benchmarks/fetch_qwen.py puts it (skipped, with a message, where it is missing), or a path.

Exit status 0; 1 when a decode cell (tok/s or ms/step, not prefill) of the built-in 135M file
has a median ratio below 0.95: the margin of this 2-core VM's noise, where two runs of one
commit differ by up to ~5%. Other files' cells are reported, not gated. 2: a bad flag, a bad
revision, a child that failed (its stderr's last line is shown).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this file's benchmarks/ and tools/, whichever tree's specserve

from benchmarks.compare_commits import Tree, checkout, remove, working_tree  # noqa: E402
from benchmarks.fetch_qwen import DEFAULT_DEST as QWEN  # noqa: E402
from benchmarks.report import (  # noqa: E402
    BenchError,
    fmt,
    load_workload,
    lscpu_summary,
    md_table,
    out_dir,
    parse_list,
    publish,
    results_section,
    run_info,
    stage_log,
    write_json,
)
from tools import checkout as tree_code  # noqa: E402

HEADING = "## Scale check: decode by batch size and by context, two commits"
BAR = 0.95  # the VM's noise: see the docstring
KV_BYTES = 1 << 30


@dataclass(frozen=True)
class Model:
    name: str  # default | qwen | the path given
    path: Path
    gated: bool  # the built-in 135M file: a slower cell fails the run


@dataclass
class Cell:
    """One measured quantity of one model, every round, both commits."""

    model: str
    name: str  # "decode tok/s, batch 8"
    higher_is_better: bool
    gated: bool
    values: dict[str, list[float]] = field(default_factory=lambda: {"old": [], "new": []})

    def ratios(self) -> list[float]:
        """new speed / old speed, per round."""
        pairs = zip(self.values["old"], self.values["new"])
        if self.higher_is_better:
            return [n / o for o, n in pairs if o > 0]
        return [o / n for o, n in pairs if n > 0]

    def median_ratio(self) -> float:
        r = self.ratios()
        return statistics.median(r) if r else float("nan")

    def failed(self, bar: float = BAR) -> bool:
        return self.gated and not self.median_ratio() >= bar  # NaN (no data) fails too


# --- models and flags ------------------------------------------------------------------------


def builtin_model_path() -> Path:
    from specserve.engine.models import default_model_path

    return Path(default_model_path())


def models_to_measure(names: list[str]) -> tuple[list[Model], list[str]]:
    """resolve_models against the built-in model, each skipped file also said on stderr; an
    error when nothing is left to measure."""
    models, skipped = resolve_models(names, builtin_model_path())
    for line in skipped:
        print(f"skipping {line}", file=sys.stderr, flush=True)
    if not models:
        raise BenchError("no model file to measure")
    return models, skipped


def resolve_models(names: list[str], builtin: Path, qwen: Path = QWEN) -> tuple[list[Model],
                                                                               list[str]]:
    """The files to run, and one line per file skipped because it is missing (only the Qwen
    file may be; a missing path given by name is an error)."""
    if not names:
        raise BenchError("--models is empty: name default, qwen or a GGUF path")
    models, skipped = [], []
    for name in names:
        if name == "default":
            path = builtin
        elif name == "qwen":
            if not qwen.is_file():
                skipped.append(f"qwen: {qwen} is missing (python benchmarks/fetch_qwen.py "
                               "fetches it); its cells were not measured")
                continue
            path = qwen
        else:
            path = Path(name)
            if not path.is_file():
                raise BenchError(f"--models: {name!r} is neither default, qwen nor a file")
        if any(m.path == path for m in models):
            raise BenchError(f"--models names {path} twice")
        models.append(Model(name, path, gated=path.resolve() == builtin.resolve()))
    return models, skipped


def check_sizes(batch_sizes: list[int], contexts: list[int], new_tokens: int, steps: int,
                rounds: int) -> None:
    if not batch_sizes and not contexts:
        raise BenchError("--batch-sizes and --contexts are both empty: nothing to measure")
    if min([*batch_sizes, *contexts, new_tokens, steps, rounds]) < 1:
        raise BenchError("--batch-sizes, --contexts, --new-tokens, --steps and --rounds take "
                         "values >= 1")
    for flag, values in (("--batch-sizes", batch_sizes), ("--contexts", contexts)):
        if len(set(values)) != len(values):
            raise BenchError(f"{flag} names a value twice (got {values})")


def cells_of(model: Model, batch_sizes: list[int], contexts: list[int]) -> list[Cell]:
    """The cells a child's answer fills, in table order."""
    cells = [Cell(model.name, f"decode tok/s, batch {b}", True, model.gated)
             for b in batch_sizes]
    cells += [Cell(model.name, f"decode ms/step, context {c}", False, model.gated)
              for c in contexts]
    cells += [Cell(model.name, f"prefill s, context {c}", False, False) for c in contexts]
    return cells


def record(cells: list[Cell], label: str, answer: dict) -> None:
    """Puts one child's answer (``child()``'s JSON, keyed in the order of the flags) into
    ``cells``."""
    values = [*answer["tok_s"].values(), *answer["step_ms"].values(),
              *answer["prefill_s"].values()]
    if len(values) != len(cells):
        raise BenchError(f"a child answered {len(values)} values for {len(cells)} cells")
    for cell, value in zip(cells, values):
        cell.values[label].append(value)


def table(cells: list[Cell], bar: float = BAR) -> list[str]:
    rows = []
    for c in cells:
        ratios = c.ratios()
        verdict = ("info" if not c.gated and c.name.startswith("prefill") else
                   "not gated" if not c.gated else
                   "ok" if not c.failed(bar) else f"**below {bar:.2f}x**")
        digits = 3 if c.name.startswith("prefill") else 1
        rows.append([c.name, fmt(statistics.median(c.values["old"]), digits)
                     if c.values["old"] else "-",
                     fmt(statistics.median(c.values["new"]), digits) if c.values["new"] else "-",
                     f"{fmt(c.median_ratio(), 3)}x",
                     f"{fmt(min(ratios), 3)}..{fmt(max(ratios), 3)}" if ratios else "-", verdict])
    return md_table(["cell", "old", "new", "new / old speed", "range over rounds", "verdict"],
                    rows)


# --- the child: one engine, one commit, one file ---------------------------------------------


def child(spec: dict) -> dict:
    """Measures one file with whichever tree's specserve this process imports."""
    from benchmarks.plain_decode import time_ours
    from benchmarks.probes.context_scaling import measure
    from specserve.core.config import EngineConfig
    from specserve.engine.llm_engine import LLMEngine

    contexts, steps = spec["contexts"], spec["steps"]
    engine = LLMEngine(EngineConfig(
        model=spec["model"], draft_model="none", enable_prefix_caching=False,
        max_model_len=max([*contexts, 512]) + steps + 8, kv_cache_memory=KV_BYTES,
        num_threads=spec["num_threads"]))
    chats = [engine.encode(engine.render_chat([{"role": "user", "content": t}]))
             for t in load_workload("chat")]
    time_ours(engine, chats[:1], 8)  # warm-up: allocator, thread team
    measure(engine, 64, 4)
    tok_s, step_ms, prefill_s = {}, {}, {}
    for b in spec["batch_sizes"]:
        dt, _ = time_ours(engine, [chats[i % len(chats)] for i in range(b)], spec["new_tokens"])
        tok_s[str(b)] = b * spec["new_tokens"] / dt
    for c in contexts:
        prefill, step = measure(engine, c, steps)
        step_ms[str(c)], prefill_s[str(c)] = step * 1e3, prefill
    threads = getattr(engine, "threads", None)  # an older tree may not report them
    return {"tok_s": tok_s, "step_ms": step_ms, "prefill_s": prefill_s,
            "engine": engine.config.summary(),
            "threads": threads.describe() if threads is not None else "-"}


def run_child(tree: Tree, spec: dict) -> dict:
    """``child(spec)`` in a fresh process running ``tree``'s code."""
    cmd = [*tree_code.command(tree.path), str(Path(__file__).resolve()), "--child",
           json.dumps(spec)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(cmd, cwd=tree.path, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise BenchError(f"the {tree.label} tree ({tree.describe}) failed on "
                         f"{Path(spec['model']).name}: {tail[0]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- the run ---------------------------------------------------------------------------------


def run_rounds(trees: list[Tree], models: list[Model], cells: dict[str, list[Cell]],
               spec: dict, rounds: int, log) -> dict[str, dict[str, str]]:
    """Every round: each file under each tree, the tree going first alternating; fills
    ``cells``. Returns what each (file, tree) engine resolved to and its threads."""
    engines: dict[str, dict[str, str]] = {}
    for r in range(rounds):
        for m in models:
            for tree in trees if r % 2 == 0 else trees[::-1]:
                t0 = time.monotonic()
                answer = run_child(tree, {**spec, "model": str(m.path)})
                record(cells[m.name], tree.label, answer)
                engines[f"{m.name} {tree.label}"] = {"engine": answer["engine"],
                                                     "threads": answer["threads"]}
                log(f"round {r + 1}/{rounds} {m.name} {tree.label}: "
                    f"{time.monotonic() - t0:.0f} s")
    return engines


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python benchmarks/scale_check.py",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", help="old revision (required)")
    ap.add_argument("--new", default=None,
                    help="new revision [default: this working tree, as it is]")
    ap.add_argument("--models", default="default,qwen",
                    help="default (built-in 135M), qwen (fetch_qwen.py's file) or GGUF paths")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--contexts", default="512,2048,8000")
    ap.add_argument("--new-tokens", type=int, default=64, help="per sequence, decode cells")
    ap.add_argument("--steps", type=int, default=32, help="decode steps per context")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, the commits alternating")
    ap.add_argument("--num-threads", type=int, default=None,
                    help="the engines' threads [default: each engine's own choice]")
    ap.add_argument("--out", default=None,
                    help="folder for scale_check.json [default: benchmarks/results/scale]")
    ap.add_argument("--no-write", action="store_true", help="print, leave RESULTS.md alone")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.child is not None:
        print(json.dumps(child(json.loads(args.child))), flush=True)
        return 0
    log = stage_log("scale")

    trees: list[Tree] = []
    scratch: Path | None = None
    try:
        if not args.old:
            raise BenchError("--old REV is required (the commit to compare against)")
        batch_sizes = parse_list(args.batch_sizes, int, "--batch-sizes")
        contexts = parse_list(args.contexts, int, "--contexts")
        check_sizes(batch_sizes, contexts, args.new_tokens, args.steps, args.rounds)
        models, skipped = models_to_measure(parse_list(args.models, str, "--models"))
        out = out_dir(args.out, "scale")
        scratch = Path(tempfile.mkdtemp(prefix="specserve-scale-"))
        trees = [checkout("old", args.old, scratch),
                 checkout("new", args.new, scratch) if args.new else working_tree()]
        for t in trees:
            log(f"{t.label}: {t.rev} ({t.describe}) at {t.path}")
        cells = {m.name: cells_of(m, batch_sizes, contexts) for m in models}
        spec = {"batch_sizes": batch_sizes, "contexts": contexts, "new_tokens": args.new_tokens,
                "steps": args.steps, "num_threads": args.num_threads}
        engines = run_rounds(trees, models, cells, spec, args.rounds, log)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        for t in trees:
            remove(t)
        if scratch is not None:
            subprocess.run(["git", "worktree", "prune"], cwd=REPO, capture_output=True)
            shutil.rmtree(scratch, ignore_errors=True)
    return report(args, argv, trees, models, skipped, cells, engines, out)


def report(args: argparse.Namespace, argv: list[str], trees: list[Tree], models: list[Model],
           skipped: list[str], cells: dict[str, list[Cell]], engines: dict[str, dict[str, str]],
           out: Path) -> int:
    old, new = trees
    failed = [f"{c.model}: {c.name}" for cs in cells.values() for c in cs if c.failed()]
    body: list[str] = []
    for m in models:
        body += [f"**{m.path.name}** ({m.name}{', gated' if m.gated else ''}):", "",
                 *table(cells[m.name]), ""]
    body += [f"- skipped {line}" for line in skipped] + ([""] if skipped else [])
    body += [f"Threads, {key}: {e['threads']}." for key, e in engines.items()] + [""]
    body.append("Verdict: " + ("**met**: no decode cell of the 135M file is below "
                               f"{BAR:.2f}x." if not failed else
                               f"**missed**: {', '.join(failed)} below {BAR:.2f}x."))
    intro = (f"Old: {old.rev} ({old.describe}); new: {new.rev} ({new.describe}). One child "
             f"process per round, file and commit, rounds: {args.rounds}, the commit going first "
             "alternating; speculation off (every output's num_drafted 0), no draft, prefix "
             f"cache off, EOS ignored; decode tok/s over {args.new_tokens} new tokens per "
             f"sequence of B chat prompts, prefill included; ms/step the median of "
             f"{args.steps} decode steps after a prompt of that many tokens, batch 1. Values are "
             "medians over rounds; ratio = median of per-round new / old speed (for times, old "
             f"/ new); the 135M file's decode cells must stay >= {BAR:.2f}x (this VM's noise). "
             f"Threads: {args.num_threads or 'each engine chooses'}. lscpu: {lscpu_summary()}.")
    info = run_info(argv, "python benchmarks/scale_check.py")
    write_json(out / "scale_check.json", {
        "info": info, "old": old.describe, "new": new.describe, "skipped": skipped,
        "engines": engines, "cells": {name: [{"name": c.name, "values": c.values,
                                              "ratios": c.ratios()} for c in cs]
                                      for name, cs in cells.items()}})
    publish(HEADING, results_section(HEADING, info, intro, body), write=not args.no_write)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
