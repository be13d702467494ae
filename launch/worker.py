"""`kvroute worker`: a worker (worker.cli_worker, every flag of it) and, with `--http-port`, the OpenAI HTTP API for
this one worker in the same process, like `vllm serve`.

    kvroute worker --model smollm2 --port 50051 --http-port 8001

The HTTP side is the gateway's own front door and request path (auth, chat template, tokenizer, stop strings, usage
with cached tokens) over a fleet of one: this worker, its membership and load read over loopback gRPC as a gateway
reads them, its requests handed to its gRPC servicer's `generate` in this process (launch/in_process_backend.py:
the same admission, metrics and spans as a Generate call, without the loopback hop per request and per token). So a
worker answers HTTP exactly as a gateway does, and other routers (smg, vllm-router) can route over kvroute workers'
HTTP ports for a side-by-side comparison. It lives here, not in worker/, because worker/ and gateway/ never import
each other. API keys apply as in the gateway ($KVROUTE_API_KEYS, with $KVROUTE_CACHE_SALT_SECRET_FILE or
`--allow-derived-salt`), and the front door presents the worker's own token (`--auth-token-file`) to it.

So that the worker can stand in a vLLM pool (routed by kvroute's `vllm://` workers, llm-d, Dynamo or a Gateway API
Inference Extension picker), the HTTP port also serves vLLM's `POST /tokenize` and `POST /detokenize` (the
gateway's own, gateway.frontdoors.http_server), vLLM's render endpoints `POST /v1/chat/completions/render` and
`POST /v1/completions/render` (gateway.frontdoors.render_endpoints: the ids a request would be given, which
llm-d's precise prefix scorer and vllm-router's `kv_aware` tokenize through), and `GET /metrics` and
`GET /health` of its own engine (`EngineRoutes`): the engine metrics under vLLM's names (worker.metrics, the
same registry as `--metrics-port`) where vLLM serves them, on its API port, and a /health that turns 503 when
the engine stops serving.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

import uvloop

from kvroute.errors import UserError
from launch.fleet import free_port
from worker import cli_worker

if TYPE_CHECKING:
    from gateway.frontdoors.http_listener import HttpServer
    from gateway.frontdoors.http_protocol import Exchange
    from gateway.frontdoors.http_routes import Reply, Route
    from gateway.request_path import RequestPath
    from launch.in_process_backend import InProcessBackend
    from worker.engine import LLMEngine
    from worker.service import WorkerServer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli_worker.add_arguments(parser)
    parser.add_argument("--http-port", type=int, default=None, help="also serve the OpenAI HTTP API on this port")
    parser.add_argument("--http-host", default=None, help="HTTP listen address (default: --host)")
    parser.add_argument(
        "--allow-derived-salt", action="store_true", help="HTTP: accept API keys without a cache-salt secret"
    )


def run(args: argparse.Namespace) -> int:
    if args.http_port is None:
        return cli_worker.run(args)
    if not 0 <= args.http_port < 65536:
        raise UserError(f"--http-port must be in [0, 65536), got {args.http_port}")
    if args.port == 0:  # the front door must know the gRPC port it dials before the server picks one
        args.port = free_port(args.host)
    engine = cli_worker.build_engine(args)
    return uvloop.run(serve(engine, args))  # as the gateway: its HTTP front door is the same code


async def serve(engine: LLMEngine, args: argparse.Namespace) -> int:
    """The worker's own serve (signals, drain, exit codes), with the HTTP front door beside it."""
    front_door = await start_http_front_door(engine, args)
    try:
        return await cli_worker.serve(engine, args, on_serving=front_door.serve_from)
    finally:
        await front_door.stop()


