"""Envoy's `envoy.service.ext_proc.v3.ExternalProcessor` as a Gateway API Inference Extension endpoint picker
(the Endpoint Picker Protocol, docs/epp.md), over the gateway's own request path.

One ext_proc stream is one HTTP request through Envoy. What the picker does with its messages:

    request_headers   an inference request (POST /v1/chat/completions, /v1/completions, read from the path
                      as the worker's server reads it: `canonical_path`): wait for the body. Anything else
                      (GET /v1/models, /health, ...): any ready endpoint, answered at once.
    request_body      FULL_DUPLEX_STREAMED: gathered until end_of_stream (or the trailers), then the decision:
                      the headers response (x-gateway-destination-endpoint: the chosen endpoint; the ordered
                      list, fallbacks after it, in the dynamic metadata `envoy.lb`), then the body sent back as
                      streamed chunks. BUFFERED: one message,
                      the headers answered empty before it and the mutation carried by the body response.
    response_headers  the endpoint that served it (`envoy.lb` metadata `x-gateway-destination-endpoint-served`,
                      else the response header of that name) moves the in-flight book there;
                      x-kvroute-worker and x-kvroute-route are set for the client.
    response_body     each chunk goes back as it came (never buffered); the first one times TTFT, the last
                      SSE event (or the JSON body) gives usage for the span.
    stream end        the request is finished on the worker that served it, whatever happened.

The request's `model` picks the pool (gateway.pools: one per served model, each with its own fleet, index and
policy); a model no pool serves goes on (once the key is checked) to any ready endpoint, as GIE's picker
does, and the model server answers it; no model while several are served is a 400. The decision in the pool:
`RequestPath.prepare` (auth, model, limits, template, tokenizer, block hashes with the tenant's salt), the
tenant's concurrency slot, then flow control (`RequestPath.wait_for_worker`: the ext_proc stream is held, as
llm-d's is, until a worker can admit the request; its grant's worker is taken when it has an endpoint, its
first response byte marks it started, its end frees the room), then the routing policy picks once over the
workers that have an endpoint (and are in the data plane's subset hint, when it sends one); the fallbacks are
the other eligible workers by the policy's own signals without asking it again (its memory is updated once per
request): the most leading blocks cached first, then the least loaded. Refusals are ImmediateResponses in
OpenAI's error body: 400 (bad JSON, no model among several, oversize prompt), 401, 413, 429 with Retry-After, 503.
"""

from __future__ import annotations

import itertools
import json
import logging
import posixpath
import re
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import orjson
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2
from opentelemetry import trace

from gateway import tracing
from gateway.errors import BodyTooLarge, GatewayError, InvalidRequestError, ModelNotFound, NoWorkerAvailable
from gateway.fleet.fleet_state import WorkerMember
from gateway.flow_control.dispatcher import Grant
from gateway.frontdoors.openai_protocol import (
    PRIORITY_HEADER,
    ChatCompletionRequest,
    CompletionRequest,
    RequestHeaders,
    bearer_token,
    client_request_id_of,
    parse_request,
    priority_header,
)
from gateway.metrics import label_value
from gateway.pools import Pools
from gateway.request import GatewayRequest, RouteInfo, Tenant, Usage
from gateway.request_path import RequestPath
from gateway.routing.fleet_view import FleetView
from gateway.routing.router import NoReplicaAvailable, RouteRequest

logger = logging.getLogger(__name__)

