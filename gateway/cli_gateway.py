"""`kvroute gateway`: the OpenAI HTTP and gRPC front doors over one request path and a fleet state.

    kvroute gateway --model smollm2 --workers 10.0.0.1:50051,10.0.0.2:50051      # embedded fleet state
    kvroute gateway --model smollm2 --redis redis://redis:6379 [--workers ...]   # Redis (workers = fallback)
    kvroute gateway --model DIR --workers 'vllm://10.0.0.5:8000?events=tcp://10.0.0.5:5557&replay=tcp://10.0.0.5:5558'
                                                                                  # stock engines (gateway.worker_spec)
    kvroute gateway --routing-config pools.json     # several models: {"pools": [{"model", "served_model_name",
                                                    #   "workers", "block_size", "policy", "options"}, ...]}
                                                    # (pool_configs; docs/gateway.md, "Several models")

Signals:
  SIGTERM / SIGINT  drain: /ready turns 503 and gRPC health NOT_SERVING, new requests get 503 (UNAVAILABLE),
                    requests in flight get `--drain-timeout` seconds to finish; at the deadline each one
                    still open ends with an error (a stream: an error event, then `[DONE]`; gRPC:
                    UNAVAILABLE), and the process exits 0 within --drain-timeout + 2 s of the signal.
  a second one      during the drain: every stream ends with an error at once and the process exits 130.
  SIGHUP            reload --api-keys-file and --routing-config (those given), logging what changed; a file
                    that fails to load keeps what was in force. No stream is touched.

`--processes N` (N > 1) runs N gateway processes on one HTTP port (SO_REUSEPORT: the kernel spreads the
connections) and one gRPC port (grpc's own SO_REUSEPORT), each with its own fleet state; process i serves
metrics on --metrics-port + i. The first process, their parent, serves nothing: it passes SIGTERM, SIGINT
(as SIGTERM) and SIGHUP to every child, and when one child exits by itself it drains the others. It exits
with the first nonzero code of its children, else 0.
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
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gateway.frontdoors.http_listener import HttpServer, bound_socket
from gateway.frontdoors.http_protocol import HttpLimits
from gateway.responses.store import StoreLimits
from gateway.routing.router import POLICY_NAMES
from kvroute.errors import UserError
from kvroute.heap import freeze_start_up_heap

logger = logging.getLogger("kvroute.gateway")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from gateway.admission.limits import Limits

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
        "--routing-config",
        default=None,
        help="JSON file of policy options (epsilon, queue_limit, ...), `workers`, or `pools` (one per served model)",
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block; must equal the workers'")
    parser.add_argument(
        "--api-keys-file", default=None, help='JSON [{"tenant", "key_sha256", "max_concurrency"}]; or $KVROUTE_API_KEYS'
    )
    parser.add_argument("--max-prompt-tokens", type=int, default=limits.max_prompt_tokens)
    parser.add_argument(
        "--max-tokens", type=int, default=limits.max_tokens, help="largest max_tokens; a chat's default"
    )
    parser.add_argument(
        "--max-body-bytes", type=int, default=limits.max_body_bytes,
        help="a request's body (HTTP: 413 past it) or message (gRPC: RESOURCE_EXHAUSTED), refused before parsing",
    )  # fmt: skip
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
        "--max-connections",
        type=int,
        default=http.max_connections,
        help="connections per process and door: HTTP's past it get 503, gRPC's are closed",
    )
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight requests get on SIGTERM")
    parser.add_argument(
        "--flow-control", choices=("on", "off"), default="on",
        help="on: requests wait in the gateway, by priority and tenant fair share, until a worker can admit them "
        "(the routing config's flow_control; docs/flow_control.md); off: each is sent at once",
    )  # fmt: skip
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="gateway processes sharing the ports (SO_REUSEPORT), one fleet view each",
    )
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
    store = StoreLimits()
    parser.add_argument(
        "--responses-ttl", type=float, default=store.ttl_s,
        help="seconds a stored /v1/responses response is kept (30 days); in Redis with --redis, else in memory",
    )  # fmt: skip
    parser.add_argument(
        "--responses-max-bytes", type=int, default=store.max_response_bytes,
        help="a stored response's bytes (its whole conversation); a bigger one is served and not stored",
    )  # fmt: skip
    parser.add_argument(
        "--responses-tenant-bytes", type=int, default=store.max_tenant_bytes,
        help="a tenant's stored responses, in bytes; its oldest go to make room",
    )  # fmt: skip
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
    """A built (not yet started) gateway: its pools (one request path and fleet state per served model) and
    the front doors' settings."""

    request_path: Any  # gateway.pools.Pools: what the front doors call
    fleets: list[Any]  # gateway.fleet.fleet_state.FleetState, one per pool
    max_body_bytes: int
    default_max_tokens: int
    http_limits: HttpLimits
    pool_configs: list[PoolConfig]  # as read at start (SIGHUP's reload compares against them)


