"""Routing policies: one interface, `RoutingPolicy.pick(request, fleet) -> RouteDecision`.

Every policy is deterministic given the same fleet view, so two gateways with equal views agree
(`round_robin` is the exception by nature: its turn is the gateway's own counter).

- `round_robin`, `random` (seeded, keyed by request id), `least_loaded` (fewest in flight + queued).
- `session`: the session id on the consistent-hash ring, bounded loads (see gateway.hash_ring).
- `prefix`: the request's prefix key on the ring, bounded loads. The key is the chained hash of the first
  `key_blocks` blocks (of all blocks when fewer); since hashes are chained, that is simply the hash at
  depth min(key_blocks, len) - 1. The depth must pass the prefix that *all* traffic shares (a system
  prompt) or every request lands on one ring position, and stop before the part that grows turn by
  turn, or a conversation's turns scatter. The default, 1,024 tokens (2 blocks of Mooncake's 512, 64
  of ours of 16), comes from the Mooncake conversation trace: block 0 (512 tokens) is shared by all
  12,031 requests, block 1 already names the conversation (7,373 distinct keys), and every request has
  at least 2 blocks, so no turn falls back to a shorter key than its conversation's.
- `kv_aware`: the longest cached prefix according to the fleet KV index, weighed against load. The
  exact rule, chosen on the Mooncake conversation trace (8 replicas, see the replay's figures):
    1. a hit must cover the prefix key's block (depth min(key_blocks, len)): a shorter match is only
       the prefix that all traffic shares (the trace's block 0, a system prompt) and says nothing. (A
       looser rule, "or half of the prompt", followed each tenant's salted system prompt on the synthetic
       many-tenant workload, 37,472 -> 25,568 prefill tokens, but drew every new chat to the replicas that
       held the shared system prompt and split chats across them: multi-turn, 120 requests, 16,928 ->
       26,928 with two replicas idle. A prompt whose shared part ends before the key's depth is scattered
       by its key; a deeper or shallower key, `--prefix-key-tokens`, is the workload's knob.)
    2. a replica that holds a share f of the prompt may carry more load before it is skipped: it is a
       candidate while under the bound with epsilon x (1 + f) (so a full hit doubles the slack; a
       recompute costs far more than a slightly longer queue);
    3. among the candidates, the longest match wins, ties broken by the prefix key's ring order
       (reason "hit"; `skipped` lists the better-matching replicas that were over their bound);
    4. no candidate: the request is new to the fleet (or its holders are full), so it takes the
       bounded ring walk of `prefix` ("ring" or "fallback-overloaded"): a new conversation's next
       turns, and its spill, go to predictable replicas.
  Without the load term every request follows block 0 to one replica (the trace README's warning);
  with a plain bound (no step 2) and epsilon 0.5 (the default) kv_aware prefilled 96.4 M tokens, 6%
  above the ideal's 90.7 M; with step 2, 92.3 M (within 2%), at a busy-time imbalance of 1.02.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, fields
from typing import ClassVar

from gateway.fleet import FleetView
from gateway.hash_ring import DEFAULT_VNODES, HashRing, LoadBound, RingPick

BlockKey = Hashable
DEFAULT_KEY_BLOCKS = 64  # 1,024 tokens of 16-token blocks; see the module docstring


@dataclass(frozen=True)
class RouteRequest:
    request_id: str
    block_hashes: Sequence[BlockKey]  # chained (kvroute.hashing) or a trace's prefix-chained hash ids
    num_tokens: int
    session_id: str | None = None


@dataclass(frozen=True)
class RouteDecision:
    replica: str
    reason: str  # hit, ring, session, fallback-overloaded, round_robin, least_loaded, random
    matched_blocks: int = 0  # leading blocks the chosen replica holds, per the view's KV index
    skipped: tuple[str, ...] = ()  # ring successors (or better-matching replicas) passed over for load


@dataclass(frozen=True)
class PolicyOptions:
    epsilon: float = 0.5
    queue_limit: int = 8
    kv_high_watermark: float = 0.95
    min_in_flight: int = 3
    key_blocks: int = DEFAULT_KEY_BLOCKS
    vnodes: int = DEFAULT_VNODES
    seed: int = 0

    def __post_init__(self) -> None:
        if self.key_blocks < 1:
            raise ValueError(f"key_blocks must be >= 1, got {self.key_blocks}")
        if self.vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {self.vnodes}")

    @property
    def bound(self) -> LoadBound:
        return LoadBound(self.epsilon, self.queue_limit, self.kv_high_watermark, self.min_in_flight)


class NoReplicaAvailable(LookupError):
    """The view has no replica to route to (an empty fleet, or every replica excluded)."""


class RoutingPolicy(ABC):
    """Chooses a replica for a request from a read-only fleet view; never mutates the view.

    `pick(request, fleet, exclude)` never returns a replica in `exclude` (the workers a retry already
    failed on); it raises NoReplicaAvailable when no replica is left."""

    name: ClassVar[str]

    def __init__(self, options: PolicyOptions) -> None:
        self.options = options

    def pick(self, request: RouteRequest, fleet: FleetView, exclude: frozenset[str] = frozenset()) -> RouteDecision:
        if exclude:
            fleet = fleet.without(exclude)
        if not fleet.replicas:
            raise NoReplicaAvailable("no live worker to route to" + (" (all excluded)" if exclude else ""))
        return self._pick(request, fleet)

    @abstractmethod
    def _pick(self, request: RouteRequest, fleet: FleetView) -> RouteDecision: ...


def _stable_int(*parts: str) -> int:
    return int.from_bytes(hashlib.blake2b("\x00".join(parts).encode(), digest_size=8).digest(), "little")


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self, options: PolicyOptions) -> None:
        super().__init__(options)
        self._turn = 0

    def _pick(self, request: RouteRequest, fleet: FleetView) -> RouteDecision:
        replica = fleet.replicas[self._turn % len(fleet.replicas)]
        self._turn += 1
        return RouteDecision(replica, "round_robin")


class Random(RoutingPolicy):
    name = "random"

    def _pick(self, request: RouteRequest, fleet: FleetView) -> RouteDecision:
        i = _stable_int(str(self.options.seed), request.request_id) % len(fleet.replicas)
        return RouteDecision(fleet.replicas[i], "random")


class LeastLoaded(RoutingPolicy):
    name = "least_loaded"

    def _pick(self, request: RouteRequest, fleet: FleetView) -> RouteDecision:
        n = len(fleet.replicas)
        start = _stable_int(request.request_id) % n  # spread ties instead of favouring replica 0

        def load(i: int) -> tuple[int, float, int]:
            r = fleet.loads[fleet.replicas[i]]
            return (r.in_flight + r.queued, r.kv_usage, (i - start) % n)

        return RouteDecision(fleet.replicas[min(range(n), key=load)], "least_loaded")


class _RingPolicy(RoutingPolicy):
    """A policy that walks a consistent-hash ring over the fleet's replicas (rebuilt when they change)."""

    def __init__(self, options: PolicyOptions) -> None:
        super().__init__(options)
        self.bound = options.bound
        self._ring: HashRing | None = None

    def ring(self, fleet: FleetView) -> HashRing:
        if self._ring is None or self._ring.replicas != fleet.replicas:
            self._ring = HashRing(fleet.replicas, self.options.vnodes)
        return self._ring

    def prefix_key(self, request: RouteRequest) -> BlockKey:
        if not request.block_hashes:
            return request.request_id  # no full block: nothing to share, spread by request
        return request.block_hashes[min(self.options.key_blocks, len(request.block_hashes)) - 1]

    @staticmethod
    def _ring_decision(pick: RingPick, reason: str) -> RouteDecision:
        return RouteDecision(pick.replica, "fallback-overloaded" if pick.skipped else reason, skipped=pick.skipped)


