"""The simulator's flow control is the gateway's (gateway.flow_control.dispatcher, one copy): the same arrivals and
worker states give the same grants through both; on the virtual clock, bands go in order and tenants share a
band; a replay under overload queues and sheds as the routing config says, the same every time."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import zlib

import pytest

from gateway.fleet.fleet_state import FleetBook, FleetIdentity
from gateway.flow_control.config import BandSettings, FlowControlConfig, Slo
from gateway.flow_control.dispatcher import Dispatcher, queued_bytes
from gateway.flow_control.stage import FlowControl
from gateway.metrics import GatewayMetrics
from gateway.request import Tenant
from gateway.routing.kv_index import KVIndex
from gateway.routing.router import RouteRequest, make_policy
from kvroute.hashing import block_hashes
from launch.cli import main
from sim import FleetConfig, FleetSim, SimRequest
from sim.gateway import SimGateway, ViewTiming
from sim.replay import ReplayConfig, simulate
from sim.traces import Trace, TraceError, TraceRequest, read_mooncake
from worker.sim_runner import SimCostModel

IDENTITY = FleetIdentity("sim", 16, "sim", "sim")
WORKERS = ("a", "b")
# (name, tenant, band): a flood from one tenant, a quieter one, then two urgent requests
ARRIVALS = [(f"flood-{i}", "flood", 1) for i in range(6)] + [("quiet-0", "quiet", 1), ("quiet-1", "quiet", 1)]
ARRIVALS += [("urgent-0", "quiet", 0), ("urgent-1", "flood", 0)]


def route(name: str, tokens: int = 64) -> RouteRequest:
    prompt = [zlib.crc32(name.encode()) % 100_000 + i for i in range(tokens)]
    return RouteRequest(name, block_hashes(prompt, model_id="sim", block_size=16), tokens)


def saturated(fleet: FleetBook) -> FleetBook:
    for name in WORKERS:
        fleet.report_load(name, 1, 1, 2, 0.5, 100)  # two waiting: not dispatchable
    return fleet


# worker states after the arrivals, one at a time: each frees room for some grants
FREED = [("a", 1, 0, 0.2), ("b", 1, 1, 0.2), ("a", 2, 0, 0.3), ("b", 1, 0, 0.1), ("a", 0, 0, 0.0), ("b", 0, 0, 0.0)]


def test_the_simulated_gateway_and_the_live_one_grant_the_same_requests_to_the_same_workers_in_the_same_order():
    """The sim's SimGateway and the gateway's asyncio FlowControl both run one Dispatcher class: fed the same
    arrivals and the same load reports (each grant sent before the next), they grant the same requests, in the
    same order, to the same workers, for the same reasons."""
    config = FlowControlConfig(max_worker_waiting=2)

    def simulated() -> list[tuple[str, str, str]]:
        policy = make_policy("kv_aware")
        gateway = SimGateway(WORKERS, policy, IDENTITY, ViewTiming(), KVIndex(WORKERS), 100, config, lambda: 0.0)
        assert type(gateway.flow) is Dispatcher
        fleet = saturated(gateway.book)
        for i, (name, tenant, band) in enumerate(ARRIVALS):
            gateway.admit(i, route(name), tenant, 1.0, band, 32)
        order = []
        for worker, running, waiting, usage in FREED:
            fleet.report_load(worker, 1, running, waiting, usage, 100)
            gateway.flow.dispatch()
            for settled in gateway.settled:
                assert settled.grant is not None and settled.grant.decision is not None
                settled.grant.sent()
                order.append((ARRIVALS[settled.index][0], settled.grant.decision.replica, settled.reason))
            gateway.settled.clear()
        return order

    async def live() -> list[tuple[str, str, str]]:
        fleet = FleetBook(IDENTITY)
        for name in WORKERS:
            fleet.admit(name, name, 1, "sim", 16, 1 << 30, "sim", "sim")
        saturated(fleet)
        policy = make_policy("kv_aware")
        flow = FlowControl(config, lambda: fleet.fleet, policy.pick, tuple, GatewayMetrics("sim"), 16)
        assert type(flow.dispatcher) is Dispatcher
        order: list[tuple[str, str, str]] = []

        async def one(name: str, tenant: str, band: int) -> None:
            request = route(name)
            size = queued_bytes(0, request.num_tokens, len(request.block_hashes))
            grant = await flow.admit(request, Tenant(tenant, ""), band, 32, size)
            assert grant.decision is not None
            grant.sent()
            order.append((name, grant.decision.replica, grant.reason))

        tasks = []
        for arrival in ARRIVALS:
            tasks.append(asyncio.ensure_future(one(*arrival)))
            await asyncio.sleep(0)
        for worker, running, waiting, usage in FREED:
            fleet.report_load(worker, 1, running, waiting, usage, 100)
            flow.kick()
            for _ in range(3):
                await asyncio.sleep(0)
        await asyncio.gather(*tasks)
        await flow.close()
        return order

    expected = simulated()
    assert len(expected) == len(ARRIVALS)
    assert [name for name, _, _ in expected[:2]] == ["urgent-0", "urgent-1"]
    assert asyncio.run(live()) == expected


def fleet_requests(spec: list[tuple[float, str, int]], tokens: int = 64, max_tokens: int = 20) -> list[SimRequest]:
    """(arrival, tenant, band) each: a prompt of its own, `max_tokens` decoded."""
    out = []
    for i, (at, tenant, band) in enumerate(spec):
        prompt = [100_000 * (i + 1) + t for t in range(tokens)]
        out.append(SimRequest(at, lambda p=prompt: list(p), tokens, max_tokens, tenant=tenant, band=band))
    return out


def test_on_the_virtual_clock_the_urgent_band_goes_first_and_a_flood_does_not_starve_a_quiet_tenant():
    """One replica of 30 blocks (a request needs 4 prompt blocks and 2 of decode reserve): the gateway holds what
    it cannot admit. Of the requests that waited, the urgent band's (arrived last) go first, and the quiet
    tenant's two are not sent behind the flood's: fair share by tokens within the band."""
    spec = [(0.0, "flood", 1)] * 12 + [(0.001, "quiet", 1)] * 2 + [(0.002, "quiet", 0)] * 2
    config = FleetConfig(
        ("a",), 30, 16, cost=SimCostModel(100.0, 10.0), flow_control=FlowControlConfig(max_worker_waiting=1)
    )
    run = FleetSim(config, [make_policy("kv_aware")]).run(fleet_requests(spec))
    assert not any(run.shed) and all(f > 0 for f in run.finish_s)
    sent_at = [r.arrival_s + w for r, w in zip(fleet_requests(spec), run.gateway_wait_s, strict=True)]
    waited = sorted(
        (i for i, reason in enumerate(run.dispatch_reasons) if reason != "immediate"), key=sent_at.__getitem__
    )
    assert len(waited) >= 10
    assert waited[:2] == [14, 15]  # band 0
    band_1 = [i for i in waited if spec[i][2] == 1]
    assert band_1.index(12) <= 2 and band_1.index(13) <= 4  # the quiet tenant's, among the flood's
    assert set(run.dispatch_reasons) <= {"immediate", "fair_share", "cache_aware", "deadline"}


def overload_trace() -> Trace:
    """A burst twice what two replicas hold: 10 interactive requests (band 0) among 40 batch ones (band 1)."""
    requests = []
    for i in range(50):
        band = 0 if i % 5 == 0 else 1
        tokens = tuple(range(1000 * i, 1000 * i + 96))
        requests.append(
            TraceRequest(i * 4.0, 96, 30, token_ids=tokens, tenant="a" if i % 2 else "b", band=band)
        )  # fmt: skip
    return Trace("overload", "tokens", 16, tuple(requests))


SETTINGS = FlowControlConfig(
    max_worker_waiting=1,
    bands={0: BandSettings(max_wait_s=5.0, slo=Slo(ttft_s=1.0)), 1: BandSettings(max_wait_s=0.25)},
)


def test_a_replay_under_overload_queues_and_sheds_as_the_routing_config_says_and_the_same_every_time():
    config = ReplayConfig(
        replicas=2, policies=("kv_aware",), capacity_blocks=40, prefill_us_per_token=100.0, decode_ms_per_step=10.0,
        flow_control=True, flow_settings=SETTINGS,
    )  # fmt: skip
    trace = overload_trace()
    _, result = simulate(trace, "kv_aware", config)
    interactive, batch = result.bands[0], result.bands[1]
    assert (interactive.requests, batch.requests) == (10, 40)
    assert interactive.sheds == {} and interactive.goodput == 1.0 and interactive.ttft_ms["p99"] <= 1000
    assert set(batch.sheds) == {"max_wait"} and 0 < sum(batch.sheds.values()) < 40
    assert batch.served + sum(batch.sheds.values()) == 40 and batch.gateway_wait_ms["p99"] <= 250
    assert {result.status_of[i] for i, shed in enumerate(result.shed_of) if shed} == {503}
    assert sum(interactive.dispatches.values()) == 10
    assert simulate(trace, "kv_aware", config)[1].to_json() == result.to_json()  # deterministic
    # flow control off: nothing waits in the gateway or is shed; every request goes to a replica at once
    _, off = simulate(trace, "kv_aware", dataclasses.replace(config, flow_control=False))
    assert not any(off.shed_of) and off.bands[1].served == 40 and off.bands[0].dispatches == {}
    assert off.bands[0].goodput < interactive.goodput


def test_kvroute_replay_takes_the_gateways_flag_and_the_routing_configs_flow_control(tmp_path, capsys):
    """`--flow-control on --routing-config PATH`: the config's `flow_control` read as the gateway reads it, a line
    per policy and band in the table and `bands` in the JSON; a bad config is an error naming the field."""
    routing = tmp_path / "routing.json"
    routing.write_text(json.dumps({"epsilon": 0.5, "flow_control": {"bands": {"0": {"slo": {"ttft_s": 0.5}}}}}))
    out = tmp_path / "r.json"
    args = ["replay", "synthetic:multiturn", "--requests", "40", "--replicas", "2", "--capacity-blocks", "300",
            "--policies", "kv_aware", "--prefill-us-per-token", "100", "--decode-ms-per-step", "10"]  # fmt: skip
    assert main([*args, "--flow-control", "on", "--routing-config", str(routing), "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "per band (flow control on):" in table and "kv_aware priority 0: 40 requests, goodput" in table
    data = json.loads(out.read_text())
    band = data["policies"]["kv_aware"]["bands"]["0"]
    assert data["flow_control"] is True and band["requests"] == 40 and 0 <= band["goodput"] <= 1
    assert sum(band["dispatches"].values()) + sum(band["sheds"].values()) == 40
    routing.write_text(json.dumps({"flow_control": {"bands": {"0": {"max_wait_s": -1}}}}))
    assert main([*args, "--flow-control", "on", "--routing-config", str(routing)]) == 2
    assert "flow_control.bands.0.max_wait_s must be a positive number" in capsys.readouterr().err


def test_a_mooncake_trace_may_name_each_requests_tenant_weight_and_priority(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 0, "input_length": 600, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 1, "input_length": 600, "output_length": 5, "hash_ids": [1, 3], "tenant": "b", "weight": 2,
         "priority": -3},
    ]  # fmt: skip
    path.write_text("\n".join(json.dumps(line) for line in lines))
    first, second = read_mooncake(path).requests
    assert (first.tenant, first.weight, first.band) == ("default", 1.0, 0)
    assert (second.tenant, second.weight, second.band) == ("b", 2.0, -3)
    for bad, message in (
        ({"tenant": ""}, "field 'tenant' must be a non-empty string"),
        ({"weight": 0}, "field 'weight' must be a number > 0"),
        ({"priority": 1.5}, "field 'priority' must be an integer"),
        ({"priority": 10**7}, "field 'priority' must be an integer in"),
    ):
        path.write_text(json.dumps({**lines[0], **bad}))
        with pytest.raises(TraceError, match=f"line 1: {message}"):
            read_mooncake(path)
