"""The gateway's OpenAI-compatible HTTP front door: an ASGI app (served by uvicorn with uvloop and httptools)
whose generation endpoints the connection's protocol calls without ASGI (`hot_endpoints`, served by
gateway.frontdoors.http_protocol.HotCycle), the rest through Starlette.

    POST /v1/completions, /v1/chat/completions ─► parse (openai_protocol) ─► GatewayRequest
        ─► RequestPath.generate ─► Generation ─► JSON body, or server-sent events ending in `data: [DONE]`
    POST /tokenize, /detokenize (vLLM's bodies) ─► RequestPath.tokenize / detokenize ─► JSON body
    GET /v1/models, /v1/models/{id}, /health (alive), /ready (a routable worker), /openapi.json

Prometheus metrics are not on this port: they list workers and per-app series that API clients have no
business reading, so they are served apart (`--metrics-port`, gateway.metrics.metrics_app).

Starlette rather than FastAPI (why, measured: docs/gateway.md, "Why Starlette, not FastAPI"): what FastAPI would
add here (body parsing, the OpenAPI document) is done explicitly below with the same pydantic models.

The contract every response keeps:
- With API keys configured, a /v1/, /tokenize or /detokenize request without a valid key gets 401 before its
  body is read (`AuthenticateFirst`), whatever else is wrong with it.
- Errors are OpenAI's body `{"error": {"message", "type", "param", "code"}}` with the status of the
  `GatewayError` (gateway.errors): 400 naming the field (never a 422), 401, 404, 413 (the body limit is
  enforced while reading, before the body is held whole), 429 with Retry-After, 503. Any other exception is
  logged and answered 500 in the same shape, and the server keeps serving. The connection's own refusals
  (malformed HTTP 400, 408, 431, 503 over the connection cap) are gateway.frontdoors.http_protocol's, in the same shape.
  A message quotes at most a short prefix of what the client sent (`errors.quoted`).
- Once routed, every response (streamed or not, errors included) carries `x-kvroute-worker` and
  `x-kvroute-route`; every response carries `x-request-id` (the client's, echoed, or the gateway's own).
- An error after a stream started is one last `data: {"error": ...}` event, then `data: [DONE]`.
- A client that disconnects (mid-stream, or while waiting for a whole response) closes the Generation,
  which cancels its worker requests and frees their blocks.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar

import orjson
from pydantic.json_schema import models_json_schema
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.admission.auth import Authenticator
from gateway.admission.limits import Limits
from gateway.errors import GatewayError, InvalidRequestError, quoted
from gateway.frontdoors.http_protocol import Exchange, body_too_large, internal_error
from gateway.frontdoors.openai_protocol import (
    PRIORITY_HEADER,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelList,
    OpenAIModel,
    RequestHeaders,
    SamplingFields,
    TokenizeRequest,
    TokenizeResponse,
    bearer_token,
    client_request_id_of,
    parse_request,
    priority_header,
)
from gateway.metrics import GatewayMetrics
from gateway.request import Chunk, GatewayRequest, Generation, TokenizeResult, TokenLogprob, Usage
from kvroute.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = Limits().max_body_bytes
JSON = "application/json"
T = TypeVar("T")
M = TypeVar("M", bound=OpenAIModel)
# Where a client must present its API key (AuthenticateFirst): the OpenAI API and vLLM's tokenizer endpoints.
AUTHENTICATED_PREFIX = "/v1/"
AUTHENTICATED_PATHS = frozenset({"/tokenize", "/detokenize"})


class ServesModel(Protocol):
    """What the front door needs of one pool (gateway.request_path.RequestPath)."""

    served_model_name: str
    served_model_names: tuple[str, ...]  # the name above first, then its aliases
    tokenizer: Tokenizer  # /tokenize's token_strs

    async def generate(self, request: GatewayRequest) -> Generation: ...

    async def tokenize(self, request: GatewayRequest) -> TokenizeResult: ...

    async def detokenize(self, api_key: str | None, model: str | None, token_ids: list[int]) -> str: ...

    def max_model_len(self) -> int: ...


class ServesRequests(Protocol):
    """What the front door needs of gateway.request_path.RequestPath (one pool) or gateway.pools.Pools."""

    auth: Authenticator  # checked before a /v1/ request is read (AuthenticateFirst)
    metrics: GatewayMetrics  # the front door counts the requests it refuses before the path sees them

    def pool(self, model: str | None) -> ServesModel:
        """The pool serving the request's `model`; raises GatewayError (404 unknown, 400 ambiguous)."""
        ...

    def pools(self) -> Sequence[ServesModel]: ...

    def routable_workers(self) -> int: ...


