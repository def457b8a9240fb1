"""SGLang's info routes through the proxy: `GET /model_info` and `GET /server_info` (and their
older names `/get_model_info`, `/get_server_info`), answered as one SGLang server would.

- `/model_info`: relayed from the first healthy backend that answers (baseline first); both
  pools serve the same model.
- `/server_info`: the eagle pool's answer (launch arguments, `internal_states`), so a client
  that reads `internal_states[0].avg_spec_accept_length` (SGLang's benchmark does) gets the
  accept length of the speculative pool. With several eagle backends every healthy one is asked
  and that value is the mean of the lifetime averages they report. Without an eagle backend
  that answers, the first baseline answer is relayed. A `specroute` key is added: which pool
  the body describes, how many backends reported the accept length, healthy backends per pool.

Responses carry `x-specroute-pool` (the pool that answered), never a backend's address. The
client's `Authorization` header is forwarded unless a pool has its own key configured.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
from aiohttp import web

from controller.proxy.errors import NoBackendAvailable
from controller.proxy.forward import Forwarder
from controller.proxy.headers import POOL_HEADER, forwardable
from controller.proxy.limits import ResponseTooLarge, read_bounded
from controller.proxy.load import BackendState
from controller.proxy.sse import parse_json
from policies.base import Pool


class _Answer:
    def __init__(self, backend: BackendState, status: int, body: bytes, content_type: str) -> None:
        self.backend = backend
        self.status = status
        self.body = body
        self.content_type = content_type

    def json(self) -> Any:
        """The body parsed within `sse.parse_json`'s bounds (None: not JSON, or too deep)."""
        return parse_json(self.body, max_bytes=len(self.body))


async def _get(fwd: Forwarder, request: web.Request, b: BackendState, path: str) -> _Answer | None:
    """GET `path` from one backend; None when it fails or answers 5xx."""
    assert fwd.session is not None
    headers = {}
    auth = fwd.auth_header(b.pool)
    if not auth and "Authorization" in request.headers:
        auth = forwardable("Authorization", request.headers["Authorization"])
    if auth:
        headers["Authorization"] = auth
    s = fwd.settings
    timeout = aiohttp.ClientTimeout(
        total=s.health_check_timeout_s + s.connect_timeout_s, sock_connect=s.connect_timeout_s
    )
    try:
        async with fwd.session.get(
            b.url + path, headers=headers, timeout=timeout, allow_redirects=False
        ) as resp:
            body = await read_bounded(resp, s.response_limit_bytes)
            if resp.status >= 500 or 300 <= resp.status < 400:
                return None
            return _Answer(b, resp.status, body, resp.content_type)
    except (aiohttp.ClientError, TimeoutError, OSError, ResponseTooLarge):
        return None


def _healthy(fwd: Forwarder, pool: Pool) -> list[BackendState]:
    return [b for b in fwd.tracker.usable(fwd.clock()) if b.pool == pool]


def _relay(answer: _Answer) -> web.Response:
    return web.Response(
        status=answer.status,
        body=answer.body,
        content_type=answer.content_type,
        headers={POOL_HEADER: answer.backend.pool},
    )


async def model_info(fwd: Forwarder, request: web.Request) -> web.Response:
    for b in (*_healthy(fwd, "baseline"), *_healthy(fwd, "eagle")):
        answer = await _get(fwd, request, b, "/model_info")
        if answer is not None:
            return _relay(answer)
    raise NoBackendAvailable("no healthy backend answered /model_info")


def _accept_length(info: Any) -> float | None:
    states = info.get("internal_states") if isinstance(info, dict) else None
    if not isinstance(states, list) or not states or not isinstance(states[0], dict):
        return None
    value = states[0].get("avg_spec_accept_length")
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


async def server_info(fwd: Forwarder, request: web.Request) -> web.Response:
    eagle = _healthy(fwd, "eagle")
    answers = [a for a in await asyncio.gather(*(_get(fwd, request, b, "/server_info") for b in eagle)) if a]
    usable = [a for a in answers if a.status == 200 and isinstance(a.json(), dict)]
    if not usable:
        for b in _healthy(fwd, "baseline"):
            answer = await _get(fwd, request, b, "/server_info")
            if answer is None:
                continue
            answers.append(answer)
            if answer.status == 200 and isinstance(answer.json(), dict):
                usable = [answer]
                break
    if not usable:
        if answers:
            return _relay(answers[0])  # a backend's own 4xx (e.g. a wrong API key)
        raise NoBackendAvailable("no healthy backend answered /server_info")
    source = usable[0]
    body: dict[str, Any] = fwd.identity.server_info(source.json())
    lengths = [x for x in (_accept_length(a.json()) for a in usable) if x is not None]
    if len(lengths) > 1:
        states = [dict(s) if isinstance(s, dict) else s for s in body["internal_states"]]
        states[0]["avg_spec_accept_length"] = sum(lengths) / len(lengths)
        body["internal_states"] = states
    body["specroute"] = {
        "pool": source.backend.pool,
        "accept_length_backends": len(lengths),
        "healthy_backends": {"baseline": len(_healthy(fwd, "baseline")), "eagle": len(eagle)},
    }
    return web.json_response(body, headers={POOL_HEADER: source.backend.pool})
