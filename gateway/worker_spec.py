"""Worker specs: one string names a worker, the engine it runs and where its KV events come from (DESIGN §4).

    host:port                                   a kvroute worker (gRPC), as before
    kvroute://host:port                         the same, spelled out
    vllm://host:port?events=tcp://host:5557&replay=tcp://host:5558
    sglang://host:port?events=tcp://host:5557
    vllm://my-svc.ns.svc:8000?events=tcp://*:5557&replay=tcp://*:5558&discover=dns

`host:port` of a `vllm://` or `sglang://` spec is the engine's OpenAI HTTP server (`vllm serve --port`,
SGLang's `--port`). Query keys, each at most once:
  - `events`: the engine's ZMQ PUB endpoint (vLLM's `--kv-events-config` `endpoint`, with the pod's host in
    place of `*`). Without it the worker publishes no KV events the gateway can read: routed by load.
  - `replay`: the engine's ZMQ ROUTER replay endpoint (`replay_endpoint`), asked when a sequence skips.
  - `topic`: the topic the engine publishes under (vLLM's `topic`; default empty: every topic).
  - `metrics`: the URL of its Prometheus metrics (default `http://host:port/metrics`, where vLLM and
    SGLang serve them).
  - `discover=dns`: `host` is a DNS name whose every address is a worker (a Kubernetes headless Service),
    re-resolved on an interval; in `events`, `replay` and `metrics` the host `*` stands for each address.
  - `api_key_file`: a file holding the key the engine was started with (`vllm serve --api-key`, SGLang's
    `--api-key`), sent as `Authorization: Bearer` on every request to it (forwarding, /health, /metrics,
    /v1/models, /tokenize). Read once at the gateway's start (`read_api_key`); the key is never logged.
  - `dp=N`: the engine serves N data-parallel ranks behind its one HTTP address (`vllm serve
    --data-parallel-size N`, SGLang's `--dp-size N` with `--enable-dp-attention`). Each rank is its own
    cache and its own routing target (`ranks()`), worker id `host:port/dp<r>`: its events on the `events` and
    `replay` ports + r (where vLLM and SGLang publish rank r), its load from the metrics labelled with its
    rank, and its requests sent with `X-data-parallel-rank: r` (which vLLM and SGLang both honour). With
    `discover=dns`, every resolved address is such an engine: `address/dp<r>`.
  - `id`: the worker's id (letters, digits and `._:-`, at most 128), in place of its address: what the hash
    ring places sessions and prefixes by, and what `x-kvroute-worker` and the metrics' labels name. An engine
    whose address changes (a pod rescheduled; a StatefulSet's pod keeps its name, not its IP) keeps its place
    on the ring under a stable id. With `dp=N` its ranks are `<id>/dp<r>`. Not with `discover=dns`.
Only `tcp://` endpoints are accepted for `events` and `replay`. `ValueError` names the spec and what is wrong
(an unknown scheme, a bad port, an unknown or repeated query key, a query on a kvroute worker).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal
from urllib.parse import parse_qsl, urlsplit

Engine = Literal["kvroute", "vllm", "sglang"]
ENGINES: tuple[Engine, ...] = ("kvroute", "vllm", "sglang")
_QUERY_KEYS = ("events", "replay", "topic", "metrics", "discover", "api_key_file", "dp", "id")
MAX_ID_CHARS = 128
_ID_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-")
MAX_DATA_PARALLEL = 256


@dataclass(frozen=True)
class EngineTarget:
    """How an HTTP engine member is addressed beyond its address: the key it was started with (`--api-key`,
    sent as `Authorization: Bearer`; kept out of the repr, so never logged) and, for one data-parallel rank of
    an engine, that rank (sent as `X-data-parallel-rank`)."""

    api_key: str | None = field(default=None, repr=False)
    data_parallel_rank: int | None = None


@dataclass(frozen=True)
class WorkerSpec:
    """One worker (or, with `discover == "dns"`, a DNS name standing for many), as `--workers` names it."""

    engine: Engine
    host: str  # an address or a name; IPv6 without brackets
    port: int
    events: str | None = None  # ZMQ endpoint of its KV events (tcp://host:port)
    replay: str | None = None  # ZMQ endpoint of its replay socket
    topic: str = ""
    metrics: str | None = None  # its Prometheus metrics URL; None for kvroute workers (load comes over gRPC)
    discover: Literal["dns"] | None = None
    api_key_file: str | None = None  # the path only: the key is read by read_api_key
    data_parallel_size: int = 1
    data_parallel_rank: int | None = None  # set on the specs `ranks()` gives, for a DP engine
    name: str | None = None  # the spec's `id`; None: the worker is named by its address

    @property
    def worker_id(self) -> str:
        """The routing target's id: its `id` or else its address, with `/dp<r>` for rank r of a data-parallel
        engine."""
        base = self.name or self.address
        return base if self.data_parallel_rank is None else f"{base}/dp{self.data_parallel_rank}"

    def ranks(self) -> list[WorkerSpec]:
        """The routing targets of this engine: itself, or one spec per data-parallel rank (module docstring)."""
        if self.data_parallel_size == 1:
            return [self]

        def shifted(endpoint: str | None, rank: int) -> str | None:
            if endpoint is None:
                return None
            head, _, port = endpoint.rpartition(":")
            return f"{head}:{int(port) + rank}"

        return [
            replace(self, data_parallel_rank=r, events=shifted(self.events, r), replay=shifted(self.replay, r))
            for r in range(self.data_parallel_size)
        ]

    @property
    def address(self) -> str:
        """host:port, IPv6 in brackets (what a URL or a gRPC target takes)."""
        return f"{_bracketed(self.host)}:{self.port}"

    @property
    def base_url(self) -> str:
        """The engine's HTTP root (`http://host:port`)."""
        return f"http://{self.address}"

    def at(self, address: str) -> WorkerSpec:
        """This spec for one resolved address of a `discover=dns` name: `*` in its endpoints is `address`."""
        host = _bracketed(address)

        def fill(endpoint: str | None) -> str | None:
            return None if endpoint is None else endpoint.replace("://*:", f"://{host}:", 1)

        metrics = self.metrics or f"http://*:{self.port}/metrics"
        return replace(
            self, host=address, events=fill(self.events), replay=fill(self.replay), metrics=fill(metrics), discover=None
        )


