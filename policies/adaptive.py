"""The speed of an EAGLE-3 server that adapts its draft depth to the batch size (its ladder:
`policies.ladder`), derived from a profile's plain and EAGLE-3 modes.

What the profile measures, per batch size b: the plain server's per-request decode rate r_p(b)
(one token per step, so a step lasts T_0(b) = 1 / r_p(b)) and the EAGLE-3 server's r_e(b), at
one draft depth K with a mean accept length L_K (tokens per verify step, bonus included), so its
verify step lasts T_K(b) = L_K / r_e(b).

What is assumed (the profile does not measure it):

1. Chain drafting (topk 1) with a per-token acceptance alpha that does not depend on the depth:
   L(k) = 1 + alpha + ... + alpha^k, alpha solved from L(K) = L_K.
2. A verify step's cost over a plain step grows linearly with the depth (k draft passes, k more
   tokens verified per request): T_k(b) = T_0(b) + (k / K) (T_K(b) - T_0(b)). Exact at k = 0 (the
   plain server) and k = K (the EAGLE-3 server); deeper than K it is extrapolated.
3. TTFT likewise, between the two modes' TTFTs; prefill at the EAGLE-3 mode's rate at every depth
   (the draft model prefills each prompt so that it can draft later).
4. Where a bucket cycles between depths (`Ladder.settle`), each is held for the same number of steps.
5. K is the eagle mode's `speculative_num_steps`, else 3 (SGLang's usual EAGLE-3 setting: 3 steps,
   topk 1, 4 draft tokens); alpha comes from its `accept_length`, else is 0.7 (L_3 = 2.53).
   `DepthModel.assumed` names what was taken.

So the per-request rate at b is r(b) = L(k) / T_k(b) at the depth k the ladder settles at: the
plain server's rate exactly where the ladder says 0 steps (the floor an adaptive server falls back
to under load), the EAGLE-3 server's where it says K. `adaptive_mode` writes that curve as profile
points, one per batch size with its depth in `spec_steps`, so every policy predicts an adaptive
server as it predicts any mode (`adaptive_profile`); `AdaptiveSpeed` answers per depth for the
emulator, which runs the ladder's controller step by step.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from policies.ladder import Ladder
from policies.profile import TABLE_SIZE, ModeProfile, Profile, ProfileError, ProfilePoint, SpeedModel

DEFAULT_PROFILE_STEPS = 3
"""Draft depth assumed for a profile's eagle mode that does not give `speculative_num_steps`."""
DEFAULT_ALPHA = 0.7
"""Per-token draft acceptance assumed for an eagle mode without `accept_length`."""


def chain_accept_length(alpha: float, steps: int) -> float:
    """Mean tokens per verify step (bonus included) with `steps` chained drafts."""
    return sum(alpha**i for i in range(steps + 1))


def alpha_for(accept_length: float, steps: int) -> float:
    """The per-token acceptance whose chain of `steps` drafts accepts `accept_length` tokens per
    verify step on average (clamped to [0, 1))."""
    if steps <= 0 or accept_length <= 1.0:
        return 0.0
    if accept_length >= steps + 1:
        return 1.0 - 1e-9
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if chain_accept_length(mid, steps) < accept_length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass(frozen=True)
class DepthModel:
    """What the eagle mode's points were measured at: the depth K and the acceptance alpha."""

    steps: int
    alpha: float
    assumed: tuple[str, ...] = ()
    """Which of the two were assumed (`speculative_num_steps`, `accept_length`)."""

    @classmethod
    def of(cls, eagle: ModeProfile) -> DepthModel:
        assumed = []
        steps = eagle.speculative_num_steps
        if steps is None:
            steps = DEFAULT_PROFILE_STEPS
            assumed.append(f"speculative_num_steps {DEFAULT_PROFILE_STEPS}")
        if eagle.accept_length is None:
            alpha = DEFAULT_ALPHA
            assumed.append(f"accept_length {chain_accept_length(DEFAULT_ALPHA, steps):.2f}")
        else:
            alpha = alpha_for(eagle.accept_length, steps)
        return cls(steps, alpha, tuple(assumed))

    def accept_length(self, k: int) -> float:
        return chain_accept_length(self.alpha, k)


