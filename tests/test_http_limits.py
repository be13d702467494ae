"""The HTTP connection's limits (gateway.frontdoors.http_protocol) on a real socket of the gateway's HTTP server in
front of the real gateway app and request path: header size and count (431), malformed HTTP (400), both in
OpenAI's error body; the head timeout (slowloris: 408, then closed), idle fresh and keep-alive connections closed
after their timeouts, and connections over the cap refused with a fast 503. The server under test has small limits
and second-long timeouts, so that each test takes about a second.
"""

from __future__ import annotations

import contextlib
import json
import logging
import resource
import socket
import time
from collections.abc import Iterator
from typing import Any

import h11
import httpx
import pytest
from gateway_stack import KEY, GatewayStack, StackOptions, stack_fixture

from gateway.cli_gateway import add_arguments, build_gateway
from gateway.frontdoors.http_listener import HttpServer
from gateway.frontdoors.http_protocol import HttpLimits
from gateway.frontdoors.http_server import build_app
from gateway.frontdoors.openai_protocol import ErrorResponse
from kvroute.errors import UserError
from launch.cli import build_parser

LIMITS = HttpLimits(
    max_header_bytes=4096, max_headers=20, header_timeout=1.0, keep_alive_timeout=1.0, max_connections=4
)
HEALTH = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\n"

stack = stack_fixture(StackOptions(model="sim", workers=1))


@pytest.fixture(scope="module")
def server(stack: GatewayStack) -> Iterator[HttpServer]:
    path = stack.request_path
    app = build_app(path, max_body_bytes=path.limits.max_body_bytes)

    async def start() -> HttpServer:
        return HttpServer.start(app, "127.0.0.1", 0, LIMITS)

    http = stack.call(start())
    yield http
    stack.call(http.stop())


