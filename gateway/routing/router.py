"""Routing policies: one interface, `RoutingPolicy.pick(request, fleet) -> RouteDecision`.

- `round_robin`, `random` (seeded, keyed by request id), `least_loaded` (fewest in flight + queued).
- `session`: the session id on the consistent-hash ring (gateway.routing.hash_ring), bounded loads.
- `prefix`: the request's routing key on the ring, bounded loads; it reads no KV index. The key's owner
  is taken to hold the whole prompt, so it has the slack of a full hit (rule 2 below with f = 1).
- `kv_aware`: the longest cached prefix per the fleet KV index, weighed against load; the ring for the rest.

The routing key (`prefix`, `kv_aware`) is the first block past the common prefix: the leading blocks that
more than one replica's share of recent traffic carries (gateway.routing.common_prefix). It lies past a system
prompt or a popular tenant's tool schemas whatever their length, and at a conversation's, a small
tenant's or a one-off request's first block of its own, which its later turns carry too. A prompt with
no full block is keyed by its request id.

`kv_aware` decides by these rules, in order (`KVAware._pick` follows them one by one):
  0. A conversation's continued turn (`RouteRequest.holder`, /v1/responses) goes back to the replica that
     served its previous turn while that one holds a match as deep as any other replica's (rule 1's common
     prefix aside: a conversation's own blocks may be all the recent traffic a small fleet has seen) and is
     under the bound with rule 2's slack (reason "conversation"); else rules 1-4.
  1. A replica's match is the leading blocks it holds per the index. Only a match deeper than the common
     prefix says where the request belongs.
  2. A replica that holds a share f of the prompt stays a candidate under the load bound with epsilon
     scaled by (1 + HIT_SLACK x f): a recompute costs more than a somewhat longer queue.
  3. Among the candidates the longest match wins, ties broken by the key's ring order (reason "hit";
     `skipped` lists the better-matching replicas that were over their bound).
  4. No candidate: the request's own part is new to the fleet. It goes to the first replica in the key's
     ring order that holds the common prefix and is under its bound (with rule 2's slack for the share
     of the prompt that prefix is), so only its own part is computed (reason "ring"); if none does, to the
     first under the plain bound ("ring", or "fallback-overloaded" when the walk passed replicas over
     it). A new prefix's next requests, and its spill, go to predictable replicas.
Every ring policy then applies the starvation guard to a request that is not a hit: a replica that never
received a request holds no block, so rules 1-4 would never send it one. While the chosen replica is
busy (a prefill queue, or a request more than the fleet's mean in flight), the request goes instead to the
first idle replica in the key's ring order that the policy has not chosen in its last
STARVATION_WINDOW x N decisions (reason "idle"; any idle replica it never chose qualifies at once). A light
fleet is never busy, so it keeps its stickiness.

Every policy is deterministic for the same fleet view and the same earlier requests (`round_robin`'s turn,
the common-prefix sketch and the guard's memory are the policy's own state): two gateways with equal views
that were dealt the same traffic agree. `pick` only reads that state; `observe` updates it, once per request
with the request's final decision, so a retry's second pick neither counts the request again nor moves a
turn. The live gateway's loads come from worker reports plus its own
in-flight counts, the replay's from its simulation; the rules read only `FleetView`.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, fields, replace
from typing import ClassVar

import numpy as np

from gateway.routing.common_prefix import CommonPrefixSketch
from gateway.routing.fleet_view import FleetView
from gateway.routing.hash_ring import DEFAULT_VNODES, HashRing, LoadBound

BlockKey = Hashable
HIT_SLACK = 2.0  # rule 2: a replica holding a share f of the prompt has epsilon x (1 + HIT_SLACK x f)
STARVATION_WINDOW = 4  # the guard: decisions per replica an idle replica may go unchosen while others are busy


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    block_hashes: Sequence[BlockKey]  # chained (kvroute.hashing) or a trace's prefix-chained hash ids
    num_tokens: int
    session_id: str | None = None
    holder: str | None = None  # the replica that served the conversation's previous turn (kv_aware's rule 0)


@dataclass(frozen=True)
class RouteDecision:
    replica: str
    reason: str  # conversation, hit, ring, session, fallback-overloaded, idle, round_robin, least_loaded, random
    matched_blocks: int = 0  # leading blocks the chosen replica holds, per the view's KV index
    skipped: tuple[str, ...] = ()  # ring successors (or better-matching replicas) passed over for load


@dataclass(frozen=True)
class PolicyOptions:
    epsilon: float = 0.5
    queue_limit: int = 8
    kv_high_watermark: float = 0.95
    min_in_flight: int = 3
    vnodes: int = DEFAULT_VNODES
    seed: int = 0

    def __post_init__(self) -> None:
        if self.vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {self.vnodes}")

    @property
    def bound(self) -> LoadBound:
        return LoadBound(self.epsilon, self.queue_limit, self.kv_high_watermark, self.min_in_flight)


class NoReplicaAvailable(LookupError):
    """The view has no replica to route to (an empty fleet, or every replica excluded)."""


class RoutingPolicy(ABC):
    """Chooses a replica for a request from a read-only fleet view; never mutates the view.

    The caller's contract:
      1. `pick(request, fleet, exclude)` is pure: it changes neither the view nor the policy, so a retry calls
         it again with the workers already tried in `exclude`. It never returns a replica in `exclude`, and
         raises NoReplicaAvailable when no replica is left.
      2. `observe(request, decision)` records the request in the policy's memory: call it once per request,
         when the request is first sent, with that decision (before its answer: requests that arrive together
         must each see the ones before them; a retry elsewhere is not observed again)."""

    name: ClassVar[str]

    def __init__(self, options: PolicyOptions) -> None:
        self.options = options

    def pick(self, request: RouteRequest, fleet: FleetView, exclude: frozenset[str] = frozenset()) -> RouteDecision:
        view = fleet.without(exclude) if exclude else fleet
        if not view.replicas:
            raise NoReplicaAvailable("no live worker to route to" + (" (all excluded)" if exclude else ""))
        return self._pick(request, view, fleet.replicas)

    def observe(self, request: RouteRequest, decision: RouteDecision) -> None:
        """Record one routed request; the stateless policies keep nothing."""
        return

    @abstractmethod
    def _pick(self, request: RouteRequest, fleet: FleetView, members: tuple[str, ...]) -> RouteDecision:
        """`fleet` is the view less the excluded replicas; `members` every replica of the view before that."""


def _stable_int(*parts: str) -> int:
    return int.from_bytes(hashlib.blake2b("\x00".join(parts).encode(), digest_size=8).digest(), "little")


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self, options: PolicyOptions) -> None:
        super().__init__(options)
        self._turn = 0

    def _pick(self, request: RouteRequest, fleet: FleetView, members: tuple[str, ...]) -> RouteDecision:
        # The turn indexes every member, so an excluded one passes its turn to the next member after it (a
        # retry, or the picker's list of fallbacks, walks on in the rotation instead of restarting it).
        n, live = len(members), fleet.index_of
        rotation = (members[(self._turn + k) % n] for k in range(n))  # lazily: the first is live but on a retry
        return RouteDecision(next(r for r in rotation if r in live), "round_robin")

    def observe(self, request: RouteRequest, decision: RouteDecision) -> None:
        self._turn += 1


class Random(RoutingPolicy):
    name = "random"

    def _pick(self, request: RouteRequest, fleet: FleetView, members: tuple[str, ...]) -> RouteDecision:
        i = _stable_int(str(self.options.seed), request.request_id) % len(fleet.replicas)
        return RouteDecision(fleet.replicas[i], "random")


class LeastLoaded(RoutingPolicy):
    name = "least_loaded"

    def _pick(self, request: RouteRequest, fleet: FleetView, members: tuple[str, ...]) -> RouteDecision:
        n = len(fleet.replicas)
        start = _stable_int(request.request_id) % n  # spread ties instead of favouring replica 0

        def load(i: int) -> tuple[int, float, int]:
            r = fleet.loads[fleet.replicas[i]]
            return (r.in_flight + r.queued, r.kv_usage, (i - start) % n)

        return RouteDecision(fleet.replicas[min(range(n), key=load)], "least_loaded")


@dataclass(frozen=True)
class Placement:
    """Where a request's prefix puts it on the ring (see the module docstring)."""

    key: BlockKey  # the first block past the common prefix: the request's own routing key
    common: int  # leading blocks that more than one replica's share of recent traffic carries
    order: tuple[str, ...]  # every replica once, in the key's ring order


