"""specserve/engine/prebuild.py: the C++ extensions build side by side (`specserve build`, and
an engine's first start while its files are read); a built machine only imports them."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from specserve.draft import suffix_trie_ext
from specserve.engine import prebuild
from specserve.kernels import quant_ext


def test_concurrent_loads_share_one_module():
    """The engine's build thread and a layer's first call may ask at once: one module, no
    second build, and ``loaded`` says so."""
    for t in prebuild.start_builds():
        t.join()
    got: list[object] = []
    threads = [threading.Thread(target=lambda: got.append(quant_ext.load())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4 and all(m is got[0] for m in got)
    assert quant_ext.loaded()
    assert suffix_trie_ext.available()


@pytest.mark.slow
@pytest.mark.e2e
def test_specserve_build_compiles_both_then_only_imports(tmp_path):
    """A fresh cache: `specserve build` compiles both extensions and exits 0; run again, it
    rewrites neither (the cached builds are imported)."""
    env = {**os.environ, "SPECSERVE_CACHE_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "specserve", "build"]
    first = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "kernels: ready" in first.stdout and "suffix trie: ready" in first.stdout
    built = sorted((tmp_path / "ext").glob("*/*.so"))
    assert [p.parent.name.split("-")[0] for p in built] == ["qgemm", "suffix"]
    stamps = [p.stat().st_mtime_ns for p in built]
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    assert [p.stat().st_mtime_ns for p in built] == stamps
