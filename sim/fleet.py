"""The fleet simulator: requests through simulated gateways onto simulated replicas, on one virtual timeline.

Events, in time order (at equal times: step ends, then publishes, then polls, then flow-control ticks, then
arrivals):
  * arrival: request i goes to gateway i mod G, which picks a replica (`SimGateway.pick`); the replica queues
    it at once (no network in between). With flow control (`FleetConfig.flow_control`) the gateway runs the live
    gateway's own (gateway.flow_control.dispatcher) on this clock instead: the request goes at once if a replica
    can admit it, else it waits in the gateway by band and tenant, and leaves (or is shed) when the gateway
    looks again, as the live one does: when one of its requests finishes (the live gateway's kick), and every
    TICK_S while anything waits (its ticker; load reports come in at the polls and are read then);
  * step end (per busy replica): the step's outputs are delivered (first tokens, finishes: the request's
    gateway hears of it now), its KV events and load published, and the next step computed;
  * publish (every `publish_s`, when it is > 0): every replica's events and load since the last publish;
  * poll (every `poll_s` per gateway, phases spread, when it is > 0; or per gateway and replica, with
    `poll_each`; intervals drawn, with `poll_draw`): the gateway reads what was published.
With `publish_s` = `poll_s` = 0 every gateway reads a replica's events and load at the end of each of its steps.

A granted request's first token is `started` on its grant, which closes then, as the live request path does.
Per request it records the replica, the policy's reason, the cached prompt tokens the engine reported (its
first admission's), the time to first token (the end of the step that sampled it, less the arrival), the time
queued (from its arrival at the engine, which is after the step in progress as on a live worker, to its first
schedule) and in prefill (first schedule to first token), and the finish; with flow control its time queued
in the gateway, why it was sent then, or why it was shed (its TTFT and finish then NaN) and the HTTP status.
Per replica its busy time (the sum of its steps' costs), its requests, steps and preemptions; per request sent
the in-flight imbalance (max / mean of the replicas' requests routed and not finished, this one counted).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gateway.admission.auth import OPEN_TENANT
from gateway.fleet.fleet_state import FleetIdentity
from gateway.flow_control.config import FlowControlConfig
from gateway.flow_control.dispatcher import TICK_S, Grant
from gateway.routing.kv_index import KVIndex
from gateway.routing.router import RouteDecision, RouteRequest, RoutingPolicy
from kvroute.hashing import BlockHash
from kvroute.hashing import block_hashes as hash_blocks
from kvroute.kv_events import HOST
from sim.gateway import LoadReport, SimGateway, ViewTiming
from sim.replica import SimReplica
from worker.sim_runner import SimCostModel

_STEP, _PUBLISH, _POLL, _TICK = 0, 1, 2, 3  # event ranks at equal times; arrivals come last
_NEVER = float("nan")  # the time to first token and finish of a request flow control shed


@dataclass(frozen=True)
class SimRequest:
    """One request: when it arrives, its prompt (built when it arrives, so a long trace is never in memory
    at once: a new list at each call, which the replica's engine keeps as the request's tokens), how many tokens
    it decodes and the answer it samples first (a trace's known answer; then
    tokens no other request has). `block_hashes`: the gateway's hashes of the prompt when already known, under
    the fleet's model id and block size and the request's `cache_salt`: the replica's engine takes them as its own
    (LLMEngine.add_request checks the first)."""

    arrival_s: float
    prompt: Callable[[], list[int]]
    num_prompt_tokens: int
    max_tokens: int
    answer: Sequence[int] = ()
    cache_salt: str = ""
    session_id: str | None = None
    block_hashes: Sequence[BlockHash] | None = None
    # flow control's view of it (FleetConfig.flow_control): its tenant, that tenant's weight, its band (priority)
    tenant: str = OPEN_TENANT.name
    weight: float = 1.0
    band: int = 0


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
    # per request, with flow control: why it was shed ("" if it was sent) and the HTTP status its client got
    shed: list[str] = field(default_factory=list, repr=False)
    status: list[int] = field(default_factory=list, repr=False)
    gateway_wait_s: list[float] = field(default_factory=list, repr=False)  # in the gateway's queue (sent or shed)
    dispatch_reasons: list[str] = field(default_factory=list, repr=False)  # why flow control sent it then

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
    host_kv_blocks: int = 0  # each replica's host KV tier (worker/host_kv_tier.py); copies cost `cost`'s time
    flow_control: FlowControlConfig | None = None  # every gateway's flow control (None: off, sent at once)


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
                host_kv_blocks=config.host_kv_blocks,
            )
            for name in names
        ]
        identity = FleetIdentity(config.model_id, config.block_size, "sim", "sim")
        self.shared_index = KVIndex(names)
        self.now = 0.0  # the virtual clock: the time of the event being handled
        self.gateways = [
            SimGateway(
                names,
                policy,
                identity,
                config.timing,
                self.shared_index,
                config.capacity_blocks,
                config.flow_control,
                lambda: self.now,
            )
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
        cached, ttft, finish = [0] * total, [_NEVER] * total, [_NEVER] * total
        queue, prefill = [0.0] * total, [0.0] * total
        shed, status, waited, dispatched = [""] * total, [0] * total, [0.0] * total, [""] * total
        routes: list[RouteRequest | None] = [None] * total
        prompts: list[tuple[list[int], Sequence[BlockHash]] | None] = [None] * total  # and their hashes
        grants: list[Grant | None] = [None] * total
        started = [False] * total
        in_flight = [0] * n
        imbalance: list[float] = []
        peak_in_flight = 0
        events: list[tuple[float, int, int, int]] = []  # (time, rank, order, payload)
        order = 0
        current = [0] * n  # per replica: the order of its one valid step event (a cut run leaves a stale one)
        ticking = [False] * g_count  # per gateway: its flow-control ticker is in the queue
        busy = 0  # replicas with a step in the queue

        def push(at: float, rank: int, payload: int) -> None:
            nonlocal order
            order += 1
            heapq.heappush(events, (at, rank, order, payload))
            if rank == _STEP:
                current[payload] = order

        def waiting() -> bool:
            return any(g.flow is not None and g.flow.queue for g in self.gateways)

        def send(i: int, decision: RouteDecision, now: float) -> None:
            nonlocal busy, peak_in_flight
            request, route = requests[i], routes[i]
            assert route is not None
            self.gateways[i % g_count].sent(route, decision)
            r = index_of[decision.replica]
            replica_of[i], reasons[i], matched[i] = r, decision.reason, decision.matched_blocks
            in_flight[r] += 1
            peak = max(in_flight)
            imbalance.append(peak * n / sum(in_flight))
            peak_in_flight = max(peak_in_flight, peak)
            replica = self.replicas[r]
            was_idle = replica.idle
            held, prompts[i] = prompts[i], None
            assert held is not None
            prompt, hashes = held
            added = replica.add(
                str(i), i, prompt, request.max_tokens, request.answer, request.cache_salt, now,
                prompt_hashes=hashes,
            )  # fmt: skip
            if added:
                busy += was_idle
                push(replica.busy_until, _STEP, r)

        def settle(g: int, now: float) -> None:
            """Act on what gateway g's flow control decided: send what was granted, record what was shed."""
            gateway = self.gateways[g]
            while gateway.settled:
                done, gateway.settled = gateway.settled, []
                for outcome in done:
                    i = outcome.index
                    if outcome.grant is None:
                        shed[i], status[i], prompts[i] = outcome.reason, outcome.status, None
                        waited[i] = now - requests[i].arrival_s
                        continue
                    grants[i], dispatched[i], waited[i] = outcome.grant, outcome.reason, outcome.waited_s
                    route = routes[i]
                    assert route is not None
                    decision = outcome.grant.decision or gateway.pick(route)
                    send(i, decision, now)
                    outcome.grant.sent()
            flow = gateway.flow
            if flow is not None and flow.queue and not ticking[g]:
                ticking[g] = True
                push(now + TICK_S, _TICK, g)

        def dispatch(g: int, now: float) -> None:
            flow = self.gateways[g].flow
            if flow is not None and flow.queue:
                flow.dispatch()
                settle(g, now)

        # A live gateway has read each worker's books when it joined, before any request: its block count above all.
        for r in range(n):
            self._publish(r)
        for gateway in self.gateways:
            gateway.read(self._snapshot)
        if timing.publish_s > 0:
            push(0.0, _PUBLISH, 0)
        # A poller reads one gateway's view of every replica, or with `poll_each` of one replica: payload
        # g * n + r, its intervals a stream of their own.
        pollers = [(g, r) for g in range(g_count) for r in (range(n) if timing.poll_each else (-1,))]
        intervals = [timing.intervals(k) for k in range(len(pollers))]
        if timing.poll_s > 0:
            for k, (g, r) in enumerate(pollers):
                push(timing.poll_s * (g + (r + 1) / n if r >= 0 else g) / g_count, _POLL, k)
        next_request = 0
        while next_request < total or busy or waiting():
            arrival = requests[next_request].arrival_s if next_request < total else float("inf")
            if events and events[0][0] <= arrival:
                now, rank, key, payload = heapq.heappop(events)
                self.now = now
                if rank == _STEP:
                    if key != current[payload]:
                        continue
                    replica = self.replicas[payload]
                    done = replica.step()
                    finished_on = set()  # gateways that heard of a finish: their flow control looks again
                    if done is not None:
                        for out in done.outputs:
                            i = int(out.request_id)
                            gateway = self.gateways[i % g_count]
                            if not started[i]:
                                started[i] = True
                                cached[i] = out.cached_tokens
                                ttft[i] = done.at - requests[i].arrival_s
                                grant = grants[i]
                                if grant is not None and gateway.flow is not None:
                                    gateway.flow.started(grant)
                                    grant.close()
                            if out.finished:
                                finish[i] = done.at
                                timings = out.timings
                                if timings is not None and timings.first_scheduled is not None:
                                    queue[i] = timings.first_scheduled - timings.arrival
                                    first_token = timings.first_token or timings.first_scheduled
                                    prefill[i] = first_token - timings.first_scheduled
                                in_flight[payload] -= 1
                                gateway.finished(replica.name)
                                finished_on.add(i % g_count)
                        self._unpublished[payload].extend(done.events)
                        if timing.publish_s == 0:
                            self._publish(payload)
                    if replica.idle:
                        busy -= 1
                    else:
                        push(replica.busy_until, _STEP, payload)
                    for g in sorted(finished_on):  # the live gateway's kick when a worker request ends
                        dispatch(g, now)
                elif rank == _PUBLISH:
                    for r in range(n):
                        self._publish(r)
                    if next_request < total or busy or waiting():
                        push(now + timing.publish_s, _PUBLISH, 0)
                elif rank == _POLL:
                    g, r = pollers[payload]
                    self.gateways[g].read(self._snapshot, self.names[r] if r >= 0 else None)
                    if next_request < total or busy or waiting():
                        push(now + next(intervals[payload]), _POLL, payload)
                else:
                    ticking[payload] = False
                    dispatch(payload, now)
                continue
            i = next_request
            next_request += 1
            request = requests[i]
            self.now = request.arrival_s
            prompt = request.prompt()
            hashes = request.block_hashes
            if hashes is None:
                hashes = hash_blocks(
                    prompt, model_id=config.model_id, cache_salt=request.cache_salt, block_size=config.block_size
                )
            g = i % g_count
            gateway = self.gateways[g]
            routes[i] = route = RouteRequest(str(i), hashes, request.num_prompt_tokens, request.session_id)
            prompts[i] = prompt, hashes
            if gateway.flow is None:
                send(i, gateway.pick(route), request.arrival_s)
            else:
                gateway.admit(i, route, request.tenant, request.weight, request.band, request.max_tokens)
                settle(g, request.arrival_s)
            tick()
        return FleetRun(
            self.names, replica_of, reasons, cached, ttft, finish,
            [r.busy_s for r in self.replicas], [r.requests for r in self.replicas], imbalance, peak_in_flight,
            queue, prefill, [r.steps for r in self.replicas],
            [r.engine.scheduler.num_preemptions for r in self.replicas], matched,
            shed, status, waited, dispatched,
        )  # fmt: skip

    def _publish(self, r: int) -> None:
        replica = self.replicas[r]
        events, self._unpublished[r] = self._unpublished[r], []
        self._reports[r] += 1
        load = replica.reported
        report = LoadReport(self._reports[r], load.running, load.waiting, load.kv_usage, self.config.capacity_blocks)
        if events and self.config.timing.index == "shared":
            if not self.shared_index.apply(replica.name, events):
                self.shared_index.resync(replica.name, *self._snapshot(replica.name))
        for gateway in self.gateways:
            gateway.published(replica.name, events, report)
            if self.config.timing.poll_s == 0:  # read at every publish: the other replicas have nothing unread
                gateway.read(self._snapshot, replica.name)

    def _snapshot(self, name: str) -> tuple[int, list, dict[str, list]]:
        """A replica's resync point: the seq, its device's hashes and its host tier's (KVIndex.resync)."""
        seq, device, host = self.replicas[self.names.index(name)].engine.kv_manager.snapshot()
        return seq, device, {HOST: host}
