"""Reading a settings table: a frozen msgspec Struct whose fields carry their type, default,
bounds and help text (``Annotated[int, Meta(ge=1, description=...)]``, ``Literal[...]`` for
choices). ``EngineConfig`` is such a table; its validation and the CLI's flags and help are both
generated from what ``describe`` reads here, so a bound, a choice or a default is written once.

A field whose values are known only above ``core/`` (speculative methods, attention backends)
is a plain ``str`` here; the layer that knows the names validates it and the CLI lists them.
"""

from __future__ import annotations

import functools
import re
import typing
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import msgspec.inspect as mi

from specserve.core.errors import ConfigError


@dataclass(frozen=True)
class Setting:
    """One field of a settings table, as a flag: ``--{flag}``."""

    name: str
    kind: type  # bool | int | float | str
    default: Any
    optional: bool  # None allowed ("derive it")
    help: str
    choices: tuple[Any, ...] | None = None  # a Literal's values
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    pattern: str | None = None
    expect: str | None = None  # how to say what a ``pattern`` accepts, in an error

    @property
    def flag(self) -> str:
        return self.name.replace("_", "-")

    def check(self, value: Any) -> None:
        """Raises ``ConfigError`` naming the flag and what it accepts when ``value`` breaks
        this setting's type, choices or bounds."""
        if value is None:
            if not self.optional:
                raise ConfigError(f"{self.flag} must be set (got None)")
            return
        if self.choices is not None:
            if value not in self.choices:
                names = [str(c) for c in self.choices]
                listed = ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]
                raise ConfigError(f"{self.flag} must be {listed} (got {value!r})")
            return
        if not _is_kind(value, self.kind):
            raise ConfigError(f"{self.flag} must be {_KIND_NAMES[self.kind]} (got {value!r})")
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            raise ConfigError(f"{self.flag} must be {self.expect or self.pattern} (got {value!r})")
        low_ok = (self.ge is None or value >= self.ge) and (self.gt is None or value > self.gt)
        if low_ok and (self.le is None or value <= self.le):
            return
        if self.ge is not None and self.le is not None:
            bound = f"in [{_num(self.ge)}, {_num(self.le)}]"
        elif self.le is not None:
            bound = f"<= {_num(self.le)}"
        else:
            bound = f">= {_num(self.ge)}" if self.ge is not None else f"> {_num(self.gt)}"
        raise ConfigError(f"{self.flag} must be {bound} (got {value!r})")


_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _is_kind(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, kind)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


_SCALARS = {mi.BoolType: bool, mi.IntType: int, mi.FloatType: float, mi.StrType: str}


@functools.cache  # a pure function of the class: read its declaration once
def describe(table: type[msgspec.Struct]) -> tuple[Setting, ...]:
    """The table's fields in declaration order (the order ``--help`` lists them)."""
    out = []
    info = mi.type_info(table)
    assert isinstance(info, mi.StructType)
    hints = typing.get_type_hints(table, include_extras=True)
    for f in info.fields:
        t, help_text, extra = f.type, "", {}
        if isinstance(t, mi.Metadata):
            help_text = (t.extra_json_schema or {}).get("description", "")
            extra = t.extra or {}
            t = t.type
        optional = False
        if isinstance(t, mi.UnionType):
            rest = [u for u in t.types if not isinstance(u, mi.NoneType)]
            optional, t = len(rest) < len(t.types), rest[0]
            assert len(rest) == 1, f"{f.name}: one type (or None) per setting"
        if isinstance(t, mi.LiteralType):  # msgspec sorts the values: take them as written
            values = _literal_values(hints[f.name])
            kind = type(values[0])
            out.append(Setting(f.name, kind, f.default, optional, help_text, choices=values))
            continue
        kind = next(k for cls, k in _SCALARS.items() if isinstance(t, cls))
        out.append(Setting(
            f.name, kind, f.default, optional, help_text,
            ge=getattr(t, "ge", None), gt=getattr(t, "gt", None), le=getattr(t, "le", None),
            pattern=getattr(t, "pattern", None), expect=extra.get("expect"),
        ))
    return tuple(out)


def _literal_values(hint: Any) -> tuple[Any, ...]:
    if typing.get_origin(hint) is Literal:
        return typing.get_args(hint)
    for arg in typing.get_args(hint):
        values = _literal_values(arg)
        if values:
            return values
    return ()


def check_all(table: msgspec.Struct) -> None:
    """Checks every field of a settings table against its own declaration."""
    for setting in describe(type(table)):
        setting.check(getattr(table, setting.name))


def setting(table: type[msgspec.Struct], name: str) -> Setting:
    """One field of a table (components that take a setting directly check it the same way)."""
    for s in describe(table):
        if s.name == name:
            return s
    raise KeyError(name)
