"""The KV cache manager decides which blocks a request gets; the BlockPool keeps the books.

Contract for callers (the scheduler, the replay):
  1. `get_computed_blocks(hashes, num_prompt_tokens)` finds the longest cached prefix (it takes no
     references; it counts prefix-cache queries and hits). A caller that may not admit the request yet
     uses `find_prefix_hit` + `num_free_blocks_needed`, and `record_prefix_query` once it does.
  2. `allocate_slots(req_id, num_tokens, computed, restore)` makes the request hold enough blocks for
     `num_tokens` tokens, first taking references on `computed` and copying `restore` (a hit's host-tier
     part) into the first new blocks; it returns None and changes nothing when the pool cannot provide the
     blocks, so the caller can wait or preempt. A hit must be allocated before anything else allocates.
  3. `cache_blocks(req_id, hashes)` registers the request's full blocks under their hashes as they fill.
  4. `free(req_id)` returns every block of the request at once (finish, cancel, preempt, fault).

With a host tier, one event log covers both tiers (BlockPool.log_event): a block the device is about to reuse is
announced `stored` on the host tier (medium "CPU", with its parent and tokens) before the device's `removed`, so
a reader never sees the worker lose a block it still has; the host tier's LRU drops are `removed` on "CPU". A
snapshot lists both tiers (`snapshot`, `snapshot_page`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvroute.kv_events import DEVICE, HOST, BlockKey, KVEvent
from worker.block_pool import BlockPool, KVBlock
from worker.host_kv_tier import HostKVTier, KVBlockCopier


@dataclass
class PrefixHit:
    blocks: list[KVBlock]  # on the device, in order
    num_tokens: int  # the whole hit's: device and host blocks
    restore: list[BlockKey] = field(default_factory=list)  # the host tier's blocks right after `blocks`


@dataclass
class CacheStats:
    """Counters in tokens, as vLLM's prefix_cache_queries / prefix_cache_hits."""

    prefix_queries: int = 0
    prefix_hits: int = 0  # every tier's
    host_prefix_hits: int = 0  # of prefix_hits, the tokens copied back from the host tier

    @property
    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0


