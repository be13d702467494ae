"""`kvroute bench --faults`: a soak with faults. A Redis-backed fleet (a redis-server, N workers reporting
to it, two gateways reading it with the workers as their fallback) serves the workload for `--duration`
seconds while, on a fixed schedule:

  at 20% of the duration  worker w1 is killed (SIGKILL) and started again 3 s later on the same address
                          (a new boot incarnation);
  at 45%                  Redis restarts (an unpersisted Redis: it comes back empty);
  at 70%                  gateway g1 gets SIGTERM (it drains) and starts again.

Requests are dealt over the two gateways by index; one that its gateway did not start (no connection, or a
503 such as a draining gateway's) goes to the other (a load balancer's failover), and counts as failed over.
The report counts requests completed, failed by status, failed over by the client and retried by the
gateways (their `kvroute:gateway_retries` counters), and requests lost silently: a stream that ended without
`[DONE]` or an error event, or a connection that broke without a status (there must be none). At the end,
once the fleet is idle, every worker must hold no running or waiting request and no KV block in use (its
`vllm:kv_cache_usage_perc` is 0): a cancelled or failed request freed its blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvroute.errors import UserError
from launch.fleet import Child, Fleet, LaunchError, free_port, http_ok, kvroute_argv
from loadtest.bench import Arrivals, HttpSender, Target, bench_json, run_requests
from loadtest.bench_stats import RequestRecord, format_summary, summarize
from loadtest.render import BenchRequest, Workload

SILENT = ("incomplete_stream", "bad_stream", "empty_stream", "transport_error")
FAILOVER_STATUSES = ("connect_error", "http_503")
GATEWAYS = 2
WORKER_DOWN_S = 3.0
STARTUP_TIMEOUT_S = 180.0


@dataclass
class SoakFleet:
    """Redis, the workers and the gateways on launch.fleet; each child can be stopped and started again with the
    same command line (so the same ports)."""

    args: argparse.Namespace
    log_dir: Path
    fleet: Fleet = field(init=False)
    workers: list[Child] = field(default_factory=list)
    worker_metrics: list[str] = field(default_factory=list)
    gateways: list[Child] = field(default_factory=list)
    gateway_urls: list[str] = field(default_factory=list)
    gateway_metrics: list[str] = field(default_factory=list)  # each gateway's /metrics (on its metrics port)
    retries_seen: float = 0.0  # gateway retries counted before a gateway restart reset its counters

    def __post_init__(self) -> None:
        self.fleet = Fleet(self.log_dir)

    def start(self) -> None:
        from launch.redis_server import RedisServer

        self.redis = RedisServer()
        self.redis.start()
        grpc_ports = [free_port() for _ in range(self.args.workers)]
        for i, port in enumerate(grpc_ports):
            metrics_port = free_port()
            argv = kvroute_argv(
                "worker", "--model", self.args.model, "--host", "127.0.0.1",
                "--port", str(port), "--metrics-port", str(metrics_port), "--worker-id", f"w{i}",
                "--redis", self.redis.url, "--seed", str(self.args.seed),
                *(["--num-kv-blocks", str(self.args.num_kv_blocks)] if self.args.num_kv_blocks else []),
                *self.args.worker_arg,
            )  # fmt: skip
            self.workers.append(self.fleet.spawn(f"worker-w{i}", argv, start=False))
            self.worker_metrics.append(f"http://127.0.0.1:{metrics_port}/metrics")
        addresses = ",".join(f"127.0.0.1:{p}" for p in grpc_ports)
        for j in range(GATEWAYS):
            port, metrics_port = free_port(), free_port()
            argv = kvroute_argv(
                "gateway", "--model", self.args.model, "--host", "127.0.0.1",
                "--http-port", str(port), "--grpc-port", "0", "--metrics-port", str(metrics_port),
                "--redis", self.redis.url, "--workers", addresses, *self.args.gateway_arg,
            )  # fmt: skip
            self.gateways.append(self.fleet.spawn(f"gateway-g{j}", argv, start=False))
            self.gateway_urls.append(f"http://127.0.0.1:{port}")
            self.gateway_metrics.append(f"http://127.0.0.1:{metrics_port}/metrics")
        for process in [*self.workers, *self.gateways]:
            process.start()
        for url in self.worker_metrics:
            self.wait_http(url)
        for url in self.gateway_urls:
            self.wait_http(url + "/ready")

    def wait_http(self, url: str) -> None:
        """Until `url` answers 200; UserError when a child exits first (a worker killed by the schedule is
        started again before anyone waits) or after STARTUP_TIMEOUT_S."""
        try:
            self.fleet.wait_until(partial(http_ok, url), url, STARTUP_TIMEOUT_S)
        except LaunchError as exc:
            raise UserError(f"the soak fleet did not start: {exc}") from None

    def stop(self) -> None:
        self.fleet.stop()
        if hasattr(self, "redis"):
            self.redis.close()

    async def faults(self, duration_s: float, log: list[str]) -> None:
        """The schedule of the module docstring; each fault is logged with its time."""
        t0 = time.monotonic()

        async def at(fraction: float) -> None:
            await asyncio.sleep(max(0.0, t0 + fraction * duration_s - time.monotonic()))

        def note(text: str) -> None:
            log.append(f"{time.monotonic() - t0:6.1f} s  {text}")
            print(f"kvroute bench --faults: {log[-1]}", file=sys.stderr)

        await at(0.20)
        note("SIGKILL worker w1")
        await asyncio.to_thread(self.workers[1].signal, signal.SIGKILL)
        await asyncio.sleep(WORKER_DOWN_S)
        self.workers[1].start()
        await asyncio.to_thread(self.wait_http, self.worker_metrics[1])
        note("worker w1 back (new incarnation)")
        await at(0.45)
        note("Redis restart")
        await asyncio.to_thread(self.redis.restart)
        note("Redis back (empty)")
        await at(0.70)
        self.retries_seen += await asyncio.to_thread(gateway_retries, self.gateway_metrics[1])
        note("SIGTERM gateway g1 (drain)")
        await asyncio.to_thread(self.gateways[1].signal, signal.SIGTERM)
        self.gateways[1].start()
        await asyncio.to_thread(self.wait_http, self.gateway_urls[1] + "/ready")
        note("gateway g1 back")


def gateway_retries(metrics_url: str) -> float:
    """The gateway's `kvroute:gateway_retries_total` read at `metrics_url` (0 when it does not answer)."""
    try:
        text = httpx.get(metrics_url, timeout=5.0).text
    except httpx.HTTPError:
        return 0.0
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "kvroute:gateway_retries_total"
    )