@dataclass(frozen=True)
class PoolConfig:
    """One served model: the tokenizer/model source (`--model`'s forms), the name clients send as `model` (and
    its aliases), its worker specs (gateway.worker_spec), block size, routing policy, the policy's options,
    and the engine backends' options (`medium_weights`, gateway.fleet.engine_fleet.EngineOptions; read at
    start only)."""

    model: str
    served_model_name: str
    workers: tuple[str, ...]
    block_size: int
    policy: str
    options: dict[str, Any]
    aliases: tuple[str, ...] = ()
    engine: Any = None
    flow_control: Any = None  # gateway.flow_control.config.FlowControlConfig (the config's `flow_control`)


POOL_KEYS = ("model", "served_model_name", "workers", "block_size", "policy", "options")


def pool_configs(args: argparse.Namespace, config: dict[str, Any]) -> list[PoolConfig]:
    """The pools the flags and the routing config (a JSON object, `_routing_options`) describe. Raises
    ValueError naming the bad field.

    Without `pools`: one pool, from --model, --served-model-name, --workers plus the config's `workers`,
    --block-size and --policy, with the config's other keys as the policy's options. With `pools` (a list of
    objects with the keys of POOL_KEYS): one pool each; `model` is required; `served_model_name`, a name or a
    list of names (as vLLM's flag takes them; responses carry the first), defaults to it; `workers` is a list
    of specs (empty only for a lone pool over --redis); `block_size` and `policy` default to the flags; each
    pool's `options` are laid over the config's top-level policy options. With `pools`, the workers are the
    pools' own: --workers, --served-model-name and a top-level `workers` are refused."""
    options = dict(config)
    pools = options.pop("pools", None)
    workers = options.pop("workers", [])
    if not isinstance(workers, list) or not all(isinstance(item, str) for item in workers):
        raise ValueError("--routing-config: workers must be a list of worker specs (strings)")
    if pools is None:
        served = args.served_model_name or args.model
        listed = tuple(filter(None, (part.strip() for part in ",".join([args.workers, *workers]).split(","))))
        engine = _engine_options(options)
        flow = _flow_control(options)
        return [
            PoolConfig(
                args.model, served, listed, args.block_size, args.policy, options, engine=engine, flow_control=flow
            )
        ]
    if args.workers or workers or args.served_model_name:
        raise ValueError(
            "--routing-config: with `pools`, each pool names its workers and served_model_name "
            "(leave out --workers, --served-model-name and a top-level `workers`)"
        )
    if not isinstance(pools, list) or not pools:
        raise ValueError("--routing-config: pools must be a non-empty list of objects")
    configs = []
    for i, pool in enumerate(pools):
        where = f"--routing-config: pools[{i}]"
        if not isinstance(pool, dict):
            raise ValueError(f"{where} must be an object with keys {', '.join(POOL_KEYS)}")
        unknown = sorted(set(pool) - set(POOL_KEYS))
        if unknown:
            raise ValueError(f"{where} has the unknown key {unknown[0]!r}; choose from {', '.join(POOL_KEYS)}")
        model = pool.get("model")
        served = pool.get("served_model_name", model)
        names: list[Any] = served if isinstance(served, list) else [served]
        if not isinstance(model, str) or not model or not names or not all(isinstance(n, str) and n for n in names):
            raise ValueError(f"{where}: model and served_model_name (a name or a list of names) must be non-empty")
        specs = pool.get("workers", [])
        if not isinstance(specs, list) or not all(isinstance(item, str) for item in specs):
            raise ValueError(f"{where}: workers must be a list of worker specs (strings)")
        if not specs and not (args.redis and len(pools) == 1):
            raise ValueError(f"{where}: workers must name the pool's workers (only a lone pool may read --redis)")
        block_size = pool.get("block_size", args.block_size)
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
            raise ValueError(f"{where}: block_size must be an integer >= 1")
        policy = pool.get("policy", args.policy)
        if policy not in POLICY_NAMES:
            raise ValueError(f"{where}: unknown routing policy {policy!r}; choose from {', '.join(POLICY_NAMES)}")
        own = pool.get("options", {})
        if not isinstance(own, dict):
            raise ValueError(f"{where}: options must be an object of policy options")
        options_of_pool = {**options, **own}
        engine = _engine_options(options_of_pool)
        flow = _flow_control(options_of_pool)
        configs.append(
            PoolConfig(
                model, names[0], tuple(specs), block_size, policy, options_of_pool, tuple(names[1:]), engine, flow
            )
        )
    return configs


