"""The wire's enums as the Python side names them, one map each way: finish reasons and KV event kinds.

The worker sends them (worker.service), the gateway's request path and embedded fleet state read them, and the
gateway's gRPC front door sends finish reasons on to its clients.
"""

from __future__ import annotations

from proto import worker_pb2

FINISH_REASONS = {
    "stop": worker_pb2.FINISH_REASON_STOP,
    "length": worker_pb2.FINISH_REASON_LENGTH,
    "abort": worker_pb2.FINISH_REASON_ABORT,
}
FINISH_REASON_NAMES = {value: name for name, value in FINISH_REASONS.items()}
KV_EVENT_KINDS = {
    "stored": worker_pb2.KVEvent.KIND_STORED,
    "removed": worker_pb2.KVEvent.KIND_REMOVED,
    "cleared": worker_pb2.KVEvent.KIND_CLEARED,
}
KV_EVENT_KIND_NAMES = {value: name for name, value in KV_EVENT_KINDS.items()}
