"""What `specroute bench` measures and writes: per-request results, per-level summaries, the
result file (`specroute.bench/v1`) and the speed profile built from it.

Per request: TTFT (first token-bearing chunk), end-to-end time, completion tokens from the
server's usage counts, and the decode rate `(completion_tokens - 1) / (last token - first
token)`. A failed request carries an `error` and is never part of the averages.

Per level (only `measured` requests; `warmup` and `filler` requests keep the server at the
level's concurrency but are not counted): n, errors, mean with 95% t-interval and
p50/p90/p99 of decode tok/s, TTFT and end-to-end seconds, and total throughput = output
tokens emitted by all requests while the measured ones ran / that wall time (tokens assumed
evenly spread between a request's first and last token). Its interval comes from the
per-request ratio estimator sum(tokens)/sum(e2e) (Little's law for a closed loop).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from policies.base import Pool
from policies.profile import Profile, parse_profile
from policies.stats import Estimate, estimate, ratio_relative_half_width

FORMAT = "specroute.bench/v1"
MAX_DRAFT_DEPTH = 16
"""The deepest draft a profile records (`ModeProfile.speculative_num_steps`)."""

Phase = Literal["warmup", "measured", "filler"]


class ResultFileError(ValueError):
    """A result file that cannot be read; the message names the file."""


@dataclass
class RequestResult:
    phase: Phase
    start_s: float
    """Seconds since the level started."""
    ttft_s: float | None = None
    first_token_s: float | None = None
    last_token_s: float | None = None
    end_s: float | None = None
    completion_tokens: int | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    """`usage.prompt_tokens_details.cached_tokens` (SGLang's `--enable-cache-report`), when sent."""
    status: int | None = None
    error: str | None = None
    category: str | None = None
    """The prompt's `category` (prompt files with categories)."""
    accept_length: float | None = None
    """Tokens per verify step the server reported for this request (SGLang's
    `spec_tokens_details`, asked for when the prompts have categories)."""
    draft_tokens: int | None = None
    """Draft tokens per verify step the server ran this request with (vLLM's per-request
    `num_spec_tokens`): the depth an eagle profile's points were measured at."""

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def e2e_s(self) -> float | None:
        return None if self.end_s is None else self.end_s - self.start_s

    @property
    def decode_tok_s(self) -> float | None:
        """Per-request decode rate after the first token; None without two tokens."""
        if not self.ok or self.completion_tokens is None or self.completion_tokens < 2:
            return None
        if self.first_token_s is None or self.last_token_s is None:
            return None
        span = self.last_token_s - self.first_token_s
        return (self.completion_tokens - 1) / span if span > 0 else None

    def tokens_within(self, lo: float, hi: float) -> float:
        """Output tokens emitted in [lo, hi], spread evenly after the first token."""
        if not self.ok or not self.completion_tokens or self.first_token_s is None:
            return 0.0
        first, last = self.first_token_s, self.last_token_s or self.first_token_s
        n = self.completion_tokens
        got = 1.0 if lo <= first <= hi else 0.0
        if last <= first:
            return float(n) if lo <= first <= hi else 0.0
        overlap = max(0.0, min(hi, last) - max(lo, first))
        return got + (n - 1) * overlap / (last - first)

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["decode_tok_s"] = self.decode_tok_s
        d["e2e_s"] = self.e2e_s
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RequestResult:
        names = cls.__dataclass_fields__.keys()
        return cls(**{k: v for k, v in d.items() if k in names})


@dataclass(frozen=True)
class LevelSummary:
    concurrency: int
    n: int
    """Measured requests (successful + failed)."""
    errors: int
    decode_tok_s: Estimate | None
    ttft_s: Estimate | None
    e2e_s: Estimate | None
    total_tok_s: Estimate | None
    """Point = tokens / wall time; half_width from the ratio estimator; n = successful."""
    wall_s: float
    other_errors: int = 0
    """Failed warm-up or filler requests (not part of `errors`)."""

    @property
    def ok(self) -> int:
        return self.n - self.errors

    def to_json(self) -> dict[str, Any]:
        def est(e: Estimate | None) -> dict[str, Any] | None:
            return None if e is None else e.to_json()

        return {
            "concurrency": self.concurrency,
            "n": self.n,
            "ok": self.ok,
            "errors": self.errors,
            "other_errors": self.other_errors,
            "wall_s": self.wall_s,
            "decode_tok_s": est(self.decode_tok_s),
            "ttft_s": est(self.ttft_s),
            "e2e_s": est(self.e2e_s),
            "total_tok_s": est(self.total_tok_s),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LevelSummary:
        def est(key: str) -> Estimate | None:
            v = d.get(key)
            return None if v is None else Estimate.from_json(v)

        return cls(
            concurrency=int(d["concurrency"]),
            n=int(d["n"]),
            errors=int(d["errors"]),
            decode_tok_s=est("decode_tok_s"),
            ttft_s=est("ttft_s"),
            e2e_s=est("e2e_s"),
            total_tok_s=est("total_tok_s"),
            wall_s=float(d["wall_s"]),
            other_errors=int(d.get("other_errors", 0)),
        )


def summarize(concurrency: int, requests: list[RequestResult]) -> LevelSummary:
    measured = [r for r in requests if r.phase == "measured"]
    good = [r for r in measured if r.ok]
    decode = [v for r in good if (v := r.decode_tok_s) is not None]
    ttft = [r.ttft_s for r in good if r.ttft_s is not None]
    e2e = [v for r in good if (v := r.e2e_s) is not None]
    wall = 0.0
    total: Estimate | None = None
    if good:
        lo = min(r.start_s for r in measured)
        hi = max(r.end_s for r in good if r.end_s is not None)
        wall = hi - lo
        if wall > 0:
            rate = sum(r.tokens_within(lo, hi) for r in requests) / wall
            rel = ratio_relative_half_width(
                [float(r.completion_tokens or 0) for r in good], [r.e2e_s or 0.0 for r in good]
            )
            total = Estimate(n=len(good), mean=rate, half_width=None if rel is None else rel * rate)
    return LevelSummary(
        concurrency=concurrency,
        n=len(measured),
        errors=len(measured) - len(good),
        decode_tok_s=estimate(decode),
        ttft_s=estimate(ttft),
        e2e_s=estimate(e2e),
        total_tok_s=total,
        wall_s=wall,
        other_errors=sum(1 for r in requests if r.phase != "measured" and not r.ok),
    )


@dataclass
class LevelResult:
    concurrency: int
    requests: list[RequestResult]
    summary: LevelSummary

    def to_json(self) -> dict[str, Any]:
        return {
            "concurrency": self.concurrency,
            "summary": self.summary.to_json(),
            "requests": [r.to_json() for r in self.requests],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LevelResult:
        return cls(
            concurrency=int(d["concurrency"]),
            requests=[RequestResult.from_json(r) for r in d.get("requests", [])],
            summary=LevelSummary.from_json(d["summary"]),
        )


@dataclass
class BenchResult:
    """A sweep's results; `levels` grows as levels finish (a stopped sweep keeps them)."""

    metadata: dict[str, Any] = field(default_factory=dict)
    levels: list[LevelResult] = field(default_factory=list)

    @property
    def label(self) -> str:
        return str(self.metadata.get("label") or self.metadata.get("url") or "run")

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "metadata": self.metadata,
            "levels": [lv.to_json() for lv in self.levels],
        }

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def from_json(cls, data: Any, origin: str = "<result>") -> BenchResult:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ResultFileError(f"{origin}: not a specroute bench result (format {FORMAT!r})")
        try:
            return cls(
                metadata=dict(data.get("metadata") or {}),
                levels=[LevelResult.from_json(lv) for lv in data.get("levels", [])],
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ResultFileError(f"{origin}: malformed result file: {e!r}") from None

    @classmethod
    def read(cls, path: str | Path) -> BenchResult:
        p = Path(path)
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except OSError as e:
            raise ResultFileError(f"{p}: cannot read: {e.strerror or e}") from None
        except json.JSONDecodeError as e:
            raise ResultFileError(f"{p}: not valid JSON: {e}") from None
        return cls.from_json(data, str(p))

    def draft_depth(self, info: Mapping[str, Any]) -> int | None:
        """The draft depth the server ran at: SGLang's `speculative_num_steps` (`/server_info`),
        else the depth most of the measured requests reported (vLLM's per-request
        `num_spec_tokens`, also through specroute); None when neither says. Without it the
        adaptive-server model assumes SGLang's usual 3 (`policies.adaptive`), which mispredicts
        a server drafting 2."""
        reported = _depth(info.get("speculative_num_steps"))
        if reported is not None:
            return reported
        depths: dict[int, int] = {}
        for lv in self.levels:
            for r in lv.requests:
                d = _depth(r.draft_tokens) if r.phase == "measured" else None
                if d is not None:
                    depths[d] = depths.get(d, 0) + 1
        return max(depths, key=lambda d: (depths[d], -d)) if depths else None

    def to_profile(self, mode: Pool, name: str | None = None) -> Profile:
        """A one-mode `specroute.profile/v1` profile: a point per level with decode samples.

        A point's speeds are the level's medians (`robust`), not its means: one request whose
        few tokens arrived in a burst has a huge rate and would drag a mean far from what a
        typical request sees. An eagle mode with per-category speed factors (`category_factors`
        in the metadata) stores the speed they scale (`level_decode`): the median of each
        request's rate over its category's factor."""
        categories = self.metadata.get("category_factors")
        factors = categories if mode == "eagle" and isinstance(categories, dict) else {}
        points = []
        for lv in self.levels:
            s = lv.summary
            if s.decode_tok_s is None or s.decode_tok_s.mean <= 0:
                continue
            points.append(
                {
                    "concurrency": lv.concurrency,
                    "decode_tok_s": round(level_decode(lv, factors), 4),
                    "ttft_s": round(robust(s.ttft_s), 5) if s.ttft_s else 0.0,
                    "samples": s.decode_tok_s.n,
                }
            )
        if not points:
            raise ResultFileError("no level has successful requests with a decode rate: no profile")
        info = self.metadata.get("server_info") or {}
        mode_data: dict[str, Any] = {"points": points}
        if isinstance(info.get("max_running_requests"), int):
            mode_data["max_running_requests"] = info["max_running_requests"]
        accept = accept_length_between(info, self.metadata.get("server_info_end"))
        if accept is None:
            accept = info.get("avg_spec_accept_length")
        if accept is None:  # no counters (e.g. measured through specroute): the requests' own figures
            own = [r.accept_length for lv in self.levels for r in lv.requests
                   if r.phase == "measured" and r.accept_length is not None]  # fmt: skip
            accept = sum(own) / len(own) if own else None
        if mode == "eagle" and isinstance(accept, int | float) and accept > 0:
            mode_data["accept_length"] = round(float(accept), 4)
        depth = self.draft_depth(info) if mode == "eagle" else None
        if depth is not None:
            mode_data["speculative_num_steps"] = depth
        categories = self.metadata.get("category_factors")
        if mode == "eagle" and isinstance(categories, dict) and categories:
            mode_data["categories"] = categories
        md = self.metadata
        source = (
            f"specroute bench {md.get('specroute_version', '?')} against {md.get('url')} "
            f"on {md.get('started')}: {md.get('endpoint')} endpoint, prompt set "
            f"{md.get('prompt_set')}, max_tokens {md.get('max_tokens')}, "
            f"{md.get('requests_per_level')} requests per level after {md.get('warmup')} warm-up"
        )
        source += _prefill_fields(md.get("prefill"), mode_data)
        data: dict[str, Any] = {
            "format": "specroute.profile/v1",
            "name": name or f"{self.label} ({mode})",
            "source": source,
            "modes": {mode: mode_data},
        }
        if info.get("engine") in ("sglang", "vllm"):
            data["engine"] = info["engine"]  # `plan` writes launch lines for it
        return parse_profile(data, "<bench result>")


def _depth(value: object) -> int | None:
    """A draft depth a profile can hold (`ModeProfile.speculative_num_steps`), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_DRAFT_DEPTH:
        return value
    return None


def robust(e: Estimate) -> float:
    """The estimate a profile stores: the median where there is one, else the mean."""
    return e.p50 if e.p50 is not None and e.p50 > 0 else e.mean


def level_decode(lv: LevelResult, factors: Mapping[str, float]) -> float:
    """A level's decode speed as a profile point stores it: `robust` over its measured requests'
    rates, each divided by its category's speed factor in `factors` (1 for a category without
    one). Requests whose categories an EAGLE drafter accepts differently decode at different
    speeds (code twice as fast as prose, say); the profile's speed is what `factors` scale, so a
    request of factor f is predicted at f times it. The plain median of a mix of fast and slow
    categories falls anywhere in the gap between them, and moves with the mix's proportions."""
    if not factors:
        assert lv.summary.decode_tok_s is not None
        return robust(lv.summary.decode_tok_s)
    rates = [
        rate / _factor(factors, r.category)
        for r in lv.requests
        if r.phase == "measured" and (rate := r.decode_tok_s) is not None
    ]
    e = estimate(rates)
    assert e is not None
    return robust(e)


def accept_length_between(start: Any, end: Any) -> float | None:
    """vLLM's accept length between two readings of its counters (`fetch_server_info`'s), e.g.
    before and after a sweep: 1 + accepted / drafts between them (None without both, or without a
    draft in between)."""
    try:
        accepted = float(end["spec_accepted_tokens"]) - float(start["spec_accepted_tokens"])
        drafts = float(end["spec_drafts"]) - float(start["spec_drafts"])
    except (KeyError, TypeError, ValueError):
        return None
    return 1.0 + accepted / drafts if drafts > 0 and accepted >= 0 else None


def _factor(factors: Mapping[str, float], category: str | None) -> float:
    f = factors.get(category, 1.0) if category is not None else 1.0
    return f if isinstance(f, int | float) and f > 0 else 1.0


def _prefill_fields(prefill: Any, mode_data: dict[str, Any]) -> str:
    """Put the `--prefill` measurement (`controller.bench.prefill`) into a profile mode; the
    sentence the profile's source gains ("" without one)."""
    if not isinstance(prefill, dict):
        return ""
    rate = prefill.get("prefill_tok_s")
    points = prefill.get("points") or []
    said = []
    if isinstance(rate, int | float) and rate > 0:
        mode_data["prefill_tok_s"] = round(float(rate), 1)
        tokens = sorted(int(p[0]) for p in points)
        span = f" of {tokens[0]}..{tokens[-1]} tokens" if tokens else ""
        said.append(
            f"prefill_tok_s fitted (least squares, TTFT against prompt tokens) to {len(points)} fresh "
            f"prompts{span} at concurrency 1"
        )
    cache = prefill.get("cache_tokens")
    if isinstance(cache, int) and not isinstance(cache, bool) and cache >= 0:
        mode_data["cache_tokens"] = cache
        said.append("cache_tokens is the server's max_total_num_tokens (its KV pool)")
    return "; " + "; ".join(said) if said else ""