DESTINATION = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
INFERENCE_PATHS: dict[str, type[ChatCompletionRequest | CompletionRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}
BODY_CHUNK_BYTES = 62_000  # a streamed body response stays under Envoy's default 64 KiB gRPC frame budget
USAGE_TAIL_BYTES = 16_384  # of an SSE stream: enough for its last events (usage, [DONE])
JSON_KEEP_BYTES = 1 << 20  # of a whole JSON response: parsed for usage at its end, past this not kept
FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = processing_mode_pb2.ProcessingMode.BUFFERED
_OVERWRITE = base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD
_SLASHES = re.compile("/+")


def canonical_path(raw: str) -> str:
    """`raw` (a `:path`) without its query or fragment, percent-decoded whole (as the workers' front doors,
    gateway.frontdoors.http_protocol.request_path, and vLLM's uvicorn decode it: `%2F` too, a superset of RFC
    3986's unreserved characters), slashes merged and dot segments removed (as Envoy's `normalize_path` /
    `merge_slashes` do). Whatever a worker would serve as an inference request is one here, so no spelling of
    the path gets past the decision."""
    path = raw.partition("#")[0].partition("?")[0]
    return posixpath.normpath(_SLASHES.sub("/", unquote(path))) if path else path


@dataclass(frozen=True)
class EndpointMap:
    """Where Envoy dials a worker: its HTTP front door (`kvroute worker --http-port`), while the fleet state
    reads the worker over gRPC. `explicit` maps a worker id or its gRPC address to `ip:port`; otherwise a stock
    engine's (`vllm://`, `sglang://`) own address, which is its OpenAI HTTP server; otherwise the worker's
    advertised host with `target_port` (an InferencePool's targetPort: every pod serves HTTP on the same port).
    A kvroute worker with neither is not routable by the picker."""

    explicit: Mapping[str, str] = field(default_factory=dict)
    target_port: int | None = None

    @classmethod
    def parse(cls, spec: str, target_port: int | None) -> EndpointMap:
        """`spec`: `WORKER=IP:PORT,...` (WORKER: a worker id or its gRPC host:port). Raises ValueError."""
        explicit: dict[str, str] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, sep, endpoint = item.partition("=")
            host, colon, port = endpoint.rpartition(":")
            if not sep or not key or not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"--endpoints: {item!r} is not WORKER=IP:PORT")
            explicit[key] = endpoint
        if target_port is not None and not 0 < target_port < 65536:
            raise ValueError(f"--target-port must be in (0, 65536), got {target_port}")
        return cls(explicit, target_port)

    def of(self, member: WorkerMember) -> str | None:
        endpoint = self.explicit.get(member.worker_id) or self.explicit.get(member.address)
        if endpoint is not None:
            return endpoint
        if member.engine != "kvroute":
            return member.address
        if self.target_port is None:
            return None
        return f"{member.address.rpartition(':')[0]}:{self.target_port}"


@dataclass
class Pick:
    """One inference request's decision and its books, until `Picker.finish`."""

    request_id: str
    client_request_id: str | None
    tenant: Tenant
    route: RouteInfo
    endpoints: list[str]  # the chosen worker's first, then the fallbacks
    workers: dict[str, str]  # endpoint -> worker id, for the endpoints above
    prompt_tokens: int
    span: trace.Span
    arrival: float
    booked: str  # the worker whose in-flight count holds this request
    path: RequestPath  # the pool that decided it
    grant: Grant | None = None  # flow control's leave (None: off), closed when the request ends
    first_byte: float | None = None
    finished: bool = False


