"""The gateway's gRPC front door over the real request path and two real `sim` workers (tests/gateway_stack.py):
`kvroute.v1.Gateway.Generate` for text, chat and token ids, the `kvroute.v1.Worker` service answered by the
fleet, the standard health service, errors as status codes naming the field, and cancellation.

`sim` workers emit deterministic token ids (a function of the context), so the same prompt gives the same
tokens through either door and straight from a worker.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest
from gateway_stack import KEY, SERVED_MODEL, SMALL_KEY, GatewayStack, StackOptions, stack_fixture
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateway.frontdoors.grpc_server import GatewayGrpcServer, start_grpc_server
from proto import gateway_pb2, gateway_pb2_grpc, worker_pb2, worker_pb2_grpc

AUTH = (("authorization", f"Bearer {KEY}"),)
STOP = worker_pb2.FINISH_REASON_STOP
LENGTH = worker_pb2.FINISH_REASON_LENGTH
UNSET = worker_pb2.FINISH_REASON_UNSPECIFIED


stack = stack_fixture(StackOptions(model="sim", workers=2, dead_fleet=True))


@pytest.fixture(scope="module")
def channel(stack: GatewayStack) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(stack.grpc_address) as opened:
        yield opened


@pytest.fixture(scope="module")
def gateway(channel: grpc.Channel) -> gateway_pb2_grpc.GatewayStub:
    return gateway_pb2_grpc.GatewayStub(channel)


@pytest.fixture(scope="module")
def fleet_worker(channel: grpc.Channel) -> worker_pb2_grpc.WorkerStub:
    return worker_pb2_grpc.WorkerStub(channel)


def sampling(**fields: object) -> worker_pb2.SamplingParams:
    return worker_pb2.SamplingParams(**fields)


def generate(
    gateway: gateway_pb2_grpc.GatewayStub, metadata: tuple[tuple[str, str], ...] = AUTH, **fields: object
) -> tuple[list[gateway_pb2.GatewayGenerateResponse], dict[str, str]]:
    call = gateway.Generate(gateway_pb2.GatewayGenerateRequest(**fields), metadata=metadata, timeout=30)
    replies = list(call)
    return replies, dict(call.initial_metadata())


def text_of(replies: list[gateway_pb2.GatewayGenerateResponse], index: int = 0) -> str:
    return "".join(r.text for r in replies if r.index == index)


def tokens_of(replies: list[gateway_pb2.GatewayGenerateResponse], index: int = 0) -> list[int]:
    return [t for r in replies if r.index == index for t in r.token_ids]


# -- Gateway.Generate -------------------------------------------------------------------------------------------


def test_text_prompt_streams_text_tokens_route_and_usage(gateway: gateway_pb2_grpc.GatewayStub, stack: GatewayStack):
    replies, metadata = generate(gateway, prompt="Once upon a time", sampling=sampling(max_tokens=6))
    assert metadata["x-kvroute-worker"] in {w.worker_id for w in stack.workers}
    assert metadata["x-kvroute-route"].startswith("policy=kv_aware; reason=")
    route = replies[0].route
    assert (route.worker_id, route.route) == (metadata["x-kvroute-worker"], metadata["x-kvroute-route"])
    assert route.request_id == metadata["x-request-id"]
    assert all(not r.HasField("route") for r in replies[1:]), "the route comes once, in the first reply"
    assert len(tokens_of(replies)) == 6
    assert [r.finish_reason for r in replies if r.finish_reason != UNSET] == [LENGTH]
    usage = replies[-1].usage
    assert (usage.completion_tokens, usage.prompt_tokens > 0) == (6, True)
    assert all(not r.HasField("usage") for r in replies[:-1]), "usage comes last, once"
    with httpx.Client(base_url=stack.http_url, headers={"authorization": f"Bearer {KEY}"}) as http:
        body = http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 6}).json()
    assert text_of(replies) == body["choices"][0]["text"], "both doors give the same answer"


def test_chat_and_token_ids(gateway: gateway_pb2_grpc.GatewayStub) -> None:
    chat = gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user", content="Name a colour.")])
    tools = json.dumps([{"type": "function", "function": {"name": "paint", "parameters": {"type": "object"}}}])
    replies, _ = generate(gateway, chat=chat, tools_json=tools, sampling=sampling(max_tokens=4), model=SERVED_MODEL)
    assert len(tokens_of(replies)) == 4 and text_of(replies)
    ids = gateway_pb2.TokenIds(ids=list(range(200, 240)))
    replies, _ = generate(gateway, prompt_token_ids=ids, sampling=sampling(max_tokens=5, logprobs=True))
    assert len(tokens_of(replies)) == 5 and replies[-1].usage.prompt_tokens == 40
    for reply in replies:
        assert len(reply.logprobs) == len(reply.token_ids)
        assert [lp.token_id for lp in reply.logprobs] == list(reply.token_ids)


def test_cached_tokens_on_a_repeat(gateway: gateway_pb2_grpc.GatewayStub) -> None:
    ids = gateway_pb2.TokenIds(ids=list(range(1000, 1070)))  # 70 tokens: 4 full blocks
    first, meta_first = generate(gateway, prompt_token_ids=ids, sampling=sampling(max_tokens=2))
    second, meta_second = generate(gateway, prompt_token_ids=ids, sampling=sampling(max_tokens=2))
    assert meta_first["x-kvroute-worker"] == meta_second["x-kvroute-worker"]
    assert first[-1].usage.cached_tokens == 0 and second[-1].usage.cached_tokens == 64


def test_stop_token_ids_stop_strings_and_n(gateway: gateway_pb2_grpc.GatewayStub) -> None:
    ids = gateway_pb2.TokenIds(ids=list(range(300, 320)))
    full, _ = generate(gateway, prompt_token_ids=ids, sampling=sampling(max_tokens=12))
    tokens = tokens_of(full)
    k = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    stopped, _ = generate(gateway, prompt_token_ids=ids, sampling=sampling(max_tokens=12, stop_token_ids=[tokens[k]]))
    assert tokens_of(stopped) == tokens[: k + 1]
    assert [r.finish_reason for r in stopped if r.finish_reason != UNSET] == [STOP]
    text = text_of(full)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut, _ = generate(gateway, prompt_token_ids=ids, sampling=sampling(max_tokens=12), stop=["zzzz", stop])
    assert text_of(cut) == text[: text.index(stop)]
    two, _ = generate(gateway, prompt="Pick a number", sampling=sampling(max_tokens=3), n=2)
    assert {r.index for r in two if r.token_ids} == {0, 1}
    assert sorted(r.index for r in two if r.finish_reason != UNSET) == [0, 1]
    assert two[-1].usage.completion_tokens == 6


# -- errors: status codes naming the field; the server keeps serving ------------------------------------------

INVALID = grpc.StatusCode.INVALID_ARGUMENT
ERROR_CASES = [
    ("no input", {}, AUTH, INVALID, "input:"),
    ("empty prompt", {"prompt": ""}, AUTH, INVALID, "prompt:"),
    ("empty token ids", {"prompt_token_ids": gateway_pb2.TokenIds()}, AUTH, INVALID, "prompt_token_ids:"),
    ("token id outside the vocabulary", {"prompt_token_ids": gateway_pb2.TokenIds(ids=[1, 2**31])}, AUTH, INVALID,
     "prompt_token_ids:"),
    ("empty chat", {"chat": gateway_pb2.ChatMessages()}, AUTH, INVALID, "chat.messages:"),
    ("unknown role", {"chat": gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="wizard")])}, AUTH,
     INVALID, "chat.messages[0].role:"),
    ("bad tools json", {"chat": gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user")]),
                        "tools_json": "[{"}, AUTH, INVALID, "tools_json:"),
    ("tools without chat", {"prompt": "hi", "tools_json": "[]"}, AUTH, INVALID, "tools_json:"),
    ("negative temperature", {"prompt": "hi", "sampling": sampling(temperature=-1)}, AUTH, INVALID,
     "sampling.temperature:"),
    ("top_p above one", {"prompt": "hi", "sampling": sampling(top_p=2)}, AUTH, INVALID, "sampling.top_p:"),
    ("zero max_tokens", {"prompt": "hi", "sampling": sampling(max_tokens=0)}, AUTH, INVALID, "sampling.max_tokens:"),
    ("max_tokens over the limit", {"prompt": "hi", "sampling": sampling(max_tokens=1000)}, AUTH, INVALID,
     "max_tokens:"),
    ("past the context", {"prompt": "hello " * 400, "sampling": sampling(max_tokens=200)}, AUTH, INVALID,
     "max_tokens:"),
    ("n over the limit", {"prompt": "hi", "n": 9}, AUTH, INVALID, "n:"),
    ("empty stop", {"prompt": "hi", "stop": ["a", ""]}, AUTH, INVALID, "stop[1]:"),
    ("unknown model", {"prompt": "hi", "model": "gpt-9"}, AUTH, grpc.StatusCode.NOT_FOUND, "model:"),
    ("bad key", {"prompt": "hi"}, (("authorization", "Bearer nope"),), grpc.StatusCode.UNAUTHENTICATED, "invalid"),
    ("no key", {"prompt": "hi"}, (), grpc.StatusCode.UNAUTHENTICATED, "missing API key"),
    ("deeply nested tools json", {"chat": gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="user")]),
                                  "tools_json": "[" * 5000 + "]" * 5000}, AUTH, INVALID, "tools_json:"),
    ("no key and no input: the key first", {}, (), grpc.StatusCode.UNAUTHENTICATED, "missing API key"),
    ("bad key and a bad field: the key first", {"prompt": "hi", "sampling": sampling(temperature=-1)},
     (("authorization", "Bearer nope"),), grpc.StatusCode.UNAUTHENTICATED, "invalid API key"),
    ("no key and an unknown model: the key first", {"prompt": "hi", "model": "gpt-9"}, (),
     grpc.StatusCode.UNAUTHENTICATED, "missing API key"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "fields", "metadata", "code", "names"), ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_errors_are_status_codes_naming_the_field(
    gateway: gateway_pb2_grpc.GatewayStub, case: str, fields: dict, metadata: tuple, code: grpc.StatusCode, names: str
) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        generate(gateway, metadata=metadata, **fields)
    assert raised.value.code() == code, raised.value.details()
    assert names in raised.value.details(), raised.value.details()


def test_errors_quote_a_short_prefix_of_what_the_client_sent(gateway: gateway_pb2_grpc.GatewayStub) -> None:
    for fields in (
        {"prompt": "hi", "model": "m" * 60_000},  # long, within the stack's 64 KiB body limit
        {"chat": gateway_pb2.ChatMessages(messages=[gateway_pb2.ChatMessage(role="r" * 60_000)])},
    ):
        with pytest.raises(grpc.RpcError) as raised:
            generate(gateway, **fields)
        assert raised.value.code() in (grpc.StatusCode.NOT_FOUND, INVALID)
        assert len(raised.value.details()) < 200, len(raised.value.details())


def test_request_id_is_echoed_only_when_sane_as_on_the_http_door(gateway: gateway_pb2_grpc.GatewayStub) -> None:
    _, metadata = generate(gateway, AUTH + (("x-request-id", "req-42"),), prompt="hi", sampling=sampling(max_tokens=1))
    assert metadata["x-request-id"] == "req-42"
    long_id = "r" * 5000
    replies, metadata = generate(
        gateway, AUTH + (("x-request-id", long_id),), prompt="hi", sampling=sampling(max_tokens=1)
    )
    assert metadata["x-request-id"] != long_id and len(metadata["x-request-id"]) == 32
    assert replies[0].route.request_id == metadata["x-request-id"]


def test_every_fleet_worker_call_needs_the_key_first(fleet_worker: worker_pb2_grpc.WorkerStub) -> None:
    for call, request in (
        (fleet_worker.GetInfo, worker_pb2.GetInfoRequest()),
        (fleet_worker.GetStats, worker_pb2.GetStatsRequest()),
        (fleet_worker.GetKVEvents, worker_pb2.GetKVEventsRequest()),
    ):
        with pytest.raises(grpc.RpcError) as raised:
            call(request, timeout=5)
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED, call
    bad = worker_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=sampling(temperature=-1))
    with pytest.raises(grpc.RpcError) as raised:
        list(fleet_worker.Generate(bad, timeout=10))
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_still_serving_after_errors(gateway: gateway_pb2_grpc.GatewayStub) -> None:
    replies, _ = generate(gateway, prompt="still there?", sampling=sampling(max_tokens=2))
    assert replies[-1].usage.completion_tokens == 2


def test_tenant_limit_is_resource_exhausted_with_retry_after(gateway: gateway_pb2_grpc.GatewayStub) -> None:
    small = (("authorization", f"Bearer {SMALL_KEY}"),)
    request = gateway_pb2.GatewayGenerateRequest(prompt="long", sampling=sampling(max_tokens=250))
    held = gateway.Generate(request, metadata=small, timeout=30)
    next(held)  # routed and generating: the tenant's one slot is taken
    with pytest.raises(grpc.RpcError) as raised:
        generate(gateway, metadata=small, prompt="hi")
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(raised.value.trailing_metadata())["retry-after"]) >= 1
    held.cancel()


def test_cancelling_a_call_frees_the_worker_blocks(gateway: gateway_pb2_grpc.GatewayStub, stack: GatewayStack):
    before = sum(s.generation_tokens_total for s in stack.wait_workers_idle())
    call = gateway.Generate(
        gateway_pb2.GatewayGenerateRequest(prompt="Go on forever", sampling=sampling(max_tokens=250)), metadata=AUTH
    )
    next(call)
    call.cancel()
    stats = stack.wait_workers_idle()
    assert all(s.num_running == 0 and s.num_blocks_used == 0 for s in stats)
    assert sum(s.generation_tokens_total for s in stats) - before < 250


def test_no_worker_is_unavailable_and_health_follows_readiness(channel: grpc.Channel, stack: GatewayStack) -> None:
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "kvroute.v1.Gateway", "kvroute.v1.Worker"):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    assert stack.dead_grpc is not None
    with grpc.insecure_channel(f"127.0.0.1:{stack.dead_grpc.port}") as dead:
        status = health_pb2_grpc.HealthStub(dead).Check(health_pb2.HealthCheckRequest(), timeout=5).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as raised:
            generate(gateway_pb2_grpc.GatewayStub(dead), prompt="hi")
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


# -- kvroute.v1.Worker on the gateway ------------------------------------------------------------------------------


def test_worker_generate_through_the_gateway_matches_a_worker(
    fleet_worker: worker_pb2_grpc.WorkerStub, stack: GatewayStack
) -> None:
    request = worker_pb2.GenerateRequest(
        prompt_token_ids=list(range(500, 540)), sampling=sampling(max_tokens=8, temperature=0, logprobs=True)
    )
    call = fleet_worker.Generate(request, metadata=AUTH, timeout=30)
    through_gateway = list(call)
    served_by = dict(call.initial_metadata())["x-kvroute-worker"]
    worker = next(w for w in stack.workers if w.worker_id == served_by)
    with grpc.insecure_channel(f"127.0.0.1:{worker.port}") as direct_channel:
        direct = list(worker_pb2_grpc.WorkerStub(direct_channel).Generate(request, timeout=30))
    assert [t for r in through_gateway for t in r.token_ids] == [t for r in direct for t in r.token_ids]
    assert all(r.finish_reason == UNSET and not r.HasField("usage") for r in through_gateway[:-1])
    last = through_gateway[-1]
    assert last.finish_reason == LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (40, 8)
    assert all(len(r.logprobs) == len(r.token_ids) for r in through_gateway)


def test_worker_generate_errors_name_the_field_as_a_worker_does(fleet_worker: worker_pb2_grpc.WorkerStub) -> None:
    bad = worker_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=sampling(temperature=-1))
    with pytest.raises(grpc.RpcError) as raised:
        list(fleet_worker.Generate(bad, metadata=AUTH, timeout=10))
    assert raised.value.code() == INVALID and raised.value.details().startswith("temperature:")
    with pytest.raises(grpc.RpcError) as raised:
        list(fleet_worker.Generate(worker_pb2.GenerateRequest(prompt_token_ids=[1]), timeout=10))
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_get_info_describes_the_fleet_and_stats_are_per_worker(
    fleet_worker: worker_pb2_grpc.WorkerStub, stack: GatewayStack
) -> None:
    info = fleet_worker.GetInfo(worker_pb2.GetInfoRequest(), metadata=AUTH, timeout=5)
    with grpc.insecure_channel(f"127.0.0.1:{stack.workers[0].port}") as direct_channel:
        worker_info = worker_pb2_grpc.WorkerStub(direct_channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
    assert (info.model_id, info.block_size, info.hash_fingerprint) == (
        worker_info.model_id, worker_info.block_size, worker_info.hash_fingerprint,
    )  # fmt: skip
    assert info.max_model_len == 512 and info.vocab_size == stack.request_path.vocab_size
    assert info.worker_id.startswith("gateway-") and info.incarnation
    for rpc, request in ((fleet_worker.GetStats, worker_pb2.GetStatsRequest()),
                         (fleet_worker.GetKVEvents, worker_pb2.GetKVEventsRequest())):  # fmt: skip
        with pytest.raises(grpc.RpcError) as raised:
            rpc(request, metadata=AUTH, timeout=5)
        assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED and "each worker" in raised.value.details()


# -- the HTTP door's guard rails ------------------------------------------------------------------------------


@pytest.fixture
def small_door(stack: GatewayStack) -> Iterator[GatewayGrpcServer]:
    """A second gRPC door on the stack's request path, with a 4 KiB message limit and two connections."""
    server = stack.call(start_grpc_server(stack.request_path, "127.0.0.1", 0, max_body_bytes=4096, max_connections=2))
    yield server
    stack.call(server.stop(0))