def build_app(
    request_path: ServesRequests,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    default_max_tokens: int | None = None,
    extra_routes: Sequence[BaseRoute] = (),
) -> ASGIApp:
    """The HTTP app over one request path. `max_body_bytes` bounds a request body (413 past it);
    `default_max_tokens` is a chat request's max_tokens when the client sets none (completions default to
    OpenAI's 16); `extra_routes` are matched first (a worker's front door serves its engine's /metrics and
    its own /health).

    The app is AuthenticateFirst over a Starlette app, and names the generation endpoints in `hot_endpoints`:
    the HTTP protocol (gateway.frontdoors.http_protocol) serves a POST to one of those paths without ASGI,
    everything else through Starlette's routing (the same endpoints are routes there too: a wrong method is
    Starlette's 405, and any other ASGI server reaches them there)."""
    server = OpenAIServer(request_path, max_body_bytes, default_max_tokens)
    generation = (
        GenerationEndpoint(server, "/v1/completions", CompletionRequest, CompletionRenderer),
        GenerationEndpoint(server, "/v1/chat/completions", ChatCompletionRequest, ChatRenderer),
    )
    routes = [
        *extra_routes,
        *(Route(endpoint.path, endpoint, methods=["POST"]) for endpoint in generation),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
        Route("/v1/models", server.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", server.get_model, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/ready", server.ready, methods=["GET"]),
        Route("/openapi.json", server.openapi, methods=["GET"]),
    ]
    app = Starlette(
        routes=routes, exception_handlers={HTTPException: _http_exception, Exception: _unexpected_exception}
    )
    taken = {path for route in extra_routes if (path := getattr(route, "path", None))}
    hot = {endpoint.path.encode(): endpoint for endpoint in generation if endpoint.path not in taken}
    return AuthenticateFirst(app, request_path=request_path, hot_endpoints=hot)


class AuthenticateFirst:
    """Every /v1/, /tokenize and /detokenize request's API key is checked before anything else of the request
    is read, parsed or routed: a client without a valid key gets 401 and learns nothing else (not the body
    limit, not which fields are wrong, not the served model's name). /health, /ready, /metrics and
    /openapi.json stay open. The request path authenticates again (it is the contract of every caller); a key
    is one SHA-256. The keys are the request path's at each request, so a SIGHUP reload applies here too.
    `hot_endpoints` (raw path: endpoint) are what the HTTP protocol serves without ASGI; they call `refusal`
    themselves first."""

    def __init__(
        self, app: ASGIApp, request_path: ServesRequests, hot_endpoints: Mapping[bytes, GenerationEndpoint]
    ) -> None:
        self.app = app
        self.request_path = request_path
        self.metrics = request_path.metrics
        self.hot_endpoints = hot_endpoints

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        authenticated = path.startswith(AUTHENTICATED_PREFIX) or path in AUTHENTICATED_PATHS
        if scope["type"] == "http" and authenticated and (refused := refusal(self.request_path, scope["headers"])):
            await reply_response(refused)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def refusal(request_path: ServesRequests, headers: list[tuple[bytes, bytes]]) -> Reply | None:
    """The 401 for a request without a valid API key (AuthenticateFirst), or the 400 for one with two
    `Authorization` headers (the one place that decides: every later reader takes the first, which is then
    the only one), counted; None when the key is valid or the gateway is open. `headers` are the head's (the
    HTTP protocol refuses trailers)."""
    auth = request_path.auth
    if auth.open:
        return None
    keys = [value for name, value in headers if name == b"authorization"]
    try:
        if len(keys) > 1:
            raise InvalidRequestError(f"the request has {len(keys)} Authorization headers; send one")
        auth.authenticate(bearer_token(keys[0].decode("latin-1") if keys else None))
    except GatewayError as exc:
        request_path.metrics.errors.labels(type(exc).__name__).inc()
        request_id = next((value for name, value in headers if name == b"x-request-id"), b"")
        return error_reply(
            exc, {"x-request-id": client_request_id_of(request_id.decode("latin-1")) or uuid.uuid4().hex}
        )
    return None


