"""The gateway's fleet state: which workers are live, how loaded, and which blocks each holds. One interface,
two implementations (DESIGN §1, §4):

- `gateway.embedded_fleet.EmbeddedFleetState`: reads each worker directly over gRPC (GetInfo, GetStats,
  GetKVEvents with snapshot resync). `kvroute up`'s default, and a gateway's fallback while Redis is down.
- `gateway.redis_fleet.RedisFleetState`: reads the registry, load reports and KV events that each worker's
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
Membership changes (a worker joins, its heartbeat expires, it restarts with a new incarnation) update the
view and the KV index in place, never rebuilding them from nothing.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from gateway.fleet import FleetView


@dataclass(frozen=True)
class WorkerMember:
    """One live worker as the gateway knows it (from GetInfo or the Redis registry)."""

    worker_id: str
    address: str  # host:port of its gRPC Worker service
    incarnation: int
    model_id: str
    block_size: int
    max_model_len: int
    hash_fingerprint: str
    tokenizer_fingerprint: str
    parity_ok: bool  # both fingerprints equal the gateway's own: its KV entries are scored


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
    def on_dispatch(self, worker_id: str) -> None: ...

    @abstractmethod
    def on_finish(self, worker_id: str) -> None: ...

    @abstractmethod
    def on_failure(self, worker_id: str) -> None: ...
