"""The HTTP backend against the gRPC backend on the same kind of fleet (docs/engines.md): `--workers` kvroute
workers (`--model sim`) started with `--http-port` and `--kv-events-config`, and a `kvroute gateway` over them
either as gRPC workers (`host:port`) or as vLLM servers (`vllm://host:http-port?events=...&replay=...`), each
mode over a fresh fleet. A chat workload (sessions sharing a system prompt, each turn carrying the history)
runs `--concurrency` sessions at a time through the gateway's OpenAI API; prints per mode the time to the first
content token (p50, p99), the prompt tokens the workers computed (prompt - cached), the share cached, and the
CPU time per request of the gateway process and of the worker processes (user + system, during the workload):
CPU time, unlike latency, does not grow with other jobs on shared cores.
With `--workers 1` a third mode, `direct`, sends the same workload to the worker's own HTTP front door, with no
gateway in between: `vllm` less `direct` is what the gateway's HTTP backend adds.

    python -m benchmarks.engine_backend_bench --workers 2 --sessions 16 --turns 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import psutil

from launch.fleet import free_port

ROOT = Path(__file__).resolve().parent.parent
SYSTEM = "You are the support assistant of a large shop. " + " ".join(f"rule {i}: be precise." for i in range(60))


@dataclass
class Result:
    ttft: list[float]
    prompt_tokens: int
    cached_tokens: int
    gateway_cpu_s: float = 0.0
    workers_cpu_s: float = 0.0


def cpu_seconds(popens: list[subprocess.Popen]) -> float:
    total = 0.0
    for popen in popens:
        times = psutil.Process(popen.pid).cpu_times()
        total += times.user + times.system
    return total


def measured(
    url: str, args: argparse.Namespace, gateway: list[subprocess.Popen], workers: list[subprocess.Popen]
) -> Result:
    """The workload at `url`, with the CPU time the gateway (if any) and the workers spent on it."""
    before = cpu_seconds(gateway), cpu_seconds(workers)
    result = asyncio.run(workload(url, args.sessions, args.turns, args.concurrency))
    result.gateway_cpu_s = cpu_seconds(gateway) - before[0]
    result.workers_cpu_s = cpu_seconds(workers) - before[1]
    return result


@contextlib.contextmanager
def process(argv: list[str]) -> Iterator[subprocess.Popen]:
    popen = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", *argv], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    try:
        yield popen
    finally:
        popen.terminate()
        try:
            popen.wait(10)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait(5)


def wait_ready(url: str, workers: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            response = httpx.get(f"{url}/ready", timeout=2)
            if response.status_code == 200 and response.json().get("workers") == workers:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not get {workers} workers ready in {timeout:g} s")


async def session(client: httpx.AsyncClient, url: str, index: int, turns: int, result: Result) -> None:
    messages = [{"role": "system", "content": SYSTEM}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"customer {index} asks question {turn}: where is my order?"})
        body = {"messages": messages, "max_tokens": 16, "stream": True, "stream_options": {"include_usage": True}}
        start = time.perf_counter()
        first = None
        text = []
        async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = orjson.loads(line[6:])
                for choice in event.get("choices") or ():
                    content = choice.get("delta", {}).get("content")
                    if content:
                        first = first or time.perf_counter()
                        text.append(content)
                if event.get("usage"):
                    result.prompt_tokens += event["usage"]["prompt_tokens"]
                    result.cached_tokens += event["usage"]["prompt_tokens_details"]["cached_tokens"]
        result.ttft.append((first or time.perf_counter()) - start)
        messages.append({"role": "assistant", "content": "".join(text)})


async def workload(url: str, sessions: int, turns: int, concurrency: int) -> Result:
    result = Result([], 0, 0)
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=60) as client:

        async def one(index: int) -> None:
            async with limit:
                await session(client, url, index, turns, result)

        await asyncio.gather(*(one(i) for i in range(sessions)))
    return result


def run_mode(mode: str, args: argparse.Namespace) -> Result:
    with contextlib.ExitStack() as stack:
        specs = []
        workers = []
        for _ in range(args.workers):
            grpc_port, http_port, events, replay = free_port(), free_port(), free_port(), free_port()
            config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events}",
                      "replay_endpoint": f"tcp://127.0.0.1:{replay}", "bind": True}  # fmt: skip
            workers.append(stack.enter_context(process([
                "worker", "--model", "sim", "--host", "127.0.0.1", "--port", str(grpc_port), "--http-port",
                str(http_port), "--num-kv-blocks", "2048", "--max-model-len", "4096", "--sim-decode-ms-per-step",
                str(args.decode_ms), "--kv-events-config", json.dumps(config),
            ])))  # fmt: skip
            specs.append(
                f"127.0.0.1:{grpc_port}" if mode == "grpc" else
                f"vllm://127.0.0.1:{http_port}?events=tcp://127.0.0.1:{events}&replay=tcp://127.0.0.1:{replay}"
            )  # fmt: skip
        if mode == "direct":  # the client at the worker's own HTTP front door: what the gateway adds, subtracted
            url = f"http://127.0.0.1:{http_port}"
            wait_ready(url, 1)
            asyncio.run(workload(url, 2, 1, 1))
            return measured(url, args, [], workers)
        port = free_port()
        gateway = stack.enter_context(process([
            "gateway", "--model", "sim", "--host", "127.0.0.1", "--http-port", str(port), "--grpc-port", "0",
            "--metrics-port", "0", "--policy", args.policy, "--workers", ",".join(specs),
        ]))  # fmt: skip
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, args.workers)
        asyncio.run(workload(url, 2, 1, 1))  # warm the connections
        return measured(url, args, [gateway], workers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--decode-ms", type=float, default=5.0, help="the sim workers' time per decode step")
    parser.add_argument("--policy", default="kv_aware")
    args = parser.parse_args()
    print(
        f"{'backend':8} {'requests':>8} {'TTFT p50':>10} {'TTFT p99':>10} {'prefill tokens':>15} {'cached':>7} "
        f"{'gateway CPU/req':>16} {'workers CPU/req':>16}"
    )
    for mode in ("grpc", "vllm", *(("direct",) if args.workers == 1 else ())):
        result = run_mode(mode, args)
        ttft = sorted(result.ttft)
        p99 = ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))]
        computed = result.prompt_tokens - result.cached_tokens
        share = result.cached_tokens / max(1, result.prompt_tokens)
        print(
            f"{mode:8} {len(ttft):>8} {statistics.median(ttft) * 1000:>8.1f}ms {p99 * 1000:>8.1f}ms "
            f"{computed:>15,} {share:>7.1%} {result.gateway_cpu_s / len(ttft) * 1000:>14.2f}ms "
            f"{result.workers_cpu_s / len(ttft) * 1000:>14.2f}ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