class Reply(NamedTuple):
    """A whole JSON response."""

    status: int
    headers: dict[str, str]
    body: bytes


class StreamReply(NamedTuple):
    """A 200 of server-sent events; `close` runs however the stream ends, also when it never started."""

    headers: dict[str, str]
    events: AsyncGenerator[bytes, None]
    close: Callable[[], Awaitable[None]]


class GenerationEndpoint:
    """POST /v1/completions or /v1/chat/completions over an `Exchange`: the HTTP protocol's own
    (gateway.frontdoors.http_protocol.HotCycle, `serve`), or ASGI's (`__call__`, Starlette's route). An
    exception that escapes the request path is logged and answered 500 in OpenAI's shape."""

    def __init__(
        self, server: OpenAIServer, path: str, wire_type: type[SamplingFields], renderer_type: type[Renderer]
    ) -> None:
        self.server = server
        self.path = path
        self.wire_type = wire_type
        self.renderer_type = renderer_type
        self.max_body_bytes = server.max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.serve(AsgiExchange(scope, receive, send, self.max_body_bytes))

    async def serve(self, exchange: Exchange) -> None:
        try:
            reply = refusal(self.server.request_path, exchange.headers) or await self.server.generate(
                exchange, self.wire_type, self.renderer_type
            )
        except Exception:
            logger.exception("POST %s failed", self.path)
            reply = error_reply(internal_error())
        if isinstance(reply, StreamReply):
            try:
                await exchange.stream(reply.headers, reply.events)
            finally:
                await reply.close()
        else:
            await exchange.respond(*reply)


