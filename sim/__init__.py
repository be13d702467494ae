"""The fleet simulator: real engines and real routers on a virtual clock (DESIGN §5).

A simulated replica (sim.replica) is the worker's own `LLMEngine` with the sim runner: the real scheduler
(chunked prefill, the admission watermark, preemption), `KVCacheManager` and `BlockPool`, paced by the sim
worker's `SimCostModel` on a virtual clock. A simulated gateway (sim.gateway) is the real `FleetBook` and
`RoutingPolicy`, fed the replicas' KV events and load as late as the fleet-state timing (`ViewTiming`) says.
sim.fleet runs them on one timeline. `kvroute replay`, `sweep` and `doctor`, the live bench's prediction
and `benchmarks.fleet_state_bench` all run it; it imports worker/, gateway/ and kvroute/, and nothing below
imports it.
"""

from sim.fleet import FleetConfig, FleetRun, FleetSim, SimRequest
from sim.gateway import ViewTiming

__all__ = ["FleetConfig", "FleetRun", "FleetSim", "SimRequest", "ViewTiming"]
