"""`kvroute bench --compare A,B,...`: the same workload through several routers, each in front of a fresh
local fleet of kvroute workers started with the same model, seed and cache size.

Entries: a kvroute policy (`round_robin`, `prefix`, `kv_aware`, ...: `kvroute gateway` over the workers'
gRPC ports), the same in vLLM mode (`POLICY@vllm`: the workers also publish their KV events in vLLM's wire
format, `--kv-events-config`, and the gateway names them `vllm://HOST:HTTP?events=...&replay=...`, so it
routes from their ZMQ events and forwards over their OpenAI HTTP ports, as in front of `vllm serve`), or
`smg:POLICY` / `vllm-router:POLICY` (that router over the workers' own OpenAI HTTP ports, `kvroute worker
--http-port`; for vllm-router's `kv_aware` the workers also publish their KV events, and the router is given
every worker's event and replay source, as its `--help` asks). A peer whose binary is not installed is skipped
with one line. The worker mode is a part of the entry, not a flag over all of them, because it is a property of
one fleet: one entry is one fleet and one column, `kv_aware` and `kv_aware@vllm` stand side by side in one run,
and the peers, which reach the workers over HTTP only, take no mode. `POLICY[@MODE]+flow-off` runs our gateway
with `--flow-control off` (its flow control is on by default), so a run can hold it against the same policy
with it on. `+responses` sends that entry's requests through our gateway's `/v1/responses` (loadtest.bench:
a conversation's later turns continue the previous response by its id, the gateway holding the history)
instead of re-sending the history to `/v1/chat/completions`.

A traffic mix (loadtest.traffic_mix): our gateways get an API-keys file with one key per tenant (and a drawn
cache-salt secret) and each request its tenant's key; a peer gets no keys and each request its tenant's name as
`cache_salt`, so its workers keep tenants' blocks apart as ours do. Every router gets each band's `priority` in
the body; smg also its priority class as `x-smg-priority` (the most urgent band `interactive`, the least `bulk`),
with its priority scheduler on and every class allowed.

Every router is measured alike, from the workers' own Prometheus counters read before and after the
run: prefill tokens = prompt tokens received - prefix-cache hits, the cached-token share, and requests
per worker. Latencies are the client's (loadtest.bench_stats). Router overhead: after the workload, on the
idle fleet, short probe requests go alternately through the router and straight to a worker's HTTP port;
the overhead is the difference of their TTFT percentiles. After, not before: identical probes through a
router would be the first traffic it learns from (our gateway's common-prefix sketch, smg's tree), and the
replay's prediction, which sees only the workload, would then start from another state.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvroute.errors import UserError
from kvroute.hashing import DEFAULT_BLOCK_SIZE
from launch.fleet import FLEET_WORKER_FLAGS, Child, Fleet, LaunchError, free_port, http_ok, kvroute_argv
from loadtest.bench import (
    RESPONSES,
    Arrivals,
    HttpSender,
    Target,
    bench_json,
    check_api,
    run_requests,
    send_one,
)
from loadtest.bench_stats import (
    OK,
    REUSE_TARGET,
    Objectives,
    RequestRecord,
    Summary,
    format_summary,
    summarize,
)
from loadtest.render import BenchRequest, Workload, token_ids
from loadtest.traffic_mix import TenantKeys, TrafficMix

if TYPE_CHECKING:
    from gateway.flow_control.config import FlowControlConfig
    from kvroute.tokenizer import Tokenizer

KVROUTE = "kvroute"
PEERS = ("smg", "vllm-router")
WORKER_MODES = ("grpc", "vllm")  # how our gateway reaches the workers; grpc: the default, unnamed
FLOW_OFF = "flow-off"  # `POLICY+flow-off`: our gateway with --flow-control off
HOST_KV_BLOCKS = "host-kv-blocks"  # `ENTRY+host-kv-blocks=N`: that fleet's workers with a host KV tier of N blocks
PEER_INSTALL_HINT = "pip install 'kvroute[peers]'"
STARTUP_TIMEOUT_S = 180.0
PROBES = 40
PROBE_TOKENS = 24
VIEW_SEEDS = 9  # draws of the gateway's poll instants per prediction (loadtest.compare.predict)


@dataclass(frozen=True)
class Entry:
    """One `--compare` item: which router, with which policy, over workers in which mode (kvroute only)."""

    router: str  # "kvroute", "smg" or "vllm-router"
    policy: str
    mode: str = "grpc"  # one of WORKER_MODES
    flow_control: bool = True  # our gateway's --flow-control (on by default)
    host_kv_blocks: int = 0  # the workers' --host-kv-blocks (0: no host tier)
    api: str = "chat"  # how the bench sends (loadtest.bench.APIS); responses: our gateway only

    @property
    def reads_kv_events(self) -> bool:
        """Whether this router routes from the workers' vLLM-format KV events, so they must publish them: our
        gateway in vLLM mode, and vllm-router's `kv_aware` (its docs: a `--kv-event-source` per worker)."""
        if self.router == KVROUTE:
            return self.mode == "vllm"
        return self.router == "vllm-router" and self.policy == "kv_aware"

    @property
    def name(self) -> str:
        if self.router != KVROUTE:
            name = f"{self.router}:{self.policy}"
        else:
            name = self.policy if self.mode == "grpc" else f"{self.policy}@{self.mode}"
            name = name if self.flow_control else f"{name}+{FLOW_OFF}"
        name = f"{name}+{HOST_KV_BLOCKS}={self.host_kv_blocks}" if self.host_kv_blocks else name
        return name if self.api == "chat" else f"{name}+{self.api}"


def parse_entries(text: str) -> list[Entry]:
    from gateway.routing.router import POLICY_NAMES

    entries = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        spelled, *options = item.split("+")
        flow_off, host_kv_blocks, api = False, 0, "chat"
        for option in options:
            key, _, value = option.partition("=")
            if option == FLOW_OFF:
                flow_off = True
            elif option == RESPONSES:
                api = RESPONSES
            elif key == HOST_KV_BLOCKS and value.isdigit() and int(value) > 0:
                host_kv_blocks = int(value)
            else:
                raise UserError(
                    f"--compare: unknown option {option!r} in {item!r}; the options are +{FLOW_OFF}, "
                    f"+{HOST_KV_BLOCKS}=N (N >= 1) and +{RESPONSES}"
                )
        routed, at, mode = spelled.partition("@")
        router, _, policy = routed.rpartition(":")
        if router and router not in PEERS:
            raise UserError(f"--compare: unknown router {router!r} in {item!r}; peers: {', '.join(PEERS)}")
        if not policy:
            raise UserError(f"--compare: {item!r} names no policy")
        if not router and policy not in POLICY_NAMES:
            raise UserError(f"--compare: unknown kvroute policy {policy!r}; choose from {', '.join(POLICY_NAMES)}")
        if at and router:
            raise UserError(f"--compare: {item!r}: {router} reaches the workers over HTTP only; @MODE is for kvroute")
        if at and mode not in WORKER_MODES:
            raise UserError(
                f"--compare: unknown worker mode {mode!r} in {item!r}; choose from {', '.join(WORKER_MODES)}"
            )
        if flow_off and router:
            raise UserError(f"--compare: {item!r}: +{FLOW_OFF} is our gateway's flag; {router} has no flow control")
        if api == RESPONSES and router:
            raise UserError(
                f"--compare: {item!r}: +{RESPONSES} sends through our gateway's /v1/responses; for {router} leave it "
                "out (its requests go to /v1/chat/completions)"
            )
        entries.append(Entry(router or KVROUTE, policy, mode or "grpc", not flow_off, host_kv_blocks, api))
    if not entries:
        raise UserError("--compare: no entries")
    names = [e.name for e in entries]
    if len(set(names)) != len(names):
        raise UserError(f"--compare: an entry is listed twice: {', '.join(names)}")
    return entries


