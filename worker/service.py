"""The worker's gRPC service (proto/worker.proto, `kvroute.v1.Worker`) and the server around it.

    gateway ──Generate──► WorkerServicer ──► AsyncEngine.generate ──► engine thread (LLMEngine.step)
            ◄─stream──── GenerateResponse ◄── RequestOutput ◄───────┘

Errors map to status codes as the proto states: InvalidRequest -> INVALID_ARGUMENT (the message names the
field), an id in use -> ALREADY_EXISTS, a full worker (open streams, waiting queue) -> RESOURCE_EXHAUSTED,
draining or a dead engine -> UNAVAILABLE, an engine fault -> INTERNAL. A request is validated before anything
else is done with it (the block-hash parity check hashes the prompt). A closed stream (client cancellation)
cancels the handler, which closes the engine stream, which aborts the request.

The server also runs the standard health service (SERVING while up; NOT_SERVING while draining and as soon as
the engine dies) and, optionally, Prometheus metrics on a side HTTP port. Every WorkerInfo, WorkerStats and
KVEventBatch carries the worker's id and its incarnation, a random number drawn at every start.

With an `auth_token`, every `kvroute.v1.Worker` call must carry `authorization: Bearer <token>`
(TokenAuthInterceptor; UNAUTHENTICATED otherwise, before the request is even parsed); the health service stays
open. GetKVEvents answers a snapshot in pages of at most `kv_snapshot_page_blocks` blocks, each read on the
engine thread in O(page), and reading snapshot pages is rate-limited (SnapshotLimiter: RESOURCE_EXHAUSTED with
`grpc-retry-pushback-ms`).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import secrets
import socket
import struct
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from opentelemetry import trace

from kvroute.credentials import AUTHORIZATION_KEY
from kvroute.grpc_options import SERVER_OPTIONS, grpc_address
from kvroute.hashing import block_hashes, hash_fingerprint
from kvroute.kv_events import DEVICE
from kvroute.proto_maps import FINISH_REASONS, KV_EVENT_KINDS
from kvroute.sampling import InvalidRequest, SamplingParams
from kvroute.sampling_proto import sampling_from_proto
from proto import worker_pb2, worker_pb2_grpc
from worker import tracing
from worker.async_engine import (
    DEFAULT_MAX_STREAMS,
    DEFAULT_MAX_WAITING,
    AsyncEngine,
    EngineError,
    EngineOverloaded,
    EngineStopped,
    KVEventsSince,
    KVSnapshotPage,
    Lifecycle,
    RequestIdInUse,
)
from worker.engine import EngineStats, LLMEngine, RequestOutput
from worker.metrics import RequestTimer, WorkerMetrics

logger = logging.getLogger(__name__)

WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name  # "kvroute.v1.Worker"
MAX_KV_EVENTS_PER_REPLY = 4096
HEALTH_METHOD_PREFIX = f"/{health_pb2.DESCRIPTOR.services_by_name['Health'].full_name}/"  # open to probes
# Small enough that a page is a short hold of the engine thread and a small message (docs/gateway.md).
KV_SNAPSHOT_PAGE_BLOCKS = 8192
# Whole-pool snapshot reads per second, and the burst: each reader (a gateway) takes one at its start and
# after a gap in the events, so a burst covers a rolling restart of several gateways.
KV_SNAPSHOT_RATE = 2.0
KV_SNAPSHOT_BURST = 8.0


@dataclass(frozen=True)
class WorkerIdentity:
    """Who this worker is: a stable id (a StatefulSet pod name, host-port), the address gateways dial, and
    the incarnation, drawn at random at every start so a reader can tell a restart from a long gap."""

    worker_id: str
    advertise_address: str
    incarnation: int = field(default_factory=lambda: secrets.randbelow(2**64 - 1) + 1)


def default_worker_id(port: int) -> str:
    return f"{socket.gethostname()}-{port}"


def default_advertise_address(host: str, port: int) -> str:
    """host:port as another machine dials it: a wildcard listen address becomes this host's name."""
    if host in ("", "0.0.0.0", "::", "[::]"):
        host = socket.gethostname()
    return grpc_address(host, port)


# -- proto <-> engine ----------------------------------------------------------------------------------


