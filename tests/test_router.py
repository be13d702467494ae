import pytest

from gateway.fleet import FleetView
from gateway.hash_ring import HashRing, LoadBound
from gateway.kv_index import KVIndex
from gateway.router import POLICY_NAMES, NoReplicaAvailable, RouteRequest, make_policy

REPLICAS = [f"r{i}" for i in range(8)]


def fleet() -> FleetView:
    return FleetView.empty(REPLICAS)


def request(i: int, prefix: str = "p", tail: int = 3, session: str | None = None) -> RouteRequest:
    """Blocks: the prefix's 2 blocks (the key at key_blocks=2), then `tail` blocks unique to request i."""
    blocks = [f"{prefix}/0", f"{prefix}/1"] + [f"{prefix}/req{i}/{j}" for j in range(tail)]
    return RouteRequest(f"req-{i}", blocks, 16 * len(blocks), session)


def test_unknown_policy_and_option_are_named():
    with pytest.raises(ValueError, match="unknown routing policy 'nope'"):
        make_policy("nope")
    with pytest.raises(ValueError, match="unknown policy option 'bogus'"):
        make_policy("prefix", bogus=1)
    with pytest.raises(ValueError, match="key_blocks"):
        make_policy("prefix", key_blocks=0)


def test_load_bound_formula():
    view = fleet()
    for i, r in enumerate(REPLICAS):
        view.loads[r].in_flight = i  # total 28
    bound = LoadBound(epsilon=0.25)
    limit = bound.in_flight_limit(view)
    assert limit == 5  # ceil(1.25 * 29 / 8) = ceil(4.53)
    assert not bound.is_over("r4", view, limit)  # 4 + 1 <= 5
    assert bound.is_over("r5", view, limit)
    view.loads["r0"].queued = 9
    view.loads["r1"].kv_usage = 0.99
    assert bound.is_over("r0", view, limit) and bound.is_over("r1", view, limit)


def test_prefix_policy_is_sticky_per_prefix():
    policy = make_policy("prefix", key_blocks=2)
    view = fleet()
    picks = {policy.pick(request(i), view).replica for i in range(20)}
    assert len(picks) == 1
    decision = policy.pick(request(0), view)
    assert decision.reason == "ring" and decision.skipped == ()
    owners = {policy.pick(request(0, prefix=f"app{k}"), view).replica for k in range(40)}
    assert len(owners) >= 6  # distinct prefixes spread over the ring


def test_bounded_fallback_walks_ring_successors_in_order():
    policy = make_policy("prefix", key_blocks=2, epsilon=0.0, min_in_flight=1)
    view = fleet()
    order = HashRing(REPLICAS).successors("p/1")
    assert set(order) == set(REPLICAS) and len(order) == 8
    assert policy.pick(request(0), view).replica == order[0]
    view.loads[order[0]].in_flight = 1  # limit = ceil(2 / 8) = 1: the owner is over, the rest are not
    decision = policy.pick(request(1), view)
    assert (decision.replica, decision.reason, decision.skipped) == (order[1], "fallback-overloaded", (order[0],))
    view.loads[order[1]].queued = 100
    decision = policy.pick(request(2), view)
    assert decision.replica == order[2] and decision.skipped == (order[0], order[1])


def test_a_lightly_loaded_replica_is_never_over_its_bound():
    """Below min_in_flight a replica keeps its keys, whatever the fleet's mean."""
    policy = make_policy("prefix", key_blocks=2, epsilon=0.0, min_in_flight=3)
    view = fleet()
    owner = HashRing(REPLICAS).successors("p/1")[0]
    view.loads[owner].in_flight = 2
    assert policy.pick(request(0), view).replica == owner
    view.loads[owner].in_flight = 3
    assert policy.pick(request(1), view).reason == "fallback-overloaded"


def test_hot_prefix_spills_to_a_predictable_few_replicas():
    """One shared prefix for all traffic (no finishes): the owner fills to its bound, then its successors."""
    policy = make_policy("prefix", key_blocks=2, epsilon=0.5)
    view = fleet()
    order = HashRing(REPLICAS).successors("p/1")
    seen = []
    for i in range(16):
        replica = policy.pick(request(i), view).replica
        view.loads[replica].in_flight += 1
        seen.append(replica)
    assert seen[0] == order[0]
    assert len(set(seen)) > 4  # not pinned to one replica
    first_use = list(dict.fromkeys(seen))
    assert first_use == list(order[: len(first_use)])  # spill follows the ring order


@pytest.mark.parametrize("name", [p for p in POLICY_NAMES if p != "round_robin"])
def test_two_router_instances_with_the_same_view_agree(name):
    view = fleet()
    index = view.kv_index
    index.add("r3", ["p/0", "p/1", "p/req5/0"])
    for i, r in enumerate(REPLICAS):
        view.loads[r].in_flight = i % 3
    a, b = make_policy(name, key_blocks=2), make_policy(name, key_blocks=2)
    for i in range(30):
        req = request(i, prefix=f"app{i % 4}", session=f"s{i % 5}")
        assert a.pick(req, view) == b.pick(req, view)