class Picker:
    """The decisions and their books, over the gateway's pools (gateway.pools.Pools, or one RequestPath):
    each pool's fleet state, policy and limits, the request's `model` picking the pool."""

    def __init__(
        self,
        pools: Pools | RequestPath,
        endpoints: EndpointMap,
        *,
        max_body_bytes: int,
        default_max_tokens: int,
        max_endpoints: int = 0,
    ) -> None:
        """`max_endpoints`: how many endpoints the metadata's list holds at most (0: every eligible one); the
        header holds one whatever it is."""
        self.pools = pools
        self.metrics = pools.metrics  # where refusals before a pool is known are counted
        self.endpoints = endpoints
        self.max_body_bytes = max_body_bytes
        self.default_max_tokens = default_max_tokens
        self.max_endpoints = max_endpoints
        self._turn = itertools.count()
        self._unmapped: set[str] = set()  # workers without an endpoint, logged once each

    def ready(self) -> bool:
        """A pool's fleet view has a worker the picker can send Envoy to (and the picker is not draining)."""
        return any(self._eligible(path, path.fleet.view(), None) for path in self.pools.pools())

    def _eligible(self, path: RequestPath, fleet: FleetView, subset: frozenset[str] | None) -> dict[str, str]:
        """worker id -> endpoint for the workers in `path`'s view that have one (within `subset` when given)."""
        if path.draining:
            return {}
        eligible = {}
        for worker_id in fleet.replicas:
            member = path.fleet.member(worker_id)
            endpoint = self.endpoints.of(member) if member is not None else None
            if endpoint is None and member is not None and worker_id not in self._unmapped:
                self._unmapped.add(worker_id)
                logger.warning("worker %s at %s has no HTTP endpoint (--endpoints, --target-port): not routed to",
                               worker_id, member.address)  # fmt: skip
            if endpoint is not None and (subset is None or endpoint in subset):
                eligible[worker_id] = endpoint
        return eligible

    def any_endpoints(self, subset: frozenset[str] | None) -> list[str]:
        """A request that is not inference, or for a model no pool serves: every eligible endpoint of every
        pool, starting at the next in turn. Raises NoWorkerAvailable when there is none."""
        endpoints = sorted(
            {e for path in self.pools.pools() for e in self._eligible(path, path.fleet.view(), subset).values()}
        )
        if not endpoints:
            raise NoWorkerAvailable(_no_endpoint(subset))
        start = next(self._turn) % len(endpoints)
        return self._cut(endpoints[start:] + endpoints[:start])

    def _cut(self, endpoints: list[str]) -> list[str]:
        return endpoints[: self.max_endpoints] if self.max_endpoints else endpoints

    def parse(self, path: str, headers: Mapping[str, str], body: bytes) -> GatewayRequest:
        """The body as the gateway's front door reads it. Raises GatewayError (400, 413)."""
        if len(body) > self.max_body_bytes:
            raise BodyTooLarge(f"request body has {len(body)} bytes; this server accepts at most {self.max_body_bytes}")
        wire = parse_request(INFERENCE_PATHS[path], body)
        request_headers = RequestHeaders(
            api_key=bearer_token(headers.get("authorization")),
            session_id=headers.get("x-session-id") or None,
            app=headers.get("x-kvroute-app") or None,
            trace_context={name: headers[name] for name in ("traceparent", "tracestate") if name in headers},
            priority=priority_header(headers.get(PRIORITY_HEADER)),
        )
        return wire.to_gateway_request(request_headers, self.default_max_tokens)

    async def decide(
        self, request: GatewayRequest, subset: frozenset[str] | None, client_request_id: str | None
    ) -> Pick:
        """Route one inference request in the pool its `model` names. Raises GatewayError (nothing booked)
        when it is refused, ModelNotFound when no pool serves the model; otherwise the caller must call
        `finish(pick)` exactly once, however the request ends."""
        arrival = time.perf_counter()
        # the key first, as in the gateway: a model no pool serves is passed on only for a known tenant
        self.pools.auth.authenticate(request.api_key)
        path = self.pools.pool(request.model)
        if path.draining:
            raise NoWorkerAvailable("the endpoint picker is shutting down; send the request again", retry_after=1.0)
        prepared = await path.prepare(request)  # the tenant's slot is held from here
        grant: Grant | None = None
        try:
            fleet = path.fleet.view()
            eligible = self._eligible(path, fleet, subset)
            if not eligible:
                raise NoWorkerAvailable(_no_endpoint(subset))
            longest = max(path.fleet.member(w).max_model_len for w in eligible)  # type: ignore[union-attr]
            if len(prepared.prompt_ids) >= longest:
                raise InvalidRequestError(
                    f"this model's maximum context length is {longest} tokens; the prompt has "
                    f"{len(prepared.prompt_ids)}",
                    param="messages" if request.messages is not None else "prompt",
                    code="context_length_exceeded",
                )
            request_id = uuid.uuid4().hex
            route_request = RouteRequest(request_id, prepared.hashes, len(prepared.prompt_ids), request.session_id)
            grant = await path.wait_for_worker(request, prepared, route_request)  # the ext_proc stream is held
            if grant is not None:
                fleet = path.fleet.view()  # as it is now, after the wait
                eligible = self._eligible(path, fleet, subset)
                if not eligible:
                    raise NoWorkerAvailable(_no_endpoint(subset))
            if grant is not None and grant.decision is not None and grant.decision.replica in eligible:
                decision = grant.decision
            else:
                try:
                    decision = path.policy.pick(route_request, fleet, frozenset(fleet.replicas) - eligible.keys())
                except NoReplicaAvailable as exc:
                    raise NoWorkerAvailable(str(exc)) from None
            path.policy.observe(route_request, decision)
        except BaseException:
            if grant is not None:
                grant.close()
            path.concurrency.release(prepared.tenant)
            raise
        order = [decision.replica, *self._fallbacks(fleet, prepared.hashes, eligible, decision.replica)]
        route = RouteInfo(
            decision.replica, eligible[decision.replica], path.policy.name, decision.reason,
            decision.matched_blocks, decision.skipped,
        )  # fmt: skip
        span = tracing.start_request_span(request_id, request, path.served_model_name)
        tracing.record_route(span, route)
        path.fleet.on_dispatch(decision.replica)
        if grant is not None:
            grant.sent()
        metrics = path.metrics
        metrics.routing_latency.observe(time.perf_counter() - arrival)
        metrics.requests.labels(route.policy, route.reason).inc()
        metrics.routed.labels(label_value(decision.replica)).inc()
        metrics.observe_prefix(prepared.tenant, request.app, prepared.hashes, route.matched_blocks, path.block_size)
        path.active += 1
        metrics.in_flight.set(path.active)
        logger.info(
            "request %s tenant=%s prompt_tokens=%d -> %s at %s (%s)", request_id, prepared.tenant.name,
            len(prepared.prompt_ids), decision.replica, eligible[decision.replica], route.header(),
        )  # fmt: skip
        endpoints = self._cut([eligible[w] for w in order])
        return Pick(
            request_id, client_request_id, prepared.tenant, route, endpoints, dict(zip(endpoints, order, strict=False)),
            len(prepared.prompt_ids), span, arrival, decision.replica, path, grant,
        )  # fmt: skip

    @staticmethod
    def _fallbacks(fleet: FleetView, hashes: list[bytes], eligible: Mapping[str, str], chosen: str) -> list[str]:
        """The eligible workers but `chosen`, the most leading blocks cached first, then the least loaded."""
        matched = fleet.kv_index.match(hashes) if hashes else [0] * len(fleet.replicas)
        rest = [w for w in eligible if w != chosen]

        def rank(worker_id: str) -> tuple[int, int, str]:
            load = fleet.loads[worker_id]
            return -matched[fleet.index_of[worker_id]], load.in_flight + load.queued, worker_id

        return sorted(rest, key=rank)

    def served(self, pick: Pick, endpoint: str | None) -> None:
        """Envoy says which endpoint served the request: its in-flight book moves there (a retry walked the
        list), and the route says how far down the list it went."""
        if not endpoint or endpoint not in pick.workers:
            return
        worker_id = pick.workers[endpoint]
        if worker_id == pick.booked:
            return
        pick.path.fleet.on_finish(pick.booked)
        pick.path.fleet.on_dispatch(worker_id)
        skipped = tuple(pick.endpoints[: pick.endpoints.index(endpoint)])
        pick.booked = worker_id
        pick.route = RouteInfo(
            worker_id, endpoint, pick.route.policy, "fallback", 0, tuple(pick.workers[e] for e in skipped),
            attempts=len(skipped) + 1,
        )  # fmt: skip
        tracing.record_route(pick.span, pick.route)

    def finish(self, pick: Pick, usage: Usage | None, status: int | None) -> None:
        """The request is over (any way): out of the in-flight books, its tenant's slot freed, metrics and
        span recorded. Idempotent."""
        if pick.finished:
            return
        pick.finished = True
        path = pick.path
        path.fleet.on_finish(pick.booked)
        path.concurrency.release(pick.tenant)
        if pick.grant is not None and path.flow is not None:
            pick.grant.close()
            path.flow.kick()
        path.active -= 1
        path.metrics.in_flight.set(path.active)
        now = time.perf_counter()
        if pick.first_byte is not None:
            path.metrics.time_to_first_token.observe(pick.first_byte - pick.arrival)
        if status is not None and status < 400:
            path.metrics.e2e_request_latency.observe(now - pick.arrival)
        if usage is not None:
            tracing.record_usage(pick.span, pick.request_id, usage, ())
        if status is None or status >= 500:
            pick.span.set_status(trace.StatusCode.ERROR, f"upstream status {status}")
        pick.span.end()


