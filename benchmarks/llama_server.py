"""llama.cpp's own server and bench tool, built once on this machine, as the baseline our
benchmarks measure against (an optional benchmark tool: nothing in specserve needs it to serve).

    python benchmarks/llama_server.py build            # or: make llama-server
    python benchmarks/llama_server.py serve [--model PATH.gguf] [--threads 2] [--slots 1]
        [--spec-type ngram-mod] [--port 8080]
    python benchmarks/llama_server.py bench [--model PATH.gguf] [--threads 2]   # llama-bench tg128

The source is the llama.cpp tree vendored in the llama-cpp-python sdist (``LLAMA_CPP_PYTHON``),
fetched with pip (``pip download --no-binary :all: --no-deps``); it is built with cmake
(``-DGGML_NATIVE=ON -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF``, targets ``llama-server
llama-bench``, ~15 minutes on 2 cores; on CPUs with AMX also without ggml's AMX kernels,
``NO_AMX``). Layout, under ``cache_root()`` (``SPECSERVE_CACHE_DIR``,
default ``~/.cache/specserve``):

    llama.cpp/src-<version>/     the vendored llama.cpp sources
    llama.cpp/build-<version>/   the cmake build; binaries in bin/ (-noamx on AMX CPUs)
    llama.cpp/build-<version>.log

A build is reused when both binaries are there and run; only what is missing is fetched or built,
and a lock file keeps two processes from building at once.
"""

from __future__ import annotations

import argparse
import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from benchmarks.launched_server import free_port, health_ok, stop_children_on_sigterm  # noqa: E402
from benchmarks.report import BenchError  # noqa: E402
from specserve.core.paths import cache_root  # noqa: E402
from specserve.kernels.quant_ext import cpu_flags  # noqa: E402

LLAMA_CPP_PYTHON = "0.3.36"  # the sdist whose vendored llama.cpp we build
CMAKE_FLAGS = ["-DGGML_NATIVE=ON", "-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF"]
# On a CPU with AMX, GGML_NATIVE compiles ggml's AMX matmuls in, and 0.3.36's llama-server dies
# of SIGILL in them at its first batch (tinygemm_kernel_amx<block_q8_0>, 2-core Xeon,
# 2026-12-07; granting the process the tile state first does not help). Built without them it
# runs its AVX-512 VNNI kernels; the build folder says so (build-<version>-noamx).
NO_AMX = ["-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16",
          "-DCMAKE_CXX_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"]


def _has_amx() -> bool:
    return "amx_tile" in cpu_flags()


TARGETS = ["llama-server", "llama-bench"]
# llama-server's speculative types that need no second model, and the one that does.
NGRAM_SPEC_TYPES = ("ngram-mod", "ngram-simple", "ngram-map-k")
DRAFT_SPEC_TYPE = "draft-simple"
# How llama-server's log says it will not draft with the -md model (a vocabulary it cannot
# verify token for token): the most specific line first. 0.3.36 logs the first and keeps
# serving without speculation; other versions exit with it.
DRAFT_REFUSALS = ("failed to initialize speculative decoding", "vocab type must match",
                  "vocabs are not compatible")
_LOG_PREFIX = re.compile(r"^\s*[\d.:]+\s+[A-Z]\s+")  # "0.01.927.582 E " (time, level)


class DraftRefused(BenchError):
    """llama-server would not use the draft model it was given; ``line`` is its own words."""

    def __init__(self, line: str, log_path: Path) -> None:
        super().__init__(f"llama-server refused this draft: {line} (log: {log_path})")
        self.line = line


def draft_refusal(log: str) -> str | None:
    """llama-server's line refusing its draft model, without the time and level, or None."""
    lines = log.splitlines()
    for marker in DRAFT_REFUSALS:
        for line in lines:
            if marker in line:
                return " ".join(_LOG_PREFIX.sub("", line).split())
    return None


