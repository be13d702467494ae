"""The backends a request is forwarded over: kvroute gRPC and OpenAI HTTP (vLLM, SGLang). One small interface.

    Backend.open(member, job, choice) -> BackendCall
    BackendCall.read()   -> the next message, or grpc.aio.EOF once the stream is over
    BackendCall.cancel() -> end it now; a pending `read` raises asyncio.CancelledError, and the engine's
                            request is cancelled (gRPC: the call's cancel; HTTP: the connection is closed,
                            which vLLM and SGLang take as an abort)

Messages: `worker_pb2.GenerateResponse` from a kvroute worker (token ids, which the request path
detokenizes and cuts at stop strings), `EngineDelta` from an HTTP engine (text the engine detokenized and
cut at stop strings itself, so the request path applies neither again). Failures are raised as
`grpc.aio.AioRpcError` with the canonical status code for both backends, so the request path books them
one way (INVALID_ARGUMENT / OUT_OF_RANGE: the client's fault, refused with a 400 naming the field;
RESOURCE_EXHAUSTED: busy, tried elsewhere; anything else before the first token: retried elsewhere and a
breaker failure; after it: the stream ends with an error). HTTP statuses map as `_STATUS_CODES` says; a
connection that cannot be made or breaks is UNAVAILABLE.

What goes to an HTTP engine, in its own API (so its tool-call and reasoning parsers, structured output and
logprobs keep working): a chat request stays a chat request, its body as the client sent it (every field,
the engine's own extensions included); a completion is sent with the token ids the gateway hashed as its
`prompt` (what the router scored is exactly what the engine caches; docs/engines.md weighs the choice), as
is a token-level (gRPC) request. The gateway always sets `model` (the engine's served name), `stream: true`
with `stream_options.include_usage` (the engine's cached-token count arrives in its usage), `n: 1` (the
request path sends each choice on its own), the choice's `seed`, `max_tokens` (cut to the context left) and
`cache_salt` (the tenant's salt: the engine's own prefix cache isolates tenants as kvroute workers do).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol

import aiohttp
import grpc
import orjson

from gateway.fleet.fleet_state import WorkerMember
from gateway.request import GatewayRequest, TokenLogprob
from gateway.worker_client import WorkerClients
from gateway.worker_spec import EngineTarget
from kvroute.sampling import SamplingParams
from kvroute.sampling_proto import sampling_to_proto
from proto import worker_pb2

# An engine's HTTP status -> the canonical code the request path books (see the module docstring).
_STATUS_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,  # the engine wants a key the gateway does not have: a setup error
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.NOT_FOUND,  # the engine does not serve the model named: retried elsewhere, a breaker failure
    413: grpc.StatusCode.OUT_OF_RANGE,
    422: grpc.StatusCode.INVALID_ARGUMENT,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
MAX_ERROR_BYTES = 64 * 1024  # of an engine's error body read to name the fault
MAX_EVENT_BYTES = 16 * 1024 * 1024  # one SSE event of an engine's stream; past it the stream fails
_QUEUE_DEPTH = 8  # engine events read ahead of the client: a slow client slows the read, nothing piles up
_DELTA_TEXT = ("content",)
_DELTA_PASSED = ("tool_calls", "reasoning_content", "reasoning", "function_call")
# Tool calls in one choice: a delta's `index` names the call it continues, and the gateway (merging a whole
# message) and the client keep a call per index, so an index is an engine's claim on their memory.
MAX_TOOL_CALLS = 128


@dataclasses.dataclass
class ForwardJob:
    """What every worker request of one client request carries (the request path builds it once)."""

    request_id: str
    request: GatewayRequest
    prompt_ids: list[int]
    salt: str
    hashes: list[bytes]
    params: SamplingParams  # max_tokens possibly cut to the context left
    trace_context: dict[str, str]
    priority: int = dataclasses.field(default=0, kw_only=True)  # effective: its tenant's clamp applied

    def seed(self, choice: int) -> int | None:
        """n choices, n different samples; wrapped to stay an int64 (a seed of 2**63 - 1 with n = 2 is valid)."""
        seed = self.params.seed
        return (seed + choice + 2**63) % 2**64 - 2**63 if seed is not None else None

    def choice_id(self, choice: int) -> str:
        return self.request_id if choice == 0 else f"{self.request_id}-{choice}"


@dataclasses.dataclass(frozen=True)
class EngineDelta:
    """One message of an HTTP engine's stream, for one choice: text to append (its stop strings already cut),
    the fields of a chat delta beyond `content` (tool_calls, reasoning_content) as the engine sent them,
    logprobs, and on the last one the finish reason and the engine's usage."""

    text: str = ""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None
    completion_tokens: int | None = None  # the engine's count, on the last message
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when the engine reports it


