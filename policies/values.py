"""The values a policy sees and returns (`policies.base` re-exports every name here: import them
from there). A leaf module: it imports nothing of ours.

Apart from `base` so that it can be compiled: `simulator.native` builds this module, the routing
core, the view builder, `cost_model` and the engine's hot modules with mypyc for the simulator,
and a module holding `runtime_checkable` protocols (`Policy`, `Resettable`) cannot be compiled.
The rules of these values (built once, never assigned again; `BackendLoad` and `Decision` refuse
an assignment) are in `policies.base`.
"""

from __future__ import annotations
import __future__

import ast
import functools
import linecache
import textwrap
import types
from collections.abc import Callable, Mapping
from dataclasses import FrozenInstanceError, dataclass, field, fields
from typing import Any, Literal, cast

Pool = Literal["baseline", "eagle"]
POOLS: tuple[Pool, Pool] = ("baseline", "eagle")
EndpointKind = Literal["chat", "completions", "generate"]
"""The OpenAI routes, and SGLang's native `/generate`."""


def other_pool(pool: Pool) -> Pool:
    return "eagle" if pool == "baseline" else "baseline"


def parse_pool(value: str) -> Pool:
    """Validate a pool name coming from the outside (config, header, CLI)."""
    if value == "baseline":
        return "baseline"
    if value == "eagle":
        return "eagle"
    raise ValueError(f"unknown pool {value!r}: expected 'baseline' or 'eagle'")


@dataclass(frozen=True, slots=True)
class RequestFeatures:
    """Compact, text-free features of what a request asks (built by `policies.features`, the one
    extractor the proxy and the simulator share). Hashes are stable 64-bit ints (blake2b of the
    text, never Python's salted `hash`), so a run reproduces to the bit and replicas agree."""

    family: int = 0
    """Prompt family: hash of the system prompt's first block (or, without a system prompt, of
    the first block of the prompt); 0 when there is no text."""
    grams: tuple[int, ...] = ()
    """Hashed word n-gram ids of a bounded slice of the canonical prompt text (system prompt,
    last user message, tool definitions), sorted, without repeats, at most a few hundred."""
    temperature: float | None = None
    """Sampling temperature as sent (None: the server's default)."""
    top_p: float | None = None
    top_k: int | None = None
    response_format: str | None = None
    """`response_format.type` ("json_object", "json_schema", "text", ...), or None."""
    tools: int = 0
    """Number of tool definitions sent."""
    n: int = 1
    model: int = 0
    """Hash of the `model` field; 0 when absent."""
    traits: int = 0
    """What kind of task the text looks like, as bits (`policies.features.TRAITS`: code fences and
    syntax, math notation, a language other than English, a long document with a short question,
    an instruction to translate, summarize or extract, tool schemas, ...)."""


@dataclass(slots=True)
class RequestInfo:
    """What a policy may know about a request (never its text)."""

    endpoint: EndpointKind = "chat"
    stream: bool = True
    prompt_tokens: int = 0
    """Estimate of the prompt length in tokens."""
    max_tokens: int | None = None
    hint: str | None = None
    """Domain tag from `x-specroute-hint` (e.g. "code", "prose"), bounded by the controller."""
    forced_pool: Pool | None = None
    """Pool forced by the client (`x-specroute-mode`) when the config allows it."""
    features: RequestFeatures | None = None
    """What the request asks, as compact features (None when no extractor ran, e.g. traces
    without text); `hint` above stays the client's own word and is a feature too."""
    client: int = 0
    """A stable hash of who sent the request (its API key or address, as the proxy knows it); 0
    when unknown. A learning policy bounds the share of what one client teaches."""
    sequences: int = 1
    """Sequences the backend runs for it (`n` x prompts): the slots it holds, and how many its
    `completion_tokens` are the sum of."""


HINT_HEADER = "x-specroute-hint"
"""The request header that carries `RequestInfo.hint` (read by the proxy and the emulator)."""


