"""Where should the fleet's KV index live? `python -m benchmarks.fleet_state_bench` measures both layouts.

(a) llm-d's layout: the index in Redis, one hash per block (field per worker); a gateway looks a request's
    blocks up in Redis (pipelined) on every request.
(b) kvroute's: workers' KV events in Redis Streams (+ a snapshot key); each gateway applies them to a
    KV index in its own memory and looks requests up there.

1. Lookup cost per request, with a real redis-server on this machine (loopback: a lower bound; every
   network round trip adds to (a) only): a 4,096-token prompt (256 blocks) over 8 workers holding 2,000
   blocks each, half of the prompt cached on one. (a) as one pipeline of HKEYS, and in pipelines of 32
   that stop at the first chunk with a miss; (b) KVIndex.match. Also the write cost per KV event.
2. Hit rate and load imbalance with 1, 2 and 4 gateways, in the fleet simulator (sim/: the real engine with
   the sim runner's cost model as each worker, the real router and fleet books as each gateway, on a virtual
   clock): (a) sees what the reporters published (every 50 ms), (b) additionally waits for its gateway's next
   poll (every 100 ms, phases spread), and a "private" gateway sees no events at all (its own routing
   decisions only). Load: "combined" takes the workers' reported running + waiting (published with the
   events) at each poll plus the gateway's own requests since, "own" counts this gateway's requests only.
   The workload: agent sessions on one 2,000-token tool prompt, each turn adding to the session's history
   after a short think time, at about 4 requests in flight per worker. Imbalance: the mean over arrivals of
   max / mean of the workers' true in-flight counts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass

from gateway.routing.kv_index import KVIndex
from gateway.routing.router import make_policy
from kvroute.fleet_keys import FleetKeys, pack_hashes, redis_client, stream_id
from kvroute.hashing import block_hashes
from sim import FleetConfig, FleetSim, SimRequest, ViewTiming

MODEL_ID = "bench"
BLOCK = 16
PUBLISH_S = 0.05  # worker.reporter's publish_interval
POLL_S = 0.1  # gateway.fleet.redis_fleet's poll_interval


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

    def sim_request(self) -> SimRequest:
        return SimRequest(
            self.arrival, lambda: list(self.tokens), len(self.tokens), self.output_tokens, block_hashes=self.hashes
        )


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


LAYOUTS = {  # index layout -> the simulated gateways' KV index feed (sim.gateway.ViewTiming.index)
    "redis-index": "shared",
    "streams": "books",
    "private": "private",
}
LOADS = {"combined": "reported", "own": "own"}


def simulate(
    requests: list[Request], num_workers: int, num_gateways: int, index_mode: str, load_mode: str,
    capacity_blocks: int, policy_name: str = "kv_aware",
) -> dict[str, float]:  # fmt: skip
    """One layout through the fleet simulator (sim/): real engines as workers, real books and policies as
    gateways, with the reporters' publish interval and the gateways' poll interval."""
    timing = ViewTiming(LAYOUTS[index_mode], LOADS[load_mode], publish_s=PUBLISH_S, poll_s=POLL_S)
    config = FleetConfig(tuple(f"w{i}" for i in range(num_workers)), capacity_blocks, BLOCK, MODEL_ID, timing=timing)
    fleet = FleetSim(config, [make_policy(policy_name) for _ in range(num_gateways)])
    run = fleet.run([r.sim_request() for r in requests])
    prompt_tokens = sum(len(r.tokens) for r in requests)
    return {
        "hit_rate": sum(run.cached_tokens) / prompt_tokens,
        "imbalance": statistics.mean(run.imbalance),
        "peak_in_flight": run.peak_in_flight,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis", help="a Redis URL to measure against (default: start redis-server here)")
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--json", help="also write the figures to this file")
    args = parser.parse_args(argv)

    server, url = None, args.redis
    if url is None:
        from launch.redis_server import RedisServer

        server = RedisServer()
        server.start()
        url = server.url
    try:
        costs = asyncio.run(lookup_costs(url, args.workers, 2000, 4096, args.iterations))
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
