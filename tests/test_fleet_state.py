"""Both fleet states over real `sim` workers (real gRPC servers, started in-process) and, for the Redis one,
a real redis-server with each worker's real reporter: membership (join, expiry, restart with a new
incarnation), hash parity, a late gateway, Redis stopped and restarted mid-run, and two gateways agreeing."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass

import grpc
import pytest

from gateway.fleet.embedded_fleet import EmbeddedFleetState
from gateway.fleet.fleet_state import BookkeepingFleetState, FleetBook, FleetIdentity
from gateway.fleet.redis_fleet import RedisFleetState
from gateway.routing.router import RouteRequest, make_policy
from kvroute.fleet_keys import FleetKeys, WorkerRecord, redis_client
from kvroute.hashing import block_hashes
from launch.fleet import free_port
from launch.redis_server import RedisSentinel
from proto import worker_pb2, worker_pb2_grpc
from worker.async_engine import MAX_CONSECUTIVE_STEP_FAILURES
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.reporter import WorkerReporter, reporter_for_server
from worker.service import WorkerServer, start_worker_server
from worker.sim_runner import SimRunner

BLOCK = 16
POLL = 0.05  # the gateways' poll interval in these tests
HEARTBEAT, TTL = 0.1, 0.6
KINDS = ("embedded", "redis")


@dataclass
class Worker:
    server: WorkerServer
    reporter: WorkerReporter | None
    channel: grpc.aio.Channel

    @property
    def worker_id(self) -> str:
        return self.server.worker_id

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    async def generate(self, prompt: list[int]) -> worker_pb2.Usage:
        stub = worker_pb2_grpc.WorkerStub(self.channel)
        request = worker_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=worker_pb2.SamplingParams(max_tokens=1))
        responses = [r async for r in stub.Generate(request)]
        return responses[-1].usage

    async def stop(self, deregister: bool = True) -> None:
        if self.reporter is not None:
            await self.reporter.stop(deregister=deregister)
        await self.channel.close()
        await self.server.stop(drain_timeout=0)


class LostDevice(SimRunner):
    """A sim runner whose every step fails, as on a lost GPU: the engine dies after a few steps."""

    def run(self, batch: object) -> object:
        raise RuntimeError("CUDA error: device lost")


async def start_worker(
    worker_id: str,
    redis_url: str | None,
    port: int = 0,
    block_size: int = BLOCK,
    snapshot_every: int = 10_000,
    lost_device: bool = False,
    host_kv_blocks: int = 0,
) -> Worker:
    config = EngineConfig(
        model="sim", num_kv_blocks=64, max_model_len=256, block_size=block_size, host_kv_blocks=host_kv_blocks
    )
    engine = LLMEngine(config)
    if lost_device:
        engine.runner = LostDevice(config)
    server = await start_worker_server(engine, port=port, worker_id=worker_id)
    reporter = None
    if redis_url is not None:
        reporter = reporter_for_server(
            server, redis_url, heartbeat_interval=HEARTBEAT, heartbeat_ttl=TTL, publish_interval=0.02,
            snapshot_every=snapshot_every,
        )  # fmt: skip
        await reporter.start()
    return Worker(server, reporter, grpc.aio.insecure_channel(f"127.0.0.1:{server.port}"))


def run(main: Callable[[], Coroutine[None, None, None]], timeout: float = 30.0) -> None:
    """Run a test's coroutine; a hang fails after `timeout` seconds with the stack of the await that hung."""
    asyncio.run(asyncio.wait_for(main(), timeout))


def identity_of(worker: Worker) -> FleetIdentity:
    info = worker.server.servicer.info
    return FleetIdentity(info.model_id, info.block_size, info.hash_fingerprint, info.tokenizer_fingerprint)


def fleet_state(kind: str, addresses: list[str], identity: FleetIdentity, redis_url: str) -> BookkeepingFleetState:
    if kind == "embedded":
        return EmbeddedFleetState(addresses, identity, poll_interval=POLL, unreachable_after=0.3)
    return RedisFleetState(redis_url, identity, poll_interval=POLL)


def hashes(prompt: list[int], model_id: str = "sim-v1") -> list[bytes]:
    return block_hashes(prompt, model_id=model_id, block_size=BLOCK)


def prompt(seed: int, blocks: int = 6) -> list[int]:
    return [(seed * 7919 + i) % 1000 + 1 for i in range(blocks * BLOCK + 3)]


