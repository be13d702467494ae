"""The block pool keeps the books of the paged KV cache; it decides nothing.

Every block is in exactly one of two states:
  * in use: ref_cnt > 0, referenced by that many live sequences, never evicted;
  * free:   ref_cnt == 0, in the free queue. A free block that still holds a hash stays findable in the
            hash map (a cached block) until it is reused for new data, which evicts it.

The free queue is ordered by eviction priority: allocation pops from the head. Freed blocks without a
hash go to the head (nothing is lost by reusing them); freed cached blocks go to the tail (LRU).

There is at most one physical block per hash: a block whose hash is already cached by another block is
left uncached. So a `removed` event always means this pool has lost that block (see DESIGN §7); a host tier
behind it (worker/kv_cache_manager.py) may still hold a copy, and says so with its own events in this log.

Events (`stored` / `removed` / `cleared`) carry a sequence number that grows by one per event, so a
reader can detect a gap and resync from `snapshot()`. The pool keeps at most `max_pending_events` events
between two `drain_events()`; older ones are dropped, so an engine that nobody drains (offline use) keeps
bounded memory, and its reader sees the gap and resyncs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from kvroute.kv_events import DEVICE, BlockKey, KVEvent, KVEventKind

# Events kept between two drains. A step emits at most about twice the blocks it allocates (a `removed` per
# eviction, a `stored` per run of new blocks), a few hundred at the default token budget, so a reader that
# drains every step never loses one.
MAX_PENDING_EVENTS = 16384


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockKey | None = None
    # What a `stored` event names a cached block by besides its hash, kept while it is cached when the pool is
    # asked to (`keep_block_tokens`: a host tier announces the blocks it takes over with them).
    parent_hash: BlockKey | None = None
    token_ids: tuple[int, ...] = ()
    cache_salt: str = ""
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """A doubly linked list of free blocks, so that taking a cached block out of the middle is O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free

    def __iter__(self) -> Iterator[KVBlock]:
        node = self._head.next_free
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free block")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, f"block {block.block_id} is not in the free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        self._insert_after(self._tail.prev_free, block)

    def appendleft(self, block: KVBlock) -> None:
        self._insert_after(self._head, block)

    def _insert_after(self, prev: KVBlock | None, block: KVBlock) -> None:
        assert prev is not None and prev.next_free is not None
        assert block.prev_free is None and block.next_free is None, f"block {block.block_id} queued twice"
        nxt = prev.next_free
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block
        self.num_free += 1


