"""The chart's endpoint-picker objects (`epp.enabled`): rendered by Helm's own engine (as tests/test_helm.py
does), the built-in kinds checked against the Kubernetes schemas, the Gateway API and Inference Extension kinds
against their published CRDs (../shared/k8s-schemas/, each served version's openAPIV3Schema), and the wiring:
the picker's command line parses with the real `kvroute epp` parser, the pool selects the worker pods and targets
the HTTP port they serve, its endpointPickerRef reaches the picker's container port."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from test_helm import (
    CHART,
    MIN_KUBE_VERSION,
    Peer,
    Release,
    admitted,
    chart,
    parse_kvroute,
    render_values,
)

SCHEMAS = Path(__file__).resolve().parents[2] / "shared" / "k8s-schemas"
CRDS = {
    "InferencePool": "inference.networking.k8s.io_inferencepools.yaml",
    "HTTPRoute": "gateway.networking.k8s.io_httproutes.yaml",
    "GRPCRoute": "gateway.networking.k8s.io_grpcroutes.yaml",
}
EPP_VALUES: dict[str, Any] = {
    "epp": {
        "enabled": True,
        "failureMode": "FailOpen",
        "gatewayRef": {"name": "inference-gateway", "sectionName": "http"},
    },
    "gateway": {
        "httpRoute": {"enabled": True, "parentRefs": [{"name": "inference-gateway"}]},
        "grpcRoute": {"enabled": True, "parentRefs": [{"name": "inference-gateway"}]},
    },
}

pytestmark = pytest.mark.skipif(not SCHEMAS.is_dir(), reason=f"no CRD schemas at {SCHEMAS}")


def _render(values: dict[str, Any]) -> list[dict[str, Any]]:
    return render_values(values).objects


@pytest.fixture(scope="module")
def objects() -> list[dict[str, Any]]:
    return _render(EPP_VALUES)


def _one(objects: list[dict[str, Any]], kind: str, name_suffix: str = "") -> dict[str, Any]:
    (found,) = [o for o in objects if o["kind"] == kind and o["metadata"]["name"].endswith(name_suffix)]
    return found


def _crd_schemas(kind: str) -> dict[str, dict[str, Any]]:
    crd = yaml.safe_load((SCHEMAS / CRDS[kind]).read_text())
    return {v["name"]: v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v.get("served")}


def test_custom_kinds_validate_against_their_crds(objects: list[dict[str, Any]]) -> None:
    seen = set()
    for obj in objects:
        if obj["kind"] not in CRDS:
            continue
        group, version = obj["apiVersion"].split("/")
        schemas = _crd_schemas(obj["kind"])
        assert version in schemas, f"{obj['kind']} {version} is not a served version ({sorted(schemas)})"
        jsonschema.validate(obj, schemas[version])
        seen.add(obj["kind"])
    assert seen == set(CRDS), seen
    assert len([o for o in objects if o["kind"] == "HTTPRoute"]) == 2, "the gateway's route and the pool's"


def test_built_in_kinds_validate(objects: list[dict[str, Any]]) -> None:
    for obj in objects:
        if obj["kind"] in CRDS or obj["kind"] == "ServiceMonitor":
            continue
        kubernetes_validate.validate(obj, MIN_KUBE_VERSION, strict=True)


def test_off_by_default() -> None:
    objects = _render({})
    assert not [o for o in objects if o["kind"] == "InferencePool" or o["metadata"]["name"].endswith("-epp")]
    worker = _one(objects, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]
    assert "--http-port" not in worker["args"]


def test_the_pool_selects_the_workers_and_targets_their_http_port(objects: list[dict[str, Any]]) -> None:
    pool = _one(objects, "InferencePool")["spec"]
    workers = _one(objects, "StatefulSet")
    template = workers["spec"]["template"]
    assert pool["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    container = template["spec"]["containers"][0]
    port = pool["targetPorts"][0]["number"]
    assert parse_kvroute(container["args"]).http_port == port
    assert {"name": "http", "containerPort": port, "protocol": "TCP"} in container["ports"]
    assert pool["endpointPickerRef"]["failureMode"] == "FailOpen"


def test_the_picker_ref_reaches_the_epp_container(objects: list[dict[str, Any]]) -> None:
    ref = _one(objects, "InferencePool")["spec"]["endpointPickerRef"]
    service = _one(objects, "Service", "-epp")
    assert service["metadata"]["name"] == ref["name"]
    (port,) = [p for p in service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    deployment = _one(objects, "Deployment", "-epp")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    args = [a.replace("$(KVROUTE_POLICY)", "kv_aware") for a in container["args"]]
    parsed = parse_kvroute(args)
    assert parsed.command == "epp" and parsed.port == named[port["targetPort"]]
    assert parsed.target_port == _one(objects, "InferencePool")["spec"]["targetPorts"][0]["number"]
    assert parsed.redis, "the picker reads the chart's Redis fleet state"
    assert container["readinessProbe"]["grpc"] == {"port": parsed.port, "service": "readiness"}
    # SIGTERM: NOT_SERVING while deciding for drainDelay, then drainTimeout for the streams, within the grace
    assert (parsed.drain_delay, parsed.drain_timeout) == (5.0, 30.0)
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace >= parsed.drain_delay + parsed.drain_timeout + 5


def test_the_route_sends_the_gateway_to_the_pool(objects: list[dict[str, Any]]) -> None:
    route = _one(objects, "HTTPRoute", "-pool")["spec"]
    assert route["parentRefs"][0]["name"] == "inference-gateway" and route["parentRefs"][0]["sectionName"] == "http"
    (backend,) = route["rules"][0]["backendRefs"]
    assert backend == {
        "group": "inference.networking.k8s.io",
        "kind": "InferencePool",
        "name": _one(objects, "InferencePool")["metadata"]["name"],
    }


def test_chart_lints_with_the_epp_on() -> None:
    import helm_python as helm

    report = helm.lint(str(CHART), copy.deepcopy(EPP_VALUES), strict=True, kube_version=f"v{MIN_KUBE_VERSION}")
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], problems or report["errors"]


@pytest.mark.parametrize(
    "gateway_from", [[], [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gw"}}}]]
)
def test_network_policy_admits_the_pickers_flows(gateway_from: list[dict[str, Any]]) -> None:
    """With the chart's NetworkPolicies on (the default): the picker reaches Redis, the Gateway's data plane
    reaches the picker's port and the workers' HTTP port (anyone, when epp.gatewayFrom is empty), and the
    workers' gRPC port stays the gateways' only."""
    values = copy.deepcopy(EPP_VALUES)
    values["epp"]["gatewayFrom"] = gateway_from
    release = Release(chart().merge_values(copy.deepcopy(values)), _render(values), "")
    pods = {c.spec["name"]: c for c in release.containers()}
    envoy = Peer("envoy", {"app": "envoy"}, namespace="gw")
    stranger = Peer("stranger", {"app": "x"}, namespace="elsewhere")
    epp_peer = Peer("epp", pods["epp"].pod["metadata"]["labels"])
    worker, epp = pods["worker"], pods["epp"]
    redis_port = int(pods["redis"].ports["redis"])
    assert admitted(release, epp_peer, pods["redis"], redis_port)
    assert admitted(release, envoy, worker, worker.ports["http"])
    assert admitted(release, envoy, epp, epp.ports["grpc"])
    assert admitted(release, stranger, worker, worker.ports["http"]) is not bool(gateway_from)
    assert admitted(release, stranger, epp, epp.ports["grpc"]) is not bool(gateway_from)
    assert not admitted(release, envoy, worker, worker.ports["grpc"]), "the workers' gRPC port stays closed"
    assert not admitted(release, epp_peer, worker, worker.ports["grpc"])


def _salt_and_keys(pod: dict[str, Any]) -> tuple[str | None, str | None]:
    """The secret a pod's KVROUTE_CACHE_SALT_SECRET_FILE comes from, and the secret its API keys come from."""
    container = pod["containers"][0]
    env = {e["name"]: e for e in container.get("env", [])}
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    salt = None
    if "KVROUTE_CACHE_SALT_SECRET_FILE" in env:
        path = env["KVROUTE_CACHE_SALT_SECRET_FILE"]["value"]
        (mount,) = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        salt = volumes[mount["name"]]["secret"]["secretName"]
    keys = env.get("KVROUTE_API_KEYS", {}).get("valueFrom", {}).get("secretKeyRef", {}).get("name")
    if "api-keys" in volumes:
        keys = volumes["api-keys"]["secret"]["secretName"]
    return salt, keys