def worker_idle_state(metrics_url: str) -> dict[str, float]:
    """Running and waiting requests and KV usage, from a worker's Prometheus text."""
    wanted = {
        "vllm:num_requests_running": "running",
        "vllm:num_requests_waiting": "waiting",
        "vllm:kv_cache_usage_perc": "kv_usage",
    }
    text = httpx.get(metrics_url, timeout=5.0).text
    out = dict.fromkeys(wanted.values(), float("nan"))
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[wanted[sample.name]] = sample.value
    return out


class FailoverSender:
    """Deals requests over several gateways by index. A request its gateway did not start (no connection, or
    a 503 such as a draining gateway's "send the request again") goes to the next one, as a load balancer
    in front of the gateways would send it."""

    def __init__(self, targets: list[Target]) -> None:
        self.senders = [HttpSender(t) for t in targets]
        self.failed_over = 0

    async def send(self, request: BenchRequest, t0: float) -> RequestRecord:
        first = request.index % len(self.senders)
        record = await self.senders[first].send(request, t0)
        for k in range(1, len(self.senders)):
            if record.status not in FAILOVER_STATUSES:
                break
            self.failed_over += 1
            record = await self.senders[(first + k) % len(self.senders)].send(request, t0)
        return record

    async def close(self) -> None:
        for sender in self.senders:
            await sender.close()


