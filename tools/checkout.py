"""Run the code of one source checkout, whichever checkout the environment has installed.

pyproject's ``package-dir`` installs the folders ``kernels/``, ``target/``, ``draft/`` and
``distill/`` as ``specserve.kernels`` etc. An editable install (``make install``) maps those names
to ITS checkout, so code run from another checkout of the same repository (a git worktree, an
old commit that ``benchmarks/compare_commits.py`` serves) would mix its own ``specserve/`` with
the installed checkout's folders. ``use(root)`` puts a finder first on ``sys.meta_path`` that
resolves ``specserve`` and the mapped folders from ``root``, read from ``root``'s own
pyproject. Development tooling only: the installed package never changes its import path.

    python tools/checkout.py ROOT -m specserve serve ...   # any module, run from ROOT's code
    python tools/checkout.py ROOT script.py args ...
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import runpy
import sys
from pathlib import Path

import tomllib


class CheckoutFinder(importlib.abc.MetaPathFinder):
    """``specserve`` and its mapped subpackages from one checkout's folders."""

    def __init__(self, root: Path) -> None:
        self.root = root.resolve()
        tool = tomllib.loads((self.root / "pyproject.toml").read_text())["tool"]["setuptools"]
        self.folders = {"specserve": self.root / "specserve"} | {
            pkg: self.root / folder for pkg, folder in tool.get("package-dir", {}).items()}

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.folders:
            folder = self.folders[fullname]
            return importlib.util.spec_from_file_location(
                fullname, folder / "__init__.py", submodule_search_locations=[str(folder)])
        parent = fullname.rpartition(".")[0]
        if parent in self.folders:  # a direct child: the installed finder must not answer
            return importlib.machinery.PathFinder.find_spec(fullname, [str(self.folders[parent])])
        return None


def use(root: Path) -> None:
    """From now on this process imports ``specserve`` from ``root`` (before anything imports
    it)."""
    if "specserve" in sys.modules:
        raise RuntimeError("tools.checkout.use must run before specserve is imported")
    sys.meta_path.insert(0, CheckoutFinder(root))
    sys.path.insert(0, str(Path(root).resolve()))  # tests/, benchmarks/, tools/ of that root


def command(root: Path) -> list[str]:
    """The argv prefix that runs a module or script of ``root`` with ``root``'s code."""
    return [sys.executable, str(Path(__file__).resolve()), str(Path(root).resolve())]


def main(argv: list[str]) -> None:
    if len(argv) < 2:
        sys.exit(__doc__)
    root, rest = Path(argv[0]), argv[1:]
    use(root)
    if rest[0] == "-m":
        if len(rest) < 2:
            sys.exit("tools/checkout.py ROOT -m MODULE [args]: MODULE missing")
        sys.argv = [rest[1], *rest[2:]]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = rest
        runpy.run_path(rest[0], run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
