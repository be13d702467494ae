"""The worker's reporter: registers the worker in Redis and publishes its load and KV events (DESIGN §3).

It runs beside the gRPC server in the same event loop (`kvroute worker --redis URL`). Key layout and record
fields: kvroute.fleet_keys. Every `publish_interval` (0.05 s) it appends the engine's new KV events to the
incarnation's stream, in order, one entry per event with the event's seq as entry id; every
`heartbeat_interval` (1 s), or sooner when the load or the engine state changed, it rewrites the info hash (identity,
fingerprints, load, a `beat` counter) and renews its time-to-live (`heartbeat_ttl`, 5 s).

Snapshots: at registration, and every `snapshot_every` events, it writes every cached block hash as of a
seq and trims the stream to the events after the previous snapshot, so a late gateway starts from the
snapshot and a lagging one from the stream. Events the engine no longer retains are covered the same way.

Redis down: the worker serves on; the reporter logs once, retries every publish interval, and on its return
registers again with a fresh snapshot (Redis may have come back empty), then goes on from the engine's
current seq. `stop()` marks the record "stopped" (gateways drop the worker at once) and lets it expire.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import TYPE_CHECKING, Protocol

from redis.exceptions import RedisError

from kvroute.fleet_keys import (
    DATA_TTL_S,
    DEFAULT_PREFIX,
    FleetKeys,
    WorkerDescription,
    WorkerRecord,
    check_worker_id,
    pack_hashes,
    pack_priority_loads,
    redis_client,
    stream_id,
)
from kvroute.kv_events import DEVICE, BlockKey

if TYPE_CHECKING:
    from worker.async_engine import KVEventsSince
    from worker.engine import EngineStats
    from worker.service import WorkerServer

logger = logging.getLogger(__name__)

_AHEAD_OF_ANY_ENGINE = 2**63  # asking for events after this seq gets a snapshot (KVEventsSince contract)


class EngineFeed(Protocol):
    """What the reporter reads from the engine (worker.async_engine.AsyncEngine has this shape)."""

    latest_stats: EngineStats

    async def kv_events_since(self, after_seq: int, max_events: int = ...) -> KVEventsSince: ...


class WorkerReporter:
    """Reports one worker to Redis until `stop()`. `start()` returns at once: a Redis that is down at start
    is retried like one that goes down later (the worker must serve without it)."""

    def __init__(
        self,
        redis_url: str,
        identity: WorkerDescription,
        engine: EngineFeed,
        *,
        engine_state: Callable[[], str] = lambda: "serving",
        heartbeat_interval: float = 1.0,
        heartbeat_ttl: float = 5.0,
        publish_interval: float = 0.05,
        snapshot_every: int = 10_000,
        max_events: int = 4096,
        key_prefix: str = DEFAULT_PREFIX,
        password: str | None = None,
    ) -> None:
        """`password`: Redis's, for a URL that carries none (kvroute.credentials.redis_password)."""
        if not heartbeat_interval > 0:
            raise ValueError(f"--heartbeat-interval must be > 0 seconds, got {heartbeat_interval}")
        if not heartbeat_ttl > heartbeat_interval:
            raise ValueError(
                f"--heartbeat-ttl ({heartbeat_ttl}) must be longer than --heartbeat-interval ({heartbeat_interval})"
            )
        if not 0 < publish_interval <= heartbeat_interval:
            raise ValueError(f"publish_interval must be in (0, heartbeat_interval], got {publish_interval}")
        check_worker_id(identity.worker_id)
        self.identity = identity
        self.engine = engine
        self.engine_state = engine_state
        self.heartbeat_interval = heartbeat_interval
        self.heartbeat_ttl = heartbeat_ttl
        self.publish_interval = publish_interval
        self.snapshot_every = snapshot_every
        self.max_events = max_events
        self.keys = FleetKeys(key_prefix)
        self._redis = redis_client(
            redis_url, password=password, socket_timeout=max(heartbeat_interval, 1.0), socket_connect_timeout=1.0
        )
        self._info_key = self.keys.info(identity.worker_id)
        self._stream_key = self.keys.events(identity.worker_id, identity.incarnation)
        self._snapshot_key = self.keys.snapshot(identity.worker_id, identity.incarnation)
        self._task: asyncio.Task | None = None
        self._stopping = False
        self._registered = False
        self._published_seq = 0  # the last event in the stream or under the snapshot
        self._snapshot_seq = 0
        self._beat = 0
        self._last_beat_at = 0.0
        self._last_load: tuple[object, ...] = ()
        self._down_since: float | None = None
        self._last_error: str | None = None  # an unexpected error is logged once, not every publish interval

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"reporter {self.identity.worker_id}")

    async def stop(self, deregister: bool = True) -> None:
        """Stop publishing. `deregister`: mark the record stopped so gateways drop this worker now (best
        effort); without it the record is left to expire, as a killed worker's would."""
        if self._task is not None:
            self._stopping = True  # ends the loop even if redis-py swallows the cancellation
            self._task.cancel()
            await asyncio.wait({self._task})
            self._task = None
        try:
            if self._registered and deregister:
                await self._write_record("stopped", ttl=self.heartbeat_ttl)
        except (RedisError, OSError) as exc:
            logger.warning("reporter: could not deregister %s: %s", self.identity.worker_id, exc)
        finally:
            await self._redis.aclose()

    async def _run(self) -> None:
        while not self._stopping:
            try:
                if not self._registered:
                    await self._register()
                await self._publish_events()
                await self._heartbeat()
                if self._down_since is not None:
                    logger.warning("reporter: Redis is back after %.1f s", time.monotonic() - self._down_since)
                    self._down_since = None
            except (RedisError, OSError) as exc:
                self._registered = False
                if self._down_since is None:
                    self._down_since = time.monotonic()
                    logger.warning("reporter: Redis unreachable (%s); the worker serves on, retrying", exc)
            except Exception as exc:  # the reporter must not die silently: gateways would drop this worker
                if repr(exc) != self._last_error:
                    self._last_error = repr(exc)
                    logger.exception("reporter: publishing failed")
            await asyncio.sleep(self.publish_interval)

    async def _register(self) -> None:
        """Snapshot, then record and discovery: a gateway that finds the id finds its record and snapshot."""
        await self._write_snapshot()
        await self._write_record(self.engine_state(), ttl=self.heartbeat_ttl)
        self._registered = True
        logger.info(
            "reporter: %s registered at %s (incarnation %d, KV events from seq %d)",
            self.identity.worker_id, self.identity.address, self.identity.incarnation, self._published_seq,
        )  # fmt: skip

    async def _write_snapshot(self) -> None:
        since = await self.engine.kv_events_since(_AHEAD_OF_ANY_ENGINE, 1)
        await self._put_snapshot(since.latest_seq, since.snapshot or [], since.host_snapshot)

    async def _put_snapshot(self, seq: int, device: Sequence[BlockKey], host: Sequence[BlockKey]) -> None:
        previous = self._snapshot_seq if self._registered else seq
        pipe = self._redis.pipeline(transaction=False)
        pipe.hset(self._snapshot_key, mapping={"seq": str(seq), "h": pack_hashes(device), "hc": pack_hashes(host)})
        pipe.expire(self._snapshot_key, DATA_TTL_S)
        # Keep the events after the previous snapshot: a reader a little behind catches up without it.
        pipe.xtrim(self._stream_key, minid=stream_id(previous + 1), approximate=False)
        await pipe.execute()
        self._snapshot_seq = seq
        self._published_seq = seq

    async def _publish_events(self) -> None:
        while True:
            since = await self.engine.kv_events_since(self._published_seq, self.max_events)
            if since.snapshot is not None:  # the engine no longer has the events after ours
                await self._put_snapshot(since.latest_seq, since.snapshot, since.host_snapshot)
                return
            if not since.events:
                return
            pipe = self._redis.pipeline(transaction=False)
            for event in since.events:
                fields: dict[str, str | bytes] = {"k": event.kind, "h": pack_hashes(event.block_hashes)}
                if event.medium != DEVICE:
                    fields["m"] = event.medium
                pipe.xadd(self._stream_key, fields, id=stream_id(event.seq))  # type: ignore[arg-type]  # (invariant)
            await pipe.execute()
            self._published_seq = since.events[-1].seq
            if self._published_seq - self._snapshot_seq >= self.snapshot_every:
                await self._write_snapshot()
            if self._published_seq >= since.latest_seq:
                return

    async def _heartbeat(self) -> None:
        stats = self.engine.latest_stats
        state = self.engine_state()
        load = (
            state, stats.num_running, stats.num_waiting, stats.num_blocks_used, stats.num_blocks_total,
            _priority_loads(stats),
        )  # fmt: skip
        now = time.monotonic()
        if load == self._last_load and now - self._last_beat_at < self.heartbeat_interval:
            return
        await self._write_record(state, ttl=self.heartbeat_ttl)
        self._last_load, self._last_beat_at = load, now

    async def _write_record(self, engine_state: str, ttl: float) -> None:
        stats = self.engine.latest_stats
        self._beat += 1
        record = WorkerRecord(
            **asdict(self.identity),
            heartbeat_ttl=self.heartbeat_ttl,
            engine_state=engine_state,
            beat=self._beat,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            num_blocks_used=stats.num_blocks_used,
            num_blocks_total=stats.num_blocks_total,
            kv_cache_usage=stats.kv_cache_usage,
            kv_event_seq=self._published_seq,
            priority_loads=_priority_loads(stats),
        )
        pipe = self._redis.pipeline(transaction=False)
        # redis-py's mapping is invariant in its key type (FieldT, a union that str is one of)
        pipe.hset(self._info_key, mapping=record.to_fields())  # type: ignore[arg-type]
        pipe.pexpire(self._info_key, int(ttl * 1000))
        pipe.expire(self._stream_key, DATA_TTL_S)
        pipe.expire(self._snapshot_key, DATA_TTL_S)
        if engine_state != "stopped":  # (gateways prune ids whose record expired; this adds it back)
            pipe.sadd(self.keys.workers, self.identity.worker_id)
        await pipe.execute()


