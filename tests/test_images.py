"""The images, built with deploy/build-images.sh and run with podman as the chart runs them.

They run wherever podman runs and the base image exists (`$KVROUTE_IMAGE_BASE`, default debian-base:local, which
`deploy/build-images.sh --make-base` makes with debootstrap), and are skipped, saying why, elsewhere or with
`KVROUTE_IMAGE_TESTS=0`. A build needs the network to Debian's mirror and PyPI; the gateway image takes about a
minute with podman's layer cache (docs/kubernetes.md, "Building the images"). The CPU worker image is built only with
torch's CPU wheel in a folder named by `$KVROUTE_IMAGE_WHEELS`. Each container runs with the chart's security
settings (uid 10001, a read-only root with /tmp writable, no capabilities, no privilege escalation) on the host's
loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import pytest

from launch.fleet import free_port

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "deploy" / "build-images.sh"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
REGISTRY = "ghcr.io/kvroute"
BASE = os.environ.get("KVROUTE_IMAGE_BASE", "debian-base:local")
WHEELS = os.environ.get("KVROUTE_IMAGE_WHEELS", "")
# What the chart's securityContext asks of every kvroute container.
AS_THE_CHART_RUNS_IT = [
    "--user", "10001:10001", "--read-only", "--tmpfs", "/tmp", "--cap-drop", "ALL",
    "--security-opt", "no-new-privileges", "--network", "host", "--no-healthcheck",
]  # fmt: skip
# Where the default OCI runtime cannot set rlimits or cgroups (containers inside containers), runc with the
# rlimits given explicitly can.
RUNTIME_FALLBACK = ["--runtime", "runc", "--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]


def podman(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout)


@cache
def why_not() -> str | None:
    """Why these tests cannot run here, or None."""
    if os.environ.get("KVROUTE_IMAGE_TESTS") == "0":
        return "KVROUTE_IMAGE_TESTS=0 turns the image builds off"
    if shutil.which("podman") is None:
        return "podman is not installed (Debian: apt-get install -y podman)"
    if podman("image", "exists", BASE).returncode != 0:
        return f"no base image {BASE}: make it with `deploy/build-images.sh --make-base`, or set KVROUTE_IMAGE_BASE"
    if run_flags() is None:
        return f"podman cannot run a container here: {podman('run', '--rm', BASE, 'true').stderr.strip()}"
    return None


@cache
def run_flags() -> list[str] | None:
    """The runtime flags with which `podman run` works on this host: none, or the fallback."""
    for flags in ([], RUNTIME_FALLBACK):
        if podman("run", "--rm", *flags, BASE, "true").returncode == 0:
            return flags
    return None


pytestmark = [pytest.mark.slow, pytest.mark.skipif(why_not() is not None, reason=str(why_not()))]


def build(image: str) -> str:
    """Builds one image with the script, as an operator would; returns its reference."""
    command = [str(BUILD), "--base", BASE, "--images", image]
    bundle = Path("/etc/ssl/certs/ca-certificates.crt")
    if bundle.exists():  # the host's trusted CAs (a proxy that re-signs TLS among them)
        command += ["--ca-bundle", str(bundle)]
    if WHEELS:
        command += ["--wheels", WHEELS]
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    name = {"gateway": "kvroute-gateway", "worker-cpu": "kvroute-worker-cpu"}[image]
    return f"{REGISTRY}/{name}:{VERSION}"


@pytest.fixture(scope="module")
def gateway_image() -> str:
    return build("gateway")


@pytest.fixture(scope="module")
def worker_image() -> str:
    if not WHEELS:  # a 3 GB image and minutes of build: only when asked, with torch's CPU wheel at hand
        pytest.skip(
            "the CPU worker image needs torch's CPU wheel: set KVROUTE_IMAGE_WHEELS to a folder with it "
            "(download.pytorch.org, where it would come from otherwise, is not among this machine's registries)"
        )
    return build("worker-cpu")


@contextmanager
def container(image: str, *args: str) -> Iterator[str]:
    name = f"kvroute-test-{os.getpid()}-{time.monotonic_ns()}"
    started = podman("run", "-d", "--name", name, *run_flags(), *AS_THE_CHART_RUNS_IT, image, *args)
    assert started.returncode == 0, started.stderr
    try:
        yield name
    finally:
        podman("rm", "-f", "-t", "0", name)


def logs(name: str) -> str:
    result = podman("logs", name)
    return (result.stdout + result.stderr)[-4000:]


def image_healthcheck(image: str) -> list[str]:
    """The image's own HEALTHCHECK command (Docker format), as `podman exec` runs it."""
    test = json.loads(podman("image", "inspect", image).stdout)[0]["Healthcheck"]["Test"]
    assert test[0] == "CMD", test
    return test[1:]


