"""The Redis fleet state: every gateway builds its view from what the workers' reporters write to Redis.

Layout (kvroute.fleet_keys): a registry hash per worker (identity, fingerprints, load, a `beat` counter,
refreshed every heartbeat with a time-to-live) and a stream of KV events per worker incarnation, with a
snapshot key. Each gateway reads the streams into its own in-memory KV index (so a routing decision never
waits on Redis; benchmarks/fleet_state_bench.py measures the choice against llm-d's index-in-Redis layout).

Every `poll_interval` (0.1 s) one round:
    SMEMBERS workers, HGETALL each record (one pipeline)
        ──► FleetBook.admit (join; new incarnation = restart, old entries dropped; parity checked)
        ──► FleetBook.report_load when `beat` moved;  state draining / dead / stopped ──► leave at once
        ──► leave when `beat` has not moved for the record's heartbeat_ttl (as this gateway's clock sees it)
    XRANGE each scored worker's stream after its last applied seq (one pipeline, then paging)
        ──► FleetBook.apply_events; a gap (trimmed, or Redis came back empty) ──► the snapshot, then on.

Stated times: a worker whose reporter stops leaves within heartbeat_ttl + poll_interval of its last beat;
a deregistered, draining or dead one within poll_interval (a draining one's requests in flight go on); a
new one joins, and its cached blocks are scored, within poll_interval of its registration (events: the
reporter's 0.05 s + poll_interval).

Redis down: the view stays as it was (no worker expires: nobody can beat), loads go on from this gateway's
own counts, and each round retries. With `fallback_addresses` (`--workers` beside `--redis`), after
`fallback_after` seconds (at once when Redis is down at start) the gateway reads those workers directly
(gateway.fleet.embedded_fleet.WorkerPoller) into the same books; stream ids are the workers' own event seqs, so
both sources continue from the same place. When Redis answers again, the direct reading stops, every
member gets a fresh heartbeat_ttl of grace (reporters re-register), and the streams resume.

Liveness (`answering`): the worker's beat moved within half its heartbeat_ttl (2.5 s with the reporter's
defaults, a beat a second and a 5 s TTL); while Redis is down, the direct fallback's polls when it runs
(gateway.fleet.embedded_fleet), else every member counts as answering (nobody can beat: a stream's deadline
then ends only at its cap).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from redis.exceptions import RedisError

from gateway.fleet.embedded_fleet import PollOptions, WorkerPoller, stop_pollers
from gateway.fleet.fleet_state import BookkeepingFleetState, FleetIdentity, WorkerMember
from gateway.routing.fleet_view import PriorityShare
from kvroute.fleet_keys import (
    DEFAULT_PREFIX,
    FleetKeys,
    WorkerRecord,
    as_text,
    redis_client,
    seq_of,
    stream_id,
    unpack_hashes,
    unpack_priority_loads,
)
from kvroute.kv_events import DEVICE, HOST, KVEvent

logger = logging.getLogger(__name__)


class RedisFleetState(BookkeepingFleetState):
    """A fleet state read from Redis (see the module docstring). `start()` reads Redis once (a Redis that is
    down is not an error: the gateway starts with an empty view, or the fallback workers') and then polls."""

    def __init__(
        self,
        redis_url: str,
        identity: FleetIdentity,
        *,
        poll_interval: float = 0.1,
        key_prefix: str = DEFAULT_PREFIX,
        max_events: int = 4096,
        fallback_addresses: Sequence[str] = (),
        fallback_after: float = 1.0,
        password: str | None = None,
        worker_token: str | None = None,
    ) -> None:
        """`password`: Redis's, for a URL that carries none; `worker_token`: what the fallback's direct reads
        present to the workers (kvroute.credentials)."""
        super().__init__(identity)
        if not poll_interval > 0:
            raise ValueError(f"poll_interval must be > 0 seconds, got {poll_interval}")
        if max_events < 1:
            raise ValueError(f"max_events must be >= 1, got {max_events}")
        self.poll_interval = poll_interval
        self.max_events = max_events
        self.fallback_after = fallback_after
        self.keys = FleetKeys(key_prefix)
        self._redis = redis_client(redis_url, password=password, socket_timeout=1.0, socket_connect_timeout=1.0)
        options = PollOptions(poll_interval=poll_interval)
        self._fallback = [WorkerPoller(address, self.book, options, worker_token) for address in fallback_addresses]
        self._fallback_tasks: list[asyncio.Task] = []
        self._beat: dict[str, tuple[int, int]] = {}  # worker id -> (incarnation, beat) last seen
        self._beat_at: dict[str, float] = {}  # worker id -> this gateway's time when its beat last moved
        self._ttl: dict[str, float] = {}
        self._published_seq: dict[str, int] = {}  # worker id -> the reporter's kv_event_seq
        self._bad_records: set[str] = set()  # ids whose malformed record was logged
        self._down_since: float | None = None
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._stopping = False

    @property
    def redis_ok(self) -> bool:
        """False while Redis is unreachable (the view is then the last one, or the fallback's)."""
        return self._down_since is None

    async def start(self) -> None:
        await self.poll_once()
        if self._down_since is not None and self._fallback:
            await self._start_fallback()
        self._task = asyncio.create_task(self._run(), name="redis fleet state")

    async def stop(self) -> None:
        if self._task is not None:
            # The flag ends the loop even if redis-py swallows the cancellation (seen under load).
            self._stopping = True
            self._wake.set()
            self._task.cancel()
            await asyncio.wait({self._task})
            self._task = None
        await self._stop_fallback()
        await self._redis.aclose()

    def answering(self, worker_id: str) -> bool:
        if self.book.member(worker_id) is None:
            return False
        if self._down_since is None:
            return self.book.silent_for(worker_id) <= self._ttl.get(worker_id, 0.0) / 2
        if self._fallback_tasks:
            return self.book.silent_for(worker_id) <= 2 * (self.poll_interval + PollOptions().rpc_timeout)
        return True

    def on_failure(self, worker_id: str) -> None:
        self._wake.set()
        for poller in self._fallback:
            if poller.worker_id == worker_id:
                poller.wake()

    async def _run(self) -> None:
        while not self._stopping:
            try:
                await self.poll_once()
                if self._down_since is not None and self._fallback and not self._fallback_tasks:
                    if self._now() - self._down_since >= self.fallback_after:
                        await self._start_fallback()
            except Exception:  # a dead loop would freeze the view: log and keep polling
                logger.exception("fleet: reading Redis failed")
            self._wake.clear()
            # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel that races the wake-up.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.poll_interval):
                    await self._wake.wait()

    async def poll_once(self) -> None:
        """One round: registry, then KV events. A Redis error ends the round and is counted as an outage."""
        try:
            await self._read_registry()
            await self._read_events()
        except (RedisError, OSError) as exc:
            if self._down_since is None:
                self._down_since = self._now()
                logger.warning("fleet: Redis unreachable (%s); routing on the last view and own counts", exc)
            return
        if self._down_since is not None:
            logger.warning("fleet: Redis is back after %.1f s", self._now() - self._down_since)
            self._down_since = None
            now = self._now()
            for worker_id in self._beat_at:
                self._beat_at[worker_id] = now  # an outage is nobody's missed heartbeat
            await self._stop_fallback()

    # -- registry -------------------------------------------------------------------------------------

    async def _read_registry(self) -> None:
        ids = sorted(as_text(raw) for raw in await self._redis.smembers(self.keys.workers))
        pipe = self._redis.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hgetall(self.keys.info(worker_id))
        raws = await pipe.execute() if ids else []
        now = self._now()
        present: set[str] = set()
        missing: list[str] = []
        for worker_id, raw in zip(ids, raws, strict=True):
            if not raw:
                missing.append(worker_id)
                continue
            record = self._parse(worker_id, raw)
            if record is None:
                continue
            present.add(worker_id)
            self._update(record, now)
        for member in self.book.members():
            if member.worker_id not in present and self._expired(member.worker_id, now):
                self.book.leave(member.worker_id, "its registry entry is gone")
                self._forget(member.worker_id)
        stale_ids = [w for w in missing if self.book.member(w) is None]
        if stale_ids:  # expired records: their reporters add them back at their next heartbeat
            await self._redis.srem(self.keys.workers, *stale_ids)

    def _parse(self, worker_id: str, raw: dict) -> WorkerRecord | None:
        try:
            record = WorkerRecord.from_fields(raw)
            if record.worker_id != worker_id:
                raise ValueError(f"worker record: worker_id {record.worker_id!r} under the key of {worker_id!r}")
        except ValueError as exc:
            if worker_id not in self._bad_records:
                self._bad_records.add(worker_id)
                logger.error("fleet: ignoring worker %s: %s", worker_id, exc)
            return None
        self._bad_records.discard(worker_id)
        return record

    def _update(self, record: WorkerRecord, now: float) -> None:
        worker_id = record.worker_id
        if record.engine_state != "serving":
            if self.book.member(worker_id) is not None:
                lost = record.engine_state != "draining"
                self.book.leave(worker_id, f"it reports {record.engine_state}", lost=lost)
            self._forget(worker_id)
            return
        beat = (record.incarnation, record.beat)
        moved = self._beat.get(worker_id) != beat
        if moved:
            self._beat[worker_id], self._beat_at[worker_id] = beat, now
        self._ttl[worker_id] = record.heartbeat_ttl
        if self._expired(worker_id, now):
            if self.book.member(worker_id) is not None:
                self.book.leave(worker_id, f"no heartbeat for {now - self._beat_at[worker_id]:.1f} s")
            return
        self.book.admit(
            worker_id, record.address, record.incarnation, record.model_id, record.block_size,
            record.max_model_len, record.hash_fingerprint, record.tokenizer_fingerprint,
        )  # fmt: skip
        if moved:
            self.book.report_load(
                worker_id,
                record.incarnation,
                record.num_running,
                record.num_waiting,
                record.kv_cache_usage,
                record.num_blocks_total,
                tuple(PriorityShare(*load) for load in unpack_priority_loads(record.priority_loads)),
            )
        self._published_seq[worker_id] = record.kv_event_seq

    def _expired(self, worker_id: str, now: float) -> bool:
        seen = self._beat_at.get(worker_id)
        return seen is not None and now - seen > self._ttl.get(worker_id, 0.0)

    def _forget(self, worker_id: str) -> None:
        for books in (self._beat, self._beat_at, self._ttl, self._published_seq):
            books.pop(worker_id, None)

    # -- KV events ------------------------------------------------------------------------------------

    async def _read_events(self) -> None:
        behind = [m for m in self.book.members() if m.parity_ok]  # one XRANGE each, in one pipeline
        while behind:
            pipe = self._redis.pipeline(transaction=False)
            for member in behind:
                after = self.book.last_seq(member.worker_id)
                key = self.keys.events(member.worker_id, member.incarnation)
                pipe.xrange(key, min=stream_id(after + 1), count=self.max_events)
            pages = await pipe.execute()
            more = []
            for member, entries in zip(behind, pages, strict=True):
                if await self._apply_page(member, entries) and len(entries) == self.max_events:
                    more.append(member)
            behind = more

    async def _apply_page(self, member: WorkerMember, entries: list) -> bool:
        """Apply one page of a worker's stream; True when it applied cleanly (more may follow)."""
        worker_id, incarnation = member.worker_id, member.incarnation
        after = self.book.last_seq(worker_id)
        if entries and seq_of(entries[0][0]) == after + 1:
            events = [
                KVEvent(
                    seq_of(i),
                    f[b"k"].decode(),
                    tuple(unpack_hashes(f[b"h"])),
                    medium=f[b"m"].decode() if b"m" in f else DEVICE,
                )
                for i, f in entries
            ]
            if self.book.apply_events(worker_id, incarnation, events):
                return True
        elif not entries and self._published_seq.get(worker_id, 0) <= after:
            return False  # nothing new (or the reporter restarted its count: the incarnation tells)
        await self._resync(member)  # the events after ours are gone: start from the snapshot
        return False

    async def _resync(self, member: WorkerMember) -> None:
        raw = await self._redis.hgetall(self.keys.snapshot(member.worker_id, member.incarnation))
        if b"seq" not in raw:
            return  # not written yet (Redis came back empty): the reporter writes one as it re-registers
        seq, packed, host = int(raw[b"seq"]), raw.get(b"h", b""), raw.get(b"hc", b"")
        assert isinstance(packed, bytes) and isinstance(host, bytes), "redis_client keeps responses as bytes"
        offloaded = {HOST: unpack_hashes(host)} if host else None
        self.book.resync(member.worker_id, member.incarnation, seq, unpack_hashes(packed), offloaded)
        logger.info("fleet: worker %s resynced from its snapshot at seq %d", member.worker_id, seq)

    # -- the direct fallback ------------------------------------------------------------------------

    async def _start_fallback(self) -> None:
        logger.warning("fleet: reading %d workers directly until Redis is back", len(self._fallback))
        await asyncio.gather(*(poller.poll_once() for poller in self._fallback))
        self._fallback_tasks = [asyncio.create_task(p.run(), name=f"poll {p.address}") for p in self._fallback]

    async def _stop_fallback(self) -> None:
        if not self._fallback_tasks:
            return
        await stop_pollers(self._fallback, self._fallback_tasks)
        self._fallback_tasks = []
        await asyncio.gather(*(poller.close() for poller in self._fallback))
        for poller in self._fallback:
            poller.worker_id = None  # Redis owns membership again

    @staticmethod
    def _now() -> float:
        return asyncio.get_running_loop().time()


def _medium(fields: dict[bytes, bytes]) -> str:
    """A stream entry's tier (kvroute.fleet_keys: `m` only for a host-tier event)."""
    medium = fields.get(b"m")
    return DEVICE if medium is None else medium.decode()