class _RingPolicy(RoutingPolicy):
    """A policy that walks a consistent-hash ring over the fleet's replicas (rebuilt when they change, not
    when a retry excludes some: it walks the whole ring's order and skips them), with the starvation guard
    of the module docstring."""

    def __init__(self, options: PolicyOptions) -> None:
        super().__init__(options)
        self.bound = options.bound
        self._ring: HashRing | None = None
        self._decisions = 0
        self._last_chosen: dict[str, int] = {}  # replica -> the decision that last chose it

    def ring(self, members: tuple[str, ...]) -> HashRing:
        """The ring over `members` (a view's sorted replica ids), built again only when they change."""
        if self._ring is None or self._ring.replicas != members:
            self._ring = HashRing(members, self.options.vnodes)
        return self._ring

    def order(self, key: BlockKey, fleet: FleetView, members: tuple[str, ...]) -> tuple[str, ...]:
        """The replicas of `fleet` in the key's order on the ring over `members` (a superset of them)."""
        order = self.ring(members).successors(key)
        if len(fleet.replicas) == len(members):
            return order
        kept = fleet.index_of
        return tuple(r for r in order if r in kept)

    def observe(self, request: RouteRequest, decision: RouteDecision) -> None:
        self._decisions += 1
        self._last_chosen[decision.replica] = self._decisions

    def _walk(
        self, order: Sequence[str], fleet: FleetView, slack: float = 1.0, total: int | None = None
    ) -> tuple[str | None, tuple[str, ...]]:
        """The first replica of `order` under its bound (None if none is), and the ones over it before it;
        `total` is the fleet's in-flight count when the caller already has it."""
        limit = self.bound.in_flight_limit(fleet, slack, total)
        for i, replica in enumerate(order):
            if not self.bound.is_over(replica, fleet, limit):
                return replica, tuple(order[:i])
        return None, tuple(order)

    @staticmethod
    def _least_loaded(order: Sequence[str], fleet: FleetView) -> RouteDecision:
        """Every replica is over its bound: the least loaded one (ties to the earlier in `order`)."""
        replica = min(order, key=lambda r: fleet.loads[r].in_flight + fleet.loads[r].queued)
        return RouteDecision(replica, "fallback-overloaded", 0, tuple(r for r in order if r != replica))

    def _guarded(
        self,
        decision: RouteDecision,
        order: Sequence[str],
        fleet: FleetView,
        matched: list[int] | None = None,
        total: int | None = None,
    ) -> RouteDecision:
        """The decision, or (for a request that is not a hit) the first starving replica in `order`: an
        idle one that this policy never chose, or, while the chosen replica is busy (it has a prefill queue,
        or a request more than the fleet's mean in flight), an idle one this policy has not chosen in its
        last STARVATION_WINDOW x N decisions."""
        chosen = fleet.loads[decision.replica]
        if decision.reason != "hit" and chosen.in_flight > 0:
            total = fleet.total_in_flight if total is None else total
            busy = chosen.queued > 0 or chosen.in_flight >= total / len(fleet.replicas) + 1
            horizon = self._decisions + 1 - STARVATION_WINDOW * len(fleet.replicas)  # this decision is the next
            loads, last_chosen = fleet.loads, self._last_chosen
            for replica in order:
                if loads[replica].in_flight:
                    continue
                last = last_chosen.get(replica)
                if last is None or (busy and last <= horizon):
                    depth = matched[fleet.index_of[replica]] if matched else 0
                    decision = RouteDecision(replica, "idle", depth, (decision.replica,))
                    break
        return decision


