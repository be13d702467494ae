"""What `kvroute epp` behind Envoy costs per request, in one run on the same sim workers (docs/epp.md):

    Envoy alone        round robin over the workers' HTTP ports (the baseline)
    Envoy + epp        the ext_proc picker (FULL_DUPLEX_STREAMED), override_host upstream
    kvroute gateway    the gateway as the front door (HTTP in, gRPC to the workers)

Short chat requests (max_tokens 1, sim workers with no decode delay) are sent one at a time, the three paths
interleaved round by round; latency is the client's, from send to the whole answer. CPU per request is the
front door's processes' (Envoy and the picker, or the gateway) user + system time over the timed requests,
from /proc. Streamed requests (16 tokens) time the first token through Envoy with and without the picker.
Then the picker's decision time (parse, template, tokenize, hash, pick) for a 4,096-token prompt,
in-process over the same workers.

Run: python -m benchmarks.epp_bench [--requests 300]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from launch.envoy_proxy import Envoy, EnvoyConfig
from launch.fleet import free_port

ROOT = Path(__file__).resolve().parents[1]
MODEL_LEN = 8192


def _spawn(argv: list[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "launch.cli", *argv], cwd=ROOT, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def _wait_http(url: str, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready in {timeout} s")


def _cpu_seconds(pids: list[int]) -> float:
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def _percentiles(xs: list[float]) -> tuple[float, float]:
    q = statistics.quantiles(xs, n=100)
    return q[49], q[98]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300, help="timed requests per path")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args(argv)
    processes: list[subprocess.Popen[bytes]] = []
    try:
        grpc_addresses, endpoints = [], []
        for i in range(args.workers):
            grpc_port, http_port = free_port(), free_port()
            processes.append(
                _spawn(
                    [
                        "worker",
                        "--model",
                        "sim",
                        "--host",
                        "127.0.0.1",
                        "--port",
                        str(grpc_port),
                        "--http-port",
                        str(http_port),
                        "--metrics-port",
                        "0",
                        "--worker-id",
                        f"w{i}",
                        "--sim-decode-ms-per-step",
                        "0",
                        "--sim-prefill-us-per-token",
                        "0",
                        "--max-model-len",
                        str(MODEL_LEN),
                    ]
                )  # fmt: skip
            )
            grpc_addresses.append(f"127.0.0.1:{grpc_port}")
            endpoints.append(f"127.0.0.1:{http_port}")
        for endpoint in endpoints:
            _wait_http(f"http://{endpoint}/health")
        fleet = ["--workers", ",".join(grpc_addresses), "--max-prompt-tokens", str(MODEL_LEN)]
        mapping = ",".join(f"{g}={e}" for g, e in zip(grpc_addresses, endpoints, strict=True))
        epp_port, gateway_port = free_port(), free_port()
        epp = _spawn(["epp", "--model", "sim", "--host", "127.0.0.1", "--port", str(epp_port), "--metrics-port", "0",
                      "--endpoints", mapping, "--log-level", "warning", *fleet])  # fmt: skip
        gateway = _spawn(["gateway", "--model", "sim", "--host", "127.0.0.1", "--http-port", str(gateway_port),
                          "--grpc-port", "0", "--metrics-port", "0", "--log-level", "warning", *fleet])  # fmt: skip
        processes += [epp, gateway]
        _wait_http(f"http://127.0.0.1:{gateway_port}/ready")
        alone = Envoy(EnvoyConfig(free_port(), free_port(), endpoints, upstream="round_robin"))
        picked = Envoy(EnvoyConfig(free_port(), free_port(), endpoints, epp_port=epp_port))
        with alone, picked:
            assert alone.process is not None and picked.process is not None
            paths = {
                "Envoy alone (round robin)": (alone.url, [alone.process.pid]),
                "Envoy + kvroute epp": (picked.url, [picked.process.pid, epp.pid]),
                "kvroute gateway": (f"http://127.0.0.1:{gateway_port}", [gateway.pid]),
            }
            _measure(paths, args.requests)
        decision_time(grpc_addresses, endpoints)
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(10)


def _measure(paths: dict[str, tuple[str, list[int]]], requests: int) -> None:
    body = {"model": "sim", "messages": [{"role": "user", "content": "Name three colours. " * 8}], "max_tokens": 1}
    clients = {name: httpx.Client(base_url=url, timeout=30) for name, (url, _) in paths.items()}
    times: dict[str, list[float]] = {name: [] for name in paths}
    cpu: dict[str, float] = dict.fromkeys(paths, 0.0)

    def one(name: str) -> float:
        start = time.perf_counter()
        reply = clients[name].post("/v1/chat/completions", json=body)
        assert reply.status_code == 200, reply.text
        return time.perf_counter() - start

    for name in paths:  # warm connections, caches and the policy's sketch
        for _ in range(30):
            one(name)
    rounds = 10
    for _ in range(rounds):
        for name, (_, pids) in paths.items():
            before = _cpu_seconds(pids)
            times[name].extend(one(name) for _ in range(requests // rounds))
            cpu[name] += _cpu_seconds(pids) - before
    base_p50, base_p99 = _percentiles(times["Envoy alone (round robin)"])
    print(f"{'path':28} {'p50 ms':>7} {'p99 ms':>7} {'+p50 ms':>8} {'+p99 ms':>8} {'CPU ms/req':>10}")
    for name, xs in times.items():
        p50, p99 = _percentiles(xs)
        per_request = cpu[name] / len(xs) * 1e3
        print(
            f"{name:28} {p50 * 1e3:7.2f} {p99 * 1e3:7.2f} {(p50 - base_p50) * 1e3:8.2f} {(p99 - base_p99) * 1e3:8.2f} "
            f"{per_request:10.2f}"
        )
    first: dict[str, list[float]] = {name: [] for name in paths if name != "kvroute gateway"}
    stream_body = {**body, "max_tokens": 16, "stream": True}
    for _ in range(rounds):
        for name in first:
            for _ in range(10):
                start = time.perf_counter()
                with clients[name].stream("POST", "/v1/chat/completions", json=stream_body) as reply:
                    chunks = reply.iter_lines()
                    next(line for line in chunks if '"content":"' in line and '"content":""' not in line)
                    first[name].append(time.perf_counter() - start)
                    for _ in chunks:
                        pass
    print(f"{'streamed, first token':28} {'p50 ms':>7} {'p99 ms':>7}")
    for name, xs in first.items():
        p50, p99 = _percentiles(xs)
        print(f"{name:28} {p50 * 1e3:7.2f} {p99 * 1e3:7.2f}")
    for client in clients.values():
        client.close()


def decision_time(grpc_addresses: list[str], endpoints: list[str]) -> None:
    from gateway import cli_epp as cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    mapping = ",".join(f"{g}={e}" for g, e in zip(grpc_addresses, endpoints, strict=True))
    args = parser.parse_args(["--model", "sim", "--workers", ",".join(grpc_addresses), "--endpoints", mapping,
                              "--max-prompt-tokens", str(MODEL_LEN), "--metrics-port", "0"])  # fmt: skip
    picker = cli.build_picker(args)
    (path,) = picker.pools.pools()  # --model sim: one pool

    async def run() -> None:
        await path.fleet.start()
        try:
            tokenizer = path.tokenizer
            text = " ".join(f"w{i}" for i in range(8000))
            ids = tokenizer.encode(text, add_special_tokens=False)[:4096]
            prompt = tokenizer.decode(ids)
            body = b'{"model":"sim","max_tokens":1,"messages":[{"role":"user","content":' + _json_str(prompt) + b"}]}"
            samples = []
            for i in range(40):
                start = time.perf_counter()
                request = picker.parse("/v1/chat/completions", {}, body.replace(b"w0", f"v{i}".encode(), 1))
                pick = await picker.decide(request, None, None)
                samples.append(time.perf_counter() - start)
                picker.finish(pick, None, 200)
            samples = samples[5:]
            print(
                f"decision for a {pick.prompt_tokens}-token chat prompt (parse, template, tokenize, hash, pick): "
                f"p50 {statistics.median(samples) * 1e3:.2f} ms, max {max(samples) * 1e3:.2f} ms"
            )
        finally:
            await path.fleet.stop()
            await path.close()

    asyncio.run(run())


def _json_str(text: str) -> bytes:
    import orjson

    return orjson.dumps(text)


if __name__ == "__main__":
    main()
