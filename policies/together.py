"""Co-located servers: a mode's speed while the other mode's server, on the same cores, is busy.

A profile mode may carry `together` points (`ModeProfile.together`): its per-request decode
rate and TTFT measured while both servers ran `concurrency` requests each (`specroute bench URL
--together URL2`). Alone, a server runs at its `points`; while its partner has running requests
it runs at the together curve built here:

- the slowdown at a together point is `f = together decode / alone decode` at that concurrency
  (the alone curve interpolated as usual), and `g = together TTFT / alone TTFT` for TTFT (when
  either is 0: `1 / f`);
- between together points `f` and `g` are interpolated linearly in concurrency, and held
  constant below the first and beyond the last (one point at concurrency 1 gives one factor for
  every batch size);
- the together curve has a point at every concurrency of either list, the alone speed there
  times the slowdown there, and is read like any mode's points (`SpeedModel`);
- prefill runs at the together `prefill_tok_s` when given, else at the alone one times `f`
  at concurrency 1.

The slowdown depends on the server's own batch size, not on how busy its partner is (the points
were measured with both at the same concurrency): a model of two servers sharing cores, exact
at the measured points for equal loads.
"""

from __future__ import annotations

import numpy as np

from policies.profile import ModeProfile, Profile, ProfilePoint, SpeedModel


def slowdowns(mode: ModeProfile) -> list[tuple[float, float, float]]:
    """(concurrency, decode factor f, TTFT factor g) at each together point; [] without any."""
    if mode.together is None:
        return []
    alone = SpeedModel(mode.model_copy(update={"together": None}))
    out = []
    for p in mode.together.points:
        c = p.concurrency
        f = p.decode_tok_s / float(alone.decode_tok_s_array(c))
        ttft = float(alone.ttft_array(c))
        g = p.ttft_s / ttft if ttft > 0 and p.ttft_s > 0 else 1.0 / f
        out.append((c, f, g))
    return out


def together_mode(mode: ModeProfile) -> ModeProfile | None:
    """The mode while its co-located partner is busy (see the module's opening); None when the
    mode has no together points."""
    if mode.together is None:
        return None
    factors = slowdowns(mode)
    alone = SpeedModel(mode.model_copy(update={"together": None}))
    cs = np.array([c for c, _, _ in factors], dtype=np.float64)
    fs = np.array([f for _, f, _ in factors], dtype=np.float64)
    gs = np.array([g for _, _, g in factors], dtype=np.float64)
    knots = sorted({p.concurrency for p in mode.points} | {p.concurrency for p in mode.together.points})
    points = []
    for k in knots:
        f = float(np.interp(k, cs, fs))
        g = float(np.interp(k, cs, gs))
        points.append(
            ProfilePoint(
                concurrency=k,
                decode_tok_s=float(alone.decode_tok_s_array(k)) * f,
                ttft_s=float(alone.ttft_array(k)) * g,
            )
        )
    prefill = mode.together.prefill_tok_s
    if prefill is None and mode.prefill_tok_s is not None:
        prefill = mode.prefill_tok_s * float(np.interp(1.0, cs, fs))
    return mode.model_copy(update={"points": points, "prefill_tok_s": prefill, "together": None})


def describe(profile: Profile) -> str | None:
    """One line on the co-location model a profile carries (None: none): the decode speed factors
    while the other server is busy, e.g. `... baseline x0.62 at c=1; eagle x0.58 at c=1, x0.70 at
    c=2`."""
    parts = []
    for name, mode in profile.modes.items():
        factors = slowdowns(mode)
        if factors:
            shown = ", ".join(f"x{f:.2f} at c={c:g}" for c, f, _ in factors)
            parts.append(f"{name} {shown}")
    if not parts:
        return None
    return (
        "co-located pairs (the profile's together points: baseline-i and eagle-i share cores, then "
        "the other servers two by two), decode "
        "speed while the other is busy: " + "; ".join(parts)
    )


def to_json(profile: Profile) -> dict[str, list[dict[str, float]]] | None:
    """Per mode with together points: `[{"concurrency", "decode_factor", "ttft_factor"}]`; None
    when no mode has any (`simulate --json`'s `colocation`)."""
    out: dict[str, list[dict[str, float]]] = {
        name: [{"concurrency": c, "decode_factor": f, "ttft_factor": g} for c, f, g in slowdowns(mode)]
        for name, mode in profile.modes.items()
        if mode.together is not None
    }
    return out or None
