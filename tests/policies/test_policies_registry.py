"""The policy registry: built-ins, parameters described for listings, user policies by
import path and by entry point, and clear errors for everything that can go wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, ConfigDict

from policies.base import BackendLoad, LoadView, PoolLoad, RequestInfo
from policies.fixed import SPEC as FIXED
from policies.profile import parse_profile, resolve_profile
from policies.registry import PolicyContext, PolicyError, PolicyRegistry, PolicySpec, default_registry
from policies.routing import Router
from policies.spec import NoParams

BUILTINS = ["cache_only", "cost_model", "fixed", "online", "round_robin", "threshold"]
VIEW = LoadView(
    PoolLoad("baseline", (BackendLoad("b0", "baseline"),)),
    PoolLoad("eagle", (BackendLoad("e0", "eagle"),)),
)


@pytest.fixture
def reg() -> PolicyRegistry:
    return default_registry(entry_points=False)


def test_builtins_are_registered_and_described(reg: PolicyRegistry) -> None:
    assert reg.names() == BUILTINS
    for spec in reg.specs():
        assert spec.help
        rows = list(spec.describe_params())
        assert rows or spec.params is NoParams, spec.name  # the comparison routers take none
        for key, typ, default, help_ in rows:
            assert key and typ and default and help_, (spec.name, key)
            assert "typing" not in typ and "Annotated" not in typ
    by_key = {(s.name, r[0]): r for s in reg.specs() for r in s.describe_params()}
    assert by_key[("fixed", "pool")][1:3] == ("baseline|eagle", "baseline")
    assert by_key[("threshold", "signal")][1:3] == ("local|scraped|max", "max")
    assert by_key[("cost_model", "hint_speedup")][1:3] == ("dict[str, float]", "{}")
    assert by_key[("cost_model", "mean_output_tokens")][1:3] == ("float | None", "null")
    assert by_key[("online", "buckets")][1] == "list[int]"
    assert reg.get("cost_model").needs_profile and not reg.get("online").needs_profile


def test_every_builtin_can_be_created_and_routes(reg: PolicyRegistry) -> None:
    ctx = PolicyContext(resolve_profile("kimi-k25-int4-8gpu"), seed=1)
    for name in BUILTINS:
        policy = reg.create(name, {}, ctx)
        d = policy.choose(RequestInfo(), VIEW, 0.0)
        assert d.policy == name and d.pool in ("baseline", "eagle")
        d = Router(1).decide(policy, RequestInfo(), VIEW, 0.0)  # the core picks the backend
        assert d.backend == {"baseline": "b0", "eagle": "e0"}[d.pool]


def test_unknown_policy_lists_the_known_ones(reg: PolicyRegistry) -> None:
    with pytest.raises(
        PolicyError, match=r"unknown policy 'fastest'; known policies: cache_only, cost_model, fixed, online"
    ):
        reg.create("fastest")


def test_duplicate_registration_raises(reg: PolicyRegistry) -> None:
    with pytest.raises(PolicyError, match="'fixed' is already registered"):
        reg.register(FIXED)


def test_params_from_strings_as_a_cli_gives_them(reg: PolicyRegistry) -> None:
    p = reg.parse_params("threshold", {"threshold": "5", "hysteresis": "2", "signal": "local"})
    assert p.model_dump() == {"threshold": 5, "hysteresis": 2, "signal": "local"}
    with pytest.raises(PolicyError, match=r"policy 'threshold': invalid parameter threshold: .*integer"):
        reg.parse_params("threshold", {"threshold": "five"})
    with pytest.raises(PolicyError, match="hint_speedup"):
        reg.parse_params("cost_model", {"hint_speedup": "{not json"})


def test_plugin_by_import_path(reg: PolicyRegistry) -> None:
    name = "plugin_policy_example:AlternatingPolicy"
    spec = reg.get(name)
    assert spec.help == "Alternate between the pools, one request each."
    assert [r[:3] for r in spec.describe_params()] == [("first", "baseline|eagle", "baseline")]
    policy = reg.create(name, {"first": "eagle"})
    assert [policy.choose(RequestInfo(), VIEW, 0.0).pool for _ in range(3)] == ["eagle", "baseline", "eagle"]
    with pytest.raises(PolicyError, match="invalid parameter first"):
        reg.create(name, {"first": "turbo"})


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no_such_module_xyz:Policy", "cannot import module 'no_such_module_xyz': ModuleNotFoundError"),
        ("plugin_policy_example:Missing", "module 'plugin_policy_example' has no attribute 'Missing'"),
        ("plugin_policy_example:NotAPolicy", "class NotAPolicy lacks choose() and observe()"),
        ("plugin_policy_example:BadParams", "BadParams.Params must be a pydantic model"),
        ("plugin_policy_example:FailsToStart", "cannot be created: RuntimeError: no GPU here"),
        ("plugin_policy_example:", "expected module.path:ClassName"),
    ],
)
def test_bad_plugins_fail_clearly(reg: PolicyRegistry, name: str, message: str) -> None:
    with pytest.raises(PolicyError) as info:
        reg.create(name)
    assert message in str(info.value)
    assert name in str(info.value)
    if "import" in message or "attribute" in message:
        assert "known policies: cache_only, cost_model, fixed, online, round_robin, threshold" in str(
            info.value
        )


@pytest.fixture
def plugin_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real (if tiny) installed distribution on sys.path, as pip would leave it, with one
    working and one broken entry point in the `specroute.policies` group."""
    dist = tmp_path / "specroute_fake_plugin-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: specroute-fake-plugin\nVersion: 1.0\n", encoding="utf-8"
    )
    (dist / "entry_points.txt").write_text(
        "[specroute.policies]\n"
        "alternating = plugin_policy_example:AlternatingPolicy\n"
        "broken = no_such_module_xyz:Policy\n",
        encoding="utf-8",
    )
    monkeypatch.syspath_prepend(str(tmp_path))


