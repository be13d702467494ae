"""Router decision cost: hash a 4,096-token prompt and pick a replica (`python -m benchmarks.router_bench`).

Runs over 8 and over 64 replicas by default. The fleet KV index is warm (each replica holds 2,000 blocks
of other prompts and one holds half of this prompt), loads are mixed, and the prompt differs every
iteration, so nothing is served from a cache that a live gateway would not have (the policies' own
common-prefix sketches see every iteration's prompt, as a gateway's would). Prints median and p90
microseconds per step and per policy, the kv_aware decision (hashing + pick) against its target, and the
machine's load average (the figures are only comparable with others measured under the same load).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from gateway.routing.fleet_view import FleetView
from gateway.routing.router import POLICY_NAMES, RouteRequest, make_policy
from kvroute.hashing import block_hashes

MODEL_ID = "bench"
TARGET_US = {8: 200, 64: 1000}  # the decision budget per fleet size


def warm_fleet(num_replicas: int, shared_prompt: list[int], rng: random.Random) -> FleetView:
    fleet = FleetView.empty([f"replica-{i}" for i in range(num_replicas)])
    for i, replica in enumerate(fleet.replicas):
        other = [rng.randrange(32_000) for _ in range(2_000 * 16)]
        fleet.kv_index.add(replica, block_hashes(other, model_id=MODEL_ID))
        fleet.loads[replica].in_flight = i % 4
    half = shared_prompt[: len(shared_prompt) // 2]
    fleet.kv_index.add(fleet.replicas[3], block_hashes(half, model_id=MODEL_ID))
    return fleet


def bench(num_tokens: int, num_replicas: int, iterations: int, seed: int = 0) -> dict[str, list[float]]:
    rng = random.Random(seed)
    base = [rng.randrange(32_000) for _ in range(num_tokens)]
    fleet = warm_fleet(num_replicas, base, rng)
    policies = {name: make_policy(name) for name in POLICY_NAMES}
    samples: dict[str, list[float]] = {name: [] for name in ("hash", *POLICY_NAMES)}
    for i in range(iterations):
        tokens = base[: num_tokens // 2] + [(t + i) % 32_000 for t in base[num_tokens // 2 :]]
        start = time.perf_counter()
        hashes = block_hashes(tokens, model_id=MODEL_ID)
        samples["hash"].append(time.perf_counter() - start)
        request = RouteRequest(f"req-{i}", hashes, num_tokens)
        for name, policy in policies.items():
            start = time.perf_counter()
            policy.observe(request, policy.pick(request, fleet))
            samples[name].append(time.perf_counter() - start)
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--replicas", default="8,64", help="comma list of fleet sizes (default 8,64)")
    parser.add_argument("--iterations", type=int, default=2000)
    args = parser.parse_args(argv)
    summary = []
    for replicas in (int(n) for n in args.replicas.split(",")):
        samples = bench(args.tokens, replicas, args.iterations)
        print(f"{args.tokens}-token prompt, {replicas} replicas, {args.iterations} iterations (µs)")
        print(f"{'step':<16}{'median':>10}{'p90':>10}")
        for name, values in samples.items():
            us = sorted(v * 1e6 for v in values)
            print(f"{name:<16}{statistics.median(us):>10.1f}{us[int(0.9 * len(us))]:>10.1f}")
        decision_us = (statistics.median(samples["hash"]) + statistics.median(samples["kv_aware"])) * 1e6
        target = TARGET_US.get(replicas)
        summary.append(
            f"kv_aware decision (hashing + pick), {replicas} replicas: {decision_us:.1f} µs median"
            + (f" ({decision_us / target:.2f} x the {target:,} µs target)" if target else "")
        )
        print()
    print("\n".join(summary))
    print("load average (1, 5, 15 min): " + ", ".join(f"{x:.2f}" for x in os.getloadavg()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