async def eventually(condition: Callable[[], bool], timeout: float = 3.0) -> float:
    """Seconds until `condition()` held; fails the test after `timeout`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def matched(fleet: BookkeepingFleetState, worker_id: str, block_hashes_: list[bytes]) -> int:
    view = fleet.view()
    if worker_id not in view.index_of:
        return -1
    return view.kv_index.match(block_hashes_)[view.index_of[worker_id]]


# -- the books, without servers ----------------------------------------------------------------------------


def test_load_combines_reports_with_own_requests_since_and_never_falls_below_own_in_flight():
    book = FleetBook(FleetIdentity("m", BLOCK, "h", "t"))
    book.admit("w", "127.0.0.1:1", 7, "m", BLOCK, 256, "h", "t")
    load = book.fleet.loads["w"]
    book.on_dispatch("w")
    book.on_dispatch("w")
    assert load.in_flight == 2  # no report yet: own count only
    book.report_load("w", 7, running=3, waiting=1, kv_usage=0.25)  # other gateways' requests included
    assert (load.in_flight, load.queued, load.kv_usage) == (4, 1, 0.25)
    book.on_dispatch("w")
    assert load.in_flight == 5  # routed since the report: not in it yet
    book.on_finish("w")
    book.on_finish("w")
    assert load.in_flight == 3
    book.report_load("w", 7, running=0, waiting=0, kv_usage=0.0)  # a stale report: own in-flight is the floor
    assert load.in_flight == 1
    book.report_load("w", 8, running=9, waiting=9, kv_usage=1.0)  # another incarnation's report is ignored
    assert load.in_flight == 1
    assert book.fleet.total_in_flight == 1


def test_registry_records_and_urls_refuse_bad_input_naming_the_field():
    record = WorkerRecord("w-1", "h:1", 3, "m", BLOCK, 256, "a", "b", 5.0, "serving", 1, 0, 0, 0, 10, 0.0, 0)
    raw = {k.encode(): v.encode() for k, v in record.to_fields().items()}
    assert WorkerRecord.from_fields(raw) == record
    with pytest.raises(ValueError, match="missing field 'incarnation'"):
        WorkerRecord.from_fields({k: v for k, v in raw.items() if k != b"incarnation"})
    with pytest.raises(ValueError, match="'num_running' is not an integer"):
        WorkerRecord.from_fields(raw | {b"num_running": b"many"})
    with pytest.raises(ValueError, match="engine_state"):
        WorkerRecord.from_fields(raw | {b"engine_state": b"sleepy"})
    with pytest.raises(ValueError, match="worker_id"):
        FleetKeys().info("a}{b")
    for url in ("http://redis:6379", "redis+sentinel://host/", "redis+sentinel://host:x/svc"):
        with pytest.raises(ValueError, match="--redis"):
            redis_client(url)


# -- membership --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_join_kv_entries_and_leave_within_the_stated_time(kind, redis_server):
    async def main() -> None:
        redis_url = redis_server.url if kind == "redis" else None
        workers = [await start_worker(f"w{i}", redis_url) for i in range(2)]
        later_port = free_port()  # a worker that is not up yet (the embedded state is told its address)
        addresses = [w.address for w in workers] + [f"127.0.0.1:{later_port}"]
        fleet = fleet_state(kind, addresses, identity_of(workers[0]), redis_server.url)
        await fleet.start()
        try:
            await eventually(lambda: fleet.view().replicas == ("w0", "w1"))
            assert {m.worker_id: m.address for m in fleet.members()} == {w.worker_id: w.address for w in workers}
            p = prompt(1)
            usage = await workers[0].generate(p)
            assert usage.cached_tokens == 0
            seen = await eventually(lambda: matched(fleet, "w0", hashes(p)) == 6, timeout=1.0)
            assert matched(fleet, "w1", hashes(p)) == 0
            assert seen < 0.5  # a cached prefix is routable within a few polls

            joined = await start_worker("w2", redis_url, port=later_port)
            await eventually(lambda: "w2" in fleet.view().replicas, timeout=2.0)  # channel backoff <= 1 s
            await joined.stop()  # drains (and deregisters): out within a poll or two
            await eventually(lambda: "w2" not in fleet.view().replicas, timeout=1.5)

            killed = workers[1]
            await killed.stop(deregister=False)  # as a killed process: no goodbye, its heartbeat expires
            left = await eventually(lambda: "w1" not in fleet.view().replicas, timeout=3.0)
            limit = 0.3 + 0.5 + POLL if kind == "embedded" else TTL + HEARTBEAT + POLL  # the stated bounds
            assert left < limit + 0.3
            assert matched(fleet, "w0", hashes(p)) == 6  # the others' entries are untouched
        finally:
            await fleet.stop()
            await workers[0].stop()

    run(main)


@pytest.mark.parametrize("kind", KINDS)
def test_answering_is_the_workers_own_answers_as_the_fleet_state_sees_them(kind, redis_server):
    async def main() -> None:
        redis_url = redis_server.url if kind == "redis" else None
        workers = [await start_worker(f"w{i}", redis_url) for i in range(2)]
        fleet = fleet_state(kind, [w.address for w in workers], identity_of(workers[0]), redis_server.url)
        await fleet.start()
        try:
            await eventually(lambda: fleet.view().replicas == ("w0", "w1"))
            await asyncio.sleep(0.3)  # a few polls and heartbeats: both keep answering
            assert fleet.answering("w0") and fleet.answering("w1") and not fleet.answering("nobody")
            silent = workers[1]
            if kind == "redis":
                await silent.reporter.stop(deregister=False)  # its heartbeat stops (its server still serves)
                await eventually(lambda: not fleet.answering("w1"), timeout=TTL)  # half the TTL
                assert fleet.member("w1") is not None  # not answering, before its TTL makes it leave
            else:
                await silent.server.server.stop(grace=None)
                await eventually(lambda: not fleet.answering("w1"), timeout=3.0)
            assert fleet.answering("w0")
        finally:
            await fleet.stop()
            for worker in workers:
                await worker.stop()

    run(main)


@pytest.mark.parametrize("kind", KINDS)
def test_a_restarted_worker_gets_no_routing_on_its_old_entries(kind, redis_server):
    async def main() -> None:
        redis_url = redis_server.url if kind == "redis" else None
        worker = await start_worker("w0", redis_url)
        other = await start_worker("w1", redis_url)
        port = worker.server.port
        fleet = fleet_state(kind, [worker.address, other.address], identity_of(worker), redis_server.url)
        await fleet.start()
        try:
            old = prompt(1)
            await worker.generate(old)
            await eventually(lambda: matched(fleet, "w0", hashes(old)) == 6)
            first = fleet.member("w0")
            await worker.stop(deregister=False)
            worker = await start_worker("w0", redis_url, port=port)  # same id and address, new incarnation
            for seed in range(2, 6):  # more events than before: new sequence numbers pass the old ones
                await worker.generate(prompt(seed))
            await eventually(lambda: fleet.member("w0") is not None and fleet.member("w0") != first)
            assert fleet.member("w0").incarnation != first.incarnation
            await eventually(lambda: matched(fleet, "w0", hashes(prompt(5))) == 6)
            assert matched(fleet, "w0", hashes(old)) == 0
            assert fleet.counters.restarts + fleet.counters.leaves >= 1
            decision = make_policy("kv_aware").pick(RouteRequest("r", hashes(old), len(old)), fleet.view())
            assert decision.matched_blocks == 0
        finally:
            await fleet.stop()
            await worker.stop()
            await other.stop()

    run(main)


@pytest.mark.parametrize("kind", KINDS)
def test_a_worker_whose_engine_died_leaves_at_the_next_poll(kind, redis_server):
    async def main() -> None:
        redis_url = redis_server.url if kind == "redis" else None
        dying = await start_worker("dying", redis_url, lost_device=True)
        healthy = await start_worker("healthy", redis_url)
        fleet = fleet_state(kind, [dying.address, healthy.address], identity_of(healthy), redis_server.url)
        await fleet.start()
        try:
            await eventually(lambda: fleet.view().replicas == ("dying", "healthy"))
            for seed in range(MAX_CONSECUTIVE_STEP_FAILURES):
                with pytest.raises(grpc.aio.AioRpcError):
                    await dying.generate(prompt(seed))
            await asyncio.wait_for(dying.server.engine.wait_dead(), 5)
            left = await eventually(lambda: fleet.view().replicas == ("healthy",), timeout=1.0)
            assert left < 0.5  # the process still answers: it is the reported state that takes it out
        finally:
            await fleet.stop()
            await dying.stop()
            await healthy.stop()

    run(main)


# -- hash parity -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_parity_mismatch_is_counted_and_routed_by_load_only(kind, redis_server, caplog):
    async def main() -> None:
        redis_url = redis_server.url if kind == "redis" else None
        good = await start_worker("good", redis_url)
        odd = await start_worker("odd", redis_url, block_size=8)  # another block size: other hashes
        fleet = fleet_state(kind, [good.address, odd.address], identity_of(good), redis_server.url)
        await fleet.start()
        try:
            await eventually(lambda: fleet.view().replicas == ("good", "odd"))
            assert not fleet.member("odd").parity_ok and fleet.member("good").parity_ok
            assert fleet.counters.parity_mismatches == {"odd": 1}
            p = prompt(3)
            await odd.generate(p)
            await good.generate(prompt(4))
            await eventually(lambda: matched(fleet, "good", hashes(prompt(4))) == 6)
            await asyncio.sleep(5 * POLL)
            assert matched(fleet, "odd", hashes(p)) == 0 and fleet.view().kv_index.num_blocks("odd") == 0
            policy = make_policy("least_loaded")
            fleet.on_dispatch("good")
            fleet.on_dispatch("good")
            assert policy.pick(RouteRequest("r", hashes(p), len(p)), fleet.view()).replica == "odd"  # by load
        finally:
            await fleet.stop()
            await good.stop()
            await odd.stop()

    with caplog.at_level("WARNING", logger="gateway.fleet.fleet_state"):
        run(main)
    lines = [r.getMessage() for r in caplog.records if "hash parity" in r.getMessage()]
    assert len(lines) == 1 and "odd" in lines[0] and "block size 8" in lines[0]


# -- Redis: late gateways, outages, agreement ----------------------------------------------------------------


def test_an_embedded_gateway_that_lost_events_rebuilds_the_worker_from_seq_0(caplog):
    """A gap in a worker's events (here: the index marked stale, as a gap leaves it): the next poll rebuilds the
    worker's cached set from seq 0 apart from the book, then swaps it in; the book then holds the worker's pool."""

    async def main() -> None:
        worker = await start_worker("w0", None)
        state = EmbeddedFleetState([worker.address], identity_of(worker), poll_interval=POLL, unreachable_after=0.3)
        await state.start()
        try:
            first, second = prompt(1), prompt(2)
            await worker.generate(first)
            await eventually(lambda: matched(state, "w0", hashes(first)) == 6)
            state.book.fleet.kv_index.mark_stale("w0")
            await worker.generate(second)
            await eventually(lambda: "resyncing" in caplog.text and matched(state, "w0", hashes(second)) == 6)
            assert matched(state, "w0", hashes(first)) == 6
            _, pool = await worker.server.engine.call(lambda e: e.kv_manager.pool.snapshot())
            await eventually(lambda: state.view().kv_index.held("w0") == set(pool))
        finally:
            await state.stop()
            await worker.stop()

    with caplog.at_level("WARNING", logger="gateway.fleet.embedded_fleet"):
        run(main)


def test_a_late_gateway_sees_blocks_cached_before_it_started(redis_server):
    async def main() -> None:
        # A snapshot after every event trims the stream: the late gateway must start from a snapshot.
        worker = await start_worker("w0", redis_server.url, snapshot_every=1)
        try:
            prompts = [prompt(seed) for seed in range(1, 5)]
            for p in prompts:
                await worker.generate(p)
                await asyncio.sleep(0.1)
            late = RedisFleetState(redis_server.url, identity_of(worker), poll_interval=POLL)
            await late.start()
            try:
                assert [matched(late, "w0", hashes(p)) for p in prompts] == [6, 6, 6, 6]  # at start, no wait
                assert late.counters.resyncs >= 1
            finally:
                await late.stop()
        finally:
            await worker.stop()

    run(main)


@pytest.mark.parametrize("kind", KINDS)
def test_a_workers_host_tier_is_held_and_scored_below_its_device(kind, redis_server):
    """A worker with a host KV tier: the prompts its device evicted are still held, on the host tier, and score
    their blocks at 0.92 (kv_index.DEFAULT_MEDIUM_WEIGHTS), through gRPC events or Redis (from a snapshot: one
    after every event)."""

    async def main() -> None:
        worker = await start_worker("w0", redis_server.url, snapshot_every=1, host_kv_blocks=256)
        try:
            prompts = [prompt(seed) for seed in range(1, 15)]  # 14 x 6 full blocks on a device of 64
            for p in prompts:
                await worker.generate(p)
            await asyncio.sleep(0.2)
            fleet = fleet_state(kind, [worker.address], identity_of(worker), redis_server.url)
            await fleet.start()
            try:
                _, device, host = await worker.server.engine.call(lambda e: e.kv_manager.snapshot())
                device, host = set(device), set(host)

                def score(block_hashes_: list[bytes]) -> int:
                    held = device | host
                    depth = next((i for i, h in enumerate(block_hashes_) if h not in held), len(block_hashes_))
                    return math.floor(sum(1 if h in device else 0.92 for h in block_hashes_[:depth]) + 1e-9)

                expected = [score(hashes(p)) for p in prompts]
                assert expected[0] == 5 and expected[-1] == 6  # the first on the host only, the last on the device
                await eventually(lambda: [matched(fleet, "w0", hashes(p)) for p in prompts] == expected)
                if kind == "redis":
                    assert fleet.counters.resyncs >= 1
            finally:
                await fleet.stop()
        finally:
            await worker.stop()

    run(main)


def test_redis_stopped_and_restarted_keeps_the_view_and_catches_up(redis_server):
    async def main() -> None:
        workers = [await start_worker(f"w{i}", redis_server.url) for i in range(2)]
        fleet = RedisFleetState(redis_server.url, identity_of(workers[0]), poll_interval=POLL)
        direct = RedisFleetState(
            redis_server.url, identity_of(workers[0]), poll_interval=POLL,
            fallback_addresses=[w.address for w in workers], fallback_after=0.2,
        )  # fmt: skip
        await fleet.start()
        await direct.start()
        try:
            a, b = prompt(1), prompt(2)
            await workers[0].generate(a)
            await eventually(lambda: matched(fleet, "w0", hashes(a)) == 6 and matched(direct, "w0", hashes(a)) == 6)

            redis_server.stop()
            await eventually(lambda: not fleet.redis_ok and not direct.redis_ok)
            await workers[1].generate(b)  # cached while Redis is down
            await asyncio.sleep(TTL + 0.2)  # longer than a heartbeat TTL: nobody expires during an outage
            assert fleet.view().replicas == direct.view().replicas == ("w0", "w1")
            assert matched(fleet, "w0", hashes(a)) == 6
            fleet.on_dispatch("w1")  # routing goes on with this gateway's own counts
            assert fleet.view().loads["w1"].in_flight >= 1
            fleet.on_finish("w1")
            await eventually(lambda: matched(direct, "w1", hashes(b)) == 6)  # the fallback reads workers directly

            redis_server.start()  # empty: the reporters register again with fresh snapshots
            await eventually(lambda: fleet.redis_ok and direct.redis_ok)
            await eventually(lambda: matched(fleet, "w1", hashes(b)) == 6)
            assert fleet.view().replicas == ("w0", "w1") and matched(fleet, "w0", hashes(a)) == 6
            c = prompt(3)
            await workers[0].generate(c)
            await eventually(lambda: matched(fleet, "w0", hashes(c)) == 6 and matched(direct, "w0", hashes(c)) == 6)
        finally:
            await fleet.stop()
            await direct.stop()
            for worker in workers:
                await worker.stop()

    run(main)


def test_two_gateway_states_give_the_same_view_and_decisions(redis_server):
    async def main() -> None:
        workers = [await start_worker(f"w{i}", redis_server.url) for i in range(3)]
        gateways = [RedisFleetState(redis_server.url, identity_of(workers[0]), poll_interval=POLL) for _ in range(2)]
        for gateway in gateways:
            await gateway.start()
        try:
            prompts = [prompt(seed) for seed in range(6)]
            for i, p in enumerate(prompts):
                await workers[i % 3].generate(p)
            last = hashes(prompts[-1])
            await eventually(lambda: all(matched(g, "w2", last) == 6 for g in gateways))
            await asyncio.sleep(2 * HEARTBEAT)  # the same load reports
            views = [g.view() for g in gateways]
            assert views[0].replicas == views[1].replicas == ("w0", "w1", "w2")
            for p in prompts:
                assert views[0].kv_index.match(hashes(p)) == views[1].kv_index.match(hashes(p))
            # equal as loads (ReplicaLoad's equality leaves out each state's own count of reports)
            assert [views[0].loads[r] for r in views[0].replicas] == [views[1].loads[r] for r in views[1].replicas]
            policies = [make_policy("kv_aware"), make_policy("kv_aware")]
            for i, p in enumerate(prompts + [prompt(99)]):
                request = RouteRequest(f"r{i}", hashes(p), len(p))
                assert policies[0].pick(request, views[0]) == policies[1].pick(request, views[1])
        finally:
            for gateway in gateways:
                await gateway.stop()
            for worker in workers:
                await worker.stop()

    run(main)


def test_a_sentinel_url_works_on_both_sides(redis_server):
    async def main() -> None:
        with RedisSentinel(redis_server) as sentinel:
            worker = await start_worker("w0", sentinel.url)
            fleet = RedisFleetState(sentinel.url, identity_of(worker), poll_interval=POLL)
            await fleet.start()
            try:
                p = prompt(1)
                await worker.generate(p)
                await eventually(lambda: matched(fleet, "w0", hashes(p)) == 6)
            finally:
                await fleet.stop()
                await worker.stop()

    run(main)
