"""Proof of no behaviour change between two commits: same answers, same speed.

    python benchmarks/compare_commits.py [--old REV] [--new REV] [--rounds 3]
        [--speed-prompts 4] [--streams 8] [--server-args "..."] [--write-results]

``--old`` defaults to the merge base of ``main`` and HEAD; ``--new`` defaults to this checkout's
working tree as it is (uncommitted changes included). A named revision is checked out into a
temporary ``git worktree`` (removed at the end), so the comparison never touches this checkout.
Nothing is installed: each tree's server is ``python -m specserve serve`` run from that tree's
root through ``tools/checkout.py``, so it imports its own code from the shared environment
whichever checkout is installed. Both servers run with the same flags (by default none: the
default model and the default speculation) and are started one after the other, so neither's
first-start kernel tuning runs while the other loads the CPU.

1. Answers. The same 20 prompts (chat and completions alternating, prompts from
   benchmarks/prompts/, greedy, ``max_tokens`` 128) go to each server one at a time, once with
   the server's default speculation (no ``speculative`` field) and once with
   ``"speculative": {"method": "off"}``. Every prompt's four answers (old and new, speculative
   and plain) must be byte-identical: text, finish reason and token count. Any difference, or
   any failed request, makes the exit status 1.
2. Speed. Decode speed, single stream (``--speed-prompts`` requests one after another) and
   ``--streams`` concurrent streams, each request streaming exactly ``max_tokens`` tokens (EOS
   ignored) over SSE, in both speculation modes. The two trees' servers alternate request by
   request in the single-stream cell and batch by batch in the concurrent one (old first, then
   new first in the next round), so drift on a shared machine hits both alike. The figure is
   output tokens over wall time; the verdict is the median over rounds of the per-round
   new / old ratio against ``--speed-bar`` (0.98x). Speed is printed, not enforced in the exit
   status: timings on a busy machine are indicative.

Exit status: 0 identical answers, 1 any answer difference or failed request, 2 a setup problem
(bad revision, a server that does not start), 130 interrupted.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent
REPO = ROOT.parent
sys.path.insert(0, str(REPO))

from benchmarks.client import Target, sse_request  # noqa: E402
from benchmarks.launched_server import LaunchedServer  # noqa: E402
from benchmarks.report import (  # noqa: E402
    BenchError,
    fmt,
    load_workload,
    md_table,
    out_dir,
    run_info,
    stage_log,
    write_json,
    write_results_section,
)

WORKLOADS = ("chat", "rewrite", "code", "summarize")
MODES = (None, "off")  # None: the server's default speculation (no `speculative` field)


def mode_name(mode: str | None) -> str:
    return "default" if mode is None else mode


@dataclass
class Prompt:
    endpoint: str  # chat | completions
    workload: str
    text: str


@dataclass
class Answer:
    """What a test compares: the bytes of the text, why it ended, how many tokens."""

    text: str
    finish_reason: str | None
    tokens: int
    error: str | None = None


@dataclass
class Tree:
    label: str  # old | new
    rev: str  # what the user named
    describe: str  # the commit (and whether the working tree is dirty)
    path: Path
    temporary: bool  # a worktree this script made (and removes)


@dataclass
class Cell:
    """One speed measurement cell: a speculation mode at a stream count, every round."""

    mode: str | None
    streams: int
    tok_s: dict[str, list[float]] = field(default_factory=lambda: {"old": [], "new": []})

    def ratios(self) -> list[float]:
        return [n / o for o, n in zip(self.tok_s["old"], self.tok_s["new"]) if o > 0]


class _Target(Target):
    """A request body that, for mode None, leaves ``speculative`` out (the server's default)."""

    def body(self, prompt: str, mode: str | None) -> dict:
        body = super().body(prompt, mode or "off")
        if mode is None:
            body.pop("speculative")
        return body


def prompt_set(n: int) -> list[Prompt]:
    """n prompts cycling through the workloads, chat and completions alternating so that each
    workload is sent both ways."""
    pools = {w: load_workload(w) for w in WORKLOADS}
    out = []
    for j in range(n):
        w, k = WORKLOADS[j % len(WORKLOADS)], j // len(WORKLOADS)
        endpoint = "chat" if (j + k) % 2 == 0 else "completions"
        out.append(Prompt(endpoint, w, pools[w][k % len(pools[w])]))
    return out


# --- trees ---------------------------------------------------------------------------------------


def git(*args: str, cwd: Path = REPO) -> str:
    proc = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BenchError(f"git {' '.join(args)}: {proc.stderr.strip()}")
    return proc.stdout.strip()


def working_tree() -> Tree:
    sha = git("rev-parse", "--short", "HEAD")
    changed = [line for line in git("status", "--porcelain").splitlines() if line]
    dirty = f" + {len(changed)} uncommitted file(s)" if changed else ""
    return Tree("new", "working tree", f"{sha}{dirty}", REPO, temporary=False)


def checkout(label: str, rev: str, parent: Path, name: str | None = None) -> Tree:
    """A temporary detached worktree of ``rev`` under ``parent``."""
    try:
        sha = git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except BenchError:
        raise BenchError(f"--{label} {rev!r} is not a commit of {REPO}") from None
    path = parent / label
    git("worktree", "add", "--detach", "--quiet", str(path), sha)
    return Tree(label, name or rev, git("rev-parse", "--short", sha), path, temporary=True)


def remove(tree: Tree) -> None:
    if tree.temporary:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree.path)], cwd=REPO,
                       capture_output=True)