@pytest.fixture
def idle_server(server: HttpServer, stack: GatewayStack) -> HttpServer:
    """The server once every connection of an earlier test has gone."""

    async def open_connections() -> int:
        return server.open_connections

    deadline = time.monotonic() + 5
    while stack.call(open_connections()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return server


def connect(server: HttpServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=5)


def read_until_closed(sock: socket.socket, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def parse_response(raw: bytes) -> tuple[int, dict[str, str], Any]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, json.loads(body) if body else None


def assert_openai_error(raw: bytes, status: int, code: str | None = None) -> dict[str, Any]:
    got, headers, body = parse_response(raw)
    assert got == status, raw[:300]
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    ErrorResponse.model_validate(body)
    if code is not None:
        assert body["error"]["code"] == code, body
    return body["error"]


def test_flags_default_to_the_limits_and_refuse_nonsense() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([])
    defaults = HttpLimits()
    assert (args.max_header_bytes, args.max_headers, args.header_timeout, args.keep_alive_timeout) == (
        defaults.max_header_bytes, defaults.max_headers, defaults.header_timeout, defaults.keep_alive_timeout,
    )  # fmt: skip
    assert args.max_connections == defaults.max_connections
    for bad in ({"max_headers": 0}, {"header_timeout": 0.0}, {"max_connections": -1}):
        with pytest.raises(ValueError, match="--" + next(iter(bad)).replace("_", "-")):
            HttpLimits(**bad)


def test_kvroute_gateway_serves_under_its_flags() -> None:
    argv = ["gateway", "--model", "sim", "--workers", "127.0.0.1:1", "--max-headers", "7", "--keep-alive-timeout", "90"]
    gateway = build_gateway(build_parser(argv).parse_args(argv))
    assert gateway.http_limits == HttpLimits(max_headers=7, keep_alive_timeout=90.0)
    with pytest.raises(UserError, match="--header-timeout must be > 0"):
        argv = ["gateway", "--model", "sim", "--workers", "127.0.0.1:1", "--header-timeout", "0"]
        build_gateway(build_parser(argv).parse_args(argv))


def test_headers_over_the_size_get_431_in_openai_shape(idle_server: HttpServer) -> None:
    url = f"http://127.0.0.1:{idle_server.port}/health"
    assert httpx.get(url, headers={"x-fill": "a" * 3000}).status_code == 200, "under the limit: served"
    response = httpx.get(url, headers={"x-fill": "a" * 5000})
    assert response.status_code == 431
    ErrorResponse.model_validate(response.json())
    assert response.json()["error"]["code"] == "request_headers_too_large"
    assert "4096 bytes" in response.json()["error"]["message"]


def test_a_huge_header_is_refused_while_it_streams_in(idle_server: HttpServer) -> None:
    """The refusal comes after the limit, not after the header: the client is answered before it has sent
    a tenth of its 1 MiB header, so the server never held it."""
    with connect(idle_server) as sock:
        sock.sendall(HEALTH + b"x-fill: ")
        sent = 0
        answer = b""
        sock.settimeout(0.05)
        while sent < 2**20 and not answer:
            try:
                sock.sendall(b"a" * 8192)
                sent += 8192
                answer = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
        answer += read_until_closed(sock)
    assert sent < 2**17, f"answered only after {sent} bytes"
    assert_openai_error(answer, 431, "request_headers_too_large")


def test_too_many_headers_get_431(idle_server: HttpServer) -> None:
    url = f"http://127.0.0.1:{idle_server.port}/health"
    assert httpx.get(url, headers={f"x-h{i}": "1" for i in range(10)}).status_code == 200
    response = httpx.get(url, headers={f"x-h{i}": "1" for i in range(30)})
    assert response.status_code == 431
    assert "more than 20 headers" in response.json()["error"]["message"]


def test_malformed_http_gets_400_in_openai_shape(idle_server: HttpServer) -> None:
    with connect(idle_server) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        error = assert_openai_error(read_until_closed(sock), 400, None)
    assert error["type"] == "invalid_request_error" and error["message"].startswith("malformed HTTP request")


@pytest.mark.slow
def test_slowloris_is_answered_408_and_closed_within_the_header_timeout(idle_server: HttpServer) -> None:
    with connect(idle_server) as sock:
        start = time.monotonic()
        sock.sendall(HEALTH)
        sock.settimeout(0.2)
        answer = b""
        for byte in b"x-slow: " + b"a" * 40:  # one byte each 0.1 s: 4.8 s if nobody stopped it
            try:
                sock.sendall(bytes([byte]))
                answer = sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                break
            if answer:
                break
            time.sleep(0.1)
        answer += read_until_closed(sock)
        elapsed = time.monotonic() - start
    assert_openai_error(answer, 408, "request_timeout")
    assert LIMITS.header_timeout - 0.1 < elapsed < LIMITS.header_timeout + 1.0, elapsed


@pytest.mark.slow
def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(idle_server: HttpServer) -> None:
    with connect(idle_server) as sock:
        start = time.monotonic()
        assert read_until_closed(sock) == b"", "nothing was asked, nothing is answered"
        elapsed = time.monotonic() - start
    assert LIMITS.header_timeout - 0.1 < elapsed < LIMITS.header_timeout + 1.0, elapsed


@pytest.mark.slow
def test_an_idle_keep_alive_connection_is_closed_after_its_timeout(idle_server: HttpServer) -> None:
    with connect(idle_server) as sock:
        sock.sendall(HEALTH + b"\r\n")
        sock.settimeout(5)
        first = sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200"), first
        start = time.monotonic()
        assert read_until_closed(sock) == b""
        elapsed = time.monotonic() - start
    assert LIMITS.keep_alive_timeout - 0.1 < elapsed < LIMITS.keep_alive_timeout + 1.0, elapsed


@pytest.mark.slow
def test_connections_over_the_cap_get_a_fast_503_and_open_ones_are_served(idle_server: HttpServer) -> None:
    held = [connect(idle_server) for _ in range(LIMITS.max_connections - 1)]
    try:
        with connect(idle_server) as last:
            time.sleep(0.1)  # the four are accepted
            start = time.monotonic()
            with connect(idle_server) as over:
                over.sendall(HEALTH + b"\r\n")
                error = assert_openai_error(read_until_closed(over), 503, "too_many_connections")
            assert time.monotonic() - start < 0.5, "refused at once"
            assert "4 connections" in error["message"]
            last.sendall(HEALTH + b"\r\n")  # a connection under the cap is still served
            last.settimeout(5)
            assert last.recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        for sock in held:
            sock.close()


@pytest.mark.slow
def test_a_body_that_stops_arriving_is_cut_off(idle_server: HttpServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR)
    with connect(idle_server) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer " + KEY.encode() + b"\r\ncontent-length: 100\r\n\r\n" + b'{"prompt": "'
        )
        start = time.monotonic()
        assert read_until_closed(sock) == b"", "a stalled upload is closed, as if the client had left"
        elapsed = time.monotonic() - start
    assert LIMITS.header_timeout - 0.1 < elapsed < LIMITS.header_timeout + 1.0, elapsed
    assert httpx.get(f"http://127.0.0.1:{idle_server.port}/health").status_code == 200
    assert not caplog.records, "a client cut off mid-body is not a server error"


@pytest.mark.slow
def test_a_pipelined_head_that_stalls_is_timed_out_too(idle_server: HttpServer) -> None:
    """Two requests in one write are both served; a third head begun in the same write and never finished
    gets 408 within the header timeout (not the longer keep-alive wait)."""
    with connect(idle_server) as sock:
        sock.sendall(HEALTH + b"\r\n" + HEALTH + b"\r\n" + HEALTH)
        start = time.monotonic()
        raw = read_until_closed(sock)
        elapsed = time.monotonic() - start
    assert raw.count(b"HTTP/1.1 200") == 2
    assert_openai_error(raw[raw.index(b"HTTP/1.1 408") :], 408, "request_timeout")
    assert elapsed < LIMITS.header_timeout + 1.0, elapsed


def test_an_upgrade_request_is_plain_http_and_never_hides_a_second_request(
    idle_server: HttpServer, caplog: pytest.LogCaptureFixture
) -> None:
    """No WebSocket or h2c here: a bodiless upgrade request is served as HTTP/1.1 and its connection closed
    (a request pipelined behind it is not read); one with a body is refused, so that a request written as
    its body is never served as a request of its own. Nothing is logged per request."""
    caplog.set_level(logging.WARNING)
    upgrade = b"connection: upgrade\r\nupgrade: websocket\r\n"
    with connect(idle_server) as sock:
        sock.sendall(HEALTH + upgrade + b"\r\n" + HEALTH + b"\r\n")
        raw = read_until_closed(sock)
    assert raw.startswith(b"HTTP/1.1 200") and raw.count(b"HTTP/1.1") == 1, raw
    hidden = HEALTH + b"\r\n"
    with connect(idle_server) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer " + KEY.encode() + b"\r\n"
            b"connection: upgrade\r\nupgrade: h2c\r\ncontent-length: %d\r\n\r\n" % len(hidden)
        )
        time.sleep(0.1)  # the body in a read of its own: httptools would parse it as a request
        with contextlib.suppress(OSError):
            sock.sendall(hidden)
        raw = read_until_closed(sock)
    assert raw.count(b"HTTP/1.1") == 1, raw
    error = assert_openai_error(raw, 400)
    assert "Upgrade" in error["message"]
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.records


