"""HTTP layer of the emulator: SGLang's routes, its error bodies, and the read loop that turns
engine events into responses (the bodies themselves are built in `shapes.py`).

How it works: a generation request becomes one engine request per sample (`n` per prompt; a
batch has several prompts), all sharing one event queue. Every read takes all the events that
are queued, not just one: after a late wake-up (a loaded machine, a paused process) the engine
runs the overdue steps back to back, and SGLang's tokenizer manager likewise drains a request's
whole output list and sends the latest state. So one chunk may carry the tokens of several
steps, and a completions chunk carries the finish reason when the update that ended the sample
is the one it reports. Response headers go out with the first event, as SGLang sends them.

Deviations, on purpose (docs/sglang.md lists them for users): `/v1/loads` reports live
running/waiting counts (SGLang's are at most a few decode steps old); `/health` answers at once
(0.5.23 runs a one-token generation); token text, ids and logprobs are synthetic; tools and
tool calls, `echo`, `max_tokens: 0` and per-prompt `sampling_params` lists are not emulated;
the prefix cache works in blocks of `cache_block_tokens` tokens of the prompt's canonical text
(SGLang's works per token), and running requests' tokens do not bound admission.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from policies.base import HINT_HEADER
from simulator.emulator import shapes
from simulator.emulator.batching import Event, FinishReason, QueueFull, Tokens
from simulator.emulator.info import loads_body, server_info_body
from simulator.emulator.requests import (
    BadRequest,
    ContractError,
    GenerateError,
    GenRequest,
    Kind,
    context_error,
    parse_generate,
    parse_openai,
)
from simulator.emulator.shapes import Sample, Update
from simulator.emulator.state import EMULATOR_KEY, Emulator

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_UNAUTHENTICATED = ("/health", "/ready", "/metrics")


def error_response(status: int, message: str, type_: str = "BadRequestError") -> web.Response:
    """SGLang's flat error body."""
    body = {"object": "error", "message": message, "type": type_, "param": None, "code": status}
    return web.Response(status=status, text=shapes.dumps(body), content_type="application/json")


def _nested_error(status: int, error: Any) -> web.Response:
    """`/generate`'s errors: `{"error": "..."}` (contract) or `{"error": {"message": ...}}`."""
    return web.Response(status=status, text=shapes.dumps({"error": error}), content_type="application/json")


def _drop_connection(request: web.Request) -> None:
    """Die abruptly: the client sees the connection close mid-response."""
    if request.transport is not None:
        request.transport.abort()


class _Dropped(Exception):
    pass


async def _event_stream(request: web.Request, *events: bytes) -> web.StreamResponse:
    """HTTP 200 with these SSE events and nothing else (errors SGLang streams)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await resp.write(b"".join(events))
    await resp.write_eof()
    return resp


# -- reading the engine ---------------------------------------------------------------------


async def next_updates(queue: asyncio.Queue[Event], samples: list[Sample]) -> list[Update]:
    """Wait for at least one event, then take every queued one: per sample (in the order they
    appear) the new tokens and the finish, if it came. Advances each sample's `sent`/`finish`."""
    events = [await queue.get()]
    while not queue.empty():
        events.append(queue.get_nowait())
    new: dict[int, int] = {}
    finish: dict[int, FinishReason] = {}
    for ev in events:
        new.setdefault(ev.index, 0)
        if isinstance(ev, Tokens):
            new[ev.index] += ev.n
        else:
            finish[ev.index] = ev.reason
    updates = []
    for index, n in new.items():
        s = samples[index]
        updates.append(Update(s, s.sent, n, finish.get(index)))
        s.sent += n
        if index in finish:
            s.finish = finish[index]
    return updates


def _sample_rids(g: GenRequest) -> list[str]:
    """SGLang's ids: the client's `rid` for one sample; `rid_i` per prompt of a batch; fresh
    ids for parallel samples (n > 1)."""
    if g.samples == 1:
        return [g.rid or uuid.uuid4().hex]
    if g.n == 1 and g.rid is not None:
        return [f"{g.rid}_{i}" for i in range(g.samples)]
    return [uuid.uuid4().hex for _ in range(g.samples)]


