"""Two pools behind one gateway (gateway.pools): each model routed on its own fleet, index and hashes.

A real gateway in process (tests/gateway_stack.py's loop and servers) with two pools of `sim` workers: pool
"alpha" at block size 16, pool "beta" at block size 32, so the same text hashes apart in the two. The same
workers then serve a real `kvroute gateway` process that reads both pools from `--routing-config`, and the
endpoint picker over the same pools (driven message by message as tests/test_epp.py drives it): the model
picks the pool; a model no pool serves goes on to a model server, as GIE's picker does (docs/epp.md).
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_epp import Exchange, _bodies, _destination, _request_headers, serving_picker
from test_epp_envoy import _spawn, _wait

from gateway.admission.auth import Authenticator, cache_salt, key_sha256
from gateway.admission.limits import TenantConcurrency
from gateway.cli_epp import EndpointPicker
from gateway.fleet.embedded_fleet import EmbeddedFleetState
from gateway.frontdoors.ext_proc import EndpointMap
from gateway.frontdoors.grpc_server import start_grpc_server
from gateway.frontdoors.http_listener import HttpServer
from gateway.frontdoors.http_server import build_app
from gateway.metrics import GatewayMetrics
from gateway.pools import Pools
from gateway.request_path import RequestPath, fleet_identity
from gateway.routing.router import make_policy
from kvroute.hashing import block_hashes
from kvroute.model_source import resolve_model
from kvroute.tokenizer import Tokenizer
from launch.worker import free_port
from proto import gateway_pb2, gateway_pb2_grpc
from tests.gateway_stack import KEY, SMALL_KEY, GatewayStack, StackOptions
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.service import start_worker_server

BLOCK_SIZES = {"alpha": 16, "beta": 32}
AUTH = {"authorization": f"Bearer {KEY}"}
PROMPT = "a shared system prompt that runs well past a few blocks of either size " * 6


class PoolsStack(GatewayStack):
    """GatewayStack's loop, with one gateway over two pools of two sim workers each."""

    async def _start(self) -> None:
        o = self.options
        loop = asyncio.get_running_loop()
        source = resolve_model("sim")
        tokenizer = await loop.run_in_executor(None, Tokenizer.for_model, source)
        auth = Authenticator(o.api_keys)
        concurrency = TenantConcurrency(o.limits)
        self.worker_pool: dict[int, str] = {}  # worker port -> its pool
        self.fleets: list[EmbeddedFleetState] = []
        paths = []
        for name, block_size in BLOCK_SIZES.items():
            addresses = []
            for _ in range(2):
                config = EngineConfig(
                    model="sim", num_kv_blocks=o.num_kv_blocks, max_model_len=o.max_model_len,
                    sim_decode_ms_per_step=o.sim_decode_ms_per_step, sim_prefill_us_per_token=1.0,
                    block_size=block_size,
                )  # fmt: skip
                engine = await loop.run_in_executor(None, LLMEngine, config)
                worker = await start_worker_server(engine, port=0)
                self.workers.append(worker)
                self.worker_pool[worker.port] = name
                addresses.append(f"127.0.0.1:{worker.port}")
            identity = fleet_identity(source.model_id, tokenizer, block_size)
            fleet = EmbeddedFleetState(addresses, identity, poll_interval=0.05, unreachable_after=0.5)
            await fleet.start()
            self.fleets.append(fleet)
            paths.append(
                RequestPath(
                    fleet,
                    make_policy("kv_aware"),
                    tokenizer,
                    source.model_id,
                    name,
                    auth,
                    o.limits,
                    GatewayMetrics(name),
                    block_size=block_size,
                    concurrency=concurrency,
                )  # fmt: skip
            )
        self.pools = Pools(paths)
        app = build_app(self.pools, max_body_bytes=o.limits.max_body_bytes, default_max_tokens=o.limits.max_tokens)
        self.http = HttpServer.start(app, "127.0.0.1", 0)
        self.grpc = await start_grpc_server(
            self.pools, "127.0.0.1", 0, max_body_bytes=o.limits.max_body_bytes, health_interval_s=0.1
        )

    async def _stop(self) -> None:
        await self.grpc.stop(grace=0)
        await self.http.stop()
        for fleet in self.fleets:
            await fleet.stop()
        await self.pools.close()
        for worker in self.workers:
            await worker.stop(drain_timeout=0)

    def pool_of(self, worker_id: str) -> str:
        """The pool whose fleet holds `worker_id`."""
        pools = self.pools.pools()
        (name,) = [p.served_model_name for p in pools if any(m.worker_id == worker_id for m in p.members())]
        return name


