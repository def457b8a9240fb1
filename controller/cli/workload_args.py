"""Command-line pieces shared by `specroute simulate`, `tune` and `plan`: the workload flags and
the values they become."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from controller.cli.args import non_negative_float, non_negative_int, positive_float, positive_int
from policies.ladder import Ladder
from policies.profile import Profile, ProfileError
from policies.spec import PolicyError
from simulator.engine.deployment import (
    DEFAULT_LADDER,
    DeploymentError,
    parse_adaptive,
)
from simulator.engine.loop import SimulationError
from simulator.engine.report import ReportError
from simulator.engine.traces import TRACE_FORMATS, TraceError, describe_skipped, skipped_records
from simulator.engine.workloads import (
    DEFAULT_LEVELS,
    WORKLOAD_KINDS,
    AcceptModel,
    LengthSpec,
    WorkloadError,
    WorkloadSpec,
)
from simulator.planning.tuner import TuneError

SIMULATION_ERRORS = (
    ProfileError,
    PolicyError,
    WorkloadError,
    TraceError,
    DeploymentError,
    TuneError,
    ReportError,
    SimulationError,
)
"""What a simulating command reports as `specroute COMMAND: error: ...` (exit 2), not a traceback."""

REQUESTS_PER_LEVEL = 30
"""Measured requests per sweep level when not given (plan: at least this)."""
WARMUP_REQUESTS = 5
"""Unmeasured requests at the start of each sweep level when not given (plan: at least this)."""
STEADY_MEASURE_PER_CLIENT = 10
"""A sweep level in its steady state measures at least this many requests per client ..."""
STEADY_WARMUP_PER_CLIENT = 1
"""... after a warm-up of at least this many per client (`tune`, `simulate --oracle`)."""


def add_workload_args(
    p: argparse.ArgumentParser,
    *,
    title: str = "workload",
    steady_level_defaults: bool = False,
    steady_per_client: str | None = None,
) -> None:
    """The workload flags. With `steady_level_defaults` (plan), --requests-per-level and
    --warmup-requests default to None: `workload_from_args` then sizes them to the highest
    concurrency planned. With `steady_per_client` (simulate, tune) they default to None too, and
    the text says when the per-client steady-state sizing applies (see `workload_from_args`)."""
    w = p.add_argument_group(title)
    w.add_argument(
        "--workload",
        choices=WORKLOAD_KINDS,
        default="sweep",
        help="Closed-loop concurrency sweep, open-loop Poisson or bursty arrivals, a trace replay, or "
        "multi-turn conversations sharing a system prompt (multiturn), or real prompts from a file "
        "(prompts: --prompts FILE) (default sweep).",
    )
    w.add_argument(
        "--concurrency",
        type=positive_int,
        nargs="+",
        action="extend",
        metavar="N",
        help=f"Sweep levels (default {' '.join(map(str, DEFAULT_LEVELS))}).",
    )
    if steady_level_defaults:
        w.add_argument(
            "--requests-per-level",
            type=positive_int,
            help="Measured requests per sweep level (default: the highest concurrency planned, at least "
            f"{REQUESTS_PER_LEVEL}, so every level is measured in a steady state).",
        )
        w.add_argument(
            "--warmup-requests",
            type=non_negative_int,
            help="Unmeasured requests per sweep level (default: the highest concurrency planned, at least "
            f"{WARMUP_REQUESTS}).",
        )
    elif steady_per_client is not None:
        steady = (
            f"{STEADY_MEASURE_PER_CLIENT} per client, at least {REQUESTS_PER_LEVEL}",
            f"{STEADY_WARMUP_PER_CLIENT} per client, at least {WARMUP_REQUESTS}",
        )
        if steady_per_client != "always":
            steady = (
                f"{REQUESTS_PER_LEVEL}; {steady_per_client}: {steady[0]}",
                f"{WARMUP_REQUESTS}; {steady_per_client}: {steady[1]}",
            )
        w.add_argument(
            "--requests-per-level",
            type=positive_int,
            help=f"Measured requests per sweep level (default {steady[0]}: each level measured in its "
            "steady state).",
        )
        w.add_argument(
            "--warmup-requests",
            type=non_negative_int,
            help=f"Unmeasured requests at the start of each level (default {steady[1]}).",
        )
    else:
        w.add_argument(
            "--requests-per-level",
            type=positive_int,
            default=REQUESTS_PER_LEVEL,
            help="Measured requests per sweep level (at least one per client is always measured).",
        )
        w.add_argument(
            "--warmup-requests",
            type=non_negative_int,
            default=WARMUP_REQUESTS,
            help="Unmeasured requests at the start of each level.",
        )
    w.add_argument(
        "--rate",
        type=positive_float,
        default=10.0,
        help="Mean arrival rate (poisson, bursty, multiturn), requests/s.",
    )
    w.add_argument(
        "--requests",
        type=positive_int,
        default=None,
        help="Requests (poisson/bursty/multiturn/prompts: default 1000; trace: the first N, default all).",
    )
    w.add_argument(
        "--burst-factor", type=positive_float, default=4.0, help="Bursty: high-state rate / low-state rate."
    )
    w.add_argument(
        "--burst-period", type=positive_float, default=10.0, help="Bursty: mean seconds in each state."
    )
    w.add_argument(
        "--trace",
        help="Trace file (Azure LLM inference CSV, Mooncake JSONL with hash_ids, or specroute decision log "
        "JSONL).",
    )
    w.add_argument(
        "--prompts",
        metavar="FILE",
        help="Prompts workload: JSONL, one request a line with messages or prompt, optional "
        "output_tokens, temperature, hint and accept (the TRUE eagle speed factor, default 1); Poisson at "
        "--rate, --requests cycling through the file in a seeded shuffled order.",
    )
    w.add_argument("--trace-format", choices=TRACE_FORMATS, help="Trace format (default: detected).")
    w.add_argument(
        "--time-scale",
        type=positive_float,
        default=1.0,
        help="Multiply trace timestamps by this (0.5 replays twice as fast).",
    )
    w.add_argument(
        "--output-tokens",
        help="Output lengths: const:N, exp:MEAN, lognormal:MEAN,SIGMA (default const:200 or the trace's).",
    )
    w.add_argument(
        "--prompt-tokens",
        help="Prompt lengths, same forms (default const:256 or the trace's; multiturn: each turn's new user "
        "message).",
    )
    w.add_argument("--turns", help="Multiturn: turns per conversation, same forms (default const:5).")
    w.add_argument(
        "--think-time",
        type=non_negative_float,
        default=20.0,
        help="Multiturn: mean seconds between the arrivals of a conversation's turns (default 20).",
    )
    w.add_argument(
        "--system-prompt-tokens",
        type=non_negative_int,
        default=1024,
        help="Multiturn: tokens of the system prompt every conversation starts with (default 1024).",
    )
    w.add_argument(
        "--hint-mix", metavar="HINT=W,...", help="Synthetic hints with weights, e.g. code=0.3,prose=0.7."
    )
    w.add_argument(
        "--hint-accept",
        metavar="HINT=F,...",
        help="EAGLE speed factor per hint (acceptance), e.g. code=1.2,prose=0.85.",
    )
    w.add_argument(
        "--hints-hidden",
        action="store_true",
        help="The hints set each request's true EAGLE speed factor (--hint-accept, a trace's or "
        "prompt file's hints) but the policy does not see them: clients that do not send "
        "x-specroute-hint.",
    )
    w.add_argument(
        "--accept-sigma",
        type=non_negative_float,
        default=0.0,
        help="Spread (lognormal sigma, mean 1) of each request's EAGLE speed factor.",
    )


def parse_weights(text: str | None, what: str) -> dict[str, float]:
    """`NAME=NUMBER,...` with every number >= 0; empty for None or ""."""
    if not text:
        return {}
    out: dict[str, float] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        try:
            if not sep or not key.strip():
                raise ValueError
            out[key.strip()] = float(value)
        except ValueError:
            raise WorkloadError(f"{what} {item!r}: expected NAME=NUMBER[,NAME=NUMBER...]") from None
        if out[key.strip()] < 0:
            raise WorkloadError(f"{what} {item!r}: must be >= 0")
    return out


def workload_from_args(
    args: argparse.Namespace, *, max_load: float = 1.0, steady: bool | None = None
) -> WorkloadSpec:
    """The workload the flags of `add_workload_args` describe. A --requests-per-level or
    --warmup-requests left at None is, with `steady` None (plan), the highest concurrency times
    `max_load`, at least REQUESTS_PER_LEVEL / WARMUP_REQUESTS: with fewer measured (or warm-up)
    requests than clients, a level measures the first requests after warm-up, which a policy
    keeping one pool nearly empty passes quickly. With `steady` True it is sized per level (10
    measured and 1 warm-up request per client, at least REQUESTS_PER_LEVEL / WARMUP_REQUESTS);
    with `steady` False it is REQUESTS_PER_LEVEL / WARMUP_REQUESTS."""
    levels = tuple(args.concurrency) if args.concurrency else DEFAULT_LEVELS
    top = max(1, round(max(levels) * max_load))
    if args.accept_sigma < 0:
        raise WorkloadError("--accept-sigma must be >= 0")
    hint_accept = parse_weights(args.hint_accept, "--hint-accept")
    if any(v <= 0 for v in hint_accept.values()):
        raise WorkloadError("--hint-accept factors must be > 0")
    per_level = args.requests_per_level
    warmup = args.warmup_requests
    measure_per_client = warmup_per_client = 0
    if steady is not None:
        top = 0  # sized per level (steady) or fixed, not by the highest level
        measure_per_client = STEADY_MEASURE_PER_CLIENT if steady and per_level is None else 0
        warmup_per_client = STEADY_WARMUP_PER_CLIENT if steady and warmup is None else 0
    return WorkloadSpec(
        kind=args.workload,
        levels=levels,
        requests_per_level=per_level if per_level is not None else max(REQUESTS_PER_LEVEL, top),
        warmup=warmup if warmup is not None else max(WARMUP_REQUESTS, top),
        measure_per_client=measure_per_client,
        warmup_per_client=warmup_per_client,
        rate=args.rate,
        requests=args.requests,
        burst_factor=args.burst_factor,
        burst_period_s=args.burst_period,
        trace=args.trace,
        trace_format=args.trace_format,
        time_scale=args.time_scale,
        output_tokens=LengthSpec.parse(args.output_tokens) if args.output_tokens else None,
        prompt_tokens=LengthSpec.parse(args.prompt_tokens) if args.prompt_tokens else None,
        hint_mix=parse_weights(args.hint_mix, "--hint-mix"),
        accept=AcceptModel(args.accept_sigma, hint_accept),
        hints_seen=not args.hints_hidden,
        turns=LengthSpec.parse(args.turns) if args.turns else None,
        think_time_s=args.think_time,
        system_prompt_tokens=args.system_prompt_tokens,
        prompts=args.prompts,
    )


def transient_warning(spec: WorkloadSpec) -> str | None:
    """A warning when a sweep measures a transient: some level measures fewer than 10 requests
    per client, or warms up with fewer than 1 per client (then its mean e2e is off against
    Little's law and its throughput is not the level's steady state); None otherwise."""
    if spec.kind != "sweep":
        return None
    short = []
    for c in spec.levels:
        measure, warmup = spec.level_sizes(c)
        if measure < STEADY_MEASURE_PER_CLIENT * c or warmup < STEADY_WARMUP_PER_CLIENT * c:
            short.append(c)
    if not short:
        return None
    worst = max(short)
    return (
        f"concurrency {', '.join(map(str, short))}: fewer than {STEADY_MEASURE_PER_CLIENT} measured requests "
        f"or {STEADY_WARMUP_PER_CLIENT} warm-up request per client: those levels measure a transient, not a "
        f"steady state; leave --requests-per-level and --warmup-requests unset, or give at least "
        f"{STEADY_MEASURE_PER_CLIENT * worst} and {STEADY_WARMUP_PER_CLIENT * worst}"
    )


SWAMP_FACTOR = 1.25
"""Offered output tokens per second above this many times the served ones: the load swamps."""
SWAMP_TTFT_FACTOR = 10.0
"""... or a mean TTFT above this many times the profile's slowest (a full batch, no queue)."""


