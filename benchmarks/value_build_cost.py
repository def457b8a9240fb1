"""What it costs to build the policy seam's values, and what refusing assignment costs per request.

`BackendLoad` and `Decision` refuse an assignment to a field (`dataclasses.FrozenInstanceError`):
their constructors are written to set each slot through `object.__setattr__`, which mypyc
compiles to a plain store but which, interpreted, is a call per field; so the uncompiled module
builds them with a `__new__` made from that constructor, of plain stores on an assignable twin
whose class is then switched (`policies.values._stores_constructor`). `PoolLoad`, `LoadView` and
`Outcome` are plain slotted dataclasses kept to the constructor-only rule by tests
(`policies.base`). This measures, in pure Python on one core, each value's build as it is beside
three twins with the same fields and defaults:

- `written`: the constructor as written, run as it stands (`object.__setattr__` per field, the
  guard in place): what the values cost without the stores constructor;
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
from typing import Any, cast

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


def written_init(cls: type) -> Callable[..., None]:
    """`cls`'s constructor as written (uncompiled, `__new__` is made from it and holds it)."""
    made = cls.__dict__["__new__"].__func__
    if not hasattr(made, "__wrapped__"):
        raise SystemExit(f"{cls.__name__} is not built by its stores constructor: the compiled build?")
    return cast(Callable[..., None], made.__wrapped__)


def written_twin(cls: type) -> Any:
    """`cls` built by its constructor as written: the same slots and guard (`_Value`), each field
    set through `object.__setattr__`."""
    namespace = {"__slots__": tuple(f.name for f in dataclasses.fields(cls)), "__init__": written_init(cls)}
    return type(cls.__name__ + "Written", cls.__bases__, namespace)


def plain_twin(cls: type) -> Any:
    """`cls` without its guard: the same slots and its own constructor's source, each
    `object.__setattr__(self, "x", v)` a plain `self.x = (v)`."""
    source = textwrap.dedent(inspect.getsource(written_init(cls)))
    plain, stores = re.subn(r'object\.__setattr__\(self, "(\w+)", ', r"self.\1 = (", source)
    if stores == 0:
        raise SystemExit(f"{cls.__name__}'s constructor sets no field through object.__setattr__")
    namespace = dict(vars(sys.modules[cls.__module__]))
    exec(compile("from __future__ import annotations\n" + plain, "<plain twin>", "exec"), namespace)
    slots = tuple(f.name for f in dataclasses.fields(cls))
    return type(cls.__name__ + "Plain", (), {"__slots__": slots, "__init__": namespace["__init__"]})


@contextmanager
def counting(classes: tuple[type, ...]) -> Iterator[Counter[str]]:
    """Counts the values of `classes` built while inside (pure Python only: each is built by its
    `__new__`)."""
    counts: Counter[str] = Counter()
    saved = {cls: cls.__dict__["__new__"] for cls in classes}

    def wrap(cls: type, new: Callable[..., Any]) -> Callable[..., Any]:
        name = cls.__name__

        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return new(*args, **kwargs)

        return counted

    try:
        for cls, new in saved.items():
            type.__setattr__(cls, "__new__", staticmethod(wrap(cls, new.__func__)))
        yield counts
    finally:
        for cls, new in saved.items():
            type.__setattr__(cls, "__new__", new)


def built_per_request(requests: int) -> dict[str, float]:
    """Values of each guarded class a pure-Python simulation builds per simulated request."""
    if "__new__" not in BackendLoad.__dict__:
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
        f"{'value':<12} {'as is':>7} {'written':>8} {'plain':>7} {'frozen':>7} {'is/plain':>9} "
        f"{'written/plain':>14} {'frozen/plain':>13}   spread (min-max) as is / written / plain / frozen"
    )
    extra: dict[str, tuple[float, float]] = {}
    for name, (cls, values) in cases.items():
        guarded = cls in GUARDED
        kinds = [
            cls,
            written_twin(cls) if guarded else cls,
            plain_twin(cls) if guarded else cls,
            frozen_twin(cls),
        ]
        rows = []
        for kind in kinds:
            runs = timeit.repeat(functools.partial(kind, *values), number=args.n, repeat=args.repeats)
            rows.append([t / args.n * 1e9 for t in runs])
        a, w, p, f = (statistics.median(r) for r in rows)
        extra[name] = (a - p, w - p)
        spread = " / ".join(f"{min(r):.0f}-{max(r):.0f}" for r in rows)
        print(
            f"{name:<12} {a:>7.0f} {w:>8.0f} {p:>7.0f} {f:>7.0f} {a / p:>9.2f} {w / p:>14.2f} {f / p:>13.2f}"
            f"   {spread}"
        )
    per_request = built_per_request(args.requests)
    guard = sum(per_request[n] * extra[n][0] for n in per_request)
    written = sum(per_request[n] * extra[n][1] for n in per_request)
    built = ", ".join(f"{per_request[n]:.3f} {n}" for n in per_request)
    print(
        f"\nper simulated request ({args.requests:,} requests, cost_model, baseline=1,eagle=1): "
        f"{built} built; the guard adds {guard:.0f} ns as built (as is - plain, times the builds), "
        f"{written:.0f} ns with the constructors as written (written - plain)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
