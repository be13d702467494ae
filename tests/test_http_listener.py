"""The gateway's HTTP server's stop (gateway.frontdoors.http_listener.HttpServer), as a drain ends it: listening
stops, an idle keep-alive connection is closed at once, a response in flight ends whole with `connection: close`;
after `force_exit`, nothing is waited for."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.frontdoors.http_listener import HttpServer
from gateway.frontdoors.http_protocol import Exchange
from gateway.frontdoors.http_routes import HttpRoutes, Reply, Route

GET_FAST = b"GET /fast HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"
GET_SLOW = b"GET /slow HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n"


def app(release: asyncio.Event) -> HttpRoutes:
    async def fast(exchange: Exchange) -> Reply:
        return Reply(200, {}, b"{}")

    async def slow(exchange: Exchange) -> Reply:
        await release.wait()
        return Reply(200, {}, b'{"slow":true}')

    return HttpRoutes([Route(b"GET", "/fast", fast), Route(b"GET", "/slow", slow)], 1024)


def test_stop_closes_idle_connections_and_lets_a_response_in_flight_end() -> None:
    async def main() -> None:
        release = asyncio.Event()
        server = HttpServer.start(app(release), "127.0.0.1", 0)
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", server.port)
        idle_writer.write(GET_FAST)
        assert (await idle_reader.readuntil(b"{}")).startswith(b"HTTP/1.1 200")
        busy_reader, busy_writer = await asyncio.open_connection("127.0.0.1", server.port)
        busy_writer.write(GET_SLOW)
        await asyncio.sleep(0.1)
        stopping = asyncio.create_task(server.stop())
        assert await asyncio.wait_for(idle_reader.read(), 2) == b"", "an idle connection is closed at once"
        with pytest.raises(OSError):
            await asyncio.open_connection("127.0.0.1", server.port)
        assert not stopping.done(), "the response in flight is waited for"
        release.set()
        answer = await asyncio.wait_for(busy_reader.read(), 2)
        assert answer.startswith(b"HTTP/1.1 200") and b"connection: close" in answer
        assert answer.endswith(b'{"slow":true}')
        await asyncio.wait_for(stopping, 2)
        for writer in (idle_writer, busy_writer):
            writer.close()

    asyncio.run(main())


def test_after_force_exit_stop_waits_for_nothing() -> None:
    async def main() -> None:
        server = HttpServer.start(app(asyncio.Event()), "127.0.0.1", 0)
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        writer.write(GET_SLOW)
        await asyncio.sleep(0.1)
        server.force_exit()
        started = time.monotonic()
        await server.stop()
        assert time.monotonic() - started < 0.5
        assert await asyncio.wait_for(reader.read(), 2) == b"", "cut without an answer"
        assert server.open_connections == 0
        writer.close()

    asyncio.run(main())
