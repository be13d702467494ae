"""The worker's gRPC service end to end: a real engine (`sim` and `tiny`) behind a real grpc.aio server on a
free port, called through the generated client stub."""

from __future__ import annotations

import asyncio
import random
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvroute import cli
from kvroute.hashing import block_hashes, hash_fingerprint
from kvroute.sampling import SamplingParams
from proto import worker_pb2, worker_pb2_grpc
from worker.async_engine import AsyncEngine, EngineStopped
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.service import WorkerServer, start_worker_server
from worker.sim_runner import SimCostModel

SIM_MAX_MODEL_LEN = 256
SIM_BLOCKS = 64
TINY_BLOCKS = 10


@pytest.fixture(scope="module")
def sim_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="sim", num_kv_blocks=SIM_BLOCKS, max_model_len=SIM_MAX_MODEL_LEN))


@pytest.fixture(scope="module")
def tiny_engine() -> LLMEngine:
    # float32: greedy tokens must not depend on how requests were batched (bf16 near-ties would flip).
    return LLMEngine(EngineConfig(model="tiny", dtype="float32", num_kv_blocks=TINY_BLOCKS, max_num_batched_tokens=64))


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
async def serving(engine: LLMEngine) -> AsyncIterator[Client]:
    server = await start_worker_server(engine, port=0)
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
        expected = tokens_of(responses)
        stopped = await client.generate(prompt, max_tokens=6, stop_token_ids=[expected[2]])
        assert tokens_of(stopped) == expected[:3]
        assert stopped[-1].finish_reason == worker_pb2.FINISH_REASON_STOP
        batch = await client.stub.GetKVEvents(worker_pb2.GetKVEventsRequest(after_seq=0))
        assert batch.latest_seq == (await client.stats()).kv_event_seq
        stored = set(batch.snapshot_hashes) | {
            h for e in batch.events if e.kind == worker_pb2.KVEvent.KIND_STORED for h in e.block_hashes
        }
        assert set(block_hashes(prompt, model_id=sim_engine.model_id)) <= stored

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
        recent = engine.kv_events_since(latest - 2)
        assert [e.seq for e in recent.events] == [latest - 1, latest] and recent.snapshot is None
        resync = engine.kv_events_since(start_seq)  # older than the 2 retained events
        assert resync.events == [] and resync.snapshot is not None and resync.latest_seq == latest
        assert set(resync.snapshot) == set(sim_engine.kv_manager.pool.snapshot()[1])
        assert engine.kv_events_since(latest).events == []
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
        [sys.executable, "-m", "kvroute.cli", "worker", "--model", "sim", "--port", "0", "--num-kv-blocks", "32"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        match = re.fullmatch(r"kvroute worker: serving sim-v1 on 127\.0\.0\.1:(\d+)\n", line)
        assert match, (line, process.stderr.read() if process.poll() is not None else "")
        with grpc.insecure_channel(f"127.0.0.1:{match[1]}") as channel:
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            info = worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
            assert info.num_kv_blocks == 32
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
    engine = LLMEngine(EngineConfig(model="sim", num_kv_blocks=10, max_model_len=SIM_MAX_MODEL_LEN))
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
