"""Flow control in the request path, on real `sim` workers (real gRPC servers, engines and block managers), the
real embedded fleet state and the real RequestPath: band order, fair share under a flood, a client that leaves
while queued, bounds and sheds with Retry-After, drain with requests queued, a worker lost while requests wait,
and flow control off sending every request at once.

The workers hold 128 blocks of 16 tokens and every prompt here is distinct and about 1,300 tokens (81 blocks):
a worker has room for one request at a time, so the order in which requests reach it is the stage's."""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from gateway.admission.auth import Authenticator, key_sha256
from gateway.admission.limits import Limits
from gateway.cli_gateway import Gateway, pool_configs, reload
from gateway.errors import NoWorkerAvailable, RateLimited
from gateway.fleet.embedded_fleet import EmbeddedFleetState
from gateway.flow_control.config import BandSettings, FlowControlConfig, Slo
from gateway.frontdoors.ext_proc import EndpointMap, Picker
from gateway.frontdoors.http_protocol import HttpLimits
from gateway.metrics import GatewayMetrics
from gateway.pools import Pools
from gateway.request import GatewayRequest, Generation
from gateway.request_path import RequestPath, fleet_identity
from gateway.routing.router import make_policy
from kvroute.sampling import SamplingParams
from tests.test_gateway_e2e import SYSTEM, complete, run, until
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.service import WorkerServer, start_worker_server

NUM_BLOCKS = 128
KEYS = {"alpha": "key-alpha", "beta": "key-beta"}
# Room only: every request waits in the gateway until its worker's report shows room, so the order in which
# requests reach the one worker is the stage's (staging one in the worker is tested on its own).
DEFAULTS = FlowControlConfig(max_worker_staged=0)


@dataclass
class Fleet:
    servers: list[WorkerServer]
    state: EmbeddedFleetState
    path: RequestPath
    metrics: GatewayMetrics

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


@asynccontextmanager
async def fleet(
    num_workers: int = 1, flow: FlowControlConfig | None = DEFAULTS, decode_ms: float = 2.0
) -> AsyncIterator[Fleet]:
    engines = [
        LLMEngine(
            EngineConfig(
                model="sim",
                num_kv_blocks=NUM_BLOCKS,
                max_model_len=4096,
                sim_prefill_us_per_token=1.0,
                sim_decode_ms_per_step=decode_ms,
            )
        )  # fmt: skip
        for _ in range(num_workers)
    ]
    servers = [await start_worker_server(e, port=0, worker_id=f"w{i}") for i, e in enumerate(engines)]
    state = EmbeddedFleetState(
        [f"127.0.0.1:{s.port}" for s in servers],
        fleet_identity(engines[0].model_id, engines[0].tokenizer),
        poll_interval=0.05,
        unreachable_after=1.0,
    )
    await state.start()
    auth = Authenticator([{"tenant": t, "key_sha256": key_sha256(k)} for t, k in KEYS.items()])
    metrics = GatewayMetrics("sim")
    path = RequestPath(
        state, make_policy("kv_aware"), engines[0].tokenizer, engines[0].model_id, "sim", auth,
        Limits(), metrics, flow_control=flow,
    )  # fmt: skip
    await until(lambda: len(state.view().replicas) == num_workers)
    try:
        yield Fleet(servers, state, path, metrics)
    finally:
        await state.stop()
        await path.close()
        for server in servers:
            await server.stop(drain_timeout=0)


def ask(
    name: str, tenant: str = "alpha", max_tokens: int = 8, priority: int | None = None, user: str = "hello"
) -> GatewayRequest:
    """A chat of its own long prompt (no prefix shared with another `name`'s)."""
    messages = [{"role": "system", "content": f"{name}: {SYSTEM}"}, {"role": "user", "content": user}]
    return GatewayRequest(
        api_key=KEYS[tenant], model=None, messages=messages, kind="chat", priority=priority,
        params=SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )  # fmt: skip


async def served_in_order(f: Fleet, requests: list[tuple[str, GatewayRequest]]) -> list[str]:
    """Queue `requests` one after another behind a blocker on the one worker; the order they start in."""
    started: list[str] = []

    async def one(name: str, request: GatewayRequest) -> None:
        generation = await f.path.generate(request)
        started.append(name)
        await complete(generation)

    blocker = await f.path.generate(ask("blocker", max_tokens=250))
    tasks = []
    for name, request in requests:
        tasks.append(asyncio.ensure_future(one(name, request)))
        await until(lambda: len(f.path.flow.queue) == len(tasks))  # type: ignore[union-attr]
    await complete(blocker)
    await asyncio.gather(*tasks)
    return started


