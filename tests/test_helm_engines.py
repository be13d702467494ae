"""The chart's stock-engine workers (issue 20, item 8): `worker.kind: vllm | sglang` renders engine pods behind a
headless Service that the gateways discover by DNS, and no kvroute worker or worker-side reporter.

Offline with real parts, as tests/test_helm.py (whose rendering helpers this reuses): Helm's own engine renders
and lints, kubernetes-validate checks every object, the gateway's command line parses with the real `kvroute
gateway` parser, and the wiring is checked end to end: the engine's ports, flags and `--kv-events-config` JSON
(after the kubelet's $(POD_IP) expansion) against the gateway's `--workers` spec and block size, the Service,
the probes, the ServiceMonitor and the NetworkPolicy flows.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from typing import Any

import helm_python as helm
import kubernetes_validate
import pytest
import yaml
from test_helm import (  # noqa: F401 (_schemas_read_once: an autouse fixture, active here too)
    CHART,
    COMPONENT,
    CUSTOM_KINDS,
    MIN_KUBE_VERSION,
    MONITORING,
    NAMESPACE,
    POD_FIELDS,
    RELEASE,
    Container,
    Peer,
    Release,
    _schemas_read_once,
    admitted,
    chart,
    labels,
    parse_kvroute,
    render_values,
)

HF_MODEL = {"source": "pvc", "name": "SmolLM2-135M-Instruct", "pvc": {"existingClaim": "smollm2-hf"}}
ENGINE_VALUE_SETS: dict[str, dict[str, Any]] = {
    "vllm": {
        "worker": {"kind": "vllm", "replicas": 3},
        "model": HF_MODEL,
        "networkPolicy": {"enabled": True, "metricsFrom": [MONITORING]},
        "observability": {"serviceMonitor": {"enabled": True}},
    },
    "vllm-tp2": {
        "worker": {
            "kind": "vllm",
            "gpu": {"count": 2, "runtimeClassName": "nvidia"},
            "engine": {"blockSize": 32, "maxModelLen": 4096},
            "vllm": {"gpuMemoryUtilization": 0.85, "extraArgs": ["--max-num-seqs", "128"]},
        },
        "model": {**HF_MODEL, "servedModelName": "smol"},
    },
    "sglang": {
        "worker": {"kind": "sglang", "sglang": {"pageSize": 16, "memFractionStatic": 0.8}},
        "model": {"source": "hostPath", "name": "smollm2-hf", "hostPath": {"path": "/mnt/models"}},
        "networkPolicy": {"enabled": True},
    },
}
TOKEN_FILE = "/etc/kvroute/worker-token/worker-token"  # auth.workerToken, mounted where the chart mounts it
KV_EVENTS_CONFIG_KEYS = {"publisher", "endpoint", "replay_endpoint", "topic"}  # vLLM's and SGLang's KVEventsConfig


@cache
def render(value_set: str) -> Release:
    return render_values(ENGINE_VALUE_SETS[value_set])


def engine(release: Release) -> Container:
    kind = release.values["worker"]["kind"]
    return release.container(kind)


def engine_command(container: Container) -> list[str]:
    """The engine's own command, inside the shell line that reads its API key from the mounted token file."""
    command = container.spec["command"]
    if command[:2] != ["sh", "-c"]:
        return command
    script = command[2]
    return script.split("exec ", 1)[1].split(' "$@"', 1)[0].split()


def engine_flag(container: Container, flag: str) -> str | None:
    """The value after `flag` in the engine's args, or None when absent."""
    return container.args[container.args.index(flag) + 1] if flag in container.args else None


@pytest.mark.parametrize("value_set", sorted(ENGINE_VALUE_SETS))
def test_engine_value_sets_lint_and_validate(value_set: str) -> None:
    report = helm.lint(
        str(CHART),
        copy.deepcopy(ENGINE_VALUE_SETS[value_set]),
        strict=True,
        kube_version=f"v{MIN_KUBE_VERSION}",
    )
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not problems and not report["errors"], problems or report["errors"]
    for obj in render(value_set).objects:
        if obj["kind"] not in CUSTOM_KINDS:
            kubernetes_validate.validate(obj, MIN_KUBE_VERSION, strict=True)


