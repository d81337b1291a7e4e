"""Builds and loads the C++ suffix trie (draft/csrc/suffix_trie.cpp), the fast twin of
draft/suffix_trie.py.

It is compiled on first use with torch's C++ extension builder (a C++ compiler and ninja, both
needed for the quantized kernels too) and cached under ``$SPECSERVE_CACHE_DIR/ext/<key>``, keyed
by the source, the torch version and the Python version; later starts import the built module
directly (kernels/cpp_build.py). Plain C++17, no CPU-specific instructions. Where it cannot be
built, ``load`` raises and the suffix proposer falls back to the Python trie (same drafts,
slower; it logs why once).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import sys
import threading
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "suffix_trie.cpp"
_FLAGS = ["-O2", "-std=c++17"]


def build_key() -> str:
    import torch

    return hashlib.sha256(
        _SOURCE.read_bytes() + " ".join(_FLAGS).encode() + torch.__version__.encode()
        + sys.version.encode()
    ).hexdigest()[:16]


_LOAD_LOCK = threading.Lock()  # one build at a time (specserve/engine/prebuild.py starts one early)


def load() -> ModuleType:
    """The compiled module (``.SuffixTrie``); builds it on the first call on this machine.
    Raises with the reason when it cannot be had here."""
    with _LOAD_LOCK:
        return _load()


@functools.cache
def _load() -> ModuleType:
    from specserve.core.paths import cache_root
    from specserve.kernels.cpp_build import load_extension

    key = build_key()
    return load_extension(f"specserve_suffix_{key}", [_SOURCE],
                          cache_root() / "ext" / f"suffix-{key}", _FLAGS)


@functools.cache
def available() -> bool:
    """True when the C++ trie is (or can be) built here; tries, and warns, once."""
    try:
        load()
        return True
    except Exception as exc:  # no compiler, no ninja: the Python trie drafts the same, slower
        log.warning("C++ suffix trie unavailable, using the Python trie: %s", exc)
        return False
