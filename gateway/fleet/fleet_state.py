"""The gateway's fleet state: which workers are live, how loaded, and which blocks each holds. One interface,
two implementations (DESIGN §1, §4):

- `gateway.fleet.embedded_fleet.EmbeddedFleetState`: reads each worker directly over gRPC (GetInfo, GetStats,
  GetKVEvents with snapshot resync). `kvroute up`'s default, and a gateway's fallback while Redis is down.
- `gateway.fleet.redis_fleet.RedisFleetState`: reads the registry, load reports and KV events that each worker's
  reporter (worker.reporter) writes to Redis; several gateways share it.

Contract for the request path:
  1. `await start()` before the first `view()`; `await stop()` at shutdown.
  2. `view()` is the routing snapshot: `FleetView.replicas` are the ids of the live, routable workers (sorted),
     `loads` combine the workers' reported running / waiting counts with this gateway's own in-flight
     requests (the freshest signal), and the KV index scores only workers whose hash and tokenizer
     fingerprints equal the gateway's own (a mismatched worker is routable by load only). Policies only read
     the view; it may be the same object updated in place between requests.
  3. `member(worker_id)` gives the address and identity to forward to.
  4. `on_dispatch(worker_id)` when a request is sent to a worker, `on_finish(worker_id)` when it ends (any way);
     `on_failure(worker_id)` when a worker could not be reached, so the state can probe it sooner.
  5. `watch_membership(callback)`: `callback(old, lost)` is called, synchronously, with the member as it was
     when it leaves, restarts with a new incarnation or moves to a new address (the request path resets its
     circuit breaker, closes a channel no member uses any more, and, when `lost`, ends the streams still
     on it). `lost` is True when the worker's requests in flight cannot finish (it stopped answering, died,
     restarted or left the registry), False when they go on (it drains, or moved).
  6. `answering(worker_id)`: the worker answered this fleet state's own checks lately (a GetStats reply, a
     heartbeat that moved): alive, if perhaps busy. The request path asks it before it ends a stream whose
     deadline passed (gateway.forwarding.retry.StreamDeadlines), so a worker busy with a long prefill is not cut.
  7. `flags(worker_id)`: why the worker's cached prefixes are not scored (`parity_mismatch`,
     `no_kv_events`), empty for a scored worker; the request path shows them in `x-kvroute-route`.
Membership changes (a worker joins, its heartbeat expires, it restarts with a new incarnation) update the
view and the KV index in place, never rebuilding them from nothing.
"""

from __future__ import annotations

import bisect
import logging
import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from gateway.routing.fleet_view import FleetView, PriorityShare
from kvroute.fleet_keys import WorkerDescription
from kvroute.kv_events import BlockKey, KVEvent

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerMember(WorkerDescription):
    """One live worker as the gateway knows it (its description from GetInfo or the Redis registry)."""

    parity_ok: bool  # both fingerprints equal the gateway's own: its KV entries are scored
    engine: str = "kvroute"  # what it runs, so what it is forwarded over (gateway.worker_spec.ENGINES)


@dataclass(frozen=True)
class FleetIdentity:
    """What the gateway itself computes hashes with; workers must match it to be scored on their KV entries."""

    model_id: str
    block_size: int
    hash_fingerprint: str
    tokenizer_fingerprint: str


class FleetState(ABC):
    @abstractmethod
    async def start(self) -> None: ...

    @abstractmethod
    async def stop(self) -> None: ...

    @abstractmethod
    def view(self) -> FleetView: ...

    @abstractmethod
    def member(self, worker_id: str) -> WorkerMember | None: ...

    @abstractmethod
    def members(self) -> list[WorkerMember]: ...

    @abstractmethod
    def on_dispatch(self, worker_id: str, prompt_blocks: int = 0) -> None:
        """A request with `prompt_blocks` full prompt blocks was sent to the worker (contract item 4)."""

    @abstractmethod
    def on_finish(self, worker_id: str) -> None: ...

    @abstractmethod
    def on_failure(self, worker_id: str) -> None: ...

    @abstractmethod
    def watch_membership(self, callback: Callable[[WorkerMember, bool], None]) -> None: ...

    def answering(self, worker_id: str) -> bool:
        """The worker answered this state's checks lately (contract item 6). This default knows no more
        than membership; the implementations below time the worker's answers."""
        return self.member(worker_id) is not None

    def flags(self, worker_id: str) -> tuple[str, ...]:
        """Why the worker's cached prefixes are not scored (contract item 7); () when they are."""
        member = self.member(worker_id)
        return ("parity_mismatch",) if member is not None and not member.parity_ok else ()


# -- the books both implementations keep ------------------------------------------------------------------


