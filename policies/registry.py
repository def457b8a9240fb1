"""Name -> policy factory registry, with typed (pydantic) parameters per policy.

Built-in policies each expose a module-level `SPEC`; `default_registry()` collects them,
plus any entry points in the group `specroute.policies`. A name of the form
`module.path:ClassName` loads a user class that satisfies the `Policy` protocol: it may
declare a pydantic `Params` model and is constructed as `ClassName(params, context)`.
No global state: every caller builds (or is handed) its own registry.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from policies.base import Policy
from policies.profile import Profile

ENTRY_POINT_GROUP = "specroute.policies"


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
        """(name, type, default, help) for every parameter."""
        for key, f in self.params.model_fields.items():
            ann = getattr(f.annotation, "__name__", None) or str(f.annotation)
            default = "required" if f.is_required() else repr(f.get_default(call_default_factory=True))
            yield key, ann.replace("typing.", ""), default, f.description or ""


def _format_validation(name: str, e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        key = ".".join(str(x) for x in err["loc"]) or "<params>"
        parts.append(f"{key}: {err['msg']}")
    return f"policy {name!r}: invalid parameter " + "; ".join(parts)


class PolicyRegistry:
    def __init__(self) -> None:
        self._specs: dict[str, PolicySpec] = {}

    def register(self, spec: PolicySpec) -> None:
        if spec.name in self._specs:
            raise PolicyError(f"policy {spec.name!r} is already registered")
        self._specs[spec.name] = spec

    def names(self) -> list[str]:
        return sorted(self._specs)

    def specs(self) -> list[PolicySpec]:
        return [self._specs[n] for n in self.names()]

    def get(self, name: str) -> PolicySpec:
        spec = self._specs.get(name)
        if spec is not None:
            return spec
        if ":" in name:
            return _spec_from_import_path(name)
        raise PolicyError(
            f"unknown policy {name!r}; known policies: {', '.join(self.names())} "
            "(or module.path:ClassName for your own)"
        )

    def parse_params(self, name: str, params: Mapping[str, Any]) -> BaseModel:
        spec = self.get(name)
        try:
            return spec.params.model_validate(dict(params))
        except ValidationError as e:
            raise PolicyError(_format_validation(name, e)) from None

    def create(
        self, name: str, params: Mapping[str, Any] | None = None, context: PolicyContext | None = None
    ) -> Policy:
        spec = self.get(name)
        ctx = context or PolicyContext()
        if spec.needs_profile and ctx.profile is None:
            raise PolicyError(f"policy {name!r} needs a speed profile (--profile FILE)")
        parsed = self.parse_params(name, params or {})
        policy = spec.factory(parsed, ctx)
        if not isinstance(policy, Policy):
            raise PolicyError(f"policy {name!r} does not provide choose() and observe()")
        return policy


def _spec_from_import_path(path: str) -> PolicySpec:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise PolicyError(f"policy {path!r}: expected module.path:ClassName")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any import failure is the user's plugin, report it plainly
        raise PolicyError(f"policy {path!r}: cannot import {module_name!r}: {e}") from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise PolicyError(f"policy {path!r}: module {module_name!r} has no attribute {attr!r}")
    return spec_from_object(path, obj)


def spec_from_object(name: str, obj: Any) -> PolicySpec:
    """A PolicySpec from a PolicySpec, or from a class taking (params, context)."""
    if isinstance(obj, PolicySpec):
        return obj
    if not isinstance(obj, type):
        raise PolicyError(f"policy {name!r}: {obj!r} is not a class")
    if not (callable(getattr(obj, "choose", None)) and callable(getattr(obj, "observe", None))):
        raise PolicyError(f"policy {name!r}: class {obj.__name__} lacks choose() and observe()")
    params = getattr(obj, "Params", NoParams)
    if not (isinstance(params, type) and issubclass(params, BaseModel)):
        raise PolicyError(f"policy {name!r}: {obj.__name__}.Params must be a pydantic model")
    doc = (obj.__doc__ or "").strip().splitlines()

    def factory(p: Any, ctx: PolicyContext) -> Policy:
        instance: Policy = obj(p, ctx)
        if not getattr(instance, "name", None):
            instance.name = name
        return instance

    return PolicySpec(name=name, params=params, factory=factory, help=doc[0] if doc else "")


def _builtin_specs() -> list[PolicySpec]:
    from policies import fixed, threshold

    return [fixed.SPEC, threshold.SPEC]


def default_registry(*, entry_points: bool = True) -> PolicyRegistry:
    """Built-in policies plus those installed under the `specroute.policies` entry points."""
    reg = PolicyRegistry()
    for spec in _builtin_specs():
        reg.register(spec)
    if entry_points:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                reg.register(spec_from_object(ep.name, ep.load()))
            except Exception as e:
                raise PolicyError(f"entry point {ep.name!r} ({ep.value}): {e}") from None
    return reg
