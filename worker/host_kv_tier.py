"""The host tier of the KV cache: a second, larger pool of blocks in host memory that keeps the cached blocks the
device pool evicts, so that a later request whose prefix lives there (a preempted sequence coming back, a
conversation's next turn after a burst of other traffic) gets it copied back instead of prefilled. vLLM's
`--kv-offloading-size` and LMCache's CPU tier do the same; seed 004 prices the copy at a twelfth of the recompute.

Books here, bytes in the runner. `HostKVTier` maps block hashes to host slots, LRU, bounded; a `KVBlockCopier`
(the model runner: pinned memory on a GPU, a second pool in RAM on a CPU; the sim runner: only the copy's time)
moves the bytes. The KV cache manager (worker/kv_cache_manager.py) drives both: it saves a cached block as the
device pool is about to reuse it, and restores a prefix hit's host part into freshly allocated device blocks.

Its changes are KV events of medium "CPU" in the device pool's log (the manager writes them): `stored` as a block
is saved, `removed` as the LRU end drops one; a router scores a prefix held here below one on the device
(gateway/routing/kv_index.py).

Invariants (`check_invariants`): a slot is free or holds exactly one hash, and a hash at most one slot (one
physical copy per hash in this tier); the LRU order lists every held hash once; a pinned hash (one being restored)
is never evicted. A hash may sit in both tiers: a block restored to the device keeps its host copy, so that its
next eviction from the device costs no copy.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvroute.kv_events import BlockKey
from worker.config import EngineConfig


class KVBlockCopier(Protocol):
    """Moves whole KV blocks (every layer's K and V) between the device pool and the host tier, and says whether a
    block's copy costs less than recomputing its tokens (`copy_pays`: a CopyCostMeter's, or a sim's parameters)."""

    def copy_to_host(self, device_blocks: Sequence[int], host_slots: Sequence[int]) -> None: ...

    def copy_from_host(self, host_slots: Sequence[int], device_blocks: Sequence[int]) -> None: ...

    def copy_pays(self) -> bool: ...


class CopyCostMeter:
    """What a block costs to copy and to recompute, as measured: moving averages of the seconds a copy takes per
    block and a prefill per token. `copy_pays()` until both are measured (every machine measured so far copies
    12x to 441x cheaper than it recomputes: docs/worker.md), then whether a block's copy costs less than its
    `block_size` tokens' prefill; the KV cache manager saves nothing to the host tier while it does not."""

    SMOOTHING = 0.2  # the weight of each new measurement

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.copy_seconds_per_block: float | None = None
        self.prefill_seconds_per_token: float | None = None

    def observe_copy(self, num_blocks: int, seconds: float) -> None:
        if num_blocks > 0:
            self.copy_seconds_per_block = self._average(self.copy_seconds_per_block, seconds / num_blocks)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens > 0:
            self.prefill_seconds_per_token = self._average(self.prefill_seconds_per_token, seconds / num_tokens)

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.SMOOTHING * (new - old)

    def copy_pays(self) -> bool:
        copy, prefill = self.copy_seconds_per_block, self.prefill_seconds_per_token
        return copy is None or prefill is None or copy < prefill * self.block_size


@dataclass
class HostTierStats:
    """Counters in blocks."""

    saved: int = 0  # device -> host copies
    restored: int = 0  # host -> device copies
    evicted: int = 0  # dropped from the host tier's LRU end (gone from both tiers)


def host_tier_blocks(config: EngineConfig, bytes_per_block: int) -> int:
    """The host tier's blocks from `--host-kv-blocks` or `--host-kv-memory-gb` (0: no tier)."""
    if config.host_kv_blocks:
        return config.host_kv_blocks
    return int(config.host_kv_memory_gb * 2**30) // bytes_per_block


def check_host_memory(num_blocks: int, bytes_per_block: int, meminfo: Path = Path("/proc/meminfo")) -> None:
    """ValueError, saying what to ask for instead, when the tier would not fit the machine's available memory
    (MemAvailable): a tier that does would only be found out by the OOM killer, under load."""
    wanted = num_blocks * bytes_per_block
    available = available_memory_bytes(meminfo)
    if available is not None and wanted > available:
        fits = available // bytes_per_block
        raise ValueError(
            f"a host KV tier of {num_blocks} blocks needs {wanted / 2**30:.1f} GiB of host memory; this machine has "
            f"{available / 2**30:.1f} GiB available: ask for at most {fits} blocks (--host-kv-blocks), leaving "
            "room for everything else"
        )


def available_memory_bytes(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class HostKVTier:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a host KV tier needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self._slots: OrderedDict[BlockKey, int] = OrderedDict()  # least recently used first
        self._slot_hashes: list[BlockKey | None] = [None] * num_blocks
        self._free_slots = list(range(num_blocks - 1, -1, -1))
        self._pinned: set[BlockKey] = set()
        self.stats = HostTierStats()

    def __contains__(self, block_hash: BlockKey) -> bool:
        return block_hash in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def prefix(self, block_hashes: Sequence[BlockKey]) -> list[BlockKey]:
        """The leading hashes of `block_hashes` this tier holds, up to the first it does not."""
        held = []
        for block_hash in block_hashes:
            if block_hash not in self._slots:
                break
            held.append(block_hash)
        return held

    def slot(self, block_hash: BlockKey) -> int:
        return self._slots[block_hash]

    def touch(self, block_hash: BlockKey) -> None:
        self._slots.move_to_end(block_hash)

    def reserve(self, block_hash: BlockKey, evicted: list[BlockKey]) -> int | None:
        """The slot to copy `block_hash`'s block into, evicting the least recently used unpinned hash (appended
        to `evicted`) when the tier is full; None when there is nothing to copy (the tier holds it already: it
        becomes the most recent) or no room (every slot pinned)."""
        if block_hash in self._slots:
            self.touch(block_hash)
            return None
        if not self._free_slots and not self._evict_one(evicted):
            return None
        slot = self._free_slots.pop()
        self._slots[block_hash] = slot
        self._slot_hashes[slot] = block_hash
        return slot

    def _evict_one(self, evicted: list[BlockKey]) -> bool:
        victim = next((h for h in self._slots if h not in self._pinned), None)
        if victim is None:
            return False
        slot = self._slots.pop(victim)
        self._slot_hashes[slot] = None
        self._free_slots.append(slot)
        evicted.append(victim)
        self.stats.evicted += 1
        return True

    def pin(self, block_hashes: Iterable[BlockKey]) -> None:
        self._pinned.update(block_hashes)

    def unpin(self, block_hashes: Iterable[BlockKey]) -> None:
        self._pinned.difference_update(block_hashes)

    def clear(self) -> None:
        """Forget every block (the device cache was reset: weights changed, or an operator asked)."""
        self._free_slots = list(range(self.num_blocks - 1, -1, -1))
        self._slots.clear()
        self._slot_hashes = [None] * self.num_blocks
        self._pinned.clear()

    def snapshot_page(self, start: int, count: int) -> list[BlockKey]:
        """The hashes held in slots [start, start + count): a hash stays in one slot while it is held, so pages
        read at different times combine as the device pool's do (BlockPool.snapshot_page)."""
        return [h for h in self._slot_hashes[start : start + count] if h is not None]

    def check_invariants(self) -> None:
        slots = list(self._slots.values())
        assert len(set(slots)) == len(slots), "two hashes share a host slot"
        assert not set(slots) & set(self._free_slots), "a host slot is both held and free"
        assert len(slots) + len(self._free_slots) == self.num_blocks, "a host slot leaked"
        assert all(0 <= s < self.num_blocks for s in slots + self._free_slots), "a host slot out of range"
        assert self._pinned <= set(self._slots), "a pinned hash is not held"
        assert all(self._slot_hashes[s] == h for h, s in self._slots.items()), "a slot's hash is off"
        assert sum(h is not None for h in self._slot_hashes) == len(slots), "a free slot names a hash"
