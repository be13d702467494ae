"""What a router sees of the fleet: the live replicas, their load, and the KV index.

The live gateway fills it from heartbeats and KV events (embedded or through Redis); the replay fills it
from its simulated replicas. A policy only reads it, so two gateways with equal views decide alike.
The fleet state changes its membership in place (`add_replica`, `remove_replica`), between two picks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gateway.routing.kv_index import KVIndex


@dataclass
class ReplicaLoad:
    """One replica's load as the router sees it."""

    in_flight: int = 0  # requests routed to it and not finished
    queued: int = 0  # of those, requests whose prefill has not started
    kv_usage: float = 0.0  # share of its KV blocks held by live requests, 0..1


@dataclass
class FleetView:
    """The replicas (sorted ids), the load of each, and the fleet KV index over the same replicas."""

    replicas: tuple[str, ...]
    loads: dict[str, ReplicaLoad]
    kv_index: KVIndex
    index_of: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if list(self.replicas) != sorted(self.replicas) or len(set(self.replicas)) != len(self.replicas):
            raise ValueError(f"replica ids must be sorted and distinct, got {self.replicas}")
        if self.kv_index.replicas != self.replicas:
            raise ValueError("the KV index must cover the same replicas as the view")
        self.index_of = {r: i for i, r in enumerate(self.replicas)}

    @classmethod
    def empty(cls, replicas: list[str] | tuple[str, ...], kv_index: KVIndex | None = None) -> FleetView:
        ids = tuple(sorted(replicas))
        return cls(ids, {r: ReplicaLoad() for r in ids}, kv_index or KVIndex(ids))

    def without(self, exclude: frozenset[str]) -> FleetView:
        """The view less some replicas (a retry's failed workers): same loads, the index narrowed to match."""
        kept = tuple(r for r in self.replicas if r not in exclude)
        return FleetView(kept, {r: self.loads[r] for r in kept}, self.kv_index.narrowed(kept))

    def add_replica(self, replica: str, load: ReplicaLoad | None = None) -> None:
        """A worker joins: in `replicas` (sorted), `loads` and the KV index (with no entries)."""
        self.kv_index.add_replica(replica)
        self.loads[replica] = load or ReplicaLoad()
        self.replicas = self.kv_index.replicas
        self.index_of = {r: i for i, r in enumerate(self.replicas)}

    def remove_replica(self, replica: str) -> None:
        """A worker leaves: out of `replicas`, `loads` and the KV index; the others' entries stay."""
        self.kv_index.remove_replica(replica)
        del self.loads[replica]
        self.replicas = self.kv_index.replicas
        self.index_of = {r: i for i, r in enumerate(self.replicas)}

    @property
    def total_in_flight(self) -> int:
        return sum(load.in_flight for load in self.loads.values())
