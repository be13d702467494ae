"""The gateway over kvroute workers treated as vLLM servers (`vllm://` specs): the engine fleet state
(membership, health, parity, no-events detection, DNS discovery) and the HTTP backend (streaming, chat kept
as chat, cached tokens, tenant salts as `cache_salt`, cancellation, errors, a killed worker). Real workers,
their real HTTP front doors, a real gateway; see tests/engine_stack.py."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import orjson
import psutil
import pytest
import zmq
from prometheus_client import generate_latest

from gateway.admission.auth import key_sha256
from gateway.fleet.engine_fleet import EngineOptions, subscribe
from gateway.forwarding.retry import StreamDeadlines
from gateway.frontdoors.http_server import merge_delta
from gateway.metrics import label_value
from kvroute.engine_kv_events import BlockStored, EventBatch, encode_batch, encode_seq
from kvroute.hashing import block_hashes
from kvroute.model_source import resolve_model
from kvroute.tokenizer import Tokenizer
from launch.fleet import free_port
from proto import worker_pb2, worker_pb2_grpc
from tests.engine_stack import EngineStack, EngineStackOptions
from tests.gateway_stack import KEY, SMALL_KEY

pytestmark = pytest.mark.timeout(120)
LONG = " ".join(f"w{i}" for i in range(40))  # several full blocks of the sim tokenizer


@pytest.fixture(scope="module")
def stack() -> Iterator[EngineStack]:
    with EngineStack(EngineStackOptions(workers=2, sim_decode_ms_per_step=10)) as running:
        yield running


def post(stack: EngineStack, path: str, body: dict, key: str = KEY) -> httpx.Response:
    return httpx.post(f"{stack.http_url}{path}", json=body, headers={"authorization": f"Bearer {key}"}, timeout=30)


def sse_events(response: httpx.Response) -> list[dict]:
    events = []
    for block in response.text.split("\n\n"):
        if block.startswith("data: ") and block != "data: [DONE]":
            events.append(orjson.loads(block[6:]))
    assert response.text.rstrip().endswith("data: [DONE]")
    return events


@pytest.fixture(scope="module")
def evented() -> Iterator[EngineStack]:
    """Workers that publish their KV events in vLLM's wire format, read by the gateway's subscribers."""
    with EngineStack(EngineStackOptions(workers=2, sim_decode_ms_per_step=5, kv_events=True)) as running:
        yield running


def test_a_shared_prefix_is_routed_to_the_worker_whose_events_hold_it(evented: EngineStack) -> None:
    prompt = f"evented prefix {LONG}"
    first = post(evented, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
    holder = first.headers["x-kvroute-worker"]
    _wait(lambda: evented.fleet.view().kv_index.num_blocks(holder) > 0)
    for i in range(4):
        response = post(evented, "/v1/completions", {"prompt": f"{prompt} turn {i}", "max_tokens": 2})
        assert response.headers["x-kvroute-worker"] == holder
        route = dict(part.split("=", 1) for part in response.headers["x-kvroute-route"].split("; "))
        assert int(route["matched_blocks"]) > 0, route
        assert "flags" not in route
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_distinct_prefixes_spread_over_evented_workers(evented: EngineStack) -> None:
    workers = {post(evented, "/v1/completions", {"prompt": f"spread {i} {LONG}", "max_tokens": 1}).headers[
        "x-kvroute-worker"] for i in range(12)}  # fmt: skip
    assert len(workers) == 2


def test_evented_workers_are_never_flagged_silent(evented: EngineStack) -> None:
    post(evented, "/v1/completions", {"prompt": f"heard {LONG}", "max_tokens": 1})
    time.sleep(evented.options.engine.no_events_after + 0.3)
    assert evented.fleet.counters.no_kv_events == {}


def test_a_restarted_engine_gets_nothing_routed_on_its_old_entries(evented: EngineStack) -> None:
    prompt = f"before the restart {LONG}"
    holder = post(evented, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).headers["x-kvroute-worker"]
    index = [i for i in range(2) if evented.worker_id(i) == holder][0]
    _wait(lambda: evented.fleet.view().kv_index.num_blocks(holder) > 0)
    incarnation = evented.fleet.member(holder).incarnation
    evented.restart(index)  # back within the health checks' grace: still a member, its old entries still there
    # Its first batch (sequence 0) tells the gateway: prompts sent to the engine directly, past the gateway,
    # until the subscriber has reconnected to the new socket and read one.
    for i in range(50):
        body = {"prompt": f"after the restart {i} {LONG}", "max_tokens": 1}
        assert httpx.post(f"http://127.0.0.1:{evented.http_ports[index]}/v1/completions", json=body).status_code == 200
        member = evented.fleet.member(holder)
        if member is not None and member.incarnation != incarnation:
            break
        time.sleep(0.1)
    member = evented.fleet.member(holder)
    assert member is not None and member.incarnation != incarnation
    response = post(evented, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert "matched_blocks=0" in response.headers["x-kvroute-route"]


def test_engine_workers_join_by_their_http_address(stack: EngineStack) -> None:
    members = stack.fleet.members()
    assert [m.worker_id for m in members] == sorted(stack.worker_id(i) for i in range(2))
    assert {m.engine for m in members} == {"vllm"}
    assert all(m.model_id == "sim" for m in members)  # the engine's served name, from its /v1/models


def test_distinct_prefixes_spread(stack: EngineStack) -> None:
    workers = set()
    for i in range(12):
        response = post(stack, "/v1/completions", {"prompt": f"topic {i} {LONG}", "max_tokens": 1})
        assert response.status_code == 200, response.text
        workers.add(response.headers["x-kvroute-worker"])
    assert len(workers) == 2


def test_a_stream_passes_through_with_usage(stack: EngineStack) -> None:
    body = {"prompt": f"stream {LONG}", "max_tokens": 8, "stream": True, "stream_options": {"include_usage": True}}
    response = post(stack, "/v1/completions", body)
    assert response.status_code == 200, response.text
    events = sse_events(response)
    text_events = [e for e in events if e["choices"]]
    assert text_events[-1]["choices"][0]["finish_reason"] == "length"
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == 8 and "cached_tokens" in usage["prompt_tokens_details"]


def test_a_chat_request_stays_a_chat_request(stack: EngineStack) -> None:
    body = {"messages": [{"role": "user", "content": f"hello {LONG}"}], "max_tokens": 5, "stream": True}
    response = post(stack, "/v1/chat/completions", body)
    assert response.status_code == 200, response.text
    events = sse_events(response)
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events if e["choices"])
    whole = post(stack, "/v1/chat/completions", {**body, "stream": False}).json()
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"]["content"]
    assert whole["usage"]["completion_tokens"] == 5


def test_n_choices_and_logprobs_come_through_the_engine(stack: EngineStack) -> None:
    body = {"prompt": f"two ways {LONG}", "max_tokens": 3, "n": 2, "seed": 7, "logprobs": 2}
    response = post(stack, "/v1/completions", body)
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    # (the sim engine's alternatives are its sampled token only)
    assert all(len(c["logprobs"]["tokens"]) == 3 and len(c["logprobs"]["top_logprobs"]) == 3 for c in choices)
    assert response.json()["usage"]["completion_tokens"] == 6
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True, "top_logprobs": 2}
    content = post(stack, "/v1/chat/completions", chat).json()["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and all(entry["token"] and "top_logprobs" in entry for entry in content)


def test_tenant_b_never_gets_cached_tokens_from_tenant_a(stack: EngineStack) -> None:
    prompt = f"tenant secret {LONG}"
    first = post(stack, "/v1/completions", {"prompt": prompt, "max_tokens": 1}, key=KEY)
    again = post(stack, "/v1/completions", {"prompt": prompt, "max_tokens": 1}, key=KEY)
    other = post(stack, "/v1/completions", {"prompt": prompt, "max_tokens": 1}, key=SMALL_KEY)
    assert again.headers["x-kvroute-worker"] == first.headers["x-kvroute-worker"]
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_request_past_the_engines_context_is_a_400_naming_its_field(stack: EngineStack) -> None:
    # The context is the engine's max_model_len from its /v1/models card.
    assert all(m.max_model_len == 512 for m in stack.fleet.members())
    response = post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 100_000})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "max_tokens"


def test_a_client_that_leaves_cancels_the_engines_request(stack: EngineStack) -> None:
    body = {"prompt": f"long answer {LONG}", "max_tokens": 150, "stream": True, "ignore_eos": True}
    headers = {"authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", f"{stack.http_url}/v1/completions", json=body, headers=headers) as response:
        chunks = response.iter_bytes()  # kept until the client leaves: a dropped iterator closes the stream
        next(chunks)
        assert any(s.num_running for s in worker_stats(stack))
    _wait(lambda: not any(s.num_running or s.num_waiting for s in worker_stats(stack)))
    _wait(lambda: not any(stack.fleet.view().loads[w].in_flight for w in stack.fleet.view().replicas))


def test_requests_in_a_row_reuse_the_gateways_connection_to_the_engine(stack: EngineStack) -> None:
    def gateway_side_ports() -> set[int]:  # the dialling ends, closed ones (TIME_WAIT) included
        engines = set(stack.http_ports)
        return {c.laddr.port for c in psutil.net_connections("tcp") if c.raddr and c.raddr.port in engines}

    body = {"prompt": f"reuse {LONG}", "max_tokens": 4, "stream": True}
    for _ in range(2):  # a connection to each engine the policy may pick
        assert post(stack, "/v1/completions", body).status_code == 200
    before = gateway_side_ports()
    for _ in range(8):
        assert post(stack, "/v1/completions", body).status_code == 200
    assert len(gateway_side_ports() - before) <= 1  # one new connection at most (a metrics scrape's), not one a request


def worker_stats(stack: EngineStack) -> list[worker_pb2.WorkerStats]:
    stats = []
    for worker in stack.workers:
        with grpc.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stats.append(worker_pb2_grpc.WorkerStub(channel).GetStats(worker_pb2.GetStatsRequest(), timeout=5))
    return stats


def test_load_comes_from_the_engines_own_metrics(stack: EngineStack) -> None:
    # A request sent to the engine directly, past the gateway: only the engine's vllm: metrics tell of it.
    worker_id = stack.worker_id(0)
    body = {"prompt": f"direct {LONG}", "max_tokens": 100, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"http://127.0.0.1:{stack.http_ports[0]}/v1/completions", json=body) as response:
        chunks = response.iter_bytes()  # kept: a dropped iterator closes the stream
        next(chunks)
        _wait(lambda: stack.fleet.view().loads[worker_id].in_flight >= 1)
        assert stack.fleet.book.in_flight(worker_id) == 0
    _wait(lambda: stack.fleet.view().loads[worker_id].in_flight == 0)


def test_a_worker_without_kv_events_is_flagged_and_routed_by_load(stack: EngineStack) -> None:
    sent_to: set[str] = set()
    for i in range(20):  # a prompt of full blocks to every worker
        sent_to.add(post(stack, "/v1/completions", {"prompt": f"flag {i} {LONG}", "max_tokens": 1}).headers[
            "x-kvroute-worker"])  # fmt: skip
        if len(sent_to) == 2:
            break
    time.sleep(stack.options.engine.no_events_after + 0.3)
    response = post(stack, "/v1/completions", {"prompt": f"flag me {LONG}", "max_tokens": 1})
    assert response.status_code == 200
    assert "no_kv_events" in response.headers["x-kvroute-route"]
    assert sum(stack.fleet.counters.no_kv_events.values()) >= 1
    exposition = generate_latest(stack.request_path.metrics.registry).decode()
    worker = label_value(response.headers["x-kvroute-worker"])
    assert f'kvroute:gateway_no_kv_events_total{{worker="{worker}"}} 1.0' in exposition


def test_engines_that_tokenize_as_the_gateway_pass_parity(stack: EngineStack) -> None:
    # Their /tokenize (plain canaries and a chat through the template) gave the gateway's own ids.
    assert all(m.parity_ok for m in stack.fleet.members())
    assert stack.fleet.counters.parity_mismatches == {}


def test_a_tokenizer_mismatch_is_flagged_and_routed_by_load(tmp_path: Path) -> None:
    # The gateway's tokenizer: the workers' own, with another chat template (the plain canaries agree).
    Tokenizer.for_model(resolve_model("sim")).save_hf_dir(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "[edited] " + config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with EngineStack(EngineStackOptions(workers=1, gateway_tokenizer=Tokenizer.from_hf_dir(tmp_path))) as stack:
        member = stack.fleet.members()[0]
        assert not member.parity_ok
        assert stack.fleet.counters.parity_mismatches == {member.worker_id: 1}
        body = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}
        response = post(stack, "/v1/chat/completions", body)
        assert response.status_code == 200, response.text
        assert "flags=parity_mismatch" in response.headers["x-kvroute-route"]


@pytest.mark.slow
def test_a_killed_worker_leaves_and_its_requests_succeed_elsewhere() -> None:
    with EngineStack(EngineStackOptions(workers=2)) as stack:
        prompt = f"sticky {LONG}"
        first = post(stack, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
        victim = [i for i in range(2) if stack.worker_id(i) == first.headers["x-kvroute-worker"]][0]
        stack.kill(victim)
        again = post(stack, "/v1/completions", {"prompt": prompt, "max_tokens": 1})  # retried before a token
        assert again.status_code == 200, again.text
        assert again.headers["x-kvroute-worker"] == stack.worker_id(1 - victim)
        deadline = time.monotonic() + 5
        while stack.fleet.member(stack.worker_id(victim)) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stack.fleet.member(stack.worker_id(victim)) is None
        assert stack.fleet.counters.leaves == 1


@pytest.mark.slow
def test_a_worker_killed_mid_stream_ends_the_stream_with_an_error_event() -> None:
    with EngineStack(EngineStackOptions(workers=2, sim_decode_ms_per_step=20)) as stack:
        body = {"prompt": f"interrupted {LONG}", "max_tokens": 200, "stream": True, "ignore_eos": True}
        headers = {"authorization": f"Bearer {KEY}"}
        with httpx.stream("POST", f"{stack.http_url}/v1/completions", json=body, headers=headers) as response:
            victim = [i for i in range(2) if stack.worker_id(i) == response.headers["x-kvroute-worker"]][0]
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            stack.kill(victim)
            rest = list(lines)
        events = [orjson.loads(line[6:]) for line in rest if line.startswith("data: {")]
        assert "error" in events[-1] and [line for line in rest if line][-1] == "data: [DONE]"


@pytest.mark.slow
def test_a_hung_engine_ends_the_stream_at_its_inter_token_deadline() -> None:
    # A real `kvroute worker` process, stopped (SIGSTOP) mid-stream: a member still (its health checks have not
    # failed long enough to leave), but no longer answering them, so the stream's deadline ends it.
    grpc_port, http_port = free_port(), free_port()
    argv = [sys.executable, "-m", "launch.cli", "worker", "--model", "sim", "--host", "127.0.0.1", "--port",
            str(grpc_port), "--http-port", str(http_port), "--sim-decode-ms-per-step", "20"]  # fmt: skip
    worker = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(lambda: _ready(http_port), timeout=60)
        options = EngineStackOptions(
            workers=0, specs=lambda _: [f"vllm://127.0.0.1:{http_port}"],
            engine=EngineOptions(poll_interval=0.05, unreachable_after=30.0, http_timeout=0.2),
            deadlines=StreamDeadlines(first_token_s=5.0, inter_token_s=0.5),
        )  # fmt: skip
        with EngineStack(options) as stack:
            body = {"prompt": f"hung {LONG}", "max_tokens": 200, "stream": True, "ignore_eos": True}
            headers = {"authorization": f"Bearer {KEY}"}
            with httpx.stream("POST", f"{stack.http_url}/v1/completions", json=body, headers=headers) as response:
                lines = response.iter_lines()
                assert next(lines).startswith("data: ")
                worker.send_signal(signal.SIGSTOP)
                started = time.monotonic()
                rest = [line for line in lines if line]
            waited = time.monotonic() - started
            worker.send_signal(signal.SIGCONT)
        error = orjson.loads(rest[-2][6:])["error"]
        assert error["code"] == "worker_timeout" and rest[-1] == "data: [DONE]", rest[-2:]
        assert waited < 5.0
    finally:
        worker.send_signal(signal.SIGCONT)
        worker.terminate()
        worker.wait(10)


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def test_dns_discovery_joins_and_leaves_with_the_records_each_rank_of_each_address() -> None:
    """A `discover=dns` name with dp=2: every resolved address is an engine of two ranks, `address/dp<r>`,
    which join when the record appears and leave when it goes."""
    records: list[str] = []
    with EngineStack(_dns_discovered(records, "events=tcp://*:1&discover=dns&dp=2")) as stack:
        ranks = [f"{stack.worker_id(0)}/dp{r}" for r in range(2)]
        assert sorted(m.worker_id for m in stack.fleet.members()) == ranks
        response = post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
        assert response.status_code == 200 and response.headers["x-kvroute-worker"] in ranks
        records.clear()
        _wait(lambda: not stack.fleet.members())
        assert post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": 1}).status_code == 503
        records.append("127.0.0.1")
        _wait(lambda: len(stack.fleet.members()) == 2)
        assert stack.fleet.counters.joins == 4


def test_dns_discovery_forgets_the_state_of_an_address_no_longer_resolved() -> None:
    """Pod IPs churn: an address that leaves the records takes its per-worker counters with it (here its
    `no_kv_events` count: its spec names no events endpoint), so the fleet keeps state only for today's."""
    records: list[str] = []
    with EngineStack(_dns_discovered(records, "discover=dns")) as stack:
        worker = stack.worker_id(0)
        _wait(lambda: stack.fleet.counters.no_kv_events.get(worker) == 1)
        records.clear()
        _wait(lambda: not stack.fleet.members())
        assert stack.fleet.counters.no_kv_events == {} and stack.fleet.counters.parity_mismatches == {}
        assert not any(key[0] == worker for key in stack.fleet.counters.kv_event_drops)


