"""What a hostile HTTP client can do to a front door on this machine: a huge header, thousands of headers,
slowloris and idle connections, connections past the cap (the gateway's HTTP limits, docs/gateway.md).

    python -m benchmarks.http_abuse --port 8000 [--pid PID] [--connections 150] [--wait 30]

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
    print(await held(args.port, 50, args.wait, slow=True), flush=True)
    print(await held(args.port, 50, args.wait, slow=False), flush=True)
    print(await over_cap(args.port, args.connections), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, required=True, help="the gateway's HTTP port on 127.0.0.1")
    parser.add_argument("--pid", type=int, default=None, help="the gateway's pid, to report its RSS")
    parser.add_argument("--header-mib", type=int, default=64)
    parser.add_argument("--connections", type=int, default=150, help="opened at once (above --max-connections)")
    parser.add_argument("--wait", type=float, default=30.0, help="seconds a held connection is watched")
    asyncio.run(main(parser.parse_args()))
