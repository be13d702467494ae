"""`kvroute worker --kv-events-config JSON`: the worker's KV events published as vLLM publishes its own, so that
a gateway (kvroute's, llm-d's, Dynamo's, smg's) can route this worker as a `vllm://` worker (DESIGN §3).

The flag takes vLLM's JSON (`KVEventsConfig`): `{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "...", "buffer_steps": N, "hwm": N,
"max_queue_size": N}`. As in vLLM, an endpoint with a wildcard host (`*`, `::`) or an ipc/inproc address is
bound, any other is connected to (the llm-d layout: the gateway binds, pods connect); SGLang's `"bind": true`
or `false` says so outright (e.g. to bind loopback only).

What goes out (`kvroute.engine_kv_events`, vLLM 0.33's shape): per batch `[topic, seq, payload]`, seq from 0 at
start, the payload `[ts, events, data_parallel_rank]` (rank 0, always sent, as vLLM's publisher does);
`BlockStored` per run of new blocks with its `token_ids`, `block_size` and, for a run that starts a sequence
with a salt, that salt as the first block's extra key (where vLLM puts a request's `cache_salt`);
`BlockRemoved`; `AllBlocksCleared`. Each names its tier as vLLM does (`medium`): "GPU" for the engine's own
pool, "CPU" for its host KV tier, whose stores go out one block at a time with their parent and tokens (vLLM's
self-describing offloading events). Block hashes are ints: the low 64 bits of kvroute's 128-bit hash (vLLM's
own `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` conversion), since consumers (Dynamo, llm-d) read 64-bit ints; they
name blocks only, a router re-hashes the tokens. The replay socket (ROUTER) answers `[b"", start_seq]` with
every buffered batch from start_seq as `[b"", topic, seq, payload]`, then `[b"", b"", -1, b""]`.

Off the engine thread: the engine thread only appends to the AsyncEngine's event log, as for GetKVEvents; a
publisher thread reads that log every `POLL_S`, encodes and sends, and answers replays. When the log no longer
covers what it last published (it fell more than the log's capacity behind), it publishes `AllBlocksCleared`,
so subscribers drop what they can no longer keep right and rebuild from what follows.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import zmq

from kvroute.engine_kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    decode_seq,
    encode_batch,
    encode_seq,
)

if TYPE_CHECKING:
    from worker.async_engine import AsyncEngine
    from worker.block_pool import KVEvent

logger = logging.getLogger(__name__)

POLL_S = 0.005  # how long a new event waits, at most, to be published (vLLM publishes once per engine step)
# vLLM's publisher stamps every batch with its rank (0 without data parallelism), so consumers that decode a
# fixed three-field tuple (Dynamo's router) refuse a batch without it; a kvroute worker is one engine, rank 0.
DATA_PARALLEL_RANK = 0
_READ_EVENTS = 4096  # events read from the log per batch


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` (its `vllm.config.kv_events.KVEventsConfig` fields and defaults)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""
    bind: bool | None = None  # SGLang's key; None: vLLM's rule from the endpoint

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the flag's JSON; ValueError naming the key for anything vLLM would not take."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config: not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError('--kv-events-config: a JSON object, e.g. {"enable_kv_cache_events": true, ...}')
        known = cls.__dataclass_fields__
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"--kv-events-config: unknown key(s) {unknown}; known: {sorted(known)}")
        types = {"enable_kv_cache_events": bool, "publisher": str, "endpoint": str, "topic": str}
        for key, kind in types.items():
            if key in raw and not isinstance(raw[key], kind):
                raise ValueError(f"--kv-events-config: {key} must be a {kind.__name__}")
        for key in ("buffer_steps", "hwm", "max_queue_size"):
            if key in raw and (not isinstance(raw[key], int) or isinstance(raw[key], bool) or raw[key] < 1):
                raise ValueError(f"--kv-events-config: {key} must be an integer >= 1")
        if raw.get("bind") is not None and not isinstance(raw["bind"], bool):
            raise ValueError("--kv-events-config: bind must be true, false or null")
        if raw.get("replay_endpoint") is not None and not isinstance(raw["replay_endpoint"], str):
            raise ValueError("--kv-events-config: replay_endpoint must be a string or null")
        if "publisher" not in raw:  # vLLM's rule: zmq when events are enabled
            raw["publisher"] = "zmq" if raw.get("enable_kv_cache_events") else "null"
        if raw["publisher"] not in ("null", "zmq"):
            raise ValueError(f"--kv-events-config: publisher must be 'null' or 'zmq', got {raw['publisher']!r}")
        return cls(**raw)

    @property
    def publishes(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def engine_hash(block_hash: bytes) -> int:
    """The int a vLLM-format event names a kvroute block by: the hash's low 64 bits, as vLLM converts its own."""
    return int.from_bytes(block_hash[-8:], "big")


