"""Active health checks: probe every backend periodically; 200 means the probe passed.

A backend turns unhealthy after `unhealthy_threshold` failed probes in a row and healthy again
after `healthy_threshold` passed ones, so one slow probe does not take a backend out. The first
probe of a backend decides at once: until then its health is an assumption, not an observation. Failed
requests are a separate signal: the outlier detector (`controller.proxy.outlier`) ejects a
backend for a while after consecutive failures; routing needs both (`load.py`).

Which endpoint: by default the backend's engine's cheap probe (`controller.proxy.engines`), once
the engine is known (configured, or detected by the scraper), and `/ready` before that. SGLang's
`/health` (and `/health_generate`) run a one-token generation on an idle server and take at least
a second, so probing them every few seconds costs GPU work and holds a connection; `/ready`
answers from the HTTP server's state, without generating (docs/SGLANG_PROTOCOL.md, "Health and
server info"). vLLM has no `/ready`; its `/health` checks that the engine process is alive,
without generating. A backend that answers the
path with 404 (vLLM before its engine is known, an SGLang release without `/ready`) is probed on
`/health` from then on, logged once. Redirects are not followed.

A change of health is logged with why: the failed probes in a row and the last one's failure
(the status it answered, no answer within the timeout, or the connection error), or the probe
that passed.

A probe's timeout and the pause between rounds are on the proxy's injected clock
(`ClockTimeout`), like every other deadline, so a test moves time past them instead of waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import NamedTuple

import aiohttp

from controller.proxy.engines import Engine
from controller.proxy.limits import read_bounded
from controller.proxy.load import BackendState, LoadTracker
from controller.proxy.watchdog import Clock, ClockTimeout

log = logging.getLogger("specroute.health")

DEFAULT_PATH = "/ready"
FALLBACK_PATH = "/health"
_PROBE_LIMIT_BYTES = 1 << 20
_NO_LIMIT = aiohttp.ClientTimeout()
"""The session's own limits off for a probe: its one limit is `timeout_s` on the clock."""


class Probe(NamedTuple):
    ok: bool
    detail: str
    """What the probe saw, for the log: `GET /ready answered 503`, a timeout, a connection error."""


def _failure(e: BaseException) -> str:
    """A connection error in a few words (no response body: a backend's text is not logged)."""
    if isinstance(e, aiohttp.ClientConnectorError):
        return f"cannot connect ({e.os_error.strerror or type(e.os_error).__name__})"
    if isinstance(e, OSError) and e.strerror:
        return f"{type(e).__name__} ({e.strerror})"
    text = str(e).splitlines()[0][:160] if str(e) else ""
    return f"{type(e).__name__}" + (f" ({text})" if text else "")


class HealthChecker:
    def __init__(
        self,
        tracker: LoadTracker,
        session: aiohttp.ClientSession,
        *,
        path: str = DEFAULT_PATH,
        interval_s: float = 5.0,
        timeout_s: float = 5.0,
        unhealthy_threshold: int = 2,
        healthy_threshold: int = 1,
        engine_of: Callable[[str], Engine | None] | None = None,
        clock: Clock = time.monotonic,
    ) -> None:
        """`engine_of(name)`: the backend's engine when known; with the default `path` the probe
        goes to that engine's health path."""
        self.tracker = tracker
        self.session = session
        self.path = path
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.clock = clock
        self.unhealthy_threshold = unhealthy_threshold
        self.healthy_threshold = healthy_threshold
        self._paths = {b.name: path for b in tracker}
        self._streak = {b.name: 0 for b in tracker}
        """Consecutive probe results that disagree with the backend's current health."""
        self._probed: set[str] = set()
        self.engine_of = engine_of

    def _path(self, name: str) -> tuple[str, Engine | None]:
        engine = self.engine_of(name) if self.engine_of is not None else None
        path = self._paths[name]
        if engine is not None and path == DEFAULT_PATH and self.path == DEFAULT_PATH:
            path = self._paths[name] = engine.health_path
        return path, engine

    async def probe(self, backend: BackendState) -> Probe:
        path, engine = self._path(backend.name)
        try:
            with ClockTimeout(self.timeout_s, self.clock):
                url = backend.url + path
                async with self.session.get(url, timeout=_NO_LIMIT, allow_redirects=False) as resp:
                    await read_bounded(resp, _PROBE_LIMIT_BYTES)
                    status = resp.status
        except TimeoutError:
            return Probe(False, f"GET {path}: no answer within {self.timeout_s:g} s")
        except (aiohttp.ClientError, OSError) as e:
            return Probe(False, f"GET {path}: {_failure(e)}")
        if status == 404 and path != FALLBACK_PATH:
            why = (
                f"its engine is {engine.label}"
                if engine is not None
                else "engine not known yet: vLLM has no /ready, nor have SGLang releases before it"
            )
            log.warning(
                "backend %s answers %s with 404 (%s): probing %s instead",
                backend.name, path, why, FALLBACK_PATH,
            )  # fmt: skip
            self._paths[backend.name] = FALLBACK_PATH
            return await self.probe(backend)
        return Probe(status == 200, f"GET {path} answered {status}")

    def record(self, backend: BackendState, ok: bool, detail: str = "") -> None:
        """Count one probe result (`detail`: what the probe saw); the backend's health flips
        after enough in a row."""
        first = backend.name not in self._probed
        self._probed.add(backend.name)
        if ok == backend.healthy:
            self._streak[backend.name] = 0
            return
        streak = self._streak[backend.name] = self._streak[backend.name] + 1
        needed = self.healthy_threshold if ok else self.unhealthy_threshold
        if first or streak >= needed:
            self._streak[backend.name] = 0
            self.tracker.set_healthy(backend.name, ok)
            probes = "the first health probe" if first else f"{streak} health probe(s) in a row"
            if ok:
                log.warning("backend %s is now healthy: %s passed (%s)", backend.name, probes, detail)
            else:
                log.warning("backend %s is now UNHEALTHY: %s failed (last: %s)", backend.name, probes, detail)

    async def check_all(self) -> None:
        backends = list(self.tracker)
        results = await asyncio.gather(*(self.probe(b) for b in backends))
        for backend, result in zip(backends, results, strict=True):
            self.record(backend, result.ok, result.detail)

    async def run(self) -> None:
        """Probe forever (until cancelled), starting with one round right away."""
        while True:
            await self.check_all()
            await pause(self.interval_s, self.clock)


async def pause(seconds: float, clock: Clock) -> None:
    """`asyncio.sleep(seconds)` on `clock`."""
    with contextlib.suppress(TimeoutError):
        with ClockTimeout(seconds, clock):
            await asyncio.Event().wait()  # never set: only the timeout ends it
