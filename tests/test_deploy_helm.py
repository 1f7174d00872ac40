"""deploy/helm/voxtriton: the chart renders with Helm's own engine (the Helm v4 SDK through
helm-python-sdk), lints clean, and every manifest it renders validates against the Kubernetes
schemas (kubernetes-validate, offline). No cluster is involved."""

from __future__ import annotations

import re

import pytest
import yaml
from test_deploy_envoy import ENVOY_DIR, validate

CHART = ENVOY_DIR.parent / "helm" / "voxtriton"
KUBERNETES = ("1.30.0", "1.37.0")  # the oldest and the newest minor versions checked
EVERYTHING = {
    "checkpoint": {"persistentVolumeClaim": "qwen3-tts-1.7b"},
    "metrics": {"serviceMonitor": {"enabled": True}},
    "autoscaling": {"enabled": True},
    "voices": {"persistentVolumeClaim": "voxtriton-voices"},
}
VALUES = {
    "defaults": {},
    "everything on": EVERYTHING,
    "servers and a hostPath only": {
        "checkpoint": {"hostPath": "/data/qwen3-tts"},
        "gateway": {"enabled": False},
        "envoy": {"enabled": False},
        "metrics": {"annotations": False},
    },
    "shared voices, the built-in checkpoint": {"voices": {"persistentVolumeClaim": "voxtriton-voices"}},
}
# Custom resources have no schema in kubernetes-validate: their fields are checked below.
CUSTOM = {"ServiceMonitor"}


def tools():
    try:
        import helm_python
        import kubernetes_validate
    except ImportError as error:
        pytest.fail(f"{error.name} is not installed (it comes with the test extra)")
    return helm_python, kubernetes_validate


def render(values: dict) -> list[dict]:
    helm, _ = tools()
    rendered = helm.Chart.load(CHART).render(values, name="tts", namespace="speech")
    return [doc for text in rendered.values() for doc in yaml.safe_load_all(text) if doc]


def by_kind(manifests: list[dict], kind: str, suffix: str = "") -> dict:
    (found,) = [m for m in manifests if m["kind"] == kind and m["metadata"]["name"].endswith(suffix)]
    return found


def schema_errors(manifests: list[dict], version: str) -> list[str]:
    _, kubernetes_validate = tools()
    errors = []
    for manifest in manifests:
        if manifest["kind"] in CUSTOM:
            continue
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as error:
            errors.append(f"{manifest['kind']} {manifest['metadata']['name']}: {error.message}")
    return errors


def test_the_chart_lints_clean():
    helm, _ = tools()
    for values in VALUES.values():
        report = helm.lint(CHART, values, strict=True)
        assert report["errors"] == [] and all(m["severity"] < 2 for m in report["messages"]), report


@pytest.mark.parametrize("version", KUBERNETES)
@pytest.mark.parametrize("case", VALUES)
def test_every_manifest_validates_against_the_kubernetes_schemas(case, version):
    manifests = render(VALUES[case])
    assert manifests and schema_errors(manifests, version) == []


def test_an_invalid_manifest_fails_validation():
    # a misspelt key inside resources, which the chart passes through as given
    manifests = render({"triton": {"resources": {"limits": {"nvidia.com/gpu": 1}, "request": {"cpu": 8}}}})
    [error] = schema_errors(manifests, KUBERNETES[-1])
    assert error == (
        "Deployment tts-voxtriton-triton: Additional properties are not allowed ('request' was unexpected)"
    )


@pytest.mark.parametrize(
    "values,message",
    [
        ({"triton": {"replicas": "two"}}, "at '/triton/replicas': got string, want integer"),
        ({"triton": {"shmSize": "lots"}}, "at '/triton/shmSize': 'lots' does not match pattern"),
        ({"autoscaling": {"targetActiveStreams": 0}}, "at '/autoscaling/targetActiveStreams': minimum"),
    ],
)
def test_bad_values_are_refused_naming_the_value(values, message):
    helm, _ = tools()
    with pytest.raises(helm.HelmValuesError, match=re.escape(message)):
        render(values)


