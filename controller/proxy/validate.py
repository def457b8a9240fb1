"""What specroute checks in an OpenAI request body before routing it: SGLang's own rules where
they are stricter than "any JSON object", so a request SGLang would refuse is refused here, in
OpenAI's error shape and before a backend is reserved for it.

The rules follow SGLang 0.5.x (`entrypoints/openai/protocol.py`, `serving_chat.py`'s
`_validate_request`, `sampling/sampling_params.py`'s `SamplingParams.verify`):

- `max_tokens` / `max_completion_tokens`: an integer of at least 1 (SGLang's completions route
  refuses 0 -- "max_tokens must be positive" -- and its chat route reads 0 as "no limit", a
  surprise OpenAI and vLLM refuse too); `min_tokens` a non-negative integer, at most the budget.
- `messages` (chat): a non-empty list ("Messages cannot be empty.").
- Sampling ranges: `temperature` finite and >= 0, `top_p` in (0, 1], `min_p` in [0, 1],
  `top_k` -1 (all) or >= 1, `frequency_penalty` and `presence_penalty` in [-2, 2],
  `repetition_penalty` in (0, 2], `n` >= 1. The same ranges apply to `/generate`'s
  `sampling_params` (whose `max_new_tokens` may be 0: SGLang accepts it there).

`null` means "default" as in SGLang. A value of the wrong JSON type (a string for a number) is
left to the backend, which coerces what pydantic coerces; only the budget fields must be numbers
here, because routing reads them. Everything else (tools, response_format, ...) SGLang judges.

What a request costs the backend is counted here too: `sequences` is how many sequences it runs
at once (a backend runs each of `n` samples of each prompt as its own request), and
`check_sequences` refuses one asking for more than the settings allow (`max_n`,
`max_prompts_per_request`) with a 400, before anything is reserved.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

from controller.proxy.errors import BadRequest

Endpoint = Literal["chat", "completions", "generate"]

_BUDGET_KEYS = ("max_tokens", "max_completion_tokens")


def _number(value: Any) -> float | None:
    """The value as a float when it is a JSON number (not a boolean), else None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _integer(value: Any) -> int | None:
    """The value as an int when it is an integral JSON number below 2**53, else None."""
    if type(value) is int:  # the usual case, without the float round trip
        return value if abs(value) < 2**53 else None
    number = _number(value)
    if number is None or not math.isfinite(number) or not number.is_integer() or abs(number) >= 2**53:
        return None
    return int(number)


