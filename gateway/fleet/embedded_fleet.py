"""The embedded fleet state: the gateway reads each worker directly over gRPC (DESIGN §1).

`kvroute up`'s default, and the fallback of a Redis gateway while Redis is down. One `WorkerPoller` per
configured address, every `poll_interval` seconds (default 0.1):

    GetStats ──► engine_state, identity, load ──► FleetBook.report_load
       │ not a member yet, or a new worker_id / incarnation at this address
       └──► GetInfo ──► FleetBook.admit (join / restart: old entries dropped; parity checked)
    GetKVEvents(after_seq = last applied, max_events) ──► FleetBook.apply_events, paged until latest_seq;
       a snapshot reply (`is_snapshot`) ──► every page of it (next_snapshot_cursor) ──► FleetBook.resync;
       a sequence gap ──► a full resync from seq 0.

Every call presents the gateway's worker token (`token`, gateway.worker_client.worker_stub). A worker that
refuses snapshot pages for now (RESOURCE_EXHAUSTED, its rate limit) is asked again after the pause it names
(`grpc-retry-pushback-ms`), within the same poll, up to `THROTTLED_WAIT_S` in all; it is not counted as
failing, so it stays a member meanwhile.

Leaving and rejoining, as stated times:
  - a worker whose polls have failed for `unreachable_after` seconds (default 2.0) leaves the candidates:
    at most unreachable_after + rpc_timeout + poll_interval (3.1 s by default) after it stopped answering.
    (A CPU worker busy with a long prefill can miss a 0.5 s deadline; a shorter default made such workers
    flap in and out of the fleet on a 2-core machine.)
    `on_failure(worker_id)` (the request path could not reach it) polls it at once instead of waiting.
  - a worker that reports engine_state DEAD or DRAINING leaves at the next poll (within poll_interval); a
    draining one's requests in flight go on (the membership watch is told they are not lost).
  - a worker that answers again rejoins at the next poll with GetInfo and replays its KV events from 0 (a
    snapshot when they are no longer retained). The channel reconnects with a backoff of 0.1 s to 1 s, so
    a restarted worker is back within about a second of listening.
Each load report applied after the previous one counts the seconds between them in the book's
`counters.report_intervals` (the gateway's `kvroute:gateway_fleet_report_interval_seconds`): poll_interval plus
the poll's round trips and the event loop's delay, the view's real refresh under load.
Liveness (`answering`): the worker's GetStats answered within the last two poll rounds,
2 x (poll_interval + rpc_timeout) = 2.2 s by default: one missed poll is tolerated.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import grpc

from gateway.fleet.fleet_state import BookkeepingFleetState, FleetBook, FleetIdentity, WorkerMember
from gateway.routing.fleet_view import PriorityShare
from gateway.routing.kv_index import KVIndex
from gateway.worker_client import worker_stub
from kvroute.grpc_options import CLIENT_OPTIONS
from kvroute.kv_events import DEVICE, KVEvent
from kvroute.proto_maps import KV_EVENT_KIND_NAMES
from proto import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)
THROTTLED_WAIT_S = 30.0  # the most one poll waits out a worker's snapshot rate limit

_NOT_ROUTABLE = {
    worker_pb2.ENGINE_STATE_DEAD: "its engine is dead",
    worker_pb2.ENGINE_STATE_DRAINING: "it is draining",
}


@dataclass(frozen=True)
class PollOptions:
    poll_interval: float = 0.1  # seconds between two polls of one worker (stats and KV events)
    unreachable_after: float = 2.0  # seconds of failed polls before a worker leaves the candidates
    rpc_timeout: float = 1.0  # deadline of each GetInfo / GetStats / GetKVEvents call
    max_events: int = 4096  # GetKVEvents page size
    max_snapshot_blocks: int = 0  # blocks per snapshot page; 0: the worker's limit

    def __post_init__(self) -> None:
        for name in ("poll_interval", "unreachable_after", "rpc_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")
        if self.max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {self.max_events}")
        if self.max_snapshot_blocks < 0:
            raise ValueError(f"max_snapshot_blocks must be >= 0, got {self.max_snapshot_blocks}")


class _WorkerChanged(Exception):
    """The worker changed under a poll (it restarted): the next poll's GetStats re-admits it."""


class _Conflict(Exception):
    """The worker at this address cannot be a member (its id is already served from another address)."""


class _Throttled(Exception):
    """The worker kept refusing snapshot pages (its rate limit) for THROTTLED_WAIT_S: the next poll resumes."""


