"""What every test module shares: the run's own cache folder, torch's thread count restored after
each test, and the fixtures of tests/fixtures/ (tiny models and engines built once per run).
Plain helpers (the one tiny-model builder, reference computations, the in-process server) are in
tests/helpers/; no test module imports from another.

The cache. specserve keeps what it builds and measures on a machine under
``$SPECSERVE_CACHE_DIR`` (default ``~/.cache/specserve``): compiled C++ extensions (``ext/``),
kernel-tuning tables (``tune/``) and converted GGUF folders (``gguf-*``). A test run points it at
a new folder of its own, removed when the run ends, so no test reads or writes the user's cache,
and each run tunes and converts afresh, as a first start on a new machine does. Subprocesses
(the CLI, servers, Ray workers) inherit the variable, so they share the run's folder.

One part outlives the run: the compiled extensions. Compiling them takes minutes on a busy
2-core machine, and the result depends only on what they are compiled from. The run folder's
``ext/`` is a link to ``build/test-ext/`` in this checkout (gitignored; ``make clean`` removes
it), the tests' own build cache: every build sits in a folder named by a hash of its sources,
compiler flags, torch and Python versions (``quant_ext.build_key``, ``suffix_trie_ext.build_key``;
the same keys the user's cache uses), so a build found there is exactly what compiling now would
produce, and a changed source compiles afresh beside the old one. The tests of building and of
caching themselves (test_cpp_build.py, test_loader.py's GGUF cache, the tuner's table) use their
own tmp folders.

Markers (registered in pyproject.toml, ``--strict-markers``): ``e2e`` spawns a server or a
subprocess, or drives a real client over HTTP; ``browser`` drives Chromium; ``ray`` starts a Ray
cluster; ``slow`` is the rest of what takes long. ``make test-fast`` runs everything else.

The code under test is this checkout's (``tools/checkout.py``), whichever checkout the
environment has installed; subprocesses (servers, the CLI) run the installed one, which
``make test`` makes this checkout.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from tools import checkout

if "specserve" not in __import__("sys").modules:  # the suite tests THIS checkout's code, even
    checkout.use(Path(__file__).resolve().parent.parent)  # where another one is installed

from tests.fixtures.models import model_dir, models, offline, text_model  # noqa: E402,F401

_RUN_CACHE = pytest.StashKey[Path]()
_PREVIOUS = pytest.StashKey[str | None]()


def pytest_configure(config: pytest.Config) -> None:
    run_dir = Path(tempfile.mkdtemp(prefix="specserve-test-cache-"))
    builds = Path(config.rootpath) / "build" / "test-ext"
    builds.mkdir(parents=True, exist_ok=True)
    (run_dir / "ext").symlink_to(builds, target_is_directory=True)
    config.stash[_RUN_CACHE] = run_dir
    config.stash[_PREVIOUS] = os.environ.get("SPECSERVE_CACHE_DIR")
    os.environ["SPECSERVE_CACHE_DIR"] = str(run_dir)


def pytest_unconfigure(config: pytest.Config) -> None:
    run_dir = config.stash.get(_RUN_CACHE, None)
    if run_dir is None:
        return
    previous = config.stash.get(_PREVIOUS, None)
    if previous is None:
        os.environ.pop("SPECSERVE_CACHE_DIR", None)
    else:
        os.environ["SPECSERVE_CACHE_DIR"] = previous
    (run_dir / "ext").unlink(missing_ok=True)  # the link only, never the builds behind it
    shutil.rmtree(run_dir, ignore_errors=True)


@pytest.fixture(autouse=True)
def _torch_threads():
    """An engine sets torch's thread count and the kernels' pool policy for the whole process
    (``num_threads``, or the setup it chose at start-up); each test gets back the ones it
    started with, so no setting leaks into later tests. (The policy is read only where the
    kernels' extension is loaded already: this fixture never builds it.)"""
    from specserve.kernels import quant_ext, thread_policy

    n = torch.get_num_threads()
    policy = thread_policy.in_force()  # before the extension loads: the one it loads with
    yield
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    if quant_ext.loaded() and thread_policy.current() != policy:
        thread_policy.apply(policy)
