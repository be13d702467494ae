"""The fleet KV index: which replica holds which cached block, fed by the workers' KV events.

A block hash is chained (it covers its whole prefix), so "replica r holds hash h" means r can reuse the
whole prefix up to h. `match(hashes)` walks a request's hashes once and returns, per replica, how many
leading blocks that replica holds (stopping at its first miss, as the worker's own lookup does).

Events are kvroute.kv_events.KVEvent records (the worker's block pool writes them; every fleet state
reads its source's events back into them). Each replica's events carry a sequence number that grows by
one; a gap means events were lost, so the replica's entries can no longer be trusted: `apply` returns
False, the replica is marked stale (it matches nothing) until the caller resyncs it from the worker's
snapshot (`BlockPool.snapshot()`). `apply` is the one loop that applies events: a fleet state that
rebuilds a replica apart (embedded_fleet's full resync) applies them to an index of its own.

Membership changes in place (DESIGN §4): `add_replica` (a worker joined), `remove_replica` (it left: its
entries go, everyone else's stay), `reset_replica` (it restarted with a new incarnation: its entries and
sequence number start over, even when the new numbers would pass the old ones); after any of them
`replicas` is sorted. Each replica owns one bit of a holder mask for as long as it is a member (a
freed bit is reused by the next joiner), so a membership change touches only that replica's blocks.

Tiers (KVEvent.medium): a worker with a host KV tier reports that tier's changes as events of medium "CPU"
beside its device pool's ("GPU"). A block counts as held while either tier holds it, and `match` scores a
leading block held only on the host tier at `medium_weights[medium]` (default DEFAULT_MEDIUM_WEIGHTS, the copy
back against the recompute: docs/engines.md): a replica's depth less (1 - weight) per such block, rounded down to
whole blocks, as the engine fleets' WeightedKVIndex does. A tier that weighs 0 is not indexed.

`LearnedKVIndex` is the index of a gateway that sees no events: it assumes the blocks of every request
it routed are stored on the replica it chose, bounded per replica by an LRU of the replica's capacity.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from typing import TypeVar

from kvroute.kv_events import DEVICE, BlockKey, KVEvent

K = TypeVar("K", bound=Hashable)

# What a block a worker holds only in host memory is worth against one on its device, by default: restoring it costs
# its copy instead of its prefill. Seed 004 measured 34 ms to bring 1.07 GB (8k tokens of an 8B model) over PCIe
# against 421 ms to recompute them, so such a block saves 1 - 34/421 = 0.92 of what a device block saves.
DEFAULT_MEDIUM_WEIGHTS: Mapping[str, float] = {"CPU": 0.92}


def weighted_depth(block_hashes: Sequence[K], depth: int, weights: Mapping[K, float]) -> int:
    """A match of `depth` leading blocks less (1 - weight) per block `weights` names (one held only on an offloaded
    tier), rounded down to whole blocks: the router reads depths as block counts."""
    lost = sum(1.0 - weights.get(h, 1.0) for h in block_hashes[:depth])
    return math.floor(depth - lost + 1e-9)


class KVIndex:
    """Per replica, the set of cached block hashes; one dict hash -> bitmask of holders for matching. Per replica
    too, the hashes with a copy on an offloaded tier (`_offloaded`: medium -> hashes) and, of those, the hashes
    with no device copy (`_host_only`: hash -> weight)."""

    def __init__(self, replicas: Sequence[str], medium_weights: Mapping[str, float] | None = None) -> None:
        if len(set(replicas)) != len(replicas):
            raise ValueError(f"replica ids must be distinct, got {tuple(replicas)}")
        self.medium_weights = dict(DEFAULT_MEDIUM_WEIGHTS if medium_weights is None else medium_weights)
        self.replicas = tuple(replicas)
        self._bit = {r: 1 << i for i, r in enumerate(self.replicas)}
        self._slot_order: list[int] | None = None  # slot of each replica in order; None while slot == position
        self._num_slots = len(self.replicas)
        self._alive = (1 << len(self.replicas)) - 1  # the bits of the replicas that are not stale
        self._holders: dict[BlockKey, int] = {}
        self._held: dict[str, set[BlockKey]] = {r: set() for r in self.replicas}
        self._offloaded: dict[str, dict[str, set[BlockKey]]] = {r: {} for r in self.replicas}
        self._host_only: dict[str, dict[BlockKey, float]] = {r: {} for r in self.replicas}
        self._last_seq: dict[str, int] = {r: 0 for r in self.replicas}
        self._stale: set[str] = set()

    # -- queries -------------------------------------------------------------------------------

    def num_blocks(self, replica: str) -> int:
        return len(self._held[replica])

    def held(self, replica: str) -> AbstractSet[BlockKey]:
        """Every block hash the replica's events left it holding, stale or not (the index's own set: read it,
        never change it)."""
        return self._held[replica]

    def last_seq(self, replica: str) -> int:
        return self._last_seq[replica]

    def host_only(self, replica: str) -> AbstractSet[BlockKey]:
        """The block hashes the replica holds on an offloaded tier only (read it, never change it)."""
        return self._host_only[replica].keys()

    def tiers(self, replica: str) -> tuple[list[BlockKey], dict[str, set[BlockKey]]]:
        """What `resync` takes back: the hashes the replica's device holds, and per offloaded tier the hashes it
        holds there."""
        host_only = self._host_only[replica]
        device = [h for h in self._held[replica] if h not in host_only]
        return device, {medium: set(hashes) for medium, hashes in self._offloaded[replica].items()}

    def match(self, block_hashes: Sequence[BlockKey]) -> list[int]:
        """Leading blocks of `block_hashes` held by each replica, in `self.replicas` order; a block held only on an
        offloaded tier counts its tier's weight (module docstring)."""
        matched = self._match(block_hashes)
        for i, replica in enumerate(self.replicas):
            host_only, depth = self._host_only[replica], matched[i]
            if host_only and depth:
                matched[i] = weighted_depth(block_hashes, depth, host_only)
        return matched

    def _match(self, block_hashes: Sequence[BlockKey]) -> list[int]:
        order = self._slot_order
        matched = [0] * self._num_slots
        alive = self._alive
        holders = self._holders
        for depth, block_hash in enumerate(block_hashes):
            held = holders.get(block_hash, 0) & alive
            if held != alive:
                _set_depth(matched, alive & ~held, depth)
                alive = held
                if not alive:
                    break
        else:
            _set_depth(matched, alive, len(block_hashes))
        return matched if order is None else [matched[slot] for slot in order]

    def narrowed(self, replicas: Sequence[str]) -> NarrowedKVIndex:
        """A read-only view of this index over some of its replicas (`match` aligned with `replicas`)."""
        return NarrowedKVIndex(self, replicas)

    # -- membership ----------------------------------------------------------------------------

    def add_replica(self, replica: str) -> None:
        """A new member with no entries and sequence 0; `replicas` keeps its sorted order."""
        if replica in self._bit:
            raise ValueError(f"replica {replica!r} is already in the index")
        used = set(self._bit.values())
        slot = next(i for i in range(len(used) + 1) if 1 << i not in used)
        self._bit[replica] = 1 << slot
        self._held[replica] = set()
        self._offloaded[replica] = {}
        self._host_only[replica] = {}
        self._last_seq[replica] = 0
        self.replicas = tuple(sorted((*self.replicas, replica)))
        self._alive |= self._bit[replica]
        self._renumber()

    def remove_replica(self, replica: str) -> None:
        """Forget a member and its entries; the other replicas' entries are untouched."""
        self.clear(replica)
        self._alive &= ~self._bit[replica]
        del self._bit[replica], self._held[replica], self._last_seq[replica]
        del self._offloaded[replica], self._host_only[replica]
        self._stale.discard(replica)
        self.replicas = tuple(r for r in self.replicas if r != replica)
        self._renumber()

    def reset_replica(self, replica: str) -> None:
        """Drop a member's entries and restart its sequence at 0 (a restart: a new incarnation)."""
        self.clear(replica)
        self._last_seq[replica] = 0
        self._set_stale(replica, False)

    def mark_stale(self, replica: str) -> None:
        """Events were lost (the caller saw a gap in its own source's numbering): the replica matches nothing
        until `resync`."""
        self._set_stale(replica, True)

    def _renumber(self) -> None:
        order = [self._bit[r].bit_length() - 1 for r in self.replicas]
        self._slot_order = None if order == list(range(len(order))) else order
        self._num_slots = max(order, default=-1) + 1

    def _set_stale(self, replica: str, stale: bool) -> None:
        if stale:
            self._stale.add(replica)
            self._alive &= ~self._bit[replica]
        else:
            self._stale.discard(replica)
            self._alive |= self._bit[replica]

    # -- changes -------------------------------------------------------------------------------

    def add(self, replica: str, block_hashes: Iterable[BlockKey]) -> None:
        """The replica's device holds these blocks."""
        host_only = self._host_only[replica]
        if host_only:
            block_hashes = list(block_hashes)
            for block_hash in block_hashes:
                host_only.pop(block_hash, None)
        self._hold(replica, block_hashes)

    def _hold(self, replica: str, block_hashes: Iterable[BlockKey]) -> None:
        bit, held, holders = self._bit[replica], self._held[replica], self._holders
        for block_hash in block_hashes:
            if block_hash not in held:
                held.add(block_hash)
                holders[block_hash] = holders.get(block_hash, 0) | bit

    def remove(self, replica: str, block_hashes: Iterable[BlockKey]) -> None:
        """The replica's device lost these blocks: they stay held where an offloaded tier keeps a copy."""
        host_only = self._host_only[replica]
        if self._offloaded[replica]:
            block_hashes = list(block_hashes)
            kept = self._offloaded_weights(replica, block_hashes)
            host_only.update(kept)
            block_hashes = [h for h in block_hashes if h not in kept]
        self._drop(replica, block_hashes)

    def _drop(self, replica: str, block_hashes: Iterable[BlockKey]) -> None:
        bit, held, holders = self._bit[replica], self._held[replica], self._holders
        for block_hash in block_hashes:
            if block_hash in held:
                held.discard(block_hash)
                rest = holders[block_hash] & ~bit
                if rest:
                    holders[block_hash] = rest
                else:
                    del holders[block_hash]

    def _offloaded_weights(self, replica: str, block_hashes: Iterable[BlockKey]) -> dict[BlockKey, float]:
        """Of `block_hashes`, those with a copy on an offloaded tier -> the best such tier's weight."""
        out: dict[BlockKey, float] = {}
        for medium, hashes in self._offloaded[replica].items():
            weight = self.medium_weights.get(medium, 0.0)
            for block_hash in block_hashes:
                if block_hash in hashes and weight > out.get(block_hash, 0.0):
                    out[block_hash] = weight
        return out

    def add_offloaded(self, replica: str, medium: str, block_hashes: Iterable[BlockKey]) -> None:
        """Copies on offloaded tier `medium`; a block the device does not hold is held at the tier's weight."""
        weight = self.medium_weights.get(medium, 0.0)
        if weight <= 0:
            return
        block_hashes = list(block_hashes)
        self._offloaded[replica].setdefault(medium, set()).update(block_hashes)
        held, host_only = self._held[replica], self._host_only[replica]
        new = []
        for block_hash in block_hashes:
            if block_hash not in held:
                new.append(block_hash)
                host_only[block_hash] = weight
            elif block_hash in host_only and weight > host_only[block_hash]:
                host_only[block_hash] = weight
        self._hold(replica, new)

    def remove_offloaded(self, replica: str, medium: str, block_hashes: Iterable[BlockKey]) -> None:
        """Tier `medium` lost these copies; a block with no copy left anywhere leaves the index."""
        hashes = self._offloaded[replica].get(medium)
        if not hashes:
            return
        block_hashes = [h for h in block_hashes if h in hashes]
        hashes.difference_update(block_hashes)
        if not hashes:
            del self._offloaded[replica][medium]
        host_only = self._host_only[replica]
        if not host_only:
            return
        gone = [h for h in block_hashes if h in host_only]
        remaining = self._offloaded_weights(replica, gone)
        for block_hash in gone:
            if block_hash in remaining:
                host_only[block_hash] = remaining[block_hash]
            else:
                del host_only[block_hash]
        self._drop(replica, [h for h in gone if h not in remaining])

    def clear(self, replica: str) -> None:
        self._offloaded[replica].clear()
        self._host_only[replica].clear()
        self._drop(replica, list(self._held[replica]))

    def apply(self, replica: str, events: Iterable[KVEvent]) -> bool:
        """Apply one replica's events in order. Events already covered (seq <= last) are skipped.

        Returns False, and marks the replica stale, on a sequence gap; the caller must `resync` it."""
        for event in events:
            if replica in self._stale:
                return False
            expected = self._last_seq[replica] + 1
            if event.seq < expected:
                continue
            if event.seq > expected:
                self._set_stale(replica, True)
                return False
            if event.kind == "stored":
                if event.medium == DEVICE:
                    self.add(replica, event.block_hashes)
                else:
                    self.add_offloaded(replica, event.medium, event.block_hashes)
            elif event.kind == "removed":
                if event.medium == DEVICE:
                    self.remove(replica, event.block_hashes)
                else:
                    self.remove_offloaded(replica, event.medium, event.block_hashes)
            elif event.kind == "cleared":
                self.clear(replica)
            else:
                raise ValueError(f"unknown KV event kind {event.kind!r}")
            self._last_seq[replica] = event.seq
        return replica not in self._stale

    def resync(
        self,
        replica: str,
        seq: int,
        block_hashes: Iterable[BlockKey],
        offloaded: Mapping[str, Iterable[BlockKey]] | None = None,
    ) -> None:
        """Replace the replica's entries with a snapshot taken at event `seq` (KVCacheManager.snapshot()): the
        device's hashes and, per offloaded tier, that tier's."""
        self.clear(replica)
        self.add(replica, block_hashes)
        for medium, hashes in (offloaded or {}).items():
            self.add_offloaded(replica, medium, hashes)
        self._last_seq[replica] = seq
        self._set_stale(replica, False)


