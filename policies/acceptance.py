"""Predicting a request's EAGLE speed factor from what it asks, learned online.

How it works. The quantity learned is `y`, the log of a request's speed factor on EAGLE: its
accept length over the profile's when the backend reports it (SGLang's `spec_tokens_details`),
else its decode rate over the calibrated prediction at its load. Three estimates are combined:

- a hashed model over the request's tokens, in two parts. Its text part is the mean of the
  weights of the request's text tokens (`RequestFeatures.grams` and a bias) seen before, each
  weighted by how often it was taught (up to `seen_after`), from a table of `dim` floats (`id mod
  dim`); an outcome moves each of them by the error over the times it was taught (a new token
  starts at the text part's estimate plus the error), at least `rate` times the error: a token's
  weight follows the mean of what it was taught until `1 / rate` outcomes, then an exponentially
  weighted one. So frequent tokens carry the average and distinctive ones the contrast, and the
  words of a kind of request that is rarely sent to EAGLE (a few outcomes of it, each pulled
  back toward the average by the words it shares with the kinds sent there often) learn its
  factor from those few outcomes instead of a tenth of each.
  Its parameter part adds one weight per parameter token -- sampling parameters in buckets
  (temperature, top_p, top_k), `response_format`, tools, `n`, the model and the client's hint --
  from a table of `param_dim` floats, each moved by `param_rate` times the error: a parameter
  (acceptance falls with temperature) shifts every prompt alike instead of being diluted in the
  text's mean;
  The request's traits (`RequestFeatures.traits`: code, math, another language, a document with
  a question, translate / summarize / extract, tool schemas) are parameter tokens too: what one
  task type teaches reaches its never-seen prompts whatever their words. A trait says what kind
  of request it is, as the words it stands in for do, and kinds of different speeds share one
  (code in a passage of a manual and in a coding task), so it learns at the text's `rate`
  (`trait_rate`), not `param_rate`: when a kind the model never saw arrives, its trait takes on
  that kind's offset within a few of its outcomes, instead of the common level that every
  prediction shares, which would move the kinds already known. The other parameter tokens are on
  nearly every request alike (sampling parameters left unset, the model): together they are that
  common level, which a faster rate would make follow each outcome's noise;
- a per-kind offset: one per trait set (the request's `traits` as a whole: what told hints would
  call its task type), the running mean of what the token model (after the outcome's step)
  still misses for requests of that set -- the mean of its outcomes until `window`, then an
  exponentially weighted one -- shrunk toward 0 with a prior of `kind_prior` samples. A kind's
  outcomes are evidence about each of its requests however new their words: a kind never seen
  in training (say, math, faster than everything trained on) has prompts whose words are mostly
  unseen, and without its offset they were predicted compressed toward the pool average;
- a per-family offset (`RequestFeatures.family`: the system prompt's first block) learned on
  what the token model and the kind's offset miss for that family, shrunk toward 0 with a prior
  of `family_prior` samples; at most `max_families`, least recently taught out. A family keeps
  one offset per client (`RequestInfo.client`, at most `FAMILY_CLIENTS`) and its offset is their
  mean, each client weighing at most `CLIENT_WEIGHT` outcomes: one client cannot move a family
  that others teach further than its share;
- the caller's fallback `F` (the pool average for requests of that hint: what content-blind
  routing uses). When `F` averages the outcomes taught (`selected`: the backend's reported
  acceptance), it is an average of what the router chose to send: mostly the kinds that pay on
  EAGLE, so a kind rarely sent would be shrunk toward a factor too fast for it. So `shift` is
  added to it: the mean of the model's predicted deviation from `F` over every request predicted
  less its mean over the requests whose outcomes taught it (each over `window` samples, from a
  prior of 0), as of the last outcome taught -- the regression estimate of the traffic's average
  from a selected sample. It is
  0 while the model knows nothing or routing does not depend on content, and it needs no
  probability of being sent.

The prediction is `F + c * (yhat - F)`: `c` is the regression coefficient of the observed
`y - F` on the model's `yhat - F`, measured out of sample (before each outcome teaches the
model) as running means, clipped to [0, 1], and lowered for a request whose tokens are mostly
unseen (unless its kind or family has outcomes behind it). A model that does not beat the pool
average gets `c` near 0 and the request is predicted at `F`; a request with nothing known is
predicted at `F` (with `shift`: the average that content-blind routing, sending a sample of the
traffic that does not depend on content, would learn): never-seen traffic is routed as
content-blind routing routes it.

Each outcome's influence is bounded (a robust loss in log space): its error is clipped to
`step_bound` -- `CLIP_SIGMAS` times the model's out-of-sample error, within [MIN_STEP, MAX_STEP]
-- before it moves a weight or an offset, so an absurd outcome (a client that reads slowly makes
its requests look slow) moves a shared weight (one taught `1 / rate` times or more) by at most
`rate x step_bound`. Within a family, a client whose recent share of the family's outcomes is
above an equal share teaches the shared weights in proportion less (`_Family.share_weight`).

Uncertainty (`predict_spread`): the standard deviation, in log space, of the request's expected
factor -- what exploring could still find out, not how much one request's outcome scatters. One
request's error would be the model's out-of-sample squared error (`res2`) weighted by the
confidence in it plus the spread of requests around the pool average (`pop2`) for the rest; the
expected factor of requests like this one is known that much better as outcomes stand behind it:
divided by `1 + n`, `n` being the outcomes behind its tokens (their mean count, each at most
`EVIDENCE_CAP`) or its family's outcomes if more; plus the pool average's own error (its samples
given by the caller). A kind whose outcomes keep coming is soon certain and no longer explored;
a family's evidence halves every `stale_after` predictions without an outcome of that family, so
a family that stopped being sampled (say, one predicted slow) grows uncertain again and gets
re-tried by the exploration of `policies.explore`.

Deterministic (no randomness, insertion-ordered tables) and bounded: `dim` weights and counts,
`param_dim` parameter weights, one offset per trait set seen (at most 2 ** len(TRAITS)),
`max_families` families of at most `FAMILY_CLIENTS` clients.
The learned state is plain data (`state` / `load_state`: JSON-able, round-trips exactly). Pure:
no I/O, no clock.
"""

