"""Processes: the gateway imports without torch, and `kvroute up` runs a fleet and leaves no child behind."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import redis

from launch.fleet import LaunchError, free_port, wait_until

ROOT = Path(__file__).resolve().parent.parent


def test_the_gateway_and_its_front_doors_import_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"  # `import torch` now raises ImportError
        "import gateway.cli_gateway, gateway.frontdoors.http_server, gateway.frontdoors.grpc_server\n"
        "import gateway.request_path\n"
        "import gateway.fleet.embedded_fleet, gateway.fleet.redis_fleet, launch.up\n"
        "from launch.cli import build_parser\n"
        "build_parser(['gateway']).parse_args(['gateway', '--workers', 'a:1'])\n"
        "assert 'torch' not in [m.split('.')[0] for m, v in sys.modules.items() if v is not None]\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


def children_of(pid: int) -> set[int]:
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                found.add(int(entry.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_kvroute_up_serves_and_ctrl_c_stops_every_child(launcher_up) -> None:
    port, metrics_port = free_port(), free_port()
    up = launcher_up(
        "--workers", "2", "--model", "sim", "--http-port", str(port), "--grpc-port", "0",
        "--metrics-port", str(metrics_port), "--worker-args", "--num-kv-blocks 64 --max-model-len 512 --http-port 0",
    )  # fmt: skip
    lines = up.output().splitlines()
    ready = next(line for line in lines if "Ctrl-C stops them all" in line)
    assert "2 sim workers" in ready and f"http://127.0.0.1:{port}/v1" in ready
    children = children_of(up.pid)
    assert len(children) == 3  # two workers and the gateway
    # Through the gateway, and (`kvroute worker --http-port`) through a worker's own OpenAI front door.
    worker_urls = [line.split(" on ")[1].strip() for line in lines if "OpenAI HTTP API on" in line]
    assert len(worker_urls) == 2
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    for url, worker_ids in ((f"http://127.0.0.1:{port}/v1", ("worker-0", "worker-1")), (worker_urls[0], None)):
        request = urllib.request.Request(
            f"{url}/chat/completions", json.dumps(body).encode(), {"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            assert worker_ids is None or response.headers["x-kvroute-worker"] in worker_ids
            assert json.loads(response.read())["usage"]["completion_tokens"] == 3
    # The gateway's metrics on their own port, not on the API's.
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
        assert b"kvroute:gateway_requests_total{" in response.read()
    with pytest.raises(urllib.error.HTTPError, match="404"):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
    assert up.signal(signal.SIGINT, wait_s=60) == 0  # Ctrl-C
    assert not [pid for pid in children if alive(pid)]


def test_the_launcher_stops_a_child_that_ignores_sigterm_and_its_own_children(launcher) -> None:
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "grandchild = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print('grandchild', grandchild.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    stubborn = launcher.spawn("stubborn", [sys.executable, "-c", code])
    grandchild = int(stubborn.wait_for_line("grandchild", timeout_s=30).split()[1])
    assert stubborn.running and alive(grandchild)
    started = time.monotonic()
    launcher.stop(grace_s=0.5)
    assert time.monotonic() - started < 10
    assert stubborn.returncode == -signal.SIGKILL
    deadline = time.monotonic() + 5
    while alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)  # reaped by init once its parent is gone
    assert not alive(grandchild)


def test_the_launcher_signals_a_draining_child_once(launcher) -> None:
    """A worker or gateway takes a second SIGTERM as "stop without draining" (exit 130): stop sends one."""
    code = (
        "import signal, sys, time\n"
        "signals = []\n"
        "signal.signal(signal.SIGTERM, lambda *_: signals.append(1) if len(signals) == 0 else sys.exit(130))\n"
        "print('ready', flush=True)\n"
        "while not signals:\n"
        "    time.sleep(0.01)\n"
        "time.sleep(0.5)\n"  # the drain
        "sys.exit(0)\n"
    )
    drainer = launcher.spawn("drainer", [sys.executable, "-c", code])
    drainer.wait_for_line("ready", timeout_s=30)
    launcher.stop(grace_s=20)
    assert drainer.returncode == 0


def test_a_child_that_exits_while_the_fleet_starts_is_named_with_its_log(launcher) -> None:
    launcher.spawn("waiter", [sys.executable, "-c", "import time; time.sleep(60)"])
    launcher.spawn("crasher", [sys.executable, "-c", "import sys; print('no model here'); sys.exit(3)"])
    with pytest.raises(LaunchError, match=r"crasher exited with status 3\n.*no model here"):
        launcher.wait_until(lambda: False, "the fleet", timeout_s=30)
    assert launcher.exited() == "crasher exited with status 3"
    with pytest.raises(LaunchError, match="the fleet was not ready after 0.3 s"):
        wait_until(launcher.children[:1], lambda: False, "the fleet", timeout_s=0.3)


def test_free_port_never_hands_out_a_port_twice() -> None:
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)


@pytest.mark.slow
def test_kvroute_up_with_a_local_redis_runs_it_and_stops_it_with_the_fleet(launcher_up) -> None:
    port = free_port()
    up = launcher_up(
        "--workers", "1", "--model", "sim", "--http-port", str(port), "--grpc-port", "0", "--metrics-port", "0",
        "--redis", "local", "--worker-args", "--num-kv-blocks 64 --max-model-len 512",
    )  # fmt: skip
    assert "fleet state in Redis at redis://127.0.0.1:" in up.output()
    children = children_of(up.pid)
    commands = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in children]  # redis-server retitles itself
    assert len(children) == 3 and any(b"redis-server" in command for command in commands)
    body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.headers["x-kvroute-worker"] == "worker-0"
    previous = None
    for turn in range(2):  # /v1/responses' conversations live in that Redis
        body = {"model": "sim", "input": f"turn {turn}", "max_output_tokens": 2, "previous_response_id": previous}
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/responses", json.dumps(body).encode(), {"content-type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            previous = json.loads(response.read())["id"]
    url = re.search(r"fleet state in Redis at (redis://\S+)", up.output()).group(1)  # type: ignore[union-attr]
    assert len(list(redis.Redis.from_url(url).scan_iter(match="kvroute:resp:*:r:resp_*"))) == 2
    assert up.signal(signal.SIGINT, wait_s=60) == 0
    assert not [pid for pid in children if alive(pid)]


BUSY_GRPC_STARTS = """
import asyncio, sys, threading, time
import grpc
from launch.fleet import Child