def offered_tok_s(segments: Sequence[Any]) -> float | None:
    """Output tokens per second the arrivals of an open-loop workload ask for; None for sweeps."""
    if len(segments) != 1 or segments[0].batch.arrivals is None:
        return None
    batch = segments[0].batch
    span = max(batch.arrivals) - min(batch.arrivals) if len(batch) > 1 else 0.0
    return sum(batch.output_tokens) / span if span > 0 else None


def full_batch_ttft_s(profile: Profile) -> float:
    """The largest TTFT among the profile's points: what a full batch costs without a queue."""
    return max((p.ttft_s for m in profile.modes.values() for p in m.points), default=0.0)


def swamp_warning(
    offered: float | None, label: str, summary: Mapping[str, Any], full_batch_ttft: float
) -> str | None:
    """A warning when an open-loop run's load swamps its deployment: its servers delivered output
    tokens markedly slower than the arrivals asked for them (`SWAMP_FACTOR`), or its mean TTFT is
    over `SWAMP_TTFT_FACTOR` times a full batch's (a load just above capacity builds its queue
    slowly). Requests then pile up in the servers' queues and the figures measure a backlog that
    grows with the run's length, not a steady state. `label` names the run (policy and
    deployment), `summary` holds its `throughput_tok_s`, `mean_ttft_s` and `p99_ttft_s` (one run's,
    or a mean over seeds). None for closed-loop sweeps (`offered` None: their load is bounded)."""
    served = summary.get("throughput_tok_s")
    ttft = summary.get("mean_ttft_s")
    if offered is None or not isinstance(served, int | float) or not served > 0:
        return None
    short = offered > SWAMP_FACTOR * served
    queued = (
        isinstance(ttft, int | float) and full_batch_ttft > 0 and ttft > SWAMP_TTFT_FACTOR * full_batch_ttft
    )
    if not (short or queued):
        return None
    p99 = summary.get("p99_ttft_s")
    return (
        f"{label}: the offered load swamps the deployment -- arrivals ask for "
        f"{offered:.0f} output tok/s, the servers delivered {served:.0f}; mean TTFT "
        f"{_num(ttft)} s (a full batch without a queue: {full_batch_ttft:.2f} s), p99 {_num(p99)} s. "
        "Requests queue, so these figures measure a backlog that grows with the run, not a steady state: "
        "lower the rate (--rate, --time-scale) or add servers (--deployment)"
    )


