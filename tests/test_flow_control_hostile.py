"""A hostile tenant hammering the flow-control queue of a real `kvroute gateway` process in front of a real sim
worker: past its queue bound it gets 429 with Retry-After at once, another tenant's request is still served, the
gateway's RSS stays bounded and its `/health` keeps answering.

The `/health` bound here (250 ms at p99) catches a stall (the event loop held for seconds), not a regression of
a few milliseconds; its measured figure is in docs/flow_control.md."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx
import pytest

from gateway.admission.auth import key_sha256
from launch.fleet import Fleet, free_port, http_ok, kvroute_argv
from tests.test_prompt_hardening import rss_mib

HOSTILE, QUIET = "sk-hostile", "sk-quiet"
TENANT_MAX_QUEUED = 16
FLOOD = 600  # concurrent requests from the hostile tenant
HEALTH_P99_BOUND_S = 0.25
RSS_GROWTH_BOUND_MIB = 64


def chat(content: str, max_tokens: int) -> dict:
    return {"model": "sim", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads RSS from /proc (Linux only)")
def test_a_hostile_tenant_hammering_the_queue_gets_429s_and_bounds_the_gateway(launcher: Fleet, tmp_path: Path) -> None:
    keys, routing = tmp_path / "keys.json", tmp_path / "routing.json"
    keys.write_text(
        json.dumps([
            {"tenant": "hostile", "key_sha256": key_sha256(HOSTILE), "max_concurrency": 10_000},
            {"tenant": "quiet", "key_sha256": key_sha256(QUIET)},
        ])
    )  # fmt: skip
    routing.write_text(json.dumps({"flow_control": {"tenant_max_queued": TENANT_MAX_QUEUED}}))
    worker_port, http_port, metrics_port = free_port(), free_port(), free_port()
    launcher.spawn(
        "worker",
        kvroute_argv(
            "worker", "--model", "sim", "--port", str(worker_port), "--num-kv-blocks", "256",
            "--max-model-len", "2048", "--sim-decode-ms-per-step", "20",
        ),
    ).wait_for_line("kvroute worker: serving", timeout_s=120)  # fmt: skip
    gateway = launcher.spawn(
        "gateway",
        kvroute_argv(
            "gateway", "--model", "sim", "--workers", f"127.0.0.1:{worker_port}", "--host", "127.0.0.1",
            "--http-port", str(http_port), "--grpc-port", "0", "--api-keys-file", str(keys),
            "--routing-config", str(routing), "--allow-derived-salt", "--log-level", "warning",
            "--metrics-port", str(metrics_port),
        ),
    )  # fmt: skip
    url = f"http://127.0.0.1:{http_port}"
    launcher.wait_until(lambda: http_ok(f"{url}/health"), "the gateway", 60)

    async def flood_and_probe() -> tuple[list[httpx.Response], list[float], int, httpx.Response, float]:
        limits = httpx.Limits(max_connections=FLOOD + 8, max_keepalive_connections=FLOOD + 8)
        async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
            # the worker busy for a while: every later request waits in the gateway's queue
            await client.post(
                "/v1/chat/completions", json=chat("warm", 2), headers={"authorization": f"Bearer {QUIET}"}
            )
            before = rss_mib(gateway.pid)
            hostile = {"authorization": f"Bearer {HOSTILE}"}
            flood = [
                asyncio.ensure_future(
                    client.post("/v1/chat/completions", json=chat(f"flood {i}", 150), headers=hostile)
                )
                for i in range(FLOOD)
            ]
            health: list[float] = []
            deepest = 0
            async with httpx.AsyncClient(base_url=url, timeout=30) as prober:
                quiet = asyncio.ensure_future(
                    prober.post(
                        "/v1/chat/completions", json=chat("quiet", 4), headers={"authorization": f"Bearer {QUIET}"}
                    )
                )
                while not all(task.done() for task in flood) or len(health) < 100:
                    start = time.monotonic()
                    assert (await prober.get("/health")).status_code == 200
                    health.append(time.monotonic() - start)
                    deepest = max(
                        deepest, queue_depth((await prober.get(f"http://127.0.0.1:{metrics_port}/metrics")).text)
                    )
                    await asyncio.sleep(0.01)
                quiet_response = await quiet
            grown = rss_mib(gateway.pid) - before
            return [task.result() for task in flood], health, deepest, quiet_response, grown

    responses, health, deepest, quiet_response, grown = asyncio.run(flood_and_probe())
    statuses = [r.status_code for r in responses]
    refused = [r for r in responses if r.status_code == 429]
    assert set(statuses) <= {200, 429}, sorted(set(statuses))
    assert len(refused) >= FLOOD // 2, f"only {len(refused)} of {FLOOD} refused past a queue bound of 16"
    assert 0 < deepest <= TENANT_MAX_QUEUED + 1, deepest  # the quiet tenant's one request besides
    assert all(int(r.headers["retry-after"]) >= 1 for r in refused)
    assert "requests waiting for a worker, its bound" in refused[0].json()["error"]["message"]
    assert quiet_response.status_code == 200, quiet_response.text
    p99 = statistics.quantiles(health, n=100)[98]
    assert p99 < HEALTH_P99_BOUND_S, f"/health p99 {p99 * 1000:.0f} ms during the flood"
    assert grown < RSS_GROWTH_BOUND_MIB, f"RSS grew by {grown:.0f} MiB under the flood"
    p50 = statistics.median(health)
    print(f"{len(refused)}/{FLOOD} refused, deepest queue {deepest}, /health p50 {p50 * 1e3:.1f} ms", end=" ")
    print(f"p99 {p99 * 1e3:.1f} ms, RSS +{grown:.0f} MiB")


def queue_depth(metrics: str) -> int:
    """The gateway's flow-control queue depth over every band, from its Prometheus text."""
    return round(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("kvroute:gateway_flow_queue_depth{")
        )
    )
