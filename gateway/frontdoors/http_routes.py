"""An `HttpApp` as a table of routes: each (method, path) to a handler that reads the request's `Exchange` and
returns its answer, a whole `Reply` or a `StreamReply` of server-sent events, which the table writes.

    request ─► guard (e.g. the API key, before anything is read) ─► route by path, then method
        ─► handler(exchange) ─► Reply | StreamReply ─► written on the exchange

A path no route names is a 404, a method its path does not take a 405 with `Allow`, both in OpenAI's error
body; a HEAD is its GET's answer without the body; a handler's exception is logged and answered 500 in the same
shape (the server keeps serving).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from typing import NamedTuple

import orjson

from gateway.errors import GatewayError, quoted
from gateway.frontdoors.http_protocol import JSON, Exchange, internal_error

logger = logging.getLogger(__name__)


class Reply(NamedTuple):
    """A whole response."""

    status: int
    headers: dict[str, str]
    body: bytes
    content_type: bytes = JSON


class StreamReply(NamedTuple):
    """A 200 of server-sent events; `close` runs however the stream ends, also when it never started."""

    headers: dict[str, str]
    events: AsyncGenerator[bytes, None]
    close: Callable[[], Awaitable[None]]


Handler = Callable[[Exchange], Awaitable[Reply | StreamReply]]
Guard = Callable[[Exchange], Reply | None]


class Route(NamedTuple):
    """`method` requests to `path`; with `subtree`, to every path under it (`path` ends in "/")."""

    method: bytes
    path: str
    handler: Handler
    subtree: bool = False


class HttpRoutes:
    """The `HttpApp` of a route table. Of two routes for one method and path the first listed wins; `guard`
    answers a request before it is routed, or lets it through with None."""

    def __init__(self, routes: Sequence[Route], max_body_bytes: int, guard: Guard | None = None) -> None:
        self.max_body_bytes = max_body_bytes
        self.guard = guard
        self._exact: dict[str, dict[bytes, Handler]] = {}
        self._subtrees: dict[str, dict[bytes, Handler]] = {}
        for route in routes:
            table = self._subtrees if route.subtree else self._exact
            table.setdefault(route.path, {}).setdefault(route.method, route.handler)

    async def serve(self, exchange: Exchange) -> None:
        try:
            reply = (self.guard and self.guard(exchange)) or await self._answer(exchange)
        except Exception:
            logger.exception("%s %s failed", exchange.method.decode("latin-1"), quoted(exchange.path))
            reply = error_reply(internal_error())
        if isinstance(reply, StreamReply):
            try:
                await exchange.stream(reply.headers, reply.events)
            finally:
                await reply.close()
        else:
            await exchange.respond(*reply)

    async def _answer(self, exchange: Exchange) -> Reply | StreamReply:
        path = exchange.path
        methods = self._exact.get(path)
        if methods is None:
            methods = next((m for prefix, m in self._subtrees.items() if path.startswith(prefix)), None)
        if methods is None:
            return error_body(404, f"{exchange.method.decode('latin-1')} {quoted(path)}: Not Found")
        handler = methods.get(exchange.method) or (methods.get(b"GET") if exchange.method == b"HEAD" else None)
        if handler is None:
            reply = error_body(405, f"{exchange.method.decode('latin-1')} {quoted(path)}: Method Not Allowed")
            allowed = {method.decode() for method in methods} | ({"HEAD"} if b"GET" in methods else set())
            reply.headers["allow"] = ", ".join(sorted(allowed))
            return reply
        return await handler(exchange)


def error_reply(exc: GatewayError, headers: dict[str, str] | None = None) -> Reply:
    """`exc` as its status and OpenAI's error body, its own headers (Retry-After) over `headers`."""
    return Reply(exc.http_status, {**(headers or {}), **exc.http_headers()}, orjson.dumps(exc.to_openai()))


def error_body(status: int, message: str) -> Reply:
    """A refusal of the route table's own (no such route, wrong method) in OpenAI's shape."""
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": None}}
    return Reply(status, {}, orjson.dumps(body))


def header(exchange: Exchange, name: bytes) -> str | None:
    """The first `name` header of the request (`name` lower-case), as latin-1 text; None if absent."""
    return next((value.decode("latin-1") for key, value in exchange.headers if key == name), None)
