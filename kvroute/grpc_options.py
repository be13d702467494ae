"""gRPC options shared by every kvroute server and client, so that the two ends agree by construction.

Message size: a prompt at the longest context we serve is well under 1 MiB of varints; 16 MiB leaves room for
the KV-event snapshot of a large cache (GetKVEvents).

Keepalive: a client (the gateway's channels to workers, a client of the gateway's gRPC port) pings every
`KEEPALIVE_TIME_MS`, with or without calls, so that a dead peer is found between requests within about
`KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS`. A server accepts pings `MIN_PING_INTERVAL_MS` apart or more,
without calls, and never answers them with GOAWAY "too_many_pings"; the client's interval is at least the
server's minimum (checked at import).
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 16 * 2**20
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 10_000
MIN_PING_INTERVAL_MS = 5_000
assert KEEPALIVE_TIME_MS >= MIN_PING_INTERVAL_MS, "clients would ping faster than servers accept"

Options = tuple[tuple[str, int], ...]

SERVER_OPTIONS: Options = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.max_ping_strikes", 0),
)

CLIENT_OPTIONS: Options = (
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # Reconnect soon after a worker restarts at the same address (gRPC's default backoff grows to 120 s).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
)


def grpc_address(host: str, port: int) -> str:
    """host:port for grpc's add_insecure_port and channels; a bare IPv6 host gets its brackets."""
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{port}"
