"""The info routes through the proxy: `GET /v1/models`, and SGLang's `GET /model_info` and
`GET /server_info` (and their older names `/get_model_info`, `/get_server_info`), answered as
one server would.

- `/v1/models` and `/model_info`: relayed from the first healthy backend that answers (baseline
  first); both pools serve the same model.
- `/server_info`: the eagle pool's answer (launch arguments, `internal_states`), so a client
  that reads `internal_states[0].avg_spec_accept_length` (SGLang's benchmark does) gets the
  accept length of the speculative pool. With several eagle backends every healthy one is asked
  and that value is the mean of the lifetime averages they report. Without an eagle backend
  that answers, the first baseline answer is relayed. A `specroute` key is added: which pool
  the body describes, how many backends reported the accept length, healthy backends per pool.

Every byte of these answers is bounded and charged (a backend is not trusted with specroute's
memory or its event loop): an answer is read up to `info_limit_bytes` (a few MB; a larger one,
declared or read, is not taken), and what it holds is taken from the memory budget as it is
read (`INFO_COPIES` times its bytes: 503 with `Retry-After` when the budget cannot hold it) and
given back once the answer has gone to the client. A `/server_info` answer, the only one
specroute reads, has its JSON structure counted as it arrives (at most `INFO_MAX_VALUES` values
and `INFO_MAX_CONTAINERS` objects and arrays, charged by what they cost parsed) and is parsed
once, and parsed and written again off the event loop when it is large. The answer is written
to the client within `client_write_timeout_s`, else the connection is closed.

Responses carry `x-specroute-pool` (the pool that answered), never a backend's address. The
client's `Authorization` header is forwarded unless a pool has its own key configured.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from aiohttp import web

from controller.proxy.engines import taken
from controller.proxy.errors import BackendFailed, NoBackendAvailable, PayloadTooLarge
from controller.proxy.forward import Forwarder
from controller.proxy.headers import BACKEND_HEADER, POOL_HEADER, forwardable
from controller.proxy.limits import JsonBudget, MemoryBusy, ResponseTooLarge, read_bounded
from controller.proxy.load import BackendState
from controller.proxy.memory import ANSWER_COPIES, Charge
from controller.proxy.sse import parse_json
from controller.proxy.watchdog import ClockTimeout
from policies.base import Pool

INFO_COPIES = ANSWER_COPIES
"""An answer relayed as it came is held as often as any backend answer (`memory.ANSWER_COPIES`)."""
PARSED_COPIES = INFO_COPIES + 2
"""A `/server_info` answer is also written anew: the encoded text and its bytes."""
VALUE_BYTES = 80
"""What one parsed JSON value holds, at most on average (a short string or a float, and its slot)."""
CONTAINER_BYTES = 240
"""What one parsed JSON object or array holds, at most on average (a small dict)."""
INFO_MAX_VALUES = 50_000
"""Most JSON values in a `/server_info` answer (SGLang's has a few hundred)."""
INFO_MAX_CONTAINERS = 10_000
"""Most JSON objects and arrays in a `/server_info` answer."""
OFF_LOOP_BYTES = 64 * 1024
"""An answer at least this large is parsed and encoded in a worker thread."""


class InfoTooLarge(BackendFailed):
    """Every backend's answer was over `info_limit_bytes` (or too complex to parse)."""

    code = "info_answer_too_large"


class _Answer:
    def __init__(
        self, backend: BackendState, status: int, body: bytes, content_type: str, parsed: Any, charge: Charge
    ) -> None:
        self.backend = backend
        self.status = status
        self.body = body
        self.content_type = content_type
        self.parsed = parsed
        """The body's JSON, parsed once when asked for (None: not asked, not JSON, too deep)."""
        self.charge = charge
        """What the answer holds of the memory budget; the route releases it once it was sent."""

    @property
    def usable(self) -> bool:
        return self.status == 200 and isinstance(self.parsed, dict)


class _Failed:
    """Why a backend's answer was not taken: it failed, or it was over the limits."""

    def __init__(self, too_large: bool) -> None:
        self.too_large = too_large


_UNANSWERED = _Failed(too_large=False)
_TOO_LARGE = _Failed(too_large=True)


def _headers(fwd: Forwarder, request: web.Request, pool: Pool) -> dict[str, str]:
    auth = fwd.auth_header(pool)
    if not auth and "Authorization" in request.headers:
        auth = forwardable("Authorization", request.headers["Authorization"])
    return {"Authorization": auth} if auth else {}


async def _parse(body: bytes) -> Any:
    """The body's JSON within `sse.parse_json`'s bounds (depth, digits), off the loop when large."""
    if len(body) < OFF_LOOP_BYTES:
        return parse_json(body, max_bytes=len(body))
    return await asyncio.to_thread(parse_json, body, max_bytes=len(body))


async def _get(
    fwd: Forwarder, request: web.Request, b: BackendState, path: str, parse: bool = False
) -> _Answer | _Failed:
    """GET `path` from one backend within `info_limit_bytes`, charged to the memory budget as it
    is read; parsed (once) when `parse`. A failure or 5xx answer is `_UNANSWERED`, one over the
    limits `_TOO_LARGE` (nothing held for either); `MemoryBusy` when the budget cannot hold it."""
    assert fwd.session is not None
    s = fwd.settings
    timeout = aiohttp.ClientTimeout(
        total=s.health_check_timeout_s + s.connect_timeout_s, sock_connect=s.connect_timeout_s
    )
    scan = JsonBudget(INFO_MAX_VALUES, INFO_MAX_CONTAINERS) if parse else None
    charge = Charge(fwd.budget)
    try:
        async with fwd.session.get(
            b.url + path, headers=_headers(fwd, request, b.pool), timeout=timeout, allow_redirects=False
        ) as resp:
            if resp.status >= 500 or 300 <= resp.status < 400:
                charge.release()
                return _UNANSWERED
            copies = PARSED_COPIES if parse else INFO_COPIES
            body = await read_bounded(resp, s.info_limit_bytes, charge=charge, copies=copies, scan=scan)
            parsed = None
            if scan is not None and resp.status == 200:
                structure = VALUE_BYTES * scan.values + CONTAINER_BYTES * scan.containers
                if not charge.grow_to(charge.held + structure):
                    raise MemoryBusy("specroute's memory budget cannot hold this answer now")
                parsed = await _parse(body)
            return _Answer(b, resp.status, body, resp.content_type, parsed, charge)
    except (ResponseTooLarge, PayloadTooLarge):
        charge.release()
        return _TOO_LARGE
    except (aiohttp.ClientError, TimeoutError, OSError):
        charge.release()
        return _UNANSWERED
    except BaseException:
        charge.release()
        raise


def _healthy(fwd: Forwarder, pool: Pool) -> list[BackendState]:
    return [b for b in fwd.tracker.usable(fwd.clock()) if b.pool == pool]


async def _send(fwd: Forwarder, request: web.Request, response: web.Response) -> web.Response:
    """Write `response` within `client_write_timeout_s`, so the bytes it holds are not held for a
    client that does not read (its connection is closed then); the route's charge ends after."""
    try:
        with ClockTimeout(fwd.settings.client_write_timeout_s, fwd.clock):
            await response.prepare(request)
            await response.write_eof()
    except TimeoutError:
        if request.transport is not None:
            request.transport.abort()
    return response


def _relay(answer: _Answer, extra: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=answer.status,
        body=answer.body,
        content_type=answer.content_type,
        headers={POOL_HEADER: answer.backend.pool, **(extra or {})},
    )


def _refused(failures: list[_Failed], path: str, limit: int) -> BackendFailed | NoBackendAvailable:
    """The error when no backend's answer could be relayed."""
    if any(f.too_large for f in failures):
        return InfoTooLarge(f"the backends' {path} answers are larger than info_limit_bytes ({limit}) allows")
    return NoBackendAvailable(f"no healthy backend answered {path}")


async def _first(
    fwd: Forwarder,
    request: web.Request,
    path: str,
    order: list[BackendState],
    extra: Callable[[BackendState], dict[str, str]],
) -> web.Response:
    """Relay the first answer of the backends in `order`, charged until it has been written."""
    failures: list[_Failed] = []
    for b in order:
        answer = await _get(fwd, request, b, path)
        if isinstance(answer, _Failed):
            failures.append(answer)
            continue
        try:
            return await _send(fwd, request, _relay(answer, extra(b)))
        finally:
            answer.charge.release()
    raise _refused(failures, path, fwd.settings.info_limit_bytes)


async def list_models(fwd: Forwarder, request: web.Request) -> web.StreamResponse:
    """Relay `GET /v1/models` from the first healthy backend that answers (baseline first)."""
    order = sorted(fwd.tracker.usable(fwd.clock()), key=lambda b: b.pool != "baseline")
    shown = fwd.settings.backend_header
    return await _first(
        fwd, request, "/v1/models", order, lambda b: {BACKEND_HEADER: b.name} if shown else {}
    )


async def model_info(fwd: Forwarder, request: web.Request) -> web.StreamResponse:
    order = [*_healthy(fwd, "baseline"), *_healthy(fwd, "eagle")]
    return await _first(fwd, request, "/model_info", order, lambda b: {})


def _accept_length(info: Any) -> float | None:
    states = info.get("internal_states") if isinstance(info, dict) else None
    if not isinstance(states, list) or not states or not isinstance(states[0], dict):
        return None
    value = states[0].get("avg_spec_accept_length")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return taken("accept_length", float(value))


async def server_info(fwd: Forwarder, request: web.Request) -> web.StreamResponse:
    answers: list[_Answer] = []
    try:
        return await _server_info(fwd, request, answers)
    finally:
        for a in answers:
            a.charge.release()


async def _server_info(fwd: Forwarder, request: web.Request, answers: list[_Answer]) -> web.StreamResponse:
    """`answers`: every answer taken, whose charges the caller releases."""
    path = "/server_info"
    eagle = _healthy(fwd, "eagle")
    got = await _gather([_get(fwd, request, b, path, parse=True) for b in eagle])
    answers += [a for a in got if isinstance(a, _Answer)]
    failures = [a for a in got if isinstance(a, _Failed)]
    usable = [a for a in answers if a.usable]
    if not usable:
        for b in _healthy(fwd, "baseline"):
            answer = await _get(fwd, request, b, path, parse=True)
            if isinstance(answer, _Failed):
                failures.append(answer)
                continue
            answers.append(answer)
            if answer.usable:
                usable = [answer]
                break
    if not usable:
        if answers:
            return await _send(fwd, request, _relay(answers[0]))  # a backend's own 4xx (e.g. a wrong API key)
        raise _refused(failures, path, fwd.settings.info_limit_bytes)
    source = usable[0]
    body: dict[str, Any] = fwd.identity.server_info(source.parsed)
    lengths = [x for x in (_accept_length(a.parsed) for a in usable) if x is not None]
    if len(lengths) > 1:
        states = [dict(s) if isinstance(s, dict) else s for s in body["internal_states"]]
        states[0]["avg_spec_accept_length"] = sum(lengths) / len(lengths)
        body["internal_states"] = states
    body["specroute"] = {
        "pool": source.backend.pool,
        "accept_length_backends": len(lengths),
        "healthy_backends": {"baseline": len(_healthy(fwd, "baseline")), "eagle": len(eagle)},
    }
    size = sum(len(a.body) for a in usable)
    for a in answers:
        a.body = b""  # only the parsed answers are needed now
    text = json.dumps(body) if size < OFF_LOOP_BYTES else await asyncio.to_thread(json.dumps, body)
    response = web.Response(
        text=text, content_type="application/json", headers={POOL_HEADER: source.backend.pool}
    )
    del text, body
    return await _send(fwd, request, response)


async def _gather(gets: list[Awaitable[_Answer | _Failed]]) -> list[_Answer | _Failed]:
    """Every backend's answer; on an error (`MemoryBusy`) the others are cancelled and what they
    hold is given back before it propagates."""
    tasks = [asyncio.ensure_future(g) for g in gets]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        done = await asyncio.gather(*tasks, return_exceptions=True)
        for a in done:
            if isinstance(a, _Answer):
                a.charge.release()
        raise
