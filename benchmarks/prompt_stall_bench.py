"""Can one client's big prompt stall every other client? `/health` latency while `--clients` clients send
multi-megabyte chat prompts to one gateway, for this tree's gateway and (`--before ROOT`) another tree's.

    python -m benchmarks.prompt_stall_bench [--before /work/main] [--clients 4] [--seconds 8] [--json OUT]

Set-up: one `sim` worker (this tree's; it answers at once) and, over it, `kvroute gateway` started from each
tree under test (its own cwd and PYTHONPATH), with the default limits (32,768 prompt tokens, 4 MiB bodies).
Scenarios, each for `--seconds` and each gateway in turn within a scenario (a shared machine's drift then hits
both alike), every request's text distinct (so no memory of earlier prompts helps):
- `refused_3.9MB`: 3.9 MB of English in a chat body, over the limit by its length alone;
- `tokenized_1MB`: 1 MB of English, just within the length bound (32,768 x 25 word bytes for SmolLM2), so it
  must be tokenized (~230,000 tokens) to be refused;
- `punct_2.6MB`: 2.6 MB of `, .` (no word bytes; within 32,768 x 81 bytes), tokenized (~1.7 M tokens) to be
  refused: the most work a client can make one request cost;
- `accepted_28k`: ~120 KB of English (~28,000 tokens) with max_tokens 1, routed to the worker.
Meanwhile a probe (this process; the clients run in a child process) sends GET /health every 10 ms on one
keep-alive connection and records each answer's latency; `idle` is the probe alone. `noise p99` is how late a
1 ms sleep wakes in another process meanwhile: the machine's own share of a p99. Also timed: one 3 MiB prompt
over the gRPC Gateway.Generate, alone (median of 3), until it is refused.
"""

from __future__ import annotations

import argparse
import http.client
import json
import multiprocessing
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from benchmarks.gateway_bench import wait_ok
from launch.fleet import Fleet, free_port, kvroute_argv
from loadtest.bench_stats import percentiles
from proto import gateway_pb2, gateway_pb2_grpc

ROOT = Path(__file__).resolve().parent.parent
PROSE = "The quick brown fox jumps over the lazy dog while the old cat watches from the warm windowsill. "
SCENARIOS = {
    "refused_3.9MB": (PROSE, 3_900_000),
    "tokenized_1MB": (PROSE, 1_000_000),
    "punct_2.6MB": (", .", 2_600_000),
    "accepted_28k": (PROSE, 120_000),
}
PROBE_INTERVAL_S = 0.01


