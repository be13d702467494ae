import hashlib

import pytest

from gateway.routing.common_prefix import HALF_LIFE, CommonPrefixSketch
from gateway.routing.fleet_view import FleetView
from gateway.routing.hash_ring import HashRing, LoadBound
from gateway.routing.kv_index import KVIndex
from gateway.routing.router import POLICY_NAMES, STARVATION_WINDOW, NoReplicaAvailable, RouteRequest, make_policy

REPLICAS = [f"r{i}" for i in range(8)]


def fleet() -> FleetView:
    return FleetView.empty(REPLICAS)


def request(i: int, prefix: str = "p", tail: int = 3, session: str | None = None) -> RouteRequest:
    """Blocks: the prefix's 2 blocks, then `tail` blocks unique to request i."""
    blocks = [f"{prefix}/0", f"{prefix}/1"] + [f"{prefix}/req{i}/{j}" for j in range(tail)]
    return RouteRequest(f"req-{i}", blocks, 16 * len(blocks), session)


def route(policy, req: RouteRequest, view: FleetView, exclude: frozenset[str] = frozenset()):
    """One routed request as a gateway routes it: the pick, then the policy's memory updated with it."""
    decision = policy.pick(req, view, exclude)
    policy.observe(req, decision)
    return decision


def warm(policy, view: FleetView, prefix: str = "p", n: int = 8, blocks: int = 2) -> None:
    """Route `n` one-off requests that share `blocks` blocks of `prefix`, so the policy's sketch knows
    them as common (the view's loads are left as they were)."""
    for i in range(n):
        shared = [f"{prefix}/{j}" for j in range(blocks)]
        route(policy, RouteRequest(f"warm-{i}", [*shared, f"warm/{i}"], 16 * (blocks + 1)), view)


def test_unknown_policy_and_option_are_named():
    with pytest.raises(ValueError, match="unknown routing policy 'nope'"):
        make_policy("nope")
    with pytest.raises(ValueError, match="unknown policy option 'bogus'"):
        make_policy("prefix", bogus=1)
    with pytest.raises(ValueError, match="vnodes"):
        make_policy("prefix", vnodes=0)


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


def test_common_prefix_sketch_finds_the_shared_depth_whatever_its_length():
    sketch = CommonPrefixSketch()
    shared = [f"sys/{j}" for j in range(40)]  # longer than any fixed key depth
    for i in range(192):
        tenant = [f"t{i % 16}/{j}" for j in range(3)]  # each tenant is 1/16 of the traffic: under 1/8
        sketch.observe(sketch.cells(shared + tenant + [f"own/{i}"]))
    cells = sketch.cells(shared + ["t0/0", "t0/1", "t0/2", "new"])
    assert sketch.common_prefix(cells, replicas=8) == (40, 1.0)
    assert sketch.common_prefix(cells, replicas=16)[0] == 40  # exactly 1/16 is not more than a fair share
    assert sketch.common_prefix(cells, replicas=32)[0] == 43  # at 32 replicas a tenant is common too
    assert sketch.common_prefix(sketch.cells(["other/0"]), replicas=8) == (0, 0.0)
    for i in range(2 * HALF_LIFE):  # the traffic moves on: the old prefix's share halves every HALF_LIFE
        sketch.observe(sketch.cells(["new-app/0", f"own2/{i}"]))
    assert sketch.common_prefix(cells, replicas=8)[0] == 0


def test_a_conversation_stays_on_one_replica_past_a_long_shared_prefix():
    """Chats behind a 3-block system prompt that all traffic carries: each chat's turns stay together (its
    key is its first own block, carried by all its turns), and the chats spread over the fleet."""
    policy = make_policy("prefix")
    view = fleet()
    warm(policy, view, "sys", blocks=3)
    system = ["sys/0", "sys/1", "sys/2"]
    picks: dict[int, set[str]] = {c: set() for c in range(24)}
    for turn in range(4):
        for chat in range(24):
            blocks = system + [f"chat{chat}/{t}" for t in range(turn + 1)]
            picks[chat].add(route(policy, RouteRequest(f"c{chat}t{turn}", blocks, 16 * len(blocks)), view).replica)
    assert all(len(replicas) == 1 for replicas in picks.values())
    assert len({r for replicas in picks.values() for r in replicas}) >= 6


