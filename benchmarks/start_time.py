"""Start time and memory of a GGUF model, two commits in one run: the engine built in a fresh
process with the compiled kernels and tuning tables cached but the model's own caches cold (a
first start of this file), then again (a second start).

    python benchmarks/start_time.py --model FILE [--old REV] [--new REV] [--cold] [--no-write]

Each commit runs in its own temporary worktree (benchmarks/compare_commits.py's) with its own
``SPECSERVE_CACHE_DIR``, seeded with a copy of this machine's ``ext/`` and ``tune/`` caches, so
neither the C++ build nor kernel timing is in the figures. ``--cold`` adds two starts before those:
one with an empty cache (the C++ build, kernel tuning, the thread choice and the model all
cold: nothing ran before and nothing was built at install), and one with only the compiled
extensions cached (after `make` or `specserve build`). Reported
per commit: wall seconds from process launch to the engine built (imports included), the
engine's own build seconds, and RSS after the build. Writes a section of benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.compare_commits import Tree, checkout, remove, working_tree  # noqa: E402
from benchmarks.report import (  # noqa: E402
    lscpu_summary,
    md_table,
    run_info,
    write_results_section,
)

CHILD = """
import json, sys, time
t0 = time.perf_counter()
from specserve.core.config import EngineConfig
from specserve.engine.llm_engine import LLMEngine
t1 = time.perf_counter()
LLMEngine(EngineConfig(model=sys.argv[1], draft_model="none", num_threads=2))
t2 = time.perf_counter()
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS:"))
print(json.dumps({"import_s": t1 - t0, "build_s": t2 - t1, "rss_mb": rss / 1024}))
"""


def _start(tree: Tree, model: str, cache: Path) -> dict:
    script = cache / "child.py"
    script.write_text(CHILD)
    env = {**__import__("os").environ, "SPECSERVE_CACHE_DIR": str(cache)}
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, str(tree.path / "tools" / "checkout.py"),
                          str(tree.path), str(script), model], env=env, capture_output=True,
                         text=True, check=True)
    wall = time.perf_counter() - t0
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return {**got, "wall_s": wall}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--old", default="HEAD~1")
    ap.add_argument("--new", default=None, help="a commit [default: this working tree]")
    ap.add_argument("--cold", action="store_true",
                    help="also a start with an empty cache (C++ build and tuning cold)")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    from specserve.core.paths import cache_root

    info = run_info(sys.argv[1:], "python benchmarks/start_time.py")
    seed = cache_root()
    work = Path(tempfile.mkdtemp(prefix="specserve-start-"))
    rows = []
    trees = []
    try:
        for label, rev in (("old", args.old), ("new", args.new)):
            tree = working_tree() if rev is None else checkout(label, rev, work)
            trees.append(tree)
            cold = installed = None
            if args.cold:
                (work / f"cold-{label}").mkdir()
                cold = _start(tree, args.model, work / f"cold-{label}")
                if (seed / "ext").is_dir():  # what `make` leaves: the C++ built, nothing timed
                    shutil.copytree(seed / "ext", work / f"installed-{label}" / "ext")
                    installed = _start(tree, args.model, work / f"installed-{label}")
            cache = work / f"cache-{label}"
            cache.mkdir()
            for part in ("ext", "tune"):
                if (seed / part).is_dir():
                    shutil.copytree(seed / part, cache / part)
            first, second = _start(tree, args.model, cache), _start(tree, args.model, cache)
            rows.append((label, tree.describe, cold, installed, first, second))
            print(label, tree.describe, json.dumps({"cold": cold, "installed": installed,
                                                    "first": first, "second": second}),
                  flush=True)
    finally:
        for tree in trees:
            remove(tree)
        shutil.rmtree(work, ignore_errors=True)
    intro = (f"Start of `{Path(args.model).name}` in a fresh process: wall seconds from launch "
             f"to the engine built (imports included; the engine's own build in brackets), with "
             f"the C++ build and kernel tuning cached, the model's caches cold (first start) then "
             f"warm (second). `draft_model=none`, 2 threads. lscpu: {lscpu_summary()}.")
    if args.cold:
        intro += (" The cold start ran first, with an empty cache: the C++ build, kernel "
                  "tuning and the thread choice in it too; then the start after an install "
                  "that built the C++ (`make`, `specserve build`): the compiled extensions "
                  "cached, tuning and the thread choice cold.")

    def cell(r: dict | None) -> str:
        return "-" if r is None else f"{r['wall_s']:.1f} ({r['build_s']:.1f})"

    head = ["commit", *(["cold start s", "after install s"] if args.cold else []),
            "first start s", "second start s", "RSS MB first / second"]
    body = md_table(head, [
        [f"{label} {describe}", *([cell(c), cell(i)] if args.cold else []), cell(a), cell(b),
         f"{a['rss_mb']:.0f} / {b['rss_mb']:.0f}"]
        for label, describe, c, i, a, b in rows])
    print("\n".join([intro, *body]))
    if not args.no_write:
        write_results_section(f"## Start time of a GGUF file, two commits, {Path(args.model).name}",
                              info, intro, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
