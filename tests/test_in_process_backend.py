"""The worker's HTTP front door forwards in process (launch/in_process_backend.py): a real engine and its gRPC
servicer, read through the gateway's Backend contract as the request path reads a gRPC call."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from gateway.fleet.fleet_state import WorkerMember
from gateway.forwarding.backends import ForwardJob
from gateway.request import GatewayRequest
from kvroute.sampling import SamplingParams
from launch.in_process_backend import InProcessBackend
from worker.config import EngineConfig
from worker.engine import LLMEngine
from worker.service import start_worker_server

pytestmark = pytest.mark.timeout(60)


def job(request_id: str, max_tokens: int) -> ForwardJob:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    request = GatewayRequest(None, None, prompt_token_ids=list(range(1, 40)), params=params, kind="tokens")
    return ForwardJob(request_id, request, list(range(1, 40)), "", [], params, {})


async def read_all(call) -> list:
    messages = []
    while (message := await call.read()) is not grpc.aio.EOF:
        messages.append(message)
    return messages


def test_a_request_streams_is_refused_before_serving_and_ends_when_the_door_closes() -> None:
    async def body() -> None:
        engine = LLMEngine(EngineConfig(model="sim", num_kv_blocks=64, max_model_len=256, sim_decode_ms_per_step=5))
        server = await start_worker_server(engine, port=0, worker_id="w0")
        backend = InProcessBackend()
        member = WorkerMember("w0", f"127.0.0.1:{server.port}", 1, "sim", 16, 256, "", "", True)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await read_all(backend.open(member, job("early", 3), 0))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            backend.serve_from(server)
            messages = await read_all(backend.open(member, job("whole", 3), 0))
            assert sum(len(m.token_ids) for m in messages) == 3 and messages[-1].finish_reason
            long = backend.open(member, job("long", 200), 0)
            assert (await long.read()).token_ids
            await backend.close()  # as a gRPC channel's close ends its calls
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await read_all(long)
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
            for _ in range(100):  # the engine's request was aborted: its blocks come back
                if not server.engine.engine.has_unfinished_requests():
                    break
                await asyncio.sleep(0.02)
            server.engine.engine.check_invariants()
            assert not server.engine.engine.has_unfinished_requests()
        finally:
            await server.stop(drain_timeout=0)

    asyncio.run(body())