DP_RANK_HEADER = "X-data-parallel-rank"  # vLLM's (`_get_data_parallel_rank`) and SGLang's (serving_base), any case


class BackendCall(Protocol):
    async def read(self) -> Any: ...

    def cancel(self) -> bool: ...


class Backend(Protocol):
    def open(self, member: WorkerMember, job: ForwardJob, choice: int) -> BackendCall: ...

    async def close(self) -> None: ...

    def release(self, address: str) -> None: ...


def generate_request(job: ForwardJob, choice: int) -> worker_pb2.GenerateRequest:
    """One choice of `job` as a kvroute worker's `Generate` takes it."""
    seed = job.seed(choice)
    params = job.params if seed == job.params.seed else dataclasses.replace(job.params, seed=seed)
    return worker_pb2.GenerateRequest(
        request_id=job.choice_id(choice),
        prompt_token_ids=job.prompt_ids,
        sampling=sampling_to_proto(params),
        cache_salt=job.salt,
        block_hashes=job.hashes,
        trace_context=job.trace_context,
        priority=job.priority,
    )


class QueuedCall:
    """A BackendCall whose messages a producer task puts in a small queue (`_QUEUE_DEPTH`: a slow reader slows
    the producer, nothing piles up): `read` takes the next one (raising an exception put there), `cancel` cancels
    the producer and wakes a pending read. A subclass starts its producer with `_start(coroutine, name)`; the
    producer ends by putting `grpc.aio.EOF` or an exception."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Any] = asyncio.Queue(_QUEUE_DEPTH)
        self._cancelled = False
        self._task: asyncio.Task[None] | None = None

    def _start(self, producer: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        self._task = asyncio.get_running_loop().create_task(producer, name=name)
        return self._task

    async def read(self) -> Any:
        if self._cancelled:
            raise asyncio.CancelledError
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> bool:
        if self._cancelled:
            return False
        self._cancelled = True
        if self._task is not None:
            self._task.cancel()
        with contextlib.suppress(asyncio.QueueFull):  # wake a pending read; a full queue has no reader waiting
            self._queue.put_nowait(asyncio.CancelledError())
        return True

    def fail(self, error: BaseException) -> None:
        """End the call from the backend's side (its worker went away): the producer is cancelled, what it had
        queued is dropped, and the next read raises `error`."""
        if self._task is not None:
            self._task.cancel()
        while not self._queue.empty():
            self._queue.get_nowait()
        self._queue.put_nowait(error)


class GrpcBackend:
    """kvroute workers: `kvroute.v1.Worker.Generate` over kept channels (gateway.worker_client)."""

    def __init__(self, clients: WorkerClients) -> None:
        self.clients = clients

    def open(self, member: WorkerMember, job: ForwardJob, choice: int) -> BackendCall:
        return self.clients.stub(member.address).Generate(generate_request(job, choice))

    def release(self, address: str) -> None:
        self.clients.release(address)

    async def close(self) -> None:
        await self.clients.close()


class HttpBackend:
    """vLLM and SGLang: their OpenAI HTTP API, one `aiohttp.ClientSession` per address with at most
    `max_connections` kept-alive connections (a request past them waits for one, up to `pool_timeout` seconds
    more than `connect_timeout`, then fails UNAVAILABLE and is tried elsewhere). aiohttp, not httpx: less
    work per request (docs/engines.md). `engine(worker_id)`: how to address a member (EngineTarget), None
    (or no `engine`) for an engine that wants neither a key nor a rank."""

    def __init__(
        self,
        *,
        max_connections: int = 256,
        connect_timeout: float = 2.0,
        pool_timeout: float = 5.0,
        engine: Callable[[str], EngineTarget | None] | None = None,
    ) -> None:
        self.max_connections = max_connections
        self.engine = engine
        self.timeout = aiohttp.ClientTimeout(
            total=None, connect=pool_timeout + connect_timeout, sock_connect=connect_timeout, sock_read=None
        )
        self._clients: dict[str, aiohttp.ClientSession] = {}
        self._closing: set[asyncio.Task[None]] = set()

    def client(self, address: str, key: str | None = None) -> aiohttp.ClientSession:
        """The session to `address`, made at its first request (with the engine's key as a default header)."""
        client = self._clients.get(address)
        if client is None:
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0, use_dns_cache=True)
            client = aiohttp.ClientSession(
                base_url=f"http://{address}", connector=connector, timeout=self.timeout,
                skip_auto_headers=("Accept-Encoding", "User-Agent"),
                headers={"Authorization": f"Bearer {key}"} if key else None,
            )  # fmt: skip
            self._clients[address] = client
        return client

    def open(self, member: WorkerMember, job: ForwardJob, choice: int) -> BackendCall:
        path, body = engine_request(job, member.model_id, choice)
        target = self.engine(member.worker_id) if self.engine is not None else None
        headers = _JSON
        if target is not None and target.data_parallel_rank is not None:
            headers = {**_JSON, DP_RANK_HEADER: str(target.data_parallel_rank)}
        client = self.client(member.address, target.api_key if target is not None else None)
        return HttpCall(client, path, body, job.request.kind == "chat", headers)

    def release(self, address: str) -> None:
        """No member has this address any more: its client closes once the requests still on it end."""
        client = self._clients.pop(address, None)
        if client is not None:
            task = asyncio.get_running_loop().create_task(client.close(), name=f"close http {address}")
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        clients, self._clients = self._clients, {}
        await asyncio.gather(*(c.close() for c in clients.values()), *self._closing, return_exceptions=True)


