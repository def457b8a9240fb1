"""What the routing policy learned, kept across reloads and restarts.

How it works.

- A running policy has an *identity* (`PolicyIdentity`): its name, its parameters as resolved
  (defaults filled in, so `{}` and `{"calibrate": true}` are the same `cost_model`), a digest of
  its speed profile and its seed. A reload (`PolicyAdmin.swap`: SIGHUP or `POST /admin/policy`)
  whose identity is the running one's keeps the running policy object, and so everything it
  learned; any other starts a fresh policy and says so (`controller.proxy.admin`).
- With `state_file` set, `StateKeeper` saves what the policy learned (its `state()`, see
  `policies.learned`) and the prefix index of every backend (`policies.prefix.PrefixIndex`: what
  specroute believes each backend has cached) every `state_save_interval_s` and once more after
  the drain at shutdown, and loads them at start, before the listener opens.
- The file is one JSON object: `format` ("specroute.state"), `version` (`VERSION`), `saved_at`
  (Unix time), `policy` (the identity), `learned` (the policy's state, or null for a policy
  that keeps none), `prefixes` (per backend: pool, name, URL and the index's state). It is
  written whole to a temporary file beside it, flushed to disk and renamed over the old one, so
  a crash leaves the old file or the new one, never a mix. A file over `MAX_BYTES` is neither
  written (the prefix beliefs are left out first; if it is still too large, the old file stays)
  nor read.
- At start a file that cannot be read, is not JSON, is not a specroute state file, has another
  version, is larger than `MAX_BYTES` or holds data the policy refuses is ignored with a
  warning: the policy starts fresh (serve never fails to start over its state file). Learned
  state saved for another policy identity is ignored with a warning naming what differs; the
  prefix beliefs of backends with the same pool, name and URL are loaded whatever the policy.
- Metrics: `specroute_state_loads_total{result}` (`loaded`, `absent`, `other_policy`,
  `invalid`) and `specroute_state_saves_total{result}` (`ok`, `error`: the disk refused,
  `too_large`, `unencodable`).

The state is encoded and written in a worker thread; what is encoded is a copy taken on the
event loop (`state()` returns copies), so requests go on being routed and learned from.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter

from controller.proxy.config import ConfigError, Settings
from controller.proxy.load import LoadTracker
from policies.base import Policy
from policies.learned import learner
from policies.registry import PolicyRegistry
from policies.spec import PolicyContext

log = logging.getLogger("specroute.state")

FORMAT = "specroute.state"
VERSION = 1
MAX_BYTES = 64 * 1024 * 1024
"""The largest state file written or read."""
LOAD_RESULTS = ("loaded", "absent", "other_policy", "invalid")
SAVE_RESULTS = ("ok", "error", "too_large", "unencodable")


@dataclass(frozen=True)
class PolicyIdentity:
    """What makes two policies the same for what they learn (see the module docstring)."""

    name: str
    params: Mapping[str, Any]
    profile: str | None
    """sha256 of the profile's JSON (None: no profile)."""
    seed: int

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "params": dict(self.params), "profile": self.profile, "seed": self.seed}

    def key(self) -> str:
        return json.dumps(self.as_dict(), sort_keys=True, default=str)

    def differences(self, saved: object) -> list[str]:
        """What differs between this identity and a saved one (`as_dict`'s shape), in words."""
        if not isinstance(saved, dict):
            return ["the policy (not recorded)"]
        if saved.get("name") != self.name:
            return [f"policy {saved.get('name')!r} (now {self.name!r})"]
        out = []
        params = saved.get("params")
        mine = json.loads(json.dumps(dict(self.params), default=str))
        if not isinstance(params, dict):
            out.append("params")
        else:
            changed = sorted(k for k in set(params) | set(mine) if params.get(k) != mine.get(k))
            if changed:
                out.append(f"params {', '.join(changed)}")
        if saved.get("profile") != self.profile:
            out.append("profile")
        if saved.get("seed") != self.seed:
            out.append("seed")
        return out

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PolicyIdentity) and self.key() == other.key()

    def __hash__(self) -> int:
        return hash(self.key())


def policy_identity(
    registry: PolicyRegistry, name: str, params: Mapping[str, Any], context: PolicyContext
) -> PolicyIdentity:
    """The identity of the policy `registry.create(name, params, context)` builds (PolicyError
    on parameters it would refuse)."""
    resolved = registry.parse_params(name, params).model_dump(mode="json")
    profile = None
    if context.profile is not None:
        profile = hashlib.sha256(context.profile.to_json().encode()).hexdigest()
    return PolicyIdentity(name, resolved, profile, context.seed)


class StateMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.loads = Counter(
            "specroute_state_loads",
            "Loads of the state file at start, by result (loaded, absent, other_policy: saved for "
            "another policy identity, invalid: unreadable, corrupt, foreign or too large).",
            ["result"],
            registry=registry,
        )
        self.saves = Counter(
            "specroute_state_saves",
            "Saves of the state file, by result (ok, error: the disk refused, too_large, unencodable).",
            ["result"],
            registry=registry,
        )
        for result in LOAD_RESULTS:
            self.loads.labels(result)
        for result in SAVE_RESULTS:
            self.saves.labels(result)


class StateKeeper:
    """Loads, periodically saves and finally saves `path` (see the module docstring).

    `policy()` is the running policy and `identity()` its identity (both change on reloads);
    `fresh()` replaces the running policy by a newly built one (after a refused load)."""

    def __init__(
        self,
        path: str,
        *,
        interval_s: float,
        tracker: LoadTracker,
        policy: Callable[[], Policy],
        identity: Callable[[], PolicyIdentity],
        fresh: Callable[[], None],
        metrics: StateMetrics,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.interval_s = interval_s
        self.tracker = tracker
        self.policy = policy
        self.identity = identity
        self.fresh = fresh
        self.metrics = metrics
        self.wall_clock = wall_clock
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    # -- loading --

    def load(self) -> str:
        """Load the file into the running policy and the prefix indexes; returns the result
        (one of LOAD_RESULTS), counted and logged."""
        result = self._load()
        self.metrics.loads.labels(result).inc()
        return result

    def _read(self) -> dict[str, Any] | None:
        """The file's object, or None when it is absent (OSError/ValueError: not usable)."""
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size > MAX_BYTES:
                    raise ValueError(f"{size} bytes, over the {MAX_BYTES} a state file may hold")
                data = f.read(MAX_BYTES + 1)
        except FileNotFoundError:
            return None
        if len(data) > MAX_BYTES:
            raise ValueError(f"over the {MAX_BYTES} bytes a state file may hold")
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"not JSON ({e})"[:300]) from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError("not a specroute state file")
        if doc.get("version") != VERSION:
            raise ValueError(f"state file version {doc.get('version')!r}; this specroute reads {VERSION}")
        return doc

    def _load(self) -> str:
        try:
            doc = self._read()
        except (OSError, ValueError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            log.warning("state file %s: ignored, the policy starts fresh: %s", self.path, why)
            return "invalid"
        if doc is None:
            log.info("state file %s does not exist yet: the policy starts fresh", self.path)
            return "absent"
        age = _age(doc.get("saved_at"), self.wall_clock())
        self._load_prefixes(doc.get("prefixes"))
        try:
            identity, policy = self.identity(), self.policy()
        except ValueError as e:  # PolicyError: the running policy's settings do not resolve
            log.warning("state file %s: ignored, the policy's identity is unknown: %s", self.path, e)
            return "invalid"
        differs = identity.differences(doc.get("policy"))
        if differs:
            log.warning(
                "state file %s was saved for another policy (%s differ); %s starts fresh",
                self.path, "; ".join(differs), identity.name,
            )  # fmt: skip
            return "other_policy"
        learned = doc.get("learned")
        target = learner(policy)
        if target is None or learned is None:
            log.info("state file %s: policy %s keeps no learned state", self.path, identity.name)
            return "loaded"
        try:
            target.load_state(learned)
        except (ValueError, TypeError, KeyError) as e:
            self.fresh()  # whatever the policy did with the part it took, it starts over
            log.warning(
                "state file %s: the learned state is ignored (%s); %s starts fresh",
                self.path,
                e,
                identity.name,
            )
            return "invalid"
        log.warning(
            "state file %s: %s goes on from what it had learned (saved %s)", self.path, identity.name, age
        )
        return "loaded"

    def _load_prefixes(self, saved: object) -> None:
        if not isinstance(saved, list):
            return
        backends = {(b.pool, b.name, b.url): b for b in self.tracker if b.prefixes is not None}
        loaded = 0
        for entry in saved:
            if not isinstance(entry, dict):
                continue
            b = backends.get((entry.get("pool"), entry.get("name"), entry.get("url")))  # type: ignore[arg-type]
            if b is None or b.prefixes is None:
                continue
            try:
                b.prefixes.load_state(entry.get("index"))
                loaded += 1
            except ValueError as e:
                log.warning("state file %s: prefix beliefs of %s ignored: %s", self.path, b.name, e)
        if loaded:
            log.info("state file %s: prefix beliefs of %d backend(s) loaded", self.path, loaded)

    # -- saving --

    def snapshot(self, prefixes: bool = True) -> dict[str, Any]:
        """The file's object, as it stands (call on the event loop: the policy is not locked)."""
        target = learner(self.policy())
        return {
            "format": FORMAT,
            "version": VERSION,
            "saved_at": self.wall_clock(),
            "policy": self.identity().as_dict(),
            "learned": None if target is None else target.state(),
            "prefixes": [
                {"pool": b.pool, "name": b.name, "url": b.url, "index": b.prefixes.state()}
                for b in self.tracker
                if b.prefixes is not None and prefixes
            ],
        }

    async def save(self) -> str:
        """Write the file now; returns the result (one of SAVE_RESULTS), counted, logged when it
        is not `ok` (and once when saving works again)."""
        async with self._lock:
            result = await self._save()
        self.metrics.saves.labels(result).inc()
        if result == "ok" and self._failing:
            log.warning("state file %s: saved again", self.path)
        self._failing = result != "ok"
        return result

    async def _save(self) -> str:
        try:
            doc = self.snapshot()
            data = await asyncio.to_thread(_encode, doc)
            if len(data) > MAX_BYTES:
                log.warning(
                    "state file %s: %d bytes with the prefix beliefs, over %d: saved without them",
                    self.path, len(data), MAX_BYTES,
                )  # fmt: skip
                doc["prefixes"] = []
                data = await asyncio.to_thread(_encode, doc)
        except (ValueError, TypeError, OverflowError) as e:  # a learner's state() that is not plain data
            log.error("state file %s: not saved, the state cannot be encoded: %s", self.path, e)
            return "unencodable"
        if len(data) > MAX_BYTES:
            log.error("state file %s: not saved: %d bytes, over %d", self.path, len(data), MAX_BYTES)
            return "too_large"
        try:
            await asyncio.to_thread(write_atomic, self.path, data)
        except OSError as e:
            if not self._failing:
                log.error("state file %s: not saved (the old file stays): %s", self.path, e.strerror or e)
            return "error"
        return "ok"

    def start(self) -> None:
        """Save every `interval_s` from now on (call once serve listens)."""
        self._task = asyncio.get_running_loop().create_task(self._every())

    async def _every(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.save()

    async def stop(self) -> str:
        """Stop the periodic saves and save once more (after the drain)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        result = await self.save()
        if result == "ok":
            log.info("state file %s saved", self.path)
        return result


def _encode(doc: Mapping[str, Any]) -> bytes:
    return json.dumps(doc, allow_nan=False, separators=(",", ":")).encode()


def _age(saved_at: object, now: float) -> str:
    if isinstance(saved_at, bool) or not isinstance(saved_at, int | float):
        return "at an unknown time"
    seconds = now - saved_at
    if seconds < 0:
        return "in the future, by this machine's clock"
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def write_atomic(path: str, data: bytes) -> None:
    """Replace `path` by a file holding `data`, whole or not at all: written to a temporary
    file in the same directory (created if need be), flushed to disk, renamed over `path`, the
    directory flushed."""
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename itself durable (not every file system lets us)
        dfd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def check_state_path(path: str) -> None:
    """ConfigError unless `state_file` can be written: not a directory, and its directory
    writable, or creatable under the nearest existing one (nothing is created here: serve
    writes the file, and its directory, once it listens)."""
    if os.path.isdir(path):
        raise ConfigError(f"state_file {path}: is a directory")
    directory = os.path.dirname(os.path.abspath(path))
    existing = directory
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError(f"state_file {path}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"state_file {path}: directory {existing} is not writable")


class RunningPolicy(Protocol):
    """What the keeper needs of `controller.proxy.admin.PolicyAdmin`."""

    def running(self) -> Policy: ...

    def identity(self) -> PolicyIdentity: ...

    def fresh(self) -> None: ...


def keeper_for(
    settings: Settings, admin: RunningPolicy, tracker: LoadTracker, registry: CollectorRegistry
) -> StateKeeper:
    """The `StateKeeper` of an application (`settings.state_file` set)."""
    assert settings.state_file is not None
    return StateKeeper(
        settings.state_file,
        interval_s=settings.state_save_interval_s,
        tracker=tracker,
        policy=admin.running,
        identity=admin.identity,
        fresh=admin.fresh,
        metrics=StateMetrics(registry),
    )