class EngineRoutes:
    """The front door's view of its own engine, as vLLM's server gives it (`routes`, matched before the
    gateway app's own): `GET /metrics`, the worker's registry in the text format; `GET /health`, 200 while
    the engine serves, 503 before the gRPC server is up, while it drains and once the engine is dead (a
    router probing /health, as kvroute's `vllm://` workers and Kubernetes do, stops sending it requests)."""

    def __init__(self) -> None:
        self.server: WorkerServer | None = None

    def serve_from(self, server: WorkerServer) -> None:
        self.server = server

    def routes(self) -> list[Route]:
        from gateway.frontdoors.http_routes import Route

        return [Route(b"GET", "/metrics", self.metrics), Route(b"GET", "/health", self.health)]

    async def metrics(self, exchange: Exchange) -> Reply:
        from gateway.frontdoors.http_routes import Reply
        from worker.metrics import TEXT_FORMAT

        if self.server is None:
            return Reply(503, {}, b"the worker is not serving yet\n", b"text/plain; charset=utf-8")
        return Reply(200, {}, self.server.metrics.text_format(), TEXT_FORMAT.encode())

    async def health(self, exchange: Exchange) -> Reply:
        import orjson

        from gateway.frontdoors.http_routes import Reply
        from worker.async_engine import Lifecycle

        server = self.server
        if server is None:
            return Reply(503, {}, b'{"status":"starting"}')
        if server.engine.state is Lifecycle.DEAD:
            return Reply(503, {}, orjson.dumps({"status": "dead", "error": server.engine.error}))
        if server.servicer.draining or server.engine.state is not Lifecycle.RUNNING:
            return Reply(503, {}, b'{"status":"draining"}')
        return Reply(200, {}, b'{"status":"ok"}')


@dataclass
class FrontDoor:
    http: HttpServer
    request_path: RequestPath
    engine_routes: EngineRoutes
    backend: InProcessBackend

    def serve_from(self, server: WorkerServer) -> None:
        """The worker serves: its /metrics, /health and requests from here on."""
        self.engine_routes.serve_from(server)
        self.backend.serve_from(server)

    async def stop(self) -> None:
        await self.http.stop()
        await self.request_path.fleet.stop()
        await self.request_path.close()


async def start_http_front_door(engine: LLMEngine, args: argparse.Namespace) -> FrontDoor:
    from gateway.admission.auth import Authenticator
    from gateway.admission.limits import Limits
    from gateway.fleet.embedded_fleet import EmbeddedFleetState
    from gateway.frontdoors import http_server
    from gateway.frontdoors.http_listener import HttpServer
    from gateway.frontdoors.render_endpoints import RenderEndpoints
    from gateway.metrics import GatewayMetrics
    from gateway.request_path import RequestPath, fleet_identity
    from gateway.responses.endpoints import ResponsesEndpoints
    from gateway.responses.store import MemoryResponseStore
    from gateway.routing.router import make_policy
    from launch.in_process_backend import InProcessBackend

    block_size = engine.config.block_size
    identity = fleet_identity(engine.model_id, engine.tokenizer, block_size)
    token = cli_worker.auth_token(args)
    fleet = EmbeddedFleetState([f"{dial_host(args.host)}:{args.port}"], identity, token=token)
    limits = Limits()
    try:
        auth = Authenticator.from_config(None, allow_derived_salt=args.allow_derived_salt)
    except ValueError as exc:
        raise UserError(str(exc)) from exc
    backend = InProcessBackend()
    request_path = RequestPath(
        fleet, make_policy("round_robin"), engine.tokenizer, engine.model_id, args.model, auth, limits,
        GatewayMetrics(args.model), block_size=block_size, kvroute_backend=backend,
    )  # fmt: skip
    await fleet.start()  # the worker is not serving yet: its poller keeps trying, /ready says 503 until it is
    engine_routes = EngineRoutes()
    render = RenderEndpoints(request_path, limits.max_body_bytes, limits.max_tokens)
    responses = ResponsesEndpoints(request_path, MemoryResponseStore(), limits.max_body_bytes, limits.max_tokens)
    app = http_server.build_app(
        request_path, default_max_tokens=limits.max_tokens,
        extra_routes=[*engine_routes.routes(), *render.routes(), *responses.routes()],
    )  # fmt: skip
    host = args.http_host or args.host
    http = HttpServer.start(app, host, args.http_port)
    print(f"kvroute worker: OpenAI HTTP API on http://{host}:{http.port}/v1", flush=True)
    return FrontDoor(http, request_path, engine_routes, backend)


def dial_host(host: str) -> str:
    """An address to reach a server listening on `host` from this machine."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