def own_connection(port: int) -> grpc.Channel:
    """A channel with a connection of its own (channels of one process otherwise share one per address)."""
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=(("grpc.use_local_subchannel_pool", 1),))


def test_a_message_past_the_body_limit_is_refused_before_it_is_parsed(small_door: GatewayGrpcServer) -> None:
    """`--max-body-bytes` bounds a gRPC message as it bounds an HTTP body (the default, 4 MiB, not gRPC's
    16 MiB); gRPC refuses it from its length prefix, before the request is deserialized."""
    with own_connection(small_door.port) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        replies, _ = generate(stub, prompt="x" * 1600, sampling=sampling(max_tokens=2))
        assert len(tokens_of(replies)) == 2, "under the limit: served"
        with pytest.raises(grpc.RpcError) as raised:
            generate(stub, prompt="x" * 5000, sampling=sampling(max_tokens=2))
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in raised.value.details() and "4096" in raised.value.details()


def test_the_default_message_limit_is_the_http_body_limit(stack: GatewayStack) -> None:
    server = stack.call(start_grpc_server(stack.request_path, "127.0.0.1", 0))
    try:
        with own_connection(server.port) as channel, pytest.raises(grpc.RpcError) as raised:
            generate(gateway_pb2_grpc.GatewayStub(channel), prompt="x" * (4 * 2**20 + 1), sampling=sampling())
        assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert str(4 * 2**20) in raised.value.details()
    finally:
        stack.call(server.stop(0))


