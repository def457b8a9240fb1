"""A completion request's body as the forwarder reads it: checked (bad input -> 400) and its
prompt size estimated, before anything is routed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from controller.proxy.errors import BadRequest
from controller.proxy.generate import check_generate_body, generate_prompt_chars
from controller.proxy.limits import LARGE_JSON, load_json, load_large_json
from controller.proxy.validate import check_openai_body
from policies.base import EndpointKind


def parse_small_body(raw: bytes, endpoint: EndpointKind) -> dict[str, Any] | None:
    """`parse_body` of a body under `LARGE_JSON` bytes (the usual one), on the event loop and
    without a coroutine; None for a larger one."""
    return check_body(load_json(raw), endpoint) if len(raw) < LARGE_JSON else None


async def parse_body(raw: bytes, endpoint: EndpointKind) -> dict[str, Any]:
    """The checked body; one of `LARGE_JSON` bytes or more parsed in steps in a worker thread."""
    body = parse_small_body(raw, endpoint)
    return body if body is not None else check_body(await load_large_json(raw), endpoint)


def check_body(body: Any, endpoint: EndpointKind) -> dict[str, Any]:
    """The parsed body, checked (bad input -> 400)."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    if endpoint == "generate":
        check_generate_body(body)
    elif endpoint == "chat":
        if not isinstance(body.get("messages"), list):
            raise BadRequest("'messages' is required and must be a list")
    elif "prompt" not in body:
        raise BadRequest("'prompt' is required")
    stream = body.get("stream", False)
    if not isinstance(stream, bool) and stream is not None:
        raise BadRequest("'stream' must be a boolean")
    if endpoint != "generate":
        check_openai_body(body, endpoint)  # SGLang's rules where it is stricter (validate.py)
    return body


def _text_len(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        total = 0
        for part in value:
            if isinstance(part, str):
                total += len(part)
            elif isinstance(part, dict):
                text = part.get("text")
                total += len(text) if isinstance(text, str) else 0
            elif isinstance(part, int):
                total += 4  # a token id
            elif isinstance(part, list):  # a batch of prompts; deeper nesting is not counted
                total += sum(4 if isinstance(x, int) else len(x) if isinstance(x, str) else 0 for x in part)
        return total
    return 0


def estimate_prompt_tokens(body: Mapping[str, Any], endpoint: EndpointKind) -> int:
    """Cheap estimate: characters / 4."""
    if endpoint == "generate":
        chars = generate_prompt_chars(body)
    elif endpoint == "chat":
        chars = sum(_text_len(m.get("content")) for m in body["messages"] if isinstance(m, dict))
    else:
        chars = _text_len(body.get("prompt"))
    return chars // 4
