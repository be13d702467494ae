import pytest

from gateway.routing.fleet_view import FleetView
from gateway.routing.kv_index import KVIndex, LearnedKVIndex
from kvroute.hashing import block_hashes
from kvroute.kv_events import HOST, KVEvent
from worker.kv_cache_manager import KVCacheManager

BS = 4
REPLICAS = ("a", "b", "c")


def hashes(tokens: list[int]) -> list[bytes]:
    return block_hashes(tokens, model_id="t", block_size=BS)


def run_request(mgr: KVCacheManager, req_id: str, tokens: list[int]) -> None:
    hs = hashes(tokens)
    hit = mgr.get_computed_blocks(hs, len(tokens))
    assert mgr.allocate_slots(req_id, len(tokens), hit.blocks) is not None
    mgr.cache_blocks(req_id, hs)
    mgr.free(req_id)


def test_index_mirrors_a_real_block_pool_through_its_events():
    mgr = KVCacheManager(num_blocks=6, block_size=BS)
    index = KVIndex(REPLICAS)
    for i in range(8):  # 8 requests of 3 blocks through 6 blocks: stored and removed events
        run_request(mgr, f"r{i}", [i % 3] * 4 + list(range(100 * i, 100 * i + 8)))
        assert index.apply("b", mgr.drain_events())
        assert index.held("b") == set(mgr.pool.cached)
    assert index.num_blocks("a") == 0


def test_match_counts_leading_blocks_per_replica():
    index = KVIndex(REPLICAS)
    index.add("a", ["x0", "x1", "x2"])
    index.add("b", ["x0", "x2"])  # a gap at x1: only x0 is usable
    index.add("c", ["y0"])
    assert index.match(["x0", "x1", "x2", "x3"]) == [3, 1, 0]
    assert index.match(["x0", "x1"]) == [2, 1, 0]
    assert index.match([]) == [0, 0, 0]
    index.remove("a", ["x1"])
    assert index.match(["x0", "x1", "x2"]) == [1, 1, 0]
    index.clear("a")
    assert index.match(["x0"]) == [0, 1, 0]


def test_sequence_gap_marks_stale_until_resync_from_snapshot():
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    index = KVIndex(REPLICAS)
    run_request(mgr, "r1", list(range(12)))
    assert index.apply("a", mgr.drain_events())
    run_request(mgr, "r2", list(range(50, 62)))
    lost = mgr.drain_events()
    run_request(mgr, "r3", list(range(80, 92)))
    assert not index.apply("a", mgr.drain_events())  # r2's events never arrived
    assert index.match(hashes(list(range(12)))) == [0, 0, 0]  # stale: r1's blocks, still held, match nothing
    seq, cached = mgr.pool.snapshot()
    index.resync("a", seq, cached)
    assert index.last_seq("a") == seq
    assert index.match(hashes(list(range(50, 62)))) == [3, 0, 0]
    assert index.apply("a", lost)  # old events (seq <= the snapshot's) are skipped
    assert index.num_blocks("a") == len(cached)


def test_learned_index_is_an_lru_of_the_replica_capacity_evicting_tails_first():
    index = LearnedKVIndex(REPLICAS, capacity_blocks=4)
    index.record_routed("a", ["s", "p1", "p2"])
    index.record_routed("a", ["s", "q1", "q2"])  # 5 distinct blocks: p2, the oldest tail, goes first
    assert index.match(["s", "p1", "p2"]) == [2, 0, 0]
    assert index.match(["s", "q1", "q2"]) == [3, 0, 0]
    assert index.num_blocks("a") == 4 and index.num_blocks("b") == 0


def stored(seq: int, *block_hashes: str) -> KVEvent:
    return KVEvent(seq, "stored", block_hashes)


def test_membership_changes_in_place_keep_the_other_replicas_entries():
    index = KVIndex(REPLICAS)
    index.add("a", ["x0", "x1"])
    index.add("b", ["x0"])
    index.add("c", ["x0", "x1", "x2"])
    index.remove_replica("b")
    assert index.replicas == ("a", "c")
    assert index.match(["x0", "x1", "x2"]) == [2, 3]
    index.add_replica("bb")  # takes b's freed bit, sorted between a and c, with nothing cached
    assert index.replicas == ("a", "bb", "c")
    assert index.match(["x0", "x1", "x2"]) == [2, 0, 3]
    index.add("bb", ["x0", "x1", "x2", "x3"])
    index.add_replica("0")  # a fourth bit, sorted first
    assert index.match(["x0", "x1", "x2", "x3"]) == [0, 2, 4, 3]
    assert index.narrowed(("c", "bb")).match(["x0", "x1", "x2", "x3"]) == [3, 4]
    with pytest.raises(ValueError, match="already"):
        index.add_replica("a")


def test_a_restart_drops_entries_even_when_new_sequence_numbers_pass_the_old():
    index = KVIndex(REPLICAS)
    assert index.apply("a", [stored(1, "old0"), stored(2, "old1")])
    index.reset_replica("a")  # new incarnation: its seq starts over at 1
    assert index.match(["old0"]) == [0, 0, 0] and index.last_seq("a") == 0
    assert index.apply("a", [stored(1, "new0"), stored(2, "new1"), stored(3, "new2")])
    assert index.match(["new0", "new1", "new2"]) == [3, 0, 0]
    assert index.match(["old0", "old1"]) == [0, 0, 0]


