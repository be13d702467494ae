"""The gateway's OpenAI-compatible HTTP front door: a route table (gateway.frontdoors.http_routes) served by the
gateway's own HTTP protocol (gateway.frontdoors.http_protocol: uvloop, httptools, every limit), one request cycle
for every endpoint.

    POST /v1/completions, /v1/chat/completions ─► parse (openai_protocol) ─► GatewayRequest
        ─► RequestPath.generate ─► Generation ─► JSON body, or server-sent events ending in `data: [DONE]`
    POST /tokenize, /detokenize (vLLM's bodies) ─► RequestPath.tokenize / detokenize ─► JSON body
    POST /v1/responses, GET and DELETE /v1/responses/{id}, GET .../input_items (gateway.responses, added by
    the servers that build this app)
    GET /v1/models, /v1/models/{id}, /health (alive), /ready (a routable worker), /openapi.json

Prometheus metrics are not on this port: they list workers and per-app series that API clients have no
business reading, so they are served apart (`--metrics-port`, gateway.frontdoors.metrics_port).

No web framework: what one would add here (body parsing, the OpenAPI document) is done explicitly below with
the same pydantic models, and routing is a dict (why, measured: docs/gateway.md, "The HTTP transport").

The contract every response keeps:
- With API keys configured, a /v1/, /tokenize or /detokenize request without a valid key gets 401 before its
  body is read (`authenticate_first`), whatever else is wrong with it.
- Errors are OpenAI's body `{"error": {"message", "type", "param", "code"}}` with the status of the
  `GatewayError` (gateway.errors): 400 naming the field (never a 422), 401, 404, 405, 413 (the body limit is
  enforced while reading, before the body is held whole), 429 with Retry-After, 503. Any other exception is
  logged and answered 500 in the same shape, and the server keeps serving. The connection's own refusals
  (malformed HTTP 400, 408, 431, 503 over the connection cap) are gateway.frontdoors.http_protocol's, in the
  same shape. A message quotes at most a short prefix of what the client sent (`errors.quoted`).
- Once routed, every response (streamed or not, errors included) carries `x-kvroute-worker` and
  `x-kvroute-route`; every response carries `x-request-id` (the client's, echoed, or the gateway's own).
- An error after a stream started is one last `data: {"error": ...}` event, then `data: [DONE]`.
- A client that disconnects (mid-stream, or while waiting for a whole response) closes the Generation,
  which cancels its worker requests and frees their blocks.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

import orjson
from pydantic.json_schema import models_json_schema

from gateway.admission.auth import Authenticator
from gateway.admission.limits import Limits
from gateway.errors import GatewayError, InvalidRequestError, quoted
from gateway.frontdoors.http_protocol import Exchange, body_too_large, internal_error
from gateway.frontdoors.http_routes import Guard, HttpRoutes, Reply, Route, StreamReply, error_reply
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
M = TypeVar("M", bound=OpenAIModel)
# Where a client must present its API key (authenticate_first): the OpenAI API and vLLM's tokenizer endpoints.
AUTHENTICATED_PREFIX = "/v1/"
AUTHENTICATED_PATHS = frozenset({"/tokenize", "/detokenize"})
MODEL_CARDS = "/v1/models/"


class ServesModel(Protocol):
    """What the front door needs of one pool (gateway.request_path.RequestPath)."""

    served_model_name: str
    served_model_names: tuple[str, ...]  # the name above first, then its aliases
    tokenizer: Tokenizer  # /tokenize's token_strs

    async def generate(self, request: GatewayRequest) -> Generation: ...

    async def tokenize(self, request: GatewayRequest, *, backlog: bool = True) -> TokenizeResult: ...

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
    extra_routes: Sequence[Route] = (),
) -> HttpRoutes:
    """The HTTP app over one request path. `max_body_bytes` bounds a request body (413 past it);
    `default_max_tokens` is a chat request's max_tokens when the client sets none (completions default to
    OpenAI's 16); `extra_routes` are matched first (a worker's front door serves its engine's /metrics and
    its own /health, vLLM's render endpoints, and the Responses API's routes: gateway.responses)."""
    server = OpenAIServer(request_path, max_body_bytes, default_max_tokens)
    routes = [
        *extra_routes,
        Route(b"POST", "/v1/completions", server.completions),
        Route(b"POST", "/v1/chat/completions", server.chat_completions),
        Route(b"POST", "/tokenize", server.tokenize),
        Route(b"POST", "/detokenize", server.detokenize),
        Route(b"GET", "/v1/models", server.list_models),
        Route(b"GET", MODEL_CARDS, server.get_model, subtree=True),
        Route(b"GET", "/health", server.health),
        Route(b"GET", "/ready", server.ready),
        Route(b"GET", "/openapi.json", server.openapi),
    ]
    return HttpRoutes(routes, max_body_bytes, guard=authenticate_first(request_path))


def authenticate_first(request_path: ServesRequests) -> Guard:
    """Every /v1/, /tokenize and /detokenize request's API key is checked before anything else of the request
    is read, parsed or routed: a client without a valid key gets 401 and learns nothing else (not the body
    limit, not which fields are wrong, not the served model's name). /health, /ready, /metrics and
    /openapi.json stay open. The request path authenticates again (it is the contract of every caller); a key
    is one SHA-256. The keys are the request path's at each request, so a SIGHUP reload applies here too."""

    def guard(exchange: Exchange) -> Reply | None:
        path = exchange.path
        if path.startswith(AUTHENTICATED_PREFIX) or path in AUTHENTICATED_PATHS:
            return refusal(request_path, exchange.headers)
        return None

    return guard


def refusal(request_path: ServesRequests, headers: list[tuple[bytes, bytes]]) -> Reply | None:
    """The 401 for a request without a valid API key (authenticate_first), or the 400 for one with two
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


NOBODY_LISTENS = Reply(499, {}, b"")  # the client left: written nowhere


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

    # -- generation endpoints ---------------------------------------------------------------------------

    async def completions(self, exchange: Exchange) -> Reply | StreamReply:
        return await self.generate(exchange, CompletionRequest, CompletionRenderer)

    async def chat_completions(self, exchange: Exchange) -> Reply | StreamReply:
        return await self.generate(exchange, ChatCompletionRequest, ChatRenderer)

    async def generate(
        self, exchange: Exchange, wire_type: type[SamplingFields], renderer_type: type[Renderer]
    ) -> Reply | StreamReply:
        """The response to one generation request."""
        headers = read_headers(exchange.headers)
        client_request_id = client_request_id_of(headers.get("x-request-id"))
        try:
            body = await read_body(exchange, headers, self.max_body_bytes)
            wire = parse_request(wire_type, body)
            gateway_request = wire.to_gateway_request(request_headers(headers), self.default_max_tokens)
            gateway_request.api_json = body
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

    async def tokenize(self, exchange: Exchange) -> Reply:
        """vLLM's /tokenize: `{"count", "max_model_len", "tokens", "token_strs"}` (token_strs null unless
        return_token_strs), the ids a generation with the same prompt or messages is sent with."""

        async def answer(wire: TokenizeRequest, headers: Mapping[str, str]) -> dict[str, Any]:
            pool = self.request_path.pool(wire.model)
            result = await pool.tokenize(wire.to_gateway_request(request_headers(headers)))
            ids = result.token_ids
            token_strs = [pool.tokenizer.token_text(i) or "" for i in ids] if wire.return_token_strs else None
            return {"count": len(ids), "max_model_len": result.max_model_len, "tokens": ids, "token_strs": token_strs}

        return await self._tokenizer_endpoint(exchange, TokenizeRequest, answer)

    async def detokenize(self, exchange: Exchange) -> Reply:
        """vLLM's /detokenize: `{"prompt"}`, the text of the ids with special tokens written out."""

        async def answer(wire: DetokenizeRequest, headers: Mapping[str, str]) -> dict[str, Any]:
            api_key = bearer_token(headers.get("authorization"))
            return {"prompt": await self.request_path.pool(wire.model).detokenize(api_key, wire.model, wire.tokens)}

        return await self._tokenizer_endpoint(exchange, DetokenizeRequest, answer)

    async def _tokenizer_endpoint(
        self,
        exchange: Exchange,
        wire_type: type[M],
        answer: Callable[[M, Mapping[str, str]], Awaitable[dict[str, Any]]],
    ) -> Reply:
        """Read and parse the body as `wire_type` (the body limit, OpenAI's error shape), then `answer` it."""
        headers = read_headers(exchange.headers)
        reply_headers = {"x-request-id": client_request_id_of(headers.get("x-request-id")) or uuid.uuid4().hex}
        try:
            body = await read_body(exchange, headers, self.max_body_bytes)
            result = await answer(parse_request(wire_type, body), headers)
        except GatewayError as exc:
            self.request_path.metrics.errors.labels(type(exc).__name__).inc()
            return error_reply(exc, reply_headers)
        return Reply(200, reply_headers, orjson.dumps(result))

    # -- the rest -----------------------------------------------------------------------------------------

    def _model_card(self, pool: ServesModel, name: str) -> dict[str, Any]:
        """vLLM's card: `max_model_len` is what a router reads to size requests (RequestPath.max_model_len)."""
        return {
            "id": name, "object": "model", "created": self.started, "owned_by": "kvroute", "root": name,
            "parent": None, "max_model_len": pool.max_model_len(),
        }  # fmt: skip

    async def list_models(self, exchange: Exchange) -> Reply:
        cards = [self._model_card(pool, name) for pool in self.request_path.pools() for name in pool.served_model_names]
        return Reply(200, {}, orjson.dumps({"object": "list", "data": cards}))

    async def get_model(self, exchange: Exchange) -> Reply:
        try:
            name = exchange.path.removeprefix(MODEL_CARDS)
            pool = self.request_path.pool(name)
        except GatewayError as exc:
            return error_reply(exc)
        return Reply(200, {}, orjson.dumps(self._model_card(pool, name)))

    async def health(self, exchange: Exchange) -> Reply:
        return Reply(200, {}, b'{"status":"ok"}')

    async def ready(self, exchange: Exchange) -> Reply:
        """200 with at least one routable worker, else 503; the body counts them (`kvroute up` waits for all)."""
        workers = self.request_path.routable_workers()
        if workers:
            return Reply(200, {}, orjson.dumps({"status": "ready", "workers": workers}))
        return Reply(503, {}, b'{"status":"no routable worker","workers":0}')

    async def openapi(self, exchange: Exchange) -> Reply:
        return Reply(200, {}, self._openapi)


