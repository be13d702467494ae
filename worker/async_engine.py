"""The engine behind asyncio: one LLMEngine stepped by a background thread, requests streamed to coroutines.

Threads. LLMEngine is not thread-safe, so only the engine thread touches it. Coroutines talk to it through a
list of operations (add, abort, call) guarded by a condition variable; the thread sleeps on the condition
while there is nothing to do and applies the queued operations between steps, in the order they were
submitted. Each step's outputs go back to the event loop in one `call_soon_threadsafe`.

Requests. Every request gets a handle of its own, a serial number that is its id inside the LLMEngine; the
client's `request_id` never reaches the engine. The event loop keeps the one map of live requests, handle ->
stream, and an output is put on the stream of its handle, or dropped when that stream has closed. So a client
id reused after a cancel can never receive the old request's outputs (DESIGN §3). Client ids are only checked
for uniqueness among the open streams (RequestIdInUse).

A request lives as long as its `generate` iterator: when the consumer stops iterating (a closed stream, a
cancelled task), the iterator aborts the request and the engine frees its blocks before its next step.

Lifecycle, one state guarded by the condition:

    NEW ──start()──► RUNNING ──shutdown()──► STOPPING ──► STOPPED
                        └──────────┴── the death rule ──► DEAD

The death rule (enforced in `_step_failed` and `_run`): a step that raises fails the requests in flight (their
streams end with EngineError) and the engine goes on, because one bad batch should not take the worker down.
The engine is DEAD instead when, after the failure, the block pool's books no longer balance, when
MAX_CONSECUTIVE_STEP_FAILURES steps in a row have failed (the fault is not the batch's: a lost device, a
broken kernel), or when anything outside a step raises. A dead engine ends every open stream and refuses every
new request with EngineDead, and `wait_dead()` returns its error, so the server reports NOT_SERVING and exits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import itertools
import logging
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvroute.kv_events import DEVICE, BlockKey, KVEvent
from kvroute.sampling import InvalidRequest, SamplingParams
from worker.engine import EngineStats, LLMEngine, RequestOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")

MAX_CONSECUTIVE_STEP_FAILURES = 3
DEFAULT_MAX_STREAMS = 256
DEFAULT_MAX_WAITING = 256


class RequestIdInUse(InvalidRequest):
    """Another open stream already has this id (gRPC ALREADY_EXISTS)."""


class EngineError(RuntimeError):
    """The engine failed this request (an engine fault, not the request's fault); other requests go on."""


class EngineStopped(RuntimeError):
    """The engine was shut down and takes no new requests."""


class EngineDead(EngineStopped):
    """The engine thread died (see the death rule); the message says why. Send the request elsewhere."""


class EngineOverloaded(RuntimeError):
    """A bound on open streams or on waiting requests is reached (gRPC RESOURCE_EXHAUSTED); retry later or
    elsewhere. `limit` names the bound."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(f"{limit}: {message}")
        self.limit = limit


class Lifecycle(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"
    DEAD = "dead"


@dataclass(frozen=True)
class KVEventsSince:
    """The cache changes after a sequence number, or a snapshot when they are no longer retained."""

    events: list[KVEvent]
    latest_seq: int
    snapshot: list[BlockKey] | None = None  # every cached hash on the device as of latest_seq
    host_snapshot: list[BlockKey] = dataclasses.field(default_factory=list)  # and on the host tier


@dataclass(frozen=True)
class KVSnapshotPage:
    """The cached hashes of one range of the block pool or the host tier after it (`medium`), as of `seq`;
    `next_block` starts the next page (None after the last)."""

    seq: int
    block_hashes: list[BlockKey]
    next_block: int | None
    medium: str = DEVICE


@dataclass(eq=False)
class _Stream:
    request_id: str  # the client's
    queue: asyncio.Queue[RequestOutput | BaseException] = dataclasses.field(default_factory=asyncio.Queue)


@dataclass
class _Add:
    handle: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str
    priority: int
    grammar: Any = None  # params.structured compiled (LLMEngine.compile_structured), off the step loop


@dataclass
class _Abort:
    handle: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future


_Op = _Add | _Abort | _Call
_Delivery = tuple[str, "RequestOutput | BaseException"]  # (handle, what its stream gets)


class _KVEventLog:
    """The last `capacity` KV events the engine thread published. The cached set itself is the block
    pool's; a reader that is not covered by these events gets the pool's snapshot instead."""

    def __init__(self, capacity: int, latest_seq: int) -> None:
        self.events: deque[KVEvent] = deque(maxlen=capacity)
        self.latest_seq = latest_seq

    def extend(self, new_events: Sequence[KVEvent]) -> None:
        if not new_events:
            return
        if new_events[0].seq != self.latest_seq + 1:
            # The pool dropped events between two drains: no reader may be served across that gap.
            self.events.clear()
        self.events.extend(new_events)
        self.latest_seq = new_events[-1].seq

    def since(self, after_seq: int, max_events: int) -> list[KVEvent] | None:
        """Up to `max_events` events after `after_seq`, or None when that reader must resync from a snapshot:
        the events it needs are gone, or it is ahead of this log (it read a previous incarnation)."""
        oldest_retained = self.events[0].seq if self.events else self.latest_seq + 1
        if after_seq > self.latest_seq or after_seq + 1 < oldest_retained:
            return None
        start = after_seq + 1 - oldest_retained
        return list(itertools.islice(self.events, start, start + max_events))


class AsyncEngine:
    """Owns one LLMEngine and its step thread. Create and use it from one asyncio event loop.

    `max_streams` bounds the open `generate` streams and `max_waiting` the requests accepted but not yet
    running; past either, `check_admission` raises EngineOverloaded."""

    def __init__(
        self,
        engine: LLMEngine,
        kv_event_capacity: int = 65536,
        max_streams: int = DEFAULT_MAX_STREAMS,
        max_waiting: int = DEFAULT_MAX_WAITING,
    ) -> None:
        if max_streams < 1 or max_waiting < 1:
            raise ValueError(f"max_streams and max_waiting must be >= 1, got {max_streams} and {max_waiting}")
        self.engine = engine
        self.max_streams = max_streams
        self.max_waiting = max_waiting
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._ops: list[_Op] = []  # guarded by _cond
        self._state = Lifecycle.NEW  # guarded by _cond (read without it where a stale value is harmless)
        self._error: str | None = None  # why the engine died; set before the state becomes DEAD
        self._thread_done = asyncio.Event()  # set on the event loop when the step thread has returned
        self._dead = asyncio.Event()
        # Event loop only: the live requests by handle, and their client ids (RequestIdInUse).
        self._streams: dict[str, _Stream] = {}
        self._open_ids: set[str] = set()
        self._handles = itertools.count(1)
        self._failed_steps = 0  # engine thread only: consecutive failed steps
        engine.drain_kv_events()  # a reader starts from the pool's snapshot, which covers them
        self._kv_lock = threading.Lock()
        self._kv_events = _KVEventLog(kv_event_capacity, latest_seq=engine.kv_manager.pool.event_seq)
        self.latest_stats: EngineStats = engine.stats()  # replaced (never mutated) after every step

    # -- asyncio side --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the step thread; call from the event loop that will consume the outputs."""
        with self._cond:
            if self._state is not Lifecycle.NEW:
                raise RuntimeError(f"AsyncEngine cannot start: it is {self._state.value}")
            self._state = Lifecycle.RUNNING
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    @property
    def state(self) -> Lifecycle:
        return self._state

    @property
    def error(self) -> str | None:
        """Why the engine died (None while it has not)."""
        return self._error

    async def wait_dead(self) -> str:
        """Return the engine's error once it has died (never returns for an engine that stops cleanly)."""
        await self._dead.wait()
        assert self._error is not None
        return self._error

    @property
    def num_active_requests(self) -> int:
        """Open `generate` streams."""
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not running as of the last step: the engine's waiting queue plus those
        submitted since (an estimate that never lags behind a burst of new streams)."""
        return max(len(self._streams) - self.latest_stats.num_running, self.latest_stats.num_waiting, 0)

    def check_admission(self, request_id: str, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        """Raise what `generate` would raise before the engine sees the request: InvalidRequest naming the
        bad field, RequestIdInUse, EngineStopped / EngineDead, or EngineOverloaded. Cheap: reads no tokens
        beyond the prompt's validation, hashes nothing."""
        if self._state is Lifecycle.DEAD:
            raise EngineDead(f"the engine died: {self._error}")
        if self._state not in (Lifecycle.NEW, Lifecycle.RUNNING):
            raise EngineStopped("the engine is shut down")
        self.engine.validate_request(list(prompt_token_ids), params)
        if request_id in self._open_ids:
            raise RequestIdInUse("request_id", f"{request_id!r} is already in use by a running request")
        if len(self._streams) >= self.max_streams:
            raise EngineOverloaded(
                "max_concurrent_streams", f"all {self.max_streams} Generate streams of this worker are open"
            )
        if self.num_waiting >= self.max_waiting:
            raise EngineOverloaded(
                "max_waiting", f"the waiting queue is full ({self.max_waiting} requests wait for a slot or KV blocks)"
            )

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str = "",
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream one request's outputs; the last has `finished` set.

        Raises what `check_admission` raises at the first iteration, before the engine sees the request;
        EngineError if the engine fails it later, EngineDead if the engine dies meanwhile. Leaving the
        iteration early (break, aclose, cancellation) aborts the request and frees its blocks. A consumer that
        falls behind gets the outputs that piled up merged into one (as vLLM's output collector does), never
        a backlog.
        """
        prompt = list(prompt_token_ids)
        self.check_admission(request_id, prompt, params)
        # A grammar may take a while to compile: in a thread, neither on the step loop nor on the event loop.
        grammar = await asyncio.to_thread(self.engine.compile_structured, params) if params.structured else None
        handle = str(next(self._handles))
        stream = _Stream(request_id)
        self._streams[handle] = stream
        self._open_ids.add(request_id)
        finished = False
        try:
            self._submit(_Add(handle, prompt, params, cache_salt, priority, grammar))
            while not finished:
                item = _merge_ready(await stream.queue.get(), stream.queue)
                if isinstance(item, BaseException):
                    finished = True  # the engine has already dropped the request
                    raise item
                finished = item.finished
                yield item
        finally:
            del self._streams[handle]
            self._open_ids.discard(request_id)
            if not finished:
                self._submit(_Abort(handle))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between two steps, after every operation submitted before.
        Once the thread has ended (stopped or dead) it runs here, on the engine as the thread left it."""
        if self._thread is None:
            return fn(self.engine)
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        try:
            self._submit(_Call(fn, future))
        except EngineStopped:
            await self._thread_done.wait()
            return fn(self.engine)
        return await future

    async def stats(self) -> EngineStats:
        """The engine's stats after every operation submitted so far (latest_stats may be one step old)."""
        return await self.call(lambda engine: engine.stats())

    @property
    def kv_event_seq(self) -> int:
        """The sequence number of the last KV event published."""
        with self._kv_lock:
            return self._kv_events.latest_seq

    async def kv_events_since(self, after_seq: int, max_events: int = 4096) -> KVEventsSince:
        """Up to `max_events` KV events after `after_seq`, answered at once from the published log; or, when
        the log does not cover `after_seq` (too old, or ahead of this engine), a snapshot of every cached hash,
        taken between two steps (so it may wait for the step in progress) and consistent with its seq."""
        logged = self.kv_events_logged(after_seq, max_events)
        if logged is not None:
            return logged
        seq, device, host = await self.call(self._kv_snapshot)
        return KVEventsSince([], seq, device, host)

    def kv_events_logged(self, after_seq: int, max_events: int) -> KVEventsSince | None:
        """`kv_events_since` from the published log only: None where that would take a snapshot."""
        with self._kv_lock:
            latest_seq = self._kv_events.latest_seq
            events = self._kv_events.since(after_seq, max_events)
        return None if events is None else KVEventsSince(events, latest_seq)

    async def kv_snapshot_page(self, start_block: int, max_blocks: int) -> KVSnapshotPage:
        """One page of a snapshot (BlockPool.snapshot_page), read between two steps after the pool's pending
        events are published, so its seq is the log's latest. Raises ValueError for a start outside the pool."""

        def read(engine: LLMEngine) -> KVSnapshotPage:
            self._publish_kv_events(engine)
            return KVSnapshotPage(*engine.kv_manager.snapshot_page(start_block, max_blocks))

        return await self.call(read)

    async def shutdown(self) -> None:
        """Abort every request (their streams end with finish_reason "abort") and stop the thread."""
        with self._cond:
            if self._state is Lifecycle.NEW:
                self._state = Lifecycle.STOPPED
            elif self._state is Lifecycle.RUNNING:
                self._state = Lifecycle.STOPPING
                self._cond.notify()
        if self._thread is not None:
            # The thread's last deliveries were scheduled before it set _thread_done, so they have run.
            await self._thread_done.wait()

    def _submit(self, op: _Op) -> None:
        with self._cond:
            if self._state in (Lifecycle.STOPPED, Lifecycle.DEAD):
                if isinstance(op, _Abort):
                    return  # the engine already dropped every request
                if self._state is Lifecycle.DEAD:
                    raise EngineDead(f"the engine died: {self._error}")
                raise EngineStopped("the engine is shut down")
            self._ops.append(op)
            self._cond.notify()

    def _deliver(self, deliveries: list[_Delivery]) -> None:
        for handle, item in deliveries:
            stream = self._streams.get(handle)
            if stream is not None:  # else its consumer left; the engine dropped the request or will
                stream.queue.put_nowait(item)

    def _on_dead(self, error: str) -> None:
        for stream in self._streams.values():
            stream.queue.put_nowait(EngineDead(f"the engine died: {error}"))
        self._dead.set()

    # -- engine thread -------------------------------------------------------------------------

    def _post(self, fn: Callable[..., object], *args: object) -> None:
        """Run `fn(*args)` on the event loop; dropped when the loop is closed (the process is exiting)."""
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            pass

    def _run(self) -> None:
        try:
            self._step_loop()
        except Exception as exc:
            logger.exception("the engine thread died")
            self._die(str(exc) if isinstance(exc, _Fatal) else f"{type(exc).__name__}: {exc}")
        finally:
            self._post(self._thread_done.set)

    def _die(self, error: str) -> None:
        with self._cond:
            self._error = error
            self._state = Lifecycle.DEAD
            late, self._ops = self._ops, []
        for op in late:
            if isinstance(op, _Call):
                self._run_call(op)
        self._post(self._on_dead, error)

    def _step_loop(self) -> None:
        while True:
            with self._cond:
                while not self._ops and self._state is Lifecycle.RUNNING and not self.engine.has_unfinished_requests():
                    self._cond.wait()
                ops, self._ops = self._ops, []
                stopping = self._state is Lifecycle.STOPPING
            deliveries = [delivery for op in ops for delivery in self._apply(op)]
            if stopping:
                self._publish(deliveries + self._abort_all() + self._close())
                return
            if self.engine.has_unfinished_requests():
                deliveries += self._step()
            self._publish(deliveries)

    def _apply(self, op: _Op) -> list[_Delivery]:
        if isinstance(op, _Add):
            try:
                self.engine.add_request(
                    op.handle, op.prompt_token_ids, op.params, op.cache_salt, op.priority, grammar=op.grammar
                )
            except InvalidRequest as exc:
                return [(op.handle, exc)]
            except Exception as exc:
                logger.exception("engine failed to add request %s", op.handle)
                return [(op.handle, EngineError(f"engine failed to add the request: {exc!r}"))]
        elif isinstance(op, _Abort):
            self.engine.abort_request(op.handle)  # its abort notice goes to a closed stream: dropped
        else:
            self._run_call(op)
        return []

    def _run_call(self, op: _Call) -> None:
        try:
            result, error = op.fn(self.engine), None
        except Exception as exc:
            result, error = None, exc
        self._post(_resolve, op.future, result, error)

    def _step(self) -> list[_Delivery]:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            return self._step_failed(exc)
        if any(output.new_token_ids for output in outputs):
            self._failed_steps = 0  # the model ran (a step that only hands out abort notices proves nothing)
        return [(output.request_id, output) for output in outputs]

    def _step_failed(self, exc: Exception) -> list[_Delivery]:
        """Fail the requests in flight (a fault in one step cannot be pinned on one request), then apply the
        death rule: raise _Fatal when the pool's books are broken or too many steps in a row have failed."""
        self._failed_steps += 1
        in_flight = list(self.engine.scheduler.requests)
        logger.exception("engine step failed (%d in a row); failing %d requests", self._failed_steps, len(in_flight))
        for handle in in_flight:
            self.engine.abort_request(handle)
        failed: list[_Delivery] = [(handle, EngineError(f"engine step failed: {exc!r}")) for handle in in_flight]
        try:
            self.engine.check_invariants()
        except AssertionError as broken:
            self._publish(failed)
            raise _Fatal(f"a failed step ({exc!r}) left the KV block books broken: {broken}") from exc
        if self._failed_steps >= MAX_CONSECUTIVE_STEP_FAILURES:
            self._publish(failed)
            raise _Fatal(f"{self._failed_steps} engine steps failed in a row; the last: {exc!r}") from exc
        return failed

    def _abort_all(self) -> list[_Delivery]:
        for handle in list(self.engine.scheduler.requests):
            self.engine.abort_request(handle)
        # With nothing left to run, a step only hands out the abort notices (finish_reason "abort").
        return [(output.request_id, output) for output in self.engine.step()]

    def _close(self) -> list[_Delivery]:
        """Take no more operations; answer those submitted since the last batch without running them."""
        with self._cond:
            self._state = Lifecycle.STOPPED
            late, self._ops = self._ops, []
        deliveries: list[_Delivery] = []
        for op in late:
            if isinstance(op, _Add):
                deliveries.append((op.handle, EngineStopped("the engine is shut down")))
            elif isinstance(op, _Call):
                self._run_call(op)
        return deliveries

    def _publish(self, deliveries: list[_Delivery]) -> None:
        self.latest_stats = self.engine.stats()
        self._publish_kv_events(self.engine)
        if deliveries:
            self._post(self._deliver, deliveries)

    def _publish_kv_events(self, engine: LLMEngine) -> None:
        events = engine.drain_kv_events()
        if events:
            with self._kv_lock:
                self._kv_events.extend(events)

    def _kv_snapshot(self, engine: LLMEngine) -> tuple[int, list[BlockKey], list[BlockKey]]:
        """On the engine thread: publish the pool's pending events, then take its snapshot, so the snapshot's
        seq is the log's latest and a reader can go on from it with events."""
        self._publish_kv_events(engine)
        return engine.kv_manager.snapshot()


class _Fatal(Exception):
    """Raised on the engine thread when the death rule says the engine is dead."""


def _merge_ready(
    item: RequestOutput | BaseException, queue: asyncio.Queue[RequestOutput | BaseException]
) -> RequestOutput | BaseException:
    """`item` extended by the outputs already waiting behind it (an error ends the merge and wins)."""
    while isinstance(item, RequestOutput) and not item.finished and not queue.empty():
        after = queue.get_nowait()
        if isinstance(after, BaseException):
            return after
        item = dataclasses.replace(
            after,
            new_token_ids=item.new_token_ids + after.new_token_ids,
            new_logprobs=item.new_logprobs + after.new_logprobs,
            new_top_logprobs=item.new_top_logprobs + after.new_top_logprobs,
        )
    return item


def _resolve(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
