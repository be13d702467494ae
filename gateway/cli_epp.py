"""`kvroute epp`: the endpoint picker of a Gateway API InferencePool (Envoy ext_proc over gRPC), with the
gateway's model, fleet, policy and limit flags (docs/epp.md).

    kvroute epp --model smollm2 --workers 10.0.0.1:50051,10.0.0.2:50051 --target-port 8000 --port 9002
    kvroute epp --model smollm2 --redis redis://redis:6379 --target-port 8000

One gRPC port serves `envoy.service.ext_proc.v3.ExternalProcessor` and `grpc.health.v1.Health` under the
names `liveness` (SERVING while the process answers), `readiness` and the ext_proc service's own name
(SERVING while the fleet view has a worker with an endpoint). Envoy dials the workers' HTTP ports: `--target-port`
(the InferencePool's targetPort, on each worker's advertised host) or `--endpoints WORKER=IP:PORT,...`.
Several models: `--routing-config` with `pools` (gateway.cli_gateway.pool_configs), the request's model picking
the pool.

SIGTERM / SIGINT: health NOT_SERVING at once (readiness and the ext_proc name) while the picker goes on deciding
for `--drain-delay` seconds, so that a data plane that health-checks its pickers moves new streams to another
replica first; then it stops taking streams and those in flight get `--drain-timeout` seconds to finish. A
second signal skips the delay.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from contextlib import suppress
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2

from gateway import cli_gateway
from gateway.frontdoors.ext_proc import EndpointMap, ExternalProcessor, Picker
from gateway.frontdoors.grpc_health import ReadinessHealth
from kvroute.errors import UserError
from kvroute.grpc_options import SERVER_OPTIONS, grpc_address
from kvroute.heap import freeze_start_up_heap

logger = logging.getLogger("kvroute.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_INTERVAL_S = 0.5
# The gateway's front-door flags that mean nothing here: accepted (one parser for both), hidden from --help.
_FRONT_DOOR_FLAGS = (
    "--http-port", "--grpc-port", "--max-header-bytes", "--max-headers", "--header-timeout", "--keep-alive-timeout",
    "--max-connections", "--retries", "--first-token-timeout", "--inter-token-timeout",
)  # fmt: skip


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli_gateway.add_arguments(parser)
    for action in parser._actions:
        if any(flag in _FRONT_DOOR_FLAGS for flag in action.option_strings):
            action.help = argparse.SUPPRESS
    parser.set_defaults(http_port=0, grpc_port=0)
    parser.add_argument("--port", type=int, default=9002, help="ext_proc + health gRPC port (0: a free one)")
    parser.add_argument(
        "--target-port",
        type=int,
        default=None,
        help="the workers' HTTP port Envoy dials (an InferencePool's targetPort)",
    )
    parser.add_argument(
        "--max-endpoints", type=int, default=0,
        help="endpoints in the envoy.lb metadata's list, the chosen one first (0: all eligible); the "
        "x-gateway-destination-endpoint header names the chosen one alone",
    )  # fmt: skip
    parser.add_argument(
        "--endpoints", default="", help="WORKER=IP:PORT,...: a worker's (id or gRPC address) HTTP endpoint, explicitly"
    )
    parser.add_argument(
        "--drain-delay", type=float, default=2.0,
        help="seconds a signalled picker keeps deciding while its health says NOT_SERVING (above the data "
        "plane's health-check interval), before it stops taking streams",
    )  # fmt: skip


@dataclass
class EndpointPicker:
    """A started picker: its gRPC server (ext_proc + health) and the port it listens on."""

    server: grpc.aio.Server
    port: int
    health: ReadinessHealth  # readiness and ext_proc's service; liveness stays SERVING until the stop
    picker: Picker

    async def going_away(self) -> None:
        """Readiness NOT_SERVING from here, whatever the fleet (the drain: Envoy leaves, decisions go on)."""
        await self.health.hold(False)

    async def stop(self, grace: float) -> None:
        """Every service NOT_SERVING at once, then stop; streams in flight get `grace` seconds."""
        await self.health.stop()
        await self.server.stop(grace)


def build_picker(args: argparse.Namespace) -> Picker:
    """The picker over the gateway's request path and fleet state, from the parsed flags. Raises UserError."""
    if not 0 <= args.port < 65536:
        raise UserError(f"--port must be in [0, 65536), got {args.port}")
    try:
        endpoints = EndpointMap.parse(args.endpoints, args.target_port)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    if args.max_endpoints < 0:
        raise UserError(f"--max-endpoints must be >= 0, got {args.max_endpoints}")
    if args.drain_delay < 0:
        raise UserError(f"--drain-delay must be >= 0, got {args.drain_delay}")
    gateway = cli_gateway.build_gateway(args)
    # an engine fleet's kvroute workers, if any
    grpc_workers = any(getattr(fleet, "grpc_pollers", True) for fleet in gateway.fleets)
    if grpc_workers and not endpoints.explicit and endpoints.target_port is None:
        raise UserError(
            "say where Envoy dials the kvroute workers: --target-port PORT and/or --endpoints WORKER=IP:PORT,... "
            "(vllm:// and sglang:// workers are dialled at their own address)"
        )
    return Picker(
        gateway.request_path,
        endpoints,
        max_body_bytes=gateway.max_body_bytes,
        default_max_tokens=gateway.default_max_tokens,
        max_endpoints=args.max_endpoints,
    )