def test_the_workers_front_doors_hold_the_pickers_keys_and_salt() -> None:
    """Envoy sends the clients to the workers' HTTP front doors: same API keys and cache-salt secret as the picker,
    or the tenant-salted hashes the picker routes by are not the ones the workers cache under."""
    objects = _render({**EPP_VALUES, "auth": {"existingSecret": "tenant-keys"}})
    workers = _one(objects, "StatefulSet")["spec"]["template"]["spec"]
    picker = _one(objects, "Deployment", "-epp")["spec"]["template"]["spec"]
    assert _salt_and_keys(workers) == _salt_and_keys(picker)
    assert _salt_and_keys(picker)[1] == "tenant-keys" and _salt_and_keys(picker)[0]
    assert _salt_and_keys(_one(_render({"epp": {"enabled": False}}), "StatefulSet")["spec"]["template"]["spec"]) == (
        None,
        None,
    )


POOLS = [
    {"model": "sim", "served_model_name": ["alpha", "alpha-latest"], "block_size": 16,
     "workers": ["vllm://alpha-vllm.models.svc:8000?events=tcp://*:5557&replay=tcp://*:5558&discover=dns"]},
    {"model": "sim", "served_model_name": "beta", "block_size": 32, "policy": "prefix", "options": {"epsilon": 0.5},
     "workers": ["vllm://beta-vllm.models.svc:8000?events=tcp://*:5557&replay=tcp://*:5558&discover=dns"]},
]  # fmt: skip