@dataclass(frozen=True)
class LlamaCpp:
    """Where this machine's llama.cpp build lives."""

    version: str
    src: Path
    build: Path
    log: Path

    @property
    def server(self) -> Path:
        return self.build / "bin" / "llama-server"

    @property
    def bench(self) -> Path:
        return self.build / "bin" / "llama-bench"

    @classmethod
    def at(cls, version: str = LLAMA_CPP_PYTHON) -> LlamaCpp:
        base = cache_root() / "llama.cpp"
        name = f"build-{version}" + ("-noamx" if _has_amx() else "")
        return cls(version, base / f"src-{version}", base / name, base / f"{name}.log")

    def ready(self) -> bool:
        return runs(self.server) and runs(self.bench)


def runs(binary: Path) -> bool:
    """The binary starts and answers ``--help`` (a half-written build does not)."""
    if not binary.is_file():
        return False
    try:
        done = subprocess.run([str(binary), "--help"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def ensure_built(llama: LlamaCpp | None = None, log=print) -> LlamaCpp:
    """The build, made first if it is missing or does not run."""
    llama = llama or LlamaCpp.at()
    if llama.ready():
        return llama
    llama.build.parent.mkdir(parents=True, exist_ok=True)
    with open(llama.build.parent / f".build-{llama.version}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process may be building: wait for it
        if llama.ready():
            return llama
        if not (llama.src / "CMakeLists.txt").is_file():
            fetch_source(llama, log)
        build(llama, log)
    if not llama.ready():
        raise BenchError(f"the llama.cpp build finished but {llama.server} or {llama.bench} "
                         f"does not run; see {llama.log}")
    return llama


def fetch_source(llama: LlamaCpp, log=print) -> None:
    """The llama.cpp tree vendored in the llama-cpp-python sdist, unpacked to ``llama.src``."""
    log(f"fetching llama-cpp-python=={llama.version} (sdist) for its vendored llama.cpp")
    with tempfile.TemporaryDirectory(dir=llama.src.parent) as tmp:
        _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
              "-d", tmp, f"llama-cpp-python=={llama.version}"], "pip download")
        sdists = list(Path(tmp).glob("llama_cpp_python-*.tar.gz"))
        if not sdists:
            raise BenchError(f"pip download left no llama_cpp_python sdist in {tmp}")
        with tarfile.open(sdists[0]) as tar:
            tar.extractall(tmp, filter="data")
        vendored = next(Path(tmp).glob("llama_cpp_python-*/vendor/llama.cpp"), None)
        if vendored is None or not (vendored / "CMakeLists.txt").is_file():
            raise BenchError(f"{sdists[0].name} holds no vendor/llama.cpp tree")
        if llama.src.exists():
            shutil.rmtree(llama.src)
        shutil.move(str(vendored), llama.src)


def build(llama: LlamaCpp, log=print) -> None:
    jobs = str(os.cpu_count() or 2)
    log(f"building {' '.join(TARGETS)} in {llama.build} (~15 minutes on 2 cores; log: "
        f"{llama.log})")
    with llama.log.open("ab") as out:
        flags = CMAKE_FLAGS + (NO_AMX if _has_amx() else [])
        for cmd in (["cmake", "-S", str(llama.src), "-B", str(llama.build), *flags],
                    ["cmake", "--build", str(llama.build), "--target", *TARGETS, "-j", jobs]):
            if shutil.which(cmd[0]) is None:
                raise BenchError("cmake is missing: install it (apt-get install cmake)")
            done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT)
            if done.returncode != 0:
                raise BenchError(f"{' '.join(cmd[:3])} failed (exit {done.returncode}); see "
                                 f"{llama.log}")


def _run(cmd: list[str], what: str) -> None:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:]
        raise BenchError(f"{what} failed (exit {done.returncode}): {tail[0] if tail else ''}")


