"""A started request's streams: each worker request of one client request (`WorkerStream`), and the
`Generation` the front doors iterate over them (`StreamingGeneration`), from the first token to the usage.

    worker messages ──► StreamingGeneration ──► Chunks (every choice, interleaved) ──► usage
    kvroute gRPC: token ids, detokenized here incrementally, stop strings matched across token boundaries
                  (gateway.forwarding.stop_strings); HTTP engines: text the engine cut at stop strings itself.

One choice is read directly (no task per token); `n` choices are read by whichever has a message next. After
a choice's first token nothing is retried: a worker that fails, hangs or closes the stream then ends it with
UpstreamError naming the worker (the front door writes an error event, then `[DONE]`); that failure is not
booked on the worker's breaker, whose outcome the first token already was (gateway.forwarding.retry).
Closing a generation (`aclose`, a client that left) cancels every worker request still running, which frees
their blocks on the workers, and releases the request's books once through its `StreamOwner`.

The request path (gateway.request_path) routes and opens the streams, watches them for deadlines and ends them
from outside (`WorkerStream.ended`); this module only reads them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

import grpc
from opentelemetry import trace

from gateway import structured_request, tracing
from gateway.errors import GatewayError, UpstreamError
from gateway.fleet.fleet_state import FleetState
from gateway.forwarding.backends import BackendCall, EngineDelta
from gateway.forwarding.stop_strings import ChoiceText
from gateway.metrics import GatewayMetrics, finished_reason_label
from gateway.request import Chunk, GatewayRequest, Generation, RouteInfo, Tenant, TokenLogprob, Usage
from gateway.tool_calls import ToolCallDelta, ToolCallParser
from kvroute.proto_maps import FINISH_REASON_NAMES
from kvroute.tokenizer import Tokenizer
from proto import worker_pb2


class StreamEnded(Exception):
    """The gateway ended a worker request from outside its reader (the watchdog, a worker that left, the drain)."""

    def __init__(self, error: GatewayError, worker_fault: bool) -> None:
        super().__init__(error.message)
        self.error = error
        self.worker_fault = worker_fault  # the worker is at fault: a breaker failure, and retried before a token


@dataclasses.dataclass(eq=False)  # identity: kept in sets
class WorkerStream:
    choice: int
    worker_id: str
    call: BackendCall  # a grpc.aio.UnaryStreamCall, or gateway.forwarding.backends.HttpCall
    request_id: str
    incarnation: int  # of the worker it was sent to (a restart ends only the old incarnation's requests)
    first: worker_pb2.GenerateResponse | EngineDelta | None = None
    done: bool = False  # the worker's stream is over (finished, failed or cancelled): on_finish was called
    waiting_since: float | None = None  # time.monotonic() since the reader waits on the worker; None otherwise
    ended: StreamEnded | None = None  # set when the gateway ended it

    def opened(self) -> worker_pb2.GenerateResponse | EngineDelta:
        """The first message, which the request path sets before a generation reads the stream."""
        if self.first is None:
            raise RuntimeError(f"worker request {self.request_id} is read before its first message")
        return self.first

    async def next_message(self) -> worker_pb2.GenerateResponse | EngineDelta | object:
        """The worker request's next message (or grpc.aio.EOF), timed by the watchdog (`waiting_since`). Raises
        StreamEnded when the gateway ended it, AioRpcError when the worker failed it."""
        self.waiting_since = time.monotonic()
        try:
            return await self.call.read()
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.ended is None or (task is not None and task.cancelling()):
                raise  # a real cancellation (the client left), not the gateway's end of the call
            raise self.ended from None
        finally:
            self.waiting_since = None


@dataclasses.dataclass(frozen=True)
class Finished:
    """A generation that ended without an error, as its band's SLO judges it (gateway.flow_control.config.Slo)."""

    time_to_first_token: float
    e2e_latency: float
    completion_tokens: int


class StreamOwner(Protocol):
    """What a StreamingGeneration needs of the request path that started it."""

    tokenizer: Tokenizer
    metrics: GatewayMetrics
    fleet: FleetState

    def end_dispatch(self, stream: WorkerStream) -> None:
        """The worker request is over (any way): out of the fleet's in-flight count and the watchdog's view."""

    def generation_closed(self, tenant: Tenant, band: int | None, finished: Finished | None) -> None:
        """The generation released its books: the tenant's slot goes back. `band`: its flow-control band (None:
        flow control off); `finished`: its timings when every choice ended without an error, else None."""