class _Value:
    """What makes `BackendLoad` and `Decision` values: assigning to or deleting a field raises
    `dataclasses.FrozenInstanceError`. Their constructors set each field once, through
    `object.__setattr__` (uncompiled, through `_stores_constructor`)."""

    __slots__ = ()

    def __setattr__(self, name: str, value: object) -> None:
        raise FrozenInstanceError(_refused(self, name))

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(_refused(self, name))

    def __reduce__(self) -> tuple[type[_Value], tuple[object, ...]]:
        # copy and pickle rebuild it through the constructor (their default sets each slot: refused)
        return type(self), tuple(getattr(self, f.name) for f in fields(cast(Any, self)) if f.init)


def _refused(value: object, name: str) -> str:
    kind = type(value).__name__
    return (
        f"{kind} is a value: its field {name!r} cannot be assigned or deleted "
        "(make a new one: dataclasses.replace)"
    )


def load_of(in_flight: int, running: int | None, queued: int | None) -> int:
    """A backend's load (`BackendLoad.load`): the larger of this replica's in-flight count and
    the backend-reported running + queued (`running` None: no fresh sample, in flight alone)."""
    if running is None:
        return in_flight
    scraped = running + queued if queued else running
    return scraped if scraped > in_flight else in_flight


@dataclass(slots=True, init=False)
class BackendLoad(_Value):
    """Load of one backend as seen at decision time (built by `policies.view`, for the proxy and
    the simulator alike).

    `load` and `admits` are derived from the other fields by the constructor (the one place
    each rule is written) and stored, not computed per read: the routing core and the policies
    read them several times per decision, and a plain field costs a fifth of a property's read.
    `dataclasses.replace` rebuilds them from the new fields. A value: assigning to a field raises
    `dataclasses.FrozenInstanceError` (`policies.base`)."""

    name: str
    pool: Pool
    usable: bool
    """May get requests health-wise: its health probes pass and the outlier detector has not
    ejected it (or the proxy is in panic mode: every backend). Whether it takes a request now
    is `admits`."""
    in_flight: int
    """Sequences this proxy replica has in flight on the backend (exact; a request counts its
    `RequestInfo.sequences`)."""
    in_flight_tokens: int
    """Output-token budget of those requests (max_tokens times each one's sequences)."""
    running: int | None
    """Backend-reported running requests, already combined with the requests this replica
    dispatched/finished since the sample; None when there is no fresh sample."""
    queued: int | None
    """Backend-reported waiting requests (same combination); None without a fresh sample."""
    accept_length: float | None
    sample_age_s: float | None
    cached_tokens: int
    """Tokens of THIS request's prompt the router believes the backend holds in its prefix cache
    (the longest prefix of the request's block fingerprint in the backend's prefix index, in
    tokens); 0 when unknown or when prefix tracking is off. Set per decision."""
    full: bool
    """At its admission bound (its own or its pool's in-flight bound): it takes no request now."""
    max_running: int | None = None
    """The running-request cap the backend reports (SGLang's `/server_info`, `/v1/loads`; vLLM's
    learned full batch): beyond it requests wait in its queue. None: not reported, the profile's
    `max_running_requests` applies (always so in the simulator, whose servers run the profile)."""
    load: int = field(init=False, compare=False)
    """The larger of the local in-flight count and the backend-reported load (running + queued,
    when there is a fresh sample)."""
    admits: bool = field(init=False, compare=False)
    """Whether this backend may take a request now: usable and not full. The routing core and
    the policies route only to backends that admit."""

    def __init__(
        self,
        name: str,
        pool: Pool,
        usable: bool = True,
        in_flight: int = 0,
        in_flight_tokens: int = 0,
        running: int | None = None,
        queued: int | None = None,
        accept_length: float | None = None,
        sample_age_s: float | None = None,
        cached_tokens: int = 0,
        full: bool = False,
        max_running: int | None = None,
    ) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "pool", pool)
        object.__setattr__(self, "usable", usable)
        object.__setattr__(self, "in_flight", in_flight)
        object.__setattr__(self, "in_flight_tokens", in_flight_tokens)
        object.__setattr__(self, "running", running)
        object.__setattr__(self, "queued", queued)
        object.__setattr__(self, "accept_length", accept_length)
        object.__setattr__(self, "sample_age_s", sample_age_s)
        object.__setattr__(self, "cached_tokens", cached_tokens)
        object.__setattr__(self, "full", full)
        object.__setattr__(self, "max_running", max_running)
        object.__setattr__(self, "load", load_of(in_flight, running, queued))
        object.__setattr__(self, "admits", usable and not full)

    @property
    def scraped(self) -> int | None:
        """Backend-reported running + queued, or None without a fresh sample."""
        if self.running is None:
            return None
        return self.running + (self.queued or 0)


