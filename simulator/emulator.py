"""An emulated SGLang server whose speed follows a specroute profile.

How it works: `create_emulator_app(config)` builds an aiohttp app that speaks SGLang's HTTP
API (OpenAI-compatible chat/completions, streaming and not; /v1/models, /health, /ready,
/server_info, /v1/loads, /abort_request, /metrics). Generation requests go to a
`BatchEngine` (continuous batching, see `emulator_engine`), which decides when each token
exists; this module only turns engine events into SGLang-shaped responses. Token text is
synthetic, token counts are exact. `run_emulator(config)` runs one on 127.0.0.1:0 and yields
an `EmulatorServer` with its URL and live fault knobs.

`time_scale` multiplies every modelled duration: wall seconds = profile seconds x
time_scale (0.5 runs twice as fast as the profile, 2.0 twice as slow). Fault durations
(`stall_s`) are wall seconds and are not scaled.

Client disconnects abort the request at once only when the app runs with aiohttp's
`handler_cancellation=True` (as `run_emulator` and `specroute emulate` do); otherwise the
request is aborted at its next write.
"""

from __future__ import annotations

import math
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, model_validator

from policies.base import Pool
from policies.profile import Profile
from simulator.emulator_engine import BatchEngine, EngineRequest, Finished, QueueFull, Tokens
from simulator.emulator_http import SGLANG_VERSION, add_routes
from simulator.emulator_metrics import EmulatorMetrics

DEFAULT_MAX_RUNNING = {"baseline": 256, "eagle": 48}


class FaultConfig(BaseModel):
    """Fault knobs; live-tunable (assignments are validated) through `EmulatorServer.faults`."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    error_rate: float = Field(
        default=0.0, ge=0, le=1, description="Fraction of generation requests answered 500."
    )
    max_queued_requests: int | None = Field(
        default=None, ge=0, description="Waiting-queue bound: beyond it 503 (streaming: 200 + error event)."
    )
    stall_s: float = Field(
        default=0.0, ge=0, description="Wall seconds to wait before answering a generation."
    )
    die_after_chunks: int | None = Field(
        default=None, ge=0, description="Drop the connection after this many content chunks (no [DONE])."
    )
    refuse_connections: bool = Field(default=False, description="Close every connection without an answer.")
    unhealthy: bool = Field(default=False, description="/health and /ready answer 503.")


class EmulatorConfig(BaseModel):
    """Everything an emulated server is built from (frozen; faults are copied and live)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Pool = Field(description="baseline (plain decoding) or eagle (EAGLE-3 speculative decoding).")
    profile: Profile = Field(description="Speed profile; the `mode` entry sets the timing.")
    model: str = Field(default="specroute-emulated", description="Served model name (/v1/models, metrics).")
    time_scale: float = Field(default=1.0, gt=0, description="Wall seconds per profile second.")
    max_running_requests: int | None = Field(default=None, ge=1, description="Override the profile's cap.")
    accept_length: float | None = Field(
        default=None, ge=1, description="Override the profile's accept_length."
    )
    speculative_num_steps: int = Field(default=3, ge=1, le=16, description="Draft steps per verify (eagle).")
    hint_factors: dict[str, float] = Field(
        default_factory=dict, description="Acceptance factor per x-specroute-hint value (eagle)."
    )
    output_tokens_mean: float = Field(
        default=256.0, ge=1, description="Mean natural output length (no max_tokens)."
    )
    output_tokens_cv: float = Field(default=0.5, ge=0, description="Coefficient of variation (lognormal).")
    max_model_len: int = Field(default=262144, ge=16, description="Context length reported and enforced.")
    eos_token_id: int = Field(default=163586, description="Reported as matched_stop when a request stops.")
    stats_interval_steps: int = Field(default=40, ge=1, description="Decode steps between gauge refreshes.")
    api_key: str | None = Field(default=None, description="When set, generation routes need this Bearer key.")
    seed: int = Field(default=0, description="Seeds output lengths, acceptance draws and error draws.")
    faults: FaultConfig = Field(default_factory=lambda: FaultConfig())

    @model_validator(mode="after")
    def _check_mode(self) -> EmulatorConfig:
        mode = self.profile.mode(self.mode)  # raises ProfileError naming the modes it has
        if self.mode == "eagle" and self.accept_length is None and mode.accept_length is None:
            raise ValueError("the profile's eagle mode has no accept_length: set accept_length")
        accept = self.accept_length or mode.accept_length
        if self.mode == "eagle" and accept is not None and accept > self.speculative_num_steps + 1:
            raise ValueError(
                f"accept_length {accept} is more than a verify step can accept with "
                f"speculative_num_steps={self.speculative_num_steps} (at most "
                f"{self.speculative_num_steps + 1}): raise speculative_num_steps"
            )
        for hint, factor in self.hint_factors.items():
            if not factor > 0:
                raise ValueError(f"hint_factors[{hint!r}] must be > 0, got {factor}")
        return self

    @property
    def effective_max_running(self) -> int:
        mode = self.profile.mode(self.mode)
        return self.max_running_requests or mode.max_running_requests or DEFAULT_MAX_RUNNING[self.mode]

    @property
    def effective_accept_length(self) -> float | None:
        if self.mode != "eagle":
            return None
        return self.accept_length or self.profile.mode(self.mode).accept_length


