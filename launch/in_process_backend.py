"""The worker's own HTTP front door forwards to its engine in this process (launch/worker.py): the gateway's
Backend contract (gateway.forwarding.backends) over `WorkerServicer.generate`, no gRPC hop per request or token.
It lives in launch/ because gateway/ and worker/ never import each other."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import aclosing

import grpc

from gateway.fleet.fleet_state import WorkerMember
from gateway.forwarding.backends import BackendCall, ForwardJob, QueuedCall, generate_request, rpc_error
from proto import worker_pb2
from worker.service import GENERATE_ERRORS, WorkerServer, WorkerServicer, status_code


class InProcessBackend:
    """kvroute requests of the front door's request path, forwarded to this worker's servicer in this process
    (the gateway's Backend contract: gateway.forwarding.backends). Before the servicer serves, and for an error
    it raises, a call fails as the gRPC call would: `grpc.aio.AioRpcError` with the servicer's status code."""

    def __init__(self) -> None:
        self.servicer: WorkerServicer | None = None
        self._calls: set[InProcessCall] = set()  # not yet ended

    def serve_from(self, server: WorkerServer) -> None:
        self.servicer = server.servicer

    def open(self, member: WorkerMember, job: ForwardJob, choice: int) -> BackendCall:
        call = InProcessCall(self.servicer, generate_request(job, choice), self._calls.discard)
        self._calls.add(call)
        return call

    def release(self, address: str) -> None:
        return

    async def close(self) -> None:
        """End every call still streaming with UNAVAILABLE, as closing a gRPC channel ends its calls."""
        for call in list(self._calls):
            call.fail(rpc_error(grpc.StatusCode.UNAVAILABLE, "the worker's front door closed"))
        self._calls.clear()


class InProcessCall(QueuedCall):
    """One choice's `WorkerServicer.generate` stream, read as a gRPC call's messages; `cancel` cancels it, which
    aborts the engine's request and frees its blocks."""

    def __init__(
        self,
        servicer: WorkerServicer | None,
        request: worker_pb2.GenerateRequest,
        on_end: Callable[[InProcessCall], None],
    ) -> None:
        super().__init__()
        task = self._start(self._run(servicer, request), f"generate {request.request_id}")
        task.add_done_callback(lambda _: on_end(self))  # however it ends, cancelled before its first step too

    async def _run(self, servicer: WorkerServicer | None, request: worker_pb2.GenerateRequest) -> None:
        if servicer is None:
            await self._queue.put(rpc_error(grpc.StatusCode.UNAVAILABLE, "the worker is not serving yet"))
            return
        try:
            async with aclosing(servicer.generate(request)) as responses:
                async for response in responses:
                    await self._queue.put(response)
            await self._queue.put(grpc.aio.EOF)
        except GENERATE_ERRORS as exc:
            await self._queue.put(rpc_error(status_code(exc), str(exc)))
