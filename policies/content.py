"""`cost_model`'s content hook: each request's eagle speed factor from what it asks.

How it works: `ContentAcceptance` sits between `cost_model` and its `SpeedCalibration`. For a
request with features (`RequestInfo.features`) it asks `policies.acceptance.AcceptanceModel`
for the request's log speed factor, with the content-blind estimate as the fallback `F`:

- when the backend reports acceptance (`spec_details`): `F` is the calibrated acceptance of
  the request's hint (or of untagged requests), and the factor is the acceptance itself. That
  calibrated mean averages what the router sent to EAGLE, so the model corrects it for the
  selection (`AcceptanceModel.shift`; not a hint's told prior, which no outcome taught);
- timing only: `F` is the eagle pool's calibrated speed plus the hint's term, and the factor
  replaces the pool's mean (the load buckets' deviation from it stays);
- without calibration: `F` is the hint's `hint_speedup` (1 without one).

Outcomes teach it: the reported accept length over the profile's, else the decode rate over
the profile's at the request's load, less the load bucket's deviation from the pool mean. With
timing only, the rate handed on to the calibration has the predicted content deviation divided
out, so the pool and bucket means keep learning the speed of an average request (a pair that
sends only the fast requests to eagle does not mistake them for a faster server).

Each prediction carries its spread (`AcceptanceModel.predict_spread`), the pool average's own
evidence being the calibrated samples behind `F`; `policies.explore` reads it. What it learns
is the model's (`AcceptanceModel.state`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from policies.acceptance import AcceptanceModel
from policies.base import Outcome, RequestInfo
from policies.calibration import SpeedCalibration


class ContentAcceptance:
    def __init__(self, hint_speedup: Mapping[str, float], profile_accept: float | None) -> None:
        self.model = AcceptanceModel()
        self._hint_speedup = hint_speedup
        self._profile_accept = profile_accept

    def reported(self, outcome: Outcome) -> float | None:
        """The request's speed factor as the backend reported it: its accept length over the
        profile's (None without a report, or when the profile gives no accept length)."""
        accept = outcome.accept_length
        if accept is None or not accept > 0.0 or not self._profile_accept:
            return None
        return accept / self._profile_accept

    def _fallback(self, hint: str | None, cal: SpeedCalibration | None) -> tuple[float, bool]:
        """(`F`, whether it is an average of the outcomes taught: then the model corrects it for
        which requests were sent, `AcceptanceModel.shift`)."""
        if cal is None:
            return (math.log(self._hint_speedup.get(hint, 1.0)) if hint is not None else 0.0), False
        if cal.accept_reported:
            told = hint is not None and cal.hints.get(hint) is None and hint in self._hint_speedup
            return cal.log_hint(hint), not told
        return cal.pool["eagle"].value + cal.log_hint(hint), False

    @staticmethod
    def _fallback_n(hint: str | None, cal: SpeedCalibration | None) -> float:
        """Samples behind the fallback: its hint's (or untagged requests') calibrated mean."""
        if cal is None:
            return 0.0
        state = cal.hints.get(hint) if hint is not None else None
        if state is not None:
            return float(state.n)
        return float(cal.untagged.n if cal.accept_reported else cal.pool["eagle"].n)

    def factor(self, request: RequestInfo, cal: SpeedCalibration | None) -> tuple[float, float, float] | None:
        """(the eagle rate multiplier `cost_model` applies for this request, its speed factor
        against the profile, the factor's standard deviation in log space), or None for a
        request without features."""
        features = request.features
        if features is None:
            return None
        hint = request.hint
        fallback, selected = self._fallback(hint, cal)
        y, sd = self.model.predict_spread(
            features, hint, fallback, self._fallback_n(hint, cal), selected=selected
        )
        if cal is not None and not cal.accept_reported:
            return math.exp(y - cal.pool["eagle"].value), math.exp(y), sd
        return math.exp(y), math.exp(y), sd

    def observe(
        self, outcome: Outcome, cal: SpeedCalibration | None, batch: int, rate_ratio: float | None
    ) -> float | None:
        """Learn from an eagle outcome (`rate_ratio`: its decode rate over the profile's at
        `batch`, None when unknown, e.g. not streamed); returns the rate ratio the calibration
        should learn from."""
        request = outcome.request
        features = request.features
        if features is None:
            return rate_ratio
        hint = request.hint
        fallback, selected = self._fallback(hint, cal)
        accept = outcome.accept_length
        if accept is not None and accept > 0.0 and self._profile_accept:
            y = math.log(accept / self._profile_accept)
            self.model.learn(features, hint, y, fallback, request.client, selected=selected)
            return rate_ratio
        if rate_ratio is None or not rate_ratio > 0.0:
            return rate_ratio
        if cal is not None and cal.accept_reported:
            return rate_ratio  # this backend reports acceptance; one that did not is not comparable
        deviation = 0.0 if cal is None else cal.log_speed("eagle", batch) - cal.pool["eagle"].value
        y = math.log(rate_ratio) - deviation
        used = self.model.predict(features, hint, fallback)
        self.model.learn(features, hint, y, fallback, request.client)
        return rate_ratio / math.exp(used - fallback)
