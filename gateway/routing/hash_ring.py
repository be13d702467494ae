"""A consistent-hash ring (md5 points, virtual nodes) with the bounded-load walk of Mirrokni et al.

A key's replicas in ring order are its successors on the ring. The bounded walk takes the first
successor that is under its bound, so a hot key's overflow always lands on the same second replica
(which then warms its cache for that key) instead of scattering over the fleet.

A replica is over its bound when
    in_flight + 1 > max(ceil((1 + epsilon) * (total_in_flight + 1) / num_replicas), min_in_flight)
or its prefill queue is over `queue_limit`, or its KV usage is over `kv_high_watermark`. Why the floor
`min_in_flight` (3) and the default epsilon (0.5), with figures: docs/routing.md, "The load bound".
"""

from __future__ import annotations

import math
from bisect import bisect
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from hashlib import md5

from gateway.routing.fleet_view import FleetView

DEFAULT_VNODES = 160


def ring_key(key: Hashable) -> str:
    """A stable string for a block hash (bytes) or a trace's hash id (int), the same in every process."""
    return key.hex() if isinstance(key, bytes) else str(key)


@dataclass(frozen=True)
class LoadBound:
    epsilon: float = 0.5
    queue_limit: int = 8
    kv_high_watermark: float = 0.95
    min_in_flight: int = 3

    def __post_init__(self) -> None:
        if self.epsilon < 0:
            raise ValueError(f"epsilon must be >= 0, got {self.epsilon}")
        if self.min_in_flight < 1:
            raise ValueError(f"min_in_flight must be >= 1, got {self.min_in_flight}")
        if self.queue_limit < 0:
            raise ValueError(f"queue_limit must be >= 0, got {self.queue_limit}")
        if not 0 < self.kv_high_watermark <= 1:
            raise ValueError(f"kv_high_watermark must be in (0, 1], got {self.kv_high_watermark}")

    def in_flight_limit(self, fleet: FleetView, slack: float = 1.0, total_in_flight: int | None = None) -> int:
        """The most in-flight requests a replica may have after taking the next one; `slack` scales
        epsilon (kv_aware lets a replica that holds more of the prompt carry more). A caller that asks
        several times in one decision passes the fleet's `total_in_flight` (a sum over every replica)."""
        total = fleet.total_in_flight if total_in_flight is None else total_in_flight
        fair_share = math.ceil((1 + self.epsilon * slack) * (total + 1) / len(fleet.replicas))
        return max(fair_share, self.min_in_flight)

    def is_over(self, replica: str, fleet: FleetView, limit: int) -> bool:
        load = fleet.loads[replica]
        return load.in_flight + 1 > limit or load.queued > self.queue_limit or load.kv_usage > self.kv_high_watermark


class HashRing:
    """A ketama-style continuum over the replica ids, with each position's successor list cached.

    Replica r's `vnodes` points are md5("r-0") ... md5("r-{vnodes-1}") as 128-bit integers, and a key's position
    is the first point after md5(ring_key(key)): uhashring's placement (its default ring), which the ring used to
    be built on; `tests/test_router.py` pins the placements.
    """

    def __init__(self, replicas: Sequence[str], vnodes: int = DEFAULT_VNODES) -> None:
        if not replicas:
            raise ValueError("a hash ring needs at least one replica")
        self.replicas = tuple(replicas)
        owner_of_point = {_point(f"{replica}-{v}"): replica for replica in self.replicas for v in range(vnodes)}
        points = sorted(owner_of_point.items())
        self._points = [point for point, _ in points]
        self._owners = [owner for _, owner in points]
        self._successors: dict[int, tuple[str, ...]] = {}

    def position(self, key: Hashable) -> int:
        pos = bisect(self._points, _point(ring_key(key)))
        return 0 if pos == len(self._points) else pos

    def successors(self, key: Hashable) -> tuple[str, ...]:
        """Every replica once, in ring order from the key's position (the first is the key's owner)."""
        pos = self.position(key)
        cached = self._successors.get(pos)
        if cached is None:
            seen: dict[str, None] = {}
            owners, n, total = self._owners, len(self.replicas), len(self._owners)
            for i in range(pos, pos + total):  # the continuum from the key's point, wrapping once
                seen.setdefault(owners[i % total])
                if len(seen) == n:
                    break
            cached = self._successors[pos] = tuple(seen)
        return cached


def _point(text: str) -> int:
    return int.from_bytes(md5(text.encode()).digest(), "big")
