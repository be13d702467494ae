"""What a hostile HTTP client can do to a front door on this machine: a huge header, thousands of headers,
slowloris and idle connections, connections past the cap, and a chunked body's framing: millions of
trailers, a huge chunk extension, a key sent only as a trailer, a body sent on after a 401 (the gateway's
HTTP limits, docs/gateway.md).

    python -m benchmarks.http_abuse --port 8000 [--pid PID] [--api-key KEY] [--connections 150] [--wait 30]

With `--api-key` (a key the gateway accepts) the framing attacks carry it, so the server reads their bodies;
without, each is answered 401 first (what an attacker without a key gets to do after it).

Only loopback is a target. Every attack is bounded in bytes, connections and seconds; the report is one
line per attack: the answer's status (or `closed` / `open`), and when it came.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from pathlib import Path

HOST = "127.0.0.1"
HEAD = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n"
BODY = b'{"prompt": "hi", "max_tokens": 2}'


def chunked_post(api_key: str | None) -> bytes:
    key = b"authorization: Bearer %b\r\n" % api_key.encode() if api_key else b""
    return b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n%btransfer-encoding: chunked\r\n\r\n" % key


def rss_mib(pid: int | None) -> str:
    if pid is None:
        return ""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return f"; gateway RSS {int(line.split()[1]) / 1024:.0f} MiB"
    return ""


async def status_of(reader: asyncio.StreamReader, timeout: float) -> str:
    try:
        line = await asyncio.wait_for(reader.readline(), timeout)
    except (TimeoutError, ConnectionError):
        return "open" if not reader.at_eof() else "closed"
    return line.split()[1].decode() if line.startswith(b"HTTP/") else "closed"


async def big_header(port: int, mib: int) -> str:
    reader, writer = await asyncio.open_connection(HOST, port)
    start = time.perf_counter()
    writer.write(HEAD + b"x-big: ")
    sent, chunk = 0, b"a" * 65536
    read = asyncio.ensure_future(reader.readline())
    try:
        while sent < mib * 2**20 and not read.done():
            writer.write(chunk)
            await writer.drain()
            sent += len(chunk)
    except ConnectionError:
        pass
    try:
        line = await asyncio.wait_for(read, 5)
    except (TimeoutError, ConnectionError):
        line = b""
    status = line.split()[1].decode() if line.startswith(b"HTTP/") else "no answer"
    writer.close()
    elapsed = time.perf_counter() - start
    return f"{mib} MiB header: {status} after {elapsed:.2f} s (the client had written {sent / 2**20:.0f} MiB)"


async def stream_until_answered(port: int, start: bytes, filler: bytes, most: int) -> tuple[str, int, float]:
    """Write `start`, then `filler` until the server answers, stops reading, or `most` bytes went: the
    answer's status (or `open` / `closed`), the bytes of filler written before it, the seconds it took."""
    reader, writer = await asyncio.open_connection(HOST, port)
    started = time.perf_counter()
    writer.write(start)
    read = asyncio.ensure_future(reader.readline())
    sent = 0
    try:
        while sent < most and not read.done():
            writer.write(filler)
            await writer.drain()
            sent += len(filler)
    except ConnectionError:
        pass
    elapsed = time.perf_counter() - started
    try:
        line = await asyncio.wait_for(read, 5)
        status = line.split()[1].decode() if line.startswith(b"HTTP/") else "closed"
    except (TimeoutError, ConnectionError):
        status = "closed" if reader.at_eof() else "open"
    writer.close()
    return status, sent, elapsed


async def trailers(port: int, count: int, api_key: str | None, pid: int | None) -> str:
    batch = b"x-t: 1\r\n" * 10_000
    start = chunked_post(api_key) + b"%x\r\n%b\r\n0\r\n" % (len(BODY), BODY)
    status, sent, elapsed = await stream_until_answered(port, start, batch, count * 8)
    written = f"the client had written {sent // 8:,}"
    return f"{count:,} trailers: {status} after {elapsed:.2f} s ({written}){rss_mib(pid)}"


async def chunk_extension(port: int, mib: int, api_key: str | None) -> str:
    start = chunked_post(api_key) + b"5;ext="
    status, sent, elapsed = await stream_until_answered(port, start, b"a" * 65536, mib << 20)
    written = f"the client had written {sent / 2**20:.0f} MiB"
    return f"a {mib} MiB chunk extension: {status} after {elapsed:.2f} s ({written})"


async def key_in_trailer(port: int, api_key: str | None) -> str:
    """The head carries no key, the trailer a valid one, all in one write."""
    if not api_key:
        return "a key only in a trailer: skipped (no --api-key)"
    reader, writer = await asyncio.open_connection(HOST, port)
    chunked = b"%x\r\n%b\r\n" % (len(BODY), BODY)
    writer.write(chunked_post(None) + chunked + b"0\r\nauthorization: Bearer %b\r\n\r\n" % api_key.encode())
    status = await status_of(reader, 10)
    writer.close()
    return f"a key only in a trailer: {status}"


