"""Flow control's decisions, with no event loop of its own: what waits, what goes now, to which worker and why,
what is shed. The gateway runs it under asyncio (gateway.flow_control.stage), the fleet simulator on its virtual
clock (sim.fleet): one copy, so a replay queues, dispatches and sheds as the gateway would.

Caller contract:
  1. `arrive(...)`: a Grant when the request may be sent now (`immediate`; Grant(None) when the fleet has no
     routable worker: the caller answers as it would without flow control), else the queued entry: its outcome
     comes later through `outcomes` (it may come within this very call). Refused at arrival, it raises
     GatewayError: RateLimited (429) past its tenant's queue bound, NoWorkerAvailable (503) past the band's or
     the whole queue's, each with Retry-After from the measured drain rate.
  2. `dispatch()` whenever room may have freed (a worker request ended, a load report came, the membership
     changed), and every TICK_S while anything waits (expiry and deadlines move with the clock alone).
  3. A granted request: `grant.sent()` once its worker request is sent, `started(grant)` when its first token
     came, `grant.close()` when the caller is done with it (any way; idempotent): the worker's room counts the
     grant's blocks until the second report after its first token, or until it closes without one.
  4. `withdraw(entry)` when a queued request's client left (False: it was no longer queued); `forget(worker)` when
     a worker left or restarted; `end_queued(message)` at the drain's deadline.
Outcomes (`Outcomes`): `queued` when a request waits, `granted` when one goes (immediate ones too, with no
handle), `shed` when one is refused or dropped (refusals at arrival too, with no handle).

Dispatch, band by band (most urgent first), while some worker can take a request: a request that has waited
`deadline_share` of its band's max wait goes first (reason `deadline`); else, among the band's fair-share head
and its `cache_lookahead` oldest requests, the one a dispatchable worker holds the longest prefix of
(`cache_aware`, or `fair_share` when that is the head itself); else the fair-share head (`fair_share`). A
request that finds the queue empty and a worker with room goes at once (`immediate`). A band whose requests fit
no worker now lets a less urgent band use the room. Before each dispatch, what waited past its band's
max_wait_s is shed (`max_wait`); with no live worker left, everything waiting is (`no_worker`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from gateway.errors import GatewayError, NoWorkerAvailable, RateLimited
from gateway.flow_control.config import FlowControlConfig
from gateway.flow_control.drain_rate import DrainRate
from gateway.flow_control.fair_queue import FairQueue, QueuedRequest, QueueFull
from gateway.flow_control.saturation import blocks_needed, dispatchable
from gateway.routing.fleet_view import FleetView, ReplicaLoad
from gateway.routing.router import NoReplicaAvailable, RouteDecision, RouteRequest

TICK_S = 0.02  # how often waiting requests are looked at between kicks (load reports come every ~0.1 s)
SHUTTING_DOWN = "gateway_shutting_down"  # as gateway.request_path's: the drain's error code
# What a queued request is counted as holding in the gateway's memory, beyond its body: its prompt ids and block
# hashes as Python keeps them (a list slot and a small int; a bytes object of 16).
QUEUED_BYTES_PER_TOKEN = 8
QUEUED_BYTES_PER_BLOCK = 64

P = TypeVar("P")
P_contra = TypeVar("P_contra", contravariant=True)
Pick = Callable[[RouteRequest, FleetView, frozenset[str]], RouteDecision]


def queued_bytes(body_bytes: int, prompt_tokens: int, prompt_blocks: int) -> int:
    """What a waiting request counts against the queue's byte bounds."""
    return body_bytes + QUEUED_BYTES_PER_TOKEN * prompt_tokens + QUEUED_BYTES_PER_BLOCK * prompt_blocks


class Grant:
    """Leave to send a request: the worker to try first (None: no routable worker now) and why it went now.
    Its blocks count against that worker's room until the second load report after its first token (the first
    may have been taken just before it)."""

    def __init__(self, decision: RouteDecision | None, reason: str, blocks: int = 0, band: int = 0) -> None:
        self.decision = decision
        self.reason = reason
        self.blocks = blocks
        self.band = band
        self.unsent = decision is not None
        self.open = decision is not None  # its blocks still count
        self.started_at_report: int | None = None  # the worker's report count when its first token came

    def sent(self) -> None:
        """Its worker request was sent."""
        self.unsent = False

    def started(self, reports: int) -> None:
        """Its first token came when the worker had made `reports` reports: the next one shows its blocks."""
        self.unsent = False
        if self.started_at_report is None:
            self.started_at_report = reports

    def close(self) -> None:
        """The caller is done with it: unless it started (its blocks count until the next report), its room is
        free at once (it failed, or its client left, before a first token)."""
        self.unsent = False
        if self.started_at_report is None:
            self.open = False


@dataclass(eq=False)
class Waiting(Generic[P]):
    """What a queued request carries: what its pick needs, and the caller's `handle` for it."""

    route_request: RouteRequest
    max_tokens: int
    handle: P


