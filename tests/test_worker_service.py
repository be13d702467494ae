"""The worker's gRPC service end to end: a real engine (`sim` and `tiny`) behind a real grpc.aio server on a
free port, called through the generated client stub."""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute.hashing import block_hashes, hash_fingerprint
from kvroute.sampling import SamplingParams
from launch import cli
from proto import worker_pb2, worker_pb2_grpc
from worker.async_engine import MAX_CONSECUTIVE_STEP_FAILURES, AsyncEngine, EngineDead, EngineError, EngineStopped
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.sampler import SamplerOutput
from worker.scheduler import SchedulerOutput
from worker.service import WorkerServer, start_worker_server
from worker.sim_runner import SimCostModel, SimRunner

SIM_MAX_MODEL_LEN = 256
SIM_BLOCKS = 64
TINY_BLOCKS = 10


@pytest.fixture(scope="module")
def sim_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="sim", num_kv_blocks=SIM_BLOCKS, max_model_len=SIM_MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def tiny_engine() -> LLMEngine:
    # float32: greedy tokens must not depend on how requests were batched (bf16 near-ties would flip). No decode
    # reserve: the pressure tests want admission on the prompts' blocks, and the preemptions that follow.
    config = EngineConfig(
        model="tiny", dtype="float32", num_kv_blocks=TINY_BLOCKS, max_num_batched_tokens=64, decode_reserve_tokens=0
    )
    return LLMEngine(config)