def test_a_more_urgent_band_goes_first_and_each_band_in_arrival_order() -> None:
    async def body() -> None:
        async with fleet() as f:
            requests = [(f"batch-{i}", ask(f"batch-{i}", priority=10)) for i in range(3)]
            requests += [(f"urgent-{i}", ask(f"urgent-{i}", priority=0)) for i in range(2)]
            order = await served_in_order(f, requests)
            assert order == ["urgent-0", "urgent-1", "batch-0", "batch-1", "batch-2"]
            assert f.sample("kvroute:gateway_flow_dispatches_total", band="10", reason="fair_share") == 3
            assert f.sample("kvroute:gateway_flow_queue_wait_seconds_count", band="0") == 3  # the blocker too
            assert f.sample("kvroute:gateway_flow_queue_depth", band="10") == 0

    run(body)


def test_a_flood_from_one_tenant_does_not_hold_back_another() -> None:
    async def body() -> None:
        async with fleet() as f:
            requests = [(f"alpha-{i}", ask(f"alpha-{i}")) for i in range(6)]
            requests += [(f"beta-{i}", ask(f"beta-{i}", tenant="beta")) for i in range(2)]
            order = await served_in_order(f, requests)
            # equal weights and costs: beta's two alternate with alpha's flood from its arrival
            assert order.index("beta-0") <= 1 and order.index("beta-1") <= 3, order
            assert [n for n in order if n.startswith("alpha")] == [f"alpha-{i}" for i in range(6)]

    run(body)


def test_a_worker_that_frees_room_takes_first_the_waiting_request_whose_prefix_it_holds() -> None:
    async def body() -> None:
        # a decode reserve that a busy worker cannot give: the waiting requests need a worker's room even on a hit
        # slow decoding: the blockers outlast the queued requests' tokenizing on a loaded machine
        async with fleet(
            2, flow=FlowControlConfig(decode_reserve_tokens=2048, max_worker_staged=0), decode_ms=4.0
        ) as f:
            short = await f.path.generate(ask("prefix-a", max_tokens=150, user="first"))
            long = await f.path.generate(ask("prefix-b", max_tokens=400, user="first"))
            holder, other = short.route.worker_id, long.route.worker_id
            assert holder != other
            started: dict[str, Generation] = {}

            async def start(name: str) -> None:
                request = ask(name, max_tokens=800, user="second")
                started[name] = await f.path.generate(request)  # held open: its worker stays busy

            # the fair-share head shares no prefix with the worker that frees room first; the younger one does
            tasks = [asyncio.ensure_future(start("prefix-b"))]
            await until(lambda: len(f.path.flow.queue) == 1)  # type: ignore[union-attr]
            tasks.append(asyncio.ensure_future(start("prefix-a")))
            await until(lambda: len(f.path.flow.queue) == 2)  # type: ignore[union-attr]
            await complete(short)
            await complete(long)
            await asyncio.gather(*tasks)
            try:
                routes = {name: (g.route.worker_id, g.route.matched_blocks >= 64) for name, g in started.items()}
                assert list(started) == ["prefix-a", "prefix-b"], routes
                assert routes == {"prefix-a": (holder, True), "prefix-b": (other, True)}
                assert f.sample("kvroute:gateway_flow_dispatches_total", band="0", reason="cache_aware") == 1
            finally:
                for generation in started.values():
                    await generation.aclose()

    run(body)


def test_a_client_that_leaves_while_queued_frees_its_place_and_its_slot_at_once() -> None:
    async def body() -> None:
        async with fleet() as f:
            assert f.path.flow is not None
            blocker = await f.path.generate(ask("blocker", max_tokens=250))
            waiting = asyncio.ensure_future(f.path.generate(ask("leaves", tenant="beta")))
            await until(lambda: len(f.path.flow.queue) == 1)  # type: ignore[union-attr]
            assert f.path.concurrency.in_flight["beta"] == 1
            waiting.cancel()
            await asyncio.wait({waiting})
            assert len(f.path.flow.queue) == 0 and "beta" not in f.path.concurrency.in_flight
            assert f.sample("kvroute:gateway_flow_queue_depth", band="0") == 0
            assert f.state.book.in_flight("w0") == 1  # the blocker only: the one that left was never sent
            await complete(blocker)
            assert await f.path.wait_drained(2.0)

    run(body)


