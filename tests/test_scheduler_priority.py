"""The worker's priority scheduling (worker/scheduler.py, "Priority"; vLLM's `--scheduling-policy priority`):
waiting requests by (priority, arrival); a more urgent request that does not fit preempts the least urgent
running ones, newest first, and never an equal or more urgent one; fcfs ignores priorities. The block-pool
invariants are checked after every step. Then the signal a worker reports for it (`priority_loads`), the gateway's
saturation rule that reads it, and a request's priority reaching a real worker through a real gateway."""

from __future__ import annotations

import functools
import random

import grpc
import pytest

from gateway.admission.auth import Authenticator, key_sha256
from gateway.admission.limits import Limits
from gateway.errors import InvalidRequestError
from gateway.fleet.embedded_fleet import EmbeddedFleetState
from gateway.fleet.fleet_state import BookkeepingFleetState, FleetIdentity
from gateway.fleet.redis_fleet import RedisFleetState
from gateway.flow_control.config import FlowControlConfig
from gateway.flow_control.saturation import dispatchable
from gateway.frontdoors.grpc_server import worker_request_to_gateway
from gateway.frontdoors.openai_protocol import RequestHeaders
from gateway.metrics import GatewayMetrics
from gateway.request import GatewayRequest
from gateway.request_path import RequestPath, fleet_identity
from gateway.routing.fleet_view import PriorityShare, ReplicaLoad
from gateway.routing.router import make_policy
from kvroute.fleet_keys import WorkerRecord, pack_priority_loads, unpack_priority_loads
from kvroute.hashing import BlockHasher
from kvroute.sampling import SamplingParams
from proto import worker_pb2, worker_pb2_grpc
from tests.test_gateway_e2e import SYSTEM, run, until
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.kv_cache_manager import KVCacheManager
from worker.reporter import reporter_for_server
from worker.scheduler import MAX_PRIORITY_LOADS, PriorityLoad, Scheduler, SchedulerOutput
from worker.sequence import Sequence, SequenceStatus
from worker.service import start_worker_server

BS = 16


def scheduler(policy: str = "priority", num_blocks: int = 20, max_num_seqs: int = 64, reserve: int = 0) -> Scheduler:
    config = EngineConfig(
        model="sim", num_kv_blocks=num_blocks, max_num_seqs=max_num_seqs, watermark=0.0,
        decode_reserve_tokens=reserve, scheduling_policy=policy,
    )  # fmt: skip
    return Scheduler(config, KVCacheManager(num_blocks, BS))


def sequence(name: str, prompt: list[int] | int, priority: int = 0, max_tokens: int = 3) -> Sequence:
    tokens = prompt if isinstance(prompt, list) else [random.Random(name).randrange(1, 30000) for _ in range(prompt)]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Sequence(name, tokens, params, BlockHasher("test"), priority=priority)


def step(s: Scheduler) -> SchedulerOutput:
    out = s.schedule()
    n = len(out.sampling)
    s.update(out, [7] * n, [0.0] * n)
    s.check_invariants()
    return out


def admission_order(s: Scheduler, seqs: list[Sequence]) -> list[str]:
    for seq in seqs:
        s.add(seq)
    order: list[str] = []
    while s.has_unfinished():
        step(s)
        order += [q.request_id for q in s.running if q.request_id not in order]
    return order


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_waiting_requests_are_admitted_by_priority_then_arrival(policy: str) -> None:
    seqs = [sequence("a1", 40, 1), sequence("b0", 40, 0), sequence("c1", 40, 1), sequence("d0", 40, 0)]
    order = admission_order(scheduler(policy, max_num_seqs=1), seqs)
    assert order == (["b0", "d0", "a1", "c1"] if policy == "priority" else ["a1", "b0", "c1", "d0"])


def fill(s: Scheduler) -> dict[str, Sequence]:
    """16 of the 20 blocks held: e (priority 0), m (1), then l1 and l2 (2), 4 blocks each, all decoding."""
    seqs = {q.request_id: q for q in (sequence("l1", 60, 2, 50), sequence("l2", 60, 2, 50))}
    seqs |= {q.request_id: q for q in (sequence("m", 60, 1, 50), sequence("e", 60, 0, 50))}
    for seq in seqs.values():
        s.add(seq)
    step(s)
    assert len(s.running) == 4 and s.kv.num_free_blocks == 4
    return seqs