def _submit(e: Emulator, g: GenRequest, hint: str | None) -> list[Sample]:
    """One engine request per sample, sharing one event queue; QueueFull (nothing left
    submitted) when the waiting queue is at its bound."""
    engine = e.engine
    engine.max_queued_requests = e.faults.max_queued_requests
    queue: asyncio.Queue[Event] = asyncio.Queue()
    samples: list[Sample] = []
    try:
        for i, rid in enumerate(_sample_rids(g)):
            req = e.new_request(
                rid, g.prompt_of(i), g.max_tokens, g.ignore_eos, hint, events=queue, index=i,
                text=g.text_of(i), chat=g.kind == "chat", ids_prompt=g.ids_prompt, temperature=g.temperature,
            )  # fmt: skip
            engine.submit(req)
            samples.append(Sample(i, req))
    except QueueFull:
        for s in samples:
            engine.abort(s.req.rid)
        raise
    return samples


def _spec(e: Emulator, samples: list[Sample]) -> list[dict[str, Any]]:
    return [shapes.spec_meta(s.req) if e.config.mode == "eagle" else {} for s in samples]


async def _read_all(e: Emulator, request: web.Request, samples: list[Sample]) -> None:
    """Until every sample has finished (non-streaming answers), with the mid-answer fault."""
    queue = samples[0].req.events
    chunks = 0
    while any(s.finish is None for s in samples):
        updates = await next_updates(queue, samples)
        chunks += sum(1 for u in updates if u.new)
        die = e.faults.die_after_chunks
        if die is not None and chunks >= die:
            _drop_connection(request)
            raise _Dropped


async def _stream(
    request: web.Request, e: Emulator, samples: list[Sample], write: Callable[[list[Update]], bytes]
) -> web.StreamResponse:
    """Stream `write(updates)` per read until every sample has finished; the caller writes the
    tail and ends the response."""
    queue = samples[0].req.events
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    chunks = 0
    while any(s.finish is None for s in samples):
        updates = await next_updates(queue, samples)
        if not resp.prepared:
            await resp.prepare(request)
        await resp.write(write(updates))
        chunks += sum(1 for u in updates if u.new)
        die = e.faults.die_after_chunks
        if die is not None and chunks >= die and any(s.finish is None for s in samples):
            _drop_connection(request)
            raise _Dropped
    return resp


# -- the generation routes ---------------------------------------------------------------


def _emulator(request: web.Request) -> Emulator:
    return request.app[EMULATOR_KEY]


Answer = Callable[[], Awaitable[web.StreamResponse]]


async def _faults(e: Emulator, g: GenRequest) -> web.Response | None:
    """The knobs that act before generation; an answer when one fires."""
    if e.faults.stall_s > 0:
        await asyncio.sleep(e.faults.stall_s)
    if e.faults.error_rate > 0 and e.rng.random() < e.faults.error_rate:
        return error_response(500, "Internal server error (emulated fault).", "InternalServerError")
    if g.rid is not None and any(e.engine.is_active(r) for r in _sample_rids(g)):
        return error_response(400, f"duplicate request id {g.rid!r}")
    return None


async def _admit(
    request: web.Request, e: Emulator, g: GenRequest, queue_full: Answer
) -> list[Sample] | web.StreamResponse:
    """The fault knobs, then one engine request per sample; an answer instead when a fault
    fires or the waiting queue is full (`queue_full` builds that answer)."""
    refused = await _faults(e, g)
    if refused is not None:
        return refused
    try:
        return _submit(e, g, request.headers.get(HINT_HEADER))
    except QueueFull:
        return await queue_full()


async def _run(e: Emulator, samples: list[Sample], answer: Answer) -> web.StreamResponse:
    try:
        return await answer()
    except (ConnectionResetError, _Dropped):
        return web.Response(status=499)  # the client is gone; nothing is sent
    finally:
        for s in samples:
            if not s.req.done:
                e.engine.abort(s.req.rid)  # client gone or connection dropped: free the slot now


class _Answer:
    """The answer to one generation request: admitted (or refused), then streamed or whole."""

    def __init__(self, request: web.Request, e: Emulator, g: GenRequest) -> None:
        self.request, self.e, self.g = request, e, g
        self.samples: list[Sample] = []

    async def respond(self) -> web.StreamResponse:
        samples = await _admit(self.request, self.e, self.g, self.queue_full)
        if not isinstance(samples, list):
            return samples
        self.samples = samples
        return await _run(self.e, samples, self.streamed if self.g.stream else self.whole)

    async def queue_full(self) -> web.StreamResponse:
        raise NotImplementedError

    async def streamed(self) -> web.StreamResponse:
        raise NotImplementedError

    async def whole(self) -> web.StreamResponse:
        raise NotImplementedError