class Emulator:
    """Runtime state of one emulated server (held in the app under `EMULATOR_KEY`)."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        self.faults = config.faults.model_copy()
        self.rng = random.Random(config.seed)
        self.metrics = EmulatorMetrics(config.model, speculative=config.mode == "eagle")
        self.started_at = time.time()
        self._engine: BatchEngine | None = None

    @property
    def engine(self) -> BatchEngine:
        if self._engine is None:
            raise RuntimeError("the emulator app has not started")
        return self._engine

    async def start(self) -> None:
        c = self.config
        self._engine = BatchEngine(
            c.profile.speed(c.mode),
            max_running_requests=c.effective_max_running,
            time_scale=c.time_scale,
            accept_length=c.effective_accept_length,
            speculative_num_steps=c.speculative_num_steps,
            stats_interval_steps=c.stats_interval_steps,
            seed=c.seed + 1,
            observer=self.metrics,
        )
        self._engine.start()

    async def stop(self) -> None:
        if self._engine is not None:
            await self._engine.stop()

    def plan_output(self, max_tokens: int | None, ignore_eos: bool, prompt_tokens: int) -> tuple[int, str]:
        """(tokens to generate, finish reason when they are done)."""
        c = self.config
        room = max(1, c.max_model_len - prompt_tokens)
        if ignore_eos and max_tokens is not None:
            return min(max_tokens, room), "length"
        natural = self._natural_length()
        if max_tokens is not None and natural >= max_tokens:
            return min(max_tokens, room), "length"
        if natural >= room:
            return room, "length"
        return natural, "length" if ignore_eos else "stop"

    def _natural_length(self) -> int:
        c = self.config
        if c.output_tokens_cv <= 0:
            return max(1, round(c.output_tokens_mean))
        sigma2 = math.log1p(c.output_tokens_cv**2)
        mu = math.log(c.output_tokens_mean) - sigma2 / 2
        return max(1, round(self.rng.lognormvariate(mu, math.sqrt(sigma2))))

    def new_request(
        self, rid: str | None, prompt_tokens: int, max_tokens: int | None, ignore_eos: bool, hint: str | None
    ) -> EngineRequest:
        n, reason = self.plan_output(max_tokens, ignore_eos, prompt_tokens)
        accept = self.config.effective_accept_length or 1.0
        if hint is not None:
            accept *= self.config.hint_factors.get(hint, 1.0)
        return EngineRequest(
            rid=rid or uuid.uuid4().hex,
            prompt_tokens=prompt_tokens,
            output_tokens=n,
            finish_reason="stop" if reason == "stop" else "length",
            accept_mean=accept,
        )


EMULATOR_KEY = web.AppKey("emulator", Emulator)


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
    add_routes(app, EMULATOR_KEY)
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
        self._site = web.SockSite(self._runner, sock)
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