def test_a_more_urgent_request_that_does_not_fit_preempts_the_least_urgent_newest_first() -> None:
    s = scheduler()
    seqs = fill(s)
    urgent = sequence("u", 100, 0)  # 7 blocks: 3 more than are free, so one victim of 4 blocks is enough
    s.add(urgent)
    out = step(s)
    assert [v.request_id for v in out.preempted] == ["l2"]
    assert urgent.status is SequenceStatus.RUNNING
    assert [q.request_id for q in s.running] == ["e", "m", "l1", "u"]  # in admission order
    assert seqs["l2"].status is SequenceStatus.WAITING and s.waiting[0] is seqs["l2"]
    assert s.num_preemptions == 1
    bigger = sequence("v", 140, 0)  # 9 blocks, 1 free: only l1 and m together make room, least urgent first
    s.add(bigger)
    out = step(s)
    assert {v.request_id for v in out.preempted} == {"l1", "m"}
    assert [q.request_id for q in s.running] == ["e", "u", "v"]
    assert [q.request_id for q in s.waiting] == ["m", "l1", "l2"]  # by (priority, arrival)


def test_an_equal_or_more_urgent_request_never_preempts_for_admission() -> None:
    s = scheduler()
    fill(s)
    s.add(sequence("u", 100, 1))  # as urgent as m: may take only l1 / l2's blocks, and it needs 7
    out = step(s)
    assert [v.request_id for v in out.preempted] == ["l2"]
    s2 = scheduler()
    fill(s2)
    for name, priority in (("same", 2), ("less", 5)):  # as urgent as the least urgent running, and less
        s2.add(sequence(name, 100, priority))
    for _ in range(3):
        assert not step(s2).preempted
    assert s2.num_preemptions == 0 and [q.request_id for q in s2.waiting] == ["same", "less"]


def test_a_request_over_max_num_seqs_preempts_a_less_urgent_one() -> None:
    s = scheduler(max_num_seqs=2)
    background = [sequence("b1", 20, 1, 50), sequence("b2", 20, 1, 50)]
    for seq in background:
        s.add(seq)
    step(s)
    s.add(sequence("u", 20, 0))
    out = step(s)
    assert [v.request_id for v in out.preempted] == ["b2"]
    assert [q.request_id for q in s.running] == ["b1", "u"]


def test_under_fcfs_the_same_request_waits_and_nothing_is_preempted() -> None:
    s = scheduler("fcfs")
    fill(s)
    s.add(sequence("u", 100, -5))
    for _ in range(3):
        assert not step(s).preempted
    assert s.waiting[0].request_id == "u" and s.num_preemptions == 0
    assert s.priority_loads() == {}


def schedule_trace(policy: str, priorities: list[int]) -> list[list[tuple[str, int]]]:
    s = scheduler(policy, num_blocks=24, reserve=8)
    rng = random.Random(1)
    pending = [sequence(f"r{i}", rng.randrange(20, 120), p, rng.randrange(1, 40)) for i, p in enumerate(priorities)]
    trace = []
    while pending or s.has_unfinished():
        if pending and rng.random() < 0.5:
            s.add(pending.pop(0))
        if s.has_unfinished():
            out = step(s)
            trace.append([(q.seq.request_id, q.num_new_tokens) for q in out.seqs])
    return trace


def test_fcfs_ignores_priorities() -> None:
    rng = random.Random(0)
    mixed = [rng.randrange(-3, 4) for _ in range(40)]
    assert schedule_trace("fcfs", mixed) == schedule_trace("fcfs", [0] * 40)
    assert schedule_trace("priority", mixed) != schedule_trace("fcfs", mixed)


def test_under_load_and_aborts_the_books_hold_and_only_the_least_urgent_are_preempted() -> None:
    """Shared prefixes, a small pool, random priorities, arrivals and aborts: after every step the pool's books
    hold (Scheduler.check_invariants), and whatever a step preempted is no more urgent than anything still
    running after it."""
    rng = random.Random(3)
    s = scheduler(num_blocks=40, max_num_seqs=6, reserve=16)
    shared = [rng.randrange(1, 30000) for _ in range(48)]
    live: list[Sequence] = []
    for i in range(300):
        if rng.random() < 0.4:
            prompt = shared[: rng.choice((0, 16, 48))] + [rng.randrange(1, 30000) for _ in range(rng.randrange(8, 200))]
            seq = sequence(f"r{i}", prompt, rng.randrange(0, 4), rng.randrange(1, 120))
            s.add(seq)
            live.append(seq)
        if live and rng.random() < 0.05:
            s.abort(live.pop(rng.randrange(len(live))).request_id)
            s.check_invariants()
        if s.has_unfinished():
            out = step(s)
            if out.preempted:
                assert min(v.priority for v in out.preempted) >= max((q.priority for q in s.running), default=0)
        live = [q for q in live if not q.is_finished]
    while s.has_unfinished():
        step(s)
    assert s.num_preemptions > 0, "the pool is small enough to preempt"
    assert s.kv.pool.num_used_blocks == 0