def _events(batch: worker_pb2.KVEventBatch) -> list[KVEvent]:
    """The batch's events as records; a kind this gateway does not know makes KVIndex.apply refuse the batch."""
    return [
        KVEvent(
            e.seq,
            KV_EVENT_KIND_NAMES.get(e.kind, "unknown"),  # type: ignore[arg-type]
            tuple(e.block_hashes),
            medium=e.medium or DEVICE,
        )
        for e in batch.events
    ]


@dataclass
class _Snapshot:
    """A snapshot's hashes, read page by page: the device's, and per offloaded tier that tier's."""

    device: list[bytes] = field(default_factory=list)
    offloaded: dict[str, list[bytes]] = field(default_factory=dict)

    def add(self, page: worker_pb2.KVEventBatch) -> None:
        medium = page.snapshot_medium or DEVICE
        into = self.device if medium == DEVICE else self.offloaded.setdefault(medium, [])
        into.extend(page.snapshot_hashes)


def validate_address(address: str) -> str:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"worker address must be host:port, got {address!r}")
    return address


class PollLoop:
    """One worker's poll loop: `poll_once` every `poll_interval` seconds, or at once after `wake()`, until the
    task is cancelled or `halt()`ed; `name` (the worker's address) is what a failed poll's log names. A
    subclass defines `poll_once`."""

    def __init__(self, name: str, poll_interval: float) -> None:
        self.name = name
        self.poll_interval = poll_interval
        self._wake = asyncio.Event()
        self._halted = False

    async def poll_once(self) -> None:
        raise NotImplementedError

    async def run(self) -> None:
        """Poll until cancelled or halted."""
        while not self._halted:
            try:
                await self.poll_once()
            except Exception:  # a poller that died would freeze this worker's view: log and keep polling
                logger.exception("fleet: polling %s failed", self.name)
            self._wake.clear()
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel that races the wake-up.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_interval):
                    await self._wake.wait()

    def wake(self) -> None:
        """Poll now instead of at the next interval (the request path failed to reach this worker)."""
        self._wake.set()

    def halt(self) -> None:
        """End `run` at its next turn, even if a cancellation was swallowed by a library on its way."""
        self._halted = True
        self._wake.set()

    def resume(self) -> None:
        self._halted = False