class Outcomes(Protocol[P_contra]):
    """Where the dispatcher tells what became of requests (contract, last paragraph), by the caller's `handle`:
    None for a request that never waited (granted at once, or refused at arrival)."""

    def queued(self, band: int) -> None: ...

    def granted(self, band: int, reason: str, waited_s: float, grant: Grant, handle: P_contra | None) -> None: ...

    def shed(self, band: int, reason: str, error: GatewayError, handle: P_contra | None) -> None: ...


class Dispatcher(Generic[P]):
    """One pool's flow-control decisions (the module docstring), on `clock` (seconds)."""

    def __init__(
        self,
        config: FlowControlConfig,
        view: Callable[[], FleetView],
        pick: Pick,
        blocked: Callable[[], Collection[str]],
        block_size: int,
        outcomes: Outcomes[P],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.queue: FairQueue[Waiting[P]] = FairQueue(config)
        self.drain_rate = DrainRate()
        self._view = view
        self._pick = pick
        self._blocked = blocked
        self._block_size = block_size
        self._outcomes = outcomes
        self._clock = clock
        self._grants: dict[str, list[Grant]] = {}  # worker id -> grants whose blocks may still count

    def reconfigure(self, config: FlowControlConfig) -> None:
        """New settings: they apply to what arrives and to every dispatch from now on."""
        self.config = self.queue.config = config

    def arrive(
        self,
        route_request: RouteRequest,
        tenant: str,
        weight: float,
        band: int,
        max_tokens: int,
        size_bytes: int,
        handle: P,
    ) -> Grant | QueuedRequest[Waiting[P]]:
        """Contract item 1."""
        now = self._clock()
        if not self.queue:
            view = self._view()
            blocked = self._blocked()
            if not any(r not in blocked for r in view.replicas):
                return Grant(None, "immediate")
            placed = self._decide(route_request, max_tokens, view, blocked, band)
            if placed is not None:
                grant = self._granted_now(placed[0], placed[1], "immediate", band)
                self._outcomes.granted(band, "immediate", 0.0, grant, None)
                return grant
        cost = route_request.num_tokens + max_tokens
        entry = QueuedRequest(band, tenant, weight, cost, size_bytes, now, Waiting(route_request, max_tokens, handle))
        try:
            victims = self.queue.push(entry)
        except QueueFull as full:
            retry_after = self.drain_rate.retry_after(full.queued_ahead, now)
            error: GatewayError
            if full.reason == "tenant_limit":
                error = RateLimited(f"{full.message}; retry later", retry_after=retry_after)
            else:
                error = NoWorkerAvailable(f"{full.message}; retry later", retry_after=retry_after)
            self._outcomes.shed(band, full.reason, error, None)
            raise error from None
        self._outcomes.queued(band)
        for victim in victims:  # out of the queue already
            why = f"a more urgent request took its place in the queue (priority {band})"
            self._shed(victim, "displaced", why, queued=False)
        self.dispatch()
        return entry

    def withdraw(self, entry: QueuedRequest[Waiting[P]]) -> bool:
        """The queued request's client left: out of the queue (False: it was no longer queued)."""
        return self.queue.remove(entry)

    def forget(self, worker_id: str) -> None:
        """The worker left or restarted: what was granted to it no longer holds room anywhere."""
        self._grants.pop(worker_id, None)

    def end_queued(self, message: str) -> int:
        """Shed every waiting request with NoWorkerAvailable(`message`), code gateway_shutting_down (the drain's
        deadline: none of them can start now). Returns how many there were."""
        waiting = self.queue.all()
        for entry in waiting:
            self.queue.remove(entry)
            error = NoWorkerAvailable(
                f"{message}; the request was still waiting for a worker", code=SHUTTING_DOWN, retry_after=1.0
            )
            self._outcomes.shed(entry.band, "draining", error, entry.payload.handle)
        return len(waiting)

    def started(self, grant: Grant) -> None:
        """The granted request's first token came (contract item 3)."""
        if grant.decision is not None:
            load = self._view().loads.get(grant.decision.replica)
            grant.started(load.reports if load is not None else 0)

    # -- dispatch -----------------------------------------------------------------------------------------------

    def dispatch(self) -> None:
        """Shed what waited too long, then grant requests while a worker can take one (the module docstring)."""
        now = self._clock()
        for entry in self.queue.expired(now):
            wait = self.config.band(entry.band).max_wait_s
            self._shed(entry, "max_wait", f"no worker could take the request within its band's {wait:g} s")
        while self.queue:
            view = self._view()
            blocked = self._blocked()
            if not view.replicas:
                for entry in self.queue.all():
                    self.queue.remove(entry)
                    self._outcomes.shed(
                        entry.band, "no_worker", NoWorkerAvailable("no live worker to route to"), entry.payload.handle
                    )
                return
            if not self._dispatch_one(view, blocked, now):
                return

    def _dispatch_one(self, view: FleetView, blocked: Collection[str], now: float) -> bool:
        config = self.config
        for band in self.queue.bands():
            head = self.queue.head(band)
            if now - head.arrival >= config.band(band).max_wait_s * config.deadline_share:
                chosen, reason = head, "deadline"
            else:
                chosen, reason = self._cache_aware(band, head, view, blocked)
            placed = self._decide(chosen.payload.route_request, chosen.payload.max_tokens, view, blocked, band)
            if placed is None and chosen is not head and reason != "deadline":
                chosen, reason = head, "fair_share"
                placed = self._decide(head.payload.route_request, head.payload.max_tokens, view, blocked, band)
            if placed is not None:
                self.queue.take(chosen)
                self.drain_rate.dispatched(now)
                grant = self._granted_now(placed[0], placed[1], reason, band)
                self._outcomes.granted(band, reason, now - chosen.arrival, grant, chosen.payload.handle)
                return True
        return False

    def _cache_aware(
        self, band: int, head: QueuedRequest[Waiting[P]], view: FleetView, blocked: Collection[str]
    ) -> tuple[QueuedRequest[Waiting[P]], str]:
        """Of the head and the band's oldest requests, the one a dispatchable worker holds the longest prefix
        of; the head when none is held anywhere there is room."""
        best, best_matched = head, 0
        for entry in dict.fromkeys((head, *self.queue.oldest(band, self.config.cache_lookahead))):
            waiting = entry.payload
            hashes = waiting.route_request.block_hashes
            if not hashes:
                continue
            for replica, matched in zip(view.replicas, view.kv_index.match(hashes), strict=True):
                if matched > best_matched and replica not in blocked:
                    needed = blocks_needed(
                        len(hashes), matched, waiting.max_tokens, self._block_size, self.config.decode_reserve_tokens
                    )
                    load = view.loads[replica]
                    if dispatchable(load, *self._room_taken(replica, load, band), needed, self.config, band):
                        best, best_matched = entry, matched
        return best, "fair_share" if best is head else "cache_aware"

    def _decide(
        self, route_request: RouteRequest, max_tokens: int, view: FleetView, blocked: Collection[str], band: int
    ) -> tuple[RouteDecision, int] | None:
        """The policy's pick among the workers that can admit the request now, and the blocks it needs there;
        None when no worker can."""
        hashes = route_request.block_hashes
        matches = view.kv_index.match(hashes) if hashes else [0] * len(view.replicas)
        needs: dict[str, int] = {}
        excluded = set()
        for replica, matched in zip(view.replicas, matches, strict=True):
            needed = blocks_needed(
                len(hashes), matched, max_tokens, self._block_size, self.config.decode_reserve_tokens
            )
            load = view.loads[replica]
            room = dispatchable(load, *self._room_taken(replica, load, band), needed, self.config, band)
            if replica in blocked or not room:
                excluded.add(replica)
            else:
                needs[replica] = needed
        if not needs:
            return None
        try:
            decision = self._pick(route_request, view, frozenset(excluded))
        except NoReplicaAvailable:
            return None
        return decision, needs.get(decision.replica, 0)

    def _granted_now(self, decision: RouteDecision, blocks: int, reason: str, band: int) -> Grant:
        grant = Grant(decision, reason, blocks, band)
        self._grants.setdefault(decision.replica, []).append(grant)
        return grant

    def _room_taken(self, replica: str, load: ReplicaLoad, band: int) -> tuple[int, int, int]:
        """Of this gateway's grants to `replica` that its last report cannot show yet: the requests not sent yet,
        their blocks, and those without a first token yet; grants counted out are forgotten. On a worker that
        schedules by priority (it reports `priorities`), only the grants at `band` or more urgent: the less urgent
        ones wait behind a request of `band` there, or give it their blocks."""
        grants = self._grants.get(replica)
        if not grants:
            return 0, 0, 0
        reports = load.reports
        # a report answered just after the first token may have been taken before it: the second one shows it
        live = [g for g in grants if g.open and (g.started_at_report is None or g.started_at_report + 1 >= reports)]
        if len(live) != len(grants):
            if live:
                self._grants[replica] = live
            else:
                del self._grants[replica]
        ahead = [g for g in live if g.band <= band] if load.priorities else live
        unstarted = sum(g.started_at_report is None for g in ahead)
        return sum(g.unsent for g in ahead), sum(g.blocks for g in ahead), unstarted

    def _shed(self, entry: QueuedRequest[Waiting[P]], reason: str, why: str, queued: bool = True) -> None:
        """Drop a waiting request, with Retry-After from the drain rate; `queued`: it is still in the queue (taken
        out here)."""
        retry_after = self.drain_rate.retry_after(self.queue.depth(entry.band), self._clock())
        if queued:
            self.queue.remove(entry)
        self._outcomes.shed(
            entry.band, reason, NoWorkerAvailable(f"{why}; retry later", retry_after=retry_after), entry.payload.handle
        )