from __future__ import annotations

import math
import zlib
from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import numpy as np

from policies.base import RequestFeatures
from policies.calibration import ShrunkMean
from policies.features import TRAITS
from policies.learned import StateError, check_version, count, field, number, pack, unpack

MAX_LOG = math.log(4.0)
"""A prediction and a target stay within [1/4, 4] times the profile's speed."""
MAX_STEP = math.log(1.5)
"""An outcome's error is clipped to at most this (log space) before it teaches anything."""
MIN_STEP = 0.05
CLIP_SIGMAS = 3.0
FAMILY_CLIENTS = 16
"""Clients whose offsets a family keeps (the one with the fewest outcomes leaves first)."""
SHARE_WINDOW = 20.0
"""Outcomes of a family over which its clients' recent shares are counted (decayed)."""
QUIET = 0.05
"""A client whose recent outcomes (decayed) fall below this leaves its family."""
CLIENT_WEIGHT = 8
"""Outcomes at most that one client's offset weighs in its family's mean."""
EVIDENCE_CAP = 64
"""Outcomes at most that one token counts for in the evidence behind a prediction (a word every
kind of request shares must not make a never-tried kind look known)."""
SHIFT_PRIOR = 10.0
"""Weight, in samples, of the prior 0 of `shift`'s two means: a few requests do not move `F`."""
PRIOR_VAR = 0.3**2
"""Spread (log space, squared) of requests' factors around the pool average before any outcome:
published per-task acceptance ranges from about 0.6x to 1.5x of the average."""


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
    traits = f.traits
    if traits:
        out.extend(_TRAIT_TOKENS[i] for i in range(len(TRAITS)) if traits >> i & 1)
    return out


_TRAIT_TOKENS = [_tok(f"trait:{name}") for name in TRAITS]
_TRAIT_MASK = (1 << len(TRAITS)) - 1


