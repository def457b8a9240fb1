"""deploy/prometheus and deploy/grafana: Prometheus scrapes the compose services (and passes
`promtool check config` where installed); every dashboard query parses as PromQL (`promtool check
rules`) and names only metrics specroute or SGLang export, and the public metrics all have a
panel."""

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
    SGLANG_METRICS,
    SPECROUTE_EXTRA_METRICS,
    SPECROUTE_METRICS,
    dashboard,
    dashboard_queries,
    load_compose,
    metric_base_name,
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


def test_dashboard_uses_known_metrics_and_covers_them() -> None:
    used = {metric_base_name(m) for _, expr in dashboard_queries() for m in METRIC_NAME.findall(expr)}
    unknown = used - SPECROUTE_METRICS - SPECROUTE_EXTRA_METRICS - SGLANG_METRICS
    assert not unknown, f"dashboard queries metrics nobody exports: {sorted(unknown)}"
    missing = SPECROUTE_METRICS - used
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
