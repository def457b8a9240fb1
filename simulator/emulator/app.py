"""An emulated SGLang server whose speed follows a specroute profile.

How it works: `create_emulator_app(config)` builds an aiohttp app that speaks SGLang's HTTP
API (OpenAI-compatible chat/completions and native /generate, streaming and not; /v1/models,
/health, /ready, /server_info, /model_info, /v1/loads, /abort_request, /metrics). Generation
requests go to a `BatchEngine` (continuous batching, see `batching.py`), which decides when
each token exists; `http.py` turns engine events into SGLang-shaped responses (`shapes.py`).
Token text is synthetic, token counts are exact. `run_emulator(config)` runs one on 127.0.0.1:0 and yields
an `EmulatorServer` with its URL and live fault knobs.

`time_scale` multiplies every modelled duration: wall seconds = profile seconds x
time_scale (0.5 runs twice as fast as the profile, 2.0 twice as slow). Fault durations
(`stall_s`) are wall seconds and are not scaled.

Client disconnects abort the request at once only when the app runs with aiohttp's
`handler_cancellation=True` (as `run_emulator` and `specroute emulate` do); otherwise the
request is aborted at its next write.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from simulator.emulator.batching import BatchEngine, Finished, QueueFull, Tokens
from simulator.emulator.config import EmulatorConfig, FaultConfig
from simulator.emulator.http import add_routes
from simulator.emulator.info import SGLANG_VERSION
from simulator.emulator.state import EMULATOR_KEY, Emulator


def create_emulator_app(config: EmulatorConfig) -> web.Application:
    """The aiohttp app of one emulated server. Run it with `handler_cancellation=True`."""
    emulator = Emulator(config)
    app = web.Application(client_max_size=64 * 1024 * 1024)
    app[EMULATOR_KEY] = emulator

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await emulator.start()
        yield
        await emulator.stop()

    async def on_shutdown(app: web.Application) -> None:
        if emulator._engine is not None:
            emulator.engine.abort_all()  # open streams end with finish_reason "abort"

    app.cleanup_ctx.append(lifecycle)
    app.on_shutdown.append(on_shutdown)
    add_routes(app)
    return app


class EmulatorServer:
    """A running emulator: `url`, live `faults`, and listening on/off for refusal tests."""

    def __init__(self, app: web.Application, runner: web.AppRunner, host: str, port: int) -> None:
        self.app = app
        self.host = host
        self.port = port
        self._runner = runner
        self._site: web.SockSite | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def emulator(self) -> Emulator:
        return self.app[EMULATOR_KEY]

    @property
    def faults(self) -> FaultConfig:
        return self.emulator.faults

    @property
    def engine(self) -> BatchEngine:
        return self.emulator.engine

    async def start_listening(self) -> None:
        if self._site is not None:
            return
        sock = _bind(self.host, self.port)
        self.port = sock.getsockname()[1]
        self._site = web.SockSite(self._runner, sock, backlog=2048)  # bursts of connections: see serve
        await self._site.start()

    async def stop_listening(self) -> None:
        """Close the listening socket: new connections are refused (open ones continue)."""
        if self._site is not None:
            await self._site.stop()
            self._site = None


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


@asynccontextmanager
async def run_emulator(
    config: EmulatorConfig, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[EmulatorServer]:
    """Run an emulated server on `host:port` (0: a free port) for the duration of the block."""
    app = create_emulator_app(config)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=2.0)
    await runner.setup()
    server = EmulatorServer(app, runner, host, port)
    try:
        await server.start_listening()
        yield server
    finally:
        await runner.cleanup()


__all__ = [
    "EMULATOR_KEY",
    "SGLANG_VERSION",
    "Emulator",
    "EmulatorConfig",
    "EmulatorServer",
    "FaultConfig",
    "Finished",
    "QueueFull",
    "Tokens",
    "create_emulator_app",
    "run_emulator",
]