def peer_binary(router: str) -> str | None:
    """The peer's executable: beside this Python first (a venv), then on PATH."""
    beside = Path(sys.executable).parent / router
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(router)


@dataclass(frozen=True)
class FleetConfig:
    workers: int
    model: str
    seed: int
    num_kv_blocks: int | None
    worker_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    mix: TrafficMix = TrafficMix()
    tenant_keys: TenantKeys | None = None  # our gateways' API keys, with a mix of tenants


@dataclass
class WorkerProcess:
    worker_id: str
    grpc_port: int
    http_port: int
    metrics_port: int
    process: Child
    event_ports: tuple[int, int] | None = None  # (PUB, replay) of its vLLM-format KV events, in vLLM mode

    @property
    def spec(self) -> str:
        """The worker as our gateway's `--workers` names it: its gRPC address, or in vLLM mode its `vllm://` spec."""
        if self.event_ports is None:
            return f"127.0.0.1:{self.grpc_port}"
        events, replay = self.event_ports
        return (
            f"vllm://127.0.0.1:{self.http_port}?events=tcp://127.0.0.1:{events}&replay=tcp://127.0.0.1:{replay}"
            f"&id={self.worker_id}"
        )

    @property
    def routed_id(self) -> str:
        """The id our gateway routes it by: its `--worker-id` over gRPC, the spec's `id` (the same) in vLLM mode,
        so both modes place sessions on the ring alike, whatever ports the run drew."""
        return self.worker_id

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


class RouterFleet:
    """N workers and one router, started fresh on launch.fleet; the context manager ends every process it
    started. A worker or router that exits or is not ready in time raises LaunchError (with its log's tail)."""

    def __init__(self, entry: Entry, config: FleetConfig, log_dir: Path) -> None:
        self.entry = entry
        self.config = config
        self.fleet = Fleet(log_dir)
        self.workers: list[WorkerProcess] = []
        self.router_port = free_port()
        self.router_metrics_port = free_port()  # the router's /metrics, apart from its API port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def __enter__(self) -> RouterFleet:
        try:
            self.start()
        except BaseException:
            self.fleet.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.fleet.stop()

    def start(self) -> None:
        for i in range(self.config.workers):
            grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
            event_ports = (free_port(), free_port()) if self.entry.reads_kv_events else None
            argv = kvroute_argv(
                "worker", "--model", self.config.model,
                "--host", "127.0.0.1", "--port", str(grpc_port), "--http-port", str(http_port),
                "--metrics-port", str(metrics_port), "--worker-id", f"w{i}", "--seed", str(self.config.seed),
                *(["--num-kv-blocks", str(self.config.num_kv_blocks)] if self.config.num_kv_blocks else []),
                *(["--kv-events-config", kv_events_config(*event_ports)] if event_ports else []),
                *(["--host-kv-blocks", str(self.entry.host_kv_blocks)] if self.entry.host_kv_blocks else []),
                *FLEET_WORKER_FLAGS, *self.config.worker_args,
            )  # fmt: skip
            child = self.fleet.spawn(f"worker-{i}", argv)
            self.workers.append(WorkerProcess(f"w{i}", grpc_port, http_port, metrics_port, child, event_ports))
        ours = self.entry.router == KVROUTE
        # Our gateway finds workers as they come up, so it starts alongside them; the peers check their
        # workers once at startup (and are told the workers' block size), so they start after.
        keys = self.config.tenant_keys
        env = keys.gateway_env() if ours and keys is not None else None
        if ours:
            self.fleet.spawn(self.entry.name, self._router_argv(), env)
        for worker in self.workers:
            url = worker.http_url + "/health"
            self.fleet.wait_until(partial(http_ok, url), f"worker {worker.worker_id} at {url}", STARTUP_TIMEOUT_S)
        if not ours:
            self.fleet.spawn(self.entry.name, self._router_argv())
        url = self.url + ("/ready" if ours else "/health")
        self.fleet.wait_until(partial(http_ok, url), f"router {self.entry.name} at {url}", STARTUP_TIMEOUT_S)
        if ours:
            self._wait_all_joined()

    def _wait_all_joined(self) -> None:
        """Until the gateway has seen every worker join (its `kvroute:gateway_fleet_changes` counter), so the
        first requests are not all routed over the first worker to answer."""
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            text = httpx.get(f"http://127.0.0.1:{self.router_metrics_port}/metrics", timeout=5.0).text
            joins = sum(
                sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.name == "kvroute:gateway_fleet_changes_total" and sample.labels.get("change") == "joins"
            )
            if joins >= len(self.workers):
                return
            time.sleep(0.2)

    def target(self, model: str, args: argparse.Namespace) -> Target:
        """Where the bench sends: this router, with the mix's keys (ours) or tenant salts and smg's classes."""
        keys, bands = self.config.tenant_keys, self.config.mix.bands
        ours = self.entry.router == KVROUTE
        smg = self.entry.router == "smg" and bands
        return Target(
            self.url, model, None, args.ignore_eos, args.timeout, args.exact_length,
            tenant_keys=keys.keys if ours and keys is not None else {},
            salt_by_tenant=not ours,
            band_headers={b: {"x-smg-priority": c} for b, c in self.config.mix.smg_classes().items()} if smg else {},
            api=self.entry.api,
        )  # fmt: skip

    def _router_argv(self) -> list[str]:
        port = str(self.router_port)
        if self.entry.router == KVROUTE:
            addresses = ",".join(w.spec for w in self.workers)
            keys = self.config.tenant_keys
            return kvroute_argv(
                "gateway", "--model", self.config.model,
                "--host", "127.0.0.1", "--http-port", port, "--grpc-port", "0",
                "--metrics-port", str(self.router_metrics_port), "--workers", addresses, "--policy", self.entry.policy,
                *(["--api-keys-file", str(keys.api_keys_file)] if keys is not None else []),
                *([] if self.entry.flow_control else ["--flow-control", "off"]),
                *self.config.gateway_args,
            )  # fmt: skip
        binary = peer_binary(self.entry.router)
        assert binary is not None, "run_compare skips a peer that is not installed"
        urls = [w.http_url for w in self.workers]
        prefix = [binary, "launch"] if self.entry.router == "smg" else [binary]
        argv = [*prefix, "--host", "127.0.0.1", "--port", port, "--worker-urls", *urls, "--policy", self.entry.policy]
        # Both serve their metrics on port 29000 of every interface unless told: two runs at once would collide.
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(self.router_metrics_port)]
        if self.entry.router == "smg" and self.config.mix.bands:
            # Its admission scheduler orders by `x-smg-priority`; a tenant it does not know may ask for any class.
            argv += ["--priority-scheduler-enabled", "--priority-scheduler-default-max-class", "interactive"]
        return argv + self._peer_kv_event_args()

    def _peer_kv_event_args(self) -> list[str]:
        """What vllm-router's `kv_aware` reads besides the workers' URLs (its `--help`): each worker's ZMQ KV
        events and replay socket, their block size and the model they name. smg reads KV events only from
        gRPC workers; over HTTP its `cache_aware` keeps its own tree of the requests' text and needs nothing."""
        if self.entry.router == KVROUTE or not self.entry.reads_kv_events:
            return []
        args = [
            "--kv-event-block-size", str(worker_block_size(self.workers[0].grpc_port)),
            "--kv-event-model", self.config.model,
        ]  # fmt: skip
        for worker in self.workers:
            assert worker.event_ports is not None, "a fleet whose router reads KV events publishes them"
            events, replay = worker.event_ports
            args += ["--kv-event-source", f"{worker.http_url}=tcp://127.0.0.1:{events}"]
            args += ["--kv-event-replay-source", f"{worker.http_url}=tcp://127.0.0.1:{replay}"]
        return args

    def counters(self) -> dict[str, dict[str, float]]:
        """Each worker's cumulative counters: prompt tokens, prefix-cache hits, finished requests."""
        return {w.worker_id: scrape_counters(w.metrics_url) for w in self.workers}

    def gateway_counters(self) -> dict[str, float]:
        """Our gateway's cumulative figures (`scrape_gateway`); {} for a peer router."""
        if self.entry.router != KVROUTE:
            return {}
        return scrape_gateway(f"http://127.0.0.1:{self.router_metrics_port}/metrics")


