"""What every `specroute` command shares: how a usage error is reported, number types with
bounds, flags generated from a pydantic model, checks for optional dependencies, and how an
asyncio main runs.

Errors: a command raises `CommandError` (or returns `fail(...)`); `controller.cli.main` prints
`specroute COMMAND: error: MESSAGE` and exits 2, the code argparse uses for its own usage
errors, so a bad value is exit 2 whether argparse or the command finds it.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import math
import operator
import types
import typing
from collections.abc import Callable, Coroutine, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel
from pydantic.fields import FieldInfo

T = TypeVar("T")
Number = TypeVar("Number", int, float)

USAGE_ERROR = 2


class CommandError(Exception):
    """A usage error: bad flags or values, an unreadable input, a missing optional dependency."""


class Parser(argparse.ArgumentParser):
    """argparse with specroute's one error format: `specroute COMMAND: error: MESSAGE` first (a
    bounded number: `--jobs must be >= 1, got 0`), then where to find help; exit code 2."""

    def error(self, message: str) -> typing.NoReturn:
        flag, sep, rest = message.removeprefix("argument ").partition(": ")
        if message.startswith("argument ") and sep:
            message = f"{flag} {rest}" if rest.startswith("must be") else f"{flag}: {rest}"
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message}\n(see {self.prog} --help)\n")


def bounded(
    kind: Callable[[str], Number],
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
) -> Callable[[str], Number]:
    """An argparse type: `kind(text)` (int or float, finite) within the bounds given."""
    name = "an integer" if kind is int else "a number"

    def parse(text: str) -> Number:
        try:
            value = kind(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {name}, got {text!r}") from None
        if isinstance(value, float) and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
        checks: tuple[tuple[float | None, Callable[[float, float], bool], str], ...] = (
            (ge, operator.ge, ">="),
            (gt, operator.gt, ">"),
            (le, operator.le, "<="),
            (lt, operator.lt, "<"),
        )
        for bound, ok, word in checks:
            if bound is not None and not ok(value, bound):
                raise argparse.ArgumentTypeError(f"must be {word} {bound:g}, got {text.strip()}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


number = bounded(float)
positive_int = bounded(int, ge=1)
non_negative_int = bounded(int, ge=0)
positive_float = bounded(float, gt=0)
non_negative_float = bounded(float, ge=0)


def check_writable(*paths: str | None) -> None:
    """CommandError for an output path whose folder does not exist, before any work is done:
    every command refuses to create folders it was not asked to (a typo would go unnoticed)."""
    for path in paths:
        if not path or Path(path).resolve().parent.is_dir():
            continue
        blocker = next((d for d in Path(path).resolve().parents if d.exists() and not d.is_dir()), None)
        if blocker is not None:
            raise CommandError(f"cannot write {path}: {blocker} is not a directory")
        raise CommandError(f"cannot write {path}: no such directory ({Path(path).parent})")


def port(text: str) -> int:
    """A TCP port, 0 (any free one) to 65535."""
    try:
        return bounded(int, ge=0, le=65535)(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a port number 0..65535, got {text!r}") from None


def fraction(text: str) -> float:
    """A float in [0, 1]."""
    return bounded(float, ge=0, le=1)(text)


def require(module: str, extra: str, why: str) -> None:
    """CommandError when an optional dependency is missing, before any work starts."""
    if importlib.util.find_spec(module) is None:
        raise CommandError(f"{why} needs {module}, an optional extra: pip install 'specroute[{extra}]'")


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` on uvloop where it is installed (Linux and macOS), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        return asyncio.run(main)
    return uvloop.run(main)


# --- flags generated from a pydantic model -------------------------------------------------


def _scalar(annotation: Any) -> type | None:
    """The scalar type of a field (`int | None` -> int), or None for containers and models."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    kinds = [a for a in args if a is not type(None)]
    if len(kinds) == 1 and kinds[0] in (str, int, float, bool):
        return typing.cast(type, kinds[0])
    if len(kinds) == 1 and typing.get_origin(kinds[0]) is typing.Literal:
        return str
    return None


def _bounds(field: FieldInfo) -> dict[str, float]:
    out: dict[str, float] = {}
    for meta in field.metadata:  # pydantic keeps Field(ge=..) etc. as annotated_types.Ge(..) objects
        for key in ("ge", "gt", "le", "lt"):
            value = getattr(meta, key, None)
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[key] = value
    return out


_METAVAR: dict[type | None, str] = {int: "N", float: "X", bool: "true|false", str: "TEXT"}


def boolean(text: str) -> bool:
    value = text.strip().lower()
    if value in ("true", "1", "yes", "on"):
        return True
    if value in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def field_type(field: FieldInfo) -> Callable[[str], Any] | None:
    """The argparse type of a scalar field: bounded numbers from its constraints, None for text."""
    kind = _scalar(field.annotation)
    if kind is int or kind is float:
        return bounded(typing.cast(Callable[[str], int | float], kind), **_bounds(field))
    if kind is bool:
        return boolean
    return None


def add_model_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    model: type[BaseModel],
    *,
    skip: Iterable[str] = (),
    dest_prefix: str = "",
    metavars: Mapping[str, str] | None = None,
    help_suffix: Callable[[str, FieldInfo], str] | None = None,
    typed: bool = True,
) -> list[str]:
    """A `--field-name` flag per scalar field of `model` (help from its description), default
    None so that only the flags given reach `model_values`. Returns the fields added.

    `typed`: parse numbers and booleans here (bounded by the field's constraints); otherwise the
    text is handed to the model, which validates it (serve does that to name the source)."""
    added = []
    skipped = set(skip)
    for name, field in model.model_fields.items():
        kind = _scalar(field.annotation)
        if name in skipped or kind is None:
            continue
        choices = None
        inner = field.annotation
        if isinstance(inner, types.UnionType):
            inner = next(a for a in typing.get_args(inner) if a is not type(None))
        if typing.get_origin(inner) is typing.Literal:
            choices = [str(a) for a in typing.get_args(inner)]
        help_text = field.description or ""
        if help_suffix is not None:
            help_text += help_suffix(name, field)
        elif not field.is_required() and field.default is not None and field.default is not False:
            help_text += f" (default {field.default!r})"
        flag, dest = "--" + name.replace("_", "-"), dest_prefix + name
        if typed and kind is bool and field.default is False:  # a switch: --unhealthy
            parser.add_argument(flag, dest=dest, action="store_const", const=True, help=help_text)
            added.append(name)
            continue
        parser.add_argument(
            flag,
            dest=dest,
            type=(field_type(field) if typed else None) or str,  # str: the text as given
            choices=choices,
            required=field.is_required() and typed,
            metavar=(metavars or {}).get(name) or _METAVAR.get(kind) if choices is None else None,
            help=help_text.replace("%", "%%"),
        )
        added.append(name)
    return added


def model_values(args: argparse.Namespace, fields: Iterable[str], dest_prefix: str = "") -> dict[str, Any]:
    """The values of the flags `add_model_flags` added that the user gave."""
    out = {}
    for name in fields:
        value = getattr(args, dest_prefix + name, None)
        if value is not None:
            out[name] = value
    return out