class LlamaServer:
    """``llama-server`` on a free port (or ``port``), ready once ``/health`` says 200, stopped
    with SIGTERM. ``slots`` is ``-np``: how many streams it decodes together. ``ctx_per_slot``
    tokens of context each (llama-server splits ``-c`` over its slots). A ``draft_model`` it
    refuses (its log says so, whether it exits or serves on without drafting) raises
    ``DraftRefused``: what it would measure is not the draft it was asked to run."""

    def __init__(self, model: str, threads: int, slots: int = 1, *,
                 spec_type: str | None = None, draft_model: str | None = None,
                 ctx_per_slot: int = 2048, port: int | None = None,
                 log_path: Path | None = None, timeout: float = 120.0,
                 llama: LlamaCpp | None = None) -> None:
        llama = llama or LlamaCpp.at()
        if not llama.ready():
            raise BenchError(f"llama-server is not built ({llama.server}): run `make "
                             "llama-server` (python benchmarks/llama_server.py build)")
        if spec_type == DRAFT_SPEC_TYPE and draft_model is None:
            raise BenchError("--spec-type draft-simple needs a draft GGUF (-md)")
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [str(llama.server), "-m", model, "-t", str(threads), "-tb", str(threads),
                        "-np", str(slots), "-c", str(ctx_per_slot * slots),
                        "--host", "127.0.0.1", "--port", str(self.port), "--no-webui"]
        if spec_type:
            self.command += ["--spec-type", spec_type]
        if draft_model:
            self.command += ["-md", draft_model]
        self.spec_type, self.slots, self.draft_model = spec_type, slots, draft_model
        self.log_path = log_path or Path(tempfile.gettempdir()) / f"llama-server-{self.port}.log"
        self.timeout = timeout
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LlamaServer:
        stop_children_on_sigterm()
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._check_draft()
                tail = self.log_path.read_text(errors="replace").strip().splitlines()[-1:]
                raise BenchError(f"llama-server exited with code {self.proc.returncode}: "
                                 f"{tail[0] if tail else ''} (log: {self.log_path})")
            if health_ok(self.url):
                try:
                    self._check_draft()  # the log is complete: it loads before it listens
                except DraftRefused:
                    self.__exit__()
                    raise
                return self
            time.sleep(0.25)
        self.__exit__()
        raise BenchError(f"llama-server was not ready after {self.timeout:.0f} s "
                         f"(log: {self.log_path})")

    def _check_draft(self) -> None:
        if self.draft_model is None:
            return
        line = draft_refusal(self.log_path.read_text(errors="replace"))
        if line is not None:
            raise DraftRefused(line, self.log_path)

    def __exit__(self, *exc: object) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def default_gguf() -> str:
    from specserve.engine.models import default_model_path

    return default_model_path()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("build", help="build llama-server and llama-bench (once; cached)")
    for name in ("serve", "bench"):
        p = sub.add_parser(name)
        p.add_argument("--model", default=None, help="a .gguf [default: the built-in model]")
        p.add_argument("--threads", type=int, default=2)
    srv = sub.choices["serve"]
    srv.add_argument("--slots", type=int, default=1, help="-np: streams decoded together")
    srv.add_argument("--spec-type", default=None,
                     choices=[*NGRAM_SPEC_TYPES, DRAFT_SPEC_TYPE])
    srv.add_argument("--draft-model", default=None, help="a draft .gguf (draft-simple)")
    srv.add_argument("--port", type=int, default=8080)
    args = ap.parse_args(argv)
    try:
        llama = ensure_built()
        if args.cmd == "build":
            print(f"llama-server: {llama.server}\nllama-bench: {llama.bench}")
            return 0
        model = args.model or default_gguf()
        if args.cmd == "bench":
            return subprocess.run([str(llama.bench), "-m", model, "-t", str(args.threads),
                                   "-p", "0", "-n", "128"]).returncode
        with LlamaServer(model, args.threads, args.slots, spec_type=args.spec_type,
                         draft_model=args.draft_model, port=args.port) as server:
            print(f"llama-server ready at {server.url} (Ctrl-C stops it)", flush=True)
            try:
                assert server.proc is not None
                server.proc.wait()
            except KeyboardInterrupt:
                pass
        return 0
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
