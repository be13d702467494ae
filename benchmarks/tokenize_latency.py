"""Latency of a worker's vLLM tokenizer endpoints (docs/engines.md): one `kvroute worker --model sim --http-port`
process, one client over keep-alive, `--requests` sequential calls per body; prints p50 and p99.

    python -m benchmarks.tokenize_latency --requests 300
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from typing import Any

import httpx

from launch.fleet import free_port

TEXT = "The quick brown fox jumps over the lazy dog, 12345 times. " * 70
BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "tokenize a prompt": ("/tokenize", {"prompt": TEXT}),
    "tokenize a chat": (
        "/tokenize",
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXT}]},
    ),
    "tokenize a short prompt": ("/tokenize", {"prompt": "Hello, how are you today?"}),
}


def percentiles(client: httpx.Client, path: str, body: dict[str, Any], requests: int) -> tuple[float, float]:
    """p50 and p99 in milliseconds of `requests` sequential POSTs."""
    times = []
    for _ in range(requests):
        start = time.perf_counter()
        response = client.post(path, json=body)
        times.append(time.perf_counter() - start)
        response.raise_for_status()
    times.sort()
    return times[len(times) // 2] * 1e3, times[min(len(times) - 1, int(len(times) * 0.99))] * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args(argv)
    port = free_port()
    worker = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "worker", "--model", "sim", "--port", "0", "--http-port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            deadline = time.monotonic() + 120
            while not _ready(client):
                if worker.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the worker did not start")
                time.sleep(0.2)
            for name, (path, body) in BODIES.items():
                count = client.post(path, json=body).json()["count"]
                p50, p99 = percentiles(client, path, body, args.requests)
                print(f"{name}: {count} tokens, p50 {p50:.2f} ms, p99 {p99:.2f} ms")
            ids = client.post("/tokenize", json={"prompt": TEXT}).json()["tokens"]
            p50, p99 = percentiles(client, "/detokenize", {"tokens": ids}, args.requests)
            print(f"detokenize: {len(ids)} ids, p50 {p50:.2f} ms, p99 {p99:.2f} ms")
    finally:
        worker.terminate()
        worker.wait(30)
    return 0


def _ready(client: httpx.Client) -> bool:
    try:
        return client.get("/ready").status_code == 200
    except httpx.HTTPError:
        return False


if __name__ == "__main__":
    sys.exit(main())
