"""Speed profiles (`specroute.profile/v1`) and the queries every policy needs.

How it works: a profile gives, per mode, points (concurrency, per-request decode tok/s,
TTFT). The decode step time `1/decode_tok_s` is interpolated linearly in concurrency between
points, held constant below the first point and continued with the last segment's slope
beyond the last one (decode step time is close to linear in batch size, so two points
describe a server `t(b) = a + c*b` exactly). TTFT is interpolated the same way, never below
the last point's value beyond it. `SpeedModel` precomputes a table for integer batch sizes so
scalar queries on the hot path (proxy, simulator) are a list lookup; numpy versions serve
bulk queries.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, ValidationError, model_validator

from policies.base import Pool

FORMAT = "specroute.profile/v1"
TABLE_SIZE = 4097
"""Batch sizes 0..TABLE_SIZE-1 are looked up in `SpeedModel`'s precomputed tables."""
_TABLE_SIZE = TABLE_SIZE

FloatArray = npt.NDArray[np.float64]


class ProfileError(ValueError):
    """A profile file that cannot be used; the message names the file and the field."""


class ProfilePoint(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    concurrency: float = Field(gt=0, description="Requests running on the server.")
    decode_tok_s: float = Field(gt=0, description="Output tok/s of ONE request after its first token.")
    ttft_s: float = Field(default=0.0, ge=0, description="Time to first token at this concurrency.")
    samples: int | None = Field(default=None, ge=0, description="Requests measured (informational).")
    spec_steps: float | None = Field(
        default=None,
        ge=0,
        description="Draft depth the server runs at this concurrency (an adaptive EAGLE-3 server, "
        "`policies.adaptive`; 0: it does not draft, so a request's acceptance does not change its speed).",
    )


def _sorted_points(points: list[ProfilePoint]) -> list[ProfilePoint]:
    conc = [p.concurrency for p in points]
    if len(set(conc)) != len(conc):
        raise ValueError("points: duplicate concurrency values")
    return points if conc == sorted(conc) else sorted(points, key=lambda p: p.concurrency)


class TogetherProfile(BaseModel):
    """A mode's speed while the other mode's server, co-located on the same cores, is busy too
    (`specroute bench URL --together URL2` measures it; `profile merge --together` adds it)."""

    model_config = ConfigDict(extra="allow", frozen=True, allow_inf_nan=False)

    points: list[ProfilePoint] = Field(
        min_length=1,
        description="Measured with both servers running `concurrency` requests each: this mode's "
        "per-request decode tok/s and TTFT.",
    )
    prefill_tok_s: float | None = Field(
        default=None, gt=0, description="Prefill rate while the other server is busy (optional)."
    )

    @model_validator(mode="after")
    def _sorted_unique(self) -> TogetherProfile:
        object.__setattr__(self, "points", _sorted_points(self.points))
        return self


class ModeProfile(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True, allow_inf_nan=False)

    max_running_requests: int | None = Field(
        default=None, ge=1, description="Requests beyond this wait in the server's queue."
    )
    accept_length: float | None = Field(
        default=None, gt=0, description="Mean accepted tokens per verify step (EAGLE)."
    )
    speculative_num_steps: int | None = Field(
        default=None,
        ge=1,
        le=16,
        description="Draft depth the points were measured at (SGLang --speculative-num-steps, vLLM "
        "num_speculative_tokens; EAGLE). The adaptive-server model's reference depth, 3 when absent.",
    )
    prefill_tok_s: float | None = Field(
        default=None, gt=0, description="Prompt tokens per second of prefill (optional)."
    )
    cache_tokens: int | None = Field(
        default=None,
        ge=0,
        description="Prefix (KV) cache capacity of one server in tokens (optional; None: unknown).",
    )
    categories: dict[str, PositiveFloat] | None = Field(
        default=None,
        description="EAGLE speed factor per prompt category (its accept length over accept_length), as "
        "`specroute bench --prompts FILE` with categories measures it; cost_model's prior for requests "
        "whose x-specroute-hint names the category.",
    )
    points: list[ProfilePoint] = Field(min_length=1)
    together: TogetherProfile | None = Field(
        default=None,
        description="This mode's speed while the other mode's server is busy on the same cores "
        "(co-located servers; optional: without it the servers do not slow each other).",
    )

    @model_validator(mode="after")
    def _sorted_unique(self) -> ModeProfile:
        object.__setattr__(self, "points", _sorted_points(self.points))
        return self


class Profile(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)

    format: Literal["specroute.profile/v1"]
    name: str = ""
    source: str = ""
    modes: dict[Pool, ModeProfile] = Field(min_length=1)

    def mode(self, pool: Pool) -> ModeProfile:
        try:
            return self.modes[pool]
        except KeyError:
            raise ProfileError(
                f"profile {self.name!r} has no {pool!r} mode (has: {', '.join(self.modes)})"
            ) from None

    def speed(self, pool: Pool) -> SpeedModel:
        return SpeedModel(self.mode(pool))

    def belief(self, pool: Pool) -> SpeedModel:
        """The speed a policy predicts `pool` at: the mode's points with the server's throughput
        made concave (`concave_points`), so that a point measured low does not read as a batch
        size where one more request buys almost nothing."""
        mode = self.mode(pool)
        points = concave_points(mode.points)
        return SpeedModel(mode if points is mode.points else mode.model_copy(update={"points": points}))

    def to_json(self) -> str:
        return json.dumps(self.model_dump(mode="json", exclude_none=True), indent=2) + "\n"


def parse_profile(data: Any, origin: str = "<profile>") -> Profile:
    """Validate already-decoded JSON; errors name `origin` and the offending field."""
    try:
        return Profile.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(x) for x in err['loc']) or '<root>'}: {err['msg']}" for err in e.errors()
        )
        raise ProfileError(f"{origin}: invalid profile: {problems}") from None


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ProfileError(f"{p}: cannot read profile: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ProfileError(f"{p}: not valid JSON: {e}") from None
    return parse_profile(data, str(p))


_BUILTIN = Path(__file__).parent / "profiles"


def builtin_profile_names() -> list[str]:
    return sorted(p.stem for p in _BUILTIN.glob("*.json"))


def builtin_profile_path(name: str) -> Path:
    """Path of a profile shipped with specroute (`kimi-k25-int4-8gpu`, ...)."""
    stem = name[:-5] if name.endswith(".json") else name
    path = _BUILTIN / f"{stem}.json"
    if not path.is_file():
        raise ProfileError(f"no built-in profile {name!r} (known: {', '.join(builtin_profile_names())})")
    return path


def resolve_profile(name_or_path: str | Path) -> Profile:
    """Load a profile from a path, or by the name of a built-in one (`kimi-k25-int4-8gpu`)."""
    p = Path(name_or_path)
    if p.is_file() or len(p.parts) > 1:
        return load_profile(p)  # a missing path is reported by its path
    try:
        path = builtin_profile_path(str(name_or_path))
    except ProfileError:
        if not p.suffix:
            raise
        # written as a file name (my-profile.json): the file is what is missing
        raise ProfileError(
            f"{p}: no such profile file (in {Path.cwd()}), nor a built-in profile of that name "
            f"(built-in: {', '.join(builtin_profile_names())})"
        ) from None
    return load_profile(path)


def concave_points(points: list[ProfilePoint]) -> list[ProfilePoint]:
    """`points` (sorted by concurrency) with each decode rate raised, where it must be, onto the
    least concave majorant of the throughput b x decode rate(b) through 0 at b = 0; `points`
    itself when none is below it, and always for an adaptive server's (`spec_steps` given: its
    throughput jumps where it stops drafting).

    A server's throughput grows ever more slowly with its batch (each request added buys at most
    what the one before it did), and so a request's decode rate never rises with the batch. A
    measured point below that shape is noise (a slow moment of a shared machine, a few
    samples), and a policy that compares what one more request costs each pool reads it as a
    batch size where the throughput stalls: one low point made a plain server look full at two
    requests, and a content-aware pair sent slow requests to EAGLE-3 to spare it."""
    if len(points) < 2 or any(p.spec_steps is not None for p in points):
        return points
    hull: list[tuple[float, float]] = [(0.0, 0.0)]
    for p in points:
        x, y = p.concurrency, p.concurrency * p.decode_tok_s
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (y2 - y1) * (x - x1) <= (y - y1) * (x2 - x1):  # the last corner is on or below the chord
                hull.pop()
            else:
                break
        hull.append((x, y))
    out: list[ProfilePoint] = []
    raised, j = False, 1
    for p in points:
        b = p.concurrency
        while hull[j][0] < b:  # (the last point is the hull's last corner)
            j += 1
        (x1, y1), (x2, y2) = hull[j - 1], hull[j]
        rate = (y1 + (y2 - y1) * (b - x1) / (x2 - x1)) / b
        if rate > p.decode_tok_s * (1.0 + 1e-9):
            out.append(p.model_copy(update={"decode_tok_s": rate}))
            raised = True
        else:
            out.append(p)
    return out if raised else points


def _interp_extrap(x: FloatArray, xs: FloatArray, ys: FloatArray) -> FloatArray:
    """Linear interpolation; constant below xs[0]; last slope continued beyond xs[-1]."""
    y = np.interp(x, xs, ys)
    if len(xs) >= 2:
        slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        beyond = x > xs[-1]
        y = np.where(beyond, ys[-1] + slope * (x - xs[-1]), y)
    return y


class SpeedModel:
    """Queries on one mode of a profile. Batch sizes below 1 are treated as 1."""

    def __init__(self, mode: ModeProfile) -> None:
        self.mode = mode
        self.max_running_requests: int | None = mode.max_running_requests
        self.accept_length = mode.accept_length
        self.prefill_tok_s = mode.prefill_tok_s
        self._xs = np.array([p.concurrency for p in mode.points], dtype=np.float64)
        self._step = np.array([1.0 / p.decode_tok_s for p in mode.points], dtype=np.float64)
        self._ttft = np.array([p.ttft_s for p in mode.points], dtype=np.float64)
        grid = np.arange(_TABLE_SIZE, dtype=np.float64)
        step_table = self.step_time_array(grid)
        ttft_table = self.ttft_array(grid)
        self._step_table: list[float] = [float(v) for v in step_table]
        self._ttft_table: list[float] = [float(v) for v in ttft_table]
        self.step_table = self._step_table
        """`step_time(b)` for b in 0..TABLE_SIZE-1 (read-only: hot paths index it directly)."""
        self.ttft_table = self._ttft_table
        """`ttft_s(b)` for b in 0..TABLE_SIZE-1 (read-only)."""
        self._rate_table: list[float] = [1.0 / v for v in self._step_table]
        steps = [p.spec_steps for p in mode.points]
        self.speculating: list[bool] | None = None
        """Whether the server drafts at batch size b, for b in 0..TABLE_SIZE-1, where the points
        give `spec_steps` (an adaptive server); None: a fixed mode (it always does, if it is EAGLE)."""
        if all(s is not None for s in steps):
            depth = np.interp(np.maximum(grid, 1.0), self._xs, np.array(steps, dtype=np.float64))
            self.speculating = [bool(d > 0.0) for d in depth]

    # -- bulk (numpy) -------------------------------------------------------------------

    def step_time_array(self, batch: npt.ArrayLike) -> FloatArray:
        """Seconds per decode step for each batch size (per-request token interval)."""
        b = np.maximum(np.asarray(batch, dtype=np.float64), 1.0)
        t = _interp_extrap(b, self._xs, self._step)
        # A negative last slope extrapolated far enough would reach zero: hold it positive.
        floor = float(self._step.min()) * 1e-3
        out: FloatArray = np.maximum(t, floor)
        return out

    def decode_tok_s_array(self, batch: npt.ArrayLike) -> FloatArray:
        return 1.0 / self.step_time_array(batch)

    def ttft_array(self, batch: npt.ArrayLike) -> FloatArray:
        b = np.maximum(np.asarray(batch, dtype=np.float64), 1.0)
        t = _interp_extrap(b, self._xs, self._ttft)
        return np.maximum(np.where(b > self._xs[-1], np.maximum(t, self._ttft[-1]), t), 0.0)

    # -- scalar (table lookups for integer batch sizes) ---------------------------------

    def step_time(self, batch: int) -> float:
        if 0 <= batch < _TABLE_SIZE:
            return self._step_table[batch]
        return float(self.step_time_array(batch))

    def decode_tok_s(self, batch: int) -> float:
        """Per-request decode rate (tok/s) while `batch` requests are running."""
        if 0 <= batch < _TABLE_SIZE:
            return self._rate_table[batch]
        return 1.0 / float(self.step_time_array(batch))

    def ttft_s(self, batch: int) -> float:
        if 0 <= batch < _TABLE_SIZE:
            return self._ttft_table[batch]
        return float(self.ttft_array(batch))

    def throughput_tok_s(self, batch: int) -> float:
        """Total output tok/s of the server with `batch` requests running."""
        b = max(batch, 1)
        return b * self.decode_tok_s(b)

    def prefill_s(self, prompt_tokens: int) -> float:
        if self.prefill_tok_s is None or prompt_tokens <= 0:
            return 0.0
        return prompt_tokens / self.prefill_tok_s

    def predict_e2e_s(
        self,
        output_tokens: int,
        running: int,
        queued: int = 0,
        *,
        mean_output_tokens: float | None = None,
        prompt_tokens: int = 0,
        rate_scale: float = 1.0,
        speed_scale: float = 1.0,
    ) -> tuple[float, float]:
        """Predicted (TTFT, end-to-end) seconds of a request that joins the server now.

        The request joins `running` decoding and `queued` waiting requests. Below
        `max_running_requests` (the cap) it is admitted at once and decodes in a batch of
        `running + queued + 1`: waiting requests are admitted too, so they count.

        At the cap it waits in FIFO order behind the `running + queued - cap` requests that
        are already waiting. A full server completes requests at
        `cap * decode_tok_s(cap) / mean_output_tokens` per second (their progress is
        staggered, so completions arrive evenly), so the request is admitted after
        `ahead + 1` completions and then decodes in a full batch. `mean_output_tokens` is
        the mean length of the requests ahead; it defaults to `output_tokens`.

        `rate_scale` multiplies this request's own decode rate (e.g. an EAGLE acceptance
        factor for its prompt domain); it does not change the queue wait. `speed_scale`
        multiplies the whole server's speed (every time above is divided by it): a
        calibration of the profile against what the server really does.
        """
        ttft, e2e, _ = self.predict_system_s(
            output_tokens,
            running,
            queued,
            mean_output_tokens=mean_output_tokens,
            prompt_tokens=prompt_tokens,
            rate_scale=rate_scale,
            speed_scale=speed_scale,
        )
        return ttft, e2e

    def predict_system_s(
        self,
        output_tokens: int,
        running: int,
        queued: int = 0,
        mean_output_tokens: float | None = None,
        prompt_tokens: int = 0,
        rate_scale: float = 1.0,
        speed_scale: float = 1.0,
        queue_weight: float = math.inf,
        prefill_s: float | None = None,
        occupancy: float | None = None,
        mean_life_s: float = 0.0,
    ) -> tuple[float, float, float]:
        """(TTFT, end-to-end, marginal cost) seconds of a request that joins the server now.

        TTFT and end-to-end are `predict_e2e_s`'s. The marginal cost is what the request costs
        everyone: the seconds per request at the margin, `1 / (X(b+1) - X(b))`, where
        `X(k) = k / T(k)` is the server's completion rate (requests/s) with `k` requests
        running and `T(k)` the end-to-end time of a request like this one in a batch of `k`.
        It is this request's own time plus the time it adds to the `b` requests it slows
        down (to first order `T(b+1) + b * (T(b+1) - T(b))`), and picking the pool with the
        smaller one maximises the total completion rate.

        With `occupancy` (the mean number of requests on this server: their arrival rate times
        `mean_life_s`, their mean end-to-end time, Little's law; 0: none arrive) it is taken at
        the number of requests expected to share its life `L = T(b+1)`, `k`, instead of `b`
        (fractional: the step table interpolated; at most `cap - 1`): the present leave part way
        through it and the arriving join part way, each living `mean_life_s` and found at a
        uniform point of it, so `k = b + w * (occupancy - b)` with `x = L / mean_life_s` and
        `w = x / 2` (`x <= 1`) or `1 - 1 / (2x)`: a short request shares the present batch, a
        long one the mean occupancy; the steady state (an occupancy of `b`) keeps `b`. With none
        arriving, the present are taken to live `L`: `k = b / 2`. Its first token comes at the
        start, among those present: only its decode steps are taken at `k`. Without an
        occupancy, `b`. TTFT and end-to-end stay those of the requests present.

        Where one more request would lower the rate the cost is infinite. At the cap the request
        waits in the queue and adds nothing to the rate (a queued request produces nothing): its
        cost is its own end-to-end time plus `queue_weight` times its wait -- the wait it passes
        on to the requests that will queue behind it -- which is infinite by default (never
        queue while the other pool has room).

        `prefill_s` replaces `prompt_tokens / prefill_tok_s` (before `speed_scale`): a caller that
        knows part of the prompt is cached passes the prefill of the rest (or, for a profile
        whose TTFTs include a typical prompt's prefill, minus the time the cached part saves).
        """
        n = output_tokens if output_tokens > 1 else 1
        m = n - 1
        cap = self.max_running_requests
        occupied = (running if running > 0 else 0) + (queued if queued > 0 else 0)
        if prefill_s is not None:
            prefill = prefill_s
        else:
            prefill = prompt_tokens / self.prefill_tok_s if prompt_tokens > 0 and self.prefill_tok_s else 0.0
        decode_scale = rate_scale * speed_scale
        if cap is not None and occupied >= cap:
            mean_n = float(n) if mean_output_tokens is None else max(mean_output_tokens, 1.0)
            # (ahead + 1) completions at cap * rate(cap) / mean_n per second
            step = self.step_time(cap)
            wait = (occupied - cap + 1) * mean_n * step / cap
            ttft = (wait + self.ttft_s(cap) + prefill) / speed_scale
            e2e = ttft + m * step / decode_scale
            cost = e2e + queue_weight * wait / speed_scale if queue_weight != math.inf else math.inf
            return ttft, e2e, cost
        b = occupied
        if b + 1 < _TABLE_SIZE:  # step_time / ttft_s inlined (hot path)
            steps, ttfts = self._step_table, self._ttft_table
            t0, t1, f0, f1 = steps[b], steps[b + 1], ttfts[b], ttfts[b + 1]
        else:
            t0, t1, f0, f1 = self.step_time(b), self.step_time(b + 1), self.ttft_s(b), self.ttft_s(b + 1)
        ttft = (f1 + prefill) / speed_scale
        e2e = ttft + m * t1 / decode_scale
        if occupancy is not None:
            x = e2e / mean_life_s if mean_life_s > 0.0 else 1.0
            k = b + (0.5 * x if x <= 1.0 else 1.0 - 0.5 / x) * (occupancy - b)
            if cap is not None and k > cap - 1:
                k = cap - 1.0  # at most a full batch shares its life
            i = int(k)
            if i + 2 < _TABLE_SIZE:  # the step table interpolated at k and k + 1
                steps = self._step_table
                s1 = steps[i + 1]
                t0 = steps[i] + (k - i) * (s1 - steps[i])
                t1 = s1 + (k - i) * (steps[i + 2] - s1)
            else:
                t0, t1 = float(self.step_time_array(k)), float(self.step_time_array(k + 1))
            after = ttft + m * t1 / decode_scale
            before = (f0 + prefill) / speed_scale + m * t0 / decode_scale
            rate_gain = (k + 1) * before - k * after  # (X(k+1) - X(k)) * T(k) * T(k+1)
        else:
            after = e2e
            before = (f0 + prefill) / speed_scale + m * t0 / decode_scale
            rate_gain = (b + 1) * before - b * e2e  # (X(b+1) - X(b)) * T(b) * T(b+1)
        return ttft, e2e, before * after / rate_gain if rate_gain > 0.0 else math.inf