def run_soak(args: argparse.Namespace, workload: Workload, arrivals: Arrivals) -> int:
    """`--faults`: the soak of the module docstring; 0 when no request was lost silently and no worker leaked."""
    if args.duration is None:
        raise UserError("--faults needs --duration S (the faults are scheduled over it)")
    fault_log: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kvroute-soak-") as tmp:
        log_dir = args.keep_logs or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        fleet = SoakFleet(args, log_dir)
        try:
            print(f"kvroute bench --faults: starting Redis, {args.workers} x {args.model} workers, 2 gateways",
                  file=sys.stderr)  # fmt: skip
            fleet.start()
            model = args.served_model_name or args.model
            targets = [
                Target(url, model, None, args.ignore_eos, args.timeout, args.exact_length) for url in fleet.gateway_urls
            ]
            senders: list[FailoverSender] = []

            def make_sender() -> FailoverSender:
                senders.append(FailoverSender(targets))
                return senders[-1]

            async def soak() -> tuple[list[RequestRecord], float]:
                faults = asyncio.create_task(fleet.faults(args.duration, fault_log))
                result = await run_requests(
                    workload,
                    make_sender,
                    arrivals,
                    progress=not args.no_progress,
                    live_history=args.history == "live",
                )
                await faults
                return result

            records, duration = asyncio.run(soak())
            idle = wait_idle(fleet)
            retries = fleet.retries_seen + sum(gateway_retries(url) for url in fleet.gateway_metrics)
        finally:
            fleet.stop()
    summary = summarize(records, duration)
    statuses = Counter(r.status for r in records)
    silent = {k: v for k, v in statuses.items() if k in SILENT}
    leaks = {w: s for w, s in idle.items() if s["running"] or s["waiting"] or s["kv_usage"]}
    examples: dict[str, str] = {}
    for record in records:
        if not record.ok:
            examples.setdefault(record.status, f"{record.error} (sent at {record.sent_s:.1f} s)")
    print(format_summary(summary, f"soak with faults: {workload.name}"))
    print("faults:\n  " + "\n  ".join(fault_log))
    print(
        f"requests: {len(records)} sent, {statuses.get('ok', 0)} completed, "
        f"{len(records) - statuses.get('ok', 0)} failed with a status, {senders[0].failed_over} failed over by the "
        f"client, {retries:.0f} retried by the gateways; lost silently: {sum(silent.values())} {silent or ''}"
    )
    for status, example in examples.items():
        print(f"  {status}, e.g.: {example}")
    print("workers idle at the end (running / waiting / KV usage): " + ", ".join(
        f"{w} {s['running']:.0f}/{s['waiting']:.0f}/{s['kv_usage']:.3f}" for w, s in idle.items()
    ) + ("" if not leaks else f"; LEAKS: {sorted(leaks)}"))  # fmt: skip
    if args.json is not None:
        report: dict[str, Any] = {
            "workload": workload.name,
            "arrivals": arrivals.describe(),
            "faults": fault_log,
            "summary": summary.to_json(),
            "statuses": dict(statuses),
            "failed_over": senders[0].failed_over,
            "gateway_retries": retries,
            "lost_silently": silent,
            "workers_at_end": idle,
            "per_request": bench_json(summary, records)["per_request"],
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if not silent and not leaks else 1


def wait_idle(fleet: SoakFleet, timeout_s: float = 60.0) -> dict[str, dict[str, float]]:
    """Each worker's running / waiting / KV usage once all are idle (or after `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = {f"w{i}": worker_idle_state(url) for i, url in enumerate(fleet.worker_metrics)}
        if all(not (s["running"] or s["waiting"] or s["kv_usage"]) for s in state.values()):
            return state
        if time.monotonic() > deadline:
            return state
        time.sleep(0.5)