def default_old() -> str:
    return git("merge-base", "main", "HEAD")


def tree_server(tree: Tree, flags: list[str], log_path: Path, timeout: float) -> LaunchedServer:
    """``specserve serve`` of ``tree``'s code, not the installed checkout's."""
    return LaunchedServer(flags, log_path, timeout, root=tree.path)


# --- answers -------------------------------------------------------------------------------------


async def answer(session: aiohttp.ClientSession, url: str, prompt: Prompt, mode: str | None,
                 max_tokens: int) -> Answer:
    target = _Target(url, prompt.endpoint, None, max_tokens, ignore_eos=False)
    body = target.body(prompt.text, mode)
    path = "/v1/chat/completions" if prompt.endpoint == "chat" else "/v1/completions"
    try:
        async with session.post(url + path, json=body) as resp:
            obj = await resp.json(content_type=None)
            if resp.status != 200:
                return Answer("", None, 0, f"HTTP {resp.status}: {obj}")
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as exc:
        return Answer("", None, 0, f"{type(exc).__name__}: {exc}")
    choice = obj["choices"][0]
    text = choice["message"]["content"] if prompt.endpoint == "chat" else choice["text"]
    return Answer(text, choice.get("finish_reason"), obj["usage"]["completion_tokens"])


async def collect_answers(urls: dict[str, str], prompts: list[Prompt],
                          max_tokens: int) -> dict[tuple[str, str | None], list[Answer]]:
    """(tree, mode) -> one answer per prompt; requests one at a time (a single stream)."""
    answers: dict[tuple[str, str | None], list[Answer]] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for label, url in urls.items():
            for mode in MODES:
                answers[label, mode] = [await answer(session, url, p, mode, max_tokens)
                                        for p in prompts]
    return answers


def differences(prompts: list[Prompt],
                answers: dict[tuple[str, str | None], list[Answer]]) -> list[str]:
    """One line per prompt whose answers are not all byte-identical to old's default one, or
    per failed request."""
    lines = []
    reference = answers["old", None]
    for i, prompt in enumerate(prompts):
        for (label, mode), got in answers.items():
            a, ref = got[i], reference[i]
            name = f"prompt {i} ({prompt.endpoint}, {prompt.workload}) {label}/{mode_name(mode)}"
            if a.error:
                lines.append(f"{name}: request failed: {a.error}")
            elif ref.error is None and (a.text, a.finish_reason, a.tokens) != (
                    ref.text, ref.finish_reason, ref.tokens):
                lines.append(f"{name} differs from old/default: {a.tokens} tokens, finish "
                             f"{a.finish_reason}, text {_first_difference(ref.text, a.text)}")
    return lines


def _first_difference(a: str, b: str) -> str:
    i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return f"first differs at character {i}: {a[i:i + 30]!r} vs {b[i:i + 30]!r}"


# --- speed ---------------------------------------------------------------------------------------


