"""The HTTP side of `specroute bench`: one streaming request measured (TTFT, token times,
usage counts, errors), model discovery and SGLang's `/server_info`.

A request's TTFT is its first output event and its decode time runs to its last one. An output
event is a chunk whose choice carries a delta field (`content`, `reasoning` as vLLM names it,
`reasoning_content` as SGLang does, `tool_calls`, `role`) or completions `text`, even when the
text is empty, or a `finish_reason`: a server streams a chunk because tokens were generated, and
vLLM sends empty-content chunks while a UTF-8 sequence is incomplete, so counting only chunks with
text would end the decode early and inflate its rate. (SGLang's and vLLM's first chat chunk, the
role with empty content, goes out when the first token exists.) Token counts come from the usage
chunk (`stream_options.include_usage`), because with speculative decoding one chunk carries
several tokens, and a chunk's text says nothing of how many tokens made it. Every failure (HTTP status, error
event in the stream, missing usage or [DONE], connection error, timeout) becomes the
result's `error`; `one_request` never raises for server or network trouble.
"""

from __future__ import annotations

import json
import time
from typing import Any

import aiohttp

from controller.bench.prompts import Endpoint
from controller.bench.result import Phase, RequestResult
from controller.bench.sglang_import import parse_server_info
from controller.proxy.engines import VLLM, VLLM_ACCEPTED, VLLM_DRAFTS, VLLM_RUNNING, aggregate, read_samples
from controller.proxy.limits import ResponseTooLarge, read_bounded
from controller.proxy.scrape import SCRAPE_LIMIT_BYTES
from controller.proxy.spec_details import accept_length, vllm_accept_length


def base_url(url: str) -> str:
    u = url.rstrip("/")
    return u[: -len("/v1")] if u.endswith("/v1") else u


async def _get_json(session: aiohttp.ClientSession, url: str) -> Any | None:
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status != 200:
                return None
            return await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        return None