class StreamingGeneration(Generation):
    """A started request: iterate for Chunks (every choice, interleaved), then read `usage`."""

    def __init__(
        self,
        path: StreamOwner,
        request: GatewayRequest,
        tenant: Tenant,
        request_id: str,
        route: RouteInfo,
        prompt_ids: list[int],
        streams: list[WorkerStream],
        span: trace.Span,
        arrival: float,
        band: int | None = None,
    ) -> None:
        self.request_id = request_id
        self.route = route
        self.prompt_token_ids = prompt_ids
        self.usage = Usage(prompt_tokens=len(prompt_ids))
        self._path = path
        self._tenant = tenant
        self._streams = streams
        self._texts = [
            ChoiceText(path.tokenizer, request.stop, request.skip_special_tokens, request.params.min_tokens)
            for _ in streams
        ]
        self._want_logprobs = request.params.logprobs
        # A kvroute worker's text is read for tool calls here (an HTTP engine parses its own).
        self._tool_parsers = (
            [ToolCallParser() for _ in streams] if structured_request.parses_tool_calls(request) else None
        )
        self._span = span
        self._arrival = arrival
        self._first_token_at = time.perf_counter()  # built when the first token has come
        self._band = band
        self._finish_reasons: list[str] = []
        self._closed = False
        self._iterator: AsyncIterator[Chunk] | None = None

    def __aiter__(self) -> AsyncIterator[Chunk]:
        if self._iterator is None:
            self._iterator = self._chunks() if len(self._streams) == 1 else self._merged_chunks()
        return self._iterator

    async def aclose(self) -> None:
        """Cancel every worker request still running and release the request's books (idempotent)."""
        if self._iterator is not None:
            await self._iterator.aclose()  # type: ignore[attr-defined]
        self._finish(error=None)

    # -- one choice: read its stream directly (the common case, no task per token) ---------------------------

    async def _chunks(self) -> AsyncIterator[Chunk]:
        stream = self._streams[0]
        try:
            response = stream.opened()
            while True:
                chunk = self._consume(stream, response)
                if chunk is not None:
                    yield chunk
                if stream.done:
                    break
                response = await self._read(stream)
        except GatewayError as exc:
            self._finish(error=exc)
            raise
        finally:
            self._finish(error=None)

    # -- n choices: whichever stream has a message next -----------------------------------------------------

    async def _merged_chunks(self) -> AsyncIterator[Chunk]:
        pending: dict[asyncio.Future, WorkerStream] = {}
        try:
            for stream in self._streams:
                chunk = self._consume(stream, stream.opened())
                if chunk is not None:
                    yield chunk
                if not stream.done:
                    pending[asyncio.ensure_future(self._read(stream))] = stream
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for future in sorted(done, key=lambda f: pending[f].choice):
                    stream = pending.pop(future)
                    chunk = self._consume(stream, future.result())
                    if chunk is not None:
                        yield chunk
                    if not stream.done:
                        pending[asyncio.ensure_future(self._read(stream))] = stream
        except GatewayError as exc:
            self._finish(error=exc)
            raise
        finally:
            for future in pending:
                future.cancel()
            self._finish(error=None)

    # -- shared ---------------------------------------------------------------------------------------------

    async def _read(self, stream: WorkerStream) -> worker_pb2.GenerateResponse | EngineDelta:
        """The next message; UpstreamError if the worker failed, hung or closed the stream mid-way (or left the
        fleet); NoWorkerAvailable when the gateway's shutdown ended it. A failure here is not booked on the
        worker's breaker: its first token already was (CircuitBreakers' contract, one outcome per request)."""
        try:
            response = await stream.next_message()
        except StreamEnded as ended:
            self._end_stream(stream)
            if ended.worker_fault:
                self._path.fleet.on_failure(stream.worker_id)
            raise ended.error from None
        except grpc.aio.AioRpcError as exc:
            self._end_stream(stream)
            self._path.fleet.on_failure(stream.worker_id)
            raise UpstreamError(
                f"worker {stream.worker_id} failed mid-stream: {exc.code().name}: {exc.details()}"
            ) from None
        if not isinstance(response, worker_pb2.GenerateResponse | EngineDelta):  # grpc.aio.EOF
            self._end_stream(stream)
            raise UpstreamError(f"worker {stream.worker_id} closed the stream before finishing")
        return response

    def _consume(self, stream: WorkerStream, response: worker_pb2.GenerateResponse | EngineDelta) -> Chunk | None:
        """One worker message -> one Chunk of its choice (None when it adds nothing to say)."""
        if isinstance(response, EngineDelta):
            return self._consume_engine(stream, response)
        text_state = self._texts[stream.choice]
        token_ids = tuple(response.token_ids)
        self.usage.completion_tokens += len(token_ids)
        text = text_state.add(token_ids)
        finish_reason = None
        if text_state.stopped:
            finish_reason = "stop"
            stream.call.cancel()  # the worker frees the request's blocks now
            self._end_stream(stream)
        elif response.finish_reason != worker_pb2.FINISH_REASON_UNSPECIFIED:
            text += text_state.finish()
            finish_reason = FINISH_REASON_NAMES.get(response.finish_reason, "abort")
            self._end_stream(stream)
        if stream.choice == 0 and response.HasField("usage"):
            # On the worker's first message and its last: exact even when a stop string cancels it mid-way.
            self.usage.cached_tokens = response.usage.cached_tokens
        extra: dict[str, Any] = {}
        if self._tool_parsers is not None:
            text, calls, made_calls = _read_tool_calls(self._tool_parsers[stream.choice], text, finish_reason)
            if calls:
                extra["tool_calls"] = chat_tool_call_deltas(calls)
            if finish_reason == "stop" and made_calls:
                finish_reason = "tool_calls"
        if finish_reason is not None:
            self._finish_reasons.append(finish_reason)
            self._path.metrics.request_success.labels(finish_reason).inc()
        if not text and not token_ids and finish_reason is None and not extra:
            return None
        logprobs = self._logprobs(response) if self._want_logprobs else ()
        return Chunk(stream.choice, text, token_ids, logprobs, finish_reason, extra)

    def _consume_engine(self, stream: WorkerStream, delta: EngineDelta) -> Chunk | None:
        """An HTTP engine's message: its text as it is (the engine cut it at stop strings), its usage."""
        if delta.finish_reason is not None:
            self._end_stream(stream)
            self._finish_reasons.append(delta.finish_reason)
            self._path.metrics.request_success.labels(finished_reason_label(delta.finish_reason)).inc()
        if delta.completion_tokens is not None:
            self.usage.completion_tokens += delta.completion_tokens
        if stream.choice == 0 and delta.cached_tokens is not None:
            self.usage.cached_tokens = delta.cached_tokens
        if not delta.text and not delta.extra and not delta.logprobs and delta.finish_reason is None:
            return None
        logprobs = delta.logprobs if self._want_logprobs else ()
        return Chunk(stream.choice, delta.text, (), logprobs, delta.finish_reason, delta.extra)

    def _logprobs(self, response: worker_pb2.GenerateResponse) -> tuple[TokenLogprob, ...]:
        tops: Sequence[worker_pb2.TopLogprobs] = response.top_logprobs
        out = []
        for i, (token_id, logprob) in enumerate(zip(response.token_ids, response.logprobs, strict=False)):
            top: tuple[TokenLogprob, ...] = ()
            if i < len(tops):
                pairs = zip(tops[i].token_ids, tops[i].logprobs, strict=False)
                top = tuple(self._token_logprob(t, lp) for t, lp in pairs)
            out.append(dataclasses.replace(self._token_logprob(token_id, logprob), top=top))
        return tuple(out)

    def _token_logprob(self, token_id: int, logprob: float) -> TokenLogprob:
        raw = self._path.tokenizer.token_bytes(token_id)
        try:
            text = raw.decode()
        except UnicodeDecodeError:
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return TokenLogprob(text, token_id, logprob, list(raw))

    def _end_stream(self, stream: WorkerStream) -> None:
        if not stream.done:
            stream.done = True
            self._path.end_dispatch(stream)

    def _finish(self, error: GatewayError | None) -> None:
        """Release everything once: cancel running worker requests, the fleet's in-flight counts, the
        tenant's concurrency slot, the span and the request's metrics."""
        if error is not None and not self._closed:
            self._path.metrics.errors.labels(type(error).__name__).inc()
            self._span.set_status(trace.StatusCode.ERROR, error.message)
        if self._closed:
            return
        self._closed = True
        finished = True
        for stream in self._streams:
            if not stream.done:
                finished = False
                stream.call.cancel()
                self._end_stream(stream)
        path = self._path
        done: Finished | None = None
        if finished and error is None:
            e2e = time.perf_counter() - self._arrival
            path.metrics.e2e_request_latency.observe(e2e)
            done = Finished(self._first_token_at - self._arrival, e2e, self.usage.completion_tokens)
        tracing.record_usage(self._span, self.request_id, self.usage, self._finish_reasons)
        self._span.end()
        path.generation_closed(self._tenant, self._band, done)


def _read_tool_calls(
    parser: ToolCallParser, text: str, finish_reason: str | None
) -> tuple[str, list[ToolCallDelta], bool]:
    """(content, call deltas, whether the output made any call so far) of a choice's new text."""
    parsed = parser.feed(text)
    content, calls = parsed.content, list(parsed.calls)
    if finish_reason is not None:
        last = parser.finish()
        content += last.content
        calls += last.calls
    return content, calls, bool(parser.tool_calls)


def chat_tool_call_deltas(calls: Sequence[ToolCallDelta]) -> list[dict[str, Any]]:
    """Call deltas as a chat delta's `tool_calls` (what HTTP engines send, and Chunk.extra carries): a call's
    first with its id, type and name, the rest with argument fragments."""
    out: list[dict[str, Any]] = []
    for call in calls:
        if call.id is not None:
            function = {"name": call.name, "arguments": call.arguments}
            out.append({"index": call.index, "id": call.id, "type": "function", "function": function})
        else:
            out.append({"index": call.index, "function": {"arguments": call.arguments}})
    return out