def test_bounds_answer_429_for_the_tenant_503_for_the_fleet_and_shed_the_least_urgent_newest_first() -> None:
    async def body() -> None:
        config = FlowControlConfig(max_queued=3, tenant_max_queued=2, max_worker_staged=0)
        async with fleet(flow=config) as f:
            assert f.path.flow is not None
            blocker = await f.path.generate(ask("blocker", max_tokens=250))
            older = asyncio.ensure_future(f.path.generate(ask("batch-old", priority=5)))
            newer = asyncio.ensure_future(f.path.generate(ask("batch-new", priority=5)))
            await until(lambda: len(f.path.flow.queue) == 2)  # type: ignore[union-attr]
            with pytest.raises(RateLimited, match="alpha.*2 requests waiting") as over_tenant:
                await f.path.generate(ask("third"))
            assert over_tenant.value.http_status == 429 and over_tenant.value.retry_after is not None
            beta = asyncio.ensure_future(f.path.generate(ask("beta-batch", tenant="beta", priority=5)))
            await until(lambda: len(f.path.flow.queue) == 3)  # type: ignore[union-attr]
            urgent = asyncio.ensure_future(f.path.generate(ask("urgent", tenant="beta", priority=0)))
            with pytest.raises(NoWorkerAvailable, match="more urgent request took its place") as shed:
                await beta  # band 5's newest
            assert shed.value.http_status == 503 and shed.value.retry_after is not None and shed.value.retry_after >= 1
            assert not older.done() and not newer.done()
            with pytest.raises(NoWorkerAvailable, match="queue is full") as full:
                await f.path.generate(ask("one-more", tenant="beta", priority=5))
            assert full.value.retry_after is not None
            assert f.sample("kvroute:gateway_flow_sheds_total", band="0", reason="tenant_limit") == 1
            assert f.sample("kvroute:gateway_flow_sheds_total", band="5", reason="displaced") == 1
            assert f.sample("kvroute:gateway_flow_sheds_total", band="5", reason="queue_full") == 1
            await complete(blocker)
            for generation in await asyncio.gather(urgent, older, newer):
                await complete(generation)

    run(body)


def test_a_request_past_its_band_max_wait_gets_a_503() -> None:
    async def body() -> None:
        config = FlowControlConfig(bands={3: BandSettings(max_wait_s=0.2)}, max_worker_staged=0)
        async with fleet(flow=config) as f:
            blocker = await f.path.generate(ask("blocker", max_tokens=200))
            with pytest.raises(NoWorkerAvailable, match="within its band's 0.2 s") as late:
                await f.path.generate(ask("hurried", priority=3))
            assert late.value.retry_after is not None
            assert f.sample("kvroute:gateway_flow_sheds_total", band="3", reason="max_wait") == 1
            await blocker.aclose()

    run(body)


def test_drain_answers_the_requests_still_queued_with_the_reason() -> None:
    async def body() -> None:
        async with fleet() as f:
            blocker = await f.path.generate(ask("blocker", max_tokens=200))
            queued = [asyncio.ensure_future(f.path.generate(ask(f"q{i}"))) for i in range(2)]
            await until(lambda: len(f.path.flow.queue) == 2)  # type: ignore[union-attr]
            f.path.start_draining()
            f.path.end_streams("the gateway is shutting down: its drain timeout (0 s) passed")
            for task in queued:
                with pytest.raises(NoWorkerAvailable, match="still waiting for a worker") as ended:
                    await task
                assert ended.value.code == "gateway_shutting_down"
            assert f.sample("kvroute:gateway_flow_sheds_total", band="0", reason="draining") == 2
            with pytest.raises(Exception):  # noqa: B017 (the blocker's stream ends too, with its own error)
                await complete(blocker)
            assert await f.path.wait_drained(2.0)

    run(body)


def test_requests_waiting_while_a_worker_is_lost_go_to_another() -> None:
    async def body() -> None:
        async with fleet(num_workers=2) as f:
            held = [await f.path.generate(ask(f"blocker-{i}", max_tokens=150)) for i in range(2)]
            assert {g.route.worker_id for g in held} == {"w0", "w1"}
            queued = [asyncio.ensure_future(f.path.generate(ask(f"q{i}"))) for i in range(2)]
            await until(lambda: len(f.path.flow.queue) == 2)  # type: ignore[union-attr]
            lost = next(g for g in held if g.route.worker_id == "w0")
            await f.servers[0].stop(drain_timeout=0)
            await until(lambda: "w0" not in f.state.view().replicas, timeout=5.0)
            with pytest.raises(Exception):  # noqa: B017 (w0's own stream ends with an error)
                await complete(lost)
            await complete(next(g for g in held if g is not lost))
            for task in queued:
                generation = await task
                assert generation.route.worker_id == "w1"
                await complete(generation)

    run(body)


