"""The endpoint picker's ext_proc protocol, message by message: a real grpc.aio ExternalProcessor over the real
request path and embedded fleet state of two in-process sim workers (tests/gateway_stack.py), driven by a
gRPC client that sends what Envoy sends. Envoy itself in front of it: tests/test_epp_envoy.py."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ext_grpc
from gateway_stack import KEY, SERVED_MODEL, SMALL_KEY, GatewayStack, LoopThreadStack, StackOptions, stack_fixture
from google.protobuf import struct_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.cli_epp import EndpointPicker, start_picker
from gateway.frontdoors.ext_proc import DESTINATION, SERVED, EndpointMap, Picker, canonical_path
from gateway.pools import Pools
from gateway.request_path import RequestPath

ROOT = Path(__file__).resolve().parents[1]
stack = stack_fixture(StackOptions(model="sim", workers=2))
ENDPOINTS = {"w0": "10.0.0.1:8000", "w1": "10.0.0.2:8000"}  # nothing dials them here
LONG = "Answer as the hardware shop's assistant would, in one sentence. " * 12


@contextmanager
def serving_picker(stack: LoopThreadStack, path: Pools | RequestPath, mapping: EndpointMap) -> Iterator[EndpointPicker]:
    """A picker over `path` (a request path, or several models' pools) serving in `stack`'s loop, stopped after."""
    picker = Picker(path, mapping, max_body_bytes=64 * 1024, default_max_tokens=16)
    running = stack.call(start_picker(picker, "127.0.0.1", 0))
    try:
        yield running
    finally:
        stack.call(running.stop(0))


@pytest.fixture(scope="module")
def epp(stack: GatewayStack) -> Iterator[EndpointPicker]:
    workers = sorted(m.worker_id for m in stack.request_path.fleet.members())
    with serving_picker(
        stack, stack.request_path, EndpointMap(dict(zip(workers, ENDPOINTS.values(), strict=True)))
    ) as running:
        yield running


@pytest.fixture()
def channel(epp: EndpointPicker) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{epp.port}") as opened:
        yield opened


def _headers(pairs: dict[str, str], end_of_stream: bool = False) -> ext_pb2.HttpHeaders:
    values = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs.items()]
    return ext_pb2.HttpHeaders(headers=base_pb2.HeaderMap(headers=values), end_of_stream=end_of_stream)


def _request_headers(
    key: str = KEY, method: str = "POST", path: str = "/v1/chat/completions", subset: list[str] | None = None, **kw
) -> ext_pb2.ProcessingRequest:
    pairs = {":method": method, ":path": path, "content-type": "application/json", "authorization": f"Bearer {key}"}
    message = ext_pb2.ProcessingRequest(request_headers=_headers(pairs, method == "GET"), **kw)
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return message


def _chat_body(content: str = LONG, **kw: object) -> bytes:
    body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, **kw}
    return json.dumps(body).encode()


def _bodies(body: bytes, pieces: int = 2) -> list[ext_pb2.ProcessingRequest]:
    size = -(-len(body) // pieces)
    chunks = [body[i : i + size] for i in range(0, len(body), size)]
    return [
        ext_pb2.ProcessingRequest(request_body=ext_pb2.HttpBody(body=c, end_of_stream=i == len(chunks) - 1))
        for i, c in enumerate(chunks)
    ]


class Exchange:
    """One ext_proc stream, fed a message at a time; `take(n)` reads the picker's next n answers."""

    def __init__(self, channel: grpc.Channel) -> None:
        self._queue: list[ext_pb2.ProcessingRequest] = []
        self._more = threading.Condition()
        self._closed = False
        self._replies = ext_grpc.ExternalProcessorStub(channel).Process(self._messages(), timeout=20)

    def _messages(self) -> Iterator[ext_pb2.ProcessingRequest]:
        while True:
            with self._more:
                self._more.wait_for(lambda: self._queue or self._closed, timeout=20)
                if not self._queue:
                    return
                message = self._queue.pop(0)
            yield message

    def send(self, *messages: ext_pb2.ProcessingRequest) -> Exchange:
        with self._more:
            self._queue.extend(messages)
            self._more.notify()
        return self

    def take(self, n: int) -> list[ext_pb2.ProcessingResponse]:
        return [next(self._replies) for _ in range(n)]

    def close(self) -> None:
        with self._more:
            self._closed = True
            self._more.notify()
        for _ in self._replies:
            pass


def _set_headers(mutation: ext_pb2.HeaderMutation) -> dict[str, str]:
    return {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}


def _destination(reply: ext_pb2.ProcessingResponse, common: ext_pb2.CommonResponse) -> list[str]:
    header = _set_headers(common.header_mutation)[DESTINATION]
    metadata = reply.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DESTINATION].string_value.split(",")
    assert header == metadata[0], "the header names the chosen endpoint alone, the metadata's list starts with it"
    assert common.clear_route_cache
    return metadata


