"""The HTTP/1.1 connection the gateway's HTTP doors serve: an asyncio protocol over httptools' parser, owned here
outright (no server's private classes), with the limits a server exposed to untrusted clients needs (DESIGN §4,
limits). Every request of every endpoint goes through one `RequestCycle`, the `Exchange` an `HttpApp` reads and
answers (gateway.frontdoors.http_routes); `HttpServer` (gateway.frontdoors.http_listener) listens and drains.

    accept ─(max_connections)─► head ─(max_header_bytes, max_headers, header_timeout)─► body, response
        ─► keep-alive wait ─(keep_alive_timeout)─► the next head ... or close

- `max_connections`: a connection accepted while this process holds that many open is answered at once with
  503 (OpenAI's body, `Retry-After: 1`, `Connection: close`) and closed; the connections already open keep
  being served. A 503 rather than a silent close, so that a client or load balancer learns the cause and
  retries another replica (a reset reads as a network fault).
- `max_header_bytes` (request line and headers together) and `max_headers`: past either, 431. They are
  counted while the head streams in, so an oversize head is never held whole (httptools itself buffers a
  header until it ends, with no bound).
- `header_timeout`: a request's head must arrive whole within this many seconds of its first byte (for a
  connection's first request, of the connection's opening): else 408, or a plain close when nothing came.
  A body that stops arriving for as long (while the server is reading it) closes the connection, which the
  app sees as a client that left.
- `keep_alive_timeout`: the wait between a response and the next request's first byte.
- A chunked body's framing is not body: trailers are refused (400; the API reads none, and httptools would
  hand them to `on_header` after the body, past every head limit and where a check could read a key the head
  never carried), and chunk extensions count against `max_header_bytes` beyond `CHUNK_FRAMING_BYTES` a chunk
  (400 past it; httptools does not expose them, so the bytes received that were not body bound them: Node's
  CVE-2024-22019 was an unbounded extension read).
- A request answered before its body was read whole (401 before the body, 413) ends its connection: the
  body is not read on as if the next request could follow it.
- Malformed HTTP gets 400 in OpenAI's body.
- `Expect: 100-continue` gets 100 Continue from HTTP/1.1 only (RFC 9110 §15.2: never a 1xx to HTTP/1.0),
  when the app first reads the body.
- `Upgrade` (WebSocket, h2c) is never honoured, and httptools would parse an upgrade request's body as the
  next request (a request hidden in a body, past whatever a proxy checked): an upgrade request with a body
  gets 400; one without is served as plain HTTP/1.1 and its connection closed after the response, nothing
  after it parsed. Neither is logged.
- Pipelining: a request whose head arrives while the one before it is answered waits (reading paused) and
  starts when that response ends; responses leave in order. Writes wait while the transport's buffer is over
  its high-water mark (`pause_writing`), so a slow reader holds no more than that per connection.
- The body is buffered up to the app's `max_body_bytes` (then 413 when the app reads it), so a body is never
  held past the limit.

Every refusal, and every answer given before its request's body was read whole, ends its connection with a
lingering close: the answer is written, the write side shut, and whatever the client still sends is read
and dropped (its first `LINGER_BYTES`; then no more is read) for up to `LINGER_S`, so that the client reads
the answer instead of a reset. A refusal while a response is still being sent on the connection (a
pipelined head) closes it without an answer, which would corrupt that response.
"""

from __future__ import annotations

import asyncio
import email.utils
import http
import logging
import math
import re
import resource
from collections import deque
from collections.abc import AsyncGenerator, Awaitable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeVar, cast
from urllib.parse import unquote

import httptools
import orjson

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
JSON = b"application/json"
# A response header value may carry no control character but a tab (RFC 9110 §5.5: CR or LF would split it).
_BAD_HEADER_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
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