class AdaptiveSpeed:
    """Step times, tokens per step and TTFT of an adaptive server at any batch size and depth."""

    def __init__(self, baseline: SpeedModel, eagle: SpeedModel, depth: DepthModel) -> None:
        self.baseline = baseline
        self.eagle = eagle
        self.depth = depth
        self._lengths = [depth.accept_length(k) for k in range(17)]

    def accept_length(self, k: int) -> float:
        return self._lengths[k] if k < len(self._lengths) else self.depth.accept_length(k)

    def step_s(self, batch: int, k: int) -> float:
        """Seconds of one decode step at depth `k` (k = 0: a plain step) with `batch` running."""
        plain = self.baseline.step_time(batch)
        if k <= 0:
            return plain
        full = self.accept_length(self.depth.steps) * self.eagle.step_time(batch)
        return max(plain + k / self.depth.steps * (full - plain), plain * 1e-3)

    def ttft_s(self, batch: int, k: int) -> float:
        plain = self.baseline.ttft_s(batch)
        if k <= 0:
            return plain
        return max(plain + k / self.depth.steps * (self.eagle.ttft_s(batch) - plain), 0.0)

    def decode_tok_s(self, batch: int, depths: Sequence[int]) -> float:
        """Per-request decode rate at `batch` over a cycle of `depths` (one step each)."""
        tokens = sum(self.accept_length(k) for k in depths)
        return tokens / sum(self.step_s(batch, k) for k in depths)


def adaptive_mode(
    baseline: ModeProfile,
    eagle: ModeProfile,
    ladder: Ladder,
    *,
    max_running_requests: int | None = None,
) -> ModeProfile:
    """The eagle mode of a server that follows `ladder`: a point per batch size up to beyond
    every bucket and every measured point (the last segment continues from there, as it does
    for both modes), its depth in `spec_steps`. Its running-request cap is
    `max_running_requests`, else the eagle mode's."""
    depth = DepthModel.of(eagle)
    speed = AdaptiveSpeed(SpeedModel(baseline), SpeedModel(eagle), depth)
    marks = [p.concurrency for p in (*baseline.points, *eagle.points)]
    marks += [b.min_batch for b in ladder.buckets] + list(ladder.graph_sizes or ())
    top = min(math.ceil(max(marks)) + 2, TABLE_SIZE - 1)
    points = []
    for b in range(1, top + 1):
        depths = ladder.depths_at(b, depth.alpha)
        ttft = sum(speed.ttft_s(b, k) for k in depths) / len(depths)
        points.append(
            ProfilePoint(
                concurrency=b,
                decode_tok_s=speed.decode_tok_s(b, depths),
                ttft_s=ttft,
                spec_steps=sum(depths) / len(depths),
            )
        )
    cap = max_running_requests if max_running_requests is not None else eagle.max_running_requests
    return eagle.model_copy(
        update={
            "points": points,
            "max_running_requests": cap,
            "together": None,
            "speculative_num_steps": depth.steps,
        }
    )


def adaptive_profile(profile: Profile, ladder: Ladder, *, max_running_requests: int | None = None) -> Profile:
    """`profile` with its eagle mode replaced by `adaptive_mode` (ProfileError without both modes)."""
    mode = adaptive_mode(
        profile.mode("baseline"), profile.mode("eagle"), ladder, max_running_requests=max_running_requests
    )
    name = f"{profile.name} (eagle adapting: {ladder.describe()})"
    return profile.model_copy(update={"modes": {**profile.modes, "eagle": mode}, "name": name})


def check_adaptable(profile: Profile) -> None:
    """ProfileError unless the profile has both modes an adaptive server is derived from."""
    missing = [m for m in ("baseline", "eagle") if m not in profile.modes]
    if missing:
        raise ProfileError(
            f"profile {profile.name!r} has no {' or '.join(missing)} mode: an adaptive EAGLE-3 server's "
            "speed is derived from both"
        )