@dataclass(slots=True)
class PoolLoad:
    pool: Pool
    backends: tuple[BackendLoad, ...] = ()

    @property
    def admitting(self) -> tuple[BackendLoad, ...]:
        """Backends that may take a request now (`BackendLoad.admits`)."""
        return tuple(b for b in self.backends if b.admits)

    @property
    def in_flight(self) -> int:
        return sum(b.in_flight for b in self.backends)

    @property
    def load(self) -> int:
        return sum(b.load for b in self.backends)


@dataclass(slots=True)
class LoadView:
    """Per pool and per backend load at one instant."""

    baseline: PoolLoad = field(default_factory=lambda: PoolLoad("baseline"))
    eagle: PoolLoad = field(default_factory=lambda: PoolLoad("eagle"))

    def pool(self, pool: Pool) -> PoolLoad:
        return self.baseline if pool == "baseline" else self.eagle

    def admits(self, pool: Pool) -> bool:
        """Whether some backend of `pool` may take a request now."""
        return any(b.admits for b in self.pool(pool).backends)


@dataclass(slots=True, init=False)
class Decision(_Value):
    """What a policy decided. `reason` is a short, bounded string (a metric label).

    A policy picks the pool; it may leave `backend` empty ("") and the routing core
    (`policies.routing.Router`) returns a completed copy with the backend within the pool and
    its `backend_load` (moved to the other pool, reason `<pool>_unavailable`, when its pool has
    no backend that admits). A policy that names an admitting backend of its pool keeps it.
    A value: assigning to a field raises `dataclasses.FrozenInstanceError` (`policies.base`)."""

    pool: Pool
    backend: str
    reason: str
    predicted_ttft_s: Mapping[Pool, float] = field(default_factory=dict)
    predicted_e2e_s: Mapping[Pool, float] = field(default_factory=dict)
    backend_load: int = 0
    """Load of the chosen backend at decision time, before this request joined it."""
    policy: str = ""
    accept_factor: float | None = None
    """The eagle speed factor the policy used for this request (1 = the profile's eagle speed),
    when it predicted one from the request's content; None otherwise."""

    def __init__(
        self,
        pool: Pool,
        backend: str,
        reason: str,
        predicted_ttft_s: Mapping[Pool, float] | None = None,
        predicted_e2e_s: Mapping[Pool, float] | None = None,
        backend_load: int = 0,
        policy: str = "",
        accept_factor: float | None = None,
    ) -> None:
        # written out (not the dataclass's generated __init__): mypyc compiles this one
        # (`simulator.native`); None for a mapping is an empty one
        object.__setattr__(self, "pool", pool)
        object.__setattr__(self, "backend", backend)
        object.__setattr__(self, "reason", reason)
        object.__setattr__(self, "predicted_ttft_s", {} if predicted_ttft_s is None else predicted_ttft_s)
        object.__setattr__(self, "predicted_e2e_s", {} if predicted_e2e_s is None else predicted_e2e_s)
        object.__setattr__(self, "backend_load", backend_load)
        object.__setattr__(self, "policy", policy)
        object.__setattr__(self, "accept_factor", accept_factor)


