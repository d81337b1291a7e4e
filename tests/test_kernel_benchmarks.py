"""The kernel probes (benchmarks/probes/ kernel_forms.py, attention_cost.py, cpu_roofline.py):
flag errors are one line, attention_cost times a baseline build, and cpu_roofline's peak loops
run what they claim to."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="module")
def extension_built() -> None:
    """The C++ extension the scripts load, built (or read from the build cache) here, so a
    first build never runs inside a script's timeout."""
    from specserve.kernels import quant_ext

    quant_ext.load()


@pytest.mark.parametrize("script, args, message", [
    ("attention_cost.py", ["--baseline-key", "0000000000000000", "--no-write"], "no cached build"),
    ("attention_cost.py", ["--rows", "1,x", "--no-write"], "--rows takes a comma-separated"),
    ("attention_cost.py", ["--kv-cache-dtypes", "float32,fp8", "--no-write"],
     "--kv-cache-dtypes takes float32, float16, bfloat16"),
    ("attention_cost.py", ["--kv-cache-dtypes", "float32,bfloat16", "--form", "8", "--no-write"],
     "drop --form and --baseline-key"),
    ("kernel_forms.py", ["--rows", "two", "--no-write"], "--rows takes a comma-separated"),
    ("cpu_roofline.py", ["--rows", "1,200", "--contexts", "100", "--no-write"],
     "every --rows value must be <= every --contexts value"),
])
@pytest.mark.e2e
def test_kernel_benchmarks_reject_bad_flags_with_one_line(script, args, message,
                                                          extension_built):
    """A bad flag is a one-line error and exit code 2, not a traceback."""
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "probes" / script), *args],
                          capture_output=True, text=True, timeout=1800, cwd=root)  # a hang
    assert proc.returncode == 2, proc.stderr
    assert message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.e2e
def test_attention_cost_times_a_baseline_build(extension_built):
    """--baseline-key runs a cached build's attention beside this one's, with the same form
    argument: here the current build against itself (its cache entry exists once loaded)."""
    from specserve.kernels import quant_ext

    root = Path(__file__).resolve().parent.parent
    args = ["--baseline-key", quant_ext.build_key(), "--contexts", "40", "--rows", "1,3",
            "--repeats", "1", "--num-threads", "1", "--no-write"]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "probes" /
                                               "attention_cost.py"), *args],
                          capture_output=True, text=True, timeout=1800, cwd=root)
    assert proc.returncode == 0, proc.stderr
    assert "| context | 1 rows ms baseline -> this (speedup) |" in proc.stdout, proc.stdout
    cell = r"\d+\.\d\d -> \d+\.\d\d \(\d+\.\d\dx\)"
    assert re.search(rf"^\| 40 \| {cell} \| {cell} \|$", proc.stdout, re.M), proc.stdout


def test_peak_loops_run_every_chain_on_every_thread():
    """benchmarks/probes/cpu_roofline.py's peak loops keep each chain's value (x * 1 + 0, or
    + 0 * 1 products): the sum they return is 0 + 1 + .. + 15 per thread (per lane of
    lane-summed kinds), so every chain of every thread ran; an unknown kind is refused by name."""
    from benchmarks.probes.cpu_roofline import KINDS, peak_extension

    ext = peak_extension()
    threads = torch.get_num_threads()
    lanes = {"fma256": 1, "fma512": 16, "dpbusd256": 1, "dpbusd512": 16, "dpbf16_512": 16}
    ran = [k for k in KINDS if ext.supported(k)]
    assert "fma256" in ran  # every CPU the kernels build for has AVX2 + FMA
    for kind in ran:
        assert ext.run(kind, 3) == 120 * lanes[kind] * threads, kind
    assert not ext.supported("amx")
    with pytest.raises(RuntimeError, match="amx does not run on this CPU"):
        ext.run("amx", 1)
