"""/v1/responses' stores: the memory store's bounds, the Redis store's (a real redis-server: a tenant's flood
stays within its bytes, measured in Redis itself), two gateways sharing one Redis continuing each other's
conversations on the workers' cache, and Redis down (a continued turn gets a clear 503, a new one is served).
"""

from __future__ import annotations

import asyncio
import os
import tracemalloc
from collections.abc import Iterator

import openai
import pytest
from gateway_stack import KEY, SERVED_MODEL, GatewayStack, StackOptions

from gateway.request import Tenant
from gateway.responses.store import (
    MemoryResponseStore,
    RedisResponseStore,
    ResponseTooLarge,
    StoreLimits,
    StoreUnavailable,
    tenant_scope,
)
from kvroute.fleet_keys import redis_client
from launch.redis_server import RedisServer


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_scopes_are_opaque_and_per_tenant() -> None:
    acme, other = Tenant("acme", "salt-a"), Tenant("other", "salt-b")
    assert tenant_scope(acme) == tenant_scope(Tenant("acme", "salt-a"))
    assert tenant_scope(acme) != tenant_scope(other) and tenant_scope(acme) != tenant_scope(Tenant("acme", "x"))
    assert "acme" not in tenant_scope(acme)


def test_memory_store_bounds() -> None:
    clock = Clock()
    limits = StoreLimits(ttl_s=10, max_response_bytes=100, max_tenant_bytes=300, max_tenant_responses=5,
                         max_total_bytes=500)  # fmt: skip
    store = MemoryResponseStore(limits, clock=clock)

    async def run() -> None:
        with pytest.raises(ResponseTooLarge):
            await store.put("a", "big", b"x" * 101)
        for i in range(10):
            await store.put("a", f"r{i}", b"x" * 100)
        assert await store.usage("a") == (3, 300)  # the oldest went to make room
        assert await store.get("a", "r6") is None and await store.get("a", "r9") == b"x" * 100
        assert await store.get("b", "r9") is None  # another scope sees nothing
        for i in range(6):
            await store.put("b", f"s{i}", b"y" * 10)
        assert (await store.usage("b"))[0] == 5  # the count bound
        for i in range(3):
            await store.put("c", f"t{i}", b"z" * 100)
        total = sum([(await store.usage(s))[1] for s in "abc"])
        assert total <= 500  # the heaviest tenant gave way
        assert await store.delete("a", "r9") and await store.get("a", "r9") is None
        assert not await store.delete("a", "r9") and await store.usage("a") == (1, 100)
        clock.now = 11
        assert await store.get("a", "r8") is None  # expired

    asyncio.run(run())


def test_memory_store_flood_stays_within_the_tenant_bound() -> None:
    """The process's own memory, measured by tracemalloc, not the store's books."""
    limits = StoreLimits(max_response_bytes=64 * 1024, max_tenant_bytes=1024 * 1024)
    store = MemoryResponseStore(limits)

    async def flood() -> None:
        for i in range(400):  # 12.8 MB offered to a tenant allowed 1 MiB
            await store.put("flood", f"resp_{i:048x}", os.urandom(32 * 1024))

    tracemalloc.start()
    try:
        asyncio.run(flood())
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 1.5 * limits.max_tenant_bytes, held
    assert asyncio.run(store.usage("flood"))[1] <= limits.max_tenant_bytes


def test_redis_store_flood_stays_within_the_tenant_bound(redis_server: RedisServer) -> None:
    limits = StoreLimits(max_response_bytes=64 * 1024, max_tenant_bytes=1024 * 1024, max_tenant_responses=10_000)

    async def run() -> None:
        client = redis_client(redis_server.url)
        store = RedisResponseStore(client, limits)
        record = b"r" * 32 * 1024
        before = int((await client.info("memory"))["used_memory"])
        for i in range(200):  # 6.4 MB offered to a tenant allowed 1 MiB
            await store.put("flood", f"resp_{i}", record)
        count, size = await store.usage("flood")
        assert size <= limits.max_tenant_bytes and count == limits.max_tenant_bytes // len(record)
        assert await store.get("flood", "resp_199") == record and await store.get("flood", "resp_0") is None
        grown = int((await client.info("memory"))["used_memory"]) - before
        assert grown < 2 * limits.max_tenant_bytes, grown  # Redis itself holds about the bound, not the flood
        keys = [key async for key in client.scan_iter(match="kvroute:resp:{flood}:r:*")]
        assert len(keys) == count
        await store.put("other", "resp_1", b"o")
        assert await store.get("other", "resp_199") is None and await store.get("flood", "resp_1") is None
        assert await store.delete("flood", "resp_199") and not await store.delete("flood", "resp_199")
        assert (await store.usage("flood"))[1] == size - len(record)
        redis_server.stop()
        with pytest.raises(StoreUnavailable):
            await store.get("flood", "resp_198")
        await store.close()

    asyncio.run(run())


@pytest.fixture(scope="module")
def shared_redis() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def two_gateways(shared_redis: RedisServer) -> Iterator[GatewayStack]:
    options = StackOptions(model="tiny", workers=2, num_kv_blocks=256, max_model_len=1024, gateways=2,
                           redis_url=shared_redis.url)  # fmt: skip
    with GatewayStack(options) as stack:
        yield stack


def test_two_gateways_continue_each_others_conversations(two_gateways: GatewayStack) -> None:
    clients = [openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0) for url in two_gateways.http_urls]
    previous = None
    usages = []
    for turn in range(4):
        raw = clients[turn % 2].responses.with_raw_response.create(
            model=SERVED_MODEL, input=f"Turn {turn}, go on.", max_output_tokens=20, temperature=0,
            previous_response_id=previous,
        )  # fmt: skip
        response = raw.parse()
        usages.append((response.usage, raw.headers["x-kvroute-route"]))
        previous = response.id
    for (before, _), (after, route) in zip(usages, usages[1:], strict=False):
        computed = before.input_tokens + before.output_tokens - 1
        assert after.input_tokens_details.cached_tokens >= 0.95 * (computed // 16 * 16), (before, after)
        assert "reason=conversation" in route
    assert clients[0].responses.retrieve(previous).id == previous


def test_redis_down(two_gateways: GatewayStack, shared_redis: RedisServer) -> None:
    client = openai.OpenAI(base_url=f"{two_gateways.http_url}/v1", api_key=KEY, max_retries=0)
    stored = client.responses.create(model=SERVED_MODEL, input="Before.", max_output_tokens=2)
    shared_redis.stop()
    try:
        with pytest.raises(openai.InternalServerError) as refused:
            client.responses.create(model=SERVED_MODEL, input="go on", previous_response_id=stored.id)
        assert refused.value.status_code == 503 and "response store" in refused.value.body["message"]
        with pytest.raises(openai.InternalServerError):
            client.responses.retrieve(stored.id)
        fresh = client.responses.create(model=SERVED_MODEL, input="A new turn.", max_output_tokens=2)
        assert fresh.status in ("completed", "incomplete")  # served, not stored
    finally:
        shared_redis.start()
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(fresh.id)
