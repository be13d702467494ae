"""The engine behind asyncio: one LLMEngine stepped by a background thread, requests streamed to coroutines.

LLMEngine is not thread-safe, so only the engine thread touches it. Coroutines talk to it through a list of
operations (add, abort, call) guarded by a condition variable; the thread sleeps on the condition while
there is nothing to do and applies the queued operations between steps, in the order they were submitted.
Each step's outputs go back to the event loop in one `call_soon_threadsafe`, to a queue per request.

A request lives as long as its `generate` iterator: when the consumer stops iterating (a closed stream,
a cancelled task), the iterator aborts the request and the engine frees its blocks before its next step.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from kvroute.sampling import InvalidRequest, SamplingParams
from worker.block_pool import BlockKey, KVEvent
from worker.engine import EngineStats, LLMEngine, RequestOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")


class RequestIdInUse(InvalidRequest):
    """Another running request already has this id (gRPC ALREADY_EXISTS)."""


class EngineError(RuntimeError):
    """The engine failed this request (an engine fault, not the request's fault); other requests go on."""


class EngineStopped(RuntimeError):
    """The engine was shut down and takes no new requests."""


@dataclass(frozen=True)
class KVEventsSince:
    """The cache changes after a sequence number, or a snapshot when they are no longer retained."""

    events: list[KVEvent]
    latest_seq: int
    snapshot: list[BlockKey] | None = None  # every cached hash as of latest_seq


@dataclass
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    future: asyncio.Future


_Op = _Add | _Abort | _Call
_Delivery = tuple[str, "RequestOutput | BaseException"]


@dataclass
class _KVEventLog:
    """The last `capacity` KV events and a mirror of the cached set they describe (for snapshots)."""

    capacity: int
    events: deque[KVEvent] = field(default_factory=deque)
    cached: dict[BlockKey, None] = field(default_factory=dict)  # insertion-ordered set
    latest_seq: int = 0

    def extend(self, new_events: Sequence[KVEvent]) -> None:
        for event in new_events:
            if event.kind == "stored":
                self.cached.update(dict.fromkeys(event.block_hashes))
            elif event.kind == "removed":
                for block_hash in event.block_hashes:
                    self.cached.pop(block_hash, None)
            else:
                self.cached.clear()
            self.events.append(event)
            self.latest_seq = event.seq
        while len(self.events) > self.capacity:
            self.events.popleft()

    def since(self, after_seq: int, max_events: int) -> KVEventsSince:
        oldest_retained = self.events[0].seq if self.events else self.latest_seq + 1
        missed = after_seq + 1 < oldest_retained and after_seq < self.latest_seq
        if missed or after_seq > self.latest_seq:  # (the reader is ahead: this worker restarted)
            return KVEventsSince([], self.latest_seq, list(self.cached))
        start = max(0, after_seq + 1 - oldest_retained)
        end = min(len(self.events), start + max_events)
        return KVEventsSince(list(itertools.islice(self.events, start, end)), self.latest_seq)


class AsyncEngine:
    """Owns one LLMEngine and its step thread. Create and use it from one asyncio event loop."""

    def __init__(self, engine: LLMEngine, kv_event_capacity: int = 65536) -> None:
        self.engine = engine
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._cond = threading.Condition()
        self._ops: list[_Op] = []  # guarded by _cond
        self._stopping = False  # guarded by _cond: shutdown was asked
        self._stopped = False  # guarded by _cond: the thread takes no more operations
        self._streams: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}  # event loop only
        self._live: dict[str, int] = {}  # engine thread only: request id -> prompt tokens
        engine.drain_kv_events()  # the snapshot below covers them
        kv_event_seq, cached = engine.kv_manager.pool.snapshot()
        self._kv_events = _KVEventLog(kv_event_capacity, cached=dict.fromkeys(cached), latest_seq=kv_event_seq)
        self._kv_lock = threading.Lock()
        self.latest_stats: EngineStats = engine.stats()  # replaced (never mutated) after every step

    # -- asyncio side --------------------------------------------------------------------------

    def start(self) -> None:
        """Start the step thread; call from the event loop that will consume the outputs."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="engine-step-loop", daemon=True)
        self._thread.start()

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        params: SamplingParams,
        cache_salt: str = "",
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; the last has `finished` set.

        Raises InvalidRequest (RequestIdInUse for an id in use) at the first iteration, before the engine
        sees the request; EngineError if the engine fails it later. Leaving the iteration early (break,
        aclose, cancellation) aborts the request and frees its blocks. A consumer that falls behind gets
        the outputs that piled up merged into one (as vLLM's output collector does), never a backlog.
        """
        prompt = list(prompt_token_ids)
        self._validate(request_id, prompt, params)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._streams[request_id] = queue
        self._submit(_Add(request_id, prompt, params, cache_salt))
        finished = False
        try:
            while not finished:
                item = _merge_ready(await queue.get(), queue)
                if isinstance(item, BaseException):
                    finished = True  # the engine has already dropped the request
                    raise item
                finished = item.finished
                yield item
        finally:
            del self._streams[request_id]
            if not finished:
                self._submit(_Abort(request_id))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between two steps, after every operation submitted before."""
        if self._thread is None:
            return fn(self.engine)
        future: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        try:
            self._submit(_Call(fn, future))
        except EngineStopped:
            await asyncio.to_thread(self._thread.join)
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

    def kv_events_since(self, after_seq: int, max_events: int = 4096) -> KVEventsSince:
        with self._kv_lock:
            return self._kv_events.since(after_seq, max_events)

    async def shutdown(self) -> None:
        """Abort every request (their streams end with finish_reason "abort") and stop the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            # The thread's last deliveries were scheduled before the join's result, so they have run.
            await asyncio.to_thread(self._thread.join)

    def _validate(self, request_id: str, prompt: list[int], params: SamplingParams) -> None:
        if self._stopping:
            raise EngineStopped("the engine is shut down")
        if request_id in self._streams:
            raise RequestIdInUse("request_id", f"{request_id!r} is already in use by a running request")
        self.engine.validate_request(prompt, params)

    def _submit(self, op: _Op) -> None:
        with self._cond:
            if self._stopped:
                if isinstance(op, _Abort):
                    return  # shutdown already aborted every request
                raise EngineStopped("the engine is shut down")
            self._ops.append(op)
            self._cond.notify()

    def _fail_all_streams(self, error: EngineError) -> None:
        for queue in self._streams.values():
            queue.put_nowait(error)

    def _deliver(self, deliveries: list[_Delivery]) -> None:
        for request_id, item in deliveries:
            queue = self._streams.get(request_id)
            if queue is not None:
                queue.put_nowait(item)

    # -- engine thread -------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._step_loop()
        except Exception as exc:
            # Only a broken engine gets here (its own calls raised outside a step); fail loudly, never hang.
            logger.exception("the engine thread died")
            with self._cond:
                self._stopping = self._stopped = True
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._fail_all_streams, EngineError(f"the engine thread died: {exc!r}"))

    def _step_loop(self) -> None:
        while True:
            with self._cond:
                while not self._ops and not self._stopping and not self.engine.has_unfinished_requests():
                    self._cond.wait()
                ops, self._ops = self._ops, []
                stopping = self._stopping
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
                self.engine.add_request(op.request_id, op.prompt_token_ids, op.params, op.cache_salt)
            except InvalidRequest as exc:
                return [(op.request_id, exc)]
            except Exception as exc:
                logger.exception("engine failed to add request %s", op.request_id)
                return [(op.request_id, EngineError(f"engine failed to add the request: {exc!r}"))]
            self._live[op.request_id] = len(op.prompt_token_ids)
        elif isinstance(op, _Abort):
            if self._live.pop(op.request_id, None) is not None:
                self.engine.abort_request(op.request_id)
        else:
            self._run_call(op)
        return []

    def _run_call(self, op: _Call) -> None:
        try:
            result, error = op.fn(self.engine), None
        except Exception as exc:
            result, error = None, exc
        assert self._loop is not None
        self._loop.call_soon_threadsafe(_resolve, op.future, result, error)

    def _step(self) -> list[_Delivery]:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            # A fault in one step cannot be pinned on one request: fail those in flight, keep serving.
            logger.exception("engine step failed; failing %d in-flight requests", len(self._live))
            error = f"engine step failed: {exc!r}"
            failed = list(self._live)
            for request_id in failed:
                self.engine.abort_request(request_id)
            self._live.clear()
            return [(request_id, EngineError(error)) for request_id in failed]
        for output in outputs:
            if output.finished:
                self._live.pop(output.request_id, None)
        return [(output.request_id, output) for output in outputs]

    def _abort_all(self) -> list[_Delivery]:
        deliveries: list[_Delivery] = []
        for request_id, prompt_tokens in self._live.items():
            self.engine.abort_request(request_id)
            deliveries.append((request_id, RequestOutput(request_id, [], [], True, "abort", prompt_tokens, 0)))
        self._live.clear()
        return deliveries

    def _close(self) -> list[_Delivery]:
        """Take no more operations; answer those submitted since the last batch without running them."""
        with self._cond:
            self._stopped = True
            late, self._ops = self._ops, []
        deliveries: list[_Delivery] = []
        for op in late:
            if isinstance(op, _Add):
                deliveries.append((op.request_id, EngineStopped("the engine is shut down")))
            elif isinstance(op, _Call):
                self._run_call(op)
        return deliveries

    def _publish(self, deliveries: list[_Delivery]) -> None:
        self.latest_stats = self.engine.stats()
        events = self.engine.drain_kv_events()
        if events:
            with self._kv_lock:
                self._kv_events.extend(events)
        if deliveries:
            assert self._loop is not None
            self._loop.call_soon_threadsafe(self._deliver, deliveries)


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
        )
    return item


def _resolve(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.done():  # the caller was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