class NarrowedKVIndex:
    """`match` of a KVIndex restricted to some of its replicas, in the order given."""

    def __init__(self, index: KVIndex, replicas: Sequence[str]) -> None:
        self.replicas = tuple(replicas)
        self._index = index
        position = {r: i for i, r in enumerate(index.replicas)}
        self._positions = [position[r] for r in self.replicas]

    def match(self, block_hashes: Sequence[BlockKey]) -> list[int]:
        matched = self._index.match(block_hashes)
        return [matched[i] for i in self._positions]

    def narrowed(self, replicas: Sequence[str]) -> NarrowedKVIndex:
        return NarrowedKVIndex(self._index, replicas)


class LearnedKVIndex(KVIndex):
    """A gateway's own guess of the fleet's cache, learned from its routing decisions only.

    Each replica's entries are an LRU bounded by `capacity_blocks`. A routed request's blocks are
    touched from last to first, so its tail is evicted before the prefix it shares with others."""

    def __init__(self, replicas: Sequence[str], capacity_blocks: int) -> None:
        super().__init__(replicas)
        self.capacity_blocks = capacity_blocks
        self._lru: dict[str, OrderedDict[BlockKey, None]] = {r: OrderedDict() for r in self.replicas}

    def add_replica(self, replica: str) -> None:
        super().add_replica(replica)
        self._lru[replica] = OrderedDict()

    def remove_replica(self, replica: str) -> None:
        super().remove_replica(replica)
        del self._lru[replica]

    def reset_replica(self, replica: str) -> None:
        super().reset_replica(replica)
        self._lru[replica].clear()

    def record_routed(self, replica: str, block_hashes: Sequence[BlockKey]) -> None:
        lru = self._lru[replica]
        new = []
        for block_hash in reversed(block_hashes):
            if block_hash in lru:
                lru.move_to_end(block_hash)
            else:
                lru[block_hash] = None
                new.append(block_hash)
        self.add(replica, new)
        evicted = []
        while len(lru) > self.capacity_blocks:
            evicted.append(lru.popitem(last=False)[0])
        self.remove(replica, evicted)


def _set_depth(matched: list[int], replicas_mask: int, depth: int) -> None:
    while replicas_mask:
        lowest = replicas_mask & -replicas_mask
        matched[lowest.bit_length() - 1] = depth
        replicas_mask ^= lowest