def test_two_gateways_on_one_worker_share_it_and_neither_queue_starves() -> None:
    """Two gateways, each with its own fleet state and queue, in front of one worker with room for one request at
    a time: every request of both is served, and both gateways' requests start among the first ones (neither
    waits for the other's queue to empty); the worker never queues more than the two gateways' bounds allow."""

    async def body() -> None:
        async with fleet() as f:
            other_state = EmbeddedFleetState(
                [f"127.0.0.1:{s.port}" for s in f.servers], fleet_identity(f.path.model_id, f.path.tokenizer),
                poll_interval=0.05, unreachable_after=1.0,
            )  # fmt: skip
            await other_state.start()
            other = RequestPath(
                other_state, make_policy("kv_aware"), f.path.tokenizer, f.path.model_id, "sim",
                f.path.auth, Limits(), GatewayMetrics("sim"), flow_control=DEFAULTS,
            )  # fmt: skip
            await until(lambda: len(other_state.view().replicas) == 1)
            started: list[str] = []
            worker_waiting: list[int] = []

            async def one(path: RequestPath, name: str) -> None:
                generation = await path.generate(ask(name))
                started.append(name)
                await complete(generation)

            try:
                blocker = await f.path.generate(ask("blocker", max_tokens=250))
                await until(lambda: other_state.view().loads["w0"].in_flight > 0)
                tasks = [
                    asyncio.ensure_future(one(path, f"{gw}{i}"))
                    for i in range(4)
                    for gw, path in (("a", f.path), ("b", other))
                ]
                await until(lambda: len(f.path.flow.queue) == 4 and len(other.flow.queue) == 4)  # type: ignore[union-attr]
                engine = f.servers[0].engine.engine
                watcher = asyncio.ensure_future(_watch_waiting(engine, worker_waiting))
                await complete(blocker)
                await asyncio.gather(*tasks)
                watcher.cancel()
            finally:
                await other_state.stop()
                await other.close()
            assert sorted(started) == sorted(f"{gw}{i}" for i in range(4) for gw in "ab")
            first_half = started[:4]
            assert any(n.startswith("a") for n in first_half) and any(n.startswith("b") for n in first_half), started
            # each gateway grants while the worker's waiting count is under max_worker_waiting (2) as it last saw it
            assert max(worker_waiting) <= 2 * DEFAULTS.max_worker_waiting, worker_waiting

    run(body)


async def _watch_waiting(engine: LLMEngine, seen: list[int]) -> None:
    while True:
        seen.append(len(engine.scheduler.waiting))
        await asyncio.sleep(0.005)


def test_requests_are_counted_against_their_band_slo() -> None:
    async def body() -> None:
        slo = {0: BandSettings(slo=Slo(ttft_s=30.0, e2e_s=60.0)), 3: BandSettings(slo=Slo(ttft_s=1e-6))}
        async with fleet(flow=FlowControlConfig(bands=slo, max_worker_staged=0)) as f:
            for name, priority in (("kind", 0), ("kind-too", 0), ("strict", 3)):
                await complete(await f.path.generate(ask(name, priority=priority)))
            assert f.sample("kvroute:gateway_slo_requests_total", band="0", met="true") == 2
            assert f.sample("kvroute:gateway_slo_requests_total", band="3", met="false") == 1
            await complete(await f.path.generate(ask("no-slo", priority=7)))
            assert f.sample("kvroute:gateway_slo_requests_total", band="7", met="true") == 0

    run(body)


def test_flow_control_off_sends_every_request_at_once() -> None:
    async def body() -> None:
        async with fleet(flow=None) as f:
            assert f.path.flow is None
            held: list[Generation] = [await f.path.generate(ask(f"r{i}", max_tokens=60)) for i in range(3)]
            assert f.state.book.in_flight("w0") == 3  # nothing waited in the gateway
            for generation in held:
                await complete(generation)
            assert f.sample("kvroute:gateway_flow_dispatches_total", band="0", reason="immediate") == 0

    run(body)


