"""Module boundaries that keep the front end free of import cycles: the WebSocket, the
playground and the shared request plumbing (api.py) never import the REST module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "specserve"


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("name", ["ws.py", "playground.py", "api.py"])
def test_front_end_modules_do_not_import_server(name):
    assert "specserve.server" not in imported_modules(PKG / name)


def test_api_imports_no_transport():
    mods = imported_modules(PKG / "api.py")
    assert not mods & {"specserve.ws", "specserve.playground", "specserve.server"}
