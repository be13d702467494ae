"""`kvroute up`: a whole fleet on this machine, N workers and a gateway, as child processes.

    kvroute up --workers 2 --model smollm2            # then: POST http://127.0.0.1:8000/v1/chat/completions

Each worker gets a free gRPC port; the gateway routes over them (embedded fleet state, or Redis with
--redis URL, the workers then reporting there too; `--redis local` starts a redis-server for the fleet). The
fleet's shared secrets, the worker token and the tenants' cache-salt secret, are drawn at random for each
`up` and handed to the children in their environment (never on a command line), unless this environment
already names them (KVROUTE_WORKER_TOKEN[_FILE], KVROUTE_CACHE_SALT_SECRET[_FILE]): set those when several
`up`s share a Redis.

`up` prints where the gateway listens once it is ready, and stops every child on Ctrl-C or SIGTERM: SIGTERM
(each drains), then SIGKILL for any still alive after the grace period (launch/fleet.py, which also makes
sure no child outlives `up`). A child that exits on its own stops the fleet (exit status 1).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
from collections.abc import Mapping

from gateway.admission.auth import SALT_SECRET_ENV, SALT_SECRET_FILE_ENV
from gateway.routing.router import POLICY_NAMES
from kvroute.credentials import WORKER_TOKEN_ENV, WORKER_TOKEN_FILE_ENV, generate_secret
from kvroute.errors import UserError
from launch.fleet import FLEET_WORKER_FLAGS, Fleet, LaunchError, free_port, grpc_serving, kvroute_argv, routable
from launch.redis_server import RedisServer

READY_TIMEOUT_S = 600.0  # SmolLM2 on two busy cores: load, warm-up (kernel build on first use)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", type=int, default=2, help="number of worker processes")
    parser.add_argument("--model", default="smollm2", help="tiny | smollm2 | sim | PATH")
    parser.add_argument("--policy", choices=POLICY_NAMES, default="kv_aware")
    parser.add_argument(
        "--flow-control", choices=("on", "off"), default="on",
        help="the gateway's flow control (docs/flow_control.md); off: each request is sent at once",
    )  # fmt: skip
    parser.add_argument("--http-port", type=int, default=8000, help="the gateway's OpenAI HTTP port")
    parser.add_argument("--grpc-port", type=int, default=50050, help="the gateway's gRPC port (0: off)")
    parser.add_argument(
        "--metrics-port", type=int, default=9091, help="the gateway's Prometheus /metrics port (0: off)"
    )
    parser.add_argument(
        "--redis",
        default=None,
        metavar="URL|local",
        help="fleet state in Redis at this URL, or `local`: a redis-server of this fleet's own, on a free "
        "loopback port, stopped with it (default: embedded)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="where the gateway listens (workers stay on loopback)")
    parser.add_argument(
        "--worker-args",
        default="",
        help='extra `kvroute worker` flags, e.g. "--num-kv-blocks 512"; after up\'s own (--scheduling-policy '
        'priority: "--scheduling-policy fcfs" undoes it)',
    )
    parser.add_argument(
        "--gateway-args", default="", help='extra `kvroute gateway` flags, e.g. "--log-level info" (a line per request)'
    )


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
    env = fleet_environment(os.environ)
    fleet = Fleet(env=env)
    local_redis = _start_local_redis() if args.redis == "local" else None
    redis_url = local_redis.url if local_redis is not None else args.redis
    redis = ["--redis", redis_url] if redis_url else []
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
                    "--worker-id", f"worker-{i}", *FLEET_WORKER_FLAGS, *redis, *shlex.split(args.worker_args),
                ),
            )  # fmt: skip
        fleet.spawn(
            "gateway",
            kvroute_argv(
                "gateway", "--model", args.model, "--host", args.host, "--http-port", str(http_port),
                "--grpc-port", str(args.grpc_port), "--metrics-port", str(args.metrics_port),
                "--workers", ",".join(addresses), "--policy", args.policy, "--flow-control", args.flow_control,
                "--log-level", "warning", *redis, *shlex.split(args.gateway_args),
            ),
        )  # fmt: skip
        url = f"http://{'127.0.0.1' if args.host in ('0.0.0.0', '') else args.host}:{http_port}"
        try:
            fleet.wait_until(
                lambda: routable(url) >= len(addresses) and all(grpc_serving(a) for a in addresses),
                "the fleet",
                READY_TIMEOUT_S,
                interrupted=lambda: stopping,
            )
        except LaunchError as exc:
            print(f"kvroute up: {exc}", file=sys.stderr)
            return 1
        if not stopping:
            grpc_where = f", gRPC 127.0.0.1:{args.grpc_port}" if args.grpc_port else ""
            redis_where = f", fleet state in Redis at {redis_url}" if redis_url else ""
            metrics_where = f", metrics on port {args.metrics_port}" if args.metrics_port else ""
            print(
                f"kvroute up: {args.workers} {args.model} workers ({', '.join(addresses)}) behind {url}/v1"
                f"{grpc_where}{metrics_where}{redis_where}, policy {args.policy}; Ctrl-C stops them all",
                flush=True,
            )
        try:
            fleet.wait_until(lambda: False, "the fleet's end", float("inf"), interrupted=lambda: stopping)
        except LaunchError as exc:
            print(f"kvroute up: {str(exc).splitlines()[0]}; stopping the others", file=sys.stderr)
            return 1
        return 0
    finally:
        print("kvroute up: stopping the fleet", flush=True)
        fleet.stop()
        if local_redis is not None:
            local_redis.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _start_local_redis() -> RedisServer:
    """`--redis local`: a redis-server for this fleet alone (launch/redis_server.py, the tests' own)."""
    try:
        server = RedisServer()
        server.start()
    except RuntimeError as exc:
        raise UserError(f"--redis local: {exc}") from None
    return server
