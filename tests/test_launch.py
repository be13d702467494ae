"""Processes: the gateway imports without torch, and `kvroute up` runs a fleet and leaves no child behind."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from launch.fleet import free_port

ROOT = Path(__file__).resolve().parent.parent


def test_the_gateway_and_its_front_doors_import_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"  # `import torch` now raises ImportError
        "import gateway.cli_gateway, gateway.http_server, gateway.grpc_server, gateway.request_path\n"
        "import gateway.embedded_fleet, gateway.redis_fleet, launch.up\n"
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


def test_kvroute_up_serves_and_ctrl_c_stops_every_child() -> None:
    port, metrics_port = free_port(), free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "up", "--workers", "2", "--model", "sim", "--http-port", str(port),
         "--grpc-port", "0", "--metrics-port", str(metrics_port),
         "--worker-args", "--num-kv-blocks 64 --max-model-len 512 --http-port 0"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        lines = []
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            line = up.stdout.readline()
            assert line, "kvroute up exited:\n" + "".join(lines)
            lines.append(line)
            if "Ctrl-C stops them all" in line:
                break
        assert "2 sim workers" in lines[-1] and f"http://127.0.0.1:{port}/v1" in lines[-1]
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
        up.send_signal(signal.SIGINT)  # Ctrl-C
        assert up.wait(timeout=60) == 0
        assert not [pid for pid in children if alive(pid)]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
