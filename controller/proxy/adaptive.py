"""Eagle backends that adapt their draft depth in-engine, and the profile policies predict them with.

Each eagle backend's ladder (`policies.ladder`) comes from `backend_adaptive` when set there (the
setting wins), else from what the backend reports (`scrape.py`: SGLang's `/server_info`, vLLM's
`/server_info?config_format=json`), else it is not known yet. The policies see one eagle mode, so
the pool is predicted with one ladder: the one all its backends known so far follow; when they
differ (or some do not adapt) the pool is predicted as the profile's fixed EAGLE-3 mode, and a
warning says so. `EagleLadders.adapt` turns a policy context into that prediction's: the profile
with its eagle mode replaced by the ladder's speed (`policies.adaptive.adaptive_profile`). The app
builds its policies through it (`PolicyAdmin`'s `adapt`) and rebuilds the running one when a
report changes the pool's ladder (`ladder_reported`): its learned state starts afresh then, as on a
reload.
"""

from __future__ import annotations

import logging

from controller.proxy.config import Settings
from policies.adaptive import adaptive_profile
from policies.ladder import Ladder, Reported, parse_ladder
from policies.profile import Profile
from policies.spec import PolicyContext

log = logging.getLogger("specroute.adaptive")
_KEEP = 8
"""Adapted profiles remembered (the running policy's and its shadows' are the newest)."""


def _same(a: Ladder | None, b: Ladder | None) -> bool:
    if a is None or b is None:
        return a is b
    return a.same_depths(b)


class EagleLadders:
    """The eagle pool's in-engine adaptation: configured, reported, and the one predicted."""

    def __init__(self, settings: Settings) -> None:
        self.eagle = [b.name for b in settings.backends("eagle")]
        self.configured: dict[str, Ladder | None] = {
            name: parse_ladder(spec) for name, spec in settings.backend_adaptive.items()
        }
        self.reported: dict[str, Ladder | None] = {}
        self._told: set[tuple[str, str]] = set()
        self._made: dict[int, tuple[Profile, Profile]] = {}
        """id of an adapted profile -> (it, the profile it was made from): `adapt` starts from the base."""

    def ladder_of(self, name: str) -> tuple[bool, Ladder | None]:
        """(known, ladder) of one eagle backend: configured, else reported."""
        if name in self.configured:
            return True, self.configured[name]
        if name in self.reported:
            return True, self.reported[name]
        return False, None

    def pool_ladder(self) -> Ladder | None:
        """The ladder the eagle pool is predicted with (None: the profile's fixed EAGLE-3 mode)."""
        known = [ladder for ok, ladder in map(self.ladder_of, self.eagle) if ok]
        if not known or known[0] is None or not all(_same(known[0], other) for other in known[1:]):
            return None
        return known[0]

    def _tell(self, name: str, message: str) -> None:
        if (name, message) not in self._told:
            self._told.add((name, message))
            log.warning("eagle backend %s: %s", name, message)

    def report(self, name: str, reported: Reported) -> bool:
        """A backend's own report; True when it changes the pool's ladder."""
        if name not in self.eagle:
            return False
        before = self.pool_ladder()
        self.reported[name] = reported.ladder
        configured = name in self.configured
        if reported.note is not None and not configured:
            self._tell(name, reported.note)
        if configured and not _same(self.configured[name], reported.ladder):
            said = "no adaptation" if reported.ladder is None else f"the ladder {reported.ladder.describe()}"
            self._tell(name, f"it reports {said}; backend_adaptive says otherwise and is followed")
        known = [ladder for ok, ladder in map(self.ladder_of, self.eagle) if ok]
        if len(known) > 1 and not all(_same(known[0], other) for other in known[1:]):
            self._tell(
                "pool",
                "eagle backends adapt differently: the pool is predicted as the profile's fixed EAGLE-3 mode",
            )
        return not _same(before, self.pool_ladder())

    def adapt(self, context: PolicyContext) -> PolicyContext:
        """`context` with its profile's eagle mode following the pool's ladder (as it is when the
        pool has none, or the profile lacks a mode the adaptive speed is derived from)."""
        profile = context.profile
        if profile is None:
            return context
        made = self._made.get(id(profile))
        base = made[1] if made is not None and made[0] is profile else profile
        ladder = self.pool_ladder()
        if ladder is None or "baseline" not in base.modes or "eagle" not in base.modes:
            return context if base is profile else PolicyContext(base, context.seed)
        adapted = adaptive_profile(base, ladder)
        self._made[id(adapted)] = (adapted, base)
        while len(self._made) > _KEEP:  # the oldest first: a dict keeps insertion order
            del self._made[next(iter(self._made))]
        return PolicyContext(adapted, context.seed)

    def describe(self) -> str:
        ladder = self.pool_ladder()
        if ladder is None:
            return "fixed EAGLE-3 (the profile's)"
        return f"adapting: {ladder.describe()} ({ladder.origin})"
