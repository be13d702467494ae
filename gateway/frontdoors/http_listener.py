"""`HttpServer`: an `HttpApp` served on one listening socket by gateway.frontdoors.http_protocol's connection,
in the running event loop, and its graceful stop.

    start ─► listen (SO_REUSEPORT when processes share the port) ─► serve ... ─► stop: stop listening, idle
        connections closed, busy ones after their response (`connection: close`), up to GRACEFUL_STOP_S;
        then every request still running is cancelled and its connection closed

`force_exit` (the gateway's drain already ended every stream with an error event) makes `stop` wait for
nothing. The socket is created and bound here (`listen_socket`) so that the real port is known before serving.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass

from gateway.frontdoors.http_protocol import HttpApp, HttpConnection, HttpLimits, ServerState, raise_open_files_limit
from kvroute.errors import UserError

logger = logging.getLogger(__name__)

GRACEFUL_STOP_S = 5.0  # how long `stop` waits for open responses to end
LISTEN_BACKLOG = 2048


def bound_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A bound TCP socket (port 0: a free one); `reuse_port`: SO_REUSEPORT, for several processes."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP spelled out: asyncio disables Nagle only on sockets whose proto says TCP, and accepted
    # sockets inherit it (with proto 0, keep-alive responses waited ~40 ms for delayed ACKs).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UserError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    return sock


def listen_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A bound, listening TCP socket (port 0: a free one), so the real port is known before serving."""
    sock = bound_socket(host, port, reuse_port)
    sock.listen(LISTEN_BACKLOG)
    sock.setblocking(False)
    return sock


@dataclass
class HttpServer:
    """An `HttpApp` served on host:port; `task` ends when the server stops (or fails to start)."""

    port: int
    state: ServerState
    task: asyncio.Task[None]
    _stopping: asyncio.Event
    _force_exit: bool = False

    @classmethod
    def start(
        cls, app: HttpApp, host: str, port: int, limits: HttpLimits | None = None, reuse_port: bool = False
    ) -> HttpServer:
        """Serve `app` on host:port (0: a free one) under `limits` (default: HttpLimits' defaults), sharing the
        port with other processes when `reuse_port`. Call it in the running loop."""
        limits = limits or HttpLimits()
        raise_open_files_limit(limits.max_connections)
        sock = listen_socket(host, port, reuse_port)
        state = ServerState()
        stopping = asyncio.Event()
        task = asyncio.create_task(_serve(app, limits, state, sock, stopping))
        return cls(sock.getsockname()[1], state, task, stopping)

    @property
    def open_connections(self) -> int:
        return len(self.state.connections)

    def force_exit(self) -> None:
        """Make the next `stop` close open connections without waiting for their responses to end."""
        self._force_exit = True

    async def stop(self) -> None:
        """Stop listening; open requests get GRACEFUL_STOP_S to end (none after `force_exit`), then are cut."""
        if self.task.done():
            return
        self._stopping.set()
        await asyncio.shield(self.task)
        state = self.state
        for connection in list(state.connections):
            connection.shutdown()
        if not self._force_exit:
            try:
                async with asyncio.timeout(GRACEFUL_STOP_S):
                    while state.connections or state.tasks:
                        await asyncio.sleep(0.1)
            except TimeoutError:
                logger.error(
                    "HTTP stop: %d requests still running after %g s; cancelled", len(state.tasks), GRACEFUL_STOP_S
                )
        for task in list(state.tasks):
            task.cancel()
        for connection in list(state.connections):
            connection.transport.close()


async def _serve(
    app: HttpApp, limits: HttpLimits, state: ServerState, sock: socket.socket, stopping: asyncio.Event
) -> None:
    """Accept connections until `stopping`; the date header refreshed each second meanwhile."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: HttpConnection(app, limits, state), sock=sock, backlog=LISTEN_BACKLOG)
    try:
        while not stopping.is_set():
            state.refresh_date()
            try:
                async with asyncio.timeout(1.0):
                    await stopping.wait()
            except TimeoutError:
                pass
    finally:
        server.close()