def test_bounded_fallback_walks_ring_successors_in_order():
    policy = make_policy("prefix", epsilon=0.0, min_in_flight=1)
    view = fleet()
    one_block = RouteRequest("req", ["k"], 16)  # the key of a one-block prompt is its block
    order = HashRing(REPLICAS).successors("k")
    assert set(order) == set(REPLICAS) and len(order) == 8
    assert policy.pick(one_block, view).replica == order[0]
    view.loads[order[0]].in_flight = 1  # limit = ceil(2 / 8) = 1: the owner is over, the rest are not
    decision = policy.pick(one_block, view)
    assert (decision.replica, decision.reason, decision.skipped) == (order[1], "fallback-overloaded", (order[0],))
    view.loads[order[1]].queued = 100
    decision = policy.pick(one_block, view)
    assert decision.replica == order[2] and decision.skipped == (order[0], order[1])


@pytest.mark.parametrize(
    ("replicas", "owners", "digest"),
    [
        (REPLICAS, ["r2", "r3", "r1", "r2"], "008e1593d501d7e2"),
        (["worker-0", "worker-1", "worker-2"], ["worker-0", "worker-0", "worker-1", "worker-2"], "6e2ab5bc4a061f04"),
        (
            ["127.0.0.1:50051", "127.0.0.1:50052", "10.0.0.7:8000/dp1", "w0", "w1"],
            ["127.0.0.1:50051", "w0", "127.0.0.1:50052", "127.0.0.1:50051"],
            "e54f82d4d7d5088d",
        ),
    ],
)
def test_ring_placements_are_pinned(replicas: list[str], owners: list[str], digest: str) -> None:
    """Placements are uhashring 2.5's (its default ring, 160 md5 points per replica), on which the ring was
    built: a change moves every session and prefix to another replica on upgrade, so it must be deliberate."""
    ring = HashRing(replicas)
    assert [ring.successors(key)[0] for key in ("k", "req-7", bytes(16), 5)] == owners
    keys = [i.to_bytes(16, "little") for i in range(300)] + list(range(300)) + ["req-7", "session-a"]
    every_order = repr([ring.successors(key) for key in keys]).encode()
    assert hashlib.sha256(every_order).hexdigest()[:16] == digest


def test_a_lightly_loaded_replica_is_never_over_its_bound():
    """Below min_in_flight a replica keeps its keys, whatever the fleet's mean."""
    policy = make_policy("prefix", epsilon=0.0, min_in_flight=3)
    view = fleet()
    for r in REPLICAS:
        view.loads[r].in_flight = 1  # nobody idle: the starvation guard stays out of it
    one_block = RouteRequest("req", ["k"], 16)
    owner = HashRing(REPLICAS).successors("k")[0]
    view.loads[owner].in_flight = 2
    assert policy.pick(one_block, view).replica == owner
    view.loads[owner].in_flight = 3
    assert policy.pick(one_block, view).reason == "fallback-overloaded"


def test_a_prefix_all_traffic_shares_reaches_every_replica():
    """The issue's failure: one shared prefix put every request on one ring key, and replicas that never
    got a request were never candidates. Now the key is each request's own block."""
    for name in ("prefix", "kv_aware"):
        policy = make_policy(name)
        view = fleet()
        seen = []
        for i in range(64):
            decision = route(policy, request(i, "platform", tail=2), view)
            view.loads[decision.replica].in_flight += 1
            view.kv_index.add(decision.replica, request(i, "platform", tail=2).block_hashes)
            seen.append(decision.replica)
        assert set(seen) == set(REPLICAS), name
        assert max(seen.count(r) for r in REPLICAS) <= 16, name


def test_identical_prompts_spill_in_ring_order():
    """A prompt sent again and again (all of it common): its key is its last block, so the owner fills
    to its bound and the spill follows the key's ring successors."""
    policy = make_policy("prefix", epsilon=0.5)
    view = fleet()
    same = RouteRequest("same", ["hot/0", "hot/1"], 32)
    policy.sketch.observe(policy.sketch.cells(same.block_hashes))  # seen before: all of it is common
    seen = []
    for _ in range(24):
        replica = route(policy, same, view).replica
        view.loads[replica].in_flight += 1
        seen.append(replica)
    first_use = list(dict.fromkeys(seen))
    assert len(first_use) > 4  # not pinned to one replica
    assert first_use == list(HashRing(REPLICAS).successors("hot/1")[: len(first_use)])


