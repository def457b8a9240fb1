"""SIGHUP while serving: re-read the config file, and apply it only whole.

How it works: `ConfigReloader.request` is the loop's SIGHUP handler. It runs its `hooks` at once
(the decision log reopens its file: a log rotator sends SIGHUP after moving it) and starts one
reload task; SIGHUPs that arrive while a reload runs are folded into one more reload after it
(a storm of signals costs two reads, not hundreds). A reload reads the file until it is stable:
two reads `settle_s` apart must find the same bytes, size, modification time and inode, else
it reads again, up to `STABLE_ATTEMPTS` times. So a file still being written (an editor saving
in several writes, a deploy tool copying it) is not applied half way: only a file that stopped
changing, parses whole and validates whole (settings, profile and policy built) replaces the
running policy. Any failure leaves the running configuration as it was, is logged (without
secrets: `controller.proxy.redact`) and counted in `specroute_config_reloads_total{result}`:

    ok          applied
    invalid     unreadable, not YAML, or a setting, profile or policy that does not validate
    unstable    still changing after STABLE_ATTEMPTS reads
    no_config   serve was started without --config: nothing to re-read

`specroute_config_last_reload_successful` is 1 until a reload fails, and again after one
succeeds (Prometheus' own convention for its config reloads).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge

from controller.proxy.config import ConfigError, Settings
from controller.proxy.redact import Redactor, secrets_in_values, secrets_in_yaml
from policies.profile import ProfileError
from policies.spec import PolicyError

log = logging.getLogger("specroute.reload")

STABLE_ATTEMPTS = 8
"""Reads of a changing config file before a reload gives up (each `settle_s` after the last)."""
RESULTS = ("ok", "invalid", "unstable", "no_config")


class FileUnstable(Exception):
    """The config file kept changing while it was read."""


@dataclass(frozen=True, slots=True)
class Snapshot:
    """One read of a file: what it held and how it stood when read."""

    size: int
    mtime_ns: int
    inode: tuple[int, int]
    digest: bytes
    data: bytes


def snapshot(path: str) -> Snapshot:
    """Read `path` once (OSError when it cannot be); the stat is of the very file read. A file
    written to during the read gets size -1, which no other snapshot matches."""
    with open(path, "rb") as f:
        before = os.fstat(f.fileno())
        data = f.read()
        after = os.fstat(f.fileno())
    moved = (before.st_size, before.st_mtime_ns) != (after.st_size, after.st_mtime_ns)
    return Snapshot(
        -1 if moved else after.st_size,
        after.st_mtime_ns,
        (after.st_dev, after.st_ino),
        hashlib.sha256(data).digest(),
        data,
    )


def _same(a: Snapshot, b: Snapshot) -> bool:
    return (
        a.size >= 0
        and a.size == len(a.data)
        and (a.size, a.mtime_ns, a.inode, a.digest) == (b.size, b.mtime_ns, b.inode, b.digest)
    )


async def read_stable(
    path: str,
    settle_s: float,
    *,
    attempts: int = STABLE_ATTEMPTS,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> bytes:
    """The file's bytes once two reads `settle_s` apart agree (FileUnstable after `attempts`
    reads that did not; OSError when it cannot be read). The first read and each read that
    found the file changed are logged at INFO (a test on a driven clock waits for those lines
    before it moves the clock on); `sleep` is `asyncio.sleep` unless the caller's clock is
    another (`serve` given a test's clock, `run_serve`)."""
    last = await asyncio.to_thread(snapshot, path)
    log.info("SIGHUP: config file %s read; reading it again in %g s to see it settled", path, settle_s)
    for _ in range(attempts):
        await sleep(settle_s)
        now = await asyncio.to_thread(snapshot, path)
        if _same(last, now):
            return now.data
        log.info("SIGHUP: config file %s is changing; waiting for it to settle", path)
        last = now
    raise FileUnstable(f"config file {path} was still changing after {attempts} reads {settle_s:g} s apart")


class ReloadMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.reloads = Counter(
            "specroute_config_reloads",
            "Config reloads asked for by SIGHUP, by result (ok, invalid, unstable, no_config).",
            ["result"],
            registry=registry,
        )
        for result in RESULTS:
            self.reloads.labels(result)
        self.last_ok = Gauge(
            "specroute_config_last_reload_successful",
            "1 when the last config reload succeeded (or none failed yet), else 0.",
            registry=registry,
        )
        self.last_ok.set(1)

    def count(self, result: str) -> None:
        self.reloads.labels(result).inc()
        if result in ("ok", "invalid", "unstable"):
            self.last_ok.set(1 if result == "ok" else 0)


class ConfigReloader:
    """Re-reads `path` on `request()` and hands the validated settings to `apply`.

    `load(text)` builds the settings from the file's text (the caller merges environment and
    flags); `apply(settings)` swaps the policy in and raises PolicyError/ProfileError when it
    cannot be built (nothing is changed then)."""

    def __init__(
        self,
        path: str | None,
        load: Callable[[str], Settings],
        apply: Callable[[Settings], None],
        metrics: ReloadMetrics,
        *,
        settle_s: float,
        redactor: Redactor | None = None,
        hooks: Sequence[Callable[[], None]] = (),
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.path = path
        self.load = load
        self.apply = apply
        self.metrics = metrics
        self.settle_s = settle_s
        self.redactor = redactor
        self.hooks = list(hooks)
        self.sleep = sleep
        self._task: asyncio.Task[None] | None = None
        self._again = False

    def request(self) -> None:
        """Ask for a reload (the SIGHUP handler; call on the event loop)."""
        for hook in self.hooks:
            try:
                hook()
            except Exception:
                log.exception("SIGHUP hook failed")
        if self._task is not None and not self._task.done():
            self._again = True  # folded: one more reload once this one ends
            return
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def wait(self) -> None:
        """Until no reload is running (tests, shutdown)."""
        while self._task is not None and not self._task.done():
            await asyncio.shield(self._task)

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            self._again = False
            try:
                self.metrics.count(await self._once())
            except Exception:  # never let a reload end serve
                log.exception("SIGHUP: reload failed, running config kept")
                self.metrics.count("invalid")
            if not self._again:
                return

    async def _once(self) -> str:
        if self.path is None:
            log.warning("SIGHUP: no --config file to re-read; policy unchanged")
            return "no_config"
        try:
            data = await read_stable(self.path, self.settle_s, sleep=self.sleep)
        except FileUnstable as e:
            log.error("SIGHUP: reload failed, running config kept: %s", e)
            return "unstable"
        except OSError as e:
            log.error(
                "SIGHUP: reload failed, running config kept: config file %s: cannot read: %s",
                self.path,
                e.strerror or e,
            )
            return "invalid"
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            log.error("SIGHUP: reload failed, running config kept: config file %s is not UTF-8", self.path)
            return "invalid"
        if self.redactor is not None:
            self.redactor.add(secrets_in_yaml(text))
        try:
            fresh = self.load(text)
            if self.redactor is not None:
                self.redactor.add(secrets_in_values(dict(fresh)))
            fresh.require_backends()
            self.apply(fresh)
        except (ConfigError, PolicyError, ProfileError) as e:
            log.error("SIGHUP: reload failed, running config kept: %s", e)
            return "invalid"
        log.warning("SIGHUP: config file %s applied", self.path)
        return "ok"
