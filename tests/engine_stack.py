"""A real gateway over kvroute workers that it treats as vLLM servers: each worker (sim model) serves its own
OpenAI HTTP front door (launch.worker.start_http_front_door, what `kvroute worker --http-port` runs), and the
gateway's fleet is gateway.fleet.engine_fleet.EngineFleetState over `vllm://127.0.0.1:<http port>` specs, so every
request is forwarded over the HTTP backend. Like tests/gateway_stack.py it runs in a background thread's
event loop; tests talk to it over real sockets and reach into it through `call(coroutine)`.

    with EngineStack(EngineStackOptions(workers=2)) as stack:
        httpx.post(f"{stack.http_url}/v1/completions", json={"prompt": "hi"})
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.admission.auth import Authenticator
from gateway.admission.limits import Limits
from gateway.fleet.engine_fleet import (
    EngineFleetState,
    EngineOptions,
    EventSourceFactory,
    Resolver,
    resolve_all,
    subscribe,
)
from gateway.forwarding.backends import HttpBackend
from gateway.forwarding.retry import StreamDeadlines
from gateway.frontdoors.http_listener import HttpServer
from gateway.frontdoors.http_server import build_app
from gateway.metrics import GatewayMetrics
from gateway.request_path import RequestPath, fleet_identity
from gateway.responses.endpoints import ResponsesEndpoints
from gateway.responses.store import MemoryResponseStore
from gateway.routing.router import make_policy
from gateway.worker_spec import WorkerSpec, parse_worker_spec
from kvroute.model_source import resolve_model
from kvroute.tokenizer import Tokenizer
from launch.fleet import free_port
from launch.worker import FrontDoor, start_http_front_door
from tests.gateway_stack import API_KEYS, SERVED_MODEL, LoopThreadStack
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.service import WorkerServer, start_worker_server


@dataclass
class EngineStackOptions:
    workers: int = 2
    sim_decode_ms_per_step: float = 2.0
    policy: str = "kv_aware"
    gateway_tokenizer: Tokenizer | None = None  # default: the workers' own (sim's); another fails parity
    api_keys: list[dict[str, Any]] | None = field(default_factory=lambda: list(API_KEYS))
    engine: EngineOptions = field(
        default_factory=lambda: EngineOptions(poll_interval=0.05, unreachable_after=0.5, no_events_after=0.5)
    )
    # Each worker publishes its KV events (worker.kv_event_publisher, vLLM's wire format, with replay) on
    # loopback ports its spec names; without, each spec names a port nothing publishes on: no events.
    kv_events: bool = False
    events: EventSourceFactory = subscribe
    resolve: Resolver = resolve_all
    specs: Callable[[list[int]], list[str]] | None = None  # HTTP ports -> the gateway's specs (default: one each)
    deadlines: StreamDeadlines | None = None


class EngineStack(LoopThreadStack):
    def __init__(self, options: EngineStackOptions | None = None) -> None:
        super().__init__("engine-stack")
        self.options = options or EngineStackOptions()
        self.workers: list[WorkerServer] = []
        self.front_doors: list[FrontDoor | None] = []
        self.http_ports: list[int] = []
        self.grpc_ports: list[int] = []
        self.event_ports: list[tuple[int, int]] = []  # (events, replay) per worker, with kv_events
        self.publishers: list[Any] = []
        self.engines: list[LLMEngine] = []
        self.fleet: EngineFleetState
        self.request_path: RequestPath
        self.http: HttpServer

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http.port}"

    def worker_id(self, index: int) -> str:
        return f"127.0.0.1:{self.http_ports[index]}"

    def spec(self, index: int) -> str:
        """Worker `index`'s spec as the gateway is given it."""
        if not self.options.kv_events:
            return f"vllm://127.0.0.1:{self.http_ports[index]}?events=tcp://127.0.0.1:1"
        events, replay = self.event_ports[index]
        return (
            f"vllm://127.0.0.1:{self.http_ports[index]}?events=tcp://127.0.0.1:{events}&replay=tcp://127.0.0.1:{replay}"
        )

    def _publish(self, index: int) -> Any:
        from worker.kv_event_publisher import KVEventPublisher, KVEventsConfig

        events, replay = self.event_ports[index]
        config = KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://127.0.0.1:{events}",
            replay_endpoint=f"tcp://127.0.0.1:{replay}", bind=True,
        )  # fmt: skip
        server = self.workers[index]
        publisher = KVEventPublisher(server.engine, config, self.engines[index].config.block_size)
        publisher.start()
        return publisher

    def restart(self, index: int) -> None:
        """Worker `index` stops and a new one (an empty cache, its event sequence from 0) starts on its ports."""
        self.call(self._kill(index))
        self.call(self._start_worker(index))

    def kill(self, index: int) -> None:
        """Stop worker `index` at once: its HTTP port and its gRPC port stop answering."""
        self.call(self._kill(index))

    async def _kill(self, index: int) -> None:
        front_door = self.front_doors[index]
        if front_door is not None:
            self.front_doors[index] = None
            front_door.http.force_exit()
            await front_door.stop()
            if self.publishers:
                self.publishers[index].stop()
            await self.workers[index].stop(drain_timeout=0)

    async def _start_worker(self, index: int) -> None:
        """Worker `index` on its ports (its engine, gRPC server, HTTP front door and, with kv_events, publisher)."""
        o = self.options
        engine = await asyncio.get_running_loop().run_in_executor(None, _engine, o.sim_decode_ms_per_step)
        server = await start_worker_server(engine, port=self.grpc_ports[index])
        args = argparse.Namespace(
            host="127.0.0.1", port=self.grpc_ports[index], http_host=None, http_port=self.http_ports[index],
            model="sim", allow_derived_salt=False, auth_token_file=None,
        )  # fmt: skip
        front_door = await start_http_front_door(engine, args)
        front_door.serve_from(server)  # its /metrics, /health and requests: the engine's own, in this process
        if index == len(self.workers):
            self.engines.append(engine)
            self.workers.append(server)
            self.front_doors.append(front_door)
        else:
            self.engines[index], self.workers[index], self.front_doors[index] = engine, server, front_door
        if o.kv_events:
            publisher = self._publish(index)
            if index == len(self.publishers):
                self.publishers.append(publisher)
            else:
                self.publishers[index] = publisher

    async def _start(self) -> None:
        o = self.options
        loop = asyncio.get_running_loop()
        for index in range(o.workers):
            self.grpc_ports.append(free_port())
            self.http_ports.append(free_port())
            if o.kv_events:
                self.event_ports.append((free_port(), free_port()))
            await self._start_worker(index)
        source = resolve_model("sim")
        tokenizer = o.gateway_tokenizer or await loop.run_in_executor(None, Tokenizer.for_model, source)
        texts = o.specs(self.http_ports) if o.specs else [self.spec(i) for i in range(o.workers)]
        specs: list[WorkerSpec] = [parse_worker_spec(t) for t in texts]
        identity = fleet_identity(source.model_id, tokenizer)
        self.fleet = EngineFleetState(
            specs, identity, tokenizer, options=o.engine, events=o.events, resolve=o.resolve
        )  # fmt: skip
        await self._wait_workers_ready()
        await self.fleet.start()
        limits = Limits(max_prompt_tokens=2000, max_tokens=256, max_body_bytes=64 * 1024, max_n=4)
        self.request_path = RequestPath(
            self.fleet, make_policy(o.policy), tokenizer, source.model_id, SERVED_MODEL,
            Authenticator(o.api_keys), limits, GatewayMetrics(SERVED_MODEL), deadlines=o.deadlines,
            http_backend=HttpBackend(engine=self.fleet.engine_target),
        )  # fmt: skip
        store = MemoryResponseStore()
        responses = ResponsesEndpoints(self.request_path, store, limits.max_body_bytes, limits.max_tokens)
        app = build_app(
            self.request_path, max_body_bytes=limits.max_body_bytes, default_max_tokens=limits.max_tokens,
            extra_routes=responses.routes(),
        )  # fmt: skip
        self.http = HttpServer.start(app, "127.0.0.1", 0)

    async def _wait_workers_ready(self) -> None:
        """Until each worker's own front door routes to its worker (its /ready), at most 20 s."""
        import httpx

        async with httpx.AsyncClient() as client:
            for port in self.http_ports:
                for _ in range(400):
                    response = await client.get(f"http://127.0.0.1:{port}/ready")
                    if response.status_code == 200:
                        break
                    await asyncio.sleep(0.05)

    async def _stop(self) -> None:
        if hasattr(self, "http"):
            await self.http.stop()
        if hasattr(self, "fleet"):
            await self.fleet.stop()
        if hasattr(self, "request_path"):
            await self.request_path.close()
        for index in range(len(self.front_doors)):
            await self._kill(index)


def _engine(decode_ms: float) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model="sim", num_kv_blocks=256, max_model_len=512, sim_decode_ms_per_step=decode_ms,
            sim_prefill_us_per_token=1.0,
        )
    )  # fmt: skip
