"""The flow-control stage of the request path (DESIGN §4; docs/flow_control.md): after auth, limits, prompt
and hashes, before the pick. A request goes to a worker when one can admit it now (gateway.flow_control.
saturation); until then it waits here, in a FairQueue by band and tenant, and its worker is picked with the
routing policy when it leaves the queue, not when it arrived.

Caller contract (gateway.request_path):
  1. `grant = await admit(...)`: returns a Grant once the request may be sent, or raises a GatewayError:
     RateLimited (429) past its tenant's queue bound, NoWorkerAvailable (503) past the band's or the whole
     queue's bound, when it is shed for a more urgent request, when it waits past its band's max_wait_s, when
     the fleet has no live worker left, or at `end_queued` (the drain deadline); each with Retry-After from the
     measured drain rate. Cancelled (the client left), it is out of the queue at once.
  2. `grant.decision` is the worker to try first (None: the fleet has no routable worker now; the path then
     answers as it would without flow control). `grant.sent()` once its worker request is sent, `started(grant)`
     when its first token came, `grant.close()` when the path is done with it (any way; idempotent): the
     worker's room counts the grant's blocks until the second report after its first token, or until it
     closes without one.
  3. `kick()` when room may have freed (a worker request ended, the membership changed); the stage also looks
     every TICK_S while anything waits (load reports arrive on the fleet state's own clock).

Dispatch, each time room may have freed, band by band (most urgent first), while some worker can take a
request: a request that has waited `deadline_share` of its band's max wait goes first (reason `deadline`);
else, among the band's fair-share head and its `cache_lookahead` oldest requests, the one a dispatchable
worker holds the longest prefix of (`cache_aware`, or `fair_share` when that is the head itself); else the
fair-share head (`fair_share`). A request that finds the queue empty and a worker with room goes at once
(`immediate`). A band whose requests fit no worker now lets a less urgent band use the room.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Callable, Collection

from gateway.errors import GatewayError, NoWorkerAvailable, RateLimited
from gateway.flow_control.config import FlowControlConfig
from gateway.flow_control.drain_rate import DrainRate
from gateway.flow_control.fair_queue import FairQueue, QueuedRequest, QueueFull
from gateway.flow_control.saturation import blocks_needed, dispatchable
from gateway.metrics import GatewayMetrics
from gateway.request import Tenant
from gateway.routing.fleet_view import FleetView
from gateway.routing.router import NoReplicaAvailable, RouteDecision, RouteRequest

TICK_S = 0.02  # how often waiting requests are looked at between kicks (load reports come every ~0.1 s)
MAX_BAND_LABELS = 16  # bands with their own metric series beyond the configured ones; later ones are "other"
SHUTTING_DOWN = "gateway_shutting_down"  # as gateway.request_path's: the drain's error code

Pick = Callable[[RouteRequest, FleetView, frozenset[str]], RouteDecision]


@dataclasses.dataclass(eq=False)
class _Ticket:
    """What a queued request carries: what its pick needs, and the future its caller waits on."""

    route_request: RouteRequest
    max_tokens: int
    future: asyncio.Future[Grant]


class Grant:
    """Leave to send a request: the worker to try first (None: no routable worker now) and why it went now.
    Its blocks count against that worker's room until the second load report after its first token (the first
    may have been taken just before it)."""

    def __init__(self, decision: RouteDecision | None, reason: str, blocks: int = 0) -> None:
        self.decision = decision
        self.reason = reason
        self.blocks = blocks
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
        """The request path is done with it: unless it started (its blocks count until the next report), its
        room is free at once (it failed, or its client left, before a first token)."""
        self.unsent = False
        if self.started_at_report is None:
            self.open = False


class FlowControl:
    """One pool's flow-control stage (see the module docstring for the caller contract and the order)."""

    def __init__(
        self,
        config: FlowControlConfig,
        view: Callable[[], FleetView],
        pick: Pick,
        blocked: Callable[[], Collection[str]],
        metrics: GatewayMetrics,
        block_size: int,
    ) -> None:
        self.config = config
        self.queue: FairQueue[_Ticket] = FairQueue(config)
        self.drain_rate = DrainRate()
        self._view = view
        self._pick = pick
        self._blocked = blocked
        self._metrics = metrics
        self._block_size = block_size
        self._grants: dict[str, list[Grant]] = {}  # worker id -> grants whose blocks may still count
        self._ticker: asyncio.Task[None] | None = None
        self._kicked = False
        self._band_labels: dict[int, str] = {}

    def reconfigure(self, config: FlowControlConfig) -> None:
        """A SIGHUP's new settings: they apply to what arrives and to every dispatch from now on."""
        self.config = self.queue.config = config

    # -- the caller's side ----------------------------------------------------------------------------------

    async def admit(
        self, route_request: RouteRequest, tenant: Tenant, band: int, max_tokens: int, size_bytes: int
    ) -> Grant:
        """Wait until the request may be sent (caller contract item 1)."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        label = self.band_label(band)
        if not self.queue:
            view = self._view()
            blocked = self._blocked()
            if not any(r not in blocked for r in view.replicas):
                return Grant(None, "immediate")
            placed = self._decide(route_request, max_tokens, view, blocked, band)
            if placed is not None:
                self._metrics.flow_dispatches.labels(label, "immediate").inc()
                self._metrics.flow_queue_wait.labels(label).observe(0.0)
                return self._granted_now(placed[0], placed[1], "immediate")
        ticket = _Ticket(route_request, max_tokens, loop.create_future())
        cost = route_request.num_tokens + max_tokens
        entry = QueuedRequest(band, tenant.name, tenant.weight, cost, size_bytes, now, ticket)
        try:
            victims = self.queue.push(entry)
        except QueueFull as full:
            self._metrics.flow_sheds.labels(label, full.reason).inc()
            retry_after = self.drain_rate.retry_after(full.queued_ahead, now)
            if full.reason == "tenant_limit":
                raise RateLimited(f"{full.message}; retry later", retry_after=retry_after) from None
            raise NoWorkerAvailable(f"{full.message}; retry later", retry_after=retry_after) from None
        self._metrics.flow_queue_depth.labels(label).inc()
        for victim in victims:  # out of the queue already
            why = f"a more urgent request took its place in the queue (priority {band})"
            self._shed(victim, "displaced", why, queued=False)
        self._dispatch()
        if self.queue:
            self._start_ticker()
        try:
            return await ticket.future
        except BaseException:
            if self.queue.remove(entry):
                self._metrics.flow_queue_depth.labels(label).dec()
            elif ticket.future.done() and not ticket.future.cancelled() and ticket.future.exception() is None:
                ticket.future.result().close()  # granted, but its caller left before it could send
            raise

    def kick(self) -> None:
        """Room may have freed: dispatch soon (once, however many kicks come before it runs)."""
        if self.queue and not self._kicked:
            self._kicked = True
            asyncio.get_running_loop().call_soon(self._kicked_dispatch)

    def forget(self, worker_id: str) -> None:
        """The worker left or restarted: what was granted to it no longer holds room anywhere; dispatch soon."""
        self._grants.pop(worker_id, None)
        self.kick()

    def end_queued(self, message: str) -> int:
        """Answer every waiting request with NoWorkerAvailable(`message`), code gateway_shutting_down (the
        drain's deadline: none of them can start now). Returns how many there were."""
        waiting = self.queue.all()
        for entry in waiting:
            error = NoWorkerAvailable(
                f"{message}; the request was still waiting for a worker", code=SHUTTING_DOWN, retry_after=1.0
            )
            self._fail(entry, "draining", error)
        return len(waiting)

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.wait({self._ticker})
            self._ticker = None

    def band_label(self, band: int) -> str:
        """The band's metric label: its value, for configured bands and the first MAX_BAND_LABELS others."""
        label = self._band_labels.get(band)
        if label is None:
            configured = band in self.config.bands or band == 0
            if configured or len(self._band_labels) < MAX_BAND_LABELS + len(self.config.bands):
                label = self._band_labels[band] = str(band)
            else:
                label = "other"
        return label

    # -- dispatch -----------------------------------------------------------------------------------------------

    def _kicked_dispatch(self) -> None:
        self._kicked = False
        self._dispatch()

    def _start_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="flow control")

    async def _tick(self) -> None:
        while self.queue:
            await asyncio.sleep(TICK_S)
            self._dispatch()

    def _dispatch(self) -> None:
        """Shed what waited too long, then grant requests while a worker can take one (the module docstring)."""
        now = time.monotonic()
        for entry in self.queue.expired(now):
            wait = self.config.band(entry.band).max_wait_s
            self._shed(entry, "max_wait", f"no worker could take the request within its band's {wait:g} s")
        while self.queue:
            view = self._view()
            blocked = self._blocked()
            if not view.replicas:
                for entry in self.queue.all():
                    self._fail(entry, "no_worker", NoWorkerAvailable("no live worker to route to"))
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
                label = self.band_label(band)
                self._metrics.flow_queue_depth.labels(label).dec()
                self._metrics.flow_dispatches.labels(label, reason).inc()
                self._metrics.flow_queue_wait.labels(label).observe(now - chosen.arrival)
                grant = self._granted_now(placed[0], placed[1], reason)
                if not chosen.payload.future.done():
                    chosen.payload.future.set_result(grant)
                return True
        return False

    def _cache_aware(
        self, band: int, head: QueuedRequest[_Ticket], view: FleetView, blocked: Collection[str]
    ) -> tuple[QueuedRequest[_Ticket], str]:
        """Of the head and the band's oldest requests, the one a dispatchable worker holds the longest prefix
        of; the head when none is held anywhere there is room."""
        best, best_matched = head, 0
        for entry in dict.fromkeys((head, *self.queue.oldest(band, self.config.cache_lookahead))):
            ticket = entry.payload
            hashes = ticket.route_request.block_hashes
            if not hashes:
                continue
            for replica, matched in zip(view.replicas, view.kv_index.match(hashes), strict=True):
                if matched > best_matched and replica not in blocked:
                    needed = blocks_needed(
                        len(hashes), matched, ticket.max_tokens, self._block_size, self.config.decode_reserve_tokens
                    )
                    load = view.loads[replica]
                    if dispatchable(load, *self._room_taken(replica, load.reports), needed, self.config, band):
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
            room = dispatchable(load, *self._room_taken(replica, load.reports), needed, self.config, band)
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

    def _granted_now(self, decision: RouteDecision, blocks: int, reason: str) -> Grant:
        grant = Grant(decision, reason, blocks)
        self._grants.setdefault(decision.replica, []).append(grant)
        return grant

    def _room_taken(self, replica: str, reports: int) -> tuple[int, int, int]:
        """The requests granted to `replica` and not sent yet, the blocks of its grants that its report (number
        `reports`) cannot show yet, and the grants without a first token yet; grants counted out are forgotten."""
        grants = self._grants.get(replica)
        if not grants:
            return 0, 0, 0
        # a report answered just after the first token may have been taken before it: the second one shows it
        live = [g for g in grants if g.open and (g.started_at_report is None or g.started_at_report + 1 >= reports)]
        if len(live) != len(grants):
            if live:
                self._grants[replica] = live
            else:
                del self._grants[replica]
        unstarted = sum(g.started_at_report is None for g in live)
        return sum(g.unsent for g in live), sum(g.blocks for g in live), unstarted

    def started(self, grant: Grant) -> None:
        """The granted request's first token came (caller contract item 2)."""
        if grant.decision is not None:
            load = self._view().loads.get(grant.decision.replica)
            grant.started(load.reports if load is not None else 0)

    def _shed(self, entry: QueuedRequest[_Ticket], reason: str, why: str, queued: bool = True) -> None:
        retry_after = self.drain_rate.retry_after(self.queue.depth(entry.band), time.monotonic())
        self._fail(entry, reason, NoWorkerAvailable(f"{why}; retry later", retry_after=retry_after), queued)

    def _fail(self, entry: QueuedRequest[_Ticket], reason: str, error: GatewayError, queued: bool = True) -> None:
        """Answer a waiting request with `error`; `queued`: it is still in the queue (taken out here)."""
        if queued and not self.queue.remove(entry):
            return
        label = self.band_label(entry.band)
        self._metrics.flow_queue_depth.labels(label).dec()
        self._metrics.flow_sheds.labels(label, reason).inc()
        future = entry.payload.future
        if not future.done():
            future.set_exception(error)
        with contextlib.suppress(asyncio.CancelledError):
            future.exception()  # retrieved here: a caller that already left never reads it
