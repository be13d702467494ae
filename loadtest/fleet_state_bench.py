"""Where should the fleet's KV index live? `python -m loadtest.fleet_state_bench` measures both layouts.

(a) llm-d's layout: the index in Redis, one hash per block (field per worker); a gateway looks a request's
    blocks up in Redis (pipelined) on every request.
(b) kvroute's: workers' KV events in Redis Streams (+ a snapshot key); each gateway applies them to a
    KV index in its own memory and looks requests up there.

1. Lookup cost per request, with a real redis-server on this machine (loopback: a lower bound; every
   network round trip adds to (a) only): a 4,096-token prompt (256 blocks) over 8 workers holding 2,000
   blocks each, half of the prompt cached on one. (a) as one pipeline of HKEYS, and in pipelines of 32
   that stop at the first chunk with a miss; (b) KVIndex.match. Also the write cost per KV event.
2. Hit rate and load imbalance with 1, 2 and 4 gateways, on a simulated clock over real block managers
   (worker.kv_cache_manager) and the real router and fleet books: (a) sees what the reporters published
   (every 50 ms), (b) additionally waits for its gateway's next poll (every 100 ms, phases spread), and a
   "private" gateway sees no events at all (its own routing decisions only). Load: "combined" takes the
   workers' reported running + waiting (published with the events) plus the gateway's own requests since,
   "own" counts this gateway's requests only. The workload: agent sessions on one 2,000-token tool prompt,
   each turn adding to the session's history after a short think time, at about 4 requests in flight per
   worker. Imbalance: the mean over arrivals of max / mean of the workers' true in-flight counts.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import random
import statistics
import time
from dataclasses import dataclass, field

from gateway.fleet import FleetView
from gateway.fleet_state import FleetBook, FleetIdentity
from gateway.kv_index import KVIndex, LearnedKVIndex
from gateway.router import RouteRequest, make_policy
from kvroute.fleet_keys import FleetKeys, pack_hashes, redis_client, stream_id
from kvroute.hashing import block_hashes
from worker.kv_cache_manager import KVCacheManager

MODEL_ID = "bench"
BLOCK = 16
PUBLISH_S = 0.05  # worker.reporter's publish_interval
POLL_S = 0.1  # gateway.redis_fleet's poll_interval


# -- 1. lookup and write cost against a real Redis --------------------------------------------------------


async def lookup_costs(redis_url: str, workers: int, blocks_each: int, prompt_tokens: int, iterations: int) -> dict:
    rng = random.Random(0)
    client = redis_client(redis_url)
    await client.flushdb()
    names = [f"worker-{i}" for i in range(workers)]
    index = KVIndex(names)
    prompt = [rng.randrange(32_000) for _ in range(prompt_tokens)]
    pipe = client.pipeline(transaction=False)
    for name in names:
        held = block_hashes([rng.randrange(32_000) for _ in range(blocks_each * BLOCK)], model_id=MODEL_ID)
        index.add(name, held)
        for h in held:
            pipe.hset(b"bench:blk:" + h, name, b"1")
    half = block_hashes(prompt[: prompt_tokens // 2], model_id=MODEL_ID)
    index.add(names[3], half)
    for h in half:
        pipe.hset(b"bench:blk:" + h, names[3], b"1")
    await pipe.execute()

    async def redis_match(hashes: list[bytes], chunk: int) -> list[int]:
        matched = dict.fromkeys(names, 0)
        alive = set(names)
        for start in range(0, len(hashes), chunk):
            p = client.pipeline(transaction=False)
            for h in hashes[start : start + chunk]:
                p.hkeys(b"bench:blk:" + h)
            for depth, holders in enumerate(await p.execute(), start):
                alive &= {x.decode() for x in holders}
                for name in alive:
                    matched[name] = depth + 1
                if not alive:
                    return [matched[n] for n in names]
        return [matched[n] for n in names]

    samples: dict[str, list[float]] = {"(a) redis, 1 pipeline": [], "(a) redis, 32/pipeline": [], "(b) memory": []}
    for i in range(iterations):
        tokens = prompt[: prompt_tokens // 2] + [(t + i) % 32_000 for t in prompt[prompt_tokens // 2 :]]
        hashes = block_hashes(tokens, model_id=MODEL_ID)
        start = time.perf_counter()
        a = await redis_match(hashes, len(hashes))
        samples["(a) redis, 1 pipeline"].append(time.perf_counter() - start)
        start = time.perf_counter()
        a32 = await redis_match(hashes, 32)
        samples["(a) redis, 32/pipeline"].append(time.perf_counter() - start)
        start = time.perf_counter()
        b = index.match(hashes)
        samples["(b) memory"].append(time.perf_counter() - start)
        assert a == a32 == b, (a, a32, b)

    # Writes per KV event of 4 blocks: (a) one HSET per block, (b) one XADD per event.
    events = [block_hashes([rng.randrange(32_000) for _ in range(4 * BLOCK)], model_id=MODEL_ID) for _ in range(2000)]
    keys = FleetKeys("bench")
    start = time.perf_counter()
    p = client.pipeline(transaction=False)
    for event in events:
        for h in event:
            p.hset(b"bench:w:" + h, "worker-0", b"1")
    await p.execute()
    write_a = (time.perf_counter() - start) / len(events)
    start = time.perf_counter()
    p = client.pipeline(transaction=False)
    for seq, event in enumerate(events, 1):
        p.xadd(keys.events("worker-0", 1), {"k": "stored", "h": pack_hashes(event)}, id=stream_id(seq))
    await p.execute()
    write_b = (time.perf_counter() - start) / len(events)
    memory = await client.info("memory")
    await client.flushdb()
    await client.aclose()
    return {
        "lookup_us": {k: _stats_us(v) for k, v in samples.items()},
        "write_us_per_event": {"(a) HSET per block": write_a * 1e6, "(b) XADD per event": write_b * 1e6},
        "redis_used_memory_mb": memory["used_memory"] / 2**20,
    }


def _stats_us(values: list[float]) -> dict[str, float]:
    us = sorted(v * 1e6 for v in values)
    return {"median": statistics.median(us), "p99": us[min(len(us) - 1, int(0.99 * len(us)))]}


# -- 2. hit rate and imbalance with several gateways (simulated clock) ---------------------------------------


@dataclass
class Request:
    arrival: float
    tokens: list[int]
    hashes: list[bytes]
    output_tokens: int


def hot_prompt_workload(n: int, seed: int, rate: float) -> list[Request]:
    """One 2,000-token prompt on every request, a distinct 100-token question each (DESIGN §7's hot prefix)."""
    rng = random.Random(seed)
    hot = [rng.randrange(32_000) for _ in range(2000)]
    requests, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        tokens = hot + [rng.randrange(32_000) for _ in range(100)]
        requests.append(Request(t, tokens, block_hashes(tokens, model_id=MODEL_ID), rng.randrange(20, 200)))
    return requests


def agent_workload(n: int, sessions: int, seed: int, rate: float) -> list[Request]:
    rng = random.Random(seed)
    tools = [rng.randrange(32_000) for _ in range(2000)]
    histories = [tools + [rng.randrange(32_000) for _ in range(300)] for _ in range(sessions)]
    requests, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        s = rng.randrange(sessions)
        histories[s] = histories[s] + [rng.randrange(32_000) for _ in range(rng.randrange(50, 200))]
        if len(histories[s]) > 6000:  # the session ends; a new one takes its slot
            histories[s] = tools + [rng.randrange(32_000) for _ in range(300)]
        tokens = histories[s]
        requests.append(Request(t, tokens, block_hashes(tokens, model_id=MODEL_ID), rng.randrange(20, 200)))
    return requests


@dataclass
class Worker:
    name: str
    cache: KVCacheManager
    running: int = 0
    unpublished: list = field(default_factory=list)


def simulate(
    requests: list[Request], num_workers: int, num_gateways: int, index_mode: str, load_mode: str,
    capacity_blocks: int, policy_name: str = "kv_aware",
) -> dict[str, float]:  # fmt: skip
    names = [f"w{i}" for i in range(num_workers)]
    workers = {n: Worker(n, KVCacheManager(num_blocks=capacity_blocks, block_size=BLOCK)) for n in names}
    identity = FleetIdentity(MODEL_ID, BLOCK, "h", "t")
    books = [FleetBook(identity) for _ in range(num_gateways)]
    for book in books:
        for name in names:
            book.admit(name, name, 1, MODEL_ID, BLOCK, 8192, "h", "t")
    shared = KVIndex(names)  # (a): what Redis holds
    if index_mode == "redis-index":
        views = [FleetView(book.fleet.replicas, book.fleet.loads, shared) for book in books]
    elif index_mode == "private":
        views = [
            FleetView(book.fleet.replicas, book.fleet.loads, LearnedKVIndex(names, capacity_blocks)) for book in books
        ]
    else:
        views = [book.fleet for book in books]
    policies = [make_policy(policy_name) for _ in books]
    stream: dict[str, list] = {n: [] for n in names}  # published events, per worker
    read_upto = [dict.fromkeys(names, 0) for _ in books]  # (b): how far each gateway has applied
    reports: dict[str, tuple[int, int]] = {}  # worker -> (report number, running) as last published
    taken = [dict.fromkeys(names, -1) for _ in books]

    queue: list[tuple[float, int, str, object]] = []
    order = 0

    def push(at: float, kind: str, payload: object) -> None:
        nonlocal order
        order += 1
        heapq.heappush(queue, (at, order, kind, payload))

    for i, request in enumerate(requests):
        push(request.arrival, "arrive", i)
    end = requests[-1].arrival
    for k in range(int(end / PUBLISH_S) + 2):
        push(k * PUBLISH_S, "publish", k)
    for g in range(num_gateways):
        phase = POLL_S * g / num_gateways
        for k in range(int(end / POLL_S) + 2):
            push(phase + k * POLL_S, "poll", g)

    prompt_tokens = cached_tokens = 0
    imbalance: list[float] = []
    peak = 0
    while queue:
        now, _, kind, payload = heapq.heappop(queue)
        if kind == "publish":
            for w in workers.values():
                events = w.unpublished
                w.unpublished = []
                stream[w.name].extend(events)
                shared.apply(w.name, events)
                reports[w.name] = (payload, w.running)
        elif kind == "poll":
            g = payload
            for name in names:
                if index_mode == "streams":
                    books[g].apply_events(name, 1, stream[name][read_upto[g][name] :])
                    read_upto[g][name] = len(stream[name])
                if load_mode == "combined" and name in reports and reports[name][0] != taken[g][name]:
                    taken[g][name] = reports[name][0]
                    books[g].report_load(name, 1, reports[name][1], 0, 0.0)
        elif kind == "arrive":
            i = payload
            request = requests[i]
            g = i % num_gateways
            running = [w.running for w in workers.values()]
            route = RouteRequest(f"r{i}", request.hashes, len(request.tokens))
            decision = policies[g].pick(route, views[g])
            policies[g].observe(route, decision)
            if index_mode == "private":
                views[g].kv_index.record_routed(decision.replica, request.hashes)
            worker = workers[decision.replica]
            hit = worker.cache.get_computed_blocks(request.hashes, len(request.tokens))
            if worker.cache.allocate_slots(f"r{i}", len(request.tokens), hit.blocks) is None:
                raise RuntimeError("capacity_blocks is too small for the requests in flight")
            worker.cache.cache_blocks(f"r{i}", request.hashes)
            worker.unpublished.extend(worker.cache.drain_events())
            worker.running += 1
            books[g].on_dispatch(decision.replica)
            prompt_tokens += len(request.tokens)
            cached_tokens += hit.num_tokens
            mean = (sum(running) + 1) / len(running)
            running[names.index(decision.replica)] += 1
            imbalance.append(max(running) / mean)
            peak = max(peak, max(running))
            duration = 40e-6 * (len(request.tokens) - hit.num_tokens) + 0.02 * request.output_tokens
            push(now + duration, "finish", (i, decision.replica, g))
        else:
            i, name, g = payload
            worker = workers[name]
            worker.cache.free(f"r{i}")
            worker.unpublished.extend(worker.cache.drain_events())
            worker.running -= 1
            books[g].on_finish(name)
    return {
        "hit_rate": cached_tokens / prompt_tokens,
        "imbalance": statistics.mean(imbalance),
        "peak_in_flight": peak,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis", help="a Redis URL to measure against (default: start redis-server here)")
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)

    server = None
    if args.redis is None:
        from launch.redis_server import RedisServer

        server = RedisServer()
        server.start()
    try:
        costs = asyncio.run(lookup_costs(args.redis or server.url, args.workers, 2000, 4096, args.iterations))
    finally:
        if server is not None:
            server.close()
    print(f"1. lookup of a 4,096-token prompt over {args.workers} workers (µs; Redis on loopback, shared machine)")
    for name, s in costs["lookup_us"].items():
        print(f"   {name:<24} median {s['median']:>9.1f}   p99 {s['p99']:>9.1f}")
    memory_us = costs["lookup_us"]["(b) memory"]["median"]
    for name in ("(a) redis, 1 pipeline", "(a) redis, 32/pipeline"):
        print(f"   {name} / (b): {costs['lookup_us'][name]['median'] / memory_us:.0f}x")
    for name, us in costs["write_us_per_event"].items():
        print(f"   write, {name:<22} {us:>7.1f} µs per 4-block event")

    rate = args.workers * 4 / 2.2  # about 4 in flight per worker at a mean request time of ~2.2 s
    workloads = {
        "agents": agent_workload(args.requests, sessions=64, seed=1, rate=rate),
        "hot-prompt": hot_prompt_workload(args.requests, seed=2, rate=rate),
    }
    print(f"\n2. {args.requests} requests per workload, {args.workers} workers, kv_aware (simulated clock)")
    header = ("workload", "gateways", "index", "load", "hit rate", "imbalance", "peak")
    print("   {:<11} {:>8}  {:<12} {:<9} {:>9} {:>10} {:>5}".format(*header))
    configs = [
        (workload, gateways, index_mode, load_mode)
        for workload in workloads
        for gateways in (1, 2, 4)
        for index_mode in ("redis-index", "streams", "private")
        for load_mode in ("combined", "own")
        if load_mode == "combined" or (index_mode == "streams" and gateways > 1)
    ]
    results = []
    for workload, gateways, index_mode, load_mode in configs:
        r = simulate(workloads[workload], args.workers, gateways, index_mode, load_mode, capacity_blocks=6000)
        results.append({"workload": workload, "gateways": gateways, "index": index_mode, "load": load_mode, **r})
        row = (workload, gateways, index_mode, load_mode, r["hit_rate"], r["imbalance"], r["peak_in_flight"])
        print("   {:<11} {:>8}  {:<12} {:<9} {:>9.3f} {:>10.2f} {:>5}".format(*row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"costs": costs, "simulation": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
