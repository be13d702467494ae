"""The fleet replay: a trace through N simulated replicas, routed by the real router, on a simulated clock.

Each replica is a real `worker.kv_cache_manager.KVCacheManager` with `capacity_blocks` blocks. The cost
model:
  * a replica prefills one request at a time, in arrival order: TTFT = the wait for the replica's
    prefill + uncached prompt tokens x `prefill_us_per_token`;
  * decode then runs for `output_length` steps of `decode_ms_per_step`, concurrently with the
    replica's other requests;
  * a request holds its KV blocks (prompt + output - 1 tokens) from admission to its finish; a request
    that does not fit waits (in order) until finishing requests free blocks. Its prompt blocks are
    offered to the cache at admission (a later request on that replica prefills after it), the blocks
    of a known answer at finish (a multi-turn chat's next turn reuses them).
  * busy time of a replica = its prefill time + the time it has at least one request decoding;
    load_imbalance = max / mean busy time; busy_min_share = min / mean (a starved replica shows 0).
Mooncake traces: a block is 512 tokens, each hash id one cacheable block, the last partial one
included (allocated as if full; a hit on it counts its real tokens). Token-id traces: chained hashes
of full blocks (kvroute.hashing, model id "replay", the request's tenant salt), and at least the
prompt's last token is always computed, as the worker does.

The router sees, per replica, in_flight (routed, not finished), queued (prefill not started) and
kv_usage. With G gateways (requests dealt round-robin by arrival) and `shared_view`, every gateway
reads the fleet's KV index (fed by the block pools' KV events) and loads, as through Redis; without
it each gateway sees only its own decisions: its own in-flight counts and a `LearnedKVIndex`.
Two yardsticks are printed with every replay: the ideal (one unlimited cache, in arrival order, no
routing) and the bounded oracle (loadtest.oracle: exact caches, longest prefix under a request-count
bound), which runs with every replay through one gateway with the exact fleet index.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from gateway.fleet import FleetView, ReplicaLoad
from gateway.kv_index import LearnedKVIndex
from gateway.router import POLICY_NAMES, RouteRequest, RoutingPolicy, make_policy
from kvroute.hashing import block_hashes, extend_block_hashes
from kvroute.prefix import common_prefix_length
from loadtest.oracle import BoundedOracle
from loadtest.traces import Trace, TraceRequest
from worker.kv_cache_manager import KVCacheManager

REPLAY_MODEL_ID = "replay"
ORACLE = BoundedOracle.name
REPLAY_POLICIES = (*POLICY_NAMES, ORACLE)


class ReplayError(ValueError):
    """A configuration or trace the replay cannot run (bad sizes, a request larger than a replica)."""


@dataclass(frozen=True)
class ReplayConfig:
    replicas: int = 4
    policies: tuple[str, ...] = ("round_robin", "prefix", "kv_aware")
    capacity_blocks: int = 10_000
    gateways: int = 1
    shared_view: bool = False
    prefill_us_per_token: float = 32.0
    decode_ms_per_step: float = 20.0
    epsilon: float = 0.5
    min_in_flight: int = 3
    seed: int = 0
    progress: bool = False
    # The replicas' names (default replica-0, replica-1, ...): a live fleet's worker ids put the replay's
    # hash ring where the gateway's is, so a session's key has the same owner in both.
    replica_names: tuple[str, ...] | None = None
    # The model id block hashes are computed with: a live fleet's (e.g. "sim-v1") gives the gateway's very
    # hashes, hence its ring keys; a salt is the trace request's, as the gateway would compute it.
    model_id: str = REPLAY_MODEL_ID

    def __post_init__(self) -> None:
        for name in ("replicas", "capacity_blocks", "gateways", "min_in_flight"):
            if getattr(self, name) < 1:
                raise ReplayError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.replica_names is not None and (
            len(self.replica_names) != self.replicas or len(set(self.replica_names)) != self.replicas
        ):
            raise ReplayError(f"replica_names must be {self.replicas} distinct names, got {list(self.replica_names)}")
        for name in ("prefill_us_per_token", "decode_ms_per_step", "epsilon"):
            if getattr(self, name) < 0:
                raise ReplayError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not self.policies:
            raise ReplayError("no policies given")
        for policy in self.policies:
            if policy not in REPLAY_POLICIES:
                raise ReplayError(f"unknown policy {policy!r}; choose from {', '.join(REPLAY_POLICIES)}")

    @property
    def policy_options(self) -> dict[str, float | int]:
        return {"epsilon": self.epsilon, "min_in_flight": self.min_in_flight, "seed": self.seed}


def make_replay_policy(name: str, config: ReplayConfig) -> RoutingPolicy:
    """A fresh policy: the router's by name, or the replay's bounded oracle."""
    if name == ORACLE:
        return BoundedOracle()
    return make_policy(name, **config.policy_options)


@dataclass
class PolicyResult:
    policy: str
    prefill_tokens: int
    hit_rate: float
    load_imbalance: float  # busy time, max / mean
    busy_min_share: float  # busy time, min / mean
    ttft_ms: dict[str, float]
    per_replica_requests: list[int]
    per_replica_busy_s: list[float]
    reasons: dict[str, int]
    cached_tokens: list[int] = field(repr=False)  # per request, in trace order
    replica_of: list[int] = field(repr=False)  # per request: the replica's index
    ttft_samples_ms: list[float] = field(repr=False)
    vs_one_gateway: float | None = None  # relative hit-rate loss against one gateway (G > 1 only)

    def to_json(self) -> dict:
        out = {
            "prefill_tokens": self.prefill_tokens,
            "hit_rate": round(self.hit_rate, 6),
            "load_imbalance": round(self.load_imbalance, 4),
            "busy_min_share": round(self.busy_min_share, 4),
            "ttft_ms": {k: round(v, 3) for k, v in self.ttft_ms.items()},
            "per_replica_requests": self.per_replica_requests,
            "per_replica_busy_s": [round(b, 3) for b in self.per_replica_busy_s],
            "reasons": self.reasons,
        }
        if self.vs_one_gateway is not None:
            out["vs_one_gateway"] = round(self.vs_one_gateway, 6)
        return out


@dataclass(frozen=True)
class Divergence:
    """Where each request first differs from the previous request of its session (or app)."""

    unit: str  # "tokens" or "blocks"
    first_of_session: int
    buckets: dict[str, int]  # "lo-hi" (inclusive) -> requests

    def to_json(self) -> dict:
        return {"unit": self.unit, "first_of_session": self.first_of_session, "buckets": self.buckets}


@dataclass
class ReplayResult:
    trace: str
    requests: int
    input_tokens: int
    config: ReplayConfig
    ideal_prefill_tokens: int
    policies: dict[str, PolicyResult]
    divergence: Divergence

    @property
    def ideal_hit_rate(self) -> float:
        return 1 - self.ideal_prefill_tokens / self.input_tokens

    @property
    def oracle_prefill_tokens(self) -> int:
        return self.policies[ORACLE].prefill_tokens

    def to_json(self) -> dict:
        return {
            "trace": self.trace,
            "requests": self.requests,
            "input_tokens": self.input_tokens,
            "replicas": self.config.replicas,
            "capacity_blocks": self.config.capacity_blocks,
            "gateways": self.config.gateways,
            "shared_view": self.config.shared_view,
            "prefill_us_per_token": self.config.prefill_us_per_token,
            "decode_ms_per_step": self.config.decode_ms_per_step,
            "ideal": {"prefill_tokens": self.ideal_prefill_tokens, "hit_rate": round(self.ideal_hit_rate, 6)},
            "policies": {name: result.to_json() for name, result in self.policies.items()},
            "first_divergence": self.divergence.to_json(),
        }


# -- the trace, prepared once for every policy --------------------------------------------------


@dataclass(frozen=True)
class _Prepared:
    index: int
    arrival_ms: float
    input_length: int
    output_length: int
    route: RouteRequest
    usable_blocks: int  # how many leading blocks a cache hit may cover
    kv_tokens: int  # tokens of KV the request holds while it runs
    finish_keys: Sequence  # keys of every full block at finish (prompt + known answer)
    session: str


def _prepare(trace: Trace, model_id: str = REPLAY_MODEL_ID) -> list[_Prepared]:
    out = []
    for i, req in enumerate(trace.requests):
        if trace.kind == "mooncake":
            keys: Sequence = req.hash_ids
            usable = len(keys)
            finish_keys = keys
            kv_tokens = len(keys) * trace.block_size + max(req.output_length - 1, 0)
            session = str(keys[min(1, len(keys) - 1)])
        else:
            keys = block_hashes(
                req.token_ids, model_id=model_id, cache_salt=req.cache_salt, block_size=trace.block_size
            )
            usable = (req.input_length - 1) // trace.block_size
            finish_keys = keys + _answer_hashes(req, keys, trace.block_size, model_id)
            kv_tokens = req.input_length + max(req.output_length - 1, 0)
            session = req.session_id if req.session_id is not None else f"request-{i}"
        route = RouteRequest(f"req-{i}", keys, req.input_length, req.session_id)
        out.append(
            _Prepared(
                i, req.arrival_ms, req.input_length, req.output_length, route, usable, kv_tokens, finish_keys, session
            )
        )
    return out


def _answer_hashes(req: TraceRequest, prompt_keys: list, block_size: int, model_id: str) -> list:
    if not req.output_token_ids:
        return []
    # Only the answer's first output_length - 1 tokens get KV (the last sampled token is never fed back).
    kv_tokens = (req.token_ids + req.output_token_ids)[: req.input_length + max(req.output_length - 1, 0)]
    parent = prompt_keys[-1] if prompt_keys else None
    tail = kv_tokens[len(prompt_keys) * block_size :]
    if parent is None:
        return block_hashes(tail, model_id=model_id, cache_salt=req.cache_salt, block_size=block_size)
    return extend_block_hashes(parent, tail, block_size)


def _cached_tokens(prepared: _Prepared, matched_blocks: int, block_size: int) -> int:
    return min(matched_blocks * block_size, prepared.input_length)


def ideal_prefill_tokens(prepared: Sequence[_Prepared], block_size: int) -> int:
    """Prefill tokens with one unlimited cache, requests in arrival order, no routing."""
    seen: set = set()
    total = 0
    for p in prepared:
        depth = 0
        keys = p.route.block_hashes
        while depth < p.usable_blocks and keys[depth] in seen:
            depth += 1
        total += p.input_length - _cached_tokens(p, depth, block_size)
        seen.update(p.finish_keys)
    return total


# -- simulated replicas ---------------------------------------------------------------------------


class _Replica:
    """One simulated replica: a real KV cache manager, a FIFO prefill queue and decode accounting."""

    def __init__(self, name: str, capacity_blocks: int, block_size: int) -> None:
        self.name = name
        self.manager = KVCacheManager(capacity_blocks, block_size)
        self.block_size = block_size
        self.prefill_free_at = 0.0
        self.pending_prefill: deque[float] = deque()  # start times of admitted, not yet started prefills
        self.waiting: deque[tuple[_Prepared, int]] = deque()  # (request, gateway) short of KV blocks
        self.in_flight = 0
        self.requests = 0
        self.prefill_ms = 0.0
        self.decode_ms = 0.0
        self._decode_span = (0.0, 0.0)  # the current union of decode intervals (they start in order)

    def queued(self, now: float) -> int:
        while self.pending_prefill and self.pending_prefill[0] <= now:
            self.pending_prefill.popleft()
        return len(self.pending_prefill) + len(self.waiting)

    def add_decode(self, start: float, end: float) -> None:
        span_start, span_end = self._decode_span
        if start > span_end:
            self.decode_ms += span_end - span_start
            self._decode_span = (start, end)
        else:
            self._decode_span = (span_start, max(span_end, end))

    @property
    def busy_ms(self) -> float:
        return self.prefill_ms + self.decode_ms + self._decode_span[1] - self._decode_span[0]


@dataclass
class _Gateway:
    policy: RoutingPolicy
    view: FleetView
    learned: LearnedKVIndex | None  # None: reads the shared fleet view


class Simulation:
    """One policy's run over a prepared trace: `replicas` (each with its `manager`), the shared `fleet`
    view and its KV index stay readable after `run()` (tests check the books balance)."""

    def __init__(
        self,
        trace: Trace,
        prepared: list[_Prepared],
        policy: str,
        gateways: int,
        shared: bool,
        config: ReplayConfig,
        tick: Callable[[], None],
    ) -> None:
        self.config = config
        self.block_size = trace.block_size
        self.prepared = prepared
        self.tick = tick
        n = config.replicas
        width = len(str(n - 1))
        names = config.replica_names or tuple(f"replica-{i:0{width}d}" for i in range(n))
        self.replicas = [_Replica(name, config.capacity_blocks, trace.block_size) for name in names]
        names = tuple(r.name for r in self.replicas)
        self.fleet = FleetView.empty(names)
        self.feed_index = shared or gateways == 1
        self.gateways = []
        for _ in range(gateways):
            if shared or gateways == 1:
                self.gateways.append(_Gateway(make_replay_policy(policy, config), self.fleet, None))
            else:
                learned = LearnedKVIndex(names, config.capacity_blocks)
                view = FleetView(names, {r: ReplicaLoad() for r in names}, learned)
                self.gateways.append(_Gateway(make_replay_policy(policy, config), view, learned))
        self.finishes: list[tuple[float, int, int, int]] = []  # (time, request, replica, gateway)
        self.cached = [0] * len(prepared)
        self.replica_of = [0] * len(prepared)
        self.ttft = [0.0] * len(prepared)
        self.reasons: Counter[str] = Counter()

    def run(self) -> None:
        for p in self.prepared:
            self._finish_until(p.arrival_ms)
            g = p.index % len(self.gateways)
            gateway = self.gateways[g]
            if gateway.learned is None:
                self._refresh_loads(p.arrival_ms)
            decision = gateway.policy.pick(p.route, gateway.view)
            gateway.policy.observe(p.route, decision)
            self.reasons[decision.reason] += 1
            r = self.fleet.index_of[decision.replica]
            self.replica_of[p.index] = r
            if gateway.learned is not None:
                gateway.learned.record_routed(decision.replica, p.route.block_hashes)
                gateway.view.loads[decision.replica].in_flight += 1
            replica = self.replicas[r]
            replica.in_flight += 1
            replica.requests += 1
            if replica.waiting or not self._admit(replica, p, g, p.arrival_ms):
                replica.waiting.append((p, g))
            self.tick()
        self._finish_until(float("inf"))

    def _refresh_loads(self, now: float) -> None:
        for replica in self.replicas:
            load = self.fleet.loads[replica.name]
            load.in_flight = replica.in_flight
            load.queued = replica.queued(now)
            load.kv_usage = replica.manager.pool.usage

    def _admit(self, replica: _Replica, p: _Prepared, gateway: int, now: float) -> bool:
        manager = replica.manager
        req_id = p.route.request_id
        hit = manager.find_longest_cache_hit(p.route.block_hashes[: p.usable_blocks])
        if manager.allocate_slots(req_id, p.kv_tokens, hit) is None:
            return False
        manager.cache_blocks(req_id, p.route.block_hashes)
        self._publish(replica)
        cached = _cached_tokens(p, len(hit), self.block_size)
        start = max(now, replica.prefill_free_at)
        end = start + (p.input_length - cached) * self.config.prefill_us_per_token / 1000
        replica.prefill_free_at = end
        replica.prefill_ms += end - start
        if start > now:
            replica.pending_prefill.append(start)
        finish = end + p.output_length * self.config.decode_ms_per_step
        replica.add_decode(end, finish)
        self.cached[p.index] = cached
        self.ttft[p.index] = end - p.arrival_ms
        heapq.heappush(self.finishes, (finish, p.index, self.fleet.index_of[replica.name], gateway))
        return True

    def _finish_until(self, now: float) -> None:
        while self.finishes and self.finishes[0][0] <= now:
            at, index, r, g = heapq.heappop(self.finishes)
            replica = self.replicas[r]
            p = self.prepared[index]
            replica.manager.cache_blocks(p.route.request_id, p.finish_keys)
            replica.manager.free(p.route.request_id)
            self._publish(replica)
            replica.in_flight -= 1
            if self.gateways[g].learned is not None:
                self.gateways[g].view.loads[replica.name].in_flight -= 1
            while replica.waiting and self._admit(replica, replica.waiting[0][0], replica.waiting[0][1], at):
                replica.waiting.popleft()

    def _publish(self, replica: _Replica) -> None:
        events = replica.manager.drain_events()
        if self.feed_index and events and not self.fleet.kv_index.apply(replica.name, events):
            seq, hashes = replica.manager.pool.snapshot()
            self.fleet.kv_index.resync(replica.name, seq, hashes)

    def result(self, policy: str) -> PolicyResult:
        input_tokens = sum(p.input_length for p in self.prepared)
        cached = sum(self.cached)
        busy = [r.busy_ms for r in self.replicas]
        mean_busy = sum(busy) / len(busy)
        ttft = np.asarray(self.ttft)
        percentiles = {f"p{q}": float(np.percentile(ttft, q)) for q in (50, 90, 99)}
        return PolicyResult(
            policy=policy,
            prefill_tokens=input_tokens - cached,
            hit_rate=cached / input_tokens,
            load_imbalance=max(busy) / mean_busy if mean_busy > 0 else 1.0,
            busy_min_share=min(busy) / mean_busy if mean_busy > 0 else 1.0,
            ttft_ms=percentiles,
            per_replica_requests=[r.requests for r in self.replicas],
            per_replica_busy_s=[b / 1000 for b in busy],
            reasons=dict(sorted(self.reasons.items())),
            cached_tokens=self.cached,
            replica_of=self.replica_of,
            ttft_samples_ms=self.ttft,
        )


# -- the public API -------------------------------------------------------------------------------


def replay(trace: Trace, config: ReplayConfig) -> ReplayResult:
    """Replay `trace` once per policy (and, with G > 1 gateways, once more with one gateway), and once
    with the bounded oracle (one gateway) whether or not it is among the policies; it is the last result."""
    prepared = _prepare(trace, config.model_id)
    _check_fits(trace, prepared, config)
    policies = [p for p in config.policies if p != ORACLE]
    runs = len(policies) * (2 if config.gateways > 1 else 1) + 1
    with _progress(len(prepared) * runs, config.progress) as bar:
        results = {}
        for policy in policies:
            results[policy] = _run(trace, prepared, policy, config.gateways, config.shared_view, config, bar)
            if config.gateways > 1:
                one = _run(trace, prepared, policy, 1, True, config, bar)
                loss = (one.hit_rate - results[policy].hit_rate) / one.hit_rate if one.hit_rate else 0.0
                results[policy].vs_one_gateway = loss
        results[ORACLE] = _run(trace, prepared, ORACLE, 1, True, config, bar)
    return ReplayResult(
        trace=trace.name,
        requests=len(prepared),
        input_tokens=trace.input_tokens,
        config=config,
        ideal_prefill_tokens=ideal_prefill_tokens(prepared, trace.block_size),
        policies=results,
        divergence=first_divergence(trace),
    )


def _run(
    trace: Trace, prepared: list[_Prepared], policy: str, gateways: int, shared: bool, config: ReplayConfig, bar
) -> PolicyResult:
    sim = Simulation(trace, prepared, policy, gateways, shared, config, bar.update)
    sim.run()
    return sim.result(policy)


def simulate(trace: Trace, policy: str, config: ReplayConfig) -> Simulation:
    """Run one policy through one gateway (the shared view) and return the finished simulation."""
    prepared = _prepare(trace, config.model_id)
    _check_fits(trace, prepared, config)
    sim = Simulation(trace, prepared, policy, 1, True, config, lambda: None)
    sim.run()
    return sim


def _check_fits(trace: Trace, prepared: list[_Prepared], config: ReplayConfig) -> None:
    for p in prepared:
        need = -(-p.kv_tokens // trace.block_size)
        if need > config.capacity_blocks:
            raise ReplayError(
                f"request {p.index + 1} needs {need} KV blocks of {trace.block_size} tokens, "
                f"more than --capacity-blocks {config.capacity_blocks}"
            )


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def __enter__(self) -> _NoBar:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="replay", leave=False, mininterval=0.5, disable=None)


def first_divergence(trace: Trace) -> Divergence:
    """Histogram of the position (tokens, or blocks for Mooncake) where each request first differs
    from the previous request of its session (Mooncake: of its conversation, the first two blocks)."""
    mooncake = trace.kind == "mooncake"
    last: dict[str, tuple[int, ...]] = {}
    buckets: Counter[tuple[int, int]] = Counter()
    first = 0
    for i, req in enumerate(trace.requests):
        seq = req.hash_ids if mooncake else req.token_ids
        if mooncake:
            session = str(seq[min(1, len(seq) - 1)])
        else:
            session = req.session_id if req.session_id is not None else f"request-{i}"
        previous = last.get(session)
        last[session] = seq
        if previous is None:
            first += 1
            continue
        buckets[_bucket(common_prefix_length(previous, seq))] += 1
    labels = {f"{lo}-{hi}": buckets[(lo, hi)] for lo, hi in sorted(buckets)}
    return Divergence("blocks" if mooncake else "tokens", first, labels)


def _bucket(position: int) -> tuple[int, int]:
    if position == 0:
        return (0, 0)
    lo = 1 << (position.bit_length() - 1)
    return (lo, 2 * lo - 1)