def _no_endpoint(subset: frozenset[str] | None) -> str:
    if subset is not None:
        return f"no ready endpoint in the data plane's subset ({', '.join(sorted(subset)) or 'empty'})"
    return "no ready endpoint to route to"


# -- building ext_proc messages --------------------------------------------------------------------------------


def header_options(headers: Mapping[str, str]) -> list[base_pb2.HeaderValueOption]:
    return [
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode()), append_action=_OVERWRITE)
        for k, v in headers.items()
    ]


def destination(endpoints: list[str], response_type: str, path: str | None = None) -> ext_pb2.ProcessingResponse:
    """The protocol's result: the header names the one endpoint to send the request to (`endpoints[0]`, what an
    ORIGINAL_DST cluster dials), the `envoy.lb` metadata the whole ordered list, the fallbacks after it; `path`,
    when given, replaces the request's `:path` (the spelling the decision was made for)."""
    headers = {DESTINATION: endpoints[0]} if path is None else {DESTINATION: endpoints[0], ":path": path}
    common = ext_pb2.CommonResponse(
        header_mutation=ext_pb2.HeaderMutation(set_headers=header_options(headers)), clear_route_cache=True
    )
    metadata = struct_pb2.Struct()
    metadata.update({LB_NAMESPACE: {DESTINATION: ",".join(endpoints)}})
    if response_type == "request_headers":
        return ext_pb2.ProcessingResponse(
            request_headers=ext_pb2.HeadersResponse(response=common), dynamic_metadata=metadata
        )
    return ext_pb2.ProcessingResponse(request_body=ext_pb2.BodyResponse(response=common), dynamic_metadata=metadata)