@pytest.mark.parametrize("value_set", sorted(ENGINE_VALUE_SETS))
def test_engine_pods_replace_kvroute_workers_and_the_gateways_discover_them(value_set: str) -> None:
    release = render(value_set)
    kind = release.values["worker"]["kind"]
    assert not release.all("StatefulSet"), "no kvroute workers"
    deployment = release.one("Deployment", "worker")
    assert deployment["spec"]["replicas"] == release.values["worker"]["replicas"]
    (service,) = [s for s in release.all("Service") if labels(s).get(COMPONENT) == "worker"]
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is False
    gateway = release.parsed("gateway")
    assert gateway.redis is None, "engine workers need no worker-side reporter"
    (spec,) = gateway.workers if isinstance(gateway.workers, list) else [gateway.workers]
    container = engine(release)
    ports = container.ports
    host = f"{service['metadata']['name']}.{NAMESPACE}.svc"
    assert spec == (
        f"{kind}://{host}:{ports['http']}?events=tcp://*:{ports['kv-events']}"
        f"&replay=tcp://*:{ports['kv-replay']}&discover=dns&api_key_file={TOKEN_FILE}"
    )
    service_ports = {p["name"]: container.resolve_port(p["targetPort"]) for p in service["spec"]["ports"]}
    assert service_ports == ports
    assert int(engine_flag(container, "--port") or 0) == ports["http"]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert container.spec[probe]["httpGet"] == {"path": "/health", "port": "http"}
    assert container.pod["metadata"]["annotations"].get("prometheus.io/port") == str(ports["http"])


@pytest.mark.parametrize("value_set", sorted(ENGINE_VALUE_SETS))
def test_the_engine_publishes_kv_events_where_the_gateway_reads_them_with_its_block_size(value_set: str) -> None:
    release = render(value_set)
    container, gateway = engine(release), release.parsed("gateway")
    config = json.loads(engine_flag(container, "--kv-events-config") or "{}")
    served = gateway.served_model_name or gateway.model
    assert KV_EVENTS_CONFIG_KEYS <= set(config) and config["publisher"] == "zmq"
    assert config["endpoint"] == f"tcp://*:{container.ports['kv-events']}"
    assert config["replay_endpoint"] == f"tcp://*:{container.ports['kv-replay']}"
    # llm-d's topic, with the pod's own address after the kubelet's expansion.
    assert config["topic"] == f"kv@{POD_FIELDS['status.podIP']}:{container.ports['http']}@{served}"
    assert engine_flag(container, "--served-model-name") == served
    (mount,) = [m for m in container.spec["volumeMounts"] if m["name"] == "model"]
    vllm = release.values["worker"]["kind"] == "vllm"
    model_arg = container.args[0] if vllm else engine_flag(container, "--model-path")
    assert model_arg == gateway.model and model_arg.startswith(mount["mountPath"] + "/") and mount["readOnly"]
    block_size = release.values["worker"]["engine"]["blockSize"]
    assert gateway.block_size == block_size
    if vllm:
        assert engine_command(container) == ["vllm", "serve"] and config["enable_kv_cache_events"] is True
        assert int(engine_flag(container, "--block-size") or 0) == block_size
        assert "--enable-prompt-tokens-details" in container.args, "cached_tokens in usage"
    else:
        assert engine_command(container) == ["python3", "-m", "sglang.launch_server"]
        assert "--enable-metrics" in container.args and "enable_kv_cache_events" not in config
        assert engine_flag(container, "--page-size") == "16"


def test_notes_name_the_engine_fleet() -> None:
    assert f"fleet state: vllm pods, found by DNS ({RELEASE}-worker)" in render("vllm").notes
    assert "fleet state: bundled Redis" in render_defaults().notes


