"""The gateway's subscriber to stock engines' KV events (vLLM, SGLang, and kvroute workers started with
`--kv-events-config`), over ZMQ, feeding a `FleetBook` (gateway/fleet/fleet_state.py) through the KV event records
the index already takes, so the policies and the index do not change (DESIGN §4). The wire format is
`kvroute.engine_kv_events`.

Entry point (what an engine fleet state does with one worker):

    source = EngineEventSource(worker_id, "tcp://10.0.0.5:5557", replay_endpoint="tcp://10.0.0.5:5558")
    subscriber = EngineEventSubscriber(book, source, on_restart=...)
    await subscriber.start()          # after book.admit(worker_id, ...): events for a non-member are dropped
    subscriber.last_event_at          # time.monotonic() of its last well-formed batch, None before the first
    subscriber.counters               # EngineEventCounters: batches, blocks, and every drop by reason
    await subscriber.stop()           # before (or right after) book.leave(worker_id, ...)

Caller contract:
  1. One subscriber per routing target: a worker, or one data-parallel rank of one (each rank is its own cache
     and publishes on the endpoint's port + rank; `EngineEventSource.data_parallel_rank` names the rank, and
     batches stamped with another rank are counted and dropped). Create and use it on the book's event loop.
  2. The book's identity is the pool's: every stored block is re-hashed from the event's `token_ids` with
     `kvroute.hashing` under the pool's model id (a LoRA block under its `lora_name`), the salt the event
     names (vLLM's `extra_keys`, SGLang's `cache_salt`) and the pool's block size; the engine's own hash
     values only name blocks within its stream (a bounded engine-hash -> our-hash map, so `BlockRemoved`
     evicts). Nothing depends on PYTHONHASHSEED or `--prefix-caching-hash-algo`.
  3. Block size: an engine whose block size divides the pool's is aggregated into the pool's blocks (SGLang's
     pages, 1 token by default); any other is a parity failure: logged once, counted (`parity_failures`),
     its events dropped. `parity_failed` says so, for the fleet state to route that worker by load.
  4. Sequence numbers (one per batch, from 0 at the engine's start): a skip marks the worker stale in the
     book (routed by load) and asks the replay socket for the missing batches; where the engine's buffer no
     longer holds them (or there is no replay socket) its entries are dropped and rebuilt from what follows.
     A sequence that goes back (to 0), or any but the next one after the SUB connection dropped, is an engine
     restart: its entries are dropped and `on_restart(worker_id)` is called (the fleet state may treat it as a
     new incarnation); the new process's batches are then replayed from 0.
  5. Bad input never raises out of the subscriber and never puts a wrong entry in the index; each drop is
     counted in `counters.dropped[reason]` and in the book's `FleetCounters.kv_event_drops` (served by the
     gateway as `kvroute:gateway_kv_event_drops{worker, reason}`). A malformed frame, a batch for a worker not
     in the book, a foreign rank or topic, a stored run whose parent it never saw: dropped, entries kept. A
     malformed batch in sequence (not msgpack, an unknown tag, wrong types, over a bound of
     `kvroute.engine_kv_events`: bytes, events, blocks or token ids per event or per batch, each checked before
     what it bounds is decoded) is a lost batch: dropped, and the worker's entries dropped and rebuilt from what
     follows (what it changed is unknown), as are batches the replay cannot give back ("lost_batches"). A frame
     over `MAX_MESSAGE_BYTES` is never read (ZMQ_MAXMSGSIZE): the link drops, as in item 4.
  6. `medium`: a block held only on tiers other than the GPU ("CPU", "CPU_PINNED", "DISK", ...) is in the
     index when `medium_weights` gives one of its tiers a weight > 0, and `weights` maps it to the largest
     such weight (a block with a GPU copy, weight 1, is not in `weights`); a tier not named weighs 0: its
     blocks are not in the index. The fleet state scores a leading block at its weight (EngineFleetState).
  7. `EngineEventHub` is the llm-d layout: one SUB socket the gateway binds, that the engines' publishers
     connect to, keyed by topic (`kv@<ip>:<port>@<model>`): `hub.add(topic, subscriber)` for a subscriber
     made with `events_endpoint=None`.
  8. No batch holds the event loop: `receive(frames)` (what the reader and the hub call) decodes a batch one
     event at a time and applies it in slices of `SLICE_BLOCKS` blocks, the loop run between them, one batch at
     a time per subscriber (a replay's end waits its turn); `handle(frames)` applies it at once, for a caller
     off the loop. Live batches held during a replay are bounded by `MAX_HELD_BATCHES` and `MAX_HELD_BYTES`,
     the batches a replay gives back by `MAX_REPLAY_BATCHES` and `MAX_REPLAY_BYTES`.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Generator, Mapping
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
import zmq.utils.monitor

from gateway.fleet.fleet_state import FleetBook
from kvroute.engine_kv_events import (
    END_SEQ,
    GPU_MEDIA,
    MAX_BATCH_BYTES,
    AllBlocksCleared,
    BatchBudget,
    BatchHead,
    BlockRemoved,
    BlockStored,
    EngineHash,
    KVEventDecodeError,
    decode_event,
    decode_seq,
    encode_seq,
    open_batch,
)
from kvroute.hashing import HASH_BYTES, BlockHash, extend_block_hashes, hash_block, root_hash
from kvroute.kv_events import KVEvent, KVEventKind

logger = logging.getLogger(__name__)

# Engine blocks (SGLang: pages) remembered per worker, engine hash -> our hash: a large GPU's cache of 16-token
# blocks. A fleet state that knows the engine's capacity (vLLM's num_gpu_blocks, SGLang's max_total_num_tokens
# / page size) passes that instead. Past it the oldest is forgotten, and dropped from the index, since its
# removal could no longer be read.
DEFAULT_MAX_BLOCKS = 1 << 18
# A replay is a few thousand batches at most (the engines' buffer_steps default is 10,000); these bound a
# publisher that never ends one, or sends one too large to keep: past a bound the rest is not read, and the
# worker's entries are rebuilt from the live batches after the replay, as for any lost batch.
REPLAY_TIMEOUT_S = 2.0
MAX_REPLAY_BATCHES = 20_000
MAX_REPLAY_BYTES = 4 * MAX_BATCH_BYTES
# Live batches kept while a replay is in flight, by count and by bytes; past either they are lost too, and the
# worker rebuilt after.
MAX_HELD_BATCHES = 20_000
MAX_HELD_BYTES = 4 * MAX_BATCH_BYTES
# ZMQ_MAXMSGSIZE on every socket that reads events: a larger frame is never delivered (the peer is
# disconnected, as for a lost link), so no more than one batch's bound is ever read into memory.
MAX_MESSAGE_BYTES = MAX_BATCH_BYTES
# ZMQ_RCVHWM (messages queued per connection, libzmq's default 1,000) on the same sockets: a connection queues at
# most RCV_HWM x MAX_MESSAGE_BYTES = 64 MiB in the gateway (the default's: 16 GiB) while the reader is behind.
# Past it libzmq stops reading that connection, and the rest waits in the kernel's socket buffers and the engine's
# send queue (a PUB drops past its own SNDHWM: a gap, replayed), so a small bound loses nothing a larger one keeps.
RCV_HWM = 4
# Blocks decoded, hashed and told to the book between two yields to the event loop while one batch is applied (about
# 1 ms of work, a few on a loaded 2-core machine); messages handled per wake-up.
SLICE_BLOCKS = 512
_BURST = 64

Steps = Generator[None, None, None]  # a piece of work that yields wherever the event loop may run between slices


def check_medium_weights(weights: Mapping[str, float]) -> None:
    """ValueError, naming the entry, unless each is an offloaded tier's name (vLLM's `medium`: "CPU", "DISK",
    ...) with a weight in [0, 1]; "GPU" may be named only at 1."""
    for medium, weight in weights.items():
        if not isinstance(medium, str) or not medium:
            raise ValueError(f"medium_weights: a tier is named by a non-empty string, got {medium!r}")
        if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0.0 <= weight <= 1.0:
            raise ValueError(f"medium_weights: {medium}'s weight must be a number in [0, 1], got {weight!r}")
        if medium in GPU_MEDIA and weight != 1:
            raise ValueError(f"medium_weights: a GPU block weighs 1, got {weight!r}")


@dataclass(frozen=True)
class EngineEventSource:
    """Where one routing target publishes: its PUB endpoint (None when it connects to an EngineEventHub),
    its replay endpoint (None: gaps are rebuilt, not replayed), its topic ("" takes every topic on the
    socket) and its data-parallel rank."""

    worker_id: str
    events_endpoint: str | None
    replay_endpoint: str | None = None
    topic: str = ""
    data_parallel_rank: int = 0


@dataclass
class EngineEventCounters:
    """What one subscriber received and dropped since start (all monotonic)."""

    batches: int = 0  # well-formed batches applied
    stored_blocks: int = 0  # engine blocks in BlockStored events applied
    removed_blocks: int = 0
    cleared: int = 0
    gaps: int = 0  # a sequence number skipped
    replayed_batches: int = 0
    rebuilds: int = 0  # entries dropped because batches were lost for good
    restarts: int = 0  # the sequence went back: the engine restarted
    parity_failures: int = 0  # events whose block size does not fit the pool's
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> batches or events dropped
    # The fleet's FleetCounters.kv_event_drops, where every drop is counted too (the gateway's metrics).
    worker_id: str = ""
    book_drops: dict[tuple[str, str], int] | None = field(default=None, repr=False)

    def drop(self, reason: str, count: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + count
        if self.book_drops is not None:
            key = (self.worker_id, reason)
            self.book_drops[key] = self.book_drops.get(key, 0) + count


@dataclass(slots=True)
class _Partial:
    """An engine page that does not end one of the pool's blocks: the last full block before it and the
    tokens since (fewer than a block)."""

    anchor: BlockHash
    tokens: tuple[int, ...]
    foreign: tuple = ()


@dataclass(slots=True)
class _Pending:
    """What a batch changed in the ingest's holdings since the book was last told (`to_book`: it is told;
    a replay's batches are not, the book mirrored at its end)."""

    to_book: bool
    added: list[BlockHash] = field(default_factory=list)
    removed: list[BlockHash] = field(default_factory=list)
    cleared: bool = False