def _priority_loads(stats: EngineStats) -> str:
    """The record's `priority_loads` field (kvroute.fleet_keys)."""
    return pack_priority_loads([(p, load.running_blocks, load.waiting) for p, load in stats.priority_loads.items()])


def reporter_for_server(
    server: WorkerServer,
    redis_url: str,
    *,
    heartbeat_interval: float = 1.0,
    heartbeat_ttl: float = 5.0,
    **options: object,
) -> WorkerReporter:
    """A reporter for a running WorkerServer: its identity and advertise address, its engine's events and
    load, and its engine state (draining while it drains, dead when the engine died). Call `start()`."""
    info = server.servicer.info
    identity = WorkerDescription(
        worker_id=server.worker_id,
        address=server.advertise_address,
        incarnation=server.incarnation,
        model_id=info.model_id,
        block_size=info.block_size,
        max_model_len=info.max_model_len,
        hash_fingerprint=info.hash_fingerprint,
        tokenizer_fingerprint=info.tokenizer_fingerprint,
    )

    def engine_state() -> str:
        if server.engine.error is not None:
            return "dead"
        return "draining" if server.servicer.draining else "serving"

    return WorkerReporter(
        redis_url,
        identity,
        server.engine,
        engine_state=engine_state,
        heartbeat_interval=heartbeat_interval,
        heartbeat_ttl=heartbeat_ttl,
        **options,  # type: ignore[arg-type]
    )


async def start_reporter(
    server: WorkerServer,
    redis_url: str,
    *,
    heartbeat_interval: float = 1.0,
    heartbeat_ttl: float = 5.0,
    password: str | None = None,
) -> WorkerReporter:
    """`kvroute worker --redis URL`: report this server until `stop()`. Raises ValueError naming a bad flag
    (a bad URL, a TTL not longer than the interval); an unreachable Redis is retried, not an error."""
    reporter = reporter_for_server(
        server, redis_url, heartbeat_interval=heartbeat_interval, heartbeat_ttl=heartbeat_ttl, password=password
    )
    await reporter.start()
    return reporter