@pytest.fixture(scope="module")
def stack() -> Iterator[PoolsStack]:
    with PoolsStack(StackOptions()) as running:
        deadline = time.monotonic() + 10
        while not all(len(p.members()) == 2 for p in running.pools.pools()):
            assert time.monotonic() < deadline, "the four workers did not join their pools"
            time.sleep(0.05)
        yield running


def complete(stack: PoolsStack, model: str | None, prompt: str = PROMPT, key: str = KEY) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 4}
    if model is not None:
        body["model"] = model
    headers = {"authorization": f"Bearer {key}"}
    return httpx.post(f"{stack.http_url}/v1/completions", json=body, headers=headers, timeout=30)


def matched_blocks(response: httpx.Response) -> int:
    route = dict(part.split("=", 1) for part in response.headers["x-kvroute-route"].split("; "))
    return int(route["matched_blocks"])


def wait_indexed(stack: PoolsStack, model: str, prompt: str) -> None:
    """Until the pool's fleet has read its worker's KV events for `prompt` (its index matches the prompt)."""
    ids = httpx.post(f"{stack.http_url}/tokenize", json={"model": model, "prompt": prompt}, headers=AUTH).json()
    path = stack.pools.pool(model)
    salt = cache_salt(path.auth.authenticate(KEY), None)
    hashes = block_hashes(ids["tokens"], model_id=path.model_id, cache_salt=salt, block_size=path.block_size)
    deadline = time.monotonic() + 5
    while max(path.fleet.view().kv_index.match(hashes), default=0) == 0:
        assert time.monotonic() < deadline, f"pool {model}'s index never saw the prompt"
        time.sleep(0.02)


def test_models_lists_every_pool(stack: PoolsStack) -> None:
    listed = httpx.get(f"{stack.http_url}/v1/models", headers=AUTH).json()
    assert [card["id"] for card in listed["data"]] == ["alpha", "beta"]
    assert httpx.get(f"{stack.http_url}/v1/models/beta", headers=AUTH).json()["id"] == "beta"
    assert httpx.get(f"{stack.http_url}/v1/models/gamma", headers=AUTH).status_code == 404


def test_each_pool_routes_on_its_own_workers_and_index(stack: PoolsStack) -> None:
    first = complete(stack, "alpha")
    assert first.status_code == 200, first.text
    assert first.json()["model"] == "alpha"
    assert stack.pool_of(first.headers["x-kvroute-worker"]) == "alpha"
    wait_indexed(stack, "alpha", PROMPT)
    again = complete(stack, "alpha")
    assert again.headers["x-kvroute-worker"] == first.headers["x-kvroute-worker"]
    assert matched_blocks(again) > 0
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0

    other = complete(stack, "beta")  # the same text: alpha's entries are not beta's
    assert other.status_code == 200, other.text
    assert other.json()["model"] == "beta"
    assert stack.pool_of(other.headers["x-kvroute-worker"]) == "beta"
    assert matched_blocks(other) == 0
    assert other.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    wait_indexed(stack, "beta", PROMPT)
    beta_again = complete(stack, "beta")
    assert beta_again.headers["x-kvroute-worker"] == other.headers["x-kvroute-worker"]
    # beta's blocks are 32 tokens: it matches half as many blocks as alpha over the same prompt
    assert 0 < matched_blocks(beta_again) < matched_blocks(again)


def test_the_model_picks_the_pool_or_is_refused(stack: PoolsStack) -> None:
    unknown = complete(stack, "x" * 100)
    assert unknown.status_code == 404
    error = unknown.json()["error"]
    assert error["param"] == "model" and "x" * 30 in error["message"] and "x" * 41 not in error["message"]
    missing = complete(stack, None)
    assert missing.status_code == 400
    assert missing.json()["error"]["param"] == "model" and "alpha, beta" in missing.json()["error"]["message"]
    tokens = httpx.post(f"{stack.http_url}/tokenize", json={"model": "beta", "prompt": "hi"}, headers=AUTH)
    assert tokens.status_code == 200 and tokens.json()["count"] > 0