class Exchange(Protocol):
    """One request as an `HttpApp` sees it: its method, path and headers, its body, its response (exactly one
    `respond` or `stream`). Served by `RequestCycle`."""

    method: bytes  # as received: b"GET", b"POST"
    path: str  # the target's path, percent-decoded, without its query
    headers: list[tuple[bytes, bytes]]  # the head's, as received, names lower-case

    @property
    def query(self) -> str:
        """The target's query as sent (after `?`, before any `#`), latin-1 text; empty without one."""
        ...

    async def body(self) -> bytes:
        """The whole body; BodyTooLarge once it passes the app's `max_body_bytes`; the task cancelled if the
        client leaves first."""
        ...

    async def until_disconnected(self, work: Awaitable[T]) -> T | None:
        """`work`'s result, or None once the client has left (then `work` was cancelled where it waited)."""
        ...

    async def respond(self, status: int, headers: Mapping[str, str], body: bytes, content_type: bytes = JSON) -> None:
        """A whole response (its head only, to a HEAD request); nothing when the client has left."""
        ...

    async def stream(self, headers: Mapping[str, str], events: AsyncGenerator[bytes, None]) -> None:
        """A 200 of server-sent events from `events` until they end or the client leaves; `events` is closed
        however it ends."""
        ...


class HttpApp(Protocol):
    """What a connection serves: every request, through its `Exchange`."""

    max_body_bytes: int  # a body past it is not held (the app gets BodyTooLarge when it reads the body)

    async def serve(self, exchange: Exchange) -> None:
        """Answer the request; an exception that escapes is logged, answered 500 if no response began, and
        closes the connection."""
        ...


def internal_error() -> GatewayError:
    """The 500 of a request whose handling failed (and was logged)."""
    return GatewayError("the server failed to answer this request; it has been logged")


def body_too_large(size: int, limit: int) -> BodyTooLarge:
    return BodyTooLarge(f"request body has {size} bytes or more; this server accepts at most {limit}")


def status_line(status: int) -> bytes:
    try:
        phrase = http.HTTPStatus(status).phrase
    except ValueError:
        phrase = ""
    return b"HTTP/1.1 %d %s\r\n" % (status, phrase.encode())


_STATUS_LINES = {status.value: status_line(status.value) for status in http.HTTPStatus}


@dataclass
class ServerState:
    """What the connections of one server share: the open ones (the cap counts them), the running request
    tasks (a drain waits for them), and the headers every response carries (`date`, refreshed each second by
    the server)."""

    connections: set[HttpConnection] = field(default_factory=set)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    default_headers: bytes = b""

    def refresh_date(self) -> None:
        self.default_headers = b"date: %s\r\n" % email.utils.formatdate(usegmt=True).encode()


class _Refused(Exception):
    """Raised from a parser callback to stop parsing; the refusal itself is in `_refusal`."""