def build_gateway(args: argparse.Namespace) -> Gateway:
    """Everything `kvroute gateway` serves, from its parsed flags and routing config (`pool_configs`): one
    request path per pool, sharing the Authenticator, the tenants' concurrency, the worker channels and the
    metrics registry. Raises UserError with one line."""
    from gateway.admission.auth import Authenticator
    from gateway.admission.limits import Limits, TenantConcurrency
    from gateway.forwarding.backends import HttpBackend
    from gateway.forwarding.retry import RetryPolicy, StreamDeadlines
    from gateway.metrics import GatewayMetrics
    from gateway.pools import Pools, check_one_worker_once
    from gateway.request_path import RequestPath, fleet_identity
    from gateway.routing.router import make_policy
    from gateway.worker_client import WorkerClients
    from gateway.worker_spec import check_engine_ids, parse_worker_specs
    from kvroute.credentials import worker_token
    from kvroute.model_source import resolve_model
    from kvroute.tokenizer import Tokenizer

    for flag in ("http_port", "grpc_port", "metrics_port"):
        if not 0 <= getattr(args, flag) < 65536:
            raise UserError(f"--{flag.replace('_', '-')} must be in [0, 65536), got {getattr(args, flag)}")
    if args.block_size < 1:
        raise UserError(f"--block-size must be >= 1, got {args.block_size}")
    try:
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
        configs = pool_configs(args, _routing_options(args.routing_config))
        policies = [make_policy(config.policy, **config.options) for config in configs]
        specs = [parse_worker_specs(",".join(config.workers)) for config in configs]
        check_one_worker_once(specs)
        check_engine_ids([spec for pool_specs in specs for spec in pool_specs])
        tokenizers: dict[str, tuple[Any, Any]] = {}  # --model form -> (source, tokenizer), one per model
        for config in configs:
            if config.model not in tokenizers:
                source = resolve_model(config.model)
                tokenizer = Tokenizer.for_model(source)
                if args.tokenizer_cache_bytes is not None:
                    tokenizer.limit_run_cache(args.tokenizer_cache_bytes)
                tokenizers[config.model] = (source, tokenizer)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        raise UserError(str(exc)) from exc
    if args.redis and len(configs) > 1:
        raise UserError("--redis holds one model's workers: with several pools, list each pool's workers")
    concurrency = TenantConcurrency(limits)
    clients = WorkerClients(token)
    metrics = GatewayMetrics(configs[0].served_model_name, tenant_labels=args.metrics_tenant_labels)
    paths: list[RequestPath] = []
    for config, policy, pool_specs in zip(configs, policies, specs, strict=True):
        if not pool_specs and not args.redis:
            raise UserError("name the fleet: --workers host:port,... and/or --redis URL")
        source, tokenizer = tokenizers[config.model]
        identity = fleet_identity(source.model_id, tokenizer, config.block_size)
        fleet = _fleet_state(args, pool_specs, identity, tokenizer, token, config.engine)
        paths.append(
            RequestPath(
                fleet,
                policy,
                tokenizer,
                source.model_id,
                config.served_model_name,
                auth,
                limits,
                metrics.for_model(config.served_model_name) if paths else metrics,
                block_size=config.block_size,
                retry=retry,
                clients=clients,
                http_backend=HttpBackend(engine=getattr(fleet, "engine_target", None)),
                deadlines=deadlines,
                log_prompts=args.log_prompts,
                concurrency=concurrency,
                aliases=config.aliases,
                flow_control=config.flow_control if args.flow_control == "on" else None,
            )
        )
    try:
        pools = Pools(paths)
    except ValueError as exc:
        raise UserError(f"--routing-config: {exc}") from exc
    fleets = [path.fleet for path in paths]
    return Gateway(pools, fleets, limits.max_body_bytes, limits.max_tokens, http_limits, configs)


