"""The engine's process keeps one OpenMP team (specserve/engine/openmp_team.py): once the thread
that ran parallel regions first hands its team back, another thread's parallel regions run with
spinning workers instead of workers that sleep and wake at every region.

Counted, not timed, in a fresh interpreter (other tests' threads keep teams of their own):
voluntary context switches of the process over 200 parallel regions run by a second thread.
sentencepiece is imported first when installed: its wheel bundles a libgomp of its own, loaded
before torch's, as in a server that has loaded its tokenizer.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = r"""
import os, sys, threading
try:
    import sentencepiece  # noqa: F401  (a second libgomp, as a server's tokenizer loads it)
except ImportError:
    pass
import torch
from specserve.engine.openmp_team import release_openmp_team

def switches():
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                total += int(f.read().split("voluntary_ctxt_switches:")[1].split()[0])
        except OSError:
            pass
    return total

x = torch.ones(1 << 22)
x.add_(1)  # the main thread's team, as loading and tuning an engine make one
released = release_openmp_team() if sys.argv[1] == "release" else None
counts = {}

def regions():
    x.add_(1)  # this thread's own team (outside the count)
    before = switches()
    for _ in range(200):
        x.add_(1)  # one parallel region each (far above the grain size)
    counts["n"] = switches() - before

t = threading.Thread(target=regions)
t.start()
t.join()
print(released, counts["n"])
"""


def run(mode: str) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH",)}
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                          timeout=300, env=env, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert done.returncode == 0, done.stderr
    released, n = done.stdout.split()
    return released, int(n)


@pytest.mark.skipif(torch.get_num_threads() < 2 or "OpenMP" not in
                    torch.__config__.parallel_info().split("ATen parallel backend:")[-1],
                    reason="needs torch's OpenMP backend with 2+ threads")
@pytest.mark.skipif(bool(os.environ.get("OMP_WAIT_POLICY") or os.environ.get("GOMP_SPINCOUNT")),
                    reason="an explicit OpenMP wait policy decides spinning by itself")
@pytest.mark.e2e  # subprocesses
def test_one_team_spins_two_teams_sleep_at_every_region():
    released, after_release = run("release")
    assert released == "True"
    _, two_teams = run("keep")
    # Two teams: past the core count, libgomp's workers sleep at every region (one wake-up
    # each, ~200); one team spins through them.
    assert two_teams >= 150, two_teams
    assert after_release <= 20, after_release
