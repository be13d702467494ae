"""The gateway's metrics (issue 19, item 5): served apart from the API port, label values bounded and plain,
a client's apps counted against its own tenant's budget and never written into another tenant's series, and
no tenant name in any label unless the operator asks. Through a real gateway (tests/gateway_stack.py)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from gateway_stack import KEY, SMALL_KEY, GatewayStack, StackOptions, stack_fixture
from prometheus_client.parser import text_string_to_metric_families

from gateway.metrics import MAX_APPS_PER_TENANT, MAX_LABEL_CHARS, GatewayMetrics, tenant_id
from gateway.request import Tenant

stack = stack_fixture(StackOptions(model="sim", workers=1))
C = "/v1/completions"
OPENMETRICS = "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5"


@pytest.fixture()
def api(stack: GatewayStack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.http_url, timeout=30) as http:
        yield http


def complete(api: httpx.Client, key: str, app: str | None) -> None:
    headers = {"authorization": f"Bearer {key}"}
    if app is not None:
        headers["x-kvroute-app"] = app
    response = api.post(C, json={"prompt": "Hello there, how are you? " * 8, "max_tokens": 1}, headers=headers)
    assert response.status_code == 200, response.text


def prefix_series(text: str) -> list[dict[str, str]]:
    """The labels of every kvroute:prefix_hit_rate sample."""
    return [
        sample.labels
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "kvroute:prefix_hit_rate"
    ]


def test_metrics_are_not_on_the_api_port(api: httpx.Client, stack: GatewayStack) -> None:
    assert api.get("/metrics").status_code == 404
    scraped = httpx.get(stack.metrics_url, headers={"accept": OPENMETRICS})
    assert scraped.status_code == 200
    # The text format, whatever a Prometheus server's Accept asks for: OpenMetrics would escape the colons.
    assert scraped.headers["content-type"].startswith("text/plain; version=0.0.4")
    assert "kvroute:gateway_requests_in_flight{model_name=" in scraped.text and "kvroute_" not in scraped.text


def test_client_named_apps_are_bounded_scoped_per_tenant_and_name_no_tenant(
    api: httpx.Client, stack: GatewayStack
) -> None:
    huge = "a" * 8000 + '"} evil{x="'
    complete(api, KEY, huge)
    complete(api, KEY, "chat<|im_end|> {x}")
    for i in range(MAX_APPS_PER_TENANT + 10):  # acme spends its whole app budget, and more
        complete(api, KEY, f"app{i}")
    complete(api, SMALL_KEY, "app0")  # the same app name from another tenant
    complete(api, SMALL_KEY, None)
    text = httpx.get(stack.metrics_url).text
    series = prefix_series(text)
    assert all(len(labels["app"]) <= MAX_LABEL_CHARS for labels in series)
    assert all(
        set(labels["app"]) <= set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-")
        for labels in series
    )
    assert "acme" not in text and "small" not in text, "tenant names stay out of the labels by default"
    acme = {
        labels["app"] for labels in series if labels["tenant"] == tenant_id(stack.request_path.auth.authenticate(KEY))
    }
    small = {
        labels["app"]
        for labels in series
        if labels["tenant"] == tenant_id(stack.request_path.auth.authenticate(SMALL_KEY))
    }
    assert len(acme) == MAX_APPS_PER_TENANT + 1 and "other" in acme  # its budget, then "other"
    assert small == {"app0", "default"}, "another tenant's budget and series are its own"
    assert len(text) < 200_000


def test_tenant_names_only_when_the_operator_asks() -> None:
    named, opaque = GatewayMetrics("m", tenant_labels=True), GatewayMetrics("m")
    tenant = Tenant("acme corp", "salt-of-acme")
    for metrics in (named, opaque):
        metrics.observe_prefix(tenant, None, [b"x"], matched_blocks=1, block_size=16)
    assert prefix_series(named.render().decode()) == [{"tenant": "acme_corp", "app": "default"}]
    (labels,) = prefix_series(opaque.render().decode())
    assert labels["tenant"] == tenant_id(tenant) != tenant_id(Tenant("acme corp", "another salt"))
    assert "acme" not in labels["tenant"]


def test_each_pools_series_count_in_the_one_registry() -> None:
    first = GatewayMetrics("pool-a")
    second = first.for_model("pool-b")
    for metrics, finished in ((first, 3), (second, 1)):
        for _ in range(finished):
            metrics.request_success.labels("stop").inc()
            metrics.requests.labels("kv_aware", "hit").inc()
            metrics.routed.labels("w0").inc()
    first.errors.labels("RateLimited").inc()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(first.render().decode())
        for sample in family.samples
    }
    success = "kvroute:gateway_request_success_total"
    assert samples[(success, (("finished_reason", "stop"), ("model_name", "pool-a")))] == 3
    assert samples[(success, (("finished_reason", "stop"), ("model_name", "pool-b")))] == 1
    assert samples[("kvroute:gateway_requests_total", (("policy", "kv_aware"), ("reason", "hit")))] == 4
    assert samples[("kvroute:gateway_routed_requests_total", (("worker", "w0"),))] == 4
    assert samples[("kvroute:gateway_request_errors_total", (("type", "RateLimited"),))] == 1


def test_the_views_refresh_is_a_histogram_of_report_intervals(stack: GatewayStack) -> None:
    deadline = time.monotonic() + 10.0
    while True:  # the embedded fleet state polls its worker every 0.05 s (tests/gateway_stack.py)
        families = {f.name: f for f in text_string_to_metric_families(httpx.get(stack.metrics_url).text)}
        samples = {s.name: s for s in families["kvroute:gateway_fleet_report_interval_seconds"].samples}
        count = samples["kvroute:gateway_fleet_report_interval_seconds_count"].value
        if count >= 3 or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert count >= 3
    mean = samples["kvroute:gateway_fleet_report_interval_seconds_sum"].value / count
    assert 0.045 <= mean < 2.0, "poll_interval plus each poll's round trip"
    family = families["kvroute:gateway_fleet_report_interval_seconds"]
    buckets = [s for s in family.samples if s.name.endswith("_bucket")]
    assert buckets[-1].labels["le"] == "+Inf" and buckets[-1].value == count
    assert [s.value for s in buckets] == sorted(s.value for s in buckets), "cumulative"