def _num(v: Any) -> str:
    return f"{v:.1f}" if isinstance(v, int | float) else "nan"


def deployment_text(deployment: Mapping[str, int] | Sequence[tuple[str, int]]) -> str:
    """`baseline=1,eagle=1`."""
    items = deployment.items() if isinstance(deployment, Mapping) else deployment
    return ",".join(f"{k}={v}" for k, v in items)


def describe_workload(spec: WorkloadSpec, sweep: str) -> str:
    """`workload: WHAT; output tokens LENGTHS` for a command's header line; `sweep` is what a sweep
    is called (each command words its levels)."""
    if spec.kind == "sweep":
        what = sweep
    elif spec.kind == "trace":
        what = f"trace {spec.trace} (time scale {spec.time_scale:g})"
        skipped = skip_note(spec)
        if skipped is not None:
            what += f"; {skipped}"
    elif spec.kind == "multiturn":
        turns = spec.turns or "const:5"
        what = (
            f"multiturn, rate {spec.rate:g}/s, turns {turns}, think time {spec.think_time_s:g} s, "
            f"system prompt {spec.system_prompt_tokens} tokens"
        )
    elif spec.kind == "prompts":
        what = f"prompts {spec.prompts}, rate {spec.rate:g}/s"
    else:
        what = f"{spec.kind}, rate {spec.rate:g}/s"
    if spec.output_tokens:
        out = str(spec.output_tokens)
    else:
        out = "trace" if spec.kind == "trace" else "const:200"
    return f"workload: {what}; output tokens {out}"