def _response_store(args: argparse.Namespace) -> Any:
    """/v1/responses' store: the fleet's Redis with --redis (every gateway continues every conversation),
    else this process's memory (docs/agents.md)."""
    from gateway.responses.store import MemoryResponseStore, RedisResponseStore
    from kvroute.credentials import redis_password
    from kvroute.fleet_keys import redis_client

    try:
        limits = StoreLimits(
            ttl_s=args.responses_ttl, max_response_bytes=args.responses_max_bytes,
            max_tenant_bytes=args.responses_tenant_bytes,
        )  # fmt: skip
        if args.redis:
            return RedisResponseStore(redis_client(args.redis, password=redis_password()), limits)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    if args.processes > 1:
        logger.warning(
            "/v1/responses: %d processes each keep their own stored responses; a conversation continued on "
            "another process's connection gets 404 (give --redis to share them)", args.processes,
        )  # fmt: skip
    return MemoryResponseStore(limits)


def _routing_options(path: str | None) -> dict[str, Any]:
    if path is None:
        return {}
    try:
        options = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--routing-config {path}: {exc}") from exc
    if not isinstance(options, dict):
        raise ValueError(f"--routing-config {path}: must be a JSON object of policy options (and `pools`)")
    return options


def _engine_options(options: dict[str, Any]) -> Any:
    """The routing config's engine keys (gateway.fleet.engine_fleet.EngineOptions.from_routing_config), taken out."""
    from gateway.fleet.engine_fleet import EngineOptions

    return EngineOptions.from_routing_config(options)


def _flow_control(options: dict[str, Any]) -> Any:
    """The routing config's `flow_control` (gateway.flow_control.config.FlowControlConfig), taken out."""
    from gateway.flow_control.config import FlowControlConfig

    return FlowControlConfig.from_routing_config(options)


def _fleet_state(
    args: argparse.Namespace, specs: list[Any], identity: Any, tokenizer: Any, token: str | None, engine: Any
) -> Any:
    from gateway.fleet.embedded_fleet import EmbeddedFleetState, validate_address
    from kvroute.credentials import redis_password

    addresses = [spec.address for spec in specs]
    if any(spec.engine != "kvroute" for spec in specs):
        if args.redis:
            raise UserError("--redis takes kvroute workers only (host:port); vllm:// and sglang:// workers are read "
                            "directly: leave out --redis")  # fmt: skip
        from gateway.fleet.engine_fleet import EngineFleetState

        try:
            return EngineFleetState(specs, identity, tokenizer, options=engine, token=token)
        except ValueError as exc:
            raise UserError(str(exc)) from exc
    try:
        for address in addresses:
            validate_address(address)
        fleet: Any
        if args.redis:
            from gateway.fleet.redis_fleet import RedisFleetState

            fleet = RedisFleetState(
                args.redis, identity, fallback_addresses=addresses, password=redis_password(), worker_token=token
            )
        else:
            fleet = EmbeddedFleetState(addresses, identity, token=token)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    fleet.book.set_medium_weights(engine.medium_weights)  # a kvroute worker's host KV tier
    return fleet