def post(path: bytes, body: dict[str, Any], *headers: bytes) -> bytes:
    data = json.dumps(body).encode()
    head = [b"POST " + path + b" HTTP/1.1", b"host: 127.0.0.1", b"authorization: Bearer " + KEY.encode(), *headers]
    return b"\r\n".join([*head, b"content-length: %d" % len(data), b"", data])


def responses(raw: bytes, methods: list[bytes]) -> list[tuple[h11.Response, bytes]]:
    """The responses in `raw`, one per request of `methods`, in order."""
    client = h11.Connection(h11.CLIENT)
    client.receive_data(raw)
    out: list[tuple[h11.Response, bytes]] = []
    for method in methods:
        client.send(h11.Request(method=method, target="/", headers=[("host", "x")]))
        client.send(h11.EndOfMessage())
        head, body = client.next_event(), b""
        while not isinstance(event := client.next_event(), h11.EndOfMessage):
            body += event.data
        out.append((head, body))
        if client.our_state is h11.DONE and client.their_state is h11.DONE:
            client.start_next_cycle()
    return out


def test_generation_requests_pipelined_on_one_connection_are_answered_in_order(idle_server: HttpServer) -> None:
    """Pipelining: a whole answer, a stream and a GET written in one go come back in order on the one
    connection, each whole, and the last one's `connection: close` closes it."""
    with connect(idle_server) as sock:
        sock.sendall(
            post(b"/v1/completions", {"prompt": "hi", "max_tokens": 2}, b"x-request-id: first-1")
            + post(b"/v1/completions", {"prompt": "hi", "max_tokens": 3, "stream": True}, b"x-request-id: second-2")
            + HEALTH
            + b"connection: close\r\n\r\n"
        )
        raw = read_until_closed(sock)
    (whole, whole_body), (stream, stream_body), (health, _) = responses(raw, [b"POST", b"POST", b"GET"])
    assert whole.status_code == 200 and dict(whole.headers)[b"x-request-id"] == b"first-1"
    assert json.loads(whole_body)["usage"]["completion_tokens"] == 2
    assert stream.status_code == 200 and dict(stream.headers)[b"x-request-id"] == b"second-2"
    assert dict(stream.headers)[b"content-type"].startswith(b"text/event-stream")
    assert stream_body.endswith(b"data: [DONE]\n\n") and stream_body.count(b"data: ") >= 2
    assert health.status_code == 200 and dict(health.headers)[b"connection"] == b"close"