def streamed_body(kind: str, body: bytes, end_of_stream: bool) -> Iterable[ext_pb2.ProcessingResponse]:
    """`body` sent back in FULL_DUPLEX_STREAMED mode (kind: request_body or response_body), in chunks."""
    pieces = [body[i : i + BODY_CHUNK_BYTES] for i in range(0, len(body), BODY_CHUNK_BYTES)] or [b""]
    for i, piece in enumerate(pieces):
        mutation = ext_pb2.BodyMutation(
            streamed_response=ext_pb2.StreamedBodyResponse(
                body=piece, end_of_stream=end_of_stream and i == len(pieces) - 1
            )
        )
        yield ext_pb2.ProcessingResponse(
            **{kind: ext_pb2.BodyResponse(response=ext_pb2.CommonResponse(body_mutation=mutation))}
        )


def immediate(error: GatewayError, request_id: str | None) -> ext_pb2.ProcessingResponse:
    """A refusal answered by Envoy on the picker's behalf, in OpenAI's error body."""
    headers = {"content-type": "application/json", "x-request-id": request_id or uuid.uuid4().hex}
    headers.update(error.http_headers())
    return ext_pb2.ProcessingResponse(
        immediate_response=ext_pb2.ImmediateResponse(
            status=http_status_pb2.HttpStatus(code=error.http_status),
            headers=ext_pb2.HeaderMutation(set_headers=header_options(headers)),
            body=orjson.dumps(error.to_openai()),
            details=f"kvroute_epp_{error.code or type(error).__name__}",
        )
    )


def _headers_of(message: ext_pb2.HttpHeaders) -> dict[str, str]:
    return {
        h.key.lower(): (h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value)
        for h in message.headers.headers
    }


def _metadata_value(request: ext_pb2.ProcessingRequest, namespace: str, key: str) -> Any:
    if namespace not in request.metadata_context.filter_metadata:
        return None
    fields = request.metadata_context.filter_metadata[namespace].fields
    if key not in fields:
        return None
    value = fields[key]
    if value.HasField("list_value"):
        return [v.string_value for v in value.list_value.values]
    return value.string_value


