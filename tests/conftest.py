"""Shared fixtures: fake SGLang-like backends and the real proxy app, all on 127.0.0.1:0.

- `fake_backend(**kw)` starts a `tests.fakes.FakeBackend` and returns it (stopped at teardown).
- `raw_backend(answer)` starts a `tests.fakes.RawBackend` (raw bytes) and returns it.
- `proxy(baseline=[...], eagle=[...], policy=..., policy_params=..., **settings)` builds the real
  app with `create_app` (optionally with a `clock` and `shadows`) and serves it on 127.0.0.1:0;
  returns a `RunningProxy`.
- `emulator(mode="baseline", profile=KIMI, **config)` starts an in-process SGLang emulator
  (`simulator.emulator.app.run_emulator`); its default time scale is the `emulator_time_scale` fixture,
  which a test module may override.
- `tiny_tmpfs`: a 256 KiB tmpfs (`helpers.tiny_tmpfs`) at a fresh path, for the test's length.
- `spawn_serve(*args, env=..., stderr=..., preexec_fn=...)` runs `specroute serve --port 0 ...` as
  a subprocess and returns a `ServeProcess` (its URL read from the "specroute listening on" line);
  with `driven=True` it runs on a clock the test moves (`tests/driven_serve.py`):
  `ServeProcess.advance_clock(s)`. Its `shutdown_grace_s` is 0 unless the test sets it (see
  `start_serve`).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web
from fakes import FakeBackend, RawAnswer, RawBackend
from helpers import KIMI, wait_until
from helpers import tiny_tmpfs as mounted_tmpfs
from prometheus_client import CollectorRegistry

from controller.cli import spawn
from controller.proxy.app import FORWARDER, TRACKER, create_app, make_runner
from controller.proxy.config import Settings
from controller.proxy.core import policy_context
from controller.proxy.forward import Forwarder
from controller.proxy.load import LoadTracker
from controller.proxy.ticket import Observer, RequestRecord
from policies.base import Policy
from policies.profile import Profile
from policies.registry import default_registry
from simulator.emulator.app import EmulatorConfig, EmulatorServer, run_emulator


def pytest_configure(config: pytest.Config) -> None:
    """No test runs a compiled simulator it did not build: a build of these very sources in the
    user's cache (`specroute native build`) would make `simulate` in a test process note that its
    modules are already loaded, and make runs depend on what the machine happens to hold. The
    tests of the build (tests/simulator/test_native.py) point this at builds of their own."""
    builds = tempfile.mkdtemp(prefix="specroute-test-native-")
    os.environ["SPECROUTE_NATIVE_DIR"] = builds
    config.add_cleanup(lambda: shutil.rmtree(builds, ignore_errors=True))


@dataclass
class RunningProxy:
    url: str
    """Base URL, e.g. http://127.0.0.1:PORT (the OpenAI base_url is url + "/v1")."""
    app: web.Application
    settings: Settings
    metrics: CollectorRegistry
    records: list[RequestRecord] = field(default_factory=list)
    runner: web.AppRunner | None = None

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    @property
    def tracker(self) -> LoadTracker:
        return self.app[TRACKER]

    @property
    def forwarder(self) -> Forwarder:
        return self.app[FORWARDER]

    def client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.base_url, api_key="k", max_retries=0, timeout=30)

    async def metrics_text(self) -> str:
        async with aiohttp.ClientSession() as s, s.get(self.url + "/metrics") as r:
            assert r.status == 200
            return await r.text()

    def sample(self, name: str, **labels: str) -> float | None:
        return self.metrics.get_sample_value(name, labels)

    def in_flight_samples(self) -> list[float]:
        return [
            s.value
            for m in self.metrics.collect()
            if m.name == "specroute_in_flight_requests"
            for s in m.samples
        ]

    async def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Wait until no request is in flight (client disconnects are noticed asynchronously)."""
        await wait_until(lambda: not self.tracker.total_in_flight, timeout_s, interval_s=0.01)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@pytest.fixture
async def fake_backend() -> AsyncIterator[Callable[..., Awaitable[FakeBackend]]]:
    started: list[FakeBackend] = []

    async def make(**kwargs: Any) -> FakeBackend:
        fb = FakeBackend(**kwargs)
        await fb.start()
        started.append(fb)
        return fb

    yield make
    for fb in started:
        await fb.stop()


@pytest.fixture
async def raw_backend() -> AsyncIterator[Callable[[RawAnswer], Awaitable[RawBackend]]]:
    started: list[RawBackend] = []

    async def make(answer: RawAnswer) -> RawBackend:
        rb = RawBackend(answer)
        await rb.start()
        started.append(rb)
        return rb

    yield make
    for rb in started:
        await rb.stop()


@pytest.fixture
def emulator_time_scale() -> float:
    """Wall seconds per profile second of the `emulator` fixture's servers unless a test passes one."""
    return 0.05