def test_a_generation_request_that_expects_100_continue_gets_it(idle_server: HttpServer) -> None:
    """A client that waits for 100 Continue before its body (curl does, past 1 KiB) is told to go on, then
    answered; HTTP/1.0 gets its answer and the connection closed."""
    request = post(b"/v1/completions", {"prompt": "hi", "max_tokens": 2}, b"expect: 100-continue")
    head, _, body = request.partition(b"\r\n\r\n")
    with connect(idle_server) as sock:
        sock.sendall(head + b"\r\n\r\n")
        assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body + post(b"/v1/completions", {"prompt": "hi", "max_tokens": 2}, b"connection: close"))
        raw = read_until_closed(sock)
    assert [response.status_code for response, _ in responses(raw, [b"POST", b"POST"])] == [200, 200]
    with connect(idle_server) as sock:
        sock.sendall(post(b"/v1/completions", {"prompt": "hi", "max_tokens": 2}).replace(b"HTTP/1.1", b"HTTP/1.0", 1))
        status, headers, _ = parse_response(read_until_closed(sock))
    assert status == 200 and headers["connection"] == "close"


# -- a chunked body's framing: trailers, chunk extensions; answers before the body ------------------------------

TOKENIZE = b"/tokenize"
COMPLETIONS = b"/v1/completions"