class _Family:
    """A family's offset: the weighted mean of its clients' offsets (see the module docstring)."""

    __slots__ = ("clients", "n", "offset", "taught_at")

    def __init__(self) -> None:
        self.n = 0
        self.offset = 0.0
        self.taught_at = 0
        """`AcceptanceModel.asked` when an outcome last taught the family."""
        self.clients: dict[int, list[float]] = {}
        """client -> [outcomes, recent outcomes (decayed over SHARE_WINDOW), offset]"""

    def share_weight(self, client: int) -> float:
        """How much an outcome of `client` may teach what everyone shares: 1 while its recent share
        of the family's outcomes is at most an equal share among the family's active clients,
        falling to 0 at twice that share (1 for a family with one client)."""
        clients = self.clients
        if len(clients) < 2:
            return 1.0
        own = clients.get(client)
        if own is None:
            return 1.0
        total = sum(c[1] for c in clients.values())
        fair = total / len(clients)
        return 1.0 if own[1] <= fair else max(0.0, 2.0 - own[1] / fair)

    def teach(self, client: int, residual: float, window: float) -> None:
        clients = self.clients
        keep = 1.0 - 1.0 / SHARE_WINDOW
        for key in list(clients):
            c = clients[key]
            c[1] *= keep
            if c[1] < QUIET and key != client:  # a client gone quiet no longer counts
                del clients[key]
        own = clients.get(client)
        if own is None:
            if len(clients) >= FAMILY_CLIENTS:
                del clients[min(clients, key=lambda c: clients[c][1])]
            own = clients[client] = [0.0, 0.0, 0.0]
        own[0] += 1.0
        own[1] += 1.0
        a = max(1.0 / own[0], 1.0 / window)
        own[2] += a * (residual - own[2])
        self.n += 1
        total = weight = 0.0
        for n, _, offset in clients.values():
            w = n if n < CLIENT_WEIGHT else CLIENT_WEIGHT
            total += w * offset
            weight += w
        self.offset = total / weight


