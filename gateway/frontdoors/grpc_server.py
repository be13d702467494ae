"""The gateway's gRPC front door (proto/gateway.proto), on one port:

- `kvroute.v1.Gateway.Generate`: a text prompt, chat messages or token ids in; text, tokens, logprobs, the
  finish reason and usage streamed out, with the route in the initial metadata (`x-kvroute-worker`,
  `x-kvroute-route`, `x-request-id`) and in the first reply.
- `kvroute.v1.Worker`, so that a token-level client treats the gateway as one large worker: Generate is
  routed like any request (the gateway's auth, limits, retries and tenant salt apply; it reaches the worker with
  the gateway's own worker token, never the client's `authorization`, which is its API key); GetInfo describes
  the fleet (the gateway's model, block size and fingerprints; the smallest context among its workers).
  GetStats and GetKVEvents answer UNIMPLEMENTED: they are one engine's books (its occupancy, its event
  sequence numbers and incarnation), which a fleet does not have; summing them would give a reader numbers
  that match no worker and event sequences that are not a sequence. The fleet's load is in GET /metrics,
  and a reader of KV events reads each worker (or Redis).
- `grpc.health.v1.Health`: SERVING while the request path has a routable worker, checked every second.

The HTTP door's guard rails, as gRPC has them:
- a request message past `max_body_bytes` (the gateway's `--max-body-bytes`) is refused RESOURCE_EXHAUSTED
  before it is parsed (gRPC reads the message's length prefix before deserializing it);
- a connection accepted while the server holds `max_connections` (`--max-connections`) is closed at once,
  before its HTTP/2 handshake (`grpc.max_allowed_incoming_connections`; the client sees UNAVAILABLE), and
  the connections already open are served on;
- metadata is bounded by gRPC's own limits (RESOURCE_EXHAUSTED: always past 16 KiB, at random past 8 KiB).
Streams per connection are not capped: a call without a valid key is refused before its handler, and a
tenant's calls count against its concurrency limit.

With API keys configured, every call but health's is authenticated before its handler runs
(`AuthenticateFirst`; two `authorization` entries are INVALID_ARGUMENT, so every reader of the key reads the
one there is). Both Generate methods translate to a `GatewayRequest` and back, and nothing else; a
`GatewayError` becomes its gRPC status (`grpc_code`), whose message starts with the field at fault (quoting
at most a short prefix of the client's value), with trailing metadata `retry-after` when it has one. A
cancelled call closes the Generation, which cancels its worker requests.
"""

from __future__ import annotations

import logging
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import grpc
import pydantic_core

from gateway.admission.auth import Authenticator
from gateway.admission.limits import Limits
from gateway.errors import GatewayError, InvalidRequestError, quoted
from gateway.fleet.fleet_state import FleetIdentity, WorkerMember
from gateway.frontdoors.grpc_health import ReadinessHealth
from gateway.frontdoors.http_protocol import HttpLimits
from gateway.frontdoors.openai_protocol import (
    COMPLETION_DEFAULT_MAX_TOKENS,
    PRIORITY_HEADER,
    RequestHeaders,
    bearer_token,
    client_request_id_of,
    priority_header,
)
from gateway.metrics import GatewayMetrics
from gateway.request import PRIORITY_RANGE, Chunk, GatewayRequest, Generation, TokenLogprob
from kvroute.grpc_options import SERVER_OPTIONS, grpc_address
from kvroute.proto_maps import FINISH_REASONS
from kvroute.sampling import InvalidRequest, SamplingParams
from kvroute.sampling_proto import sampling_from_proto
from proto import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

GATEWAY_SERVICE = gateway_pb2.DESCRIPTOR.services_by_name["Gateway"].full_name  # "kvroute.v1.Gateway"
WORKER_SERVICE = worker_pb2.DESCRIPTOR.services_by_name["Worker"].full_name  # "kvroute.v1.Worker"
HEALTH_INTERVAL_S = 1.0
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


class ServesPool(Protocol):
    """What the Worker service's GetInfo reads of one pool (gateway.request_path.RequestPath)."""

    identity: FleetIdentity  # what the gateway hashes and tokenizes with
    vocab_size: int

    def members(self) -> list[WorkerMember]: ...