class _OpenAIAnswer(_Answer):
    """The answer of an OpenAI route."""

    def __init__(self, request: web.Request, e: Emulator, g: GenRequest) -> None:
        super().__init__(request, e, g)
        self.details = g.spec_details and e.config.mode == "eagle"

    async def queue_full(self) -> web.StreamResponse:
        if not self.g.stream:
            return error_response(503, "The request queue is full.", "SERVICE_UNAVAILABLE")
        return await _event_stream(self.request, shapes.queue_full_event(), shapes.DONE)

    async def streamed(self) -> web.StreamResponse:
        e, samples = self.e, self.samples
        c = e.config
        events = shapes.OpenAIEvents(
            self.g,
            c.eos_token_id,
            cache_report=c.enable_cache_report,
            reasoning_tokens=c.reasoning_tokens,
            empty_chunk_every=c.empty_chunk_every,
        )
        finished: list[Sample] = []

        def write(updates: list[Update]) -> bytes:
            finished.extend(u.sample for u in updates if u.finish is not None)
            return b"".join(events.update(u) for u in updates)

        resp = await _stream(self.request, e, samples, write)
        await resp.write(events.tail(finished, samples, _spec(e, samples) if self.details else None))
        await resp.write_eof()
        return resp

    async def whole(self) -> web.StreamResponse:
        e, samples = self.e, self.samples
        await _read_all(e, self.request, samples)
        spec = _spec(e, samples) if self.details else None
        c = e.config
        body = shapes.openai_response(
            self.g, samples, c.eos_token_id, spec, cache_report=c.enable_cache_report
        )
        return web.Response(text=shapes.dumps(body), content_type="application/json")


async def _openai(request: web.Request, kind: Kind) -> web.StreamResponse:
    e = _emulator(request)
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return error_response(400, "the request body is not valid JSON")
    try:
        g = parse_openai(body, kind, e.config.model)
    except BadRequest as err:
        return error_response(400, str(err))
    too_long = context_error(g, e.config.max_model_len)
    if too_long is not None:
        return error_response(400, too_long)
    return await _OpenAIAnswer(request, e, g).respond()


async def chat(request: web.Request) -> web.StreamResponse:
    return await _openai(request, "chat")


async def completions(request: web.Request) -> web.StreamResponse:
    return await _openai(request, "completions")


class _NativeAnswer(_Answer):
    """The answer of `/generate`."""

    def __init__(self, request: web.Request, e: Emulator, g: GenRequest) -> None:
        super().__init__(request, e, g)
        self.loop = asyncio.get_running_loop()

    async def queue_full(self) -> web.StreamResponse:
        g = self.g
        if not g.stream:
            return error_response(503, "The request queue is full.", "503")
        event = shapes.native_queue_full_event(g.rid or uuid.uuid4().hex, g.prompt_of(0))
        return await _event_stream(self.request, event, shapes.DONE)

    def output(self, s: Sample) -> dict[str, Any]:
        spec = _spec(self.e, [s])[0] if s.finish is not None else None
        return shapes.native_output(self.g, s, self.e.config.eos_token_id, spec, self.loop.time())

    async def streamed(self) -> web.StreamResponse:
        def write(updates: list[Update]) -> bytes:
            return b"".join(shapes.event(self.output(u.sample)) for u in updates)

        resp = await _stream(self.request, self.e, self.samples, write)
        await resp.write(shapes.DONE)
        await resp.write_eof()
        return resp

    async def whole(self) -> web.StreamResponse:
        await _read_all(self.e, self.request, self.samples)
        outputs = [self.output(s) for s in self.samples]
        body = outputs if self.g.batch else outputs[0]
        return web.Response(text=shapes.dumps(body), content_type="application/json")