def _ttft_count(stack: GatewayStack) -> float:
    text = stack.request_path.metrics.render().decode()
    (line,) = [x for x in text.splitlines() if x.startswith("kvroute:gateway_time_to_first_token_seconds_count")]
    return float(line.rsplit(" ", 1)[1])


def test_full_duplex_decides_after_the_body_and_sends_it_back(stack: GatewayStack, channel: grpc.Channel) -> None:
    body = _chat_body()
    ttft_before = _ttft_count(stack)
    exchange = Exchange(channel).send(_request_headers(), *_bodies(body, 3))
    headers, *rest = exchange.take(2)
    assert headers.WhichOneof("response") == "request_headers"
    endpoints = _destination(headers, headers.request_headers.response)
    assert sorted(endpoints) == sorted(ENDPOINTS.values()), "the chosen endpoint first, then every fallback"
    streamed = rest[0].request_body.response.body_mutation.streamed_response
    assert streamed.body == body and streamed.end_of_stream
    response = _headers({":status": "200", "content-type": "text/event-stream", SERVED: endpoints[0]})
    exchange.send(ext_pb2.ProcessingRequest(response_headers=response))
    (reply,) = exchange.take(1)
    set_headers = _set_headers(reply.response_headers.response.header_mutation)
    assert set_headers["x-kvroute-route"].startswith("policy=kv_aware; reason=")
    assert SERVED in reply.response_headers.response.header_mutation.remove_headers
    chunks = [b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', b'data: {"usage":{"prompt_tokens":5}}\n\n']
    for i, chunk in enumerate(chunks):
        exchange.send(ext_pb2.ProcessingRequest(response_body=ext_pb2.HttpBody(body=chunk, end_of_stream=i == 1)))
        (echo,) = exchange.take(1)
        assert echo.response_body.response.body_mutation.streamed_response.body == chunk, "passed on as it came"
    exchange.close()
    assert _ttft_count(stack) == ttft_before + 1, "the first response chunk timed the request's TTFT"


def test_buffered_mode(channel: grpc.Channel) -> None:
    config = ext_pb2.ProtocolConfiguration(
        request_body_mode=processing_mode_pb2.ProcessingMode.BUFFERED,
        response_body_mode=processing_mode_pb2.ProcessingMode.NONE,
    )
    exchange = Exchange(channel).send(_request_headers(protocol_config=config))
    (headers,) = exchange.take(1)
    assert headers.request_headers == ext_pb2.HeadersResponse(), "answered empty: Envoy waits for it"
    exchange.send(*_bodies(_chat_body(), 1))
    (body,) = exchange.take(1)
    assert len(_destination(body, body.request_body.response)) == 2
    assert not body.request_body.response.HasField("body_mutation"), "the buffered body goes on unchanged"
    exchange.close()


def test_subset_hint(stack: GatewayStack, channel: grpc.Channel) -> None:
    only = ENDPOINTS["w1"]
    exchange = Exchange(channel).send(_request_headers(subset=[only]), *_bodies(_chat_body()))
    headers, _ = exchange.take(2)
    assert _destination(headers, headers.request_headers.response) == [only]
    exchange.close()
    exchange = Exchange(channel).send(_request_headers(subset=["10.9.9.9:8000"]), *_bodies(_chat_body()))
    (refused,) = exchange.take(1)
    assert refused.immediate_response.status.code == 503
    assert json.loads(refused.immediate_response.body)["error"]["type"] == "service_unavailable"
    exchange.close()


def test_not_inference_goes_to_any_endpoint(channel: grpc.Channel) -> None:
    exchange = Exchange(channel).send(_request_headers(method="GET", path="/v1/models"))
    (reply,) = exchange.take(1)
    assert sorted(_destination(reply, reply.request_headers.response)) == sorted(ENDPOINTS.values())
    exchange.close()


@pytest.mark.parametrize(
    ("key", "body", "status", "error_type"),
    [
        (KEY, b"{not json", 400, "invalid_request_error"),
        ("sk-wrong", _chat_body(), 401, "authentication_error"),
        (KEY, _chat_body("word " * 3000), 400, "invalid_request_error"),
        (KEY, _chat_body("x" * 70_000), 413, "invalid_request_error"),
    ],
)
def test_refusals_in_openai_body(channel: grpc.Channel, key: str, body: bytes, status: int, error_type: str) -> None:
    exchange = Exchange(channel).send(_request_headers(key=key), *_bodies(body, 1))
    (reply,) = exchange.take(1)
    assert reply.immediate_response.status.code == status
    assert json.loads(reply.immediate_response.body)["error"]["type"] == error_type
    exchange.close()


def test_tenant_over_its_limit_gets_429_until_its_request_ends(stack: GatewayStack, channel: grpc.Channel) -> None:
    first = Exchange(channel).send(_request_headers(key=SMALL_KEY), *_bodies(_chat_body()))
    first.take(2)
    second = Exchange(channel).send(_request_headers(key=SMALL_KEY), *_bodies(_chat_body()))
    (refused,) = second.take(1)
    assert refused.immediate_response.status.code == 429
    assert "retry-after" in _set_headers(refused.immediate_response.headers)
    second.close()
    first.close()  # the stream ends without a response: the request is finished all the same
    stack.call(asyncio.sleep(0.1))
    third = Exchange(channel).send(_request_headers(key=SMALL_KEY), *_bodies(_chat_body()))
    assert third.take(2)[0].WhichOneof("response") == "request_headers"
    third.close()


def test_served_elsewhere_moves_the_book(stack: GatewayStack, channel: grpc.Channel) -> None:
    fleet = stack.request_path.fleet

    def in_flight() -> dict[str, int]:
        return {w: fleet.view().loads[w].in_flight for w in fleet.view().replicas}

    before = in_flight()
    exchange = Exchange(channel).send(_request_headers(), *_bodies(_chat_body("fallback " * 40)))
    headers, _ = exchange.take(2)
    primary, fallback = _destination(headers, headers.request_headers.response)
    workers = {e: w for w, e in zip(sorted(before), ENDPOINTS.values(), strict=True)}
    assert in_flight()[workers[primary]] == before[workers[primary]] + 1
    metadata = struct_pb2.Struct()
    metadata.update({SERVED: fallback})
    response = ext_pb2.ProcessingRequest(response_headers=_headers({":status": "200"}))
    response.metadata_context.filter_metadata["envoy.lb"].CopyFrom(metadata)
    exchange.send(response)
    (reply,) = exchange.take(1)
    set_headers = _set_headers(reply.response_headers.response.header_mutation)
    assert set_headers["x-kvroute-worker"] == workers[fallback]
    assert "reason=fallback" in set_headers["x-kvroute-route"] and "attempts=2" in set_headers["x-kvroute-route"]
    assert in_flight()[workers[fallback]] == before[workers[fallback]] + 1
    assert in_flight()[workers[primary]] == before[workers[primary]]
    exchange.close()
    stack.call(asyncio.sleep(0.1))
    assert in_flight() == before


def test_health_names(epp: EndpointPicker) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{epp.port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
            status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status
            assert status == health_pb2.HealthCheckResponse.SERVING, service


def test_the_picker_imports_without_torch_or_the_worker() -> None:
    """It runs on the gateway image, which has no torch; gateway/ never imports worker/."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import gateway.cli_epp, gateway.frontdoors.ext_proc\n"
        "from launch.cli import build_parser\n"
        "build_parser(['epp']).parse_args(['epp', '--workers', 'a:1', '--target-port', '8000'])\n"
        "loaded = {m.split('.')[0] for m, v in sys.modules.items() if v is not None}\n"
        "assert not loaded & {'torch', 'worker'}, loaded & {'torch', 'worker'}\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workers", "127.0.0.1:1"], "--target-port PORT and/or --endpoints"),
        (["--workers", "127.0.0.1:1", "--endpoints", "w0=nowhere"], "is not WORKER=IP:PORT"),
        (["--workers", "127.0.0.1:1", "--target-port", "0"], "--target-port must be in"),
        (["--workers", "127.0.0.1:1", "--target-port", "8000", "--max-endpoints", "-1"], "--max-endpoints"),
    ],
)
def test_bad_flags_are_one_line_errors(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    from launch.cli import main

    assert main(["epp", "--model", "sim", *argv]) == 2
    assert message in capsys.readouterr().err


def test_envoys_protos_and_opentelemetrys_import_side_by_side() -> None:
    """xds-protos ships an older copy of OpenTelemetry's protos over opentelemetry-proto's files; the set-up
    reinstalls the latter after it (deploy/docker/otel-proto-over-xds.sh), so the OTLP exporter and the picker's
    protos both import in one process."""
    from envoy.service.ext_proc.v3 import external_processor_pb2
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope

    assert external_processor_pb2.ProcessingRequest and OTLPSpanExporter and InstrumentationScope


def test_an_engine_is_dialled_at_its_own_address() -> None:
    """A vllm:// or sglang:// worker's address is its OpenAI HTTP server: Envoy dials it there, unless mapped
    explicitly; a kvroute worker's comes from --target-port (tests/test_epp_envoy_engines.py runs it whole)."""
    from gateway.fleet.fleet_state import WorkerMember

    def member(worker_id: str, engine: str) -> WorkerMember:
        return WorkerMember(worker_id, worker_id, 1, "m", 16, 512, "h", "t", parity_ok=True, engine=engine)

    engine, kvroute = member("10.0.0.5:8000", "vllm"), member("10.0.0.6:50051", "kvroute")
    assert EndpointMap({}, 8001).of(engine) == "10.0.0.5:8000"
    assert EndpointMap({}, None).of(engine) == "10.0.0.5:8000"
    assert EndpointMap({"10.0.0.5:8000": "10.0.0.9:9000"}, None).of(engine) == "10.0.0.9:9000"
    assert EndpointMap({}, 8001).of(kvroute) == "10.0.0.6:8001"
    assert EndpointMap({}, None).of(kvroute) is None


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        ("/v1/chat/completions", "/v1/chat/completions"),
        ("/v1/chat%2Fcompletions?x=1", "/v1/chat/completions"),
        ("/v1//chat///completions", "/v1/chat/completions"),
        ("//v1/chat/completions", "/v1/chat/completions"),
        ("/v1/x/%2E%2E/chat/./completions/", "/v1/chat/completions"),
        ("/v1/%63hat/completions#frag", "/v1/chat/completions"),
        ("/v1/chat%252Fcompletions", "/v1/chat%2Fcompletions"),  # decoded once, as the worker decodes it
    ],
)
def test_canonical_path_is_what_a_worker_serves(raw: str, canonical: str) -> None:
    assert canonical_path(raw) == canonical


@pytest.mark.parametrize(
    "body_mode", [processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED, processing_mode_pb2.ProcessingMode.BUFFERED]
)
def test_a_path_spelled_otherwise_is_decided_and_sent_on_in_one_spelling(channel: grpc.Channel, body_mode: int) -> None:
    config = ext_pb2.ProtocolConfiguration(request_body_mode=body_mode)  # type: ignore[arg-type]
    exchange = Exchange(channel).send(_request_headers(path="/v1//chat%2Fcompletions?a=1", protocol_config=config))
    if body_mode == processing_mode_pb2.ProcessingMode.BUFFERED:
        exchange.take(1)  # the headers, answered empty
    exchange.send(*_bodies(_chat_body(), 1))
    (reply,) = exchange.take(1)
    common = getattr(reply, reply.WhichOneof("response")).response
    assert len(_destination(reply, common)) == 2, "decided, as /v1/chat/completions is"
    assert _set_headers(common.header_mutation)[":path"] == "/v1/chat/completions?a=1"
    exchange.close()
