"""The gateway's queue of requests that wait for a worker: bands by priority, fair share across tenants within
a band, first come first served within a tenant; bounded, shedding the least urgent first. Pure: it keeps no
clock of its own (every call that needs one is given `now`) and knows nothing of workers.

Order (what `head` gives):
  - bands: the lower priority value first (vLLM's `priority`);
  - within a band, start-time fair queueing over tenants: a request of cost c (tokens) from a tenant of
    weight w gets the virtual start tag S = max(V, F_tenant) and moves the tenant's finish to S + c / w; the
    band serves the smallest tag and sets V to it. A tenant that floods the band only pushes its own tags
    ahead, and one of long prompts spends its share in tokens, not requests;
  - within a tenant, by arrival (tags grow with each request it sends).
A request taken out of order (`take` of one that is not the head: a cache-aware dispatch) still moves V to
its tag at most, so the others' shares are kept over time.

Bounds (`push` raises QueueFull naming which; nothing is changed):
  1. the tenant's requests and bytes over every band: `tenant_limit` (its own bound: 429);
  2. the band's requests and bytes: `band_full` (503);
  3. the whole queue's requests and bytes: requests of a less urgent band are shed, that band's newest
     first (returned, for the caller to answer), until the arrival fits; when no less urgent request is
     left, `queue_full` (503).
A hostile client can hold at most its tenant's bound; the queue's memory is bounded by its byte bounds.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from gateway.flow_control.config import FlowControlConfig

P = TypeVar("P")


class QueueFull(Exception):
    """`push` refused a request: `reason` is tenant_limit, band_full or queue_full; `queued_ahead` the
    requests that must leave the bound's queue before there is room (for Retry-After)."""

    def __init__(self, reason: str, message: str, queued_ahead: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.queued_ahead = queued_ahead


@dataclass(eq=False)
class QueuedRequest(Generic[P]):
    """One waiting request: its band, tenant and weight, its cost in tokens (its fair-share charge), its size
    in bytes (its memory bound), when it arrived, and the caller's `payload`."""

    band: int
    tenant: str
    weight: float
    cost: float
    size_bytes: int
    arrival: float
    payload: P
    seq: int = 0
    tag: float = 0.0  # virtual start


@dataclass
class _Band(Generic[P]):
    by_arrival: dict[int, QueuedRequest[P]] = field(default_factory=dict)  # seq -> request, oldest first
    tenants: dict[str, deque[QueuedRequest[P]]] = field(default_factory=dict)  # each tenant's, by arrival
    finish: dict[str, float] = field(default_factory=dict)  # tenant -> virtual finish of its last request
    virtual_time: float = 0.0
    size_bytes: int = 0


class FairQueue(Generic[P]):
    """Requests waiting per band; see the module docstring for the order, the bounds and what is shed."""

    def __init__(self, config: FlowControlConfig) -> None:
        self.config = config
        self._bands: dict[int, _Band[P]] = {}
        self._seq = itertools.count(1)
        self._tenant_count: dict[str, int] = {}
        self._tenant_bytes: dict[str, int] = {}
        self.size_bytes = 0
        self.count = 0

    def __len__(self) -> int:
        return self.count

    def depth(self, band: int) -> int:
        queued = self._bands.get(band)
        return len(queued.by_arrival) if queued is not None else 0

    def bands(self) -> list[int]:
        """The bands holding requests, most urgent first."""
        return sorted(self._bands)

    def tenant_depth(self, tenant: str) -> int:
        return self._tenant_count.get(tenant, 0)

    def push(self, request: QueuedRequest[P]) -> list[QueuedRequest[P]]:
        """Queue `request` (its seq and tag set here); returns the requests shed to make room, already out of
        the queue. Raises QueueFull (nothing changed)."""
        config = self.config
        settings = config.band(request.band)
        tenant = request.tenant
        tenant_count = self._tenant_count.get(tenant, 0)
        if tenant_count + 1 > config.tenant_max_queued or (
            self._tenant_bytes.get(tenant, 0) + request.size_bytes > config.tenant_max_queued_bytes
        ):
            raise QueueFull(
                "tenant_limit",
                f"tenant {tenant!r} has {tenant_count} requests waiting for a worker, its bound on this gateway",
                tenant_count,
            )
        band = self._bands.get(request.band)
        depth = len(band.by_arrival) if band is not None else 0
        band_bytes = band.size_bytes if band is not None else 0
        if (settings.max_queued is not None and depth + 1 > settings.max_queued) or (
            settings.max_queued_bytes is not None and band_bytes + request.size_bytes > settings.max_queued_bytes
        ):
            raise QueueFull("band_full", f"priority {request.band}'s queue is full ({depth} requests)", depth)
        victims = self._victims(request)
        for victim in victims:
            self.remove(victim)
        if band is None:
            band = self._bands[request.band] = _Band()
        request.seq = next(self._seq)
        request.tag = max(band.virtual_time, band.finish.get(tenant, 0.0))
        band.finish[tenant] = request.tag + request.cost / request.weight
        band.by_arrival[request.seq] = request
        band.tenants.setdefault(tenant, deque()).append(request)
        band.size_bytes += request.size_bytes
        self._tenant_count[tenant] = self._tenant_count.get(tenant, 0) + 1  # a victim may have been its own
        self._tenant_bytes[tenant] = self._tenant_bytes.get(tenant, 0) + request.size_bytes
        self.size_bytes += request.size_bytes
        self.count += 1
        return victims

    def _victims(self, request: QueuedRequest[P]) -> list[QueuedRequest[P]]:
        """The less urgent requests to shed, least urgent band's newest first, for `request` to fit the whole
        queue's bounds; QueueFull when shedding every one of them would not make room."""
        config = self.config
        count, size = self.count + 1, self.size_bytes + request.size_bytes
        victims: list[QueuedRequest[P]] = []
        if count <= config.max_queued and size <= config.max_queued_bytes:
            return victims
        for band in sorted((b for b in self._bands if b > request.band), reverse=True):
            for victim in reversed(self._bands[band].by_arrival.values()):
                victims.append(victim)
                count, size = count - 1, size - victim.size_bytes
                if count <= config.max_queued and size <= config.max_queued_bytes:
                    return victims
        raise QueueFull("queue_full", f"this gateway's queue is full ({self.count} requests waiting)", self.count)

    def remove(self, request: QueuedRequest[P]) -> bool:
        """Take `request` out wherever it is (it left, or it was shed); False if it was not queued."""
        band = self._bands.get(request.band)
        if band is None or band.by_arrival.pop(request.seq, None) is None:
            return False
        own = band.tenants[request.tenant]
        if own[0] is request:
            own.popleft()
        else:
            own.remove(request)
        if not own:
            del band.tenants[request.tenant]
        band.size_bytes -= request.size_bytes
        left = self._tenant_count[request.tenant] - 1
        if left:
            self._tenant_count[request.tenant] = left
            self._tenant_bytes[request.tenant] -= request.size_bytes
        else:
            del self._tenant_count[request.tenant], self._tenant_bytes[request.tenant]
        self.size_bytes -= request.size_bytes
        self.count -= 1
        if not band.by_arrival:
            del self._bands[request.band]  # its virtual clock restarts with its next request: no tenant is owed
        return True

    def take(self, request: QueuedRequest[P]) -> None:
        """`request` is dispatched: out of the queue, its band's virtual time moved to its tag."""
        band = self._bands[request.band]
        band.virtual_time = max(band.virtual_time, request.tag)
        self.remove(request)
        if request.band in self._bands:
            # finish tags at or behind the clock change nothing (max(V, F) = V): forget them, so the book
            # holds only tenants that are ahead of it
            band.finish = {t: f for t, f in band.finish.items() if f > band.virtual_time or t in band.tenants}

    def head(self, band: int) -> QueuedRequest[P]:
        """The band's next request in fair order: the smallest start tag among its tenants' oldest requests."""
        return min((own[0] for own in self._bands[band].tenants.values()), key=lambda r: (r.tag, r.seq))

    def oldest(self, band: int, n: int) -> list[QueuedRequest[P]]:
        """The band's `n` longest-waiting requests, oldest first."""
        return list(itertools.islice(self._bands[band].by_arrival.values(), n))

    def expired(self, now: float) -> list[QueuedRequest[P]]:
        """The requests that have waited past their band's max_wait_s (still queued: the caller sheds them)."""
        found = []
        for band_value, band in self._bands.items():
            limit = self.config.band(band_value).max_wait_s
            for request in band.by_arrival.values():
                if now - request.arrival <= limit:
                    break
                found.append(request)
        return found

    def all(self) -> list[QueuedRequest[P]]:
        return [r for band in self.bands() for r in self._bands[band].by_arrival.values()]