def engine_request(job: ForwardJob, engine_model: str, choice: int) -> tuple[str, dict[str, Any]]:
    """The path and JSON body of one choice's request to an HTTP engine (the module docstring's rules)."""
    request, params = job.request, job.params
    sent = orjson.loads(request.api_json) if request.api_json is not None else None  # valid: the front door read it
    if request.kind == "chat" and sent is not None:
        path, body = "/v1/chat/completions", sent
        body.pop("max_completion_tokens", None)
    else:
        path, body = "/v1/completions", sent or {}
        body["prompt"] = job.prompt_ids
        if sent is None:  # a token-level request: its sampling is all there is
            body.update(_sampling_body(params, request))
    body.update(
        model=engine_model, stream=True, stream_options={"include_usage": True}, n=1, max_tokens=params.max_tokens
    )
    seed = job.seed(choice)
    if seed is not None:
        body["seed"] = seed
    body.pop("cache_salt", None)
    if job.salt:
        body["cache_salt"] = job.salt
    return path, body


def _sampling_body(params: SamplingParams, request: GatewayRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k or -1,
        "min_tokens": params.min_tokens, "ignore_eos": params.ignore_eos,
        "skip_special_tokens": request.skip_special_tokens,
    }  # fmt: skip
    if params.stop_token_ids:
        body["stop_token_ids"] = list(params.stop_token_ids)
    if request.stop:
        body["stop"] = list(request.stop)
    if params.logprobs:
        body["logprobs"] = params.top_logprobs
    return body


