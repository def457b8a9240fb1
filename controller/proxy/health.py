"""Active health checks: probe every backend periodically; 200 means healthy.

Passive marking (a backend refused a connection or timed out before its first byte) happens in
`forward.py`; the probes here are what brings such a backend back.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from controller.proxy.load import LoadTracker

log = logging.getLogger("specroute.health")


class HealthChecker:
    def __init__(
        self,
        tracker: LoadTracker,
        session: aiohttp.ClientSession,
        *,
        path: str = "/health",
        interval_s: float = 5.0,
        timeout_s: float = 5.0,
    ) -> None:
        self.tracker = tracker
        self.session = session
        self.path = path
        self.interval_s = interval_s
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def probe(self, name: str) -> bool:
        try:
            async with self.session.get(name + self.path, timeout=self.timeout) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def check_all(self) -> None:
        names = [b.name for b in self.tracker]
        results = await asyncio.gather(*(self.probe(n) for n in names))
        for name, ok in zip(names, results, strict=True):
            if self.tracker.set_healthy(name, ok):
                log.warning("backend %s is now %s", name, "healthy" if ok else "UNHEALTHY")

    async def run(self) -> None:
        """Probe forever (until cancelled), starting with one round right away."""
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval_s)