def response_from_output(
    output: RequestOutput, completion_tokens: int, first: bool = False
) -> worker_pb2.GenerateResponse:
    """One engine output as a GenerateResponse. `usage` is set on the first response (prompt and cached
    tokens as admitted, so a gateway that cancels early still knows them) and on the last (final counts)."""
    response = worker_pb2.GenerateResponse(token_ids=output.new_token_ids, logprobs=output.new_logprobs)
    for ids, logprobs in output.new_top_logprobs:
        response.top_logprobs.add(token_ids=ids, logprobs=logprobs)
    if output.finished:
        response.finish_reason = FINISH_REASONS[output.finish_reason or "abort"]
    if output.finished or first:
        response.usage.CopyFrom(
            worker_pb2.Usage(
                prompt_tokens=output.prompt_tokens,
                completion_tokens=completion_tokens,
                cached_tokens=output.cached_tokens,
            )
        )
    return response


def stats_to_proto(
    stats: EngineStats,
    kv_event_seq: int,
    identity: WorkerIdentity,
    engine_state: worker_pb2.EngineState,
    engine_error: str = "",
) -> worker_pb2.WorkerStats:
    return worker_pb2.WorkerStats(
        num_blocks_total=stats.num_blocks_total,
        num_blocks_used=stats.num_blocks_used,
        num_blocks_cached=stats.num_blocks_cached,
        num_running=stats.num_running,
        num_waiting=stats.num_waiting,
        prefix_queries=stats.prefix_queries,
        prefix_hits=stats.prefix_hits,
        num_preemptions=stats.num_preemptions,
        kv_cache_usage=stats.kv_cache_usage,
        prompt_tokens_total=stats.prompt_tokens_total,
        generation_tokens_total=stats.generation_tokens_total,
        priority_loads=[
            worker_pb2.PriorityLoad(priority=priority, running_blocks=load.running_blocks, waiting=load.waiting)
            for priority, load in stats.priority_loads.items()
        ],
        kv_event_seq=kv_event_seq,
        worker_id=identity.worker_id,
        incarnation=identity.incarnation,
        engine_state=engine_state,
        engine_error=engine_error,
    )


def worker_info(engine: LLMEngine, identity: WorkerIdentity) -> worker_pb2.WorkerInfo:
    config = engine.config
    return worker_pb2.WorkerInfo(
        model_id=engine.model_id,
        block_size=config.block_size,
        hash_fingerprint=hash_fingerprint(engine.model_id, config.block_size),
        max_model_len=engine.max_model_len,
        vocab_size=engine.vocab_size,
        num_kv_blocks=engine.stats().num_blocks_total,
        num_host_kv_blocks=0 if engine.kv_manager.host_tier is None else engine.kv_manager.host_tier.num_blocks,
        kv_cache_dtype=config.kv_cache_dtype,
        dtype=str(engine.dtype).removeprefix("torch."),
        max_num_seqs=config.max_num_seqs,
        tokenizer_fingerprint=engine.tokenizer.fingerprint,
        worker_id=identity.worker_id,
        incarnation=identity.incarnation,
        attention_backend=engine.attention_backend,
        dtype_reason=engine.dtype_reason,
    )


def kv_events_to_proto(since: KVEventsSince, identity: WorkerIdentity) -> worker_pb2.KVEventBatch:
    """Events from the log; a snapshot goes over the wire in pages (`snapshot_page_to_proto`), never whole."""
    assert since.snapshot is None, "a whole snapshot is never sent: page it"
    batch = worker_pb2.KVEventBatch(
        latest_seq=since.latest_seq, worker_id=identity.worker_id, incarnation=identity.incarnation
    )
    for event in since.events:
        batch.events.add(
            seq=event.seq,
            kind=KV_EVENT_KINDS[event.kind],
            block_hashes=list(event.block_hashes),
            parent_hash=event.parent_hash or b"",
            medium="" if event.medium == DEVICE else event.medium,
        )
    return batch


_CURSOR = struct.Struct("<QQI")  # incarnation, the snapshot's seq (its first page's), the next page's block