class BlockPool:
    """Bookkeeping for `num_blocks` KV blocks: ref counts, the hash map, the free queue and the event log.
    `keep_block_tokens`: each cached block keeps its parent hash, tokens and salt (KVBlock)."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        max_pending_events: int = MAX_PENDING_EVENTS,
        keep_block_tokens: bool = False,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if max_pending_events < 1:
            raise ValueError(f"max_pending_events must be >= 1, got {max_pending_events}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.keep_block_tokens = keep_block_tokens
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockKey, KVBlock] = {}
        self._events: deque[KVEvent] = deque(maxlen=max_pending_events)
        self.event_seq = 0

    # -- queries -------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, cached or not)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    @property
    def usage(self) -> float:
        """Share of blocks referenced by live sequences (vLLM's kv_cache_usage)."""
        return self.num_used_blocks / self.num_blocks

    def get_cached_block(self, block_hash: BlockKey) -> KVBlock | None:
        return self.cached.get(block_hash)

    # -- changes -------------------------------------------------------------------------------

    def eviction_candidates(self, n: int) -> list[KVBlock]:
        """The cached blocks that `allocate(n)` would evict (the first n of the free queue that hold a hash)."""
        out = []
        for count, block in enumerate(self.free_queue):
            if count == n:
                break
            if block.block_hash is not None:
                out.append(block)
        return out

    def allocate(self, n: int) -> list[KVBlock]:
        """Take `n` blocks for new data (ref_cnt 1 each), evicting cached ones from the LRU end if needed."""
        if n > len(self.free_queue):
            raise ValueError(f"asked for {n} blocks, only {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (a cache hit); a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference on each block, in the given order: pass the blocks that should be evicted
        first first (a sequence's tail before its shared root)."""
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed with ref_cnt 0"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def cache_blocks(
        self,
        blocks: list[KVBlock],
        hashes: list[BlockKey],
        parent: BlockKey | None,
        token_ids: Sequence[int] = (),
        cache_salt: str = "",
    ) -> None:
        """Register consecutive full blocks of one sequence under their hashes; `parent` is the hash of the
        block before `blocks[0]` (None when it is the sequence's first). `token_ids`, when given, are the
        blocks' tokens (an equal number per block) and `cache_salt` the sequence's salt: each `stored` event
        carries its run's share of them, for publishers whose format names the tokens (vLLM's).

        A block already registered, or whose hash another block holds, is skipped (one physical block per
        hash). The new blocks are announced as one `stored` event per contiguous run, each with the hash
        just before the run as its parent, so a reader can chain every event onto what it already holds."""
        if not self.enable_caching:
            return
        per_block = len(token_ids) // len(blocks) if blocks else 0
        run: list[BlockKey] = []
        run_start = 0
        run_parent = parent
        for i, (block, block_hash) in enumerate(zip(blocks, hashes, strict=True)):
            if block.block_hash is not None or block_hash in self.cached:
                if run:
                    self._emit_stored(run, run_parent, token_ids[run_start * per_block : i * per_block], cache_salt)
                    run = []
                run_parent = block_hash
                run_start = i + 1
                continue
            block.block_hash = block_hash
            self.cached[block_hash] = block
            if self.keep_block_tokens:
                block.parent_hash = hashes[i - 1] if i else parent
                block.token_ids = tuple(token_ids[i * per_block : (i + 1) * per_block])
                block.cache_salt = cache_salt
            run.append(block_hash)
        if run:
            self._emit_stored(run, run_parent, token_ids[run_start * per_block : len(blocks) * per_block], cache_salt)

    def _emit_stored(self, run: list[BlockKey], parent: BlockKey | None, tokens: Sequence[int], salt: str) -> None:
        self.log_event("stored", tuple(run), parent, tuple(tokens), salt)

    def reset_cache(self) -> bool:
        """Forget every cached hash (weights changed, an operator asked); only when no block is in use."""
        if self.num_used_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        self.log_event("cleared", ())
        return True

    def drain_events(self) -> list[KVEvent]:
        """The events since the last drain, in order. At most `max_pending_events` of them: when more piled
        up the oldest were dropped, so the first seq returned is then more than one past the last one
        drained, and the reader must resync from `snapshot()`."""
        events = list(self._events)
        self._events.clear()
        return events

    def snapshot(self) -> tuple[int, list[BlockKey]]:
        """The last event's sequence number and every cached hash: a reader's resync point."""
        return self.event_seq, list(self.cached)

    def snapshot_page(self, start: int, count: int) -> tuple[int, list[BlockKey], int | None]:
        """A snapshot in pages, each O(`count`): the last event's sequence number, the cached hashes of blocks
        [start, start + count), and where the next page starts (None after the last block). Pages read at
        different times combine into the cached set as of the first page's seq when the events after that
        seq are applied on top: a hash cached throughout sits in one block all that time, so exactly one
        page lists it, and every other hash is settled by its last event."""
        if not 0 <= start < self.num_blocks or count < 1:
            raise ValueError(f"a snapshot page is start in [0, {self.num_blocks}) and count >= 1, got {start}, {count}")
        stop = min(start + count, self.num_blocks)
        hashes = [block.block_hash for block in self.blocks[start:stop] if block.block_hash is not None]
        return self.event_seq, hashes, stop if stop < self.num_blocks else None

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        del self.cached[block.block_hash]
        self.log_event("removed", (block.block_hash,))
        block.block_hash = block.parent_hash = None
        block.token_ids = ()

    def log_event(
        self,
        kind: KVEventKind,
        hashes: tuple,
        parent: BlockKey | None = None,
        tokens: tuple[int, ...] = (),
        salt: str = "",
        medium: str = DEVICE,
    ) -> None:
        """Append one event to the log under the next seq: the pool's own, and a host tier's (`medium`), so
        that a reader sees both tiers' changes in the order they happened."""
        self.event_seq += 1
        self._events.append(KVEvent(self.event_seq, kind, hashes, parent, tokens, salt, medium))

    # -- integrity -----------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if the books disagree. Tests call this after every operation."""
        queued = list(self.free_queue)
        assert len(queued) == self.free_queue.num_free, "free queue length is off"
        queued_ids = {b.block_id for b in queued}
        assert len(queued_ids) == len(queued), "a block is in the free queue twice"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"block {block.block_id} has ref_cnt {block.ref_cnt}"
            in_queue = block.block_id in queued_ids
            assert in_queue == (block.ref_cnt == 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but in free queue = {in_queue}"
            )
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) is block, f"block {block.block_id} hash not mapped"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"map points {block_hash!r} at a block holding another"
        hashes_in_queue = [b.block_hash is not None for b in queued]
        first_cached = hashes_in_queue.index(True) if True in hashes_in_queue else len(queued)
        assert all(hashes_in_queue[first_cached:]), "a hashless free block sits behind a cached one"
