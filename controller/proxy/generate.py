"""SGLang's native `POST /generate` as the forwarder sees it: what it checks in the body, what a
policy learns from it, and where the answer reports its token count.

A `/generate` request is routed exactly like an OpenAI one (same policy, reservation, failover,
metrics, decision log); only these facts differ:

- The body (GenerateReqInput) has `text` or `input_ids` (or `input_embeds`) instead of
  `messages`/`prompt`, and the output budget is `sampling_params.max_new_tokens` (SGLang's default
  when it is absent: 128 tokens).
- One prompt per request. A batch (`text` as a list, `input_ids` as a list of lists) is refused with
  a 400: specroute decides per request, and a batch would reach one pool as one decision while
  the server runs each prompt as its own request. Send the prompts as separate requests (each is
  then routed on its own). `sampling_params.n > 1` is one request and is routed as one.
- Token counts come from `meta_info.completion_tokens`, which is cumulative in a stream: the last
  output of each sample has its total. A non-streamed answer is one object (or a list for n > 1).
  A streamed n > 1 answer is counted from the samples whose last output is among the last bytes
  read (the forwarder keeps a short tail), so it may count fewer than all samples.
- SGLang reports a full queue on a streamed `/generate` as HTTP 200 whose one output is an abort
  with `status_code` 503 (not an `{"error": ...}` event): `controller.proxy.sse.first_event`
  reads it as overload, like the OpenAI routes' queue-full event.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from controller.proxy.errors import BadRequest
from controller.proxy.sse import as_count, parse_json
from controller.proxy.validate import check_generate_sampling

SGLANG_DEFAULT_MAX_NEW_TOKENS = 128
_COUNT_RE = re.compile(rb'"completion_tokens"\s*:\s*(\d{1,15})(?![\d.eE])')
_BATCH = (
    "a batch /generate (a list of prompts) is not routed: specroute decides per request, so send "
    "each prompt as its own request"
)


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def check_generate_body(body: Mapping[str, Any]) -> None:
    """BadRequest for a `/generate` body specroute cannot route (SGLang judges the rest)."""
    text, ids, embeds = body.get("text"), body.get("input_ids"), body.get("input_embeds")
    if text is None and ids is None and embeds is None:
        raise BadRequest("'text' or 'input_ids' is required")
    if isinstance(text, list) or (isinstance(ids, list) and ids and not _is_token_ids(ids)):
        raise BadRequest(_BATCH)
    if text is not None and not isinstance(text, str):
        raise BadRequest("'text' must be a string")
    if ids is not None and not _is_token_ids(ids):
        raise BadRequest("'input_ids' must be a list of token ids")
    if embeds is not None and ids is None and text is None:
        if not isinstance(embeds, list) or not embeds or not isinstance(embeds[0], list):
            raise BadRequest("'input_embeds' must be a list of embedding vectors")
        if embeds[0] and isinstance(embeds[0][0], list):
            raise BadRequest(_BATCH)
    params = body.get("sampling_params")
    if params is not None and not isinstance(params, dict):
        raise BadRequest("'sampling_params' must be an object")
    value = (params or {}).get("max_new_tokens")
    if value is not None:
        integral = isinstance(value, int) or (isinstance(value, float) and value.is_integer())
        if isinstance(value, bool) or not integral or not 0 <= value < 2**53:
            raise BadRequest("'sampling_params.max_new_tokens' must be a non-negative integer")
    check_generate_sampling(params or {})


def generate_prompt_chars(body: Mapping[str, Any]) -> int:
    """Prompt size in characters as the forwarder estimates it (a token id counts 4)."""
    text = body.get("text")
    if isinstance(text, str):
        return len(text)
    ids = body.get("input_ids")
    if isinstance(ids, list):
        return 4 * len(ids)
    embeds = body.get("input_embeds")
    return 4 * len(embeds) if isinstance(embeds, list) else 0


def generate_max_tokens(body: Mapping[str, Any]) -> int | None:
    """The output budget: `sampling_params.max_new_tokens`, SGLang's 128 when absent, None when
    the client set it to null (up to the context length)."""
    params = body.get("sampling_params") or {}
    if "max_new_tokens" not in params:
        return SGLANG_DEFAULT_MAX_NEW_TOKENS
    value = params["max_new_tokens"]
    return int(value) if value is not None else None


def generate_completion_tokens(data: bytes) -> int | None:
    """Completion tokens in a `/generate` answer: a whole body (an object, or a list for n > 1),
    or the tail of a stream (`data:` events; per sample the last count seen, added up)."""
    stripped = data.strip()
    if stripped[:1] in (b"{", b"["):
        whole = parse_json(stripped, max_bytes=len(stripped))
        outputs = whole if isinstance(whole, list) else [whole]
        counts = [_count(o) for o in outputs]
        if whole is not None and all(c is not None for c in counts):
            return sum(c for c in counts if c is not None)
    last: dict[int, int] = {}
    for line in data.split(b"\n"):
        line = line.strip()
        if not line.startswith(b"data:") or line.find(b"completion_tokens") < 0:
            continue
        event = parse_json(line[5:])
        if not isinstance(event, dict):
            continue  # the torn start of the tail
        count = _count(event)
        if count is not None:
            index = event.get("index", 0)
            last[index if isinstance(index, int) else 0] = count
    if last:
        return sum(last.values())
    found = _COUNT_RE.findall(data)  # one output larger than the tail (long logprobs)
    return int(found[-1]) if found else None


def _count(output: Any) -> int | None:
    if not isinstance(output, dict):
        return None
    meta = output.get("meta_info")
    return as_count(meta.get("completion_tokens")) if isinstance(meta, dict) else None
