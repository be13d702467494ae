"""One simulated gateway: the real `FleetBook` and `RoutingPolicy`, fed what the replicas published as late as
the fleet-state timing says.

`ViewTiming` is how stale a gateway's view is:
  * `index`: where its KV index comes from.
      - "books": the gateway's own book applies the replicas' published KV events at each of its polls
        (kvroute's layout: events in Redis Streams, or read over gRPC by the embedded fleet state);
      - "shared": one KV index that every gateway reads, updated as the replicas publish (llm-d's layout:
        the index in Redis; also `kvroute replay --shared-view`);
      - "private": no events at all; each gateway learns from its own routing decisions (`LearnedKVIndex`).
  * `load`: "reported" takes the replicas' published running + waiting at each poll, plus the gateway's own
    requests since (FleetBook's rule); "own" counts only this gateway's requests in flight.
  * `publish_s`: replicas publish KV events and load every `publish_s` seconds (0: at the end of every step);
    `poll_s`: each gateway reads them every `poll_s` seconds, the gateways' phases spread evenly (0: as soon as
    they are published).
  * `poll_each`: each gateway reads each replica on a schedule of its own (the embedded fleet state's one poller
    per worker), the replicas' first reads spread evenly over `poll_s` after the gateway's; else it reads all
    of them at once.
  * `poll_draw`: each next interval between two reads is drawn from these `(low, high, weight)` ranges (a
    weighted range, then uniformly within it: a live gateway's measured histogram, `kvroute:gateway_fleet_
    report_interval_seconds`), seeded by `seed`; () (the default): every interval is `poll_s`.

With a `FlowControlConfig` the gateway runs the gateway's own flow control (gateway.flow_control.dispatcher, the
code the live gateway runs) on the simulator's clock: `admit` queues a request or grants it at once, and what
becomes of each request (granted, with its grant; shed, with the reason and the HTTP status the client would
get) is collected in `settled` for the fleet simulator to act on (sim.fleet).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass

from gateway.errors import GatewayError
from gateway.fleet.fleet_state import FleetBook, FleetIdentity
from gateway.flow_control.config import FlowControlConfig
from gateway.flow_control.dispatcher import Dispatcher, Grant, queued_bytes
from gateway.routing.fleet_view import FleetView
from gateway.routing.kv_index import KVIndex, LearnedKVIndex
from gateway.routing.router import RouteDecision, RouteRequest, RoutingPolicy
from kvroute.kv_events import KVEvent

INDEX_FEEDS = ("books", "shared", "private")
LOAD_FEEDS = ("reported", "own")


@dataclass(frozen=True)
class ViewTiming:
    index: str = "books"
    load: str = "reported"
    publish_s: float = 0.0
    poll_s: float = 0.0
    poll_each: bool = False
    poll_draw: tuple[tuple[float, float, float], ...] = ()
    seed: int = 0

    def __post_init__(self) -> None:
        if self.index not in INDEX_FEEDS:
            raise ValueError(f"index must be one of {', '.join(INDEX_FEEDS)}, got {self.index!r}")
        if self.load not in LOAD_FEEDS:
            raise ValueError(f"load must be one of {', '.join(LOAD_FEEDS)}, got {self.load!r}")
        if self.publish_s < 0 or self.poll_s < 0:
            raise ValueError("publish_s and poll_s must be >= 0")
        if self.poll_draw and (
            self.poll_s <= 0
            or any(not 0 < low <= high or weight < 0 for low, high, weight in self.poll_draw)
            or not sum(weight for _, _, weight in self.poll_draw) > 0
        ):
            raise ValueError("poll_draw needs poll_s > 0 and ranges 0 < low <= high with weights >= 0, not all 0")

    def intervals(self, stream: int) -> Iterator[float]:
        """The intervals between one poller's reads (`stream` numbers the poller: each draws its own)."""
        if not self.poll_draw:
            return itertools.repeat(self.poll_s)
        rng = random.Random(self.seed * 1_000_003 + stream)
        ranges = [(low, high) for low, high, _ in self.poll_draw]
        weights = list(itertools.accumulate(weight for _, _, weight in self.poll_draw))
        return (rng.uniform(*rng.choices(ranges, cum_weights=weights)[0]) for _ in itertools.count())


@dataclass(frozen=True)
class LoadReport:
    """A replica's published load, numbered so a gateway takes each report once."""

    number: int
    running: int
    waiting: int
    kv_usage: float
    num_blocks: int = 0  # the replica's KV blocks in all (a kvroute worker's GetStats says)


@dataclass(frozen=True)
class Settled:
    """What flow control made of request `index`: a `grant` to send it now, or shed (`grant` None) for
    `reason`, answered with `status`; `waited_s` in the gateway's queue."""

    index: int
    grant: Grant | None
    reason: str
    waited_s: float = 0.0
    status: int = 0