def test_stale_replicas_match_nothing_until_resynced():
    index = KVIndex(REPLICAS)
    index.add("a", ["x0"])
    index.add("b", ["x0"])
    assert not index.apply("a", [stored(7, "x1")])
    assert index.match(["x0"]) == [0, 1, 0] and index.held("a") == {"x0"}
    index.resync("a", 7, ["x0"])
    assert index.match(["x0"]) == [1, 1, 0]


def test_fleet_view_membership_keeps_loads_index_and_retry_views_aligned():
    view = FleetView.empty(REPLICAS)
    view.kv_index.add("c", ["x0"])
    view.loads["c"].in_flight = 4
    view.add_replica("ab")
    assert view.replicas == ("a", "ab", "b", "c") and view.index_of["c"] == 3
    assert view.kv_index.match(["x0"])[view.index_of["c"]] == 1
    view.remove_replica("a")
    assert view.replicas == ("ab", "b", "c") and view.index_of == {"ab": 0, "b": 1, "c": 2}
    assert view.loads["c"].in_flight == 4 and view.total_in_flight == 4
    retry = view.without(frozenset({"b"}))
    assert retry.replicas == ("ab", "c") and retry.kv_index.match(["x0"]) == [0, 1]
    second_retry = retry.without(frozenset({"ab"}))  # a narrowed view narrows again, over the same index
    assert second_retry.replicas == ("c",) and second_retry.kv_index.match(["x0"]) == [1]


def test_learned_index_follows_membership():
    index = LearnedKVIndex(REPLICAS, capacity_blocks=2)
    index.record_routed("b", ["s", "p"])
    index.remove_replica("a")
    index.add_replica("d")
    index.record_routed("d", ["s", "q", "r"])  # capacity 2: the tail r goes first
    assert index.replicas == ("b", "c", "d")
    assert index.match(["s", "q", "r"]) == [1, 0, 2]
    index.reset_replica("b")
    assert index.num_blocks("b") == 0


def test_a_block_held_only_on_the_host_tier_scores_its_weight():
    index = KVIndex(("a", "b"), {HOST: 0.5})
    events = [
        KVEvent(1, "stored", ("s", "p1", "p2", "p3")),
        KVEvent(2, "stored", ("p2", "p3"), "p1", medium=HOST),  # saved to the host as the device reuses them
        KVEvent(3, "removed", ("p2", "p3")),
    ]
    assert index.apply("a", events)
    assert index.apply("b", [KVEvent(1, "stored", ("s", "p1", "p2"))])
    assert index.match(["s", "p1", "p2", "p3"]) == [3, 3]  # a: 2 device blocks + 2 host blocks at 0.5
    assert set(index.host_only("a")) == {"p2", "p3"}
    assert index.apply("a", [KVEvent(4, "stored", ("p2",), "p1")])  # restored to the device
    assert index.match(["s", "p1", "p2", "p3"]) == [3, 3]  # 3.5, rounded down
    assert index.apply("a", [KVEvent(5, "removed", ("p2", "p3"), medium=HOST)])  # the host's LRU drops them
    assert index.match(["s", "p1", "p2", "p3"]) == [3, 3]  # p2 is on the device still, p3 is gone
    assert sorted(index.tiers("a")[0]) == ["p1", "p2", "s"] and index.tiers("a")[1] == {}
    assert index.apply("a", [KVEvent(6, "removed", ("p2",))])
    assert index.match(["s", "p1", "p2"]) == [2, 3] and not index.host_only("a")


def test_a_resync_restores_both_tiers_and_a_tier_weighing_nothing_is_not_indexed():
    index = KVIndex(("a",))
    index.resync("a", 7, ["s"], {HOST: ["s", "p1", "p2"]})
    assert index.match(["s", "p1", "p2"]) == [2]  # 1 + 2 x 0.92
    device, offloaded = index.tiers("a")
    rebuilt = KVIndex(("a",))
    rebuilt.resync("a", 7, device, offloaded)
    assert rebuilt.match(["s", "p1", "p2"]) == [2] and rebuilt.tiers("a") == (["s"], {HOST: {"s", "p1", "p2"}})
    assert index.apply("a", [KVEvent(8, "cleared")])
    assert index.match(["s"]) == [0] and index.tiers("a") == ([], {})
    blind = KVIndex(("a",), {})
    assert blind.apply("a", [KVEvent(1, "stored", ("s",)), KVEvent(2, "stored", ("s", "p1"), medium=HOST)])
    assert blind.match(["s", "p1"]) == [1]
    assert blind.apply("a", [KVEvent(3, "removed", ("s",))])
    assert blind.match(["s"]) == [0] and blind.num_blocks("a") == 0


def test_a_restart_or_a_departure_drops_the_workers_host_tier_too():
    index = KVIndex(("a", "b"))
    for replica in ("a", "b"):
        assert index.apply(replica, [KVEvent(1, "stored", ("s",)), KVEvent(2, "stored", ("p1", "p2"), medium=HOST)])
    index.reset_replica("a")  # a new incarnation: its host memory is gone with the process
    assert index.tiers("a") == ([], {}) and not index.host_only("a") and index.match(["s", "p1", "p2"]) == [0, 2]
    assert index.apply("a", [KVEvent(1, "stored", ("s",))])
    index.remove_replica("b")
    index.add_replica("b")  # a new member in the freed slot starts empty
    assert index.tiers("b") == ([], {}) and index.match(["s", "p1", "p2"]) == [1, 0]
