"""Traces the replay reads: Mooncake-format JSONL (optionally gzipped) and token-id traces.

Mooncake lines: {"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]},
one prefix-chained id per 512-token block of the prompt, the last (usually partial) block included; optionally
"tenant" (a name), "weight" (its fair share, > 0) and "priority" (its band, an integer as vLLM's `priority`):
who sends it and how urgent it is, for the gateway's flow control (sim.replay: `--flow-control on`).
Token-id traces come from sim.workloads: token ids, the known answer's ids (so the engine's cache
of a turn's answer can serve the next turn), a session/app id and the tenant's cache salt.
"""

from __future__ import annotations

import gzip
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from gateway.request import PRIORITY_RANGE

MOONCAKE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace that cannot be read; the message names the file line or the field."""


@dataclass(frozen=True)
class TraceRequest:
    arrival_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...] = ()  # Mooncake: one prefix-chained id per 512-token block
    token_ids: tuple[int, ...] = ()  # token-id traces: the prompt
    output_token_ids: tuple[int, ...] = ()  # the answer, when the trace knows it (multi-turn chat)
    session_id: str | None = None  # app / conversation: the unit of the first-divergence histogram
    cache_salt: str = ""  # the tenant's salt (token-id traces)
    # who sends it and how urgent it is, for the gateway's flow control (sim.replay: ReplayConfig.flow_control)
    tenant: str = "default"
    weight: float = 1.0  # the tenant's fair-share weight
    band: int = 0  # its priority as the gateway clamps it (lower is more urgent)


@dataclass(frozen=True)
class Trace:
    name: str
    kind: Literal["mooncake", "tokens"]
    block_size: int  # tokens per cacheable block: 512 for Mooncake, the replay's block size otherwise
    requests: tuple[TraceRequest, ...]

    @property
    def input_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)


def read_mooncake(path: str | Path) -> Trace:
    """Read a Mooncake JSONL trace (.gz by suffix); requests are ordered by timestamp (stable)."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such file")
    opener = gzip.open if path.suffix == ".gz" else open
    requests = []
    try:
        with opener(path, "rt", encoding="utf-8") as lines:
            for number, line in enumerate(lines, start=1):
                if line.strip():
                    requests.append(parse_mooncake_line(line, number))
    except (OSError, UnicodeDecodeError, EOFError) as exc:
        raise TraceError(f"{path}: cannot read: {exc}") from exc
    if not requests:
        raise TraceError(f"{path}: no requests")
    requests.sort(key=lambda r: r.arrival_ms)
    return Trace(path.name, "mooncake", MOONCAKE_BLOCK_TOKENS, tuple(requests))


def json_object_line(line: str, number: int, error: type[Exception] = TraceError) -> dict:
    """Line `number` of a JSON-lines file as its object; raises `error` naming the line otherwise."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise error(f"line {number}: not valid JSON ({exc.msg})") from None
    if not isinstance(record, dict):
        raise error(f"line {number}: expected a JSON object")
    return record


def parse_mooncake_line(line: str, number: int) -> TraceRequest:
    record = json_object_line(line, number)
    timestamp = _field(record, "timestamp", number, (int, float))
    input_length = _field(record, "input_length", number, (int,))
    output_length = _field(record, "output_length", number, (int,))
    hash_ids = _field(record, "hash_ids", number, (list,))
    if timestamp < 0 or not math.isfinite(timestamp):
        raise TraceError(f"line {number}: timestamp must be a finite number >= 0, got {timestamp}")
    if input_length < 1:
        raise TraceError(f"line {number}: input_length must be >= 1, got {input_length}")
    if output_length < 0:
        raise TraceError(f"line {number}: output_length must be >= 0, got {output_length}")
    if not all(type(h) is int for h in hash_ids):
        raise TraceError(f"line {number}: hash_ids must be a list of integers")
    expected = math.ceil(input_length / MOONCAKE_BLOCK_TOKENS)
    if len(hash_ids) != expected:
        raise TraceError(
            f"line {number}: hash_ids has {len(hash_ids)} ids, but input_length {input_length} "
            f"needs ceil({input_length}/{MOONCAKE_BLOCK_TOKENS}) = {expected}"
        )
    tenant = record.get("tenant", "default")
    if not isinstance(tenant, str) or not tenant:
        raise TraceError(f"line {number}: field 'tenant' must be a non-empty string, got {tenant!r}")
    weight = record.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (math.isfinite(weight) and weight > 0):
        raise TraceError(f"line {number}: field 'weight' must be a number > 0, got {weight!r}")
    priority = record.get("priority", 0)
    if type(priority) is not int or not PRIORITY_RANGE[0] <= priority <= PRIORITY_RANGE[1]:
        bounds = list(PRIORITY_RANGE)
        raise TraceError(f"line {number}: field 'priority' must be an integer in {bounds}, got {priority!r}")
    return TraceRequest(
        float(timestamp), input_length, output_length, hash_ids=tuple(hash_ids), tenant=tenant, weight=float(weight),
        band=priority,
    )  # fmt: skip


def _field(record: dict, name: str, number: int, types: tuple[type, ...]):
    if name not in record:
        raise TraceError(f"line {number}: missing field {name!r}")
    value = record[name]
    if isinstance(value, bool) or not isinstance(value, types):
        kind = " or ".join(t.__name__ for t in types)
        raise TraceError(f"line {number}: field {name!r} must be {kind}, got {value!r}")
    return value