class HttpCall(QueuedCall):
    """One choice's request to an HTTP engine, read as `EngineDelta`s (the BackendCall contract). The request
    is sent at once, by a task that reads the engine's server-sent events as they arrive (no buffering past
    `_QUEUE_DEPTH` events) and closes the connection when cancelled. The choice's finish is held back until
    the engine's usage event (or the end of the stream), so its last EngineDelta carries both."""

    def __init__(
        self, client: aiohttp.ClientSession, path: str, body: dict[str, Any], chat: bool, headers: dict[str, str]
    ) -> None:
        super().__init__()
        self._chat = chat
        self._start(self._run(client, path, body, headers), f"http {path}")

    async def _run(
        self, client: aiohttp.ClientSession, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> None:
        try:
            async with client.post(path, data=orjson.dumps(body), headers=headers) as response:
                if response.status != 200:
                    raise await _http_error(response)
                held: EngineDelta | None = None  # the choice's finish, waiting for the usage event
                async for data in _sse_data(response):
                    if data == b"[DONE]":  # read on to the body's end: a connection left mid-body is not reused
                        continue
                    event = _event(data)
                    delta, usage = self._delta(event), event.get("usage")
                    if delta is not None and delta.finish_reason is None:
                        await self._queue.put(delta)
                        continue
                    if delta is not None:
                        held = delta
                    if usage and held is not None:
                        await self._queue.put(_with_usage(held, usage))
                        held = None
                if held is not None:
                    await self._queue.put(held)
            await self._queue.put(grpc.aio.EOF)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AioRpcError as exc:
            await self._queue.put(exc)
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            await self._queue.put(rpc_error(grpc.StatusCode.UNAVAILABLE, f"{type(exc).__name__}: {exc}"))
        except (ValueError, TypeError, KeyError) as exc:
            await self._queue.put(rpc_error(grpc.StatusCode.INTERNAL, f"the engine sent a malformed event: {exc}"))

    def _delta(self, event: dict[str, Any]) -> EngineDelta | None:
        """The event's choice as an EngineDelta; None for an event without one (the usage event)."""
        choices = event.get("choices")
        if not choices:
            return None
        choice = choices[0]
        if self._chat:
            delta = choice.get("delta") or {}
            text = "".join(delta.get(k) or "" for k in _DELTA_TEXT)
            extra = {k: delta[k] for k in _DELTA_PASSED if delta.get(k)}
            _check_tool_calls(extra.get("tool_calls", []))
            logprobs = _chat_logprobs(choice.get("logprobs"))
        else:
            text, extra, logprobs = choice.get("text") or "", {}, _completion_logprobs(choice.get("logprobs"))
        finish_reason = choice.get("finish_reason")
        if finish_reason is not None and not isinstance(finish_reason, str):
            raise ValueError(f"finish_reason is {type(finish_reason).__name__}, not a string")
        return EngineDelta(text, extra, logprobs, finish_reason)


def _check_tool_calls(calls: Any) -> None:
    """ValueError (a malformed event) unless each tool-call delta is an object whose `index`, where given, is
    an integer in [0, MAX_TOOL_CALLS)."""
    if not isinstance(calls, list):
        raise ValueError(f"tool_calls is {type(calls).__name__}, not an array")
    for call in calls:
        index = call.get("index", 0) if isinstance(call, dict) else None
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < MAX_TOOL_CALLS:
            raise ValueError(f"a tool_calls index must be an integer in [0, {MAX_TOOL_CALLS}), got {index!r}"[:120])


_JSON = {"content-type": "application/json", "accept": "text/event-stream"}


async def _sse_data(response: aiohttp.ClientResponse) -> Any:
    """The `data:` payloads of a server-sent event stream, each as bytes, as they arrive."""
    buffer = b""
    async for piece in response.content.iter_any():
        buffer += piece
        while True:
            end = buffer.find(b"\n\n")
            if end < 0:
                break
            block, buffer = buffer[:end], buffer[end + 2 :]
            lines = block.replace(b"\r\n", b"\n").split(b"\n")
            data = b"\n".join(line[5:].lstrip(b" ") for line in lines if line.startswith(b"data:"))
            if data:
                yield data
        if len(buffer) > MAX_EVENT_BYTES:
            raise ValueError(f"an event over {MAX_EVENT_BYTES} bytes")


def _event(data: bytes) -> dict[str, Any]:
    event = orjson.loads(data)
    if not isinstance(event, dict):
        raise ValueError("an event that is not a JSON object")
    error = event.get("error")
    if error:  # vLLM and SGLang end a failing stream with an error event
        message = error.get("message") if isinstance(error, dict) else str(error)
        raise rpc_error(grpc.StatusCode.INTERNAL, f"the engine failed the stream: {message}")
    return event


def _with_usage(delta: EngineDelta, usage: dict[str, Any] | None) -> EngineDelta:
    if not usage:
        return delta
    details = usage.get("prompt_tokens_details") or {}
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return dataclasses.replace(
        delta, completion_tokens=usage.get("completion_tokens"), cached_tokens=cached if cached is not None else None
    )


def _chat_logprobs(logprobs: dict[str, Any] | None) -> tuple[TokenLogprob, ...]:
    if not logprobs:
        return ()
    return tuple(
        TokenLogprob(
            entry["token"],
            -1,
            float(entry["logprob"]),
            list(entry.get("bytes") or entry["token"].encode()),
            tuple(_chat_logprobs({"content": entry.get("top_logprobs") or ()})),
        )  # fmt: skip
        for entry in logprobs.get("content") or ()
    )


def _completion_logprobs(logprobs: dict[str, Any] | None) -> tuple[TokenLogprob, ...]:
    if not logprobs:
        return ()
    tokens: Sequence[str] = logprobs.get("tokens") or ()
    values: Sequence[float] = logprobs.get("token_logprobs") or ()
    tops: Sequence[dict[str, float] | None] = logprobs.get("top_logprobs") or ()
    out = []
    for i, (token, value) in enumerate(zip(tokens, values, strict=False)):
        top = tops[i] if i < len(tops) else None
        top = top or {}
        alternatives = tuple(TokenLogprob(t, -1, float(lp), list(t.encode())) for t, lp in top.items() if t != token)
        out.append(TokenLogprob(token, -1, float(value), list(token.encode()), alternatives))
    return tuple(out)


async def _http_error(response: aiohttp.ClientResponse) -> grpc.aio.AioRpcError:
    """An engine's refusal as the canonical error: its message, and the field it names where it names one."""
    raw = b""
    async for piece in response.content.iter_any():
        raw += piece
        if len(raw) > MAX_ERROR_BYTES:
            break
    message = raw[:MAX_ERROR_BYTES].decode(errors="replace").strip() or response.reason or ""
    with contextlib.suppress(ValueError, TypeError, AttributeError):
        error = orjson.loads(raw).get("error") or orjson.loads(raw)
        if isinstance(error, dict):
            text, param = error.get("message") or message, error.get("param")
            message = f"{param}: {text}" if param and not str(text).startswith(f"{param}: ") else str(text)
    code = _STATUS_CODES.get(response.status)
    if code is None:
        code = grpc.StatusCode.INVALID_ARGUMENT if response.status < 500 else grpc.StatusCode.INTERNAL
    return rpc_error(code, f"HTTP {response.status}: {message}" if code not in _CLIENT_CODES else message)


_CLIENT_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE}


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """A failure as a gRPC call raises it, for a backend that is not gRPC (the request path books them alike)."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)