class AsgiExchange:
    """An `Exchange` over ASGI: what GenerationEndpoint reads and writes when a server other than
    gateway.frontdoors.http_protocol's calls it."""

    def __init__(self, scope: Scope, receive: Receive, send: Send, max_body_bytes: int) -> None:
        self.headers: list[tuple[bytes, bytes]] = scope["headers"]
        self.scope, self.receive, self.send = scope, receive, send
        self.max_body_bytes = max_body_bytes

    async def body(self) -> bytes:
        return await read_body(self.receive, None, self.max_body_bytes)

    async def until_disconnected(self, work: Awaitable[T]) -> T | None:
        return await until_disconnected(self.receive, work)

    async def respond(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        await reply_response(Reply(status, dict(headers), body))(self.scope, self.receive, self.send)

    async def stream(self, headers: Mapping[str, str], events: AsyncGenerator[bytes, None]) -> None:
        await EventStreamResponse(events, dict(headers))(self.scope, self.receive, self.send)


class OpenAIServer:
    """The endpoints' handlers over one request path (routes in `build_app`)."""

    def __init__(
        self,
        request_path: ServesRequests,
        max_body_bytes: int,
        default_max_tokens: int | None,
    ) -> None:
        self.request_path = request_path
        self.max_body_bytes = max_body_bytes
        self.default_max_tokens = default_max_tokens
        self.started = int(time.time())
        self._openapi = orjson.dumps(openapi_document())

    # -- generation endpoints (GenerationEndpoint) -------------------------------------------------------

    async def generate(
        self, exchange: Exchange, wire_type: type[SamplingFields], renderer_type: type[Renderer]
    ) -> Reply | StreamReply:
        """The response to one generation request."""
        headers = hot_headers(exchange.headers)
        client_request_id = client_request_id_of(headers.get("x-request-id"))
        try:
            check_content_length(headers.get("content-length"), self.max_body_bytes)
            body = await exchange.body()
            wire = parse_request(wire_type, body)
            gateway_request = wire.to_gateway_request(request_headers(headers), self.default_max_tokens)
            gateway_request.api_json = body
        except ClientDisconnect:  # left (or was cut off by the connection's timeouts) mid-body
            return NOBODY_LISTENS
        except GatewayError as exc:
            self.request_path.metrics.errors.labels(type(exc).__name__).inc()
            return error_reply(exc, {"x-request-id": client_request_id or uuid.uuid4().hex})
        # generate() returns at the first token, a whole response at the last: a client that leaves before
        # either (a long prefill, a long answer) cancels the work, which cancels the worker requests.
        work = self._answer(gateway_request, wire, renderer_type, client_request_id)
        reply = await exchange.until_disconnected(work)
        return NOBODY_LISTENS if reply is None else reply

    async def _answer(
        self,
        gateway_request: GatewayRequest,
        wire: SamplingFields,
        renderer_type: type[Renderer],
        client_request_id: str | None,
    ) -> Reply | StreamReply:
        pool: ServesModel | None = None
        try:
            pool = self.request_path.pool(gateway_request.model)
            generation = await pool.generate(gateway_request)
        except GatewayError as exc:
            if pool is None:  # the pool counts its own refusals
                self.request_path.metrics.errors.labels(type(exc).__name__).inc()
            return error_reply(exc, {"x-request-id": client_request_id or uuid.uuid4().hex})
        headers = {
            "x-request-id": client_request_id or generation.request_id,
            "x-kvroute-worker": generation.route.worker_id,
            "x-kvroute-route": generation.route.header(),
        }
        renderer = renderer_type(generation, wire, pool.served_model_name)
        if wire.stream:
            return StreamReply(headers, renderer.events(), generation.aclose)
        try:
            body = await renderer.whole()
        except GatewayError as exc:
            return error_reply(exc, headers)
        return Reply(200, headers, orjson.dumps(body))

    # -- vLLM's tokenizer endpoints -----------------------------------------------------------------------

    async def tokenize(self, request: Request) -> Response:
        """vLLM's /tokenize: `{"count", "max_model_len", "tokens", "token_strs"}` (token_strs null unless
        return_token_strs), the ids a generation with the same prompt or messages is sent with."""

        async def answer(wire: TokenizeRequest) -> dict[str, Any]:
            pool = self.request_path.pool(wire.model)
            result = await pool.tokenize(wire.to_gateway_request(request_headers(request.headers)))
            ids = result.token_ids
            token_strs = [pool.tokenizer.token_text(i) or "" for i in ids] if wire.return_token_strs else None
            return {"count": len(ids), "max_model_len": result.max_model_len, "tokens": ids, "token_strs": token_strs}

        return await self._tokenizer_endpoint(request, TokenizeRequest, answer)

    async def detokenize(self, request: Request) -> Response:
        """vLLM's /detokenize: `{"prompt"}`, the text of the ids with special tokens written out."""

        async def answer(wire: DetokenizeRequest) -> dict[str, Any]:
            api_key = bearer_token(request.headers.get("authorization"))
            return {"prompt": await self.request_path.pool(wire.model).detokenize(api_key, wire.model, wire.tokens)}

        return await self._tokenizer_endpoint(request, DetokenizeRequest, answer)

    async def _tokenizer_endpoint(
        self, request: Request, wire_type: type[M], answer: Callable[[M], Awaitable[dict[str, Any]]]
    ) -> Response:
        """Read and parse the body as `wire_type` (the body limit, OpenAI's error shape), then `answer` it."""
        headers = {"x-request-id": client_request_id_of(request.headers.get("x-request-id")) or uuid.uuid4().hex}
        try:
            body_bytes = await read_body(request.receive, request.headers.get("content-length"), self.max_body_bytes)
            body = await answer(parse_request(wire_type, body_bytes))
        except ClientDisconnect:
            return Response(status_code=499)
        except GatewayError as exc:
            self.request_path.metrics.errors.labels(type(exc).__name__).inc()
            return error_response(exc, headers)
        return Response(orjson.dumps(body), media_type=JSON, headers=headers)

    # -- the rest -----------------------------------------------------------------------------------------

    def _model_card(self, pool: ServesModel, name: str) -> dict[str, Any]:
        """vLLM's card: `max_model_len` is what a router reads to size requests (RequestPath.max_model_len)."""
        return {
            "id": name, "object": "model", "created": self.started, "owned_by": "kvroute", "root": name,
            "parent": None, "max_model_len": pool.max_model_len(),
        }  # fmt: skip

    async def list_models(self, request: Request) -> Response:
        cards = [self._model_card(pool, name) for pool in self.request_path.pools() for name in pool.served_model_names]
        return Response(orjson.dumps({"object": "list", "data": cards}), media_type=JSON)

    async def get_model(self, request: Request) -> Response:
        try:
            name = request.path_params["model"]
            pool = self.request_path.pool(name)
        except GatewayError as exc:
            return error_response(exc)
        return Response(orjson.dumps(self._model_card(pool, name)), media_type=JSON)

    async def health(self, request: Request) -> Response:
        return Response(b'{"status":"ok"}', media_type=JSON)

    async def ready(self, request: Request) -> Response:
        """200 with at least one routable worker, else 503; the body counts them (`kvroute up` waits for all)."""
        workers = self.request_path.routable_workers()
        if workers:
            return Response(orjson.dumps({"status": "ready", "workers": workers}), media_type=JSON)
        return Response(b'{"status":"no routable worker","workers":0}', status_code=503, media_type=JSON)

    async def openapi(self, request: Request) -> Response:
        return Response(self._openapi, media_type=JSON)


# -- reading a request -------------------------------------------------------------------------------------


async def read_body(receive: Receive, content_length: str | None, limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to pass `limit` bytes: at once from the
    Content-Length header's value, else while it streams in (chunked), so an oversize body is never held
    whole. ClientDisconnect if the client leaves before its end."""
    check_content_length(content_length, limit)
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.request":
            part = message.get("body", b"")
            size += len(part)
            if size > limit:
                raise body_too_large(size, limit)
            if not message.get("more_body", False):
                if not parts:
                    return part
                parts.append(part)
                return b"".join(parts)
            parts.append(part)
        elif message["type"] == "http.disconnect":
            raise ClientDisconnect()


def check_content_length(content_length: str | None, limit: int) -> None:
    """413 for a Content-Length header past `limit`, 400 for one that is not a number."""
    if content_length is not None:
        if not content_length.isdigit():
            raise InvalidRequestError(f"Content-Length header {quoted(content_length)} is not a number")
        if int(content_length) > limit:
            raise body_too_large(int(content_length), limit)


# The request headers the generation endpoints read (hot_headers).
_HOT_HEADERS = frozenset(
    (
        b"content-length",
        b"x-request-id",
        b"authorization",
        b"x-session-id",
        b"x-kvroute-app",
        b"x-kvroute-priority",
        b"traceparent",
        b"tracestate",
    )
)


def hot_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The generation endpoints' request headers by (lower-case) name, latin-1 text; of a repeated header
    the first, as Starlette's `Headers.get`."""
    headers: dict[str, str] = {}
    for name, value in raw:
        if name in _HOT_HEADERS:
            headers.setdefault(name.decode("latin-1"), value.decode("latin-1"))
    return headers


def request_headers(headers: Mapping[str, str]) -> RequestHeaders:
    """What the request path reads of the request's headers (`headers` by lower-case name)."""
    trace = {name: headers[name] for name in ("traceparent", "tracestate") if name in headers}
    return RequestHeaders(
        api_key=bearer_token(headers.get("authorization")),
        session_id=headers.get("x-session-id") or None,
        app=headers.get("x-kvroute-app") or None,
        trace_context=trace,
        priority=priority_header(headers.get(PRIORITY_HEADER)),
    )


# -- rendering a Generation ------------------------------------------------------------------------------------


def merge_delta(message: dict[str, Any], delta: dict[str, Any]) -> None:
    """Fold one chat delta's extra fields into a whole message as an OpenAI client does: strings append,
    tool calls merge by their `index` (their arguments append; id, type and name are taken once)."""
    for key, value in delta.items():
        if key == "tool_calls" and isinstance(value, list):
            calls = message.setdefault("tool_calls", [])
            for part in value:
                index = part.get("index", len(calls)) if isinstance(part, dict) else len(calls)
                while len(calls) <= index:
                    calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                call = calls[index]
                for field in ("id", "type"):
                    if part.get(field):
                        call[field] = part[field]
                function = part.get("function") or {}
                call["function"]["name"] += function.get("name") or ""
                call["function"]["arguments"] += function.get("arguments") or ""
        elif isinstance(value, str):
            message[key] = message.get(key, "") + value
        else:
            message[key] = value


def usage_body(usage: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def sse(body: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(body) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class Renderer:
    """Turns one Generation into an endpoint's response body (`whole`) or its stream of events (`events`).
    Both close the Generation however they end, which cancels whatever its workers still compute."""

    object_name = ""
    chunk_object_name = ""
    id_prefix = ""

    def __init__(self, generation: Generation, wire: Any, model: str) -> None:
        self.generation = generation
        self.wire = wire
        self.include_usage = wire.include_usage
        self.head = {
            "id": f"{self.id_prefix}{generation.request_id}",
            "object": self.chunk_object_name if wire.stream else self.object_name,
            "created": int(time.time()),
            "model": model,
        }

    async def whole(self) -> dict[str, Any]:
        texts: dict[int, list[str]] = {}
        logprobs: dict[int, list[TokenLogprob]] = {}
        finish: dict[int, str] = {}
        extras: dict[int, dict[str, Any]] = {}
        try:
            async for chunk in self.generation:
                texts.setdefault(chunk.index, []).append(chunk.text)
                if chunk.extra:
                    merge_delta(extras.setdefault(chunk.index, {}), chunk.extra)
                logprobs.setdefault(chunk.index, []).extend(chunk.logprobs)
                if chunk.finish_reason is not None:
                    finish[chunk.index] = chunk.finish_reason
        finally:
            await self.generation.aclose()
        choices = [
            self.choice(index, "".join(texts.get(index, ())), logprobs.get(index, []), finish.get(index, "abort"))
            for index in range(self.wire.n)
        ]
        for index, extra in extras.items():
            choices[index].get("message", {}).update(extra)
        return {**self.head, "choices": choices, "usage": usage_body(self.generation.usage)}

    async def events(self) -> AsyncGenerator[bytes, None]:
        try:
            for event in self.opening():
                yield sse(event)
            async for chunk in self.generation:
                chunk_event = self.chunk_event(chunk)
                if chunk_event is not None:
                    yield sse(chunk_event)
            if self.include_usage:
                yield sse({**self.head, "choices": [], "usage": usage_body(self.generation.usage)})
        except GatewayError as exc:
            yield sse(exc.to_openai())
        except Exception:  # a bug, not the client's: the stream still ends in OpenAI's shape
            logger.exception("stream %s failed", self.generation.request_id)
            yield sse(internal_error().to_openai())
        finally:
            await self.generation.aclose()
        yield SSE_DONE

    def event(self, choice: dict[str, Any]) -> dict[str, Any]:
        event = {**self.head, "choices": [choice]}
        if self.include_usage:
            event["usage"] = None
        return event

    def opening(self) -> list[dict[str, Any]]:
        return []

    def choice(self, index: int, text: str, logprobs: list[TokenLogprob], finish_reason: str) -> dict[str, Any]:
        raise NotImplementedError

    def chunk_event(self, chunk: Chunk) -> dict[str, Any] | None:
        raise NotImplementedError


class CompletionRenderer(Renderer):
    """`text_completion` bodies and chunks; logprobs as {tokens, token_logprobs, top_logprobs, text_offset}."""

    object_name = chunk_object_name = "text_completion"
    id_prefix = "cmpl-"

    def __init__(self, generation: Generation, wire: Any, model: str) -> None:
        super().__init__(generation, wire, model)
        self.text_offset: dict[int, int] = {}  # per choice: characters of token text so far

    def logprobs(self, index: int, logprobs: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict[str, Any] | None:
        if self.wire.logprobs is None:
            return None
        offset = self.text_offset.get(index, 0)
        offsets = []
        for lp in logprobs:
            offsets.append(offset)
            offset += len(lp.token)
        self.text_offset[index] = offset
        top = []
        for lp in logprobs:
            alternatives = {alt.token: alt.logprob for alt in lp.top}
            alternatives.setdefault(lp.token, lp.logprob)  # the sampled token is always listed (as vLLM does)
            top.append(alternatives)
        return {
            "tokens": [lp.token for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": top,
            "text_offset": offsets,
        }

    def choice(self, index: int, text: str, logprobs: list[TokenLogprob], finish_reason: str) -> dict[str, Any]:
        lp = self.logprobs(index, logprobs)
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": finish_reason}

    def chunk_event(self, chunk: Chunk) -> dict[str, Any] | None:
        if not chunk.text and chunk.finish_reason is None and not chunk.logprobs:
            return None
        lp = self.logprobs(chunk.index, chunk.logprobs)
        choice = {"index": chunk.index, "text": chunk.text, "logprobs": lp, "finish_reason": chunk.finish_reason}
        return self.event(choice)


class ChatRenderer(Renderer):
    """`chat.completion` bodies and `chat.completion.chunk`s; logprobs as OpenAI's chat shape
    {content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}."""

    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"
    id_prefix = "chatcmpl-"

    def logprobs(self, logprobs: list[TokenLogprob] | tuple[TokenLogprob, ...]) -> dict[str, Any] | None:
        if not self.wire.logprobs:
            return None
        return {
            "content": [
                {
                    "token": lp.token,
                    "logprob": lp.logprob,
                    "bytes": lp.bytes,
                    "top_logprobs": [{"token": t.token, "logprob": t.logprob, "bytes": t.bytes} for t in lp.top],
                }
                for lp in logprobs
            ]
        }

    def choice(self, index: int, text: str, logprobs: list[TokenLogprob], finish_reason: str) -> dict[str, Any]:
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": self.logprobs(logprobs), "finish_reason": finish_reason}

    def opening(self) -> list[dict[str, Any]]:
        """OpenAI's first chunk of each choice: the role, no content yet."""
        return [
            self.event(
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            )
            for i in range(self.wire.n)
        ]

    def chunk_event(self, chunk: Chunk) -> dict[str, Any] | None:
        if not chunk.text and chunk.finish_reason is None and not chunk.logprobs and not chunk.extra:
            return None
        delta = {"content": chunk.text} if chunk.text or (chunk.finish_reason is None and not chunk.extra) else {}
        delta.update(chunk.extra)
        choice = {
            "index": chunk.index,
            "delta": delta,
            "logprobs": self.logprobs(chunk.logprobs) if chunk.logprobs else None,
            "finish_reason": chunk.finish_reason,
        }
        return self.event(choice)


# -- responses -----------------------------------------------------------------------------------------------


class EventStreamResponse(Response):
    """Server-sent events from `events`, while listening for the client's disconnect: when the client goes,
    the events' iterator is cancelled and closed, even while no event is due (a long prefill); it is closed
    however the response ends."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[bytes, None], headers: dict[str, str]) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers({**headers, "cache-control": "no-cache"})  # no body set: no Content-Length
        self.events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_all() -> None:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            await until_disconnected(receive, send_all())
        finally:
            await self.events.aclose()


async def until_disconnected(receive: Receive, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None if the client disconnected first: then `work` is cancelled where it waits (so
    its own cleanup runs) and the cancellation ends here. One listener task per call; `work` runs in the
    caller's task."""
    current = asyncio.current_task()
    assert current is not None
    disconnected = False

    async def listen() -> None:
        nonlocal disconnected
        while (await receive())["type"] != "http.disconnect":
            pass
        disconnected = True
        current.cancel()

    listener = asyncio.ensure_future(listen())
    try:
        return await work
    except asyncio.CancelledError:
        if not disconnected:
            raise
        current.uncancel()
        return None
    finally:
        listener.cancel()


NOBODY_LISTENS = Reply(499, {}, b"")  # the client left: written nowhere


def error_reply(exc: GatewayError, headers: dict[str, str] | None = None) -> Reply:
    return Reply(exc.http_status, {**(headers or {}), **exc.http_headers()}, orjson.dumps(exc.to_openai()))


def reply_response(reply: Reply) -> Response:
    return Response(reply.body, status_code=reply.status, media_type=JSON, headers=reply.headers)


def error_response(exc: GatewayError, headers: dict[str, str] | None = None) -> Response:
    return reply_response(error_reply(exc, headers))


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own refusals (no such route, wrong method) in OpenAI's error shape."""
    assert isinstance(exc, HTTPException)
    error = GatewayError(f"{request.method} {quoted(request.url.path)}: {exc.detail}")
    body = {"error": {"message": error.message, "type": "invalid_request_error", "param": None, "code": None}}
    return Response(orjson.dumps(body), status_code=exc.status_code, media_type=JSON, headers=exc.headers)


async def _unexpected_exception(request: Request, exc: Exception) -> Response:
    logger.error("%s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(internal_error())


# -- the OpenAPI document ----------------------------------------------------------------------------------------

_ERROR_STATUSES = {
    "400": "invalid field (named in error.param), or context_length_exceeded",
    "401": "missing or unknown API key",
    "404": "unknown model",
    "408": "the request's head did not arrive within the header timeout",
    "413": "request body too large",
    "431": "request headers too large or too many",
    "429": "over the tenant's concurrency limit (Retry-After)",
    "503": "no worker can take the request, or the server holds its connection cap",
}


def openapi_document() -> dict[str, Any]:
    """OpenAPI 3.1 for the generation endpoints, from the same pydantic models that validate the bodies."""
    _, schemas = models_json_schema(
        [
            (CompletionRequest, "validation"),
            (ChatCompletionRequest, "validation"),
            (CompletionResponse, "serialization"),
            (ChatCompletionResponse, "serialization"),
            (ChatCompletionChunk, "serialization"),
            (ErrorResponse, "serialization"),
            (ModelList, "serialization"),
            (TokenizeRequest, "validation"),
            (TokenizeResponse, "serialization"),
            (DetokenizeRequest, "validation"),
            (DetokenizeResponse, "serialization"),
        ],
        ref_template="#/components/schemas/{model}",
    )

    def ref(name: str) -> dict[str, str]:
        return {"$ref": f"#/components/schemas/{name}"}

    def json_content(name: str) -> dict[str, Any]:
        return {"application/json": {"schema": ref(name)}}

    errors = {
        status: {"description": text, "content": json_content("ErrorResponse")}
        for status, text in _ERROR_STATUSES.items()
    }
    stream = {
        "description": "with stream: true, `data: <chunk JSON>` events, then `data: [DONE]`",
        "schema": {"type": "string"},
    }

    def generation(summary: str, request: str, response: str, chunk: str) -> dict[str, Any]:
        ok = {
            "description": "the result, or a stream of chunks (" + chunk + ")",
            "content": {**json_content(response), "text/event-stream": stream},
        }
        return {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": json_content(request)},
                "responses": {"200": ok, **errors},
            }
        }

    def tokenizer_endpoint(summary: str, request: str, response: str) -> dict[str, Any]:
        refusals = {status: errors[status] for status in ("400", "401", "404", "413")}
        ok = {"description": "the result", "content": json_content(response)}
        return {
            "post": {
                "summary": summary,
                "requestBody": {"required": True, "content": json_content(request)},
                "responses": {"200": ok, **refusals},
            }
        }

    def simple(summary: str, content: dict[str, Any] | None = None) -> dict[str, Any]:
        return {
            "get": {
                "summary": summary,
                "responses": {"200": {"description": "OK", **({"content": content} if content else {})}},
            }
        }

    return {
        "openapi": "3.1.0",
        "info": {"title": "kvroute gateway", "version": "1", "description": "OpenAI-compatible API"},
        "paths": {
            "/v1/completions": generation(
                "Complete a prompt", "CompletionRequest", "CompletionResponse", "CompletionResponse"
            ),
            "/v1/chat/completions": generation(
                "Answer a chat", "ChatCompletionRequest", "ChatCompletionResponse", "ChatCompletionChunk"
            ),
            "/tokenize": tokenizer_endpoint(
                "The token ids a prompt or a chat is sent with (vLLM's)", "TokenizeRequest", "TokenizeResponse"
            ),
            "/detokenize": tokenizer_endpoint(
                "The text of token ids, special tokens written out (vLLM's)", "DetokenizeRequest", "DetokenizeResponse"
            ),
            "/v1/models": simple("The served model", json_content("ModelList")),
            "/health": simple("Liveness"),
            "/ready": {
                "get": {
                    "summary": "Readiness: at least one routable worker",
                    "responses": {"200": {"description": "ready"}, "503": {"description": "no routable worker"}},
                }
            },
        },
        "components": {"schemas": schemas["$defs"]},
    }
