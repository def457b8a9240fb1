"""Name -> policy factory registry, with typed (pydantic) parameters per policy.

Built-in policies each expose a module-level `SPEC` (built from `policies.spec`, which they
import; the registry imports them, never the other way round); `default_registry()` collects them,
plus any entry points in the group `specroute.policies`. A name of the form
`module.path:ClassName` loads a user class that satisfies the `Policy` protocol: it may
declare a pydantic `Params` model and is constructed as `ClassName(params, context)`.
No global state: every caller builds (or is handed) its own registry.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import types
import typing
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from policies import cache_only, cost_model, fixed, online, round_robin, threshold
from policies.base import Policy
from policies.spec import NoParams, PolicyContext, PolicyError, PolicySpec, type_label

ENTRY_POINT_GROUP = "specroute.policies"

__all__ = [
    "BUILTIN_SPECS",
    "ENTRY_POINT_GROUP",
    "PolicyContext",
    "PolicyError",
    "PolicyRegistry",
    "PolicySpec",
    "default_registry",
    "spec_from_object",
    "type_label",
]


def _format_validation(name: str, e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        key = ".".join(str(x) for x in err["loc"]) or "<params>"
        parts.append(f"{key}: {err['msg']}")
    return f"policy {name!r}: invalid parameter " + "; ".join(parts)


class PolicyRegistry:
    def __init__(self) -> None:
        self._specs: dict[str, PolicySpec] = {}
        self._broken: dict[str, str] = {}

    def register(self, spec: PolicySpec) -> None:
        if spec.name in self._specs:
            raise PolicyError(f"policy {spec.name!r} is already registered")
        self._specs[spec.name] = spec

    def register_broken(self, name: str, problem: str) -> None:
        """Remember a plugin that failed to load: listing it is harmless, using it raises."""
        self._broken[name] = problem

    def names(self) -> list[str]:
        return sorted(self._specs)

    def specs(self) -> list[PolicySpec]:
        return [self._specs[n] for n in self.names()]

    def broken(self) -> dict[str, str]:
        """Entry-point plugins that could not be loaded, with the reason."""
        return dict(self._broken)

    def get(self, name: str) -> PolicySpec:
        spec = self._specs.get(name)
        if spec is not None:
            return spec
        if name in self._broken:
            raise PolicyError(self._broken[name])
        known = f"known policies: {', '.join(self.names())}"
        if ":" in name:
            return _spec_from_import_path(name, known)
        raise PolicyError(f"unknown policy {name!r}; {known} (or module.path:ClassName for your own)")

    def parse_params(self, name: str, params: Mapping[str, Any]) -> BaseModel:
        """Validate parameters; strings given for list/dict parameters are read as JSON."""
        spec = self.get(name)
        try:
            return spec.params.model_validate(_decode_json_strings(spec.params, params))
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
        try:
            policy = spec.factory(parsed, ctx)
        except PolicyError:
            raise
        except Exception as e:  # a profile without the needed mode, a plugin's own bug, ...
            raise PolicyError(f"policy {name!r} cannot be created: {type(e).__name__}: {e}") from None
        if not isinstance(policy, Policy):
            raise PolicyError(f"policy {name!r} does not provide name, choose() and observe()")
        return policy


def _decode_json_strings(model: type[BaseModel], params: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(params)
    for key, value in out.items():
        f = model.model_fields.get(key)
        if f is None or not isinstance(value, str) or not _wants_container(f.annotation):
            continue
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            pass  # left as is: validation reports the field
    return out


def _wants_container(annotation: Any) -> bool:
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        return any(_wants_container(a) for a in typing.get_args(annotation))
    return origin in (dict, list, tuple) or annotation in (dict, list, tuple)


def _spec_from_import_path(path: str, known: str) -> PolicySpec:
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise PolicyError(f"policy {path!r}: expected module.path:ClassName; {known}")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # any import failure is the user's plugin, report it plainly
        raise PolicyError(
            f"policy {path!r}: cannot import module {module_name!r}: {type(e).__name__}: {e}; {known}"
        ) from None
    obj = getattr(module, attr, None)
    if obj is None:
        raise PolicyError(f"policy {path!r}: module {module_name!r} has no attribute {attr!r}; {known}")
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


BUILTIN_SPECS: tuple[PolicySpec, ...] = (
    fixed.SPEC,
    threshold.SPEC,
    cost_model.SPEC,
    online.SPEC,
    round_robin.SPEC,
    cache_only.SPEC,
)


def default_registry(*, entry_points: bool = True) -> PolicyRegistry:
    """Built-in policies plus those installed under the `specroute.policies` entry points.

    A plugin that fails to load does not break the others: it is listed by `broken()` and
    asking for it by name raises a `PolicyError` with the reason.
    """
    reg = PolicyRegistry()
    for spec in BUILTIN_SPECS:
        reg.register(spec)
    if entry_points:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                reg.register(spec_from_object(ep.name, ep.load()))
            except Exception as e:
                reg.register_broken(ep.name, f"entry point {ep.name!r} ({ep.value}): {e}")
    return reg