def test_one_server_per_gpu_with_its_shared_memory_probes_and_checkpoint():
    manifests = render({**EVERYTHING, "triton": {"shmSize": "16Gi"}})
    pod = by_kind(manifests, "Deployment", "-triton")["spec"]["template"]["spec"]
    (server,) = pod["containers"]
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 1 and server["args"][0] == "serve"
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert volumes["checkpoint"]["persistentVolumeClaim"] == {"claimName": "qwen3-tts-1.7b", "readOnly": True}
    mounts = {mount["name"]: mount["mountPath"] for mount in server["volumeMounts"]}
    assert mounts == {"dshm": "/dev/shm", "checkpoint": "/models/checkpoint", "voices": "/voices"}
    assert server["readinessProbe"]["httpGet"]["path"] == "/v2/models/tts/ready"
    assert server["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    startup = server["startupProbe"]
    assert startup["httpGet"]["path"] == "/v2/models/tts/ready"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1200  # kernels compile on first start
    ports = {port["name"]: port["containerPort"] for port in server["ports"]}
    assert ports == {"http": 8000, "grpc": 8001, "metrics": 8002}


def test_envoy_balances_over_the_headless_service_with_the_repository_config(tmp_path):
    manifests = render({})
    headless = by_kind(manifests, "Service", "-triton-headless")
    assert headless["spec"]["clusterIP"] == "None"
    config = yaml.safe_load(by_kind(manifests, "ConfigMap", "-envoy")["data"]["envoy.yaml"])
    clusters = {cluster["name"]: cluster for cluster in config["static_resources"]["clusters"]}
    [[server]] = [e["lb_endpoints"] for e in clusters["triton"]["load_assignment"]["endpoints"]]
    assert server["endpoint"]["address"]["socket_address"] == {
        "address": "tts-voxtriton-triton-headless.speech.svc.cluster.local",
        "port_value": 8001,
    }
    assert server["endpoint"]["health_check_config"] == {"port_value": 8000}
    # everything but the endpoints is deploy/envoy/envoy.yaml's
    original = yaml.safe_load((ENVOY_DIR / "envoy.yaml").read_text())
    for cluster in (*clusters.values(), *original["static_resources"]["clusters"]):
        del cluster["load_assignment"]
    assert config == original
    (tmp_path / "envoy.yaml").write_text(yaml.safe_dump(config))
    assert validate(tmp_path / "envoy.yaml").returncode == 0
    gateway = by_kind(manifests, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert gateway["args"][-2:] == ["--backend", "tts-voxtriton-envoy:9001"]


def test_metrics_are_scraped_and_the_servers_scale_on_streams_in_flight():
    manifests = render(EVERYTHING)
    service = by_kind(manifests, "Service", "-triton")
    monitor = by_kind(manifests, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == ["metrics"]
    assert {"name": "metrics", "port": 8002, "targetPort": "metrics"} in service["spec"]["ports"]
    hpa = by_kind(manifests, "HorizontalPodAutoscaler")
    assert (
        hpa["spec"]["scaleTargetRef"]["name"]
        == by_kind(manifests, "Deployment", "-triton")["metadata"]["name"]
    )
    [metric] = hpa["spec"]["metrics"]
    assert metric["pods"]["metric"]["name"] == "voxtriton_active_streams"
    assert metric["pods"]["target"] == {"type": "AverageValue", "averageValue": "900"}
    assert "replicas" not in by_kind(manifests, "Deployment", "-triton")["spec"]  # the autoscaler's
    annotations = by_kind(render({}), "Deployment", "-triton")["spec"]["template"]["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == "8002"


@pytest.mark.parametrize("checkpoint", [{}, {"persistentVolumeClaim": "qwen3-tts-1.7b"}])
def test_servers_and_gateways_share_the_registered_voices(checkpoint):
    """A voice registered through any gateway pod is written where every server reads voices."""
    manifests = render({"checkpoint": checkpoint, "voices": {"persistentVolumeClaim": "voxtriton-voices"}})
    for component in ("-triton", "-gateway"):
        pod = by_kind(manifests, "Deployment", component)["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        assert volumes["voices"]["persistentVolumeClaim"] == {"claimName": "voxtriton-voices"}
        mounts = {mount["name"]: mount["mountPath"] for mount in container["volumeMounts"]}
        assert mounts["voices"] == "/voices" and ("checkpoint" in mounts) == bool(checkpoint)
    server = by_kind(manifests, "Deployment", "-triton")["spec"]["template"]["spec"]["containers"][0]
    assert server["args"][-2:] == ["--param", "tts:voices_dir=/voices"]
    gateway = by_kind(manifests, "Deployment", "-gateway")["spec"]["template"]["spec"]["containers"][0]
    assert gateway["args"][-2:] == ["--voices-dir", "/voices"]
    # without a claim no pod mounts one
    for manifest in render({}):
        if manifest["kind"] == "Deployment":
            volumes = manifest["spec"]["template"]["spec"].get("volumes", [])
            assert "voices" not in {volume["name"] for volume in volumes}
