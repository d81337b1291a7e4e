"""Compile-once, load-fast C++ extensions (the quantized kernels, the suffix trie).

torch's builder (``cpp_extension.load``) re-runs ninja on every load to check the build is
current, ~2 s even when nothing changed, and that landed inside the first request that needed
the extension. The build directory is keyed by a hash of the sources, flags, torch and Python,
so a ``<name>.so`` already there is current by construction: it is imported directly, and the
builder runs only when it is missing.

Builds are serialized by an ``flock`` on ``<build_dir>/.build.lock``, which the OS releases when
its holder dies. torch's own lock (a ``lock`` file it deletes when done) outlives a build that was
killed, and every later start then waits on it forever; under our lock nobody else is building in
that folder, so such a file is stale and is removed.
"""

from __future__ import annotations

import fcntl
import importlib.machinery
import importlib.util
import logging
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)


def load_extension(name: str, sources: list[Path], build_dir: Path, cflags: list[str],
                   ldflags: list[str] | None = None) -> ModuleType:
    """The module ``name`` built from ``sources`` in ``build_dir`` (a directory whose name
    already encodes everything the build depends on)."""
    import torch  # noqa: F401  (the extension links libtorch: torch must be loaded first)

    t0 = time.perf_counter()
    built = build_dir / f"{name}.so"
    module = _import_built(name, built)
    if module is not None:
        log.info("%s loaded in %.2fs (%s)", name, time.perf_counter() - t0, built)
        return module
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # another process may be building the same folder
        module = _import_built(name, built)  # it has: use its build
        if module is not None:
            log.info("%s loaded in %.2fs after another process built it", name,
                     time.perf_counter() - t0)
            return module
        stale = build_dir / "lock"
        if stale.exists():
            log.warning("%s: removing %s left by a build that was killed", name, stale)
            stale.unlink()
        module = cpp_extension.load(
            name=name, sources=[str(p) for p in sources], extra_cflags=cflags,
            extra_ldflags=ldflags or [], build_directory=str(build_dir), verbose=False,
        )
    log.info("%s built in %.1fs (%s)", name, time.perf_counter() - t0, build_dir)
    return module


def _import_built(name: str, built: Path) -> ModuleType | None:
    """The module at ``built`` if it imports; None when it is missing or unusable (e.g. a build
    cut short: the builder then redoes it)."""
    if not built.exists():
        return None
    try:
        loader = importlib.machinery.ExtensionFileLoader(name, str(built))
        spec = importlib.util.spec_from_file_location(name, built, loader=loader)
        if spec is None:
            return None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        return module
    except (ImportError, OSError) as exc:
        log.warning("%s: cached build unusable (%s); rebuilding", name, exc)
        return None
