"""What clients learn about the backends.

Clients see a backend by its configured name (`NAME=URL`; the URL itself when unnamed) in
`x-specroute-backend`, in specroute's error messages ("backend gpu-3 refused the connection")
and in `/ready`. With `backend_header: false` they learn only the pool: every text bound for a
client goes through `BackendIdentity.for_clients`, the one place that hides names, which turns
"backend gpu-3" into "a baseline backend" (and any other mention of a name, URL or host:port
into the same). Call it where specroute's own words leave for a client: the error responses
(the app's error middleware, `http_errors.CLIENT_TEXT`) and the error event that ends a broken stream.
`/ready` lists healthy backends by name only when names are shown, and `server_info` drops
a backend's addresses from the launch arguments it relays (`host`, `port`, ...).

Logs, metrics labels and the decision log keep the names: they are for operators.

Whatever `backend_header` says, `server_info` masks the secrets in SGLang's launch arguments
(`api_key`, `admin_api_key`): with an upstream key configured, anyone who can reach specroute
could otherwise read the key the backend checks.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from controller.proxy.config import Settings
from controller.proxy.redact import MASK
from policies.base import POOLS, Pool

_NAME_CHARS = r"A-Za-z0-9_.-"
_ADDRESS_KEYS = re.compile(r"(^|_)(host|hostname|port|addr|address|url|endpoint|ip)s?($|_)")
_SECRET_KEYS = re.compile(r"(^|_)(api_key|key|token|secret|password)($|_)", re.IGNORECASE)


def _article(pool: str) -> str:
    return f"an {pool} backend" if pool[:1] in "aeiou" else f"a {pool} backend"


@dataclass(frozen=True, slots=True)
class _Shown:
    pool: Pool
    hidden_as: str


class BackendIdentity:
    """Hides backend names from client-bound texts when `show` is False (else passes them)."""

    def __init__(self, backends: Iterable[tuple[str, str, Pool]], *, show: bool) -> None:
        """`backends`: (name, url, pool) of every configured backend."""
        self.show = show
        self._tokens: dict[str, _Shown] = {}
        for name, url, pool in backends:
            shown = _Shown(pool, _article(pool))
            parts = urlsplit(url)
            for token in (name, url, parts.netloc):
                if token:
                    self._tokens.setdefault(token, shown)
        self._pattern: re.Pattern[str] | None = None
        if self._tokens and not show:
            names = "|".join(re.escape(t) for t in sorted(self._tokens, key=len, reverse=True))
            self._pattern = re.compile(
                rf"(?P<prefix>\bbackend\s+)?(?<![{_NAME_CHARS}/:])(?P<q>['\"]?)(?P<name>{names})"
                rf"(?P=q)(?![{_NAME_CHARS}])"
            )

    @classmethod
    def from_settings(cls, settings: Settings) -> BackendIdentity:
        return cls(
            ((b.name, b.url, pool) for pool in POOLS for b in settings.backends(pool)),
            show=settings.backend_header,
        )

    def for_clients(self, text: str) -> str:
        """`text` as a client may see it: with names hidden, "backend NAME" (or a bare NAME, URL
        or host:port of a backend) becomes "a baseline backend" / "an eagle backend"."""
        if self._pattern is None:
            return text
        tokens = self._tokens
        return self._pattern.sub(lambda m: tokens[m.group("name")].hidden_as, text)

    def names(self, names: list[str]) -> list[str] | None:
        """A list of backend names for a client body: the names, or None when hidden."""
        return names if self.show else None

    def server_info(self, body: dict[str, Any]) -> dict[str, Any]:
        """A backend's `/server_info` for clients: secrets masked; addresses dropped when names
        are hidden."""
        out: dict[str, Any] = {}
        for key, value in body.items():
            if _SECRET_KEYS.search(key) and value not in (None, "", False):
                out[key] = MASK
            elif not self.show and _ADDRESS_KEYS.search(key) and not isinstance(value, dict | list):
                continue
            elif isinstance(value, str) and not self.show:
                out[key] = self.for_clients(value)
            else:
                out[key] = value
        return out
