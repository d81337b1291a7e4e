"""What every benchmark mode shares at its edges: run metadata (machine, commit, command),
workload prompt files, output folders, JSON files, markdown tables and the RESULTS.md section."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parent  # benchmarks/
RESULTS_MD = ROOT / "RESULTS.md"


class BenchError(Exception):
    """A user-facing problem (bad flag, missing file, server that will not start): the CLI
    prints it as one line and exits 2."""


@dataclass
class RunInfo:
    machine: str
    cpu: str
    cpu_count: int
    torch_threads: int
    torch: str
    transformers: str
    gpu: str | None
    python: str
    commit: str
    command: str
    started: str

    def describe(self) -> str:
        gpu = f", GPU {self.gpu}" if self.gpu else ", no GPU"
        return (f"{self.cpu} ({self.cpu_count} cores, {self.torch_threads} torch threads){gpu}, "
                f"{self.machine}, Python {self.python}, torch {self.torch}, transformers "
                f"{self.transformers}; commit {self.commit}")


def check_plain(num_drafted: int, what: str) -> None:
    """Plain decoding means speculation off: a "plain" answer that drafted anything (the
    engine's default method is auto) makes the benchmark stop instead of timing the wrong
    thing."""
    if num_drafted:
        raise BenchError(f"{what}: {num_drafted} tokens drafted in a plain (speculation off) "
                         "run: it must send speculative off")


def run_info(argv: list[str], program: str = "python -m benchmarks") -> RunInfo:
    import torch
    import transformers

    from specserve.kernels.tuner import (
        cpu_model,  # one reading of the CPU model for tuner and reports
    )

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return RunInfo(
        machine=f"{platform.system()} {platform.machine()}", cpu=cpu_model(),
        cpu_count=os.cpu_count() or 0, torch_threads=torch.get_num_threads(),
        torch=str(torch.__version__), transformers=str(transformers.__version__), gpu=gpu,
        python=platform.python_version(), commit=_commit(),
        command=f"{program} {shlex.join(argv)}".rstrip(),
        started=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )


def lscpu_summary() -> str:
    """The lines of ``lscpu`` a timing depends on (model, cores, threads per core, caches,
    flags that pick kernels), as one line; "" where lscpu is missing."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""
    keep = ("Model name", "CPU(s)", "Thread(s) per core", "Core(s) per socket", "L2 cache",
            "L3 cache", "Hypervisor vendor")
    fields = {}
    for line in out.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keep and key.strip() not in fields:
            fields[key.strip()] = " ".join(value.split())
    flags = set(next((ln.split(":", 1)[1].split() for ln in out.splitlines()
                      if ln.startswith("Flags:")), []))
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if f in flags]
    parts = [f"{k} {fields[k]}" for k in keep if k in fields]
    return "; ".join(parts + ([f"flags {' '.join(isa)}"] if isa else []))


def _commit() -> str:
    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    sha = git("rev-parse", "--short", "HEAD") or "unknown"
    # Uncommitted changes make the numbers not reproducible from the hash alone: say so.
    return sha + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def stage_log(tag: str):
    """A progress printer for a long benchmark: ``[tag  123s] text``, seconds since this call."""
    t_start = time.monotonic()

    def log(text: str) -> None:
        print(f"[{tag} {time.monotonic() - t_start:6.0f}s] {text}", flush=True)

    return log


def load_workload(name: str) -> list[str]:
    """Prompts of benchmarks/prompts/<name>.json, or of a JSON file path: a list of strings."""
    path = Path(name) if name.endswith(".json") else ROOT / "prompts" / f"{name}.json"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in (ROOT / "prompts").glob("*.json")))
        raise BenchError(f"workload {name!r} not found ({path}); known: {known}")
    try:
        prompts = json.loads(path.read_text())
    except ValueError as exc:
        raise BenchError(f"{path} is not valid JSON: {exc}") from exc
    if not (isinstance(prompts, list) and prompts and all(isinstance(p, str) for p in prompts)):
        raise BenchError(f"{path} must hold a non-empty JSON list of prompt strings")
    return prompts