class ServesFleet(Protocol):
    """What the gRPC front door needs of gateway.request_path.RequestPath (one pool) or gateway.pools.Pools
    (whose `generate` picks the pool by the request's model)."""

    auth: Authenticator  # checked before a call's request is looked at (AuthenticateFirst)
    metrics: GatewayMetrics  # the front door counts the requests it refuses before the path sees them

    async def generate(self, request: GatewayRequest) -> Generation: ...

    def pool(self, model: str | None) -> ServesPool:
        """The pool serving `model`; raises GatewayError (404 unknown, 400 when None names several)."""
        ...

    def ready(self) -> bool: ...


# -- wire -> GatewayRequest ------------------------------------------------------------------------------------


def call_headers(context: grpc.aio.ServicerContext) -> tuple[RequestHeaders, str | None]:
    """The call's metadata as the HTTP front door reads headers, and the client's x-request-id (when sane
    to echo, as on the HTTP door). Raises InvalidRequestError for a bad x-kvroute-priority."""
    metadata = {key.lower(): value for key, value in context.invocation_metadata() or () if isinstance(value, str)}
    trace = {name: metadata[name] for name in ("traceparent", "tracestate") if name in metadata}
    headers = RequestHeaders(
        api_key=bearer_token(metadata.get("authorization")),
        session_id=metadata.get("x-session-id") or None,
        app=metadata.get("x-kvroute-app") or None,
        trace_context=trace,
        priority=priority_header(metadata.get(PRIORITY_HEADER)),
    )
    return headers, client_request_id_of(metadata.get("x-request-id"))


def checked_sampling(msg: worker_pb2.SamplingParams, default_max_tokens: int, prefix: str = "") -> SamplingParams:
    """kvroute.sampling_proto's conversion, validated: raises InvalidRequestError naming the first bad field
    (as `prefix` + its name)."""
    params = sampling_from_proto(msg, default_max_tokens)
    try:
        params.validate()
    except InvalidRequest as exc:
        raise InvalidRequestError(str(exc).removeprefix(f"{exc.field}: "), param=f"{prefix}{exc.field}") from None
    return params


def gateway_request_from_proto(
    msg: gateway_pb2.GatewayGenerateRequest, headers: RequestHeaders, default_max_tokens: int | None
) -> GatewayRequest:
    """The internal request of a Gateway.Generate call; raises InvalidRequestError naming the field."""
    which = msg.WhichOneof("input")
    fields: dict[str, Any] = {}
    if which is None:
        raise InvalidRequestError("set one of prompt, chat, prompt_token_ids", param="input")
    if msg.tools_json and which != "chat":
        raise InvalidRequestError("applies to chat input only (the chat template reads it)", param="tools_json")
    if which == "prompt":
        if not msg.prompt:
            raise InvalidRequestError("is empty", param="prompt")
        fields = {"prompt": msg.prompt, "kind": "completion"}
    elif which == "prompt_token_ids":
        if not msg.prompt_token_ids.ids:
            raise InvalidRequestError("is empty; send at least one token id", param="prompt_token_ids")
        fields = {"prompt_token_ids": list(msg.prompt_token_ids.ids), "kind": "tokens"}
    else:
        fields = {"messages": _messages(msg.chat.messages), "kind": "chat", "template_kwargs": _tools(msg.tools_json)}
    chat_default = default_max_tokens if default_max_tokens is not None else COMPLETION_DEFAULT_MAX_TOKENS
    max_tokens = chat_default if which == "chat" else COMPLETION_DEFAULT_MAX_TOKENS
    stops = tuple(msg.stop)
    for i, stop in enumerate(stops):
        if not stop:
            raise InvalidRequestError("must not be an empty string", param=f"stop[{i}]")
    return GatewayRequest(
        api_key=headers.api_key,
        model=msg.model or None,
        params=checked_sampling(msg.sampling, max_tokens, prefix="sampling."),
        max_tokens_defaulted=not msg.sampling.HasField("max_tokens"),
        stop=stops,
        n=msg.n or 1,
        session_id=headers.session_id or msg.session_id or None,
        app=headers.app or msg.app or None,
        priority=headers.priority,
        client_cache_salt=msg.cache_salt,
        skip_special_tokens=not msg.keep_special_tokens,
        stream=True,
        trace_context=headers.trace_context,
        **fields,
    )


