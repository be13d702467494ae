"""`kvroute up`: a whole fleet on this machine, N workers and a gateway, as child processes.

    kvroute up --workers 2 --model smollm2            # then: POST http://127.0.0.1:8000/v1/chat/completions

Each worker gets a free gRPC port; the gateway routes over them (embedded fleet state, or Redis with
--redis, the workers then reporting there too). The fleet's shared secrets, the worker token and the
tenants' cache-salt secret, are drawn at random for each `up` and handed to the children in their
environment (never on a command line), unless this environment already names them
(KVROUTE_WORKER_TOKEN[_FILE], KVROUTE_CACHE_SALT_SECRET[_FILE]): set those when several `up`s share a Redis.

`up` prints where the gateway listens once it is ready, and stops every child on Ctrl-C or SIGTERM: they
share one process group, which gets SIGTERM (each drains), then SIGKILL for any still alive after the grace
period. Each child also asks the kernel for SIGTERM should `up` itself die without cleaning up
(PR_SET_PDEATHSIG), so no worker outlives it. A child that exits on its own stops the fleet (exit status 1).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field

from gateway.auth import SALT_SECRET_ENV, SALT_SECRET_FILE_ENV
from gateway.router import POLICY_NAMES
from kvroute.credentials import WORKER_TOKEN_ENV, WORKER_TOKEN_FILE_ENV, generate_secret
from kvroute.errors import UserError
from launch.worker import free_port

READY_TIMEOUT_S = 600.0  # SmolLM2 on two busy cores: load, warm-up (kernel build on first use)
STOP_GRACE_S = 15.0
_PR_SET_PDEATHSIG = 1


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="number of worker processes")
    parser.add_argument("--model", default="smollm2", help="tiny | smollm2 | sim | PATH")
    parser.add_argument("--policy", choices=POLICY_NAMES, default="kv_aware")
    parser.add_argument("--http-port", type=int, default=8000, help="the gateway's OpenAI HTTP port")
    parser.add_argument("--grpc-port", type=int, default=50050, help="the gateway's gRPC port (0: off)")
    parser.add_argument(
        "--metrics-port", type=int, default=9091, help="the gateway's Prometheus /metrics port (0: off)"
    )
    parser.add_argument("--redis", default=None, help="fleet state in Redis at this URL (default: embedded)")
    parser.add_argument("--host", default="127.0.0.1", help="where the gateway listens (workers stay on loopback)")
    parser.add_argument("--worker-args", default="", help='extra `kvroute worker` flags, e.g. "--num-kv-blocks 512"')
    parser.add_argument(
        "--gateway-args", default="", help='extra `kvroute gateway` flags, e.g. "--log-level info" (a line per request)'
    )


@dataclass
class Fleet:
    """The children of one `kvroute up`: workers first, the gateway last, all in one process group."""

    names: dict[subprocess.Popen, str] = field(default_factory=dict)
    pgid: int | None = None

    @property
    def children(self) -> list[subprocess.Popen]:
        return list(self.names)

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        """Start a child in the fleet's process group (the first child founds it), with `env` (default: ours)."""
        child = subprocess.Popen(
            argv,
            process_group=0 if self.pgid is None else self.pgid,
            preexec_fn=_die_with_parent,
            env=env,
        )
        if self.pgid is None:
            self.pgid = child.pid
        self.names[child] = name
        return child

    def exited(self) -> str | None:
        """`name (status N)` of a child that has exited, if any."""
        dead = next((c for c in self.children if c.poll() is not None), None)
        return None if dead is None else f"{self.names[dead]} exited with status {dead.returncode}"

    def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM to the group, SIGKILL to it after `grace_s`; returns once every child is reaped."""
        if self.pgid is None:
            return
        _signal_group(self.pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for child in self.children:
            try:
                child.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        _signal_group(self.pgid, signal.SIGKILL)
        for child in self.children:
            child.wait()


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent dies (Linux; elsewhere the process group serves)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def kvroute_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "launch.cli", *args]


def fleet_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """`environ` with a fresh worker token and cache-salt secret wherever it names none, for every child."""
    env = dict(environ)
    for file_var, value_var in ((WORKER_TOKEN_FILE_ENV, WORKER_TOKEN_ENV), (SALT_SECRET_FILE_ENV, SALT_SECRET_ENV)):
        if not env.get(file_var) and not env.get(value_var):
            env[value_var] = generate_secret()
    return env


def run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise UserError(f"--workers must be >= 1, got {args.workers}")
    for flag in ("http_port", "grpc_port", "metrics_port"):
        if not 0 <= getattr(args, flag) < 65536:
            raise UserError(f"--{flag.replace('_', '-')} must be in [0, 65536), got {getattr(args, flag)}")
    http_port = args.http_port or free_port(args.host)
    addresses = [f"127.0.0.1:{free_port()}" for _ in range(args.workers)]
    redis = ["--redis", args.redis] if args.redis else []
    env = fleet_environment(os.environ)
    fleet = Fleet()
    stopping = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for i, address in enumerate(addresses):
            port = address.rsplit(":", 1)[1]
            fleet.spawn(
                f"worker-{i}",
                kvroute_argv(
                    "worker", "--model", args.model, "--host", "127.0.0.1", "--port", port,
                    "--worker-id", f"worker-{i}", *redis, *shlex.split(args.worker_args),
                ),
                env,
            )  # fmt: skip
        fleet.spawn(
            "gateway",
            kvroute_argv(
                "gateway", "--model", args.model, "--host", args.host, "--http-port", str(http_port),
                "--grpc-port", str(args.grpc_port), "--metrics-port", str(args.metrics_port),
                "--workers", ",".join(addresses), "--policy", args.policy,
                "--log-level", "warning", *redis, *shlex.split(args.gateway_args),
            ),
            env,
        )  # fmt: skip
        url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '') else args.host}:{http_port}"
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not stopping and not (_routable(url) >= len(addresses) and all(_serving(a) for a in addresses)):
            dead = fleet.exited()
            if dead is not None:
                print(f"kvroute up: {dead}", file=sys.stderr)
                return 1
            if time.monotonic() > deadline:
                print(f"kvroute up: the fleet was not ready after {READY_TIMEOUT_S:g} s", file=sys.stderr)
                return 1
            time.sleep(0.25)
        if not stopping:
            grpc_where = f", gRPC 127.0.0.1:{args.grpc_port}" if args.grpc_port else ""
            metrics_where = f", metrics on port {args.metrics_port}" if args.metrics_port else ""
            print(
                f"kvroute up: {args.workers} {args.model} workers ({', '.join(addresses)}) behind {url}/v1"
                f"{grpc_where}{metrics_where}, policy {args.policy}; Ctrl-C stops them all",
                flush=True,
            )
        while not stopping:
            dead = fleet.exited()
            if dead is not None:
                print(f"kvroute up: {dead}; stopping the others", file=sys.stderr)
                return 1
            time.sleep(0.25)
        return 0
    finally:
        print("kvroute up: stopping the fleet", flush=True)
        fleet.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _routable(url: str) -> int:
    """How many workers the gateway can route to now (its /ready body), 0 when it does not answer."""
    try:
        with urllib.request.urlopen(f"{url}/ready", timeout=1.0) as response:
            return int(json.loads(response.read())["workers"])
    except (urllib.error.URLError, OSError, ValueError, KeyError):
        return 0


def _serving(address: str) -> bool:
    """The worker's gRPC health says SERVING (it has loaded and warmed up its model)."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING
