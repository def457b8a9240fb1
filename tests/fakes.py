"""A fake SGLang-like backend: a small real aiohttp app on 127.0.0.1:0.

It answers `/v1/chat/completions` and `/v1/completions` (streaming and not) with exactly
SGLang's shapes (docs/SGLANG_PROTOCOL.md, "Streaming answers"): role chunk, content chunks, a
finish chunk, the speculative details chunk (`choices: []`, `sglext.spec_tokens_details`) when
`return_spec_tokens_details` and the backend is `speculative`, the usage chunk (`choices: []`)
when `stream_options.include_usage`, then `data: [DONE]`. With `vllm_metrics` it answers as vLLM
started with `--per-request-spec-decode-metrics summary` instead: `metrics.speculative_decoding`
beside the usage of a whole answer and on a stream's usage event (SGLang's field ignored).
Answers are deterministic (the id is a hash of the request body, `created` is fixed) so a
response fetched directly and one fetched through the proxy can be compared byte for byte.

Behaviour is switched at run time through `mode` (or per request by a body field `fake_mode`,
which the proxy passes through like any unknown field):
  ok          normal answers
  error500    HTTP 500 with SGLang's flat error body
  queue_full  streaming: HTTP 200 whose first event is the queue-full error; else HTTP 503
  bad_request HTTP 400 with SGLang's flat error body
  stall       headers (streaming) but never a first event / never a body
  die_mid     stream `fail_after` content chunks, then drop the connection
  stall_mid   stream `fail_after` content chunks, then go silent
  pause_mid   stream `fail_after` content chunks, then wait for `resume` (set by the test)
  drop        read the request, then drop the connection without answering
A stopped backend (`await fake.stop()`) refuses connections. A request of `n` samples (x its
prompts, on /v1/completions) runs that many sequences, as SGLang does: one choice each (streamed
interleaved, `index` 0..) and `completion_tokens` their sum.

`RawBackend(answer)` answers with raw bytes instead, for misbehaviour no HTTP server framework
lets you produce (101, close-delimited streams torn mid-event, `Connection`-named headers).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from helpers import free_port

CREATED = 1700000000
QUEUE_FULL = {
    "error": {
        "object": "error",
        "message": "The request queue is full.",
        "type": "SERVICE_UNAVAILABLE",
        "param": None,
        "code": 503,
    }
}
"""The error event SGLang streams (after HTTP 200) when its request queue is full."""


def sglang_error(message: str, status: int, type_: str = "Error") -> dict[str, Any]:
    """SGLang's flat error body (no `{"error": ...}` wrapper)."""
    return {"object": "error", "message": message, "type": type_, "param": None, "code": status}


