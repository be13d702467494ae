"""The request path: one request from an API key to a stream of text, top to bottom (DESIGN §1, §4).

    GatewayRequest (from a front door)
      1. auth          API key -> Tenant (401)                                   gateway.admission.auth
      2. limits        n, max_tokens, stop strings; tenant concurrency (429)     gateway.admission.limits
      3. prompt        chat template + tokenize (typed special tokens stay text), or the prompt's ids;
                       in the prompt pool off the event loop (short ones on it), refused past
                       max_prompt_tokens (before tokenizing where its length proves it)   kvroute.tokenizer
      4. hash          block hashes with the tenant's salt (the client's mixed in under it)
      4b. flow control wait in the gateway, by priority band and tenant fair share, until a worker can
                       admit the request now (429/503 past a queue bound); the worker re-picked
                       when it leaves the queue (off: `flow_control=None`)            gateway.flow_control
      5. route         policy.pick(request, fleet.view(), exclude)               gateway.routing.router
      6. forward       over the worker's backend (kvroute gRPC, or vLLM / SGLang OpenAI HTTP in the
                       engine's own API); before its first message a failed worker is retried on
                       another (backoff, breaker)                                gateway.forwarding.backends,
                                                                                 gateway.forwarding.retry
      7. detokenize    incremental, stop strings across token boundaries (a kvroute worker's token ids;
                       an HTTP engine sends text it cut at stop strings itself)  gateway.request_stream
    Generation: route known (the first token has come), then Chunks per choice, then usage.

`n` choices are n worker requests. The first is routed; the others go to the same worker once the first
has its first token, so they find its prompt's blocks cached; if a later one fails, or the client leaves
before every choice has its first token, every worker request already opened is ended. From the first token
on, the stream is gateway.request_stream's (StreamingGeneration): nothing is retried, and closing it early
cancels every worker request it holds, which frees their blocks on the workers.

Every worker request is watched while the gateway waits on it (one watchdog task, a tick of 0.2 s):
  - past its deadline (gateway.forwarding.retry.StreamDeadlines) on a worker that no longer answers its fleet state,
    or past the cap on one that does, it ends: before its first token it is retried on another worker,
    after it the stream ends with UpstreamError naming the worker (an error event, then `[DONE]`);
  - when its worker leaves the fleet with its requests lost (fleet `watch_membership`: it stopped
    answering, died or restarted; not when it drains), it ends the same way at once;
  - `end_streams(message)` (the gateway's drain deadline, a second signal) ends every one with
    NoWorkerAvailable(message), code `gateway_shutting_down`, and starts no worker request after.
Ending one cancels its backend call (gRPC: the call; HTTP: the connection), which frees its blocks on the worker.

Errors before any output are GatewayErrors raised from `generate` (the front door answers with their
status). Nothing here logs prompt text unless `log_prompts` is set.

One request costs its own latency only: the cheap checks come first (auth, limits, the tenant's concurrency
slot), and templating and tokenizing a prompt of more than INLINE_PROMPT_CHARS characters, hashing more than
INLINE_HASH_TOKENS ids and writing more than INLINE_DETOKENIZE_IDS ids out as text (/detokenize) run in a
bounded thread pool (the tokenizer releases the GIL while it works), so a multi-megabyte prompt neither stalls
the event loop nor costs anything once its tenant is at its limit; shorter ones run on the loop. /tokenize and
/detokenize hold the tenant's slot as a generation does.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import grpc
from opentelemetry import trace

from gateway import structured_request, tracing
from gateway.admission.auth import Authenticator, cache_salt
from gateway.admission.limits import RETRY_AFTER_SECONDS, Limits, TenantConcurrency
from gateway.errors import (
    ContextLengthExceeded,
    GatewayError,
    InvalidRequestError,
    ModelNotFound,
    NoWorkerAvailable,
    RateLimited,
    UpstreamError,
    quoted,
)
from gateway.fleet.fleet_state import FleetIdentity, FleetState, WorkerMember
from gateway.flow_control.config import FlowControlConfig
from gateway.flow_control.dispatcher import Grant, queued_bytes
from gateway.flow_control.stage import FlowControl
from gateway.forwarding.backends import Backend, EngineDelta, ForwardJob, GrpcBackend, HttpBackend
from gateway.forwarding.retry import CircuitBreakers, RetryPolicy, StreamDeadlines
from gateway.metrics import GatewayMetrics, label_value
from gateway.request import GatewayRequest, Generation, RouteInfo, Tenant, TokenizeResult
from gateway.request_stream import Finished, StreamEnded, StreamingGeneration, WorkerStream
from gateway.routing.fleet_view import FleetView
from gateway.routing.router import NoReplicaAvailable, RouteDecision, RouteRequest, RoutingPolicy
from gateway.worker_client import WorkerClients
from kvroute.chat_template import ChatTemplateError
from kvroute.hashing import DEFAULT_BLOCK_SIZE, block_hashes, hash_fingerprint
from kvroute.sampling import InvalidRequest
from kvroute.tokenizer import PromptTooLong, Tokenizer
from proto import worker_pb2

logger = logging.getLogger(__name__)
T = TypeVar("T")

# The worker refused the request itself: sending it elsewhere cannot help.
_CLIENT_FAULTS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}
# The worker is full: try another, but it is healthy (no breaker failure).
_BUSY = {grpc.StatusCode.RESOURCE_EXHAUSTED}
WATCH_TICK_S = 0.2  # how often the watchdog looks at the open worker requests
SHUTTING_DOWN = "gateway_shutting_down"  # the error code of a stream ended by the gateway's own shutdown
# Threads that template and tokenize prompts: the tokenizer uses one core per prompt, and a tenant's requests
# beyond its concurrency never reach the pool; more prompts than threads wait their turn in the pool's queue.
PROMPT_THREADS = max(2, min(8, os.cpu_count() or 1))
# A prompt of at most this many characters of text is templated and tokenized on the event loop: handing it
# to the pool and back costs more CPU than the work (docs/gateway.md, "CPU efficiency"), and its cold encode
# holds the loop for well under a millisecond.
INLINE_PROMPT_CHARS = 2048
# Past these many token ids, hashing a prompt's blocks (about 0.5 ms at 8,192) and writing ids out as text (about
# 1 ms at 1,024) go to the prompt pool too.
INLINE_HASH_TOKENS = 8192
INLINE_DETOKENIZE_IDS = 1024
# /tokenize requests whose prompts wait for the pool at once, beyond which one is refused (429): the pool is the
# one generation templates its prompts in, and a tokenizer client is not to queue ahead of them without bound.
TOKENIZE_BACKLOG = 2 * PROMPT_THREADS


@dataclasses.dataclass(frozen=True)
class PreparedPrompt:
    """A request past auth, validation, template and tokenizer: what routing needs."""

    tenant: Tenant
    salt: str  # the tenant's cache salt, the client's mixed in under it
    prompt_ids: list[int]
    hashes: list[bytes]  # the prompt's full blocks, chained with the salt (kvroute.hashing)


def fleet_identity(model_id: str, tokenizer: Tokenizer, block_size: int = DEFAULT_BLOCK_SIZE) -> FleetIdentity:
    """What this gateway hashes and tokenizes with; a worker must match it to be scored on its KV entries."""
    return FleetIdentity(model_id, block_size, hash_fingerprint(model_id, block_size), tokenizer.fingerprint)


class RequestPath:
    """What both front doors call: `generate(request) -> Generation`, `ready()`, and the drain at shutdown.
    `kvroute_backend`: what kvroute workers are forwarded over (default: gRPC, `GrpcBackend`; a worker's own
    front door passes one that calls its engine in process)."""

    def __init__(
        self,
        fleet: FleetState,
        policy: RoutingPolicy,
        tokenizer: Tokenizer,
        model_id: str,
        served_model_name: str,
        auth: Authenticator,
        limits: Limits,
        metrics: GatewayMetrics,
        *,
        block_size: int = DEFAULT_BLOCK_SIZE,
        retry: RetryPolicy | None = None,
        breakers: CircuitBreakers | None = None,
        clients: WorkerClients | None = None,
        http_backend: HttpBackend | None = None,
        kvroute_backend: Backend | None = None,
        deadlines: StreamDeadlines | None = None,
        log_prompts: bool = False,
        concurrency: TenantConcurrency | None = None,
        aliases: Sequence[str] = (),
        flow_control: FlowControlConfig | None = None,
    ) -> None:
        self.fleet = fleet
        self.policy = policy
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.served_model_name = served_model_name  # what responses name as their `model`
        self.served_model_names = (served_model_name, *aliases)  # what requests may name (vLLM's several names)
        self.auth = auth
        self.limits = limits
        self.metrics = metrics
        self.block_size = block_size
        self.retry = retry or RetryPolicy()
        self.breakers = breakers or CircuitBreakers()
        self.clients = clients or WorkerClients()
        http = http_backend or HttpBackend()
        # by WorkerMember.engine: what each worker is forwarded over
        self.backends: dict[str, Backend] = {
            "kvroute": kvroute_backend or GrpcBackend(self.clients), "vllm": http, "sglang": http,
        }  # fmt: skip
        self.deadlines = deadlines or StreamDeadlines()
        self.log_prompts = log_prompts
        self.concurrency = concurrency or TenantConcurrency(limits)  # shared by the pools of one gateway
        self._prompt_pool = ThreadPoolExecutor(PROMPT_THREADS, thread_name_prefix="kvroute-prompt")
        self._tokenize_backlog = 0  # /tokenize jobs in the prompt pool or its queue
        self.vocab_size = tokenizer.vocab_size
        self.identity = fleet_identity(model_id, tokenizer, block_size)
        self.draining = False
        self.active = 0  # Generations not yet closed
        self._starting = 0  # `generate` calls not yet returned (routing, waiting for a first token)
        self._idle = asyncio.Event()
        self._idle.set()
        self._open_streams: dict[str, set[WorkerStream]] = {}  # worker id -> its requests not yet done
        self._watchdog: asyncio.Task[None] | None = None
        self._shutdown: str | None = None  # end_streams' message: no worker request starts after it
        # None: flow control off (`--flow-control off`), every request picked and sent at once as before it
        self.flow: FlowControl | None = None
        if flow_control is not None:
            self.flow = FlowControl(
                flow_control, fleet.view, self._pick, self.breakers.blocked, metrics, block_size
            )  # fmt: skip
        metrics.watch(lambda: getattr(fleet, "counters", None), self.breakers.states)
        fleet.watch_membership(self._member_changed)

    def _pick(self, request: RouteRequest, fleet: FleetView, exclude: frozenset[str]) -> RouteDecision:
        return self.policy.pick(request, fleet, exclude)  # the policy in force (a SIGHUP may replace it)

    # -- health and shutdown ------------------------------------------------------------------------------

    def routable_workers(self) -> int:
        """How many workers can take a request now: in the fleet and not behind an open breaker; 0 while
        draining."""
        if self.draining:
            return 0
        blocked = self.breakers.blocked()
        return sum(r not in blocked for r in self.fleet.view().replicas)

    def ready(self) -> bool:
        """At least one worker can take a request now (and the gateway is not draining)."""
        return self.routable_workers() > 0

    def members(self) -> list[WorkerMember]:
        return self.fleet.members()

    def start_draining(self) -> None:
        """Refuse new requests (503, so a load balancer retries another gateway); in-flight ones go on."""
        self.draining = True

    async def wait_drained(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for every request to end (those still before their first token
        included); True if they all did."""
        # asyncio.timeout, not wait_for: 3.11's wait_for can swallow a cancel (a second signal's).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        return self._idle.is_set()

    def end_streams(self, message: str) -> int:
        """End every worker request now, each with NoWorkerAvailable(`message`) (code `gateway_shutting_down`):
        a started stream gets it as its error event then `[DONE]` (gRPC: UNAVAILABLE), a request waiting for
        its first token gets it as its 503; no worker request starts after this. Returns how many requests
        were open. Their front doors close them as they write the error: `wait_drained` sees them go."""
        self._shutdown = message
        if self.flow is not None:
            self.flow.end_queued(message)
        for streams in list(self._open_streams.values()):
            for stream in list(streams):
                self._end(stream, NoWorkerAvailable(message, code=SHUTTING_DOWN), worker_fault=False)
        return self.active + self._starting

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.wait({self._watchdog})
            self._watchdog = None
        if self.flow is not None:
            await self.flow.close()
        for backend in {id(b): b for b in self.backends.values()}.values():
            await backend.close()
        self._prompt_pool.shutdown(wait=False, cancel_futures=True)

    def _member_changed(self, old: WorkerMember, lost: bool) -> None:
        """A worker left, restarted or moved: its breaker's history no longer applies, a channel to an
        address no member has any more is closed, and when its requests are `lost` they end now."""
        self.breakers.forget(old.worker_id)
        if lost:
            for stream in list(self._open_streams.get(old.worker_id, ())):
                if stream.incarnation == old.incarnation:
                    error = UpstreamError(
                        f"worker {old.worker_id} left the fleet (it stopped answering, died or restarted)"
                    )
                    self._end(stream, error, worker_fault=True)
        if all(member.address != old.address for member in self.fleet.members()):
            self.backends[old.engine].release(old.address)
        if self.flow is not None:
            self.flow.forget(old.worker_id)  # waiting requests are picked afresh when they leave the queue

    # -- the watchdog over open worker requests ---------------------------------------------------------------

    def _end(self, stream: WorkerStream, error: GatewayError, worker_fault: bool) -> None:
        """End a worker request from outside its reader: the reader's pending (or next) read raises
        StreamEnded with `error`. `worker_fault`: the worker is at fault (retry, breaker failure)."""
        if stream.ended is None and not stream.done:
            stream.ended = StreamEnded(error, worker_fault)
            stream.call.cancel()

    async def _watch(self) -> None:
        """End the worker requests that are overdue (StreamDeadlines); returns once none is open (`_send`
        starts it again)."""
        while self._open_streams:
            await asyncio.sleep(WATCH_TICK_S)
            try:
                self._end_overdue(time.monotonic())
            except Exception:  # a dead watchdog would leave hung streams hanging: log and go on
                logger.exception("the stream watchdog failed")

    def _end_overdue(self, now: float) -> None:
        for worker_id, streams in list(self._open_streams.items()):
            answering = functools.partial(self.fleet.answering, worker_id)
            for stream in list(streams):
                if stream.waiting_since is None or stream.ended is not None:
                    continue
                why = self.deadlines.overdue(now - stream.waiting_since, stream.first is not None, answering)
                if why is not None:
                    logger.info("request %s choice %d: worker %s %s", stream.request_id, stream.choice, worker_id, why)
                    self._end(
                        stream, UpstreamError(f"worker {worker_id} {why}", code="worker_timeout"), worker_fault=True
                    )

    # -- the path -----------------------------------------------------------------------------------------

    async def generate(self, request: GatewayRequest) -> Generation:
        """Route and start `request`; returns once its worker has sent the first token. Raises a GatewayError
        (nothing was sent to the client yet) for a bad request, a refused key, a limit, or no worker."""
        self._starting += 1
        self._idle.clear()
        try:
            return await self._generate(request)
        except GatewayError as exc:
            self.metrics.errors.labels(type(exc).__name__).inc()
            raise
        finally:
            self._starting -= 1
            if self.active == 0 and self._starting == 0:
                self._idle.set()

    async def _generate(self, request: GatewayRequest) -> Generation:
        arrival = time.perf_counter()
        if self.draining:
            raise NoWorkerAvailable("the gateway is shutting down; send the request again", retry_after=1.0)
        prepared = await self.prepare(request)  # from here the tenant's concurrency slot is held
        tenant, salt, prompt_ids, hashes = prepared.tenant, prepared.salt, prepared.prompt_ids, prepared.hashes
        request_id = uuid.uuid4().hex
        span = tracing.start_request_span(request_id, request, self.served_model_name)
        streams: list[WorkerStream] = []
        grant: Grant | None = None
        priority = tenant.clamped_priority(request.priority)
        band = None if self.flow is None else priority
        try:
            params = request.params
            structured = structured_request.structured_output(request)
            if structured is not params.structured:
                params = dataclasses.replace(params, structured=structured)
            forward = _Forward(
                request_id, request, prompt_ids, salt, hashes, params, tracing.worker_trace_context(span),
                request.max_tokens_defaulted, span, priority=priority,
            )  # fmt: skip
            route_request = RouteRequest(
                request_id, hashes, len(prompt_ids), request.session_id, request.conversation_worker
            )
            grant = await self.wait_for_worker(request, prepared, route_request)
            first, route = await self._open(forward, route_request, choice=0, arrival=arrival, grant=grant)
            if grant is not None and self.flow is not None:
                self.flow.started(grant)
            streams.append(first)
            if request.n > 1:
                streams += await self._open_more(forward, route_request, request.n, prefer=route.worker_id)
        except BaseException as exc:
            for stream in streams:  # the first choice streams on while a later one failed or the client left
                stream.call.cancel()
                self.end_dispatch(stream)
            self.concurrency.release(tenant)
            if isinstance(exc, GatewayError):
                span.set_status(trace.StatusCode.ERROR, exc.message)
                if band is not None:
                    self._judge_slo(band, None)
            span.end()
            raise
        finally:
            if grant is not None:
                grant.close()
        now = time.perf_counter()
        self.metrics.time_to_first_token.observe(now - arrival)
        self.metrics.requests.labels(route.policy, route.reason).inc()
        self.metrics.observe_prefix(tenant, request.app, hashes, route.matched_blocks, self.block_size)
        tracing.record_route(span, route)
        if logger.isEnabledFor(logging.INFO):
            prompt = f" prompt={self.tokenizer.decode(prompt_ids)!r}" if self.log_prompts else ""
            logger.info(
                "request %s tenant=%s prompt_tokens=%d -> %s (%s)%s",
                request_id, tenant.name, len(prompt_ids), route.worker_id, route.header(), prompt,
            )  # fmt: skip
        self.active += 1
        self.metrics.in_flight.set(self.active)
        self._idle.clear()
        return StreamingGeneration(
            self, request, tenant, request_id, route, prompt_ids, streams, span, arrival, band
        )  # fmt: skip

    async def wait_for_worker(
        self, request: GatewayRequest, prepared: PreparedPrompt, route_request: RouteRequest
    ) -> Grant | None:
        """Step 4b, flow control (None when it is off): wait until a worker can admit the request; its Grant names
        the worker to try first. Raises GatewayError (429, 503: gateway.flow_control.stage)."""
        if self.flow is None:
            return None
        band = prepared.tenant.clamped_priority(request.priority)
        size = queued_bytes(len(request.api_json or b""), len(prepared.prompt_ids), len(prepared.hashes))
        max_tokens = request.params.max_tokens * request.n
        return await self.flow.admit(route_request, prepared.tenant, band, max_tokens, size)

    async def prepare(self, request: GatewayRequest) -> PreparedPrompt:
        """Steps 1-4 of the path, the part every front door shares (the endpoint picker included): the tenant,
        the model, the limits, the tenant's concurrency slot (429; taken before the prompt's expensive work, so
        a tenant at its limit costs no more), the prompt's token ids (templated and tokenized in the prompt pool)
        and their block hashes. Raises a GatewayError (401, 404, 400, 429) holding nothing; on success the
        caller holds the tenant's slot and must release it once (`concurrency.release(prepared.tenant)`),
        however the request ends."""
        tenant = self.auth.authenticate(request.api_key)
        self._check_model(request.model)
        self.limits.check_request(request)
        try:
            request.params.validate()
        except InvalidRequest as exc:
            raise InvalidRequestError(str(exc).removeprefix(f"{exc.field}: "), param=exc.field) from None
        structured_request.check(request)
        salt = cache_salt(tenant, request.client_cache_salt)
        self.concurrency.acquire(tenant)
        prompt_ids = await self._prompt_token_ids(request, salt, tenant)  # on an error, the slot is released
        hash_blocks = functools.partial(
            block_hashes, prompt_ids, model_id=self.model_id, cache_salt=salt, block_size=self.block_size
        )
        hashes = await self._off_loop(hash_blocks, tenant, inline=len(prompt_ids) <= INLINE_HASH_TOKENS)
        return PreparedPrompt(tenant, salt, prompt_ids, hashes)

    async def _prompt_token_ids(
        self, request: GatewayRequest, salt: str, tenant: Tenant, backlog: bool = False
    ) -> list[int]:
        """The prompt's ids within `max_prompt_tokens` (InvalidRequestError or ContextLengthExceeded naming the
        field): given ids are checked here, text is templated and tokenized in the prompt pool (`_off_loop`:
        raising, the tenant's slot is released). `salt` scopes the tokenizer's memory of text runs (one tenant
        never times another's). `backlog`: the job counts against TOKENIZE_BACKLOG (a /tokenize request)."""
        if request.prompt_token_ids is not None:
            return await self._off_loop(functools.partial(self._checked_token_ids, request.prompt_token_ids), tenant)
        try:
            _check_prompt_fields(request)
        except GatewayError:
            self.concurrency.release(tenant)
            raise
        tokenize = functools.partial(self._tokenize, request, salt)
        return await self._off_loop(tokenize, tenant, inline=_small_prompt(request), backlog=backlog)

    async def _off_loop(
        self, work: Callable[[], T], tenant: Tenant, *, inline: bool = True, backlog: bool = False
    ) -> T:
        """`work()`, on the event loop when `inline`, else in the prompt pool. Raising, it releases the tenant's
        slot; if the caller is cancelled while the pool works, only once that work ends (a client that leaves
        and sends again cannot pile up work its limit would refuse)."""
        job = None
        try:
            if inline:
                return work()
            if backlog and self._tokenize_backlog >= TOKENIZE_BACKLOG:
                raise RateLimited(
                    f"this gateway's {TOKENIZE_BACKLOG} /tokenize requests are being tokenized; retry shortly",
                    retry_after=RETRY_AFTER_SECONDS,
                )
            job = asyncio.get_running_loop().run_in_executor(self._prompt_pool, work)
            if backlog:
                self._tokenize_backlog += 1
                job.add_done_callback(self._tokenize_done)
            return await asyncio.shield(job)
        except BaseException:
            if job is not None and not job.done():  # cancelled: the pool still works on it
                job.add_done_callback(lambda _: self.concurrency.release(tenant))
            else:
                self.concurrency.release(tenant)
            raise

    def _tokenize_done(self, _: object) -> None:
        self._tokenize_backlog -= 1

    def _tokenize(self, request: GatewayRequest, salt: str) -> list[int]:
        """Template and tokenize `request`'s text (in the prompt pool), refused past the prompt-length limit
        before it is tokenized whole when its length proves it (kvroute.tokenizer.Tokenizer.tokens_at_least: a
        bound that never refuses a prompt that fits)."""
        limit = self.limits.max_prompt_tokens
        field = "messages" if request.messages is not None else "prompt"
        try:
            if request.messages is not None:
                kwargs = dict(request.template_kwargs)
                add_generation_prompt = bool(kwargs.pop("add_generation_prompt", True))
                if request.tools is not None:
                    kwargs["tools"] = request.tools
                ids = self.tokenizer.encode_chat(
                    request.messages, add_generation_prompt, cache_scope=salt, max_tokens=limit, **kwargs
                )
                if request.add_special_tokens:
                    ids = self.tokenizer.add_special_tokens(ids)
            else:
                # A completion's prompt is the client's whole text (it may spell the template itself), as in vLLM.
                add_special_tokens = request.add_special_tokens is not False
                ids = self.tokenizer.encode(
                    request.prompt or "", add_special_tokens=add_special_tokens, max_tokens=limit
                )
        except PromptTooLong as exc:
            raise ContextLengthExceeded(
                f"the prompt has {exc.count} tokens; this gateway accepts at most {limit}", param=field
            ) from None
        except (ChatTemplateError, TypeError) as exc:
            raise InvalidRequestError(str(exc), param=field) from None
        if not ids:
            raise InvalidRequestError("is empty; send at least one token", param=field)
        return ids

    def _checked_token_ids(self, given: Sequence[int]) -> list[int]:
        """A token-level client's ids: the length first (a list past the limit is not scanned), then the vocabulary."""
        field = "prompt_token_ids"
        if not given:
            raise InvalidRequestError("is empty; send at least one token", param=field)
        if len(given) > self.limits.max_prompt_tokens:
            raise ContextLengthExceeded(
                f"the prompt has {len(given)} tokens; this gateway accepts at most {self.limits.max_prompt_tokens}",
                param=field,
            )
        ids = list(given)
        if min(ids) < 0 or max(ids) >= self.tokenizer.vocab_size:
            bad = next(t for t in ids if not 0 <= t < self.tokenizer.vocab_size)
            raise InvalidRequestError(
                f"token id {bad} is outside the vocabulary [0, {self.tokenizer.vocab_size})", param=field
            )
        return ids

    def pool(self, model: str | None) -> RequestPath:
        """The path that serves `model` (None: this one): itself, or ModelNotFound (404)."""
        self._check_model(model)
        return self

    def pools(self) -> list[RequestPath]:
        return [self]

    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise ModelNotFound(f"the model {quoted(model)} does not exist", param="model")

    # -- vLLM's /tokenize and /detokenize -------------------------------------------------------------------

    async def tokenize(self, request: GatewayRequest, *, backlog: bool = True) -> TokenizeResult:
        """The prompt ids `generate` would send for `request`, after the same checks (the key, the model, the
        chat template, the prompt-length limit) and without routing: what vLLM's /tokenize answers, and what a
        router compares with an engine's to check tokenizer parity. It holds a tenant's concurrency slot while it
        works (429 at the limit), and a long prompt is tokenized in the prompt pool as for `generate`, at most
        TOKENIZE_BACKLOG of them at once (429 past it; without `backlog`, a prompt rendered for a generation
        that follows, as /v1/responses renders a conversation, is not counted there). Raises GatewayError."""
        tenant = self.auth.authenticate(request.api_key)
        self._check_model(request.model)
        salt = cache_salt(tenant, request.client_cache_salt)
        self.concurrency.acquire(tenant)
        ids = await self._prompt_token_ids(request, salt, tenant, backlog=backlog)  # an error releases the slot
        self.concurrency.release(tenant)
        return TokenizeResult(ids, self.max_model_len())

    async def detokenize(self, api_key: str | None, model: str | None, token_ids: Sequence[int]) -> str:
        """The text of `token_ids`, special tokens written out (vLLM's /detokenize). At most as many ids as
        a sequence holds (max_prompt_tokens + max_tokens), each in the vocabulary; raises GatewayError. It holds
        a tenant's concurrency slot while it works; past INLINE_DETOKENIZE_IDS ids it works in the prompt pool."""
        tenant = self.auth.authenticate(api_key)
        self._check_model(model)
        limit = self.limits.max_prompt_tokens + self.limits.max_tokens
        if len(token_ids) > limit:
            raise InvalidRequestError(f"has {len(token_ids)} token ids; at most {limit} here", param="tokens")
        for i, token_id in enumerate(token_ids):
            if not 0 <= token_id < self.vocab_size:
                raise InvalidRequestError(
                    f"token id {token_id} is outside the vocabulary [0, {self.vocab_size})", param=f"tokens[{i}]"
                )
        self.concurrency.acquire(tenant)
        decode = functools.partial(self.tokenizer.decode, token_ids, skip_special_tokens=False)
        text = await self._off_loop(decode, tenant, inline=len(token_ids) <= INLINE_DETOKENIZE_IDS)
        self.concurrency.release(tenant)
        return text

    def max_model_len(self) -> int:
        """The longest sequence every matching worker takes (the smallest of their contexts); without one,
        the gateway's own prompt-token limit."""
        contexts = [m.max_model_len for m in self.fleet.members() if m.parity_ok]
        return min(contexts) if contexts else self.limits.max_prompt_tokens

    async def _open(
        self,
        forward: _Forward,
        route_request: RouteRequest,
        choice: int,
        arrival: float,
        prefer: str | None = None,
        grant: Grant | None = None,
    ) -> tuple[WorkerStream, RouteInfo]:
        """Send one choice's worker request and wait for its first message, retrying another worker on a
        failure before it (at most `retry.retries` times). `prefer`: a worker to try first (a later choice
        goes where the first one went). `grant`: flow control's leave, its pick tried first (and told when a
        worker request is sent)."""
        decided = grant.decision if grant is not None else None
        failed: list[str] = []
        busy = 0
        last_error = ""
        attempts = 0
        for attempt in range(self.retry.retries + 1):
            if attempt:
                await asyncio.sleep(self.retry.backoff(attempt))
            if self._shutdown is not None:
                raise NoWorkerAvailable(self._shutdown, code=SHUTTING_DOWN)
            exclude = self.breakers.blocked().union(failed) if failed else self.breakers.blocked()
            fleet = self.fleet.view()
            if decided is not None and decided.replica in fleet.index_of and decided.replica not in exclude:
                decision = decided
            elif prefer is not None and prefer in fleet.index_of and prefer not in exclude:
                decision = RouteDecision(prefer, "same-request")
            else:
                try:
                    decision = self.policy.pick(route_request, fleet, exclude)
                except NoReplicaAvailable:
                    break
            prefer = decided = None
            member = self.fleet.member(decision.replica)
            if member is None:  # left between the view and now
                failed.append(decision.replica)
                continue
            self._check_context(forward, member)
            attempts += 1
            if choice == 0 and attempts == 1:
                self.metrics.routing_latency.observe(time.perf_counter() - arrival)
                # Once per request, when it is first sent (RoutingPolicy's contract): a burst of requests that
                # arrive together must each see the ones before it, not wait for their first tokens.
                self.policy.observe(route_request, decision)
            stream = self._send(forward, member, choice)
            if grant is not None:
                grant.sent()
            first = await self._first_message(stream, forward.request)
            if isinstance(first, _Failed):
                busy += first.cause == "busy"
                failed.append(member.worker_id)
                last_error = first.message
                if attempt < self.retry.retries:
                    self.metrics.retries.labels(first.cause).inc()
                left = self.retry.retries - attempt
                logger.warning(
                    "request %s choice %d: %s; %d retries left", forward.request_id, choice, last_error, left
                )
                continue
            stream.first = first
            skipped = tuple(dict.fromkeys((*failed, *decision.skipped)))
            route = RouteInfo(
                member.worker_id, member.address, self.policy.name, decision.reason, decision.matched_blocks,
                skipped, attempts, self.fleet.flags(member.worker_id),
            )  # fmt: skip
            return stream, route
        if busy and busy == attempts:
            raise RateLimited(f"every worker tried is at capacity ({last_error})", retry_after=RETRY_AFTER_SECONDS)
        if attempts:
            raise NoWorkerAvailable(f"no worker could take the request after {attempts} attempts; last: {last_error}")
        if self.fleet.view().replicas:
            raise NoWorkerAvailable("every live worker's circuit breaker is open; retry shortly", retry_after=1.0)
        raise NoWorkerAvailable("no live worker to route to")

    async def _first_message(
        self, stream: WorkerStream, request: GatewayRequest
    ) -> worker_pb2.GenerateResponse | EngineDelta | _Failed:
        """The worker request's first message, its breaker booked a success; or, for a failure that another
        worker may not share, why it failed (_Failed), the request ended and its breaker and fleet state told.
        Raises what no retry can help: the client's own fault (InvalidRequestError), the gateway's shutdown, a
        cancellation (the client left), each with the request ended and its breaker not blamed."""
        worker_id = stream.worker_id
        try:
            first = await stream.next_message()
        except grpc.aio.AioRpcError as exc:
            self.end_dispatch(stream)
            cause = self._refused(worker_id, exc, request)
            return _Failed(cause, f"worker {worker_id}: {exc.code().name}: {exc.details()}")
        except StreamEnded as ended:  # overdue on a hung worker, or the worker left: retry elsewhere
            self.end_dispatch(stream)
            if not ended.worker_fault:
                self.breakers.on_abandoned(worker_id)
                raise ended.error from None
            self._worker_failed(worker_id)
            return _Failed("timeout", ended.error.message)
        except BaseException:
            stream.call.cancel()
            self.end_dispatch(stream)
            self.breakers.on_abandoned(worker_id)
            raise
        if first is grpc.aio.EOF:  # the stream ended without a message: a worker bug, a failure
            self.end_dispatch(stream)
            self._worker_failed(worker_id)
            return _Failed("eof", f"worker {worker_id}: stream ended without a response")
        self.breakers.on_success(worker_id)
        return first  # type: ignore[return-value]

    def _worker_failed(self, worker_id: str) -> None:
        self.breakers.on_failure(worker_id)
        self.fleet.on_failure(worker_id)

    def _refused(self, worker_id: str, exc: grpc.aio.AioRpcError, request: GatewayRequest) -> str:
        """Book a worker's refusal before its first token and name its cause ("busy": full but healthy; else
        a failure for its breaker). Raises InvalidRequestError when the worker refused the request itself."""
        code = exc.code()
        if code in _CLIENT_FAULTS:
            self.breakers.on_abandoned(worker_id)
            param, message = _split_field(exc.details() or code.name)
            if param == "structured":
                param = structured_request.param_of_structured(request)
            raise InvalidRequestError(message, param=param) from None
        if code in _BUSY:
            self.breakers.on_abandoned(worker_id)
            return "busy"
        self._worker_failed(worker_id)
        return code.name.lower()

    async def _open_more(
        self, forward: _Forward, route_request: RouteRequest, n: int, prefer: str
    ) -> list[WorkerStream]:
        """Choices 1..n-1, on the first choice's worker (its prompt blocks are cached there now)."""
        tasks = [
            asyncio.ensure_future(self._open(forward, route_request, choice, 0.0, prefer=prefer))
            for choice in range(1, n)
        ]
        try:
            opened = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            # Each cancelled `_open` ends its own worker request; one that had opened its stream is ended here.
            await asyncio.wait(tasks)
            for task in tasks:
                if not task.cancelled() and task.exception() is None:
                    stream, _ = task.result()
                    stream.call.cancel()
                    self.end_dispatch(stream)
            raise
        return [stream for stream, _ in opened]

    def _check_context(self, forward: _Forward, member: WorkerMember) -> None:
        """Prompt + max_tokens must fit the worker's context. A max_tokens the client did not set (the front
        door's default) is cut to the context that is left instead."""
        prompt_tokens, max_tokens = len(forward.prompt_ids), forward.params.max_tokens
        if prompt_tokens + max_tokens <= member.max_model_len:
            return
        if forward.max_tokens_defaulted and prompt_tokens < member.max_model_len:
            forward.params = dataclasses.replace(forward.params, max_tokens=member.max_model_len - prompt_tokens)
            return
        raise ContextLengthExceeded(
            f"this model's maximum context length is {member.max_model_len} tokens; the prompt has "
            f"{prompt_tokens} tokens and max_tokens is {max_tokens} ({prompt_tokens + max_tokens} in all)",
            param="max_tokens" if prompt_tokens < member.max_model_len else "messages",
        )

    def _send(self, forward: _Forward, member: WorkerMember, choice: int) -> WorkerStream:
        self.fleet.on_dispatch(member.worker_id, len(forward.hashes))
        self.breakers.on_dispatch(member.worker_id)
        self.metrics.routed.labels(label_value(member.worker_id)).inc()
        call = self.backends[member.engine].open(member, forward, choice)
        stream = WorkerStream(choice, member.worker_id, call, forward.choice_id(choice), member.incarnation)
        self._open_streams.setdefault(member.worker_id, set()).add(stream)
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = asyncio.get_running_loop().create_task(self._watch(), name="stream watchdog")
        return stream

    def end_dispatch(self, stream: WorkerStream) -> None:
        """The worker request is over (any way): out of the fleet's in-flight count and the watchdog's view."""
        streams = self._open_streams.get(stream.worker_id)
        if streams is not None:
            streams.discard(stream)
            if not streams:
                del self._open_streams[stream.worker_id]
        self.fleet.on_finish(stream.worker_id)
        if self.flow is not None:
            self.flow.kick()

    def generation_closed(self, tenant: Tenant, band: int | None, finished: Finished | None) -> None:
        self.concurrency.release(tenant)
        if band is not None:
            self._judge_slo(band, finished)
        self.active -= 1
        self.metrics.in_flight.set(self.active)
        if self.active == 0 and self._starting == 0:
            self._idle.set()

    def _judge_slo(self, band: int, finished: Finished | None) -> None:
        """Count a request of a band with an SLO as meeting it or not (one refused or failed does not)."""
        assert self.flow is not None
        slo = self.flow.config.band(band).slo
        if not slo.bounded:
            return
        met = False
        if finished is not None:
            tokens = finished.completion_tokens
            decode = finished.e2e_latency - finished.time_to_first_token
            tpot = decode / (tokens - 1) if tokens > 1 else None
            met = slo.met(finished.time_to_first_token, tpot, finished.e2e_latency)
        self.metrics.slo_requests.labels(self.flow.band_label(band), "true" if met else "false").inc()


