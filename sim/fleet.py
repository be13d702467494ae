"""The fleet simulator: requests through simulated gateways onto simulated replicas, on one virtual timeline.

Events, in time order (at equal times: step ends, then publishes, then polls, then arrivals):
  * arrival: request i goes to gateway i mod G, which picks a replica (`SimGateway.pick`); the replica queues
    it at once (no network in between);
  * step end (per busy replica): the step's outputs are delivered (first tokens, finishes: the request's
    gateway hears of it now), its KV events and load published, and the next step computed;
  * publish (every `publish_s`, when it is > 0): every replica's events and load since the last publish;
  * poll (every `poll_s` per gateway, phases spread, when it is > 0; or per gateway and replica, with
    `poll_each`; intervals drawn, with `poll_draw`): the gateway reads what was published.
With `publish_s` = `poll_s` = 0 every gateway reads a replica's events and load at the end of each of its steps.

Per request it records the replica, the policy's reason, the cached prompt tokens the engine reported (its
first admission's), the time to first token (the end of the step that sampled it, less the arrival), the time
queued (from its arrival at the engine, which is after the step in progress as on a live worker, to its first
schedule) and in prefill (first schedule to first token), and the finish; per replica its busy time (the sum
of its steps' costs), its requests, steps and preemptions; per arrival the in-flight imbalance (max / mean of
the replicas' requests routed and not finished, this one counted).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.fleet.fleet_state import FleetIdentity
from gateway.routing.kv_index import KVIndex
from gateway.routing.router import RouteRequest, RoutingPolicy
from kvroute.hashing import block_hashes as hash_blocks
from kvroute.kv_events import BlockKey
from sim.gateway import LoadReport, SimGateway, ViewTiming
from sim.replica import SimReplica
from worker.sim_runner import SimCostModel

_STEP, _PUBLISH, _POLL = 0, 1, 2  # event ranks at equal times; arrivals come last


@dataclass(frozen=True)
class SimRequest:
    """One request: when it arrives, its prompt (built when it arrives, so a long trace is never in memory
    at once), how many tokens it decodes and the answer it samples first (a trace's known answer; then
    tokens no other request has). `block_hashes`: the gateway's hashes of the prompt when already known."""

    arrival_s: float
    prompt: Callable[[], list[int]]
    num_prompt_tokens: int
    max_tokens: int
    answer: Sequence[int] = ()
    cache_salt: str = ""
    session_id: str | None = None
    block_hashes: Sequence[BlockKey] | None = None


@dataclass
class FleetRun:
    """What a run recorded (see the module docstring); per-request lists are in request order."""

    replicas: tuple[str, ...]
    replica_of: list[int]
    reasons: list[str]
    cached_tokens: list[int]
    ttft_s: list[float]
    finish_s: list[float]
    busy_s: list[float]
    requests_per_replica: list[int]
    imbalance: list[float] = field(repr=False)
    peak_in_flight: int = 0  # the most requests in flight on one replica at an arrival
    queue_s: list[float] = field(default_factory=list, repr=False)  # per request: at the engine to first scheduled
    prefill_s: list[float] = field(default_factory=list, repr=False)  # per request: first scheduled to first token
    steps: list[int] = field(default_factory=list)  # per replica: engine steps that computed tokens
    preemptions: list[int] = field(default_factory=list)  # per replica
    matched_blocks: list[int] = field(default_factory=list, repr=False)  # per request: the pick's matched blocks

    @property
    def reason_counts(self) -> dict[str, int]:
        return dict(sorted(Counter(self.reasons).items()))


@dataclass(frozen=True)
class FleetConfig:
    """The simulated fleet: replica names (sorted, as a FleetView holds them), cache and engine sizes, the
    cost model, the block hashes' model id and block size, and how stale the gateways' views are."""

    replicas: tuple[str, ...]
    capacity_blocks: int
    block_size: int = 16
    model_id: str = "replay"
    cost: SimCostModel = SimCostModel()
    timing: ViewTiming = ViewTiming()
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    watermark: float = 0.01
    step_overhead_s: float = 0.0  # per step beyond the cost model (sim.replica.SimReplica)


