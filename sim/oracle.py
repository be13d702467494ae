"""The replay's yardstick: a bounded longest-prefix oracle (`kvroute replay --policies oracle`).

It knows every replica's cache exactly (the replay's fleet KV index, fed by the block pools' events at the
end of every step) and routes request i (counting from 0) by two rules:

  1. a replica is a candidate while it has been given fewer than ceil(1.1 * (i + 1) / N) requests, so
     after any prefix of the trace no replica holds more than 10% above its share of requests (the set
     is never empty: N replicas at that count would already hold more than i requests);
  2. among the candidates, the longest cached prefix wins; ties go to the fewest assigned, then to the
     lowest replica index.

No live router can do this (it needs the caches exactly and counts every request of the fleet), yet it is
greedy, not an optimum: it looks at one request at a time and ignores load, so a policy can beat it (the
replay's table names it "bounded longest-prefix yardstick"). A policy's prefill over the oracle's says how it
compares with exact-knowledge greedy placement; the ideal (one unlimited cache, no routing) is the lower bound
no routing can beat.
"""

from __future__ import annotations

import math
from fractions import Fraction

from gateway.routing.fleet_view import FleetView
from gateway.routing.router import PolicyOptions, RouteDecision, RouteRequest, RoutingPolicy

ORACLE_SLACK = Fraction(11, 10)  # a Fraction: ceil(1.1 (i + 1) / N) with no float rounding at the edges


class BoundedOracle(RoutingPolicy):
    name = "oracle"

    def __init__(self, options: PolicyOptions | None = None) -> None:
        super().__init__(options or PolicyOptions())
        self._assigned: dict[str, int] = {}
        self._routed = 0

    def _pick(self, request: RouteRequest, fleet: FleetView, members: tuple[str, ...]) -> RouteDecision:
        n = len(fleet.replicas)
        cap = math.ceil(ORACLE_SLACK * (self._routed + 1) / n)
        matched = fleet.kv_index.match(request.block_hashes)
        assigned = [self._assigned.get(r, 0) for r in fleet.replicas]
        best = min(
            (i for i in range(n) if assigned[i] + 1 <= cap),
            key=lambda i: (-matched[i], assigned[i], i),
        )
        return RouteDecision(fleet.replicas[best], "oracle", matched[best])

    def observe(self, request: RouteRequest, decision: RouteDecision) -> None:
        self._assigned[decision.replica] = self._assigned.get(decision.replica, 0) + 1
        self._routed += 1
