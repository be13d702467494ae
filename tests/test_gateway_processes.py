"""`kvroute gateway --processes N`: N gateway processes on one port, one fleet view each, run as one group."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import time
import urllib.request

import pytest

from launch.up import Fleet, kvroute_argv
from launch.worker import free_port

SYSTEM = "You answer questions about the opening hours of a small bicycle repair shop, briefly. " * 8


def two_free_ports() -> int:
    """A port M with M and M + 1 free right now (process i serves metrics on M + i)."""
    for _ in range(50):
        port = free_port()
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two adjacent free ports")


def wait_ready(port: int, fleet: Fleet, timeout: float = 120, workers: int = 2) -> None:
    """Until 20 connections in a row find /ready with `workers` routable workers (the kernel deals each to a
    process: all of them see the whole fleet; a worker still starting would take no prompt)."""
    deadline = time.monotonic() + timeout
    in_a_row = 0
    while time.monotonic() < deadline:
        assert fleet.exited() is None, fleet.exited()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=2) as response:
                seen = json.loads(response.read()).get("workers", 0) if response.status == 200 else 0
                in_a_row = in_a_row + 1 if seen == workers else 0
        except OSError:
            in_a_row = 0
        if in_a_row == 20:
            return
        time.sleep(0.02 if in_a_row else 0.2)
    raise AssertionError(f"port {port} not ready within {timeout} s")


def chat(port: int, text: str) -> str:
    """One request on a connection of its own (so the kernel deals it to either process): its worker. The
    text is the system message, so that no two prompts share a block (under the template's default system
    prompt they would share one, and kv_aware sends a new prompt to that block's holder once its KV events
    are in the view: rule 4 of gateway/routing/router.py)."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        messages = [{"role": "system", "content": text}, {"role": "user", "content": "Open today?"}]
        body = {"model": "sim", "messages": messages, "max_tokens": 2}
        connection.request("POST", "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"})
        response = connection.getresponse()
        assert response.status == 200, response.read()
        response.read()
        return response.headers["x-kvroute-worker"]
    finally:
        connection.close()


def routed(metrics_port: int) -> float:
    """The requests one process has routed (its kvroute:gateway_requests_total, all series)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(v) for v in re.findall(r"^kvroute:gateway_requests_total\{[^}]*\} (\S+)$", text, re.M))


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(stat[1]) == pid:
                out.append(int(entry))
    return out


@pytest.mark.slow
def test_processes_share_one_port_route_one_prefix_alike_and_drain_as_a_group() -> None:
    fleet = Fleet()
    try:
        worker_ports = [free_port() for _ in range(2)]
        for i, port in enumerate(worker_ports):
            fleet.spawn(
                f"worker-{i}",
                kvroute_argv(
                    "worker", "--model", "sim", "--port", str(port), "--worker-id", f"worker-{i}",
                    "--sim-prefill-us-per-token", "0", "--sim-decode-ms-per-step", "0", "--num-kv-blocks", "512",
                ),
            )  # fmt: skip
        http_port, metrics_port = free_port(), two_free_ports()
        gateway = fleet.spawn(
            "gateway",
            kvroute_argv(
                "gateway", "--model", "sim", "--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", "0",
                "--metrics-port", str(metrics_port), "--processes", "2", "--log-level", "warning",
                "--workers", ",".join(f"127.0.0.1:{p}" for p in worker_ports),
            ),
        )  # fmt: skip
        wait_ready(http_port, fleet)
        for port in (metrics_port, metrics_port + 1):  # both processes are up
            deadline = time.monotonic() + 60
            while True:
                try:
                    routed(port)
                    break
                except OSError:
                    assert time.monotonic() < deadline, f"metrics port {port} never answered"
                    time.sleep(0.2)
        processes = children_of(gateway.pid)
        assert len(processes) == 2

        # Each prompt once, then from many connections over both processes: once its worker's KV events
        # have reached every process's view, each prompt lands on that worker whichever process routes it.
        prompts = [f"Customer number {i} writes: " * 3 + SYSTEM for i in range(8)]
        holders = {prompt: chat(http_port, prompt) for prompt in prompts}
        assert set(holders.values()) == {"worker-0", "worker-1"}  # the prompts do spread
        time.sleep(1.5)  # the KV events reach each process's fleet view (embedded: GetKVEvents polls)
        for _ in range(4):
            for prompt in prompts:
                assert chat(http_port, prompt) == holders[prompt]
        shares = [routed(metrics_port), routed(metrics_port + 1)]
        assert all(share > 0 for share in shares), shares  # the kernel spread the connections over both

        gateway.process.send_signal(signal.SIGHUP)  # passed on; each process reloads (here: nothing) and serves on
        time.sleep(0.5)
        assert chat(http_port, "Still there?") in ("worker-0", "worker-1")
        assert all(os.path.exists(f"/proc/{pid}") for pid in processes)

        assert gateway.signal(signal.SIGTERM, wait_s=40) == 0  # the whole group drains and exits 0
        assert not [pid for pid in processes if os.path.exists(f"/proc/{pid}")]
    finally:
        fleet.stop()
