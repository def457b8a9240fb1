"""Adaptive speculation ladders: the draft depth an engine runs at each batch size.

Two engines adapt their EAGLE draft depth to the batch size in-engine:

- SGLang `--speculative-adaptive` (EAGLE/EAGLE3, topk 1; `--speculative-adaptive-config FILE`):
  batch-size buckets, each with candidate step counts; a bucket serves the batches from its
  key up to the next key (batches below the first key use the first bucket), after padding the
  batch to the next captured CUDA-graph size when graphs are on. Within a bucket an EMA
  controller picks the depth from the drafts accepted: every `update_interval` batches after
  `warmup_batches` it steps down while the EMA of accepted drafts per request is at most
  `prev - 0.5 + down_hysteresis` (`0.5 + down_hysteresis` towards 0 steps), else up while it is
  above `current - 0.5 + up_hysteresis`; at 0 steps it probes the next candidate. Default
  (`SGLANG_DEFAULT`): batch >= 1 -> {1, 3, 5, 7}, >= 8 -> {0, 1, 3}, >= 32 -> {0, 1},
  >= 64 -> {0}.
- vLLM `num_speculative_tokens_per_batch_size`: inclusive batch ranges `(lo, hi, k)`, the first
  from 1; k may be 0 (no drafting); a gap carries the previous range's k, as does every batch
  beyond the last range; k is capped at `num_speculative_tokens`.

A `Ladder` holds either as buckets (a vLLM range is a bucket with one candidate). `settle`
gives the depths a bucket runs at in a steady state, for a per-token draft acceptance `alpha`:
the EMA is taken as converged to its mean at each depth (`accepted_drafts`), the controller's
rule (`next_steps`, which the emulator runs step by step) is applied until a state repeats, and
the depths of that cycle are returned (each held for the same number of batches: the controller
decides every `update_interval` batches). With
SGLang's default ladder and an EAGLE-3 drafter (alpha ~0.6-0.8) it settles at 3 steps below
batch 32, 1 step from 32 and 0 from 64. Parsing: `parse_ladder` (the settings' and the CLI's
text), `from_sglang_config`, `from_vllm_schedule`, and what each engine reports about itself
(`from_sglang_server_info`, `from_vllm_server_info`). What a depth costs and gives is
`policies.adaptive`.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

Engine = Literal["sglang", "vllm"]
MAX_STEPS = 16
"""Largest draft depth accepted in a ladder (SGLang's and vLLM's practical range is 0-10)."""


class LadderError(ValueError):
    """A ladder that cannot be used; the message says which part."""


@dataclass(frozen=True)
class Bucket:
    """The batches from `min_batch` up to the next bucket's, and the depths the engine picks from."""

    min_batch: int
    steps: tuple[int, ...]
    """Candidate draft depths, ascending (one: a fixed depth)."""
    up_hysteresis: float = 0.0
    down_hysteresis: float = -0.25
    ema_alpha: float = 0.2
    update_interval: int = 5
    warmup_batches: int = 10