class WorkerPoller(PollLoop):
    """Keeps one worker's membership, load and KV entries in a FleetBook by polling it over gRPC."""

    def __init__(self, address: str, book: FleetBook, options: PollOptions, token: str | None = None) -> None:
        super().__init__(validate_address(address), options.poll_interval)
        self.address = address
        self.book = book
        self.options = options
        self.token = token
        self.worker_id: str | None = None  # set while it is a member through this poller
        self._channel: grpc.aio.Channel | None = None
        self._stub: worker_pb2_grpc.WorkerStub | None = None
        self._failing_since: float | None = None
        self._conflict: str | None = None  # the id conflict last logged (logged once, not every poll)
        self._refused_logged = False
        self._reported_at: float | None = None  # loop time of the last load report applied while a member

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = self._stub = None

    async def poll_once(self) -> None:
        """One round: stats, membership, KV events. Never raises for a worker's failure; it counts it."""
        try:
            await self._poll()
            self._failing_since = None
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            self._on_failure(exc)
        except (_WorkerChanged, _Throttled) as exc:
            logger.info("fleet: %s", exc)
        except _Conflict as exc:
            self._leave(str(exc))
            if str(exc) != self._conflict:
                self._conflict = str(exc)
                logger.error("fleet: %s is not admitted: %s", self.address, exc)

    def _connect(self) -> worker_pb2_grpc.WorkerStub:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.address, options=CLIENT_OPTIONS)
            self._stub = worker_stub(self._channel, self.token)
        return self._stub

    async def _poll(self) -> None:
        stub, timeout = self._connect(), self.options.rpc_timeout
        stats = await stub.GetStats(worker_pb2.GetStatsRequest(), timeout=timeout)
        if stats.engine_state in _NOT_ROUTABLE:
            reason = _NOT_ROUTABLE[stats.engine_state]
            lost = stats.engine_state != worker_pb2.ENGINE_STATE_DRAINING
            self._leave(f"{reason}" + (f" ({stats.engine_error})" if stats.engine_error else ""), lost=lost)
            return
        member = self._current()
        if member is None or not self._same_worker(member, stats.worker_id, stats.incarnation):
            member = await self._admit(stub)
        self.book.report_load(
            member.worker_id,
            member.incarnation,
            stats.num_running,
            stats.num_waiting,
            stats.kv_cache_usage,
            stats.num_blocks_total,
            tuple(PriorityShare(p.priority, p.running_blocks, p.waiting) for p in stats.priority_loads),
        )
        now = asyncio.get_running_loop().time()
        if self._reported_at is not None:
            self.book.counters.report_intervals.observe(now - self._reported_at)
        self._reported_at = now
        if member.parity_ok:
            await self._poll_events(stub, member)

    def _current(self) -> WorkerMember | None:
        if self.worker_id is None:
            return None
        member = self.book.member(self.worker_id)
        return member if member is not None and member.address == self.address else None

    def _same_worker(self, member: WorkerMember, worker_id: str, incarnation: int) -> bool:
        # A worker that predates identities reports neither: it is known by its address.
        return (worker_id or self.address) == member.worker_id and incarnation == member.incarnation

    async def _admit(self, stub: worker_pb2_grpc.WorkerStub) -> WorkerMember:
        info = await stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=self.options.rpc_timeout)
        worker_id = info.worker_id or self.address
        if self.worker_id is not None and self.worker_id != worker_id:
            self._leave(f"{self.address} now serves worker {worker_id}")
        other = self.book.member(worker_id)
        if other is not None and other.address != self.address:
            raise _Conflict(f"worker id {worker_id!r} is already served from {other.address}")
        self.worker_id = worker_id
        return self.book.admit(
            worker_id, self.address, info.incarnation, info.model_id, info.block_size, info.max_model_len,
            info.hash_fingerprint, info.tokenizer_fingerprint,
        )  # fmt: skip

    async def _poll_events(self, stub: worker_pb2_grpc.WorkerStub, member: WorkerMember) -> None:
        """Apply the events after the last applied one, page by page, until the worker's latest."""
        while True:
            batch = await self._get_events(stub, member, self.book.last_seq(member.worker_id))
            if batch.is_snapshot:
                seq, snapshot, batch = await self._read_snapshot(stub, member, batch)
                self.book.resync(member.worker_id, member.incarnation, seq, snapshot.device, snapshot.offloaded)
                if seq >= batch.latest_seq:
                    return
                continue  # the events after the snapshot's seq, which its later pages may have overtaken
            events = _events(batch)
            if not self.book.apply_events(member.worker_id, member.incarnation, events):
                logger.warning("fleet: worker %s: a gap in its KV events; resyncing", member.worker_id)
                await self._full_resync(stub, member)
                return
            if not events or self.book.last_seq(member.worker_id) >= batch.latest_seq:
                return

    async def _full_resync(self, stub: worker_pb2_grpc.WorkerStub, member: WorkerMember) -> None:
        """Rebuild the worker's cached set from seq 0 (events, or a snapshot) in an index of its own, then swap it
        in at once."""
        worker_id = member.worker_id
        rebuilt = KVIndex((worker_id,), self.book.fleet.kv_index.medium_weights)
        while True:
            batch = await self._get_events(stub, member, rebuilt.last_seq(worker_id))
            if batch.is_snapshot:
                seq, snapshot, batch = await self._read_snapshot(stub, member, batch)
                rebuilt.resync(worker_id, seq, snapshot.device, snapshot.offloaded)
            if not rebuilt.apply(worker_id, _events(batch)):
                raise _WorkerChanged(f"worker {worker_id} sent events out of order")
            if not batch.events or rebuilt.last_seq(worker_id) >= batch.latest_seq:
                break
        self.book.resync(worker_id, member.incarnation, rebuilt.last_seq(worker_id), *rebuilt.tiers(worker_id))

    async def _read_snapshot(
        self, stub: worker_pb2_grpc.WorkerStub, member: WorkerMember, first: worker_pb2.KVEventBatch
    ) -> tuple[int, _Snapshot, worker_pb2.KVEventBatch]:
        """The snapshot whose first page is `first`: its seq, the hashes of all its pages by tier, and the last page."""
        snapshot, batch = _Snapshot(), first
        snapshot.add(first)
        while batch.next_snapshot_cursor:
            batch = await self._get_events(stub, member, first.snapshot_seq, batch.next_snapshot_cursor)
            if not batch.is_snapshot or batch.snapshot_seq != first.snapshot_seq:
                raise _WorkerChanged(f"worker {member.worker_id} answered a snapshot page out of order")
            snapshot.add(batch)
        return first.snapshot_seq, snapshot, batch

    async def _get_events(
        self, stub: worker_pb2_grpc.WorkerStub, member: WorkerMember, after_seq: int, cursor: bytes = b""
    ) -> worker_pb2.KVEventBatch:
        request = worker_pb2.GetKVEventsRequest(
            after_seq=after_seq,
            max_events=self.options.max_events,
            snapshot_cursor=cursor,
            max_snapshot_blocks=self.options.max_snapshot_blocks,
        )
        waited = 0.0
        while True:
            try:
                batch = await stub.GetKVEvents(request, timeout=self.options.rpc_timeout)
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                    raise
                pause = _pushback_s(exc)
                if waited + pause > THROTTLED_WAIT_S:
                    raise _Throttled(f"worker {member.worker_id} refuses snapshot pages: {exc.details()}") from None
                await asyncio.sleep(pause)
                waited += pause
        if batch.worker_id and not self._same_worker(member, batch.worker_id, batch.incarnation):
            # Restarted between two calls: the next poll's GetStats sees the new incarnation and re-admits.
            raise _WorkerChanged(f"worker {member.worker_id} restarted (incarnation {batch.incarnation})")
        return batch

    def _on_failure(self, exc: grpc.aio.AioRpcError | TimeoutError) -> None:
        now = asyncio.get_running_loop().time()
        # A wrong token is a setup error, not an outage: say so once.
        if (
            isinstance(exc, grpc.aio.AioRpcError)
            and exc.code() == grpc.StatusCode.UNAUTHENTICATED
            and not self._refused_logged
        ):
            self._refused_logged = True
            logger.error(
                "fleet: the worker at %s refuses this gateway's worker token (%s); check --worker-token-file / "
                "$KVROUTE_WORKER_TOKEN_FILE against the worker's --auth-token-file",
                self.address,
                exc.details(),
            )
        if self._failing_since is None:
            self._failing_since = now
            if self.worker_id is not None:
                logger.info("fleet: worker %s at %s failed a poll: %s", self.worker_id, self.address, _why(exc))
        if now - self._failing_since >= self.options.unreachable_after:
            self._leave(f"unreachable at {self.address} for {now - self._failing_since:.1f} s ({_why(exc)})")

    def _leave(self, reason: str, lost: bool = True) -> None:
        self._reported_at = None
        if self.worker_id is not None:
            member = self.book.member(self.worker_id)
            if member is not None and member.address == self.address:
                self.book.leave(self.worker_id, reason, lost=lost)
            self.worker_id = None