def kv_events_config(events_port: int, replay_port: int) -> str:
    """`kvroute worker --kv-events-config`'s JSON (vLLM's): publish on loopback, binding both ports."""
    return json.dumps({
        "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{events_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}", "bind": True,
    })  # fmt: skip


def scrape_counters(metrics_url: str) -> dict[str, float]:
    """A worker's cumulative figures from its Prometheus text (vLLM's names): `prompt_tokens`, `prefix_hits`,
    `requests`, `preemptions`, `steps` (engine steps that computed tokens), the seconds its finished requests
    spent queued (`queue_s`: arrival at the engine to first scheduled) and in prefill (`prefill_s`), and its
    own time to first token (`ttft_s` over `first_tokens`: from the Generate call to the first token sent) with
    its cumulative histogram buckets (`ttft_le:BOUND`, seconds)."""
    text = httpx.get(metrics_url, timeout=10.0).text
    wanted = {
        "vllm:prompt_tokens_total": "prompt_tokens",
        "vllm:prefix_cache_hits_total": "prefix_hits",
        "vllm:e2e_request_latency_seconds_count": "requests",
        "vllm:num_preemptions_total": "preemptions",
        "kvroute:num_preemptions_recomputed_total": "preemptions_recomputed",
        "vllm:iteration_tokens_total_count": "steps",
        "vllm:request_queue_time_seconds_sum": "queue_s",
        "vllm:request_prefill_time_seconds_sum": "prefill_s",
        "vllm:time_to_first_token_seconds_sum": "ttft_s",
        "vllm:time_to_first_token_seconds_count": "first_tokens",
    }
    out = dict.fromkeys(wanted.values(), 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[wanted[sample.name]] += sample.value
            elif sample.name == "vllm:time_to_first_token_seconds_bucket":
                key = f"ttft_le:{sample.labels['le']}"
                out[key] = out.get(key, 0.0) + sample.value
    return out


def scrape_gateway(metrics_url: str) -> dict[str, float]:
    """Our gateway's cumulative figures from its Prometheus text: the load reports it applied and the seconds
    between them (`reports`, `report_interval_s`, the histogram's buckets `report_le:BOUND`:
    kvroute:gateway_fleet_report_interval_seconds), and its requests by routing reason (`reason:NAME`,
    kvroute:gateway_requests_total)."""
    text = httpx.get(metrics_url, timeout=10.0).text
    out = {"reports": 0.0, "report_interval_s": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kvroute:gateway_fleet_report_interval_seconds_bucket":
                key = f"report_le:{sample.labels['le']}"
                out[key] = out.get(key, 0.0) + sample.value
            elif sample.name == "kvroute:gateway_fleet_report_interval_seconds_count":
                out["reports"] += sample.value
            elif sample.name == "kvroute:gateway_fleet_report_interval_seconds_sum":
                out["report_interval_s"] += sample.value
            elif sample.name == "kvroute:gateway_requests_total":
                key = f"reason:{sample.labels['reason']}"
                out[key] = out.get(key, 0.0) + sample.value
    return out


def gateway_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What the gateway saw during the run: the seconds between two load reports of a worker (its view's
    refresh), as their mean (None without reports) and their histogram ({upper bound ("le", seconds): reports
    at or below it}, ascending, cumulative), and its requests by routing reason."""
    if not after:
        return {}

    def delta(prefix: str) -> dict[str, int]:
        return {
            k.partition(":")[2]: int(v - before.get(k, 0.0)) for k, v in after.items() if k.startswith(prefix + ":")
        }

    reports = after["reports"] - before.get("reports", 0.0)
    interval = after["report_interval_s"] - before.get("report_interval_s", 0.0)
    return {
        "report_interval_ms_mean": round(interval / reports * 1e3, 3) if reports else None,
        "report_interval_buckets": dict(sorted(delta("report_le").items(), key=lambda kv: float(kv[0]))),
        "reasons": {k: v for k, v in sorted(delta("reason").items()) if v},
    }


# counter_delta's figures of the engines, shown per run
ENGINE_FIGURES = (
    "preemptions",
    "preemptions_recomputed",
    "steps",
    "queue_ms_mean",
    "prefill_ms_mean",
    "ttft_ms_mean",
    "ttft_buckets",
)


def counter_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, Any]:
    """What the run cost the workers, from their own counters."""
    delta = {w: {k: after[w][k] - before[w][k] for k in after[w]} for w in after}
    prompt = sum(d["prompt_tokens"] for d in delta.values())
    hits = sum(d["prefix_hits"] for d in delta.values())
    requests = sum(d["requests"] for d in delta.values())
    first = sum(d["first_tokens"] for d in delta.values())
    return {
        "prompt_tokens": int(prompt),
        "prefill_tokens": int(prompt - hits),
        "cached_token_share": hits / prompt if prompt else 0.0,
        "per_worker_requests": {w: int(d["requests"]) for w, d in delta.items()},
        "preemptions": int(sum(d["preemptions"] for d in delta.values())),
        "preemptions_recomputed": int(sum(d["preemptions_recomputed"] for d in delta.values())),
        "steps": int(sum(d["steps"] for d in delta.values())),
        "queue_ms_mean": round(sum(d["queue_s"] for d in delta.values()) * 1e3 / requests, 3) if requests else 0.0,
        "prefill_ms_mean": round(sum(d["prefill_s"] for d in delta.values()) * 1e3 / requests, 3) if requests else 0.0,
        "ttft_ms_mean": round(sum(d["ttft_s"] for d in delta.values()) * 1e3 / first, 3) if first else 0.0,
        # The workers' TTFT histogram, merged: {upper bound ("le", seconds): requests at or below it}, ascending.
        "ttft_buckets": {
            k.partition(":")[2]: int(sum(d.get(k, 0.0) for d in delta.values()))
            for k in sorted(
                {k for d in delta.values() for k in d if k.startswith("ttft_le:")},
                key=lambda k: float(k.partition(":")[2]),
            )
        },
    }


async def probe_overhead(fleet: RouterFleet, model: str, probes: int = PROBES) -> dict[str, float]:
    """TTFT through the router minus TTFT straight to a worker, p50 and p99, from `probes` short requests
    each way, alternated (the same text each time, so both paths see a warm cache after the first); through
    a gateway with API keys, with the first tenant's."""
    prompt = " probe" * PROBE_TOKENS
    keys = fleet.config.tenant_keys
    api_key = next(iter(keys.keys.values())) if keys is not None and fleet.entry.router == KVROUTE else None
    via_router, direct = [], []
    async with httpx.AsyncClient(timeout=60.0) as client:
        for i in range(probes + 2):  # the first pair warms caches and connections
            request = BenchRequest(i, 0.0, 1, prompt=prompt)
            worker = fleet.workers[i % len(fleet.workers)]
            routed = await send_one(client, Target(fleet.url, model, api_key), request, time.perf_counter())
            straight = await send_one(client, Target(worker.http_url, model), request, time.perf_counter())
            if i >= 2 and routed.ok and straight.ok:
                via_router.append(routed.ttft_s)
                direct.append(straight.ttft_s)
    if not via_router:
        return {"p50": float("nan"), "p99": float("nan")}
    routed_ms, direct_ms = np.asarray(via_router) * 1e3, np.asarray(direct) * 1e3
    return {f"p{p}": float(np.percentile(routed_ms, p) - np.percentile(direct_ms, p)) for p in (50, 99)}


@dataclass
class RunResult:
    entry: Entry
    records: list[RequestRecord]
    summary: Summary
    workers: dict[str, Any]
    overhead_ms: dict[str, float]
    capacity_blocks: int  # KV blocks per worker
    routed_ids: tuple[str, ...] = ()  # the ids the router knew the workers by, in `workers`' order
    prediction: dict[str, Any] | None = None  # the replay's, for a kvroute policy
    gateway: dict[str, Any] = field(default_factory=dict)  # gateway_delta: our gateway's view refresh and reasons

    def to_json(self) -> dict[str, Any]:
        def pick(stats: dict[str, float | None]) -> dict[str, float | None]:
            return {k: None if (v := stats[k]) is None else round(v, 3) for k in ("p50", "p90", "p99")}

        return {
            **({"worker_mode": self.entry.mode} if self.entry.router == KVROUTE else {}),
            "ttft_ms": pick(self.summary.ttft_ms),
            "e2e_ms": pick(self.summary.e2e_ms),
            "tpot_ms": pick(self.summary.tpot_ms),
            "prefill_tokens": self.workers["prefill_tokens"],
            "prompt_tokens": self.workers["prompt_tokens"],
            "cached_token_share": round(self.workers["cached_token_share"], 6),
            "goodput": round(self.summary.goodput, 6),
            **self._mix_json(),
            "completed_tokens_per_s": round(self.summary.total_token_throughput, 2),
            "preemptions": self.workers["preemptions"],
            "preemptions_recomputed": self.workers["preemptions_recomputed"],
            "queue_lost_hits": self.summary.lost_hits,
            "continued_reuse": self.summary.reuse,
            "errors": self.summary.errors,
            "completed": self.summary.completed,
            "requests": self.summary.requests,
            "per_worker_requests": self.workers["per_worker_requests"],
            "engine": {k: self.workers[k] for k in ENGINE_FIGURES},
            "router_overhead_ms": {k: round(v, 3) for k, v in self.overhead_ms.items()},
            **({"gateway": self.gateway} if self.gateway else {}),
            "request_throughput": round(self.summary.request_throughput, 4),
            **({"replay_prediction": self.prediction} if self.prediction else {}),
            "per_request": bench_json(self.summary, self.records)["per_request"],
        }

    def _mix_json(self) -> dict[str, Any]:
        """Per band and per tenant figures, and the tenants' fairness, for a run of a traffic mix."""
        figures = self.summary.to_json()
        return {k: figures[k] for k in ("per_band", "per_tenant", "fairness") if k in figures}


def run_entry(
    entry: Entry,
    config: FleetConfig,
    workload: Workload,
    arrivals: Arrivals,
    objectives: Objectives,
    args: argparse.Namespace,
    log_dir: Path,
) -> RunResult:
    with RouterFleet(entry, config, log_dir) as fleet:
        model = args.served_model_name or config.model
        capacity_blocks = worker_capacity_blocks(fleet.workers[0].grpc_port)
        before, gateway_before = fleet.counters(), fleet.gateway_counters()
        make_sender = partial(HttpSender, fleet.target(model, args))
        records, duration = asyncio.run(
            run_requests(
                workload, make_sender, arrivals, progress=not args.no_progress, live_history=args.history == "live"
            )
        )
        time.sleep(0.2)  # the last request's counters are updated as its stream ends
        workers = counter_delta(before, fleet.counters())
        gateway = gateway_delta(gateway_before, fleet.gateway_counters())
        overhead = asyncio.run(probe_overhead(fleet, model, args.probes))
        routed_ids = tuple(w.routed_id for w in fleet.workers)
    if entry.router != KVROUTE:
        # A peer passes on the worker's own front door's x-kvroute-route, which is no routing decision of its own.
        for record in records:
            record.route = None
    summary = summarize(records, duration, objectives)
    return RunResult(entry, records, summary, workers, overhead, capacity_blocks, routed_ids, gateway=gateway)


TableRow = tuple[str, Callable[[RunResult], str]]  # a label and its cell for each run


def format_table(results: dict[str, RunResult]) -> str:
    """One side-by-side table of the runs."""
    rows: list[TableRow] = [
        ("TTFT p50 ms", lambda r: _ms(r.summary.ttft_ms["p50"])),
        ("TTFT p90 ms", lambda r: _ms(r.summary.ttft_ms["p90"])),
        ("TTFT p99 ms", lambda r: _ms(r.summary.ttft_ms["p99"])),
        ("E2E p50 ms", lambda r: _ms(r.summary.e2e_ms["p50"])),
        ("E2E p99 ms", lambda r: _ms(r.summary.e2e_ms["p99"])),
        ("TPOT p50 ms", lambda r: _ms(r.summary.tpot_ms["p50"])),
        ("prefill tokens", lambda r: f"{r.workers['prefill_tokens']:,}"),
        ("cached share", lambda r: f"{r.workers['cached_token_share']:.1%}"),
        ("goodput", lambda r: f"{r.summary.goodput:.1%}"),
        *_mix_rows(results),
        ("req/s", lambda r: f"{r.summary.request_throughput:.2f}"),
        ("completed tok/s", lambda r: f"{r.summary.total_token_throughput:,.0f}"),
        ("preemptions", lambda r: f"{r.workers['preemptions']:,}"),
        ("of which recomputed", lambda r: f"{r.workers['preemptions_recomputed']:,}"),
        ("hits lost in queue", lambda r: _lost_hits(r.summary.lost_hits)),
        ("continued reuse p50", lambda r: _share(r.summary.reuse, "median")),
        ("continued reuse min", lambda r: _share(r.summary.reuse, "min")),
        (f"reuse >= {REUSE_TARGET:.0%}", lambda r: _share(r.summary.reuse, "share_at_target")),
        ("errors", lambda r: str(sum(r.summary.errors.values()))),
        ("requests/worker", lambda r: "/".join(str(v) for v in r.workers["per_worker_requests"].values())),
        ("overhead p50 ms", lambda r: _ms(r.overhead_ms["p50"])),
        ("overhead p99 ms", lambda r: _ms(r.overhead_ms["p99"])),
        ("replay prefill", lambda r: f"{r.prediction['prefill_tokens']:,}" if r.prediction else "-"),
        ("replay hit rate", lambda r: f"{r.prediction['hit_rate']:.1%}" if r.prediction else "-"),
        ("replay goodput", lambda r: f"{r.prediction['goodput']:.1%}" if r.prediction else "-"),
        *_predicted_band_rows(results),
        ("ideal prefill", lambda r: f"{r.prediction['ideal_prefill_tokens']:,}" if r.prediction else "-"),
        ("prefill x ideal", lambda r: _times_ideal(r)),
    ]
    names = list(results)
    width = max(12, *(len(n) for n in names)) + 2
    label_width = max(18, *(len(label) + 1 for label, _ in rows))
    lines = [f"{'':<{label_width}}" + "".join(f"{n:>{width}}" for n in names)]
    for label, cell in rows:
        lines.append(f"{label:<{label_width}}" + "".join(f"{cell(results[n]):>{width}}" for n in names))
    return "\n".join(lines)


def _mix_rows(results: dict[str, RunResult]) -> list[TableRow]:
    """The table's rows of a traffic mix: goodput and TTFT p50 / p99 per band, goodput per tenant, fairness."""
    first = next(iter(results.values())).summary

    def band(name: str, key: str, cell: Callable[[dict], str]) -> TableRow:
        return f"{name} {key}", lambda r: cell(r.summary.per_band[name]) if name in r.summary.per_band else "-"

    def tenant(name: str) -> TableRow:
        def cell(run: RunResult) -> str:
            figures = run.summary.per_tenant.get(name)
            return "-" if figures is None else f"{figures['goodput']:.1%}"

        return f"tenant {name} goodput", cell

    rows: list[TableRow] = []
    for name in first.per_band:
        rows.append(band(name, "goodput", lambda b: f"{b['goodput']:.1%}"))
        rows.append(band(name, "TTFT p50 ms", lambda b: _ms(b["ttft_ms"]["p50"])))
        rows.append(band(name, "TTFT p99 ms", lambda b: _ms(b["ttft_ms"]["p99"])))
    rows += [tenant(name) for name in first.per_tenant]
    if first.per_tenant:
        rows.append(("fairness (Jain)", lambda r: "-" if r.summary.fairness is None else f"{r.summary.fairness:.3f}"))
    return rows


def _predicted_band_rows(results: dict[str, RunResult]) -> list[TableRow]:
    """The replay's goodput per band of a traffic mix, beside the measured rows."""

    def cell(name: str) -> Callable[[RunResult], str]:
        def figure(run: RunResult) -> str:
            band = (run.prediction or {}).get("per_band", {}).get(name)
            return "-" if band is None else f"{band['goodput']:.1%}"

        return figure

    return [(f"replay {name} goodput", cell(name)) for name in next(iter(results.values())).summary.per_band]


def _ms(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:,.1f}"


def _share(figures: dict[str, float] | None, key: str) -> str:
    return "-" if figures is None else f"{figures[key]:.1%}"


def _lost_hits(lost: dict[str, float] | None) -> str:
    return "-" if lost is None else f"{lost['lost']:.0f}/{lost['hits']:.0f} ({lost['share']:.0%})"


def format_ratios(results: dict[str, RunResult]) -> list[str]:
    """For each of our runs in vLLM mode or through /v1/responses whose entry without that is in the run too:
    its prefill and TTFT p50 over that one's."""
    lines = []
    for name, run in results.items():
        if run.entry.router != KVROUTE:
            continue
        bases = [replace(run.entry, mode="grpc")] if run.entry.mode != "grpc" else []
        bases += [replace(run.entry, api="chat")] if run.entry.api != "chat" else []
        for base in (results.get(entry.name) for entry in bases):
            if base is None:
                continue
            prefill = _ratio(run.workers["prefill_tokens"], base.workers["prefill_tokens"])
            ttft = _ratio(run.summary.ttft_ms["p50"], base.summary.ttft_ms["p50"])
            lines.append(f"{name} / {base.entry.name}: prefill x{prefill}, TTFT p50 x{ttft}")
    return lines


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b or a != a or b != b else f"{a / b:.3f}"


def _times_ideal(run: RunResult) -> str:
    """Measured prefill over the ideal (one unlimited cache on the same prompts), for a predicted run."""
    if not run.prediction or not run.prediction["ideal_prefill_tokens"]:
        return "-"
    return f"{run.workers['prefill_tokens'] / run.prediction['ideal_prefill_tokens']:.3f}"


def add_compare_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("fleets started here (instead of --url): --compare, --faults")
    group.add_argument(
        "--compare",
        default=None,
        metavar="LIST",
        help="comma list: kvroute policies (round_robin, prefix, kv_aware, ...) over gRPC workers, POLICY@vllm "
        "(over the same workers in vLLM mode: vllm:// specs, ZMQ KV events, HTTP), smg:POLICY, vllm-router:POLICY; "
        "ours take +flow-off, +host-kv-blocks=N and +responses (sent through /v1/responses)",
    )
    group.add_argument(
        "--faults",
        action="store_true",
        help="soak: a Redis fleet with 2 gateways; kill a worker, restart Redis and a gateway during --duration",
    )
    group.add_argument("--workers", type=int, default=2, help="workers per fleet (default 2)")
    group.add_argument("--model", default="sim", help="the workers' model: sim | tiny | smollm2 | PATH (default sim)")
    group.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks per worker (default: the worker's)")
    group.add_argument(
        "--worker-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for every worker (repeat); after the fleet's own --scheduling-policy priority "
        "(--worker-arg=--scheduling-policy=fcfs undoes it)",
    )
    group.add_argument(
        "--gateway-arg", action="append", default=[], metavar="ARG", help="extra argument for kvroute gateway"
    )
    group.add_argument(
        "--no-predict", action="store_true", help="skip the replay's prediction for the kvroute policies"
    )
    group.add_argument("--keep-logs", type=Path, default=None, metavar="DIR", help="keep the processes' logs here")
    group.add_argument(
        "--probes",
        type=int,
        default=PROBES,
        metavar="N",
        help=f"router-overhead probes, each through the router and straight to a worker (default {PROBES})",
    )


def run_compare(
    args: argparse.Namespace, workload: Workload, arrivals: Arrivals, objectives: Objectives, mix: TrafficMix
) -> int:
    """`--compare`: each entry over a fresh fleet, the table on stdout; 0 when every entry ran without errors."""
    entries = parse_entries(args.compare)
    if args.url:
        raise UserError("--compare starts its own fleets; drop --url")
    if args.api != "chat":
        raise UserError(
            f"--api is for --url runs; with --compare give an entry +{RESPONSES} (e.g. kv_aware+{RESPONSES})"
        )
    for entry in entries:
        check_api(entry.api, args.ignore_eos, args.exact_length)
    if args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    if args.probes < 2:
        raise UserError(f"--probes must be >= 2 (percentiles of each side), got {args.probes}")
    config = FleetConfig(
        args.workers, args.model, args.seed, args.num_kv_blocks, tuple(args.worker_arg), tuple(args.gateway_arg), mix
    )
    print(
        f"kvroute bench --compare: {len(workload.requests):,} requests of {workload.name}, {arrivals.describe()}, "
        f"{args.workers} x {args.model} workers per fleet",
        file=sys.stderr,
    )
    results: dict[str, RunResult] = {}
    skipped: dict[str, str] = {}
    with _log_dir(args.keep_logs) as log_dir:
        if mix.tenants:
            config = replace(config, tenant_keys=TenantKeys.write(mix.tenants, log_dir))
        for entry in entries:
            if entry.router != KVROUTE and peer_binary(entry.router) is None:
                skipped[entry.name] = f"{entry.router} is not installed: {PEER_INSTALL_HINT}"
                print(f"skipping {entry.name}: {skipped[entry.name]}", file=sys.stderr)
                continue
            try:
                logs = log_dir / entry.name.replace(":", "-")
                logs.mkdir(parents=True, exist_ok=True)
                results[entry.name] = run_entry(entry, config, workload, arrivals, objectives, args, logs)
            except LaunchError as exc:
                skipped[entry.name] = str(exc).splitlines()[0]
                print(f"{entry.name} failed: {exc}", file=sys.stderr)
                continue
            print(format_summary(results[entry.name].summary, entry.name), file=sys.stderr)
    if not results:
        raise UserError("no entry ran: " + "; ".join(f"{k}: {v}" for k, v in skipped.items()))
    if not args.no_predict:
        for result in results.values():
            if result.entry.router == KVROUTE and result.records:
                result.prediction = predict(
                    workload, result, config, args.tokenizer, args.history == "live", objectives
                )  # fmt: skip
    print(format_table(results))
    for line in format_ratios(results):
        print(line)
    for name, reason in skipped.items():
        print(f"{name}: skipped ({reason})")
    if args.json is not None:
        report = {
            "workload": workload.name,
            "requests": len(workload.requests),
            "arrivals": arrivals.describe(),
            "workers": args.workers,
            "model": args.model,
            "num_kv_blocks": args.num_kv_blocks,
            "seed": args.seed,
            "runs": {name: result.to_json() for name, result in results.items()},
            "skipped": skipped,
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.plot is not None:
        from loadtest.plot import plot_runs

        plot_runs(
            {n: (r.records, r.workers["per_worker_requests"]) for n, r in results.items()},
            args.plot,
            f"{workload.name}: {args.workers} x {args.model} workers, {arrivals.describe()}",
        )
    return 0 if all(not r.summary.errors for r in results.values()) and not skipped else 1


@contextlib.contextmanager
def _log_dir(keep: Path | None) -> Iterator[Path]:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix="kvroute-compare-") as tmp:
        yield Path(tmp)


def predict(
    workload: Workload,
    run: RunResult,
    config: FleetConfig,
    tokenizer_spec: str,
    live_history: bool = True,
    objectives: Objectives | None = None,
) -> dict[str, Any]:
    """The replay's prediction for one kvroute run: the prompts exactly as the workers received them
    (rendered, with the run's own answers in closed-loop chats, templated, tokenized; through `/v1/responses` a
    completion prompt is one user message and a continued conversation the same prompt as chat's), in the order and at
    the times the bench sent them in that run, over replicas named as the gateway names the live workers (so
    the replay's hash ring is the gateway's) with the live model's block hashes, the run's cache size and the
    sim workers' cost model (`config.worker_args`), through the fleet simulator (sim/: the workers' own engine and
    scheduler on a virtual clock, the gateway's books read as often as the embedded fleet state polls). Each
    request's answer is the text the fleet streamed, tokenized in place after its prompt: its worker holds
    that KV when it finishes, as a worker caches the blocks its decoded tokens fill, and a next turn that
    carries the answer back (closed loop) reuses it. The stream
    has no token ids, so this assumes the text re-tokenizes to the decoded ids: sim words do; where a real
    model's text does not, the replay over-predicts that turn's reuse. Each simulated step also takes the
    workers' measured time per step beyond the cost model (`step_overhead_ms`: their mean TPOT less the mean
    the cost model alone gives the same requests, simulated first). The simulated gateway reads each
    worker on a poller of its own, as the embedded fleet state does, at intervals drawn from the live gateway's
    own (`view_refresh_ms` their mean, `view_draw`); the instants they fall at are not measured, so the
    prediction is the median run (by TTFT p50) of VIEW_SEEDS draws (`ttft_ms_p50_per_seed`). A traffic mix's
    requests are hashed with their tenant's salt, as the gateway derives it. The simulated gateway runs the live
    one's flow control (gateway.flow_control.dispatcher) when the run's gateway had it on (not `+flow-off`), with
    the `flow_control` of a `--routing-config` among the `--gateway-arg`s, each request in its tenant (its weight
    from the mix) and its band (its priority as the gateway clamps it): requests wait in the simulated gateway and
    are shed as in the live one. TTFT: the simulated engine's (`ttft_ms`), and with the run's measured time outside
    the engines added (`ttft_ms_with_outside_engine`, `outside_engine_ms`). Goodput (overall, `per_band`,
    `per_tenant`, `fairness`): the bench's own summary (loadtest.bench_stats) over the simulated requests, each
    with the time outside the engines added to its TTFT and end, a shed one failed with the status its client
    would have got, judged by the run's `objectives`."""
    from gateway.admission.auth import OPEN_TENANT, cache_salt
    from gateway.request import Tenant
    from kvroute.model_source import resolve_model
    from loadtest.bench import with_answers
    from loadtest.render import vocabulary
    from sim.replay import ReplayConfig, ideal_prefill_tokens, simulate
    from sim.traces import Trace, TraceRequest

    tokenizer = vocabulary(tokenizer_spec).tokenizer
    salts = config.tenant_keys.salts() if config.tenant_keys is not None else {}
    weights = config.mix.weights
    answers = {r.index: r.output_text for r in run.records if r.ok}
    sent = sorted(run.records, key=lambda r: r.sent_s)
    requests = []
    for record in sent:
        request = workload.requests[record.index]
        if live_history:
            request = with_answers(request, workload.requests, answers)
        if run.entry.api == RESPONSES and request.messages is None:  # a string input: one user message
            request = replace(request, prompt=None, messages=({"role": "user", "content": request.prompt or ""},))
        ids = tuple(token_ids(request, tokenizer))
        tenant = Tenant(request.tenant, salts[request.tenant]) if request.tenant in salts else OPEN_TENANT
        requests.append(
            TraceRequest(
                record.sent_s * 1e3,
                len(ids),
                max(record.output_tokens, 1) if record.ok else request.max_tokens,
                token_ids=ids,
                output_token_ids=decoded_ids(request, ids, answers.get(record.index), record.output_tokens, tokenizer),
                session_id=request.session,
                cache_salt=cache_salt(tenant, request.cache_salt),
                tenant=tenant.name,
                weight=weights.get(tenant.name, 1.0),
                band=tenant.clamped_priority(request.priority),
            )
        )
    trace = Trace(f"live:{workload.name}", "tokens", DEFAULT_BLOCK_SIZE, tuple(requests))
    names = tuple(run.workers["per_worker_requests"])
    replay_config = ReplayConfig(
        replicas=config.workers,
        policies=(run.entry.policy,),
        capacity_blocks=run.capacity_blocks,
        replica_names=run.routed_ids or names,
        model_id=resolve_model(config.model).model_id,
        view_poll_s=view_refresh_s(run),
        view_poll_each=True,
        view_poll_draw=view_draw(run),
        flow_control=run.entry.flow_control,
        flow_settings=routing_flow_settings(config.gateway_args),
        host_kv_blocks=run.entry.host_kv_blocks,
        **sim_costs(config.worker_args),
    )
    # The workers' own work per step, beyond the cost model: their mean TPOT less the one the cost model alone
    # gives the same requests (a decode step's cost and the prefill chunks that share it), simulated first. The
    # mean, not the median: a queue grows with the mean step, and a busy CPU stretches a share of steps only.
    live_tpot_s = [r.tpot_s for r in run.records if r.tpot_s is not None]
    if live_tpot_s:
        _, costed = simulate(trace, run.entry.policy, replay_config)
        model_tpot_ms = float(np.mean([t for t in costed.tpot_samples_ms if t is not None]))
        overhead_ms = float(np.mean(live_tpot_s)) * 1e3 - model_tpot_ms
        replay_config = replace(replay_config, step_overhead_ms=max(overhead_ms, 0.0))
    # The gateway's polls fall at instants no run records: the median of VIEW_SEEDS draws of them.
    seeds = VIEW_SEEDS if replay_config.view_poll_draw else 1
    drawn = [simulate(trace, run.entry.policy, replace(replay_config, view_seed=seed))[1] for seed in range(seeds)]
    drawn.sort(key=lambda r: r.ttft_ms["p50"])
    result = drawn[len(drawn) // 2]
    outside = outside_engine_ms(run)
    records = []
    for record, prepared, ttft, e2e, shed, status in zip(
        sent, trace.requests, result.ttft_samples_ms, result.e2e_samples_ms, result.shed_of, result.status_of,
        strict=True,
    ):  # fmt: skip
        request = workload.requests[record.index]
        simulated = RequestRecord(
            record.index, record.sent_s, OK if not shed else f"http_{status}", session=request.session,
            tenant=request.tenant, band=request.band,
        )  # fmt: skip
        if not shed:
            simulated.ttft_s, simulated.e2e_s = (ttft + outside) * 1e-3, (e2e + outside) * 1e-3
            simulated.output_tokens, simulated.prompt_tokens = prepared.output_length, prepared.input_length
        records.append(simulated)
    end_s = max((r.sent_s + (r.e2e_s or 0.0) for r in records), default=0.0)
    summary = summarize(records, end_s - min((r.sent_s for r in records), default=0.0), objectives)
    return {
        "flow_control": replay_config.flow_control,
        "goodput": round(summary.goodput, 6),
        **{k: v for k, v in summary.to_json().items() if k in ("per_band", "per_tenant", "fairness")},
        "sheds": dict(sorted(Counter(s for s in result.shed_of if s).items())),
        "prefill_tokens": result.prefill_tokens,
        "ideal_prefill_tokens": ideal_prefill_tokens(trace, replay_config.model_id),
        "hit_rate": round(result.hit_rate, 6),
        "ttft_ms": {k: round(v, 3) for k, v in result.ttft_ms.items()},
        "outside_engine_ms": round(outside, 3),
        "step_overhead_ms": round(replay_config.step_overhead_ms, 3),
        "view_refresh_ms": round(replay_config.view_poll_s * 1e3, 3),
        "view_seeds": seeds,
        "ttft_ms_p50_per_seed": [round(r.ttft_ms["p50"], 3) for r in drawn],
        "ttft_ms_with_outside_engine": {k: round(v + outside, 3) for k, v in result.ttft_ms.items()},
        "per_worker_requests": dict(zip(names, result.per_replica_requests, strict=False)),
        "reasons": result.reasons,
        "engine": {
            "preemptions": result.preemptions,
            "steps": result.steps,
            "queue_ms_mean": round(float(np.mean(result.queue_samples_ms)), 3),
            "prefill_ms_mean": round(float(np.mean(result.prefill_samples_ms)), 3),
        },
        # In the order sent, as `requests` above: the replay's worker, cached tokens and TTFT for each request.
        "per_request": [
            {
                "index": record.index,
                "worker": names[r],
                "reason": reason,
                "matched_blocks": m,
                "cached_tokens": c,
                "ttft_ms": round(t, 3),
                "queue_ms": round(q, 3),
            }
            for record, r, reason, m, c, t, q in zip(
                sorted(run.records, key=lambda r: r.sent_s),
                result.replica_of,
                result.reason_of,
                result.matched_of,
                result.cached_tokens,
                result.ttft_samples_ms,
                result.queue_samples_ms,
                strict=True,
            )
        ],
    }


def view_draw(run: RunResult) -> tuple[tuple[float, float, float], ...]:
    """The live gateway's intervals between two load reports of a worker as `sim.ViewTiming.poll_draw` ranges:
    (lower bound, upper bound, reports) per bucket of its histogram that holds any (the first bucket's and the
    +Inf bucket's at their one finite bound); () without a histogram."""
    ranges, lower, below = [], 0.0, 0
    for le, count in run.gateway.get("report_interval_buckets", {}).items():
        upper = float(le)
        if count > below:
            low = lower or upper
            ranges.append((low, low if upper == float("inf") else upper, float(count - below)))
        lower, below = upper, count
    return tuple(ranges)


def view_refresh_s(run: RunResult) -> float:
    """Seconds between two reads of a worker's load and KV events by the simulated gateway: the live gateway's
    mean interval between two load reports of a worker during the run (`gateway_delta`), else the embedded
    fleet state's poll interval."""
    from gateway.fleet.embedded_fleet import PollOptions

    measured = run.gateway.get("report_interval_ms_mean")
    return measured * 1e-3 if measured else PollOptions().poll_interval


def outside_engine_ms(run: RunResult) -> float:
    """The run's time to first token outside the workers' engines (the client, the router, the gateway's
    tokenizing and routing, gRPC both ways, the first SSE event), at the median, under the run's own load: the
    client's TTFT median less the workers' own (`vllm:time_to_first_token_seconds`, from the Generate call to
    the first token sent), read from their histogram as Prometheus's `histogram_quantile` reads it (linear
    within the bucket that holds it, so only as exact as that bucket is narrow), kept between 0 (no request's
    client TTFT is below its worker's) and the difference of the two means (exact, from the histogram's sum);
    0 without figures. A median, not a mean: under load a share of requests waits much longer outside the
    engines (event loops behind on a busy CPU), which moves the mean far more than the median it is added to."""
    client_s = [r.ttft_s for r in run.records if r.ok and r.ttft_s is not None]
    buckets = [(float(le), count) for le, count in run.workers["ttft_buckets"].items()]
    if not client_s or not buckets or not buckets[-1][1]:
        return 0.0
    median = (float(np.median(client_s)) - histogram_quantile(0.5, buckets)) * 1e3
    mean = float(np.mean(client_s)) * 1e3 - run.workers["ttft_ms_mean"]
    return min(max(median, 0.0), max(mean, 0.0))


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """The q-quantile of a cumulative histogram [(upper bound, count), ...] ascending and ending at +Inf, as
    Prometheus's `histogram_quantile` reads it: linear within the bucket that holds it, from 0 below the first
    bound, the last finite bound when it falls in the +Inf bucket."""
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if bound == float("inf"):
                return lower
            return lower + (bound - lower) * (rank - below) / (count - below) if count > below else bound
        lower, below = bound, count
    return lower


def decoded_ids(
    request: BenchRequest, prompt_ids: tuple[int, ...], answer: str | None, output_tokens: int, tokenizer: Tokenizer
) -> tuple[int, ...]:
    """The ids of `answer` as they follow the prompt when the conversation is tokenized with it (chat: as the
    assistant message; completion: appended), at most `output_tokens`; () for no answer, or when the prompt
    does not tokenize the same with the answer after it."""
    if not answer:
        return ()
    full = token_ids(request, tokenizer, answer)
    if tuple(full[: len(prompt_ids)]) != prompt_ids:
        return ()
    return tuple(full[len(prompt_ids) : len(prompt_ids) + output_tokens])


def routing_flow_settings(gateway_args: tuple[str, ...]) -> FlowControlConfig:
    """The `flow_control` of the routing config a `--gateway-arg` names (`--routing-config PATH`, either form),
    read as the gateway reads it; the defaults without one."""
    from sim.replay_cli import flow_settings

    path = None
    for i, arg in enumerate(gateway_args):
        flag, sep, value = arg.partition("=")
        if flag == "--routing-config":
            path = value if sep else (gateway_args[i + 1] if i + 1 < len(gateway_args) else "")
    return flow_settings(None if path is None else Path(path))


def sim_costs(worker_args: tuple[str, ...]) -> dict[str, Any]:
    """ReplayConfig's keyword arguments for the cost-model fields that the `--worker-arg`s set on sim workers
    (both `--flag=V` and `--flag V` forms); unset ones keep the replay's defaults, which are the sim worker's."""
    flags = {
        "--sim-prefill-us-per-token": "prefill_us_per_token",
        "--sim-decode-ms-per-step": "decode_ms_per_step",
        "--sim-host-copy-us-per-block": "host_copy_us_per_block",
    }
    costs: dict[str, Any] = {}
    for i, arg in enumerate(worker_args):
        flag, sep, value = arg.partition("=")
        if flag in flags:
            if not sep:
                value = worker_args[i + 1] if i + 1 < len(worker_args) else ""
            try:
                costs[flags[flag]] = float(value)
            except ValueError:
                raise UserError(f"--worker-arg {flag} needs a number, got {value!r}") from None
    return costs


def worker_block_size(grpc_port: int) -> int:
    """A running worker's KV block size (GetInfo)."""
    import grpc

    from proto import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        info = worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=10.0)
    return info.block_size


def worker_capacity_blocks(grpc_port: int) -> int:
    """A running worker's KV blocks (GetStats)."""
    import grpc

    from proto import worker_pb2, worker_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
        stats = worker_pb2_grpc.WorkerStub(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=10.0)
    return stats.num_blocks_total
