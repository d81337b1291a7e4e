"""The GPU recipe's plumbing, without a GPU: the GGUF travels in parts and is rebuilt only when
every part is there and the sha256 matches; results come back in pieces under the size limit."""

from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tools import gpu_recipe


@pytest.fixture
def store(tmp_path, monkeypatch):
    blob = bytes(range(256)) * 1000
    monkeypatch.setattr(gpu_recipe, "STORE", tmp_path / "store")
    monkeypatch.setattr(gpu_recipe, "GGUF_SHA256", hashlib.sha256(blob).hexdigest())
    parts = []
    for i, start in enumerate(range(0, len(blob), 100_000), start=1):
        part = tmp_path / "carried" / f"part-{i}-of-3"
        part.parent.mkdir(exist_ok=True)
        part.write_bytes(blob[start:start + 100_000])
        parts.append(str(part))
    return blob, parts


def test_parts_reassemble_to_the_checked_file(store):
    blob, parts = store
    gpu_recipe.store(parts[::-1])  # any order
    assert gpu_recipe.assemble().read_bytes() == blob


def test_a_missing_part_says_the_machine_was_given_back(store):
    _, parts = store
    gpu_recipe.store([parts[0], parts[2]])
    with pytest.raises(RuntimeError, match=r"parts \[2\] of 3.*given back"):
        gpu_recipe.assemble()


def test_a_corrupt_part_is_refused(store):
    _, parts = store
    gpu_recipe.store(parts)
    (gpu_recipe.STORE / "part-2-of-3").write_bytes(b"x" * 100_000)
    with pytest.raises(RuntimeError, match="sha256"):
        gpu_recipe.assemble()


def test_results_come_back_in_pieces_that_rejoin(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_recipe, "PIECE", 4096)
    r = gpu_recipe.Recipe(tmp_path / "out", tmp_path / "work")
    (r.work / "data").mkdir()
    payload = os.urandom(12_000)  # incompressible: 3 pieces
    (r.work / "data" / "shard-00000.pt").write_bytes(payload)
    r.say("hello")
    r.finish(["data", "absent"])
    pieces = sorted((tmp_path / "out").glob("results.tar.gz.*"))
    assert len(pieces) >= 2 and all(p.stat().st_size <= 4096 for p in pieces)
    joined = b"".join(p.read_bytes() for p in pieces)
    with tarfile.open(fileobj=io.BytesIO(joined), mode="r:gz") as t:
        assert t.extractfile("data/shard-00000.pt").read() == payload
    assert "hello" in (tmp_path / "out" / "recipe.log").read_text()
    assert (tmp_path / "out" / "speeds.json").is_file()


@pytest.mark.e2e
def test_the_recipe_runs_uninstalled_from_the_tree(tmp_path):
    """Call 2 as the GPU machine runs it: the bare tree, no install (-S: no site-packages), the
    printed command from the repo root; the part lands in the store."""
    root = Path(gpu_recipe.__file__).resolve().parent.parent
    part = tmp_path / "part-2-of-3"
    part.write_bytes(b"abc")
    python, flag, module = gpu_recipe.RECIPE.split()
    assert (python, flag) == ("python3", "-m")
    env = {**os.environ, "SPECSERVE_RECIPE_STORE": str(tmp_path / "store")}
    subprocess.run([sys.executable, "-S", "-m", module, "store", str(part)], cwd=root, env=env,
                   check=True, capture_output=True)
    assert (tmp_path / "store" / "part-2-of-3").read_bytes() == b"abc"
