"""`kvroute gateway`: the OpenAI HTTP and gRPC front doors over one request path and a fleet state.

    kvroute gateway --model smollm2 --workers 10.0.0.1:50051,10.0.0.2:50051      # embedded fleet state
    kvroute gateway --model smollm2 --redis redis://redis:6379 [--workers ...]   # Redis (workers = fallback)
    kvroute gateway --model DIR --workers 'vllm://10.0.0.5:8000?events=tcp://10.0.0.5:5557&replay=tcp://10.0.0.5:5558'
                                                                                  # stock engines (gateway.worker_spec)

Signals:
  SIGTERM / SIGINT  drain: /ready turns 503 and gRPC health NOT_SERVING, new requests get 503 (UNAVAILABLE),
                    requests in flight get `--drain-timeout` seconds to finish; at the deadline each one
                    still open ends with an error (a stream: an error event, then `[DONE]`; gRPC:
                    UNAVAILABLE), and the process exits 0 within --drain-timeout + 2 s of the signal.
  a second one      during the drain: every stream ends with an error at once and the process exits 130.
  SIGHUP            reload --api-keys-file and --routing-config (those given), logging what changed; a file
                    that fails to load keeps what was in force. No stream is touched.
It imports no torch (the gateway image has none) and loads only the tokenizer.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn

from gateway.http_protocol import HttpLimits, raise_open_files_limit
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
    parser.add_argument(
        "--workers",
        default="",
        help="worker specs, comma-separated: host:port (kvroute gRPC) or vllm:// / sglang:// "
        "host:port?events=tcp://...&replay=tcp://...[&discover=dns] (their OpenAI HTTP servers)",
    )
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
    http = HttpLimits()
    parser.add_argument(
        "--max-header-bytes", type=int, default=http.max_header_bytes, help="request line + headers; past it 431"
    )
    parser.add_argument("--max-headers", type=int, default=http.max_headers, help="headers per request; past it 431")
    parser.add_argument(
        "--header-timeout", type=float, default=http.header_timeout, help="seconds for a request's head (408 after)"
    )
    parser.add_argument(
        "--keep-alive-timeout", type=float, default=http.keep_alive_timeout,
        help="seconds an idle keep-alive connection is kept; above the load balancer's idle timeout",
    )  # fmt: skip
    parser.add_argument(
        "--max-connections", type=int, default=http.max_connections, help="HTTP connections per process; past it 503"
    )
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    parser.add_argument(
        "--worker-token-file",
        default=None,
        help="the token presented to the workers (default: $KVROUTE_WORKER_TOKEN_FILE, else $KVROUTE_WORKER_TOKEN)",
    )
    parser.add_argument(
        "--allow-derived-salt",
        action="store_true",
        help="accept API keys without $KVROUTE_CACHE_SALT_SECRET_FILE: tenants' salts then derive from their names",
    )
    parser.add_argument(
        "--first-token-timeout",
        type=float,
        default=10.0,
        help="seconds a request waits for its worker's first token before, if the worker has stopped answering "
        "the fleet state, it is retried elsewhere (a worker that answers gets 10x)",
    )
    parser.add_argument(
        "--inter-token-timeout",
        type=float,
        default=5.0,
        help="seconds a stream waits for its worker's next token before, if the worker has stopped answering "
        "the fleet state, it ends with an error event (a worker that answers gets 10x)",
    )
    parser.add_argument("--log-prompts", action="store_true", help="log prompt text (never logged otherwise)")
    parser.add_argument(
        "--metrics-port", type=int, default=9091, help="Prometheus /metrics port, apart from the API (0: off)"
    )
    parser.add_argument("--metrics-host", default=None, help="metrics listen address (default: --host)")
    parser.add_argument(
        "--metrics-tenant-labels", action="store_true", help="name tenants in metric labels (default: opaque ids)"
    )
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


@dataclass
class Gateway:
    """A built (not yet started) gateway: its request path and fleet state, and the front doors' settings."""

    request_path: Any  # gateway.request_path.RequestPath
    fleet: Any  # gateway.fleet_state.FleetState
    max_body_bytes: int
    default_max_tokens: int
    http_limits: HttpLimits


