"""specserve: the engine, server and CLI; ``specserve.kernels``, ``specserve.target``,
``specserve.draft`` and ``specserve.distill`` live in the folders beside this one and install
under this package (pyproject ``package-dir``), so nothing named ``kernels`` or ``draft`` lands
at the top of site-packages (Hugging Face's kernel hub package is called ``kernels``)."""

from pathlib import Path

# Run from a source checkout (tests, benchmarks, the GPU recipe, a worktree beside another tree's
# editable install), the four folders resolve from THIS checkout: the checkout's root joins the
# package's search path. An installed wheel has them under specserve/ and no pyproject.toml
# beside it, so this does nothing there.
_ROOT = Path(__file__).resolve().parent.parent
if (_ROOT / "pyproject.toml").is_file() and all(
    (_ROOT / name / "__init__.py").is_file() for name in ("kernels", "target", "draft", "distill")
):
    __path__.append(str(_ROOT))
