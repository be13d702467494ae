"""The engine fleet state: stock vLLM and SGLang servers (and kvroute workers beside them) as one fleet
(DESIGN §4, gateway.fleet.fleet_state's contract).

Members come from worker specs (gateway.worker_spec): a `kvroute` spec is polled over gRPC exactly as the
embedded fleet state does (gateway.fleet.embedded_fleet.WorkerPoller); a `vllm` / `sglang` spec by an
`EnginePoller` over the engine's own HTTP endpoints, every `poll_interval` seconds (default 0.25):

    GET /health ──► 200: it answers (`answering`)       anything else, or no answer: failing
    not a member yet ──► GET /v1/models (served name, max_model_len), the tokenizer canaries
        (POST /tokenize), the block size it reports (`vllm:cache_config_info`) ──► FleetBook.admit
    GET <metrics> ──► running, waiting, KV usage ──► FleetBook.report_load
        vLLM:   vllm:num_requests_running, vllm:num_requests_waiting, vllm:kv_cache_usage_perc
        SGLang: sglang:num_running_reqs,   sglang:num_queue_reqs,     sglang:token_usage
        (summed over the label sets an engine writes; KV usage: the largest; for one rank of a data-parallel
        engine, `dp=N` in its spec, only the samples of its rank: gateway.worker_spec)

Stated times, the embedded fleet's:
  - a worker whose health checks have failed for `unreachable_after` seconds (default 2.0) leaves, its
    requests lost: at most unreachable_after + http_timeout + poll_interval (3.25 s by default) after it
    stopped answering. `on_failure` (the request path could not reach it) checks it at once.
  - it rejoins at the first poll that answers, as a new incarnation (its old entries dropped).
  - an engine that restarted within that time is readmitted as a new incarnation (its old entries dropped,
    its requests in flight ended) when its KV-event sequence goes back to 0, or when the
    `process_start_time_seconds` on its metrics page changes (vLLM's and SGLang's pages carry it).
  - `answering`: a health check answered within 2 x (poll_interval + http_timeout) = 2.5 s.

Parity, before a worker's cached prefixes count (FleetBook.admit's rule: a mismatch is logged once per
incarnation, counted in `kvroute:gateway_parity_mismatches`, and the worker is routed by load only):
  - tokenizer: the engine's `/tokenize` on `CANARIES` (plain texts with its special tokens, and a chat
    through its chat template; SGLang's `/tokenize` takes no messages, so for SGLang the plain texts only)
    must give the gateway's own ids; an engine that cannot answer is unverified, which counts as a mismatch.
    An engine that serves no `/tokenize` (404 or 405: NVIDIA Dynamo's frontend) but names an `events`
    endpoint is checked from its own KV events instead (`EventParity`): each canary, behind a random prefix
    so that none of it is cached, goes to it as a one-token completion or chat, and the `token_ids` of the
    `BlockStored` events it publishes for it must be the gateway's ids for that request's full blocks.
  - blocks: the block size it reports (vLLM's `vllm:cache_config_info`) must be the gateway's; an engine
    that reports none is taken at the gateway's (its events' block size is checked again per event).
  The hash itself cannot differ: the gateway re-hashes the token ids the events carry with its own hash.

No KV events: a worker is flagged `no_kv_events` (logged once, counted in `kvroute:gateway_no_kv_events`,
shown in `x-kvroute-route` as `flags=no_kv_events`, routed by load) when its spec names no `events`
endpoint (at once), or when it was sent a prompt of at least one full block `no_events_after` seconds ago
(default 10) and no KV event has arrived from it since it joined. The flag clears when its first event
arrives. (An engine started without `--kv-events-config` is the common cause.)

DNS (`discover=dns`): the name is resolved at start and every `resolve_interval` seconds (default 5): each
address is a worker (its spec with `*` replaced, gateway.worker_spec.WorkerSpec.at); an address that
disappears leaves at once, its requests going on (a pod being replaced drains), and its per-worker state
(poller, KV entries, counters: FleetBook.forget) goes with it, so churning pod IPs grow nothing; a resolution
that fails keeps the workers it had (logged once until it succeeds again).
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import socket
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, cast

import httpx
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from gateway.fleet.embedded_fleet import PollLoop, PollOptions, WorkerPoller, stop_pollers
from gateway.fleet.fleet_state import BookkeepingFleetState, FleetBook, FleetIdentity
from gateway.routing.fleet_view import FleetView
from gateway.routing.kv_index import DEFAULT_MEDIUM_WEIGHTS, BlockKey, weighted_depth
from gateway.worker_spec import EngineTarget, WorkerSpec, read_api_key
from kvroute.engine_kv_events import BlockStored, EngineHash, KVEventDecodeError, decode_batch
from kvroute.hashing import BlockHash, hash_fingerprint
from kvroute.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# (running, waiting, KV usage in [0, 1]) per engine, as their Prometheus endpoints name them.
LOAD_METRICS = {
    "vllm": ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"),
    "sglang": ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"),
}
CANARIES: tuple[str | list[dict[str, str]], ...] = (
    "The quick brown fox jumps over the lazy dog; 1234567890 times.",
    "naïve café, 東京タワー 🙂\n\tcode: def f(x): return x ** 2",
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 12 + 30? Answer in one word."},
    ],
)
START_TIME = "process_start_time_seconds"  # prometheus_client's, on vLLM's and SGLang's pages: a change is a restart
UNVERIFIED = "unverified"  # the tokenizer fingerprint of an engine whose /tokenize could not be compared
MAX_METRICS_BYTES = 4 * 1024 * 1024
# The most KV blocks an engine's word is taken for when its KV-event map is sized (a 64 M-token cache of 16):
# the map's memory, and the pause of its own resizes under churn, grow with it.
MAX_ENGINE_BLOCKS = 1 << 22
NOT_SERVED = (404, 405)  # an engine's answer to a path it does not serve (FastAPI's, axum's)
CANARY_EVENTS_WAIT_S = 2.0  # after its answer, how long a canary's BlockStored events may take to arrive


class EventSource(Protocol):
    """A worker's KV-event subscriber (gateway.fleet.engine_events): feeds the book, says when it last heard."""

    last_event_at: float | None  # time.monotonic() of the last event applied; None: none yet

    @property
    def parity_failed(self) -> bool:
        """An event's block size did not fit the pool's: its events are dropped."""

    @property
    def weights(self) -> Mapping[BlockHash, float]:
        """Its blocks held only on offloaded tiers -> their weight (< 1)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


# (spec, worker id, book, on_restart, options, capacity) -> the worker's subscriber, started when it joins, stopped
# when it leaves. `capacity`: the KV blocks the engine says it has, None where it does not say.
EventSourceFactory = Callable[
    [WorkerSpec, str, FleetBook, Callable[[str], None], "EngineOptions", int | None], EventSource
]
Resolver = Callable[[str, int], Awaitable[list[str]]]


@dataclass(frozen=True)
class EngineOptions:
    """`medium_weights`: what a cached block a worker (an engine, or a kvroute worker with a host KV tier) holds only
    on an offloaded tier is worth to the router,
    by vLLM's `medium` name (`{"CPU": 0.5, "DISK": 0.25}`; a GPU block is worth 1, a tier not named 0: its
    blocks are not scored; DEFAULT_MEDIUM_WEIGHTS where the routing config names none, `{}` to score none). A
    worker's match is the sum of its leading blocks' weights, in whole blocks (rounded down), so a prefix half
    on the CPU at 0.5 counts three quarters of its blocks."""

    poll_interval: float = 0.25
    unreachable_after: float = 2.0
    http_timeout: float = 1.0
    no_events_after: float = 10.0
    resolve_interval: float = 5.0
    medium_weights: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_MEDIUM_WEIGHTS))

    @classmethod
    def from_routing_config(cls, options: dict[str, Any]) -> EngineOptions:
        """The engine keys of a routing config (`medium_weights`), taken out of `options`; ValueError names a
        bad one."""
        from gateway.fleet.engine_events import check_medium_weights

        weights = options.pop("medium_weights", dict(DEFAULT_MEDIUM_WEIGHTS))
        if not isinstance(weights, dict):
            raise ValueError("--routing-config: medium_weights must be an object of tier -> weight")
        check_medium_weights(weights)
        return cls(medium_weights=weights)


def subscribe(
    spec: WorkerSpec,
    worker_id: str,
    book: FleetBook,
    on_restart: Callable[[str], None],
    options: EngineOptions,
    capacity: int | None = None,
) -> EventSource:
    """The default EventSourceFactory: gateway.fleet.engine_events' ZMQ subscriber to the spec's endpoints. Its
    map of the engine's blocks is bounded at the engine's capacity where that is above the default (an engine
    never holds more live blocks than that; offloaded tiers make it more than its GPU's), up to a ceiling an
    engine's say-so cannot pass."""
    from gateway.fleet.engine_events import DEFAULT_MAX_BLOCKS, EngineEventSource, EngineEventSubscriber

    source = EngineEventSource(worker_id, spec.events, spec.replay, spec.topic, spec.data_parallel_rank or 0)
    max_blocks = min(max(DEFAULT_MAX_BLOCKS, capacity or 0), MAX_ENGINE_BLOCKS)
    return EngineEventSubscriber(
        book, source, on_restart=on_restart, max_blocks=max_blocks, medium_weights=options.medium_weights
    )


async def resolve_all(host: str, port: int) -> list[str]:
    """Every address `host` resolves to (A and AAAA records), sorted, each once."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


class EnginePoller(PollLoop):
    """Keeps one vLLM / SGLang server's membership, load and KV-event subscriber in a FleetBook."""

    def __init__(
        self,
        spec: WorkerSpec,
        book: FleetBook,
        client: httpx.AsyncClient,
        tokenizer: Tokenizer,
        options: EngineOptions,
        events: EventSourceFactory,
        api_key: str | None = None,
    ) -> None:
        super().__init__(spec.worker_id, options.poll_interval)
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.spec = spec
        self.worker_id = spec.worker_id
        self.target = EngineTarget(api_key, spec.data_parallel_rank)
        self.book = book
        self.client = client
        self.tokenizer = tokenizer
        self.options = options
        self.events_factory = events
        self.source: EventSource | None = None
        self.awaiting_since: float | None = None  # first prompt of >= 1 block sent this incarnation
        self.silent = False  # flagged no_kv_events
        self.started: float | None = None  # its process_start_time_seconds, where its metrics have it
        self._failing_since: float | None = None
        self._stopping: set[asyncio.Task[None]] = set()

    async def close(self) -> None:
        await self._stop_source()

    async def poll_once(self) -> None:
        """One round: health, membership (with parity), load, the no-events check. Never raises for the
        engine's failure; it counts it."""
        try:
            health = await self.client.get(
                f"{self.spec.base_url}/health", headers=self.headers, timeout=self.options.http_timeout
            )
            if health.status_code != 200:
                raise _Failing(f"/health answered {health.status_code}")
            member = self.book.member(self.worker_id)
            if member is None:
                await self._join()
            else:
                self.book.heard(member.worker_id, member.incarnation)
            await self._report_load()
            self._failing_since = None
        except (_Failing, httpx.HTTPError, OSError) as exc:
            self._on_failure(_why(exc))
            return
        self._check_events()

    def on_dispatch(self, prompt_blocks: int) -> None:
        if prompt_blocks and self.awaiting_since is None:
            self.awaiting_since = time.monotonic()

    def leave(self, reason: str, lost: bool) -> None:
        if self.book.member(self.worker_id) is not None:
            self.book.leave(self.worker_id, reason, lost=lost)
        self.awaiting_since, self.silent = None, False

    async def _join(self) -> None:
        models = await self._json("GET", "/v1/models")
        data = models.get("data") if isinstance(models, dict) else None
        if not data or not isinstance(data[0], dict) or not isinstance(data[0].get("id"), str):
            raise _Failing("/v1/models lists no model")
        served, max_model_len = data[0]["id"], data[0].get("max_model_len")
        if not isinstance(max_model_len, int) or max_model_len < 1:
            max_model_len = 2**31 - 1  # the engine says none: it refuses an over-long request itself
        identity = self.book.identity
        cache = await self._cache_config()
        block_size = cache.block_size or identity.block_size
        tokenizer_fingerprint = await self._tokenizer_parity(served, block_size)
        incarnation = secrets.randbits(63)
        await self._stop_source()
        self.book.admit(
            self.worker_id, self.spec.address, incarnation, served, block_size, max_model_len,
            hash_fingerprint(identity.model_id, block_size), tokenizer_fingerprint, self.spec.engine,
        )  # fmt: skip
        self.awaiting_since, self.silent, self.started = None, False, None
        if self.spec.events is None:
            self._flag_silent("its spec names no events= endpoint")
        else:
            self.source = self.events_factory(
                self.spec, self.worker_id, self.book, self._restarted, self.options, cache.num_blocks
            )
            await self.source.start()

    def _restarted(self, worker_id: str) -> None:
        """The engine's event sequence went back to 0: it restarted. It is readmitted as a new incarnation
        (its entries dropped, its requests in flight ended as lost), as a kvroute worker's restart is."""
        member = self.book.member(worker_id)
        if member is None:
            return
        self.book.admit(
            worker_id, member.address, secrets.randbits(63), member.model_id, member.block_size,
            member.max_model_len, member.hash_fingerprint, member.tokenizer_fingerprint, member.engine,
        )  # fmt: skip
        self.awaiting_since = None

    async def _tokenizer_parity(self, served: str, block_size: int) -> str:
        """The gateway's tokenizer fingerprint if the engine's /tokenize (or, without one, its KV events)
        agrees on every canary, else a fingerprint that differs from it (the reason logged)."""
        for canary in CANARIES:
            if self.spec.engine == "sglang" and not isinstance(canary, str):
                continue  # SGLang's /tokenize takes a prompt only: its chat template cannot be compared
            if isinstance(canary, str):
                body: dict[str, Any] = {"model": served, "prompt": canary, "add_special_tokens": True}
                ours = self.tokenizer.encode(canary, add_special_tokens=True)
            else:
                body = {"model": served, "messages": canary, "add_generation_prompt": True}
                ours = self.tokenizer.encode_chat(canary, True)
            try:
                answer = await self._json("POST", "/tokenize", body)
            except _NotServed as exc:
                if self.spec.events is None:
                    logger.warning("fleet: %s: cannot check its tokenizer (%s, and no events= endpoint to check it "
                                   "from): routed by load", self.worker_id, exc)  # fmt: skip
                    return UNVERIFIED
                return await EventParity(self, served, block_size).check()
            except _Failing as exc:
                logger.warning("fleet: %s: cannot check its tokenizer (%s): routed by load", self.worker_id, exc)
                return UNVERIFIED
            theirs = answer.get("tokens") if isinstance(answer, dict) else None
            if theirs != ours:
                first = next((i for i, (a, b) in enumerate(zip(ours, theirs or [], strict=False)) if a != b), None)
                logger.warning(
                    "fleet: %s tokenizes a canary differently (%d ids here, %s there; first difference at %s)",
                    self.worker_id, len(ours), len(theirs) if isinstance(theirs, list) else "none", first,
                )  # fmt: skip
                return f"engine-mismatch-{self.worker_id}"
        return self.book.identity.tokenizer_fingerprint

    async def _cache_config(self) -> CacheConfig:
        """The block size and capacity (GPU and CPU blocks) the engine's `vllm:cache_config_info` says."""
        text = await self._metrics_text()
        for sample in _samples(text, ("vllm:cache_config_info",)) if text is not None else ():
            labels = sample.labels
            size = labels.get("block_size", "")
            blocks = [int(labels[k]) for k in ("num_gpu_blocks", "num_cpu_blocks") if labels.get(k, "").isdigit()]
            return CacheConfig(int(size) if size.isdigit() else None, sum(blocks) if blocks else None)
        return CacheConfig(None, None)

    async def _report_load(self) -> None:
        member = self.book.member(self.worker_id)
        text = await self._metrics_text()
        if member is None or text is None:
            return
        running_name, waiting_name, usage_name = LOAD_METRICS[self.spec.engine]
        running = waiting = usage = 0.0
        started = None
        rank = self.spec.data_parallel_rank
        for sample in _samples(text, (*LOAD_METRICS[self.spec.engine], START_TIME)):
            if not math.isfinite(sample.value) or sample.value < 0:
                continue
            if rank is not None and sample.name != START_TIME and not _of_rank(sample.labels, rank):
                continue
            if sample.name == START_TIME:
                started = sample.value
            elif sample.name == running_name:
                running += sample.value
            elif sample.name == waiting_name:
                waiting += sample.value
            elif sample.name == usage_name:
                usage = max(usage, sample.value)
        if started is not None and self.started is not None and started != self.started:
            logger.warning("fleet: %s restarted (its process start time changed): its entries are dropped",
                           self.worker_id)  # fmt: skip
            self._restarted(self.worker_id)
            member = self.book.member(self.worker_id) or member
        self.started = started
        self.book.report_load(member.worker_id, member.incarnation, int(running), int(waiting), min(usage, 1.0))

    async def _metrics_text(self) -> str | None:
        """The engine's metrics page, None when it serves none (the worker stays, routed on own counts)."""
        url = self.spec.metrics or f"{self.spec.base_url}/metrics"
        try:
            response = await self.client.get(url, headers=self.headers, timeout=self.options.http_timeout)
        except httpx.HTTPError:
            return None
        if response.status_code != 200 or len(response.content) > MAX_METRICS_BYTES:
            return None
        return response.text

    async def _json(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        try:
            response = await self.client.request(
                method, f"{self.spec.base_url}{path}", json=body, headers=self.headers,
                timeout=self.options.http_timeout,
            )  # fmt: skip
        except httpx.HTTPError as exc:
            raise _Failing(f"{path}: {_why(exc)}") from None
        if response.status_code in NOT_SERVED:
            raise _NotServed(f"{path} answered {response.status_code}")
        if response.status_code != 200:
            raise _Failing(f"{path} answered {response.status_code}")
        try:
            return response.json()
        except ValueError:
            raise _Failing(f"{path} answered no JSON") from None

    def _check_events(self) -> None:
        if self.book.member(self.worker_id) is None or self.spec.events is None:
            return
        heard = self.source is not None and self.source.last_event_at is not None
        if heard and self.silent:
            self.silent = False
            logger.info("fleet: %s publishes KV events now; its cached prefixes are scored", self.worker_id)
        elif not heard and not self.silent and self.awaiting_since is not None:
            waited = time.monotonic() - self.awaiting_since
            if waited >= self.options.no_events_after:
                self._flag_silent(f"it was sent prompts of full blocks {waited:.0f} s ago and published no KV event")

    def _flag_silent(self, why: str) -> None:
        self.silent = True
        counters = self.book.counters
        counters.no_kv_events[self.worker_id] = counters.no_kv_events.get(self.worker_id, 0) + 1
        if self.spec.events is None:
            hint = "add its events= endpoint to the spec, and start it with --kv-events-config"
        else:
            hint = f"was it started with --kv-events-config, and is {self.spec.events} reachable?"
        logger.warning(
            "fleet: worker %s publishes no KV events (%s; %s): routed by load only", self.worker_id, why, hint
        )

    def _on_failure(self, why: str) -> None:
        now = time.monotonic()
        if self._failing_since is None:
            self._failing_since = now
            if self.book.member(self.worker_id) is not None:
                logger.info("fleet: worker %s failed a health check: %s", self.worker_id, why)
        if now - self._failing_since >= self.options.unreachable_after:
            if self.book.member(self.worker_id) is not None:
                self.leave(f"unreachable at {self.spec.address} for {now - self._failing_since:.1f} s ({why})", True)
                task = asyncio.get_running_loop().create_task(self._stop_source(), name=f"unsubscribe {self.worker_id}")
                self._stopping.add(task)  # referenced until done: a task nobody holds may be collected mid-way
                task.add_done_callback(self._stopping.discard)

    async def _stop_source(self) -> None:
        source, self.source = self.source, None
        if source is not None:
            await source.stop()


class CacheConfig(NamedTuple):
    """What an engine's metrics say of its KV cache; None where they do not say."""

    block_size: int | None
    num_blocks: int | None


class _Failing(Exception):
    """The engine did not answer a check as a live one does."""


class _NotServed(_Failing):
    """The engine does not serve that path at all."""


class EventParity:
    """Tokenizer parity from an engine's own KV events, for an engine without `/tokenize` (module docstring).

    `check()` subscribes to the engine's events for the while, sends each canary and returns the gateway's
    tokenizer fingerprint when the engine stored exactly the gateway's ids for every one, else a differing
    fingerprint (the reason logged: other ids stored, or nothing published for it). A canary goes at most
    twice, the second time only if nothing at all arrived (a subscription still on its way)."""

    def __init__(self, poller: EnginePoller, served: str, block_size: int) -> None:
        self.poller = poller
        self.served = served
        self.block_size = block_size
        self.chains: dict[EngineHash, list[int]] = {}  # engine block hash -> the token ids up to its end
        self.stored = 0  # BlockStored events seen

    async def check(self) -> str:
        poller = self.poller
        sock = zmq.asyncio.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, poller.spec.topic.encode())
        try:
            sock.connect(poller.spec.events or "")
            for canary in CANARIES:
                verdict = await self._canary(sock, canary)
                if verdict is not None:
                    logger.warning("fleet: %s serves no /tokenize and %s: routed by load", poller.worker_id, verdict)
                    return UNVERIFIED if self.stored == 0 else f"engine-mismatch-{poller.worker_id}"
        except (_Failing, zmq.ZMQError) as exc:
            logger.warning("fleet: %s: cannot check its tokenizer from its KV events (%s): routed by load",
                           poller.worker_id, _why(exc))  # fmt: skip
            return UNVERIFIED
        finally:
            sock.close(linger=0)
        logger.info("fleet: %s serves no /tokenize; its KV events hold the gateway's ids for every canary",
                    poller.worker_id)  # fmt: skip
        return poller.book.identity.tokenizer_fingerprint

    async def _canary(self, sock: zmq.asyncio.Socket, canary: str | list[dict[str, str]]) -> str | None:
        """None when the engine stored the gateway's ids for the canary's full blocks, else why not."""
        for _ in range(2):
            path, body, ours = self._request(canary, f"parity check {secrets.token_hex(8)}: ")
            expected = ours[: len(ours) // self.block_size * self.block_size]
            stored_before = self.stored
            await self.poller._json("POST", path, {**body, "model": self.served, "max_tokens": 1})
            deadline = time.monotonic() + CANARY_EVENTS_WAIT_S
            while (left := deadline - time.monotonic()) > 0:
                if not await sock.poll(left * 1000):
                    break
                if self._holds(await sock.recv_multipart(), expected):
                    return None
            if self.stored > stored_before:
                return f"stored other token ids than the gateway's {len(expected)} for a canary"
        return "published no KV event for a canary"

    def _request(self, canary: str | list[dict[str, str]], unique: str) -> tuple[str, dict[str, Any], list[int]]:
        """The canary behind `unique` (first, so its first block is new to the engine), repeated until it
        fills at least two blocks: its path, body and the gateway's ids for it."""
        tokenizer = self.poller.tokenizer
        body: dict[str, Any]
        for repeat in range(1, 65):
            if isinstance(canary, str):
                text = unique + canary * repeat
                path, body = "/v1/completions", {"prompt": text}
                ours = tokenizer.encode(text, add_special_tokens=True)
            else:
                messages = [{**canary[0], "content": unique + canary[0]["content"] * repeat}, *canary[1:]]
                path, body = "/v1/chat/completions", {"messages": messages}
                ours = tokenizer.encode_chat(messages, True)
            if len(ours) >= 2 * self.block_size:
                break
        return path, body, ours

    def _holds(self, frames: list[bytes], expected: list[int]) -> bool:
        """Applies one message's BlockStored events to the chains; whether a chain now starts with `expected`."""
        if len(frames) != 3:
            return False
        try:
            batch = decode_batch(frames[2])
        except KVEventDecodeError:
            return False
        found = False
        for event in batch.events:
            if not isinstance(event, BlockStored):
                continue
            self.stored += 1
            if event.parent_block_hash is None:
                before: list[int] = []
            elif event.parent_block_hash in self.chains:
                before = self.chains[event.parent_block_hash]
            else:
                continue  # it continues a prefix stored before this check began
            tokens = before + list(event.token_ids)
            for i, block_hash in enumerate(event.block_hashes):
                self.chains[block_hash] = tokens[: len(before) + (i + 1) * event.block_size]
            found = found or tokens[: len(expected)] == expected
        return found


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


def _of_rank(labels: dict[str, str], rank: int) -> bool:
    """A sample of data-parallel rank `rank`'s load: labelled with it (vLLM's `engine`, SGLang's `dp_rank`
    label), or labelled with no rank at all (an engine that writes one series for every rank)."""
    value = labels.get("engine", labels.get("dp_rank"))
    return value is None or value == str(rank)


def _samples(text: str, names: tuple[str, ...]) -> list[Any]:
    """The samples of the series `names` on a text-format metrics page. Only their lines are parsed: an
    engine's page is mostly histograms, and parsing all of it at every poll would cost a gateway core."""
    lines = [line for line in text.splitlines() if line.startswith(names)]
    try:
        return [
            sample for family in text_string_to_metric_families("\n".join(lines) + "\n") for sample in family.samples
        ]
    except (ValueError, TypeError, IndexError) as exc:
        logger.debug("fleet: an engine's metrics page does not parse: %s", exc)
        return []


class _DnsGroup:
    """The workers behind one `discover=dns` name: one EnginePoller per resolved address, or with `dp=N` one
    per address and rank (`WorkerSpec.ranks` of that address's spec)."""

    def __init__(self, spec: WorkerSpec, make: Callable[[WorkerSpec], EnginePoller], resolve: Resolver) -> None:
        self.spec = spec
        self.make = make
        self.resolve = resolve
        self.pollers: dict[tuple[str, int | None], EnginePoller] = {}  # by resolved address and rank
        self.by_id: dict[str, EnginePoller] = {}  # the same, by worker id
        self.tasks: dict[tuple[str, int | None], asyncio.Task[None]] = {}
        self._failed = False

    async def refresh(self, start_tasks: bool) -> None:
        try:
            addresses = set(await self.resolve(self.spec.host, self.spec.port))
        except OSError as exc:
            if not self._failed:
                self._failed = True
                logger.warning("fleet: cannot resolve %s (%s); keeping its %d workers", self.spec.host, exc,
                               len(self.pollers))  # fmt: skip
            return
        self._failed = False
        known = {address for address, _ in self.pollers}
        for key in sorted(k for k in self.pollers if k[0] not in addresses):
            poller = self.pollers.pop(key)
            self.by_id.pop(poller.worker_id, None)
            task = self.tasks.pop(key, None)
            await stop_pollers([poller], [task] if task else [])
            poller.leave(f"{key[0]} is no longer an address of {self.spec.host}", lost=False)
            await poller.close()
            poller.book.forget(poller.worker_id)
        for address in sorted(addresses - known):
            for target in self.spec.at(address).ranks():
                key = (address, target.data_parallel_rank)
                poller = self.pollers[key] = self.make(target)
                self.by_id[poller.worker_id] = poller
                await poller.poll_once()
                if start_tasks:
                    self.tasks[key] = asyncio.create_task(poller.run(), name=f"poll {poller.worker_id}")

    def start_tasks(self) -> None:
        for key, poller in self.pollers.items():
            if key not in self.tasks:
                self.tasks[key] = asyncio.create_task(poller.run(), name=f"poll {poller.worker_id}")

    async def stop(self) -> None:
        await stop_pollers(list(self.pollers.values()), list(self.tasks.values()))
        self.tasks = {}
        await asyncio.gather(*(p.close() for p in self.pollers.values()))


class EngineFleetState(BookkeepingFleetState):
    """A fleet of vLLM / SGLang servers and kvroute workers from worker specs (the module docstring).

    `start()` checks every worker once (so those that answer are members when it returns) and then keeps
    polling each in the background; `stop()` ends the polling, the subscribers and the HTTP client.
    `events`: makes each engine worker's KV-event subscriber when it joins (default: `subscribe`, over
    ZMQ). `resolve`: host, port -> addresses, for
    `discover=dns` specs (default: the system resolver). `token`: what kvroute workers are shown. ValueError
    names a spec whose `api_key_file` cannot be read. `engine_target(worker_id)`: that engine's key and rank, for
    the HTTP backend (gateway.forwarding.backends.HttpBackend)."""

    def __init__(
        self,
        specs: Sequence[WorkerSpec],
        identity: FleetIdentity,
        tokenizer: Tokenizer,
        *,
        options: EngineOptions | None = None,
        events: EventSourceFactory = subscribe,
        resolve: Resolver = resolve_all,
        token: str | None = None,
    ) -> None:
        super().__init__(identity)
        self.options = options or EngineOptions()
        o = self.options
        self.answer_window = 2 * (o.poll_interval + o.http_timeout)
        self._client = httpx.AsyncClient(limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))
        grpc_options = PollOptions(o.poll_interval, o.unreachable_after, o.http_timeout, 4096, 0)
        keys = {s.api_key_file: read_api_key(s) for s in specs if s.api_key_file is not None}

        def make(spec: WorkerSpec) -> EnginePoller:
            key = keys.get(spec.api_key_file) if spec.api_key_file is not None else None
            return EnginePoller(spec, self.book, self._client, tokenizer, o, events, key)

        self.grpc_pollers = [WorkerPoller(s.address, self.book, grpc_options, token) for s in specs
                             if s.engine == "kvroute"]  # fmt: skip
        self.engine_pollers = [
            make(r) for s in specs if s.engine != "kvroute" and s.discover is None for r in s.ranks()
        ]
        self._static = {p.worker_id: p for p in self.engine_pollers}
        self.dns_groups = [_DnsGroup(s, make, resolve) for s in specs if s.discover == "dns"]
        self._tasks: list[asyncio.Task[Any]] = []

    async def start(self) -> None:
        await asyncio.gather(
            *(p.poll_once() for p in [*self.grpc_pollers, *self.engine_pollers]),
            *(group.refresh(start_tasks=False) for group in self.dns_groups),
        )
        self._tasks = [asyncio.create_task(p.run(), name=f"poll {p.address}") for p in self.grpc_pollers]
        self._tasks += [asyncio.create_task(p.run(), name=f"poll {p.worker_id}") for p in self.engine_pollers]
        for group in self.dns_groups:
            group.start_tasks()
        if self.dns_groups:
            self._tasks.append(asyncio.create_task(self._resolve_loop(), name="dns discovery"))

    async def _resolve_loop(self) -> None:
        while True:
            await asyncio.sleep(self.options.resolve_interval)
            for group in self.dns_groups:
                try:
                    await group.refresh(start_tasks=True)
                except Exception:  # discovery that died would freeze membership: log and go on
                    logger.exception("fleet: DNS discovery of %s failed", group.spec.host)

    async def stop(self) -> None:
        pollers: list[WorkerPoller | EnginePoller] = [*self.grpc_pollers, *self.engine_pollers]
        await stop_pollers(pollers, self._tasks)
        self._tasks = []
        for group in self.dns_groups:
            await group.stop()
        await asyncio.gather(*(p.close() for p in pollers))
        await self._client.aclose()

    def on_dispatch(self, worker_id: str, prompt_blocks: int = 0) -> None:
        self.book.on_dispatch(worker_id)
        poller = self._engine_poller(worker_id)
        if poller is not None:
            poller.on_dispatch(prompt_blocks)

    def on_failure(self, worker_id: str) -> None:
        poller: Any = self._engine_poller(worker_id)
        if poller is None:
            poller = next((p for p in self.grpc_pollers if p.worker_id == worker_id), None)
        if poller is not None:
            poller.wake()

    def flags(self, worker_id: str) -> tuple[str, ...]:
        poller = self._engine_poller(worker_id)
        flags = super().flags(worker_id)
        if poller is None:
            return flags
        if poller.source is not None and poller.source.parity_failed and not flags:
            flags = ("parity_mismatch",)
        return (*flags, "no_kv_events") if poller.silent else flags

    def engine_target(self, worker_id: str) -> EngineTarget | None:
        """How to address an engine member (its key, its data-parallel rank), for the HTTP backend; None for
        a worker this fleet state does not poll as an engine."""
        poller = self._engine_poller(worker_id)
        return poller.target if poller is not None else None

    def view(self) -> FleetView:
        """The book's view; while any engine holds blocks only on an offloaded tier, with its index scoring
        each leading block at its weight (EngineOptions.medium_weights)."""
        view = self.book.fleet
        weights = {p.worker_id: p.source.weights for p in self._all_engine_pollers() if p.source and p.source.weights}
        if not weights:
            return view
        return FleetView(view.replicas, view.loads, WeightedKVIndex(view.kv_index, weights))

    def _all_engine_pollers(self) -> list[EnginePoller]:
        return [*self.engine_pollers, *(p for g in self.dns_groups for p in g.pollers.values())]

    def _engine_poller(self, worker_id: str) -> EnginePoller | None:
        poller = self._static.get(worker_id)
        if poller is None and self.dns_groups:
            poller = next((g.by_id[worker_id] for g in self.dns_groups if worker_id in g.by_id), None)
        return poller


class WeightedKVIndex:
    """A fleet KV index whose `match` scores each leading block a worker holds only on an offloaded tier at
    that tier's weight: the worker's depth less (1 - weight) per such block, rounded down to whole blocks (the
    router reads depths as block counts). `weights`: worker id -> its offloaded blocks' weights. The rest of
    the index (holders, narrowing for a retry) reads through."""

    def __init__(self, index: Any, weights: Mapping[str, Mapping[BlockHash, float]]) -> None:
        self.index = index
        self.replicas = index.replicas
        self.weights = weights

    def match(self, block_hashes: Sequence[BlockKey]) -> list[int]:
        matched = list(self.index.match(block_hashes))
        hashes = cast(Sequence[BlockHash], block_hashes)  # an engine fleet's index holds our block hashes
        for i, replica in enumerate(self.replicas):
            weights, depth = self.weights.get(replica), matched[i]
            if weights and depth:
                matched[i] = weighted_depth(hashes, depth, weights)
        return matched

    def narrowed(self, replicas: Sequence[str]) -> WeightedKVIndex:
        return WeightedKVIndex(self.index.narrowed(replicas), self.weights)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.index, name)
