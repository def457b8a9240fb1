"""Issue 37, finding 3: one huge prompt trapped `online` (serve's default without a profile). It
learned raw TTFT per load bucket, prefill included and unclipped, so one chat request of ~240k
prompt tokens made the pool it landed on look slow for everyone: 0.00 of the others' requests
(0.66 before), and it was never re-sampled. Now TTFT is learned as a wait per bucket plus a
prefill rate per prompt token, samples are clipped once an estimate is trusted (and rebased on
a persistent change), and a pool unheard of is re-sampled.

The environment is synthetic and runs in virtual time (the policy's `now`), one request every
0.5 s: no waiting."""

from __future__ import annotations

from dataclasses import dataclass, field

from helpers import Routed

from policies.base import POOLS, BackendLoad, Decision, LoadView, Outcome, Policy, PoolLoad, RequestInfo
from policies.registry import PolicyContext, default_registry

VIEW = LoadView(
    PoolLoad("baseline", (BackendLoad("b0", "baseline"),)), PoolLoad("eagle", (BackendLoad("e0", "eagle"),))
)
HUGE = 240_000


def online(**params: object) -> Policy:
    return Routed(default_registry(entry_points=False).create("online", params, PolicyContext(None, 7)), 7)


@dataclass
class Servers:
    """Two pools answering at once (no concurrency): a TTFT wait, a prefill rate, a decode rate per
    pool; a pool prefilling a prompt holds the prompts sent to it behind that prefill."""

    decode: dict[str, float] = field(default_factory=lambda: {"baseline": 100.0, "eagle": 150.0})
    prefill_tok_s: float = 8000.0
    wait_s: float = 0.1
    busy_until: dict[str, float] = field(default_factory=lambda: {"baseline": 0.0, "eagle": 0.0})

    def outcome(self, req: RequestInfo, d: Decision, now: float) -> Outcome:
        queued = max(0.0, self.busy_until[d.pool] - now)
        prefill = req.prompt_tokens / self.prefill_tok_s
        self.busy_until[d.pool] = max(self.busy_until[d.pool], now) + prefill
        ttft = self.wait_s + queued + prefill
        tokens = req.max_tokens or 128
        return Outcome(req, d, now, ttft, tokens, ttft + (tokens - 1) / self.decode[d.pool], "ok")


def traffic(policy: Policy, servers: Servers, start: float, seconds: float) -> list[Decision]:
    """A request of 200 prompt tokens every 0.5 s from `start`, each observed when it is answered."""
    out = []
    for i in range(int(seconds * 2)):
        now = start + i * 0.5
        req = RequestInfo(prompt_tokens=200, max_tokens=128)
        d = policy.choose(req, VIEW, now)
        policy.observe(servers.outcome(req, d, now))
        out.append(d)
    return out


def share(decisions: list[Decision], pool: str) -> float:
    return sum(d.pool == pool for d in decisions) / len(decisions)


def huge_prompt(policy: Policy, servers: Servers, now: float) -> Decision:
    req = RequestInfo(prompt_tokens=HUGE, max_tokens=128)
    d = policy.choose(req, VIEW, now)
    policy.observe(servers.outcome(req, d, now))
    return d


def test_one_huge_prompt_does_not_trap_the_pool_it_landed_on() -> None:
    """The probe's scenario: the others pause while the 240k-token prompt runs (30 s of prefill),
    then resume. Each pool's share in the 30 s after it is within 10% of its share before, and
    the next short request is predicted as before (not 30 s of TTFT)."""
    policy, servers = online(), Servers()
    before = traffic(policy, servers, 0.0, 600.0)[-120:]
    last_short = before[-1]
    d = huge_prompt(policy, servers, 600.0)
    assert d.predicted_ttft_s[d.pool] > 20.0  # its own prefill is predicted
    after = traffic(policy, servers, 600.0 + 31.0, 30.0)
    for pool in ("baseline", "eagle"):
        assert abs(share(after, pool) - share(before, pool)) <= 0.10, (
            pool,
            share(before, pool),
            share(after, pool),
        )
    first = after[0]
    for pool in POOLS:
        assert first.predicted_ttft_s[pool] < 2 * last_short.predicted_ttft_s[pool] + 0.05
    learned = policy.state()["prefill_tok_s"][d.pool]  # type: ignore[attr-defined]
    assert 4000 <= learned <= 16000  # what the huge prompt taught: its pool's prefill rate


def test_requests_queued_behind_a_huge_prompt_move_away_and_come_back() -> None:
    """Others keep coming while the huge prompt prefills: requests sent to that pool meanwhile wait
    behind it (a real slowness, learned), and 10 to 30 s after its end the shares are back."""
    policy, servers = online(), Servers()
    before = traffic(policy, servers, 0.0, 600.0)[-120:]
    d = huge_prompt(policy, servers, 600.0)
    during = traffic(policy, servers, 600.5, 30.0)
    assert share(during, d.pool) < share(before, d.pool)  # it was slow then, and was avoided
    after = traffic(policy, servers, 631.0, 30.0)[20:]
    for pool in ("baseline", "eagle"):
        assert abs(share(after, pool) - share(before, pool)) <= 0.10, (
            pool,
            share(before, pool),
            share(after, pool),
        )


def test_one_absurd_outcome_moves_a_trusted_estimate_little() -> None:
    """One outcome of 1 tok/s decode and 300 s of TTFT (a slow reader, a stalled backend) after
    200 ordinary ones moves the predictions by at most a few percent."""
    policy, servers = online(epsilon=0.0), Servers()
    traffic(policy, servers, 0.0, 100.0)
    req = RequestInfo(prompt_tokens=200, max_tokens=128)
    before = policy.choose(req, VIEW, 100.0)
    bad = Outcome(req, Decision("eagle", "e0", "faster_eagle"), 100.0, 300.0, 128, 300.0 + 127.0, "ok")
    policy.observe(bad)
    after = policy.choose(req, VIEW, 100.5)
    assert after.pool == before.pool == "eagle"
    assert after.predicted_e2e_s["eagle"] <= 1.05 * before.predicted_e2e_s["eagle"]
    assert after.predicted_ttft_s["eagle"] <= before.predicted_ttft_s["eagle"] + 0.2


def test_a_pool_that_looked_slow_is_re_sampled_and_regained() -> None:
    """EAGLE's acceptance collapses for a minute (decode 10 tok/s) and recovers: the policy moves
    to baseline, then re-samples eagle (every resample_s / resample_every, then outcome after
    outcome while it surprises) and is back on it within 20 s of the recovery."""
    policy, servers = online(), Servers()
    before = traffic(policy, servers, 0.0, 300.0)[-120:]
    servers.decode["eagle"] = 10.0
    slow = traffic(policy, servers, 300.0, 60.0)
    assert share(slow[-60:], "eagle") <= 0.1
    servers.decode["eagle"] = 150.0
    back = traffic(policy, servers, 360.0, 60.0)
    assert share(back[40:], "eagle") >= share(before, "eagle") - 0.10
    probes = [i for i, d in enumerate(back) if d.pool == "eagle"]
    assert probes and probes[0] * 0.5 <= 20.0  # re-sampled within two spans (the slow minute grew it)
