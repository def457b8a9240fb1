"""Which headers cross the proxy, in each direction.

Hop-by-hop headers (RFC 9110 7.6.1) describe one connection and stop here: the fixed list, and
every header the `Connection` header names. The client's `Accept-Encoding` is not forwarded:
specroute asks backends for `identity`, because it reads the answers it relays (the first event,
the usage chunk); a backend that compresses anyway has its `Content-Encoding` relayed with the
bytes, so the client can decode them. A forwarded header value must be valid UTF-8: the HTTP
client re-encodes header values and would silently drop other bytes, so such a request is
refused (400) rather than forwarded altered. `PoolRewrite` is what changes per pool: the model
name in the body and the Authorization header.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from multidict import CIMultiDict

from controller.proxy.errors import BadRequest
from policies.base import HINT_HEADER as HINT_HEADER  # its one home; re-exported for the proxy
from policies.base import Decision, Pool

if TYPE_CHECKING:
    from pydantic import SecretStr

    from controller.proxy.config import Settings

MODE_HEADER = "x-specroute-mode"
POOL_HEADER = "x-specroute-pool"
BACKEND_HEADER = "x-specroute-backend"
REASON_HEADER = "x-specroute-reason"
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade"}
)
_REQUEST_DROP = _HOP_BY_HOP | frozenset(
    {
        "host", "content-length", "proxy-authorization", "accept-encoding", "expect", "content-encoding",
        MODE_HEADER, HINT_HEADER,
    }
)  # fmt: skip
_RESPONSE_DROP = _HOP_BY_HOP | frozenset(
    {"content-length", "date", "server", POOL_HEADER, BACKEND_HEADER, REASON_HEADER}
)


def connection_named(headers: Mapping[str, str]) -> frozenset[str]:
    """The header names listed in `Connection` (lower case): hop-by-hop as well."""
    value = headers.get("Connection")
    if not value:
        return frozenset()
    return frozenset(token.strip().lower() for token in value.split(",") if token.strip())


def forwardable(key: str, value: str) -> str:
    """`value`, or 400 when it cannot be forwarded unchanged (not UTF-8)."""
    if not value.isascii():
        try:
            value.encode("utf-8")  # a byte that is not UTF-8 arrives as a lone surrogate
        except UnicodeEncodeError:
            raise BadRequest(
                f"header {key[:64]!r} is not valid UTF-8: specroute cannot forward it unchanged"
            ) from None
    return value


def _dropped(base: frozenset[str], headers: Mapping[str, str]) -> frozenset[str]:
    """`base` and the headers `Connection` names (`base` itself when it names none: no new set
    per request)."""
    named = connection_named(headers)
    return base | named if named else base


def upstream_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """The client's request headers that go to the backend, plus `Accept-Encoding: identity`."""
    drop = _dropped(_REQUEST_DROP, headers)
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in headers.items():
        if key.lower() not in drop:
            out.add(key, forwardable(key, value))
    out["Accept-Encoding"] = "identity"
    return out


def client_headers(
    backend_headers: Mapping[str, str], decision: Decision, *, show_backend: bool
) -> CIMultiDict[str]:
    """The backend's response headers for the client, with specroute's own."""
    drop = _dropped(_RESPONSE_DROP, backend_headers)
    out: CIMultiDict[str] = CIMultiDict()
    for key, value in backend_headers.items():
        if key.lower() not in drop:
            out.add(key, value)
    out[POOL_HEADER] = decision.pool
    if show_backend:
        out[BACKEND_HEADER] = decision.backend
    out[REASON_HEADER] = decision.reason
    return out


class PoolRewrite:
    """What changes in a request for the pool it goes to: the `model` named in its body and the
    `Authorization` header, when the settings configure them for that pool (else the client's)."""

    def __init__(self, models: Mapping[Pool, str | None], auth: Mapping[Pool, str | None]) -> None:
        self._models = dict(models)
        self._auth = dict(auth)

    @classmethod
    def from_settings(cls, settings: Settings) -> PoolRewrite:
        keys: tuple[tuple[Pool, SecretStr | None], ...] = (
            ("baseline", settings.baseline_api_key),
            ("eagle", settings.eagle_api_key),
        )
        return cls(
            {"baseline": settings.baseline_model, "eagle": settings.eagle_model},
            {pool: None if key is None else f"Bearer {key.get_secret_value()}" for pool, key in keys},
        )

    def auth_header(self, pool: Pool) -> str | None:
        """The Authorization header configured for `pool` (None: forward the client's)."""
        return self._auth[pool]

    def apply(
        self, pool: Pool, raw: bytes, body: Mapping[str, Any], headers: CIMultiDict[str]
    ) -> tuple[bytes, CIMultiDict[str]]:
        """(body bytes, headers) of the request as `pool`'s backends get it."""
        model = self._models[pool]
        if model is not None:
            raw = json.dumps({**body, "model": model}).encode()
        auth = self._auth[pool]
        if auth is not None:
            headers = headers.copy()
            headers["Authorization"] = auth
        return raw, headers