def _messages(messages: Sequence[gateway_pb2.ChatMessage]) -> list[dict[str, Any]]:
    if not messages:
        raise InvalidRequestError("is empty; send at least one message", param="chat.messages")
    out = []
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            roles = ", ".join(sorted(CHAT_ROLES))
            raise InvalidRequestError(
                f"must be one of {roles}, got {quoted(message.role)}", param=f"chat.messages[{i}].role"
            )
        entry = {"role": message.role, "content": message.content}
        if message.name:
            entry["name"] = message.name
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        out.append(entry)
    return out


def _tools(tools_json: str) -> dict[str, Any]:
    """The tools, parsed as the HTTP door parses its bodies (pydantic's JSON parser, with its nesting bound:
    a deeper document is refused by name instead of exhausting Python's recursion)."""
    if not tools_json:
        return {}
    try:
        tools = pydantic_core.from_json(tools_json, allow_inf_nan=False)
    except ValueError as exc:
        raise InvalidRequestError(f"is not valid JSON: {exc}", param="tools_json") from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise InvalidRequestError("must be a JSON array of tool objects", param="tools_json")
    return {"tools": tools}


def worker_request_to_gateway(msg: worker_pb2.GenerateRequest, headers: RequestHeaders) -> GatewayRequest:
    """A token-level client's Worker.Generate as a routed request. The client's request_id is not used
    (the gateway names its worker requests itself, so two clients' ids can never collide on a worker), nor
    its block_hashes (the gateway computes its own). Its `priority` counts as the body's (x-kvroute-priority
    wins)."""
    priority = headers.priority
    if priority is None and msg.HasField("priority"):
        priority = msg.priority
        if not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
            low, high = PRIORITY_RANGE
            raise InvalidRequestError(f"must be an integer in [{low}, {high}], got {priority}", param="priority")
    return GatewayRequest(
        api_key=headers.api_key,
        model=None,
        prompt_token_ids=list(msg.prompt_token_ids),
        params=checked_sampling(msg.sampling, SamplingParams().max_tokens),
        session_id=headers.session_id,
        app=headers.app,
        priority=priority,
        client_cache_salt=msg.cache_salt,
        stream=True,
        kind="tokens",
        trace_context=dict(msg.trace_context) or headers.trace_context,
    )


# -- Generation -> wire ------------------------------------------------------------------------------------------


def _logprob_proto(lp: TokenLogprob) -> gateway_pb2.TokenLogprob:
    return gateway_pb2.TokenLogprob(
        token=lp.token,
        token_id=lp.token_id,
        logprob=lp.logprob,
        token_bytes=bytes(lp.bytes),
        top_logprobs=[_logprob_proto(top) for top in lp.top],
    )


def gateway_reply(chunk: Chunk) -> gateway_pb2.GatewayGenerateResponse:
    return gateway_pb2.GatewayGenerateResponse(
        index=chunk.index,
        text=chunk.text,
        token_ids=chunk.token_ids,
        logprobs=[_logprob_proto(lp) for lp in chunk.logprobs],
        finish_reason=FINISH_REASONS.get(chunk.finish_reason or "", worker_pb2.FINISH_REASON_UNSPECIFIED),
    )


def worker_reply(chunk: Chunk) -> worker_pb2.GenerateResponse:
    return worker_pb2.GenerateResponse(
        token_ids=chunk.token_ids,
        logprobs=[lp.logprob for lp in chunk.logprobs],
        top_logprobs=[
            worker_pb2.TopLogprobs(token_ids=[t.token_id for t in lp.top], logprobs=[t.logprob for t in lp.top])
            for lp in chunk.logprobs
            if lp.top
        ],
        finish_reason=FINISH_REASONS.get(chunk.finish_reason or "", worker_pb2.FINISH_REASON_UNSPECIFIED),
    )


def usage_proto(generation: Generation) -> worker_pb2.Usage:
    usage = generation.usage
    return worker_pb2.Usage(
        prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens, cached_tokens=usage.cached_tokens
    )


async def abort(context: grpc.aio.ServicerContext, exc: GatewayError) -> NoReturn:
    trailing = tuple(exc.http_headers().items())  # retry-after, when the error has one
    await context.abort(exc.grpc_code, exc.message, trailing_metadata=trailing)
    raise AssertionError("unreachable: context.abort raises")


