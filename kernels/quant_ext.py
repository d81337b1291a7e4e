"""Builds and loads the CPU extension: block-quantized matmuls (kernels/csrc/qgemm.cpp) and the
fused float32 ops of the quantized decode path (kernels/csrc/fused.cpp).

The extension is compiled on first use with torch's own C++ extension builder (gcc, ninja) and
cached under ``$SPECSERVE_CACHE_DIR/ext/<key>``, keyed by the source, the torch version and the
Python version, so later starts load it in well under a second. It needs AVX2 and FMA (every
x86-64 server CPU since 2013); elsewhere ``available()`` is False and quantized models fall back
to torch kernels (see kernels/quant.py). Faster forms for CPUs with AVX-VNNI, AVX-512 VNNI or
AMX-INT8 (kernels/csrc/amx.cpp) are compiled in beside the AVX2 one (function-level targets)
and chosen at run time: the kernel tuner times every form this CPU runs (``supported_isas``),
since the fastest one differs by CPU.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
import sys
import threading
from pathlib import Path
from types import ModuleType

import torch

from specserve.core.paths import cache_root
from specserve.kernels.cpp_build import load_extension

log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("qgemm.cpp", "fused.cpp", "pool.cpp", "amx.cpp")]
# not compiled on their own, but part of what a build depends on
_HEADERS = [_CSRC / "pool.h", _CSRC / "amx.h", _CSRC / "block_simd.h"]
# -fopenmp: the kernels' regions run on their own pool (csrc/pool.h), but its openmp policy
# (the old static split, kept for comparisons) calls at::parallel_for, OpenMP pragmas in a
# header. The extension's libgomp.so.1 resolves to the one torch has already loaded.
_FLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-ffp-contract=off", "-fopenmp"]


def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_supported() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and {"avx2", "fma", "f16c"} <= cpu_flags()


def build_key() -> str:
    """Changes whenever the sources, flags, torch or Python change (the kernel tuner keys its
    table on it too: a rebuilt kernel is re-measured)."""
    source = b"".join(p.read_bytes() for p in _SOURCES + _HEADERS)
    return hashlib.sha256(
        source + " ".join(_FLAGS).encode() + torch.__version__.encode() + sys.version.encode()
    ).hexdigest()[:16]


# One build at a time in this process: an engine starts the build in a thread while its model
# loads (specserve/engine/prebuild.py), and the first layer that needs the kernels waits here.
_LOAD_LOCK = threading.Lock()


def load() -> ModuleType:
    """The compiled extension; builds it on the first call on this machine. Raises
    ``RuntimeError`` with the reason when it cannot be had here."""
    with _LOAD_LOCK:
        return _load()


def loaded() -> bool:
    """True once the extension is loaded in this process (nothing is built or imported)."""
    return _load.cache_info().currsize > 0


@functools.cache
def _load() -> ModuleType:
    if not cpu_supported():
        raise RuntimeError("the block-quantized CPU kernels need an x86-64 CPU with AVX2 and FMA")
    key = build_key()
    module = load_extension(f"specserve_qgemm_{key}", _SOURCES,
                            cache_root() / "ext" / f"qgemm-{key}", _FLAGS, ["-fopenmp"])
    from specserve.kernels.thread_policy import from_env  # imports this module

    try:  # SPECSERVE_THREAD_POLICY: how the kernels' regions wait (no result changes)
        policy = from_env()
    except ValueError as exc:  # a typo must not cost the kernels: say so, keep the default
        log.warning("%s; keeping the default thread policy", exc)
        policy = None
    if policy is not None:
        module.set_thread_policy(policy.spin_us, policy.wait_us, policy.openmp, policy.threads,
                                 policy.chunks)
    return module


@functools.cache
def available() -> bool:
    """True when the extension is (or can be) built and loaded on this machine. Cached, so a
    machine without a compiler tries (and warns) once, not once per layer."""
    try:
        load()
        return True
    except Exception as exc:  # a missing compiler, a CPU without AVX2: fall back, say why once
        log.warning("block-quantized CPU kernels unavailable, using torch kernels: %s", exc)
        return False


# The block kernels' instruction-set forms, in the C++ extension's numbering (qgemm.cpp).
ISAS = ("avx2", "avxvnni", "avx512vnni", "amx")
# Rows per pass each form takes: 16 (16 at a time, the rest in one pass) needs AVX-512's 32
# vector registers for 16 rows' accumulators beside a block's codes; AMX's tiles hold 16 rows.
ROWS_PER_PASS = {"avx2": (1, 2, 4, 8), "avxvnni": (1, 2, 4, 8), "avx512vnni": (1, 2, 4, 8, 16),
                 "amx": (16,), "avx2p5": (1, 2, 4, 8)}


@functools.cache
def supported_isas() -> tuple[str, ...]:
    """The forms of the block kernels this CPU runs, AVX2 first; () without the extension."""
    if not available():
        return ()
    ext = load()
    return tuple(name for i, name in enumerate(ISAS) if ext.block_isa_supported(i))


# The AVX2 form on a layer's five-bit planes (kernels/quant.py's P5_FORM bit), a tuner candidate
# of the layers that hold them.
FIVE_BIT = "avx2p5"


def kernel_code(name: str) -> int:
    """``"<isa>/<rows per pass>"`` (a tuner candidate) -> block_linear's kernel argument;
    ``"avx2p5/<rows>"``: the AVX2 form on the layer's five-bit planes (bit 1 << 10, which the
    layer strips)."""
    isa, _, rows = name.partition("/")
    if isa == FIVE_BIT:
        return (1 << 10) | kernel_code(f"avx2/{rows}")
    if isa not in ISAS or not rows.isdigit() or int(rows) not in ROWS_PER_PASS[isa]:
        forms = ", ".join(f"{i}/<{'|'.join(map(str, r))}>" for i, r in ROWS_PER_PASS.items())
        raise ValueError(f"unknown block kernel {name!r}: expected one of {forms}")
    return 32 * ISAS.index(isa) + int(rows)
