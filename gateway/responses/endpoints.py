"""The Responses API's routes over one request path (`routes()`, for `build_app`'s `extra_routes`):

    POST   /v1/responses                        create (whole or streamed; gateway.responses.render)
    GET    /v1/responses/{id}                   the stored Response object
    DELETE /v1/responses/{id}                   {"id", "object": "response", "deleted": true}
    GET    /v1/responses/{id}/input_items       the items the response was generated from (earlier turns
                                                included), newest first by default; limit, order, after

A create is the chat path with the conversation rendered here: the stored conversation of
`previous_response_id` (gateway.responses.store, read under the caller's tenant only) and the new input go
through the model's chat template, the previous turn's run spelled with the sampled ids
(gateway.responses.prompt), and the prompt is sent to a kvroute worker as token ids (to an HTTP engine as the
chat it is), routed first to the worker that served the previous turn (`GatewayRequest.conversation_worker`:
kv_aware takes it while it holds the prefix and is under its load bound, reason `conversation`). With `store`
(the default) the response is stored before its last event (or its body) is sent, so a client that continues
at once finds it.

Errors are OpenAI's: an unknown id, another tenant's, an expired or deleted one are all the same 404; the store
unreachable is a 503 for what needs it (retrieve, delete, list, a continued turn), while a new turn is served
and left unstored (counted in `kvroute:gateway_responses_store_errors_total`).
"""

from __future__ import annotations

import base64
import logging
import re
import time
import uuid
from array import array
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

import orjson

from gateway.errors import GatewayError, InvalidRequestError, quoted
from gateway.frontdoors.http_protocol import Exchange
from gateway.frontdoors.http_routes import Reply, Route, StreamReply, error_reply
from gateway.frontdoors.http_server import (
    DEFAULT_MAX_BODY_BYTES,
    NOBODY_LISTENS,
    read_body,
    read_headers,
    request_headers,
)
from gateway.frontdoors.openai_protocol import client_request_id_of, parse_request, stop_strings
from gateway.request import GatewayRequest
from gateway.responses.prompt import continued_prompt
from gateway.responses.render import ResponseRenderer, Turn
from gateway.responses.store import ResponseStore, ResponseTooLarge, StoreUnavailable, tenant_scope
from gateway.responses.wire import (
    ResponsesRequest,
    chat_messages,
    chat_tool_choice,
    chat_tools,
    input_items,
    new_id,
    public,
    shown_tools,
)
from kvroute.sampling import SamplingParams

if TYPE_CHECKING:
    from gateway.frontdoors.http_server import ServesModel, ServesRequests

logger = logging.getLogger(__name__)

RESPONSES_PATH = "/v1/responses"
RECORD_VERSION = 1
RESPONSE_ID = re.compile(r"resp_[0-9a-f]{48}")  # wire.new_id("resp"): 192 random bits
RECORD_BYTES_PER_TOKEN = 6  # a token id in a record: 4 bytes, base64 (the prompt's and the output's)
MAX_LIST_LIMIT = 100  # input_items' limit, as OpenAI's
DEFAULT_LIST_LIMIT = 20


class ResponseNotFound(GatewayError):
    http_status = 404
    error_type = "invalid_request_error"
    default_code = "response_not_found"


class StoreDown(GatewayError):
    http_status = 503
    error_type = "service_unavailable"
    default_code = "response_store_unavailable"


def _not_found(response_id: str, param: str | None = None) -> ResponseNotFound:
    code = "previous_response_not_found" if param else None
    return ResponseNotFound(f"no response with id {quoted(response_id)} was found", param=param, code=code)


def _store_down(exc: StoreUnavailable) -> StoreDown:
    return StoreDown(f"{exc}; stored responses cannot be read now, retry shortly", retry_after=1.0)


def _pack(ids: Sequence[int]) -> str:
    return base64.b64encode(array("I", ids).tobytes()).decode()


def _unpack(text: str) -> list[int]:
    ids = array("I")
    ids.frombytes(base64.b64decode(text))
    return ids.tolist()