async def busy() -> None:
    server = grpc.aio.server()
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    async def calls(channel):
        call = channel.unary_unary("/none.None/None")
        while True:
            try:
                await call(b"")
            except grpc.aio.AioRpcError:
                pass
    await asyncio.gather(*(calls(grpc.aio.insecure_channel(f"127.0.0.1:{port}")) for _ in range(4)))

threading.Thread(target=lambda: asyncio.run(busy()), daemon=True).start()
time.sleep(0.5)
codes = []
for i in range(100):
    child = Child(f"true{i}", ["true"])
    child.start()
    codes.append(child.process.wait())
print([c for c in codes if c != 0])
"""


@pytest.mark.skipif(sys.platform != "linux", reason="gRPC's fork handlers are the Linux poller's")
def test_children_start_while_grpc_channels_are_busy_in_the_launching_process() -> None:
    """A fork() beside gRPC's polling threads crashed 9% of children before exec (SIGSEGV/SIGABRT); a start must
    not fork a copy of the parent's gRPC state."""
    result = subprocess.run(
        [sys.executable, "-c", BUSY_GRPC_STARTS], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip() == "[]", f"children that died before exec, by status: {result.stdout}"


@pytest.mark.skipif(not Path("/usr/bin/setpriv").exists(), reason="needs util-linux's setpriv (Linux)")
def test_a_killed_launcher_leaves_no_child_behind() -> None:
    code = "from launch.fleet import Child; import time; Child('sleeper', ['sleep', '300']).start(); time.sleep(300)"
    launcher = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT)
    try:
        assert poll(lambda: bool(children_of(launcher.pid)), 30), "the launcher never started its sleeper"
        (sleeper,) = children_of(launcher.pid)
        launcher.kill()
        launcher.wait(10)
        assert poll(lambda: not alive(sleeper), 10), "the sleeper outlived its killed launcher"
    finally:
        launcher.kill()


def poll(done, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True
