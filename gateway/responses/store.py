"""Where the Responses API keeps its stored responses: the conversation state of `previous_response_id`.

One interface, two stores:
- `MemoryResponseStore`: a single gateway's (the default without `--redis`). Bounded per tenant and in all; a
  restart forgets every response (a continued turn then gets 404, as for an expired one).
- `RedisResponseStore`: the fleet's Redis (the default with `--redis`), shared by every gateway, so a
  conversation continues through any of them. A record is one string; a tenant's index and byte count are
  kept beside it and trimmed in one Lua script, so a flood of stored responses evicts that tenant's oldest.

The contract both keep:
1. A record lives under its tenant's `scope` (`tenant_scope`): a lookup with another scope finds nothing, so
   no tenant reads, lists or continues another's response, even knowing its id (ids are 192 random bits).
2. `put` stores a record of at most `limits.max_response_bytes` (else raises ResponseTooLarge and stores
   nothing); a tenant's records hold at most `limits.max_tenant_bytes` and `limits.max_tenant_responses`
   (its oldest are dropped to make room); a record expires `limits.ttl_s` after it was stored.
3. Any failure to reach the store raises StoreUnavailable (the front door answers 503 for the requests that
   need the store, and serves the rest).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Protocol

from redis.exceptions import RedisError

from gateway.request import Tenant

DAY_S = 86_400


class StoreUnavailable(Exception):
    """The store could not be reached; nothing was read or written."""


class ResponseTooLarge(ValueError):
    """A record over the store's per-response limit; nothing was stored."""


