"""What it costs to build the policy seam's values, slotted (as they are) against frozen.

`policies.base` keeps `BackendLoad`, `PoolLoad`, `LoadView`, `Decision` and `Outcome` slotted but
not frozen (a documented constructor-only rule, enforced by tests/policies/test_values.py),
because the simulator builds several of them per simulated request. This measures the build
cost of each as it is and as a frozen twin (same fields, `frozen=True`), on one core.

    python benchmarks/value_build_cost.py [--n 1000000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import statistics
import sys
import timeit
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from policies.base import BackendLoad, Decision, Outcome, RequestInfo


def _backend_load_derived(self: Any) -> None:
    """`BackendLoad`'s derived fields, as its constructor sets them (a frozen class must use
    `object.__setattr__`)."""
    running, queued, in_flight = self.running, self.queued, self.in_flight
    if running is None:
        load = in_flight
    else:
        scraped = running + queued if queued else running
        load = scraped if scraped > in_flight else in_flight
    object.__setattr__(self, "load", load)
    object.__setattr__(self, "admits", self.usable and not self.full)


DERIVED = {"BackendLoad": _backend_load_derived}
"""Per class with derived fields (`field(init=False)`): the frozen twin's `__post_init__`."""


def frozen_twin(cls: type) -> Any:
    """`cls` frozen: the same constructor fields and defaults (read from its `__init__`, which
    may be hand-written), derived fields set in `__post_init__`."""
    params = inspect.signature(cls).parameters
    fields = []
    for f in dataclasses.fields(cls):
        if not f.init:
            fields.append((f.name, f.type, dataclasses.field(init=False)))
            continue
        default = params[f.name].default
        if f.default_factory is not dataclasses.MISSING:
            fields.append((f.name, f.type, dataclasses.field(default_factory=f.default_factory)))
        elif default is inspect.Parameter.empty:
            fields.append((f.name, f.type, dataclasses.field()))
        else:
            fields.append((f.name, f.type, dataclasses.field(default=default)))
    namespace = {"__post_init__": DERIVED[cls.__name__]} if cls.__name__ in DERIVED else {}
    return dataclasses.make_dataclass(
        cls.__name__ + "Frozen", fields, frozen=True, slots=True, namespace=namespace
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    info = RequestInfo()
    decision = Decision("eagle", "e0", "faster_eagle", {}, {}, 3, "cost_model")
    cases: dict[str, tuple[type, tuple[Any, ...]]] = {
        "BackendLoad": (BackendLoad, ("e0", "eagle", True, 4, 800, 3, 1, 3.1, 0.0)),
        "Decision": (Decision, ("eagle", "e0", "faster_eagle", {}, {}, 3, "cost_model", None)),
        "Outcome": (Outcome, (info, decision, 1.0, 0.2, 200, 4.0, "ok", None, None)),
    }
    python = sys.version.split()[0]
    print(f"build cost per value, median of {args.repeats} x {args.n:,} builds (ns); python {python}")
    print(f"{'value':<12} {'slotted':>9} {'frozen':>9} {'ratio':>6}   spread (min-max) slotted / frozen")
    for name, (cls, values) in cases.items():
        rows = []
        for kind in (cls, frozen_twin(cls)):
            runs = timeit.repeat(functools.partial(kind, *values), number=args.n, repeat=args.repeats)
            rows.append([t / args.n * 1e9 for t in runs])
        a, b = (statistics.median(r) for r in rows)
        print(
            f"{name:<12} {a:>9.0f} {b:>9.0f} {b / a:>6.2f}   "
            f"{min(rows[0]):.0f}-{max(rows[0]):.0f} / {min(rows[1]):.0f}-{max(rows[1]):.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
