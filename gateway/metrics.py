"""The gateway's Prometheus metrics, in the worker's naming style (`kvroute:` prefix, own registry; the
exposition appends `_total` to counters). Served on their own port (`--metrics-port`,
gateway.frontdoors.metrics_port), never on the API port, in the Prometheus text format 0.0.4 whatever the Accept
header (in OpenMetrics this prometheus_client escapes ':' and a Prometheus server would store `kvroute_...`).

One registry per gateway, whatever its pools (gateway.pools): each pool's `GatewayMetrics` is a view of it
(`for_model`) whose `model_name` label, on the series vLLM labels so (TTFT, E2E, finished requests, requests in
flight), takes only configured pools' names.

Routing: requests by policy and reason, requests routed per worker, routing latency (template, tokenize,
hash and pick), retries by cause, breaker state per worker, parity mismatches, membership changes and the
seconds between two load reports of a worker (read from the fleet state's counters at scrape time).
Requests: TTFT and E2E as the client sees them through the gateway, errors by type, requests in flight.
Flow control (docs/flow_control.md): queue depth and wait per band, sheds and dispatches by band and reason, and
requests that met their band's SLO or not.

The prefix doctor's live half, per tenant and app (the `x-kvroute-app` header, else "default"): where each
request's prompt first diverges from the same app's previous request (in tokens, at block granularity:
caching works in blocks), and the share of prompt blocks the chosen worker already held (matched / prompt
blocks, since start).

Label values clients can influence are bounded (the rules are `label_value`'s): an app name is cut to
`MAX_LABEL_CHARS` and every character outside [A-Za-z0-9._-] becomes "_". Apps are counted per tenant: a
tenant's first `MAX_APPS_PER_TENANT` apps get their own series (under its own `tenant` label, so one tenant
can never write into another's), later ones count as its "other"; `MAX_APPS` bounds all tenants together.
The `tenant` label is an opaque id (`tenant_id`) unless the operator asks for names (`tenant_labels`,
`--metrics-tenant-labels`).
"""

from __future__ import annotations

import hashlib
import itertools
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from gateway.request import Tenant
from kvroute.prefix import common_prefix_length

TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
E2E_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)
# Seconds a request waited in the flow-control queue (0 for one that went at once): from the report interval to
# a band's longest max wait.
FLOW_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ROUTING_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
DIVERGENCE_BUCKETS = (0, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536)
MAX_APPS = 100  # (tenant, app) series of the prefix doctor, all tenants together
MAX_APPS_PER_TENANT = 16
MAX_LABEL_CHARS = 64
DEFAULT_APP = "default"  # a request without x-kvroute-app
OTHER_APP = "other"  # a tenant's apps past its budget
_LABEL_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


def label_value(text: str) -> str:
    """`text` as a bounded, plain label value: at most MAX_LABEL_CHARS characters, each in [A-Za-z0-9._-]
    (any other becomes "_"); an empty text is "_"."""
    return _LABEL_UNSAFE.sub("_", text[:MAX_LABEL_CHARS]) or "_"


# The finish reasons a series may carry: OpenAI's and the engines' own (vLLM's, SGLang's). Any other string an
# HTTP engine sends reaches its client as it is but is counted as "other": an engine must not grow the series.
FINISHED_REASONS = frozenset(
    {"stop", "length", "abort", "tool_calls", "function_call", "content_filter", "error", "repetition"}
)


def finished_reason_label(reason: str) -> str:
    return reason if reason in FINISHED_REASONS else "other"


def tenant_id(tenant: Tenant) -> str:
    """An opaque, stable label for `tenant`: a digest of its cache salt (keyed by the salt secret, so names
    cannot be confirmed by hashing guesses; equal on every gateway that shares the secret)."""
    return "t-" + hashlib.sha256(b"kvroute-metrics-tenant\x00" + tenant.cache_salt.encode()).hexdigest()[:12]


