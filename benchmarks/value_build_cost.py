"""What it costs to build the policy seam's values, and what refusing assignment costs per request.

`BackendLoad` and `Decision` refuse an assignment to a field (`dataclasses.FrozenInstanceError`):
their constructors set each slot through `object.__setattr__`, which mypyc compiles to a plain
store but which, in pure Python, is a call per field. `PoolLoad`, `LoadView` and `Outcome` are
plain slotted dataclasses kept to the constructor-only rule by tests (`policies.base`). This
measures, in pure Python on one core, each value's build as it is beside two twins with the
same fields and defaults:

- `plain`: the same slots and constructor with plain stores (`self.x = x`): no guard;
- `frozen`: a `@dataclass(frozen=True, slots=True)` (derived fields in `__post_init__`).

Then what the guard costs a simulated request: the values a pure-Python simulation builds per
request (cost_model, one baseline and one eagle server, `simulator_speed.py`'s workload), times
the difference of each guarded value's build from its plain twin's.

    python benchmarks/value_build_cost.py [--n 300000] [--repeats 5] [--requests 20000]

The end-to-end figure is `simulator_speed.py --against` an older tree (wall clock), or the
instruction counts of its `--child` runs under callgrind.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import re
import statistics
import sys
import textwrap
import timeit
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from policies.base import BackendLoad, Decision, Outcome, RequestInfo
from policies.profile import resolve_profile
from simulator.engine.runner import PolicyChoice, run
from simulator.engine.workloads import LengthSpec, WorkloadSpec, generate

GUARDED: tuple[type, ...] = (BackendLoad, Decision)
PROFILE = "kimi-k25-int4-8gpu"


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


def plain_twin(cls: type) -> Any:
    """`cls` without its guard: the same slots and its own constructor's source, each
    `object.__setattr__(self, "x", v)` a plain `self.x = (v)`."""
    source = textwrap.dedent(inspect.getsource(cls.__init__))  # type: ignore[misc]
    plain, stores = re.subn(r'object\.__setattr__\(self, "(\w+)", ', r"self.\1 = (", source)
    if stores == 0:
        raise SystemExit(f"{cls.__name__}'s constructor sets no field through object.__setattr__")
    namespace = dict(vars(sys.modules[cls.__module__]))
    exec(compile("from __future__ import annotations\n" + plain, "<plain twin>", "exec"), namespace)
    slots = tuple(f.name for f in dataclasses.fields(cls))
    return type(cls.__name__ + "Plain", (), {"__slots__": slots, "__init__": namespace["__init__"]})


@contextmanager
def counting(classes: tuple[type, ...]) -> Iterator[Counter[str]]:
    """Counts the values of `classes` built while inside (pure Python only)."""
    counts: Counter[str] = Counter()
    saved = {cls: cls.__dict__["__init__"] for cls in classes}

    def wrap(cls: type, init: Callable[..., None]) -> Callable[..., None]:
        name = cls.__name__

        def counted(self: Any, *args: Any, **kwargs: Any) -> None:
            counts[name] += 1
            init(self, *args, **kwargs)

        return counted

    try:
        for cls, init in saved.items():
            type.__setattr__(cls, "__init__", wrap(cls, init))
        yield counts
    finally:
        for cls, init in saved.items():
            type.__setattr__(cls, "__init__", init)


def built_per_request(requests: int) -> dict[str, float]:
    """Values of each guarded class a pure-Python simulation builds per simulated request."""
    if type(BackendLoad.__init__).__name__ != "function":
        raise SystemExit("the compiled build is active (SPECROUTE_NATIVE_DIR?): this counts the pure Python")
    workload = generate(
        WorkloadSpec(kind="poisson", rate=4.0, requests=requests, output_tokens=LengthSpec("exp", 200)), 1
    )
    with counting(GUARDED) as counts:
        run(resolve_profile(PROFILE), PolicyChoice("cost_model"), [("baseline", 1), ("eagle", 1)], workload)
    return {cls.__name__: counts[cls.__name__] / requests for cls in GUARDED}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=300_000, help="Builds per timing.")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--requests", type=int, default=20_000, help="Simulated requests counted.")
    args = ap.parse_args()
    info = RequestInfo()
    decision = Decision("eagle", "e0", "faster_eagle", {}, {}, 3, "cost_model")
    cases: dict[str, tuple[type, tuple[Any, ...]]] = {
        # as `policies.view.true_load` builds it in the simulator
        "BackendLoad": (BackendLoad, ("e0", "eagle", True, 4, 800, 3, 1, 3.1, 0.0)),
        # as cost_model returns it
        "Decision": (Decision, ("eagle", "e0", "faster_eagle", {}, {}, 3, "cost_model", None)),
        "Outcome": (Outcome, (info, decision, 1.0, 0.2, 200, 4.0, "ok", None, None)),
    }
    python = sys.version.split()[0]
    print(f"build cost per value, median of {args.repeats} x {args.n:,} builds (ns); python {python}, pure")
    print(
        f"{'value':<12} {'as is':>7} {'plain':>7} {'frozen':>7} {'is/plain':>9} {'frozen/plain':>13}"
        "   spread (min-max) as is / plain / frozen"
    )
    extra: dict[str, float] = {}
    for name, (cls, values) in cases.items():
        kinds = [cls, plain_twin(cls) if cls in GUARDED else cls, frozen_twin(cls)]
        rows = []
        for kind in kinds:
            runs = timeit.repeat(functools.partial(kind, *values), number=args.n, repeat=args.repeats)
            rows.append([t / args.n * 1e9 for t in runs])
        a, p, f = (statistics.median(r) for r in rows)
        extra[name] = a - p
        spread = " / ".join(f"{min(r):.0f}-{max(r):.0f}" for r in rows)
        print(f"{name:<12} {a:>7.0f} {p:>7.0f} {f:>7.0f} {a / p:>9.2f} {f / p:>13.2f}   {spread}")
    per_request = built_per_request(args.requests)
    guard = sum(per_request[n] * extra[n] for n in per_request)
    built = ", ".join(f"{per_request[n]:.3f} {n}" for n in per_request)
    print(
        f"\nper simulated request ({args.requests:,} requests, cost_model, baseline=1,eagle=1): "
        f"{built} built; the guard adds {guard:.0f} ns (as is - plain, times the builds)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