def test_routing_pools_reach_the_gateway_and_the_picker() -> None:
    from gateway.cli_gateway import pool_configs

    values = {**EPP_VALUES, "routing": {"policy": "kv_aware", "options": {"epsilon": 0.25}, "pools": POOLS}}
    release = render_values(values)
    (config_map,) = [o for o in release.all("ConfigMap") if o["metadata"]["name"].endswith("-routing")]
    config = json.loads(config_map["data"]["routing.json"])
    for obj in release.objects:
        if obj["kind"] in ("ConfigMap", "Deployment"):
            kubernetes_validate.validate(obj, MIN_KUBE_VERSION, strict=True)
    for name in ("gateway", "epp"):
        args = [a.replace("$(KVROUTE_POLICY)", config_map["data"]["policy"]) for a in release.container(name).args]
        assert "--redis" not in args and "--workers" not in args, f"{name}: the pools name the workers"
        pools = pool_configs(parse_kvroute(args), config)
        built = [(p.served_model_name, p.aliases, p.block_size, p.policy, p.options) for p in pools]
        assert built == [
            ("alpha", ("alpha-latest",), 16, "kv_aware", {"epsilon": 0.25}),
            ("beta", (), 32, "prefix", {"epsilon": 0.5}),
        ], name


def test_routing_pools_are_checked_by_the_schema() -> None:
    values = {"routing": {"policy": "kv_aware", "pools": [{"model": "sim"}]}}
    with pytest.raises(helm.HelmValuesError) as caught:
        chart().render(values, name="r", namespace="ns")
    assert "/routing/pools/0" in str(caught.value) and "workers" in str(caught.value)