def sse(payload: dict[str, Any]) -> bytes:
    """One SSE event with a chunk, compact JSON as SGLang's `model_dump_json` writes it."""
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def sse_error(payload: dict[str, Any]) -> bytes:
    """One SSE event with an error, spaced JSON as SGLang's `json.dumps` writes it."""
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def stream_event(
    rid: str, model: Any, chat: bool, choices: list[dict[str, Any]], **extra: Any
) -> dict[str, Any]:
    """The envelope of a streamed chunk: id, object, created, model, choices, then `extra`."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    return {"id": rid, "object": obj, "created": CREATED, "model": model, "choices": choices, **extra}


def stream_chunk(
    rid: str,
    model: Any,
    chat: bool,
    text: str | None,
    finish: str | None = None,
    role: bool = False,
    index: int = 0,
) -> dict[str, Any]:
    """A one-choice streamed chunk (of choice `index`): the role chunk (chat, `role=True`), a
    content chunk, or the finish chunk (`text=None`, `finish` set). Completions chunks carry
    `usage: null`."""
    if chat:
        delta: dict[str, Any] = {"reasoning_content": None}
        if role:
            delta.update(role="assistant", content="")
        elif text is not None:
            delta["content"] = text
        c = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish, "matched_stop": None}
        return stream_event(rid, model, chat, [c])
    c = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish, "matched_stop": None}
    return stream_event(rid, model, chat, [c], usage=None)


def _sequences(body: dict[str, Any]) -> int:
    """The sequences a request runs: `n` x its prompts (a list of strings or of token-id lists
    is one prompt each)."""
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else 1
    return prompts * int(body.get("n") or 1)


def closed_port_url() -> str:
    """A URL on 127.0.0.1 where nothing listens (connection refused)."""
    return f"http://127.0.0.1:{free_port()}"


class FakeBackend:
    def __init__(
        self,
        name: str = "fake",
        *,
        model: str = "fake-model",
        chunks: int = 8,
        delay_s: float = 0.0,
        first_byte_delay_s: float = 0.0,
        ready_route: bool = True,
        speculative: bool = False,
        vllm_metrics: bool = False,
    ) -> None:
        self.name = name
        self.ready_route = ready_route
        """Serve GET /ready (SGLang releases before it had only /health)."""
        self.speculative = speculative
        """Answer `return_spec_tokens_details` (2 tokens per verify step after the first)."""
        self.vllm_metrics = vllm_metrics
        """Report vLLM's per-request `metrics.speculative_decoding` (`vllm_speculation`)."""
        self.probes: list[str] = []
        """Paths of the health probes received."""
        self.model = model
        self.chunks = chunks
        self.delay_s = delay_s
        self.first_byte_delay_s = first_byte_delay_s
        self.mode = "ok"
        self.fail_after = 2
        self.health_status = 200
        self.metrics_text = ""
        self.requests: list[dict[str, Any]] = []
        self.request_headers: list[dict[str, str]] = []
        self.active = 0
        self.stalled = 0
        """Requests this backend is holding in a stall (`stall`, `stall_mid`) right now."""
        self.max_active = 0
        self.sequences = 0
        """Sequences of the requests in progress (`n` x prompts, as SGLang runs them)."""
        self.max_sequences = 0
        self.paused = 0
        """Requests waiting in `pause_mid` for `resume`."""
        self.resume = asyncio.Event()
        self.completed = 0
        self.aborted = 0
        self.url = ""
        self._runner: web.AppRunner | None = None
        self.app = self._build_app()

    # -- lifecycle --

    async def start(self, port: int = 0) -> str:
        self._runner = web.AppRunner(
            self.app, handler_cancellation=True, access_log=None, shutdown_timeout=0.5
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # -- answers --

    def _build_app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024)  # whatever the proxy lets through
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        if self.ready_route:
            app.router.add_get("/ready", self._health)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        self.probes.append(request.path)
        return web.json_response({}, status=self.health_status)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text, content_type="text/plain")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.model,
                        "object": "model",
                        "created": CREATED,
                        "owned_by": "sglang",
                        "root": self.model,
                        "parent": None,
                        "max_model_len": 32768,
                    }
                ],
            }
        )

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    def _tokens(self, body: dict[str, Any]) -> list[str]:
        n = body.get("max_tokens") or body.get("max_completion_tokens") or self.chunks
        return [f"tok{i} " for i in range(min(int(n), self.chunks))]

    async def _serve(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        self.requests.append(body)
        self.request_headers.append(dict(request.headers))
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        sequences = _sequences(body)
        self.sequences += sequences
        self.max_sequences = max(self.max_sequences, self.sequences)
        mode = str(body.get("fake_mode", self.mode))
        try:
            if mode in ("error500", "bad_request") or (mode == "queue_full" and not body.get("stream")):
                status = {"error500": 500, "bad_request": 400, "queue_full": 503}[mode]
                return web.json_response(sglang_error(f"fake {mode}", status), status=status)
            if mode == "stall" and not body.get("stream"):
                await self._stall()
            if mode == "drop":
                assert request.transport is not None
                request.transport.abort()
                raise asyncio.CancelledError
            if self.first_byte_delay_s:
                await asyncio.sleep(self.first_byte_delay_s)
            # specroute appends fields to ask for the usage chunk and the speculative details a
            # client did not ask for: the id stays that of the client's own bytes, so direct and
            # proxied answers compare
            own = raw
            for suffix in (
                b', "return_spec_tokens_details": true}',
                b', "stream_options": {"include_usage": true}}',
            ):
                own = own[: -len(suffix)] + b"}" if own.endswith(suffix) else own
            rid = str(body.get("rid") or "fake" + hashlib.sha1(own).hexdigest()[:24])
            model = str(body.get("model", self.model))
            tokens = self._tokens(body)
            if body.get("stream"):
                resp = await self._stream(request, body, rid, model, tokens, chat, mode)
            else:
                resp = self._whole(body, rid, model, tokens, chat)
            self.completed += 1
            return resp
        except asyncio.CancelledError:
            self.aborted += 1
            raise
        finally:
            self.active -= 1
            self.sequences -= sequences

    async def _stall(self) -> None:
        """Say nothing more (until the proxy gives up and its connection's close cancels this)."""
        self.stalled += 1
        try:
            await asyncio.sleep(3600)
        finally:
            self.stalled -= 1

    def _usage(self, body: dict[str, Any], n: int) -> dict[str, Any]:
        """`n`: the tokens of each sequence."""
        prompt = len(json.dumps(body.get("messages", body.get("prompt", "")))) // 4
        n *= _sequences(body)
        return {
            "prompt_tokens": prompt,
            "total_tokens": prompt + n,
            "completion_tokens": n,
            "prompt_tokens_details": None,
            "reasoning_tokens": 0,
            "completion_tokens_details": None,
        }

    def spec_details(self, body: dict[str, Any], n: int) -> dict[str, Any] | None:
        """SGLang's `spec_tokens_details` for `n` tokens when asked for and speculative, else None."""
        if not (self.speculative and body.get("return_spec_tokens_details") is True and n > 1):
            return None
        verify = n // 2  # the first token from prefill, then 2 per verify step (1 draft + bonus)
        return {
            "spec_accept_rate": (n - 1 - verify) / verify,
            "spec_accept_length": n / verify,
            "spec_verify_ct": verify,
            "spec_num_correct_drafts": n - 1 - verify,
            "spec_num_proposed_drafts": verify,
        }

    def vllm_speculation(self, n: int) -> dict[str, Any] | None:
        """vLLM's `speculative_decoding` statistics for `n` tokens (k=2, one draft of two accepted
        per verify step after the first token: 1.5 per step), or None when not `vllm_metrics`."""
        if not self.vllm_metrics:
            return None
        steps = (n - 1) // 2
        return {
            "mean_acceptance_length": 2.0 if steps else 1.0,
            "draft_acceptance_rate": 0.5 if steps else 0.0,
            "acceptance_histogram": [0, steps, 0],
            "num_spec_steps": steps,
            "num_accepted_draft_tokens": steps,
            "num_draft_tokens": 2 * steps,
            "num_spec_tokens": 2,
        }

    def _whole(
        self, body: dict[str, Any], rid: str, model: str, tokens: list[str], chat: bool
    ) -> web.Response:
        text = "".join(tokens)
        choice: dict[str, Any]
        if chat:
            choice = {
                "index": 0,
                "message": {"role": "assistant", "content": text, "reasoning_content": None},
                "logprobs": None,
                "finish_reason": "length",
                "matched_stop": None,
            }
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "matched_stop": None,
            }
        out = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": CREATED,
            "model": model,
            "choices": [choice | {"index": k} for k in range(_sequences(body))],
            "usage": self._usage(body, len(tokens)),
            "metadata": {"weight_version": "default"},
        }
        details = self.spec_details(body, len(tokens))
        if details is not None:
            out["sglext"] = {"spec_tokens_details": details}
        if (stats := self.vllm_speculation(len(tokens))) is not None:
            out["metrics"] = {"speculative_decoding": stats}
        return web.json_response(out)

    async def _stream(
        self,
        request: web.Request,
        body: dict[str, Any],
        rid: str,
        model: str,
        tokens: list[str],
        chat: bool,
        mode: str,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        if mode == "stall":
            await self._stall()
        if mode == "queue_full":
            await resp.write(sse_error(QUEUE_FULL) + SSE_DONE)
            return resp
        delay_s = float(body.get("fake_delay_s", self.delay_s))  # a request may pace its own stream

        choices = range(_sequences(body))

        def piece(text: str | None, finish: str | None, role: bool = False) -> bytes:
            return b"".join(sse(stream_chunk(rid, model, chat, text, finish, role, k)) for k in choices)

        if chat:
            await resp.write(piece(None, None, role=True))
        for i, tok in enumerate(tokens):
            if mode == "pause_mid" and i == self.fail_after:
                self.paused += 1
                try:
                    await self.resume.wait()
                finally:
                    self.paused -= 1
            if mode in ("die_mid", "stall_mid") and i == self.fail_after:
                if mode == "stall_mid":
                    await self._stall()
                assert request.transport is not None
                request.transport.abort()
                return resp
            if delay_s:
                await asyncio.sleep(delay_s)
            await resp.write(piece(tok, None))
        await resp.write(piece(None, "length"))
        details = self.spec_details(body, len(tokens))
        if details is not None:
            await resp.write(sse(stream_event(rid, model, chat, [], sglext={"spec_tokens_details": details})))
        options = body.get("stream_options") or {}
        if options.get("include_usage"):
            event = stream_event(rid, model, chat, [], usage=self._usage(body, len(tokens)))
            if (stats := self.vllm_speculation(len(tokens))) is not None:
                event["metrics"] = {"speculative_decoding": stats}
            await resp.write(sse(event))
        await resp.write(SSE_DONE)
        await resp.write_eof()
        return resp


@dataclass
class RawRequest:
    method: str
    path: str
    headers: list[tuple[str, bytes]]
    """(lower-case name, raw value) in the order sent."""
    body: bytes

    def header(self, name: str) -> bytes | None:
        return next((v for k, v in self.headers if k == name.lower()), None)


RawAnswer = Callable[[RawRequest, asyncio.StreamWriter], Awaitable[None]]

RAW_COMPLETION: dict[str, Any] = {
    "id": "x",
    "object": "chat.completion",
    "created": 1,
    "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
}
"""A non-streaming chat completion, for raw backends to answer with."""


def raw_json_response(body: bytes, status: str = "200 OK") -> bytes:
    """A whole HTTP/1.1 JSON response with `body`, for a `RawAnswer` to write (then it closes)."""
    return (
        f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + body


class RawBackend:
    """A backend that answers with raw bytes, for what a well-behaved HTTP server cannot send: a
    101, a close-delimited stream torn mid-event, `Connection`-named headers, redirects, a body
    without end. `answer(request, writer)` writes the response; the connection is closed after
    it returns. Every request is kept in `requests`."""

    def __init__(self, answer: RawAnswer) -> None:
        self.answer = answer
        self.requests: list[RawRequest] = []
        self.url = ""
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self.url

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for w in self._writers:
                w.transport.abort()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            line, *lines = head[:-4].split(b"\r\n")
            method, path, _ = line.decode().split(" ", 2)
            headers = [
                (k.strip().lower().decode(), v.strip()) for k, _, v in (x.partition(b":") for x in lines)
            ]
            length = int(next((v for k, v in headers if k == "content-length"), b"0"))
            request = RawRequest(method, path, headers, await reader.readexactly(length))
            self.requests.append(request)
            await self.answer(request, writer)
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            writer.close()


POLL_S = 0.05
"""How often the proxy looks again at a deadline on a test's clock (the clocks' `poll_s`)."""


class ShiftedClock:
    """The proxy's clock for tests that need time to pass: `time.monotonic()` plus what
    `advance` added, so a test moves a deadline (a back-off, an ejection) instead of sleeping."""

    poll_s = POLL_S
    """Its time jumps: the proxy's timers on it look again this often (`controller.proxy.watchdog.poll_s`)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds

    async def ticking(self, aw: Awaitable[Any], step_s: float, when: Callable[[], bool] | None = None) -> Any:
        """Await `aw` while this clock moves on by `step_s` every two of the proxy's deadline
        polls (`POLL_S`): each deadline shorter than `step_s` that `aw` meets expires at the next
        tick, whenever it was armed, so a chain of timeouts (a first byte on one backend, then
        on the next) runs in a few real tenths of a second. Every deadline on this clock moves:
        limits that must not expire meanwhile (an idle timeout) are set well above `step_s`.

        `when`: a tick happens only when it holds at that moment (an in-process proxy runs on
        this loop, so nothing moves between the check and the step): e.g. "every request in
        flight is one that only a timeout ends", so no healthy request's deadline is moved."""
        task = asyncio.ensure_future(aw)
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=2 * POLL_S)
                if not task.done() and (when is None or when()):
                    self.advance(step_s)
        finally:
            task.cancel()  # when this is cancelled (a test's timeout), `aw` ends with it
        return task.result()
