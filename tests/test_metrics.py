"""Prometheus metrics: vLLM's names with sane values, scraped over HTTP from a real worker (`sim`)."""

from __future__ import annotations

import asyncio
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proto import worker_pb2, worker_pb2_grpc
from worker.config import EngineConfig
from worker.engine import EngineStats, LLMEngine
from worker.metrics import RequestTimer, WorkerMetrics
from worker.service import start_worker_server

MODEL = "sim"


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample at http://127.0.0.1:port/metrics, keyed by (name, sorted labels without model_name)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "model_name"))
            samples[(sample.name, labels)] = sample.value
    return samples


def test_metrics_endpoint_has_vllm_names_with_sane_values() -> None:
    engine = LLMEngine(EngineConfig(model=MODEL, num_kv_blocks=64))
    prompt = list(range(1, 41))  # 40 tokens: 2 full blocks
    max_tokens = 5

    async def main() -> dict:
        server = await start_worker_server(engine, port=0, metrics_port=0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                request = worker_pb2.GenerateRequest(
                    prompt_token_ids=prompt, sampling=worker_pb2.SamplingParams(max_tokens=max_tokens)
                )
                for _ in range(3):  # the second and third hit the cached blocks of the first
                    async for _ in stub.Generate(request):
                        pass
                await stub.GetStats(worker_pb2.GetStatsRequest())  # the engine thread has published its stats
            return await asyncio.to_thread(scrape, server.metrics_port)
        finally:
            await server.stop(drain_timeout=0)

    m = asyncio.run(main())
    assert m[("vllm:num_requests_running", ())] == 0
    assert m[("vllm:num_requests_waiting", ())] == 0
    assert m[("vllm:kv_cache_usage_perc", ())] == 0.0
    assert m[("vllm:prefix_cache_queries_total", ())] == 3 * len(prompt)
    assert m[("vllm:prefix_cache_hits_total", ())] == 2 * 32
    assert m[("vllm:prompt_tokens_total", ())] == 3 * len(prompt)
    assert m[("vllm:generation_tokens_total", ())] == 3 * max_tokens
    assert m[("vllm:num_preemptions_total", ())] == 0
    assert m[("vllm:request_success_total", (("finished_reason", "length"),))] == 3
    assert m[("vllm:time_to_first_token_seconds_count", ())] == 3
    assert m[("vllm:e2e_request_latency_seconds_count", ())] == 3
    assert m[("vllm:inter_token_latency_seconds_count", ())] == 3 * (max_tokens - 1)
    assert m[("vllm:request_time_per_output_token_seconds_count", ())] == 3
    ttft_sum = m[("vllm:time_to_first_token_seconds_sum", ())]
    e2e_sum = m[("vllm:e2e_request_latency_seconds_sum", ())]
    assert 0 < ttft_sum < e2e_sum < 10
    # The phases vLLM reports, from the engine's own timestamps: queue + prefill + decode = inference + queue.
    phases = [m[(f"vllm:request_{p}_time_seconds_sum", ())] for p in ("queue", "prefill", "decode", "inference")]
    assert all(
        m[(f"vllm:request_{p}_time_seconds_count", ())] == 3 for p in ("queue", "prefill", "decode", "inference")
    )
    assert phases[1] + phases[2] == pytest.approx(phases[3]) and phases[3] < e2e_sum
    assert m[("vllm:request_prompt_tokens_sum", ())] == 3 * len(prompt)
    assert m[("vllm:request_generation_tokens_sum", ())] == 3 * max_tokens
    assert m[("vllm:request_params_max_tokens_sum", ())] == 3 * max_tokens
    # Every token the steps computed: the first prompt whole, the others past their 2 cached blocks, the decodes.
    computed = len(prompt) + 2 * (len(prompt) - 32) + 3 * (max_tokens - 1)
    assert m[("vllm:iteration_tokens_total_sum", ())] == computed
    info = next(labels for (name, labels) in m if name == "vllm:cache_config_info")
    assert dict(info) == {
        "block_size": "16",
        "cache_dtype": "auto",
        "enable_prefix_caching": "True",
        "num_gpu_blocks": "64",
    }


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_request_timer_observes_ttft_itl_e2e() -> None:
    metrics = WorkerMetrics("m", lambda: None)
    clock = FakeClock()
    timer = RequestTimer(metrics, clock)
    clock.now += 0.5
    timer.on_tokens(1)  # TTFT 0.5
    clock.now += 0.1
    timer.on_tokens(1)  # ITL 0.1
    clock.now += 0.4
    timer.on_tokens(2)  # two tokens together: two gaps of 0.2
    timer.on_finished("stop")  # E2E 1.0; TPOT (1.0 - 0.5) / 3
    r = metrics.registry
    labels = {"model_name": "m"}
    assert r.get_sample_value("vllm:time_to_first_token_seconds_sum", labels) == pytest.approx(0.5)
    assert r.get_sample_value("vllm:inter_token_latency_seconds_count", labels) == 3
    assert r.get_sample_value("vllm:inter_token_latency_seconds_sum", labels) == pytest.approx(0.5)
    assert r.get_sample_value("vllm:e2e_request_latency_seconds_sum", labels) == pytest.approx(1.0)
    assert r.get_sample_value("vllm:request_time_per_output_token_seconds_sum", labels) == pytest.approx(0.5 / 3)
    success = r.get_sample_value("vllm:request_success_total", {**labels, "finished_reason": "stop"})
    assert success == 1


def test_each_worker_has_its_own_registry() -> None:
    stats = EngineStats(10, 4, 3, 2, 1, 100, 40, 1, 0, 100, 20)
    first = WorkerMetrics("a", lambda: stats)
    second = WorkerMetrics("b", lambda: None)  # no stats yet: no gauges, and no error
    assert first.registry.get_sample_value("vllm:kv_cache_usage_perc", {"model_name": "a"}) == 0.4
    assert first.registry.get_sample_value("vllm:num_requests_waiting", {"model_name": "a"}) == 1
    assert second.registry.get_sample_value("vllm:kv_cache_usage_perc", {"model_name": "b"}) is None


def test_metrics_listen_where_the_grpc_port_listens_unless_told_otherwise() -> None:
    engine = LLMEngine(EngineConfig(model=MODEL, num_kv_blocks=16))

    async def main() -> list[tuple[str, int] | None]:
        addresses = []
        for metrics_host in (None, "0.0.0.0"):
            server = await start_worker_server(engine, "127.0.0.1", port=0, metrics_port=0, metrics_host=metrics_host)
            addresses.append(server.metrics.address)
            await server.stop(drain_timeout=0)
            assert server.metrics.address is None
        return addresses

    loopback, everywhere = asyncio.run(main())
    assert loopback is not None and loopback[0] == "127.0.0.1"
    assert everywhere is not None and everywhere[0] == "0.0.0.0"