def to_wire(events: list[KVEvent], block_size: int) -> list:
    """kvroute's KV events as vLLM's event records. A worker's block pool keys its blocks by kvroute's hashes
    (bytes); KVEvent's wider key type is the replay's."""
    out: list = []
    for event in events:
        hashes = cast(tuple[bytes, ...], event.block_hashes)
        if event.kind == "stored":
            parent = None if event.parent_hash is None else engine_hash(cast(bytes, event.parent_hash))
            extra = None
            if event.parent_hash is None and event.cache_salt:
                extra = ((event.cache_salt,),) + (None,) * (len(hashes) - 1)
            out.append(
                BlockStored(
                    tuple(engine_hash(h) for h in hashes),
                    parent,
                    event.token_ids,
                    block_size,
                    None,
                    event.medium,
                    None,
                    extra,
                )  # fmt: skip
            )
        elif event.kind == "removed":
            out.append(BlockRemoved(tuple(engine_hash(h) for h in hashes), event.medium))
        else:
            out.append(AllBlocksCleared())
    return out


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """Publishes one AsyncEngine's KV events per `config` from a thread of its own, until `stop()`.

    `start()` binds (or connects) the sockets and raises ValueError naming the endpoint when it cannot;
    `endpoint` / `replay_endpoint` are as bound (a `:0` port filled in); `binds` says whether the PUB socket
    was bound, or connected (then nobody hears it until a subscriber binds that address: logged as a
    warning, since an endpoint spelled as a host address connects by vLLM's rule). `published` counts batches sent,
    `published_seq` is the engine's last event seq they covered (it equals `engine.kv_event_seq` when the
    publisher has caught up)."""

    def __init__(self, engine: AsyncEngine, config: KVEventsConfig, block_size: int) -> None:
        self.engine = engine
        self.config = config
        self.block_size = block_size
        self.endpoint: str | None = None
        self.replay_endpoint: str | None = None
        self.binds = True
        self.published = 0
        self.published_seq = engine.kv_event_seq
        self._ctx = zmq.Context()
        self._pub: zmq.Socket | None = None
        self._replay: zmq.Socket | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._seq = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        config = self.config
        try:
            pub = self._ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.set_hwm(config.hwm)
            self.binds = _binds(config.endpoint) if config.bind is None else config.bind
            self.endpoint = self._attach(pub, config.endpoint, self.binds)
            self._pub = pub
            if config.replay_endpoint is not None:
                replay = self._ctx.socket(zmq.ROUTER)
                replay.setsockopt(zmq.LINGER, 0)
                replay.setsockopt(zmq.SNDHWM, 2 * (config.buffer_steps + 1))
                self.replay_endpoint = self._attach(replay, config.replay_endpoint, True)
                self._replay = replay
        except zmq.ZMQError as exc:
            self._close()
            raise ValueError(f"--kv-events-config: cannot open {exc}") from None
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        logger.info(
            "kv events: publishing on %s (replay %s, topic %r)", self.endpoint, self.replay_endpoint, config.topic
        )
        if not self.binds:
            logger.warning(
                "kv events: the publisher CONNECTED to %s and waits for a subscriber that binds it (llm-d's "
                "layout); until one does, nobody receives the events. By vLLM's rule only a wildcard host "
                "(tcp://*:PORT) or an ipc/inproc address is bound: to bind %s, add \"bind\": true",
                self.endpoint, self.endpoint,
            )  # fmt: skip

    @staticmethod
    def _attach(sock: zmq.Socket, endpoint: str, bind: bool) -> str:
        try:
            if bind:
                if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
                    host = endpoint[len("tcp://") : -2]
                    port = sock.bind_to_random_port(f"tcp://{host}")
                    return f"tcp://{host}:{port}"
                sock.bind(endpoint)
            else:
                sock.connect(endpoint)
        except zmq.ZMQError as exc:
            raise zmq.ZMQError(exc.errno, f"{endpoint}: {exc.strerror}") from None
        return endpoint

    def stop(self) -> None:
        """Publish what is left, stop the thread and close the sockets."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._close()

    def _close(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        self._ctx.term()

    def _run(self) -> None:
        after = self.engine.kv_event_seq
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            stopping = self._stop.is_set()
            try:
                after = self._publish_new(after)
                if self._replay is not None:
                    while poller.poll(0 if stopping else int(POLL_S * 1000)):
                        self._serve_replay()
                elif not stopping:
                    time.sleep(POLL_S)
            except Exception:  # the engine serves on without its events; subscribers see the gap
                logger.exception("kv events: publishing failed")
                time.sleep(0.1)
            if stopping:
                return

    def _publish_new(self, after: int) -> int:
        """Send the events after `after` from the engine's log as batches; the last seq published."""
        while True:
            since = self.engine.kv_events_logged(after, _READ_EVENTS)
            if since is None:  # fell behind the log: subscribers must drop what they hold
                logger.warning("kv events: the publisher fell behind the engine's event log; publishing a clear")
                self._send([AllBlocksCleared()])
                after = since_latest = self.engine.kv_event_seq
                self.published_seq = since_latest
                return after
            if not since.events:
                return after
            self._send(to_wire(since.events, self.block_size))
            after = self.published_seq = since.events[-1].seq

    def _send(self, events: list) -> None:
        assert self._pub is not None
        payload = encode_batch(EventBatch(time.time(), tuple(events), DATA_PARALLEL_RANK))
        seq = self._seq
        self._seq += 1
        self._pub.send_multipart((self._topic, encode_seq(seq), payload))
        self._buffer.append((seq, payload))
        self.published += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("kv events: a replay request is [identity, b'', 8-byte seq], got %d frames", len(frames))
            return
        client, _, start_frame = frames
        start = decode_seq(start_frame)
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart((client, b"", self._topic, encode_seq(seq), payload))
        self._replay.send_multipart((client, b"", b"", encode_seq(-1), b""))