async def fetch_server_info(session: aiohttp.ClientSession, base: str) -> dict[str, Any]:
    """The server's engine, acceptance and running-request cap: SGLang's `/server_info` (or
    `/get_server_info`), else vLLM's `/metrics` (its lifetime speculative counters; it does not
    export `--max-num-seqs`).

    Always returns a dict; fields the server does not have are None."""
    for path in ("/server_info", "/get_server_info"):
        info = await _get_json(session, base + path)
        if isinstance(info, dict):
            return {"endpoint": path, "engine": "sglang", **parse_server_info(info)}
    out: dict[str, Any] = {"endpoint": None, "engine": None, **parse_server_info(None)}
    try:
        async with session.get(base + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp:
            text = (await read_bounded(resp, SCRAPE_LIMIT_BYTES)).decode(errors="replace") if resp.ok else ""
    except (aiohttp.ClientError, TimeoutError, ResponseTooLarge):
        return out
    found = read_samples(text, VLLM.wanted)
    if not found or VLLM_RUNNING not in found:
        return out
    accepted, drafts = aggregate(found.get(VLLM_ACCEPTED, ())), aggregate(found.get(VLLM_DRAFTS, ()))
    out.update(endpoint="/metrics", engine="vllm", spec_accepted_tokens=accepted, spec_drafts=drafts)
    if drafts is not None:  # vLLM exports the spec-decode counters only with --speculative-config
        out["speculative_algorithm"] = "vllm speculative decoding"
    if accepted is not None and drafts:
        out["avg_spec_accept_length"] = 1.0 + accepted / drafts
    return out


async def discover_context(session: aiohttp.ClientSession, base: str) -> int | None:
    """The model's context length (`max_model_len` in `GET /v1/models`, as vLLM and SGLang report
    it); None when the server does not say."""
    data = await _get_json(session, base + "/v1/models")
    try:
        value = data["data"][0]["max_model_len"]  # type: ignore[index]
    except (KeyError, IndexError, TypeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


class BenchError(RuntimeError):
    """The sweep cannot run (server unreachable); the message says why."""


async def discover_model(session: aiohttp.ClientSession, base: str) -> str:
    """First model id of `GET /v1/models` ("default" if the server has no such route).

    Raises BenchError when nothing answers at `base`, so a wrong URL fails at once."""
    try:
        async with session.get(base + "/v1/models", timeout=aiohttp.ClientTimeout(total=30)) as resp:
            data = await resp.json(content_type=None) if resp.status == 200 else None
    except (aiohttp.ClientConnectionError, TimeoutError) as e:
        raise BenchError(f"cannot reach {base}: {e.__class__.__name__}: {e}") from None
    except (aiohttp.ClientError, ValueError):
        data = None
    try:
        return str(data["data"][0]["id"])  # type: ignore[index]
    except (KeyError, IndexError, TypeError):
        return "default"


def _error_message(obj: Any) -> str | None:
    """The message of an error event (OpenAI nested or SGLang flat), else None."""
    if not isinstance(obj, dict):
        return None
    err = obj.get("error")
    if isinstance(err, dict):
        return str(err.get("message") or err)
    if err is not None:
        return str(err)
    if obj.get("object") == "error":
        return str(obj.get("message") or "error")
    return None


_DELTA_FIELDS = ("content", "reasoning", "reasoning_content", "tool_calls", "role")


def _token_bearing(choice: dict[str, Any], endpoint: Endpoint) -> bool:
    """An output event (see the module's opening): text fields present, even empty, or a finish."""
    if choice.get("finish_reason") is not None:
        return True
    if endpoint == "completions":
        return isinstance(choice.get("text"), str)
    delta = choice.get("delta")
    return isinstance(delta, dict) and any(delta.get(k) is not None for k in _DELTA_FIELDS)


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    endpoint: Endpoint,
    phase: Phase,
    t0: float,
    timeout_s: float,
) -> RequestResult:
    """Send one streaming request; never raises for server or network trouble."""
    start = time.perf_counter()
    r = RequestResult(phase=phase, start_s=start - t0)
    spec: Any = None
    vllm_spec: Any = None
    done = False
    events = 0
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.post(url, json=body, timeout=timeout) as resp:
            r.status = resp.status
            if resp.status != 200:
                text = (await resp.text(errors="replace"))[:300]
                r.error = f"HTTP {resp.status}: {text.strip()}"
                return r
            async for raw in resp.content:
                line = raw.decode("utf-8", errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                payload = line[5:].strip()
                events += 1
                if payload == "[DONE]":
                    done = True
                    break
                now = time.perf_counter() - t0
                try:
                    obj = json.loads(payload)
                except json.JSONDecodeError:
                    obj = None
                if not isinstance(obj, dict):
                    r.error = f"malformed event: {payload[:100]}"
                    return r
                if (msg := _error_message(obj)) is not None:
                    r.error = f"error event: {msg}"
                    return r
                choices = obj.get("choices")
                for choice in choices if isinstance(choices, list) else []:
                    if not isinstance(choice, dict):
                        continue
                    if _token_bearing(choice, endpoint):
                        if r.first_token_s is None:
                            r.first_token_s = now
                            r.ttft_s = now - r.start_s
                        r.last_token_s = now
                    if choice.get("finish_reason") == "abort":
                        r.error = "request aborted by the server"
                        return r
                ext = obj.get("sglext")
                if isinstance(ext, dict) and "spec_tokens_details" in ext:
                    spec = ext["spec_tokens_details"]
                metrics = obj.get("metrics")  # vLLM's --per-request-spec-decode-metrics
                if isinstance(metrics, dict) and "speculative_decoding" in metrics:
                    vllm_spec = metrics["speculative_decoding"]
                usage = obj.get("usage")
                if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
                    r.completion_tokens = usage["completion_tokens"]
                    if isinstance(usage.get("prompt_tokens"), int):
                        r.prompt_tokens = usage["prompt_tokens"]
                    details = usage.get("prompt_tokens_details")
                    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                        r.cached_tokens = details["cached_tokens"]
    except TimeoutError:
        r.error = f"timeout after {timeout_s:g} s"
    except aiohttp.ClientError as e:
        r.error = f"connection error: {e.__class__.__name__}: {e}"
    except ValueError as e:  # aiohttp: an SSE line longer than its read limit
        r.error = f"stream read error: {e}"
    finally:
        r.end_s = time.perf_counter() - t0
    if spec is not None:
        r.accept_length = accept_length(spec, r.completion_tokens)
    elif vllm_spec is not None:
        r.accept_length = vllm_accept_length(vllm_spec)
        depth = vllm_spec.get("num_spec_tokens") if isinstance(vllm_spec, dict) else None
        r.draft_tokens = depth if isinstance(depth, int) and not isinstance(depth, bool) else None
    if r.error is None:
        if events == 0:
            r.error = "no SSE events in the response (does the server stream?)"
        elif not done:
            r.error = "stream ended before [DONE]"
        elif r.completion_tokens is None:
            r.error = "no usage in the stream (stream_options.include_usage ignored?)"
        elif r.first_token_s is None or r.completion_tokens < 1:
            r.error = "no tokens generated"
    return r