_RANGES: tuple[tuple[str, Callable[[float], bool], str], ...] = (
    ("temperature", lambda v: math.isfinite(v) and v >= 0, "a non-negative finite number"),
    ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
    ("min_p", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
    ("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]"),
    ("repetition_penalty", lambda v: 0 < v <= 2, "in (0, 2] (1.0 = no penalty)"),
)


_SAMPLING_KEYS = frozenset([*(key for key, _, _ in _RANGES), "top_k", "n"])


def _check_sampling(params: Mapping[str, Any], where: str) -> None:
    """The sampling ranges, for the keys the body has (most name none of them: a missing or null
    key costs one `dict.get`, on every request's path; a body with none of them, one test)."""
    if _SAMPLING_KEYS.isdisjoint(params):
        return
    for key, ok, wanted in _RANGES:
        value = params.get(key)
        if value is None:
            continue
        number = _number(value)
        if number is not None and not ok(number):
            raise BadRequest(f"'{where}{key}' must be {wanted}, got {value!r}", param=where + key)
    value = params.get("top_k")
    top_k = None if value is None else _integer(value)
    if top_k is not None and top_k != -1 and top_k < 1:
        raise BadRequest(f"'{where}top_k' must be -1 (all) or at least 1, got {top_k}", param=where + "top_k")
    n = params.get("n")
    if n is not None and ((count := _integer(n)) is None or count < 1):
        raise BadRequest(f"'{where}n' must be an integer of at least 1, got {n!r}", param=where + "n")


def _budget(body: Mapping[str, Any]) -> int | None:
    budget = None
    for key in _BUDGET_KEYS:
        value = body.get(key)
        if value is None:
            continue
        tokens = _integer(value)
        if tokens is None or tokens < 0:
            raise BadRequest(f"'{key}' must be a non-negative integer", param=key)
        if tokens == 0:
            raise BadRequest(
                f"'{key}' must be at least 1 (SGLang refuses 0, or reads it as no limit)", param=key
            )
        budget = tokens if budget is None else min(budget, tokens)
    return budget


def check_openai_body(body: Mapping[str, Any], endpoint: Endpoint) -> None:
    """BadRequest (naming the field) for a chat or completions body SGLang would refuse."""
    budget = _budget(body)
    min_tokens = body.get("min_tokens")
    if min_tokens is not None:
        low = _integer(min_tokens)
        if low is None or low < 0 or (budget is not None and low > budget):
            bound = f" and at most the budget ({budget})" if budget is not None else ""
            raise BadRequest(f"'min_tokens' must be a non-negative integer{bound}", param="min_tokens")
    _check_sampling(body, "")
    if endpoint == "chat" and body.get("messages") == []:
        raise BadRequest("'messages' cannot be empty", param="messages")


def check_generate_sampling(params: Mapping[str, Any]) -> None:
    """BadRequest for `/generate` sampling_params SGLang's `SamplingParams.verify` would refuse."""
    _check_sampling(params, "sampling_params.")


# --- sequences ----------------------------------------------------------------------------


def _n(params: Mapping[str, Any]) -> int:
    """`n` of checked sampling parameters (1 when absent or null)."""
    value = params.get("n")
    return 1 if value is None else _integer(value) or 1


def _prompts(prompt: Any) -> int:
    """Prompts in an OpenAI `prompt` or SGLang `text` / `input_ids`: a string or a list of token
    ids is one; a list of strings or of token-id lists is one per entry (at least one)."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        return len(prompt)
    return 1


def prompts(body: Mapping[str, Any], endpoint: Endpoint) -> int:
    """How many prompts a checked body holds (a chat request: one)."""
    if endpoint == "chat":
        return 1
    if endpoint == "completions":
        return _prompts(body.get("prompt"))
    text = body.get("text")
    return _prompts(text if text is not None else body.get("input_ids"))


def sequences(body: Mapping[str, Any], endpoint: Endpoint) -> int:
    """How many sequences the backend runs for a checked body: `n` for a chat request, prompts x
    `n` for a completions one (SGLang and vLLM run each sample of each prompt as a request of its
    own), and for `/generate` the prompts x `sampling_params.n` (a list of `sampling_params`, one
    per prompt: the sum of their `n`). What the request holds of a backend's running slots, and
    what its `completion_tokens` are the sum over."""
    if endpoint == "generate":
        params = body.get("sampling_params")
        if isinstance(params, list):
            return sum(_n(p) if isinstance(p, dict) else 1 for p in params) or 1
        return prompts(body, endpoint) * _n(params if isinstance(params, dict) else {})
    return prompts(body, endpoint) * _n(body)


def check_sequences(body: Mapping[str, Any], endpoint: Endpoint, max_n: int, max_prompts: int) -> int:
    """`sequences(body, endpoint)`, or BadRequest when `n` is over `max_n`, the prompts over
    `max_prompts`, or the sequences over the larger of the two (so no request runs more sequences
    than either setting allows on its own)."""
    if endpoint == "generate":
        params = body.get("sampling_params")
        each = params if isinstance(params, list) else [params]
        n = max((_n(p) for p in each if isinstance(p, dict)), default=1)
        where = "sampling_params.n"
    else:
        n = _n(body)
        where = "n"
    if n > max_n:
        raise BadRequest(f"'{where}' is {n}: at most {max_n} (max_n) per request", param=where)
    if endpoint == "chat":
        count = total = n
    else:
        count = prompts(body, endpoint)
        if count > max_prompts:
            field = "prompt" if endpoint == "completions" else "text"
            raise BadRequest(
                f"'{field}' holds {count} prompts: at most {max_prompts} (max_prompts_per_request) per "
                "request; send the rest as further requests",
                param=field,
            )
        total = sequences(body, endpoint)
    most = max(max_n, max_prompts)
    if total > most:
        raise BadRequest(
            f"this request runs {total} sequences ({count} prompts x n): at most {most} per request "
            "(the larger of max_n and max_prompts_per_request)",
            param=where,
        )
    return total