@dataclasses.dataclass(frozen=True)
class _Failed:
    """A worker request that failed before its first message: the retry cause (a metric label) and what to log."""

    cause: str
    message: str


@dataclasses.dataclass
class _Forward(ForwardJob):
    """What every worker request of one client request carries, and the request path's own part of it."""

    max_tokens_defaulted: bool  # the client set none: cut to the context left rather than refused
    span: trace.Span


def _small_prompt(request: GatewayRequest) -> bool:
    """Whether the text to template and tokenize has at most INLINE_PROMPT_CHARS characters: a string prompt,
    or messages whose contents are strings (anything else, template variables such as `tools` included, is
    not counted and goes to the pool)."""
    if request.messages is None:
        return isinstance(request.prompt, str) and len(request.prompt) <= INLINE_PROMPT_CHARS
    if request.template_kwargs.keys() - {"add_generation_prompt"} or request.tools:
        return False
    total = 0
    for message in request.messages:
        if not isinstance(message, dict) or len(message) > 3:
            return False
        for value in message.values():
            if not isinstance(value, str):
                return False
            total += len(value)
        if total > INLINE_PROMPT_CHARS:
            return False
    return True


def _check_prompt_fields(request: GatewayRequest) -> None:
    """The text fields a prompt needs before it is templated: InvalidRequestError naming the field."""
    if request.messages is not None and not request.messages:
        raise InvalidRequestError("must hold at least one message", param="messages")
    if request.messages is None and request.prompt is None:
        raise InvalidRequestError("one of prompt, messages or prompt_token_ids is required", param="prompt")


def _split_field(details: str) -> tuple[str | None, str]:
    """A worker's INVALID_ARGUMENT message split into the field it names and the rest
    ("max_tokens: must be ..." -> ("max_tokens", "must be ..."))."""
    head, sep, rest = details.partition(": ")
    if sep and head.replace("_", "").isalnum():
        return head, rest
    return None, details
