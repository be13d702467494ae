"""`kvroute gateway`: the OpenAI HTTP and gRPC front doors over one request path and a fleet state.

    kvroute gateway --model smollm2 --workers 10.0.0.1:50051,10.0.0.2:50051      # embedded fleet state
    kvroute gateway --model smollm2 --redis redis://redis:6379 [--workers ...]   # Redis (workers = fallback)

On SIGTERM / SIGINT the gateway drains: /ready turns 503 and gRPC health NOT_SERVING, new requests get 503
(UNAVAILABLE), requests in flight get `--drain-timeout` seconds to finish, then the servers stop and the
process exits. It imports no torch (the gateway image has none) and loads only the tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from gateway.router import POLICY_NAMES
from kvroute.cli import UserError

logger = logging.getLogger("kvroute.gateway")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from gateway.limits import Limits

    limits = Limits()
    parser.add_argument(
        "--model",
        default="smollm2",
        help="tokenizer, chat template and model id: tiny | smollm2 | sim | PATH (as the workers')",
    )
    parser.add_argument("--served-model-name", default=None, help="what clients pass as `model` (default: --model)")
    parser.add_argument("--host", default="0.0.0.0", help="listen address of both front doors")
    parser.add_argument("--http-port", type=int, default=8000, help="OpenAI HTTP API port (0: a free one)")
    parser.add_argument("--grpc-port", type=int, default=50050, help="gRPC Gateway + Worker + Health port (0: off)")
    parser.add_argument("--workers", default="", help="worker addresses host:port,host:port (embedded fleet state)")
    parser.add_argument("--redis", default=None, help="Redis fleet state URL (redis://, rediss://, redis+sentinel://)")
    parser.add_argument("--policy", choices=POLICY_NAMES, default="kv_aware")
    parser.add_argument(
        "--routing-config", default=None, help="JSON file of policy options (epsilon, queue_limit, ...)"
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block; must equal the workers'")
    parser.add_argument(
        "--api-keys-file", default=None, help='JSON [{"tenant", "key_sha256", "max_concurrency"}]; or $KVROUTE_API_KEYS'
    )
    parser.add_argument("--max-prompt-tokens", type=int, default=limits.max_prompt_tokens)
    parser.add_argument(
        "--max-tokens", type=int, default=limits.max_tokens, help="largest max_tokens; a chat's default"
    )
    parser.add_argument("--max-body-bytes", type=int, default=limits.max_body_bytes)
    parser.add_argument("--max-n", type=int, default=limits.max_n)
    parser.add_argument("--max-stop", type=int, default=limits.max_stop)
    parser.add_argument("--tenant-max-concurrency", type=int, default=None, help="per tenant whose key sets none")
    parser.add_argument(
        "--tokenizer-cache-bytes", type=int, default=None, help="memory for tokenized text runs (64 MiB; 0: off)"
    )
    parser.add_argument(
        "--retries", type=int, default=2, help="other workers tried when one fails before its first token"
    )
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    parser.add_argument("--log-prompts", action="store_true", help="log prompt text (never logged otherwise)")
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


@dataclass
class Gateway:
    """A built (not yet started) gateway: its request path and fleet state, and the front doors' settings."""

    request_path: Any  # gateway.request_path.RequestPath
    fleet: Any  # gateway.fleet_state.FleetState
    max_body_bytes: int
    default_max_tokens: int


def build_gateway(args: argparse.Namespace) -> Gateway:
    """Everything `kvroute gateway` serves, from its parsed flags. Raises UserError with one line."""
    from gateway.auth import Authenticator
    from gateway.limits import Limits
    from gateway.metrics import GatewayMetrics
    from gateway.request_path import RequestPath, fleet_identity
    from gateway.retry import RetryPolicy
    from gateway.router import make_policy
    from kvroute.model_source import resolve_model
    from kvroute.tokenizer import Tokenizer

    for flag in ("http_port", "grpc_port"):
        if not 0 <= getattr(args, flag) < 65536:
            raise UserError(f"--{flag.replace('_', '-')} must be in [0, 65536), got {getattr(args, flag)}")
    if args.block_size < 1:
        raise UserError(f"--block-size must be >= 1, got {args.block_size}")
    addresses = [a.strip() for a in args.workers.split(",") if a.strip()]
    if not addresses and not args.redis:
        raise UserError("name the fleet: --workers host:port,... and/or --redis URL")
    try:
        source = resolve_model(args.model)
        tokenizer = Tokenizer.for_model(source)
        if args.tokenizer_cache_bytes is not None:
            tokenizer.limit_run_cache(args.tokenizer_cache_bytes)
        limits = Limits(
            max_prompt_tokens=args.max_prompt_tokens,
            max_tokens=args.max_tokens,
            max_body_bytes=args.max_body_bytes,
            max_n=args.max_n,
            max_stop=args.max_stop,
            tenant_max_concurrency=args.tenant_max_concurrency,
        )
        retry = RetryPolicy(retries=args.retries)
        auth = Authenticator.from_config(args.api_keys_file)
        policy = make_policy(args.policy, **_routing_options(args.routing_config))
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(str(exc)) from exc
    served = args.served_model_name or args.model
    metrics = GatewayMetrics(served)
    fleet = _fleet_state(args, addresses, fleet_identity(source.model_id, tokenizer, args.block_size))
    request_path = RequestPath(
        fleet,
        policy,
        tokenizer,
        source.model_id,
        served,
        auth,
        limits,
        metrics,
        block_size=args.block_size,
        retry=retry,
        log_prompts=args.log_prompts,
    )
    return Gateway(request_path, fleet, limits.max_body_bytes, limits.max_tokens)