class FleetSim:
    """One run: `policies` (one per gateway) over `config`'s replicas. The replicas and gateways stay readable
    after `run()` (tests check the books balance)."""

    def __init__(self, config: FleetConfig, policies: Sequence[RoutingPolicy]) -> None:
        self.config = config
        names = tuple(sorted(config.replicas))
        self.names = names
        self.replicas = [
            SimReplica(
                name,
                config.capacity_blocks,
                config.block_size,
                config.cost,
                config.model_id,
                config.max_num_batched_tokens,
                config.max_num_seqs,
                config.watermark,
                step_overhead_s=config.step_overhead_s,
            )
            for name in names
        ]
        identity = FleetIdentity(config.model_id, config.block_size, "sim", "sim")
        self.shared_index = KVIndex(names)
        self.gateways = [
            SimGateway(names, policy, identity, config.timing, self.shared_index, config.capacity_blocks)
            for policy in policies
        ]
        self._reports = [0] * len(names)
        self._unpublished: list[list] = [[] for _ in names]

    def run(self, requests: Sequence[SimRequest], tick: Callable[[], None] = lambda: None) -> FleetRun:
        config, timing = self.config, self.config.timing
        n, g_count = len(self.replicas), len(self.gateways)
        index_of = {name: i for i, name in enumerate(self.names)}
        total = len(requests)
        replica_of, reasons, matched = [0] * total, [""] * total, [0] * total
        cached, ttft, finish = [0] * total, [0.0] * total, [0.0] * total
        queue, prefill = [0.0] * total, [0.0] * total
        started = [False] * total
        in_flight = [0] * n
        imbalance: list[float] = []
        peak_in_flight = 0
        events: list[tuple[float, int, int, int]] = []  # (time, rank, order, payload)
        order = 0
        current = [0] * n  # per replica: the order of its one valid step event (a cut run leaves a stale one)

        def push(at: float, rank: int, payload: int) -> None:
            nonlocal order
            order += 1
            heapq.heappush(events, (at, rank, order, payload))
            if rank == _STEP:
                current[payload] = order

        if timing.publish_s > 0:
            push(0.0, _PUBLISH, 0)
        # A poller reads one gateway's view of every replica, or with `poll_each` of one replica: payload
        # g * n + r, its intervals a stream of their own.
        pollers = [(g, r) for g in range(g_count) for r in (range(n) if timing.poll_each else (-1,))]
        intervals = [timing.intervals(k) for k in range(len(pollers))]
        if timing.poll_s > 0:
            for k, (g, r) in enumerate(pollers):
                push(timing.poll_s * (g + (r + 1) / n if r >= 0 else g) / g_count, _POLL, k)
        busy = 0  # replicas with a step in the queue
        next_request = 0
        while next_request < total or busy:
            arrival = requests[next_request].arrival_s if next_request < total else float("inf")
            if events and events[0][0] <= arrival:
                now, rank, key, payload = heapq.heappop(events)
                if rank == _STEP:
                    if key != current[payload]:
                        continue
                    replica = self.replicas[payload]
                    done = replica.step()
                    if done is not None:
                        for out in done.outputs:
                            i = int(out.request_id)
                            if not started[i]:
                                started[i] = True
                                cached[i] = out.cached_tokens
                                ttft[i] = done.at - requests[i].arrival_s
                            if out.finished:
                                finish[i] = done.at
                                timings = out.timings
                                if timings is not None and timings.first_scheduled is not None:
                                    queue[i] = timings.first_scheduled - timings.arrival
                                    first_token = timings.first_token or timings.first_scheduled
                                    prefill[i] = first_token - timings.first_scheduled
                                in_flight[payload] -= 1
                                self.gateways[i % g_count].finished(replica.name)
                        self._unpublished[payload].extend(done.events)
                        if timing.publish_s == 0:
                            self._publish(payload)
                    if replica.idle:
                        busy -= 1
                    else:
                        push(replica.busy_until, _STEP, payload)
                elif rank == _PUBLISH:
                    for r in range(n):
                        self._publish(r)
                    if next_request < total or busy:
                        push(now + timing.publish_s, _PUBLISH, 0)
                else:
                    g, r = pollers[payload]
                    self.gateways[g].read(self._snapshot, self.names[r] if r >= 0 else None)
                    if next_request < total or busy:
                        push(now + next(intervals[payload]), _POLL, payload)
                continue
            i = next_request
            next_request += 1
            request = requests[i]
            prompt = request.prompt()
            hashes = request.block_hashes
            if hashes is None:
                hashes = hash_blocks(
                    prompt, model_id=config.model_id, cache_salt=request.cache_salt, block_size=config.block_size
                )
            gateway = self.gateways[i % g_count]
            decision = gateway.pick(RouteRequest(str(i), hashes, request.num_prompt_tokens, request.session_id))
            r = index_of[decision.replica]
            replica_of[i], reasons[i], matched[i] = r, decision.reason, decision.matched_blocks
            in_flight[r] += 1
            peak = max(in_flight)
            imbalance.append(peak * n / sum(in_flight))
            peak_in_flight = max(peak_in_flight, peak)
            replica = self.replicas[r]
            was_idle = replica.idle
            if replica.add(
                str(i), i, prompt, request.max_tokens, request.answer, request.cache_salt, request.arrival_s
            ):
                busy += was_idle
                push(replica.busy_until, _STEP, r)
            tick()
        return FleetRun(
            self.names, replica_of, reasons, cached, ttft, finish,
            [r.busy_s for r in self.replicas], [r.requests for r in self.replicas], imbalance, peak_in_flight,
            queue, prefill, [r.steps for r in self.replicas],
            [r.engine.scheduler.num_preemptions for r in self.replicas], matched,
        )  # fmt: skip

    def _publish(self, r: int) -> None:
        replica = self.replicas[r]
        events, self._unpublished[r] = self._unpublished[r], []
        self._reports[r] += 1
        load = replica.reported
        report = LoadReport(self._reports[r], load.running, load.waiting, load.kv_usage)
        if events and self.config.timing.index == "shared":
            if not self.shared_index.apply(replica.name, events):
                seq, hashes = self._snapshot(replica.name)
                self.shared_index.resync(replica.name, seq, hashes)
        for gateway in self.gateways:
            gateway.published(replica.name, events, report)
            if self.config.timing.poll_s == 0:
                gateway.read(self._snapshot)

    def _snapshot(self, name: str) -> tuple[int, list]:
        return self.replicas[self.names.index(name)].engine.kv_manager.pool.snapshot()
