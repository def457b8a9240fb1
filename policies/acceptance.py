"""Predicting a request's EAGLE speed factor from what it asks, learned online.

How it works. The quantity learned is `y`, the log of a request's speed factor on EAGLE: its
accept length over the profile's when the backend reports it (SGLang's `spec_tokens_details`),
else its decode rate over the calibrated prediction at its load. Three estimates are combined:

- a hashed model over the request's tokens, in two parts. Its text part is the mean of the
  weights of the request's text tokens (`RequestFeatures.grams` and a bias) seen before, each
  weighted by how often it was taught (up to `seen_after`), from a table of `dim` floats (`id mod
  dim`); an outcome moves each of them by `rate` times the error (a new token starts at the
  text part's estimate), so frequent tokens carry the average and distinctive ones the contrast.
  Its parameter part adds one weight per parameter token -- sampling parameters in buckets
  (temperature, top_p, top_k), `response_format`, tools, `n`, the model and the client's hint --
  from a table of `param_dim` floats, each moved by `param_rate` times the error: a parameter
  (acceptance falls with temperature) shifts every prompt alike instead of being diluted in the
  text's mean;
- a per-family offset (`RequestFeatures.family`: the system prompt's first block) learned on
  what the token model misses for that family, shrunk toward 0 with a prior of `family_prior`
  samples; at most `max_families`, least recently taught out;
- the caller's fallback `F` (the pool average for requests of that hint: what content-blind
  routing uses).

The prediction is `F + c * (yhat - F)`: `c` is the regression coefficient of the observed
`y - F` on the model's `yhat - F`, measured out of sample (before each outcome teaches the
model) as running means, clipped to [0, 1], and lowered for a request whose tokens are mostly
unseen. A model that does not beat the pool average gets `c` near 0 and the request is
predicted at `F`; a request with nothing known is predicted at `F`: never-seen traffic is
routed as content-blind routing routes it.

Deterministic (no randomness, insertion-ordered tables) and bounded: `dim` weights and counts,
`param_dim` parameter weights, `max_families` families. Pure: no I/O, no clock.
"""

from __future__ import annotations

import math
import zlib
from collections import OrderedDict
from typing import Any

import numpy as np

from policies.base import RequestFeatures
from policies.calibration import ShrunkMean
from policies.learned import StateError, check_version, count, field, number, pack, unpack

MAX_LOG = math.log(4.0)
"""A prediction and a target stay within [1/4, 4] times the profile's speed."""


def _tok(name: str) -> int:
    return zlib.crc32(name.encode())


_BIAS = _tok("bias")


def _bucket(value: float | None, edges: tuple[float, ...]) -> int:
    if value is None:
        return -1
    for i, e in enumerate(edges):
        if value <= e:
            return i
    return len(edges)


_TEMP_EDGES = (0.0, 0.3, 0.6, 0.9, 1.2)
_TOP_P_EDGES = (0.5, 0.9, 0.99)
_TOP_K_EDGES = (1.0, 20.0, 100.0)


def param_tokens(features: RequestFeatures, hint: str | None) -> list[int]:
    """Token ids of the request's parameters and hint (the grams are the text's)."""
    f = features
    out = [
        _tok(f"temperature:{_bucket(f.temperature, _TEMP_EDGES)}"),
        _tok(f"top_p:{_bucket(f.top_p, _TOP_P_EDGES)}"),
        _tok(f"top_k:{_bucket(None if f.top_k is None else float(f.top_k), _TOP_K_EDGES)}"),
        _tok(f"model:{f.model}"),
    ]
    if f.response_format is not None:
        out.append(_tok(f"response_format:{f.response_format}"))
    if f.tools:
        out.append(_tok("tools"))
    if f.n > 1:
        out.append(_tok("n>1"))
    if hint is not None:
        out.append(_tok(f"hint:{hint}"))
    return out


class _Family:
    __slots__ = ("n", "offset")

    def __init__(self) -> None:
        self.n = 0
        self.offset = 0.0


