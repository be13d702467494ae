"""KV events over ZMQ in vLLM's wire format, both ends real: kvroute workers (sim model) publishing with
`worker.kv_event_publisher` (as `kvroute worker --kv-events-config` does), the gateway's
`gateway.fleet.engine_events` subscriber decoding them into a FleetBook whose index must equal the worker's pool.
Everything on loopback; every wait bounded."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from gateway.fleet.engine_events import EngineEventHub, EngineEventSource, EngineEventSubscriber
from gateway.fleet.fleet_state import FleetBook, FleetIdentity
from kvroute.engine_kv_events import (
    MAX_BATCH_BYTES,
    BlockRemoved,
    BlockStored,
    EventBatch,
    encode_batch,
    encode_seq,
)
from kvroute.hashing import block_hashes, hash_fingerprint
from kvroute.sampling import SamplingParams
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.kv_event_publisher import KVEventPublisher, KVEventsConfig
from worker.service import WorkerServer, start_worker_server

ROOT = Path(__file__).resolve().parents[1]
BLOCK = 4
TOKENIZER_FP = "tokenizer"


def run(coroutine, timeout: float = 60):
    async def bounded():
        async with asyncio.timeout(timeout):
            return await coroutine

    return asyncio.run(bounded())


async def until(predicate: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


def sim_engine(num_kv_blocks: int = 64) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model="sim",
            block_size=BLOCK,
            num_kv_blocks=num_kv_blocks,
            max_model_len=256,
            sim_decode_ms_per_step=0.1,
            sim_prefill_us_per_token=1.0,
        )  # fmt: skip
    )


async def start_worker(num_kv_blocks: int = 64, **events: object) -> tuple[WorkerServer, KVEventPublisher]:
    engine = await asyncio.get_running_loop().run_in_executor(None, sim_engine, num_kv_blocks)
    server = await start_worker_server(engine, port=0)
    config = {"enable_kv_cache_events": True, "endpoint": "tcp://127.0.0.1:0", "bind": True}
    config["replay_endpoint"] = "tcp://127.0.0.1:0"
    config.update(events)
    publisher = KVEventPublisher(server.engine, KVEventsConfig.from_json(json.dumps(config)), BLOCK)
    publisher.start()
    return server, publisher


async def stop_worker(server: WorkerServer, publisher: KVEventPublisher) -> None:
    publisher.stop()
    await server.stop(drain_timeout=0)


async def generate(server: WorkerServer, prompt: list[int], salt: str = "", max_tokens: int = 2) -> None:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    async for _ in server.engine.generate(f"r{time.monotonic_ns()}", prompt, params, salt):
        pass


async def pool_hashes(server: WorkerServer) -> set[bytes]:
    return await server.engine.call(lambda engine: set(engine.kv_manager.pool.cached))


async def caught_up(server: WorkerServer, publisher: KVEventPublisher) -> None:
    """Every event the engine has logged is published."""
    await server.engine.kv_snapshot_page(0, 1)  # the pool's pending events into the engine's log
    await until(lambda: publisher.published_seq == server.engine.kv_event_seq, what="the publisher")


def book_for(model_id: str, worker_id: str = "w") -> FleetBook:
    identity = FleetIdentity(model_id, BLOCK, hash_fingerprint(model_id, BLOCK), TOKENIZER_FP)
    book = FleetBook(identity)
    book.admit(worker_id, "127.0.0.1:1", 1, model_id, BLOCK, 256, identity.hash_fingerprint, TOKENIZER_FP)
    return book


def held(book: FleetBook, worker_id: str, hashes: set[bytes]) -> bool:
    """The book's index holds exactly `hashes` for the worker (and matches on them: not stale)."""
    index = book.fleet.kv_index
    i = index.replicas.index(worker_id)
    return index.held(worker_id) == hashes and all(index.match([h])[i] == 1 for h in hashes)


def stale(book: FleetBook, worker_id: str) -> bool:
    """The worker's entries are ignored (after a gap, until a resync): nothing it holds matches."""
    index = book.fleet.kv_index
    i = index.replicas.index(worker_id)
    return bool(index.held(worker_id)) and all(index.match([h])[i] == 0 for h in index.held(worker_id))