@dataclass
class Client:
    server: WorkerServer
    stub: worker_pb2_grpc.WorkerStub
    health: health_pb2_grpc.HealthStub

    async def generate(
        self, prompt: list[int], request_id: str = "", **sampling: object
    ) -> list[worker_pb2.GenerateResponse]:
        request = worker_pb2.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt, sampling=worker_pb2.SamplingParams(**sampling)
        )
        return [response async for response in self.stub.Generate(request)]

    async def stats(self) -> worker_pb2.WorkerStats:
        return await self.stub.GetStats(worker_pb2.GetStatsRequest())

    async def check_invariants(self) -> None:
        await self.server.engine.call(lambda engine: engine.check_invariants())

    async def wait_until_idle(self, timeout: float = 5.0) -> worker_pb2.WorkerStats:
        """Stats once no block is in use and nothing runs (a cancellation reaches the server asynchronously)."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            stats = await self.stats()
            idle = stats.num_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
            if idle or asyncio.get_running_loop().time() > deadline:
                return stats
            await asyncio.sleep(0.02)


@asynccontextmanager
async def serving(engine: LLMEngine, **options: Any) -> AsyncIterator[Client]:
    server = await start_worker_server(engine, port=0, **options)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield Client(server, worker_pb2_grpc.WorkerStub(channel), health_pb2_grpc.HealthStub(channel))
    finally:
        await server.stop(drain_timeout=0)


def run_with(engine: LLMEngine, body: Callable[[Client], Awaitable[None]]) -> None:
    async def main() -> None:
        async with serving(engine) as client:
            await body(client)
            assert (await client.wait_until_idle()).num_blocks_used == 0
            await client.check_invariants()

    asyncio.run(main())


async def read_rest(call: grpc.aio.UnaryStreamCall) -> list[worker_pb2.GenerateResponse]:
    """The remaining messages of a call already read with read() (grpc forbids mixing read() and async for)."""
    responses = []
    while (response := await call.read()) != grpc.aio.EOF:
        responses.append(response)
    return responses


def tokens_of(responses: list[worker_pb2.GenerateResponse]) -> list[int]:
    return [token for response in responses for token in response.token_ids]


def test_generate_streams_tokens_and_final_usage(sim_engine: LLMEngine) -> None:
    prompt = list(range(100, 140))

    async def body(client: Client) -> None:
        start_seq = (await client.stats()).kv_event_seq
        responses = await client.generate(prompt, max_tokens=6, temperature=0, logprobs=True)
        assert len(responses) >= 2, "tokens are streamed, not sent at once"
        assert all(r.finish_reason == worker_pb2.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
        last = responses[-1]
        assert last.finish_reason == worker_pb2.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (40, 6)
        assert all(len(r.logprobs) == len(r.token_ids) for r in responses)
        context = list(prompt)
        for token in tokens_of(responses):  # sim tokens are a fixed function of the context
            assert token == sim_engine.runner.next_token(context[-1], len(context))
            context.append(token)
        again = await client.generate(prompt, max_tokens=6, temperature=0)
        assert tokens_of(again) == tokens_of(responses)
        assert again[-1].usage.cached_tokens == 32, "the repeat hits the two cached full blocks"
        # The first message carries the prompt's usage too (a gateway that cancels early still knows it).
        assert (responses[0].usage.prompt_tokens, responses[0].usage.cached_tokens) == (40, 0)
        assert (again[0].usage.prompt_tokens, again[0].usage.cached_tokens) == (40, 32)
        assert not responses[1].HasField("usage"), "middle messages carry no usage"
        expected = tokens_of(responses)
        stopped = await client.generate(prompt, max_tokens=6, stop_token_ids=[expected[2]])
        assert tokens_of(stopped) == expected[:3]
        assert stopped[-1].finish_reason == worker_pb2.FINISH_REASON_STOP
        # The events since the first request are all retained: events, not a snapshot.
        batch = await client.stub.GetKVEvents(worker_pb2.GetKVEventsRequest(after_seq=start_seq))
        assert not batch.is_snapshot and batch.latest_seq == (await client.stats()).kv_event_seq
        stored = [h for e in batch.events if e.kind == worker_pb2.KVEvent.KIND_STORED for h in e.block_hashes]
        assert stored == block_hashes(prompt, model_id=sim_engine.model_id)

    run_with(sim_engine, body)


def test_info_health_and_block_hash_parity(sim_engine: LLMEngine) -> None:
    async def body(client: Client) -> None:
        info = await client.stub.GetInfo(worker_pb2.GetInfoRequest())
        assert info.model_id == sim_engine.model_id
        assert info.hash_fingerprint == hash_fingerprint(sim_engine.model_id, info.block_size)
        assert (info.max_model_len, info.vocab_size, info.num_kv_blocks) == (
            SIM_MAX_MODEL_LEN,
            sim_engine.vocab_size,
            SIM_BLOCKS,
        )
        assert info.tokenizer_fingerprint == sim_engine.tokenizer.fingerprint
        for service in ("", "kvroute.v1.Worker"):
            reply = await client.health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        prompt = list(range(50))
        hashes = block_hashes(prompt, model_id=info.model_id, cache_salt="tenant-a", block_size=info.block_size)
        request = worker_pb2.GenerateRequest(
            prompt_token_ids=prompt,
            cache_salt="tenant-a",
            block_hashes=hashes,
            sampling=worker_pb2.SamplingParams(max_tokens=2),
            trace_context={"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"},
        )
        responses = [r async for r in client.stub.Generate(request)]
        assert responses[-1].usage.completion_tokens == 2
        assert client.server.servicer._check_block_hashes(request)
        del request.block_hashes[0]
        assert not client.server.servicer._check_block_hashes(request)

    run_with(sim_engine, body)


BAD_REQUESTS = [
    # (prompt, sampling, the field the error must name)
    ([], {"max_tokens": 4}, "prompt"),
    (list(range(SIM_MAX_MODEL_LEN)), {"max_tokens": 4}, "prompt"),
    ([1, 2, 10**6], {"max_tokens": 4}, "prompt_token_ids"),
    ([1, 2, 3], {"max_tokens": 0}, "max_tokens"),
    ([1, 2, 3], {"max_tokens": -5}, "max_tokens"),
    ([1, 2, 3], {"max_tokens": SIM_MAX_MODEL_LEN}, "max_tokens"),
    ([1, 2, 3], {"temperature": -0.5}, "temperature"),
    ([1, 2, 3], {"temperature": float("nan")}, "temperature"),
    ([1, 2, 3], {"top_p": 0.0}, "top_p"),
    ([1, 2, 3], {"top_p": 1.5}, "top_p"),
    ([1, 2, 3], {"top_k": -1}, "top_k"),
]


def test_bad_input_is_invalid_argument_naming_the_field(sim_engine: LLMEngine) -> None:
    async def body(client: Client) -> None:
        healthy = asyncio.ensure_future(client.generate(list(range(20)), max_tokens=20, temperature=0))
        for prompt, sampling, field in BAD_REQUESTS:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.generate(prompt, **sampling)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (field, info.value)
            assert info.value.details().startswith(f"{field}:"), info.value.details()
        responses = await healthy
        assert responses[-1].usage.completion_tokens == 20, "a request running meanwhile is unharmed"
        assert (await client.generate([7, 8, 9], max_tokens=3))[-1].usage.completion_tokens == 3

    run_with(sim_engine, body)


def test_pool_too_small_for_request_is_invalid_argument(tiny_engine: LLMEngine) -> None:
    async def body(client: Client) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.generate([1, 2, 3], max_tokens=TINY_BLOCKS * 16)  # more blocks than the pool holds
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("max_tokens:")

    run_with(tiny_engine, body)


def test_duplicate_request_id_is_already_exists(sim_engine: LLMEngine) -> None:
    async def body(client: Client) -> None:
        first = client.stub.Generate(
            worker_pb2.GenerateRequest(
                request_id="dup", prompt_token_ids=[1, 2, 3], sampling=worker_pb2.SamplingParams(max_tokens=200)
            )
        )
        await first.read()
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.generate([4, 5, 6], request_id="dup", max_tokens=2)
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert "dup" in info.value.details()
        first.cancel()
        await client.wait_until_idle()
        assert (await client.generate([4, 5, 6], request_id="dup", max_tokens=2))[-1].usage.completion_tokens == 2

    run_with(sim_engine, body)


def test_cancelling_streams_frees_their_blocks(sim_engine: LLMEngine) -> None:
    async def body(client: Client) -> None:
        calls = []
        for i in range(4):
            prompt = [1000 + i] * (30 + 17 * i)
            sampling = worker_pb2.SamplingParams(max_tokens=150)
            request = worker_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=sampling)
            calls.append(client.stub.Generate(request))
        for i, call in enumerate(calls):
            for _ in range(i):  # cancel each after a different number of messages (0: before the first)
                await call.read()
        busy = await client.stats()
        assert busy.num_blocks_used > 0
        for call in calls:
            call.cancel()
        stats = await client.wait_until_idle()
        assert stats.num_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
        assert client.server.engine.num_active_requests == 0
        await client.check_invariants()

    run_with(sim_engine, body)


def test_out_of_kv_memory_queues_or_preempts_and_all_complete(tiny_engine: LLMEngine) -> None:
    """10 blocks of 16 tokens; 4 requests needing 4-5 blocks each at the end: admission waits and running
    sequences are preempted, yet every request finishes with the tokens it gets without pressure (two at
    a time fit the pool)."""
    prompts = [[(97 * i + j) % 500 + 1 for j in range(40 + 3 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    unpressured = [r.token_ids for pair in (prompts[:2], prompts[2:]) for r in tiny_engine.generate(pair, params)]
    assert tiny_engine.stats().num_preemptions == 0

    async def body(client: Client) -> None:
        before = await client.stats()
        results = await asyncio.gather(
            *(client.generate(p, max_tokens=16, temperature=0, ignore_eos=True) for p in prompts)
        )
        for responses, expected in zip(results, unpressured, strict=True):
            assert responses[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
            assert tokens_of(responses) == expected
        after = await client.stats()
        assert after.num_preemptions > before.num_preemptions, "the pool was too small for all at once"

    run_with(tiny_engine, body)


def test_engine_fault_fails_in_flight_requests_and_keeps_serving(sim_engine: LLMEngine) -> None:
    real_step = sim_engine.step
    faults = iter([True])

    def faulty_step() -> list:
        if next(faults, False):
            raise RuntimeError("injected fault")
        return real_step()

    async def body(client: Client) -> None:
        call = client.stub.Generate(
            worker_pb2.GenerateRequest(prompt_token_ids=[5] * 20, sampling=worker_pb2.SamplingParams(max_tokens=50))
        )
        await call.read()
        sim_engine.step = faulty_step
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await read_rest(call)
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert "injected fault" in info.value.details()
        assert (await client.generate([6] * 20, max_tokens=3))[-1].usage.completion_tokens == 3

    try:
        run_with(sim_engine, body)
    finally:
        del sim_engine.step


def test_drain_refuses_new_requests_and_finishes_running_ones(sim_engine: LLMEngine) -> None:
    async def main() -> None:
        server = await start_worker_server(sim_engine, port=0)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            client = Client(server, worker_pb2_grpc.WorkerStub(channel), health_pb2_grpc.HealthStub(channel))
            running = client.stub.Generate(
                worker_pb2.GenerateRequest(prompt_token_ids=[9] * 20, sampling=worker_pb2.SamplingParams(max_tokens=25))
            )
            await running.read()
            stopping = asyncio.ensure_future(server.stop(drain_timeout=10))
            await asyncio.sleep(0.05)
            health = await client.health.Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.generate([1, 2, 3], max_tokens=2)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            rest = await read_rest(running)
            assert rest[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
            assert rest[-1].usage.completion_tokens == 25
            await stopping
        assert sim_engine.stats().num_blocks_used == 0
        sim_engine.check_invariants()

    asyncio.run(main())


def test_kv_events_poll_and_snapshot_resync(sim_engine: LLMEngine) -> None:
    async def main() -> None:
        engine = AsyncEngine(sim_engine, kv_event_capacity=2)
        engine.start()
        start_seq = engine.kv_event_seq
        for i in range(4):  # each prompt stores one new chain of 3 full blocks
            async for _ in engine.generate(f"kv-{i}", [2000 + i] * 48, SamplingParams(max_tokens=1)):
                pass
        await engine.stats()  # the events of the last step are published
        latest = engine.kv_event_seq
        assert latest >= start_seq + 4
        recent = await engine.kv_events_since(latest - 2)
        assert [e.seq for e in recent.events] == [latest - 1, latest] and recent.snapshot is None
        resync = await engine.kv_events_since(start_seq)  # older than the 2 retained events
        assert resync.events == [] and resync.snapshot is not None and resync.latest_seq == latest
        assert set(resync.snapshot) == set(sim_engine.kv_manager.pool.snapshot()[1])
        assert (await engine.kv_events_since(latest)).events == []
        # Events the log never saw (drained by someone else, as when the pool dropped undrained ones): a
        # reader from before the gap resyncs from a snapshot, one after it reads events again.
        assert await engine.call(lambda e: e.kv_manager.pool.reset_cache() and e.drain_kv_events())
        async for _ in engine.generate("kv-after-gap", [2100] * 48, SamplingParams(max_tokens=1)):
            pass
        await engine.stats()
        after_gap = await engine.kv_events_since(latest)
        assert after_gap.snapshot is not None and after_gap.latest_seq == engine.kv_event_seq
        assert set(after_gap.snapshot) == set(sim_engine.kv_manager.pool.snapshot()[1])
        assert (await engine.kv_events_since(after_gap.latest_seq)).events == []
        await engine.shutdown()

    asyncio.run(main())


def test_leaving_the_iteration_aborts_the_request(sim_engine: LLMEngine) -> None:
    async def consume(engine: AsyncEngine, request_id: str, num_outputs: int) -> None:
        async with aclosing(engine.generate(request_id, [3000] * 40, SamplingParams(max_tokens=150))) as outputs:
            async for _ in outputs:
                num_outputs -= 1
                if num_outputs == 0:
                    break

    async def main() -> None:
        engine = AsyncEngine(sim_engine)
        engine.start()
        await consume(engine, "closed", 2)  # the consumer stops reading
        task = asyncio.ensure_future(consume(engine, "cancelled", 10**6))
        await asyncio.sleep(0.1)
        task.cancel()  # the consumer's task is cancelled
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = await engine.stats()  # ordered after both aborts
        assert (stats.num_blocks_used, stats.num_running, stats.num_waiting) == (0, 0, 0)
        await engine.call(lambda e: e.check_invariants())
        await engine.shutdown()
        with pytest.raises(EngineStopped):
            await anext(engine.generate("late", [1, 2], SamplingParams(max_tokens=1)))

    asyncio.run(main())


def test_kvroute_worker_command_serves_until_sigterm() -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "launch.cli", "worker", "--model", "sim", "--port", "0", "--num-kv-blocks", "32"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "KVROUTE_WORKER_ID": "pod-7"},
    )
    try:
        line = process.stdout.readline()
        match = re.fullmatch(
            r"kvroute worker: serving sim-v1 on 127\.0\.0\.1:(\d+) as pod-7 "
            r"\(advertised 127\.0\.0\.1:(\d+), incarnation ([0-9a-f]{16})\)\n",
            line,
        )
        assert match and match[1] == match[2], (line, process.stderr.read() if process.poll() is not None else "")
        with grpc.insecure_channel(f"127.0.0.1:{match[1]}") as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            info = worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
            assert info.num_kv_blocks == 32
            assert (info.worker_id, info.incarnation) == ("pod-7", int(match[3], 16))
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
        assert "draining" in process.stdout.read()
    finally:
        process.kill()
        process.wait()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "no-such-model"], "model: 'no-such-model' is not one of"),
        (["--model", "sim", "--max-num-seqs", "0"], "max_num_seqs must be >= 1"),
        (["--model", "sim", "--port", "70000"], "--port must be in [0, 65536)"),
        (["--model", "sim", "--device", "gpu0"], "--device 'gpu0' is not a device torch knows"),
        (["--model", "sim", "--device", "cuda:99"], "--device 'cuda:99': "),
        (["--model", "sim", "--device", "meta"], "the worker runs on cpu or cuda[:N]"),
        (["--model", "sim", "--max-waiting", "0"], "--max-waiting must be >= 1"),
        (["--model", "sim", "--engine-dead-grace", "-1"], "--engine-dead-grace must be >= 0"),
    ],
)
def test_kvroute_worker_bad_arguments_are_one_line_errors(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["worker", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvroute worker: error: ") and message in err and err.count("\n") == 1


def test_a_slow_consumer_gets_piled_up_outputs_merged(sim_engine: LLMEngine) -> None:
    async def main() -> None:
        engine = AsyncEngine(sim_engine)
        engine.start()
        prompt = [4000] * 20
        sizes, tokens = [], []
        async for output in engine.generate("slow", prompt, SamplingParams(max_tokens=30, logprobs=True)):
            sizes.append(len(output.new_token_ids))
            assert len(output.new_logprobs) == len(output.new_token_ids)
            tokens += output.new_token_ids
            if len(sizes) == 1:
                await asyncio.sleep(0.3)  # ~15 sim decode steps pile up meanwhile
        await engine.shutdown()
        assert len(tokens) == 30 and max(sizes) > 1 and len(sizes) < 30
        context = list(prompt)
        for token in tokens:
            assert token == sim_engine.runner.next_token(context[-1], len(context))
            context.append(token)

    asyncio.run(main())


def test_cancellations_under_kv_pressure_keep_the_books_straight() -> None:
    """Requests that wait, run or were preempted are cancelled at random points; the rest complete."""
    engine = LLMEngine(
        EngineConfig(model="sim", num_kv_blocks=10, max_model_len=SIM_MAX_MODEL_LEN, decode_reserve_tokens=0)
    )
    engine.runner.cost = SimCostModel(prefill_us_per_token=0.0, decode_ms_per_step=2.0)
    rng = random.Random(0)
    plans = [(rng.randrange(30, 60), rng.choice([None, None, 0, 2, 6])) for _ in range(16)]

    async def one(client: Client, i: int, prompt_len: int, cancel_after: int | None) -> int | None:
        request = worker_pb2.GenerateRequest(
            prompt_token_ids=[5000 + i] * prompt_len, sampling=worker_pb2.SamplingParams(max_tokens=40)
        )
        call = client.stub.Generate(request)
        if cancel_after is None:
            return sum(len(r.token_ids) for r in await read_rest(call))
        for _ in range(cancel_after):
            await call.read()
        call.cancel()
        return None

    async def body(client: Client) -> None:
        results = await asyncio.gather(*(one(client, i, n, c) for i, (n, c) in enumerate(plans)))
        assert [r for r in results if r is not None] == [40] * sum(c is None for _, c in plans)
        assert (await client.stats()).num_preemptions > 0, "the pool was too small for all at once"

    run_with(engine, body)


# -- request identity, KV events, limits -------------------------------------------------------------


def sim_tokens(engine: LLMEngine, prompt: list[int], n: int) -> list[int]:
    """The n tokens a sim engine generates after `prompt` (a fixed function of the context)."""
    context = list(prompt)
    for _ in range(n):
        context.append(engine.runner.next_token(context[-1], len(context)))
    return context[len(prompt) :]


def fast_sim_engine(**config: Any) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model="sim", max_model_len=SIM_MAX_MODEL_LEN, **config))
    engine.runner.cost = SimCostModel(prefill_us_per_token=0.0, decode_ms_per_step=2.0)
    return engine


def test_a_reused_request_id_never_receives_another_requests_tokens() -> None:
    """Cancel a stream and reuse its id at once, 40 times over, while other streams keep the engine busy: every
    stream gets exactly the tokens of its own context, and ends as its own request ends."""
    engine = fast_sim_engine(num_kv_blocks=128)

    async def body(client: Client) -> None:
        done = asyncio.Event()

        async def load(i: int) -> int:
            served = 0
            while not done.is_set():
                prompt = [7000 + i, served % 500 + 1] * 10
                responses = await client.generate(prompt, request_id=f"load-{i}", max_tokens=30)
                assert tokens_of(responses) == sim_tokens(engine, prompt, 30)
                served += 1
            return served

        background = [asyncio.ensure_future(load(i)) for i in range(4)]
        for round_ in range(40):
            old_prompt = [6000 + round_] * 24
            old = client.stub.Generate(
                worker_pb2.GenerateRequest(
                    request_id="reused", prompt_token_ids=old_prompt, sampling=worker_pb2.SamplingParams(max_tokens=100)
                )
            )
            first = await old.read()
            assert list(first.token_ids) == sim_tokens(engine, old_prompt, len(first.token_ids))
            old.cancel()
            new_prompt = [6500 + round_] * (17 + round_ % 5)
            while True:
                try:
                    responses = await client.generate(new_prompt, request_id="reused", max_tokens=8)
                    break
                except grpc.aio.AioRpcError as exc:  # the cancel has not reached the worker yet
                    assert exc.code() == grpc.StatusCode.ALREADY_EXISTS, exc
                    await asyncio.sleep(0.001)
            assert tokens_of(responses) == sim_tokens(engine, new_prompt, 8), f"round {round_}"
            assert responses[-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
            assert responses[-1].usage.prompt_tokens == len(new_prompt)
        done.set()
        assert all(served > 0 for served in await asyncio.gather(*background))

    run_with(engine, body)


def test_kv_events_over_grpc_snapshot_paging_reader_ahead_and_true_parents() -> None:
    """Two requests computing one prefix at once, then evictions: every stored range, read page by page, chains
    onto its true parent, and the events replayed give the pool's cached set. A reader older than the log, or
    ahead of it, gets a snapshot."""
    engine = fast_sim_engine(num_kv_blocks=16, max_num_batched_tokens=64)
    before = [9000 + i for i in range(32)]  # cached before the server starts: only a snapshot covers it
    a = [8000 + i for i in range(48)]
    b = a + [8100 + i for i in range(32)]  # a's 3 blocks and 2 of its own
    evicting = [[8200 + 100 * k + i for i in range(48)] for k in range(3)]
    engine.generate([before], SamplingParams(max_tokens=1))
    parent_of = {}
    for prompt in (before, a, b, *evicting):
        hashes = block_hashes(prompt, model_id=engine.model_id)
        parent_of.update(zip(hashes, [b"", *hashes[:-1]], strict=True))

    async def body(client: Client) -> None:
        info = await client.stub.GetInfo(worker_pb2.GetInfoRequest())
        assert info.worker_id == "worker-under-test" and info.incarnation != 0
        old = await client.stub.GetKVEvents(worker_pb2.GetKVEventsRequest(after_seq=0))
        assert old.is_snapshot and not old.events and old.snapshot_seq == old.latest_seq == 1
        assert set(old.snapshot_hashes) == set(block_hashes(before, model_id=engine.model_id))
        assert (old.worker_id, old.incarnation) == (info.worker_id, info.incarnation)
        # a and b reach the engine in one batch (its thread is held meanwhile), so both miss the cache: b computes
        # a's blocks again, and its stored ranges start after them.
        held = asyncio.ensure_future(client.server.engine.call(lambda _: time.sleep(0.3)))
        await asyncio.sleep(0.05)
        first = asyncio.ensure_future(client.generate(a, max_tokens=2))
        await asyncio.sleep(0.05)
        second = asyncio.ensure_future(client.generate(b, max_tokens=2))
        await asyncio.gather(held, first, second)
        for prompt in evicting:
            await client.generate(prompt, max_tokens=2)
        await client.wait_until_idle()

        events, after = [], old.snapshot_seq
        while True:  # one event per page
            page = await client.stub.GetKVEvents(worker_pb2.GetKVEventsRequest(after_seq=after, max_events=1))
            assert not page.is_snapshot and len(page.events) <= 1
            assert (page.worker_id, page.incarnation) == (info.worker_id, info.incarnation)
            if not page.events:
                break
            assert page.events[0].seq == after + 1
            events.append(page.events[0])
            after = page.events[0].seq
        whole = await client.stub.GetKVEvents(worker_pb2.GetKVEventsRequest(after_seq=old.snapshot_seq))
        assert list(whole.events) == events and whole.latest_seq == after
        assert any(e.kind == worker_pb2.KVEvent.KIND_REMOVED for e in events), "the pool was too small for all"

        cached = set(old.snapshot_hashes)
        for event in events:
            if event.kind == worker_pb2.KVEvent.KIND_STORED:
                chain = list(event.block_hashes)
                assert event.parent_hash == parent_of[chain[0]]
                assert all(parent_of[h] == p for p, h in itertools.pairwise(chain))
                assert not event.parent_hash or event.parent_hash in cached, "a reader can chain the range"
                cached |= set(chain)
            else:
                assert event.kind == worker_pb2.KVEvent.KIND_REMOVED
                cached -= set(event.block_hashes)
        b_hashes = block_hashes(b, model_id=engine.model_id)
        assert [list(e.block_hashes) for e in events if e.parent_hash == b_hashes[2]] == [b_hashes[3:4]]
        pool_seq, pool_cached = await client.server.engine.call(lambda e: e.kv_manager.pool.snapshot())
        assert cached == set(pool_cached) and pool_seq == after

        ahead = await client.stub.GetKVEvents(worker_pb2.GetKVEventsRequest(after_seq=after + 1000))
        assert ahead.is_snapshot and ahead.snapshot_seq == ahead.latest_seq == after
        assert set(ahead.snapshot_hashes) == cached
        stats = await client.stats()
        assert (stats.worker_id, stats.incarnation, stats.kv_event_seq) == (info.worker_id, info.incarnation, after)
        assert stats.engine_state == worker_pb2.ENGINE_STATE_SERVING

    async def main() -> None:
        async with serving(engine, worker_id="worker-under-test", advertise_address="w0.kvroute:50051") as client:
            assert (client.server.worker_id, client.server.advertise_address) == (
                "worker-under-test",
                "w0.kvroute:50051",
            )
            await body(client)
            await client.check_invariants()

    asyncio.run(main())


def test_past_its_bounds_generate_is_resource_exhausted_naming_what_is_full() -> None:
    async def open_stream(client: Client, prompt: list[int]) -> grpc.aio.UnaryStreamCall:
        call = client.stub.Generate(
            worker_pb2.GenerateRequest(prompt_token_ids=prompt, sampling=worker_pb2.SamplingParams(max_tokens=200))
        )
        await call.read()
        return call

    async def refused(client: Client, limit: str) -> str:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.generate([1, 2, 3], max_tokens=2)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert info.value.details().startswith(f"{limit}: "), info.value.details()
        metrics = client.server.metrics
        labels = {"model_name": metrics.model_name, "limit": limit}
        assert metrics.registry.get_sample_value("kvroute:requests_refused_total", labels) == 1
        return info.value.details()

    async def streams(client: Client) -> None:
        calls = [await open_stream(client, [10 + i] * 20) for i in range(2)]
        assert "all 2 Generate streams" in await refused(client, "max_concurrent_streams")
        calls[0].cancel()
        await client.wait_until_idle(timeout=0.5)  # (it is not idle: calls[1] runs)
        while client.server.engine.num_active_requests > 1:
            await asyncio.sleep(0.01)
        assert (await client.generate([1, 2, 3], max_tokens=2))[-1].usage.completion_tokens == 2
        calls[1].cancel()

    async def waiting(client: Client) -> None:
        running = await open_stream(client, [20] * 20)  # the only slot (max_num_seqs=1)
        queued = client.stub.Generate(
            worker_pb2.GenerateRequest(prompt_token_ids=[21] * 20, sampling=worker_pb2.SamplingParams(max_tokens=2))
        )
        while client.server.engine.num_active_requests < 2:
            await asyncio.sleep(0.01)
        assert "waiting queue is full" in await refused(client, "max_waiting")
        running.cancel()
        assert (await read_rest(queued))[-1].usage.completion_tokens == 2

    async def main() -> None:
        async with serving(fast_sim_engine(num_kv_blocks=64), max_concurrent_streams=2) as client:
            await streams(client)
        engine = fast_sim_engine(num_kv_blocks=64, max_num_seqs=1)
        async with serving(engine, max_waiting=1) as client:
            await waiting(client)

    asyncio.run(main())


def test_a_prompt_is_validated_before_it_is_hashed(sim_engine: LLMEngine) -> None:
    """The hash-parity check hashes the whole prompt: a prompt over the context is refused before it."""

    async def body(client: Client) -> None:
        metrics = client.server.metrics
        labels = {"model_name": metrics.model_name}
        wrong = [b"\0" * 16] * 2
        too_long = worker_pb2.GenerateRequest(
            prompt_token_ids=list(range(1, 4 * SIM_MAX_MODEL_LEN)), block_hashes=wrong, sampling={"max_tokens": 2}
        )
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.stub.Generate(too_long).read()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and info.value.details().startswith("prompt:")
        assert metrics.registry.get_sample_value("kvroute:block_hash_mismatches_total", labels) == 0
        valid = worker_pb2.GenerateRequest(prompt_token_ids=list(range(1, 40)), block_hashes=wrong)
        assert [r async for r in client.stub.Generate(valid)][-1].finish_reason == worker_pb2.FINISH_REASON_LENGTH
        assert metrics.registry.get_sample_value("kvroute:block_hash_mismatches_total", labels) == 1

    run_with(sim_engine, body)


# -- a dead engine -------------------------------------------------------------------------------------


class FailingRunner(SimRunner):
    """A sim runner whose device fails on demand: each of its next `failures` steps raises, as a lost GPU's."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config, SimCostModel(prefill_us_per_token=0.0, decode_ms_per_step=2.0))
        self.failures = 0
        self.on_failure: Callable[[], None] = lambda: None

    def run(self, batch: SchedulerOutput) -> SamplerOutput:
        if self.failures:
            self.failures -= 1
            self.on_failure()
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return super().run(batch)