# The event loop shares the GIL with the prompt pool's threads (template, tokenizer): a thread that holds it is
# asked to hand it over after this long. Python's default, 5 ms, lets one big prompt's templating add up to a
# few hand-overs of 5 ms to every other client's request; 0.5 ms keeps /health's p99 under 20 ms while clients
# send multi-megabyte prompts (docs/gateway.md, "Big prompts"), at no cost while nothing contends.
GIL_SWITCH_INTERVAL_S = 0.0005


def run(args: argparse.Namespace) -> int:
    if args.processes < 1:
        raise UserError(f"--processes must be at least 1, got {args.processes}")
    if args.processes > 1:
        return run_group(args)
    return run_one(args)


def run_one(args: argparse.Namespace) -> int:
    import uvloop

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    gateway = build_gateway(args)
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    freeze_start_up_heap()
    return uvloop.run(serve(gateway, args))


def run_group(args: argparse.Namespace) -> int:
    """`--processes N`: fork N gateways onto one port (module docstring). The parent holds the port bound,
    not listening (so port 0 names one port for all, and no connection waits in its queue), before any
    gRPC or event loop exists in it."""
    import os

    reserved = bound_socket(args.host, args.http_port, reuse_port=True)
    args.http_port = reserved.getsockname()[1]
    children: list[int] = []
    stopping = False

    def forward(sig: int, frame: Any) -> None:
        nonlocal stopping
        stopping = stopping or sig != signal.SIGHUP
        for child in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGHUP if sig == signal.SIGHUP else signal.SIGTERM)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, forward)
    for i in range(args.processes):
        pid = os.fork()
        if pid == 0:
            reserved.close()
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent passes it on as SIGTERM
            signal.signal(signal.SIGHUP, signal.SIG_IGN)  # until serve() listens for it
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if args.metrics_port:
                args.metrics_port += i
            code = 1
            try:
                code = run_one(args)
            except UserError as exc:
                print(f"kvroute gateway: {exc}", file=sys.stderr, flush=True)
                code = 2
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        children.append(pid)
    codes: list[int] = []
    running = set(children)
    while running:
        pid, status = os.wait()
        running.discard(pid)
        codes.append(os.waitstatus_to_exitcode(status))
        if not stopping and running:  # a child ended by itself: the group ends with it
            stopping = True
            for child in running:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGTERM)
    reserved.close()
    return next((code for code in codes if code != 0), 0)


