import itertools

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from gateway.routing.kv_index import KVIndex
from kvroute.hashing import block_hashes
from worker.block_pool import BlockPool
from worker.kv_cache_manager import KVCacheManager

BS = 4


def hashes(tokens):
    return block_hashes(tokens, model_id="t", block_size=BS)


def run_request(mgr: KVCacheManager, req_id: str, tokens: list[int]) -> int:
    """Admit, compute and finish one request; returns its cached prompt tokens."""
    hs = hashes(tokens)
    hit = mgr.get_computed_blocks(hs, len(tokens))
    assert mgr.allocate_slots(req_id, len(tokens), hit.blocks) is not None
    mgr.cache_blocks(req_id, hs)
    mgr.check_invariants()
    mgr.free(req_id)
    mgr.check_invariants()
    return hit.num_tokens


def test_prefix_hit_leaves_the_last_token_to_compute():
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    tokens = list(range(12))  # exactly 3 blocks
    assert run_request(mgr, "a", tokens) == 0
    assert run_request(mgr, "b", tokens) == 8  # a full hit keeps one token (so one block) to compute
    assert run_request(mgr, "c", tokens + [99]) == 12
    assert mgr.stats.prefix_queries == 12 + 12 + 13
    assert mgr.stats.prefix_hits == 8 + 12


def test_lookup_stops_at_first_miss():
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    run_request(mgr, "a", list(range(16)))
    changed = list(range(16))
    changed[5] = 77  # block 1 differs, so blocks 2 and 3 (chained) miss too
    assert len(mgr.find_longest_cache_hit(hashes(changed))) == 1


def test_lru_evicts_least_recent_and_tail_first():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    run_request(mgr, "a", [1] * 8)  # 2 blocks
    run_request(mgr, "b", [2] * 8)  # 2 blocks, pool now full of cached blocks
    run_request(mgr, "c", [1] * 8 + [3])  # hits a's 2 blocks, needs 1 new: evicts b's tail first
    events = mgr.drain_events()
    removed = [e.block_hashes[0] for e in events if e.kind == "removed"]
    assert removed == [hashes([2] * 8)[1]]
    assert mgr.find_longest_cache_hit(hashes([2] * 8)) != []  # b's root survives


def test_lru_churn_seed_numbers():
    """5 prefixes through a 4-slot cache, twice: 0 of 10 hit; with 5 slots, 5 of 10.

    Each request is one cacheable block plus one token; the extra pool block holds that uncached tail."""
    for slots, expected in ((4, 0), (5, 5)):
        mgr = KVCacheManager(num_blocks=slots + 1, block_size=BS)
        hits = 0
        for round_ in range(2):
            for p in range(5):
                hits += run_request(mgr, f"{round_}-{p}", [p] * BS + [100]) > 0
        assert hits == expected


def test_in_use_blocks_are_never_evicted():
    mgr = KVCacheManager(num_blocks=3, block_size=BS)
    hs = hashes([1] * 8)
    mgr.allocate_slots("a", 8)
    mgr.cache_blocks("a", hs)
    assert mgr.allocate_slots("b", 8) is None  # only 1 free block; nothing changes
    mgr.check_invariants()
    assert mgr.allocate_slots("b", 4) is not None
    assert mgr.find_longest_cache_hit(hs) == mgr.pool.blocks[:0] + mgr.req_blocks["a"]


def test_one_physical_block_per_hash_and_no_false_removed_events():
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    tokens = [5] * 8
    hs = hashes(tokens)
    # Two requests compute the same blocks at the same time (neither saw the other's cache).
    for req in ("a", "b"):
        assert mgr.allocate_slots(req, len(tokens)) is not None
    for req in ("a", "b"):
        mgr.cache_blocks(req, hs)
    stored = [h for e in mgr.drain_events() if e.kind == "stored" for h in e.block_hashes]
    assert stored == hs  # stored once
    mgr.free("a")
    mgr.free("b")
    mgr.check_invariants()
    # Fill the pool with other data: each hash is removed exactly once, when its only copy goes.
    mgr.allocate_slots("c", 8 * BS)
    removed = [h for e in mgr.drain_events() if e.kind == "removed" for h in e.block_hashes]
    assert sorted(removed) == sorted(hs)


def test_stored_events_split_around_held_hashes_each_with_its_true_parent():
    pool = BlockPool(8)
    hs = hashes(list(range(16)))  # 4 chained blocks
    other = pool.allocate(1)
    pool.cache_blocks(other, [hs[1]], hs[0])  # another sequence's block already holds h1
    pool.drain_events()
    pool.cache_blocks(pool.allocate(4), hs, None)
    stored = [(e.block_hashes, e.parent_hash) for e in pool.drain_events()]
    assert stored == [((hs[0],), None), ((hs[2], hs[3]), hs[1])]
    pool.check_invariants()