def chunked_head(path: bytes, *headers: bytes, key: bool = True) -> bytes:
    auth = [b"authorization: Bearer " + KEY.encode()] if key else []
    lines = [b"POST " + path + b" HTTP/1.1", b"host: 127.0.0.1", *auth, *headers, b"transfer-encoding: chunked"]
    return b"\r\n".join([*lines, b"", b""])


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def rss_bytes() -> int:
    """This process's resident set (the server under test runs in it)."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def answered_after(sock: socket.socket, start: bytes, filler: bytes, most: int) -> tuple[int, bytes]:
    """Send `start`, then `filler` over and over until the server answers or `most` bytes went: the bytes
    sent when the answer came (or when the server stopped reading), and the whole answer."""
    sock.sendall(start)
    sent, answer = 0, b""
    sock.settimeout(0.02)
    while sent < most and not answer:
        try:
            sock.sendall(filler)
            sent += len(filler)
            answer = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            break
    with contextlib.suppress(OSError):
        answer += read_until_closed(sock)
    return sent, answer


@pytest.mark.parametrize("path", [COMPLETIONS, TOKENIZE])
def test_trailers_are_refused_and_never_held(idle_server: HttpServer, path: bytes) -> None:
    """A chunked body's trailers are not headers the head limits counted (httptools hands them to the same
    callback, after the body): the API needs none, so the first is refused with 400 and the connection
    closed, before the server holds a trailer section (here up to 4 MiB of them, half a million small ones)."""
    before = rss_bytes()
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    start = chunked_head(path) + chunk(body) + b"0\r\n"
    with connect(idle_server) as sock:
        sent, answer = answered_after(sock, start, b"x-t: 1\r\n" * 1024, 2**22)
    assert sent < 2**18, f"answered only after {sent} bytes of trailers"
    error = assert_openai_error(answer, 400)
    assert "trailer" in error["message"]
    assert rss_bytes() - before < 16 * 2**20


def test_a_huge_chunk_extension_is_refused_quickly(idle_server: HttpServer) -> None:
    """A chunk extension (`5;name=value`) is framing, not body: it counts against the head limit (Node's
    CVE-2024-22019), so 4 MiB of it is refused after the first tens of KiB, not read for as long as it comes."""
    with connect(idle_server) as sock:
        started = time.monotonic()
        sent, answer = answered_after(sock, chunked_head(TOKENIZE) + b"5;ext=", b"a" * 8192, 2**22)
    assert sent < 2**18, f"answered only after {sent} bytes of one chunk extension"
    error = assert_openai_error(answer, 400)
    assert "chunk extension" in error["message"]
    assert time.monotonic() - started < 2.0


@pytest.mark.parametrize("path", [COMPLETIONS, TOKENIZE])
def test_a_body_in_many_small_chunks_is_served(idle_server: HttpServer, path: bytes) -> None:
    """Framing is bounded per chunk, not per body: a body sent a byte a chunk (5 bytes of framing each, 5
    times the body here) over many reads is served."""
    body = json.dumps({"prompt": "hi " * 300, "max_tokens": 2}).encode()
    with connect(idle_server) as sock:
        sock.sendall(chunked_head(path, b"connection: close"))
        for start in range(0, len(body), 100):
            sock.sendall(b"".join(chunk(body[i : i + 1]) for i in range(start, min(start + 100, len(body)))))
            time.sleep(0.001)
        sock.sendall(b"0\r\n\r\n")
        raw = read_until_closed(sock)
    assert raw.startswith(b"HTTP/1.1 200"), raw[:300]


def test_a_key_sent_only_as_a_trailer_never_authenticates(idle_server: HttpServer) -> None:
    """Authentication reads the head only. A request whose key comes only as a trailer is refused whether
    its trailer arrives with the head (400: trailers are refused before the endpoint ever ran) or after the
    endpoint answered 401 (then the connection is closed and the trailer never read)."""
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    trailer = b"0\r\nauthorization: Bearer " + KEY.encode() + b"\r\n\r\n"
    with connect(idle_server) as sock:
        sock.sendall(chunked_head(COMPLETIONS, key=False) + chunk(body) + trailer)
        raw = read_until_closed(sock)
    assert raw.count(b"HTTP/1.1 ") == 1, raw
    assert_openai_error(raw, 400)
    with connect(idle_server) as sock:
        sock.sendall(chunked_head(COMPLETIONS, key=False) + chunk(body))
        sock.settimeout(5)
        first = sock.recv(65536)
        with contextlib.suppress(OSError):
            sock.sendall(trailer)
        raw = first + read_until_closed(sock)
    assert raw.count(b"HTTP/1.1 ") == 1, raw
    assert parse_response(raw)[0] == 401


def test_a_duplicated_authorization_header_is_refused(idle_server: HttpServer) -> None:
    """One place reads the key: two Authorization headers (an invalid one and a valid one, in either order)
    are refused, never read as whichever a given check happens to take."""
    url = f"http://127.0.0.1:{idle_server.port}/v1/completions"
    for first, second in ((KEY, "sk-wrong"), ("sk-wrong", KEY)):
        headers = [("authorization", f"Bearer {first}"), ("authorization", f"Bearer {second}")]
        response = httpx.post(url, headers=headers, json={"prompt": "hi", "max_tokens": 2})
        assert response.status_code == 400, response.text
        assert "Authorization" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "key", "status"),
    [(COMPLETIONS, False, 401), (TOKENIZE, False, 401), (COMPLETIONS, True, 413), (TOKENIZE, True, 413)],
)
def test_an_answer_before_the_body_closes_the_connection(
    idle_server: HttpServer, path: bytes, key: bool, status: int
) -> None:
    """An answer given before the body was read (401, 413) ends the connection: the client is told (its
    write side is shut after the answer) and what it goes on sending is not read as a body."""
    auth = [b"authorization: Bearer " + KEY.encode()] if key else []
    head = [b"POST " + path + b" HTTP/1.1", b"host: 127.0.0.1", *auth, b"content-length: %d" % 2**30]
    with connect(idle_server) as sock:
        sock.sendall(b"\r\n".join([*head, b"", b""]))
        sock.settimeout(5)
        answer = sock.recv(65536)
        assert parse_response(answer.partition(b"\r\n\r\n")[0] + b"\r\n\r\n")[0] == status, answer
        started = time.monotonic()
        closed = False
        sock.settimeout(0.05)
        while not closed and time.monotonic() - started < 2 * LIMITS.keep_alive_timeout:
            try:
                sock.sendall(b"a" * 4096)
                closed = sock.recv(65536) == b""
            except TimeoutError:
                continue
            except OSError:
                closed = True
    assert closed, "the connection stayed open to read the body"
    assert time.monotonic() - started < 0.5


@pytest.mark.parametrize("path", [COMPLETIONS, TOKENIZE])
def test_http_1_0_gets_no_100_continue(idle_server: HttpServer, path: bytes) -> None:
    """RFC 9110 §15.2: no 1xx to an HTTP/1.0 client, even one that sends `Expect: 100-continue`."""
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    head = [b"POST " + path + b" HTTP/1.0", b"host: 127.0.0.1", b"authorization: Bearer " + KEY.encode()]
    head += [b"expect: 100-continue", b"content-length: %d" % len(body)]
    with connect(idle_server) as sock:
        sock.sendall(b"\r\n".join([*head, b"", b""]))
        sock.settimeout(0.3)
        with pytest.raises(TimeoutError):
            sock.recv(65536)
        sock.sendall(body)
        raw = read_until_closed(sock)
    assert raw.startswith(b"HTTP/1.1 200"), raw
    assert b"100 Continue" not in raw
