"""One OpenMP team per engine process.

libgomp spins at its barriers only while the process holds no more OpenMP threads than the
machine has cores; past that it "throttles": a worker that reaches a barrier sleeps on a futex
and is woken at the next parallel region. A thread that has run a parallel region keeps its team
alive, so a server whose main thread built the engine (loading and kernel tuning run parallel
regions) and whose engine thread then decodes holds two teams: on 2 cores, 3 OpenMP threads
plus the main one. Every one of the ~300 parallel regions of a SmolLM2-135M decode step then
costs a sleep and a wake-up (measured: 312 voluntary context switches per token; 0 with one
team), and on a quiet 2-core machine the server's plain decoding ran at 69-76 tok/s against
192-210 in process. Handing the builder's team back before the engine thread starts leaves one.
"""

from __future__ import annotations

import ctypes


def release_openmp_team() -> bool:
    """Frees the calling thread's OpenMP thread team in every libgomp the process has loaded
    (``omp_pause_resource_all``: in libgomp it frees just the calling thread's pool). Wheels
    bundle their own copies (torch's, sentencepiece's), and only torch's runs the kernels, so
    each copy is asked. Intel's runtime is left alone (there it would stop every team). False
    where no libgomp is loaded or no call succeeded."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return False
    paths = {fields[-1] for fields in map(str.split, maps.splitlines())
             if len(fields) >= 6 and "/libgomp" in fields[-1]}
    released = False
    for path in sorted(paths):
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all  # the loaded copy: dlopen reuses it
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        released |= pause(2) == 0  # omp_pause_hard
    return released