def test_grpc_picks_the_pool_by_model(stack: PoolsStack) -> None:
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = gateway_pb2_grpc.GatewayStub(channel)
        metadata = (("authorization", f"Bearer {KEY}"),)
        request = gateway_pb2.GatewayGenerateRequest(model="beta", prompt="hello there")
        request.sampling.max_tokens = 2
        replies = list(stub.Generate(request, metadata=metadata, timeout=10))
        assert stack.pool_of(replies[0].route.worker_id) == "beta"
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(gateway_pb2.GatewayGenerateRequest(model="gamma", prompt="hi"), metadata=metadata))
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_tenants_concurrency_spans_the_pools(stack: PoolsStack) -> None:
    body = {"model": "alpha", "prompt": "hold", "max_tokens": 200, "stream": True}
    headers = {"authorization": f"Bearer {SMALL_KEY}"}
    with httpx.stream("POST", f"{stack.http_url}/v1/completions", json=body, headers=headers, timeout=30) as held:
        assert held.status_code == 200
        refused = complete(stack, "beta", "other", key=SMALL_KEY)
        assert refused.status_code == 429, refused.text


def _routing_config(stack: PoolsStack, beta_epsilon: float) -> str:
    pools = [
        {
            "model": "sim",
            "served_model_name": [name, f"{name}-latest"] if name == "beta" else name,
            "workers": [f"127.0.0.1:{port}" for port, pool in stack.worker_pool.items() if pool == name],
            "block_size": block_size,
            **({"options": {"epsilon": beta_epsilon}} if name == "beta" else {}),
        }
        for name, block_size in BLOCK_SIZES.items()
    ]
    return json.dumps({"epsilon": 0.5, "pools": pools})


def _matched_when_indexed(url: str, model: str, prompt: str) -> httpx.Response:
    """The same request again until the gateway's index for `model` has the first one's blocks (≤ 10 s)."""
    deadline = time.monotonic() + 10
    while True:
        reply = httpx.post(
            f"{url}/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 2}, headers=AUTH, timeout=30
        )
        assert reply.status_code == 200, reply.text
        if matched_blocks(reply) > 0 or time.monotonic() > deadline:
            return reply
        time.sleep(0.1)


