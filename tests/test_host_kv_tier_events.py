"""The host KV tier's KV events (medium "CPU"): in the KV cache manager's log in an order that never shows a block
lost while the worker still holds it, with the parent and tokens vLLM's format needs; snapshots over both tiers; and
the gateway reading them three ways: a kvroute worker's gRPC events and snapshot pages (EmbeddedFleetState), its
vLLM-format ZMQ events (EngineEventSubscriber, the `vllm://` path), and vLLM's own decoder. Every gateway index ends
equal to the worker's two tiers, a host-only block scored at its tier's weight."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import grpc
import zmq
import zmq.asyncio

from gateway.fleet.embedded_fleet import EmbeddedFleetState
from gateway.fleet.engine_events import EngineEventSource, EngineEventSubscriber
from gateway.request_path import fleet_identity
from gateway.routing.kv_index import DEFAULT_MEDIUM_WEIGHTS, KVIndex
from kvroute.kv_events import DEVICE, HOST
from kvroute.sampling import SamplingParams
from proto import worker_pb2, worker_pb2_grpc
from tests.test_engine_events import BLOCK, book_for, caught_up, generate, run, stop_worker, until
from tests.test_engine_kv_events_reference import PRODUCER, ROOT, engine_env
from tests.test_host_kv_tier import BS, ValueCopier, compute, hashes
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.host_kv_tier import HostKVTier
from worker.kv_cache_manager import KVCacheManager
from worker.kv_event_publisher import KVEventPublisher, KVEventsConfig
from worker.service import start_worker_server

CPU_WEIGHT = DEFAULT_MEDIUM_WEIGHTS[HOST]


def tiers_of(mgr: KVCacheManager) -> tuple[set, set]:
    """What the worker holds: its device pool's cached hashes and its host tier's."""
    _, device, host = mgr.snapshot()
    return set(device), set(host)


def test_the_managers_log_saves_before_it_evicts_and_applies_to_an_index_equal_to_both_tiers() -> None:
    copier = ValueCopier()
    mgr = KVCacheManager(4, BS, host_tier=HostKVTier(4), copier=copier)
    a, b, c = list(range(100, 113)), list(range(200, 216)), list(range(300, 316))
    compute(mgr, copier, "a", a)  # 3 full blocks cached
    compute(mgr, copier, "b", b)  # a's blocks go to the host as b reuses them
    events = mgr.drain_events()
    first_host = next(i for i, e in enumerate(events) if e.medium == HOST)
    first_removal = next(i for i, e in enumerate(events) if e.kind == "removed")
    assert first_host < first_removal, "the host copy is announced before the device's loss"
    host_stores = [e for e in events if e.medium == HOST and e.kind == "stored"]
    by_hash = {e.block_hashes[0]: e for e in host_stores}
    a_hashes = hashes(a)
    assert set(by_hash) == set(a_hashes)
    for i, block_hash in enumerate(a_hashes):  # each names its parent and its own tokens
        assert by_hash[block_hash].token_ids == tuple(a[i * BS : (i + 1) * BS])
        assert by_hash[block_hash].parent_hash == (a_hashes[i - 1] if i else None)
    compute(mgr, copier, "c", c)  # b's 4 blocks to the host: the tier's LRU drops a's
    events += mgr.drain_events()
    assert any(e.kind == "removed" and e.medium == HOST for e in events)

    index = KVIndex(("w",))
    assert index.apply("w", events)
    device, host = tiers_of(mgr)
    assert host - device and set(index.held("w")) == device | host
    assert set(index.host_only("w")) == host - device
    got_device, got_offloaded = index.tiers("w")
    assert set(got_device) == device and got_offloaded == {HOST: host}

    pages, start = [], 0  # the snapshot in pages of 3 slots: the device's 4 blocks, then the host's 4 slots
    while start is not None:
        seq, page, start, medium = mgr.snapshot_page(start, 3)
        pages.append((medium, page))
    assert [m for m, _ in pages] == [DEVICE, DEVICE, HOST, HOST]
    rebuilt = KVIndex(("w",))
    rebuilt.resync(
        "w", seq, [h for m, p in pages if m == DEVICE for h in p], {HOST: [h for m, p in pages if m == HOST for h in p]}
    )
    assert rebuilt.tiers("w")[1] == got_offloaded and set(rebuilt.tiers("w")[0]) == device
    b_hashes = hashes(b)
    assert rebuilt.match(b_hashes) == index.match(b_hashes) == [int(4 * CPU_WEIGHT)]
    assert mgr.reset_cache() and tiers_of(mgr) == (set(), set())
    assert index.apply("w", mgr.drain_events()) and not index.held("w")


def tier_engine() -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model="sim",
            block_size=BLOCK,
            num_kv_blocks=16,
            host_kv_blocks=24,
            max_model_len=256,
            sim_decode_ms_per_step=0.1,
            sim_prefill_us_per_token=1.0,
            sim_host_copy_us_per_block=0.5,  # below the 4 us a block of 4 tokens takes to recompute
        )  # fmt: skip
    )


def prompts(rounds: int, first: int = 0) -> list[list[int]]:
    """Distinct prompts of 8 full blocks: a pool of 16 evicts to the host tier, which then drops its oldest."""
    return [[1000 * (i + 1) + j for j in range(8 * BLOCK + 1)] for i in range(first, first + rounds * 3)]


async def churn(server, rounds: int = 2, first: int = 0) -> None:
    for prompt in prompts(rounds, first):
        await generate(server, prompt)


def test_a_gateway_reads_a_workers_host_tier_over_grpc_events_and_snapshot_pages() -> None:
    async def main() -> None:
        engine = await asyncio.get_running_loop().run_in_executor(None, tier_engine)
        engine.generate(prompts(2), SamplingParams(max_tokens=2))  # before serving: readers start from a snapshot
        server = await start_worker_server(engine, port=0)
        identity = fleet_identity(engine.model_id, engine.tokenizer, BLOCK)
        fleet = EmbeddedFleetState([f"127.0.0.1:{server.port}"], identity, poll_interval=0.02, max_snapshot_blocks=5)
        try:
            await fleet.start()  # it starts from the snapshot, in pages of 5 over both tiers
            member = fleet.members()[0].worker_id

            async def settled() -> bool:
                index = fleet.view().kv_index
                seq, *_ = await server.engine.call(lambda e: e.kv_manager.snapshot())
                return index.last_seq(member) == seq

            async def check() -> None:
                deadline = time.monotonic() + 10
                while not await settled() and time.monotonic() < deadline:
                    await asyncio.sleep(0.02)
                device, host = await server.engine.call(lambda e: tiers_of(e.kv_manager))
                index = fleet.view().kv_index
                assert host - device, "the churn left blocks on the host tier only"
                assert set(index.held(member)) == device | host
                assert set(index.host_only(member)) == host - device

            await check()
            assert fleet.counters.resyncs >= 1
            await churn(server, first=6)  # then events, host stores and drops among them
            await check()
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                info = await stub.GetInfo(worker_pb2.GetInfoRequest())
                assert (info.num_kv_blocks, info.num_host_kv_blocks) == (16, 24)
                page = await stub.GetKVEvents(worker_pb2.GetKVEventsRequest(after_seq=10**9, max_snapshot_blocks=16))
                page = await stub.GetKVEvents(worker_pb2.GetKVEventsRequest(snapshot_cursor=page.next_snapshot_cursor))
                assert page.snapshot_medium == HOST and page.snapshot_hashes
        finally:
            await fleet.stop()
            await server.stop(drain_timeout=0)

    run(main())


def test_a_workers_vllm_format_events_name_the_host_tier_and_vllms_decoder_reads_them() -> None:
    async def main() -> list[bytes]:
        engine = await asyncio.get_running_loop().run_in_executor(None, tier_engine)
        server = await start_worker_server(engine, port=0)
        config = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0", "bind": True, "topic": "kv@w"}
        config["replay_endpoint"] = "tcp://127.0.0.1:0"
        publisher = KVEventPublisher(server.engine, KVEventsConfig.from_json(json.dumps(config)), BLOCK)
        publisher.start()
        book = book_for(engine.model_id)
        source = EngineEventSource("w", publisher.endpoint, publisher.replay_endpoint, topic="kv@w")
        subscriber = EngineEventSubscriber(book, source, medium_weights=DEFAULT_MEDIUM_WEIGHTS)
        raw = zmq.asyncio.Context.instance().socket(zmq.SUB)
        raw.setsockopt(zmq.SUBSCRIBE, b"")
        raw.connect(publisher.endpoint)
        await subscriber.start()
        try:
            await asyncio.sleep(0.3)
            await churn(server, rounds=3)
            await caught_up(server, publisher)
            await until(lambda: subscriber.counters.batches == publisher.published, what="every batch")
            device, host = await server.engine.call(lambda e: tiers_of(e.kv_manager))
            assert host - device and subscriber.counters.dropped == {}
            assert set(book.fleet.kv_index.held("w")) == device | host
            assert subscriber.weights == {h: CPU_WEIGHT for h in host - device}
            payloads = []
            while await raw.poll(200):
                payloads.append((await raw.recv_multipart())[2])
            return payloads
        finally:
            raw.close(linger=0)
            await subscriber.stop()
            await stop_worker(server, publisher)

    payloads = run(main())
    env = engine_env("vllm")  # vLLM's own structs (skips where the wheel's sources are absent)
    result = subprocess.run(
        [sys.executable, str(PRODUCER), "vllm", "decode"], input="".join(p.hex() + "\n" for p in payloads),
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    events = [e for line in result.stdout.splitlines() for e in json.loads(line)["events"]]
    host_stores = [e for e in events if e["type"] == "BlockStored" and e["medium"] == HOST]
    host_drops = [e for e in events if e["type"] == "BlockRemoved" and e["medium"] == HOST]
    assert host_stores and host_drops
    assert all(len(e["block_hashes"]) == 1 and len(e["token_ids"]) == BLOCK for e in host_stores)
    assert all((e["parent_block_hash"] is None) == (e["token_ids"][0] % 1000 == 0) for e in host_stores)
    device_stores = {
        h for e in events if e["type"] == "BlockStored" and e["medium"] == DEVICE for h in e["block_hashes"]
    }
    assert {e["block_hashes"][0] for e in host_stores} <= device_stores  # the same blocks, now on the host