POLL_INTERVAL_BUCKETS = (0.05, 0.1, 0.105, 0.11, 0.12, 0.14, 0.17, 0.2, 0.25, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)


@dataclass
class SecondsHistogram:
    """Durations in seconds as a Prometheus histogram keeps them (a count per upper bound, the last +Inf, and
    the sum), for a collector to read at scrape time."""

    bounds: tuple[float, ...] = POLL_INTERVAL_BUCKETS
    counts: list[int] = field(default_factory=lambda: [0] * (len(POLL_INTERVAL_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.total += seconds


@dataclass
class FleetCounters:
    """Membership and parity events since start, for the gateway's metrics (all monotonic)."""

    joins: int = 0
    leaves: int = 0
    restarts: int = 0  # a known worker came back with a new incarnation
    resyncs: int = 0  # a worker's KV entries were replaced from a snapshot
    parity_mismatches: dict[str, int] = field(default_factory=dict)  # worker id -> mismatched incarnations seen
    no_kv_events: dict[str, int] = field(default_factory=dict)  # worker id -> times found publishing no KV events
    # (worker id, reason) -> engine KV event batches or events dropped (gateway.fleet.engine_events names the reasons)
    kv_event_drops: dict[tuple[str, str], int] = field(default_factory=dict)
    # Seconds between two load reports of one worker that this gateway applied (the embedded fleet state's
    # GetStats replies): how often the view's load and KV entries are refreshed.
    report_intervals: SecondsHistogram = field(default_factory=SecondsHistogram)


@dataclass
class _Reported:
    running: int
    waiting: int
    kv_usage: float
    num_blocks: int
    priorities: tuple[PriorityShare, ...]


class FleetBook:
    """Members, reported load, this gateway's own in-flight counts and the KV index: the state both fleet
    states keep, whatever feeds it. Used from one event loop; every method is synchronous, so a `view()`
    taken for one pick never changes under it.

    Caller contract (the feeding side):
      1. `admit(...)` when a worker answers GetInfo / appears in the registry: it joins, or, with a new
         incarnation, restarts (its entries dropped; its sequence starts over at 0). It returns the member.
      2. `report_load` with each stats report; `apply_events` with its KV events in order (False on a
         sequence gap: resync it), `resync` with a snapshot. Each takes the incarnation the data came
         with and ignores data from any other incarnation (returning False from `apply_events`).
      3. `leave(worker_id, reason, lost=...)` when its heartbeat expires, it stops answering, or its engine is
         dead (`lost`: its requests in flight cannot finish), or it drains (`lost=False`: they go on).
    `silent_for(worker_id)`: seconds since the worker was last heard (admitted, or a load report).
    Load of a member: its reported running + waiting, plus this gateway's requests dispatched since that
    report less those finished since, never below this gateway's own in-flight count (with no report yet,
    the own count alone). `queued`, `kv_usage`, `num_blocks` and `priorities` are as reported; `reports` counts
    the reports.
    """

    def __init__(self, identity: FleetIdentity) -> None:
        self.identity = identity
        self.fleet = FleetView.empty([])
        self.counters = FleetCounters()
        self._members: dict[str, WorkerMember] = {}
        self._own: dict[str, int] = {}  # this gateway's requests in flight per worker (members or not)
        self._since_report: dict[str, int] = {}  # own dispatches less own finishes since the last report
        self._reported: dict[str, _Reported] = {}
        self._heard: dict[str, float] = {}  # member id -> time.monotonic() of its last admission or report
        self._watchers: list[Callable[[WorkerMember, bool], None]] = []

    def set_medium_weights(self, weights: Mapping[str, float]) -> None:
        """What a block a member holds only on an offloaded tier is worth to the router (KVIndex)."""
        self.fleet.kv_index.medium_weights = dict(weights)

    def watch_membership(self, callback: Callable[[WorkerMember, bool], None]) -> None:
        """`callback(old, lost)` when a member leaves, restarts (new incarnation) or moves (new address)."""
        self._watchers.append(callback)

    def _changed(self, old: WorkerMember, lost: bool) -> None:
        for callback in self._watchers:
            callback(old, lost)

    # -- reads ----------------------------------------------------------------------------------------

    def member(self, worker_id: str) -> WorkerMember | None:
        return self._members.get(worker_id)

    def members(self) -> list[WorkerMember]:
        return [self._members[w] for w in sorted(self._members)]

    def is_current(self, worker_id: str, incarnation: int) -> bool:
        member = self._members.get(worker_id)
        return member is not None and member.incarnation == incarnation

    def last_seq(self, worker_id: str) -> int:
        """The last KV event seq applied for a member (0: nothing yet, or its entries are not scored)."""
        return self.fleet.kv_index.last_seq(worker_id)

    def silent_for(self, worker_id: str) -> float:
        """Seconds since the member was last heard (admitted or reported its load); inf for a non-member."""
        heard = self._heard.get(worker_id)
        return math.inf if heard is None else time.monotonic() - heard

    def in_flight(self, worker_id: str) -> int:
        """This gateway's own requests in flight on a worker."""
        return self._own.get(worker_id, 0)

    # -- membership -----------------------------------------------------------------------------------

    def admit(
        self,
        worker_id: str,
        address: str,
        incarnation: int,
        model_id: str,
        block_size: int,
        max_model_len: int,
        hash_fingerprint: str,
        tokenizer_fingerprint: str,
        engine: str = "kvroute",
    ) -> WorkerMember:
        """A worker as it describes itself: joins, restarts (new incarnation) or stays (a changed address
        is taken). Parity is checked here: a mismatch is logged once per incarnation and counted. `engine`:
        what it runs (kvroute, vllm, sglang)."""
        identity = self.identity
        parity_ok = hash_fingerprint == identity.hash_fingerprint and tokenizer_fingerprint == (
            identity.tokenizer_fingerprint
        )
        member = WorkerMember(
            worker_id, address, incarnation, model_id, block_size, max_model_len,
            hash_fingerprint, tokenizer_fingerprint, parity_ok, engine,
        )  # fmt: skip
        old = self._members.get(worker_id)
        if old == member:
            return old
        if old is None:
            self.fleet.add_replica(worker_id)
            self.counters.joins += 1
            logger.info("fleet: worker %s joined at %s (incarnation %d)", worker_id, address, incarnation)
        elif old.incarnation != incarnation:
            self.fleet.kv_index.reset_replica(worker_id)
            self._reported.pop(worker_id, None)
            self._since_report.pop(worker_id, None)
            self.counters.restarts += 1
            logger.info(
                "fleet: worker %s restarted (incarnation %d -> %d); its KV entries were dropped",
                worker_id, old.incarnation, incarnation,
            )  # fmt: skip
        if not parity_ok and (old is None or old.incarnation != incarnation or old.parity_ok):
            self.counters.parity_mismatches[worker_id] = self.counters.parity_mismatches.get(worker_id, 0) + 1
            logger.warning(
                "fleet: worker %s at %s fails hash parity (model %r, block size %d, hash %s, tokenizer %s; this "
                "gateway: model %r, block size %d, hash %s, tokenizer %s): routed by load only, its cached "
                "prefixes are not scored",
                worker_id, address, model_id, block_size, hash_fingerprint[:12], tokenizer_fingerprint[:12],
                identity.model_id, identity.block_size, identity.hash_fingerprint[:12],
                identity.tokenizer_fingerprint[:12],
            )  # fmt: skip
            self.fleet.kv_index.reset_replica(worker_id)
        self._members[worker_id] = member
        self._heard[worker_id] = time.monotonic()
        self._refresh_load(worker_id)
        if old is not None and (old.incarnation != incarnation or old.address != address):
            self._changed(old, lost=old.incarnation != incarnation)
        return member

    def leave(self, worker_id: str, reason: str, *, lost: bool = True) -> None:
        """The worker stops being a candidate; its KV entries go, every other worker's stay. `lost`: its
        requests in flight cannot finish (False for a worker that drains: they go on)."""
        old = self._members.pop(worker_id, None)
        if old is None:
            return
        self.fleet.remove_replica(worker_id)
        self._reported.pop(worker_id, None)
        self._since_report.pop(worker_id, None)
        self._heard.pop(worker_id, None)
        self.counters.leaves += 1
        logger.warning("fleet: worker %s left the candidates: %s", worker_id, reason)
        self._changed(old, lost)

    def forget(self, worker_id: str) -> None:
        """A worker gone for good (a DNS address no longer resolved): after `leave`, its per-worker counters go
        too, so a fleet whose addresses keep changing holds state only for those it has now."""
        counters = self.counters
        counters.parity_mismatches.pop(worker_id, None)
        counters.no_kv_events.pop(worker_id, None)
        for key in [key for key in counters.kv_event_drops if key[0] == worker_id]:
            del counters.kv_event_drops[key]

    # -- reports --------------------------------------------------------------------------------------

    def heard(self, worker_id: str, incarnation: int) -> None:
        """The member answered a check that carries no load report (an engine's /health)."""
        if self.is_current(worker_id, incarnation):
            self._heard[worker_id] = time.monotonic()

    def report_load(
        self,
        worker_id: str,
        incarnation: int,
        running: int,
        waiting: int,
        kv_usage: float,
        num_blocks: int = 0,
        priorities: tuple[PriorityShare, ...] = (),
    ) -> None:
        """`num_blocks`: the worker's KV blocks in all, 0 where it does not say (an HTTP engine); `priorities`:
        what each priority holds and has waiting there, when it schedules by priority."""
        if not self.is_current(worker_id, incarnation):
            return
        self._reported[worker_id] = _Reported(running, waiting, kv_usage, num_blocks, priorities)
        self._since_report[worker_id] = 0
        self._heard[worker_id] = time.monotonic()
        self._refresh_load(worker_id)
        load = self.fleet.loads.get(worker_id)
        if load is not None:
            load.reports += 1

    def apply_events(self, worker_id: str, incarnation: int, events: Iterable[KVEvent]) -> bool:
        """Apply a member's KV events in order. False on a sequence gap (resync it) or for data of another
        incarnation (re-admit it). A worker that fails parity keeps no entries: its events are dropped."""
        if not self.is_current(worker_id, incarnation):
            return False
        if not self._members[worker_id].parity_ok:
            return True
        return self.fleet.kv_index.apply(worker_id, events)

    def mark_stale(self, worker_id: str, incarnation: int) -> None:
        """A member's events were lost where the feeder numbers them itself (an engine's ZMQ sequence): its
        entries are not scored (routed by load) until `resync`."""
        if self.is_current(worker_id, incarnation):
            self.fleet.kv_index.mark_stale(worker_id)

    def resync(
        self,
        worker_id: str,
        incarnation: int,
        seq: int,
        block_hashes: Iterable[BlockKey],
        offloaded: Mapping[str, Iterable[BlockKey]] | None = None,
    ) -> None:
        """Replace a member's entries with its snapshot as of event `seq`: its device's hashes and, per offloaded
        tier, that tier's (KVIndex.resync)."""
        if not self.is_current(worker_id, incarnation):
            return
        if not self._members[worker_id].parity_ok:
            block_hashes, offloaded = (), None
        self.fleet.kv_index.resync(worker_id, seq, block_hashes, offloaded)
        self.counters.resyncs += 1

    # -- this gateway's own requests ------------------------------------------------------------------

    def on_dispatch(self, worker_id: str, prompt_blocks: int = 0) -> None:
        self._own[worker_id] = self._own.get(worker_id, 0) + 1
        if worker_id in self._since_report:
            self._since_report[worker_id] += 1
        self._refresh_load(worker_id)

    def on_finish(self, worker_id: str) -> None:
        own = self._own.get(worker_id, 0)
        if own <= 1:
            self._own.pop(worker_id, None)
        else:
            self._own[worker_id] = own - 1
        if worker_id in self._since_report:
            self._since_report[worker_id] -= 1
        self._refresh_load(worker_id)

    def _refresh_load(self, worker_id: str) -> None:
        load = self.fleet.loads.get(worker_id)
        if load is None:
            return
        own = self._own.get(worker_id, 0)
        reported = self._reported.get(worker_id)
        if reported is None:
            load.in_flight, load.queued, load.kv_usage = own, 0, 0.0
            load.num_blocks, load.busy_reported, load.priorities = 0, own, ()
            return
        estimate = reported.running + reported.waiting + self._since_report[worker_id]
        load.in_flight = max(own, estimate)
        load.busy_reported = max(own, reported.running + reported.waiting + max(0, self._since_report[worker_id]))
        load.queued = reported.waiting
        load.kv_usage = reported.kv_usage
        load.num_blocks = reported.num_blocks
        load.priorities = reported.priorities


class BookkeepingFleetState(FleetState):
    """The part of a FleetState that reads and writes its FleetBook; implementations feed the book.

    `answering`: the book heard the worker within `answer_window` seconds (each implementation states its
    window from how often a live worker is heard)."""

    answer_window: float = 2.2

    def __init__(self, identity: FleetIdentity) -> None:
        self.book = FleetBook(identity)

    @property
    def identity(self) -> FleetIdentity:
        return self.book.identity

    @property
    def counters(self) -> FleetCounters:
        """Joins, leaves, restarts, resyncs and parity mismatches per worker (for the gateway's metrics)."""
        return self.book.counters

    def view(self) -> FleetView:
        return self.book.fleet

    def member(self, worker_id: str) -> WorkerMember | None:
        return self.book.member(worker_id)

    def members(self) -> list[WorkerMember]:
        return self.book.members()

    def on_dispatch(self, worker_id: str, prompt_blocks: int = 0) -> None:
        self.book.on_dispatch(worker_id, prompt_blocks)

    def on_finish(self, worker_id: str) -> None:
        self.book.on_finish(worker_id)

    def watch_membership(self, callback: Callable[[WorkerMember, bool], None]) -> None:
        self.book.watch_membership(callback)

    def answering(self, worker_id: str) -> bool:
        return self.book.silent_for(worker_id) <= self.answer_window
