"""The chart's alerts (issue 29 item 3; docs/kubernetes.md, "Alerts"): a PrometheusRule, off by default and on with
one value, its thresholds from values; checked against the Prometheus Operator's CRD where ../shared/k8s-schemas
has it, and by Prometheus' own promtool: the rules parse (`check rules`), and each alert fires on series shaped as
the workers and gateways export them, and not below its threshold (`test rules`)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.test_helm import NAMESPACE, render_values

SCHEMAS = Path(__file__).resolve().parents[2] / "shared" / "k8s-schemas"
PROMETHEUS_RULE_CRD = SCHEMAS / "monitoring.coreos.com_prometheusrules.yaml"
PROMTOOL = shutil.which("promtool")
ALERTS = {
    "KvrouteWorkerPreempting",
    "KvroutePrefixHitRateFalling",
    "KvrouteWorkerWithoutKvEvents",
    "KvrouteRequestsShed",
}
ON = {"observability": {"prometheusRule": {"enabled": True}}}
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="no promtool on PATH (Debian's `prometheus` package installs /usr/bin/promtool)"
)


def prometheus_rule(values: dict[str, Any]) -> dict[str, Any]:
    (rule,) = render_values(values).all("PrometheusRule")
    return rule


def test_alerts_are_off_by_default_and_one_value_turns_them_on() -> None:
    assert render_values({}).all("PrometheusRule") == []
    rule = prometheus_rule(ON)
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == NAMESPACE
    alerts = [r for group in rule["spec"]["groups"] for r in group["rules"]]
    assert {a["alert"] for a in alerts} == ALERTS
    for alert in alerts:
        assert f'namespace="{NAMESPACE}"' in alert["expr"], alert["alert"]
        assert alert["labels"] == {"severity": "warning"}


def test_thresholds_selector_and_labels_come_from_values() -> None:
    rule = prometheus_rule(
        {
            "observability": {
                "prometheusRule": {
                    "enabled": True,
                    "labels": {"release": "prometheus"},
                    "selector": 'job="kvroute"',
                    "severity": "page",
                    "preemptions": {"perSecond": 0.5, "window": "2m", "for": "1m"},
                    "sheds": {"fraction": 0.2},
                }
            }
        }
    )
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    alerts = {r["alert"]: r for group in rule["spec"]["groups"] for r in group["rules"]}
    preempting = alerts["KvrouteWorkerPreempting"]
    assert preempting["expr"].endswith("> 0.5") and '{job="kvroute"}[2m]' in preempting["expr"]
    assert preempting["for"] == "1m" and preempting["labels"] == {"severity": "page"}
    assert alerts["KvrouteRequestsShed"]["expr"].endswith("> 0.2")


@pytest.mark.parametrize(
    ("values", "field"),
    [
        ({"drop": 1.5}, "drop"),
        ({"window": "15 minutes"}, "window"),
        ({"baseline": "30m1h"}, "baseline"),  # Prometheus' durations run from years down to milliseconds
    ],
)
def test_the_schema_refuses_bad_thresholds_naming_the_field(values: dict[str, Any], field: str) -> None:
    import helm_python as helm

    with pytest.raises(helm.HelmValuesError) as refused:
        render_values({"observability": {"prometheusRule": {"enabled": True, "prefixHitRate": values}}})
    assert field in str(refused.value)


@pytest.mark.skipif(
    not PROMETHEUS_RULE_CRD.exists(),
    reason=f"no PrometheusRule CRD schema at {PROMETHEUS_RULE_CRD} (prometheus-operator's "
    "example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml)",
)
def test_the_prometheus_rule_validates_against_its_crd() -> None:
    crd = yaml.safe_load(PROMETHEUS_RULE_CRD.read_text())
    schemas = {v["name"]: v["schema"]["openAPIV3Schema"] for v in crd["spec"]["versions"] if v.get("served")}
    jsonschema.validate(prometheus_rule(ON), schemas["v1"])


def rules_file(tmp_path: Path, *, annotations: bool = True) -> Path:
    """The rule groups as Prometheus reads them from a file (the PrometheusRule's spec), with or without their
    annotations."""
    spec = prometheus_rule(ON)["spec"]
    if not annotations:
        for group in spec["groups"]:
            for rule in group["rules"]:
                rule.pop("annotations")
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@needs_promtool
def test_promtool_checks_the_rules(tmp_path: Path) -> None:
    assert PROMTOOL is not None
    checked = subprocess.run(
        [PROMTOOL, "check", "rules", str(rules_file(tmp_path))], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 4 rules found" in checked.stdout


def _series(name: str, labels: str, values: str) -> dict[str, str]:
    return {"series": f'{name}{{namespace="{NAMESPACE}",{labels}}}', "values": values}


# Series at a 1-minute step, as promtool's `x` notation writes them ('a+bxN': a, then N steps of +b).
SERIES = [
    # w-0 preempts 6 sequences a minute (0.1/s, over the default 0.05), w-1 one a minute (under it).
    _series("vllm:num_preemptions_total", 'pod="w-0"', "0+6x30"),
    _series("vllm:num_preemptions_total", 'pod="w-1"', "0+1x30"),
    # 10,000 prompt tokens looked up a minute; hits 60% of them for the first hour, then 20%.
    _series("vllm:prefix_cache_queries_total", 'pod="w-0"', "0+10000x120"),
    _series("vllm:prefix_cache_hits_total", 'pod="w-0"', "0+6000x60 360000+2000x60"),
    # vllm://10.0.0.7 was found without events once, at minute 5.
    _series("kvroute:gateway_no_kv_events_total", 'pod="g-0",worker="vllm://10.0.0.7:8000"', "0x4 1+0x30"),
    # 100 requests routed a minute, 5 shed (4.8% of those offered, over the default 1%).
    _series("kvroute:gateway_requests_total", 'pod="g-0",policy="kv_aware",reason="hit"', "0+100x30"),
    _series("kvroute:gateway_flow_sheds_total", 'pod="g-0",band="0",reason="fleet_queue_full"', "0+5x30"),
]


def _fired(**labels: str) -> dict[str, Any]:
    """An alert expected firing, by its labels (promtool adds the alert's name)."""
    return {"exp_labels": {"severity": "warning", "namespace": NAMESPACE, **labels}}


@needs_promtool
def test_each_alert_fires_on_its_metrics_and_not_below_its_threshold(tmp_path: Path) -> None:
    """The expressions on their own (promtool compares an alert's annotations too; `check rules` has parsed
    their templates)."""
    tests = {
        "rule_files": [str(rules_file(tmp_path, annotations=False))],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": SERIES,
                "alert_rule_test": [
                    # 5m of rate, held 10m: firing for w-0 at 20m, not for w-1.
                    {"eval_time": "20m", "alertname": "KvrouteWorkerPreempting",
                     "exp_alerts": [_fired(pod="w-0")]},
                    # The rate falls from 60% to 20% at 60m; over a 15m window, held 15m, against 1h before.
                    {"eval_time": "50m", "alertname": "KvroutePrefixHitRateFalling", "exp_alerts": []},
                    {"eval_time": "95m", "alertname": "KvroutePrefixHitRateFalling",
                     "exp_alerts": [_fired()]},
                    {"eval_time": "3m", "alertname": "KvrouteWorkerWithoutKvEvents", "exp_alerts": []},
                    {"eval_time": "6m", "alertname": "KvrouteWorkerWithoutKvEvents",
                     "exp_alerts": [_fired(worker="vllm://10.0.0.7:8000")]},
                    {"eval_time": "25m", "alertname": "KvrouteWorkerWithoutKvEvents", "exp_alerts": []},
                    {"eval_time": "15m", "alertname": "KvrouteRequestsShed",
                     "exp_alerts": [_fired()]},
                ],
            }
        ],
    }  # fmt: skip
    path = tmp_path / "tests.yaml"
    path.write_text(yaml.safe_dump(tests, sort_keys=False))
    assert PROMTOOL is not None
    tested = subprocess.run([PROMTOOL, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert tested.returncode == 0, tested.stdout + tested.stderr
