"""README.md documents the CLI as it is: its flag tables are what ``specserve serve --help``
says, and every ``--flag`` it names is a flag some ``specserve`` command takes."""

from __future__ import annotations

import argparse
import re

from tools import flag_table

# flags of other programs the README quotes: pip, tools/flag_table.py
FOREIGN = {"--no-deps", "--write"}


def all_options() -> set[str]:
    from specserve.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {s for p in [parser, *sub.choices.values()] for a in p._actions
            for s in a.option_strings}


def test_readme_flag_tables_match_the_cli():
    readme = flag_table.README.read_text()
    assert flag_table.replaced(readme, flag_table.tables()) == readme, (
        "README.md's flag tables are out of date: run `python -m tools.flag_table --write`")


def test_every_flag_the_readme_names_exists():
    readme = flag_table.README.read_text()
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", readme))
    unknown = sorted(named - all_options() - FOREIGN)
    assert not unknown, f"README.md names flags no specserve command takes: {unknown}"


def test_a_changed_help_text_shows_as_stale():
    """The check can fail: a table that no longer matches the parser is caught."""
    readme = flag_table.README.read_text()
    block = flag_table.tables()
    assert "| `--port` | 8000 |" in block
    stale = flag_table.replaced(readme, block.replace("| `--port` | 8000 |", "| `--port` | 80 |"))
    assert flag_table.replaced(stale, block) != stale