def chat_body(unit: str, size_bytes: int, tag: str) -> bytes:
    text = f"[{tag}] " + unit * (size_bytes // len(unit))
    body = {"model": "sim", "messages": [{"role": "user", "content": text}], "max_tokens": 1, "temperature": 0}
    return json.dumps(body).encode()


def _client(port: int, unit: str, size_bytes: int, tag: str, until: float, results: list[tuple[float, int]]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    i = 0
    while time.monotonic() < until:
        body = chat_body(unit, size_bytes, f"{tag}-{i}")
        started = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body, {"content-type": "application/json"})
        response = conn.getresponse()
        response.read()
        results.append((time.perf_counter() - started, response.status))
        i += 1
    conn.close()


def _clients(port: int, unit: str, size_bytes: int, clients: int, seconds: float, out: Any) -> None:
    """In a child process: `clients` threads sending prompts for `seconds`; puts [(latency_s, status)]."""
    until = time.monotonic() + seconds
    results: list[tuple[float, int]] = []
    threads = [
        threading.Thread(target=_client, args=(port, unit, size_bytes, f"c{c}", until, results)) for c in range(clients)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    out.put(results)


def probe(port: int, stop: threading.Event) -> list[float]:
    """GET /health every PROBE_INTERVAL_S until `stop`; each answer's latency in seconds."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    latencies = []
    while not stop.is_set():
        started = time.perf_counter()
        conn.request("GET", "/health")
        conn.getresponse().read()
        latencies.append(time.perf_counter() - started)
        time.sleep(PROBE_INTERVAL_S)
    conn.close()
    return latencies


def _noise(seconds: float, out: Any) -> None:
    """In a child process: how late 1 ms sleeps wake up (the machine's own scheduling noise), in seconds."""
    late = []
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        started = time.perf_counter()
        time.sleep(0.001)
        late.append(time.perf_counter() - started - 0.001)
    out.put(late)


def scenario(port: int, prompt: tuple[str, int] | None, clients: int, seconds: float) -> dict[str, Any]:
    """/health latency (and the machine's noise) while `clients` send `prompt` (unit, bytes) for `seconds`."""
    context = multiprocessing.get_context("spawn")
    noise_out = context.Queue()
    noise = context.Process(target=_noise, args=(seconds, noise_out))
    noise.start()
    stop = threading.Event()
    health: list[float] = []
    prober = threading.Thread(target=lambda: health.extend(probe(port, stop)))
    prober.start()
    requests: list[tuple[float, int]] = []
    if prompt is None:
        time.sleep(seconds)
    else:
        out = context.Queue()
        child = context.Process(target=_clients, args=(port, *prompt, clients, seconds, out))
        child.start()
        requests = out.get(timeout=seconds + 300)
        child.join(30)
    stop.set()
    prober.join(60)
    late = noise_out.get(timeout=60)
    noise.join(30)
    stats = percentiles(health, (50, 99))
    result: dict[str, Any] = {
        "health_samples": len(health),
        "health_p50_ms": stats["p50"],
        "health_p99_ms": stats["p99"],
        "health_max_ms": max(health) * 1e3,
        "noise_p99_ms": percentiles(late, (99,))["p99"],
    }
    if requests:
        result.update(
            requests=len(requests),
            statuses=sorted({status for _, status in requests}),
            request_p50_s=statistics.median(latency for latency, _ in requests),
        )
    return result


def grpc_refusal_s(port: int) -> float:
    """Seconds until a 3 MiB completion prompt over Gateway.Generate is refused (median of 3, alone)."""
    times = []
    options = [("grpc.max_send_message_length", 8 * 2**20)]
    with grpc.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        for i in range(3):
            prompt = f"[grpc-{i}] " + PROSE * (3 * 2**20 // len(PROSE))
            started = time.perf_counter()
            try:
                list(stub.Generate(gateway_pb2.GatewayGenerateRequest(prompt=prompt), timeout=120))
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.INVALID_ARGUMENT:
                    raise
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def start_gateways(fleet: Fleet, trees: dict[str, Path]) -> dict[str, tuple[int, int]]:
    """One sim worker (this tree's) and a gateway from each tree over it; {label: (http port, grpc port)}."""
    worker_port = free_port()
    fleet.spawn(
        "worker",
        kvroute_argv("worker", "--model", "sim", "--port", str(worker_port), "--max-model-len", "32768",
                     "--num-kv-blocks", "32768", "--sim-prefill-us-per-token", "0", "--sim-decode-ms-per-step", "0"),
    )  # fmt: skip
    ports = {}
    for label, root in trees.items():
        http_port, grpc_port = free_port(), free_port()
        # `env -C` runs the gateway in `root` with `root` on its path: the tree under test, whatever this one is;
        # a tree from before issue 22 has its command line in kvroute/cli.py.
        cli = "launch.cli" if (root / "launch" / "cli.py").exists() else "kvroute.cli"
        fleet.spawn(
            f"gateway ({label})",
            ["env", "-C", str(root), f"PYTHONPATH={root}", sys.executable, "-m", cli, "gateway",
             "--model", "sim", "--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", str(grpc_port),
             "--workers", f"127.0.0.1:{worker_port}", "--log-level", "warning"],
        )  # fmt: skip
        ports[label] = (http_port, grpc_port)
    for http_port, _ in ports.values():
        wait_ok(f"http://127.0.0.1:{http_port}/ready", 300, fleet)
    return ports


def measure(trees: dict[str, Path], clients: int, seconds: float) -> dict[str, Any]:
    """Every scenario, each tree's gateway in turn within it (the shared machine's drift hits both alike)."""
    fleet = Fleet()
    try:
        ports = start_gateways(fleet, trees)
        results: dict[str, dict[str, Any]] = {label: {} for label in trees}
        for name, prompt in {"idle": None, **SCENARIOS}.items():
            for label, (http_port, _) in ports.items():
                results[label][name] = scenario(http_port, prompt, clients, seconds)
                print(f"  {label} {name}: {results[label][name]}", file=sys.stderr)
        for label, (_, grpc_port) in ports.items():
            results[label]["grpc_3MiB_refusal_s"] = grpc_refusal_s(grpc_port)
        return results
    finally:
        fleet.stop()


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", type=Path, default=None, help="another tree's gateway, measured alike")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=8.0, help="per scenario")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    trees = {"before": args.before.resolve()} if args.before else {}
    trees["after"] = ROOT
    report: dict[str, Any] = {"cpu": cpu_model(), "cores": multiprocessing.cpu_count(), "clients": args.clients}
    report.update(measure(trees, args.clients, args.seconds))
    print(f"{'/health (ms)':16}" + "".join(f"{label + ' p50 / p99 / max':>28}" for label in trees) + "  noise p99")
    for name in ("idle", *SCENARIOS):
        cells = [
            f"{r['health_p50_ms']:8.1f} /{r['health_p99_ms']:7.1f} /{r['health_max_ms']:7.1f}"
            for r in (report[label][name] for label in trees)
        ]
        noise = max(report[label][name]["noise_p99_ms"] for label in trees)
        print(f"{name:16}" + "".join(f"{cell:>28}" for cell in cells) + f"{noise:11.1f}")
    print(f"{'gRPC 3 MiB (s)':16}" + "".join(f"{report[label]['grpc_3MiB_refusal_s']:>28.2f}" for label in trees))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
