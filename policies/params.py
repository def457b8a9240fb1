"""The one grammar for policy parameters typed by hand, in every command and the admin endpoint.

    KEY=VALUE                       one parameter (`serve --policy-param`, `simulate`, `tune`)
    NAME[:KEY=VALUE,KEY=VALUE...]   a policy with inline parameters (`simulate --policy`, `plan`)
    KEY=V1,V2,...                   a grid of values (`tune --grid`, `plan --grid POLICY:...`)

A VALUE is JSON when it parses as JSON (`4`, `0.5`, `true`, `null`, `[1,2]`,
`{"code": 1.2}`, `"quoted"`), else the text itself (`e2e`, `baseline`): the policy's parameter
model validates and converts it either way. Commas inside brackets, braces or quotes do not
separate parameters, so a dict or list value can be given inline:
`cost_model:hint_speedup={"code":1.2,"chat":0.8},objective=ttft`. NAME may itself be
`module.path:ClassName`: the parameters start after the first colon that is followed by
`KEY=`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from policies.spec import PolicyError

_PARAMS_START = re.compile(r"\s*[A-Za-z_][A-Za-z0-9_]*\s*=")


def parse_value(text: str) -> Any:
    """A parameter value: JSON when it parses, else the text (stripped)."""
    text = text.strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def split_top_level(text: str, sep: str = ",") -> list[str]:
    """`text` split at `sep` outside brackets, braces and double-quoted strings."""
    parts: list[str] = []
    depth = 0
    quoted = escaped = False
    start = 0
    for i, ch in enumerate(text):
        if quoted:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
        elif ch == '"':
            quoted = True
        elif ch in "[{":
            depth += 1
        elif ch in "]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def parse_assignment(item: str, what: str) -> tuple[str, Any]:
    """`KEY=VALUE` -> (KEY, value)."""
    key, sep, value = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise PolicyError(f"{what} {item!r}: expected KEY=VALUE")
    return key, parse_value(value)


def parse_assignments(items: Iterable[str], what: str = "--policy-param") -> dict[str, Any]:
    """`KEY=VALUE` items -> {KEY: value}; a later KEY overrides an earlier one."""
    return dict(parse_assignment(item, what) for item in items)


def split_policy_ref(text: str) -> tuple[str, str | None]:
    """`NAME[:PARAMS]` -> (NAME, PARAMS or None); NAME may be `module.path:ClassName`."""
    at = text.find(":")
    while at >= 0:
        if _PARAMS_START.match(text, at + 1):
            return text[:at].strip(), text[at + 1 :]
        at = text.find(":", at + 1)
    return text.strip(), None


def parse_policy_ref(text: str, what: str = "--policy") -> tuple[str, dict[str, Any] | None]:
    """`NAME` or `NAME:KEY=VALUE,...` -> (NAME, params or None when none were given inline)."""
    name, params = split_policy_ref(text)
    if not name:
        raise PolicyError(f"{what} {text!r}: expected NAME or NAME:KEY=VALUE,...")
    if params is None:
        return name, None
    return name, parse_assignments(split_top_level(params), f"{what} {text!r}:")


def parse_grid_item(item: str, what: str = "--grid") -> tuple[str, list[Any]]:
    """`KEY=V1,V2,...` -> (KEY, [values])."""
    key, sep, values = item.partition("=")
    key = key.strip()
    parts = split_top_level(values) if sep else []
    if not key or not parts or any(not p.strip() for p in parts):
        raise PolicyError(f"{what} {item!r}: expected KEY=V1,V2,...")
    return key, [parse_value(p) for p in parts]
