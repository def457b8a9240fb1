"""Simulated server kinds and deployments.

A server kind turns a speed profile into two per-batch-size tables the engine reads on its hot
path: the per-request decode rate (tok/s while `b` requests are running) and the TTFT.

- `baseline`, `eagle`: the profile's mode of that name, as is.
- `adaptive`: an EAGLE-3 server that picks its draft depth by batch size in-engine (SGLang's
  `--speculative-adaptive`, vLLM's `num_speculative_tokens_per_batch_size`): its ladder
  (`policies.ladder`, SGLang's default unless told) and the speed each depth gives
  (`policies.adaptive`: the plain mode's speed where the ladder says 0 steps, the EAGLE-3 mode's
  at the depth it was measured at, derived between). It takes the plain server's
  `max_running_requests` (launched with it, see `simulator.planning.config`: SGLang would cap a
  speculative server at 48, below the batch sizes where the default ladder stops drafting). For
  routing it counts as part of the `eagle` pool (it speculates); a request's acceptance factor
  applies where the server drafts at the batch size the request starts decoding in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

from policies.adaptive import adaptive_mode
from policies.base import POOLS, Pool
from policies.ladder import SGLANG_DEFAULT, Ladder, LadderError, parse_ladder
from policies.profile import ModeProfile, Profile, ProfileError, ProfilePoint, SpeedModel
from policies.together import together_mode

ServerKind = Literal["baseline", "eagle", "adaptive"]
SERVER_KINDS: tuple[ServerKind, ...] = ("baseline", "eagle", "adaptive")
DEFAULT_LADDER: Ladder = SGLANG_DEFAULT
_TABLE = 4097


class DeploymentError(ValueError):
    """A deployment or ladder spec that cannot be used."""


@dataclass(frozen=True)
class ServerModel:
    """Speed tables of one simulated server (index = running requests)."""

    name: str
    kind: ServerKind
    pool: Pool
    rate: tuple[float, ...]
    """Per-request decode tok/s with `b` running requests, for b in 0.._TABLE-1."""
    ttft: tuple[float, ...]
    max_running_requests: int | None
    prefill_tok_s: float | None
    speculative: bool
    accept_length: float | None = None
    cache_tokens: int | None = None
    """Prefix (KV) cache capacity in tokens; None or 0: no prefix cache modelled."""
    together: ServerModel | None = None
    """This server's tables while its co-located partner is busy (`policies.together`,
    `simulator.engine.colocation`); None: it does not slow down when the other server runs."""
    drafting: tuple[bool, ...] | None = None
    """An adaptive server: whether it drafts with `b` running, for b in 0.._TABLE-1 (the last
    entry beyond); None: always, if it is speculative."""

    def rate_at(self, b: int) -> float:
        """Per-request decode rate at any batch size (step time linear beyond the table)."""
        n = len(self.rate)
        if b < n:
            return self.rate[b]
        last, prev = 1.0 / self.rate[-1], 1.0 / self.rate[-2]
        return 1.0 / max(last + (last - prev) * (b - n + 1), last * 1e-3)

    def ttft_at(self, b: int) -> float:
        return self.ttft[b] if b < len(self.ttft) else self.ttft[-1]


def parse_adaptive(text: str) -> Ladder:
    """An adaptive server's ladder as `--adaptive-ladder` gives it (`policies.ladder.parse_ladder`:
    `sglang`, `MIN:STEPS[/STEPS...],...`, a vLLM schedule or a JSON file); `off` is no ladder."""
    try:
        ladder = parse_ladder(text)
    except LadderError as e:
        raise DeploymentError(f"--adaptive-ladder: {e}") from None
    if ladder is None:
        raise DeploymentError("--adaptive-ladder off: an adaptive server needs a ladder (e.g. sglang)")
    return ladder


def _tables(speed: SpeedModel) -> tuple[list[float], list[float]]:
    return [speed.step_time(b) for b in range(_TABLE)], [speed.ttft_s(b) for b in range(_TABLE)]


def build_server(
    profile: Profile,
    kind: ServerKind,
    name: str,
    ladder: Ladder = DEFAULT_LADDER,
) -> ServerModel:
    if kind in ("baseline", "eagle"):
        pool: Pool = "baseline" if kind == "baseline" else "eagle"
        speed = profile.speed(pool)
        step, ttft = _tables(speed)
        model = ServerModel(
            name=name,
            kind=kind,
            pool=pool,
            rate=tuple(1.0 / s for s in step),
            ttft=tuple(ttft),
            max_running_requests=speed.max_running_requests,
            prefill_tok_s=speed.prefill_tok_s,
            speculative=kind == "eagle",
            accept_length=speed.accept_length,
            cache_tokens=speed.mode.cache_tokens,
        )
        together = together_mode(speed.mode)
        if together is None:
            return model
        t_step, t_ttft = _tables(SpeedModel(together))
        slowed = replace(model, rate=tuple(1.0 / s for s in t_step), ttft=tuple(t_ttft),
                         prefill_tok_s=together.prefill_tok_s)  # fmt: skip
        return replace(model, together=slowed)
    if kind != "adaptive":
        raise DeploymentError(f"unknown server kind {kind!r}; known: {', '.join(SERVER_KINDS)}")
    try:
        base_mode, eagle_mode = profile.mode("baseline"), profile.mode("eagle")
    except ProfileError as e:
        raise DeploymentError(f"an adaptive server needs the baseline and eagle modes: {e}") from None
    mode = adaptive_mode(base_mode, eagle_mode, ladder, max_running_requests=base_mode.max_running_requests)
    speed = SpeedModel(mode)
    step, ttft = _tables(speed)
    model = ServerModel(
        name=name,
        kind="adaptive",
        pool="eagle",
        rate=tuple(1.0 / s for s in step),
        ttft=tuple(ttft),
        max_running_requests=speed.max_running_requests,
        prefill_tok_s=speed.prefill_tok_s,
        speculative=True,
        accept_length=speed.accept_length,
        cache_tokens=mode.cache_tokens,
        drafting=None if speed.speculating is None else tuple(speed.speculating),
    )
    base_together, eagle_together = together_mode(base_mode), together_mode(eagle_mode)
    if base_together is None or eagle_together is None:
        return model
    # while its partner is busy, each depth of its ladder runs as that mode's server then does
    slowed_mode = adaptive_mode(
        base_together, eagle_together, ladder, max_running_requests=base_mode.max_running_requests
    )
    t_step, t_ttft = _tables(SpeedModel(slowed_mode))
    slowed = replace(model, rate=tuple(1.0 / s for s in t_step), ttft=tuple(t_ttft),
                     prefill_tok_s=slowed_mode.prefill_tok_s)  # fmt: skip
    return replace(model, together=slowed)


def server_profile(
    belief: Profile, overrides: Sequence[Profile] = (), speed: Mapping[Pool, float] | None = None
) -> Profile:
    """What the simulated servers run from (the truth), when it is not what the policies believe.

    Each mode comes from the one `overrides` profile that has it, else from `belief`; a mode in
    two overrides is an error. `speed` then multiplies a mode's speed: decode and prefill rates
    times the factor, TTFTs divided by it (`eagle=0.8`: the eagle server is 20% slower than
    its profile says)."""
    modes = dict(belief.modes)
    given: dict[str, str] = {}
    for other in overrides:
        for mode, spec in other.modes.items():
            if mode in given:
                raise DeploymentError(
                    f"server profiles {given[mode]!r} and {other.name!r} both give the {mode} mode"
                )
            given[mode] = other.name
            modes[mode] = spec
    for mode, factor in (speed or {}).items():
        if mode not in modes:
            raise DeploymentError(f"--server-speed {mode}: the server profile has no {mode} mode")
        if not factor > 0:
            raise DeploymentError(f"--server-speed {mode}={factor}: the factor must be > 0")
        spec = modes[mode]
        modes[mode] = _scaled_mode(spec, factor)
    if not overrides and not speed:
        return belief
    parts = [o.name for o in overrides] or [belief.name]
    if speed:
        parts.append(", ".join(f"{m} x{f:g}" for m, f in sorted(speed.items())))
    return belief.model_copy(update={"modes": modes, "name": "; ".join(parts)})


def _scaled_points(points: Sequence[ProfilePoint], factor: float) -> list[ProfilePoint]:
    return [
        p.model_copy(update={"decode_tok_s": p.decode_tok_s * factor, "ttft_s": p.ttft_s / factor})
        for p in points
    ]


def _scaled_mode(spec: ModeProfile, factor: float) -> ModeProfile:
    """`spec` `factor` times as fast (its together speeds too: the same server, slowed alike)."""
    prefill = None if spec.prefill_tok_s is None else spec.prefill_tok_s * factor
    update: dict[str, object] = {"points": _scaled_points(spec.points, factor), "prefill_tok_s": prefill}
    together = spec.together
    if together is not None:
        rate = None if together.prefill_tok_s is None else together.prefill_tok_s * factor
        update["together"] = together.model_copy(
            update={"points": _scaled_points(together.points, factor), "prefill_tok_s": rate}
        )
    return spec.model_copy(update=update)


def parse_speed(items: Sequence[str]) -> dict[Pool, float]:
    """`MODE=FACTOR` items (each may hold several, comma-separated) -> {mode: factor}."""
    out: dict[Pool, float] = {}
    for item in items:
        for part in item.split(","):
            mode, sep, value = part.strip().partition("=")
            try:
                factor = float(value) if sep else math.nan
            except ValueError:
                factor = math.nan
            if mode not in POOLS or not (factor > 0 and math.isfinite(factor)):
                raise DeploymentError(
                    f"--server-speed {part.strip()!r}: expected MODE=FACTOR with MODE baseline or eagle "
                    "and FACTOR > 0 (e.g. eagle=0.8)"
                )
            if mode in out:
                raise DeploymentError(f"--server-speed: {mode} given twice")
            out["baseline" if mode == "baseline" else "eagle"] = factor
    return out


def parse_deployment(text: str) -> tuple[tuple[ServerKind, int], ...]:
    """`baseline=1,eagle=1` -> ((baseline, 1), (eagle, 1)), in the order given."""
    out: list[tuple[ServerKind, int]] = []
    seen: set[str] = set()
    for part in text.split(","):
        kind_s, sep, n_s = part.strip().partition("=")
        kind_s = kind_s.strip()
        if kind_s not in SERVER_KINDS:
            raise DeploymentError(
                f"deployment {text!r}: unknown server kind {kind_s!r} (known: {', '.join(SERVER_KINDS)})"
            )
        try:
            n = int(n_s) if sep else -1
        except ValueError:
            n = -1
        if n < 0:
            raise DeploymentError(f"deployment {text!r}: expected KIND=N with N >= 0, got {part!r}")
        if kind_s in seen:
            raise DeploymentError(f"deployment {text!r}: {kind_s!r} given twice")
        seen.add(kind_s)
        kind: ServerKind = (
            "baseline" if kind_s == "baseline" else "eagle" if kind_s == "eagle" else "adaptive"
        )
        if n:
            out.append((kind, n))
    if not out:
        raise DeploymentError(f"deployment {text!r}: no servers")
    return tuple(out)


def build_deployment(
    profile: Profile,
    deployment: Sequence[tuple[ServerKind, int]],
    ladder: Ladder = DEFAULT_LADDER,
) -> tuple[ServerModel, ...]:
    """Servers named `<kind>-<i>`, in deployment order; adaptive ones follow `ladder`."""
    return tuple(
        build_server(profile, kind, f"{kind}-{i}", ladder) for kind, n in deployment for i in range(n)
    )