def _dns_discovered(records: list[str], query: str) -> EngineStackOptions:
    """One engine named `vllm://engines.test:PORT?QUERY`, the name resolving to what `records` holds (the engine's
    address once the stack starts it), polled and resolved every 0.05 s."""

    async def resolve(host: str, port: int) -> list[str]:
        assert host == "engines.test"
        return list(records)

    def specs(ports: list[int]) -> list[str]:
        records.append("127.0.0.1")
        return [f"vllm://engines.test:{ports[0]}?{query}"]

    return EngineStackOptions(
        workers=1, specs=specs, resolve=resolve,
        engine=EngineOptions(poll_interval=0.05, unreachable_after=0.5, resolve_interval=0.05),
    )  # fmt: skip


def _wait(condition: object, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.02)
    assert condition()  # type: ignore[operator]


def test_chat_deltas_beyond_content_merge_into_one_message_as_a_client_merges_them() -> None:
    message: dict = {"role": "assistant", "content": ""}
    deltas = [
        {"reasoning_content": "Look it "},
        {"reasoning_content": "up.", "tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                                     "function": {"name": "find", "arguments": '{"q": '}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '"order"}'}}, {"index": 1, "id": "c2",
                        "function": {"name": "log", "arguments": "{}"}}]},
    ]  # fmt: skip
    for delta in deltas:
        merge_delta(message, delta)
    assert message["reasoning_content"] == "Look it up."
    assert message["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "find", "arguments": '{"q": "order"}'}},
        {"id": "c2", "type": "function", "function": {"name": "log", "arguments": "{}"}},
    ]