async def start_generation(
    request_path: ServesFleet, request: GatewayRequest, context: grpc.aio.ServicerContext, client_request_id: str | None
) -> Generation:
    """Route the request and send the route as initial metadata; a refusal aborts the call with its status."""
    try:
        generation = await request_path.generate(request)
    except GatewayError as exc:
        await abort(context, exc)
    metadata = (
        ("x-kvroute-worker", generation.route.worker_id),
        ("x-kvroute-route", generation.route.header()),
        ("x-request-id", client_request_id or generation.request_id),
    )
    try:
        await context.send_initial_metadata(metadata)
    except BaseException:  # the call was cancelled meanwhile: nobody will iterate this Generation
        await generation.aclose()
        raise
    return generation


# -- services ------------------------------------------------------------------------------------------------


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    """`kvroute.v1.Gateway`: text, chat or token ids in; text, tokens and usage out (see the module docstring)."""

    def __init__(self, request_path: ServesFleet, default_max_tokens: int | None) -> None:
        self.request_path = request_path
        self.default_max_tokens = default_max_tokens

    async def Generate(
        self, request: gateway_pb2.GatewayGenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[gateway_pb2.GatewayGenerateResponse]:
        try:
            headers, client_request_id = call_headers(context)  # a bad x-kvroute-priority: 400
            gateway_request = gateway_request_from_proto(request, headers, self.default_max_tokens)
        except GatewayError as exc:
            self.request_path.metrics.errors.labels(type(exc).__name__).inc()
            await abort(context, exc)
        generation = await start_generation(self.request_path, gateway_request, context, client_request_id)
        route = gateway_pb2.RouteMetadata(
            worker_id=generation.route.worker_id,
            route=generation.route.header(),
            request_id=client_request_id or generation.request_id,
        )
        try:
            first = True
            async for chunk in generation:
                reply = gateway_reply(chunk)
                if first:
                    reply.route.CopyFrom(route)
                    first = False
                yield reply
            last = gateway_pb2.GatewayGenerateResponse(usage=usage_proto(generation))
            if first:
                last.route.CopyFrom(route)
            yield last
        except GatewayError as exc:
            await abort(context, exc)
        finally:
            await generation.aclose()


class FleetWorkerServicer(worker_pb2_grpc.WorkerServicer):
    """`kvroute.v1.Worker` answered by the whole fleet (see the module docstring)."""

    def __init__(self, request_path: ServesFleet) -> None:
        self.request_path = request_path
        self.incarnation = random.getrandbits(63)
        self.worker_id = f"gateway-{socket.gethostname()}"

    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        try:
            headers, client_request_id = call_headers(context)  # a bad x-kvroute-priority: 400
            gateway_request = worker_request_to_gateway(request, headers)
        except GatewayError as exc:
            self.request_path.metrics.errors.labels(type(exc).__name__).inc()
            await abort(context, exc)
        generation = await start_generation(self.request_path, gateway_request, context, client_request_id)
        try:
            # A worker's last message has finish_reason and usage together, and the usage is final only
            # once the Generation has ended: hold the finishing chunk back until then.
            finishing: Chunk | None = None
            async for chunk in generation:
                if chunk.finish_reason is not None:
                    finishing = chunk
                elif chunk.token_ids:
                    yield worker_reply(chunk)
            last = worker_reply(finishing) if finishing is not None else worker_pb2.GenerateResponse()
            if finishing is None:
                last.finish_reason = worker_pb2.FINISH_REASON_ABORT
            last.usage.CopyFrom(usage_proto(generation))
            yield last
        except GatewayError as exc:
            await abort(context, exc)
        finally:
            await generation.aclose()

    async def GetInfo(self, request: worker_pb2.GetInfoRequest, context: grpc.aio.ServicerContext) -> Any:
        """The fleet as one worker: the gateway's own identity (what its hashes and token ids are computed
        with) and the smallest context among the workers that match it, so a prompt that fits fits all."""
        try:
            pool = self.request_path.pool(None)  # the fleet as one worker is one model's
        except GatewayError as exc:
            await abort(context, exc)
        identity = pool.identity
        matching = [m for m in pool.members() if m.parity_ok]
        if not matching:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker with the gateway's model is in the fleet")
        return worker_pb2.WorkerInfo(
            model_id=identity.model_id,
            block_size=identity.block_size,
            hash_fingerprint=identity.hash_fingerprint,
            tokenizer_fingerprint=identity.tokenizer_fingerprint,
            max_model_len=min(m.max_model_len for m in matching),
            vocab_size=pool.vocab_size,
            worker_id=self.worker_id,
            incarnation=self.incarnation,
        )

    async def GetStats(self, request: worker_pb2.GetStatsRequest, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "GetStats is one engine's books; the gateway is a fleet: read the gateway's GET /metrics, or each "
            "worker's GetStats",
        )

    async def GetKVEvents(self, request: worker_pb2.GetKVEventsRequest, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "GetKVEvents is one worker's event sequence; a fleet has none: read each worker's, or Redis",
        )


# -- the server ----------------------------------------------------------------------------------------------


class AuthenticateFirst(grpc.aio.ServerInterceptor):
    """With API keys configured, every call but `grpc.health.v1`'s must carry a valid key
    (`authorization: Bearer <key>`) before its handler runs: an anonymous caller gets UNAUTHENTICATED and
    learns nothing else (not which fields are wrong, not the fleet's GetInfo). The request path authenticates
    Generate again (it is the contract of every caller). The keys are the request path's at each call, so a
    SIGHUP reload applies here too."""

    def __init__(self, request_path: ServesFleet) -> None:
        self.request_path = request_path
        self.metrics = request_path.metrics

    @property
    def auth(self) -> Authenticator:
        return self.request_path.auth

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:  # fmt: skip
        handler = await continuation(details)
        if handler is None or self.auth.open or details.method.startswith("/grpc.health.v1."):
            return handler
        keys = [v for k, v in details.invocation_metadata or () if k.lower() == "authorization"]
        try:
            if len(keys) > 1:
                raise InvalidRequestError(f"the call has {len(keys)} authorization entries; send one")
            key = keys[0] if keys else None
            self.auth.authenticate(bearer_token(key if isinstance(key, str) else None))
        except GatewayError as exc:
            self.metrics.errors.labels(type(exc).__name__).inc()
            return _refusing(handler, exc)
        return handler


def _refusing(handler: grpc.RpcMethodHandler, exc: GatewayError) -> grpc.RpcMethodHandler:
    """A handler of `handler`'s kind that aborts every call with `exc`."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await abort(context, exc)

    serializers = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, **serializers)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse, **serializers)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **serializers)
    return grpc.stream_stream_rpc_method_handler(refuse, **serializers)


@dataclass
class GatewayGrpcServer:
    server: grpc.aio.Server
    port: int
    health: ReadinessHealth

    async def stop(self, grace: float | None = 5.0) -> None:
        """NOT_SERVING at once, then stop; calls in flight get `grace` seconds to finish."""
        await self.health.stop()
        await self.server.stop(grace)

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


async def start_grpc_server(
    request_path: ServesFleet,
    host: str = "0.0.0.0",
    port: int = 50050,
    *,
    default_max_tokens: int | None = None,
    max_body_bytes: int = Limits().max_body_bytes,
    max_connections: int = HttpLimits().max_connections,
    health_interval_s: float = HEALTH_INTERVAL_S,
) -> GatewayGrpcServer:
    """Serve Gateway, Worker and Health on host:port (port 0 picks a free one; `.port` says which).
    `default_max_tokens` is a chat's max_tokens when the client sets none (the gateway's --max-tokens);
    `max_body_bytes` bounds a request message and `max_connections` the open connections (the module
    docstring)."""
    options = (
        *(option for option in SERVER_OPTIONS if option[0] != "grpc.max_receive_message_length"),
        ("grpc.max_receive_message_length", max_body_bytes),
        ("grpc.max_allowed_incoming_connections", max_connections),
    )
    server = grpc.aio.server(options=options, interceptors=[AuthenticateFirst(request_path)])
    gateway_pb2_grpc.add_GatewayServicer_to_server(GatewayServicer(request_path, default_max_tokens), server)
    worker_pb2_grpc.add_WorkerServicer_to_server(FleetWorkerServicer(request_path), server)
    health = ReadinessHealth(
        server, ("", GATEWAY_SERVICE, WORKER_SERVICE), ready=request_path.ready, interval_s=health_interval_s,
        label="gateway gRPC health", not_ready="no routable worker",
    )  # fmt: skip
    bound = server.add_insecure_port(grpc_address(host, port))
    if bound == 0:
        raise OSError(f"cannot listen on {grpc_address(host, port)}")
    await server.start()
    await health.start()
    return GatewayGrpcServer(server, bound, health)
