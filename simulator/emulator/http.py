"""HTTP layer of the emulator: SGLang's routes and exact response shapes.

Shapes follow SGLang's OpenAI-compatible server (`serving_chat.py`,
`serving_completions.py`, `v1_loads.py`, `http_server.py`): chat streams send a role chunk
when the first token exists, one content chunk per engine step (several tokens per chunk on
an EAGLE server), a separate finish chunk, the `choices: []` usage chunk when
`stream_options.include_usage`, then `data: [DONE]`. Completion streams carry the finish
reason on their last content chunk. Errors use SGLang's flat error body. Response headers
are sent with the first event, as SGLang does.

Deviations, on purpose: `/v1/loads` reports live running/waiting counts (SGLang's are at most
a few decode steps old); `/health` answers at once (0.5.23 runs a one-token generation);
`n > 1`, logprobs, tools and batch prompts are not emulated (400 or ignored).
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from simulator.emulator.batching import EngineRequest, Finished, FinishReason, QueueFull

if TYPE_CHECKING:
    from simulator.emulator.state import Emulator

Kind = Literal["chat", "completions"]
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_WORDS: tuple[str, ...] = (" The", " emulated", " server", " writes", " these", " synthetic", " tokens")
_WORDS += (",", " one", " per", " step", " of", " its", " batch", " schedule", ".")
_HINT_HEADER = "x-specroute-hint"
_UNAUTHENTICATED = ("/health", "/ready", "/metrics")
SGLANG_VERSION = "0.5.23"


def _dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def _text(start: int, n: int) -> str:
    return "".join(_WORDS[(start + i) % len(_WORDS)] for i in range(n))


def error_response(status: int, message: str, type_: str = "BadRequestError") -> web.Response:
    """SGLang's flat error body."""
    body = {"object": "error", "message": message, "type": type_, "param": None, "code": status}
    return web.Response(status=status, text=_dumps(body), content_type="application/json")


class BadRequest(Exception):
    pass


@dataclass(frozen=True, slots=True)
class GenRequest:
    kind: Kind
    model: str
    stream: bool
    include_usage: bool
    max_tokens: int | None
    ignore_eos: bool
    prompt_tokens: int
    rid: str | None
    spec_details: bool = False


def _tokens_of_text(text: str) -> int:
    return math.ceil(len(text) / 4)