def test_round_robin_cycles_sorted_replicas():
    policy = make_policy("round_robin")
    view = fleet()
    assert [policy.pick(request(i), view).replica for i in range(10)] == REPLICAS + REPLICAS[:2]


def test_random_is_seeded_by_request_id():
    view = fleet()
    a, b, c = make_policy("random", seed=1), make_policy("random", seed=1), make_policy("random", seed=2)
    picks_a = [a.pick(request(i), view).replica for i in range(200)]
    assert picks_a == [b.pick(request(i), view).replica for i in range(200)]
    assert picks_a != [c.pick(request(i), view).replica for i in range(200)]
    assert len(set(picks_a)) == 8


def test_least_loaded_picks_fewest_in_flight_plus_queued():
    view = fleet()
    for r in REPLICAS:
        view.loads[r].in_flight = 3
    view.loads["r5"].in_flight = 1
    view.loads["r5"].queued = 1
    view.loads["r2"].in_flight = 1
    view.loads["r2"].queued = 0
    assert make_policy("least_loaded").pick(request(0), view).replica == "r2"


def test_session_policy_follows_the_session_id():
    policy = make_policy("session")
    view = fleet()
    picks = {policy.pick(request(i, prefix=f"x{i}", session="chat-7"), view).replica for i in range(10)}
    assert len(picks) == 1
    assert policy.pick(request(0, session="chat-7"), view).reason == "session"


def test_kv_aware_follows_the_longest_cached_prefix():
    view = fleet()
    for r in REPLICAS:  # the prefix everyone holds (a system prompt) says nothing
        view.kv_index.add(r, ["p/0"])
    policy, ring_policy = make_policy("kv_aware", key_blocks=2), make_policy("prefix", key_blocks=2)
    decision = policy.pick(request(0), view)
    assert decision.reason == "ring" and decision.replica == ring_policy.pick(request(0), view).replica
    view.kv_index.add("r6", ["p/0", "p/1", "p/req0/0"])
    view.kv_index.add("r2", ["p/0", "p/1"])
    decision = policy.pick(request(0), view)
    assert (decision.replica, decision.reason, decision.matched_blocks) == ("r6", "hit", 3)
    view.loads["r6"].queued = 100  # the best holder is overloaded: the next best candidate
    decision = policy.pick(request(0), view)
    assert (decision.replica, decision.reason, decision.matched_blocks, decision.skipped) == ("r2", "hit", 2, ("r6",))


def test_kv_aware_ignores_stale_replicas():
    view = FleetView.empty(REPLICAS, KVIndex(REPLICAS))
    view.kv_index.add("r6", ["p/0", "p/1", "p/req0/0"])
    view.kv_index.apply("r6", [type("E", (), {"seq": 5, "kind": "stored", "block_hashes": ()})()])
    assert view.kv_index.is_stale("r6")
    assert make_policy("kv_aware", key_blocks=2).pick(request(0), view).reason == "ring"


def test_kv_aware_lets_a_replica_holding_the_prompt_carry_more_load():
    view = fleet()
    for r in REPLICAS:
        view.loads[r].in_flight = 2
    view.loads["r6"].in_flight = 4  # 18 in flight: the plain bound is ceil(1.5 * 19 / 8) = 4, r6 is over it
    view.kv_index.add("r6", ["p/0", "p/1", "p/req0/0"])  # but it holds the whole prompt: slack 2 x epsilon
    req = RouteRequest("req-0", ["p/0", "p/1", "p/req0/0"], 48)
    assert make_policy("prefix", key_blocks=2).bound.is_over("r6", view, 4)
    assert make_policy("kv_aware", key_blocks=2).pick(req, view).replica == "r6"
    view.loads["r6"].in_flight = 5  # ceil(2.0 * 20 / 8) = 5: now over even with the slack
    assert make_policy("kv_aware", key_blocks=2).pick(req, view).replica != "r6"


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_an_empty_fleet_or_every_replica_excluded_raises_no_replica_available(name):
    with pytest.raises(NoReplicaAvailable, match="no live worker"):
        make_policy(name).pick(RouteRequest("r", [], 5), FleetView.empty([]))
    with pytest.raises(NoReplicaAvailable, match="all excluded"):
        make_policy(name).pick(RouteRequest("r", [], 5), FleetView.empty(["a", "b"]), exclude=frozenset({"a", "b"}))


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_pick_never_returns_an_excluded_replica(name):
    fleet = FleetView.empty(["a", "b", "c"])
    fleet.kv_index.add("b", [b"h0", b"h1"])
    policy = make_policy(name)
    for i in range(20):
        request = RouteRequest(f"r{i}", [b"h0", b"h1"], 40, session_id="s")
        assert policy.pick(request, fleet, exclude=frozenset({"b"})).replica in ("a", "c")


def test_kv_aware_routes_a_prompt_with_no_full_block():
    """A prompt shorter than one block has no hash: it goes to the ring like any new prefix (no ZeroDivision)."""
    fleet = FleetView.empty(["a", "b"])
    decision = make_policy("kv_aware").pick(RouteRequest("short", [], 9), fleet)
    assert decision.reason == "ring" and decision.matched_blocks == 0