class ResponsesEndpoints:
    """The Responses routes over one request path and one store."""

    def __init__(
        self,
        request_path: ServesRequests,
        store: ResponseStore,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        default_max_tokens: int | None = None,
    ) -> None:
        self.request_path = request_path
        self.store = store
        self.max_body_bytes = max_body_bytes
        self.default_max_tokens = default_max_tokens

    def routes(self) -> list[Route]:
        return [
            Route(b"POST", RESPONSES_PATH, self.create),
            Route(b"GET", RESPONSES_PATH + "/", self.retrieve, subtree=True),
            Route(b"DELETE", RESPONSES_PATH + "/", self.delete, subtree=True),
        ]

    # -- create ----------------------------------------------------------------------------------------------

    async def create(self, exchange: Exchange) -> Reply | StreamReply:
        headers = read_headers(exchange.headers)
        request_id = client_request_id_of(headers.get("x-request-id")) or uuid.uuid4().hex
        try:
            body = await read_body(exchange, headers, self.max_body_bytes)
            wire = parse_request(ResponsesRequest, body)
            wire.check()
            api_key = request_headers(headers).api_key
            scope = tenant_scope(self.request_path.auth.authenticate(api_key))
            pool = self.request_path.pool(wire.model)
        except GatewayError as exc:
            self.request_path.metrics.errors.labels(type(exc).__name__).inc()
            return error_reply(exc, {"x-request-id": request_id})
        reply = await exchange.until_disconnected(self._answer(wire, headers, scope, pool, request_id))
        return NOBODY_LISTENS if reply is None else reply

    async def _answer(
        self, wire: ResponsesRequest, headers: dict[str, str], scope: str, pool: ServesModel, request_id: str
    ) -> Reply | StreamReply:
        try:
            request, conversation = await self._request(wire, headers, scope, pool)
            generation = await pool.generate(request)
        except GatewayError as exc:
            self.request_path.metrics.errors.labels(type(exc).__name__).inc()
            return error_reply(exc, {"x-request-id": request_id})
        response_id = new_id("resp")
        reply_headers = {
            "x-request-id": request_id,
            "x-kvroute-worker": generation.route.worker_id,
            "x-kvroute-route": generation.route.header(),
        }
        head = {
            "id": response_id, "object": "response", "created_at": time.time(), "model": pool.served_model_name,
            "error": None, "incomplete_details": None, "instructions": wire.instructions,
            "metadata": wire.metadata or {}, "temperature": wire.temperature, "top_p": wire.top_p,
            "max_output_tokens": wire.max_output_tokens, "previous_response_id": wire.previous_response_id,
            "parallel_tool_calls": wire.parallel_tool_calls, "tool_choice": wire.tool_choice or "auto",
            "tools": shown_tools(wire.tools), "text": wire.text_config(), "truncation": "disabled",
            "store": wire.store, "user": wire.user, "background": False, "reasoning": {"effort": None, "summary": None},
            "service_tier": "default",
        }  # fmt: skip

        async def finish(turn: Turn, body: dict[str, Any]) -> None:
            if not wire.store:
                return
            record = {
                "v": RECORD_VERSION, "response": body, "items": conversation, "output": turn.output,
                "prompt": _pack(generation.prompt_token_ids), "output_ids": _pack(turn.output_ids),
                "worker": generation.route.worker_id,
            }  # fmt: skip
            try:
                await self.store.put(scope, response_id, orjson.dumps(record))
            except (StoreUnavailable, ResponseTooLarge) as exc:
                self.request_path.metrics.responses_store_errors.labels(type(exc).__name__).inc()
                logger.warning("response %s was not stored: %s", response_id, exc)

        renderer = ResponseRenderer(generation, head, pool.tokenizer.decode, finish)
        if wire.stream:
            return StreamReply(reply_headers, renderer.events(), generation.aclose)
        try:
            return Reply(200, reply_headers, orjson.dumps(await renderer.whole()))
        except GatewayError as exc:
            return error_reply(exc, reply_headers)

    async def _request(
        self, wire: ResponsesRequest, headers: dict[str, str], scope: str, pool: ServesModel
    ) -> tuple[GatewayRequest, list[dict[str, Any]]]:
        """The generation request and the conversation's items (stored earlier turns, then the new input);
        raises GatewayError (400 bad items, 404 unknown previous response, 503 store down)."""
        new_items = input_items(wire.input)
        previous = await self._load(scope, wire.previous_response_id, "previous_response_id")
        conversation = [*previous["items"], *previous["output"], *new_items] if previous else new_items
        tools, tool_choice = chat_tools(wire.tools), chat_tool_choice(wire.tool_choice)
        response_format = wire.response_format()
        read = request_headers(headers)
        max_tokens = wire.max_output_tokens or self.default_max_tokens
        params = SamplingParams(
            max_tokens=max_tokens or 16,
            temperature=1.0 if wire.temperature is None else wire.temperature,
            top_p=1.0 if wire.top_p is None else wire.top_p,
            seed=wire.seed,
        )
        common: dict[str, Any] = dict(
            api_key=read.api_key, model=wire.model, trace_context=read.trace_context, app=read.app,
            session_id=read.session_id or wire.prompt_cache_key or wire.user,
        )  # fmt: skip
        messages = chat_messages(wire.instructions, conversation)
        rendered = await pool.tokenize(
            GatewayRequest(messages=messages, kind="chat", tools=tools, **common), backlog=False
        )
        prompt = rendered.token_ids
        if previous is not None:
            prompt = continued_prompt(prompt, _unpack(previous["prompt"]), _unpack(previous["output_ids"]),
                                      pool.tokenizer)  # fmt: skip
        if wire.store:
            known = len(orjson.dumps(conversation)) + RECORD_BYTES_PER_TOKEN * len(prompt)
            if known > self.store.limits.max_response_bytes:
                raise InvalidRequestError(
                    f"this conversation would be stored in {known} bytes, past this server's limit of "
                    f"{self.store.limits.max_response_bytes} a response; start a new one, or send store=false",
                    param="previous_response_id" if previous else "input",
                )
        stop = stop_strings(wire.stop)
        # An HTTP engine is sent the turn as the chat it is (its template, its tool parser, its grammar); a
        # kvroute worker gets `prompt_token_ids`, the exact continued prompt.
        engine_body = {
            "model": wire.model or pool.served_model_name, "messages": messages, "temperature": params.temperature,
            "top_p": params.top_p, "stop": list(stop) or None, "tools": tools, "tool_choice": tool_choice,
            "parallel_tool_calls": wire.parallel_tool_calls if tools else None, "response_format": response_format,
        }  # fmt: skip
        request = GatewayRequest(
            prompt_token_ids=prompt, params=params, max_tokens_defaulted=wire.max_output_tokens is None, stop=stop,
            priority=read.priority, stream=wire.stream, kind="chat",
            api_json=orjson.dumps({key: value for key, value in engine_body.items() if value is not None}),
            conversation_worker=previous["worker"] if previous else None, tools=tools, tool_choice=tool_choice,
            parallel_tool_calls=wire.parallel_tool_calls, response_format=response_format, **common,
        )  # fmt: skip
        return request, conversation

    async def _load(self, scope: str, response_id: str | None, param: str | None = None) -> dict[str, Any] | None:
        if response_id is None:
            return None
        if not RESPONSE_ID.fullmatch(response_id):  # never a store key: no id of ours looks like it
            raise _not_found(response_id, param)
        try:
            raw = await self.store.get(scope, response_id)
        except StoreUnavailable as exc:
            raise _store_down(exc) from None
        if raw is None:
            raise _not_found(response_id, param)
        record: dict[str, Any] = orjson.loads(raw)
        return record

    # -- retrieve, delete, input_items ------------------------------------------------------------------------

    async def retrieve(self, exchange: Exchange) -> Reply:
        """GET /v1/responses/{id} and GET /v1/responses/{id}/input_items."""
        response_id, _, rest = exchange.path.removeprefix(RESPONSES_PATH + "/").partition("/")
        try:
            scope = self._scope(exchange)
            if rest not in ("", "input_items"):
                raise ResponseNotFound(f"GET {quoted(exchange.path)}: Not Found")
            record = await self._load(scope, response_id)
            assert record is not None  # _load raises for a missing one
            if rest == "":
                return Reply(200, {}, orjson.dumps(record["response"]))
            return Reply(200, {}, orjson.dumps(_item_page(record["items"], exchange.query)))
        except GatewayError as exc:
            return error_reply(exc)

    async def delete(self, exchange: Exchange) -> Reply:
        response_id = exchange.path.removeprefix(RESPONSES_PATH + "/")
        try:
            scope = self._scope(exchange)
            try:
                deleted = RESPONSE_ID.fullmatch(response_id) is not None and await self.store.delete(scope, response_id)
            except StoreUnavailable as exc:
                raise _store_down(exc) from None
            if not deleted:
                raise _not_found(response_id)
        except GatewayError as exc:
            return error_reply(exc)
        return Reply(200, {}, orjson.dumps({"id": response_id, "object": "response", "deleted": True}))

    def _scope(self, exchange: Exchange) -> str:
        api_key = request_headers(read_headers(exchange.headers)).api_key
        return tenant_scope(self.request_path.auth.authenticate(api_key))


