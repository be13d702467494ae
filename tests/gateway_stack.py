"""A real gateway over real workers, for the front doors' tests: `sim` or `tiny` workers on free ports, the
embedded fleet state over them, the real request path, the OpenAI HTTP app on the gateway's HTTP
server and the gRPC server.

It runs in a background thread's event loop (uvloop, as `kvroute gateway` does), so a test talks to it with
ordinary synchronous clients (httpx, the `openai` package, grpc stubs) over real sockets, and reaches into it
only through `call(coroutine)`:

    with GatewayStack(StackOptions(model="sim", workers=2)) as stack:
        httpx.post(f"{stack.http_url}/v1/completions", json={"prompt": "hi"})

A test module that shares one stack among its tests: `stack = stack_fixture(StackOptions(...))`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass, field
from typing import Any, Self, TypeVar

import grpc
import pytest
import uvloop

from gateway.admission.auth import Authenticator, key_sha256
from gateway.admission.limits import Limits
from gateway.fleet.embedded_fleet import EmbeddedFleetState
from gateway.frontdoors.grpc_server import GatewayGrpcServer, start_grpc_server
from gateway.frontdoors.http_listener import HttpServer
from gateway.frontdoors.http_server import build_app
from gateway.frontdoors.metrics_port import metrics_app
from gateway.metrics import GatewayMetrics
from gateway.request_path import RequestPath, fleet_identity
from gateway.responses.endpoints import ResponsesEndpoints
from gateway.responses.store import MemoryResponseStore, RedisResponseStore
from gateway.routing.router import make_policy
from kvroute.fleet_keys import redis_client
from kvroute.model_source import resolve_model
from kvroute.tokenizer import Tokenizer
from launch.fleet import free_port
from proto import worker_pb2, worker_pb2_grpc
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.service import WorkerServer, start_worker_server

T = TypeVar("T")
SERVED_MODEL = "kvroute-test"
KEY = "sk-test-acme"  # tenant "acme", no concurrency limit
SMALL_KEY = "sk-test-small"  # tenant "small", one request at a time
API_KEYS = [
    {"tenant": "acme", "key_sha256": key_sha256(KEY)},
    {"tenant": "small", "key_sha256": key_sha256(SMALL_KEY), "max_concurrency": 1},
]


@dataclass
class StackOptions:
    model: str = "sim"  # "sim" (arbitrary token ids, fast) or "tiny" (a small random Llama, real tokens)
    workers: int = 2
    policy: str = "kv_aware"
    limits: Limits = field(
        default_factory=lambda: Limits(max_prompt_tokens=2000, max_tokens=256, max_body_bytes=64 * 1024, max_n=4)
    )
    api_keys: list[dict[str, Any]] | None = field(default_factory=lambda: list(API_KEYS))
    max_model_len: int = 512
    num_kv_blocks: int = 256
    sim_decode_ms_per_step: float = 2.0
    dead_fleet: bool = False  # also serve a second gateway whose only worker address has nothing behind it
    gateways: int = 1  # gateways over the same workers (`http_urls`), each with its own fleet view
    redis_url: str | None = None  # /v1/responses' store in this Redis (shared by the gateways), else memory


def stack_fixture(options: StackOptions) -> Callable[[], Iterator[GatewayStack]]:
    """A module-scoped pytest fixture that runs one GatewayStack with `options` for all of a module's tests."""

    @pytest.fixture(scope="module")
    def stack() -> Iterator[GatewayStack]:
        with GatewayStack(options) as running:
            yield running

    return stack