def wait_until(what: str, name: str, check: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        state = podman("inspect", "--format", "{{.State.Status}}", name).stdout.strip()
        assert state == "running", f"{name} is {state} while waiting for {what}:\n{logs(name)}"
        assert time.monotonic() < deadline, f"{what} not within {timeout} s:\n{logs(name)}"
        time.sleep(0.5)


def http(url: str, body: dict | None = None, timeout: float = 30) -> tuple[int, bytes]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError):
        return 0, b""


def stop(name: str) -> tuple[float, int]:
    """SIGTERM (what the kubelet sends) and the seconds until the container exited, and its exit code."""
    start = time.monotonic()
    assert podman("stop", "-t", "30", name, timeout=60).returncode == 0
    took = time.monotonic() - start
    return took, int(podman("inspect", "--format", "{{.State.ExitCode}}", name).stdout.strip())


def test_gateway_image_serves_without_torch_and_drains_on_sigterm(gateway_image: str) -> None:
    no_torch = podman("run", "--rm", *run_flags(), "--entrypoint", "python", gateway_image, "-c", "import torch")
    assert no_torch.returncode != 0 and "No module named 'torch'" in no_torch.stderr
    http_port, grpc_port, nobody = free_port(), free_port(), free_port()
    flags = ["--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", str(grpc_port)]
    with container(gateway_image, "gateway", *flags, "--workers", f"127.0.0.1:{nobody}") as name:
        base = f"http://127.0.0.1:{http_port}"
        wait_until("/health", name, lambda: http(f"{base}/health")[0] == 200, timeout=60)
        health = podman("exec", name, *[a.replace(":8000", f":{http_port}") for a in image_healthcheck(gateway_image)])
        assert health.returncode == 0, health.stderr
        status, body = http(f"{base}/ready")
        assert status == 503 and b"no routable worker" in body
        took, code = stop(name)
    assert code == 0 and took < 15, (took, code)


def test_worker_image_serves_a_chat_completion_through_the_gateway_image(gateway_image: str, worker_image: str) -> None:
    worker_port, metrics_port, http_port, grpc_port = free_port(), free_port(), free_port(), free_port()
    worker_flags = ["--host", "127.0.0.1", "--port", str(worker_port), "--metrics-port", str(metrics_port)]
    with container(worker_image, "worker", *worker_flags, "--device", "cpu", "--model", "smollm2") as worker:
        check = [a.replace(":50051", f":{worker_port}") for a in image_healthcheck(worker_image)]
        wait_until("the worker's health", worker, lambda: podman("exec", worker, *check).returncode == 0, timeout=300)
        gateway_flags = ["--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", str(grpc_port)]
        with container(gateway_image, "gateway", *gateway_flags, "--workers", f"127.0.0.1:{worker_port}") as gateway:
            base = f"http://127.0.0.1:{http_port}"
            wait_until("/ready", gateway, lambda: http(f"{base}/ready")[0] == 200, timeout=60)
            request = {"model": "smollm2", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
            status, body = http(f"{base}/v1/chat/completions", request, timeout=120)
            assert status == 200, body[:2000]
            answer = json.loads(body)
            assert answer["choices"][0]["message"]["content"] and answer["usage"]["completion_tokens"] > 0
        took, code = stop(worker)
    assert code == 0 and took < 30, (took, code)