def _samples(url: str, name: str) -> dict[str, float]:
    """model_name label -> value of the metric `name` (its _count for a histogram) on the metrics port."""
    text = httpx.get(url).text
    return {
        sample.labels["model_name"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    }


@pytest.mark.slow
def test_a_gateway_process_serves_the_pools_of_its_routing_config(stack: PoolsStack, tmp_path: Path) -> None:
    config, keys, log = tmp_path / "routing.json", tmp_path / "keys.json", tmp_path / "gateway.log"
    config.write_text(_routing_config(stack, beta_epsilon=0.5))
    keys.write_text(json.dumps([{"tenant": "t", "key_sha256": key_sha256(KEY)}]))
    http_port, metrics_port = free_port(), free_port()
    argv = [
        "gateway", "--host", "127.0.0.1", "--http-port", str(http_port), "--grpc-port", "0", "--metrics-port",
        str(metrics_port), "--routing-config", str(config), "--api-keys-file", str(keys), "--allow-derived-salt",
    ]  # fmt: skip
    process = _spawn(argv, log)
    url, metrics_url = f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{metrics_port}/metrics"
    try:
        _wait(lambda: httpx.get(f"{url}/ready").json().get("workers") == 4, "the gateway's four workers", process, log)
        assert "serving alpha (policy kv_aware), beta (policy kv_aware)" in log.read_text()
        listed = httpx.get(f"{url}/v1/models", headers=AUTH).json()
        assert [card["id"] for card in listed["data"]] == ["alpha", "beta", "beta-latest"]

        prompt = "the process test's own prompt, long enough for several blocks of both sizes " * 6
        alpha = _matched_when_indexed(url, "alpha", prompt)
        beta = _matched_when_indexed(url, "beta-latest", prompt)  # an alias: beta's pool, answered as beta
        assert beta.json()["model"] == "beta"
        assert stack.pool_of(alpha.headers["x-kvroute-worker"]) == "alpha"
        assert stack.pool_of(beta.headers["x-kvroute-worker"]) == "beta"
        # each on its own index and block size: beta's 32-token blocks are half as many over the same prompt
        assert 0 < matched_blocks(beta) < matched_blocks(alpha), (alpha.headers, beta.headers)
        assert beta.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        unknown = httpx.post(f"{url}/v1/completions", json={"model": "gamma", "prompt": "hi"}, headers=AUTH)
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"

        ttft = _samples(metrics_url, "kvroute:gateway_time_to_first_token_seconds_count")
        assert set(ttft) == {"alpha", "beta"} and all(count >= 2 for count in ttft.values()), ttft
        assert set(_samples(metrics_url, "kvroute:gateway_requests_in_flight")) == {"alpha", "beta"}

        config.write_text(_routing_config(stack, beta_epsilon=0.25))
        process.send_signal(signal.SIGHUP)
        _wait(lambda: "for beta: {'epsilon': '0.5 -> 0.25'}" in log.read_text(), "the reload", process, log, 10)
        assert f"routing config {config} unchanged for alpha" in log.read_text()
        config.write_text(json.dumps({"pools": [{"model": "sim", "workers": []}]}))  # a bad file keeps the pools
        process.send_signal(signal.SIGHUP)
        _wait(lambda: "kept the routing config in force" in log.read_text(), "the refused reload", process, log, 10)
        assert _matched_when_indexed(url, "beta", prompt).status_code == 200
    finally:
        process.terminate()
        assert process.wait(15) == 0, log.read_text()[-2000:]


def test_the_routing_configs_pools_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from launch.cli import main

    config = tmp_path / "routing.json"
    bad = [
        ({"pools": []}, "pools must be a non-empty list"),
        ({"pools": [{"workers": ["127.0.0.1:1"]}]}, "pools[0]: model"),
        ({"pools": [{"model": "sim"}]}, "pools[0]: workers must name the pool's workers"),
        ({"pools": [{"model": "sim", "served_model_name": [], "workers": ["127.0.0.1:1"]}]}, "a list of names"),
        ({"pools": [{"model": "sim", "served_model_name": n, "workers": [f"127.0.0.1:{i}"]} for i, n in
                    enumerate((["a", "b"], "b"), 1)]}, "two pools serve the model 'b'"),
        ({"pools": [{"model": "sim", "workers": ["127.0.0.1:1"], "colour": 1}]}, "unknown key 'colour'"),
        ({"pools": [{"model": "sim", "workers": ["127.0.0.1:1"], "block_size": 0}]}, "block_size must be"),
        ({"pools": [{"model": "sim", "workers": ["127.0.0.1:1"], "policy": "fastest"}]}, "unknown routing policy"),
        ({"pools": [{"model": "sim", "workers": ["127.0.0.1:1"]}, {"model": "sim", "workers": ["127.0.0.1:2"]}]},
         "two pools serve the model 'sim'"),
        ({"pools": [{"model": "sim", "served_model_name": n, "workers": ["127.0.0.1:1"]} for n in "ab"]},
         "worker kvroute://127.0.0.1:1 and kvroute://127.0.0.1:1 are one worker (both reach 127.0.0.1:1), in pool 1 "
         "and pool 2"),
        ({"pools": [{"model": "sim", "served_model_name": n, "workers": [w]} for n, w in
                    (("a", "127.0.0.1:1"), ("b", "vllm://localhost:1"))]},
         "worker kvroute://127.0.0.1:1 and vllm://localhost:1 are one worker (both reach 127.0.0.1:1), in pool 1"),
        ({"pools": [{"model": "sim", "workers": ["127.0.0.1:1", "localhost:1"]}]},
         "kvroute://127.0.0.1:1 and kvroute://localhost:1 are one worker (both reach 127.0.0.1:1), twice in one pool"),
        ({"workers": ["127.0.0.1:1"], "pools": [{"model": "sim", "workers": ["127.0.0.1:2"]}]},
         "each pool names its workers"),
    ]  # fmt: skip
    for options, message in bad:
        config.write_text(json.dumps(options))
        assert main(["gateway", "--model", "sim", "--routing-config", str(config)]) == 2, options
        assert message in capsys.readouterr().err, options


# -- the endpoint picker over the same pools: the model picks the pool whose workers Envoy is sent to ----------


def _body(model: str | None) -> bytes:
    body = {"messages": [{"role": "user", "content": "which pool am I in? " * 20}], "max_tokens": 4}
    if model is not None:
        body["model"] = model
    return json.dumps(body).encode()


@pytest.fixture(scope="module")
def endpoints(stack: PoolsStack) -> dict[str, set[str]]:
    """pool -> the (made-up, never dialled) HTTP endpoints of its workers."""
    by_pool: dict[str, set[str]] = {}
    for i, member in enumerate(sorted(stack.pools.members(), key=lambda m: m.worker_id)):
        by_pool.setdefault(stack.pool_of(member.worker_id), set()).add(f"10.0.1.{i + 1}:8000")
    return by_pool


@pytest.fixture(scope="module")
def epp(stack: PoolsStack, endpoints: dict[str, set[str]]) -> Iterator[EndpointPicker]:
    members = sorted(stack.pools.members(), key=lambda m: m.worker_id)
    mapping = EndpointMap({m.worker_id: f"10.0.1.{i + 1}:8000" for i, m in enumerate(members)})
    with serving_picker(stack, stack.pools, mapping) as running:
        yield running


@pytest.fixture()
def channel(epp: EndpointPicker) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(f"127.0.0.1:{epp.port}") as opened:
        yield opened


def _decide(channel: grpc.Channel, model: str | None, key: str = KEY) -> list[str] | int:
    """The endpoints the picker sends Envoy to, or the status of its ImmediateResponse."""
    exchange = Exchange(channel).send(_request_headers(key=key), *_bodies(_body(model), 1))
    (reply,) = exchange.take(1)
    exchange.close()
    if reply.HasField("immediate_response"):
        return reply.immediate_response.status.code
    return _destination(reply, reply.request_headers.response)


def test_the_model_picks_the_pools_endpoints(channel: grpc.Channel, endpoints: dict[str, set[str]]) -> None:
    for model in ("alpha", "beta"):
        chosen = _decide(channel, model)
        assert isinstance(chosen, list) and set(chosen) == endpoints[model], (model, chosen)


def test_a_model_no_pool_serves_goes_on_to_a_model_server(
    channel: grpc.Channel, endpoints: dict[str, set[str]]
) -> None:
    chosen = _decide(channel, "gamma")
    assert isinstance(chosen, list) and set(chosen) == endpoints["alpha"] | endpoints["beta"], chosen
    assert _decide(channel, "gamma", key="sk-wrong") == 401, "passed on only once the key is checked"


def test_no_model_among_several_is_a_400(channel: grpc.Channel) -> None:
    assert _decide(channel, None) == 400


def test_a_pool_without_workers_leaves_the_other_serving(stack: PoolsStack) -> None:
    for worker in [w for w in stack.workers if stack.worker_pool[w.port] == "beta"]:
        stack.call(worker.stop(drain_timeout=0))
    beta = stack.pools.pool("beta")
    deadline = time.monotonic() + 10
    while beta.routable_workers():
        assert time.monotonic() < deadline, "beta's stopped workers never left its fleet"
        time.sleep(0.05)
    assert complete(stack, "beta").status_code == 503
    assert complete(stack, "alpha").status_code == 200
    ready = httpx.get(f"{stack.http_url}/ready")
    assert ready.status_code == 200 and ready.json()["workers"] == 2


def test_the_picker_reads_the_same_pools(tmp_path: Path) -> None:
    from gateway.cli_epp import build_picker
    from kvroute.errors import UserError
    from launch.cli import build_parser

    config = tmp_path / "routing.json"
    pools = [
        {"model": "sim", "served_model_name": "alpha", "workers": ["127.0.0.1:1"]},
        {"model": "sim", "served_model_name": "beta", "workers": ["127.0.0.1:2"], "block_size": 32, "policy": "prefix"},
    ]
    config.write_text(json.dumps({"pools": pools}))
    argv = ["epp", "--routing-config", str(config), "--target-port", "8000"]
    picker = build_picker(build_parser(argv).parse_args(argv))
    built = [(p.served_model_name, p.block_size, p.policy.name) for p in picker.pools.pools()]
    assert built == [("alpha", 16, "kv_aware"), ("beta", 32, "prefix")]
    with pytest.raises(UserError, match="say where Envoy dials the kvroute workers"):
        argv = ["epp", "--routing-config", str(config)]
        build_picker(build_parser(argv).parse_args(argv))