def _stores_constructor(cls: type[_Value]) -> Callable[..., _Value]:
    """The constructor `cls.__init__` as written, made into a `__new__` of plain stores: it builds
    the value as an instance of an assignable twin of `cls` (a subclass without slots of its own,
    so of the same layout, whose `__setattr__` is object's), runs the same statements with each
    `object.__setattr__(self, "f", v)` a `self.f = v`, then switches the instance's class to `cls`.
    The same value, the same signature and errors; the written `__init__` stays the one source
    (`__wrapped__` holds it).

    Why: mypyc compiles `object.__setattr__` to a plain store (`simulator.native`), but
    interpreted, each is a call costing several plain stores, and the simulator builds these values
    per request. Only this module's uncompiled form installs it (`_install_stores_constructors`);
    `benchmarks/value_build_cost.py` measures both forms."""
    init = vars(cls)["__init__"]
    code = init.__code__
    lines = linecache.getlines(code.co_filename, init.__globals__)
    if not lines:
        raise OSError(f"no source for {cls.__name__}.__init__")
    first = code.co_firstlineno
    last = max(end for _, end, _, _ in code.co_positions() if end is not None)
    tree = ast.parse(textwrap.dedent("".join(lines[first - 1 : last])))
    ast.increment_lineno(tree, first - 1)
    written = tree.body[0]
    if not isinstance(written, ast.FunctionDef) or written.decorator_list:
        raise TypeError(f"{cls.__name__}.__init__ is not a plain function definition")
    made = ast.parse(
        "def __make__(__twin__):\n"
        "    def __new__(cls):\n"
        "        self = __twin__()\n"
        "        self.__class__ = cls\n"
        "        return self\n"
        "    return __new__\n"
    )
    for node in ast.walk(made):  # the scaffold's lines are the written `def` line (tracebacks)
        if "lineno" in node._attributes:
            ast.copy_location(node, written)
    maker = made.body[0]
    assert isinstance(maker, ast.FunctionDef)
    new = maker.body[0]
    assert isinstance(new, ast.FunctionDef)
    new.args = written.args
    new.args.args[0] = ast.copy_location(ast.arg("cls"), written.args.args[0])
    new.body[1:1] = [_StoresOnly(cls.__name__).visit(statement) for statement in written.body]
    ast.fix_missing_locations(made)
    namespace: dict[str, Any] = {}
    flags = __future__.annotations.compiler_flag
    exec(compile(made, code.co_filename, "exec", flags=flags, dont_inherit=True), init.__globals__, namespace)
    twin = type(cls.__name__, (cls,), {
        "__slots__": (),
        "__new__": object.__new__,
        "__init__": object.__init__,
        "__setattr__": object.__setattr__,
        "__delattr__": object.__delattr__,
    })  # fmt: skip
    built = namespace["__make__"](twin)
    built.__qualname__ = f"{cls.__qualname__}.__new__"
    return cast(Callable[..., _Value], functools.update_wrapper(built, init, assigned=("__doc__",)))