@dataclass(frozen=True)
class StoreLimits:
    """The bounds of a response store (the gateway's `--responses-*` flags)."""

    ttl_s: float = 30 * DAY_S  # OpenAI keeps a stored response 30 days
    max_response_bytes: int = 4 * 2**20
    max_tenant_bytes: int = 256 * 2**20
    max_tenant_responses: int = 100_000
    max_total_bytes: int = 1 * 2**30  # the memory store only: every tenant together

    def __post_init__(self) -> None:
        for name in ("ttl_s", "max_response_bytes", "max_tenant_bytes", "max_tenant_responses", "max_total_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"responses store: {name} must be > 0, got {getattr(self, name)!r}")
        if self.max_response_bytes > self.max_tenant_bytes:
            raise ValueError("responses store: max_response_bytes must not exceed max_tenant_bytes")


def tenant_scope(tenant: Tenant) -> str:
    """The store's name for a tenant: opaque (a digest of its name and its server-side cache salt, which the
    salt secret makes unguessable) and the same on every gateway of the fleet."""
    digest = hashlib.sha256(b"kvroute-responses-v1\x00" + tenant.name.encode() + b"\x00" + tenant.cache_salt.encode())
    return digest.hexdigest()[:32]


class ResponseStore(Protocol):
    """Stored responses by (scope, id); the module docstring states the contract."""

    limits: StoreLimits

    async def get(self, scope: str, response_id: str) -> bytes | None: ...

    async def put(self, scope: str, response_id: str, record: bytes) -> None: ...

    async def delete(self, scope: str, response_id: str) -> bool: ...

    async def usage(self, scope: str) -> tuple[int, int]:
        """(records, bytes) the scope holds now."""
        ...

    async def close(self) -> None: ...


class MemoryResponseStore:
    """Records in this process's memory (the module docstring); one lock-free dict per tenant, oldest first."""

    def __init__(self, limits: StoreLimits | None = None, clock: Any = time.monotonic) -> None:
        self.limits = limits or StoreLimits()
        self._clock = clock
        self._scopes: dict[str, OrderedDict[str, tuple[float, bytes]]] = {}
        self._scope_bytes: dict[str, int] = {}
        self._total_bytes = 0

    async def get(self, scope: str, response_id: str) -> bytes | None:
        records = self._scopes.get(scope)
        entry = records.get(response_id) if records else None
        if entry is None:
            return None
        if self._clock() - entry[0] > self.limits.ttl_s:
            self._drop(scope, response_id)
            return None
        return entry[1]

    async def put(self, scope: str, response_id: str, record: bytes) -> None:
        if len(record) > self.limits.max_response_bytes:
            raise ResponseTooLarge(f"{len(record)} bytes; the limit is {self.limits.max_response_bytes}")
        records = self._scopes.setdefault(scope, OrderedDict())
        if response_id in records:
            self._drop(scope, response_id)
        records[response_id] = (self._clock(), record)
        self._scope_bytes[scope] = self._scope_bytes.get(scope, 0) + len(record)
        self._total_bytes += len(record)
        limits = self.limits
        while self._scope_bytes[scope] > limits.max_tenant_bytes or len(records) > limits.max_tenant_responses:
            self._drop(scope, next(iter(records)))
        while self._total_bytes > limits.max_total_bytes:
            biggest = max(self._scope_bytes, key=self._scope_bytes.__getitem__)  # the heaviest tenant gives way
            self._drop(biggest, next(iter(self._scopes[biggest])))

    async def delete(self, scope: str, response_id: str) -> bool:
        records = self._scopes.get(scope)
        if not records or response_id not in records:
            return False
        self._drop(scope, response_id)
        return True

    async def usage(self, scope: str) -> tuple[int, int]:
        return len(self._scopes.get(scope, ())), self._scope_bytes.get(scope, 0)

    async def close(self) -> None:
        return

    def _drop(self, scope: str, response_id: str) -> None:
        records = self._scopes[scope]
        _, record = records.pop(response_id)
        self._scope_bytes[scope] -= len(record)
        self._total_bytes -= len(record)
        if not records:
            del self._scopes[scope], self._scope_bytes[scope]


# KEYS: record, index (ZSET id -> stored at, ms), sizes (HASH id -> bytes), bytes (the sizes' sum).
# ARGV: id, record, ttl ms, now ms, max tenant bytes, max tenant records, the record keys' prefix.
# Records that expired by their TTL leave the index here; then the oldest go until the tenant is within bounds.
_PUT = """
local ttl, now = tonumber(ARGV[3]), tonumber(ARGV[4])
local function drop(id)
  local size = tonumber(redis.call('HGET', KEYS[3], id) or '0')
  redis.call('HDEL', KEYS[3], id)
  redis.call('ZREM', KEYS[2], id)
  redis.call('DEL', ARGV[7] .. id)
  redis.call('DECRBY', KEYS[4], size)
end
for _, id in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - ttl)) do drop(id) end
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then drop(ARGV[1]) end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ttl)
redis.call('ZADD', KEYS[2], now, ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], string.len(ARGV[2]))
redis.call('INCRBY', KEYS[4], string.len(ARGV[2]))
while tonumber(redis.call('GET', KEYS[4])) > tonumber(ARGV[5]) or redis.call('ZCARD', KEYS[2]) > tonumber(ARGV[6]) do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not oldest then redis.call('SET', KEYS[4], 0) break end
  drop(oldest)
end
for i = 2, 4 do redis.call('PEXPIRE', KEYS[i], ttl) end
return 1
"""
_DELETE = """
if redis.call('DEL', KEYS[1]) == 0 then return 0 end
local size = tonumber(redis.call('HGET', KEYS[3], ARGV[1]) or '0')
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('DECRBY', KEYS[4], size)
return 1
"""


class RedisResponseStore:
    """Records in the fleet's Redis (the module docstring). Keys, `{scope}` a Cluster hash tag so that one
    tenant's keys share a slot and its scripts run in one place:

        <prefix>:resp:{<scope>}:r:<id>   STRING  the record; expires ttl after it was stored
        <prefix>:resp:{<scope>}:index    ZSET    id -> stored at (ms): the tenant's records, oldest first
        <prefix>:resp:{<scope>}:sizes    HASH    id -> the record's bytes
        <prefix>:resp:{<scope>}:bytes    STRING  the sum of the sizes
    """

    def __init__(
        self, client: Any, limits: StoreLimits | None = None, prefix: str = "kvroute", timeout_s: float = 2.0
    ) -> None:
        self.limits = limits or StoreLimits()
        self.client = client
        self.prefix = prefix
        self.timeout_s = timeout_s
        self._put = client.register_script(_PUT)
        self._delete = client.register_script(_DELETE)

    def _keys(self, scope: str, response_id: str) -> list[str]:
        base = f"{self.prefix}:resp:{{{scope}}}:"
        return [f"{base}r:{response_id}", f"{base}index", f"{base}sizes", f"{base}bytes"]

    async def get(self, scope: str, response_id: str) -> bytes | None:
        record: bytes | None = await self._call(self.client.get(self._keys(scope, response_id)[0]))
        return record

    async def put(self, scope: str, response_id: str, record: bytes) -> None:
        limits = self.limits
        if len(record) > limits.max_response_bytes:
            raise ResponseTooLarge(f"{len(record)} bytes; the limit is {limits.max_response_bytes}")
        keys = self._keys(scope, response_id)
        args = [response_id, record, int(limits.ttl_s * 1000), int(time.time() * 1000), limits.max_tenant_bytes,
                limits.max_tenant_responses, keys[0].removesuffix(response_id)]  # fmt: skip
        await self._call(self._put(keys=keys, args=args))

    async def delete(self, scope: str, response_id: str) -> bool:
        return bool(await self._call(self._delete(keys=self._keys(scope, response_id), args=[response_id])))

    async def usage(self, scope: str) -> tuple[int, int]:
        keys = self._keys(scope, "")
        count, size = await self._call(asyncio.gather(self.client.zcard(keys[1]), self.client.get(keys[3])))
        return int(count), int(size or 0)

    async def close(self) -> None:
        await self.client.aclose()

    async def _call(self, work: Any) -> Any:
        try:
            async with asyncio.timeout(self.timeout_s):
                return await work
        except (RedisError, OSError, TimeoutError) as exc:
            raise StoreUnavailable(f"the response store (Redis) did not answer: {type(exc).__name__}") from exc