class _Ingest:
    """One engine stream's blocks re-hashed with kvroute's hash: the truth the book's entries mirror."""

    def __init__(self, model_id: str, block_size: int, max_blocks: int, medium_weights: Mapping[str, float]) -> None:
        self.model_id = model_id
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.medium_weights = medium_weights
        # The engine's live blocks, oldest first, for the bound: an OrderedDict forgets its oldest in O(1), where a
        # dict's first key is found by walking the slots deleted before it (quadratic past the bound).
        self.ours: OrderedDict[EngineHash, BlockHash] = OrderedDict()
        self.partial: OrderedDict[EngineHash, _Partial] = OrderedDict()
        self.refs: dict[BlockHash, int] = {}  # copies held (an engine may hold two physical copies of one hash)
        self.offloaded: dict[BlockHash, dict[str, int]] = {}  # of those, the copies on each tier but the GPU
        self.weights: dict[BlockHash, float] = {}  # held blocks without a GPU copy -> their best tier's weight

    def held(self) -> list[BlockHash]:
        return list(self.refs)

    def clear(self) -> None:
        self.ours.clear()
        self.partial.clear()
        self.refs.clear()
        self.offloaded.clear()
        self.weights.clear()

    def _weight(self, medium: str | None) -> float:
        return 1.0 if medium in GPU_MEDIA else self.medium_weights.get(medium or "", 0.0)

    def stored(
        self, event: BlockStored, added: list[BlockHash], removed: list[BlockHash]
    ) -> Generator[None, None, str | None]:
        """Take one BlockStored, yielding between slices of `SLICE_BLOCKS` blocks; new holdings go to `added`
        (and forgotten ones to `removed`). Returns the reason it was dropped, or None."""
        size = event.block_size
        if size != self.block_size and self.block_size % size:
            return "block_size"
        parent = event.parent_block_hash
        lora = event.lora_name
        pending: tuple[int, ...]
        foreign: tuple[Any, ...]
        if parent is None:
            anchor, pending, foreign = root_hash(lora or self.model_id, event.cache_salt()), (), ()
        elif parent in self.ours:
            anchor, pending, foreign = self.ours[parent], (), ()
        elif parent in self.partial:
            p = self.partial[parent]
            anchor, pending, foreign = p.anchor, p.tokens, p.foreign
        else:
            return "unknown_parent"
        medium = None if event.medium in GPU_MEDIA or self._weight(event.medium) <= 0 else event.medium
        counts = self._weight(event.medium) > 0
        hashes, tokens = event.block_hashes, event.token_ids
        if size == self.block_size and not pending and not event.extra_keys:
            for start in range(0, len(hashes), SLICE_BLOCKS):
                if start:
                    yield
                run = hashes[start : start + SLICE_BLOCKS]
                ours_run = extend_block_hashes(anchor, tokens[start * size : (start + len(run)) * size], size)
                for engine_hash, ours in zip(run, ours_run, strict=True):
                    self._hold(engine_hash, ours, counts, medium, added, removed)
                anchor = ours_run[-1]
            return None
        for i, engine_hash in enumerate(hashes):
            if i % SLICE_BLOCKS == SLICE_BLOCKS - 1:
                yield
            pending = pending + tokens[i * size : (i + 1) * size]
            foreign = foreign + event.foreign_keys(i)
            if len(pending) < self.block_size:
                self.partial[engine_hash] = _Partial(anchor, pending, foreign)
                continue
            ours = hash_block(anchor, pending)
            if foreign:  # keys the gateway cannot reproduce: a hash no text prompt ever has, still chainable
                ours = hashlib.blake2b(ours + repr(foreign).encode(), digest_size=HASH_BYTES).digest()
            self._hold(engine_hash, ours, counts, medium, added, removed)
            anchor, pending, foreign = ours, (), ()
        return None

    def _hold(
        self, engine_hash: EngineHash, ours: BlockHash, counts: bool, medium: str | None, added: list, removed: list
    ) -> None:
        """`medium`: None for a GPU copy, else the offloaded tier (which weighs > 0) the copy is on."""
        self.ours[engine_hash] = ours
        if counts:
            n = self.refs.get(ours, 0)
            self.refs[ours] = n + 1
            if not n:
                added.append(ours)
            if medium is not None:
                tiers = self.offloaded.setdefault(ours, {})
                tiers[medium] = tiers.get(medium, 0) + 1
            if medium is not None or ours in self.weights:
                self._reweigh(ours)
        if len(self.ours) + len(self.partial) > self.max_blocks:
            self._forget_oldest(removed)

    def _reweigh(self, ours: BlockHash) -> None:
        tiers = self.offloaded.get(ours)
        if not tiers or self.refs.get(ours, 0) > sum(tiers.values()):
            self.weights.pop(ours, None)  # a GPU copy (or none held): a whole block, or not in the index
        else:
            self.weights[ours] = max(self._weight(m) for m in tiers)

    def _forget_oldest(self, removed: list[BlockHash]) -> None:
        if self.partial:
            self.partial.popitem(last=False)
            return
        _, ours = self.ours.popitem(last=False)
        self.offloaded.pop(ours, None)
        self.weights.pop(ours, None)
        if self.refs.pop(ours, 0):
            removed.append(ours)

    def removed(self, event: BlockRemoved, removed: list[BlockHash]) -> Steps:
        """Take one BlockRemoved, yielding between slices of `SLICE_BLOCKS` blocks. A block's mapping goes with its last
        counted copy, so the map holds the engine's live blocks only and its bound is never reached by churn."""
        counts = self._weight(event.medium) > 0
        medium = None if event.medium in GPU_MEDIA else event.medium
        for i, engine_hash in enumerate(event.block_hashes):
            if i % SLICE_BLOCKS == SLICE_BLOCKS - 1:
                yield
            if self.partial.pop(engine_hash, None) is not None:
                continue
            ours = self.ours.get(engine_hash)
            if ours is None:
                continue
            n = self.refs.get(ours, 0)
            if not counts:
                if not n:
                    del self.ours[engine_hash]
                continue
            tiers = self.offloaded.get(ours)
            if medium is not None and tiers and tiers.get(medium):
                tiers[medium] -= 1
                if not tiers[medium]:
                    del tiers[medium]
            if n > 1:
                self.refs[ours] = n - 1
                self._reweigh(ours)
            elif n == 1:
                del self.refs[ours], self.ours[engine_hash]
                self.offloaded.pop(ours, None)
                self.weights.pop(ours, None)
                removed.append(ours)