def parse_list(text: str, kind: type, flag: str) -> list:
    """"1,4,16" -> [1, 4, 16]; "" -> []."""
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise BenchError(f"{flag} takes a comma-separated list of {kind.__name__}s "
                         f"(got {text!r})") from exc


def add_output_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--out", default=None,
                    help="folder for JSON results and PNG plots [default: benchmarks/results/MODE]")
    ap.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    ap.add_argument("--write-results", action="store_true",
                    help="replace this mode's section of benchmarks/RESULTS.md")


def out_dir(out: str | None, mode: str) -> Path:
    path = Path(out) if out else ROOT / "results" / mode
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise BenchError(f"cannot create the output folder {path}: {exc}") from exc
    return path


def write_json(path: Path, obj: object) -> None:
    """Dataclasses / Structs to indented JSON (NaN and infinity become null)."""
    raw = msgspec.json.encode(obj, enc_hook=_encode_other)
    path.write_bytes(msgspec.json.format(raw, indent=2) + b"\n")


def _encode_other(obj: object) -> object:
    item = getattr(obj, "item", None)  # numpy scalars
    if callable(item):
        return item()
    return str(obj)  # torch.dtype, TorchVersion, paths


def fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or value != value else f"{value:.{digits}f}"


def md_table(headers: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers),
            *("| " + " | ".join(r) + " |" for r in rows)]


def results_section(heading: str, info: RunInfo, intro: str, body: list[str]) -> str:
    """A RESULTS.md section: heading, what ran, machine and commit, the command, the body."""
    return "\n".join([
        heading, "", intro, "", f"Machine: {info.describe()}. Run started {info.started}.", "",
        f"Command: `{info.command}`", "", *body, "",
    ])


def write_results_section(heading: str, info: RunInfo, intro: str, body: list[str]) -> None:
    """Replaces (or appends) the ``heading`` section of benchmarks/RESULTS.md."""
    write_section(RESULTS_MD, heading, results_section(heading, info, intro, body))


def publish(heading: str, section: str, write: bool) -> None:
    """Prints a script's results section and, when ``write`` (no ``--no-write``), puts it in
    benchmarks/RESULTS.md under ``heading``."""
    print(section)
    if write:
        write_section(RESULTS_MD, heading, section)


def write_section(path: Path, heading: str, section: str) -> None:
    """Puts ``section`` in place of the section headed exactly ``heading`` (up to the next
    '## '), or appends it. The replaced section stays, right below the new one, under
    ``heading`` plus the date it ran, so a rerun never erases an earlier measurement."""
    text = path.read_text() if path.exists() else "# Benchmark results\n\n"
    start = _heading_at(text, heading)
    if start == -1:
        path.write_text(text.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n")
        return
    end = text.find("\n## ", start + len(heading))
    old = text[start:end + 1] if end != -1 else text[start:]
    rest = text[end + 1:] if end != -1 else ""
    same = old.rstrip("\n") == section.rstrip("\n")  # the same text written twice
    kept = "" if same else _as_earlier(old, heading)
    text = text[:start] + section.rstrip("\n") + "\n" + ("\n" + kept if kept else "") + (
        "\n" + rest if rest else "")
    path.write_text(text)


def _heading_at(text: str, heading: str) -> int:
    """Where ``heading`` stands as a whole line (a longer heading it prefixes does not count)."""
    at = 0
    while (at := text.find(heading, at)) != -1:
        line_start = at == 0 or text[at - 1] == "\n"
        line_end = at + len(heading) == len(text) or text[at + len(heading)] == "\n"
        if line_start and line_end:
            return at
        at += len(heading)
    return -1


def _as_earlier(old: str, heading: str) -> str:
    """The replaced section under a heading that names when it ran."""
    mark = "Run started "
    when = "date not recorded"
    if mark in old:
        when = old[old.index(mark) + len(mark):].split(".", 1)[0].split("\n", 1)[0].strip()
    body = old[len(heading):]
    return f"{heading} (earlier run, {when}){body.rstrip(chr(10))}\n"