class SessionAffinity(_RingPolicy):
    name = "session"

    def _pick(self, request: RouteRequest, fleet: FleetView, members: tuple[str, ...]) -> RouteDecision:
        key = request.session_id if request.session_id is not None else request.request_id
        order = self.order(key, fleet, members)
        replica, skipped = self._walk(order, fleet)
        if replica is None:
            return self._guarded(self._least_loaded(order, fleet), order, fleet)
        reason = "fallback-overloaded" if skipped else "session"
        return self._guarded(RouteDecision(replica, reason, 0, skipped), order, fleet)


class PrefixRing(_RingPolicy):
    """The request's key on the ring, bounded loads; reads no KV index. The key's owner is taken to hold
    the whole prompt, so it has the slack of a full hit (rule 2 with f = 1)."""

    name = "prefix"

    def __init__(self, options: PolicyOptions) -> None:
        super().__init__(options)
        self.sketch = CommonPrefixSketch()
        # The last placed request's blocks and sketch cells: a cache, not memory (no decision reads it), so that
        # observing the request does not compute them again.
        self._cells: tuple[Sequence[BlockKey], np.ndarray] | None = None

    def _cells_of(self, blocks: Sequence[BlockKey]) -> np.ndarray:
        if self._cells is None or self._cells[0] is not blocks:
            self._cells = (blocks, self.sketch.cells(blocks))
        return self._cells[1]

    def placement(self, request: RouteRequest, fleet: FleetView, members: tuple[str, ...]) -> Placement:
        """The request's key, common depth (over the sketch of the requests observed before it) and order."""
        blocks = request.block_hashes
        if not blocks:
            return Placement(request.request_id, 0, self.order(request.request_id, fleet, members))
        common, _ = self.sketch.common_prefix(self._cells_of(blocks), len(members))
        key = blocks[min(common, len(blocks) - 1)]
        return Placement(key, common, self.order(key, fleet, members))

    def observe(self, request: RouteRequest, decision: RouteDecision) -> None:
        super().observe(request, decision)
        if request.block_hashes:
            self.sketch.observe(self._cells_of(request.block_hashes))

    def _pick(self, request: RouteRequest, fleet: FleetView, members: tuple[str, ...]) -> RouteDecision:
        order = self.placement(request, fleet, members).order
        replica, skipped = self._walk(order, fleet, 1 + HIT_SLACK)
        if replica is None:
            return self._guarded(self._least_loaded(order, fleet), order, fleet)
        reason = "fallback-overloaded" if skipped else "ring"
        return self._guarded(RouteDecision(replica, reason, 0, skipped), order, fleet)


