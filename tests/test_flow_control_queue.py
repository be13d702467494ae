"""The flow-control queue and its parts, alone (gateway.flow_control): band order, fair share by tokens, bounds
and sheds, expiry, saturation, Retry-After from the drain rate, and the routing config's parsing."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.admission.auth import Authenticator, key_sha256
from gateway.errors import InvalidRequestError
from gateway.flow_control.config import BandSettings, FlowControlConfig, Slo
from gateway.flow_control.drain_rate import DrainRate
from gateway.flow_control.fair_queue import FairQueue, QueuedRequest, QueueFull
from gateway.flow_control.saturation import blocks_needed, dispatchable
from gateway.frontdoors.openai_protocol import (
    PRIORITY_HEADER,
    CompletionRequest,
    RequestHeaders,
    parse_request,
    priority_header,
)
from gateway.request import Tenant
from gateway.routing.fleet_view import ReplicaLoad


def request(tenant: str = "a", band: int = 0, cost: float = 100, size: int = 1000, at: float = 0.0, weight: float = 1.0,
            name: str = "") -> QueuedRequest[str]:  # fmt: skip
    return QueuedRequest(band, tenant, weight, cost, size, at, name or tenant)


def drain(queue: FairQueue[str]) -> list[str]:
    """Every request in dispatch order (always the head of the most urgent band)."""
    order = []
    while queue:
        head = queue.head(queue.bands()[0])
        queue.take(head)
        order.append(head.payload)
    return order


def test_lower_priority_values_go_first_and_each_tenant_in_arrival_order() -> None:
    queue: FairQueue[str] = FairQueue(FlowControlConfig())
    for name, band in (("batch-1", 10), ("urgent-1", -5), ("normal-1", 0), ("batch-2", 10), ("urgent-2", -5)):
        queue.push(request(band=band, name=name))
    assert queue.bands() == [-5, 0, 10]
    assert drain(queue) == ["urgent-1", "urgent-2", "normal-1", "batch-1", "batch-2"]


def test_a_flood_from_one_tenant_does_not_delay_another_by_more_than_its_share() -> None:
    queue: FairQueue[str] = FairQueue(FlowControlConfig())
    for i in range(100):
        queue.push(request("flood", name=f"flood-{i}"))
    queue.take(queue.head(0))  # the flood's first is already out: the band's clock has moved
    queue.push(request("quiet", name="quiet-0"))
    queue.push(request("quiet", name="quiet-1"))
    order = drain(queue)
    assert order.index("quiet-0") <= 1 and order.index("quiet-1") <= 3


def test_fair_share_is_in_tokens_weighted_by_tenant() -> None:
    queue: FairQueue[str] = FairQueue(FlowControlConfig())
    for i in range(40):
        queue.push(request("long", cost=1000, name=f"long-{i}"))
        queue.push(request("short", cost=100, name=f"short-{i}"))
        queue.push(request("heavy", cost=1000, weight=4.0, name=f"heavy-{i}"))
    served = {"long": 0.0, "short": 0.0, "heavy": 0.0}
    for _ in range(40):  # while all three are backlogged
        head = queue.head(0)
        queue.take(head)
        served[head.tenant] += head.cost
    # tokens served in proportion to weight (1 : 1 : 4), within one request's cost
    assert abs(served["long"] - served["short"]) <= 1000
    assert abs(served["heavy"] - 4 * served["long"]) <= 4000


def test_bounds_refuse_by_tenant_then_band_then_queue_and_shed_the_least_urgent_newest_first() -> None:
    config = FlowControlConfig(max_queued=4, tenant_max_queued=3, bands={5: BandSettings(max_queued=2)})
    queue: FairQueue[str] = FairQueue(config)
    for i in range(3):
        queue.push(request("a", band=0, name=f"a{i}"))
    with pytest.raises(QueueFull) as refused:
        queue.push(request("a", band=0))
    assert refused.value.reason == "tenant_limit" and refused.value.queued_ahead == 3
    queue.push(request("b", band=5, name="b5-old"))
    with pytest.raises(QueueFull) as refused:
        queue.push(request("c", band=5))  # the whole queue is full and nothing less urgent than band 5 waits
    assert refused.value.reason == "queue_full"
    queue.push(request("b", band=3, name="b3"))  # sheds band 5's newest
    assert [r.payload for r in queue.all()] == ["a0", "a1", "a2", "b3"]
    queue.push(request("c", band=1, name="c1"))  # sheds band 3's (the least urgent band left)
    assert [r.payload for r in queue.all()] == ["a0", "a1", "a2", "c1"]
    queue.push(request("d", band=0, name="d0"))  # sheds c1
    assert [r.payload for r in queue.all()] == ["a0", "a1", "a2", "d0"]
    with pytest.raises(QueueFull) as refused:
        queue.push(request("e", band=0))  # nothing less urgent than band 0 is left to shed
    assert refused.value.reason == "queue_full" and len(queue) == 4


def test_a_tenant_that_sheds_its_own_less_urgent_request_is_counted_once() -> None:
    queue: FairQueue[str] = FairQueue(FlowControlConfig(max_queued=1, tenant_max_queued=2))
    queue.push(request("a", band=5, name="batch"))
    assert [r.payload for r in queue.push(request("a", band=0, name="urgent"))] == ["batch"]
    assert queue.tenant_depth("a") == 1
    queue.take(queue.head(0))
    assert queue.tenant_depth("a") == 0 and len(queue) == 0


def test_bytes_bound_the_band_and_the_tenant() -> None:
    config = FlowControlConfig(tenant_max_queued_bytes=2500, bands={0: BandSettings(max_queued_bytes=3000)})
    queue: FairQueue[str] = FairQueue(config)
    queue.push(request("a", size=2000))
    with pytest.raises(QueueFull) as refused:
        queue.push(request("a", size=1000))
    assert refused.value.reason == "tenant_limit"
    with pytest.raises(QueueFull) as refused:
        queue.push(request("b", size=1500))
    assert refused.value.reason == "band_full"
    queue.push(request("b", size=1000))
    assert queue.size_bytes == 3000


def test_a_request_that_leaves_frees_its_place_and_its_tenant_bound_at_once() -> None:
    queue: FairQueue[str] = FairQueue(FlowControlConfig(tenant_max_queued=2))
    first, second = request("a", name="first"), request("a", name="second")
    queue.push(first)
    queue.push(second)
    assert queue.remove(first) and not queue.remove(first)
    queue.push(request("a", name="third"))
    assert drain(queue) == ["second", "third"]
    assert len(queue) == 0 and queue.size_bytes == 0 and queue.tenant_depth("a") == 0


def test_requests_past_their_band_max_wait_expire_oldest_first() -> None:
    config = FlowControlConfig(bands={0: BandSettings(max_wait_s=1.0)})
    queue: FairQueue[str] = FairQueue(config)
    queue.push(request(band=0, at=0.0, name="old"))
    queue.push(request(band=0, at=0.8, name="young"))
    queue.push(request(band=7, at=0.0, name="patient"))  # the default band waits 30 s
    assert [r.payload for r in queue.expired(1.5)] == ["old"]
    assert [r.payload for r in queue.expired(2.0)] == ["old", "young"]


def test_a_worker_is_dispatchable_with_room_for_the_uncached_blocks_and_the_decode_reserve() -> None:
    config = FlowControlConfig(max_worker_waiting=2, max_worker_staged=0, decode_reserve_tokens=64)
    assert blocks_needed(prompt_blocks=10, matched_blocks=4, max_tokens=1000, block_size=16, reserve=64) == 10
    busy = ReplicaLoad(in_flight=3, queued=0, kv_usage=0.9, num_blocks=100, busy_reported=3)  # 10 free
    assert dispatchable(busy, 0, 0, 0, 10, config)
    assert not dispatchable(busy, 0, 0, 0, 11, config)
    assert not dispatchable(busy, 0, 1, 0, 10, config)  # blocks granted that its report cannot show yet
    one_waiting = FlowControlConfig(max_worker_waiting=1, max_worker_staged=0)
    assert not dispatchable(busy, 1, 0, 1, 10, one_waiting)  # granted, not sent yet
    waiting = ReplicaLoad(in_flight=5, queued=2, kv_usage=0.0, num_blocks=100, busy_reported=5)
    assert not dispatchable(waiting, 0, 0, 0, 1, config)
    assert dispatchable(ReplicaLoad(), 0, 0, 0, 10_000, config)  # an idle worker takes anything
    # idle by this gateway's count (its own request just ended) is not idle until the worker's report says so
    just_freed = ReplicaLoad(in_flight=0, num_blocks=100, kv_usage=0.9, busy_reported=1)
    assert not dispatchable(just_freed, 0, 0, 0, 11, config)
    engine = ReplicaLoad(in_flight=4, queued=1, kv_usage=0.96, busy_reported=4)  # no block count: by KV usage
    assert not dispatchable(engine, 0, 0, 0, 1, config)
    engine.kv_usage = 0.5
    assert dispatchable(engine, 0, 0, 0, 1, config)


def test_one_request_is_staged_in_a_worker_without_room_when_none_waits_there() -> None:
    config = FlowControlConfig(max_worker_waiting=2, max_worker_staged=1)
    full = ReplicaLoad(in_flight=3, queued=0, kv_usage=1.0, num_blocks=100, busy_reported=3)
    assert dispatchable(full, 0, 0, 0, 50, config)  # nothing waits there: it waits in the worker for room
    assert not dispatchable(full, 0, 0, 1, 50, config)  # one of ours on its way (no first token yet)
    assert not dispatchable(ReplicaLoad(in_flight=4, queued=1, kv_usage=1.0, num_blocks=100, busy_reported=4),
                            0, 0, 0, 50, config)  # fmt: skip
    assert not dispatchable(full, 2, 0, 0, 50, config)  # max_worker_waiting still bounds what is sent


def test_retry_after_follows_the_measured_drain_rate() -> None:
    rate = DrainRate()
    assert rate.retry_after(100, now=0.0) == 1  # nothing measured yet
    for i in range(11):
        rate.dispatched(i * 0.5)  # 2 per second
    assert rate.retry_after(9, now=5.0) == 5
    assert rate.retry_after(10_000, now=5.0) == 60


def test_the_tenant_priority_is_clamped_to_its_ceiling() -> None:
    tenant = Tenant("t", "", priority=10, min_priority=2)
    assert tenant.clamped_priority(None) == 10
    assert tenant.clamped_priority(0) == 2
    assert tenant.clamped_priority(50) == 50
    assert Tenant("open", "").clamped_priority(-3) == 0  # without a ceiling, the default is the ceiling


def test_the_routing_config_section_parses_with_defaults_and_band_overrides() -> None:
    options = {
        "epsilon": 0.5,
        "flow_control": {
            "max_worker_waiting": 3,
            "max_worker_staged": 0,
            "defaults": {"max_wait_s": 20},
            "bands": {"0": {"max_wait_s": 1, "slo": {"ttft_s": 1}}, "10": {"max_queued": 50}},
        },
    }
    config = FlowControlConfig.from_routing_config(options)
    assert options == {"epsilon": 0.5}
    assert config.max_worker_waiting == 3 and config.max_worker_staged == 0
    assert config.band(0) == BandSettings(1.0, None, None, Slo(ttft_s=1.0))
    assert config.band(10) == BandSettings(20.0, 50, None, Slo())
    assert config.band(3).max_wait_s == 20.0
    for bad, field in (
        ({"max_queued": 0}, "flow_control.max_queued"),
        ({"bands": {"x": {}}}, "'x' is not an integer"),
        ({"bands": {"0": {"max_wait_s": "1"}}}, "bands.0.max_wait_s"),
        ({"bands": {"0": {"slo": {"ttft": 1}}}}, "unknown key 'ttft'"),
        ({"tenant_max_queue": 3}, "unknown key 'tenant_max_queue'"),
    ):
        with pytest.raises(ValueError, match=field):
            FlowControlConfig.from_routing_config({"flow_control": bad})


def test_priority_comes_from_the_header_over_the_body_and_a_bad_value_names_its_field() -> None:
    body = b'{"model": "m", "prompt": "hi", "priority": 5}'
    wire = parse_request(CompletionRequest, body)
    assert wire.to_gateway_request(RequestHeaders()).priority == 5
    assert wire.to_gateway_request(RequestHeaders(priority=priority_header(" -2 "))).priority == -2
    assert parse_request(CompletionRequest, b'{"prompt": "hi"}').to_gateway_request(RequestHeaders()).priority is None
    for bad in ("high", "1.5", "2000000", "", "+-1"):
        with pytest.raises(InvalidRequestError) as refused:
            priority_header(bad)
        assert refused.value.param == PRIORITY_HEADER
    for bad_body in (b'{"prompt": "hi", "priority": 1.5}', b'{"prompt": "hi", "priority": 2000000}'):
        with pytest.raises(InvalidRequestError) as refused:
            parse_request(CompletionRequest, bad_body)
        assert refused.value.param == "priority"


def test_api_keys_carry_a_tenant_priority_ceiling_and_weight() -> None:
    entries: list[dict[str, Any]] = [
        {"tenant": "batch", "key_sha256": key_sha256("k1"), "priority": 10, "min_priority": 5, "weight": 0.5},
        {"tenant": "batch", "key_sha256": key_sha256("k2"), "weight": 0.5},
        {"tenant": "plain", "key_sha256": key_sha256("k3")},
    ]
    auth = Authenticator(entries)
    batch, plain = auth.authenticate("k2"), auth.authenticate("k3")
    assert (batch.priority, batch.min_priority, batch.weight) == (10, 5, 0.5)
    assert (plain.priority, plain.min_priority, plain.weight) == (0, None, 1.0)
    for bad, message in (
        ({"weight": 0}, r"weight: must be a number > 0"),
        ({"priority": "1"}, r"priority: must be an integer"),
        ({"min_priority": 10**7}, r"min_priority: must be an integer in"),
        ({"priority": 3, "min_priority": 4}, r"min_priority: is above its priority"),
    ):
        with pytest.raises(ValueError, match=message):
            Authenticator([{"tenant": "t", "key_sha256": key_sha256("k"), **bad}])
    with pytest.raises(ValueError, match="weight: tenant 't' is given two different values"):
        Authenticator([{"tenant": "t", "key_sha256": key_sha256(k), "weight": w} for k, w in (("a", 1), ("b", 2))])


class _Outcomes:
    def queued(self, band: int) -> None:
        pass

    def granted(self, band: int, reason: str, waited_s: float, grant: object, handle: object) -> None:
        pass

    def shed(self, band: int, reason: str, error: object, handle: object) -> None:
        pass


def test_on_a_priority_worker_less_urgent_grants_do_not_hold_room_against_a_more_urgent_request() -> None:
    """A batch request staged on a worker that schedules by priority waits behind an interactive one there (or
    gives it its blocks): its grant must not count against the interactive request's room, or the interactive
    request waits in the gateway for as long as batch work keeps the worker staged."""
    from gateway.flow_control.dispatcher import Dispatcher, Grant
    from gateway.routing.fleet_view import FleetView, PriorityShare
    from gateway.routing.router import RouteDecision, RouteRequest

    config = FlowControlConfig(max_worker_waiting=2, max_worker_staged=1, decode_reserve_tokens=16)
    view = FleetView.empty(["w0"])
    # 300 blocks, 280 held by batch (priority 1) requests: nothing free for a new request without preemption
    view.loads["w0"] = ReplicaLoad(
        in_flight=4, queued=0, kv_usage=280 / 300, num_blocks=300, busy_reported=4,
        priorities=(PriorityShare(1, 280, 0),),
    )  # fmt: skip

    def pick(request: RouteRequest, fleet: FleetView, exclude: frozenset[str]) -> RouteDecision:
        return RouteDecision("w0", "only")

    dispatcher: Dispatcher[int] = Dispatcher(config, lambda: view, pick, frozenset, 16, _Outcomes())

    def request(name: str, blocks: int) -> RouteRequest:
        return RouteRequest(name, [bytes([i]) * 16 for i in range(blocks)], blocks * 16)

    batch = dispatcher.arrive(request("batch", 100), "t", 1.0, 1, 16, 0, 1)
    assert isinstance(batch, Grant) and batch.decision is not None  # staged: nothing waits there
    batch.sent()
    second_batch = dispatcher.arrive(request("batch2", 100), "t", 1.0, 1, 16, 0, 2)
    assert not isinstance(second_batch, Grant)  # one batch request staged already: this one waits here
    dispatcher.withdraw(second_batch)
    urgent = dispatcher.arrive(request("urgent", 250), "t", 1.0, 0, 16, 0, 3)
    assert isinstance(urgent, Grant) and urgent.decision is not None  # staged ahead of the batch one there
    behind = dispatcher.arrive(request("batch3", 100), "t", 1.0, 1, 16, 0, 4)
    assert not isinstance(behind, Grant)  # both grants are ahead of a batch request