def parse_worker_spec(text: str) -> WorkerSpec:
    """One spec (the module docstring's grammar). Raises ValueError naming the spec and the fault."""
    spec = text.strip()
    scheme, sep, _ = spec.partition("://")
    if not sep:
        host, port = _host_port(spec, spec)
        return WorkerSpec("kvroute", host, port)
    if scheme not in ENGINES:
        raise ValueError(f"worker {spec!r}: unknown engine {scheme!r}; expected one of {', '.join(ENGINES)}")
    parts = urlsplit(spec)
    if parts.path not in ("", "/") or parts.fragment:
        raise ValueError(f"worker {spec!r}: only host:port and a query may follow {scheme}://")
    host, port = _host_port(spec, parts.netloc)
    query: dict[str, str] = {}
    for key, value in parse_qsl(parts.query, keep_blank_values=True, strict_parsing=bool(parts.query)):
        if key not in _QUERY_KEYS:
            raise ValueError(f"worker {spec!r}: unknown query key {key!r}; expected {', '.join(_QUERY_KEYS)}")
        if key in query:
            raise ValueError(f"worker {spec!r}: query key {key!r} is given twice")
        query[key] = value
    if scheme == "kvroute":
        if query:
            raise ValueError(
                f"worker {spec!r}: a kvroute worker takes no query (its events come over gRPC, and it takes the "
                "gateway's --worker-token-file)"
            )
        return WorkerSpec("kvroute", host, port)
    discover = query.get("discover")
    if discover not in (None, "dns"):
        raise ValueError(f"worker {spec!r}: discover must be 'dns', got {discover!r}")
    for key in ("events", "replay"):
        if key in query:
            _zmq_endpoint(spec, key, query[key], wildcard=discover == "dns")
    if "replay" in query and "events" not in query:
        raise ValueError(f"worker {spec!r}: replay needs events")
    metrics = query.get("metrics")
    if metrics is not None and urlsplit(metrics).scheme not in ("http", "https"):
        raise ValueError(f"worker {spec!r}: metrics must be an http(s) URL, got {metrics!r}")
    if discover is None and any("://*:" in (query.get(k) or "") for k in ("events", "replay", "metrics")):
        raise ValueError(f"worker {spec!r}: the host * stands for a resolved address only with discover=dns")
    if query.get("api_key_file") == "":
        raise ValueError(f"worker {spec!r}: api_key_file names no file")
    dp = query.get("dp", "1")
    if not dp.isdigit() or not 1 <= int(dp) <= MAX_DATA_PARALLEL:
        raise ValueError(f"worker {spec!r}: dp must be an integer in [1, {MAX_DATA_PARALLEL}], got {dp!r}")
    name = query.get("id")
    if name is not None:
        if discover:
            raise ValueError(f"worker {spec!r}: id names one engine; with discover=dns each address is its own")
        if not name or len(name) > MAX_ID_CHARS or not set(name) <= _ID_CHARS:
            raise ValueError(f"worker {spec!r}: id must be 1 to {MAX_ID_CHARS} letters, digits or '._:-', got {name!r}")
    ports = {key: int(query[key].rpartition(":")[2]) for key in ("events", "replay") if key in query}
    for key, first in ports.items():
        if first + int(dp) - 1 > 65535:
            raise ValueError(f"worker {spec!r}: rank {int(dp) - 1}'s {key} port (the port + its rank) is past 65535")
    if len(ports) == 2 and abs(ports["events"] - ports["replay"]) < int(dp):
        raise ValueError(
            f"worker {spec!r}: rank r publishes on the events port + r and replays on the replay port + r, so with "
            f"dp={dp} the two ports must be at least {dp} apart"
        )
    return WorkerSpec(
        scheme, host, port, query.get("events"), query.get("replay"), query.get("topic", ""),
        metrics or (None if discover else f"http://{_bracketed(host)}:{port}/metrics"),
        "dns" if discover else None, query.get("api_key_file"), int(dp), name=name,
    )  # fmt: skip