def event_socket(context: zmq.asyncio.Context, kind: int) -> zmq.asyncio.Socket:
    """A socket of `kind` that reads KV events or replays, with the bounds every such socket keeps: no linger,
    frames up to MAX_MESSAGE_BYTES (ZMQ_MAXMSGSIZE) and RCV_HWM messages queued per connection (ZMQ_RCVHWM)."""
    sock = context.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.RCVHWM, RCV_HWM)
    return sock


class EngineEventSubscriber:
    """One routing target's KV events into a FleetBook (module docstring: the caller contract)."""

    def __init__(
        self,
        book: FleetBook,
        source: EngineEventSource,
        *,
        on_restart: Callable[[str], None] | None = None,
        max_blocks: int = DEFAULT_MAX_BLOCKS,
        medium_weights: Mapping[str, float] | None = None,
        replay_timeout: float = REPLAY_TIMEOUT_S,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        self.book = book
        self.source = source
        self.worker_id = source.worker_id
        self.counters = EngineEventCounters(worker_id=source.worker_id, book_drops=book.counters.kv_event_drops)
        self.last_event_at: float | None = None
        self.on_restart = on_restart
        self.replay_timeout = replay_timeout
        identity = book.identity
        weights = dict(medium_weights or {})
        check_medium_weights(weights)
        self._ingest = _Ingest(identity.model_id, identity.block_size, max_blocks, weights)
        self._ctx = context or zmq.asyncio.Context.instance()
        self._topic = source.topic.encode()
        self._expected: int | None = None  # the next engine seq; None before the first batch or after a restart
        self._held: list[tuple[int, bytes]] | None = None  # live batches kept while a replay runs
        self._held_bytes = 0
        self._held_overflow = False
        self._book_incarnation: int | None = None
        self._link_lost = False  # the SUB connection dropped and has not come back yet
        self._replaying = False
        self._last: tuple[int, bytes] | None = None  # the last batch applied (seq, payload)
        self._logged: set[str] = set()
        self._tasks: list[asyncio.Task] = []
        self._socket: zmq.asyncio.Socket | None = None
        # Held by whatever changes the ingest across yields (a message, a replay's end): one at a time.
        self._applying = asyncio.Lock()

    @property
    def weights(self) -> Mapping[BlockHash, float]:
        """Our hashes of the blocks it holds only on offloaded tiers -> their weight (contract item 6)."""
        return self._ingest.weights

    @property
    def parity_failed(self) -> bool:
        """An event's block size did not fit the pool's (contract item 3): route this worker by load."""
        return self.counters.parity_failures > 0

    async def start(self) -> None:
        """Connect the SUB socket (none when fed by an EngineEventHub) and start reading."""
        if self.source.events_endpoint is None:
            return
        sock = event_socket(self._ctx, zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, self._topic)
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
        sock.connect(self.source.events_endpoint)
        self._socket = sock
        self._tasks.append(asyncio.create_task(self._read(sock), name=f"kv-events {self.worker_id}"))
        self._tasks.append(asyncio.create_task(self._watch(sock, monitor), name=f"kv-events {self.worker_id} link"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks.clear()
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    async def _watch(self, sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket) -> None:
        """A lost connection: the engine may have restarted behind it, and its first batches gone out before
        the socket reconnects (contract item 4). Routed by load until the connection is back; then its
        replay from 0 tells: the same process still has the last batch applied, a new one does not."""
        try:
            while True:
                event = zmq.utils.monitor.parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self._reconnect(sock)
                if event["event"] == zmq.EVENT_DISCONNECTED and self._expected is not None:
                    self._link_lost = True
                    member = self.book.member(self.worker_id)
                    if member is not None:
                        self.book.mark_stale(self.worker_id, member.incarnation)
                    if self._held is None:  # what arrives before the replay has told is held, not applied
                        self._held, self._held_bytes, self._held_overflow = [], 0, False
                elif event["event"] == zmq.EVENT_CONNECTED and self._link_lost:
                    self._link_lost = False
                    if not self._replaying:
                        await self._run(self._begin_replay(0, check=self._last))
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)

    def _reconnect(self, sock: zmq.asyncio.Socket) -> None:
        """Connect again: libzmq retries a connection that failed, but not one it cut for a protocol error (a
        frame over ZMQ_MAXMSGSIZE), which would leave the worker unheard for good."""
        assert self.source.events_endpoint is not None
        with contextlib.suppress(zmq.ZMQError):  # already gone with the session the error ended
            sock.disconnect(self.source.events_endpoint)
        sock.connect(self.source.events_endpoint)

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            frames = await sock.recv_multipart(copy=True)
            await self.receive(frames)
            for _ in range(_BURST):
                try:
                    frames = await sock.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                await self.receive(frames)
            await asyncio.sleep(0)

    async def _run(self, steps: Steps) -> None:
        """Run `steps` to the end, letting the event loop run between its slices, alone on the ingest."""
        async with self._applying:
            for _ in steps:
                await asyncio.sleep(0)

    # -- one message ---------------------------------------------------------------------------------------

    def handle(self, frames: list[bytes]) -> None:
        """One PUB message `[topic, seq, payload]`, applied at once (for a caller off the event loop, e.g. a
        test); the reader and the hub use `receive`."""
        for _ in self._handle(frames):
            pass

    async def receive(self, frames: list[bytes]) -> None:
        """As `handle`, a large batch applied in slices of `SLICE_BLOCKS` blocks with the event loop run
        between them, so that no batch holds the gateway's requests for longer than one slice."""
        await self._run(self._handle(frames))

    def _handle(self, frames: list[bytes]) -> Steps:
        if len(frames) != 3:
            self._drop("frames", f"a message is 3 frames [topic, seq, payload], got {len(frames)}")
            return
        topic, seq_frame, payload = frames
        if self._topic and topic != self._topic:
            self._drop("topic", f"topic {topic[:60]!r} is not {self._topic!r}")
            return
        try:
            seq = decode_seq(seq_frame)
        except KVEventDecodeError as exc:
            self._drop("malformed", str(exc))
            return
        if self._held is not None:
            self._hold_live(seq, payload)
            return
        expected = self._expected
        if expected is not None and seq < expected:
            yield from self._restarted(f"its sequence went back to {seq} after {expected - 1}")
            expected = None
        if expected is None and seq != 0:
            yield from self._begin_replay(0, (seq, payload))
        elif expected is not None and seq > expected:
            self.counters.gaps += 1
            yield from self._begin_replay(expected, (seq, payload))
        else:
            yield from self._apply(seq, payload)

    def _restarted(self, why: str) -> Steps:
        self.counters.restarts += 1
        logger.warning("kv events: %s restarted (%s): its entries are dropped", self.worker_id, why)
        self._ingest.clear()
        self._expected = None
        yield from self._mirror()
        if self.on_restart is not None:
            self.on_restart(self.worker_id)

    def _apply(self, seq: int, payload: bytes, *, to_book: bool = True) -> Generator[None, None, bool]:
        """Decode and apply one batch as the next in sequence, to the ingest and (`to_book`) the book; False
        (counted) when it was dropped."""
        self._expected = seq + 1
        self._last = (seq, payload)
        try:
            head = open_batch(payload)
        except KVEventDecodeError as exc:
            yield from self._lost(seq, exc, to_book)
            return False
        member = self.book.member(self.worker_id)
        if member is None:
            self._drop("unknown_worker", f"{self.worker_id} is not in the fleet")
            return False
        rank = head.data_parallel_rank
        if rank is not None and rank != self.source.data_parallel_rank:
            self._drop("foreign_rank", f"rank {rank}'s batch; this subscriber reads {self.source.data_parallel_rank}'s")
            return False
        try:
            yield from self._ingest_batch(head, _Pending(to_book=to_book))
        except KVEventDecodeError as exc:
            yield from self._lost(seq, exc, to_book)
            return False
        self.last_event_at = time.monotonic()
        self.counters.batches += 1  # counted once the book has it
        return True

    def _lost(self, seq: int, exc: KVEventDecodeError, to_book: bool) -> Steps:
        # What the batch changed is unknown (a removal in it would leave a block we no longer hold): drop the
        # entries and rebuild from what follows, as for a batch the replay cannot give back.
        self._drop("malformed", str(exc))
        self._rebuild(seq, seq + 1)
        if to_book:
            yield from self._mirror()

    def _flush(self, pending: _Pending) -> Steps:
        """Tell the book what the ingest's holdings became since the last flush, then yield: the book follows
        the ingest slice by slice, never a batch's whole change at once."""
        held = self._ingest.refs
        gone = tuple(h for h in pending.removed if h not in held)  # stored then removed within the slice: gone
        kept = tuple(h for h in pending.added if h in held)  # and the reverse: held
        both: tuple[tuple[KVEventKind, tuple[bytes, ...]], ...] = (("removed", gone), ("stored", kept))
        changes = [(kind, hashes) for kind, hashes in both if hashes]
        if pending.cleared:
            changes.insert(0, ("cleared", ()))
        pending.added.clear()
        pending.removed.clear()
        pending.cleared = False
        for kind, hashes in changes if pending.to_book else ():
            member = self.book.member(self.worker_id)
            if member is None:
                break
            if member.incarnation != self._book_incarnation:
                yield from self._mirror()  # a (re)admission reset the book's entries for this worker
                break
            event = KVEvent(self.book.last_seq(self.worker_id) + 1, kind, hashes)
            if not self.book.apply_events(self.worker_id, member.incarnation, [event]):
                if not self._link_lost:  # marked stale meanwhile for a lost link: its replay mirrors it
                    yield from self._mirror()
                break
        yield

    def _flushing(self, steps: Generator[None, None, Any], pending: _Pending) -> Generator[None, None, Any]:
        """`steps`, with a flush wherever it yields; returns what it returns."""
        while True:
            try:
                next(steps)
            except StopIteration as stop:
                return stop.value
            yield from self._flush(pending)

    def _ingest_batch(self, head: BatchHead, pending: _Pending) -> Steps:
        """The batch's events decoded one at a time into the ingest, flushed to the book (`pending.to_book`) at
        every slice. KVEventDecodeError for a bad event."""
        ingest, counters = self._ingest, self.counters
        budget = BatchBudget()
        since_flush = 0
        for raw in head.events:
            event = decode_event(raw, budget)
            if isinstance(event, BlockStored):
                since_flush += len(event.block_hashes)
                if event.group_idx:
                    counters.drop("kv_cache_group")
                    continue
                reason = yield from self._flushing(ingest.stored(event, pending.added, pending.removed), pending)
                if reason == "block_size":
                    self._parity_failure(event.block_size)
                elif reason is not None:
                    counters.drop(reason)
                else:
                    counters.stored_blocks += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                since_flush += len(event.block_hashes)
                if event.group_idx:
                    counters.drop("kv_cache_group")
                    continue
                yield from self._flushing(ingest.removed(event, pending.removed), pending)
                counters.removed_blocks += len(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                ingest.clear()
                pending.added.clear()
                pending.removed.clear()
                pending.cleared = True
                counters.cleared += 1
            since_flush += 1
            if since_flush >= SLICE_BLOCKS:
                since_flush = 0
                yield from self._flush(pending)
        yield from self._flush(pending)

    def _parity_failure(self, block_size: int) -> None:
        self.counters.parity_failures += 1
        self.counters.drop("block_size")
        if "parity" not in self._logged:
            self._logged.add("parity")
            logger.warning(
                "kv events: %s publishes blocks of %d tokens, the pool hashes blocks of %d: its events are "
                "dropped and it is routed by load (start the engine with --block-size %d)",
                self.worker_id, block_size, self._ingest.block_size, self._ingest.block_size,
            )  # fmt: skip

    def _mirror(self) -> Steps:
        """Make the book's entries for this worker exactly the ingest's holdings (a resync with the first
        `SLICE_BLOCKS`, the rest added as stored events, a slice at a time)."""
        member = self.book.member(self.worker_id)
        if member is None:
            return
        held = self._ingest.held()
        incarnation = member.incarnation
        self.book.resync(self.worker_id, incarnation, self.book.last_seq(self.worker_id), held[:SLICE_BLOCKS])
        self._book_incarnation = incarnation
        for i in range(SLICE_BLOCKS, len(held), SLICE_BLOCKS):
            yield
            event = KVEvent(self.book.last_seq(self.worker_id) + 1, "stored", tuple(held[i : i + SLICE_BLOCKS]))
            if not self.book.apply_events(self.worker_id, incarnation, [event]):
                return  # readmitted or marked stale meanwhile: what did that mirrors it again

    def _drop(self, reason: str, message: str) -> None:
        self.counters.drop(reason)
        if reason not in self._logged:
            self._logged.add(reason)
            logger.warning("kv events from %s dropped (%s): %s", self.worker_id, reason, message[:200])

    # -- gaps ------------------------------------------------------------------------------------------------

    def _begin_replay(
        self, start: int, first: tuple[int, bytes] | None = None, *, check: tuple[int, bytes] | None = None
    ) -> Steps:
        """Replay from `start`, holding live batches (`first` the one that showed the gap) until it ends.
        `check` (after a reconnect): the last batch applied, which the same engine process replays unchanged."""
        member = self.book.member(self.worker_id)
        if member is not None:
            self.book.mark_stale(self.worker_id, member.incarnation)
        if self._held is None:
            self._held, self._held_bytes, self._held_overflow = [], 0, False
        if first is not None:
            self._hold_live(*first)
        self._replaying = True
        if self.source.replay_endpoint is None:
            yield from self._finish_replay(start, [], check)
            return
        task = asyncio.create_task(self._replay(start, check), name=f"kv-replay {self.worker_id}")
        self._tasks.append(task)

    def _hold_live(self, seq: int, payload: bytes) -> None:
        assert self._held is not None
        if len(self._held) >= MAX_HELD_BATCHES or self._held_bytes + len(payload) > MAX_HELD_BYTES:
            self._held_overflow = True
            self._held.clear()
            self._held_bytes = 0
        self._held.append((seq, payload))
        self._held_bytes += len(payload)

    async def _replay(self, start: int, check: tuple[int, bytes] | None) -> None:
        replayed: list[tuple[int, bytes]] = []
        replayed_bytes = 0
        complete = False  # the end marker came
        endpoint = self.source.replay_endpoint
        assert endpoint is not None  # _begin_replay replays without one in place
        sock = event_socket(self._ctx, zmq.DEALER)
        try:
            sock.connect(endpoint)
            await sock.send_multipart([b"", encode_seq(start)])
            async with asyncio.timeout(self.replay_timeout):
                while len(replayed) < MAX_REPLAY_BATCHES:
                    frames = await sock.recv_multipart()
                    if frames and frames[0] == b"":
                        frames = frames[1:]
                    if len(frames) == 3:  # [topic, seq, payload] (vLLM 0.33, SGLang); older vLLM: [seq, payload]
                        frames = frames[1:]
                    if len(frames) != 2:
                        self._drop("replay_frames", f"a replay reply is [seq, payload], got {len(frames)} frames")
                        break
                    seq = decode_seq(frames[0])
                    if seq == END_SEQ:
                        complete = True
                        break
                    replayed_bytes += len(frames[1])
                    if replayed_bytes > MAX_REPLAY_BYTES:
                        self._drop("replay", f"a replay from {endpoint} is over {MAX_REPLAY_BYTES >> 20} MiB")
                        break
                    replayed.append((seq, frames[1]))
        except (TimeoutError, KVEventDecodeError, zmq.ZMQError) as exc:
            self._drop("replay", f"replay from {self.source.replay_endpoint} failed: {exc!r}")
        finally:
            sock.close(linger=0)
            self._tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        await self._run(self._finish_replay(start, replayed, check, complete))

    def _finish_replay(
        self,
        start: int,
        replayed: list[tuple[int, bytes]],
        check: tuple[int, bytes] | None = None,
        complete: bool = False,
    ) -> Steps:
        """Apply the replayed batches and the live ones held meanwhile, in order from `start`; wherever one is
        missing, drop the entries and rebuild from what follows; then mirror the result into the book. With
        `check`, the replay (from 0) follows a reconnect: the same process goes on after its last batch
        applied here; any other is a restart, applied from its first batch."""
        held, overflow = self._held or [], self._held_overflow
        self._held = [] if self._link_lost else None  # lost again meanwhile: hold on until it is back
        self._held_bytes = 0
        self._held_overflow = False
        self._replaying = False
        batches = dict(replayed)
        self.counters.replayed_batches += len(batches)
        if check is not None:
            last_seq, last_payload = check
            if batches.get(last_seq) == last_payload:
                start = last_seq + 1
            else:
                if complete:  # the same process keeps its last batch; one with none (empty) is new too
                    yield from self._restarted(
                        "a new process behind its endpoint: its replay lacks the last batch applied"
                    )
                else:  # no whole replay to tell by: what it holds now is unknown
                    self.counters.rebuilds += 1
                    self._ingest.clear()
                start = 0
        if overflow:
            batches = {s: p for s, p in batches.items() if s >= held[0][0]} if held else {}
        batches.update(held)
        expected = start
        for seq in sorted(batches):
            if seq < expected:
                continue
            if seq > expected:
                self._rebuild(expected, seq)
            yield from self._apply(seq, batches[seq], to_book=False)
            expected = seq + 1
            yield
        self._expected = expected
        yield from self._mirror()

    def _rebuild(self, expected: int, seq: int) -> None:
        self.counters.rebuilds += 1
        self.counters.drop("lost_batches", seq - expected)
        log = logger.debug if "rebuild" in self._logged else logger.warning
        self._logged.add("rebuild")
        log(
            "kv events: %s batches %d..%d are lost (not replayable, or malformed): its entries are dropped and "
            "rebuilt from what follows",
            self.worker_id, expected, seq - 1,
        )  # fmt: skip
        self._ingest.clear()


class EngineEventHub:
    """One bound SUB socket that engines' publishers connect to (llm-d's layout), dispatching each message by
    its topic to the subscriber added for it; a topic no subscriber has is counted and dropped."""

    def __init__(self, bind_endpoint: str, *, context: zmq.asyncio.Context | None = None) -> None:
        self.bind_endpoint = bind_endpoint
        self.dropped: dict[str, int] = {}
        self._ctx = context or zmq.asyncio.Context.instance()
        self._subscribers: dict[bytes, EngineEventSubscriber] = {}
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self.endpoint: str | None = None  # as bound (the port chosen for tcp://host:0 filled in)

    def add(self, topic: str, subscriber: EngineEventSubscriber) -> None:
        if subscriber.source.events_endpoint is not None:
            raise ValueError("a hub's subscribers have events_endpoint=None: the hub reads for them")
        self._subscribers[topic.encode()] = subscriber

    def remove(self, topic: str) -> None:
        self._subscribers.pop(topic.encode(), None)

    async def start(self) -> None:
        sock = event_socket(self._ctx, zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        if self.bind_endpoint.endswith(":0"):
            port = sock.bind_to_random_port(self.bind_endpoint.rsplit(":", 1)[0])
            self.endpoint = f"{self.bind_endpoint.rsplit(':', 1)[0]}:{port}"
        else:
            sock.bind(self.bind_endpoint)
            self.endpoint = self.bind_endpoint
        self._socket = sock
        self._task = asyncio.create_task(self._read(sock), name="kv-events hub")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        for subscriber in self._subscribers.values():
            await subscriber.stop()

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            await self._dispatch(await sock.recv_multipart())
            for _ in range(_BURST):
                try:
                    frames = await sock.recv_multipart(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                await self._dispatch(frames)
            await asyncio.sleep(0)

    async def _dispatch(self, frames: list[bytes]) -> None:
        subscriber = self._subscribers.get(frames[0]) if frames else None
        if subscriber is None:
            self.dropped["unknown_topic"] = self.dropped.get("unknown_topic", 0) + 1
            return
        await subscriber.receive(frames)