def test_priority_loads_count_each_block_once_at_its_most_urgent_holder() -> None:
    s = scheduler(num_blocks=40)
    shared = list(range(1, 33))  # two full blocks both sequences share
    first = sequence("first", shared + [100] * 20, 2, 50)
    s.add(first)
    step(s)
    second = sequence("second", shared + [200] * 20, 0, 50)
    s.add(second)
    step(s)
    s.add(sequence("waits", 30 * BS, 3))
    assert s.priority_loads() == {0: PriorityLoad(4, 0), 2: PriorityLoad(2, 0), 3: PriorityLoad(0, 1)}
    many = scheduler(num_blocks=64)
    for p in range(MAX_PRIORITY_LOADS + 2):
        many.add(sequence(f"p{p}", 20, p, 50))
    step(many)
    loads = many.priority_loads()
    assert list(loads) == [0, *range(3, MAX_PRIORITY_LOADS + 2)]
    assert loads[0] == PriorityLoad(6, 0) and loads[3] == PriorityLoad(2, 0)


def test_a_redis_record_carries_the_priority_loads_and_a_record_without_them_reads_as_fcfs() -> None:
    record = WorkerRecord(
        "w0", "127.0.0.1:1", 1, "m", 16, 4096, "h", "t", 5.0, "serving", 1, 2, 1, 10, 100, 0.1, 7,
        priority_loads=pack_priority_loads([(-1, 3, 0), (4, 7, 2)]),
    )  # fmt: skip
    fields = record.to_fields()
    assert WorkerRecord.from_fields(fields) == record
    assert unpack_priority_loads(record.priority_loads) == [(-1, 3, 0), (4, 7, 2)]
    del fields["priority_loads"]
    assert WorkerRecord.from_fields(fields).priority_loads == ""
    for bad in ("1:2", "a:1:2", "1:-2:0", ",".join(["0:1:1"] * (MAX_PRIORITY_LOADS + 1))):
        with pytest.raises(ValueError, match="priority_loads"):
            WorkerRecord.from_fields({**fields, "priority_loads": bad})


def test_saturation_counts_the_blocks_a_more_urgent_request_can_reclaim() -> None:
    config = FlowControlConfig(max_worker_waiting=2, max_worker_staged=0)
    # 100 blocks, 90 held: 60 of them by priority-5 requests, 30 by priority-0 ones; two priority-5 waiting
    shares = (PriorityShare(0, 30, 0), PriorityShare(5, 60, 2))
    load = ReplicaLoad(in_flight=6, queued=2, kv_usage=0.9, num_blocks=100, busy_reported=6, priorities=shares)
    assert dispatchable(load, 0, 0, 0, 50, config, priority=0)
    assert not dispatchable(load, 0, 0, 0, 80, config, priority=0)
    assert not dispatchable(load, 0, 0, 0, 50, config, priority=5)  # equal: nothing to reclaim, two wait ahead
    assert not dispatchable(load, 0, 0, 0, 50, config)  # no priority: counted as on a fcfs worker
    assert not dispatchable(load, 0, 30, 0, 50, config, priority=0)  # this gateway's grants not yet reported
    fcfs = ReplicaLoad(in_flight=6, queued=0, kv_usage=0.9, num_blocks=100, busy_reported=6)
    assert not dispatchable(fcfs, 0, 0, 0, 50, config, priority=0)


def test_a_routed_worker_generate_takes_its_priority_field_and_the_header_wins() -> None:
    msg = worker_pb2.GenerateRequest(prompt_token_ids=[1, 2], priority=-4)
    assert worker_request_to_gateway(msg, RequestHeaders()).priority == -4
    assert worker_request_to_gateway(msg, RequestHeaders(priority=2)).priority == 2
    assert (
        worker_request_to_gateway(worker_pb2.GenerateRequest(prompt_token_ids=[1]), RequestHeaders()).priority is None
    )
    with pytest.raises(InvalidRequestError) as refused:
        worker_request_to_gateway(worker_pb2.GenerateRequest(prompt_token_ids=[1], priority=2**30), RequestHeaders())
    assert refused.value.param == "priority"


