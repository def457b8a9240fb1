"""deploy/prometheus and deploy/grafana: Prometheus scrapes the compose services and loads the
alert rules (and passes `promtool check config` where installed); every dashboard query parses as
PromQL (`promtool check rules`) and names only metrics specroute or SGLang export; every metric a
real `specroute serve` registers has a panel; the alert rules pass `promtool check rules` and
their unit tests (`promtool test rules`), each alert is exercised there, queries only metrics
that exist and is documented in docs/operations.md."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from deploy_files import (
    DEPLOY,
    METRIC_NAME,
    ROOT,
    SGLANG_METRICS,
    dashboard,
    dashboard_queries,
    load_compose,
    metric_base_name,
    registered_metrics,
)


def test_prometheus_config_targets_the_compose_services() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"specroute", "sglang"}
    compose = load_compose("compose.yaml")["services"]
    targets = {
        t: group.get("labels", {})
        for job in jobs.values()
        for group in job["static_configs"]
        for t in group["targets"]
    }
    for target, labels in targets.items():
        host = target.split(":")[0]
        assert host in compose, f"prometheus target {target} is not a compose service"
        if host.startswith("sglang-"):
            assert labels == {"pool": host.removeprefix("sglang-")}
    assert "specroute:8000" in targets


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_checks_prometheus_config() -> None:
    proc = subprocess.run(
        ["promtool", "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dashboard_uses_known_metrics_and_covers_every_registered_one() -> None:
    """Every metric the code registers (a live serve's /metrics) has a panel; no exclusions."""
    registered = registered_metrics()
    assert len(registered) >= 40
    used = {metric_base_name(m) for _, expr in dashboard_queries() for m in METRIC_NAME.findall(expr)}
    unknown = used - registered - SGLANG_METRICS
    assert not unknown, f"dashboard queries metrics nobody exports: {sorted(unknown)}"
    missing = registered - used
    assert not missing, f"dashboard shows no panel for {sorted(missing)}"
    for sglang in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:spec_accept_length"):
        assert sglang in used


def test_dashboard_structure() -> None:
    dash = dashboard()
    assert dash["uid"] == "specroute"
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for panel in dash["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"panel {panel['title']!r} overlaps another"
                cells.add((x, y))
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}"
            for var in re.findall(r"\$(\w+)", target["expr"]):
                assert var == "__rate_interval" or var in variables, f"unknown variable ${var}"
    provisioning = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    )
    assert provisioning["datasources"][0]["url"] == "http://prometheus:9090"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_dashboard_queries_parse_as_promql(tmp_path: Path) -> None:
    rules = []
    for i, (title, expr) in enumerate(dashboard_queries()):
        concrete = expr.replace("$__rate_interval", "1m")
        concrete = re.sub(r"\$\w+", ".*", concrete)
        rules.append({"record": f"dashboard:query_{i}", "expr": concrete, "labels": {"panel": title}})
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    proc = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules)} rules found" in proc.stdout


PROMETHEUS = DEPLOY / "prometheus"
ALERTS = PROMETHEUS / "alerts.yml"
ALERT_TESTS = PROMETHEUS / "alerts.test.yml"


def _alerts() -> dict[str, str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return {r["alert"]: r["expr"] for group in rules["groups"] for r in group["rules"]}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_alert_rules_pass_promtool_check_and_their_unit_tests() -> None:
    check = subprocess.run(
        ["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {len(_alerts())} rules found" in check.stdout
    test = subprocess.run(
        ["promtool", "test", "rules", ALERT_TESTS.name],
        cwd=PROMETHEUS,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert test.returncode == 0, test.stdout + test.stderr
    assert "SUCCESS" in test.stdout


def test_every_alert_is_exercised_firing_and_quiet() -> None:
    """Each alert has a unit test where it fires and one where it does not (before its `for:`
    or on the healthy series beside), so no rule ships untested."""
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in yaml.safe_load(ALERT_TESTS.read_text())["tests"]:
        for check in case["alert_rule_test"]:
            (fires if check["exp_alerts"] else quiet).add(check["alertname"])
    assert set(_alerts()) == fires, set(_alerts()) ^ fires
    assert set(_alerts()) <= quiet, set(_alerts()) - quiet


def test_alerts_cover_what_operators_must_know_and_query_real_metrics() -> None:
    alerts = _alerts()
    used = {metric_base_name(m) for expr in alerts.values() for m in METRIC_NAME.findall(expr)}
    assert used <= registered_metrics(), used - registered_metrics()
    for metric in (
        "specroute_backend_ejections_total",  # ejections
        "specroute_config_last_reload_successful",  # reload failures
        "specroute_admission_rejections_total",  # 429s
        "specroute_memory_budget_refusals_total",  # memory budget refusals
        "specroute_profile_mismatches_total",  # profile mismatches
        "specroute_prediction_ratio",  # prediction error
    ):
        assert metric in used, f"no alert on {metric}"
    operations = (ROOT / "docs" / "operations.md").read_text()
    undocumented = [name for name in alerts if f"`{name}`" not in operations]
    assert not undocumented, f"docs/operations.md does not explain {undocumented}"


def test_prometheus_loads_the_alert_rules_in_compose() -> None:
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    assert config["rule_files"] == ["alerts.yml"]
    volumes = load_compose("compose.yaml")["services"]["prometheus"]["volumes"]
    assert "./prometheus/alerts.yml:/etc/prometheus/alerts.yml:ro" in volumes