def _routing_options(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        options = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--routing-config {path}: {exc}") from exc
    if not isinstance(options, dict):
        raise ValueError(f"--routing-config {path}: must be a JSON object of policy options")
    return options


def _fleet_state(args: argparse.Namespace, addresses: list[str], identity: Any) -> Any:
    from gateway.embedded_fleet import EmbeddedFleetState, validate_address

    try:
        for address in addresses:
            validate_address(address)
        if args.redis:
            from gateway.redis_fleet import RedisFleetState

            return RedisFleetState(args.redis, identity, fallback_addresses=addresses)
        return EmbeddedFleetState(addresses, identity)
    except ValueError as exc:
        raise UserError(str(exc)) from exc


def run(args: argparse.Namespace) -> int:
    import uvloop

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    gateway = build_gateway(args)
    uvloop.run(serve(gateway, args))
    return 0


def listen_socket(host: str, port: int) -> socket.socket:
    """A bound, listening TCP socket (port 0: a free one), so the real port is known before serving."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP spelled out: asyncio disables Nagle only on sockets whose proto says TCP, and accepted
    # sockets inherit it (with proto 0, keep-alive responses waited ~40 ms for delayed ACKs).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    """uvicorn's Server without its own signal handlers: the process drains on SIGTERM itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class HttpServer:
    """An ASGI app served by uvicorn (httptools) in the running event loop."""

    port: int
    _server: _Server
    task: asyncio.Task[None]

    @classmethod
    def start(cls, app: Any, host: str, port: int) -> HttpServer:
        sock = listen_socket(host, port)
        config = uvicorn.Config(
            app, loop="none", http="httptools", lifespan="off", access_log=False, log_level="warning",
            timeout_graceful_shutdown=5,
        )  # fmt: skip
        server = _Server(config)
        return cls(sock.getsockname()[1], server, asyncio.create_task(server.serve(sockets=[sock])))

    async def stop(self) -> None:
        """Stop listening; open requests get uvicorn's graceful-shutdown timeout."""
        self._server.should_exit = True
        await self.task


async def serve(gateway: Gateway, args: argparse.Namespace) -> None:
    """Start the fleet state and both front doors, print where they listen, and serve until a signal; then
    drain and stop."""
    from gateway import http_server
    from gateway.tracing import setup_tracing

    setup_tracing()
    request_path, fleet = gateway.request_path, gateway.fleet
    await fleet.start()
    app = http_server.build_app(
        request_path,
        request_path.metrics.registry,
        max_body_bytes=gateway.max_body_bytes,
        default_max_tokens=gateway.default_max_tokens,
    )
    http = HttpServer.start(app, args.host, args.http_port)
    grpc_server = None
    if args.grpc_port:
        from gateway.grpc_server import start_grpc_server

        try:
            grpc_server = await start_grpc_server(
                request_path, args.host, args.grpc_port, default_max_tokens=gateway.default_max_tokens
            )
        except (OSError, RuntimeError) as exc:
            await http.stop()
            raise UserError(str(exc)) from exc
    grpc_where = f", gRPC on {args.host}:{grpc_server.port}" if grpc_server else ""
    print(
        f"kvroute gateway: serving {request_path.served_model_name} (policy {request_path.policy.name}) "
        f"on http://{args.host}:{http.port}/v1{grpc_where}; {len(fleet.members())} workers ready",
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await asyncio.wait([asyncio.ensure_future(stop.wait()), http.task], return_when=asyncio.FIRST_COMPLETED)
    print(f"kvroute gateway: draining ({request_path.active} in flight, up to {args.drain_timeout:g} s)", flush=True)
    request_path.start_draining()
    drained = await request_path.wait_drained(args.drain_timeout)
    if not drained:
        logger.warning("drain timeout: %d requests still in flight are cancelled", request_path.active)
    if grpc_server is not None:
        await grpc_server.stop(grace=1.0)
    await http.stop()
    await fleet.stop()
    await request_path.close()
    print("kvroute gateway: stopped", flush=True)
