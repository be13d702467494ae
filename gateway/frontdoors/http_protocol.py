"""The HTTP/1.1 connection the front door serves: uvicorn's httptools protocol with the limits that a server
exposed to untrusted clients needs and that uvicorn has no option for with httptools (DESIGN §4, limits).

    accept ─(max_connections)─► head ─(max_header_bytes, max_headers, header_timeout)─► body, response
        ─► keep-alive wait ─(keep_alive_timeout)─► the next head ... or close

- `max_connections`: a connection accepted while this process holds that many open is answered at once with
  503 (OpenAI's body, `Retry-After: 1`, `Connection: close`) and closed; the connections already open keep
  being served. A 503 rather than a silent close, so that a client or load balancer learns the cause and
  retries another replica (a reset reads as a network fault). uvicorn's `limit_concurrency` is not used: it
  answers 503 to every request of every connection once the count is reached, even the open ones'.
- `max_header_bytes` (request line and headers together) and `max_headers`: past either, 431. They are
  counted while the head streams in, so an oversize head is never held whole (httptools itself buffers a
  header until it ends, with no bound).
- `header_timeout`: a request's head must arrive whole within this many seconds of its first byte (for a
  connection's first request, of the connection's opening): else 408, or a plain close when nothing came.
  A body that stops arriving for as long (while the server is reading it) closes the connection, which the
  app sees as a client that left.
- `keep_alive_timeout`: uvicorn's own `timeout_keep_alive`, the wait between a response and the next request.
- A chunked body's framing is not body: trailers are refused (400; the API reads none, and httptools would
  append them to the head's headers after the body, past every head limit and where a check could read a
  key the head never carried), and chunk extensions count against `max_header_bytes` beyond
  `CHUNK_FRAMING_BYTES` a chunk (400 past it; httptools does not expose them, so the bytes received that
  were not body bound them: Node's CVE-2024-22019 was an unbounded extension read).
- A request answered before its body was read whole (401 before the body, 413) ends its connection: the
  body is not read on as if the next request could follow it.
- Malformed HTTP gets 400 in OpenAI's body (uvicorn answers plain text).
- `Expect: 100-continue` gets 100 Continue from HTTP/1.1 only (RFC 9110 §15.2: never a 1xx to HTTP/1.0).
- `Upgrade` (WebSocket, h2c) is never honoured, and httptools would parse an upgrade request's body as the
  next request (a request hidden in a body, past whatever a proxy checked): an upgrade request with a body
  gets 400; one without is served as plain HTTP/1.1 and its connection closed after the response, nothing
  after it parsed. Neither is logged (uvicorn warns twice per request, which any client could repeat).

A POST to one of the app's `hot_endpoints` (the generation endpoints: gateway.frontdoors.http_server) is served
by a `HotCycle` instead of uvicorn's request cycle and ASGI: the endpoint reads the body and writes its response
through the cycle (`Exchange`), with the same limits, keep-alive, pipelining, flow control and disconnects.

Every refusal, and every answer given before its request's body was read whole, ends its connection with a
lingering close: the answer is written, the write side shut, and whatever the client still sends is read
and dropped (its first `LINGER_BYTES`; then no more is read) for up to `LINGER_S`, so that the client reads
the answer instead of a reset. A refusal while a response is still being sent on the connection (a
pipelined head) closes it without an answer, which would corrupt that response.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import resource
from collections.abc import AsyncGenerator, Awaitable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import HEADER_VALUE_RE, STATUS_LINE, HttpToolsProtocol

from gateway.errors import (
    BodyTooLarge,
    GatewayError,
    HeadersTooLarge,
    InvalidRequestError,
    RequestTimeout,
    TooManyConnections,
)

logger = logging.getLogger(__name__)

LINGER_S = 2.0
LINGER_BYTES = 2**20  # read and dropped at most while lingering; then the connection waits unread for its close
REFUSAL_LOG_S = 10.0
_HEADER_OVERHEAD = 4  # ": " and CRLF around each header
# A chunk's framing without extensions: its size (16 hex digits at most, leading zeros allowed) and two CRLFs.
CHUNK_FRAMING_BYTES = 32
T = TypeVar("T")


@dataclass(frozen=True)
class HttpLimits:
    """The HTTP connection limits (flags of the same names; figures and ingress guidance in docs/gateway.md)."""

    max_header_bytes: int = 32 * 1024
    max_headers: int = 100
    header_timeout: float = 10.0
    keep_alive_timeout: float = 75.0
    max_connections: int = 2048

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_headers", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        for name in ("header_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}")

    def protocol_factory(self) -> Any:
        """What `uvicorn.Config(http=...)` takes: the protocol class with these limits bound."""
        return functools.partial(LimitedHttpToolsProtocol, limits=self)


class Exchange(Protocol):
    """One request as a hot endpoint sees it: its headers, its body, its response. Served by `HotCycle` on
    this protocol, and by an ASGI adapter (gateway.frontdoors.http_server.AsgiExchange) anywhere else."""

    headers: list[tuple[bytes, bytes]]  # as received, names lower-case

    async def body(self) -> bytes:
        """The whole body; BodyTooLarge once it passes the endpoint's `max_body_bytes`; ClientDisconnect (or
        the task cancelled) if the client leaves first."""
        ...

    async def until_disconnected(self, work: Awaitable[T]) -> T | None:
        """`work`'s result, or None once the client has left (then `work` was cancelled where it waited)."""
        ...

    async def respond(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        """A whole JSON response (Content-Type application/json); nothing when the client has left."""
        ...

    async def stream(self, headers: Mapping[str, str], events: AsyncGenerator[bytes, None]) -> None:
        """A 200 of server-sent events from `events` until they end or the client leaves; `events` is closed
        however it ends."""
        ...


class HotEndpoint(Protocol):
    """What an app lists in `hot_endpoints` (by path): served by `HotCycle`, without ASGI."""

    max_body_bytes: int

    async def serve(self, exchange: Exchange) -> None:
        """Answer the request; an exception that escapes closes the connection (the endpoint answers its own
        errors)."""
        ...


def internal_error() -> GatewayError:
    """The 500 of a request whose handling failed (and was logged)."""
    return GatewayError("the server failed to answer this request; it has been logged")


def body_too_large(size: int, limit: int) -> BodyTooLarge:
    return BodyTooLarge(f"request body has {size} bytes or more; this server accepts at most {limit}")


class _Refused(Exception):
    """Raised from a parser callback to stop parsing; the refusal itself is in `_refusal`."""


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with `HttpLimits` enforced (see the module docstring)."""

    _refused_unlogged = 0  # connections refused over the cap since the last warning (process-wide)
    _refusal_logged_at = -math.inf

    def __init__(self, *args: Any, limits: HttpLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._awaiting_head = True  # no complete head yet for the connection's next request
        self._head_begun = False  # the parser has seen the first byte of that head
        self._received_head_bytes = 0  # raw bytes since that head began: bounds a header httptools still buffers
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._last_read = 0.0
        self._linger_timer: asyncio.TimerHandle | None = None
        self._refusal: GatewayError | None = None
        self._lingering = False
        self._lingered_bytes = 0
        self._after_upgrade = False  # an upgrade request was served: nothing after it is parsed
        # The body being parsed: its chunks, its bytes (of the connection so far), its framing bytes.
        self._messages = 0  # requests parsed whole on this connection
        self._chunks = 0
        self._body_bytes = 0
        self._framing_bytes = 0
        # The app's endpoints served without ASGI, by raw path (`HotEndpoint`); none for any other app.
        self.hot_endpoints: Mapping[bytes, HotEndpoint] = getattr(self.config.app, "hot_endpoints", None) or {}
        self._serving: HotCycle | None = None  # the hot request whose response is being written

    # -- the connection ------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self.transport = transport
            self._log_refusal()
            self._refuse(
                TooManyConnections(
                    f"this server holds {self.limits.max_connections} connections, its limit; retry shortly",
                    retry_after=1.0,
                )
            )
            return
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        for timer in (self._head_timer, self._body_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._linger_timer = None
        for cycle in (self._serving, self.cycle):
            if isinstance(cycle, HotCycle):
                cycle.lost()
        if isinstance(self.cycle, HotCycle):
            self.cycle = None  # uvicorn's own cleanup is for its own cycles
        super().connection_lost(exc)

    def eof_received(self) -> None:
        if self._lingering:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._lingered_bytes += len(data)
            if self._lingered_bytes > LINGER_BYTES:
                self.transport.pause_reading()  # what a client sends on after its answer costs no more reads
            return
        if self._after_upgrade:
            return  # read and dropped until the connection closes
        self._unset_keepalive_if_required()
        self._last_read = self.loop.time()
        in_body, message, body_bytes = not self._awaiting_head, self._messages, self._body_bytes
        if not in_body:
            self._received_head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._after_upgrade = True
            return
        except httptools.HttpParserError as exc:
            self._refuse(self._refusal or InvalidRequestError(f"malformed HTTP request ({exc})"))
            return
        # Timers only for what this chunk left unfinished: a request that arrives whole in one read (nearly
        # all of them) costs none.
        if self._awaiting_head:
            if self._received_head_bytes > self.limits.max_header_bytes:
                self._refuse(self._head_too_large())
            elif self._head_begun and self._head_timer is None:
                self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)
            return
        if in_body and message == self._messages:  # a read within one body: what was not body is framing
            self._framing_bytes += len(data) - (self._body_bytes - body_bytes)
            if self._framing_bytes > self.limits.max_header_bytes + CHUNK_FRAMING_BYTES * self._chunks:
                self._refuse(
                    InvalidRequestError(
                        f"the body's chunk extensions pass {self.limits.max_header_bytes} bytes, this server's "
                        "limit; send chunks without extensions"
                    )
                )
                return
        if self._body_timer is None and self.cycle is not None and self.cycle.more_body:
            self._body_timer = self.loop.call_later(self.limits.header_timeout, self._body_stalled)

    # -- the parser's callbacks ------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_begun = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._awaiting_head:  # after the head: a trailer of a chunked body
            self._refusal = InvalidRequestError(
                "this server accepts no trailers after a chunked body; send every header in the request's head"
            )
            raise _Refused
        super().on_header(name, value)

    def on_chunk_header(self) -> None:
        self._chunks += 1

    def on_headers_complete(self) -> None:
        """The head's exact size and count, checked once it is whole (while it streams in, the bytes received
        bound it)."""
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        if len(self.headers) > self.limits.max_headers:
            self._refusal = HeadersTooLarge(
                f"the request has more than {self.limits.max_headers} headers, this server's limit"
            )
            raise _Refused
        size = len(self.url) + sum(len(name) + len(value) for name, value in self.headers)
        if size + _HEADER_OVERHEAD * len(self.headers) > self.limits.max_header_bytes:
            self._refusal = self._head_too_large()
            raise _Refused
        upgrade = self.parser.should_upgrade()
        if upgrade and any(
            name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0")
            for name, value in self.headers
        ):
            self._refusal = InvalidRequestError(
                "this server does not switch protocols; send a request with a body without an Upgrade header"
            )
            raise _Refused
        self._awaiting_head = False
        self._chunks = self._framing_bytes = 0
        if self.parser.get_http_version() != "1.1":
            self.expect_100_continue = False  # RFC 9110 §15.2: no 1xx to an HTTP/1.0 client
        endpoint = self.hot_endpoints.get(self.url) if not upgrade and self.parser.get_method() == b"POST" else None
        if endpoint is None:
            super().on_headers_complete()
            if upgrade:
                self.cycle.keep_alive = False
            return
        existing = self.cycle
        keep_alive = self.parser.get_http_version() != "1.0" and self.parser.should_keep_alive()
        self.cycle = HotCycle(self, endpoint, self.headers, keep_alive, self.expect_100_continue)  # type: ignore[assignment]
        if existing is None or existing.response_complete:
            self._start_asgi_task(self.cycle, None)
        else:  # pipelined: it waits for the response before it, as uvicorn's own cycles do
            self.flow.pause_reading()
            self.pipeline.appendleft((self.cycle, None))  # type: ignore[arg-type]

    def _start_asgi_task(self, cycle: Any, app: Any) -> None:
        if isinstance(cycle, HotCycle):
            self._serving = cycle
            cycle.start()
        else:
            super()._start_asgi_task(cycle, app)

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if isinstance(self.cycle, HotCycle):
            self.cycle.feed(body)
        else:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if isinstance(self.cycle, HotCycle):
            self.cycle.complete()
        else:
            super().on_message_complete()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._awaiting_head = True
        self._head_begun = False
        self._received_head_bytes = 0
        self._messages += 1

    def on_response_complete(self) -> None:
        cycle = self.cycle
        if not self._awaiting_head and cycle is not None and cycle.response_complete:
            # Answered before its body was read whole (401 before the body, 413): the rest is not read on.
            self.server_state.total_requests += 1
            self._linger_close()
            return
        super().on_response_complete()

    # -- refusals ----------------------------------------------------------------------------------------------

    def _head_too_large(self) -> HeadersTooLarge:
        return HeadersTooLarge(
            f"the request line and headers pass {self.limits.max_header_bytes} bytes, this server's limit"
        )

    def _log_refusal(self) -> None:
        """One warning per REFUSAL_LOG_S at most, with the count since the last: a flood of connections must
        not become a flood of log lines."""
        cls = LimitedHttpToolsProtocol
        cls._refused_unlogged += 1
        now = self.loop.time()
        if now - cls._refusal_logged_at >= REFUSAL_LOG_S:
            logger.warning(
                "%d HTTP connections refused since the last report: %d open, the --max-connections cap",
                cls._refused_unlogged, len(self.connections),
            )  # fmt: skip
            cls._refused_unlogged, cls._refusal_logged_at = 0, now

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        if not self._head_begun:
            self.transport.close()  # nothing was asked: nothing to answer
            return
        self._refuse(
            RequestTimeout(f"the request's head did not arrive within {self.limits.header_timeout:g} s; send it whole")
        )

    def _body_stalled(self) -> None:
        """Close a connection whose body has not moved for `header_timeout` seconds; a pause while the server
        itself stopped reading (flow control) does not count."""
        idle = self.loop.time() - self._last_read
        if self.flow.read_paused or idle < self.limits.header_timeout:
            wait = self.limits.header_timeout - (0.0 if self.flow.read_paused else idle)
            self._body_timer = self.loop.call_later(wait, self._body_stalled)
            return
        self._body_timer = None
        self.transport.close()

    def _refuse(self, error: GatewayError) -> None:
        """Answer `error` (OpenAI's body, Connection: close) and end the connection with a lingering close. A
        request whose response has not begun is abandoned unanswered (its endpoint, if it runs, writes
        nothing); while a response is being sent the connection is closed without an answer, which would
        corrupt it."""
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if self.pipeline or (cycle is not None and cycle.response_started and not cycle.response_complete):
            self._lingering = True
            self.transport.close()
            return
        if isinstance(cycle, HotCycle):
            cycle.lost()
        elif cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # as uvicorn marks a cycle whose client left: its sends write nothing
            cycle.message_event.set()
        body = orjson.dumps(error.to_openai())
        head = [STATUS_LINE[error.http_status]]
        for name, value in (
            *self.server_state.default_headers,
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            *((name.encode(), value.encode()) for name, value in error.http_headers().items()),
        ):
            head += [name, b": ", value, b"\r\n"]
        self.transport.write(b"".join([*head, b"\r\n", body]))
        self._linger_close()

    def _linger_close(self) -> None:
        """End the connection after what was written: shut the write side, then read and drop what the client
        still sends (up to LINGER_BYTES) for up to LINGER_S, so that it reads the answer rather than a reset."""
        self._lingering = True
        for timer in (self._head_timer, self._body_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = None
        self._unset_keepalive_if_required()
        if self.transport.is_closing():
            return
        if self.flow is not None:
            self.flow.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()


class HotCycle:
    """One request to a hot endpoint on its connection: the body as the parser hands it over, the endpoint's
    task, its response written straight to the transport (an `Exchange`). It keeps what uvicorn's
    RequestResponseCycle keeps: the body limit while the body streams in, 100 Continue when the client waits
    for it, write flow control, keep-alive (`connection: close` when the request or a shutdown asks for it), the
    next pipelined request started once the response ends, and a client that leaves cancels the task where
    it waits (`until_disconnected`, `stream` and `body` end there)."""

    def __init__(
        self,
        protocol: LimitedHttpToolsProtocol,
        endpoint: HotEndpoint,
        headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
        expect_100_continue: bool,
    ) -> None:
        self.protocol = protocol
        self.endpoint = endpoint
        self.target = protocol.url  # the request line's, for the log
        self.headers = headers
        self.keep_alive = keep_alive  # uvicorn's shutdown clears it
        self.waiting_for_100_continue = expect_100_continue
        self.more_body = True  # the parser has not seen the body's end
        self.response_started = False
        self.response_complete = False
        self.disconnected = False
        self._parts: list[bytes] = []
        self._size = 0
        self._too_large = False
        self._body_ready: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None

    # -- the protocol's side -------------------------------------------------------------------------------

    def start(self) -> None:
        tasks = self.protocol.tasks
        self._task = task = self.protocol.loop.create_task(self._run())
        task.add_done_callback(tasks.discard)
        tasks.add(task)

    def feed(self, body: bytes) -> None:
        if self._too_large:
            return  # 413 is on its way, after which the connection reads nothing more
        self._size += len(body)
        if self._size > self.endpoint.max_body_bytes:
            self._too_large = True
            self._parts.clear()
            self._wake()
        else:
            self._parts.append(body)

    def complete(self) -> None:
        self.more_body = False
        self._wake()

    def lost(self) -> None:
        if self.response_complete:
            return
        self.disconnected = True
        if self._task is not None and not self._task.done():
            self._task.cancel()

    def _wake(self) -> None:
        if self._body_ready is not None and not self._body_ready.done():
            self._body_ready.set_result(None)

    async def _run(self) -> None:
        try:
            await self.endpoint.serve(self)
        except asyncio.CancelledError:
            if not self.disconnected:
                raise
        except Exception:
            logger.exception("POST %r failed", self.target[:40])
            if not self.response_started and not self.disconnected:  # as uvicorn's cycle answers, in OpenAI's body
                error = internal_error()
                self.keep_alive = False
                await self.respond(error.http_status, {}, orjson.dumps(error.to_openai()))
            self.protocol.transport.close()
        else:
            if not self.response_complete and not self.disconnected:
                logger.error("POST %r: the endpoint returned without completing its response", self.target[:40])
                self.protocol.transport.close()

    # -- the endpoint's side (Exchange) --------------------------------------------------------------------

    async def body(self) -> bytes:
        while self.more_body and not self._too_large:
            if self.waiting_for_100_continue and not self.protocol.transport.is_closing():
                self.protocol.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                self.waiting_for_100_continue = False
            self._body_ready = self.protocol.loop.create_future()
            await self._body_ready
        if self._too_large:
            raise body_too_large(self._size, self.endpoint.max_body_bytes)
        parts, self._parts = self._parts, []
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def until_disconnected(self, work: Awaitable[T]) -> T | None:
        try:
            return await work
        except asyncio.CancelledError:
            if not self.disconnected:
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
            return None

    async def respond(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        if self.protocol.flow.write_paused and not self.disconnected:
            await self.protocol.flow.drain()  # a pipelined request's answer waits for the one before it to drain
        if self.disconnected:
            return
        head = self._head(status, headers, b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body))
        self.protocol.transport.write(head + body)
        self._completed()

    async def stream(self, headers: Mapping[str, str], events: AsyncGenerator[bytes, None]) -> None:
        transport, flow = self.protocol.transport, self.protocol.flow
        try:
            if self.disconnected:
                return
            transport.write(
                self._head(
                    200,
                    headers,
                    b"cache-control: no-cache\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                    b"transfer-encoding: chunked\r\n",
                )
            )
            async for event in events:
                if flow.write_paused:
                    await flow.drain()
                if self.disconnected:
                    return
                transport.write(b"%x\r\n%b\r\n" % (len(event), event))
            transport.write(b"0\r\n\r\n")
            self._completed()
        except asyncio.CancelledError:
            if not self.disconnected:
                raise
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
        finally:
            await events.aclose()

    def _head(self, status: int, headers: Mapping[str, str], fixed: bytes) -> bytes:
        """The status line and headers; `headers`' values are checked as uvicorn checks them (no CR, LF or
        other controls), the rest are this module's."""
        values = [value.encode("latin-1") for value in headers.values()]
        if HEADER_VALUE_RE.search(b"".join(values)):
            raise RuntimeError("Invalid HTTP header value.")
        self.response_started = True
        self.waiting_for_100_continue = False
        if self.more_body:
            self.keep_alive = False  # answered before the body's end: the connection ends after this answer
        parts: list[bytes] = [STATUS_LINE[status]]
        for name, value in self.protocol.server_state.default_headers:
            parts += [name, b": ", value, b"\r\n"]
        for header, value in zip(headers, values, strict=True):
            parts += [header.encode("latin-1"), b": ", value, b"\r\n"]
        parts.append(fixed)
        parts.append(b"\r\n" if self.keep_alive else b"connection: close\r\n\r\n")
        return b"".join(parts)

    def _completed(self) -> None:
        self.response_complete = True
        protocol = self.protocol
        if protocol._serving is self:
            protocol._serving = None
        if not self.keep_alive and not self.more_body:
            protocol.transport.close()
        protocol.on_response_complete()  # with the body unread, a lingering close


def raise_open_files_limit(connections: int) -> None:
    """Raise this process's soft open-files limit (up to its hard limit) so that `connections` sockets and
    some headroom fit; warn when they cannot (the kernel's accept would fail before the connection cap)."""
    needed = connections + 256  # gRPC channels, logs, the tokenizer's files
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < needed:
        logger.warning(
            "open-files limit %d is below --max-connections %d + 256: accept will fail first; raise ulimit -n",
            soft, connections,
        )  # fmt: skip
