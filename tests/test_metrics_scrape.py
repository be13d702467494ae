"""Metrics as a real Prometheus server stores them (issue 19, item 11): Debian's `prometheus` scrapes a worker
and a gateway every second, and the names it stores are vLLM's `vllm:*` and our `kvroute:*`, not their
OpenMetrics-escaped `vllm_*` / `kvroute_*` spellings. .ci/run installs the package; where /usr/bin/prometheus
is absent the scrape test is skipped (the format test beside it still runs).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from gateway_stack import KEY, GatewayStack, StackOptions

from launch.fleet import Fleet, free_port
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.service import WorkerServer, start_worker_server

PROMETHEUS = shutil.which("prometheus") or "/usr/bin/prometheus"
# What Prometheus 2.x sends: OpenMetrics first, the text format as a fallback.
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
    "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
# The vLLM series a worker serves (docs/worker.md lists them); histograms by their _count series.
VLLM_SERIES = [
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
    "vllm:time_to_first_token_seconds_count", "vllm:inter_token_latency_seconds_count",
    "vllm:request_time_per_output_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_count", "vllm:request_inference_time_seconds_count",
    "vllm:request_prompt_tokens_count", "vllm:request_generation_tokens_count",
    "vllm:request_params_max_tokens_count", "vllm:iteration_tokens_total_count", "vllm:cache_config_info",
    "vllm:lora_requests_info",
]  # fmt: skip
# The info series' labels that Gateway API Inference Extension pickers read (block size, pool size; LoRA).
INFO_LABELS = {
    "vllm:cache_config_info": {"block_size": "16", "num_gpu_blocks": "64"},
    "vllm:lora_requests_info": {"max_lora": "0", "running_lora_adapters": "", "waiting_lora_adapters": ""},
}


def metrics_worker(stack: GatewayStack) -> WorkerServer:
    """One more sim worker in the stack's loop, with its metrics on a free port."""

    async def start() -> WorkerServer:
        engine = await asyncio.get_running_loop().run_in_executor(
            None, lambda: LLMEngine(EngineConfig(model="sim", num_kv_blocks=64, max_model_len=512))
        )
        return await start_worker_server(engine, port=0, metrics_port=0)

    return stack.call(start(), timeout=60)


def test_worker_metrics_answer_the_text_format_whatever_the_accept_header() -> None:
    async def main() -> tuple[str, str]:
        engine = LLMEngine(EngineConfig(model="sim", num_kv_blocks=16))
        server = await start_worker_server(engine, port=0, metrics_port=0)
        try:
            request = urllib.request.Request(
                f"http://127.0.0.1:{server.metrics_port}/metrics", headers={"accept": PROMETHEUS_ACCEPT}
            )
            with await asyncio.to_thread(urllib.request.urlopen, request, timeout=5) as response:
                return response.headers["content-type"], response.read().decode()
        finally:
            await server.stop(drain_timeout=0)

    content_type, text = asyncio.run(main())
    assert content_type.startswith("text/plain; version=0.0.4")
    assert "\nvllm:num_requests_running{" in text and "vllm_" not in text


def query(url: str, path: str, **params: str) -> Any:
    with urllib.request.urlopen(f"{url}{path}?{urllib.parse.urlencode(params)}", timeout=5) as response:
        return json.loads(response.read())["data"]


@pytest.mark.slow
@pytest.mark.skipif(not Path(PROMETHEUS).exists(), reason="no prometheus binary (.ci/run installs Debian's)")
def test_a_real_prometheus_stores_vllm_and_kvroute_names(tmp_path: Path) -> None:
    with GatewayStack(StackOptions(model="sim", workers=1)) as stack:
        worker = metrics_worker(stack)
        try:
            for _ in range(2):  # a request through the gateway, and one to the scraped worker's own port
                response = urllib.request.urlopen(
                    urllib.request.Request(
                        f"{stack.http_url}/v1/completions",
                        json.dumps({"prompt": "Hello there " * 8, "max_tokens": 3}).encode(),
                        {"content-type": "application/json", "authorization": f"Bearer {KEY}"},
                    ),
                    timeout=30,
                )
                assert response.status == 200
            stack.call(_generate(worker.port))
            names, labels = scrape_with_prometheus(tmp_path, worker.metrics_port, stack.metrics_http.port)
        finally:
            stack.call(worker.stop(drain_timeout=0))
    missing = [name for name in [*VLLM_SERIES, "kvroute:gateway_requests_total"] if name not in names]
    assert not missing, f"stored names lack {missing}; stored: {sorted(names)}"
    assert not [n for n in names if n.startswith(("vllm_", "kvroute_"))], "no name stored escaped"
    for name, expected in INFO_LABELS.items():
        stored = labels[name]
        assert {key: stored.get(key, "") for key in expected} == expected, stored


async def _generate(port: int) -> None:
    import grpc

    from proto import worker_pb2, worker_pb2_grpc

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        request = worker_pb2.GenerateRequest(
            prompt_token_ids=list(range(1, 41)), sampling=worker_pb2.SamplingParams(max_tokens=3)
        )
        async for _ in worker_pb2_grpc.WorkerStub(channel).Generate(request):
            pass


def scrape_with_prometheus(
    tmp_path: Path, worker_port: int, gateway_port: int
) -> tuple[set[str], dict[str, dict[str, str]]]:
    """Run Prometheus on a free loopback port, scraping both targets every second, until each has been
    scraped with the series in; returns every metric name it stored, and the stored labels of one series of
    each INFO_LABELS name (Prometheus drops a label whose value is empty)."""
    config = tmp_path / "prometheus.yml"
    config.write_text(
        "global: {scrape_interval: 1s, scrape_timeout: 1s}\n"
        "scrape_configs:\n"
        f"  - {{job_name: worker, static_configs: [{{targets: ['127.0.0.1:{worker_port}']}}]}}\n"
        f"  - {{job_name: gateway, static_configs: [{{targets: ['127.0.0.1:{gateway_port}']}}]}}\n"
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}"]  # fmt: skip
    found: dict[str, Any] = {}

    def scraped() -> bool:
        try:
            found["up"] = query(url, "/api/v1/query", query="up == 1")
            found["names"] = set(query(url, "/api/v1/label/__name__/values"))
        except (urllib.error.URLError, OSError):
            return False
        return len(found["up"]) == 2 and {
            "vllm:request_decode_time_seconds_count", "kvroute:gateway_requests_total"
        } <= found["names"]  # fmt: skip

    with Fleet(tmp_path / "logs") as fleet:
        fleet.spawn("prometheus", argv)
        fleet.wait_until(scraped, "Prometheus's scrape of both targets", 30)
        labels = {}
        for name in INFO_LABELS:
            series = query(url, "/api/v1/series", **{"match[]": name})
            labels[name] = series[0] if series else {}
    return found["names"], labels