class KVAware(PrefixRing):
    name = "kv_aware"

    def _pick(self, request: RouteRequest, fleet: FleetView, members: tuple[str, ...]) -> RouteDecision:
        place = self.placement(request, fleet, members)
        matched = fleet.kv_index.match(request.block_hashes)
        total = len(request.block_hashes)
        in_flight = fleet.total_in_flight  # read once: a sum over the fleet, and every bound below needs it
        index_of = fleet.index_of
        depths = [matched[index_of[r]] for r in place.order]  # in ring order

        if request.holder is not None and request.holder in index_of:  # rule 0: the conversation's holder
            held = matched[index_of[request.holder]]
            if held and held >= max(depths):  # as deep as any: the common prefix may be all it has seen yet
                limit = self.bound.in_flight_limit(fleet, 1 + HIT_SLACK * held / total, in_flight)
                if not self.bound.is_over(request.holder, fleet, limit):
                    return RouteDecision(request.holder, "conversation", held)  # a hit: no starvation guard
        best = -1
        for i, m in enumerate(depths):  # rule 3: the order breaks ties, so the first longest match wins
            if m <= place.common or (best >= 0 and m <= depths[best]):
                continue  # rule 1: no deeper than the common prefix; or no better than the best so far
            limit = self.bound.in_flight_limit(fleet, 1 + HIT_SLACK * m / total, in_flight)
            if not self.bound.is_over(place.order[i], fleet, limit):
                best = i  # rule 2
        if best >= 0:
            better = tuple(r for r, m in zip(place.order, depths, strict=True) if m > depths[best])  # over their bound
            decision = RouteDecision(place.order[best], "hit", depths[best], better)
            return self._guarded(decision, place.order, fleet, matched, in_flight)
        common = min(place.common, total)  # rule 4
        holders = [r for r, m in zip(place.order, depths, strict=True) if m >= common]
        replica, _ = self._walk(holders, fleet, 1 + HIT_SLACK * common / max(total, 1), in_flight)
        if replica is not None:
            decision = RouteDecision(replica, "ring", matched[index_of[replica]])
            return self._guarded(decision, place.order, fleet, matched, in_flight)
        replica, skipped = self._walk(place.order, fleet, 1.0, in_flight)
        if replica is None:
            decision = self._least_loaded(place.order, fleet)
            decision = replace(decision, matched_blocks=matched[index_of[decision.replica]])
            return self._guarded(decision, place.order, fleet, matched, in_flight)
        reason = "fallback-overloaded" if skipped else "ring"
        decision = RouteDecision(replica, reason, matched[index_of[replica]], skipped)
        return self._guarded(decision, place.order, fleet, matched, in_flight)


POLICIES: dict[str, type[RoutingPolicy]] = {
    cls.name: cls for cls in (RoundRobin, Random, LeastLoaded, SessionAffinity, PrefixRing, KVAware)
}
POLICY_NAMES = tuple(POLICIES)
_OPTION_NAMES = tuple(f.name for f in fields(PolicyOptions))


def make_policy(name: str, **options: float | int) -> RoutingPolicy:
    """A fresh policy by name; `options` are PolicyOptions fields. Raises ValueError for unknown names."""
    if name not in POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
    unknown = sorted(set(options) - set(_OPTION_NAMES))
    if unknown:
        raise ValueError(f"unknown policy option {unknown[0]!r}; choose from {', '.join(_OPTION_NAMES)}")
    return POLICIES[name](PolicyOptions(**options))  # type: ignore[arg-type]
