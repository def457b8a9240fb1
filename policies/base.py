"""The policy seam: plain data in, a `Decision` out. The values are defined in `policies.values`
(a leaf, apart so that it compiles: see there) and re-exported here; import them from this module.

How it works: the controller (live proxy) and the simulator both build a `RequestInfo` and a
`LoadView`, call `policy.choose(request, view, now)`, act on the returned `Decision`, and when
the request has ended feed an `Outcome` back through `policy.observe`. Nothing in this module
(or in any policy) does I/O, reads a clock, or touches asyncio; randomness comes from a
`random.Random` that the caller seeds. That is what lets the simulator run the very same
policy objects as the proxy and reproduce a run to the bit.

Values, built once. `BackendLoad` and `Decision` refuse an assignment to (or a deletion of) a
field: it raises `dataclasses.FrozenInstanceError`, in the pure Python and in the compiled build
alike; a variant is a new value (`dataclasses.replace`; `copy` and `pickle` work). They are
slotted classes whose constructors are written to set each field once through
`object.__setattr__`, which mypyc compiles to a plain store; uncompiled, each is built by a
`__new__` made from that constructor, of plain stores on an assignable twin whose class is then
switched (`policies.values`). `benchmarks/value_build_cost.py` gives what building one costs, and
`benchmarks/simulator_speed.py --against` an older tree what it costs a simulated request.
`PoolLoad`, `LoadView` and `Outcome` are slotted dataclasses kept to the same rule by the tests
(`tests/policies/test_values.py` makes them refuse a second assignment and runs the routing
core, every policy, the simulator and the proxy's view through them). Whoever receives a value
may keep it: the simulator hands the same `BackendLoad` to several decisions while its server is
unchanged.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from policies.values import (
    HINT_HEADER,
    POOLS,
    BackendLoad,
    Decision,
    EndpointKind,
    InvalidDecision,
    LoadView,
    NoHealthyBackend,
    Outcome,
    OutcomeStatus,
    Pool,
    PoolLoad,
    RequestFeatures,
    RequestInfo,
    load_of,
    other_pool,
    parse_pool,
)

__all__ = [
    "HINT_HEADER",
    "POOLS",
    "BackendLoad",
    "Decision",
    "EndpointKind",
    "InvalidDecision",
    "LoadView",
    "NoHealthyBackend",
    "Outcome",
    "OutcomeStatus",
    "Policy",
    "Pool",
    "PoolLoad",
    "RequestFeatures",
    "RequestInfo",
    "Resettable",
    "load_of",
    "other_pool",
    "parse_pool",
    "reads_features",
]


@runtime_checkable
class Policy(Protocol):
    """A routing policy. Pure: no I/O, no clock reads, no asyncio."""

    name: str

    def choose(self, request: RequestInfo, view: LoadView, now: float) -> Decision:
        """Pick a pool for `request` (the routing core picks the backend when `backend` is "").

        Called through `policies.routing.Router.decide`, which handles requests with a
        `forced_pool` itself: a policy never sees those. May raise NoHealthyBackend."""
        ...

    def observe(self, outcome: Outcome) -> None:
        """Feedback once a request chosen by this policy has ended (`policies.routing.teaches`
        says whether it is one a policy should learn speeds from)."""
        ...


def reads_features(policy: object) -> bool:
    """Whether `policy` may read `RequestInfo.features`: True unless it has an attribute
    `reads_features` that is False (optional, like `Resettable`). The proxy extracts a request's
    features (`policies.features`) only when its policy or a shadow policy may read
    them; otherwise `RequestInfo.features` is None, as for a trace without text."""
    return getattr(policy, "reads_features", True) is not False


@runtime_checkable
class Resettable(Protocol):
    """A policy with state tied to the clock (optional: `policies.routing.reset` calls it)."""

    def reset(self) -> None:
        """A new run on an empty deployment begins (the simulator calls it at the start of
        every segment, whose clock restarts at 0): forget what is in flight or queued (state
        tied to the old clock), keep what was learned. The proxy never calls it (its clock
        does not restart)."""
        ...
