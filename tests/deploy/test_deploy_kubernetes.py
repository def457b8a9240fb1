"""deploy/kubernetes/: the manifests validate against the Kubernetes JSON schemas
(kubernetes-validate, offline, strict, where installed); the Deployment, Service, generated
ConfigMap, NetworkPolicy and ServiceMonitors agree with each other and with the config (ports,
probes, grace period, replicas, mounts, state file); the config is a kustomize
configMapGenerator (an edited config rolls the pods); and the container's `specroute serve`
args parse with the real CLI."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_files import (
    K8S,
    arg_value,
    check_specroute_command,
    config_map_generator,
    configmap_config,
    k8s_deployment,
    yaml_docs,
)

from controller.proxy.config import load_settings


def _manifests() -> Iterator[tuple[str, dict[str, Any]]]:
    generated = set(config_map_generator()["files"])
    for path in sorted(K8S.glob("*.yaml")):
        if path.name == "kustomization.yaml" or path.name in generated:
            continue
        for doc in yaml_docs(path):
            yield path.name, doc


def test_kubernetes_manifests_validate_against_schemas() -> None:
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    checked = []
    for name, doc in _manifests():
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: no schema in the Kubernetes set; see the structural test
        try:
            kv.validate(doc, "1.30", strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{name} {doc['kind']}: {e}")
        checked.append(doc["kind"])
    assert sorted(checked) == ["Deployment", "NetworkPolicy", "PodDisruptionBudget", "Service"]


def test_kubernetes_structure(tmp_path: Path) -> None:
    kinds: dict[str, list[dict[str, Any]]] = {}
    for _, doc in _manifests():
        assert doc.get("apiVersion") and doc.get("kind") and doc["metadata"]["name"]
        kinds.setdefault(doc["kind"], []).append(doc)
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    for resource in kustomization["resources"]:
        assert (K8S / resource).is_file(), resource
    generator = config_map_generator()
    shipped = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert shipped == set(kustomization["resources"]) | set(generator["files"])
    # a generated ConfigMap's name carries its content's hash, which kustomize writes into the
    # Deployment too: an edited config rolls the pods (unless hashes were turned off)
    assert "ConfigMap" not in kinds
    assert not generator.get("options", {}).get("disableNameSuffixHash")
    assert not kustomization.get("generatorOptions", {}).get("disableNameSuffixHash")

    dep = k8s_deployment()
    assert dep["apiVersion"] == "apps/v1"
    pod = dep["spec"]["template"]["spec"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (container,) = pod["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] in ports
    assert container["resources"]["requests"]["cpu"] and container["resources"]["limits"]["memory"]
    assert pod["securityContext"]["runAsNonRoot"] is True

    settings = load_settings(environ={}, config_file=configmap_config(tmp_path))
    assert settings.port in ports.values()
    assert settings.replicas == dep["spec"]["replicas"]  # each replica is told how many there are
    # SIGTERM comes after preStop (none: specroute's shutdown_grace_s covers the endpoint update)
    pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
    pause = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
    assert settings.shutdown_grace_s >= 5  # kube-proxy and ingresses take seconds to drop the pod
    grace = settings.shutdown_grace_s + settings.drain_timeout_s
    assert pod["terminationGracePeriodSeconds"] > pause + grace + 2  # exit takes ~1 s after the drain
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    (config_volume,) = [v for v in pod["volumes"] if "configMap" in v]
    assert config_volume["configMap"]["name"] == generator["name"]
    assert arg_value(container["args"], "--config").startswith(mounts[config_volume["name"]] + "/")
    assert settings.decision_log is not None
    assert Path(settings.decision_log).parent == Path(mounts["logs"])
    # the state file on a writable volume of its own (the root file system is read-only)
    assert settings.state_file is not None
    assert Path(settings.state_file).parent == Path(mounts["state"])
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert "emptyDir" in next(v for v in pod["volumes"] if v["name"] == "state")

    # the NetworkPolicy covers these pods' port: clients by label, Prometheus, no one else
    (policy,) = kinds["NetworkPolicy"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    rules = policy["spec"]["ingress"]
    assert all(port["port"] in ports for rule in rules for port in rule["ports"])
    peers = [peer for rule in rules for peer in rule["from"]]
    assert all(peer.get("podSelector", {}).get("matchLabels") for peer in peers)  # never "anyone"
    assert any(peer["podSelector"]["matchLabels"].get("specroute.io/client") == "true" for peer in peers)
    assert any(
        peer["podSelector"]["matchLabels"].get("app.kubernetes.io/name") == "prometheus" for peer in peers
    )

    (service,) = kinds["Service"]
    assert service["spec"]["selector"].items() <= labels.items()
    (sport,) = service["spec"]["ports"]
    assert sport["targetPort"] in ports

    monitors = {m["metadata"]["name"]: m for m in kinds["ServiceMonitor"]}
    own = monitors["specroute"]
    assert own["apiVersion"] == "monitoring.coreos.com/v1"
    assert own["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in own["spec"]["endpoints"]] == [sport["name"]]
    assert all(e["path"] == "/metrics" for m in monitors.values() for e in m["spec"]["endpoints"])


def test_kubernetes_command_is_accepted() -> None:
    (container,) = k8s_deployment()["spec"]["template"]["spec"]["containers"]
    assert "command" not in container, "the image's entrypoint (specroute serve) is expected"
    check_specroute_command("serve", container["args"], "deployment.yaml args")