def test_the_stacks_door_keeps_the_stacks_body_limit(channel: grpc.Channel, stack: GatewayStack) -> None:
    """The test stack's gRPC door is started as the gateway starts its own, with the configured body limit (64
    KiB here, as its HTTP door), not the default's 4 MiB: a test of the limit over the stack tests the gateway's."""
    limit = stack.options.limits.max_body_bytes
    with pytest.raises(grpc.RpcError) as raised:
        generate(gateway_pb2_grpc.GatewayStub(channel), prompt="x" * (limit + 1), sampling=sampling(max_tokens=2))
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(limit) in raised.value.details()


def test_connections_over_the_cap_are_closed_and_open_ones_served(small_door: GatewayGrpcServer) -> None:
    health = health_pb2.HealthCheckRequest()
    first, second = own_connection(small_door.port), own_connection(small_door.port)
    try:
        for channel in (first, second):
            health_pb2_grpc.HealthStub(channel).Check(health, timeout=5)
        with own_connection(small_door.port) as over, pytest.raises(grpc.RpcError) as raised:
            health_pb2_grpc.HealthStub(over).Check(health, timeout=5)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        replies, _ = generate(gateway_pb2_grpc.GatewayStub(second), prompt="hi", sampling=sampling(max_tokens=2))
        assert len(tokens_of(replies)) == 2, "a connection under the cap is still served"
        first.close()
        deadline = time.monotonic() + 5
        while True:  # the server sees the first close soon after: a new connection is taken again
            with own_connection(small_door.port) as again:
                try:
                    health_pb2_grpc.HealthStub(again).Check(health, timeout=5)
                    break
                except grpc.RpcError:
                    assert time.monotonic() < deadline, "a closed connection's place was never freed"
                    time.sleep(0.05)
    finally:
        first.close()
        second.close()


def test_two_authorization_entries_are_refused(gateway: gateway_pb2_grpc.GatewayStub) -> None:
    """One reader of the key: two `authorization` entries (a valid key among them, in either order) are
    INVALID_ARGUMENT, never read as whichever entry a given check takes."""
    for keys in ((KEY, "sk-wrong"), ("sk-wrong", KEY)):
        metadata = tuple(("authorization", f"Bearer {key}") for key in keys)
        with pytest.raises(grpc.RpcError) as raised:
            generate(gateway, metadata, prompt="hi", sampling=sampling(max_tokens=2))
        assert raised.value.code() == INVALID and "authorization" in raised.value.details()
