"""The HTTP front door's own cost per request: gateway.frontdoors.http_server.build_app served by the gateway's
HTTP server (uvloop, httptools, gateway.frontdoors.http_protocol) over a request path that answers at once
(16 chunks of one token, no worker), against a bare JSON route on the same server (the transport's floor),
measured in the same run.

Run: python -m benchmarks.front_door_bench
What it isolates: body read + strict pydantic validation + GatewayRequest + response/SSE rendering + the
disconnect handling. The request path (tokenize, hash, route, gRPC) is measured by benchmarks/gateway_bench.py.
"""

from __future__ import annotations

import http.client
import json
import multiprocessing
import socket
import statistics
import time
import uuid

from launch.fleet import free_port

N_CHUNKS = 16


def serve(kind: str, port: int) -> None:
    import asyncio

    import orjson
    import uvloop

    from gateway.admission.auth import Authenticator
    from gateway.frontdoors.http_listener import HttpServer
    from gateway.frontdoors.http_protocol import Exchange, HttpApp
    from gateway.frontdoors.http_routes import HttpRoutes, Reply, Route
    from gateway.frontdoors.http_server import DEFAULT_MAX_BODY_BYTES, build_app
    from gateway.metrics import GatewayMetrics
    from gateway.request import Chunk, Generation, RouteInfo, Usage

    class Instant(Generation):
        def __init__(self) -> None:
            self.request_id = uuid.uuid4().hex
            self.route = RouteInfo("w0", "127.0.0.1:1", "kv_aware", "hit", 3)
            self.prompt_token_ids = [1] * 40
            self.usage = Usage(40, N_CHUNKS, 32)
            self._it = self._chunks()

        async def _chunks(self):
            for i in range(N_CHUNKS):
                yield Chunk(0, " word", (i,), (), "length" if i == N_CHUNKS - 1 else None)

        def __aiter__(self):
            return self._it

        async def aclose(self) -> None:
            await self._it.aclose()

    class InstantPath:
        served_model_name = "m"
        auth = Authenticator()
        metrics = GatewayMetrics("m")

        async def generate(self, request):
            return Instant()

        def routable_workers(self) -> int:
            return 1

        def pool(self, model):
            return self

        def pools(self):
            return [self]

    app: HttpApp
    if kind == "bare":

        async def ok(exchange: Exchange) -> Reply:
            await exchange.body()
            return Reply(200, {}, orjson.dumps({"ok": True}))

        app = HttpRoutes([Route(b"POST", "/v1/chat/completions", ok)], DEFAULT_MAX_BODY_BYTES)
    else:
        app = build_app(InstantPath(), default_max_tokens=256)

    async def serve_forever() -> None:
        HttpServer.start(app, "127.0.0.1", port)
        await asyncio.Event().wait()

    uvloop.run(serve_forever())


BODY = json.dumps(
    {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name three colours. " * 10},
        ],
        "max_tokens": 16,
        "temperature": 0.7,
    }
).encode()
STREAM_BODY = json.dumps({**json.loads(BODY), "stream": True, "stream_options": {"include_usage": True}}).encode()


def one(conn: http.client.HTTPConnection, body: bytes) -> float:
    start = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", body=body, headers={"content-type": "application/json"})
    response = conn.getresponse()
    data = response.read()
    assert response.status == 200, data
    return time.perf_counter() - start


def main() -> None:
    ports = {"bare": free_port(), "front_door": free_port()}
    procs = [multiprocessing.Process(target=serve, args=(k, p), daemon=True) for k, p in ports.items()]
    for p in procs:
        p.start()
    for port in ports.values():
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "server did not start"
                time.sleep(0.2)
    conns = {k: http.client.HTTPConnection("127.0.0.1", p) for k, p in ports.items()}
    cases = {
        "bare JSON endpoint": ("bare", BODY),
        "chat, whole response": ("front_door", BODY),
        "chat, streamed (16 chunks + usage)": ("front_door", STREAM_BODY),
    }
    times: dict[str, list[float]] = {name: [] for name in cases}
    for kind, body in cases.values():
        for _ in range(100):
            one(conns[kind], body)
    for _ in range(10):
        for name, (kind, body) in cases.items():
            times[name].extend(one(conns[kind], body) for _ in range(200))
    for p in procs:
        p.terminate()
    base = statistics.median(times["bare JSON endpoint"])
    print(f"{'case':38} {'p50 µs':>8} {'p99 µs':>8} {'p50 / bare':>10}")
    for name, xs in times.items():
        q = statistics.quantiles(xs, n=100)
        print(f"{name:38} {q[49] * 1e6:8.0f} {q[98] * 1e6:8.0f} {statistics.median(xs) / base:10.2f}")


if __name__ == "__main__":
    main()