@pytest.mark.parametrize("name", [p for p in POLICY_NAMES if p != "round_robin"])
def test_two_router_instances_with_the_same_view_agree(name):
    view = fleet()
    index = view.kv_index
    index.add("r3", ["p/0", "p/1", "p/req5/0"])
    for i, r in enumerate(REPLICAS):
        view.loads[r].in_flight = i % 3
    a, b = make_policy(name), make_policy(name)
    for i in range(30):
        req = request(i, prefix=f"app{i % 4}", session=f"s{i % 5}")
        assert route(a, req, view) == route(b, req, view)


def test_round_robin_cycles_sorted_replicas():
    policy = make_policy("round_robin")
    view = fleet()
    assert [route(policy, request(i), view).replica for i in range(10)] == REPLICAS + REPLICAS[:2]


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
    picks = {route(policy, request(i, prefix=f"x{i}", session="chat-7"), view).replica for i in range(10)}
    assert len(picks) == 1
    assert policy.pick(request(0, session="chat-7"), view).reason == "session"


def test_kv_aware_follows_the_longest_cached_prefix():
    view = fleet()
    for r in REPLICAS:  # the prefix everyone holds (a system prompt) says nothing
        view.kv_index.add(r, ["p/0", "p/1"])
    policy, ring_policy = make_policy("kv_aware"), make_policy("prefix")
    warm(policy, view, n=40)  # request 0 is sent 3 times below: 3 of 43 stays under 1/8, not common
    warm(ring_policy, view, n=40)
    decision = policy.pick(request(0), view)
    assert decision.reason == "ring" and decision.replica == ring_policy.pick(request(0), view).replica
    view.kv_index.add("r6", ["p/0", "p/1", "p/req0/0", "p/req0/1"])
    view.kv_index.add("r2", ["p/0", "p/1", "p/req0/0"])
    decision = policy.pick(request(0), view)
    assert (decision.replica, decision.reason, decision.matched_blocks) == ("r6", "hit", 4)
    view.loads["r6"].queued = 100  # the best holder is overloaded: the next best candidate
    decision = policy.pick(request(0), view)
    assert (decision.replica, decision.reason, decision.matched_blocks, decision.skipped) == ("r2", "hit", 3, ("r6",))


def test_kv_aware_sends_a_new_prefix_to_a_holder_of_the_common_prefix():
    """Rule 4: of the key's ring successors, the first that holds what the traffic shares."""
    view = fleet()
    policy = make_policy("kv_aware")
    warm(policy, view)
    order = HashRing(REPLICAS).successors("p/req0/0")
    view.kv_index.add(order[2], ["p/0", "p/1"])
    view.kv_index.add(order[5], ["p/0", "p/1"])
    decision = policy.pick(request(0), view)
    assert (decision.replica, decision.reason, decision.matched_blocks) == (order[2], "ring", 2)


def test_kv_aware_ignores_stale_replicas():
    view = FleetView.empty(REPLICAS, KVIndex(REPLICAS))
    view.kv_index.add("r6", ["p/0", "p/1", "p/req0/0"])
    view.kv_index.apply("r6", [type("E", (), {"seq": 5, "kind": "stored", "block_hashes": ()})()])
    assert view.kv_index.match(["p/0"])[6] == 0  # stale: what it holds matches nothing
    assert make_policy("kv_aware").pick(request(0), view).reason == "ring"


def test_kv_aware_lets_a_replica_holding_the_prompt_carry_more_load():
    view = fleet()
    for r in REPLICAS:
        view.loads[r].in_flight = 2
    view.loads["r6"].in_flight = 4  # 18 in flight: the plain bound is ceil(1.5 * 19 / 8) = 4, r6 is over it
    view.kv_index.add("r6", ["p/0", "p/1", "p/req0/0"])  # a full hit: epsilon x (1 + 2) = 1.5
    req = RouteRequest("req-0", ["p/0", "p/1", "p/req0/0"], 48)
    assert make_policy("kv_aware").bound.is_over("r6", view, 4)
    assert make_policy("kv_aware").pick(req, view).replica == "r6"  # ceil(2.5 * 19 / 8) = 6
    view.loads["r6"].in_flight = 7  # ceil(2.5 * 22 / 8) = 7: now over even with the slack
    assert make_policy("kv_aware").pick(req, view).replica != "r6"


