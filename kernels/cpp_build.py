"""Compile-once, load-fast C++ extensions (the quantized kernels, the suffix trie).

torch's builder (``cpp_extension.load``) re-runs ninja on every load to check the build is
current, ~2 s even when nothing changed, and that landed inside the first request that needed
the extension. The build directory is keyed by a hash of the sources, flags, torch and Python,
so a ``<name>.so`` already there is current by construction: it is imported directly, and the
builder runs only when it is missing.
"""

from __future__ import annotations

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
    if built.exists():
        try:
            loader = importlib.machinery.ExtensionFileLoader(name, str(built))
            spec = importlib.util.spec_from_file_location(name, built, loader=loader)
            if spec is not None:
                module = importlib.util.module_from_spec(spec)
                loader.exec_module(module)
                log.info("%s loaded in %.2fs (%s)", name, time.perf_counter() - t0, built)
                return module
        except (ImportError, OSError) as exc:  # e.g. a build cut short: let the builder redo it
            log.warning("%s: cached build unusable (%s); rebuilding", name, exc)
    from torch.utils import cpp_extension

    build_dir.mkdir(parents=True, exist_ok=True)
    module = cpp_extension.load(
        name=name, sources=[str(p) for p in sources], extra_cflags=cflags,
        extra_ldflags=ldflags or [], build_directory=str(build_dir), verbose=False,
    )
    log.info("%s built in %.1fs (%s)", name, time.perf_counter() - t0, build_dir)
    return module