def test_a_range_cached_after_another_requests_copy_chains_onto_that_copy():
    """Two requests compute one prefix at once (neither saw the other's cache); the second's own blocks
    follow the first's, and its stored event names the first's last block as its parent."""
    mgr = KVCacheManager(num_blocks=16, block_size=BS)
    hs = hashes(list(range(20)))  # 5 blocks
    assert mgr.allocate_slots("a", 12) is not None and mgr.allocate_slots("b", 20) is not None
    mgr.cache_blocks("a", hs[:3])
    mgr.cache_blocks("b", hs[:1])
    mgr.cache_blocks("b", hs)
    stored = [(e.block_hashes, e.parent_hash) for e in mgr.drain_events()]
    assert stored == [(tuple(hs[:3]), None), (tuple(hs[3:]), hs[2])]
    mgr.check_invariants()


def test_an_undrained_pool_keeps_its_newest_events_and_its_reader_resyncs():
    pool = BlockPool(4, max_pending_events=8)
    index = KVIndex(["w"])

    def cache_one(key: str) -> None:
        blocks = pool.allocate(1)
        pool.cache_blocks(blocks, [key], None)
        pool.free(blocks)

    for i in range(20):  # 20 stored and 16 removed events, nobody draining
        cache_one(f"h{i}")
    events = pool.drain_events()
    assert [e.seq for e in events] == list(range(pool.event_seq - 7, pool.event_seq + 1))
    assert not index.apply("w", events), "the reader sees the gap"
    index.resync("w", *pool.snapshot())
    cache_one("h20")
    assert index.apply("w", pool.drain_events())
    assert index.held("w") == set(pool.cached) and len(pool.cached) == 4


def test_event_sequence_numbers_are_gapless():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    for i in range(6):
        run_request(mgr, str(i), [i] * 8)
    seqs = [e.seq for e in mgr.drain_events()]
    assert seqs == list(range(1, len(seqs) + 1))
    last, cached = mgr.pool.snapshot()
    assert last == seqs[-1] and len(cached) == mgr.pool.num_cached_blocks


def test_reset_cache_only_when_idle():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    run_request(mgr, "a", [1] * 8)
    mgr.allocate_slots("b", 4)
    assert not mgr.pool.reset_cache()
    mgr.free("b")
    assert mgr.pool.reset_cache()
    assert mgr.pool.num_cached_blocks == 0
    mgr.check_invariants()


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)
    with pytest.raises(ValueError, match="block_size"):
        KVCacheManager(4, 0)


class BlockManagerMachine(RuleBasedStateMachine):
    """Random admissions, growth, caching, frees and aborts; the books must balance after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(num_blocks=12, block_size=BS)
        self.tokens: dict[str, list[int]] = {}
        self.next_id = 0
        self.parent_of: dict = {}  # every hash the machine made -> the hash before it (None: a first block)
        self.cached: set = set()  # the pool's cached set, as a reader rebuilds it from the events

    def hashes(self, tokens: list[int]) -> list:
        hs = hashes(tokens)
        self.parent_of.update(zip(hs, [None, *hs], strict=False))
        return hs

    @rule(prefix=st.integers(0, 3), length=st.integers(1, 20))
    def admit(self, prefix, length):
        tokens = [prefix] * min(length, 8) + list(range(length - min(length, 8)))
        hit = self.mgr.get_computed_blocks(self.hashes(tokens), len(tokens))
        assert hit.num_tokens < len(tokens)
        req = f"r{self.next_id}"
        self.next_id += 1
        free_before = self.mgr.num_free_blocks
        if self.mgr.allocate_slots(req, len(tokens), hit.blocks) is None:
            assert self.mgr.num_free_blocks == free_before
            assert req not in self.mgr.req_blocks
            return
        self.tokens[req] = tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.integers(1, 6))
    def grow(self, data, extra):
        req = data.draw(st.sampled_from(sorted(self.tokens)))
        tokens = self.tokens[req] + [7] * extra
        if self.mgr.allocate_slots(req, len(tokens)) is not None:
            self.tokens[req] = tokens
            self.mgr.cache_blocks(req, self.hashes(tokens))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def finish(self, data):
        req = data.draw(st.sampled_from(sorted(self.tokens)))
        self.mgr.cache_blocks(req, self.hashes(self.tokens.pop(req)))
        self.mgr.free(req)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def abort(self, data):
        req = data.draw(st.sampled_from(sorted(self.tokens)))
        del self.tokens[req]
        self.mgr.free(req)

    @invariant()
    def books_balance(self):
        self.mgr.check_invariants()
        for h, block in self.mgr.pool.cached.items():
            assert block.block_hash == h

    @invariant()
    def events_chain_onto_true_parents_and_rebuild_the_cached_set(self):
        for event in self.mgr.drain_events():
            if event.kind == "stored":
                chain = list(event.block_hashes)
                assert event.parent_hash == self.parent_of[chain[0]]
                assert all(self.parent_of[h] == p for p, h in itertools.pairwise(chain))
                self.cached |= set(chain)
            else:
                self.cached -= set(event.block_hashes)
        assert self.cached == set(self.mgr.pool.cached)

    def teardown(self):
        for req in list(self.tokens):
            self.mgr.free(req)
        self.mgr.check_invariants()
        assert self.mgr.pool.num_used_blocks == 0


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