async def traffic(server: WorkerServer, publisher: KVEventPublisher, rounds: int = 3) -> None:
    """Shared prefixes, a salted tenant and enough distinct prompts to evict (a pool of 64 blocks of 4); each
    request's events published before the next starts, so there are several batches."""
    shared = list(range(100, 140))
    for i in range(rounds):
        for prompt, salt in (
            (shared + [200 + i] * 8, ""), (shared, "tenant-b"), ([300 + 7 * i + j for j in range(60)], ""),
        ):  # fmt: skip
            await generate(server, prompt, salt)
            await caught_up(server, publisher)


def leading(hashes: list[bytes], cached: set[bytes]) -> int:
    return next((i for i, h in enumerate(hashes) if h not in cached), len(hashes))


class Frames:
    """A raw SUB socket on a publisher: the frames exactly as the publisher sent them."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.frames: list[list[bytes]] = []

    async def read(self, count: int, timeout: float = 5.0) -> list[list[bytes]]:
        async with asyncio.timeout(timeout):
            while len(self.frames) < count:
                self.frames.append(await self.sock.recv_multipart())
        return self.frames

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


# -- a worker's publisher into the gateway's subscriber ------------------------------------------------------


def test_worker_events_rebuild_the_workers_pool_in_the_gateways_index() -> None:
    async def main() -> None:
        server, publisher = await start_worker(topic="kv@w")
        book = book_for(server.engine.engine.model_id)
        source = EngineEventSource("w", publisher.endpoint, publisher.replay_endpoint, topic="kv@w")
        subscriber = EngineEventSubscriber(book, source)
        await subscriber.start()
        try:
            assert subscriber.last_event_at is None
            await traffic(server, publisher)
            await caught_up(server, publisher)
            await until(lambda: subscriber.counters.batches == publisher.published, what="every batch")
            cached = await pool_hashes(server)
            assert cached and held(book, "w", cached)
            assert subscriber.counters.dropped == {} and subscriber.last_event_at is not None
            assert subscriber.counters.removed_blocks > 0  # the pool evicted, and the index followed
            shared = list(range(100, 140))
            index = book.fleet.kv_index
            # The gateway's own hashes of a prompt (kvroute.hashing, the tenant's salt) find the worker's blocks.
            plain = block_hashes(shared, model_id=book.identity.model_id, block_size=BLOCK)
            salted = block_hashes(shared, model_id=book.identity.model_id, cache_salt="tenant-b", block_size=BLOCK)
            assert index.match(plain) == [leading(plain, cached)] and leading(plain, cached) > 0
            assert index.match(salted) == [leading(salted, cached)] and leading(salted, cached) > 0
            other = block_hashes(shared, model_id=book.identity.model_id, cache_salt="tenant-c", block_size=BLOCK)
            assert index.match(other) == [0]
        finally:
            await subscriber.stop()
            await stop_worker(server, publisher)

    run(main())


def test_a_gap_is_filled_from_the_replay_socket() -> None:
    async def main() -> None:
        server, publisher = await start_worker()
        frames = Frames(publisher.endpoint)
        await asyncio.sleep(0.3)  # the SUB connection is up before the first batch
        book = book_for(server.engine.engine.model_id)
        subscriber = EngineEventSubscriber(book, EngineEventSource("w", None, publisher.replay_endpoint))
        try:
            await traffic(server, publisher, rounds=2)
            await caught_up(server, publisher)
            received = await frames.read(publisher.published)
            assert [int.from_bytes(f[1], "big") for f in received] == list(range(len(received)))
            for i, message in enumerate(received):
                if i != 2:  # batch 2 is lost on the way
                    subscriber.handle(message)
            assert stale(book, "w")  # routed by load while the replay runs
            cached = await pool_hashes(server)
            await until(lambda: held(book, "w", cached), what="the replayed index")
            assert subscriber.counters.gaps == 1 and subscriber.counters.rebuilds == 0
            assert subscriber.counters.replayed_batches >= len(received) - 2
        finally:
            frames.close()
            await subscriber.stop()
            await stop_worker(server, publisher)

    run(main())


def test_a_gap_past_the_replay_buffer_drops_the_entries_and_rebuilds_from_what_follows() -> None:
    async def main() -> None:
        server, publisher = await start_worker(buffer_steps=2)
        frames = Frames(publisher.endpoint)
        await asyncio.sleep(0.3)
        book = book_for(server.engine.engine.model_id)
        subscriber = EngineEventSubscriber(book, EngineEventSource("w", None, publisher.replay_endpoint))
        try:
            first = list(range(10, 26))
            await generate(server, first)
            await traffic(server, publisher, rounds=2)
            await caught_up(server, publisher)
            received = await frames.read(publisher.published)
            assert len(received) > 4
            subscriber.handle(received[0])
            for message in received[2:]:  # batch 1 is lost, and the buffer keeps only the last 2
                subscriber.handle(message)
            await until(lambda: subscriber.counters.rebuilds == 1, what="the rebuild")
            index = book.fleet.kv_index
            cached = await pool_hashes(server)
            assert not stale(book, "w") and 0 < index.num_blocks("w") < len(cached)
            # Nothing it holds is wrong: every entry is in the worker's pool.
            hashes = [h for message in received for h in _stored_hashes(book, message)]
            assert all(h in cached for h in hashes if h in index.held("w"))
        finally:
            frames.close()
            await subscriber.stop()
            await stop_worker(server, publisher)

    run(main())


def _stored_hashes(book: FleetBook, message: list[bytes]) -> list[bytes]:
    """Every prompt's hashes the test sent, as the gateway computes them (to probe the index with)."""
    model_id = book.identity.model_id
    prompts = [list(range(10, 26)), list(range(100, 140))] + [[300 + 7 * i + j for j in range(60)] for i in range(2)]
    return [h for p in prompts for h in block_hashes(p, model_id=model_id, block_size=BLOCK)]