@pytest.fixture
async def emulator(emulator_time_scale: float) -> AsyncIterator[Callable[..., Awaitable[EmulatorServer]]]:
    async with AsyncExitStack() as stack:

        async def make(mode: str = "baseline", profile: Profile = KIMI, **kw: Any) -> EmulatorServer:
            kw.setdefault("time_scale", emulator_time_scale)
            config = EmulatorConfig(mode=mode, profile=profile, **kw)  # type: ignore[arg-type]
            return await stack.enter_async_context(run_emulator(config))

        yield make


@pytest.fixture
def tiny_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs (needs root and the right to mount; skipped elsewhere)."""
    with mounted_tmpfs(tmp_path / "tmpfs") as mnt:
        yield mnt


@pytest.fixture
async def proxy() -> AsyncIterator[Callable[..., Awaitable[RunningProxy]]]:
    running: list[RunningProxy] = []

    async def make(
        *,
        baseline: Sequence[str] = (),
        eagle: Sequence[str] = (),
        policy: str = "threshold",
        policy_params: dict[str, Any] | None = None,
        health_checks: bool = True,
        observers: Sequence[Observer] = (),
        clock: Callable[[], float] | None = None,
        shadows: Sequence[tuple[str, Policy]] | None = None,
        **settings: Any,
    ) -> RunningProxy:
        s = Settings.model_validate(
            {
                "baseline": list(baseline),
                "eagle": list(eagle),
                "policy": policy,
                "policy_params": policy_params or {},
                **settings,
            }
        )
        registry = default_registry(entry_points=False)
        context = policy_context(s)
        pol = registry.create(s.policy, s.policy_params, context)
        metrics = CollectorRegistry()
        records: list[RequestRecord] = []
        app = create_app(
            s,
            pol,
            registry=registry,
            metrics_registry=metrics,
            context=context,
            observers=[records.append, *observers],
            health_checks=health_checks,
            shadows=shadows,
            clock=clock if clock is not None else time.monotonic,
        )
        runner = make_runner(app, shutdown_timeout=s.drain_timeout_s)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        rp = RunningProxy(f"http://127.0.0.1:{runner.addresses[0][1]}", app, s, metrics, records, runner)
        running.append(rp)
        return rp

    yield make
    for rp in running:
        await rp.stop()


@dataclass
class ServeProcess:
    proc: asyncio.subprocess.Process
    url: str
    stderr_lines: list[str] = field(default_factory=list)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    async def wait(self, timeout_s: float = 30.0) -> int:
        return await asyncio.wait_for(self.proc.wait(), timeout_s)

    async def advance_clock(self, seconds: float) -> None:
        """Move the process's clock on (started with `driven=True`, see `tests/driven_serve.py`):
        its deadlines pass as if `seconds` had."""
        async with (
            aiohttp.ClientSession() as s,
            s.post(self.url + "/_test/clock", json={"advance_s": seconds}) as r,
        ):
            assert r.status == 200, await r.text()


SHUTDOWN_GRACE_ENV = "SPECROUTE_SHUTDOWN_GRACE_S"
DRIVEN_SERVE = Path(__file__).resolve().parent / "driven_serve.py"


async def start_serve(
    *args: str,
    env: dict[str, str] | None = None,
    timeout_s: float = 30.0,
    stderr: int = asyncio.subprocess.PIPE,
    preexec_fn: Callable[[], Any] | None = None,
    driven: bool = False,
) -> ServeProcess:
    """Run `specroute serve --port 0 ARGS` and wait for its listening line. `stderr` is piped
    unless DEVNULL is passed (a test that does not read it and makes serve log a lot). `driven`:
    the same serve on a clock the test moves (`tests/driven_serve.py`, `advance_clock`).

    `shutdown_grace_s` is 0 unless the test sets it (`--shutdown-grace-s`, or in `env`): the
    shipped 5 s would make every SIGTERM of a test wait 5 s with `/ready` at 503 before the
    drain, which only the shutdown tests look at (they set it themselves)."""
    environ = {SHUTDOWN_GRACE_ENV: "0", **os.environ, **(env or {})}
    command = [str(DRIVEN_SERVE)] if driven else ["-m", "controller.cli", "serve"]
    proc, line = await spawn.start(
        [sys.executable, *command, "--port", "0", *args], marker="specroute listening on ",
        stderr=stderr, stdin=None, env=environ, preexec_fn=preexec_fn, timeout_s=timeout_s,
    )  # fmt: skip
    return ServeProcess(proc, spawn.url_of(line))


@pytest.fixture
async def spawn_serve() -> AsyncIterator[Callable[..., Awaitable[ServeProcess]]]:
    procs: list[ServeProcess] = []

    async def make(*args: str, **kw: Any) -> ServeProcess:
        sp = await start_serve(*args, **kw)
        procs.append(sp)
        return sp

    yield make
    for sp in procs:
        if sp.proc.returncode is None:
            sp.proc.kill()
            await sp.proc.wait()