def test_starvation_guard_sends_a_new_prefix_to_an_idle_replica():
    """Three replicas hold the shared prefix, one holds nothing: rules 1-4 never choose it. The guard does,
    once at once (a replica never chosen) and then whenever it idled STARVATION_WINDOW x N decisions while
    the chosen replica was busy; a hit is never redirected, and a light fleet is left alone."""
    names = ["a", "b", "c", "d"]
    view = FleetView.empty(names)
    policy = make_policy("kv_aware")
    for r in "abc":
        view.kv_index.add(r, ["p/0", "p/1"])
    warm(policy, view)
    assert {route(policy, request(i), view).replica for i in range(40)} <= {"a", "b", "c"}  # light: sticky
    for r in "abc":
        view.loads[r].in_flight = 3
    decision = route(policy, request(50), view)
    assert (decision.replica, decision.reason) == ("d", "idle") and decision.skipped[0] in "abc"
    assert route(policy, request(51), view).replica != "d"  # chosen recently: the window runs again
    view.loads["d"].in_flight = 1
    for i in range(STARVATION_WINDOW * len(names)):
        route(policy, request(60 + i), view)
    view.loads["d"].in_flight = 0
    for r in "abc":
        view.loads[r].queued = 1  # the chosen replica has a prefill queue: busy
    assert policy.pick(request(99), view).reason == "idle"
    view.kv_index.add("a", ["p/0", "p/1", "p/req7/0", "p/req7/1", "p/req7/2"])
    assert policy.pick(request(7), view).reason == "hit"  # a hit keeps its replica


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
        assert route(policy, request, fleet, exclude=frozenset({"b"})).replica in ("a", "c")


def test_kv_aware_routes_a_prompt_with_no_full_block():
    """A prompt shorter than one block has no hash: it goes to the ring like any new prefix (no ZeroDivision)."""
    fleet = FleetView.empty(["a", "b"])
    decision = make_policy("kv_aware").pick(RouteRequest("short", [], 9), fleet)
    assert decision.reason == "ring" and decision.matched_blocks == 0


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_pick_is_pure_and_a_retry_is_observed_once(name):
    """A retry picks again with the failed worker excluded, then the request is observed once, with the
    decision it was sent on: the policy then decides the next requests as if the retry's first pick never
    happened (the sketch counted the request once, the guard and round robin's turn moved once)."""
    view = fleet()
    view.kv_index.add("r3", ["p/0", "p/1", "p/req5/0"])
    for i, r in enumerate(REPLICAS):
        view.loads[r].in_flight = i % 3
    retried, direct = make_policy(name), make_policy(name)
    for i in range(40):
        req = request(i, prefix=f"app{i % 3}", session=f"s{i % 5}")
        first = retried.pick(req, view)
        assert retried.pick(req, view) == first  # pure: the same pick again
        again = route(retried, req, view, exclude=frozenset({first.replica}))
        assert again.replica != first.replica
        assert route(direct, req, view, exclude=frozenset({first.replica})) == again
        probe = request(100 + i, prefix=f"app{i % 3}")
        assert retried.pick(probe, view) == direct.pick(probe, view)


@pytest.mark.parametrize("name", ["session", "prefix", "kv_aware"])
def test_a_retry_walks_the_whole_rings_order_skipping_the_excluded(name):
    """The retry's ring is the fleet's ring (not one rebuilt over the workers left, then rebuilt back), and
    its order is that ring's order less the excluded workers."""
    policy = make_policy(name)
    view = fleet()
    req = RouteRequest("req", ["k"], 16, session_id="k")
    ring = policy.ring(view.replicas)
    order = ring.successors("k")
    assert route(policy, req, view).replica == order[0]
    for tried in range(1, 4):
        decision = route(policy, req, view, exclude=frozenset(order[:tried]))
        assert decision.replica == order[tried], tried
    assert policy.ring(view.replicas) is ring