def test_a_sighup_reload_applies_the_routing_configs_flow_control(tmp_path: Path) -> None:
    async def body() -> None:
        config = tmp_path / "routing.json"
        args = argparse.Namespace(
            routing_config=str(config), api_keys_file=None, workers="127.0.0.1:1", served_model_name=None,
            model="sim", block_size=16, policy="kv_aware", redis=None,
        )  # fmt: skip
        config.write_text(json.dumps({"flow_control": {"bands": {"0": {"max_wait_s": 5}}}}))
        configs = pool_configs(args, json.loads(config.read_text()))
        assert configs[0].options == {} and configs[0].flow_control.band(0).max_wait_s == 5
        engine = LLMEngine(EngineConfig(model="sim", num_kv_blocks=NUM_BLOCKS, max_model_len=4096))
        state = EmbeddedFleetState([], fleet_identity(engine.model_id, engine.tokenizer))
        path = RequestPath(
            state, make_policy("kv_aware"), engine.tokenizer, engine.model_id, "sim", Authenticator(), Limits(),
            GatewayMetrics("sim"), flow_control=configs[0].flow_control,
        )  # fmt: skip
        gateway = Gateway(Pools([path]), [state], 2**20, 16, HttpLimits(), configs)
        config.write_text(json.dumps({"flow_control": {"bands": {"0": {"max_wait_s": 2}}, "tenant_max_queued": 7}}))
        reload(gateway, args)
        assert path.flow is not None and path.flow.config.band(0).max_wait_s == 2
        assert path.flow.queue.config.tenant_max_queued == 7
        config.write_text(json.dumps({"flow_control": {"max_queued": -1}}))
        reload(gateway, args)  # refused: what was in force stays
        assert path.flow.config.tenant_max_queued == 7
        await path.close()

    run(body)


def test_a_hostile_tenant_cannot_grow_the_queue_past_its_bound_nor_delay_another() -> None:
    async def body() -> None:
        config = FlowControlConfig(tenant_max_queued=8, decode_reserve_tokens=2048, max_worker_staged=0)
        async with fleet(flow=config) as f:
            assert f.path.flow is not None
            blocker = await f.path.generate(ask("blocker", max_tokens=250))
            flood = [
                asyncio.ensure_future(
                    f.path.generate(
                        GatewayRequest(
                            api_key=KEYS["alpha"],
                            model=None,
                            prompt=f"flood {i}",
                            params=SamplingParams(max_tokens=800),
                        )
                    )
                )  # fmt: skip
                for i in range(100)
            ]
            deepest = 0
            while not all(task.done() for task in flood[8:]):
                deepest = max(deepest, f.path.flow.queue.tenant_depth("alpha"))
                await asyncio.sleep(0.005)
            refused = [task.exception() for task in flood[8:]]
            assert all(isinstance(e, RateLimited) and e.retry_after for e in refused), refused[:3]
            assert deepest <= 8 and f.path.flow.queue.tenant_depth("alpha") == 8
            quiet = asyncio.ensure_future(f.path.generate(ask("quiet", tenant="beta")))
            await until(lambda: f.path.flow.queue.tenant_depth("beta") == 1)  # type: ignore[union-attr]
            await complete(blocker)
            await complete(await quiet)  # fair share: ahead of most of the flood's queued requests
            assert f.path.flow.queue.tenant_depth("alpha") >= 6
            for task in flood[:8]:
                task.cancel()
            await asyncio.wait(flood[:8])
            for task in flood[:8]:  # those that started before the cancel hold a generation
                if not task.cancelled():
                    await task.result().aclose()
            assert len(f.path.flow.queue) == 0 and not f.path.concurrency.in_flight

    run(body)


def test_the_endpoint_picker_holds_a_request_in_the_same_stage_until_a_worker_can_admit_it() -> None:
    async def body() -> None:
        async with fleet() as f:
            picker = Picker(f.path, EndpointMap({"w0": "10.0.0.1:8000"}), max_body_bytes=2**20, default_max_tokens=8)
            blocker = await f.path.generate(ask("blocker", max_tokens=250))
            held = asyncio.ensure_future(picker.decide(ask("picked"), None, None))
            await until(lambda: len(f.path.flow.queue) == 1)  # type: ignore[union-attr]
            assert not held.done()
            await complete(blocker)
            pick = await held
            assert pick.endpoints[0] == "10.0.0.1:8000" and pick.grant is not None
            assert f.sample("kvroute:gateway_flow_dispatches_total", band="0", reason="fair_share") == 1
            picker.finish(pick, None, 200)
            assert not f.path.concurrency.in_flight and f.state.book.in_flight("w0") == 0

    run(body)