class LoopThreadStack:
    """Servers run in an event loop of their own, on a daemon thread, so that synchronous tests and clients can
    talk to them: `with Stack(...) as stack:` starts them (`_start`, in that loop) and stops them (`_stop`);
    `call` runs a coroutine there and returns its result. A subclass defines `_start` and `_stop`."""

    def __init__(self, name: str) -> None:
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)

    async def _start(self) -> None:
        raise NotImplementedError

    async def _stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        self.thread.start()
        try:
            self.call(self._start(), timeout=120)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.call(self._stop(), timeout=60)
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)

    def call(self, coroutine: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        """Run a coroutine in the stack's event loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)


class GatewayStack(LoopThreadStack):
    def __init__(self, options: StackOptions | None = None) -> None:
        super().__init__("gateway-stack")
        self.options = options or StackOptions()
        self.workers: list[WorkerServer] = []
        self.request_path: RequestPath
        self.http: HttpServer
        self.metrics_http: HttpServer  # the gateway's /metrics, apart from the API port
        self.grpc: GatewayGrpcServer
        self.dead_http: HttpServer | None = None
        self.more_http: list[HttpServer] = []  # the gateways after the first (StackOptions.gateways)
        self.dead_grpc: GatewayGrpcServer | None = None
        self._closers: list[Any] = []

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http.port}"

    @property
    def http_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{http.port}" for http in (self.http, *self.more_http)]

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_http.port}/metrics"

    @property
    def dead_http_url(self) -> str:
        assert self.dead_http is not None
        return f"http://127.0.0.1:{self.dead_http.port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc.port}"

    def worker_stats(self) -> list[worker_pb2.WorkerStats]:
        """Each worker's GetStats, asked over its own gRPC port."""
        stats = []
        for worker in self.workers:
            with grpc.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
                stats.append(worker_pb2_grpc.WorkerStub(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=5))
        return stats

    def wait_workers_idle(self, timeout: float = 5.0) -> list[worker_pb2.WorkerStats]:
        """Every worker's stats once none runs, waits or holds a block (a cancellation travels asynchronously)."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.worker_stats()
            idle = all(s.num_running == 0 and s.num_waiting == 0 and s.num_blocks_used == 0 for s in stats)
            if idle or time.monotonic() > deadline:
                return stats
            time.sleep(0.02)

    # -- in the loop -------------------------------------------------------------------------------------------

    def _engine(self) -> LLMEngine:
        o = self.options
        config = EngineConfig(
            model=o.model,
            num_kv_blocks=o.num_kv_blocks,
            max_model_len=o.max_model_len,
            sim_decode_ms_per_step=o.sim_decode_ms_per_step,
            sim_prefill_us_per_token=1.0,
        )
        if o.model == "tiny":
            config.dtype = "float32"
        return LLMEngine(config)

    async def _start(self) -> None:
        o = self.options
        loop = asyncio.get_running_loop()
        engines = [await loop.run_in_executor(None, self._engine) for _ in range(o.workers)]
        for engine in engines:
            self.workers.append(await start_worker_server(engine, port=0))
        source = resolve_model(o.model)
        tokenizer = await loop.run_in_executor(None, Tokenizer.for_model, source)
        addresses = [f"127.0.0.1:{w.port}" for w in self.workers]
        self.request_path, self.http, self.grpc = await self._gateway(addresses, source.model_id, tokenizer)
        self.metrics_http = HttpServer.start(metrics_app(self.request_path.metrics), "127.0.0.1", 0)
        for _ in range(o.gateways - 1):
            self.more_http.append((await self._gateway(addresses, source.model_id, tokenizer))[1])
        if o.dead_fleet:
            dead_address = f"127.0.0.1:{free_port()}"
            _, self.dead_http, self.dead_grpc = await self._gateway([dead_address], source.model_id, tokenizer)

    async def _gateway(
        self, addresses: list[str], model_id: str, tokenizer: Tokenizer
    ) -> tuple[RequestPath, HttpServer, GatewayGrpcServer]:
        o = self.options
        fleet = EmbeddedFleetState(addresses, fleet_identity(model_id, tokenizer), poll_interval=0.05)
        await fleet.start()
        metrics = GatewayMetrics(SERVED_MODEL)
        request_path = RequestPath(
            fleet, make_policy(o.policy), tokenizer, model_id, SERVED_MODEL, Authenticator(o.api_keys), o.limits,
            metrics,
        )  # fmt: skip
        store = RedisResponseStore(redis_client(o.redis_url)) if o.redis_url else MemoryResponseStore()
        responses = ResponsesEndpoints(request_path, store, o.limits.max_body_bytes, o.limits.max_tokens)
        app = build_app(
            request_path, max_body_bytes=o.limits.max_body_bytes, default_max_tokens=o.limits.max_tokens,
            extra_routes=responses.routes(),
        )  # fmt: skip
        http = HttpServer.start(app, "127.0.0.1", 0)
        grpc_server = await start_grpc_server(
            request_path, "127.0.0.1", 0, default_max_tokens=o.limits.max_tokens,
            max_body_bytes=o.limits.max_body_bytes, health_interval_s=0.1,
        )  # fmt: skip
        self._closers.append((http, grpc_server, fleet, request_path, store))
        return request_path, http, grpc_server

    async def _stop(self) -> None:
        if hasattr(self, "metrics_http"):
            await self.metrics_http.stop()
        for http, grpc_server, fleet, request_path, store in reversed(self._closers):
            await grpc_server.stop(grace=0)
            await http.stop()
            await fleet.stop()
            await request_path.close()
            await store.close()
        for worker in self.workers:
            await worker.stop(drain_timeout=0)
