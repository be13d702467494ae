"""Two pools behind one gateway (gateway.pools): each model routed on its own fleet, index and hashes.

A real gateway in process (tests/gateway_stack.py's loop and servers) with two pools of `sim` workers: pool
"alpha" at block size 16, pool "beta" at block size 32, so the same text hashes apart in the two.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import grpc
import httpx
import pytest

from gateway.auth import Authenticator, cache_salt
from gateway.cli_gateway import HttpServer
from gateway.embedded_fleet import EmbeddedFleetState
from gateway.grpc_server import start_grpc_server
from gateway.http_server import build_app
from gateway.limits import TenantConcurrency
from gateway.metrics import GatewayMetrics
from gateway.pools import Pools
from gateway.request_path import RequestPath, fleet_identity
from gateway.router import make_policy
from kvroute.hashing import block_hashes
from kvroute.model_source import resolve_model
from kvroute.tokenizer import Tokenizer
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
        self.grpc = await start_grpc_server(self.pools, "127.0.0.1", 0, health_interval_s=0.1)

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