def _chat_prompt_tokens(messages: Any) -> int:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list")
    total = 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{i}] must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, str):
            total += _tokens_of_text(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    total += _tokens_of_text(part["text"])
        elif content is not None:
            raise BadRequest(f"messages[{i}].content must be a string, a list of parts or null")
        total += 4  # chat template overhead per message
    return total


def _completion_prompt_tokens(prompt: Any) -> int:
    if isinstance(prompt, str):
        return max(1, _tokens_of_text(prompt))
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return len(prompt)
        if len(prompt) == 1:
            return _completion_prompt_tokens(prompt[0])
        raise BadRequest("the emulator serves one prompt per request")
    raise BadRequest("'prompt' must be a non-empty string or list of token ids")


def _opt_int(body: dict[str, Any], key: str, minimum: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise BadRequest(f"'{key}' must be an integer >= {minimum}")
    return v


def parse_generation(body: Any, kind: Kind, default_model: str) -> GenRequest:
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    model = body.get("model", default_model)
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string")
    if ":" in model:
        base, adapter = model.split(":", 1)
        raise BadRequest(f"model {model!r} selects LoRA adapter {adapter!r} of {base!r}, but LoRA is off")
    if kind == "chat":
        prompt_tokens = _chat_prompt_tokens(body.get("messages"))
        max_tokens = _opt_int(body, "max_completion_tokens", 1)
        if max_tokens is None:
            max_tokens = _opt_int(body, "max_tokens", 1)
    else:
        prompt_tokens = _completion_prompt_tokens(body.get("prompt"))
        max_tokens = _opt_int(body, "max_tokens", 1)
    n = _opt_int(body, "n", 1)
    if n not in (None, 1):
        raise BadRequest("the emulator supports n=1 only")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object")
    ignore_eos = body.get("ignore_eos", False)
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise BadRequest("'rid' must be a string")
    return GenRequest(
        kind=kind,
        model=model,
        stream=stream,
        include_usage=bool(options.get("include_usage")),
        max_tokens=max_tokens,
        ignore_eos=bool(ignore_eos),
        prompt_tokens=prompt_tokens,
        rid=rid,
        spec_details=bool(body.get("return_spec_tokens_details")),
    )


# -- response bodies -----------------------------------------------------------------------


def _usage(g: GenRequest, completion: int) -> dict[str, Any]:
    u: dict[str, Any] = {
        "prompt_tokens": g.prompt_tokens,
        "total_tokens": g.prompt_tokens + completion,
        "completion_tokens": completion,
        "prompt_tokens_details": None,
        "reasoning_tokens": 0,
    }
    if g.kind == "chat":
        u["completion_tokens_details"] = None
    else:
        del u["prompt_tokens_details"]  # completions' usage chunk is dumped with exclude_none
    return u


class _Stream:
    """Builds the SSE events of one streaming response."""

    def __init__(self, g: GenRequest, rid: str, eos_token_id: int) -> None:
        self.g = g
        self.rid = rid
        self.eos = eos_token_id
        self.created = int(time.time())
        obj = "chat.completion.chunk" if g.kind == "chat" else "text_completion"
        self._head = {"id": rid, "object": obj, "created": self.created, "model": g.model}

    def _event(self, choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return f"data: {_dumps({**self._head, 'choices': choices, **extra})}\n\n".encode()

    def _matched(self, reason: FinishReason | None) -> int | None:
        return self.eos if reason == "stop" else None

    def role(self) -> bytes:
        delta = {"reasoning_content": None, "role": "assistant", "content": ""}
        return self._event([self._chat_choice(delta, None)])

    def _chat_choice(self, delta: dict[str, Any], reason: FinishReason | None) -> dict[str, Any]:
        return {
            "index": 0,
            "delta": delta,
            "logprobs": None,
            "finish_reason": reason,
            "matched_stop": self._matched(reason),
        }

    def content(self, text: str, reason: FinishReason | None = None) -> bytes:
        if self.g.kind == "chat":
            return self._event([self._chat_choice({"reasoning_content": None, "content": text}, None)])
        choice = {
            "index": 0,
            "text": text,
            "logprobs": None,
            "finish_reason": reason,
            "matched_stop": self._matched(reason),
        }
        return self._event([choice], usage=None)

    def finish(self, reason: FinishReason) -> bytes:
        if self.g.kind == "chat":
            return self._event([self._chat_choice({"reasoning_content": None}, reason)])
        return self.content("", reason)

    def usage(self, completion: int) -> bytes:
        return self._event([], usage=_usage(self.g, completion))

    def spec_details(self, details: dict[str, Any]) -> bytes:
        return self._event([], sglext={"spec_tokens_details": details})


def spec_tokens_details(req: EngineRequest, num_steps: int) -> dict[str, Any]:
    """SGLang's per-request acceptance summary (`return_spec_tokens_details`). As in SGLang's
    TokenizerManager, `spec_accept_length` is completion tokens / verify passes (the first token,
    from prefill, included) and the proposed drafts are verify passes x (draft tokens - 1)."""
    verify = req.verify_ct
    correct = req.accepted_tokens - verify  # drafts accepted, bonus tokens excluded
    proposed = verify * num_steps
    return {
        "spec_accept_rate": correct / proposed if proposed else 0.0,
        "spec_accept_length": req.generated / verify if verify else 0.0,
        "spec_verify_ct": verify,
        "spec_num_correct_drafts": correct,
        "spec_num_proposed_drafts": proposed,
    }


def queue_full_event() -> bytes:
    err = {
        "object": "error",
        "message": "The request queue is full.",
        "type": "SERVICE_UNAVAILABLE",
        "param": None,
        "code": 503,
    }
    return f"data: {json.dumps({'error': err})}\n\n".encode()


def _drop_connection(request: web.Request) -> None:
    """Die abruptly: the client sees the connection close mid-response."""
    if request.transport is not None:
        request.transport.abort()


class _Dropped(Exception):
    pass


# -- handlers ------------------------------------------------------------------------------


def add_routes(app: web.Application, key: web.AppKey[Emulator]) -> None:
    def emu(request: web.Request) -> Emulator:
        return request.app[key]

    @web.middleware
    async def gate(request: web.Request, handler: Handler) -> web.StreamResponse:
        e = emu(request)
        if e.faults.refuse_connections:
            _drop_connection(request)
            raise web.HTTPServiceUnavailable()  # never reaches the client: the socket is gone
        key_ = e.config.api_key
        if key_ is not None and not request.path.startswith(_UNAUTHENTICATED):
            if request.headers.get("Authorization", "") != f"Bearer {key_}":
                return web.json_response({"error": "Unauthorized"}, status=401)
        gauge = e.metrics.http_requests_active
        gauge.inc()
        try:
            return await handler(request)
        finally:
            gauge.dec()

    app.middlewares.append(gate)

    async def generate(request: web.Request, kind: Kind) -> web.StreamResponse:
        e = emu(request)
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_response(400, "the request body is not valid JSON")
        try:
            g = parse_generation(body, kind, e.config.model)
        except BadRequest as err:
            return error_response(400, str(err))
        if g.prompt_tokens >= e.config.max_model_len:
            return error_response(
                400,
                f"The input ({g.prompt_tokens} tokens) is longer than the model's context length "
                f"({e.config.max_model_len} tokens).",
            )
        if g.max_tokens is not None and g.prompt_tokens + g.max_tokens >= e.config.max_model_len:
            total = g.prompt_tokens + g.max_tokens
            return error_response(  # SGLang's TokenizerManager._validate_one_request wording
                400,
                f"Requested token count exceeds the model's maximum context length of "
                f"{e.config.max_model_len} tokens. You requested a total of {total} tokens: "
                f"{g.prompt_tokens} tokens from the input messages and {g.max_tokens} tokens for the "
                "completion. Please reduce the number of tokens in the input messages or the "
                "completion to fit within the limit.",
            )
        faults = e.faults
        if faults.stall_s > 0:
            await asyncio.sleep(faults.stall_s)
        if faults.error_rate > 0 and e.rng.random() < faults.error_rate:
            return error_response(500, "Internal server error (emulated fault).", "InternalServerError")
        engine = e.engine
        if g.rid is not None and engine.is_active(g.rid):
            return error_response(400, f"duplicate request id {g.rid!r}")
        req = e.new_request(
            g.rid, g.prompt_tokens, g.max_tokens, g.ignore_eos, request.headers.get(_HINT_HEADER)
        )
        engine.max_queued_requests = faults.max_queued_requests
        try:
            engine.submit(req)
        except QueueFull:
            if not g.stream:
                return error_response(503, "The request queue is full.", "SERVICE_UNAVAILABLE")
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await resp.write(queue_full_event() + b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        try:
            if g.stream:
                return await _stream(request, e, g, req)
            return await _complete(e, g, req, request)
        except (ConnectionResetError, _Dropped):
            return web.Response(status=499)  # the client is gone; nothing is sent
        finally:
            if not req.done:
                engine.abort(req.rid)  # client gone or connection dropped: free the slot now

    async def chat(request: web.Request) -> web.StreamResponse:
        return await generate(request, "chat")

    async def completions(request: web.Request) -> web.StreamResponse:
        return await generate(request, "completions")

    async def models(request: web.Request) -> web.Response:
        c = emu(request).config
        card = {
            "id": c.model,
            "object": "model",
            "created": int(emu(request).started_at),
            "owned_by": "sglang",
            "root": c.model,
            "parent": None,
            "max_model_len": c.max_model_len,
        }
        return web.json_response({"object": "list", "data": [card]})

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=503 if emu(request).faults.unhealthy else 200)

    async def server_info(request: web.Request) -> web.Response:
        return web.json_response(_server_info(emu(request), request))

    async def model_info(request: web.Request) -> web.Response:
        c = emu(request).config
        info = {
            "model_path": c.model,
            "tokenizer_path": c.model,
            "served_model_name": c.model,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }
        return web.json_response(info)

    async def loads(request: web.Request) -> web.Response:
        return web.json_response(_loads(emu(request)))

    async def abort(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return error_response(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        engine = emu(request).engine
        if body.get("abort_all"):
            engine.abort_all()
        rid = body.get("rid")
        for r in rid if isinstance(rid, list) else [rid]:
            if isinstance(r, str):
                engine.abort(r)
        return web.Response(status=200)

    async def metrics(request: web.Request) -> web.Response:
        data = generate_latest(emu(request).metrics.registry)
        return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", models)
    for path in ("/health", "/health_generate", "/ready"):
        app.router.add_get(path, health)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    for path in ("/model_info", "/get_model_info"):
        app.router.add_get(path, model_info)
    app.router.add_get("/v1/loads", loads)
    app.router.add_post("/abort_request", abort)
    app.router.add_get("/metrics", metrics)


async def _stream(request: web.Request, e: Emulator, g: GenRequest, req: EngineRequest) -> web.StreamResponse:
    s = _Stream(g, req.rid, e.config.eos_token_id)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    sent_role = False
    chunks = 0
    reason: FinishReason | None = None
    while reason is None:
        ev = await req.events.get()
        if not resp.prepared:
            await resp.prepare(request)
        out = b""
        if g.kind == "chat" and not sent_role:
            out += s.role()
            sent_role = True
        if isinstance(ev, Finished):
            reason = ev.reason
            out += s.finish(reason)
        else:
            text = _text(req.generated - ev.n, ev.n)
            if g.kind == "chat":
                out += s.content(text)
            else:
                nxt = _peek_finish(req)
                out += s.content(text, nxt)
                reason = nxt
            chunks += 1
        await resp.write(out)
        die = e.faults.die_after_chunks
        if die is not None and chunks >= die and reason is None:
            _drop_connection(request)
            raise _Dropped
    tail = b""
    if g.spec_details and e.config.mode == "eagle":
        tail += s.spec_details(spec_tokens_details(req, e.config.speculative_num_steps))
    if g.include_usage:
        tail += s.usage(req.generated)
    await resp.write(tail + b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp


def _peek_finish(req: EngineRequest) -> FinishReason | None:
    """Completions carry the finish reason on the last content chunk: take it if queued."""
    if req.events.empty():
        return None
    ev = req.events.get_nowait()
    if isinstance(ev, Finished):
        return ev.reason
    raise AssertionError("a token event cannot follow another without a step in between")


async def _complete(e: Emulator, g: GenRequest, req: EngineRequest, request: web.Request) -> web.Response:
    chunks = 0
    while True:
        ev = await req.events.get()
        if isinstance(ev, Finished):
            reason = ev.reason
            break
        chunks += 1
        die = e.faults.die_after_chunks
        if die is not None and chunks >= die:
            _drop_connection(request)
            raise _Dropped
    text = _text(0, req.generated)
    matched = e.config.eos_token_id if reason == "stop" else None
    if g.kind == "chat":
        message = {"role": "assistant", "content": text, "reasoning_content": None, "tool_calls": None}
        choice: dict[str, Any] = {"index": 0, "message": message}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text}
        obj = "text_completion"
    choice.update(logprobs=None, finish_reason=reason, matched_stop=matched)
    usage = _usage(g, req.generated)
    usage.setdefault("prompt_tokens_details", None)
    body = {
        "id": req.rid,
        "object": obj,
        "created": int(time.time()),
        "model": g.model,
        "choices": [choice],
        "usage": usage,
        "metadata": {"weight_version": "default"},
    }
    if g.spec_details and e.config.mode == "eagle":
        body["sglext"] = {"spec_tokens_details": spec_tokens_details(req, e.config.speculative_num_steps)}
    return web.Response(text=_dumps(body), content_type="application/json")


def _spec_section(e: Emulator) -> dict[str, float] | None:
    if e.config.mode != "eagle":
        return None
    st = e.engine.stats
    return {"accept_length": st.spec_accept_length, "accept_rate": st.spec_accept_rate}


def _loads(e: Emulator) -> dict[str, Any]:
    engine = e.engine
    cap = engine.max_running_requests
    used = engine.used_tokens()
    load: dict[str, Any] = {
        "dp_rank": 0,
        "timestamp": time.time(),
        "num_running_reqs": engine.num_running,
        "num_waiting_reqs": engine.num_queued,
        "num_used_tokens": used,
        "num_total_tokens": used,
        "max_total_num_tokens": engine.max_total_num_tokens,
        "token_usage": used / engine.max_total_num_tokens,
        "gen_throughput": engine.stats.gen_throughput,
        "cache_hit_rate": 0.0,
        "utilization": engine.num_running / cap,
        "max_running_requests": cap,
        "queues": {"waiting": engine.num_queued, "grammar": 0, "paused": 0, "retracted": 0},
    }
    spec = _spec_section(e)
    if spec is not None:
        load["speculative"] = spec
    return {
        "timestamp": datetime.now(UTC).isoformat(),
        "version": SGLANG_VERSION,
        "accelerator": "specroute emulator",
        "num_accelerators": 0,
        "loads": [load],
    }


def _server_info(e: Emulator, request: web.Request) -> dict[str, Any]:
    c = e.config
    engine = e.engine
    eagle = c.mode == "eagle"
    steps = c.speculative_num_steps if eagle else None
    state: dict[str, Any] = {
        "effective_max_running_requests_per_dp": engine.max_running_requests,
        "last_gen_throughput": engine.stats.gen_throughput,
        "memory_usage": {"weight": 0.0, "kvcache": 0.0, "token_capacity": engine.max_total_num_tokens},
    }
    avg = engine.avg_accept_length()
    if avg is not None:
        state["avg_spec_accept_length"] = avg
    host, _, port = (request.host or "").rpartition(":")
    return {
        "model_path": c.model,
        "tokenizer_path": c.model,
        "served_model_name": c.model,
        "host": host or None,
        "port": int(port) if port.isdigit() else None,
        "context_length": c.max_model_len,
        "max_running_requests": engine.max_running_requests,
        "max_queued_requests": e.faults.max_queued_requests,
        "speculative_algorithm": "EAGLE3" if eagle else None,
        "speculative_num_steps": steps,
        "speculative_eagle_topk": 1 if eagle else None,
        "speculative_num_draft_tokens": steps + 1 if steps is not None else None,
        "tp_size": 1,
        "dp_size": 1,
        "enable_metrics": True,
        "internal_states": [state],
        "version": SGLANG_VERSION,
        "specroute_emulator": {
            "mode": c.mode,
            "profile": c.profile.name,
            "time_scale": c.time_scale,
            "accept_length": c.effective_accept_length,
        },
    }
