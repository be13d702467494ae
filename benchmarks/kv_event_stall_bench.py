"""How long one large KV-event batch holds the gateway's event loop (docs/engines.md, "Bounds"; not a timed test).

    python -m benchmarks.kv_event_stall_bench [--blocks 625000] [--per-event 1000]

One batch of `--blocks` blocks of 16 tokens (one sequence, `--per-event` blocks per BlockStored, token ids under
128 so the densest packing: 625,000 blocks are 10 M ids in 12.5 MiB, under the 16 MiB bound) is published on a
loopback PUB socket to a started `EngineEventSubscriber` at its default map bound (262,144 blocks, so most of
the batch is evicted as it goes). Prints the time until the book holds it and how late a 1 ms sleep on the same
loop woke meanwhile (p50, p99, max: the longest a request, a `/health`, would have waited), and the loop
thread's CPU time between two wake-ups (what the batch held the loop for, without the turns other processes
had on a loaded machine).
"""

from __future__ import annotations

import argparse
import asyncio
import time

import msgspec
import zmq
import zmq.asyncio

from gateway.fleet.engine_events import EngineEventSource, EngineEventSubscriber
from gateway.fleet.fleet_state import FleetBook, FleetIdentity
from kvroute.engine_kv_events import encode_seq
from kvroute.hashing import hash_fingerprint
from kvroute.heap import freeze_start_up_heap

BLOCK = 16


def batch(blocks: int, per_event: int) -> bytes:
    events, parent = [], None
    for start in range(0, blocks, per_event):
        hashes = list(range(1 + start, 1 + min(start + per_event, blocks)))
        tokens = [i % 100 for i in range(start * BLOCK, (start + len(hashes)) * BLOCK)]
        events.append({"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
                       "token_ids": tokens, "block_size": BLOCK})  # fmt: skip
        parent = hashes[-1]
    return msgspec.msgpack.encode([time.time(), events, 0])


async def late(gaps: list[float], held: list[float], last: list[float]) -> None:
    """Appends how late each 1 ms sleep woke (`gaps`) and the loop thread's CPU time since the last wake-up
    (`held`: what the loop was held for, whatever else the machine ran); `last`: the clocks at the last one."""
    while True:
        await asyncio.sleep(0.001)
        now, cpu = time.perf_counter(), time.thread_time()
        gaps.append(now - last[0] - 0.001)
        held.append(cpu - last[1])
        last[:] = [now, cpu]


async def measure(payload: bytes, blocks: int) -> None:
    identity = FleetIdentity("m", BLOCK, hash_fingerprint("m", BLOCK), "tok")
    book = FleetBook(identity)
    book.admit("w", "127.0.0.1:1", 1, "m", BLOCK, 1 << 30, identity.hash_fingerprint, "tok")
    pub = zmq.asyncio.Context.instance().socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    subscriber = EngineEventSubscriber(book, EngineEventSource("w", f"tcp://127.0.0.1:{port}"))
    await subscriber.start()
    await asyncio.sleep(0.5)  # connected and subscribed
    gaps: list[float] = []
    held: list[float] = []
    last = [time.perf_counter(), time.thread_time()]
    ticker = asyncio.create_task(late(gaps, held, last))
    began = time.perf_counter()
    await pub.send_multipart([b"", encode_seq(0), payload])
    while subscriber.counters.stored_blocks < blocks or book.fleet.kv_index.num_blocks("w") < min(blocks, 1 << 18):
        await asyncio.sleep(0.001)
    took = time.perf_counter() - began
    gaps.append(time.perf_counter() - last[0] - 0.001)  # a wait still under way (the whole apply, where unsliced)
    held.append(time.thread_time() - last[1])
    ticker.cancel()
    await subscriber.stop()
    pub.close(linger=0)
    print(f"{blocks} blocks ({len(payload) / 2**20:.1f} MiB) applied in {took:.2f} s ({len(gaps)} wake-ups)")
    for name, values in (("the loop woke late by", gaps), ("the loop was held (its CPU time) for", held)):
        values.sort()
        p50, p99 = (values[int(len(values) * q)] * 1e3 for q in (0.5, 0.99))
        print(f"  {name} p50 {p50:.1f} ms, p99 {p99:.1f} ms, max {values[-1] * 1e3:.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=625_000)
    parser.add_argument("--per-event", type=int, default=1_000, help="blocks per BlockStored")
    args = parser.parse_args()
    payload = batch(args.blocks, args.per_event)
    freeze_start_up_heap()  # as the gateway does after start-up
    asyncio.run(measure(payload, args.blocks))


if __name__ == "__main__":
    main()