def read_api_key(spec: WorkerSpec) -> str | None:
    """The key in the spec's `api_key_file` (surrounding whitespace dropped), None without one. ValueError names
    the file (never the key) when it cannot be read or holds no key."""
    if spec.api_key_file is None:
        return None
    try:
        key = Path(spec.api_key_file).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"worker {spec.engine}://{spec.address}: api_key_file {spec.api_key_file}: {exc}") from None
    if not key or any(c.isspace() for c in key):
        raise ValueError(
            f"worker {spec.engine}://{spec.address}: api_key_file {spec.api_key_file} must hold one key, no spaces"
        )
    return key


def parse_worker_specs(text: str) -> list[WorkerSpec]:
    """A comma-separated `--workers` list (empty items skipped); ValueError on a bad one, a repeated worker, or
    two engines under one worker id (`check_engine_ids`)."""
    specs = [parse_worker_spec(item) for item in text.split(",") if item.strip()]
    seen: set[tuple[str, str]] = set()
    for spec in specs:
        key = (spec.engine, spec.address)
        if key in seen:
            raise ValueError(f"worker {spec.engine}://{spec.address} is named twice in --workers")
        seen.add(key)
    check_engine_ids(specs)
    return specs


def check_engine_ids(specs: Sequence[WorkerSpec]) -> None:
    """ValueError naming two engines (vLLM / SGLang specs, each rank) whose worker ids are the same: an `id`
    given twice, or one equal to another engine's address."""
    ids: dict[str, WorkerSpec] = {}
    for spec in specs:
        if spec.engine == "kvroute":
            continue  # named by its own --worker-id, which the gateway learns from it
        for target in spec.ranks():
            other = ids.setdefault(target.worker_id, spec)
            if other is not spec:
                raise ValueError(
                    f"worker id {target.worker_id!r} is taken twice in --workers ({other.engine}://{other.address} "
                    f"and {spec.engine}://{spec.address})"
                )


def _host_port(spec: str, netloc: str) -> tuple[str, int]:
    host, sep, port = netloc.rpartition(":")
    if not sep or not host:
        raise ValueError(f"worker {spec!r}: expected host:port")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"worker {spec!r}: port must be in [1, 65535], got {port!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"worker {spec!r}: {host!r} in brackets is not an IPv6 address") from None
    elif ":" in host:
        raise ValueError(f"worker {spec!r}: write an IPv6 host in brackets ([::1]:8000)")
    if any(c in host for c in "/?#@ "):
        raise ValueError(f"worker {spec!r}: bad host {host!r}")
    return host, int(port)


def _zmq_endpoint(spec: str, key: str, endpoint: str, wildcard: bool) -> None:
    scheme, sep, rest = endpoint.partition("://")
    if scheme != "tcp" or not sep:
        raise ValueError(f"worker {spec!r}: {key} must be a tcp:// endpoint, got {endpoint!r}")
    host, port = _host_port(spec, rest)
    if host == "*" and not wildcard:
        raise ValueError(f"worker {spec!r}: the host * stands for a resolved address only with discover=dns")
    del port


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host