class HttpConnection(asyncio.Protocol):
    """One client connection under `HttpLimits` (see the module docstring), its requests served by `app`."""

    _refused_unlogged = 0  # connections refused over the cap since the last warning (process-wide)
    _refusal_logged_at = -math.inf

    def __init__(self, app: HttpApp, limits: HttpLimits, state: ServerState) -> None:
        self.app = app
        self.limits = limits
        self.state = state
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport = None  # type: ignore[assignment]  # set by connection_made
        self.cycle: RequestCycle | None = None  # the request being parsed (or the last one)
        self.serving: RequestCycle | None = None  # the request whose response is being written
        self.pipeline: deque[RequestCycle] = deque()  # parsed requests waiting for the responses before them
        self.read_paused = False
        self.write_paused = False
        self._writable = asyncio.Event()
        self._writable.set()
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._expect_continue = False  # the head being parsed asks for 100 Continue
        self._awaiting_head = True  # no complete head yet for the connection's next request
        self._head_begun = False  # the parser has seen the first byte of that head
        self._received_head_bytes = 0  # raw bytes since that head began: bounds a header httptools still buffers
        self._head_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._keep_alive_timer: asyncio.TimerHandle | None = None
        self._linger_timer: asyncio.TimerHandle | None = None
        self._last_read = 0.0
        self._refusal: GatewayError | None = None
        self._lingering = False
        self._lingered_bytes = 0
        self._after_upgrade = False  # an upgrade request was served: nothing after it is parsed
        # The body being parsed: its chunks, its bytes (of the connection so far), its framing bytes.
        self._messages = 0  # requests parsed whole on this connection
        self._chunks = 0
        self._body_bytes = 0
        self._framing_bytes = 0

    # -- the connection ------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's TCPTransport, no asyncio subclass
        if len(self.state.connections) >= self.limits.max_connections:
            self._log_refusal()
            self._refuse(
                TooManyConnections(
                    f"this server holds {self.limits.max_connections} connections, its limit; retry shortly",
                    retry_after=1.0,
                )
            )
            return
        self.state.connections.add(self)
        self._head_timer = self.loop.call_later(self.limits.header_timeout, self._head_timed_out)

    def connection_lost(self, exc: Exception | None) -> None:
        self.state.connections.discard(self)
        for timer in (self._head_timer, self._body_timer, self._keep_alive_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._keep_alive_timer = self._linger_timer = None
        for cycle in (self.serving, self.cycle, *self.pipeline):
            if cycle is not None:
                cycle.lost()
        self.pipeline.clear()
        self._writable.set()  # a writer waiting to drain wakes and finds its client gone

    def eof_received(self) -> bool | None:
        if self._lingering:
            self.transport.close()
        return None

    def pause_writing(self) -> None:
        self.write_paused = True
        self._writable.clear()

    def resume_writing(self) -> None:
        self.write_paused = False
        self._writable.set()

    async def drain(self) -> None:
        """Wait until the transport takes writes again (or the connection is lost)."""
        await self._writable.wait()

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.read_paused = True
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()

    def shutdown(self) -> None:
        """A drain's end: close an idle connection now, a busy one after its response."""
        if self.cycle is None or self.cycle.response_complete:
            self.transport.close()
        else:
            self.cycle.keep_alive = False

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._lingered_bytes += len(data)
            if self._lingered_bytes > LINGER_BYTES:
                self.transport.pause_reading()  # what a client sends on after its answer costs no more reads
            return
        if self._after_upgrade:
            return  # read and dropped until the connection closes
        if self._keep_alive_timer is not None:
            self._keep_alive_timer.cancel()
            self._keep_alive_timer = None
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
        self._head_begun = True
        self._url = b""
        self._headers = []
        self._expect_continue = False

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._awaiting_head:  # after the head: a trailer of a chunked body
            self._refusal = InvalidRequestError(
                "this server accepts no trailers after a chunked body; send every header in the request's head"
            )
            raise _Refused
        name = name.lower()
        if name == b"expect" and value.lower() == b"100-continue":
            self._expect_continue = True
        self._headers.append((name, value))

    def on_chunk_header(self) -> None:
        self._chunks += 1

    def on_headers_complete(self) -> None:
        """The head's exact size and count, checked once it is whole (while it streams in, the bytes received
        bound it); then the request's cycle, started now or after the responses before it."""
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        headers = self._headers
        if len(headers) > self.limits.max_headers:
            self._refusal = HeadersTooLarge(
                f"the request has more than {self.limits.max_headers} headers, this server's limit"
            )
            raise _Refused
        size = len(self._url) + sum(len(name) + len(value) for name, value in headers)
        if size + _HEADER_OVERHEAD * len(headers) > self.limits.max_header_bytes:
            self._refusal = self._head_too_large()
            raise _Refused
        upgrade = self.parser.should_upgrade()
        if upgrade and any(
            name == b"transfer-encoding" or (name == b"content-length" and value.strip() != b"0")
            for name, value in headers
        ):
            self._refusal = InvalidRequestError(
                "this server does not switch protocols; send a request with a body without an Upgrade header"
            )
            raise _Refused
        try:
            path = request_path(self._url)
        except httptools.HttpParserInvalidURLError:
            self._refusal = InvalidRequestError("malformed HTTP request (the request target is not a URL)")
            raise _Refused from None
        self._awaiting_head = False
        self._chunks = self._framing_bytes = 0
        http_1_1 = self.parser.get_http_version() == "1.1"
        expect_continue = http_1_1 and self._expect_continue  # RFC 9110 §15.2: no 1xx to an HTTP/1.0 client
        keep_alive = http_1_1 and self.parser.should_keep_alive() and not upgrade
        cycle = RequestCycle(self, self.parser.get_method(), path, self._url, headers, keep_alive, expect_continue)
        existing, self.cycle = self.cycle, cycle
        if existing is None or existing.response_complete:
            self._start(cycle)
        else:  # pipelined: it waits for the response before it
            self.pause_reading()
            self.pipeline.append(cycle)

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self.cycle is not None:
            self.cycle.feed(body)

    def on_message_complete(self) -> None:
        if self.cycle is not None:
            self.cycle.complete()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._awaiting_head = True
        self._head_begun = False
        self._received_head_bytes = 0
        self._messages += 1

    # -- the requests ------------------------------------------------------------------------------------------

    def _start(self, cycle: RequestCycle) -> None:
        self.serving = cycle
        task = self.loop.create_task(cycle.run())
        cycle.task = task
        self.state.tasks.add(task)
        task.add_done_callback(self.state.tasks.discard)

    def on_response_complete(self, cycle: RequestCycle) -> None:
        """`cycle`'s response is written: the next pipelined request starts, or the keep-alive wait."""
        if self.serving is cycle:
            self.serving = None
        if self.transport.is_closing():
            return
        if not self._awaiting_head and self.cycle is cycle:
            # Answered before its body was read whole (401 before the body, 413): the rest is not read on.
            self._linger_close()
            return
        self.resume_reading()
        if self.pipeline:
            self._start(self.pipeline.popleft())
        else:
            self._keep_alive_timer = self.loop.call_later(self.limits.keep_alive_timeout, self._keep_alive_ended)

    def _keep_alive_ended(self) -> None:
        self._keep_alive_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    # -- refusals ----------------------------------------------------------------------------------------------

    def _head_too_large(self) -> HeadersTooLarge:
        return HeadersTooLarge(
            f"the request line and headers pass {self.limits.max_header_bytes} bytes, this server's limit"
        )

    def _log_refusal(self) -> None:
        """One warning per REFUSAL_LOG_S at most, with the count since the last: a flood of connections must
        not become a flood of log lines."""
        cls = HttpConnection
        cls._refused_unlogged += 1
        now = self.loop.time()
        if now - cls._refusal_logged_at >= REFUSAL_LOG_S:
            logger.warning(
                "%d HTTP connections refused since the last report: %d open, the --max-connections cap",
                cls._refused_unlogged, len(self.state.connections),
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
        if self.read_paused or idle < self.limits.header_timeout:
            wait = self.limits.header_timeout - (0.0 if self.read_paused else idle)
            self._body_timer = self.loop.call_later(wait, self._body_stalled)
            return
        self._body_timer = None
        self.transport.close()

    def _refuse(self, error: GatewayError) -> None:
        """Answer `error` (OpenAI's body, Connection: close) and end the connection with a lingering close. A
        request whose response has not begun is abandoned unanswered (its app, if it runs, writes nothing);
        while a response is being sent the connection is closed without an answer, which would corrupt it."""
        if self.transport.is_closing():
            return
        serving = self.serving
        if self.pipeline or (serving is not None and serving.response_started):
            self._lingering = True
            self.transport.close()
            return
        for cycle in (serving, self.cycle):
            if cycle is not None:
                cycle.lost()
        body = orjson.dumps(error.to_openai())
        head = [_STATUS_LINES[error.http_status], self.state.default_headers]
        for name, value in (
            ("content-type", "application/json"),
            ("content-length", str(len(body))),
            ("connection", "close"),
            *error.http_headers().items(),
        ):
            head.append(f"{name}: {value}\r\n".encode("latin-1"))
        self.transport.write(b"".join([*head, b"\r\n", body]))
        self._linger_close()

    def _linger_close(self) -> None:
        """End the connection after what was written: shut the write side, then read and drop what the client
        still sends (up to LINGER_BYTES) for up to LINGER_S, so that it reads the answer rather than a reset."""
        self._lingering = True
        for timer in (self._head_timer, self._body_timer, self._keep_alive_timer):
            if timer is not None:
                timer.cancel()
        self._head_timer = self._body_timer = self._keep_alive_timer = None
        if self.transport.is_closing():
            return
        self.resume_reading()
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()


def request_path(target: bytes) -> str:
    """A request target's path, percent-decoded (as UTF-8), without its query; the absolute form's too.
    Raises httptools.HttpParserInvalidURLError for a target that is no URL."""
    if target[:1] == b"/" and b"?" not in target and b"%" not in target and b"#" not in target:
        return target.decode("latin-1")
    path = httptools.parse_url(target).path or b"/"
    return unquote(path.decode("latin-1"))


class RequestCycle:
    """One request on its connection (an `Exchange`): the body as the parser hands it over, the app's task, its
    response written straight to the transport. It keeps the body limit while the body streams in, 100
    Continue when the client waits for it, write flow control, keep-alive (`connection: close` when the
    request or a drain asks for it), and a client that leaves cancels the task where it waits
    (`until_disconnected`, `stream` and `body` end there)."""

    def __init__(
        self,
        connection: HttpConnection,
        method: bytes,
        path: str,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        keep_alive: bool,
        expect_100_continue: bool,
    ) -> None:
        self.connection = connection
        self.method = method
        self.path = path
        self.target = target  # the request line's, for the log
        self.headers = headers
        self.keep_alive = keep_alive  # a drain clears it
        self.waiting_for_100_continue = expect_100_continue
        self.max_body_bytes = connection.app.max_body_bytes
        self.more_body = True  # the parser has not seen the body's end
        self.response_started = False
        self.response_complete = False
        self.disconnected = False
        self.task: asyncio.Task[None] | None = None
        self._parts: list[bytes] = []
        self._size = 0
        self._too_large = False
        self._body_ready: asyncio.Future[None] | None = None

    @property
    def query(self) -> str:
        return self.target.partition(b"?")[2].partition(b"#")[0].decode("latin-1")

    # -- the connection's side -----------------------------------------------------------------------------

    def feed(self, body: bytes) -> None:
        if self._too_large:
            return  # 413 is on its way, after which the connection reads nothing more
        self._size += len(body)
        if self._size > self.max_body_bytes:
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
        if self.task is not None and not self.task.done():
            self.task.cancel()

    def _wake(self) -> None:
        if self._body_ready is not None and not self._body_ready.done():
            self._body_ready.set_result(None)

    async def run(self) -> None:
        try:
            await self.connection.app.serve(self)
        except asyncio.CancelledError:
            if not self.disconnected:
                raise
        except Exception:
            logger.exception("%s %r failed", self.method.decode("latin-1"), self.target[:40])
            if not self.response_started and not self.disconnected:
                error = internal_error()
                self.keep_alive = False
                await self.respond(error.http_status, {}, orjson.dumps(error.to_openai()))
            self.connection.transport.close()
        else:
            if not self.response_complete and not self.disconnected:
                logger.error("%r: the app returned without completing its response", self.target[:40])
                self.connection.transport.close()

    # -- the app's side (Exchange) -------------------------------------------------------------------------

    async def body(self) -> bytes:
        transport = self.connection.transport
        while self.more_body and not self._too_large:
            if self.waiting_for_100_continue and not transport.is_closing():
                transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                self.waiting_for_100_continue = False
            self._body_ready = self.connection.loop.create_future()
            await self._body_ready
        if self._too_large:
            raise body_too_large(self._size, self.max_body_bytes)
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

    async def respond(self, status: int, headers: Mapping[str, str], body: bytes, content_type: bytes = JSON) -> None:
        if self.connection.write_paused and not self.disconnected:
            await self.connection.drain()  # a pipelined request's answer waits for the one before it to drain
        if self.disconnected:
            return
        fixed = b"content-type: %b\r\ncontent-length: %d\r\n" % (content_type, len(body))
        self.connection.transport.write(self._head(status, headers, fixed) + (b"" if self.method == b"HEAD" else body))
        self._completed()

    async def stream(self, headers: Mapping[str, str], events: AsyncGenerator[bytes, None]) -> None:
        connection = self.connection
        transport = connection.transport
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
                if connection.write_paused:
                    await connection.drain()
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
        """The status line and headers; `headers`' values may carry no control character (a CR or LF would
        split the response), the rest are this module's."""
        values = [value.encode("latin-1") for value in headers.values()]
        if _BAD_HEADER_VALUE.search(b"".join(values)):
            raise ValueError("a response header value carries a control character")
        self.response_started = True
        self.waiting_for_100_continue = False
        if self.more_body:
            self.keep_alive = False  # answered before the body's end: the connection ends after this answer
        parts: list[bytes] = [_STATUS_LINES.get(status) or status_line(status), self.connection.state.default_headers]
        for header, value in zip(headers, values, strict=True):
            parts += [header.encode("latin-1"), b": ", value, b"\r\n"]
        parts.append(fixed)
        parts.append(b"\r\n" if self.keep_alive else b"connection: close\r\n\r\n")
        return b"".join(parts)

    def _completed(self) -> None:
        self.response_complete = True
        connection = self.connection
        if not self.keep_alive and not self.more_body:
            connection.transport.close()
        connection.on_response_complete(self)


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