def test_entry_point_plugins_are_listed_and_a_broken_one_is_isolated(plugin_dist: None) -> None:
    reg = default_registry()
    assert "alternating" in reg.names() and "broken" not in reg.names()
    assert reg.create("alternating", {"first": "eagle"}).choose(RequestInfo(), VIEW, 0.0).pool == "eagle"
    assert "broken" in reg.broken()
    with pytest.raises(PolicyError, match=r"entry point 'broken' \(no_such_module_xyz:Policy\)"):
        reg.create("broken")


def test_profile_problems_become_policy_errors(reg: PolicyRegistry) -> None:
    with pytest.raises(PolicyError, match=r"policy 'cost_model' needs a speed profile"):
        reg.create("cost_model")
    baseline_only = parse_profile(
        {
            "format": "specroute.profile/v1",
            "modes": {"baseline": {"points": [{"concurrency": 1, "decode_tok_s": 9}]}},
        }
    )
    with pytest.raises(PolicyError, match="no eagle mode"):
        reg.create("cost_model", {}, PolicyContext(baseline_only))
    # online works without a profile and with a partial one
    assert reg.create("online", {}, PolicyContext(baseline_only)).choose(RequestInfo(), VIEW, 0.0)


def test_custom_spec_registration() -> None:
    class Params(BaseModel):
        model_config = ConfigDict(extra="forbid")

    reg = PolicyRegistry()
    reg.register(PolicySpec("mine", Params, lambda p, ctx: FIXED.factory(FIXED.params(), ctx), help="h"))
    assert reg.names() == ["mine"]
    with pytest.raises(PolicyError, match="known policies: mine"):
        reg.get("yours")


def test_policies_command_lists_entry_point_plugins_and_broken_ones(
    plugin_dist: None, capsys: pytest.CaptureFixture[str]
) -> None:
    from controller.cli import main

    assert main(["policies"]) == 0
    out = capsys.readouterr().out
    assert "alternating" in out.splitlines() and "--policy-param first=" in out  # listed with its parameters
    # a plugin that fails to load is named with the reason, not silently left out
    assert "broken  (installed plugin that failed to load" in out
    assert "no_such_module_xyz" in out