def build_gateway(args: argparse.Namespace) -> Gateway:
    """Everything `kvroute gateway` serves, from its parsed flags. Raises UserError with one line."""
    from gateway.auth import Authenticator
    from gateway.backends import HttpBackend
    from gateway.limits import Limits
    from gateway.metrics import GatewayMetrics
    from gateway.request_path import RequestPath, fleet_identity
    from gateway.retry import RetryPolicy, StreamDeadlines
    from gateway.router import make_policy
    from gateway.worker_client import WorkerClients
    from kvroute.credentials import worker_token
    from kvroute.model_source import resolve_model
    from kvroute.tokenizer import Tokenizer

    for flag in ("http_port", "grpc_port", "metrics_port"):
        if not 0 <= getattr(args, flag) < 65536:
            raise UserError(f"--{flag.replace('_', '-')} must be in [0, 65536), got {getattr(args, flag)}")
    if args.block_size < 1:
        raise UserError(f"--block-size must be >= 1, got {args.block_size}")
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
        http_limits = HttpLimits(
            max_header_bytes=args.max_header_bytes,
            max_headers=args.max_headers,
            header_timeout=args.header_timeout,
            keep_alive_timeout=args.keep_alive_timeout,
            max_connections=args.max_connections,
        )
        deadlines = StreamDeadlines(args.first_token_timeout, args.inter_token_timeout)
        auth = Authenticator.from_config(args.api_keys_file, allow_derived_salt=args.allow_derived_salt)
        token = worker_token(args.worker_token_file, "--worker-token-file")
        options = _routing_options(args.routing_config)
        specs = _worker_specs(args.workers, options.pop("workers", []))
        engine_options = _engine_options(options)
        policy = make_policy(args.policy, **options)
    except (ValueError, FileNotFoundError) as exc:
        raise UserError(str(exc)) from exc
    if not specs and not args.redis:
        raise UserError("name the fleet: --workers host:port,... and/or --redis URL")
    served = args.served_model_name or args.model
    metrics = GatewayMetrics(served, tenant_labels=args.metrics_tenant_labels)
    identity = fleet_identity(source.model_id, tokenizer, args.block_size)
    fleet = _fleet_state(args, specs, identity, tokenizer, token, engine_options)
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
        clients=WorkerClients(token),
        http_backend=HttpBackend(engine=getattr(fleet, "engine_target", None)),
        deadlines=deadlines,
        log_prompts=args.log_prompts,
    )
    return Gateway(request_path, fleet, limits.max_body_bytes, limits.max_tokens, http_limits)


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


def _worker_specs(flag: str, configured: Any) -> list[Any]:
    """--workers and the routing config's `workers` (a list of specs), as parsed specs."""
    from gateway.worker_spec import parse_worker_specs

    if not isinstance(configured, list) or not all(isinstance(item, str) for item in configured):
        raise ValueError("--routing-config: workers must be a list of worker specs (strings)")
    return parse_worker_specs(",".join([flag, *configured]))


def _engine_options(options: dict[str, Any]) -> Any:
    """The routing config's engine keys (gateway.engine_fleet.EngineOptions.from_routing_config), taken out."""
    from gateway.engine_fleet import EngineOptions

    return EngineOptions.from_routing_config(options)


def _fleet_state(
    args: argparse.Namespace, specs: list[Any], identity: Any, tokenizer: Any, token: str | None, engine: Any
) -> Any:
    from gateway.embedded_fleet import EmbeddedFleetState, validate_address
    from kvroute.credentials import redis_password

    addresses = [spec.address for spec in specs]
    if any(spec.engine != "kvroute" for spec in specs):
        if args.redis:
            raise UserError("--redis takes kvroute workers only (host:port); vllm:// and sglang:// workers are read "
                            "directly: leave out --redis")  # fmt: skip
        from gateway.engine_fleet import EngineFleetState

        try:
            return EngineFleetState(specs, identity, tokenizer, options=engine, token=token)
        except ValueError as exc:
            raise UserError(str(exc)) from exc
    try:
        for address in addresses:
            validate_address(address)
        if args.redis:
            from gateway.redis_fleet import RedisFleetState

            return RedisFleetState(
                args.redis, identity, fallback_addresses=addresses, password=redis_password(), worker_token=token
            )
        return EmbeddedFleetState(addresses, identity, token=token)
    except ValueError as exc:
        raise UserError(str(exc)) from exc