def failing_engine() -> tuple[LLMEngine, FailingRunner]:
    config = EngineConfig(model="sim", num_kv_blocks=32, max_model_len=SIM_MAX_MODEL_LEN)
    engine = LLMEngine(config)
    engine.runner = runner = FailingRunner(config)
    return engine, runner


def test_a_dead_engine_turns_the_worker_not_serving_and_refuses_requests() -> None:
    """Failing steps fail their requests (INTERNAL) and the worker serves on; a success resets the count; the
    MAX_CONSECUTIVE_STEP_FAILURES-th failure in a row kills the engine: NOT_SERVING, DEAD, UNAVAILABLE."""
    engine, runner = failing_engine()

    async def failed(client: Client, prompt: list[int]) -> str:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await client.generate(prompt, max_tokens=5)
        assert info.value.code() == grpc.StatusCode.INTERNAL
        return info.value.details()

    async def main() -> None:
        async with serving(engine) as client:
            running = client.stub.Generate(
                worker_pb2.GenerateRequest(prompt_token_ids=[5] * 20, sampling=worker_pb2.SamplingParams(max_tokens=90))
            )
            await running.read()
            runner.failures = MAX_CONSECUTIVE_STEP_FAILURES - 1
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await read_rest(running)  # in flight when the step failed
            assert info.value.code() == grpc.StatusCode.INTERNAL and "illegal memory access" in info.value.details()
            for _ in range(MAX_CONSECUTIVE_STEP_FAILURES - 2):
                assert "illegal memory access" in await failed(client, [6] * 20)
            assert (await client.generate([7] * 20, max_tokens=3))[-1].usage.completion_tokens == 3
            assert (await client.stats()).engine_state == worker_pb2.ENGINE_STATE_SERVING

            runner.failures = MAX_CONSECUTIVE_STEP_FAILURES
            for i in range(MAX_CONSECUTIVE_STEP_FAILURES):
                await failed(client, [8 + i] * 20)
            error = await asyncio.wait_for(client.server.engine.wait_dead(), 5)
            assert f"{MAX_CONSECUTIVE_STEP_FAILURES} engine steps failed in a row" in error
            assert "illegal memory access" in error
            stats = await client.stats()
            assert (stats.engine_state, stats.engine_error) == (worker_pb2.ENGINE_STATE_DEAD, error)
            for service in ("", "kvroute.v1.Worker"):
                for _ in range(100):  # set by the server's watch task, just after the death
                    health = await client.health.Check(health_pb2.HealthCheckRequest(service=service))
                    if health.status == health_pb2.HealthCheckResponse.NOT_SERVING:
                        break
                    await asyncio.sleep(0.01)
                assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING, service
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await client.generate([9] * 20, max_tokens=2)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert info.value.details() == f"the engine died: {error}"
            assert (await client.stub.GetInfo(worker_pb2.GetInfoRequest())).model_id == engine.model_id

    asyncio.run(main())


