"""specserve.kernels: attention, norm, rotary and block-quantized matmul kernels.

This folder installs as ``specserve.kernels`` (pyproject's package-dir). From the repo root (the
tests, the benchmarks) it is also on sys.path as a top-level ``kernels``, the name of Hugging
Face's kernel hub package, which transformers imports whenever it is installed (transformers
5.25 requires it). Imported under that name, this file hands the import the installed package,
so transformers gets its own and nothing of ours runs twice.
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    # sys.path without the entries whose kernels/ is a specserve checkout's (this one, or a
    # worktree's that a benchmark put there too)
    _path = [p for p in sys.path if not os.path.isfile(
        os.path.join(os.path.abspath(p or os.curdir), "kernels", "quant_ext.py"))]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _path)
    if _spec is None or _spec.loader is None:
        raise ImportError("no top-level package `kernels` is installed: this folder is "
                          "specserve.kernels' source, import it as specserve.kernels")
    _hub = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _hub  # what the import statement returns once this file ends
    _spec.loader.exec_module(_hub)