class AcceptanceModel:
    """Online predictor of `log(speed factor)` per request; see the module docstring."""

    def __init__(
        self,
        *,
        dim: int = 1 << 14,
        rate: float = 0.1,
        param_rate: float = 0.03,
        param_dim: int = 1 << 10,
        family_prior: float = 4.0,
        max_families: int = 4096,
        window: int = 200,
        seen_after: int = 8,
    ) -> None:
        if dim < 1 or dim & (dim - 1) or param_dim < 1 or param_dim & (param_dim - 1):
            raise ValueError("dim and param_dim must be powers of two")
        self._mask = dim - 1
        self._pmask = param_dim - 1
        self._p = [0.0] * param_dim
        self._param_rate = param_rate
        self._w = [0.0] * dim
        self._count = [0] * dim
        self._rate = rate
        self._family_prior = family_prior
        self._max_families = max_families
        self._window = float(window)
        self._seen_after = seen_after
        self._families: OrderedDict[int, _Family] = OrderedDict()
        # out of sample: mean of (y - F)(yhat - F) and of (yhat - F)^2; the model starts untrusted
        self.cov = ShrunkMean(0.0)
        self.var = ShrunkMean(0.01)
        self.taught = 0

    @property
    def families(self) -> int:
        """Families tracked (at most `max_families`)."""
        return len(self._families)

    def _indices(self, features: RequestFeatures, hint: str | None) -> tuple[list[int], list[int]]:
        """(text token slots: the grams and the bias, parameter slots)."""
        mask, pmask = self._mask, self._pmask
        text = [g & mask for g in features.grams]
        text.append(_BIAS & mask)
        return text, [t & pmask for t in param_tokens(features, hint)]

    def _estimate(
        self, idx: tuple[list[int], list[int]], family: int
    ) -> tuple[float, float, float, _Family | None]:
        """(model estimate, its text part, evidence in [0, 1], family state)."""
        w, count, cap = self._w, self._count, self._seen_after
        total = weight = 0.0
        text, params = idx
        for i in text:
            c = count[i]
            if c:
                c = c if c < cap else cap
                total += c * w[i]
                weight += c
        mean = total / weight if weight else 0.0
        p = self._p
        lin = mean + sum([p[j] for j in params])
        seen = weight / (cap * len(text))
        fam = self._families.get(family) if family else None
        if fam is not None and fam.n:
            shrink = fam.n / (fam.n + self._family_prior)
            lin += shrink * fam.offset
            seen = max(seen, shrink)
        return lin, mean, seen, fam

    def predict(self, features: RequestFeatures, hint: str | None, fallback: float) -> float:
        """log speed factor for the request, between the model and `fallback` by confidence."""
        if not self.taught:
            return fallback
        yhat, _, seen, _ = self._estimate(self._indices(features, hint), features.family)
        return _clip(fallback + self.confidence(seen) * (yhat - fallback))

    def confidence(self, seen: float) -> float:
        """How far to trust the model over the fallback: the regression coefficient of the
        observed `y - F` on the model's `yhat - F` (out of sample, in [0, 1]), times the
        evidence (a request whose tokens are mostly unseen leans on the fallback)."""
        cov, var = self.cov.value, self.var.value
        beta = cov / var if var > 0 else 0.0
        beta = 0.0 if beta < 0 else 1.0 if beta > 1 else beta
        return beta * (1.0 if seen > 0.5 else 2.0 * seen)

    def learn(self, features: RequestFeatures, hint: str | None, target: float, fallback: float) -> None:
        """Learn from one outcome: `target` is its observed log speed factor, `fallback` what the
        pool average predicted for it."""
        if not math.isfinite(target) or not math.isfinite(fallback):
            return
        y = _clip(target)
        idx = self._indices(features, hint)
        yhat, mean, _, fam = self._estimate(idx, features.family)
        window = self._window
        if self.taught:
            d = max(-1.0, min(1.0, yhat - fallback))
            self.cov.add(max(-1.0, min(1.0, y - fallback)) * d, 10.0, window)
            self.var.add(d * d, 10.0, window)
        self.taught += 1
        err = max(-1.0, min(1.0, y - yhat))
        step = self._rate * err
        w, count = self._w, self._count
        for i in idx[0]:
            if count[i]:
                w[i] += step
            else:
                w[i] = mean + step  # a new token starts at the text part's estimate
            count[i] += 1
        p, pstep = self._p, self._param_rate * err
        for j in idx[1]:
            p[j] += pstep
        if features.family:
            families = self._families
            if fam is None:
                fam = families[features.family] = _Family()
                if len(families) > self._max_families:
                    families.popitem(last=False)
            else:
                families.move_to_end(features.family)
            # the family learns what the linear model (after this step) still misses
            lin = self._estimate(idx, 0)[0]
            fam.n += 1
            a = max(1.0 / fam.n, 1.0 / window)
            fam.offset += a * (y - lin - fam.offset)

    # What it learned, as plain data (`policies.learned`): the taught token weights (sparse: a
    # weight is read only once its token was taught), the parameter weights, the families in
    # least-recently-taught order, the out-of-sample means; long arrays `pack`ed. Dimensions and
    # rates are parameters.

    def state(self) -> dict[str, Any]:
        counts = np.asarray(self._count, dtype=np.int64)
        slots = np.flatnonzero(counts)
        families = self._families
        return {
            "version": STATE_VERSION,
            "dim": len(self._w),
            "param_dim": len(self._p),
            "token_slots": pack(slots, "<i8"),
            "token_weights": pack(np.asarray(self._w)[slots], "<f8"),
            "token_counts": pack(counts[slots], "<i8"),
            "params": pack(self._p, "<f8"),
            "family_keys": pack(list(families), "<u8"),
            "family_counts": pack([f.n for f in families.values()], "<i8"),
            "family_offsets": pack([f.offset for f in families.values()], "<f8"),
            "cov": [self.cov.n, self.cov.value],
            "var": [self.var.n, self.var.value],
            "taught": self.taught,
        }

    def load_state(self, state: object) -> None:
        what = "content model"
        s = check_version(state, what, STATE_VERSION)
        dim, param_dim = len(self._w), len(self._p)
        if field(s, "dim", what) != dim or field(s, "param_dim", what) != param_dim:
            raise StateError(f"{what}: saved with other dimensions")
        slots = unpack(field(s, "token_slots", what), "<i8", what)
        weights = unpack(field(s, "token_weights", what), "<f8", what, len(slots))
        taught_counts = unpack(field(s, "token_counts", what), "<i8", what, len(slots))
        w, counts = [0.0] * dim, [0] * dim
        for i, weight, c in zip(slots, weights, taught_counts, strict=True):
            if not 0 <= i < dim or counts[i] or not c:
                raise StateError(f"{what}: a token slot is out of range, repeated or untaught")
            w[i], counts[i] = weight, c
        keys = unpack(field(s, "family_keys", what), "<u8", what)
        family_counts = unpack(field(s, "family_counts", what), "<i8", what, len(keys))
        offsets = unpack(field(s, "family_offsets", what), "<f8", what, len(keys))
        if len(set(keys)) != len(keys) or 0 in keys:
            raise StateError(f"{what}: a family key is 0 or repeated")
        if len(keys) > self._max_families:
            raise StateError(f"{what}: more families than max_families")
        families: OrderedDict[int, _Family] = OrderedDict()
        for key, n, offset in zip(keys, family_counts, offsets, strict=True):
            fam = families[key] = _Family()
            fam.n, fam.offset = n, offset
        means = []
        for key in ("cov", "var"):
            pair = field(s, key, what)
            if not isinstance(pair, list) or len(pair) != 2:
                raise StateError(f"{what}: {key} must be [samples, value]")
            m = ShrunkMean(number(pair[1], what))
            m.n = count(pair[0], what)
            means.append(m)
        params = unpack(field(s, "params", what), "<f8", what, param_dim)
        taught = count(field(s, "taught", what), what)
        self._w, self._count, self._p, self._families = w, counts, params, families
        self.cov, self.var = means
        self.taught = taught


STATE_VERSION = 1
"""The layout of `AcceptanceModel.state()`."""


def _clip(x: float) -> float:
    return MAX_LOG if x > MAX_LOG else -MAX_LOG if x < -MAX_LOG else x