# -- reading a request -------------------------------------------------------------------------------------


async def read_body(exchange: Exchange, headers: Mapping[str, str], limit: int) -> bytes:
    """The body, refused with 413 as soon as it is known to pass `limit` bytes: at once from the
    Content-Length header's value (`headers` by lower-case name), else while it streams in (chunked), so an
    oversize body is never held whole."""
    check_content_length(headers.get("content-length"), limit)
    return await exchange.body()


def check_content_length(content_length: str | None, limit: int) -> None:
    """413 for a Content-Length header past `limit`, 400 for one that is not a number."""
    if content_length is not None:
        if not content_length.isdigit():
            raise InvalidRequestError(f"Content-Length header {quoted(content_length)} is not a number")
        if int(content_length) > limit:
            raise body_too_large(int(content_length), limit)


# The request headers the endpoints read (read_headers).
_READ_HEADERS = frozenset(
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


def read_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The endpoints' request headers by (lower-case) name, latin-1 text; of a repeated header the first."""
    headers: dict[str, str] = {}
    for name, value in raw:
        if name in _READ_HEADERS:
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
            message = choices[index].get("message", {})
            message.update(extra)
            if message.get("tool_calls") and not message.get("content"):
                message["content"] = None  # as OpenAI answers a message of tool calls only
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
