"""Module boundaries: the package is layered and no import runs back up a layer; the front end
is free of import cycles (the WebSocket, the playground and the shared request plumbing in api.py
never import the aiohttp app module); everything is imported under the one installed package,
``specserve`` (kernels/, target/, draft/ and distill/ install as ``specserve.kernels`` etc.; see
pyproject.toml)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.module_graph import PKG, ROOT, imported_modules

# folder at the repo root -> the package it installs as
SUBPACKAGES = {name: f"specserve.{name}" for name in ("kernels", "target", "draft", "distill")}
SOURCE_DIRS = ["specserve", *SUBPACKAGES, "benchmarks", "tests"]
# Bottom to top: a module may import its own layer and the layers below it, never above.
LAYERS = [
    ["specserve.core"],  # shared types: errors, config, sampling params, sampling, sequence
    ["specserve.kernels"],
    ["specserve.target"],
    ["specserve.draft"],
    ["specserve.spec"],  # speculator, policy, acceptance model, rejection sampler
    ["specserve.engine"],  # engine, async engine, scheduler, block manager, outputs, tokenizer
    ["specserve.server"],  # HTTP, WebSocket, protocol, OpenAPI, deadlines, metrics, playground
    ["specserve.scale", "specserve.distill"],  # Ray Serve replicas; making drafts
    ["specserve.cli", "specserve.__main__"],
]
# Upward imports allowed: none.
KNOWN_UPWARD: set[str] = set()


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] in SUBPACKAGES:
        parts = ["specserve", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(module: str) -> int | None:
    for i, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    return None


def package_files() -> list[Path]:
    return sorted(p for folder in ["specserve", *SUBPACKAGES]
                  for p in (ROOT / folder).rglob("*.py"))


def test_every_module_has_a_layer():
    assert [module_name(p) for p in package_files()
            if layer_of(module_name(p)) is None and module_name(p) != "specserve"] == []


def test_no_import_runs_up_a_layer():
    bad = []
    for path in package_files():
        name = module_name(path)
        own = layer_of(name)
        for mod in imported_modules(path):
            other = layer_of(mod)
            if own is not None and other is not None and other > own:
                bad.append(f"{name} imports {mod}")
    assert set(bad) == KNOWN_UPWARD


@pytest.mark.parametrize("name", ["ws.py", "playground.py", "api.py"])
def test_front_end_modules_do_not_import_server(name):
    assert "specserve.server.app" not in imported_modules(PKG / "server" / name)


def test_api_imports_no_transport():
    mods = imported_modules(PKG / "server" / "api.py")
    assert not mods & {"specserve.server.ws", "specserve.server.playground",
                       "specserve.server.app"}


def test_nothing_imports_the_folders_as_top_level_packages():
    """`from kernels.metadata import ...` would still run from the repo root (the folder is on
    sys.path there) but load a second copy of the module (two AttentionMetadata classes) and
    fail once installed, where no top-level `kernels` exists."""
    bad = []
    for folder in SOURCE_DIRS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for mod in imported_modules(path):
                if mod.split(".")[0] in SUBPACKAGES:
                    bad.append(f"{path.relative_to(ROOT)}: {mod}")
    assert not bad, "import these as specserve.<name>: " + "; ".join(bad)


def test_install_layout_is_one_top_level_package():
    """pyproject maps each folder to specserve.<folder>, lists every package (a folder with
    __init__.py) so the wheel holds it, and installs nothing else at the top level."""
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python >= 3.11")
    tool = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    package_dir = tool["package-dir"]
    assert package_dir == {pkg: folder for folder, pkg in SUBPACKAGES.items()}
    on_disk = {module_name(init) for init in PKG.rglob("__init__.py")} | {
        ".".join((SUBPACKAGES[init.relative_to(ROOT).parts[0]],
                  *init.relative_to(ROOT).parts[1:-1]))
        for folder in SUBPACKAGES for init in (ROOT / folder).rglob("__init__.py")
    }
    assert set(tool["packages"]) == on_disk
    assert {p.split(".")[0] for p in tool["packages"]} == {"specserve"}
    assert set(tool["package-data"]) <= set(tool["packages"])


@pytest.mark.e2e
def test_a_checkout_runs_its_own_folders(tmp_path):
    """tools/checkout.py runs this checkout's specserve.kernels etc.; -S: no site-packages, so
    no installed finder could answer instead (and the package itself changes no import path:
    without the tool, the folders are not found)."""
    code = ("import specserve.kernels, specserve.target, specserve.draft, specserve.distill as d; "
            "print(d.__file__)")
    script = tmp_path / "where.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-S", str(ROOT / "tools" / "checkout.py"), str(ROOT),
                          str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         check=True).stdout
    assert Path(out.strip()) == ROOT / "distill" / "__init__.py"
    bare = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path,
                          env={**env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    assert bare.returncode != 0 and "specserve.kernels" in bare.stderr
