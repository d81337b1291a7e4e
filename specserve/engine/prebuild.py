"""Compiling the C++ extensions beside the model's loading.

A first start on a machine compiles two extensions: the kernels (kernels/quant_ext.py, three
translation units) and the suffix trie (draft/suffix_trie_ext.py, one). Built one after the
other, at the moment a layer or the suffix proposer first needs them, the compiler ran alone for
long stretches on one core of two while the model waited. Started in threads when an engine
begins to build, the compilers (child processes) run beside the model's loading and beside each
other; whichever part first needs an extension waits for its build (each ``load`` is locked),
and a machine that has them cached only imports them. A build that fails is reported by the
extension's own ``available()`` (once, with the reason), exactly as without this.
"""

from __future__ import annotations

import threading


def start_builds() -> list[threading.Thread]:
    """Starts building (or importing) both extensions in daemon threads; returns them."""
    from specserve.draft import suffix_trie_ext
    from specserve.kernels import quant_ext

    threads = [threading.Thread(target=ext.available, name=f"build-{name}", daemon=True)
               for name, ext in (("kernels", quant_ext), ("suffix-trie", suffix_trie_ext))]
    for t in threads:
        t.start()
    return threads


def build_all() -> dict[str, bool]:
    """Builds both extensions now, side by side (``specserve build``); which ones are usable."""
    from specserve.draft import suffix_trie_ext
    from specserve.kernels import quant_ext

    for t in start_builds():
        t.join()
    return {"kernels": quant_ext.available(), "suffix trie": suffix_trie_ext.available()}