class SimGateway:
    """Routes with `policy` over its view; `read` feeds it what the replicas published (see ViewTiming). With
    `flow_control`, the gateway's flow control on `clock` (the simulator's virtual time, seconds)."""

    def __init__(
        self,
        replicas: Sequence[str],
        policy: RoutingPolicy,
        identity: FleetIdentity,
        timing: ViewTiming,
        shared_index: KVIndex,
        capacity_blocks: int,
        flow_control: FlowControlConfig | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.policy = policy
        self.timing = timing
        self.book = FleetBook(identity)
        for name in replicas:
            self.book.admit(
                name, name, 1, identity.model_id, identity.block_size, 1 << 30,
                identity.hash_fingerprint, identity.tokenizer_fingerprint,
            )  # fmt: skip
        fleet = self.book.fleet
        self.learned: LearnedKVIndex | None = None
        if timing.index == "shared":
            self.view = FleetView(fleet.replicas, fleet.loads, shared_index)
        elif timing.index == "private":
            self.learned = LearnedKVIndex(fleet.replicas, capacity_blocks)
            self.view = FleetView(fleet.replicas, fleet.loads, self.learned)
        else:
            self.view = fleet
        self._unread: dict[str, list[list[KVEvent]]] = {name: [] for name in fleet.replicas}
        self._reports: dict[str, LoadReport] = {}
        self._taken: dict[str, int] = dict.fromkeys(fleet.replicas, -1)
        self.flow: Dispatcher[int] | None = None
        if flow_control is not None:
            if clock is None:
                raise ValueError("flow control runs on the simulator's clock: give `clock`")
            self.flow = Dispatcher(
                flow_control, lambda: self.view, self._pick, _nothing_blocked, identity.block_size, self, clock
            )  # fmt: skip
        self.settled: list[Settled] = []  # flow control's outcomes not yet acted on
        self._arriving = -1  # the request `admit` is taking in (the outcome of a refusal names none)

    def pick(self, request: RouteRequest) -> RouteDecision:
        """The policy's pick over this gateway's view (`sent` once the request goes)."""
        return self.policy.pick(request, self.view)

    def _pick(self, request: RouteRequest, view: FleetView, exclude: frozenset[str]) -> RouteDecision:
        return self.policy.pick(request, view, exclude)

    def sent(self, request: RouteRequest, decision: RouteDecision) -> None:
        """The request goes to `decision.replica` now: the policy's memory (once per request, as the live
        gateway's at its first send) and the book's in-flight count."""
        self.policy.observe(request, decision)
        if self.learned is not None:
            self.learned.record_routed(decision.replica, request.block_hashes)
        self.book.on_dispatch(decision.replica)

    def admit(self, index: int, request: RouteRequest, tenant: str, weight: float, band: int, max_tokens: int) -> None:
        """Request `index` into flow control (sizes as the live gateway counts them, with no body): granted at
        once, queued, or refused; whatever became of it, and of any request it displaced, is in `settled`."""
        assert self.flow is not None
        size = queued_bytes(0, request.num_tokens, len(request.block_hashes))
        self._arriving = index
        try:
            arrived = self.flow.arrive(request, tenant, weight, band, max_tokens, size, index)
        except GatewayError:
            return  # told to `shed`
        if isinstance(arrived, Grant):
            self.settled.append(Settled(index, arrived, arrived.reason))

    # -- flow control's outcomes (gateway.flow_control.dispatcher.Outcomes) --------------------------------------

    def queued(self, band: int) -> None:
        pass

    def granted(self, band: int, reason: str, waited_s: float, grant: Grant, handle: int | None) -> None:
        if handle is not None:  # one granted at once is `admit`'s to record
            self.settled.append(Settled(handle, grant, reason, waited_s))

    def shed(self, band: int, reason: str, error: GatewayError, handle: int | None) -> None:
        index = self._arriving if handle is None else handle
        self.settled.append(Settled(index, None, reason, status=error.http_status))

    def finished(self, replica: str) -> None:
        self.book.on_finish(replica)

    def published(self, replica: str, events: list[KVEvent], report: LoadReport) -> None:
        """A replica published: held until the gateway's next `read`."""
        if events and self.timing.index == "books":
            self._unread[replica].append(events)
        self._reports[replica] = report

    def read(self, resync, replica: str | None = None) -> None:
        """Apply what `replica` (None: every replica) published since the last read; `resync(replica)` gives
        (seq, device hashes, offloaded hashes by tier) after a gap."""
        names = self._unread if replica is None else (replica,)
        if self.timing.index == "books":
            for name in names:
                batches = self._unread[name]
                for events in batches:
                    if not self.book.apply_events(name, 1, events):
                        self.book.resync(name, 1, *resync(name))
                batches.clear()
        if self.timing.load == "reported":
            for name in names:
                report = self._reports.get(name)
                if report is not None and report.number != self._taken[name]:
                    self._taken[name] = report.number
                    self.book.report_load(
                        name, 1, report.running, report.waiting, report.kv_usage, report.num_blocks
                    )  # fmt: skip


def _nothing_blocked() -> Collection[str]:
    return ()  # a simulated replica never fails: no breaker opens