def test_a_failed_step_that_breaks_the_block_books_kills_the_engine_at_once() -> None:
    engine, runner = failing_engine()
    pool = engine.kv_manager.pool

    def corrupt() -> None:
        pool.blocks[-1].ref_cnt += 1  # a reference that no request holds

    runner.on_failure = corrupt

    async def main() -> None:
        async_engine = AsyncEngine(engine)
        async_engine.start()
        runner.failures = 1
        with pytest.raises(EngineError, match="illegal memory access"):
            async for _ in async_engine.generate("broken", [3] * 20, SamplingParams(max_tokens=4)):
                pass
        error = await asyncio.wait_for(async_engine.wait_dead(), 5)
        assert "left the KV block books broken" in error
        with pytest.raises(EngineDead, match="books broken"):
            await anext(async_engine.generate("after", [3] * 20, SamplingParams(max_tokens=4)))
        assert (await async_engine.stats()).num_blocks_total == 32  # a call still runs, on the dead engine
        await async_engine.shutdown()

    asyncio.run(main())


DEAD_WORKER = """
import argparse, asyncio, sys
from worker import cli_worker
from worker.engine import LLMEngine

parser = argparse.ArgumentParser()
cli_worker.add_arguments(parser)
args = parser.parse_args(sys.argv[1:])
engine = LLMEngine(cli_worker.engine_config(args))

def run(batch):
    raise RuntimeError("injected device failure")

engine.runner.run = run
sys.exit(asyncio.run(cli_worker.serve(engine, args)))
"""