def test_gpus_tensor_parallelism_and_engine_options_reach_the_pod() -> None:
    release = render("vllm-tp2")
    container = engine(release)
    assert container.spec["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert container.pod["spec"]["runtimeClassName"] == "nvidia"
    assert engine_flag(container, "--tensor-parallel-size") == "2"
    assert engine_flag(container, "--gpu-memory-utilization") == "0.85"
    assert engine_flag(container, "--max-model-len") == "4096"
    assert container.args[-2:] == ["--max-num-seqs", "128"]
    assert json.loads(engine_flag(container, "--kv-events-config") or "{}")["topic"].endswith("@smol")
    assert container.spec["image"] == "docker.io/vllm/vllm-openai:v0.11.0"
    sglang = engine(render("sglang"))
    assert engine_flag(sglang, "--tp-size") == "1" and engine_flag(sglang, "--mem-fraction-static") == "0.8"


@pytest.mark.parametrize("value_set", sorted(ENGINE_VALUE_SETS))
def test_engine_pods_run_hardened(value_set: str) -> None:
    container = engine(render(value_set))
    pod_ctx = container.pod["spec"]["securityContext"]
    ctx = container.spec["securityContext"]
    assert pod_ctx["runAsNonRoot"] is True and pod_ctx["seccompProfile"]["type"] == "RuntimeDefault"
    assert ctx["readOnlyRootFilesystem"] is True and ctx["allowPrivilegeEscalation"] is False
    assert ctx["capabilities"]["drop"] == ["ALL"]
    env = {e["name"]: e.get("value") for e in container.spec["env"]}
    assert env["HOME"].startswith("/tmp") and env["HF_HOME"].startswith("/tmp"), "caches on the writable volume"
    assert container.pod["spec"]["automountServiceAccountToken"] is False


def test_network_policy_admits_the_gateways_and_the_scraper_to_the_engines_only() -> None:
    release = render("vllm")
    target = engine(release)
    gateway = release.container("gateway")
    peers = {
        "gateway": Peer("gateway", gateway.pod["metadata"]["labels"]),
        "prometheus": Peer("prometheus", {"app": "prometheus"}, namespace="monitoring"),
        "neighbour": Peer("neighbour", {"app": "something-else"}),
        "impostor": Peer("impostor", gateway.pod["metadata"]["labels"], namespace="elsewhere"),
    }
    allowed = {("gateway", port) for port in target.ports.values()} | {("prometheus", target.ports["http"])}
    for peer in peers.values():
        for port in target.ports.values():
            assert admitted(release, peer, target, port) is ((peer.name, port) in allowed), (peer.name, port)
    for policy in release.all("NetworkPolicy"):
        if policy["spec"]["podSelector"]["matchLabels"].items() <= target.pod["metadata"]["labels"].items():
            for rule in policy["spec"]["ingress"]:
                for port in rule["ports"]:
                    target.resolve_port(port["port"])  # every port it names is one the engine serves


def test_the_service_monitor_and_disruption_budget_cover_the_engines() -> None:
    release = render("vllm")
    (monitor,) = [m for m in release.all("ServiceMonitor") if labels(m).get(COMPONENT) == "worker"]
    (service,) = [s for s in release.all("Service") if labels(s).get(COMPONENT) == "worker"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= labels(service).items()
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"
    pdb = release.one("PodDisruptionBudget", "worker")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= engine(release).pod["metadata"]["labels"].items()


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"worker": {"kind": "vllm"}}, "at '/model/source': value must be one of 'pvc', 'hostPath'"),
        ({"worker": {"kind": "tgi"}, "model": HF_MODEL}, "at '/worker/kind': value must be one of 'kvroute'"),
        ({"worker": {"kind": "vllm", "vllm": {"prot": 1}}, "model": HF_MODEL}, "additional properties 'prot'"),
        ({"worker": {"kind": "vllm", "vllm": {"image": {"repository": "x", "tag": ""}}}, "model": HF_MODEL}, "/tag"),
    ],
    ids=["baked-in-model", "unknown-kind", "typo", "untagged-image"],
)
def test_schema_refuses_engine_values_it_cannot_serve(values: dict[str, Any], message: str) -> None:
    with pytest.raises(helm.HelmValuesError) as caught:
        chart().render(values, name=RELEASE, namespace=NAMESPACE)
    assert message in str(caught.value)


def test_the_gateways_workers_spec_parses_with_the_gateways_own_parser() -> None:
    worker_spec = pytest.importorskip("gateway.worker_spec", reason="the worker-spec parser lands with h-engines")
    for value_set in sorted(ENGINE_VALUE_SETS):
        release = render(value_set)
        gateway = release.parsed("gateway")
        (text,) = gateway.workers if isinstance(gateway.workers, list) else [gateway.workers]
        spec = worker_spec.parse_worker_spec(text)
        assert (spec.engine, spec.discover) == (release.values["worker"]["kind"], "dns")


def test_kvroute_workers_are_unchanged_by_default() -> None:
    release = render_defaults()
    assert release.one("StatefulSet", "worker") and parse_kvroute(release.container("worker").args).redis
    assert not [o for o in release.objects if labels(o).get("kvroute.dev/worker-kind")]


@cache
def render_defaults() -> Release:
    manifests = chart().render({}, name=RELEASE, namespace=NAMESPACE, is_install=True)
    objects = [o for p, t in sorted(manifests.items()) if p.endswith(".yaml") for o in yaml.safe_load_all(t) if o]
    notes = next(text for path, text in manifests.items() if path.endswith("NOTES.txt"))
    return Release(chart().merge_values({}), objects, notes)


