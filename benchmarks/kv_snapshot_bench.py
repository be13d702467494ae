"""What a KV snapshot and the worker token cost: a real worker (a `sim` pool filled with cached blocks) behind a
real gRPC server on loopback.

    python -m benchmarks.kv_snapshot_bench [--blocks 100000] [--calls 1500]

Prints the whole snapshot as one message would carry it (the engine-thread copy, the message and its size)
against the paged GetKVEvents (pages, the largest, the slowest round trip, the engine thread per page), and
GetStats latency without and with the token check (best of 3 rounds). docs/gateway.md quotes its figures.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import grpc

from gateway.worker_client import worker_stub
from kvroute.credentials import generate_secret
from kvroute.sampling import SamplingParams
from proto import worker_pb2
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.service import KV_SNAPSHOT_PAGE_BLOCKS, start_worker_server

MAX_MODEL_LEN = 4096


def filled_engine(num_blocks: int) -> LLMEngine:
    """A sim engine whose whole pool holds cached blocks (distinct chains of full blocks)."""
    config = EngineConfig(
        model="sim", num_kv_blocks=num_blocks, max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=8192,
        sim_prefill_us_per_token=0.0, sim_decode_ms_per_step=0.0,
    )  # fmt: skip
    engine = LLMEngine(config)
    prompt_len = MAX_MODEL_LEN - config.block_size
    chains = num_blocks // (prompt_len // config.block_size) + 1
    engine.generate([[k + 1] + [100 + i % 40000 for i in range(prompt_len - 1)] for k in range(chains)],
                    SamplingParams(max_tokens=1))  # fmt: skip
    return engine


async def stats_p50_ms(stub: object, calls: int) -> float:
    best = float("inf")
    for _ in range(3):
        latencies = []
        for _ in range(calls):
            start = time.perf_counter()
            await stub.GetStats(worker_pb2.GetStatsRequest())  # type: ignore[attr-defined]
            latencies.append(time.perf_counter() - start)
        best = min(best, sorted(latencies)[calls // 2] * 1e3)
    return best


async def main(num_blocks: int, calls: int) -> None:
    engine = filled_engine(num_blocks)
    cached = engine.kv_manager.pool.num_cached_blocks
    token = generate_secret()
    for server_token in (None, token):
        server = await start_worker_server(engine, port=0, auth_token=server_token, kv_snapshot_burst=1e6)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = worker_stub(channel, server_token)
                p50 = await stats_p50_ms(stub, calls)
                print(f"GetStats p50 {'with' if server_token else 'without'} the token check: {p50:.3f} ms")
                if server_token is None:
                    continue
                start = time.perf_counter()
                since = await server.engine.kv_events_since(0)
                copied = time.perf_counter()
                whole = worker_pb2.KVEventBatch(is_snapshot=True, snapshot_seq=since.latest_seq)
                whole.snapshot_hashes.extend(since.snapshot or ())
                built = time.perf_counter()
                print(f"whole snapshot of {cached} blocks: engine thread {1e3 * (copied - start):.1f} ms, message "
                      f"{1e3 * (built - copied):.1f} ms, {whole.ByteSize() / 2**20:.2f} MiB")  # fmt: skip
                start = time.perf_counter()
                pages, slowest, largest = 0, 0.0, 0
                request = worker_pb2.GetKVEventsRequest(after_seq=0)
                while True:
                    sent = time.perf_counter()
                    page = await stub.GetKVEvents(request)
                    pages, slowest = pages + 1, max(slowest, time.perf_counter() - sent)
                    largest = max(largest, page.ByteSize())
                    if not page.next_snapshot_cursor:
                        break
                    request = worker_pb2.GetKVEventsRequest(snapshot_cursor=page.next_snapshot_cursor)
                total = time.perf_counter() - start
                start = time.perf_counter()
                for _ in range(20):
                    engine.kv_manager.pool.snapshot_page(0, KV_SNAPSHOT_PAGE_BLOCKS)
                per_page = (time.perf_counter() - start) / 20
                print(f"paged: {pages} pages, largest {largest / 1024:.0f} KiB, {1e3 * total:.1f} ms in all, slowest "
                      f"round trip {1e3 * slowest:.2f} ms, engine thread {1e3 * per_page:.2f} ms per page")  # fmt: skip
        finally:
            await server.stop(drain_timeout=0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kv_snapshot_bench", description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=100_000, help="KV blocks in the pool, all cached")
    parser.add_argument("--calls", type=int, default=1500, help="GetStats calls per round")
    args = parser.parse_args()
    asyncio.run(main(args.blocks, args.calls))