async def generate(request: web.Request) -> web.StreamResponse:
    """SGLang's native `/generate` (GenerateReqInput)."""
    e = _emulator(request)
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return error_response(400, "the request body is not valid JSON", "Bad Request")
    stream = isinstance(body, dict) and body.get("stream") is True

    async def refuse(message: str) -> web.StreamResponse:
        # SGLang raises ValueError inside the generator: an error event once streaming
        if stream:
            return await _event_stream(request, shapes.native_error_event(message), shapes.DONE)
        return _nested_error(400, {"message": message})

    try:
        g = parse_generate(body)
    except ContractError as err:
        return _nested_error(400, str(err))
    except GenerateError as err:
        return await refuse(str(err))
    too_long = context_error(g, e.config.max_model_len)
    if too_long is not None:
        return await refuse(too_long)
    return await _NativeAnswer(request, e, g).respond()


# -- what the server says of itself ---------------------------------------------------------


async def models(request: web.Request) -> web.Response:
    e = _emulator(request)
    c = e.config
    card = {
        "id": c.model,
        "object": "model",
        "created": int(e.started_at),
        "owned_by": "sglang",
        "root": c.model,
        "parent": None,
        "max_model_len": c.max_model_len,
    }
    return web.json_response({"object": "list", "data": [card]})


async def health(request: web.Request) -> web.Response:
    return web.Response(status=503 if _emulator(request).faults.unhealthy else 200)


async def server_info(request: web.Request) -> web.Response:
    return web.json_response(server_info_body(_emulator(request), request))


async def model_info(request: web.Request) -> web.Response:
    c = _emulator(request).config
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
    return web.json_response(loads_body(_emulator(request)))


async def metrics(request: web.Request) -> web.Response:
    data = generate_latest(_emulator(request).metrics.registry)
    return web.Response(body=data, headers={"Content-Type": CONTENT_TYPE_LATEST})


# -- control ------------------------------------------------------------------------------


async def abort(request: web.Request) -> web.Response:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        return error_response(400, "the request body is not valid JSON")
    if not isinstance(body, dict):
        return error_response(400, "the request body must be a JSON object")
    engine = _emulator(request).engine
    if body.get("abort_all"):
        engine.abort_all()
    rid = body.get("rid")
    for r in rid if isinstance(rid, list) else [rid]:
        if isinstance(r, str):
            engine.abort(r)
    return web.Response(status=200)


async def flush_cache(request: web.Request) -> web.Response:
    """SGLang's answer, word for word; 400 (nothing flushed) while requests run or wait."""
    e = _emulator(request)
    engine = e.engine
    idle = engine.num_running == 0 and engine.num_queued == 0
    ok = idle and (e.cache is None or e.cache.flush())
    return web.Response(status=200 if ok else 400, text=shapes.FLUSH_CACHE_ANSWER)


@web.middleware
async def gate(request: web.Request, handler: Handler) -> web.StreamResponse:
    """The connection-refusal fault, the API key (but on the probes and /metrics), and the
    `http_requests_active` gauge."""
    e = _emulator(request)
    if e.faults.refuse_connections:
        _drop_connection(request)
        raise web.HTTPServiceUnavailable()  # never reaches the client: the socket is gone
    key = e.config.api_key
    if key is not None and not request.path.startswith(_UNAUTHENTICATED):
        if request.headers.get("Authorization", "") != f"Bearer {key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
    gauge = e.metrics.http_requests_active
    gauge.inc()
    try:
        return await handler(request)
    finally:
        gauge.dec()


ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("POST", "/v1/chat/completions", chat),
    ("POST", "/v1/completions", completions),
    ("POST", "/generate", generate),
    ("PUT", "/generate", generate),
    ("GET", "/v1/models", models),
    *(("GET", path, health) for path in ("/health", "/health_generate", "/ready")),
    *(("GET", path, server_info) for path in ("/server_info", "/get_server_info")),
    *(("GET", path, model_info) for path in ("/model_info", "/get_model_info")),
    ("GET", "/v1/loads", loads),
    ("POST", "/abort_request", abort),
    ("GET", "/metrics", metrics),
    ("GET", "/flush_cache", flush_cache),
    ("POST", "/flush_cache", flush_cache),
)
"""SGLang's routes the emulator answers, with their handlers (GET answers HEAD too)."""


def add_routes(app: web.Application) -> None:
    """The emulator's routes and its `gate` middleware on `app` (which holds the `Emulator`
    under `EMULATOR_KEY`)."""
    app.middlewares.append(gate)
    for method, path, handler in ROUTES:
        if method == "GET":
            app.router.add_get(path, handler)
        else:
            app.router.add_route(method, path, handler)