def test_the_engines_require_the_worker_token_as_their_api_key_and_the_gateways_present_it() -> None:
    """auth.workerToken.engineApiKey (on by default): each engine starts with the token as its API key, read from
    its mounted file as it starts (vLLM: $VLLM_API_KEY, so on no command line; SGLang: --api-key), and the
    gateways' and the picker's spec names the same file, mounted from the same Secret."""
    for value_set in ("vllm", "sglang"):
        values = copy.deepcopy(ENGINE_VALUE_SETS[value_set])
        values["epp"] = {"enabled": True}
        release = render_values(values)
        container = engine(release)
        script = container.spec["command"][2]
        read = f'"$$(cat {TOKEN_FILE})"'  # the kubelet turns $$ into $: the shell reads the file
        if value_set == "vllm":
            assert script == f'VLLM_API_KEY={read} exec vllm serve "$@"'
        else:
            assert script.endswith(f"--api-key {read}")
        for name in (value_set, "gateway", "epp"):
            pod = release.container(name)
            (mount,) = [m for m in pod.spec["volumeMounts"] if TOKEN_FILE.startswith(m["mountPath"] + "/")]
            volume = next(v for v in pod.pod["spec"]["volumes"] if v["name"] == mount["name"])
            assert volume["secret"]["secretName"] == f"{RELEASE}-worker-token", name
            assert {i["path"] for i in volume["secret"]["items"]} == {TOKEN_FILE.rsplit("/", 1)[1]}
        for name in ("gateway", "epp"):
            (spec,) = release.parsed(name).workers if isinstance(release.parsed(name).workers, list) else [
                release.parsed(name).workers]  # fmt: skip
            assert f"api_key_file={TOKEN_FILE}" in spec, name
    values = copy.deepcopy(ENGINE_VALUE_SETS["vllm"])
    values["auth"] = {"workerToken": {"engineApiKey": False}}
    release = render_values(values)
    assert engine(release).spec["command"] == ["vllm", "serve"]
    assert "api_key_file" not in release.parsed("gateway").workers


def test_data_parallel_ranks_get_their_gpus_ports_and_the_gateways_spec() -> None:
    """vllm.dataParallelSize / sglang.dpSize: the engine's flags, gpu.count x ranks GPUs, each rank's two ZMQ ports
    (the ports + rank) on the pod, the Service and the NetworkPolicies (gateways and pickers), and `dp=N` in the
    spec, whose ranks (the gateway's own parser) subscribe to exactly those ports."""
    from gateway.worker_spec import parse_worker_spec

    for kind, key, flags in (
        ("vllm", "dataParallelSize", ["--data-parallel-size", "2"]),
        ("sglang", "dpSize", ["--dp-size", "2", "--enable-dp-attention"]),
    ):
        values = {
            "worker": {"kind": kind, "gpu": {"count": 2}, kind: {key: 2, "kvEventsPort": 5557, "replayPort": 5600}},
            "model": HF_MODEL, "networkPolicy": {"enabled": True}, "epp": {"enabled": True},
        }  # fmt: skip
        release = render_values(values)
        container = engine(release)
        at = container.args.index(flags[0])
        assert container.args[at : at + len(flags)] == flags
        if kind == "sglang":
            assert engine_flag(container, "--tp-size") == "4"  # dp attention: every GPU of the pod in --tp-size
        else:
            assert engine_flag(container, "--tensor-parallel-size") == "2"
        assert container.spec["resources"]["limits"]["nvidia.com/gpu"] == "4"
        ports = container.ports
        assert ports == {"http": ports["http"], "kv-events": 5557, "kv-events-1": 5558, "kv-replay": 5600,
                         "kv-replay-1": 5601}  # fmt: skip
        (service,) = [s for s in release.all("Service") if labels(s).get(COMPONENT) == "worker"]
        assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports
        spec = parse_worker_spec(release.parsed("gateway").workers)
        assert spec.data_parallel_size == 2
        ranks = [r.at("10.1.2.3") for r in spec.at("10.1.2.3").ranks()]
        assert [(r.events, r.replay) for r in ranks] == [
            (f"tcp://10.1.2.3:{5557 + r}", f"tcp://10.1.2.3:{5600 + r}") for r in range(2)
        ]
        for peer in ("gateway", "epp"):
            source = Peer(peer, release.container(peer).pod["metadata"]["labels"])
            for port in ports.values():
                assert admitted(release, source, container, port), (kind, peer, port)
    overlapping = {"worker": {"kind": "vllm", "vllm": {"dataParallelSize": 2}}, "model": HF_MODEL}
    with pytest.raises(Exception, match="must be at least 2 apart"):
        render_values(overlapping)


def test_the_picker_reads_the_engines_itself_and_the_pool_targets_their_port() -> None:
    """epp.enabled over stock engines: the picker gets the engines' spec (not the Redis that no engine writes),
    and the InferencePool's targetPort is the engines' API port (SGLang's 30000, not a kvroute worker's)."""
    values = copy.deepcopy(ENGINE_VALUE_SETS["sglang"])
    values["epp"] = {"enabled": True}
    release = render_values(values)
    epp = release.parsed("epp")
    assert epp.redis is None and epp.workers == release.parsed("gateway").workers
    (pool,) = release.all("InferencePool")
    assert pool["spec"]["targetPorts"] == [{"number": engine(release).ports["http"]}] == [{"number": 30000}]
    assert epp.target_port == 30000