def _usage(is_sse: bool, kept: bytes) -> Usage | None:
    """Usage from a response's last SSE events or its JSON body; None when it carries none."""
    candidates: list[bytes] = []
    if is_sse:
        candidates = [line[5:].strip() for line in kept.split(b"\n") if line.startswith(b"data:")][::-1]
    else:
        candidates = [kept]
    for raw in candidates:
        try:
            body = json.loads(raw)
        except ValueError:
            continue
        usage = body.get("usage") if isinstance(body, dict) else None
        if isinstance(usage, dict):
            details = usage.get("prompt_tokens_details") or {}
            return Usage(
                int(usage.get("prompt_tokens") or 0),
                int(usage.get("completion_tokens") or 0),
                int(details.get("cached_tokens") or 0),
            )
    return None


# -- the service -----------------------------------------------------------------------------------------------


class ExternalProcessor(ext_grpc.ExternalProcessorServicer):
    """`Process`: one ext_proc stream per HTTP request, as the module docstring says."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    async def Process(  # noqa: N802 (the gRPC method's name)
        self, request_iterator: AsyncIterator[ext_pb2.ProcessingRequest], context: Any
    ) -> AsyncIterator[ext_pb2.ProcessingResponse]:
        exchange = _Exchange(self.picker)
        try:
            async for message in request_iterator:
                for response in await exchange.handle(message):
                    yield response
        finally:
            exchange.close()


class _Exchange:
    """One HTTP request's ext_proc stream: the state between its messages."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.request_body_mode = FULL_DUPLEX
        self.response_body_mode = FULL_DUPLEX
        self.headers: dict[str, str] = {}
        self.subset: frozenset[str] | None = None
        self.inference = False
        self.path = ""  # canonical_path of the request's :path
        self.rewritten_path: str | None = None  # the :path the worker gets, where the request's was not canonical
        self.decided = False
        self.body = bytearray()
        self.pick: Pick | None = None
        self.status: int | None = None
        self.is_sse = False
        self.kept = bytearray()

    async def handle(self, message: ext_pb2.ProcessingRequest) -> list[ext_pb2.ProcessingResponse]:
        if message.HasField("protocol_config"):
            self.request_body_mode = message.protocol_config.request_body_mode
            self.response_body_mode = message.protocol_config.response_body_mode
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return self._request_headers(message)
        if kind == "request_body":
            return await self._request_body(message.request_body)
        if kind == "request_trailers":
            return [*await self._decide(end_of_stream=False), _trailers("request_trailers")]
        if kind == "response_headers":
            return self._response_headers(message)
        if kind == "response_body":
            return self._response_body(message.response_body)
        if kind == "response_trailers":
            return [_trailers("response_trailers")]
        return []

    def _request_headers(self, message: ext_pb2.ProcessingRequest) -> list[ext_pb2.ProcessingResponse]:
        self.headers = _headers_of(message.request_headers)
        subset = _metadata_value(message, SUBSET_NAMESPACE, SUBSET)
        if subset is not None:
            self.subset = frozenset([subset] if isinstance(subset, str) else subset)
        raw = self.headers.get(":path", "")
        self.path = canonical_path(raw)
        self.inference = self.headers.get(":method") == "POST" and self.path in INFERENCE_PATHS
        written, mark, query = raw.partition("#")[0].partition("?")
        if self.inference and written != self.path:
            self.rewritten_path = self.path + mark + query
        if not self.inference or message.request_headers.end_of_stream:
            self.decided = True
            try:
                endpoints = self.picker.any_endpoints(self.subset)
            except GatewayError as exc:
                return [immediate(exc, client_request_id_of(self.headers.get("x-request-id")))]
            return [destination(endpoints, "request_headers")]
        if self.request_body_mode == BUFFERED:  # Envoy waits for this answer before it sends the body
            return [ext_pb2.ProcessingResponse(request_headers=ext_pb2.HeadersResponse())]
        return []

    async def _request_body(self, message: ext_pb2.HttpBody) -> list[ext_pb2.ProcessingResponse]:
        if self.decided:  # not inference: the body goes on as it comes
            if self.request_body_mode == FULL_DUPLEX:
                return list(streamed_body("request_body", message.body, message.end_of_stream))
            return [ext_pb2.ProcessingResponse(request_body=ext_pb2.BodyResponse())]
        self.body += message.body
        if len(self.body) > self.picker.max_body_bytes:
            limit = self.picker.max_body_bytes
            self.decided = True
            error = BodyTooLarge(
                f"request body has {len(self.body)} bytes or more; this server accepts at most {limit}"
            )
            return [immediate(error, client_request_id_of(self.headers.get("x-request-id")))]
        if not message.end_of_stream:
            return []
        return await self._decide(end_of_stream=True)

    async def _decide(self, end_of_stream: bool) -> list[ext_pb2.ProcessingResponse]:
        if self.decided:
            return []
        self.decided = True
        client_request_id = client_request_id_of(self.headers.get("x-request-id"))
        try:
            request = self.picker.parse(self.path, self.headers, bytes(self.body))
            try:
                self.pick = await self.picker.decide(request, self.subset, client_request_id)
            except ModelNotFound:
                # As GIE's picker does with a model it has no objective for: on to a model server, which
                # answers for it (a 404 in OpenAI's body, or an adapter this config does not name).
                return self._pass_on(self.picker.any_endpoints(self.subset), end_of_stream)
        except GatewayError as exc:
            self.picker.metrics.errors.labels(type(exc).__name__).inc()
            return [immediate(exc, client_request_id)]
        return self._pass_on(self.pick.endpoints, end_of_stream)

    def _pass_on(self, endpoints: list[str], end_of_stream: bool) -> list[ext_pb2.ProcessingResponse]:
        """The destination, then the gathered body (FULL_DUPLEX_STREAMED) or nothing more (BUFFERED)."""
        if self.request_body_mode == BUFFERED:
            return [destination(endpoints, "request_body", self.rewritten_path)]
        body, self.body = bytes(self.body), bytearray()
        return [
            destination(endpoints, "request_headers", self.rewritten_path),
            *streamed_body("request_body", body, end_of_stream),
        ]

    def _response_headers(self, message: ext_pb2.ProcessingRequest) -> list[ext_pb2.ProcessingResponse]:
        headers = _headers_of(message.response_headers)
        try:
            self.status = int(headers.get(":status", "0"))
        except ValueError:
            self.status = 0
        self.is_sse = headers.get("content-type", "").startswith("text/event-stream")
        mutation = ext_pb2.HeaderMutation(remove_headers=[SERVED])
        pick = self.pick
        if pick is not None:
            served = _metadata_value(message, LB_NAMESPACE, SERVED) or headers.get(SERVED)
            self.picker.served(pick, served if isinstance(served, str) else None)
            mutation = ext_pb2.HeaderMutation(
                set_headers=header_options(
                    {
                        "x-kvroute-worker": pick.route.worker_id,
                        "x-kvroute-route": pick.route.header(),
                        "x-request-id": pick.client_request_id or pick.request_id,
                    }
                ),
                remove_headers=[SERVED],
            )
            if message.response_headers.end_of_stream:
                self.picker.finish(pick, None, self.status)
        return [
            ext_pb2.ProcessingResponse(
                response_headers=ext_pb2.HeadersResponse(response=ext_pb2.CommonResponse(header_mutation=mutation))
            )
        ]

    def _response_body(self, message: ext_pb2.HttpBody) -> list[ext_pb2.ProcessingResponse]:
        pick = self.pick
        if pick is not None and not pick.finished:
            if pick.first_byte is None and message.body:
                pick.first_byte = time.perf_counter()
                if pick.grant is not None and pick.path.flow is not None:
                    pick.path.flow.started(pick.grant)
            if self.is_sse:
                self.kept = (self.kept + message.body)[-USAGE_TAIL_BYTES:]
            elif len(self.kept) + len(message.body) <= JSON_KEEP_BYTES:
                self.kept += message.body
            if message.end_of_stream:
                self.picker.finish(pick, _usage(self.is_sse, bytes(self.kept)), self.status)
        if self.response_body_mode == FULL_DUPLEX:
            return list(streamed_body("response_body", message.body, message.end_of_stream))
        return [ext_pb2.ProcessingResponse(response_body=ext_pb2.BodyResponse())]

    def close(self) -> None:
        if self.pick is not None:
            self.picker.finish(self.pick, _usage(self.is_sse, bytes(self.kept)) if self.kept else None, self.status)


def _trailers(kind: str) -> ext_pb2.ProcessingResponse:
    return ext_pb2.ProcessingResponse(**{kind: ext_pb2.TrailersResponse()})