class _StoresOnly(ast.NodeTransformer):
    """`object.__setattr__(self, "f", v)` -> `self.f = v`; refuses what a `__new__` cannot run
    as the written `__init__` did (a `return`)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner

    def visit_Expr(self, node: ast.Expr) -> ast.AST:
        call = node.value
        if (
            isinstance(call, ast.Call)
            and ast.unparse(call.func) == "object.__setattr__"
            and len(call.args) == 3
            and not call.keywords
            and isinstance(call.args[0], ast.Name)
            and call.args[0].id == "self"
            and isinstance(call.args[1], ast.Constant)
            and isinstance(call.args[1].value, str)
        ):
            target = ast.Attribute(ast.Name("self", ast.Load()), call.args[1].value, ast.Store())
            return ast.copy_location(ast.Assign([target], call.args[2]), node)
        return self.generic_visit(node)

    def visit_Return(self, node: ast.Return) -> ast.AST:
        raise TypeError(f"{self.owner}.__init__ returns early: its stores constructor would not")


def _install_stores_constructors(*classes: type[_Value]) -> None:
    """Uncompiled, each of `classes` is built by its `_stores_constructor` (its `__init__` is then
    `object.__init__`, which does nothing). Compiled, nothing changes: the constructors as written
    are already plain stores. A module without its source (bytecode alone) keeps them as written."""
    if not isinstance(_install_stores_constructors, types.FunctionType):
        return  # compiled by mypyc
    try:
        built = [(cls, _stores_constructor(cls)) for cls in classes]
    except OSError:
        return
    for cls, new in built:
        type.__setattr__(cls, "__new__", staticmethod(new))
        type.__setattr__(cls, "__init__", object.__init__)


_install_stores_constructors(BackendLoad, Decision)


class NoHealthyBackend(Exception):
    """Raised by the routing core (`policies.routing`) when a request has nowhere to go: neither
    pool has a usable backend, or the pool the client forced has none."""


class InvalidDecision(Exception):
    """A policy returned a decision the routing core cannot act on (an unknown pool or backend)."""


OutcomeStatus = Literal["ok", "error", "timeout", "client_closed", "client_error"]
"""`client_error`: the backend answered 4xx (the client's mistake, not the backend's)."""


@dataclass(slots=True, init=False)
class Outcome:
    """A finished request: the decision plus what actually happened."""

    request: RequestInfo
    decision: Decision
    started_at: float
    """The `now` that was passed to `choose`."""
    ttft_s: float | None
    completion_tokens: int | None
    duration_s: float
    status: OutcomeStatus
    accept_length: float | None = None
    """Tokens per verify step the eagle backend reported for this request (SGLang's
    `spec_tokens_details`, when asked for), or None."""
    cached_tokens: int | None = None
    """Prompt tokens the backend reported it served from its prefix cache
    (`usage.prompt_tokens_details.cached_tokens`, SGLang's `--enable-cache-report`), or None."""
    failed_over: bool = False
    """The request was moved to another backend after `decision` (its first backend failed
    before the first byte): `decision.backend_load` is not the load of the backend that served
    it. Such an outcome does not teach (`policies.routing.teaches`)."""
    client_blocked_s: float = 0.0
    """Seconds the proxy's relay was blocked writing to a client slower than the stream: part of
    `duration_s` that is the client's, not the backend's."""

    def __init__(
        self,
        request: RequestInfo,
        decision: Decision,
        started_at: float,
        ttft_s: float | None,
        completion_tokens: int | None,
        duration_s: float,
        status: OutcomeStatus,
        accept_length: float | None = None,
        cached_tokens: int | None = None,
        failed_over: bool = False,
        client_blocked_s: float = 0.0,
    ) -> None:
        # written out: mypyc compiles this one (the dataclass's generated __init__ it does not)
        self.request = request
        self.decision = decision
        self.started_at = started_at
        self.ttft_s = ttft_s
        self.completion_tokens = completion_tokens
        self.duration_s = duration_s
        self.status = status
        self.accept_length = accept_length
        self.cached_tokens = cached_tokens
        self.failed_over = failed_over
        self.client_blocked_s = client_blocked_s

    @property
    def forced(self) -> bool:
        """The client forced the pool (`x-specroute-mode`): the policy did not choose it."""
        return self.request.forced_pool is not None

    @property
    def decode_tok_s(self) -> float | None:
        """Per-sequence decode rate after the first token, or None when unknown. The time the
        relay was blocked on the client (`client_blocked_s`) is not the backend's."""
        if self.status != "ok" or self.ttft_s is None or self.completion_tokens is None:
            return None
        sequences = self.request.sequences
        tokens = self.completion_tokens / sequences if sequences > 1 else self.completion_tokens
        if tokens < 2:
            return None
        decode_time = self.duration_s - self.ttft_s - self.client_blocked_s
        if decode_time <= 0:
            return None
        return (tokens - 1) / decode_time
