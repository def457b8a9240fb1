"""SGLang's `--speculative-adaptive` in the emulator: the draft depth of every decode step.

How it works: the ladder (`policies.ladder`: SGLang's default unless `--speculative-adaptive-config`
gives one) maps the step's batch size (its running requests, see `batching.py`) to a bucket; each
bucket keeps its own EMA of the drafts accepted per request and its own depth, and decides again
every `update_interval` steps after `warmup_batches` (`policies.ladder.next_steps`, the rule the
policies' steady-state prediction applies). A step at depth k lasts `AdaptiveSpeed.step_s(b, k)`
(`policies.adaptive`: the plain step at 0, the profile's EAGLE-3 verify step at its measured depth)
and each request accepts a chain of up to k drafts at its own per-token acceptance, solved from its
mean accept length at the profile's depth.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from policies.adaptive import AdaptiveSpeed, alpha_for
from policies.ladder import Bucket, Ladder, next_steps


class _Slot:
    """One bucket's controller state."""

    __slots__ = ("batches", "bucket", "ema", "steps")

    def __init__(self, bucket: Bucket, steps: int) -> None:
        self.bucket = bucket
        self.steps = steps
        self.ema = steps - 1.0
        self.batches = 0

    def update(self, drafts: Sequence[int]) -> None:
        b = self.bucket
        if self.steps > 0:
            self.ema = (1.0 - b.ema_alpha) * self.ema + b.ema_alpha * (sum(drafts) / len(drafts))
        self.batches += 1
        after = self.batches - b.warmup_batches
        if after > 0 and after % b.update_interval == 0:
            self.steps, self.ema = next_steps(b, self.steps, self.ema)


class AdaptiveDrafting:
    """The depth of each step, the accepted drafts of each request, and the controller's learning."""

    def __init__(self, ladder: Ladder, speed: AdaptiveSpeed, rng: random.Random) -> None:
        self.ladder = ladder
        self.speed = speed
        self._rng = rng
        self._slots = {b.min_batch: _Slot(b, ladder.start_steps(b)) for b in ladder.buckets}
        self._alpha: dict[float, float] = {}
        self.last_steps = self._slots[ladder.buckets[0].min_batch].steps
        """The depth of the latest step (`sglang:spec_num_steps`)."""

    def _slot(self, batch: int) -> _Slot:
        return self._slots[self.ladder.bucket_at(batch).min_batch]

    def steps_for(self, batch: int) -> int:
        """The depth of a step with `batch` requests running."""
        steps = self.last_steps = self._slot(batch).steps
        return steps

    def alpha(self, accept_mean: float) -> float:
        """The per-token acceptance of a request whose mean accept length at the profile's
        depth is `accept_mean`."""
        a = self._alpha.get(accept_mean)
        if a is None:
            a = self._alpha[accept_mean] = alpha_for(accept_mean, self.speed.depth.steps)
        return a

    def drafts(self, accept_mean: float, steps: int) -> int:
        """Drafts accepted in one verify step of `steps` drafts (bonus token excluded)."""
        p = self.alpha(accept_mean)
        j = 0
        while j < steps and self._rng.random() < p:
            j += 1
        return j

    def observe(self, batch: int, drafts: Sequence[int]) -> None:
        """A step with `batch` requests running ended; `drafts` were accepted per request."""
        if drafts:
            self._slot(batch).update(drafts)
