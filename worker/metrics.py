"""Prometheus metrics of one worker, under vLLM's names so that vLLM dashboards and alerts work unchanged.

Occupancy gauges and cumulative counters are read from the engine's latest `EngineStats` at scrape time
(a custom collector, so they can never drift from the engine's own books). Per-request histograms are
observed by a `RequestTimer` that the gRPC service drives as it streams a request.

Every worker has its own `CollectorRegistry`, so several workers (tests, one-machine fleets) can live in
one process. Names contain ':' as vLLM's do; the exposition appends `_total` to counters.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from worker.engine import EngineStats

# vLLM's buckets (vllm/v1/metrics/loggers.py), so that quantiles compare across engines.
TTFT_BUCKETS = (
    *(0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0),
)
ITL_BUCKETS = (
    *(0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75),
    *(1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0),
)
E2E_BUCKETS = (
    *(0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0),
    *(120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0),
)


class EngineStatsCollector(Collector):
    """Gauges and counters taken from the engine's books when Prometheus scrapes."""

    def __init__(self, model_name: str, stats_source: Callable[[], EngineStats | None]) -> None:
        self.model_name = model_name
        self.stats_source = stats_source

    def collect(self) -> Iterator[Metric]:
        stats = self.stats_source()
        if stats is None:
            return
        usage = stats.kv_cache_usage
        gauges = {
            "vllm:num_requests_running": ("Number of requests in model execution batches.", stats.num_running),
            "vllm:num_requests_waiting": ("Number of requests waiting to be processed.", stats.num_waiting),
            "vllm:kv_cache_usage_perc": ("KV-cache usage. 1 means 100 percent usage.", usage),
        }
        counters = {
            "vllm:prefix_cache_queries": ("Prefix cache queries, in queried tokens.", stats.prefix_queries),
            "vllm:prefix_cache_hits": ("Prefix cache hits, in cached tokens.", stats.prefix_hits),
            "vllm:num_preemptions": ("Cumulative number of preemptions.", stats.num_preemptions),
            "vllm:prompt_tokens": ("Number of prefill tokens processed.", stats.prompt_tokens_total),
            "vllm:generation_tokens": ("Number of generation tokens processed.", stats.generation_tokens_total),
        }
        for name, (doc, value) in gauges.items():
            gauge = GaugeMetricFamily(name, doc, labels=["model_name"])
            gauge.add_metric([self.model_name], value)
            yield gauge
        for name, (doc, value) in counters.items():
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric([self.model_name], value)
            yield counter


class WorkerMetrics:
    """One worker's metrics in its own registry; `serve(port)` exposes them at http://host:port/metrics."""

    def __init__(self, model_name: str, stats_source: Callable[[], EngineStats | None]) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(model_name, stats_source))
        self.time_to_first_token = self._histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.inter_token_latency = self._histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.time_per_output_token = self._histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e_request_latency = self._histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", E2E_BUCKETS
        )
        self.request_success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        # No vLLM names for these two: vLLM neither bounds its queue nor checks a router's hashes.
        self.requests_refused = Counter(
            "kvroute:requests_refused",
            "Requests refused with RESOURCE_EXHAUSTED, by the bound that was reached.",
            ["model_name", "limit"],
            registry=self.registry,
        )
        self.block_hash_mismatches = Counter(
            "kvroute:block_hash_mismatches",
            "Requests whose gateway block hashes differ from the worker's own (a hash-parity fault).",
            ["model_name"],
            registry=self.registry,
        ).labels(model_name)
        self._http_server: WSGIServer | None = None

    def _histogram(self, name: str, documentation: str, buckets: tuple[float, ...]) -> Histogram:
        histogram = Histogram(name, documentation, ["model_name"], buckets=buckets, registry=self.registry)
        return histogram.labels(self.model_name)

    def start_request(self) -> RequestTimer:
        return RequestTimer(self)

    def serve(self, port: int, host: str) -> int:
        """Serve /metrics on host:port from a daemon thread; returns the bound port (pass 0 for a free one)."""
        self._http_server, _ = start_http_server(port, addr=host, registry=self.registry)
        return self._http_server.server_port

    @property
    def address(self) -> tuple[str, int] | None:
        """The (host, port) /metrics is bound to, or None when not serving."""
        if self._http_server is None:
            return None
        host, port = self._http_server.server_address[:2]
        return str(host), int(port)

    def stop(self) -> None:
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
            self._http_server = None


class RequestTimer:
    """Times one request from arrival: TTFT at its first tokens, inter-token gaps after, E2E at the end."""

    def __init__(self, metrics: WorkerMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self.metrics = metrics
        self.clock = clock
        self.arrival = clock()
        self.first_token_time: float | None = None
        self.last_token_time = self.arrival
        self.num_tokens = 0

    def on_tokens(self, num_new: int) -> None:
        if num_new == 0:
            return
        now = self.clock()
        if self.first_token_time is None:
            self.first_token_time = now
            self.metrics.time_to_first_token.observe(now - self.arrival)
            num_gaps = num_new - 1
        else:
            num_gaps = num_new
        # Tokens that arrive together share the gap since the previous message.
        for _ in range(num_gaps):
            self.metrics.inter_token_latency.observe((now - self.last_token_time) / num_new)
        self.last_token_time = now
        self.num_tokens += num_new

    def on_finished(self, finish_reason: str) -> None:
        now = self.clock()
        self.metrics.e2e_request_latency.observe(now - self.arrival)
        if self.first_token_time is not None and self.num_tokens > 1:
            self.metrics.time_per_output_token.observe((now - self.first_token_time) / (self.num_tokens - 1))
        self.metrics.request_success.labels(self.metrics.model_name, finish_reason).inc()
