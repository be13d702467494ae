"""KV-event ingest and index memory for engines' ZMQ events (docs/engines.md, "KV events"; not a timed test).

    python -m benchmarks.kv_events_bench [--workers 8] [--blocks 20000] [--block-size 16] [--zmq]

Ingest: vLLM 0.33-format batches (each a step's worth: BlockStored runs of new blocks with their token ids,
BlockRemoved for evictions), encoded beforehand, then fed to `EngineEventSubscriber.handle` on one core: decode,
re-hash every block with kvroute's hash, the engine-hash map and the FleetBook's index. The rate is in block
events per second (a stored or a removed block each). `--zmq` sends the same batches over a loopback PUB/SUB
pair into a started subscriber instead, so the socket's cost is in it too (the sender runs on the same event
loop: a lower bound for the gateway's core). `--sglang-pages`: SGLang's shape, one BlockStored per 1-token page,
aggregated into the pool's blocks.

Memory: `--workers` workers each holding `--blocks` blocks, half of them shared by every worker (a common system
prompt) and half their own, measured with tracemalloc around the book and the subscribers: bytes per cached
(block, worker).

Routing decision: `--route-workers` workers (64) each holding `--route-blocks` blocks (50,000) in the book's
index, as 4,096-token prompts (chains of 256 blocks), one in ten chains held by every worker; the time of one
`kv_aware` pick for a 4,096-token prompt that extends one worker's chain (median and p99 of 2,000).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import time
import tracemalloc

from gateway.fleet.engine_events import EngineEventSource, EngineEventSubscriber
from gateway.fleet.fleet_state import FleetBook, FleetIdentity
from kvroute.engine_kv_events import BlockRemoved, BlockStored, EventBatch, encode_batch, encode_seq
from kvroute.hashing import hash_fingerprint

MODEL = "bench-model"


def make_book(workers: list[str], block_size: int) -> FleetBook:
    identity = FleetIdentity(MODEL, block_size, hash_fingerprint(MODEL, block_size), "tok")
    book = FleetBook(identity)
    for w in workers:
        book.admit(w, f"{w}:8000", 1, MODEL, block_size, 4096, identity.hash_fingerprint, "tok")
    return book


def step_batches(
    count: int, block_size: int, run_blocks: int, seed: int = 0, page_size: int | None = None
) -> tuple[list[bytes], int]:
    """`count` encoded batches of one engine: each stores 4 runs of `run_blocks` new blocks (chained onto the
    previous run of the same sequence, or a new sequence) and evicts as many old blocks as it stored beyond a
    pool of 50,000. With `page_size` (SGLang) the engine's blocks are pages of that many tokens, one
    BlockStored per page. Returns the payloads and the block events (engine blocks) in them."""
    rng = random.Random(seed)
    page = page_size or block_size
    run_pages = run_blocks * block_size // page
    payloads, events_total = [], 0
    next_hash, live = 1, []
    tails: list[int | None] = [None] * 8
    for _ in range(count):
        events: list[BlockStored | BlockRemoved] = []
        for _ in range(4):
            lane = rng.randrange(len(tails))
            hashes = list(range(next_hash, next_hash + run_pages))
            next_hash += run_pages
            tokens = [rng.randrange(50_000) for _ in range(run_pages * page)]
            if page_size is None:
                events.append(BlockStored(tuple(hashes), tails[lane], tuple(tokens), block_size, None, "GPU"))
            else:
                parents = [tails[lane], *hashes[:-1]]
                for i, (h, parent) in enumerate(zip(hashes, parents, strict=True)):
                    page_tokens = tuple(tokens[i * page : (i + 1) * page])
                    events.append(BlockStored((h,), parent, page_tokens, page, None, "GPU"))
            tails[lane] = hashes[-1] if rng.random() < 0.9 else None
            live.extend(hashes)
            events_total += run_pages
        if len(live) > 50_000:
            gone, live = live[: len(live) - 50_000], live[len(live) - 50_000 :]
            events.append(BlockRemoved(tuple(gone), "GPU"))
            events_total += len(gone)
        payloads.append(encode_batch(EventBatch(time.time(), tuple(events))))
    return payloads, events_total


def ingest_rate(batches: int, block_size: int, run_blocks: int, page_size: int | None = None) -> tuple[float, int]:
    payloads, events = step_batches(batches, block_size, run_blocks, page_size=page_size)
    book = make_book(["w"], block_size)
    subscriber = EngineEventSubscriber(book, EngineEventSource("w", None))
    frames = [[b"", encode_seq(i), p] for i, p in enumerate(payloads)]
    gc.collect()
    start = time.perf_counter()
    for message in frames:
        subscriber.handle(message)
    elapsed = time.perf_counter() - start
    assert not subscriber.counters.dropped, subscriber.counters
    return events / elapsed, book.fleet.kv_index.num_blocks("w")


async def ingest_rate_zmq(batches: int, block_size: int, run_blocks: int) -> float:
    import zmq
    import zmq.asyncio

    payloads, events = step_batches(batches, block_size, run_blocks)
    ctx = zmq.asyncio.Context()
    pub = ctx.socket(zmq.PUB)
    pub.set_hwm(batches + 10)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    book = make_book(["w"], block_size)
    subscriber = EngineEventSubscriber(book, EngineEventSource("w", f"tcp://127.0.0.1:{port}"), context=ctx)
    await subscriber.start()
    await asyncio.sleep(0.3)
    start = time.perf_counter()
    for i, payload in enumerate(payloads):
        await pub.send_multipart([b"", encode_seq(i), payload])
    async with asyncio.timeout(120):
        while subscriber.counters.batches < batches:
            await asyncio.sleep(0.001)
    elapsed = time.perf_counter() - start
    await subscriber.stop()
    pub.close(linger=0)
    ctx.term()
    return events / elapsed


def index_memory(workers: int, blocks: int, block_size: int) -> float:
    """Bytes per cached (block, worker), everything the gateway keeps for it: the index's holder masks and
    per-worker sets, and each subscriber's engine-hash map and copy counts."""
    ids = [f"w{i:03d}" for i in range(workers)]
    shared_tokens = [random.Random(1).randrange(50_000) for _ in range(blocks // 2 * block_size)]
    batches = []
    for i in range(workers):
        rng = random.Random(100 + i)
        own = [rng.randrange(50_000) for _ in range(blocks // 2 * block_size)]
        half = blocks // 2
        hashes = list(range(1, blocks + 1))
        events = (
            BlockStored(tuple(hashes[:half]), None, tuple(shared_tokens), block_size, None, "GPU"),
            BlockStored(tuple(hashes[half:]), hashes[half - 1], tuple(own), block_size, None, "GPU"),
        )
        batches.append(encode_batch(EventBatch(0.0, events)))
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    book = make_book(ids, block_size)
    subscribers = [EngineEventSubscriber(book, EngineEventSource(w, None)) for w in ids]
    for subscriber, payload in zip(subscribers, batches, strict=True):
        subscriber.handle([b"", encode_seq(0), payload])
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    assert all(book.fleet.kv_index.num_blocks(w) == blocks // 2 * 2 for w in ids)
    return (after - before) / (workers * (blocks // 2) * 2)


def routing_decision(workers: int, blocks: int, block_size: int) -> tuple[float, float]:
    from gateway.routing.router import RouteRequest, make_policy

    rng = random.Random(7)
    ids = [f"w{i:03d}" for i in range(workers)]
    book = make_book(ids, block_size)
    index = book.fleet.kv_index
    chain = 256
    shared = [[rng.randbytes(16) for _ in range(chain)] for _ in range(blocks // chain // 10)]
    own: dict[str, list[list[bytes]]] = {}
    for w in ids:
        chains = [[rng.randbytes(16) for _ in range(chain)] for _ in range(blocks // chain - len(shared))]
        own[w] = chains
        for c in shared + chains:
            index.add(w, c)
    policy = make_policy("kv_aware")
    times = []
    for i in range(2000):
        target = own[ids[i % workers]][i % len(own[ids[0]])]
        request = RouteRequest(f"r{i}", target[:200] + [rng.randbytes(16) for _ in range(56)], 256 * block_size)
        start = time.perf_counter()
        decision = policy.pick(request, book.fleet)
        policy.observe(request, decision)
        times.append(time.perf_counter() - start)
        assert decision.matched_blocks == 200, decision
    times.sort()
    return times[len(times) // 2] * 1e6, times[int(len(times) * 0.99)] * 1e6


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=2000)
    parser.add_argument("--run-blocks", type=int, default=8, help="blocks per BlockStored run")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=20_000, help="cached blocks per worker (memory)")
    parser.add_argument("--zmq", action="store_true", help="also over a loopback PUB/SUB pair")
    parser.add_argument("--sglang-pages", action="store_true", help="also SGLang's one event per 1-token page")
    parser.add_argument("--route-workers", type=int, default=64)
    parser.add_argument("--route-blocks", type=int, default=50_000, help="cached blocks per worker (routing)")
    args = parser.parse_args(argv)
    rate, held = ingest_rate(args.batches, args.block_size, args.run_blocks)
    print(f"ingest (decode + re-hash + index), one core: {rate:,.0f} block events/s ({held:,} blocks held)")
    if args.sglang_pages:
        rate, held = ingest_rate(args.batches // 8, args.block_size, args.run_blocks, page_size=1)
        print(f"ingest of SGLang pages (1 token, aggregated): {rate:,.0f} page events/s ({held:,} blocks held)")
    if args.zmq:
        zrate = asyncio.run(ingest_rate_zmq(args.batches, args.block_size, args.run_blocks))
        print(f"ingest over loopback ZMQ PUB/SUB: {zrate:,.0f} block events/s")
    per = index_memory(args.workers, args.blocks, args.block_size)
    print(f"memory: {per:,.0f} bytes per cached (block, worker) ({args.workers} workers x {args.blocks:,} blocks)")
    if args.route_workers:
        median, p99 = routing_decision(args.route_workers, args.route_blocks, args.block_size)
        print(
            f"kv_aware pick, {args.route_workers} workers x {args.route_blocks:,} blocks: {median:.0f} µs median, "
            f"{p99:.0f} µs p99"
        )


if __name__ == "__main__":
    main()
