"""The KV pool is zeros whose pages the process commits only as blocks are written."""

from __future__ import annotations

from pathlib import Path

import torch

from specserve.target.model_runner import zeroed_pool


def _rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def test_pool_is_zeros_of_its_dtype_and_shape():
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        pool = zeroed_pool((3, 2, 5, 16, 2, 8), dtype, torch.device("cpu"))
        assert pool.dtype == dtype and pool.shape == (3, 2, 5, 16, 2, 8)
        assert pool.is_contiguous() and not pool.any()
        assert pool.data_ptr() % 64 == 0  # as torch's allocator aligns: the kernels' rows
        pool[1, 0, 2] = 1.5  # writable, and a write lands where a view says
        assert pool.sum().item() == 1.5 * 16 * 2 * 8


def test_untouched_blocks_are_not_resident():
    """512 MB of pool: resident memory grows by the one block written, not by the pool (torch.zeros
    would commit all of it)."""
    before = _rss_mb()
    pool = zeroed_pool((32, 2, 1024, 16, 4, 16), torch.float32, torch.device("cpu"))  # 512 MiB
    pool[0, 0, 3:7] = 1.0  # 4 blocks of one layer's keys: 64 KiB in one or two huge pages
    grown = _rss_mb() - before
    assert grown < 64, f"RSS grew {grown:.0f} MB for a 512 MiB pool with 4 blocks written"
    assert pool[0, 0, 3:7].all() and not pool[0, 0, 7].any() and not pool[1].any()


def test_the_rss_benchmark_finds_the_pool_and_its_resident_pages():
    """benchmarks/server_rss.py splits a server's RSS into the pool's resident pages and the rest,
    by the pool's mapping in /proc/PID/smaps: here, a fresh process's own pool (as a server's
    is; in this test process another mapping of the pool's size, touched, may be alive from an
    earlier test, and the benchmark then reads that one)."""
    import json
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    script = """
import json, os, sys, torch
from benchmarks.server_rss import kv_resident_mb
from specserve.target.model_runner import zeroed_pool
shape = (8, 2, 1000, 16, 2, 64)  # 131 MB of float32: a mapping of its own
pool = zeroed_pool(shape, torch.float32, torch.device("cpu"))
nbytes = pool.numel() * 4
untouched = kv_resident_mb(os.getpid(), nbytes)
pool[3] = 2.0  # one layer's keys and values: 16.4 MB (+ up to two 2 MB huge pages' edges)
print(json.dumps([untouched, kv_resident_mb(os.getpid(), nbytes)]))
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 0, out.stderr
    untouched, touched = json.loads(out.stdout.strip().splitlines()[-1])
    assert untouched is not None and untouched < 16
    assert 16.3 <= touched - untouched <= 16.4 + 4.2, (untouched, touched)