class _LiveCollector(Collector):
    """Read at scrape time: breaker states, and parity mismatches and membership changes from the fleet
    state's counters (`gateway.fleet.fleet_state.FleetCounters`), summed over every source (one per pool)."""

    def __init__(self) -> None:
        self.sources: list[tuple[Callable[[], Any], Callable[[], Mapping[str, int]]]] = []

    def collect(self) -> Iterator[Metric]:
        breakers = GaugeMetricFamily(
            "kvroute:gateway_breaker_state",
            "Circuit breaker per worker that has failed since it last succeeded: 0 closed, 1 half-open, 2 open.",
            labels=["worker"],
        )
        states: dict[str, int] = {}
        for _, breaker_states in self.sources:
            for worker, state in breaker_states().items():
                states[worker] = max(states.get(worker, 0), int(state))
        for worker, state in sorted(states.items()):
            breakers.add_metric([label_value(worker)], state)
        yield breakers
        all_counters = [c for c in (fleet_counters() for fleet_counters, _ in self.sources) if c is not None]
        if not all_counters:
            return
        per_worker = (
            ("kvroute:gateway_parity_mismatches", "parity_mismatches",
             "Worker incarnations whose hash or tokenizer fingerprint differed from the gateway's (routed by load)."),
            ("kvroute:gateway_no_kv_events", "no_kv_events",
             "Times an engine worker was found publishing no KV events (routed by load until its events arrive)."),
        )  # fmt: skip
        for name, attribute, help_text in per_worker:
            family = CounterMetricFamily(name, help_text, labels=["worker"])
            for worker, count in sorted(_summed(getattr(c, attribute) for c in all_counters).items()):
                family.add_metric([label_value(worker)], count)
            yield family
        changes = CounterMetricFamily(
            "kvroute:gateway_fleet_changes", "Fleet membership changes seen by this gateway.", labels=["change"]
        )
        for change in ("joins", "leaves", "restarts", "resyncs"):
            changes.add_metric([change], sum(getattr(c, change) for c in all_counters))
        yield changes
        drops = CounterMetricFamily(
            "kvroute:gateway_kv_event_drops",
            "Engine KV event batches or events dropped, by worker and reason (gateway.fleet.engine_events).",
            labels=["worker", "reason"],
        )
        for (worker, reason), count in sorted(_summed(getattr(c, "kv_event_drops", {}) for c in all_counters).items()):
            drops.add_metric([label_value(worker), reason], count)
        yield drops
        intervals = HistogramMetricFamily(
            "kvroute:gateway_fleet_report_interval_seconds",
            "Seconds between two load reports of one worker applied to this gateway's view (its refresh).",
        )
        histograms = [c.report_intervals for c in all_counters]
        counts = [sum(h.counts[i] for h in histograms) for i in range(len(histograms[0].counts))]
        cumulative = list(itertools.accumulate(counts))
        bounds = [*(str(b) for b in histograms[0].bounds), "+Inf"]
        intervals.add_metric([], list(zip(bounds, cumulative, strict=True)), sum(h.total for h in histograms))
        yield intervals


def _summed(counts: Iterable[Mapping[Any, int]]) -> dict[Any, int]:
    total: dict[Any, int] = {}
    for each in counts:
        for key, count in each.items():
            total[key] = total.get(key, 0) + count
    return total


class _Children:
    """A labelled family's series (children) kept by their label values, so that `labels(*values)` is one dict
    lookup once the series exists (prometheus_client's own `labels` checks the values and takes a lock every
    call); `bound` label values come first (a pool's `model_name`). It holds one entry per series the family
    has, never more: every label value of the request path is bounded where it is made (`label_value` and
    the app budget, the configured pools, the router's reasons, the retry causes, error class names, finish
    reasons), and no series is ever removed."""

    def __init__(self, family: Counter | Gauge | Histogram, *bound: str) -> None:
        self._family = family
        self._bound = bound
        self._children: dict[tuple[str, ...], Any] = {}

    def labels(self, *values: str) -> Any:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._family.labels(*self._bound, *values)
        return child


