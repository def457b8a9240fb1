"""deploy/gateway/: the Kubernetes manifests build with `kubectl kustomize`, the core kinds validate
against Kubernetes' schemas (kubernetes-validate, strict) and the InferencePool against the
released Gateway API Inference Extension CRD (v1.6.0's openAPIV3Schema, read from
/work/shared/data/gie, or the file `SPECROUTE_GIE_CRD` names); the pieces agree with each other
(the pool's endpoint picker is the picker's Service and gRPC port, the probes ask the protocol's
health services, the config is a valid specroute config); and Envoy accepts
deploy/gateway/envoy.yaml (`envoy --mode validate`)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from gateway_setup import ENVOY_YAML, ROOT, envoy_binary

from controller.cli import build_parser
from controller.proxy.config import load_settings

K8S = ROOT / "deploy" / "gateway" / "kubernetes"
GIE_CRD = Path(
    os.environ.get("SPECROUTE_GIE_CRD")
    or "/work/shared/data/gie/inference.networking.k8s.io_inferencepools.yaml"
)


def _built() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: `kubectl kustomize` cannot build deploy/gateway/kubernetes")
    out = subprocess.run([kubectl, "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    kinds: dict[str, dict[str, Any]] = {}
    for d in docs:
        assert d["kind"] not in kinds, f"two {d['kind']}s"
        kinds[d["kind"]] = d
    return kinds


def test_kustomize_builds_every_manifest_and_the_core_kinds_validate() -> None:
    docs = _built()
    kinds = _by_kind(docs)
    assert set(kinds) == {"ConfigMap", "Deployment", "Service", "InferencePool", "HTTPRoute"}
    for d in docs:
        assert d["metadata"]["labels"]["app.kubernetes.io/part-of"] == "specroute"
    kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is not installed")
    for kind in ("ConfigMap", "Deployment", "Service"):
        try:
            kv.validate(kinds[kind], "1.30", strict=True)
        except kv.ValidationError as e:
            pytest.fail(f"{kind}: {e}")


def test_inference_pool_follows_the_released_crd() -> None:
    if not GIE_CRD.exists():
        pytest.skip(
            f"{GIE_CRD} is absent (the released InferencePool CRD, see its SOURCES.md; "
            "SPECROUTE_GIE_CRD names another copy)"
        )
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema (check-jsonschema's) is not installed")
    crd = yaml.safe_load(GIE_CRD.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    schema = version["schema"]["openAPIV3Schema"]
    pool = yaml.safe_load((K8S / "inferencepool.yaml").read_text())
    assert pool["apiVersion"] == f"{crd['spec']['group']}/v1" and pool["kind"] == crd["spec"]["names"]["kind"]
    jsonschema.validate(pool, schema)
    # The schema's CEL rule (x-kubernetes-validations), which JSON schema cannot express:
    ref = pool["spec"]["endpointPickerRef"]
    assert ref.get("kind", "Service") != "Service" or "port" in ref
    broken = {**pool, "spec": {**pool["spec"], "targetPorts": [{"number": 70000}]}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_the_pool_the_picker_and_its_config_agree(tmp_path: Path) -> None:
    docs = {d["kind"]: d for f in sorted(K8S.glob("*.yaml")) if f.name != "kustomization.yaml"
            for d in yaml.safe_load_all(f.read_text()) if d}  # fmt: skip
    pool, service, dep = docs["InferencePool"], docs["Service"], docs["Deployment"]
    ref = pool["spec"]["endpointPickerRef"]
    assert ref["name"] == service["metadata"]["name"] and ref["failureMode"] == "FailOpen"
    sports = {p["port"]: p for p in service["spec"]["ports"]}
    grpc_port = sports[ref["port"]["number"]]
    assert grpc_port["appProtocol"] == "kubernetes.io/h2c"
    pod = dep["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (container,) = pod["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = container["args"]
    assert int(args[args.index("--port") + 1]) == ports[grpc_port["targetPort"]]
    assert container["command"] == ["specroute", "picker"]
    parsed = build_parser(only="picker").parse_args(["picker", *args])  # the real CLI takes them
    assert (parsed.port, parsed.metrics_port, parsed.host) == ("9002", ports["http-metrics"], "0.0.0.0")
    assert container["readinessProbe"]["grpc"] == {
        "port": ports[grpc_port["targetPort"]],
        "service": "readiness",
    }
    assert container["livenessProbe"]["grpc"]["service"] == "liveness"
    route = docs["HTTPRoute"]
    (backend,) = route["spec"]["rules"][0]["backendRefs"]
    assert backend["kind"] == "InferencePool" and backend["name"] == pool["metadata"]["name"]

    config = yaml.safe_load(docs["ConfigMap"]["data"]["specroute.yaml"])
    (tmp_path / "specroute.yaml").write_text(yaml.safe_dump(config))
    settings = load_settings(environ={}, config_file=str(tmp_path / "specroute.yaml"))
    assert settings.replicas == dep["spec"]["replicas"]
    target = pool["spec"]["targetPorts"][0]["number"]
    assert all(b.url.endswith(f":{target}") for b in settings.backends())


def test_envoy_accepts_the_plain_envoy_config() -> None:
    binary = envoy_binary()
    out = subprocess.run(
        [binary, "--mode", "validate", "-c", str(ENVOY_YAML), "--disable-hot-restart"],
        capture_output=True, text=True, cwd=str(ROOT), timeout=120,
    )  # fmt: skip
    assert out.returncode == 0 and "OK" in out.stdout + out.stderr, out.stdout + out.stderr
