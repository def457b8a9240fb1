"""The prompts workload's file: real request bodies, one JSON object a line.

Fields: `messages` (a chat request) or `prompt` (completions), and optionally `output_tokens`
(the answer's length; default: the workload's `--output-tokens` draw), `temperature`, `top_p`,
`max_tokens` (ignored: the answer's length is `output_tokens`), `hint` (sent as
`x-specroute-hint`: the policy sees it), `accept` (the TRUE eagle speed factor of this request:
the simulated eagle server runs at the profile's speed times it; the policy never sees it;
default 1) and `category` (a label for reports, e.g. "code"). Other fields are ignored.

Each line is turned into what the proxy would see: its content features by the proxy's own
extractor (`policies.features.extract_features`) and its prompt tokens by the proxy's estimate
(characters / 4).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policies.base import EndpointKind, RequestFeatures
from policies.features import estimate_prompt_chars, extract_features

MAX_LINES = 1_000_000


class PromptsError(ValueError):
    """A prompts file that cannot be used (names the file and line)."""


@dataclass(frozen=True, slots=True)
class PromptLine:
    prompt_tokens: int
    features: RequestFeatures
    output_tokens: int | None
    hint: str | None
    accept: float
    category: str | None
    body: dict[str, Any]
    endpoint: EndpointKind


def parse_prompt_line(obj: Any, where: str) -> PromptLine:
    if not isinstance(obj, dict):
        raise PromptsError(f"{where}: expected a JSON object")
    endpoint: EndpointKind
    if isinstance(obj.get("messages"), list):
        endpoint = "chat"
        body: dict[str, Any] = {"messages": obj["messages"]}
    elif isinstance(obj.get("prompt"), str):
        endpoint = "completions"
        body = {"prompt": obj["prompt"]}
    else:
        raise PromptsError(f"{where}: needs 'messages' (a list) or 'prompt' (a string)")
    for key in ("temperature", "top_p", "top_k", "response_format", "tools", "model", "n"):
        if key in obj:
            body[key] = obj[key]
    out = obj.get("output_tokens")
    if out is not None and (isinstance(out, bool) or not isinstance(out, int) or out < 1):
        raise PromptsError(f"{where}: 'output_tokens' must be an integer >= 1")
    accept = obj.get("accept", 1.0)
    if isinstance(accept, bool) or not isinstance(accept, int | float) or not (0 < accept < math.inf):
        raise PromptsError(f"{where}: 'accept' must be a number > 0")
    hint = obj.get("hint")
    if hint is not None and not isinstance(hint, str):
        raise PromptsError(f"{where}: 'hint' must be a string")
    temperature = obj.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool) or not isinstance(temperature, int | float)
    ):
        raise PromptsError(f"{where}: 'temperature' must be a number")
    category = obj.get("category")
    return PromptLine(
        prompt_tokens=estimate_prompt_chars(body, endpoint) // 4,
        features=extract_features(body, endpoint),
        output_tokens=out,
        hint=hint,
        accept=float(accept),
        category=category if isinstance(category, str) else None,
        body=body,
        endpoint=endpoint,
    )


def read_prompts(path: str | Path) -> list[PromptLine]:
    """Every request of the file, in order (blank lines skipped)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise PromptsError(f"cannot read prompts file {str(path)!r}: {e}") from None
    out: list[PromptLine] = []
    for i, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{i}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PromptsError(f"{where}: not JSON ({e.msg})") from None
        out.append(parse_prompt_line(obj, where))
        if len(out) > MAX_LINES:
            raise PromptsError(f"{path}: more than {MAX_LINES:,} requests")
    if not out:
        raise PromptsError(f"{path}: no requests")
    return out
