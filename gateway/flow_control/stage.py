"""The flow-control stage of the request path (DESIGN §4; docs/flow_control.md): after auth, limits, prompt
and hashes, before the pick. A request goes to a worker when one can admit it now (gateway.flow_control.
saturation); until then it waits here, in a FairQueue by band and tenant, and its worker is picked with the
routing policy when it leaves the queue, not when it arrived. What waits, what goes and why is decided by
gateway.flow_control.dispatcher (the simulator runs the same on its virtual clock); this stage runs it under
asyncio: each waiting caller awaits a future, a ticker looks every TICK_S while anything waits, `kick` dispatches
soon, and the metrics are counted here.

Caller contract (gateway.request_path):
  1. `grant = await admit(...)`: returns a Grant once the request may be sent, or raises a GatewayError:
     RateLimited (429) past its tenant's queue bound, NoWorkerAvailable (503) past the band's or the whole
     queue's bound, when it is shed for a more urgent request, when it waits past its band's max_wait_s, when
     the fleet has no live worker left, or at `end_queued` (the drain deadline); each with Retry-After from the
     measured drain rate. Cancelled (the client left), it is out of the queue at once.
  2. `grant.decision` is the worker to try first (None: the fleet has no routable worker now; the path then
     answers as it would without flow control). `grant.sent()` once its worker request is sent, `started(grant)`
     when its first token came, `grant.close()` when the path is done with it (any way; idempotent): the
     worker's room counts the grant's blocks until the second report after its first token, or until it
     closes without one.
  3. `kick()` when room may have freed (a worker request ended, the membership changed); the stage also looks
     every TICK_S while anything waits (load reports arrive on the fleet state's own clock).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Collection

from gateway.errors import GatewayError
from gateway.flow_control.config import FlowControlConfig
from gateway.flow_control.dispatcher import TICK_S, Dispatcher, Grant, Pick, Waiting
from gateway.flow_control.fair_queue import FairQueue
from gateway.metrics import GatewayMetrics
from gateway.request import Tenant
from gateway.routing.fleet_view import FleetView
from gateway.routing.router import RouteRequest

MAX_BAND_LABELS = 16  # bands with their own metric series beyond the configured ones; later ones are "other"

_Future = asyncio.Future[Grant]


class FlowControl:
    """One pool's flow-control stage (see the module docstring for the caller contract)."""

    def __init__(
        self,
        config: FlowControlConfig,
        view: Callable[[], FleetView],
        pick: Pick,
        blocked: Callable[[], Collection[str]],
        metrics: GatewayMetrics,
        block_size: int,
    ) -> None:
        self.dispatcher: Dispatcher[_Future] = Dispatcher(config, view, pick, blocked, block_size, self)
        self._metrics = metrics
        self._ticker: asyncio.Task[None] | None = None
        self._kicked = False
        self._band_labels: dict[int, str] = {}

    @property
    def config(self) -> FlowControlConfig:
        return self.dispatcher.config

    @property
    def queue(self) -> FairQueue[Waiting[_Future]]:
        return self.dispatcher.queue

    def reconfigure(self, config: FlowControlConfig) -> None:
        """A SIGHUP's new settings: they apply to what arrives and to every dispatch from now on."""
        self.dispatcher.reconfigure(config)

    # -- the caller's side ----------------------------------------------------------------------------------

    async def admit(
        self, route_request: RouteRequest, tenant: Tenant, band: int, max_tokens: int, size_bytes: int
    ) -> Grant:
        """Wait until the request may be sent (caller contract item 1)."""
        future: _Future = asyncio.get_running_loop().create_future()
        arrived = self.dispatcher.arrive(
            route_request, tenant.name, tenant.weight, band, max_tokens, size_bytes, future
        )  # fmt: skip
        if isinstance(arrived, Grant):
            return arrived
        if self.queue:
            self._start_ticker()
        try:
            return await future
        except BaseException:
            if self.dispatcher.withdraw(arrived):
                self._metrics.flow_queue_depth.labels(self.band_label(band)).dec()
            elif future.done() and not future.cancelled() and future.exception() is None:
                future.result().close()  # granted, but its caller left before it could send
            raise

    def started(self, grant: Grant) -> None:
        """The granted request's first token came (caller contract item 2)."""
        self.dispatcher.started(grant)

    def kick(self) -> None:
        """Room may have freed: dispatch soon (once, however many kicks come before it runs)."""
        if self.queue and not self._kicked:
            self._kicked = True
            asyncio.get_running_loop().call_soon(self._kicked_dispatch)

    def forget(self, worker_id: str) -> None:
        """The worker left or restarted: what was granted to it no longer holds room anywhere; dispatch soon."""
        self.dispatcher.forget(worker_id)
        self.kick()

    def end_queued(self, message: str) -> int:
        """Answer every waiting request with NoWorkerAvailable(`message`), code gateway_shutting_down (the
        drain's deadline: none of them can start now). Returns how many there were."""
        return self.dispatcher.end_queued(message)

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.wait({self._ticker})
            self._ticker = None

    def band_label(self, band: int) -> str:
        """The band's metric label: its value, for configured bands and the first MAX_BAND_LABELS others."""
        label = self._band_labels.get(band)
        if label is None:
            configured = band in self.config.bands or band == 0
            if configured or len(self._band_labels) < MAX_BAND_LABELS + len(self.config.bands):
                label = self._band_labels[band] = str(band)
            else:
                label = "other"
        return label

    # -- the dispatcher's outcomes (gateway.flow_control.dispatcher.Outcomes) ------------------------------------

    def queued(self, band: int) -> None:
        self._metrics.flow_queue_depth.labels(self.band_label(band)).inc()

    def granted(self, band: int, reason: str, waited_s: float, grant: Grant, future: _Future | None) -> None:
        label = self.band_label(band)
        self._metrics.flow_dispatches.labels(label, reason).inc()
        self._metrics.flow_queue_wait.labels(label).observe(waited_s)
        if future is not None:
            self._metrics.flow_queue_depth.labels(label).dec()
            if not future.done():
                future.set_result(grant)

    def shed(self, band: int, reason: str, error: GatewayError, future: _Future | None) -> None:
        label = self.band_label(band)
        self._metrics.flow_sheds.labels(label, reason).inc()
        if future is None:
            return  # refused at arrival: `admit` raises it
        self._metrics.flow_queue_depth.labels(label).dec()
        if not future.done():
            future.set_exception(error)
        with contextlib.suppress(asyncio.CancelledError):
            future.exception()  # retrieved here: a caller that already left never reads it

    # -- when to dispatch ---------------------------------------------------------------------------------------

    def _kicked_dispatch(self) -> None:
        self._kicked = False
        self.dispatcher.dispatch()

    def _start_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(self._tick(), name="flow control")

    async def _tick(self) -> None:
        while self.queue:
            await asyncio.sleep(TICK_S)
            self.dispatcher.dispatch()