class SessionAffinity(_RingPolicy):
    name = "session"

    def _pick(self, request: RouteRequest, fleet: FleetView) -> RouteDecision:
        key = request.session_id if request.session_id is not None else request.request_id
        return self._ring_decision(self.ring(fleet).walk_bounded(key, fleet, self.bound), "session")


class PrefixRing(_RingPolicy):
    name = "prefix"

    def _pick(self, request: RouteRequest, fleet: FleetView) -> RouteDecision:
        pick = self.ring(fleet).walk_bounded(self.prefix_key(request), fleet, self.bound)
        return self._ring_decision(pick, "ring")


class KVAware(_RingPolicy):
    name = "kv_aware"

    def _pick(self, request: RouteRequest, fleet: FleetView) -> RouteDecision:
        ring = self.ring(fleet)
        key = self.prefix_key(request)
        matched = fleet.kv_index.match(request.block_hashes)
        order = ring.successors(key)
        total = len(request.block_hashes)
        best_replica, best = None, min(self.options.key_blocks, total) - 1  # rule 1: beat the key's depth
        for replica in order if total else ():  # a prompt with no full block matches nothing: to the ring
            m = matched[fleet.index_of[replica]]
            if m > best and not self.bound.is_over(replica, fleet, self.bound.in_flight_limit(fleet, 1 + m / total)):
                best_replica, best = replica, m
        if best_replica is None:
            pick = ring.walk_bounded(key, fleet, self.bound)
            reason = "fallback-overloaded" if pick.skipped else "ring"
            return RouteDecision(pick.replica, reason, matched[fleet.index_of[pick.replica]], pick.skipped)
        skipped = tuple(r for r in order if matched[fleet.index_of[r]] > best)
        return RouteDecision(best_replica, "hit", best, skipped)


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