def _item_page(items: list[dict[str, Any]], query: str) -> dict[str, Any]:
    """OpenAI's list of input items: `order` (desc by default), `limit` (1-100, 20), `after` (an item id)."""
    params = {key: values[0] for key, values in parse_qs(query, keep_blank_values=True).items()}
    order = params.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequestError(f"{quoted(order)} is not 'asc' or 'desc'", param="order")
    limit_text = params.get("limit", str(DEFAULT_LIST_LIMIT))
    if not limit_text.isdigit() or not 1 <= int(limit_text) <= MAX_LIST_LIMIT:
        raise InvalidRequestError(f"must be an integer in [1, {MAX_LIST_LIMIT}], got {quoted(limit_text)}",
                                  param="limit")  # fmt: skip
    ordered = [public(item) for item in (items if order == "asc" else reversed(items))]
    after = params.get("after")
    if after is not None:
        position = next((i for i, item in enumerate(ordered) if item["id"] == after), None)
        if position is None:
            raise InvalidRequestError(f"no item {quoted(after)} in this response's input", param="after")
        ordered = ordered[position + 1 :]
    page = ordered[: int(limit_text)]
    return {
        "object": "list", "data": page, "first_id": page[0]["id"] if page else None,
        "last_id": page[-1]["id"] if page else None, "has_more": len(ordered) > len(page),
    }  # fmt: skip
