"""FastAPI vs Starlette on uvicorn (uvloop + httptools): per-request latency of a trivial JSON endpoint, a JSON
POST endpoint that validates a small pydantic body, and a streamed (SSE, 8 events) endpoint.

Run: python -m benchmarks.framework_bench (needs `pip install fastapi`, which kvroute itself does not use)
Each framework runs in its own uvicorn process; one sequential keep-alive client (http.client) measures,
interleaving the two servers round by round so machine noise hits both alike. Also measures the framework
alone: the ASGI app called in-process, no sockets.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import multiprocessing
import statistics
import time

import orjson
from pydantic import BaseModel

from launch.fleet import free_port

BODY = json.dumps({"model": "m", "prompt": "hello world " * 40, "max_tokens": 16, "temperature": 0.5}).encode()
EVENTS = 8


class Body(BaseModel):
    model: str
    prompt: str
    max_tokens: int = 16
    temperature: float = 1.0


async def sse():
    for i in range(EVENTS):
        yield b'data: {"i": %d}\n\n' % i
    yield b"data: [DONE]\n\n"


def starlette_app():
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    async def get_json(request: Request) -> Response:
        return Response(orjson.dumps({"ok": True}), media_type="application/json")

    async def post_json(request: Request) -> Response:
        body = Body.model_validate_json(await request.body())
        return Response(orjson.dumps({"n": body.max_tokens}), media_type="application/json")

    async def stream(request: Request) -> Response:
        return StreamingResponse(sse(), media_type="text/event-stream")

    return Starlette(
        routes=[Route("/json", get_json), Route("/post", post_json, methods=["POST"]), Route("/stream", stream)]
    )


def fastapi_app():
    from fastapi import FastAPI
    from fastapi.responses import Response, StreamingResponse

    app = FastAPI()

    @app.get("/json")
    async def get_json() -> Response:
        return Response(orjson.dumps({"ok": True}), media_type="application/json")

    @app.post("/post")
    async def post_json(body: Body) -> Response:
        return Response(orjson.dumps({"n": body.max_tokens}), media_type="application/json")

    @app.get("/stream")
    async def stream() -> Response:
        return StreamingResponse(sse(), media_type="text/event-stream")

    return app


APPS = {"starlette": starlette_app, "fastapi": fastapi_app}


def serve(name: str, port: int) -> None:
    import uvicorn

    uvicorn.run(
        APPS[name](), host="127.0.0.1", port=port, loop="uvloop", http="httptools", log_level="error", access_log=False
    )


def one(conn: http.client.HTTPConnection, path: str) -> float:
    start = time.perf_counter()
    if path == "/post":
        conn.request("POST", path, body=BODY, headers={"content-type": "application/json"})
    else:
        conn.request("GET", path)
    conn.getresponse().read()
    return time.perf_counter() - start


def asgi_inprocess(app, path: str, n: int) -> float:
    """Median µs of one request through the ASGI app alone."""
    method = "POST" if path == "/post" else "GET"
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }

    async def run() -> list[float]:
        times = []
        for _ in range(n):
            sent = False

            async def receive():
                nonlocal sent
                if not sent:
                    sent = True
                    return {"type": "http.request", "body": BODY if method == "POST" else b"", "more_body": False}
                await asyncio.sleep(3600)

            async def send(message):
                pass

            start = time.perf_counter()
            await app(scope, receive, send)
            times.append(time.perf_counter() - start)
        return times

    import uvloop

    return statistics.median(uvloop.run(run())) * 1e6


def main() -> None:
    rounds, per_round = 10, 300
    ports = {name: free_port() for name in APPS}
    procs = [multiprocessing.Process(target=serve, args=(name, ports[name]), daemon=True) for name in APPS]
    for p in procs:
        p.start()
    time.sleep(2.0)
    conns = {name: http.client.HTTPConnection("127.0.0.1", port) for name, port in ports.items()}
    results: dict[tuple[str, str], list[float]] = {}
    for path in ("/json", "/post", "/stream"):
        for name in APPS:
            for _ in range(50):
                one(conns[name], path)  # warm up
        for _ in range(rounds):
            for name in APPS:
                results.setdefault((name, path), []).extend(one(conns[name], path) for _ in range(per_round))
    for p in procs:
        p.terminate()
    print(f"over HTTP (uvicorn, uvloop, httptools; {rounds * per_round} sequential keep-alive requests each)")
    print(f"{'endpoint':10} {'starlette p50 µs':>18} {'fastapi p50 µs':>16} {'ratio':>7}   p99 s/f")
    for path in ("/json", "/post", "/stream"):
        s, f = results[("starlette", path)], results[("fastapi", path)]
        q = lambda xs, p: statistics.quantiles(xs, n=100)[p - 1] * 1e6  # noqa: E731
        print(f"{path:10} {q(s, 50):18.0f} {q(f, 50):16.0f} {q(f, 50) / q(s, 50):7.2f}   {q(s, 99):.0f}/{q(f, 99):.0f}")
    print("in-process ASGI call, no sockets (median µs of 3000)")
    for path in ("/json", "/post", "/stream"):
        s_us = asgi_inprocess(starlette_app(), path, 3000)
        f_us = asgi_inprocess(fastapi_app(), path, 3000)
        print(f"{path:10} {s_us:18.1f} {f_us:16.1f} {f_us / s_us:7.2f}")


if __name__ == "__main__":
    main()
