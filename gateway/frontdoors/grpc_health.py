"""gRPC health (`grpc.health.v1.Health`) that follows a readiness check, for the gateway's gRPC front door and
the endpoint picker.

    health = ReadinessHealth(server, ("", "readiness"), ready=path.ready, label="epp readiness",
                             not_ready="no worker with an endpoint")
    await health.start()   # after server.start(): the services as ready() says, then checked every interval
    await health.hold(False)   # stop following: NOT_SERVING from here, whatever ready() says (a drain)
    await health.stop()    # stop following and enter graceful shutdown: every service NOT_SERVING

A change is logged once, as `<label>: SERVING` or `<label>: NOT_SERVING (<not_ready>)`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from contextlib import suppress

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

logger = logging.getLogger(__name__)


class ReadinessHealth:
    """The health servicer added to `server`, its `services` SERVING exactly while `ready()` (module docstring)."""

    def __init__(
        self,
        server: grpc.aio.Server,
        services: Sequence[str],
        *,
        ready: Callable[[], bool],
        interval_s: float,
        label: str,
        not_ready: str,
    ) -> None:
        self.servicer = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.servicer, server)
        self.services = tuple(services)
        self.ready = ready
        self.interval_s = interval_s
        self.label = label
        self.not_ready = not_ready
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._set(self.ready())
        self._task = asyncio.create_task(self._follow(), name=f"{self.label} health")

    async def hold(self, ready: bool) -> None:
        """Stop following `ready()`; the services stay as `ready` says."""
        await self._cancel()
        await self._set(ready)

    async def stop(self) -> None:
        await self._cancel()
        await self.servicer.enter_graceful_shutdown()

    async def _cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _set(self, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in self.services:
            await self.servicer.set(service, status)

    async def _follow(self) -> None:
        ready = self.ready()
        while True:
            await asyncio.sleep(self.interval_s)
            now = self.ready()
            if now != ready:
                ready = now
                logger.info("%s: %s", self.label, "SERVING" if ready else f"NOT_SERVING ({self.not_ready})")
                await self._set(ready)