class KVCacheManager:
    """`host_tier` and its `copier` (both or neither): a host tier behind the device pool (worker/host_kv_tier.py);
    with prefix caching only, since it keeps blocks by their hashes."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        host_tier: HostKVTier | None = None,
        copier: KVBlockCopier | None = None,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if (host_tier is None) != (copier is None):
            raise ValueError("a host KV tier needs a copier, and a copier a host tier")
        if host_tier is not None and not enable_prefix_caching:
            raise ValueError("a host KV tier keeps blocks by their hashes: it needs prefix caching")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.host_tier = host_tier
        self.copier = copier
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching, keep_block_tokens=host_tier is not None)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_hashed: dict[str, int] = {}  # leading blocks of a request already offered to the cache
        self.stats = CacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockKey]) -> list[KVBlock]:
        """The cached blocks of the longest prefix of `block_hashes`; stops at the first miss."""
        if not self.enable_prefix_caching:
            return []
        hit = []
        for block_hash in block_hashes:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit

    def find_prefix_hit(self, block_hashes: Sequence[BlockKey], num_prompt_tokens: int) -> PrefixHit:
        """The longest cached prefix usable by a new request; at least its last prompt token is left to
        compute, so a full hit still yields logits. Takes no references and counts nothing."""
        usable = (num_prompt_tokens - 1) // self.block_size
        blocks = self.find_longest_cache_hit(block_hashes[:usable])
        restore = [] if self.host_tier is None else self.host_tier.prefix(block_hashes[len(blocks) : usable])
        return PrefixHit(blocks, (len(blocks) + len(restore)) * self.block_size, restore)

    def record_prefix_query(self, hit: PrefixHit, num_prompt_tokens: int) -> None:
        """Count one admitted request's prefix-cache query and hit, in tokens."""
        self.stats.prefix_queries += num_prompt_tokens
        self.stats.prefix_hits += hit.num_tokens
        self.stats.host_prefix_hits += len(hit.restore) * self.block_size

    def get_computed_blocks(self, block_hashes: Sequence[BlockKey], num_prompt_tokens: int) -> PrefixHit:
        """`find_prefix_hit`, counted as a query: for callers that admit the request whatever the hit."""
        hit = self.find_prefix_hit(block_hashes, num_prompt_tokens)
        self.record_prefix_query(hit, num_prompt_tokens)
        return hit

    def num_free_blocks_needed(self, req_id: str, num_tokens: int, computed: Sequence[KVBlock] = ()) -> int:
        """Free blocks that `allocate_slots(req_id, num_tokens, computed)` would take from the pool:
        new blocks (a hit's host-tier part among them), plus the computed blocks now free (touching one takes
        it out of the free queue)."""
        held = len(self.req_blocks.get(req_id, ()))
        num_new = max(self.num_blocks_for(num_tokens) - held - len(computed), 0)
        return num_new + sum(1 for b in computed if b.ref_cnt == 0)

    def allocate_slots(
        self, req_id: str, num_tokens: int, computed: Sequence[KVBlock] = (), restore: Sequence[BlockKey] = ()
    ) -> list[KVBlock] | None:
        """Grow `req_id` to hold `num_tokens` tokens; `computed` and `restore` (a prefix hit's device blocks and
        host-tier hashes) only on its first call. The restored blocks are copied into the first new blocks and
        offered to the prefix cache with the request's next `cache_blocks`, as blocks it computed.

        Returns the newly allocated blocks, or None (and no change) if the pool is short."""
        held = self.req_blocks.get(req_id, [])
        if (computed or restore) and held:
            raise ValueError(f"request {req_id} already holds blocks; computed blocks come first")
        if held and len(held) * self.block_size >= num_tokens:
            return []  # its blocks hold them already (most decode steps): nothing to take, nothing to walk
        if self.num_free_blocks_needed(req_id, num_tokens, computed) > self.pool.num_free_blocks:
            return None
        num_new = max(self.num_blocks_for(num_tokens) - len(held) - len(computed), 0)
        if len(restore) > num_new:
            raise ValueError(f"request {req_id}: {len(restore)} blocks to restore, {num_new} to allocate")
        tier = self.host_tier
        if tier is not None:
            tier.pin(restore)
        self.pool.touch(computed)
        self._save_evictions(num_new)
        new_blocks = self.pool.allocate(num_new)
        if restore:
            self._restore(restore, new_blocks[: len(restore)])
        if tier is not None:
            tier.unpin(restore)
        blocks = self.req_blocks.setdefault(req_id, [])
        blocks.extend(computed)
        blocks.extend(new_blocks)
        self.num_hashed.setdefault(req_id, len(computed))
        return new_blocks

    def _save_evictions(self, num_blocks: int) -> None:
        """Copy to the host tier the cached blocks that allocating `num_blocks` is about to reuse."""
        if not num_blocks or self.host_tier is None or self.copier is None or not self.copier.copy_pays():
            return
        saved: list[KVBlock] = []
        slots: list[int] = []
        evicted: list[BlockKey] = []
        for block in self.pool.eviction_candidates(num_blocks):
            assert block.block_hash is not None
            slot = self.host_tier.reserve(block.block_hash, evicted)
            if slot is not None:
                saved.append(block)
                slots.append(slot)
        if not saved:
            return
        self.copier.copy_to_host([b.block_id for b in saved], slots)
        self.host_tier.stats.saved += len(saved)
        log = self.pool.log_event
        if evicted:
            log("removed", tuple(evicted), medium=HOST)
        for block in saved:
            log("stored", (block.block_hash,), block.parent_hash, block.token_ids, block.cache_salt, HOST)

    def _restore(self, hashes: Sequence[BlockKey], blocks: Sequence[KVBlock]) -> None:
        assert self.host_tier is not None and self.copier is not None, "a hit with a host part needs a host tier"
        slots = [self.host_tier.slot(h) for h in hashes]
        self.copier.copy_from_host(slots, [b.block_id for b in blocks])
        for block_hash in hashes:
            self.host_tier.touch(block_hash)
        self.host_tier.stats.restored += len(hashes)

    def cache_blocks(
        self, req_id: str, block_hashes: Sequence[BlockKey], token_ids: Sequence[int] = (), cache_salt: str = ""
    ) -> None:
        """Offer the request's blocks 0..len(block_hashes)-1 to the prefix cache (they are full). `token_ids`
        (the sequence's tokens so far) and `cache_salt`, when given, go into the `stored` events."""
        blocks = self.req_blocks[req_id]
        start = self.num_hashed[req_id]
        end = min(len(block_hashes), len(blocks))
        if end <= start:
            return
        parent = block_hashes[start - 1] if start > 0 else None
        bs = self.block_size
        tokens = token_ids[start * bs : end * bs] if len(token_ids) >= end * bs else ()
        self.pool.cache_blocks(blocks[start:end], list(block_hashes[start:end]), parent, tokens, cache_salt)
        self.num_hashed[req_id] = end

    def free(self, req_id: str) -> None:
        """Return all of the request's blocks, tail first so that shared roots are evicted last."""
        blocks = self.req_blocks.pop(req_id, [])
        self.num_hashed.pop(req_id, None)
        self.pool.free(reversed(blocks))

    def block_table(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(req_id, [])]

    def drain_events(self) -> list[KVEvent]:
        return self.pool.drain_events()

    def snapshot(self) -> tuple[int, list[BlockKey], list[BlockKey]]:
        """The last event's seq, the device's cached hashes and the host tier's: a reader's resync point."""
        seq, device = self.pool.snapshot()
        host = [] if self.host_tier is None else self.host_tier.snapshot_page(0, self.host_tier.num_blocks)
        return seq, device, host

    def snapshot_page(self, start: int, count: int) -> tuple[int, list[BlockKey], int | None, str]:
        """A snapshot in pages (BlockPool.snapshot_page), the device pool's blocks [0, num_blocks) first and then
        the host tier's slots after them, a page on one tier only: the last event's seq, the page's hashes, where
        the next page starts (None after the last) and the page's tier."""
        num_device = self.pool.num_blocks
        tier = self.host_tier
        if start < num_device:
            seq, hashes, stop = self.pool.snapshot_page(start, count)
            if stop is None and tier is not None:
                stop = num_device
            return seq, hashes, stop, DEVICE
        if tier is None or not start < num_device + tier.num_blocks or count < 1:
            raise ValueError(
                f"a snapshot page starts below {num_device + (tier.num_blocks if tier else 0)}, got {start}"
            )
        stop = min(start + count, num_device + tier.num_blocks)
        hashes = tier.snapshot_page(start - num_device, stop - start)
        return self.pool.event_seq, hashes, stop if stop < num_device + tier.num_blocks else None, HOST

    def reset_cache(self) -> bool:
        """Forget every cached block on both tiers (one `cleared`); only when no block is in use."""
        if not self.pool.reset_cache():
            return False
        if self.host_tier is not None:
            self.host_tier.clear()
        return True

    def check_invariants(self) -> None:
        """Pool invariants (both tiers'), plus: each block's ref_cnt equals the number of live requests holding it."""
        self.pool.check_invariants()
        if self.host_tier is not None:
            self.host_tier.check_invariants()
        refs: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            ids = [b.block_id for b in blocks]
            assert len(ids) == len(set(ids)), "a request holds one block twice"
            for block_id in ids:
                refs[block_id] = refs.get(block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt}, held by {refs.get(block.block_id, 0)}"
            )