def test_a_requests_effective_priority_reaches_the_worker_and_comes_back_in_its_load() -> None:
    """A real gateway path over a real sim worker scheduling by priority: a request's body priority (clamped by
    its tenant: one whose ceiling is 3 asking for 1 runs at 3) is what the worker runs it at, as its GetStats
    shows the gateway's fleet view."""

    async def body() -> None:
        engine = LLMEngine(
            EngineConfig(model="sim", num_kv_blocks=128, max_model_len=4096, scheduling_policy="priority",
                         sim_prefill_us_per_token=1.0, sim_decode_ms_per_step=5.0)
        )  # fmt: skip
        server = await start_worker_server(engine, port=0, worker_id="w0")
        state = EmbeddedFleetState(
            [f"127.0.0.1:{server.port}"], fleet_identity(engine.model_id, engine.tokenizer), poll_interval=0.05
        )
        await state.start()
        tenants = [{"tenant": "t", "key_sha256": key_sha256("key-t"), "priority": 3}]
        path = RequestPath(
            state, make_policy("kv_aware"), engine.tokenizer, engine.model_id, "sim", Authenticator(tenants),
            Limits(), GatewayMetrics("sim"), flow_control=FlowControlConfig(),
        )  # fmt: skip

        def worker_shows(priority: int) -> bool:
            return [share.priority for share in state.view().loads["w0"].priorities] == [priority]

        try:
            await until(lambda: len(state.view().replicas) == 1)
            for asked, runs_at in ((7, 7), (1, 3), (None, 3)):
                request = GatewayRequest(
                    api_key="key-t", model=None, kind="chat", priority=asked,
                    messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": str(asked)}],
                    params=SamplingParams(max_tokens=400, temperature=0.0),
                )  # fmt: skip
                generation = await path.generate(request)
                assert [q.priority for q in engine.scheduler.running] == [runs_at]
                await until(functools.partial(worker_shows, runs_at))
                await generation.aclose()
                await until(lambda: not engine.scheduler.running)
        finally:
            await state.stop()
            await path.close()
            await server.stop(drain_timeout=0)

    run(body)


@pytest.mark.parametrize("kind", ["embedded", "redis"])
def test_a_worker_reports_what_each_priority_holds_through_either_fleet_state(kind: str, redis_server) -> None:
    """A worker's own gRPC door takes `priority`, and its load report (GetStats, or its Redis record) carries what
    that priority holds to a gateway's fleet view."""

    async def body() -> None:
        config = EngineConfig(
            model="sim", num_kv_blocks=64, max_model_len=256, scheduling_policy="priority", sim_decode_ms_per_step=5.0
        )
        engine = LLMEngine(config)
        server = await start_worker_server(engine, port=0, worker_id="w0")
        reporter = None
        if kind == "redis":
            reporter = reporter_for_server(
                server, redis_server.url, heartbeat_interval=0.1, heartbeat_ttl=0.6, publish_interval=0.02
            )
            await reporter.start()
        info = server.servicer.info
        identity = FleetIdentity(info.model_id, info.block_size, info.hash_fingerprint, info.tokenizer_fingerprint)
        address = f"127.0.0.1:{server.port}"
        state: BookkeepingFleetState = (
            EmbeddedFleetState([address], identity, poll_interval=0.05)
            if kind == "embedded"
            else RedisFleetState(redis_server.url, identity, poll_interval=0.05)
        )
        await state.start()
        channel = grpc.aio.insecure_channel(address)

        def reported() -> tuple[PriorityShare, ...]:
            load = state.view().loads.get("w0")
            return load.priorities if load is not None else ()

        try:
            request = worker_pb2.GenerateRequest(
                prompt_token_ids=list(range(1, 100)), priority=-2, sampling=worker_pb2.SamplingParams(max_tokens=150)
            )
            call = worker_pb2_grpc.WorkerStub(channel).Generate(request)
            await call.read()
            await until(lambda: [share.priority for share in reported()] == [-2])
            assert reported()[0].running_blocks >= 7 and reported()[0].waiting == 0  # 99 prompt tokens and more
            call.cancel()
            await until(lambda: reported() == ())
        finally:
            await channel.close()
            await state.stop()
            if reporter is not None:
                await reporter.stop()
            await server.stop(drain_timeout=0)

    run(body)