class _Registry:
    """The one registry of a gateway and its metric families, shared by every pool's GatewayMetrics."""

    def __init__(self, tenant_labels: bool) -> None:
        self.tenant_labels = tenant_labels
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = _Children(Counter(
            "kvroute:gateway_requests", "Requests routed, by policy and decision reason.", ["policy", "reason"],
            registry=r,
        ))  # fmt: skip
        self.routed = _Children(
            Counter("kvroute:gateway_routed_requests", "Worker requests sent to each worker.", ["worker"], registry=r)
        )
        self.routing_latency = Histogram(
            "kvroute:gateway_routing_latency_seconds",
            "Time from arrival to the worker request being sent: template, tokenize, hash and pick.",
            buckets=ROUTING_BUCKETS, registry=r,
        )  # fmt: skip
        self.time_to_first_token = Histogram(
            "kvroute:gateway_time_to_first_token_seconds", "Time to first token through the gateway.",
            ["model_name"], buckets=TTFT_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e_request_latency = Histogram(
            "kvroute:gateway_e2e_request_latency_seconds", "Request latency through the gateway.",
            ["model_name"], buckets=E2E_BUCKETS, registry=r,
        )  # fmt: skip
        self.request_success = Counter(
            "kvroute:gateway_request_success", "Requests that finished, by finish reason.",
            ["model_name", "finished_reason"], registry=r,
        )  # fmt: skip
        self.errors = _Children(Counter(
            "kvroute:gateway_request_errors", "Requests that ended with an error, by error type.", ["type"], registry=r
        ))  # fmt: skip
        self.responses_store_errors = _Children(Counter(
            "kvroute:gateway_responses_store_errors", "Responses served but not stored (/v1/responses), by cause.",
            ["cause"], registry=r,
        ))  # fmt: skip
        self.retries = _Children(Counter(
            "kvroute:gateway_retries", "Worker requests retried on another worker, by cause.", ["cause"], registry=r
        ))  # fmt: skip
        self.in_flight = Gauge(
            "kvroute:gateway_requests_in_flight", "Requests being served.", ["model_name"], registry=r
        )
        self.prefix_divergence = _Children(Histogram(
            "kvroute:prefix_divergence_tokens",
            "Position of the first token (at block granularity) where a prompt differs from its app's previous one.",
            ["tenant", "app"], buckets=DIVERGENCE_BUCKETS, registry=r,
        ))  # fmt: skip
        self.prefix_hit_rate = _Children(Gauge(
            "kvroute:prefix_hit_rate", "Prompt blocks held by the chosen worker over prompt blocks, per app.",
            ["tenant", "app"], registry=r,
        ))  # fmt: skip
        # Flow control (gateway.flow_control): `band` is a priority value as gateway.flow_control.stage bounds it.
        self.flow_queue_depth = _Children(Gauge(
            "kvroute:gateway_flow_queue_depth", "Requests waiting in the gateway for a worker, per band.",
            ["band"], registry=r,
        ))  # fmt: skip
        self.flow_queue_wait = _Children(Histogram(
            "kvroute:gateway_flow_queue_wait_seconds",
            "Time a request waited in the gateway for a worker, per band (0 for one dispatched at once).",
            ["band"], buckets=FLOW_WAIT_BUCKETS, registry=r,
        ))  # fmt: skip
        self.flow_sheds = _Children(Counter(
            "kvroute:gateway_flow_sheds",
            "Requests refused or dropped by flow control, per band and reason (tenant_limit, band_full, queue_full, "
            "displaced, max_wait, no_worker, draining).",
            ["band", "reason"], registry=r,
        ))  # fmt: skip
        self.flow_dispatches = _Children(Counter(
            "kvroute:gateway_flow_dispatches",
            "Requests flow control sent to a worker, per band and reason "
            "(immediate, fair_share, cache_aware, deadline).",
            ["band", "reason"], registry=r,
        ))  # fmt: skip
        self.slo_requests = _Children(Counter(
            "kvroute:gateway_slo_requests",
            "Requests of a band with an SLO (routing config flow_control) that finished, by whether they met it.",
            ["band", "met"], registry=r,
        ))  # fmt: skip
        self.live = _LiveCollector()
        r.register(self.live)
        # (model, tenant, app) -> its last request's hashes: a prompt diverges from its own model's previous one
        self.previous: dict[tuple[str, str, str], Sequence[bytes]] = {}
        self.hits: dict[tuple[str, str], list[int]] = {}  # (tenant, app) -> [matched blocks, prompt blocks]
        self.apps_per_tenant: dict[str, int] = {}  # tenant label -> apps with their own series


class GatewayMetrics:
    """One pool's metrics in the gateway's registry. `tenant_labels`: label series with tenant names instead
    of opaque ids. `for_model(name)` gives another pool's, in the same registry: the series vLLM labels with
    `model_name` (TTFT, E2E latency, finished requests, requests in flight) carry the pool's served name, so
    the label takes only the configured pools' names; the routing series are the gateway's, over all pools."""

    def __init__(self, model_name: str, *, tenant_labels: bool = False, _shared: _Registry | None = None) -> None:
        shared = _shared or _Registry(tenant_labels)
        self._shared = shared
        self.model_name = model_name
        self.tenant_labels = shared.tenant_labels
        self.registry = shared.registry
        self.requests = shared.requests
        self.routed = shared.routed
        self.routing_latency = shared.routing_latency
        self.time_to_first_token = shared.time_to_first_token.labels(model_name)
        self.e2e_request_latency = shared.e2e_request_latency.labels(model_name)
        self.request_success = _Children(shared.request_success, model_name)
        self.errors = shared.errors
        self.responses_store_errors = shared.responses_store_errors
        self.retries = shared.retries
        self.in_flight = shared.in_flight.labels(model_name)
        self.prefix_divergence = shared.prefix_divergence
        self.prefix_hit_rate = shared.prefix_hit_rate
        self.flow_queue_depth = shared.flow_queue_depth
        self.flow_queue_wait = shared.flow_queue_wait
        self.flow_sheds = shared.flow_sheds
        self.flow_dispatches = shared.flow_dispatches
        self.slo_requests = shared.slo_requests

    def for_model(self, model_name: str) -> GatewayMetrics:
        """The metrics of the pool serving `model_name`, in this registry."""
        return GatewayMetrics(model_name, _shared=self._shared)

    def watch(self, fleet_counters: Callable[[], Any], breaker_states: Callable[[], Mapping[str, int]]) -> None:
        """Read these at every scrape (each pool's request path calls this once with its fleet state and
        breakers; the series sum over the pools)."""
        self._shared.live.sources.append((fleet_counters, breaker_states))

    def render(self) -> bytes:
        """The exposition text (Prometheus text format 0.0.4) for `GET /metrics`."""
        return generate_latest(self.registry)

    def tenant_label(self, tenant: Tenant) -> str:
        return label_value(tenant.name) if self.tenant_labels else tenant_id(tenant)

    def observe_prefix(
        self, tenant: Tenant, app: str | None, block_hashes: Sequence[bytes], matched_blocks: int, block_size: int
    ) -> None:
        """The prefix doctor's live half, for one routed request of `tenant`'s `app` (the client's
        x-kvroute-app, unchecked: this bounds it)."""
        shared = self._shared
        key = self._series(self.tenant_label(tenant), label_value(app) if app else DEFAULT_APP)
        previous = shared.previous.get((self.model_name, *key))
        if previous is not None:
            self.prefix_divergence.labels(*key).observe(common_prefix_length(block_hashes, previous) * block_size)
        shared.previous[(self.model_name, *key)] = block_hashes
        totals = shared.hits.setdefault(key, [0, 0])
        totals[0] += matched_blocks
        totals[1] += len(block_hashes)
        if totals[1]:
            self.prefix_hit_rate.labels(*key).set(totals[0] / totals[1])

    def _series(self, tenant: str, app: str) -> tuple[str, str]:
        """(tenant, app), or (tenant, OTHER_APP) once the tenant's or every tenant's app budget is spent."""
        key = (tenant, app)
        shared = self._shared
        if key in shared.hits:
            return key
        apps = shared.apps_per_tenant.get(tenant, 0)
        if apps >= MAX_APPS_PER_TENANT or sum(shared.apps_per_tenant.values()) >= MAX_APPS:
            return (tenant, OTHER_APP)
        shared.apps_per_tenant[tenant] = apps + 1
        return key
