"""The GPU recipe: teacher data (tokens only, >= 1M answer tokens) and the EAGLE head, on a lent
GPU machine. A development tool, not part of the installed package: it is written for one
remote-machine tool's limits. That tool copies the working tree (64 MiB a call, carried paths
included), runs one bash command (<= 2,000 characters, <= 10 minutes) and returns what it wrote
under $OUT (<= 8 files of <= 16 MiB, 64 MiB in all). The machine has torch with CUDA and
transformers but not gguf, msgspec or structlog, and reaches no network.

The default target (SmolLM2-135M-Instruct.Q4_1.gguf, 98 MB) does not fit in one call beside the
~29 MB tree, nor in two halves: it travels in N parts (3 for today's tree), one per call, stored
outside the repository (/root/specserve-gguf) between calls. The machine stays warm only ~30 s
after a call, so run the calls back to back: if it is given back in between, the stored parts
are gone and the last call says so (start again at call 1).

Here, once, in the root of the checkout the device tool sends (the one it copies, whichever
worktree made the change; it splits the GGUF into .gguf_parts/, downloads the wheels into
.whl/, adds both to .git/info/exclude, and prints the exact calls, with the number of parts
computed from that tree's size):

    python -m tools.gpu_recipe prepare

The calls for a 3-part split (what ``prepare`` printed for this tree):

  call 1, carry [".whl", ".gguf_parts/part-1-of-3"] (stores part 1; checks the engine on CUDA
  with random weights of the target's shape, picks the dtype/backend that work, measures speed):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
    TQDM_MININTERVAL=20 || exit; python3 -m tools.gpu_recipe store
    .gguf_parts/part-1-of-3 && python3 -m tools.gpu_recipe check --out $OUT

  call 2, carry [".gguf_parts/part-2-of-3"]:

    python3 -m tools.gpu_recipe store .gguf_parts/part-2-of-3

  call 3, carry [".whl", ".gguf_parts/part-3-of-3"] (reassembles and checks the sha256, makes
  the teacher data, trains the EAGLE head if `specserve distill --method eagle` exists, packs):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
    TQDM_MININTERVAL=20 || exit; python3 -m tools.gpu_recipe store
    .gguf_parts/part-3-of-3 && python3 -m tools.gpu_recipe run --out $OUT --minutes 9

(each command is one line; wrapped here). ``run`` writes to $OUT: ``speeds.json`` (data
generation and training: tokens, seconds, tok/s, which engine options ran), ``recipe.log``
(the last 4 MB of all output) and ``results.tar.gz.00`` .. (<= 15 MiB pieces; rejoin with
``cat results.tar.gz.* | tar xz``): the head folder ``eagle/``, ``eagle_curve.jsonl``, and
``data/`` (train and held-out shards, gen_log.jsonl). Left on the machine: /root/run.

On a CPU machine the same ``check``/``run`` paths work (tiny runs: ``--minutes``, ``--tokens``),
which is how they are tested; ``datagen JSON`` is the internal step they run in a subprocess.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
STORE = Path(os.environ.get("SPECSERVE_RECIPE_STORE", "/root/specserve-gguf"))
PARTS = ".gguf_parts"
WHEELS = {"gguf": "0.19.0", "msgspec": "0.23.0", "structlog": "26.1.0"}
CALL_LIMIT = 64 << 20  # what one call may carry, the tree included
PIECE = 15 << 20  # $OUT file pieces (the limit is 16 MiB a file, 64 MiB in all)
# Engine options tried in order until one runs on the machine: (dtype, attention backend).
ENGINE_OPTIONS = [("bfloat16", "auto"), ("float32", "auto"), ("bfloat16", "torch")]
# The target's shape (SmolLM2-135M), for the random-weight check of call 1.
SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    max_position_embeddings=8192, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
PRE = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade "
       "--target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 "
       "TQDM_MININTERVAL=20 || exit; ")
# Run uninstalled from the tree's root: ``-m`` puts the root on sys.path, so both ``tools`` and
# ``specserve`` (whose __init__.py finds distill/ etc. beside it) import from this tree.
RECIPE = "python3 -m tools.gpu_recipe"


# --- here: prepare ----------------------------------------------------------------------------


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def _tree_bytes() -> int:
    """What a call sends besides carried paths: tracked and untracked-not-ignored files."""
    names = _git("ls-files", "-z").split("\0") + _git(
        "ls-files", "-o", "--exclude-standard", "-z").split("\0")
    return sum((ROOT / n).stat().st_size for n in names if n and (ROOT / n).is_file())


def prepare(gguf: Path | None) -> list[tuple[str, list[str]]]:
    """Wheels, GGUF parts and excludes; returns (command, carry) per call."""
    exclude = Path(_git("rev-parse", "--git-common-dir").strip())
    exclude = (exclude if exclude.is_absolute() else ROOT / exclude) / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    lines = exclude.read_text().splitlines() if exclude.is_file() else []
    with open(exclude, "a") as f:
        for pattern in ("/.whl/", f"/{PARTS}/"):
            if pattern not in lines:
                f.write(pattern + "\n")
    whl = ROOT / ".whl"
    for name, version in WHEELS.items():
        if not list(whl.glob(f"{name}-{version}-*.whl")):
            subprocess.run([
                sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
                "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64",
                "--platform", "manylinux2014_x86_64", "-d", str(whl), f"{name}=={version}",
            ], check=True)
    if gguf is None:
        from specserve.engine.models import default_model_path

        gguf = Path(default_model_path())
    if _sha256(gguf) != GGUF_SHA256:
        raise SystemExit(f"{gguf} is not the GGUF this recipe expects (sha256 {GGUF_SHA256})")
    wheels = sum(p.stat().st_size for p in whl.glob("*.whl"))
    room = CALL_LIMIT - _tree_bytes() - wheels - (2 << 20)  # 2 MiB to spare
    size = gguf.stat().st_size
    n = math.ceil(size / room)
    parts = ROOT / PARTS
    shutil.rmtree(parts, ignore_errors=True)
    parts.mkdir()
    with open(gguf, "rb") as src:
        for i in range(1, n + 1):
            (parts / f"part-{i}-of-{n}").write_bytes(src.read(math.ceil(size / n)))
    calls = []
    for i in range(1, n + 1):
        part = f"{PARTS}/part-{i}-of-{n}"
        store = f"{RECIPE} store {part}"
        if i == 1:
            calls.append((f"{PRE}{store} && {RECIPE} check --out $OUT", [".whl", part]))
        elif i < n:
            calls.append((store, [part]))
        else:
            calls.append((f"{PRE}{store} && {RECIPE} run --out $OUT --minutes 9",
                          [".whl", part]))
    return calls


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# --- there: store, check, run -------------------------------------------------------------------


def store(parts: list[str]) -> None:
    STORE.mkdir(parents=True, exist_ok=True)
    for part in parts:
        shutil.copyfile(part, STORE / Path(part).name)
        print(f"stored {part} ({Path(part).stat().st_size} bytes) in {STORE}")


def assemble() -> Path:
    """The GGUF from the stored parts, checked against its sha256."""
    target = STORE / GGUF_NAME
    if target.is_file() and _sha256(target) == GGUF_SHA256:
        return target
    parts = sorted(STORE.glob("part-*-of-*"), key=lambda p: int(p.name.split("-")[1]))
    if not parts:
        raise RuntimeError(f"no GGUF parts in {STORE}: run every call of the recipe, "
                           f"back to back on one warm machine")
    n = int(parts[0].name.rsplit("-", 1)[1])
    missing = sorted(set(range(1, n + 1)) - {int(p.name.split("-")[1]) for p in parts})
    if missing:
        raise RuntimeError(f"GGUF parts {missing} of {n} are not in {STORE}: the machine was "
                           f"given back between calls; run all calls again, back to back")
    with open(target, "wb") as out:
        for p in parts:
            out.write(p.read_bytes())
    if _sha256(target) != GGUF_SHA256:
        raise RuntimeError(f"reassembled {target} has the wrong sha256; rerun `prepare`")
    return target


class Recipe:
    """Runs steps as subprocesses (a crash or hang of one leaves the rest able to report),
    logging everything to ``log`` and results to ``report``."""

    def __init__(self, out: Path, work: Path) -> None:
        self.out, self.work = out, work
        out.mkdir(parents=True, exist_ok=True)
        work.mkdir(parents=True, exist_ok=True)
        self.log = work / "recipe.log"
        self.report: dict = {"started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.t0 = time.monotonic()

    def say(self, text: str) -> None:
        line = f"[recipe {time.monotonic() - self.t0:6.1f}s] {text}"
        print(line, flush=True)
        with open(self.log, "a") as f:
            f.write(line + "\n")

    def sh(self, args: list[str], timeout: float) -> int:
        self.say(f"$ {' '.join(args)}  (timeout {timeout:.0f}s)")
        with open(self.log, "a") as f:
            try:
                proc = subprocess.run(args, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                      timeout=max(timeout, 1))
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = 124
        self.say(f"exit {rc}")
        return rc

    def left(self, minutes: float) -> float:
        return minutes * 60 - (time.monotonic() - self.t0)

    def datagen(self, spec: dict, timeout: float, choice: tuple[str, str] | None) -> dict | None:
        """Teacher data with the first engine option that works; its gen_log record."""
        import torch

        tried = ENGINE_OPTIONS if torch.cuda.is_available() else [("float32", "auto")]
        options = ([choice] if choice else []) + [o for o in tried if o != choice]
        for dtype, backend in options:
            if timeout < 30:
                break
            start = time.monotonic()
            run_spec = dict(spec, dtype=dtype, attention_backend=backend)
            rc = self.sh([sys.executable, "-m", "tools.gpu_recipe", "datagen",
                          json.dumps(run_spec)], timeout)
            timeout -= time.monotonic() - start
            log = Path(spec["out"]) / "data" / "gen_log.jsonl"
            if log.is_file():
                record = json.loads(log.read_text().splitlines()[-1])
                record.update(exit=rc, dtype=dtype, attention_backend=backend)
                return record
            if any((Path(spec["out"]) / "data" / "train").glob("shard-*.pt")):
                return {"exit": rc, "dtype": dtype, "attention_backend": backend,
                        "note": "stopped before its log line (timeout); shards kept"}
            self.report.setdefault("failed_engine_options", []).append([dtype, backend, rc])
        return None

    def finish(self, pack: list[str]) -> None:
        self.report["seconds"] = round(time.monotonic() - self.t0, 1)
        (self.out / "speeds.json").write_text(json.dumps(self.report, indent=1) + "\n")
        if pack:
            self._pack(pack)
        data = self.log.read_bytes()
        (self.out / "recipe.log").write_bytes(data[-(4 << 20):])

    def _pack(self, names: list[str]) -> None:
        tar = self.work / "results.tar.gz"
        with tarfile.open(tar, "w:gz") as t:
            for name in names:
                if (self.work / name).exists():
                    t.add(self.work / name, arcname=name)
        blob = tar.read_bytes()
        if len(blob) > 4 * PIECE:
            self.say(f"results.tar.gz is {len(blob)} bytes: only its first 60 MiB come back")
        for i in range(min(4, math.ceil(len(blob) / PIECE))):
            (self.out / f"results.tar.gz.{i:02d}").write_bytes(blob[i * PIECE:(i + 1) * PIECE])


def check(out: Path) -> None:
    """Call 1: the engine on this GPU with random weights of the target's shape, through the
    same data path; the first engine option that works is kept for ``run``."""
    import torch

    r = Recipe(out, STORE / "check")
    r.report["torch"] = torch.__version__
    r.report["cuda"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    model = STORE / "rand135m"
    if not (model / "config.json").is_file():
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**SMOLLM2_135M)).to(torch.bfloat16).save_pretrained(model)
        tok = ROOT / "specserve" / "drafts" / "smollm2-135m-instruct"
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copyfile(tok / name, model / name)
    on_gpu = torch.cuda.is_available()
    spec = dict(out=str(r.work / "data-run"), target=str(model), corpus=True, turns=2,
                num_prompts=512 if on_gpu else 4, num_heldout=0,
                max_new_tokens=128 if on_gpu else 8,
                gen_batch=256 if on_gpu else 4, chunk_size=256 if on_gpu else 2,
                logprobs=False, data_minutes=0.75)
    shutil.rmtree(spec["out"], ignore_errors=True)
    record = r.datagen(spec, timeout=240 if on_gpu else 900, choice=None)
    r.report["random_weights_datagen"] = record
    if record is not None:
        (STORE / "engine.json").write_text(json.dumps([record["dtype"],
                                                       record["attention_backend"]]))
    r.finish([])


def run(out: Path, minutes: float, tokens: int, max_new_tokens: int, gen_batch: int,
        heldout: int, train_args: str) -> None:
    """The last call: GGUF, teacher data, EAGLE head, results."""
    work = Path(os.environ.get("SPECSERVE_RECIPE_WORK", "/root/run"))
    r = Recipe(out, work)
    try:
        gguf = assemble()
    except RuntimeError as exc:
        r.say(str(exc))
        r.report["error"] = str(exc)
        r.finish([])
        raise SystemExit(1) from exc
    r.say(f"target {gguf} (sha256 ok)")
    import torch

    on_gpu = torch.cuda.is_available()
    r.report["cuda"] = torch.cuda.get_device_name() if on_gpu else None
    engine = STORE / "engine.json"
    choice = tuple(json.loads(engine.read_text())) if engine.is_file() else None
    # Data: about 45% of the call (it starts no shard past the deadline, counted after the
    # engine's start), training the rest.
    data_minutes = max(0.5, min(4.5, 0.45 * r.left(minutes) / 60))
    spec = dict(out=str(work), target=str(gguf), corpus=True, turns=2, num_heldout=heldout,
                max_new_tokens=max_new_tokens, gen_batch=gen_batch,
                chunk_size=2 * gen_batch, logprobs=False, max_data_tokens=tokens,
                data_minutes=data_minutes)
    t = time.monotonic()
    r.report["datagen"] = r.datagen(spec, timeout=data_minutes * 60 + 180, choice=choice)
    r.report["datagen_seconds"] = round(time.monotonic() - t, 1)
    helptext = subprocess.run([sys.executable, "-m", "specserve", "distill", "--help"],
                              cwd=ROOT, capture_output=True, text=True).stdout
    train_minutes = (r.left(minutes) - 60) / 60  # packing and a margin
    if "--method" not in helptext or "eagle" not in helptext:
        r.say("this tree has no `specserve distill --method eagle`: data only")
    elif train_minutes < 0.5:
        r.say(f"no time left to train ({train_minutes:.1f} min)")
    else:
        t = time.monotonic()
        # --max-minutes bounds the training loop; the target's load comes on top of it
        args = [sys.executable, "-m", "specserve", "distill", "--method", "eagle",
                "--target", str(gguf), "--out", str(work), "--max-minutes",
                f"{max(0.3, train_minutes - 1.0):.2f}",
                *(["--device", "cuda"] if on_gpu else []), *train_args.split()]
        r.report["train_exit"] = r.sh(args, timeout=train_minutes * 60)
        r.report["train_seconds"] = round(time.monotonic() - t, 1)
        curve = work / "eagle_curve.jsonl"
        if curve.is_file() and curve.read_text().strip():
            r.report["train_last"] = json.loads(curve.read_text().splitlines()[-1])
    r.finish(["eagle", "eagle_curve.jsonl", "data"])


def datagen(spec_json: str) -> None:
    """One teacher-data run from a JSON DataGenConfig (the recipe's subprocess step)."""
    from specserve.distill.datagen import DataGenConfig, run_datagen

    spec = json.loads(spec_json)
    spec["out"] = Path(spec["out"])
    print(json.dumps(run_datagen(DataGenConfig(**spec))))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m tools.gpu_recipe", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("prepare", help="here: wheels, GGUF parts, excludes; prints the calls")
    s.add_argument("--gguf", type=Path, default=None)
    s = sub.add_parser("store", help="there: keep GGUF parts outside the tree")
    s.add_argument("parts", nargs="+")
    s = sub.add_parser("check", help="there: the engine on CUDA with random weights")
    s.add_argument("--out", type=Path, required=True)
    s = sub.add_parser("run", help="there: reassemble, teacher data, EAGLE head, results")
    s.add_argument("--out", type=Path, required=True)
    s.add_argument("--minutes", type=float, default=9.0, help="the whole call's budget")
    s.add_argument("--tokens", type=int, default=1_000_000, help="teacher answer tokens")
    s.add_argument("--max-new-tokens", type=int, default=512)
    s.add_argument("--gen-batch", type=int, default=256)
    s.add_argument("--heldout", type=int, default=156, help="held-out conversations")
    s.add_argument("--train-args", default="", help="more `distill --method eagle` flags")
    s = sub.add_parser("datagen", help="internal: one data run from a JSON DataGenConfig")
    s.add_argument("spec")
    a = p.parse_args(argv)
    if a.cmd == "prepare":
        for i, (command, carry) in enumerate(prepare(a.gguf), start=1):
            print(f"call {i}: carry {json.dumps(carry)}\n  {command}\n")
    elif a.cmd == "store":
        store(a.parts)
    elif a.cmd == "check":
        check(a.out)
    elif a.cmd == "run":
        run(a.out, a.minutes, a.tokens, a.max_new_tokens, a.gen_batch, a.heldout,
            a.train_args)
    else:
        datagen(a.spec)


if __name__ == "__main__":
    main()