@dataclass(frozen=True)
class Ladder:
    """An engine's draft depth by batch size (see the module note)."""

    buckets: tuple[Bucket, ...]
    engine: Engine = "sglang"
    initial_steps: int | None = None
    """SGLang's `--speculative-num-steps`: each bucket starts there when it is one of its
    candidates, else at its middle candidate. None: the middle of all candidates (SGLang's default)."""
    graph_sizes: tuple[int, ...] | None = None
    """SGLang's captured CUDA-graph batch sizes, ascending (a batch is padded up to the next one
    before its bucket is looked up); None: no padding (graphs off or not reported)."""
    origin: str = ""
    """Where it came from, for messages ("SGLang's default", a file, a server's /server_info)."""
    _keys: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.buckets:
            raise LadderError("a ladder needs at least one bucket")
        keys = tuple(b.min_batch for b in self.buckets)
        if any(k < 1 for k in keys) or list(keys) != sorted(set(keys)):
            raise LadderError(f"bucket batch sizes must be >= 1 and increasing, got {list(keys)}")
        for b in self.buckets:
            if not b.steps or list(b.steps) != sorted(set(b.steps)) or not 0 <= b.steps[0]:
                raise LadderError(f"bucket {b.min_batch}: steps must be distinct, >= 0: {list(b.steps)}")
            if b.steps[-1] > MAX_STEPS:
                raise LadderError(f"bucket {b.min_batch}: at most {MAX_STEPS} steps, got {b.steps[-1]}")
        object.__setattr__(self, "_keys", keys)

    def bucket_at(self, batch: int) -> Bucket:
        """The bucket serving a batch of `batch` requests."""
        sizes = self.graph_sizes
        if sizes:
            i = bisect.bisect_left(sizes, batch)
            if i < len(sizes):
                batch = sizes[i]
        i = bisect.bisect_right(self._keys, batch) - 1
        return self.buckets[max(i, 0)]

    @property
    def candidates(self) -> tuple[int, ...]:
        """Every depth some bucket may run, ascending."""
        return tuple(sorted({s for b in self.buckets for s in b.steps}))

    @property
    def initial(self) -> int:
        """SGLang's `--speculative-num-steps` for this ladder: `initial_steps`, else the middle of
        every bucket's candidates (what SGLang picks when it is not given)."""
        if self.initial_steps is not None:
            return self.initial_steps
        every = self.candidates
        return every[len(every) // 2]

    def start_steps(self, bucket: Bucket) -> int:
        """The depth a bucket starts at (SGLang's rule)."""
        initial = self.initial
        return initial if initial in bucket.steps else bucket.steps[len(bucket.steps) // 2]

    def off_from(self) -> int | None:
        """The smallest batch from which the ladder never drafts (every later bucket: 0 steps
        only), before graph padding; None when it drafts at every batch size."""
        off = None
        for b in reversed(self.buckets):
            if b.steps != (0,):
                break
            off = b.min_batch
        return off

    def settle(self, bucket: Bucket, alpha: float) -> tuple[int, ...]:
        """The depths `bucket` cycles through in a steady state (see the module note); one
        depth when it settles."""
        if len(bucket.steps) == 1:
            return bucket.steps
        s = self.start_steps(bucket)
        ema = s - 1.0
        seen: dict[tuple[int, float], int] = {}
        trail: list[int] = []
        while True:
            if s > 0:
                ema = accepted_drafts(alpha, s)
            state = (s, round(ema, 9))
            if state in seen:
                return tuple(trail[seen[state] :])
            seen[state] = len(trail)
            trail.append(s)
            s, ema = next_steps(bucket, s, ema)

    def depths_at(self, batch: int, alpha: float) -> tuple[int, ...]:
        """The depths run at `batch` in a steady state (`settle` of its bucket)."""
        return self.settle(self.bucket_at(batch), alpha)

    def describe(self) -> str:
        """The compact form `parse_ladder` reads: `1:1/3/5/7,8:0/1/3,32:0/1,64:0`."""
        return ",".join(f"{b.min_batch}:{'/'.join(map(str, b.steps))}" for b in self.buckets)

    def vllm_schedule(self, alpha: float, max_batch: int) -> list[list[int]]:
        """vLLM's `num_speculative_tokens_per_batch_size` for the depths this ladder settles at
        (the deepest of a cycle), merged where neighbours agree; the last range ends at `max_batch`."""
        out: list[list[int]] = []
        settled: dict[int, int] = {}
        for b in range(1, max(max_batch, 1) + 1):
            bucket = self.bucket_at(b)
            k = settled.get(bucket.min_batch)
            if k is None:
                k = settled[bucket.min_batch] = max(self.settle(bucket, alpha))
            if out and out[-1][2] == k:
                out[-1][1] = b
            else:
                out.append([b, b, k])
        return out

    def same_depths(self, other: Ladder) -> bool:
        """Whether both choose depths alike (origin aside)."""
        return (self.buckets, self.engine, self.initial_steps, self.graph_sizes) == (
            other.buckets,
            other.engine,
            other.initial_steps,
            other.graph_sizes,
        )


def next_steps(bucket: Bucket, steps: int, ema: float) -> tuple[int, float]:
    """SGLang's EMA controller deciding once: (the depth to run next, the EMA it keeps) from the
    current depth and the EMA of accepted drafts per request (see the module note)."""
    candidates = bucket.steps
    i = candidates.index(steps)
    if steps == 0:  # nothing was drafted: probe the next candidate, its EMA from neutral when unknown
        i = min(i + 1, len(candidates) - 1)
        if candidates[i] > 0 and ema < 0:
            ema = candidates[i] - 1.0
        return candidates[i], ema
    start = i
    while i > 0:
        prev = candidates[i - 1]
        if ema <= (0.5 if prev == 0 else prev - 0.5) + bucket.down_hysteresis:
            i -= 1
        else:
            break
    if i == start:
        while i < len(candidates) - 1 and ema > candidates[i] - 0.5 + bucket.up_hysteresis:
            i += 1
    return candidates[i], ema


def accepted_drafts(alpha: float, steps: int) -> float:
    """Mean drafts accepted per verify step with `steps` chained drafts, each accepted with
    probability `alpha` until the first rejection (bonus token excluded)."""
    return sum(alpha**i for i in range(1, steps + 1))


def _sglang_buckets(entries: Mapping[int, Mapping[str, Any]], knobs: Mapping[str, Any]) -> tuple[Bucket, ...]:
    out = []
    for key in sorted(entries):
        cfg = {**knobs, **entries[key]}
        steps = cfg.get("candidate_steps")
        if not isinstance(steps, list) or not steps or not all(isinstance(s, int) and s >= 0 for s in steps):
            raise LadderError(f"bucket {key}: candidate_steps must be non-empty ints >= 0: {steps!r}")

        def number(name: str, default: float, cfg: Mapping[str, Any] = cfg, key: int = key) -> float:
            value = cfg.get(name, default)
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                raise LadderError(f"bucket {key}: {name} must be a number, got {value!r}")
            return float(value)

        interval, warmup = number("update_interval", 5), number("warmup_batches", 10)
        ema_alpha = number("ema_alpha", 0.2)
        if interval < 1 or warmup < 0 or not 0 < ema_alpha <= 1:
            raise LadderError(f"bucket {key}: update_interval >= 1, warmup_batches >= 0, 0 < ema_alpha <= 1")
        out.append(
            Bucket(
                key,
                tuple(sorted(set(steps))),
                up_hysteresis=number("up_hysteresis", 0.0),
                down_hysteresis=number("down_hysteresis", -0.25),
                ema_alpha=ema_alpha,
                update_interval=int(interval),
                warmup_batches=int(warmup),
            )
        )
    return tuple(out)


def from_sglang_config(data: Any, origin: str = "SGLang adaptive config") -> Ladder:
    """An SGLang `--speculative-adaptive-config` object: integer-string keys (bucket batch sizes)
    with `candidate_steps` and optional knobs; other keys are knobs for every bucket."""
    if not isinstance(data, dict):
        raise LadderError(f"{origin}: expected a JSON object, got {type(data).__name__}")
    strategy = data.get("strategy", "ema")
    if strategy != "ema":
        raise LadderError(
            f"{origin}: strategy {strategy!r} is not modelled (only SGLang's EMA controller): "
            "give the depths per batch size in the compact form instead"
        )
    entries: dict[int, Mapping[str, Any]] = {}
    for key, entry in data.items():
        if not isinstance(key, str) or not key.isdigit():
            continue
        if not isinstance(entry, dict):
            raise LadderError(f"{origin}: bucket {key} must be an object with candidate_steps")
        entries[int(key)] = entry
    if not entries:
        example = '{"1": {"candidate_steps": [1, 3]}}'
        raise LadderError(f"{origin}: no bucket (integer-string keys such as {example})")
    knobs = {k: v for k, v in data.items() if not (isinstance(k, str) and k.isdigit())}
    try:
        return Ladder(_sglang_buckets(entries, knobs), "sglang", origin=origin)
    except LadderError as e:
        raise LadderError(f"{origin}: {e}") from None


def from_vllm_schedule(data: Any, max_steps: int | None = None, origin: str = "vLLM schedule") -> Ladder:
    """vLLM's `num_speculative_tokens_per_batch_size`: `[[lo, hi, k], ...]` (see the module note);
    `max_steps` is its `num_speculative_tokens` (k is capped at it)."""
    if not isinstance(data, list) or not data:
        raise LadderError(f"{origin}: expected a non-empty list of [lo, hi, k] entries")
    ranges = []
    for entry in data:
        if not isinstance(entry, list | tuple) or len(entry) != 3:
            raise LadderError(
                f"{origin}: entry {entry!r}: expected [lo, hi, k] (context-dependent 5-item "
                "schedules are not modelled)"
            )
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in entry):
            raise LadderError(f"{origin}: entry {entry!r}: lo, hi and k must be integers")
        lo, hi, k = entry
        if lo < 1 or hi < lo or k < 0:
            raise LadderError(f"{origin}: entry {entry!r}: need 1 <= lo <= hi and k >= 0")
        ranges.append((lo, hi, k))
    ranges.sort()
    end = 0
    for lo, hi, _ in ranges:
        if lo <= end:
            raise LadderError(f"{origin}: batch-size ranges overlap")
        end = hi
    if ranges[0][0] != 1:
        raise LadderError(f"{origin}: the first range must start at batch 1")
    cap = MAX_STEPS if max_steps is None else max_steps
    buckets = tuple(Bucket(lo, (min(k, cap),)) for lo, _, k in ranges)
    try:
        return Ladder(buckets, "vllm", origin=origin)
    except LadderError as e:
        raise LadderError(f"{origin}: {e}") from None


SGLANG_DEFAULT = from_sglang_config(
    {
        "1": {"candidate_steps": [1, 3, 5, 7], "down_hysteresis": -0.25},
        "8": {"candidate_steps": [0, 1, 3], "down_hysteresis": 0.0},
        "32": {"candidate_steps": [0, 1], "down_hysteresis": 0.0},
        "64": {"candidate_steps": [0], "down_hysteresis": 0.0},
    },
    origin="SGLang's default ladder",
)
"""SGLang's built-in `--speculative-adaptive` ladder (no `--speculative-adaptive-config`)."""


def _compact(text: str) -> Ladder:
    """`MIN:STEPS[/STEPS...],...`, e.g. `1:1/3/5/7,8:0/1/3,32:0/1,64:0` (SGLang's default)."""
    buckets = []
    for part in text.split(","):
        key, sep, steps = part.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            buckets.append(Bucket(int(key), tuple(sorted({int(s) for s in steps.split("/")}))))
        except ValueError:
            raise LadderError(
                f"ladder {text!r}: bucket {part.strip()!r}: expected MIN_BATCH:STEPS[/STEPS...] "
                "(e.g. 1:1/3/5/7,8:0/1/3,32:0/1,64:0)"
            ) from None
    try:
        return Ladder(tuple(buckets), "sglang", origin=f"ladder {text}")
    except LadderError as e:
        raise LadderError(f"ladder {text!r}: {e}") from None


def parse_ladder(spec: str | Sequence[Any]) -> Ladder | None:
    """A ladder as settings and command lines give it; None for `off`.

    - `sglang` (or `default`): SGLang's default ladder;
    - `off` (or `none`): no in-engine adaptation;
    - `MIN:STEPS[/STEPS...],...`: buckets and their candidate depths (one depth: fixed);
    - a JSON list `[[lo, hi, k], ...]`, or such a list itself: a vLLM schedule;
    - a JSON object, or a path to a JSON file holding one of the above: SGLang's
      `--speculative-adaptive-config` (or a vLLM schedule).
    """
    if not isinstance(spec, str):
        return from_vllm_schedule(list(spec))
    text = spec.strip()
    word = text.lower()
    if word in ("sglang", "default"):
        return SGLANG_DEFAULT
    if word in ("off", "none"):
        return None
    if not text:
        raise LadderError("ladder: empty (use sglang, off, MIN:STEPS,... or a JSON file)")
    if text[0] in "[{":
        return _from_json(text, "ladder")
    if ":" in text and not Path(text).is_file():
        return _compact(text)
    path = Path(text)
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        why = e.strerror if isinstance(e, OSError) and e.strerror else "not UTF-8 text"
        raise LadderError(f"ladder file {text}: cannot read: {why}") from None
    return _from_json(raw, f"ladder file {text}")


def _from_json(text: str, origin: str) -> Ladder:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise LadderError(f"{origin}: not valid JSON: {e}") from None
    if isinstance(data, list):
        return from_vllm_schedule(data, origin=origin)
    return from_sglang_config(data, origin=origin)


@dataclass(frozen=True)
class Reported:
    """What a server's own report says about its adaptation: its ladder (None: it does not
    adapt), and a note for the operator when specroute had to assume part of it."""

    ladder: Ladder | None
    note: str | None = None


def _positive_ints(value: Any) -> tuple[int, ...] | None:
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        return None
    return tuple(sorted(set(value)))


def from_sglang_server_info(info: Any) -> Reported | None:
    """SGLang's `/server_info` launch arguments: `speculative_adaptive` (with an EAGLE algorithm),
    `speculative_adaptive_config` (a path on the server: its contents are not reported, so a
    server with one is predicted with the default ladder and a note), `speculative_num_steps`
    (the starting depth) and `cuda_graph_bs` (unless `disable_cuda_graph`). None when the answer
    does not say (no `speculative_adaptive` field: an older SGLang)."""
    if not isinstance(info, dict) or "speculative_adaptive" not in info:
        return None
    eagle = info.get("speculative_algorithm") in ("EAGLE", "EAGLE3")
    if info.get("speculative_adaptive") is not True or not eagle:
        return Reported(None)
    steps = info.get("speculative_num_steps")
    known = isinstance(steps, int) and not isinstance(steps, bool) and 0 <= steps <= MAX_STEPS
    initial = steps if known else None
    graphs = None if info.get("disable_cuda_graph") is True else _positive_ints(info.get("cuda_graph_bs"))
    path = info.get("speculative_adaptive_config")
    note = None
    if isinstance(path, str) and path:
        note = (
            f"it runs --speculative-adaptive-config {path[:200]!r}, whose contents /server_info does "
            "not report: predicted with SGLang's default ladder; set backend_adaptive to its ladder"
        )
    base = SGLANG_DEFAULT
    return Reported(
        Ladder(base.buckets, "sglang", initial, graphs, origin="SGLang's default ladder (/server_info)"),
        note,
    )


def from_vllm_server_info(info: Any) -> Reported | None:
    """vLLM's `/server_info?config_format=json` (served with `VLLM_SERVER_DEV_MODE=1`):
    `vllm_config.speculative_config.num_speculative_tokens_per_batch_size`, capped at its
    `num_speculative_tokens`. None when the answer is not that shape."""
    if not isinstance(info, dict):
        return None
    config = info.get("vllm_config")
    if not isinstance(config, dict):
        return None
    spec = config.get("speculative_config")
    if not isinstance(spec, dict):
        return Reported(None)
    schedule = spec.get("num_speculative_tokens_per_batch_size")
    if schedule is None:
        return Reported(None)
    k = spec.get("num_speculative_tokens")
    cap = k if isinstance(k, int) and not isinstance(k, bool) and k >= 0 else None
    try:
        return Reported(from_vllm_schedule(schedule, cap, origin="vLLM's schedule (/server_info)"))
    except LadderError as e:
        return Reported(None, f"its num_speculative_tokens_per_batch_size is not usable ({e}): not modelled")
