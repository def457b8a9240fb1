"""Workloads: what requests arrive when, with which lengths.

Every workload is generated up front from its own seeded RNG, before any policy runs, so all
policies compared on a workload see exactly the same requests (lengths, hints and acceptance
factors are properties of the request). A workload expands into one or more `Segment`s, each
simulated from an empty deployment: one per concurrency level for `sweep`, one otherwise.

- `sweep`: per level `c`, a closed loop of `c` clients run exactly as `specroute bench` runs
  a level: requests started before `warmup` requests have completed are warm-up, the next
  `requests_per_level` are measured, and clients keep sending fillers until every measured
  request has finished, so each measured request runs with `c` in flight. With
  `measure_per_client` / `warmup_per_client`, a level measures at least that many requests per
  client (and warms up with at least that many), so every level reaches its steady state.
- `poisson`: open loop, exponential inter-arrival times at `rate`.
- `bursty`: a two-state Markov-modulated Poisson process with mean rate `rate`: the high state
  is `burst_factor` times the low state's rate, each state lasts an exponential time with mean
  `burst_period_s`.
- `trace`: a trace file (see `simulator.engine.traces`), timestamps multiplied by `time_scale`
  (0.5 replays twice as fast). Lengths come from the trace unless given explicitly; a Mooncake
  trace's block ids come along (prefix caching), unless the prompt lengths are overridden.
- `multiturn`: conversations (see `multiturn`): sessions start as a Poisson process, all share
  one system prompt, and every turn resends the whole context so far (system prompt, earlier
  user messages and answers) plus a new user message, `think_time_s` (exponential mean) after
  the previous turn arrived. Prompts carry 512-token block ids, so prefix caches see the reuse.
- `prompts`: real request bodies from a JSONL file (`simulator.engine.prompts`), Poisson at
  `rate`; each request carries its content features (`policies.features`, as the proxy
  extracts them) and its TRUE eagle speed factor (`accept`, which the policy never sees).

Length specs: `const:N`, `exp:MEAN`, `lognormal:MEAN,SIGMA` (MEAN is the distribution's mean);
draws are rounded to integers >= 1.

`max_tokens` of a synthetic request is its drawn output length, as benchmark clients send it
(with `ignore_eos`); a trace gives its own.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Literal

from simulator.engine.loop import RequestBatch
from simulator.engine.prompts import PromptsError, read_prompts
from simulator.engine.traces import MOONCAKE_BLOCK_TOKENS, TraceFormat, read_trace

WorkloadKind = Literal["sweep", "poisson", "bursty", "trace", "multiturn", "prompts"]
WORKLOAD_KINDS: tuple[WorkloadKind, ...] = ("sweep", "poisson", "bursty", "trace", "multiturn", "prompts")
DEFAULT_LEVELS: tuple[int, ...] = (1, 2, 5, 10, 30, 70, 100, 250)


class WorkloadError(ValueError):
    """A workload description that cannot be used."""


@dataclass(frozen=True)
class LengthSpec:
    kind: Literal["const", "exp", "lognormal"]
    mean: float
    sigma: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LengthSpec:
        kind, sep, args = text.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            nums = [float(x) for x in args.split(",")]
        except ValueError:
            raise WorkloadError(
                f"length spec {text!r}: expected const:N, exp:MEAN or lognormal:MEAN,SIGMA"
            ) from None
        if kind == "const" and len(nums) == 1 and nums[0] >= 1:
            return cls("const", nums[0])
        if kind == "exp" and len(nums) == 1 and nums[0] > 0:
            return cls("exp", nums[0])
        if kind == "lognormal" and len(nums) == 2 and nums[0] > 0 and nums[1] >= 0:
            return cls("lognormal", nums[0], nums[1])
        raise WorkloadError(
            f"length spec {text!r}: expected const:N (N >= 1), exp:MEAN (MEAN > 0) "
            "or lognormal:MEAN,SIGMA (MEAN > 0, SIGMA >= 0)"
        )

    def __str__(self) -> str:
        if self.kind == "const":
            return f"const:{self.mean:g}"
        if self.kind == "exp":
            return f"exp:{self.mean:g}"
        return f"lognormal:{self.mean:g},{self.sigma:g}"

    def draw(self, rng: random.Random, n: int) -> list[int]:
        if self.kind == "const":
            v = max(1, round(self.mean))
            return [v] * n
        if self.kind == "exp":
            lam = 1.0 / self.mean
            return [max(1, round(rng.expovariate(lam))) for _ in range(n)]
        mu = math.log(self.mean) - self.sigma**2 / 2
        return [max(1, round(rng.lognormvariate(mu, self.sigma))) for _ in range(n)]


@dataclass(frozen=True)
class AcceptModel:
    """Per-request acceptance factor on speculative servers (mean 1 = the profile's speed).

    factor = hint_factor[hint] (1 when absent) x a lognormal draw with mean 1 and `sigma`.
    """

    sigma: float = 0.0
    hint_factor: Mapping[str, float] = field(default_factory=dict)

    def draw(self, rng: random.Random, hints: list[str | None]) -> list[float]:
        if self.sigma <= 0:  # no draws: each request's factor is its hint's
            factors = self.hint_factor
            return [factors.get(h, 1.0) if h is not None else 1.0 for h in hints]
        out: list[float] = []
        mu = -(self.sigma**2) / 2
        for h in hints:
            f = self.hint_factor.get(h, 1.0) if h is not None else 1.0
            if self.sigma > 0:
                f *= rng.lognormvariate(mu, self.sigma)
            out.append(f)
        return out


@dataclass(frozen=True)
class WorkloadSpec:
    kind: WorkloadKind = "sweep"
    levels: tuple[int, ...] = DEFAULT_LEVELS
    requests_per_level: int = 30
    warmup: int = 5
    measure_per_client: int = 0
    """Sweep: a level of `c` clients measures at least `measure_per_client * c` requests."""
    warmup_per_client: int = 0
    """Sweep: a level of `c` clients warms up with at least `warmup_per_client * c` requests."""
    rate: float = 10.0
    requests: int | None = None
    """Open-loop request count (None: 1000 for poisson/bursty, the whole trace)."""
    burst_factor: float = 4.0
    burst_period_s: float = 10.0
    trace: str | None = None
    trace_format: TraceFormat | None = None
    time_scale: float = 1.0
    output_tokens: LengthSpec | None = None
    """None: `const:200`, or the trace's lengths."""
    prompt_tokens: LengthSpec | None = None
    """None: `const:256`, or the trace's lengths."""
    hint_mix: Mapping[str, float] = field(default_factory=dict)
    """Synthetic workloads: hint tag -> weight (empty: no hints)."""
    accept: AcceptModel = field(default_factory=AcceptModel)
    hints_seen: bool = True
    """False: the hints set each request's true acceptance (`accept`) but the policy does not
    see them (`RequestBatch.hints_seen`)."""
    turns: LengthSpec | None = None
    """Multiturn: turns per session (None: const:5)."""
    think_time_s: float = 20.0
    """Multiturn: mean seconds between the arrivals of a session's turns (exponential)."""
    system_prompt_tokens: int = 1024
    """Multiturn: tokens of the system prompt every session starts with."""
    prompts: str | None = None
    """Prompts: the JSONL file of requests (see `simulator.engine.prompts`)."""

    def level_sizes(self, concurrency: int) -> tuple[int, int]:
        """(measured, warm-up) requests of the sweep level with `concurrency` clients."""
        return (
            max(self.requests_per_level, self.measure_per_client * concurrency),
            max(self.warmup, self.warmup_per_client * concurrency),
        )

    def __post_init__(self) -> None:
        if self.kind not in WORKLOAD_KINDS:
            raise WorkloadError(f"unknown workload {self.kind!r}; known: {', '.join(WORKLOAD_KINDS)}")
        if not self.levels or any(c < 1 for c in self.levels):
            raise WorkloadError("concurrency levels must be integers >= 1")
        if self.requests_per_level < 1 or self.warmup < 0:
            raise WorkloadError("requests per level must be >= 1 and warm-up >= 0")
        if self.measure_per_client < 0 or self.warmup_per_client < 0:
            raise WorkloadError("requests per client must be >= 0")
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise WorkloadError("rate must be a positive number of requests per second")
        if self.requests is not None and self.requests < 1:
            raise WorkloadError("requests must be >= 1")
        if self.burst_factor < 1 or self.burst_period_s <= 0:
            raise WorkloadError("burst factor must be >= 1 and burst period > 0")
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise WorkloadError("time scale must be > 0")
        if self.kind == "trace" and not self.trace:
            raise WorkloadError("the trace workload needs --trace FILE")
        if self.kind == "prompts" and not self.prompts:
            raise WorkloadError("the prompts workload needs --prompts FILE")
        if not (self.think_time_s >= 0 and math.isfinite(self.think_time_s)):
            raise WorkloadError("think time must be >= 0 seconds")
        if self.system_prompt_tokens < 0:
            raise WorkloadError("system prompt tokens must be >= 0")
        if any(w < 0 for w in self.hint_mix.values()) or (self.hint_mix and sum(self.hint_mix.values()) <= 0):
            raise WorkloadError("hint weights must be >= 0 and not all zero")


@dataclass(frozen=True)
class Segment:
    """Requests simulated together from an empty deployment."""

    batch: RequestBatch
    concurrency: int | None = None
    """Closed-loop clients (sweep), None for open loop (every request measured)."""
    warmup: int = 0
    measure: int | None = None


def _hints(spec: WorkloadSpec, rng: random.Random, n: int) -> list[str | None]:
    if not spec.hint_mix:
        return [None] * n
    tags = sorted(spec.hint_mix)
    weights = [spec.hint_mix[t] for t in tags]
    return list(rng.choices(tags, weights=weights, k=n))


def _synthetic(spec: WorkloadSpec, rng: random.Random, n: int, arrivals: list[float] | None) -> RequestBatch:
    out = (spec.output_tokens or LengthSpec("const", 200)).draw(rng, n)
    prompt = (spec.prompt_tokens or LengthSpec("const", 256)).draw(rng, n)
    hints = _hints(spec, rng, n)
    accept = spec.accept.draw(rng, hints)
    return RequestBatch(prompt, out, list[int | None](out), hints, accept, arrivals)


def _poisson_arrivals(rng: random.Random, rate: float, n: int) -> list[float]:
    # `rng.expovariate(rate)` inlined (a million calls cost a third of a second): the same
    # operations on the same draw, -log(1 - random()) / rate, as CPython's random.py
    t = 0.0
    out = [0.0] * n
    draw, log = rng.random, math.log
    for i in range(n):
        t += -log(1.0 - draw()) / rate
        out[i] = t
    return out


def _bursty_arrivals(rng: random.Random, spec: WorkloadSpec, n: int) -> list[float]:
    low = 2.0 * spec.rate / (1.0 + spec.burst_factor)
    rates = (low, low * spec.burst_factor)
    switch = 1.0 / spec.burst_period_s
    state = 0
    t = 0.0
    state_end = rng.expovariate(switch)
    out: list[float] = []
    while len(out) < n:
        nxt = t + rng.expovariate(rates[state])
        if nxt < state_end:
            t = nxt
            out.append(t)
        else:
            # Memoryless: restart the inter-arrival draw at the switch.
            t = state_end
            state = 1 - state
            state_end = t + rng.expovariate(switch)
    return out


def _trace(spec: WorkloadSpec, rng: random.Random) -> RequestBatch:
    assert spec.trace is not None
    records = read_trace(spec.trace, spec.trace_format, limit=None)
    if spec.requests is not None:
        records = records[: spec.requests]
    n = len(records)
    arrivals = [r.t * spec.time_scale for r in records]
    drawn_out = (spec.output_tokens or LengthSpec("const", 200)).draw(rng, n)
    drawn_prompt = (spec.prompt_tokens or LengthSpec("const", 256)).draw(rng, n)
    out: list[int] = []
    max_tokens: list[int | None] = []
    prompt: list[int] = []
    for i, r in enumerate(records):
        if spec.output_tokens is not None or r.output_tokens is None:
            out.append(drawn_out[i])
            max_tokens.append(drawn_out[i])
        else:
            out.append(r.output_tokens)
            max_tokens.append(r.max_tokens)
        prompt.append(drawn_prompt[i] if spec.prompt_tokens is not None else r.prompt_tokens)
    hints = [r.hint for r in records]
    if spec.hint_mix and all(h is None for h in hints):
        hints = _hints(spec, rng, n)
    accept = spec.accept.draw(rng, hints)
    blocks: list[tuple[int, ...]] | None = None
    if spec.prompt_tokens is None and records and all(r.blocks is not None for r in records):
        blocks = [r.blocks or () for r in records]
    return RequestBatch(prompt, out, max_tokens, hints, accept, arrivals, blocks, MOONCAKE_BLOCK_TOKENS)


def multiturn(spec: WorkloadSpec, rng: random.Random, n: int) -> RequestBatch:
    """`n` turns of conversations, by arrival (see the module note).

    A session's context after turn k is the system prompt, then each turn's user message and
    answer; turn k's prompt is the context before it plus its user message. Block j of a prompt
    (tokens 512j..512j+511) gets an id naming its content: the system prompt's whole blocks are
    shared by every session, a session's later whole blocks are its own and stay the same on
    later turns (the context only grows), and a partial last block is new each time (its content
    changes), as block hashes of real prompts behave."""
    bt = MOONCAKE_BLOCK_TOKENS
    session_rate = spec.rate / max((spec.turns or LengthSpec("const", 5)).mean, 1.0)
    user_spec = spec.prompt_tokens or LengthSpec("const", 256)
    out_spec = spec.output_tokens or LengthSpec("const", 200)
    turn_spec = spec.turns or LengthSpec("const", 5)
    system = spec.system_prompt_tokens
    ids: dict[tuple[int, int, int], int] = {}

    def block_id(owner: int, j: int, end: int) -> int:
        # owner -1: the system prompt; a whole block is named by (owner, j), a partial one by its end
        return ids.setdefault((owner, j, end), len(ids))

    turns: list[tuple[float, int, int, int, tuple[int, ...]]] = []
    start = 0.0
    session = 0
    cutoff = math.inf  # once n turns exist: the n-th arrival; later sessions cannot add earlier turns
    while True:
        start += rng.expovariate(session_rate)
        if start > cutoff:
            break
        count = turn_spec.draw(rng, 1)[0]
        t, context = start, system
        for k in range(count):
            prompt = context + user_spec.draw(rng, 1)[0]
            answer = out_spec.draw(rng, 1)[0]
            blocks = []
            for j in range(-(-prompt // bt)):
                end = min((j + 1) * bt, prompt)
                whole = end - j * bt == bt
                if whole and end <= system:
                    blocks.append(block_id(-1, j, 0))
                else:
                    blocks.append(block_id(session, j, 0 if whole else end))
            turns.append((t, session, prompt, answer, tuple(blocks)))
            context = prompt + answer
            if k + 1 < count:
                t += rng.expovariate(1.0 / spec.think_time_s) if spec.think_time_s > 0 else 0.0
        session += 1
        if cutoff == math.inf and len(turns) >= n:
            cutoff = sorted(x[0] for x in turns)[n - 1]
    turns.sort(key=lambda x: (x[0], x[1]))
    turns = turns[:n]
    prompt_tokens = [x[2] for x in turns]
    output = [x[3] for x in turns]
    hints = _hints(spec, rng, n)
    accept = spec.accept.draw(rng, hints)
    return RequestBatch(
        prompt_tokens,
        output,
        list[int | None](output),
        hints,
        accept,
        [x[0] for x in turns],
        [x[4] for x in turns],
        bt,
    )


def _prompts(spec: WorkloadSpec, rng: random.Random, n: int) -> RequestBatch:
    """`n` requests cycling through the file in a seeded shuffled order, Poisson at `rate`."""
    assert spec.prompts is not None
    try:
        lines = read_prompts(spec.prompts)
    except PromptsError as e:
        raise WorkloadError(str(e)) from None
    order = list(range(len(lines)))
    rng.shuffle(order)
    picked = [lines[order[i % len(order)]] for i in range(n)]
    drawn = (spec.output_tokens or LengthSpec("const", 200)).draw(rng, n)
    out = [p.output_tokens if p.output_tokens is not None else d for p, d in zip(picked, drawn, strict=True)]
    hints = [p.hint for p in picked]
    noise = spec.accept.draw(rng, hints)
    accept = [p.accept * f for p, f in zip(picked, noise, strict=True)]
    arrivals = _poisson_arrivals(rng, spec.rate, n)
    return RequestBatch(
        [p.prompt_tokens for p in picked],
        out,
        list[int | None](out),
        hints,
        accept,
        arrivals,
        features=[p.features for p in picked],
    )


def generate(spec: WorkloadSpec, seed: int) -> list[Segment]:
    """The workload's segments; the same spec and seed always give the same requests."""
    if spec.kind == "sweep":
        segments = []
        for level, c in enumerate(spec.levels):
            rng = random.Random(f"{seed}/sweep/{level}/{c}")
            measure, warmup = spec.level_sizes(c)
            # Enough requests for every phase: warm-up starts (< c + warmup), the measured
            # ones, and fillers (a generous bound; a level that ran out would just drain).
            n = 2 * c + warmup + measure + 4 * (c + measure)
            batch = _synthetic(spec, rng, n, None)
            segments.append(Segment(_seen(spec, batch), c, warmup, measure))
        return segments
    rng = random.Random(f"{seed}/{spec.kind}")
    n = spec.requests if spec.requests is not None else 1000
    if spec.kind == "poisson":
        batch = _synthetic(spec, rng, n, _poisson_arrivals(rng, spec.rate, n))
    elif spec.kind == "bursty":
        batch = _synthetic(spec, rng, n, _bursty_arrivals(rng, spec, n))
    elif spec.kind == "multiturn":
        batch = multiturn(spec, rng, n)
    elif spec.kind == "prompts":
        batch = _prompts(spec, rng, n)
    else:
        batch = _trace(spec, rng)
    return [Segment(_seen(spec, batch))]


def _seen(spec: WorkloadSpec, batch: RequestBatch) -> RequestBatch:
    return batch if spec.hints_seen else replace(batch, hints_seen=False)