def worker_process(argv: list[str], **kwargs: Any) -> tuple[subprocess.Popen[str], str]:
    """A worker subprocess and its address, read from its startup line."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    line = process.stdout.readline()
    match = re.match(r"kvroute worker: serving \S+ on (\S+:\d+) ", line)
    assert match, (line, process.stderr.read() if process.poll() is not None else "")
    return process, match[1]


def test_kvroute_worker_exits_1_after_the_engine_dead_grace() -> None:
    argv = ["--model", "sim", "--port", "0", "--num-kv-blocks", "32", "--engine-dead-grace", "3"]
    process, address = worker_process([sys.executable, "-c", DEAD_WORKER, *argv])
    try:
        with grpc.insecure_channel(address) as channel:
            stub = worker_pb2_grpc.WorkerStub(channel)
            for _ in range(MAX_CONSECUTIVE_STEP_FAILURES):
                request = worker_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling={"max_tokens": 2})
                with pytest.raises(grpc.RpcError) as info:
                    list(stub.Generate(request, timeout=5))
                assert info.value.code() == grpc.StatusCode.INTERNAL
            dead_at = time.monotonic()  # (the engine died a moment before the client saw the last failure)
            health = health_pb2_grpc.HealthStub(channel)
            while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status != 2:  # NOT_SERVING
                assert process.poll() is None, "NOT_SERVING while the process lives"
            assert stub.GetStats(worker_pb2.GetStatsRequest(), timeout=5).engine_state == worker_pb2.ENGINE_STATE_DEAD
        assert process.wait(timeout=30) == 1
        assert time.monotonic() - dead_at > 2.5, "the process outlives its engine by the grace"
        err = process.stderr.read()
        assert "the engine died (3 engine steps failed in a row" in err and "exiting with status 1 in 3 s" in err
    finally:
        process.kill()
        process.wait()


def test_a_second_signal_during_the_drain_stops_the_worker_at_once() -> None:
    argv = ["-m", "launch.cli", "worker", "--model", "sim", "--port", "0", "--num-kv-blocks", "64"]
    process, address = worker_process([sys.executable, *argv, "--drain-timeout", "60"])
    try:
        with grpc.insecure_channel(address) as channel:
            request = worker_pb2.GenerateRequest(prompt_token_ids=[1] * 20, sampling={"max_tokens": 1000 - 21})
            stream = worker_pb2_grpc.WorkerStub(channel).Generate(request)  # 20 s of sim decoding
            next(stream)
            process.send_signal(signal.SIGINT)
            assert process.stdout.readline().startswith("kvroute worker: draining (up to 60 s")
            process.send_signal(signal.SIGINT)
            assert process.wait(timeout=10) == 130
        assert "second signal; stopping without draining" in process.stderr.read()
    finally:
        process.kill()
        process.wait()


def test_python_dash_m_prints_a_user_error_as_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "launch.cli", "worker", "--model", "sim", "--port", "70000"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert result.stderr == "kvroute worker: error: --port must be in [0, 65536), got 70000\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_device_this_machine_lacks_is_a_one_line_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["worker", "--model", "sim", "--device", "cuda"]) == 2
    assert (
        capsys.readouterr().err == "kvroute worker: error: --device 'cuda': torch sees no CUDA device on this machine\n"
    )
