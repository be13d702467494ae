"""The KV event record: one change to a worker's set of cached blocks, in the order it happened.

The worker's block pool writes it, the worker's services send it (gRPC `KVEvent`, a Redis stream entry, vLLM's
ZMQ format), and every gateway fleet state reads it back into the same record before its KV index applies it
(`gateway.routing.kv_index.KVIndex.apply`). `seq` grows by one per event, so a reader can see a gap.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Literal

BlockKey = Hashable  # a BlockHash (bytes) in the engine and the gateway; any hashable id in the replay
KVEventKind = Literal["stored", "removed", "cleared"]
# The tiers a worker's blocks live on, by vLLM's `medium` names: "GPU" is the engine's own KV pool (on a CPU worker
# too: the pool the model reads), "CPU" its host tier (worker/host_kv_tier.py).
DEVICE = "GPU"
HOST = "CPU"


@dataclass(frozen=True)
class KVEvent:
    """`stored`: a contiguous run of new blocks after `parent_hash` on tier `medium`; `removed`: blocks that tier
    lost (a copy on the other tier may remain); `cleared`: every block is gone from every tier (`block_hashes`
    empty)."""

    seq: int
    kind: KVEventKind
    block_hashes: tuple[BlockKey, ...] = ()
    parent_hash: BlockKey | None = None
    token_ids: tuple[int, ...] = ()  # a `stored` run's tokens, when the caller gave them (vLLM's events carry them)
    cache_salt: str = ""  # the salt a `stored` run's sequence was hashed under
    medium: str = DEVICE