async def measure(url: str, todo: list[Prompt], mode: str | None, streams: int,
                  max_tokens: int) -> tuple[int, float, list[str]]:
    """Output tokens and wall seconds of the requests ``todo``, ``streams`` at a time (each
    stream sends its next request when its previous one ends); and the errors seen."""
    todo = list(todo)
    tokens, errors = 0, []

    async def stream(session: aiohttp.ClientSession) -> None:
        nonlocal tokens
        while todo:
            p = todo.pop(0)
            target = _Target(url, p.endpoint, None, max_tokens, ignore_eos=True)
            result = await sse_request(session, target, p.text, mode)
            if result.ok:
                tokens += result.output_tokens
            else:
                errors.append(result.error or "failed")

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(stream(session) for _ in range(streams)))
        wall = time.perf_counter() - t0
    return tokens, wall, errors


def run_speed(urls: dict[str, str], prompts: list[Prompt], args: argparse.Namespace,
              log) -> tuple[list[Cell], list[str]]:
    """Every cell, every round, the trees alternating: request by request in the single-stream
    cell (old, new, old, new, ...: the two see the same minute of machine noise), batch by
    batch in the concurrent one; the tree going first swaps every round."""
    cells = [Cell(mode, s) for mode in MODES for s in (1, args.streams)]
    errors: list[str] = []
    for r in range(args.rounds):
        order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
        for cell in cells:
            if cell.streams == 1:
                batches = [[prompts[i % len(prompts)]] for i in range(args.speed_prompts)]
            else:
                batches = [[prompts[i % len(prompts)] for i in range(2 * cell.streams)]]
            tokens, wall = {"old": 0, "new": 0}, {"old": 0.0, "new": 0.0}
            for batch in batches:
                for label in order:
                    n, s, errs = asyncio.run(measure(urls[label], batch, cell.mode,
                                                     cell.streams, args.max_tokens))
                    tokens[label] += n
                    wall[label] += s
                    errors += [f"{label}/{mode_name(cell.mode)} x{cell.streams}: {e}"
                               for e in errs]
            for label in order:
                cell.tok_s[label].append(tokens[label] / wall[label])
            log(f"round {r + 1}/{args.rounds} {mode_name(cell.mode)} x{cell.streams}: old "
                f"{cell.tok_s['old'][-1]:.1f}, new {cell.tok_s['new'][-1]:.1f} tok/s")
    return cells, errors


def speed_rows(cells: list[Cell], bar: float) -> list[list[str]]:
    rows = []
    for c in cells:
        ratios = c.ratios()
        med = statistics.median(ratios) if ratios else float("nan")
        verdict = "ok" if med >= bar else f"below {bar:.2f}x"
        rows.append([mode_name(c.mode), str(c.streams), fmt(statistics.median(c.tok_s["old"])),
                     fmt(statistics.median(c.tok_s["new"])), f"{fmt(med, 3)}x",
                     f"{fmt(min(ratios), 3)}..{fmt(max(ratios), 3)}" if ratios else "-",
                     verdict])
    return rows


# --- main ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python benchmarks/compare_commits.py",
                                 description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", default=None,
                    help="old revision [default: the merge base of main and HEAD]")
    ap.add_argument("--new", default=None,
                    help="new revision [default: this checkout's working tree, as it is]")
    ap.add_argument("--prompts", type=int, default=20, help="prompts in the answer check")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="speed rounds (trees alternating)")
    ap.add_argument("--speed-prompts", type=int, default=4,
                    help="requests per single-stream speed cell")
    ap.add_argument("--streams", type=int, default=8, help="concurrent streams of the second "
                    "speed cell (it sends 2 x this many requests)")
    ap.add_argument("--speed-bar", type=float, default=0.98,
                    help="new / old ratio below which a speed cell is marked")
    ap.add_argument("--no-speed", action="store_true", help="check answers only")
    ap.add_argument("--server-args", default="",
                    help="flags for both servers, e.g. \"--num-threads 1\" [default: none]")
    ap.add_argument("--startup-timeout", type=float, default=1800,
                    help="seconds a server may take to become healthy (a first start compiles "
                         "and tunes the kernels)")
    ap.add_argument("--out", default=None,
                    help="folder for server logs and JSON [default: benchmarks/results/compare]")
    ap.add_argument("--write-results", action="store_true",
                    help="append this comparison to benchmarks/RESULTS.md")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    log = stage_log("compare")

    trees: list[Tree] = []
    scratch: Path | None = None
    try:
        if min(args.prompts, args.rounds, args.speed_prompts, args.streams, args.max_tokens) < 1:
            raise BenchError("--prompts, --rounds, --speed-prompts, --streams and --max-tokens "
                             "must be >= 1")
        out = out_dir(args.out, "compare")
        flags = shlex.split(args.server_args)
        prompts = prompt_set(args.prompts)
        scratch = Path(tempfile.mkdtemp(prefix="specserve-compare-"))
        trees.append(checkout("old", args.old, scratch) if args.old else
                     checkout("old", default_old(), scratch, "the merge base of main and HEAD"))
        trees.append(checkout("new", args.new, scratch) if args.new else working_tree())
        for t in trees:
            log(f"{t.label}: {t.rev} ({t.describe}) at {t.path}")
        return run(args, trees, flags, prompts, out, log)
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        for t in trees:
            remove(t)
        subprocess.run(["git", "worktree", "prune"], cwd=REPO, capture_output=True)
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        log("done")