async def serve(gateway: Gateway, args: argparse.Namespace) -> int:
    """Start the fleet state and both front doors, print where they listen, and serve until a signal; then
    drain and stop as the module docstring says. Returns the exit code: 0 after a drain, 130 after a second
    signal."""
    from gateway.frontdoors import http_server
    from gateway.frontdoors.metrics_port import metrics_app
    from gateway.responses.endpoints import ResponsesEndpoints
    from kvroute.tracing import flush_tracing, setup_tracing

    response_store = _response_store(args)  # its flags' errors before anything starts
    setup_tracing("kvroute-gateway")
    request_path, fleets = gateway.request_path, gateway.fleets
    metrics_host = args.host if args.metrics_host is None else args.metrics_host
    metrics_http = (
        HttpServer.start(metrics_app(request_path.metrics), metrics_host, args.metrics_port)
        if args.metrics_port
        else None
    )
    for fleet in fleets:
        await fleet.start()
    responses = ResponsesEndpoints(request_path, response_store, gateway.max_body_bytes, gateway.default_max_tokens)
    app = http_server.build_app(
        request_path, max_body_bytes=gateway.max_body_bytes, default_max_tokens=gateway.default_max_tokens,
        extra_routes=responses.routes(),
    )  # fmt: skip
    in_group = getattr(args, "processes", 1) > 1
    http = HttpServer.start(app, args.host, args.http_port, gateway.http_limits, reuse_port=in_group)
    grpc_server = None
    if args.grpc_port:
        from gateway.frontdoors.grpc_server import start_grpc_server

        try:
            grpc_server = await start_grpc_server(
                request_path, args.host, args.grpc_port, default_max_tokens=gateway.default_max_tokens,
                max_body_bytes=gateway.max_body_bytes, max_connections=gateway.http_limits.max_connections,
            )  # fmt: skip
        except (OSError, RuntimeError) as exc:
            await http.stop()
            raise UserError(str(exc)) from exc
    grpc_where = f", gRPC on {args.host}:{grpc_server.port}" if grpc_server else ""
    metrics_where = f", metrics on http://{metrics_host}:{metrics_http.port}/metrics" if metrics_http else ""
    print(
        f"kvroute gateway: serving {describe_pools(request_path)} "
        f"on http://{args.host}:{http.port}/v1{grpc_where}{metrics_where}; {len(request_path.members())} workers ready",
        flush=True,
    )
    signals: asyncio.Queue[signal.Signals] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM,) if in_group else (signal.SIGINT, signal.SIGTERM):  # a group's parent sends SIGTERM
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
    for fleet in fleets:
        await fleet.stop()
    await response_store.close()
    await request_path.close()
    flush_tracing()
    print("kvroute gateway: stopped", flush=True)
    return code


def describe_pools(pools: Any) -> str:
    """`alpha (policy kv_aware), beta (policy prefix)`: each served model and its policy, for the ready line."""
    return ", ".join(f"{path.served_model_name} (policy {path.policy.name})" for path in pools.pools())


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
    from gateway.admission.auth import Authenticator

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
        _reload_routing(request_path, gateway.pool_configs, args)


def _reload_routing(pools: Any, start_configs: list[PoolConfig], args: argparse.Namespace) -> None:
    """SIGHUP's routing half: each pool (by served model name) takes its new policy or options, logging what
    changed; pools added or removed, and a pool's model, workers or block size, are read at start only
    (logged). A config that fails to parse keeps every pool's policy."""
    from gateway.routing.router import make_policy

    try:
        configs = pool_configs(args, _routing_options(args.routing_config))
        policies = {config.served_model_name: make_policy(config.policy, **config.options) for config in configs}
    except (ValueError, TypeError) as exc:
        logger.error("SIGHUP: kept the routing config in force: %s", exc)
        return
    by_name = {config.served_model_name: config for config in configs}
    start = {config.served_model_name: config for config in start_configs}
    served = {path.served_model_name: path for path in pools.pools()}
    if by_name.keys() != served.keys():
        logger.warning("SIGHUP: pools are read at start only; restart to serve %s instead of %s",
                       sorted(by_name), sorted(served))  # fmt: skip
    for name, path in served.items():
        config = by_name.get(name)
        if config is None:
            continue
        started = start.get(name)
        if started is not None and (config.model, config.workers, config.block_size, config.engine) != (
            started.model,
            started.workers,
            started.block_size,
            started.engine,
        ):
            logger.warning("SIGHUP: %s's model, workers, block size and medium_weights are read at start only; "
                           "restart to change them", name)  # fmt: skip
        if path.flow is not None and path.flow.config != config.flow_control:
            path.flow.reconfigure(config.flow_control)
            logger.warning("SIGHUP: flow control settings reloaded from %s for %s", args.routing_config, name)
        policy = policies[name]
        old, new = dataclasses.asdict(path.policy.options), dataclasses.asdict(policy.options)
        changed = {k: f"{old[k]} -> {new[k]}" for k in new if old[k] != new[k]}
        if policy.name != path.policy.name:
            changed["policy"] = f"{path.policy.name} -> {policy.name}"
        if changed:
            path.policy = policy
            logger.warning("SIGHUP: routing config reloaded from %s for %s: %s", args.routing_config, name, changed)
        else:
            logger.warning("SIGHUP: routing config %s unchanged for %s", args.routing_config, name)