async def body_after_401(port: int, seconds: float) -> str:
    """No key, a 1 GiB Content-Length, then the body for up to `seconds`: whether the server ends the
    connection after its 401 or reads on."""
    reader, writer = await asyncio.open_connection(HOST, port)
    started = time.perf_counter()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-length: %d\r\n\r\n" % 2**30)
    status = await status_of(reader, 5)
    shut_at: list[float] = []  # when the server shut its side (the rest of the answer, then end of stream)
    eof = asyncio.ensure_future(reader.read())
    eof.add_done_callback(lambda _: shut_at.append(time.perf_counter() - started))
    sent, closed = 0, None
    try:
        async with asyncio.timeout(seconds):
            while sent < 2**30:
                writer.write(b"a" * 65536)
                await writer.drain()
                sent += 65536
    except TimeoutError:
        pass
    except ConnectionError:
        closed = time.perf_counter() - started
    writer.close()
    if not eof.cancel():
        eof.exception()  # a reset, once closed: retrieved, not logged
    shut = shut_at[0] if shut_at else None
    ends = f"its side shut at {shut:.2f} s" if shut is not None else "its side open"
    ends += f", closed at {closed:.2f} s" if closed is not None else ", never closed"
    return f"a body after the {status}: the server read {sent / 2**20:.0f} MiB in {seconds:g} s at most; {ends}"


async def many_headers(port: int, count: int) -> str:
    reader, writer = await asyncio.open_connection(HOST, port)
    writer.write(HEAD + b"".join(b"x-h%d: 1\r\n" % i for i in range(count)) + b"\r\n")
    await writer.drain()
    status = await status_of(reader, 10)
    writer.close()
    return f"{count} headers: {status}"


async def held(port: int, count: int, wait: float, slow: bool) -> str:
    """`count` connections that send a head one byte a second (slow) or nothing; when each was closed."""
    start = time.perf_counter()

    async def one() -> float | None:
        reader, writer = await asyncio.open_connection(HOST, port)
        try:
            async with asyncio.timeout(wait):
                payload = HEAD + b"x-slow: " + b"a" * 10_000
                for i in range(len(payload) if slow else 0):
                    writer.write(payload[i : i + 1])
                    await writer.drain()
                    if await status_of(reader, 1.0) != "open":
                        return time.perf_counter() - start
                while await reader.read(65536):
                    pass
                return time.perf_counter() - start
        except (TimeoutError, ConnectionError):
            return None if not reader.at_eof() else time.perf_counter() - start
        finally:
            writer.close()

    closed = [t for t in await asyncio.gather(*(one() for _ in range(count))) if t is not None]
    kind = "slowloris (1 byte/s)" if slow else "idle"
    if not closed:
        return f"{count} {kind} connections: none closed in {wait:g} s"
    return (
        f"{count} {kind} connections: {len(closed)} closed, median {statistics.median(closed):.1f} s, "
        f"max {max(closed):.1f} s"
    )


async def over_cap(port: int, count: int) -> str:
    """`count` connections opened at once, each asking GET /health: how many were served and refused."""
    opened = []
    for _ in range(count):
        opened.append(await asyncio.open_connection(HOST, port))
    start = time.perf_counter()
    for _, writer in opened:
        writer.write(HEAD + b"\r\n")
    statuses = await asyncio.gather(*(status_of(reader, 10) for reader, _ in opened))
    elapsed = time.perf_counter() - start
    for _, writer in opened:
        writer.close()
    counts = {s: statuses.count(s) for s in sorted(set(statuses))}
    return f"{count} connections at once: {counts} in {elapsed * 1000:.0f} ms"


async def main(args: argparse.Namespace) -> None:
    print(f"before{rss_mib(args.pid)}", flush=True)
    print(await big_header(args.port, args.header_mib) + rss_mib(args.pid), flush=True)
    print(await many_headers(args.port, 20_000), flush=True)
    print(await trailers(args.port, args.trailers, args.api_key, args.pid), flush=True)
    print(await chunk_extension(args.port, args.extension_mib, args.api_key), flush=True)
    print(await key_in_trailer(args.port, args.api_key), flush=True)
    print(await body_after_401(args.port, 5.0), flush=True)
    print(await held(args.port, 50, args.wait, slow=True), flush=True)
    print(await held(args.port, 50, args.wait, slow=False), flush=True)
    print(await over_cap(args.port, args.connections), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True, help="the gateway's HTTP port on 127.0.0.1")
    parser.add_argument("--pid", type=int, default=None, help="the gateway's pid, to report its RSS")
    parser.add_argument("--header-mib", type=int, default=64)
    parser.add_argument("--api-key", default=None, help="a key the gateway accepts, for the framing attacks")
    parser.add_argument("--trailers", type=int, default=2_000_000, help="trailers after one chunked body")
    parser.add_argument("--extension-mib", type=int, default=256, help="one chunk extension's size")
    parser.add_argument("--connections", type=int, default=150, help="opened at once (above --max-connections)")
    parser.add_argument("--wait", type=float, default=30.0, help="seconds a held connection is watched")
    asyncio.run(main(parser.parse_args()))
