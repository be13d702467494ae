"""The Redis layout of the fleet state: written by each worker's reporter (worker.reporter), read by every
gateway (gateway.fleet.redis_fleet). One copy of the truth for both sides.

Keys (`prefix` defaults to "kvroute"; `{worker_id}` is a Cluster hash tag, so one worker's keys share a slot
and its snapshot and stream trim go in one transaction):

    <prefix>:workers                          SET    the ids of registered workers (discovery)
    <prefix>:{<worker_id>}:info               HASH   WorkerRecord: identity, fingerprints, load, heartbeat;
                                                     expires heartbeat_ttl after the last heartbeat
    <prefix>:{<worker_id>}:kv:<incarnation>   STREAM one entry per KV event, entry id "<seq>-0" (the worker's
                                                     own event seq), fields k (stored|removed|cleared), h
                                                     (the block hashes, 16 bytes each, concatenated) and, for
                                                     a host-tier event only, m (its medium, "CPU")
    <prefix>:{<worker_id>}:snap:<incarnation> HASH   seq, h: every block cached on the device as of event seq,
                                                     hc: on the host tier (a late or lagging reader starts
                                                     there; the stream keeps the events after the previous
                                                     snapshot)

`redis_client(url)` connects either side: redis://, rediss:// and unix:// through redis-py's own URL parsing;
redis+cluster:// (rediss+cluster://) as a Cluster; redis+sentinel://[user:password@]host:port[,host:port...]
/service[/db] (rediss+sentinel://) through Sentinel to the service's master.

Stream ids are the worker's event sequence numbers, so a gateway continues at the same place whether it
reads the stream or, while Redis is down, the worker's GetKVEvents. Streams and snapshots of one incarnation
expire `DATA_TTL_S` after the worker's last heartbeat (a restarted worker writes new keys).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any
from urllib.parse import unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.sentinel import Sentinel

from kvroute.hashing import HASH_BYTES
from kvroute.kv_events import BlockKey

DEFAULT_PREFIX = "kvroute"
DATA_TTL_S = 600
ENGINE_STATES = ("serving", "draining", "dead", "stopped")  # "stopped": deregistered; leave at once
_WORKER_ID = re.compile(r"[A-Za-z0-9._:@/-]{1,253}")


def check_worker_id(worker_id: str) -> str:
    """Worker ids become key parts: letters, digits and . _ : @ / - only (no braces, which tag slots)."""
    if not _WORKER_ID.fullmatch(worker_id):
        raise ValueError(f"worker_id must be 1-253 of [A-Za-z0-9._:@/-], got {worker_id!r}")
    return worker_id


@dataclass(frozen=True)
class FleetKeys:
    prefix: str = DEFAULT_PREFIX

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    def info(self, worker_id: str) -> str:
        return f"{self.prefix}:{{{check_worker_id(worker_id)}}}:info"

    def events(self, worker_id: str, incarnation: int) -> str:
        return f"{self.prefix}:{{{check_worker_id(worker_id)}}}:kv:{incarnation}"

    def snapshot(self, worker_id: str, incarnation: int) -> str:
        return f"{self.prefix}:{{{check_worker_id(worker_id)}}}:snap:{incarnation}"


@dataclass(frozen=True)
class WorkerDescription:
    """A worker as it describes itself to gateways (its GetInfo reply, its registry record): who it is, where
    to dial it, and what it hashes and tokenizes with. Shared by the reporter, the record and the gateway's
    WorkerMember, so the three never drift apart."""

    worker_id: str
    address: str  # host:port gateways dial
    incarnation: int
    model_id: str
    block_size: int
    max_model_len: int
    hash_fingerprint: str
    tokenizer_fingerprint: str


@dataclass(frozen=True)
class WorkerRecord(WorkerDescription):
    """One worker's registry entry and load, as the fields of its info hash (all written every heartbeat):
    its description, then the fields below.

    `beat` grows by one at every write: a gateway takes a new load report, and a sign of life, only when it
    changed. A worker whose beat has not changed for `heartbeat_ttl` seconds (as the gateway's clock sees
    it) has left."""

    heartbeat_ttl: float
    engine_state: str
    beat: int
    num_running: int
    num_waiting: int
    num_blocks_used: int
    num_blocks_total: int
    kv_cache_usage: float
    kv_event_seq: int  # the last event published to the stream (or covered by the snapshot)
    # Under `--scheduling-policy priority`, GetStats' priority_loads as `pack_priority_loads` writes them; "" under
    # fcfs, and for a record written before the field existed (the one field a record may lack).
    priority_loads: str = ""

    def to_fields(self) -> dict[str, str]:
        return {f.name: str(getattr(self, f.name)) for f in fields(self)}

    @classmethod
    def from_fields(cls, raw: Mapping[bytes | str, bytes | str]) -> WorkerRecord:
        """Parse an info hash; raises ValueError naming the missing or malformed field."""
        text = {as_text(k): as_text(v) for k, v in raw.items()}
        values: dict[str, object] = {}
        for f in fields(cls):
            if f.name not in text and f.name == "priority_loads":
                continue
            if f.name not in text:
                raise ValueError(f"worker record: missing field {f.name!r}")
            kind = {"int": int, "float": float}.get(str(f.type), str)
            try:
                values[f.name] = kind(text[f.name])
            except ValueError:
                bad = text[f.name]
                what = {int: "an integer", float: "a number"}.get(kind, "text")
                raise ValueError(f"worker record: field {f.name!r} is not {what}: {bad!r}") from None
        record = cls(**values)  # type: ignore[arg-type]
        check_worker_id(record.worker_id)
        unpack_priority_loads(record.priority_loads)
        if record.engine_state not in ENGINE_STATES:
            raise ValueError(f"worker record: engine_state must be one of {ENGINE_STATES}, got {record.engine_state!r}")
        return record


MAX_PRIORITY_LOADS = 8  # entries a record's priority_loads may hold (as GetStats: worker.scheduler bounds them)


def pack_priority_loads(loads: Sequence[tuple[int, int, int]]) -> str:
    """(priority, running blocks, waiting) triples as `p:blocks:waiting,...`."""
    return ",".join(f"{p}:{blocks}:{waiting}" for p, blocks, waiting in loads)


def unpack_priority_loads(text: str) -> list[tuple[int, int, int]]:
    """`pack_priority_loads`' triples; ValueError naming the field for anything else, or more than
    MAX_PRIORITY_LOADS of them."""
    if not text:
        return []
    entries = text.split(",")
    if len(entries) > MAX_PRIORITY_LOADS:
        raise ValueError(f"worker record: priority_loads has {len(entries)} entries, at most {MAX_PRIORITY_LOADS}")
    loads = []
    for entry in entries:
        parts = entry.split(":")
        try:
            priority, blocks, waiting = (int(part) for part in parts)
        except ValueError:
            raise ValueError(f"worker record: priority_loads entry {entry[:40]!r} is not p:blocks:waiting") from None
        if blocks < 0 or waiting < 0:
            raise ValueError(f"worker record: priority_loads entry {entry[:40]!r} has a negative count")
        loads.append((priority, blocks, waiting))
    return loads


def pack_hashes(block_hashes: Sequence[BlockKey]) -> bytes:
    """Block hashes as one string; ValueError for a key that is not a block hash (a replay's ids are not)."""
    checked: list[bytes] = []
    for block_hash in block_hashes:
        if not isinstance(block_hash, bytes):
            raise ValueError(f"block hashes must be {HASH_BYTES} bytes, got a {type(block_hash).__name__}")
        if len(block_hash) != HASH_BYTES:
            raise ValueError(f"block hashes must be {HASH_BYTES} bytes, got {len(block_hash)}")
        checked.append(block_hash)
    return b"".join(checked)


def unpack_hashes(packed: bytes) -> list[bytes]:
    if len(packed) % HASH_BYTES:
        raise ValueError(f"packed block hashes: {len(packed)} bytes is not a multiple of {HASH_BYTES}")
    return [packed[i : i + HASH_BYTES] for i in range(0, len(packed), HASH_BYTES)]


def redis_client(url: str, *, password: str | None = None, **options: Any) -> aioredis.Redis | RedisCluster:
    """An asyncio client for a fleet-state URL (see the module docstring); raises ValueError for a bad URL.
    `password` authenticates to Redis (to a Sentinel service's master) for a URL that carries none, so that no
    command line shows it ($KVROUTE_REDIS_PASSWORD_FILE, kvroute.credentials); a URL with a password as well is
    refused. `options` go to redis-py (e.g. socket_timeout). Responses stay bytes: block hashes are binary."""
    scheme = url.partition("://")[0].lower()
    if password is not None and urlsplit(url).password:
        raise ValueError("--redis: the URL carries a password and $KVROUTE_REDIS_PASSWORD_FILE names one; use one")
    if scheme in ("redis+sentinel", "rediss+sentinel"):
        return _sentinel_client(url, scheme, options, password)
    if password is not None:
        options = {**options, "password": password}
    if scheme in ("redis", "rediss", "unix"):
        return aioredis.Redis.from_url(url, **options)
    if scheme in ("redis+cluster", "rediss+cluster"):
        return RedisCluster.from_url(scheme.removesuffix("+cluster") + url[len(scheme) :], **options)
    schemes = "redis://, rediss://, unix://, redis+cluster:// or redis+sentinel://"
    raise ValueError(f"--redis: unsupported URL scheme {scheme!r} in {url!r}; use {schemes}")


def _sentinel_client(url: str, scheme: str, options: dict[str, Any], password: str | None) -> aioredis.Redis:
    """The master of a Sentinel URL's service; `password` is the master's when the URL names none."""
    parts = urlsplit(url)
    netloc = parts.netloc.rpartition("@")[2]
    path = [p for p in parts.path.split("/") if p]
    if not netloc or not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        form = "redis+sentinel://host:port[,host:port...]/service[/db]"
        raise ValueError(f"--redis: a Sentinel URL is {form}, got {url!r}")
    sentinels = []
    for node in netloc.split(","):
        host, _, port = node.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--redis: Sentinel address {node!r} is not host:port")
        sentinels.append((host.strip("[]"), int(port)))
    connection: dict[str, Any] = {"username": unquote(parts.username) if parts.username else None,
                                  "password": unquote(parts.password) if parts.password else password}  # fmt: skip
    if scheme.startswith("rediss"):
        connection["ssl"] = True
    sentinel = Sentinel(sentinels, sentinel_kwargs=options, **options)
    return sentinel.master_for(path[0], db=int(path[1]) if len(path) == 2 else 0, **connection)


def stream_id(seq: int) -> str:
    return f"{seq}-0"


def seq_of(entry_id: bytes | str) -> int:
    return int(as_text(entry_id).partition("-")[0])


def as_text(value: bytes | str) -> str:
    """A Redis response as text: bytes from kvroute's clients (redis_client), str from one that decodes."""
    return value.decode() if isinstance(value, bytes) else value
