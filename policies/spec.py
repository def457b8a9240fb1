"""What a policy is built from: its `PolicySpec` (name, typed parameters, factory) and the
`PolicyContext` (profile, seed). Policy modules import this; the registry collects their specs.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

from policies.base import Policy
from policies.profile import Profile


class PolicyError(ValueError):
    """Unknown policy, bad parameters, or a plugin that cannot be loaded."""


@dataclass(frozen=True)
class PolicyContext:
    """What a policy may be built from besides its parameters."""

    profile: Profile | None = None
    seed: int = 0


class NoParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass(frozen=True)
class PolicySpec:
    name: str
    params: type[BaseModel]
    factory: Callable[[Any, PolicyContext], Policy]
    help: str = ""
    needs_profile: bool = False

    def describe_params(self) -> Iterator[tuple[str, str, str, str]]:
        """(name, type, default, help) for every parameter, as plain strings for listings."""
        for key, f in self.params.model_fields.items():
            if f.is_required():
                default = "required"
            else:
                value = f.get_default(call_default_factory=True)
                default = value if isinstance(value, str) else json.dumps(value, default=str)
            yield key, type_label(f.annotation), default, f.description or ""


def type_label(annotation: Any) -> str:
    """A short readable type: `int`, `float | None`, `baseline|eagle`, `dict[str, float]`."""
    if annotation is None or annotation is type(None):
        return "None"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_label(args[0])
    if origin is typing.Literal:
        return "|".join(str(a) for a in args)
    if origin is typing.Union or origin is types.UnionType:
        return " | ".join(type_label(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_label(a) for a in args)}]" if args else name
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")