async def stop_pollers(pollers: Sequence[PollLoop], tasks: Sequence[asyncio.Task]) -> None:
    """Stop the pollers' `run` tasks and wait for them to end."""
    for poller in pollers:
        poller.halt()
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks)
    for poller in pollers:
        poller.resume()


def _pushback_s(exc: grpc.aio.AioRpcError) -> float:
    """The pause a refusal asks for (`grpc-retry-pushback-ms`), 1 s when it names none."""
    for key, value in exc.trailing_metadata() or ():
        if key == "grpc-retry-pushback-ms" and isinstance(value, str) and value.isdigit():
            return max(0.001, int(value) / 1000)
    return 1.0


def _why(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return "timed out"


class EmbeddedFleetState(BookkeepingFleetState):
    """A fleet state over a static list of worker addresses, read directly over gRPC.

    `start()` polls every worker once (so the workers that answer are members when it returns) and then
    keeps polling each in the background; `stop()` cancels the polling and closes the channels."""

    def __init__(
        self,
        addresses: Sequence[str],
        identity: FleetIdentity,
        *,
        poll_interval: float = 0.1,
        unreachable_after: float = 2.0,
        rpc_timeout: float = 1.0,
        max_events: int = 4096,
        max_snapshot_blocks: int = 0,
        token: str | None = None,
    ) -> None:
        """`token`: the worker token every call presents (kvroute.credentials); None for workers without."""
        super().__init__(identity)
        if len(set(addresses)) != len(addresses):
            raise ValueError(f"worker addresses must be distinct, got {list(addresses)}")
        options = PollOptions(poll_interval, unreachable_after, rpc_timeout, max_events, max_snapshot_blocks)
        self.answer_window = 2 * (poll_interval + rpc_timeout)
        self.pollers = [WorkerPoller(address, self.book, options, token) for address in addresses]
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        await asyncio.gather(*(poller.poll_once() for poller in self.pollers))
        self._tasks = [asyncio.create_task(poller.run(), name=f"poll {poller.address}") for poller in self.pollers]

    async def stop(self) -> None:
        await stop_pollers(self.pollers, self._tasks)
        self._tasks = []
        await asyncio.gather(*(poller.close() for poller in self.pollers))

    def on_failure(self, worker_id: str) -> None:
        for poller in self.pollers:
            if poller.worker_id == worker_id:
                poller.wake()