def snapshot_page_to_proto(
    page: KVSnapshotPage, snapshot_seq: int, identity: WorkerIdentity
) -> worker_pb2.KVEventBatch:
    batch = worker_pb2.KVEventBatch(
        is_snapshot=True,
        snapshot_seq=snapshot_seq,
        latest_seq=page.seq,
        worker_id=identity.worker_id,
        incarnation=identity.incarnation,
    )
    batch.snapshot_hashes.extend(page.block_hashes)
    if page.medium != DEVICE:
        batch.snapshot_medium = page.medium
    if page.next_block is not None:
        batch.next_snapshot_cursor = _CURSOR.pack(identity.incarnation, snapshot_seq, page.next_block)
    return batch


# -- authentication and limits ------------------------------------------------------------------------


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call but the health service's unless its metadata carries `authorization: Bearer <token>`.

    The comparison is constant-time (`hmac.compare_digest`). A refused call is answered UNAUTHENTICATED without
    deserializing its request, so an anonymous client costs the worker no parsing and learns nothing of it."""

    def __init__(self, token: str) -> None:
        if not token:
            raise ValueError("the worker token must not be empty")
        self._expected = f"Bearer {token}".encode()
        self.refused = 0
        self._logged_at = -math.inf

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or details.method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        presented = next((v for k, v in details.invocation_metadata or () if k == AUTHORIZATION_KEY), None)
        if isinstance(presented, str):
            presented = presented.encode("utf-8", "replace")
        if isinstance(presented, bytes) and hmac.compare_digest(presented, self._expected):
            return handler
        self._on_refused(details.method, presented is None)
        return _refusing_handler(handler, "missing" if presented is None else "invalid")

    def _on_refused(self, method: str, missing: bool) -> None:
        self.refused += 1
        now = time.monotonic()
        if now - self._logged_at >= 60.0:  # a scanner must not flood the log
            self._logged_at = now
            logger.warning(
                "refused %s: %s worker token (%d refused so far)", method, "no" if missing else "a wrong", self.refused
            )


def _refusing_handler(handler: grpc.RpcMethodHandler, what: str) -> grpc.RpcMethodHandler:
    message = f"{what} worker token: this port serves the fleet's gateways only (authorization: Bearer <token>)"

    async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    async def refuse_streaming(request: object, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
        yield  # unreachable: makes this an async generator, as a streaming handler must be

    # No request deserializer: the refused request's bytes are never parsed.
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, None, handler.response_serializer)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse_streaming, None, handler.response_serializer)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, None, handler.response_serializer)
    return grpc.stream_stream_rpc_method_handler(refuse_streaming, None, handler.response_serializer)


class SnapshotLimiter:
    """A token bucket of whole-pool snapshot reads: `rate` per second, up to `burst` at once. A page costs its
    share of the pool (its blocks / the pool's), so a snapshot costs 1 however it is paged."""

    def __init__(self, rate: float = KV_SNAPSHOT_RATE, burst: float = KV_SNAPSHOT_BURST) -> None:
        if not rate > 0 or not burst >= 1:
            raise ValueError(f"snapshot rate must be > 0 and burst >= 1, got {rate}, {burst}")
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._updated = time.monotonic()

    def take(self, cost: float) -> float:
        """Take `cost` (<= 1) and return 0.0, or take nothing and return the seconds until it can be taken."""
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._updated) * self.rate)
        self._updated = now
        if self._tokens >= cost:
            self._tokens -= cost
            return 0.0
        return (cost - self._tokens) / self.rate


# -- the servicer ------------------------------------------------------------------------------------


GENERATE_ERRORS = (InvalidRequest, EngineOverloaded, EngineStopped, EngineError)  # what `generate` raises


