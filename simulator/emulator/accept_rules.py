"""Content-dependent acceptance for the emulated EAGLE server (`specroute emulate --accept-rules`).

A rules file is a JSON list. `{"match": REGEX, "factor": F}` entries are searched in order
(Python `re.search`) in the request's canonical prompt text (`policies.prefix` renders it: chat
messages as `<|ROLE|>\\nTEXT\\n`, a completions prompt as it is); the first match gives the
request's acceptance factor (none matches: 1). An optional `{"temperature_slope": S}` entry
scales it by `1 - S x temperature` (the request's sampling temperature; none: 0), floored at
0.3: acceptance falls with temperature. The emulated server's mean accept length for the request
is the configured one times the factor (times an `--hint-factor`, if any), so its speed, its
`spec_tokens_details` and its accept-length metrics follow.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, PrivateAttr, field_validator

TEMPERATURE_FLOOR = 0.3


class AcceptRule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    match: str = Field(description="Python regular expression searched in the canonical prompt text.")
    factor: PositiveFloat = Field(description="Acceptance factor of a request whose text matches.")

    @field_validator("match")
    @classmethod
    def _compiles(cls, value: str) -> str:
        try:
            re.compile(value)
        except re.error as e:
            raise ValueError(f"not a regular expression: {e}") from None
        return value


class AcceptRules(BaseModel):
    """The parsed rules file (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rules: tuple[AcceptRule, ...] = ()
    temperature_slope: float = Field(default=0.0, ge=0.0)
    _compiled: tuple[tuple[re.Pattern[str], float], ...] = PrivateAttr(default=())

    def model_post_init(self, context: Any) -> None:
        self._compiled = tuple((re.compile(r.match), r.factor) for r in self.rules)

    def factor(self, text: str, temperature: float | None) -> float:
        """The acceptance factor of a request with this prompt text and temperature."""
        f = 1.0
        for pattern, factor in self._compiled:
            if pattern.search(text):
                f = factor
                break
        if self.temperature_slope and temperature:
            f *= max(TEMPERATURE_FLOOR, 1.0 - self.temperature_slope * temperature)
        return f


class AcceptRulesError(ValueError):
    """A rules file that cannot be used (names the file and the entry)."""


def parse_accept_rules(data: Any, where: str = "accept rules") -> AcceptRules:
    if not isinstance(data, list):
        raise AcceptRulesError(
            f"{where}: expected a JSON list of {{match, factor}} and {{temperature_slope}}"
        )
    rules: list[AcceptRule] = []
    slope = 0.0
    for i, entry in enumerate(data):
        if isinstance(entry, dict) and set(entry) == {"temperature_slope"}:
            value = entry["temperature_slope"]
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < float("inf"):
                raise AcceptRulesError(f"{where}[{i}]: temperature_slope must be a number >= 0")
            slope = float(value)
            continue
        try:
            rules.append(AcceptRule.model_validate(entry))
        except ValueError as e:
            first = e.errors()[0] if hasattr(e, "errors") else {"msg": str(e), "loc": ()}
            loc = ".".join(str(x) for x in first.get("loc", ()))
            raise AcceptRulesError(f"{where}[{i}]{'.' + loc if loc else ''}: {first['msg']}") from None
    return AcceptRules(rules=tuple(rules), temperature_slope=slope)


def load_accept_rules(path: str | Path) -> AcceptRules:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise AcceptRulesError(f"cannot read {str(path)!r}: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AcceptRulesError(f"{path}: not JSON ({e})") from None
    return parse_accept_rules(data, str(path))
