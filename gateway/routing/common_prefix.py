"""Where a request stops sharing its prefix with the rest of the traffic, learned from the traffic itself.

A block hash is chained, so the share of recent requests that contain block d of a prompt never grows
with d: it is 1 for a system prompt that everything carries, a tenant's share for that tenant's tool
schemas, a conversation's share for its first turn, and one request's share for a one-off question.
`common_prefix(cells, replicas)` finds the number of leading blocks whose share is above one replica's fair
share (1 / replicas): a key taken there would send more than a replica's worth of traffic to one place.
The first block past them is the request's routing key (gateway.routing.router); it sits past a shared prefix of
any length, and stops before the part that changes turn by turn, because a conversation's first unique
block is carried by all of its turns and by nothing else.

The counts live in a fixed-size array (a one-row count-min sketch over 2**18 counters, 1 MiB) indexed by
the first 8 bytes of a block hash (or a mixed integer id), so memory does not grow with traffic. Every
`HALF_LIFE` requests all counts halve, so the shares follow traffic that changes over minutes. A share is
never under-estimated (collisions only add), and at 256 blocks per request the noise is about two
counts a cell against a threshold of 64 (8 replicas), so a rare block is not taken for a common one.

Each gateway keeps its own sketch of the requests it routed. Shares are ratios, so gateways that are
dealt the same traffic mix find the same common depth; two sketches fed the same requests are equal.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence
from typing import TypeGuard, cast

import numpy as np

HALF_LIFE = 256  # requests between two halvings of every count
SKETCH_BITS = 18
_MIX = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: spreads small integer ids over the table
_SHIFT = np.uint64(64 - SKETCH_BITS)


class CommonPrefixSketch:
    """Recent traffic's share of each block hash. A router calls `observe` once per request."""

    def __init__(self) -> None:
        self._counts = np.zeros(1 << SKETCH_BITS, dtype=np.uint32)
        self._requests = 0.0  # decayed like the counts
        self._since_halving = 0

    def cells(self, block_hashes: Sequence[Hashable]) -> np.ndarray:
        """The sketch cell of each block hash (the caller passes them to the two calls below). Native-width
        indices: numpy converts uint64 indices on every gather and scatter, which costs more than both."""
        return (_as_uint64(block_hashes) >> _SHIFT).astype(np.intp)

    def common_prefix(self, cells: np.ndarray, replicas: int) -> tuple[int, float]:
        """(depth, share): the leading blocks carried by more than 1 / `replicas` of recent requests, and
        the share of requests that carry the deepest of them (0.0 when there is none)."""
        return self._common(self._counts[cells], replicas)

    def observe(self, cells: np.ndarray) -> None:
        """Count one request that carried these blocks."""
        self._counts[cells] += np.uint32(1)
        self._requests += 1
        self._since_halving += 1
        if self._since_halving == HALF_LIFE:
            self._counts >>= np.uint32(1)
            self._requests /= 2
            self._since_halving = 0

    def _common(self, counts: np.ndarray, replicas: int) -> tuple[int, float]:
        if not len(counts) or self._requests == 0:
            return 0, 0.0
        # Counts are integers, so "count <= requests / replicas" is "count <= floor(...)"; a uint32 threshold
        # keeps the comparison in the counts' own type (half the cost of comparing against a float).
        fair = np.uint32(self._requests / replicas)
        depth = int((counts <= fair).argmax())
        if depth == 0 and counts[0] > fair:
            depth = len(counts)  # every block is common
        return depth, (min(1.0, float(counts[depth - 1]) / self._requests) if depth else 0.0)


def _as_uint64(keys: Sequence[Hashable]) -> np.ndarray:
    """64 well-mixed bits per key: a block hash's first 8 bytes (already uniform), a mixed integer id, or
    a stable digest of any other key's repr (the same in every process)."""
    if not keys:
        return np.zeros(0, dtype=np.uint64)
    first = keys[0]
    if isinstance(first, bytes) and len(first) % 8 == 0:
        # One request's keys are all of one kind, so the first one's type stands for all (checking each would
        # triple this function's cost); kvroute's block hashes are 16 bytes; keys of mixed lengths take the
        # slow path.
        joined = b"".join(cast(Sequence[bytes], keys))
        if len(joined) == len(keys) * len(first):
            return np.frombuffer(joined, dtype=np.uint64)[:: len(first) // 8]
    if _all_ints(keys):
        ids = np.fromiter((k & 0xFFFF_FFFF_FFFF_FFFF for k in keys), dtype=np.uint64, count=len(keys))
        return ids * _MIX
    return np.fromiter(
        (int.from_bytes(hashlib.blake2b(repr(k).encode(), digest_size=8).digest(), "little") for k in keys),
        dtype=np.uint64,
        count=len(keys),
    )


def _all_ints(keys: Sequence[Hashable]) -> TypeGuard[Sequence[int]]:
    return all(type(k) is int for k in keys)
