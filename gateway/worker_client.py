"""gRPC channels to workers: one `grpc.aio` channel per worker address, opened on first use and kept while a
member of the fleet has that address.

A channel multiplexes every request to its worker over one HTTP/2 connection, so the cost of a request is
one stream, not a connection. Channels belong to the event loop that created them; `close()` at shutdown.
Options (message sizes, keepalive pings that find a dead connection between requests) are
kvroute.grpc_options.CLIENT_OPTIONS, which the workers' server options accept by construction.

Every call presents the gateway's worker token (kvroute.credentials), when it has one, as the metadata
`authorization: Bearer <token>`: set on the stub (`worker_stub`), so no call site can forget it, and never
taken from a client's request.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from kvroute.credentials import bearer_metadata
from kvroute.grpc_options import CLIENT_OPTIONS
from proto import worker_pb2, worker_pb2_grpc

RELEASE_GRACE_S = 600.0
_WORKER_METHODS = tuple(worker_pb2.DESCRIPTOR.services_by_name["Worker"].methods_by_name)


class _WithMetadata:
    """A stub method that sends `metadata` first on every call (a caller's own metadata follows)."""

    def __init__(self, method: Any, metadata: tuple[tuple[str, str], ...]) -> None:
        self._method = method
        self._metadata = metadata

    def __call__(self, request: Any, *, metadata: Any = None, **kwargs: Any) -> Any:
        return self._method(request, metadata=(*self._metadata, *(metadata or ())), **kwargs)


def worker_stub(channel: grpc.aio.Channel, token: str | None = None) -> worker_pb2_grpc.WorkerStub:
    """A `kvroute.v1.Worker` stub whose every method presents `token` (none: a plain stub)."""
    stub = worker_pb2_grpc.WorkerStub(channel)
    if token:
        metadata = bearer_metadata(token)
        for name in _WORKER_METHODS:
            setattr(stub, name, _WithMetadata(getattr(stub, name), metadata))
    return stub


class WorkerClients:
    """Stubs of the `kvroute.v1.Worker` service by address, over kept channels; each call presents `token`."""

    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}
        self._released: dict[asyncio.Task[None], grpc.aio.Channel] = {}  # closing once their calls end

    @property
    def addresses(self) -> frozenset[str]:
        """The addresses with an open channel."""
        return frozenset(self._channels)

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address, options=CLIENT_OPTIONS)
            self._channels[address] = channel
            stub = self._stubs[address] = worker_stub(channel, self.token)
        return stub

    def release(self, address: str) -> None:
        """No member has this address any more: its channel takes no new call and closes in the background
        once the calls still on it end (at most RELEASE_GRACE_S later: a worker that only missed heartbeats
        may still be streaming). A member at this address later gets a new channel. Call from the channels'
        event loop."""
        channel = self._channels.pop(address, None)
        self._stubs.pop(address, None)
        if channel is not None:
            closing = channel.close(grace=RELEASE_GRACE_S)
            task = asyncio.get_running_loop().create_task(closing, name=f"close channel {address}")
            self._released[task] = channel
            task.add_done_callback(lambda done: self._released.pop(done, None))

    async def close(self) -> None:
        """Close every channel, released ones too, cancelling the calls still on them (at shutdown)."""
        channels, self._channels, self._stubs = self._channels, {}, {}
        released = dict(self._released)
        for channel in [*channels.values(), *released.values()]:
            await channel.close()
        await asyncio.gather(*released, return_exceptions=True)
