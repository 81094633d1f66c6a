"""Command-line flags derived from config dataclasses.

Where a flag sets a config field, the field is the one place of its name, type, default and
help: declare it with `flag(default, help)`, add the class's flags with `add_flags`, and read
them back with `flag_values`. The flag is `--field-name` (or the `name` given, for the flags
whose name users already know), its value lands in `args.field_name`. Booleans become
`--x / --no-x`, enums and `Literal` types take their values as choices, `X | None` fields
default to None.
"""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import Field, dataclass, field, fields
from enum import Enum
from typing import Any

_FLAG = "llmserve.flag"


@dataclass(frozen=True, slots=True)
class _FlagSpec:
    help: str
    name: str | None


def flag(default: Any, help: str, *, name: str | None = None) -> Any:
    """A dataclass field that is also a flag: `--<name or field name, dashed>`."""
    return field(default=default, metadata={_FLAG: _FlagSpec(help, name)})


def flag_name(cls: type, field_name: str) -> str:
    """The flag that sets `cls.field_name`, as a user types it (`--max-num-seqs`)."""
    f = next(f for f in fields(cls) if f.name == field_name)
    spec: _FlagSpec = f.metadata[_FLAG]
    return "--" + (spec.name or f.name).replace("_", "-")


def _flagged(cls: type) -> list[tuple[Field[Any], _FlagSpec, Any]]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in fields(cls):
        spec = f.metadata.get(_FLAG)
        if spec is not None:
            out.append((f, spec, _value_type(hints[f.name])))
    return out


def _value_type(hint: Any) -> Any:
    """`int` for `int` and `int | None`; a `Literal` as it is."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (kind,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return kind
    return hint


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """One flag per field of `cls` declared with `flag`."""
    for f, spec, kind in _flagged(cls):
        default = f.default
        shown = "unset" if default is None else getattr(default, "value", default)
        kwargs: dict[str, Any] = {"dest": f.name, "help": f"{spec.help} (default: {shown})"}
        if kind is bool:
            kwargs.update(action=argparse.BooleanOptionalAction, default=default)
        elif typing.get_origin(kind) is typing.Literal:
            kwargs.update(choices=list(typing.get_args(kind)), default=default)
        elif issubclass(kind, Enum):
            kwargs.update(
                choices=[m.value for m in kind], default=None if default is None else default.value
            )
        else:
            kwargs.update(type=kind, default=default, metavar=(spec.name or f.name).upper())
        parser.add_argument(flag_name(cls, f.name), **kwargs)


def flag_values(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    """The parsed values of `cls`'s flags, by field name (enums as members)."""
    values = {}
    for f, _, kind in _flagged(cls):
        value = getattr(args, f.name)
        if value is not None and isinstance(kind, type) and issubclass(kind, Enum):
            value = kind(value)
        values[f.name] = value
    return values
