"""gRPC channels to workers: one `grpc.aio` channel per worker address, opened on first use and kept.

A channel multiplexes every request to its worker over one HTTP/2 connection, so the cost of a request is
one stream, not a connection. Channels belong to the event loop that created them; `close()` at shutdown.
Keepalive pings find a dead connection within ~20 s even when no request is running on it.
"""

from __future__ import annotations

import grpc

from proto import worker_pb2_grpc

# As the worker's server: a prompt at the longest context is well under this in varints.
MAX_MESSAGE_BYTES = 16 * 2**20
CHANNEL_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect soon after a worker restarts at the same address (gRPC's default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2_000),
)


class WorkerClients:
    """Stubs of the `kvroute.v1.Worker` service by address, over kept channels."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._stubs: dict[str, worker_pb2_grpc.WorkerStub] = {}

    def stub(self, address: str) -> worker_pb2_grpc.WorkerStub:
        stub = self._stubs.get(address)
        if stub is None:
            channel = grpc.aio.insecure_channel(address, options=CHANNEL_OPTIONS)
            self._channels[address] = channel
            stub = self._stubs[address] = worker_pb2_grpc.WorkerStub(channel)
        return stub

    async def close(self) -> None:
        """Close every channel (at shutdown)."""
        channels, self._channels, self._stubs = self._channels, {}, {}
        for channel in channels.values():
            await channel.close()
