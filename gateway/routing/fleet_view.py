"""What a router sees of the fleet: the live replicas, their load, and the KV index.

The live gateway fills it from heartbeats and KV events (embedded or through Redis); the replay fills it
from its simulated replicas. A policy only reads it, so two gateways with equal views decide alike.
The fleet state changes its membership in place (`add_replica`, `remove_replica`), between two picks.
A view's KV index is any `KVIndexView`; the fleet state's own view holds a `KVIndex` (`FleetView[KVIndex]`,
as `empty` makes), the one whose membership and entries change.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol

from typing_extensions import TypeVar  # a default for the type variable: in `typing` from Python 3.13

from gateway.routing.kv_index import KVIndex
from kvroute.kv_events import BlockKey


class KVIndexView(Protocol):
    """What a router reads of a fleet KV index: the replicas it covers (in order) and, per replica, how many
    leading blocks of a request it holds; `narrowed` to some of them for a retry. KVIndex, its
    NarrowedKVIndex and the engine fleet's WeightedKVIndex are such views."""

    @property
    def replicas(self) -> tuple[str, ...]: ...

    def match(self, block_hashes: Sequence[BlockKey]) -> list[int]: ...

    def narrowed(self, replicas: Sequence[str]) -> KVIndexView: ...


IndexT = TypeVar("IndexT", bound=KVIndexView, default=KVIndexView, covariant=True)


@dataclass(frozen=True)
class PriorityShare:
    """One priority value's share of a worker that schedules by priority (`--scheduling-policy priority`; its
    GetStats / Redis record `priority_loads`): the blocks that preempting its running requests of this priority
    or less urgent frees beyond preempting only the less urgent ones, and its requests waiting at it."""

    priority: int
    running_blocks: int
    waiting: int


@dataclass
class ReplicaLoad:
    """One replica's load as the router sees it."""

    in_flight: int = 0  # requests routed to it and not finished
    queued: int = 0  # of those, requests whose prefill has not started
    kv_usage: float = 0.0  # share of its KV blocks held by live requests, 0..1
    num_blocks: int = 0  # its KV blocks in all, as it last reported them (0: not reported)
    # Requests its last report showed plus this gateway's sent since (at least its own in flight); unlike
    # `in_flight`, not less this gateway's own finishes since (flow control's idle test: room one gateway frees is
    # no one's until every gateway can see it, else that gateway refills it at once, every time, and another
    # gateway's queue starves).
    busy_reported: int = 0
    # As it last reported them, most urgent first; empty: it schedules first come first served (or does not say).
    priorities: tuple[PriorityShare, ...] = ()
    # Load reports this fleet state took from it so far (flow control's clock of them): this gateway's own count,
    # not the worker's load, so two views of one fleet compare equal without it.
    reports: int = field(default=0, compare=False)


@dataclass
class FleetView(Generic[IndexT]):
    """The replicas (sorted ids), the load of each, and the fleet KV index over the same replicas."""

    replicas: tuple[str, ...]
    loads: dict[str, ReplicaLoad]
    kv_index: IndexT
    index_of: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if list(self.replicas) != sorted(self.replicas) or len(set(self.replicas)) != len(self.replicas):
            raise ValueError(f"replica ids must be sorted and distinct, got {self.replicas}")
        if self.kv_index.replicas != self.replicas:
            raise ValueError("the KV index must cover the same replicas as the view")
        self.index_of = {r: i for i, r in enumerate(self.replicas)}

    @classmethod
    def empty(cls, replicas: list[str] | tuple[str, ...], kv_index: KVIndex | None = None) -> FleetView[KVIndex]:
        ids = tuple(sorted(replicas))
        return FleetView(ids, {r: ReplicaLoad() for r in ids}, kv_index or KVIndex(ids))

    def without(self, exclude: frozenset[str]) -> FleetView:
        """The view less some replicas (a retry's failed workers): same loads, the index narrowed to match."""
        kept = tuple(r for r in self.replicas if r not in exclude)
        return FleetView(kept, {r: self.loads[r] for r in kept}, self.kv_index.narrowed(kept))

    def add_replica(self: FleetView[KVIndex], replica: str, load: ReplicaLoad | None = None) -> None:
        """A worker joins: in `replicas` (sorted), `loads` and the KV index (with no entries)."""
        self.kv_index.add_replica(replica)
        self.loads[replica] = load or ReplicaLoad()
        self.replicas = self.kv_index.replicas
        self.index_of = {r: i for i, r in enumerate(self.replicas)}

    def remove_replica(self: FleetView[KVIndex], replica: str) -> None:
        """A worker leaves: out of `replicas`, `loads` and the KV index; the others' entries stay."""
        self.kv_index.remove_replica(replica)
        del self.loads[replica]
        self.replicas = self.kv_index.replicas
        self.index_of = {r: i for i, r in enumerate(self.replicas)}

    @property
    def total_in_flight(self) -> int:
        return sum(load.in_flight for load in self.loads.values())
