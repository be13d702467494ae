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
- Malformed HTTP gets 400 in OpenAI's body (uvicorn answers plain text).
- `Upgrade` (WebSocket, h2c) is never honoured, and httptools would parse an upgrade request's body as the
  next request (a request hidden in a body, past whatever a proxy checked): an upgrade request with a body
  gets 400; one without is served as plain HTTP/1.1 and its connection closed after the response, nothing
  after it parsed. Neither is logged (uvicorn warns twice per request, which any client could repeat).

Every refusal ends its connection with a lingering close: the answer is written, the write side shut, and
whatever the client still sends is read and dropped for up to `LINGER_S`, so that the client reads the answer
instead of a reset. A refusal while a response is still being sent on the connection (a pipelined head)
closes it without an answer, which would corrupt that response.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import resource
from dataclasses import dataclass
from typing import Any

import httptools
import orjson
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from gateway.errors import GatewayError, HeadersTooLarge, InvalidRequestError, RequestTimeout, TooManyConnections

logger = logging.getLogger(__name__)

LINGER_S = 2.0
REFUSAL_LOG_S = 10.0
_HEADER_OVERHEAD = 4  # ": " and CRLF around each header


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
        self._after_upgrade = False  # an upgrade request was served: nothing after it is parsed

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
        super().connection_lost(exc)

    def eof_received(self) -> bool | None:
        if self._lingering:
            self.transport.close()
        return None

    def data_received(self, data: bytes) -> None:
        if self._lingering or self._after_upgrade:
            return  # read and dropped until the connection closes
        self._unset_keepalive_if_required()
        self._last_read = self.loop.time()
        if self._awaiting_head:
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
        elif self._body_timer is None and self.cycle is not None and self.cycle.more_body:
            self._body_timer = self.loop.call_later(self.limits.header_timeout, self._body_stalled)

    # -- the parser's callbacks ------------------------------------------------------------------------------

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_begun = True

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
        super().on_headers_complete()
        if upgrade:
            self.cycle.keep_alive = False

    def on_message_complete(self) -> None:
        super().on_message_complete()
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        self._awaiting_head = True
        self._head_begun = False
        self._received_head_bytes = 0

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
        """Answer `error` (OpenAI's body, Connection: close) and end the connection with a lingering close."""
        self._lingering = True
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        self._unset_keepalive_if_required()
        if self.transport.is_closing():
            return
        if self.cycle is not None and not self.cycle.response_complete:
            self.transport.close()  # a response is being sent: an answer now would corrupt it
            return
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
        if self.transport.can_write_eof():
            self.transport.write_eof()
            self._linger_timer = self.loop.call_later(LINGER_S, self.transport.close)
        else:
            self.transport.close()


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