def run(args: argparse.Namespace, trees: list[Tree], flags: list[str], prompts: list[Prompt],
        out: Path, log) -> int:
    servers = {t.label: tree_server(t, flags, out / f"server-{t.label}.log", args.startup_timeout)
               for t in trees}
    started: list[LaunchedServer] = []
    try:
        for t in trees:  # one at a time: a first start tunes kernels, which wants a quiet CPU
            t0 = time.monotonic()
            started.append(servers[t.label].__enter__())
            log(f"{t.label} server ready in {time.monotonic() - t0:.0f} s "
                f"({servers[t.label].url})")
        urls = {label: s.url for label, s in servers.items()}
        t0 = time.monotonic()
        answers = asyncio.run(collect_answers(urls, prompts, args.max_tokens))
        diffs = differences(prompts, answers)
        log(f"answers: {len(prompts)} prompts x 2 trees x 2 modes in "
            f"{time.monotonic() - t0:.0f} s, {len(diffs)} difference(s)")
        cells, speed_errors = ([], []) if args.no_speed else run_speed(urls, prompts, args, log)
    finally:
        for s in reversed(started):
            s.__exit__()
    return report(args, trees, prompts, answers, diffs, cells, speed_errors, out)


def report(args: argparse.Namespace, trees: list[Tree], prompts: list[Prompt],
           answers: dict[tuple[str, str | None], list[Answer]], diffs: list[str],
           cells: list[Cell], speed_errors: list[str], out: Path) -> int:
    """Prints the comparison (and writes it to JSON and, if asked, RESULTS.md); the exit
    status: 1 when any answer differs or any request failed."""
    old, new = trees
    tokens = sum(a.tokens for a in answers["old", None])
    lines = [f"Old: {old.rev} ({old.describe}); new: {new.rev} ({new.describe}). Server flags: "
             f"`{args.server_args or '(defaults)'}`.", "",
             f"Answers: {len(prompts)} prompts (chat and completions, greedy, max_tokens "
             f"{args.max_tokens}, {tokens} tokens per set) x old/new x default/off speculation: "
             + ("**identical**." if not diffs else f"**{len(diffs)} difference(s)**:"), ""]
    lines += [f"- {d}" for d in diffs[:40]]
    if cells:
        lines += ["", f"Decode speed ({args.max_tokens} tokens per request, EOS ignored; "
                  f"rounds: {args.rounds}, the trees alternating): tok/s medians over rounds, "
                  f"ratio = median of per-round new / old (bar {args.speed_bar}x); indicative "
                  "on a shared machine:", ""]
        lines += md_table(["speculation", "streams", "old tok/s", "new tok/s", "new / old",
                           "range", ""], speed_rows(cells, args.speed_bar))
        if speed_errors:
            lines += ["", f"{len(speed_errors)} speed request(s) failed:", "",
                      *(f"- {e}" for e in speed_errors[:20])]
    print("\n" + "\n".join(lines))
    write_json(out / "compare.json", {
        "old": old.describe, "new": new.describe, "differences": diffs,
        "speed_errors": speed_errors,
        "answers": {f"{k[0]}/{mode_name(k[1])}": v for k, v in answers.items()},
        "speed": [{"mode": mode_name(c.mode), "streams": c.streams, "tok_s": c.tok_s}
                  for c in cells]})
    if args.write_results:
        info = run_info(sys.argv[1:], program="python benchmarks/compare_commits.py")
        write_results_section(f"## No-change check: {old.describe} vs {new.describe}", info,
                              "Answers and decode speed of two commits' default servers "
                              "(benchmarks/compare_commits.py).", lines)
    return 1 if diffs or speed_errors else 0


if __name__ == "__main__":
    sys.exit(main())