def test_a_sequence_back_at_zero_is_a_restart_and_drops_the_old_entries() -> None:
    async def main() -> None:
        first, first_publisher = await start_worker()
        second, second_publisher = await start_worker()  # the same worker after a restart: its sequence is new
        first_frames, second_frames = Frames(first_publisher.endpoint), Frames(second_publisher.endpoint)
        await asyncio.sleep(0.3)
        book = book_for(first.engine.engine.model_id)
        restarted: list[str] = []
        subscriber = EngineEventSubscriber(book, EngineEventSource("w", None), on_restart=restarted.append)
        try:
            await traffic(first, first_publisher, rounds=2)
            await generate(second, list(range(500, 540)))
            await caught_up(first, first_publisher)
            await caught_up(second, second_publisher)
            for message in await first_frames.read(first_publisher.published):
                subscriber.handle(message)
            assert held(book, "w", await pool_hashes(first))
            for message in await second_frames.read(second_publisher.published):
                subscriber.handle(message)
            assert restarted == ["w"] and subscriber.counters.restarts == 1
            assert held(book, "w", await pool_hashes(second))
        finally:
            first_frames.close()
            second_frames.close()
            await stop_worker(first, first_publisher)
            await stop_worker(second, second_publisher)

    run(main())


def test_a_worker_restarted_behind_the_same_endpoint_is_a_restart() -> None:
    from launch.fleet import free_port

    events = {"endpoint": f"tcp://127.0.0.1:{free_port()}", "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}

    async def main() -> None:
        server, publisher = await start_worker(**events)
        book = book_for(server.engine.engine.model_id)
        restarted: list[str] = []
        source = EngineEventSource("w", events["endpoint"], events["replay_endpoint"])
        subscriber = EngineEventSubscriber(book, source, on_restart=restarted.append)
        await subscriber.start()
        try:
            await traffic(server, publisher, rounds=1)
            await until(lambda: subscriber.counters.batches == publisher.published, what="every batch")
            old = await pool_hashes(server)
            assert held(book, "w", old)
            await stop_worker(server, publisher)
            server, publisher = await start_worker(**events)  # a new process: its sequence starts at 0 again
            await generate(server, list(range(800, 840)))
            await caught_up(server, publisher)
            new = await pool_hashes(server)
            await until(lambda: held(book, "w", new), what="the new process's blocks only")
            assert restarted == ["w"] and subscriber.counters.restarts == 1
            assert not any(h in book.fleet.kv_index.held("w") for h in old - new)
        finally:
            await subscriber.stop()
            await stop_worker(server, publisher)

    run(main())


class Proxy:
    """A loopback TCP proxy whose connections a test can cut (a network blip between gateway and engine)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = 0
        self.server: asyncio.Server | None = None
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self.server.sockets[0].getsockname()[1]

    async def cut(self) -> None:
        """Close every connection and stop listening (until `start` again, on the same port)."""
        assert self.server is not None
        self.server.close()
        for writer in self.writers:
            writer.close()
        self.writers.clear()
        await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers += [writer, up_writer]

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            try:
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))


def test_a_dropped_connection_to_the_same_engine_is_not_a_restart() -> None:
    from launch.fleet import free_port

    events_port = free_port()

    async def main() -> None:
        server, publisher = await start_worker(endpoint=f"tcp://127.0.0.1:{events_port}")
        proxy = Proxy(events_port)
        await proxy.start()
        book = book_for(server.engine.engine.model_id)
        restarted: list[str] = []
        source = EngineEventSource("w", f"tcp://127.0.0.1:{proxy.port}", publisher.replay_endpoint)
        subscriber = EngineEventSubscriber(book, source, on_restart=restarted.append)
        await subscriber.start()
        try:
            await asyncio.sleep(0.3)
            await traffic(server, publisher, rounds=1)
            await until(lambda: subscriber.counters.batches == publisher.published, what="every batch")
            await proxy.cut()
            await until(lambda: stale(book, "w"), what="routed by load while the link is down")
            await generate(server, list(range(900, 940)))  # published while nobody receives it
            await caught_up(server, publisher)
            await proxy.start()
            cached = await pool_hashes(server)
            await until(lambda: held(book, "w", cached), timeout=10, what="the index after the reconnect")
            assert restarted == [] and subscriber.counters.restarts == 0 and subscriber.counters.rebuilds == 0
            assert subscriber.counters.replayed_batches > 0  # the missed batch came from the replay socket
        finally:
            await subscriber.stop()
            await proxy.cut()
            await stop_worker(server, publisher)

    run(main())


def test_all_blocks_cleared_drops_the_workers_entries() -> None:
    async def main() -> None:
        server, publisher = await start_worker()
        book = book_for(server.engine.engine.model_id)
        subscriber = EngineEventSubscriber(book, EngineEventSource("w", publisher.endpoint, publisher.replay_endpoint))
        await subscriber.start()
        try:
            await traffic(server, publisher, rounds=1)
            await caught_up(server, publisher)
            await until(lambda: subscriber.counters.batches == publisher.published, what="every batch")
            assert book.fleet.kv_index.num_blocks("w") > 0
            assert await server.engine.call(lambda engine: engine.kv_manager.pool.reset_cache())
            await server.engine.kv_snapshot_page(0, 1)  # publishes the pool's pending events
            await until(lambda: subscriber.counters.cleared == 1, what="AllBlocksCleared")
            assert held(book, "w", set())
        finally:
            await subscriber.stop()
            await stop_worker(server, publisher)

    run(main())


def test_the_hub_layout_one_bound_socket_keyed_by_topic() -> None:
    async def main() -> None:
        hub = EngineEventHub("tcp://127.0.0.1:0")
        await hub.start()
        assert hub.endpoint is not None
        topic = "kv@127.0.0.1:8000@sim"
        server, publisher = await start_worker(endpoint=hub.endpoint, bind=False, topic=topic)
        book = book_for(server.engine.engine.model_id)
        subscriber = EngineEventSubscriber(book, EngineEventSource("w", None, publisher.replay_endpoint, topic=topic))
        hub.add(topic, subscriber)
        try:
            await asyncio.sleep(0.3)
            await traffic(server, publisher, rounds=1)
            await caught_up(server, publisher)
            await until(lambda: subscriber.counters.batches == publisher.published, what="every batch")
            assert held(book, "w", await pool_hashes(server))
            # A pod whose topic no subscriber has: counted and dropped.
            stray = KVEventPublisher(
                server.engine, KVEventsConfig(True, "zmq", hub.endpoint, topic="kv@10.9.9.9:8000@sim", bind=False), 4
            )
            stray.start()
            try:
                await asyncio.sleep(0.3)
                await generate(server, list(range(700, 720)))
                await until(lambda: hub.dropped.get("unknown_topic", 0) > 0, what="the stray topic's drop")
            finally:
                stray.stop()
        finally:
            await hub.stop()
            await stop_worker(server, publisher)

    run(main())


# -- bad input ------------------------------------------------------------------------------------------------


def _stored(hashes: list[int], parent: int | None, first_token: int) -> BlockStored:
    tokens = tuple(range(first_token, first_token + BLOCK * len(hashes)))
    return BlockStored(tuple(hashes), parent, tokens, BLOCK)


def _message(seq: int, *events: object, rank: int | None = None) -> list[bytes]:
    return [b"", encode_seq(seq), encode_batch(EventBatch(1.0, tuple(events), rank))]


def test_bad_input_is_counted_and_dropped_and_never_poisons_the_index() -> None:
    async def main() -> None:
        book = book_for("m")
        subscriber = EngineEventSubscriber(book, EngineEventSource("w", None), max_blocks=256)
        subscriber.handle(_message(0, _stored([1, 2, 3], None, 0)))
        good = set(block_hashes(list(range(12)), model_id="m", block_size=BLOCK))
        assert held(book, "w", good)
        seq = 1

        def send(payload: bytes) -> None:
            nonlocal seq
            subscriber.handle([b"", encode_seq(seq), payload])
            seq += 1

        # Frames that are not a message: the batch's place in the sequence is unknown, nothing changes.
        subscriber.handle([b"", encode_seq(seq)])
        subscriber.handle([b"", b"\x00\x01", b""])
        assert held(book, "w", good)
        # An unknown worker, a foreign rank, a run whose parent was never seen: dropped, entries kept.
        ghost = EngineEventSubscriber(book, EngineEventSource("ghost", None))
        ghost.handle(_message(0, _stored([9], None, 50)))
        subscriber.handle(_message(seq, _stored([7], None, 90), rank=3))
        seq += 1
        subscriber.handle(_message(seq, _stored([8], 12345, 90)))
        seq += 1
        assert held(book, "w", good)
        # Batches that do not decode: lost batches, so the worker's entries are dropped (rebuilt from what
        # follows), never a wrong one added.
        for payload in (
            b"\xc1 not msgpack",
            msgspec.msgpack.encode({"ts": 1}),
            msgspec.msgpack.encode([1.0, [["BlockExploded", [1]]]]),
            msgspec.msgpack.encode([1.0, [{"type": "BlockStored", "block_hashes": ["x"], "token_ids": []}]]),
            msgspec.msgpack.encode([1.0, [["BlockStored", [5], None, [1, 2], BLOCK, None, None]]]),
            msgspec.msgpack.encode([1.0, [["BlockStored", [5], None, [-1, 2, 3, 4], BLOCK, None, None]]]),
            b"\x92" + b"\xcb" + b"\x00" * 8 + b"\xdd" + (10**6).to_bytes(4, "big"),  # claims a million events
            b"\x00" * (MAX_BATCH_BYTES + 1),
            b"\x92\xcb" + b"\x00" * 8 + b"\x91" * 50_000 + b"\xc0",  # nested too deep
        ):
            send(payload)
            assert held(book, "w", set())
            subscriber.handle(_message(seq, _stored([1, 2, 3], None, 0)))
            seq += 1
            assert held(book, "w", good)
        # A flood: far more blocks than the subscriber remembers; the index stays bounded and right.
        for i in range(400):
            subscriber.handle(_message(seq, _stored([10_000 + 2 * i, 10_001 + 2 * i], None, 1000 + 8 * i)))
            seq += 1
        index = book.fleet.kv_index
        assert index.num_blocks("w") <= 256
        last = block_hashes(list(range(1000 + 8 * 399, 1000 + 8 * 400)), model_id="m", block_size=BLOCK)
        assert index.match(last) == [2]
        counters = subscriber.counters
        assert counters.dropped["frames"] == 1 and counters.dropped["malformed"] == 10
        assert counters.dropped["foreign_rank"] == 1 and counters.dropped["unknown_parent"] == 1
        assert ghost.counters.dropped == {"unknown_worker": 1} and index.replicas == ("w",)
        assert counters.rebuilds == 9
        # The fleet's counters (the gateway's kvroute:gateway_kv_event_drops) have every drop too.
        drops = book.counters.kv_event_drops
        assert drops[("w", "malformed")] == 10 and drops[("ghost", "unknown_worker")] == 1

    run(main())


def test_a_block_size_that_does_not_fit_the_pool_is_a_parity_failure() -> None:
    book = book_for("m")
    subscriber = EngineEventSubscriber(book, EngineEventSource("w", None))
    tokens = tuple(range(12))
    subscriber.handle([b"", encode_seq(0), encode_batch(EventBatch(1.0, (BlockStored((1,), None, tokens, 12),)))])
    assert subscriber.parity_failed and subscriber.counters.parity_failures == 1
    assert held(book, "w", set())


def test_sglang_pages_are_aggregated_into_the_pools_blocks() -> None:
    book = book_for("m")
    subscriber = EngineEventSubscriber(book, EngineEventSource("w", None))
    tokens = list(range(40, 50))  # 2 full blocks of 4 and 2 tokens over
    pages = [BlockStored((100 + i,), None if i == 0 else 99 + i, (t,), 1) for i, t in enumerate(tokens)]
    subscriber.handle(_message(0, *pages))
    expected = block_hashes(tokens, model_id="m", block_size=BLOCK)
    assert held(book, "w", set(expected))
    subscriber.handle(_message(1, BlockRemoved((107,))))  # the page that ends block 2: block 2 is gone
    assert held(book, "w", {expected[0]})


# -- the flag -------------------------------------------------------------------------------------------------


def test_the_kv_events_config_flag_takes_vllms_json_and_names_what_is_wrong() -> None:
    config = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "topic": "t"}')
    assert config.publishes and config.publisher == "zmq" and config.buffer_steps == 10_000
    assert not KVEventsConfig.from_json('{"enable_kv_cache_events": false}').publishes
    for text, needle in (
        ("{bad", "not JSON"),
        ('{"enable_kv_cache_events": true, "endpont": "x"}', "endpont"),
        ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher"),
        ('{"enable_kv_cache_events": true, "buffer_steps": 0}', "buffer_steps"),
    ):
        with pytest.raises(ValueError, match=needle):
            KVEventsConfig.from_json(text)
    result = subprocess.run(
        [sys.executable, "-m", "launch.cli", "worker", "--model", "sim", "--kv-events-config", '{"endpont": 1}'],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "endpont" in result.stderr


@pytest.mark.slow
def test_kvroute_worker_with_the_flag_publishes_what_its_grpc_requests_cache() -> None:
    import grpc

    from kvroute.model_source import resolve_model
    from launch.fleet import free_port
    from proto import worker_pb2, worker_pb2_grpc

    port, events_port, replay_port = free_port(), free_port(), free_port()
    config = {
        "enable_kv_cache_events": True, "publisher": "zmq", "bind": True, "topic": f"kv@127.0.0.1:{port}@sim",
        "endpoint": f"tcp://127.0.0.1:{events_port}", "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
    }  # fmt: skip
    worker = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "worker", "--model", "sim", "--port", str(port), "--block-size",
         str(BLOCK), "--num-kv-blocks", "64", "--max-model-len", "256", "--kv-events-config", json.dumps(config)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 60
        while not any("KV events on" in line for line in lines):
            assert time.monotonic() < deadline and worker.poll() is None, "".join(lines)
            lines.append(worker.stdout.readline())
        assert f"tcp://127.0.0.1:{events_port}, replay on tcp://127.0.0.1:{replay_port}" in lines[-1]

        async def main() -> None:
            model_id = resolve_model("sim").model_id
            fleet = book_for(model_id)
            source = EngineEventSource(
                "w", f"tcp://127.0.0.1:{events_port}", f"tcp://127.0.0.1:{replay_port}", topic=config["topic"]
            )
            subscriber = EngineEventSubscriber(fleet, source)
            await subscriber.start()
            prompt = list(range(100, 132))
            try:
                async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                    stub = worker_pb2_grpc.WorkerStub(channel)
                    for salt in ("", "tenant-b"):
                        request = worker_pb2.GenerateRequest(
                            request_id=f"r-{salt}", prompt_token_ids=prompt, cache_salt=salt,
                            sampling=worker_pb2.SamplingParams(max_tokens=2),
                        )  # fmt: skip
                        async for _ in stub.Generate(request):
                            pass
                index = fleet.fleet.kv_index
                for salt in ("", "tenant-b"):
                    hashes = block_hashes(prompt, model_id=model_id, cache_salt=salt, block_size=BLOCK)
                    await until(lambda h=hashes: index.match(h) == [len(h)], what=f"the blocks of salt {salt!r}")
                assert subscriber.counters.dropped == {}
            finally:
                await subscriber.stop()

        run(main())
        worker.terminate()
        assert worker.wait(timeout=30) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_offloaded_tiers_weigh_as_configured_and_keys_the_gateway_cannot_make_never_match() -> None:
    tokens = tuple(range(8))
    ours = block_hashes(list(tokens), model_id="m", block_size=BLOCK)
    on_cpu = BlockStored((1, 2), None, tokens, BLOCK, None, "CPU")
    for weights in ({}, {"CPU": 0.5}, {"DISK": 0.25}):
        book = book_for("m")
        subscriber = EngineEventSubscriber(book, EngineEventSource("w", None), medium_weights=weights)
        subscriber.handle(_message(0, BlockStored((1, 2), None, tokens, BLOCK, None, "GPU"), on_cpu))
        assert held(book, "w", set(ours)) and subscriber.weights == {}  # a GPU copy: whole blocks
        subscriber.handle(_message(1, BlockRemoved((1, 2), "GPU")))  # evicted from the GPU, kept on the CPU
        cpu = weights.get("CPU", 0.0)
        assert held(book, "w", set(ours) if cpu else set())
        assert subscriber.weights == ({h: cpu for h in ours} if cpu else {})
        subscriber.handle(_message(2, BlockStored((1, 2), None, tokens, BLOCK, None, "GPU")))  # loaded back
        assert held(book, "w", set(ours)) and subscriber.weights == {}
        subscriber.handle(_message(3, BlockRemoved((1, 2), "GPU"), BlockRemoved((1, 2), "CPU")))
        assert held(book, "w", set()) and subscriber.weights == {}
    for bad in ({"CPU": 1.5}, {"CPU": "half"}, {"GPU": 0.5}, {"": 0.5}, {"CPU": True}):
        with pytest.raises(ValueError, match="medium_weights"):
            EngineEventSubscriber(book_for("m"), EngineEventSource("w", None), medium_weights=bad)
    book = book_for("m")
    subscriber = EngineEventSubscriber(book, EngineEventSource("w", None))
    image = BlockStored((5, 6), None, tokens, BLOCK, None, "GPU", None, ((("mm-hash", 0),), None))
    lora = BlockStored((7, 8), None, tokens, BLOCK, None, "GPU", "my-lora", (("my-lora",), None))
    subscriber.handle(_message(0, image, lora))
    index = book.fleet.kv_index
    assert index.num_blocks("w") == 4 and index.match(ours) == [0]  # held, but no text prompt of the base model
    assert index.match(block_hashes(list(tokens), model_id="my-lora", block_size=BLOCK)) == [2]


def test_churn_past_the_map_bound_keeps_a_long_lived_block() -> None:
    book = book_for("m")
    subscriber = EngineEventSubscriber(book, EngineEventSource("w", None), max_blocks=64)
    hot = list(range(BLOCK))
    subscriber.handle(_message(0, _stored([1], None, 0)))
    for i in range(500):  # stored and evicted again and again: far more blocks than the bound over time
        h = 1000 + i
        subscriber.handle(_message(1 + 2 * i, _stored([h], None, 100 + BLOCK * i)))
        subscriber.handle(_message(2 + 2 * i, BlockRemoved((h,))))
    assert held(book, "w", set(block_hashes(hot, model_id="m", block_size=BLOCK)))


def test_an_endpoint_spelled_as_a_host_address_connects_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's rule: `tcp://127.0.0.1:N` connects (only `*`, `::`, ipc and inproc bind), so nobody hears the
    events until a subscriber binds there: the publisher logs it as a warning and `--help` says it."""

    async def main() -> None:
        hub = EngineEventHub("tcp://127.0.0.1:0")
        await hub.start()
        assert hub.endpoint is not None
        with caplog.at_level("WARNING", logger="worker.kv_event_publisher"):
            server, publisher = await start_worker(endpoint=hub.endpoint, bind=None, replay_endpoint=None)
        try:
            assert not publisher.binds
            assert f"CONNECTED to {hub.endpoint}" in caplog.text and '"bind": true' in caplog.text
        finally:
            await stop_worker(server, publisher)
            await hub.stop()

    run(main())
    result = subprocess.run(
        [sys.executable, "-m", "launch.cli", "worker", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert "CONNECTS" in " ".join(result.stdout.split())