def uniform_accept_note(spec: WorkloadSpec, segments: Sequence[Any]) -> str | None:
    """For a prompts workload whose requests all have the same true EAGLE speed factor (no line
    has an `accept`, no --accept-sigma or --hint-accept spread): why policies that differ only in
    content awareness print equal rows. None otherwise."""
    if spec.kind != "prompts":
        return None
    factors = {f for seg in segments for f in seg.batch.accept}
    if len(factors) > 1:
        return None
    return (
        f"every request of {spec.prompts} has the same EAGLE speed factor ({next(iter(factors), 1.0):g}: no "
        "line has an `accept` field, and no --accept-sigma or --hint-accept spreads it), so EAGLE-3 is as "
        "fast for every prompt and content-aware routing has nothing to tell apart: policies that differ "
        "only in content awareness give equal rows, but for what content-aware cost_model spends on "
        "exploring (explore_budget; 0 turns it off). Give the lines `accept` factors (your drafter's "
        "measured acceptance per task, over its mean) to compare them."
    )


def skip_note(spec: WorkloadSpec) -> str | None:
    """How many records of a decision-log trace were left out as not completed, or None."""
    if spec.kind != "trace" or spec.trace is None:
        return None
    return describe_skipped(skipped_records(spec.trace, spec.trace_format))


def add_ladder_arg(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """--adaptive-ladder (simulate, plan)."""
    parser.add_argument(
        "--adaptive-ladder",
        metavar="LADDER",
        help="Adaptive servers' draft depth by batch size: sglang (SGLang's default ladder, the default), "
        "MIN_BATCH:STEPS[/STEPS...],... (e.g. 1:1/3/5/7,8:0/1/3,32:0/1,64:0; several steps: SGLang's "
        "controller picks among them), a vLLM schedule [[lo,hi,k],...], or a JSON file with SGLang's "
        "--speculative-adaptive-config or a vLLM schedule.",
    )


def ladder_from_args(args: argparse.Namespace) -> Ladder:
    """--adaptive-ladder, or SGLang's default ladder."""
    return parse_adaptive(args.adaptive_ladder) if args.adaptive_ladder else DEFAULT_LADDER


def profile_ref(arg: str) -> str:
    """A --profile as written into a config: a file's absolute path, or the built-in name."""
    p = Path(arg)
    return str(p.resolve()) if p.is_file() else arg