async def start_picker(picker: Picker, host: str, port: int) -> EndpointPicker:
    """Serve ext_proc and health on host:port (0: a free one). The fleet state must be started."""
    # the data plane pings its connection to the picker every health interval, to find a hung one (docs/epp.md,
    # "A picker that hangs or dies"): accepted at any rate, never answered with GOAWAY "too_many_pings"
    server = grpc.aio.server(options=SERVER_OPTIONS)
    from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc

    ext_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(picker), server)
    health = ReadinessHealth(
        server, ("", "readiness", EXT_PROC_SERVICE), ready=picker.ready, interval_s=HEALTH_INTERVAL_S,
        label="epp readiness", not_ready="no worker with an endpoint",
    )  # fmt: skip
    bound = server.add_insecure_port(grpc_address(host, port))
    if bound == 0:
        raise UserError(f"cannot listen on {grpc_address(host, port)}")
    await server.start()
    await health.servicer.set("liveness", health_pb2.HealthCheckResponse.SERVING)
    await health.start()
    return EndpointPicker(server, bound, health, picker)


def run(args: argparse.Namespace) -> int:
    import uvloop

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    picker = build_picker(args)
    sys.setswitchinterval(cli_gateway.GIL_SWITCH_INTERVAL_S)  # as the gateway does, for the same reasons
    freeze_start_up_heap()
    return uvloop.run(serve(picker, args))


async def serve(picker: Picker, args: argparse.Namespace) -> int:
    """Start the fleet states, the metrics port and the picker; serve until a signal, then drain as the
    module docstring says."""
    from gateway.frontdoors.metrics_port import metrics_app
    from kvroute.tracing import flush_tracing, setup_tracing

    setup_tracing("kvroute-epp")
    pools = picker.pools
    metrics_host = args.host if args.metrics_host is None else args.metrics_host
    metrics_http = (
        cli_gateway.HttpServer.start(metrics_app(pools.metrics), metrics_host, args.metrics_port)
        if args.metrics_port
        else None
    )
    for path in pools.pools():
        await path.fleet.start()
    epp = await start_picker(picker, args.host, args.port)
    metrics_where = f", metrics on http://{metrics_host}:{metrics_http.port}/metrics" if metrics_http else ""
    print(
        f"kvroute epp: picking for {cli_gateway.describe_pools(pools)} on "
        f"{grpc_address(args.host, epp.port)}{metrics_where}; {len(pools.members())} workers ready",
        flush=True,
    )
    signals: asyncio.Queue[signal.Signals] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    await signals.get()
    await epp.going_away()
    print(f"kvroute epp: NOT_SERVING; deciding for {args.drain_delay:g} s more (a second signal skips it)", flush=True)
    with suppress(TimeoutError):
        async with asyncio.timeout(args.drain_delay):
            await signals.get()
    print(f"kvroute epp: draining ({pools.active} in flight, up to {args.drain_timeout:g} s)", flush=True)
    pools.start_draining()
    await epp.stop(args.drain_timeout)
    if metrics_http is not None:
        await metrics_http.stop()
    for path in pools.pools():
        await path.fleet.stop()
    await pools.close()
    flush_tracing()
    print("kvroute epp: stopped", flush=True)
    return 0