def status_code(exc: Exception) -> grpc.StatusCode:
    """The gRPC status of an error raised by AsyncEngine before or while it streams a request."""
    if isinstance(exc, RequestIdInUse):
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(exc, EngineOverloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, EngineStopped):  # shut down, or dead: either way, send it elsewhere
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INTERNAL


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    """`kvroute.v1.Worker` over an AsyncEngine. Setting `draining` makes Generate answer UNAVAILABLE."""

    def __init__(
        self,
        engine: AsyncEngine,
        metrics: WorkerMetrics,
        identity: WorkerIdentity,
        *,
        snapshot_limiter: SnapshotLimiter | None = None,
        snapshot_page_blocks: int = KV_SNAPSHOT_PAGE_BLOCKS,
    ) -> None:
        if snapshot_page_blocks < 1:
            raise ValueError(f"snapshot_page_blocks must be >= 1, got {snapshot_page_blocks}")
        self.engine = engine
        self.metrics = metrics
        self.identity = identity
        self.info = worker_info(engine.engine, identity)
        self.snapshot_limiter = snapshot_limiter or SnapshotLimiter()
        self.snapshot_page_blocks = snapshot_page_blocks
        # What a snapshot covers: the device pool's blocks, then the host tier's slots.
        self.snapshot_blocks = self.info.num_kv_blocks + self.info.num_host_kv_blocks
        self.draining = False
        self._warned_hash_mismatch = False

    @property
    def engine_state(self) -> worker_pb2.EngineState:
        if self.engine.state is Lifecycle.DEAD:
            return worker_pb2.ENGINE_STATE_DEAD
        if self.draining or self.engine.state is not Lifecycle.RUNNING:
            return worker_pb2.ENGINE_STATE_DRAINING
        return worker_pb2.ENGINE_STATE_SERVING

    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        try:
            async with aclosing(self.generate(request)) as responses:
                async for response in responses:
                    yield response
        except GENERATE_ERRORS as exc:
            await context.abort(status_code(exc), str(exc))

    async def generate(self, request: worker_pb2.GenerateRequest) -> AsyncGenerator[worker_pb2.GenerateResponse, None]:
        """Generate's stream without its transport, for a front door in this process (launch.worker): the same
        admission, metrics, spans and block-hash check. Raises one of GENERATE_ERRORS (`status_code` names its
        gRPC status) before or while it streams; closing it (or cancelling its task) aborts the request, which
        frees its blocks."""
        if self.draining:
            raise EngineStopped("worker is draining; send the request elsewhere")
        request_id = request.request_id or uuid.uuid4().hex
        span = tracing.start_generate_span(
            request_id, dict(request.trace_context), self.info.model_id, len(request.prompt_token_ids)
        )
        timer = self.metrics.start_request()
        try:
            params = sampling_from_proto(request.sampling)
            self.engine.check_admission(request_id, request.prompt_token_ids, params)  # before any hashing
            tracing.record_params(span, params)
            if request.block_hashes:
                span.set_attribute("kvroute.block_hash_parity", self._check_block_hashes(request))
            async with aclosing(self._stream(request_id, request, params, timer, span)) as responses:
                async for response in responses:
                    yield response
        except GENERATE_ERRORS as exc:
            if isinstance(exc, EngineOverloaded):
                self.metrics.requests_refused.labels(self.metrics.model_name, exc.limit).inc()
            span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
            raise
        finally:
            span.end()

    async def _stream(
        self,
        request_id: str,
        request: worker_pb2.GenerateRequest,
        params: SamplingParams,
        timer: RequestTimer,
        span: trace.Span,
    ) -> AsyncGenerator[worker_pb2.GenerateResponse, None]:
        completion_tokens = 0
        finished = False
        first = True
        outputs = self.engine.generate(
            request_id, request.prompt_token_ids, params, request.cache_salt, request.priority
        )
        try:
            async with aclosing(outputs):
                async for output in outputs:
                    completion_tokens += len(output.new_token_ids)
                    timer.on_tokens(len(output.new_token_ids))
                    if output.finished:
                        finished = True
                        reason = output.finish_reason or "abort"
                        timer.on_finished(reason, output.timings, output.prompt_tokens, params.max_tokens)
                        tracing.record_finished(span, reason, completion_tokens, output.cached_tokens, output.timings)
                    yield response_from_output(output, completion_tokens, first)
                    first = False
        except (asyncio.CancelledError, GeneratorExit):
            if not finished:
                timer.on_finished("abort")
                tracing.record_finished(span, "abort", completion_tokens, 0, None)
            raise

    def _check_block_hashes(self, request: worker_pb2.GenerateRequest) -> bool:
        """Whether the gateway's routing hashes equal this worker's own; a mismatch is counted, and logged
        once. Call only on a validated request: it hashes the whole prompt."""
        config = self.engine.engine.config
        own = block_hashes(
            request.prompt_token_ids,
            model_id=self.info.model_id,
            cache_salt=request.cache_salt,
            block_size=config.block_size,
        )
        agree = list(request.block_hashes) == own
        if not agree:
            self.metrics.block_hash_mismatches.inc()
        if not agree and not self._warned_hash_mismatch:
            self._warned_hash_mismatch = True
            logger.warning(
                "request %s: the gateway's block hashes differ from this worker's (model %s, block size %d); "
                "check the gateway's hash_fingerprint against GetInfo",
                request.request_id,
                self.info.model_id,
                config.block_size,
            )
        return agree

    async def GetStats(
        self, request: worker_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerStats:
        # The last step's books, without waiting for the step in progress (a long prefill can take seconds).
        return stats_to_proto(
            self.engine.latest_stats,
            self.engine.kv_event_seq,
            self.identity,
            self.engine_state,
            self.engine.error or "",
        )

    async def GetInfo(
        self, request: worker_pb2.GetInfoRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.WorkerInfo:
        return self.info

    async def GetKVEvents(
        self, request: worker_pb2.GetKVEventsRequest, context: grpc.aio.ServicerContext
    ) -> worker_pb2.KVEventBatch:
        if request.snapshot_cursor:
            snapshot_seq, start = await self._parse_cursor(request.snapshot_cursor, context)
        else:
            limit = min(request.max_events or MAX_KV_EVENTS_PER_REPLY, MAX_KV_EVENTS_PER_REPLY)
            logged = self.engine.kv_events_logged(request.after_seq, limit)
            if logged is not None:
                return kv_events_to_proto(logged, self.identity)
            snapshot_seq, start = None, 0
        num_blocks = self.snapshot_blocks
        page_blocks = min(request.max_snapshot_blocks or self.snapshot_page_blocks, self.snapshot_page_blocks)
        wait = self.snapshot_limiter.take(min(page_blocks, num_blocks - start) / num_blocks)
        if wait:
            pushback_ms = max(1, math.ceil(wait * 1000))
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"KV snapshot reads are limited to {self.snapshot_limiter.rate:g} whole-pool reads per second; "
                f"retry in {pushback_ms / 1000:.3f} s",
                trailing_metadata=(("grpc-retry-pushback-ms", str(pushback_ms)),),
            )
        page = await self.engine.kv_snapshot_page(start, page_blocks)
        return snapshot_page_to_proto(page, page.seq if snapshot_seq is None else snapshot_seq, self.identity)

    async def _parse_cursor(self, cursor: bytes, context: grpc.aio.ServicerContext) -> tuple[int, int]:
        """(snapshot seq, next block) of a cursor this incarnation issued; INVALID_ARGUMENT for any other."""
        if len(cursor) == _CURSOR.size:
            incarnation, snapshot_seq, start = _CURSOR.unpack(cursor)
            if incarnation == self.identity.incarnation and 0 < start < self.snapshot_blocks:
                return snapshot_seq, start
        await context.abort(
            grpc.StatusCode.INVALID_ARGUMENT,
            "snapshot_cursor: not a cursor of this worker incarnation; start the snapshot again without one",
        )
        raise AssertionError("unreachable: context.abort raises")


# -- the server --------------------------------------------------------------------------------------


@dataclass
class WorkerServer:
    """A running worker: gRPC server, engine thread, health and metrics. Stop it with `stop()`.

    Other parts of one worker process start beside it in the same event loop and read it: the Redis reporter
    (identity, `engine.latest_stats`, `engine.kv_events_since`, `engine.kv_event_seq`, `engine.wait_dead`)
    and an HTTP front door (`advertise_address`)."""

    server: grpc.aio.Server
    port: int
    engine: AsyncEngine
    servicer: WorkerServicer
    health: health_aio.HealthServicer
    metrics: WorkerMetrics
    metrics_port: int | None
    identity: WorkerIdentity
    _engine_watch: asyncio.Task[None]

    @property
    def worker_id(self) -> str:
        return self.identity.worker_id

    @property
    def incarnation(self) -> int:
        return self.identity.incarnation

    @property
    def advertise_address(self) -> str:
        return self.identity.advertise_address

    async def stop(self, drain_timeout: float = 30.0) -> None:
        """Drain, then stop: report NOT_SERVING and refuse new requests (UNAVAILABLE, so a gateway retries
        elsewhere), let running requests finish for up to `drain_timeout` seconds, cancel the rest."""
        self.servicer.draining = True
        self._engine_watch.cancel()
        await self.health.enter_graceful_shutdown()
        deadline = time.monotonic() + drain_timeout
        while self.engine.num_active_requests and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.server.stop(grace=None)
        await self.engine.shutdown()
        self.metrics.stop()

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def start_worker_server(
    engine: LLMEngine,
    host: str = "127.0.0.1",
    port: int = 0,
    metrics_port: int | None = None,
    metrics_host: str | None = None,
    *,
    worker_id: str | None = None,
    advertise_address: str | None = None,
    max_concurrent_streams: int = DEFAULT_MAX_STREAMS,
    max_waiting: int = DEFAULT_MAX_WAITING,
    auth_token: str | None = None,
    kv_snapshot_rate: float = KV_SNAPSHOT_RATE,
    kv_snapshot_burst: float = KV_SNAPSHOT_BURST,
    kv_snapshot_page_blocks: int = KV_SNAPSHOT_PAGE_BLOCKS,
) -> WorkerServer:
    """Serve `engine` on host:port (0: a free port, see `.port`); health is SERVING when this returns, after
    the engine's warm-up. Metrics listen on `metrics_host` (default: `host`, so a worker bound to loopback
    never exposes them on every interface). `worker_id` defaults to `<hostname>-<port>`, `advertise_address`
    to host:port with a wildcard host replaced by this host's name. With `auth_token`, only calls that present
    it are served (health excepted); without, anyone who reaches the port is. Snapshot pages: see the module
    docstring. Must be awaited in the event loop that will run the server; raises OSError naming the address it
    cannot listen on, ValueError for a bad snapshot setting."""
    limiter = SnapshotLimiter(kv_snapshot_rate, kv_snapshot_burst)
    await asyncio.get_running_loop().run_in_executor(None, engine.warm_up)
    async_engine = AsyncEngine(engine, max_streams=max_concurrent_streams, max_waiting=max_waiting)
    config = engine.config
    metrics = WorkerMetrics(
        engine.model_id,
        lambda: async_engine.latest_stats,
        max_model_len=engine.max_model_len,
        max_num_batched_tokens=config.max_num_batched_tokens,
        cache_config={
            "block_size": str(config.block_size),
            "cache_dtype": config.kv_cache_dtype,
            "enable_prefix_caching": str(config.enable_prefix_caching),
            "num_gpu_blocks": str(engine.stats().num_blocks_total),
        },
    )
    engine.on_step = metrics.iteration_tokens.observe
    metrics_host = host if metrics_host is None else metrics_host
    bound_metrics_port = None
    if metrics_port is not None:
        try:
            bound_metrics_port = metrics.serve(metrics_port, metrics_host)
        except OSError as exc:
            where = grpc_address(metrics_host, metrics_port)
            raise OSError(f"cannot serve metrics on {where}: {exc.strerror}") from exc
    health = health_aio.HealthServicer()
    interceptors = [TokenAuthInterceptor(auth_token)] if auth_token else []
    server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
    try:
        bound_port = server.add_insecure_port(grpc_address(host, port))
    except RuntimeError as exc:
        metrics.stop()
        raise OSError(f"cannot listen on {grpc_address(host, port)}: {exc}") from exc
    identity = WorkerIdentity(
        worker_id or default_worker_id(bound_port), advertise_address or default_advertise_address(host, bound_port)
    )
    servicer = WorkerServicer(
        async_engine, metrics, identity, snapshot_limiter=limiter, snapshot_page_blocks=kv_snapshot_page_blocks
    )
    worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    async_engine.start()
    await server.start()
    for service in ("", WORKER_SERVICE):
        await health.set(service, health_pb2.HealthCheckResponse.SERVING)
    watch = asyncio.create_task(_report_engine_death(async_engine, health), name="engine-death-watch")
    return WorkerServer(
        server, bound_port, async_engine, servicer, health, metrics, bound_metrics_port, identity, watch
    )


async def _report_engine_death(engine: AsyncEngine, health: health_aio.HealthServicer) -> None:
    error = await engine.wait_dead()
    logger.error("the engine died (%s); health is NOT_SERVING", error)
    for service in ("", WORKER_SERVICE):
        await health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