# The event loop shares the GIL with the prompt pool's threads (template, tokenizer): a thread that holds it is
# asked to hand it over after this long. Python's default, 5 ms, lets one big prompt's templating add up to a
# few hand-overs of 5 ms to every other client's request; 0.5 ms keeps /health's p99 under 20 ms while clients
# send multi-megabyte prompts (docs/gateway.md, "Big prompts"), at no cost while nothing contends.
GIL_SWITCH_INTERVAL_S = 0.0005


def run(args: argparse.Namespace) -> int:
    import uvloop

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    gateway = build_gateway(args)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    return uvloop.run(serve(gateway, args))


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
    def start(cls, app: Any, host: str, port: int, limits: HttpLimits | None = None) -> HttpServer:
        """Serve `app` on host:port (0: a free one) under `limits` (gateway.http_protocol; default: its
        defaults). No WebSocket upgrade (the API has none) and no `server` header."""
        limits = limits or HttpLimits()
        raise_open_files_limit(limits.max_connections)
        sock = listen_socket(host, port)
        config = uvicorn.Config(
            app, loop="none", http=limits.protocol_factory(), ws="none", lifespan="off", access_log=False,
            log_level="warning", timeout_graceful_shutdown=5, timeout_keep_alive=limits.keep_alive_timeout,
            server_header=False,
        )  # fmt: skip
        server = _Server(config)
        return cls(sock.getsockname()[1], server, asyncio.create_task(server.serve(sockets=[sock])))

    def force_exit(self) -> None:
        """Make the next `stop` close open connections without waiting for their responses to end."""
        self._server.force_exit = True

    async def stop(self) -> None:
        """Stop listening; open requests get uvicorn's graceful-shutdown timeout."""
        self._server.should_exit = True
        await self.task


