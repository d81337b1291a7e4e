"""Where specserve keeps what it builds and measures on this machine: compiled extensions, kernel
tuning tables, converted GGUF folders. ``SPECSERVE_CACHE_DIR`` moves it (tests point it at a
folder of their own, so they never touch the user's cache)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("SPECSERVE_CACHE_DIR") or Path.home() / ".cache" / "specserve")
