"""Prometheus metrics of one worker, under vLLM's names so that vLLM dashboards and alerts work unchanged.

Occupancy gauges and cumulative counters are read from the engine's latest `EngineStats` at scrape time
(a custom collector, so they can never drift from the engine's own books). Per-request histograms are
observed by a `RequestTimer` that the gRPC service drives as it streams a request.

Every worker has its own `CollectorRegistry`, so several workers (tests, one-machine fleets) can live in
one process. Names contain ':' as vLLM's do; the exposition appends `_total` to counters. The server answers
in the Prometheus text format 0.0.4 whatever the scraper's Accept header asks (as vLLM's does): in
OpenMetrics this prometheus_client escapes ':' to '_', and a Prometheus server (which asks for OpenMetrics)
would store every `vllm:` series as `vllm_`. docs/worker.md lists the series served.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4, ThreadingWSGIServer, generate_latest
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from worker.engine import EngineStats
    from worker.sequence import RequestTimings

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
TEXT_FORMAT = CONTENT_TYPE_PLAIN_0_0_4
REQUEST_LATENCY_BUCKETS = E2E_BUCKETS  # vLLM's queue, prefill, decode and inference times share them


def buckets_1_2_5(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's build_1_2_5_buckets, for token counts)."""
    out: list[float] = []
    magnitude = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * magnitude
            if value > limit:
                return tuple(out)
            out.append(float(value))
        magnitude *= 10


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
            "kvroute:num_preemptions_recomputed": (
                "Preempted requests that resumed recomputing at least one full KV block (gone from every tier).",
                stats.num_preemptions_recomputed,
            ),
            "vllm:prompt_tokens": ("Number of prefill tokens processed.", stats.prompt_tokens_total),
            "vllm:generation_tokens": ("Number of generation tokens processed.", stats.generation_tokens_total),
        }
        if stats.host_kv_blocks_total:  # the host tier's (worker/host_kv_tier.py); vLLM has no names for these
            host_usage = stats.host_kv_blocks_cached / stats.host_kv_blocks_total
            gauges["kvroute:host_kv_cache_usage_perc"] = ("Host KV tier usage. 1 means 100 percent usage.", host_usage)
            counters |= {
                "kvroute:host_prefix_cache_hits": (
                    "Prefix cache hits copied back from the host tier, in tokens (also in vllm:prefix_cache_hits).",
                    stats.host_prefix_hits,
                ),
                "kvroute:host_kv_blocks_saved": ("KV blocks copied to the host tier.", stats.host_kv_blocks_saved),
                "kvroute:host_kv_blocks_restored": (
                    "KV blocks copied back from the host tier.",
                    stats.host_kv_blocks_restored,
                ),
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
    """One worker's metrics in its own registry; `serve(port)` exposes them at http://host:port/metrics.

    `max_model_len` and `max_num_batched_tokens` size the token-count histograms; `cache_config` becomes the
    labels of `vllm:cache_config_info` (block_size, cache_dtype, ..., as strings)."""

    def __init__(
        self,
        model_name: str,
        stats_source: Callable[[], EngineStats | None],
        *,
        max_model_len: int = 2048,
        max_num_batched_tokens: int = 2048,
        cache_config: dict[str, str] | None = None,
    ) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        self.registry.register(EngineStatsCollector(model_name, stats_source))
        if cache_config:
            info = Gauge(
                "vllm:cache_config_info", "Information of the LLMEngine's CacheConfig.", sorted(cache_config),
                registry=self.registry,
            )  # fmt: skip
            info.labels(**cache_config).set(1)
        # What Gateway API Inference Extension pickers read for LoRA affinity; this engine serves no adapters,
        # so the lists are empty and max_lora 0 (vLLM sets the value to the time of its last update).
        lora = Gauge(
            "vllm:lora_requests_info", "Running stats on lora requests.",
            ["max_lora", "running_lora_adapters", "waiting_lora_adapters"], registry=self.registry,
        )  # fmt: skip
        lora.labels(max_lora="0", running_lora_adapters="", waiting_lora_adapters="").set_to_current_time()
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
        self.queue_time = self._histogram(
            "vllm:request_queue_time_seconds", "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.prefill_time = self._histogram(
            "vllm:request_prefill_time_seconds", "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.decode_time = self._histogram(
            "vllm:request_decode_time_seconds", "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.inference_time = self._histogram(
            "vllm:request_inference_time_seconds", "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = self._histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self.request_generation_tokens = self._histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self.request_max_tokens = self._histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )
        self.iteration_tokens = self._histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
            buckets_1_2_5(max_num_batched_tokens),
        )  # fmt: skip
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

    def text_format(self) -> bytes:
        """The registry in the Prometheus text format 0.0.4 (`TEXT_FORMAT`), as /metrics serves it."""
        return generate_latest(self.registry)

    def serve(self, port: int, host: str) -> int:
        """Serve /metrics on host:port from a daemon thread, in the text format 0.0.4 whatever the Accept
        header; returns the bound port (pass 0 for a free one). Raises OSError when it cannot listen."""
        self._http_server = serve_text_format(self.registry, host, port)
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

    def on_finished(
        self, finish_reason: str, timings: RequestTimings | None = None, prompt_tokens: int = 0, max_tokens: int = 0
    ) -> None:
        """The request ended. `timings` (the engine's, on its finished output) add the phase histograms and
        the token counts; a request that ended before the engine finished it (a cancel) has none."""
        now = self.clock()
        m = self.metrics
        m.e2e_request_latency.observe(now - self.arrival)
        if self.first_token_time is not None and self.num_tokens > 1:
            m.time_per_output_token.observe((now - self.first_token_time) / (self.num_tokens - 1))
        m.request_success.labels(m.model_name, finish_reason).inc()
        if timings is None:
            return
        m.request_prompt_tokens.observe(prompt_tokens)
        m.request_generation_tokens.observe(self.num_tokens)
        m.request_max_tokens.observe(max_tokens)
        if timings.first_scheduled is not None:
            m.queue_time.observe(timings.first_scheduled - timings.arrival)
            if timings.first_token is not None and timings.last_token is not None:
                m.prefill_time.observe(timings.first_token - timings.first_scheduled)
                m.decode_time.observe(timings.last_token - timings.first_token)
                m.inference_time.observe(timings.last_token - timings.first_scheduled)


class _Exposition:
    """A WSGI app: the registry in the Prometheus text format 0.0.4 at any GET path."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        if environ["REQUEST_METHOD"] not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD")])
            return [b""]
        body = generate_latest(self.registry)
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_PLAIN_0_0_4), ("Content-Length", str(len(body)))])
        return [b"" if environ["REQUEST_METHOD"] == "HEAD" else body]


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """No access log."""


def serve_text_format(registry: CollectorRegistry, host: str, port: int) -> WSGIServer:
    """A thread-per-request HTTP server of `registry` (text format 0.0.4) on host:port, serving from a daemon
    thread; `.shutdown()` and `.server_close()` stop it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET

    class Server(ThreadingWSGIServer):
        address_family = family

    server = make_server(host, port, _Exposition(registry), Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics-http", daemon=True).start()
    return server