async def serve(gateway: Gateway, args: argparse.Namespace) -> int:
    """Start the fleet state and both front doors, print where they listen, and serve until a signal; then
    drain and stop as the module docstring says. Returns the exit code: 0 after a drain, 130 after a second
    signal."""
    from gateway import http_server
    from gateway.metrics import metrics_app
    from kvroute.tracing import flush_tracing, setup_tracing

    setup_tracing("kvroute-gateway")
    request_path, fleet = gateway.request_path, gateway.fleet
    metrics_host = args.host if args.metrics_host is None else args.metrics_host
    metrics_http = (
        HttpServer.start(metrics_app(request_path.metrics), metrics_host, args.metrics_port)
        if args.metrics_port
        else None
    )
    await fleet.start()
    app = http_server.build_app(
        request_path, max_body_bytes=gateway.max_body_bytes, default_max_tokens=gateway.default_max_tokens
    )
    http = HttpServer.start(app, args.host, args.http_port, gateway.http_limits)
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
    metrics_where = f", metrics on http://{metrics_host}:{metrics_http.port}/metrics" if metrics_http else ""
    print(
        f"kvroute gateway: serving {request_path.served_model_name} (policy {request_path.policy.name}) "
        f"on http://{args.host}:{http.port}/v1{grpc_where}{metrics_where}; {len(fleet.members())} workers ready",
        flush=True,
    )
    signals: asyncio.Queue[signal.Signals] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    loop.add_signal_handler(signal.SIGHUP, reload, gateway, args)
    first_signal = asyncio.ensure_future(signals.get())
    await asyncio.wait([first_signal, http.task], return_when=asyncio.FIRST_COMPLETED)
    print(
        f"kvroute gateway: draining ({request_path.active} in flight, up to {args.drain_timeout:g} s; "
        "a second signal stops at once)",
        flush=True,
    )
    request_path.start_draining()
    drain = asyncio.ensure_future(_drain(request_path, args.drain_timeout))
    second_signal = asyncio.ensure_future(signals.get())
    await asyncio.wait({drain, second_signal}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if drain.done():
        second_signal.cancel()
        cut = drain.result()
    else:
        drain.cancel()
        print("kvroute gateway: second signal; stopping without draining", flush=True)
        request_path.end_streams("the gateway is stopping now (a second signal during its drain)")
        await request_path.wait_drained(END_MARGIN_S)
        cut, code = True, 130
    if cut:  # every stream had its error event; a client that reads none of it does not hold the exit
        http.force_exit()
    if grpc_server is not None:
        await grpc_server.stop(grace=0 if code else 1.0)
    await http.stop()
    if metrics_http is not None:
        await metrics_http.stop()
    await fleet.stop()
    await request_path.close()
    flush_tracing()
    print("kvroute gateway: stopped", flush=True)
    return code


# Seconds the front doors get, once every stream was ended, to write their error events and `[DONE]`.
END_MARGIN_S = 0.5


async def _drain(request_path: Any, timeout: float) -> bool:
    """Wait up to `timeout` for the requests in flight; then end those still open with an error event.
    Returns whether it had to."""
    if await request_path.wait_drained(timeout):
        return False
    left = request_path.end_streams(f"the gateway is shutting down: its drain timeout ({timeout:g} s) passed")
    logger.warning("drain timeout: the %d requests still in flight end with an error", left)
    await request_path.wait_drained(END_MARGIN_S)
    return True


def reload(gateway: Gateway, args: argparse.Namespace) -> None:
    """SIGHUP: re-read --api-keys-file and --routing-config (those the gateway was started with) and log what
    changed. A file that fails to load is logged and what was in force stays. Requests in flight keep the
    tenant they were admitted as; a new routing policy starts with no memory (its sketch, guard and turn)."""
    from gateway.auth import Authenticator
    from gateway.router import make_policy

    request_path = gateway.request_path
    if not args.api_keys_file and not args.routing_config:
        logger.warning("SIGHUP: nothing to reload (no --api-keys-file, no --routing-config)")
        return
    if args.api_keys_file:
        try:
            auth = Authenticator.from_config(args.api_keys_file, allow_derived_salt=args.allow_derived_salt)
        except (ValueError, OSError) as exc:
            logger.error("SIGHUP: kept the API keys in force: %s", exc)
        else:
            before = {t.name: t.max_concurrency for t in request_path.auth.tenants}
            after = {t.name: t.max_concurrency for t in auth.tenants}
            request_path.auth = auth
            logger.warning(
                "SIGHUP: API keys reloaded from %s: %d tenants; added %s, removed %s, limits changed %s",
                args.api_keys_file, len(after), sorted(after.keys() - before.keys()) or "none",
                sorted(before.keys() - after.keys()) or "none",
                sorted(t for t in after.keys() & before.keys() if after[t] != before[t]) or "none",
            )  # fmt: skip
    if args.routing_config:
        try:
            options = _routing_options(args.routing_config)
            if options.pop("workers", None) is not None:
                logger.warning("SIGHUP: the routing config's workers are read at start only; restart to change them")
            if options.pop("medium_weights", None) is not None:
                logger.warning("SIGHUP: the routing config's medium_weights are read at start only")
            policy = make_policy(args.policy, **options)
        except (ValueError, TypeError) as exc:
            logger.error("SIGHUP: kept the routing config in force: %s", exc)
        else:
            old, new = dataclasses.asdict(request_path.policy.options), dataclasses.asdict(policy.options)
            changed = {k: f"{old[k]} -> {new[k]}" for k in new if old[k] != new[k]}
            if changed:
                request_path.policy = policy
                logger.warning("SIGHUP: routing config reloaded from %s: %s", args.routing_config, changed)
            else:
                logger.warning("SIGHUP: routing config %s unchanged", args.routing_config)