def test_a_block_held_only_on_the_cpu_is_scored_at_its_configured_weight() -> None:
    """Worker 0's events hold a prompt's leading blocks on the CPU tier only, worker 1's fewer on the GPU;
    with CPU blocks weighed 0.5 the router picks by the weighted depth: 6 CPU blocks (3) lose to 4 GPU blocks,
    10 CPU blocks (5) win."""
    ctx = zmq.Context()
    sockets = [ctx.socket(zmq.PUB) for _ in range(2)]
    ports = [s.bind_to_random_port("tcp://127.0.0.1") for s in sockets]
    options = EngineStackOptions(
        workers=2, api_keys=None,
        engine=EngineOptions(poll_interval=0.05, unreachable_after=0.5, medium_weights={"CPU": 0.5}),
        specs=lambda http: [f"vllm://127.0.0.1:{h}?events=tcp://127.0.0.1:{e}" for h, e in zip(http, ports)],  # noqa: B905
    )  # fmt: skip
    try:
        with EngineStack(options) as stack:
            for prompt, cpu_blocks, expected_worker, expected_blocks in (
                ("weights one " + LONG * 2, 6, 1, 4),
                ("weights two " + LONG * 2, 10, 0, 5),
            ):
                ids = httpx.post(f"{stack.http_url}/tokenize", json={"prompt": prompt}, timeout=10).json()["tokens"]
                assert len(ids) >= 11 * 16
                runs = [BlockStored(tuple(range(cpu_blocks)), None, tuple(ids[: 16 * cpu_blocks]), 16, None, "CPU"),
                        BlockStored(tuple(range(4)), None, tuple(ids[: 16 * 4]), 16, None, "GPU")]  # fmt: skip
                for seq in range(400):  # until both subscribers (connected after the workers joined) have them
                    for sock, run_ in zip(sockets, runs, strict=True):
                        sock.send_multipart([b"", encode_seq(seq), encode_batch(EventBatch(1.0, (run_,)))])
                    view = stack.fleet.view()
                    match = view.kv_index.match(block_hashes(ids, model_id=stack.fleet.identity.model_id))
                    weighted = dict(zip(view.replicas, match, strict=True))
                    if weighted == {stack.worker_id(0): cpu_blocks // 2, stack.worker_id(1): 4}:
                        break
                    time.sleep(0.02)
                else:
                    raise AssertionError(f"the events never reached the index: {weighted}")
                response = post(stack, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
                assert response.status_code == 200, response.text
                assert response.headers["x-kvroute-worker"] == stack.worker_id(expected_worker)
                route = dict(part.split("=", 1) for part in response.headers["x-kvroute-route"].split("; "))
                assert (route["reason"], int(route["matched_blocks"])) == ("hit", expected_blocks), route
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()


def test_an_engine_started_with_an_api_key_gets_it_on_every_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Workers whose front doors require a key (as `vllm serve --api-key` does): a gateway given the key file
    admits them (/v1/models, /tokenize, /metrics with the key), forwards with it, and never logs it; one
    without the file cannot admit them."""
    engine_key = "sk-engine-" + "7" * 24
    monkeypatch.setenv("KVROUTE_API_KEYS", json.dumps([{"tenant": "gateway", "key_sha256": key_sha256(engine_key)}]))
    monkeypatch.setenv("KVROUTE_CACHE_SALT_SECRET", "s" * 32)
    key_file = tmp_path / "engine.key"
    key_file.write_text(engine_key + "\n")
    caplog.set_level(logging.DEBUG)
    keyed = EngineStackOptions(workers=1, specs=lambda http: [f"vllm://127.0.0.1:{http[0]}?api_key_file={key_file}"])
    with EngineStack(keyed) as stack:
        assert [m.worker_id for m in stack.fleet.members()] == [stack.worker_id(0)]
        assert stack.fleet.member(stack.worker_id(0)).parity_ok  # its /tokenize answered the canaries
        direct = httpx.post(f"http://127.0.0.1:{stack.http_ports[0]}/v1/completions", json={"prompt": "hi"})
        assert direct.status_code == 401  # the engine does want a key
        for _ in range(2):
            response = post(stack, "/v1/completions", {"prompt": f"keyed {LONG}", "max_tokens": 2})
            assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    unkeyed = EngineStackOptions(workers=1, specs=lambda http: [f"vllm://127.0.0.1:{http[0]}"])
    with EngineStack(unkeyed) as stack:
        assert stack.fleet.members() == []  # /v1/models answered 401
    assert engine_key not in caplog.text


def _consecutive_pub_sockets(ctx: zmq.Context, count: int) -> tuple[list[zmq.Socket], int]:
    """`count` PUB sockets bound on consecutive loopback ports (a DP engine's rank r publishes on port + r)."""
    for _ in range(50):
        first = ctx.socket(zmq.PUB)
        port = first.bind_to_random_port("tcp://127.0.0.1", min_port=20000, max_port=60000)
        sockets = [first]
        try:
            for r in range(1, count):
                sockets.append(ctx.socket(zmq.PUB))
                sockets[-1].bind(f"tcp://127.0.0.1:{port + r}")
            return sockets, port
        except zmq.ZMQError:
            for sock in sockets:
                sock.close(linger=0)
    raise AssertionError("no consecutive free ports")


async def _recording_proxy(
    port: int,
    target: int,
    seen: list[tuple[str, str | None]],
    rewrite: Any = None,
    absent: frozenset[str] = frozenset(),
) -> Any:
    """A loopback HTTP proxy in front of a worker's front door that records each request's path and its
    X-data-parallel-rank header, as a DP engine's HTTP server would read it; with `rewrite`, each response's
    body is read whole and sent on as `rewrite(body)` (an engine that answers otherwise); the `absent` paths
    are answered 404, as by an engine that does not serve them."""
    from aiohttp import ClientSession, web

    session = ClientSession()

    async def forward(request: web.Request) -> web.StreamResponse:
        seen.append((request.path, request.headers.get("x-data-parallel-rank")))
        if request.path in absent:
            return web.json_response({"detail": "Not Found"}, status=404)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}
        upstream = await session.request(
            request.method, f"http://127.0.0.1:{target}{request.path_qs}", data=await request.read(), headers=headers
        )
        response = web.StreamResponse(status=upstream.status, headers={"content-type": upstream.content_type})
        await response.prepare(request)
        if rewrite is not None:
            await response.write(rewrite(await upstream.read()))
        async for piece in upstream.content.iter_any():
            await response.write(piece)
        await response.write_eof()
        upstream.release()
        return response

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, session


def test_each_data_parallel_rank_is_a_routing_target_and_its_requests_carry_the_rank() -> None:
    """One engine (a kvroute worker behind a proxy that records what arrives) named with dp=2 and id=pod-a: two
    members, `pod-a/dp0` and `/dp1` (the id in place of the address: what the ring places by, the header and the
    metrics say), each fed by its own rank's events (on the events port + rank, stamped with the rank); a prompt
    whose blocks only rank 1 holds goes to rank 1, sent with `X-data-parallel-rank: 1`."""
    ctx = zmq.Context()
    sockets, events = _consecutive_pub_sockets(ctx, 2)
    proxy_port, seen = free_port(), []
    options = EngineStackOptions(
        workers=1, api_keys=None,
        specs=lambda _: [f"vllm://127.0.0.1:{proxy_port}?events=tcp://127.0.0.1:{events}&dp=2&id=pod-a"],
    )  # fmt: skip
    try:
        with EngineStack(options) as stack:
            runner, session = stack.call(_recording_proxy(proxy_port, stack.http_ports[0], seen))
            try:
                ranks = ["pod-a/dp0", "pod-a/dp1"]
                _wait(lambda: sorted(m.worker_id for m in stack.fleet.members()) == ranks)
                assert {m.address for m in stack.fleet.members()} == {f"127.0.0.1:{proxy_port}"}
                prompt = "ranks " + LONG
                ids = httpx.post(f"{stack.http_url}/tokenize", json={"prompt": prompt}, timeout=10).json()["tokens"]
                held = BlockStored(tuple(range(4)), None, tuple(ids[:64]), 16, None, "GPU")
                other = BlockStored((9,), None, tuple(range(16)), 16, None, "GPU")
                hashes = block_hashes(ids, model_id=stack.fleet.identity.model_id)
                for seq in range(400):
                    sockets[0].send_multipart([b"", encode_seq(seq), encode_batch(EventBatch(1.0, (other,), 0))])
                    sockets[1].send_multipart([b"", encode_seq(seq), encode_batch(EventBatch(1.0, (held,), 1))])
                    # a batch stamped with another rank, on rank 0's port: dropped (foreign_rank)
                    sockets[0].send_multipart([b"", encode_seq(seq), encode_batch(EventBatch(1.0, (held,), 1))])
                    view = stack.fleet.view()
                    if dict(zip(view.replicas, view.kv_index.match(hashes), strict=True)) == {ranks[0]: 0, ranks[1]: 4}:
                        break
                    time.sleep(0.02)
                else:
                    raise AssertionError("rank 1's events never reached the index")
                seen.clear()
                response = post(stack, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
                assert response.status_code == 200, response.text
                assert response.headers["x-kvroute-worker"] == ranks[1]
                assert "reason=hit; matched_blocks=4" in response.headers["x-kvroute-route"]
                assert ("/v1/completions", "1") in seen
                metrics = generate_latest(stack.request_path.metrics.registry).decode()
                assert f'worker="{label_value(ranks[1])}"' in metrics
                drops = stack.fleet.counters.kv_event_drops
                assert drops.get((ranks[0], "foreign_rank"), 0) > 0 and (ranks[1], "foreign_rank") not in drops
            finally:
                stack.call(session.close())
                stack.call(runner.cleanup())
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()


def test_an_engines_own_finish_reason_reaches_the_client_and_a_bounded_series() -> None:
    """An engine's finish reason that is a string reaches the client as the engine sent it, counted as "other"
    unless it is one OpenAI or the engines name (each request's own reason here: the series would grow by one
    a request); one that is not a string is a malformed event, answered as an error, not passed on."""
    proxy_port, seen, reasons = free_port(), [], iter([b'"engine-own-1"', b'"engine-own-2"', b"7"])

    def rewrite(body: bytes) -> bytes:  # the generation answers only (the proxy also carries probes and scrapes)
        length = b'"finish_reason":"length"'
        return body.replace(length, b'"finish_reason":' + next(reasons)) if length in body else body

    options = EngineStackOptions(workers=1, api_keys=None, specs=lambda _: [f"vllm://127.0.0.1:{proxy_port}"])
    with EngineStack(options) as stack:
        runner, session = stack.call(_recording_proxy(proxy_port, stack.http_ports[0], seen, rewrite))
        try:
            _wait(lambda: len(stack.fleet.members()) == 1)
            for own in ("engine-own-1", "engine-own-2"):
                response = post(stack, "/v1/completions", {"prompt": "why " + LONG, "max_tokens": 2})
                assert response.status_code == 200, response.text
                assert response.json()["choices"][0]["finish_reason"] == own
            response = post(stack, "/v1/completions", {"prompt": "why " + LONG, "max_tokens": 2})
            assert response.status_code >= 500 and "finish_reason is int" in response.text, response.text
        finally:
            stack.call(session.close())
            stack.call(runner.cleanup())
        text = generate_latest(stack.request_path.metrics.registry).decode()
        assert 'finished_reason="other"' in text and "engine-own" not in text


def test_a_tool_call_index_out_of_bounds_is_a_malformed_event() -> None:
    """An engine's tool-call `index` names the call a delta continues; one that is not an integer in
    [0, 128) is a malformed event, answered as an error (an index of 2**40 had the gateway merge that many
    calls for a whole message, and reached a streaming client as sent)."""
    proxy_port, seen, index = free_port(), [], [b"1099511627776"]

    def rewrite(body: bytes) -> bytes:  # each generation's first delta carries a tool call of that index
        delta = b'"delta":{'
        call = b'"tool_calls":[{"index":' + index[0] + b',"function":{"name":"f","arguments":""}}],'
        return body.replace(delta, delta + call, 1) if delta in body else body

    options = EngineStackOptions(workers=1, api_keys=None, specs=lambda _: [f"vllm://127.0.0.1:{proxy_port}"])
    with EngineStack(options) as stack:
        runner, session = stack.call(_recording_proxy(proxy_port, stack.http_ports[0], seen, rewrite))
        try:
            _wait(lambda: len(stack.fleet.members()) == 1)
            chat = {"messages": [{"role": "user", "content": "why " + LONG}], "max_tokens": 2}
            response = post(stack, "/v1/chat/completions", {**chat, "stream": True})
            assert response.status_code >= 500 and "tool_calls index" in response.text, response.text
            assert "1099511627776" in response.text
            index[0] = b"-1"
            response = post(stack, "/v1/chat/completions", chat)
            assert response.status_code >= 500 and "tool_calls index" in response.text, response.text
        finally:
            stack.call(session.close())
            stack.call(runner.cleanup())


def _without_tokenize(gateway_tokenizer: Tokenizer | None = None) -> tuple[EngineStack, int]:
    """A stand-in for NVIDIA Dynamo's frontend: a worker that publishes its KV events but whose HTTP port (a
    proxy) serves no /tokenize; the gateway names it by the proxy's port (started by the caller)."""
    proxy_port, holder = free_port(), {}

    def specs(_: list[int]) -> list[str]:
        events, replay = holder["stack"].event_ports[0]
        return [f"vllm://127.0.0.1:{proxy_port}?events=tcp://127.0.0.1:{events}&replay=tcp://127.0.0.1:{replay}"]

    options = EngineStackOptions(workers=1, kv_events=True, specs=specs, gateway_tokenizer=gateway_tokenizer)
    holder["stack"] = EngineStack(options)
    return holder["stack"], proxy_port


def test_an_engine_without_tokenize_is_checked_from_its_own_kv_events() -> None:
    """Where /tokenize is absent, each canary goes to the engine as a generation and the token ids of the
    BlockStored events it publishes for it are compared with the gateway's: equal, its prefixes are scored."""
    stack, proxy_port = _without_tokenize()
    seen: list[tuple[str, str | None]] = []
    with stack:
        runner, session = stack.call(
            _recording_proxy(proxy_port, stack.http_ports[0], seen, absent=frozenset({"/tokenize"}))
        )
        try:
            _wait(lambda: len(stack.fleet.members()) == 1, timeout=20)
            (member,) = stack.fleet.members()
            assert member.parity_ok and stack.fleet.counters.parity_mismatches == {}
            paths = [path for path, _ in seen]
            assert "/tokenize" in paths and {"/v1/completions", "/v1/chat/completions"} <= set(paths)
            index = stack.fleet.view().kv_index
            before = index.num_blocks(member.worker_id)  # the canaries' blocks (their events decided parity)
            for turn in range(2):
                response = post(stack, "/v1/completions", {"prompt": f"dynamo {LONG}", "max_tokens": 2})
                assert response.status_code == 200, response.text
                if not turn:  # the first prompt's BlockStored events reach the index before the second is routed
                    _wait(lambda: stack.fleet.view().kv_index.num_blocks(member.worker_id) > before)
            assert "reason=hit" in response.headers["x-kvroute-route"], response.headers["x-kvroute-route"]
        finally:
            stack.call(session.close())
            stack.call(runner.cleanup())


def test_the_engines_capacity_from_its_metrics_reaches_its_kv_event_subscriber() -> None:
    """`vllm:cache_config_info`'s num_gpu_blocks (the sim workers': 256) is what sizes the worker's engine-block
    map (docs/engines.md, "Bounds"), where before no capacity was passed."""
    capacities: list[int | None] = []

    def recording(spec: Any, worker_id: str, book: Any, on_restart: Any, options: Any, capacity: Any) -> Any:
        capacities.append(capacity)
        return subscribe(spec, worker_id, book, on_restart, options, capacity)

    with EngineStack(EngineStackOptions(workers=1, api_keys=None, kv_events=True, events=recording)) as stack:
        _wait(lambda: len(stack.fleet.members()) == 1)
    assert capacities == [256]


def test_an_engine_without_tokenize_whose_events_hold_other_ids_is_a_mismatch(tmp_path: Path) -> None:
    # The gateway's tokenizer: the workers' own, with another chat template: the chat canary's blocks differ.
    Tokenizer.for_model(resolve_model("sim")).save_hf_dir(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = "[edited] " + config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    stack, proxy_port = _without_tokenize(Tokenizer.from_hf_dir(tmp_path))
    with stack:
        runner, session = stack.call(
            _recording_proxy(proxy_port, stack.http_ports[0], [], absent=frozenset({"/tokenize"}))
        )
        try:
            _wait(lambda: len(stack.fleet.members()) == 1, timeout=20)
            (member,) = stack.fleet.members()
            assert not member.parity_ok
            assert stack.fleet.counters.parity_mismatches == {member.worker_id: 1}
        finally:
            stack.call(session.close())
            stack.call(runner.cleanup())


def test_responses_over_engines_continue_on_the_holder(evented: EngineStack) -> None:
    """/v1/responses over vLLM engines: each turn reaches its engine as the chat it is (the engine's template and
    parsers), and a continued turn goes back to the engine that served the last one and finds it cached."""
    tools = [{"type": "function", "name": "look_up", "parameters": {"type": "object", "properties": {}}}]
    first = post(evented, "/v1/responses", {"input": f"converse {LONG}", "instructions": "terse", "tools": tools,
                                            "tool_choice": "none", "max_output_tokens": 4})  # fmt: skip
    assert first.status_code == 200, first.text
    holder = first.headers["x-kvroute-worker"]
    _wait(lambda: evented.fleet.view().kv_index.num_blocks(holder) > 0)
    body = {"input": "go on", "instructions": "terse", "tools": tools, "tool_choice": "none",
            "previous_response_id": first.json()["id"], "max_output_tokens": 4}  # fmt: skip
    second = post(evented, "/v1/responses", body)
    assert second.status_code == 200, second.text
    assert second.headers["x-kvroute-worker"] == holder and "reason=conversation" in second.headers["x-kvroute-route"]
    assert second.json()["usage"]["input_tokens_details"]["cached_tokens"] >= 16