class AcceptanceModel:
    """Online predictor of `log(speed factor)` per request; see the module docstring."""

    def __init__(
        self,
        *,
        dim: int = 1 << 14,
        rate: float = 0.1,
        param_rate: float = 0.03,
        trait_rate: float = 0.1,
        param_dim: int = 1 << 10,
        family_prior: float = 4.0,
        kind_prior: float = 4.0,
        max_families: int = 4096,
        window: int = 200,
        seen_after: int = 8,
        stale_after: int = 500,
    ) -> None:
        if dim < 1 or dim & (dim - 1) or param_dim < 1 or param_dim & (param_dim - 1):
            raise ValueError("dim and param_dim must be powers of two")
        self._mask = dim - 1
        self._pmask = param_dim - 1
        self._p = [0.0] * param_dim
        self._param_rate = param_rate
        self._trait_rate = trait_rate
        self._w = [0.0] * dim
        self._count = [0] * dim
        self._rate = rate
        self._family_prior = family_prior
        self._kind_prior = kind_prior
        self._max_families = max_families
        self._window = float(window)
        self._seen_after = seen_after
        self._stale_after = float(stale_after)
        self._families: OrderedDict[int, _Family] = OrderedDict()
        self._kinds: dict[int, list[float]] = {}
        """trait set -> [outcomes, offset]: at most one per subset of TRAITS."""
        # out of sample: mean of (y - F)(yhat - F) and of (yhat - F)^2; the model starts untrusted
        self.cov = ShrunkMean(0.0)
        self.var = ShrunkMean(0.01)
        # out of sample: the prediction's squared error, and the pool average's (y - F)^2
        self.res2 = ShrunkMean(PRIOR_VAR)
        self.pop2 = ShrunkMean(PRIOR_VAR)
        # the model's predicted deviation from F: over every request predicted, and over the
        # requests whose outcomes taught it (their difference is `shift`)
        self.traffic = ShrunkMean(0.0)
        self.sent = ShrunkMean(0.0)
        self.shift = 0.0
        """What to add to a fallback that averages the outcomes taught, for it to average the
        requests predicted (see the module docstring): their means' difference as of the last
        outcome taught, within +-MAX_STEP (predicting does not change what is predicted)."""
        self.taught = 0
        self.asked = 0
        """Predictions made (the clock a family's evidence grows stale by)."""

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
        self, idx: tuple[list[int], list[int]], family: int, kind: int = -1
    ) -> tuple[float, float, float, _Family | None]:
        """(model estimate, its text part, evidence in [0, 1], family state); `kind`: the trait
        set whose offset is added (-1: none), `family`: the family's (0: none)."""
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
        k = self._kinds.get(kind)
        if k is not None:
            shrink = k[0] / (k[0] + self._kind_prior)
            lin += shrink * k[1]
            seen = max(seen, shrink)
        fam = self._families.get(family) if family else None
        if fam is not None and fam.n:
            shrink = fam.n / (fam.n + self._family_prior)
            lin += shrink * fam.offset
            seen = max(seen, shrink)
        return lin, mean, seen, fam

    def predict(
        self, features: RequestFeatures, hint: str | None, fallback: float, *, selected: bool = False
    ) -> float:
        """log speed factor for the request, between the model and `fallback` by confidence
        (`selected`: `fallback` averages the outcomes taught, and is corrected by `shift`)."""
        if not self.taught:
            return fallback
        if selected:
            fallback += self.shift
        yhat, _, seen, _ = self._estimate(
            self._indices(features, hint), features.family, features.traits & _TRAIT_MASK
        )
        return _clip(fallback + self.confidence(seen) * (yhat - fallback))

    def predict_spread(
        self,
        features: RequestFeatures,
        hint: str | None,
        fallback: float,
        fallback_n: float,
        *,
        selected: bool = False,
    ) -> tuple[float, float]:
        """(log speed factor as `predict` gives it, its standard deviation in log space); see the
        module docstring. `fallback_n`: the samples behind `fallback`. A call is a request
        predicted: it counts in `shift`'s average over the requests predicted."""
        self.asked += 1
        pop2 = self.pop2.value
        base = pop2 / (1.0 + fallback_n)
        if not self.taught:
            self.traffic.add(0.0, SHIFT_PRIOR, self._window)
            return fallback, math.sqrt(pop2 + base)
        idx = self._indices(features, hint)
        yhat, _, seen, fam = self._estimate(idx, features.family, features.traits & _TRAIT_MASK)
        trust = self.confidence(seen)
        self.traffic.add(_unit(trust * (yhat - fallback)), SHIFT_PRIOR, self._window)
        if selected:
            fallback += self.shift
        mean = _clip(fallback + trust * (yhat - fallback))
        count = self._count
        evidence = sum([min(count[i], EVIDENCE_CAP) for i in idx[0]]) / len(idx[0])
        if fam is not None and fam.n:
            fresh = 0.5 ** ((self.asked - fam.taught_at) / self._stale_after)
            trust *= fresh
            evidence = fresh * max(evidence, fam.n)
        spread2 = trust * self.res2.value + (1.0 - trust) * pop2
        return mean, math.sqrt(spread2 / (1.0 + evidence) + base)

    def confidence(self, seen: float) -> float:
        """How far to trust the model over the fallback: the regression coefficient of the
        observed `y - F` on the model's `yhat - F` (out of sample, in [0, 1]), times the
        evidence (a request whose tokens are mostly unseen, of a kind and family with few
        outcomes, leans on the fallback)."""
        cov, var = self.cov.value, self.var.value
        beta = cov / var if var > 0 else 0.0
        beta = 0.0 if beta < 0 else 1.0 if beta > 1 else beta
        return beta * (1.0 if seen > 0.5 else 2.0 * seen)

    def learn(
        self,
        features: RequestFeatures,
        hint: str | None,
        target: float,
        fallback: float,
        client: int = 0,
        *,
        selected: bool = False,
    ) -> None:
        """Learn from one outcome: `target` is its observed log speed factor, `fallback` what the
        pool average predicted for it (`selected` as in `predict`), `client` who sent the
        request (0: unknown)."""
        if not math.isfinite(target) or not math.isfinite(fallback):
            return
        y = _clip(target)
        idx = self._indices(features, hint)
        kind = features.traits & _TRAIT_MASK
        yhat, mean, seen, fam = self._estimate(idx, features.family, kind)
        window = self._window
        deviation = self.confidence(seen) * (yhat - fallback) if self.taught else 0.0
        self.sent.add(_unit(deviation), SHIFT_PRIOR, window)
        d = self.traffic.value - self.sent.value
        self.shift = MAX_STEP if d > MAX_STEP else -MAX_STEP if d < -MAX_STEP else d
        if selected:
            fallback += self.shift
        share = 1.0 if fam is None else fam.share_weight(client)
        if share == 1.0:  # a client beyond its share does not sway how far the model is trusted
            if self.taught:
                d = max(-1.0, min(1.0, yhat - fallback))
                self.cov.add(max(-1.0, min(1.0, y - fallback)) * d, 10.0, window)
                self.var.add(d * d, 10.0, window)
                used = _clip(fallback + self.confidence(seen) * (yhat - fallback))
                cap = (2.0 * self.step_bound()) ** 2  # an outlier widens the scale by a bounded step too
                self.res2.add(min(cap, (y - used) ** 2), 10.0, window)
            self.pop2.add(min(1.0, (y - fallback) ** 2), 10.0, window)
        self.taught += 1
        bound = self.step_bound()
        err = share * max(-bound, min(bound, y - yhat))
        rate = self._rate
        w, count = self._w, self._count
        for i in idx[0]:
            c = count[i]
            if c:  # the mean of what the token was taught, then an EWMA over 1 / rate outcomes
                r = 1.0 / (c + 1)
                w[i] += (r if r > rate else rate) * err
            else:
                w[i] = mean + err  # a new token starts at the text part's estimate
            count[i] = c + 1
        p, params = self._p, idx[1]
        first_trait = len(params) - kind.bit_count()  # (param_tokens: last)
        pstep, tstep = self._param_rate * err, self._trait_rate * err
        for k, j in enumerate(params):
            p[j] += pstep if k < first_trait else tstep
        # the kind learns what the linear model (after this step) still misses: a running mean, as
        # told hints keep one value per kind; then the family, what both still miss
        lin = self._estimate(idx, 0)[0]
        own = self._kinds.get(kind)
        if own is None:
            own = self._kinds[kind] = [0.0, 0.0]
        own[0] += 1.0
        a = 1.0 / own[0]
        a = a if a > 1.0 / window else 1.0 / window
        own[1] += a * share * max(-bound, min(bound, y - lin - own[1]))
        if features.family:
            families = self._families
            if fam is None:
                fam = families[features.family] = _Family()
                if len(families) > self._max_families:
                    families.popitem(last=False)
            else:
                families.move_to_end(features.family)
            lin += own[0] / (own[0] + self._kind_prior) * own[1]  # as `_estimate` adds it
            fam.taught_at = self.asked
            fam.teach(client, max(-bound, min(bound, y - lin - fam.offset)) + fam.offset, window)

    def step_bound(self) -> float:
        """How far (log space) one outcome's error counts: `CLIP_SIGMAS` times the model's
        out-of-sample error, within [MIN_STEP, MAX_STEP] (a robust loss whose scale follows how
        well the model predicts: an outlier to an accurate model teaches little)."""
        bound = CLIP_SIGMAS * math.sqrt(self.res2.value)
        return MAX_STEP if bound > MAX_STEP else MIN_STEP if bound < MIN_STEP else bound

    # What it learned, as plain data (`policies.learned`): the taught token weights (sparse: a
    # weight is read only once its token was taught), the parameter weights, the families in
    # least-recently-taught order with their clients, the out-of-sample means; long arrays
    # `pack`ed. Dimensions and rates are parameters.

    def state(self) -> dict[str, Any]:
        counts = np.asarray(self._count, dtype=np.int64)
        slots = np.flatnonzero(counts)
        families = self._families.values()
        clients = [(c, v) for f in families for c, v in f.clients.items()]
        return {
            "version": STATE_VERSION,
            "dim": len(self._w),
            "param_dim": len(self._p),
            "token_slots": pack(slots, "<i8"),
            "token_weights": pack(np.asarray(self._w)[slots], "<f8"),
            "token_counts": pack(counts[slots], "<i8"),
            "params": pack(self._p, "<f8"),
            "family_keys": pack(list(self._families), "<u8"),
            "family_counts": pack([f.n for f in families], "<i8"),
            "family_taught_at": pack([f.taught_at for f in families], "<i8"),
            "family_clients": pack([len(f.clients) for f in families], "<i8"),
            "client_keys": pack([c for c, _ in clients], "<u8"),
            "client_outcomes": pack([v[0] for _, v in clients], "<f8"),
            "client_recent": pack([v[1] for _, v in clients], "<f8"),
            "client_offsets": pack([v[2] for _, v in clients], "<f8"),
            "kind_keys": pack(list(self._kinds), "<i8"),
            "kind_outcomes": pack([k[0] for k in self._kinds.values()], "<f8"),
            "kind_offsets": pack([k[1] for k in self._kinds.values()], "<f8"),
            "cov": [self.cov.n, self.cov.value],
            "var": [self.var.n, self.var.value],
            "res2": [self.res2.n, self.res2.value],
            "pop2": [self.pop2.n, self.pop2.value],
            "traffic": [self.traffic.n, self.traffic.value],
            "sent": [self.sent.n, self.sent.value],
            "shift": self.shift,
            "taught": self.taught,
            "asked": self.asked,
        }

    def load_state(self, state: object) -> None:
        what = "content model"
        old = isinstance(state, Mapping) and state.get("version") == 3  # before the kinds' offsets
        s = check_version(state, what, 3 if old else STATE_VERSION)
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
        taught_at = unpack(field(s, "family_taught_at", what), "<i8", what, len(keys))
        n_clients = unpack(field(s, "family_clients", what), "<i8", what, len(keys))
        total = sum(n_clients)
        client_keys = unpack(field(s, "client_keys", what), "<u8", what, total)
        outcomes = unpack(field(s, "client_outcomes", what), "<f8", what, total)
        recent = unpack(field(s, "client_recent", what), "<f8", what, total)
        offsets = unpack(field(s, "client_offsets", what), "<f8", what, total)
        if len(set(keys)) != len(keys) or 0 in keys:
            raise StateError(f"{what}: a family key is 0 or repeated")
        if len(keys) > self._max_families or any(k > FAMILY_CLIENTS for k in n_clients):
            raise StateError(f"{what}: more families than max_families, or clients than FAMILY_CLIENTS")
        families: OrderedDict[int, _Family] = OrderedDict()
        j = 0
        for key, n, at, k in zip(keys, family_counts, taught_at, n_clients, strict=True):
            fam = families[key] = _Family()
            fam.n, fam.taught_at = n, at
            for c in range(j, j + k):
                if client_keys[c] in fam.clients or outcomes[c] <= 0.0:
                    raise StateError(f"{what}: a family's client is repeated or never taught it")
                fam.clients[client_keys[c]] = [outcomes[c], recent[c], offsets[c]]
            j += k
            if fam.clients:
                pairs = [(min(k, CLIENT_WEIGHT), v) for k, _, v in fam.clients.values()]
                fam.offset = sum(a * v for a, v in pairs) / sum(a for a, _ in pairs)
        kinds: dict[int, list[float]] = {}
        if not old:
            kind_keys = unpack(field(s, "kind_keys", what), "<i8", what)
            kind_n = unpack(field(s, "kind_outcomes", what), "<f8", what, len(kind_keys))
            kind_offsets = unpack(field(s, "kind_offsets", what), "<f8", what, len(kind_keys))
            for key, n, offset in zip(kind_keys, kind_n, kind_offsets, strict=True):
                if key in kinds or not 0 <= key <= _TRAIT_MASK or n < 1.0 or abs(offset) > MAX_LOG:
                    raise StateError(f"{what}: a kind is repeated, out of range or never taught")
                kinds[key] = [n, offset]
        means = []
        for key in ("cov", "var", "res2", "pop2", "traffic", "sent"):
            pair = field(s, key, what)
            if not isinstance(pair, list) or len(pair) != 2:
                raise StateError(f"{what}: {key} must be [samples, value]")
            m = ShrunkMean(number(pair[1], what))
            m.n = count(pair[0], what)
            means.append(m)
        params = unpack(field(s, "params", what), "<f8", what, param_dim)
        taught = count(field(s, "taught", what), what)
        asked = count(field(s, "asked", what), what)
        shift = number(field(s, "shift", what), what)
        if abs(shift) > MAX_STEP:
            raise StateError(f"{what}: shift is beyond +-MAX_STEP")
        self._w, self._count, self._p, self._families, self._kinds = w, counts, params, families, kinds
        self.cov, self.var, self.res2, self.pop2, self.traffic, self.sent = means
        self.taught, self.asked, self.shift = taught, asked, shift


STATE_VERSION = 4
"""The layout of `AcceptanceModel.state()` (1: before per-client families and the spread; 2:
before `shift`'s means; 3: before the kinds' offsets, still read: the kinds start untaught)."""


def _unit(x: float) -> float:
    return 1.0 if x > 1.0 else -1.0 if x < -1.0 else x


def _clip(x: float) -> float:
    return MAX_LOG if x > MAX_LOG else -MAX_LOG if x < -MAX_LOG else x
