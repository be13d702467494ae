"""The live load generator as a library: send a rendered workload to a live OpenAI-compatible endpoint (a
kvroute gateway, one worker's own HTTP port, or another router) and time what users feel. The command line
is loadtest.bench_cli (`kvroute bench`); the statistics are loadtest.bench_stats'.

Arrivals: Poisson at `rate` requests/s (open loop, seeded), `concurrency` requests in flight, or the
workload's own timestamps. In every mode a request that continues a conversation (`BenchRequest.after`) is
sent only once the turn before it has finished, and a request with a think time (`chat`'s turns) waits that
long more, holding no concurrency slot meanwhile. With `live_history` a chat turn carries the answers the
server streamed for the session's earlier turns, as a chat client does; `duration_s` stops sending after that
many seconds (requests in flight finish and count; requests not sent do not).

Every request streams (`stream_options.include_usage`), so TTFT, ITL and the server's token counts come
from the stream itself.

The API (`Target.api`): `chat` sends each request to its own endpoint (`/v1/chat/completions` for messages,
`/v1/completions` for a prompt); `responses` sends every one to `/v1/responses`, streamed: a conversation's
system message as `instructions`, and, for a turn that continues one whose response id the bench kept
(`BenchRequest.previous_response_id`), only the messages after its last assistant message, with
`previous_response_id` (the server holds the rest); a session's first turn, or one after a failed turn, sends
the whole conversation as input items. A completion prompt goes as a string `input`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import httpx
import orjson

from gateway.frontdoors.openai_protocol import PRIORITY_HEADER  # a priority where the body has no field for it
from kvroute.errors import UserError
from loadtest.bench_stats import OK, RequestRecord, Summary
from loadtest.render import BenchRequest, Workload

WORKER_HEADER = "x-kvroute-worker"
ROUTE_HEADER = "x-kvroute-route"
APIS = ("chat", "responses")
RESPONSES = "responses"
RESPONSES_PATH = "/v1/responses"
DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Arrivals:
    """How requests are released: Poisson at `rate`, `concurrency` at a time, or the workload's timestamps
    (`time_scale` multiplies them)."""

    rate: float | None = None
    concurrency: int | None = None
    duration_s: float | None = None
    time_scale: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.rate is not None and self.concurrency is not None:
            raise ValueError("give --rate or --concurrency, not both")
        if self.rate is not None and not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"rate must be a positive number, got {self.rate}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration must be > 0 seconds, got {self.duration_s}")
        if not self.time_scale > 0:
            raise ValueError(f"time scale must be > 0, got {self.time_scale}")

    def describe(self) -> str:
        if self.rate is not None:
            return f"Poisson at {self.rate:g} req/s"
        if self.concurrency is not None:
            return f"concurrency {self.concurrency}"
        return "the workload's timestamps" + ("" if self.time_scale == 1 else f" x {self.time_scale:g}")

    def send_times(self, requests: tuple[BenchRequest, ...]) -> list[float] | None:
        """Seconds from the start at which each request may be sent; None for fixed concurrency."""
        if self.concurrency is not None:
            return None
        if self.rate is None:
            return [r.arrival_s * self.time_scale for r in requests]
        rng = random.Random(self.seed)
        times, t = [], 0.0
        for _ in requests:
            times.append(t)
            t += rng.expovariate(self.rate)
        return times


def check_api(api: str, ignore_eos: bool, exact_length: bool) -> None:
    """Raises UserError for an unknown API, or flags the API cannot carry."""
    if api not in APIS:
        raise UserError(f"--api must be one of {', '.join(APIS)}, got {api!r}")
    if api == RESPONSES and (ignore_eos or exact_length):
        raise UserError(
            "/v1/responses takes no ignore_eos or min_tokens: --ignore-eos and --exact-length are for --api chat"
        )


@dataclass
class Target:
    """Where requests go: an OpenAI-compatible base URL and the model name it serves. A request of a traffic
    mix (loadtest.traffic_mix) carries its band's `priority` in the body, and its tenant's key from
    `tenant_keys` (a router with API keys), or with `salt_by_tenant` its tenant's name as `cache_salt` (a router
    without tenants: the workers still keep each tenant's blocks apart, as our gateway's tenant salts do);
    `band_headers` adds headers per band (smg's priority class)."""

    url: str
    model: str
    api_key: str | None = None
    ignore_eos: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    exact_length: bool = False  # min_tokens = max_tokens
    tenant_keys: Mapping[str, str] = field(default_factory=dict)
    salt_by_tenant: bool = False
    band_headers: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    api: str = "chat"  # one of APIS (module docstring)

    def __post_init__(self) -> None:
        check_api(self.api, self.ignore_eos, self.exact_length)

    def path(self, request: BenchRequest) -> str:
        return RESPONSES_PATH if self.api == RESPONSES else request.endpoint

    def headers(self, request: BenchRequest) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        api_key = self.tenant_keys.get(request.tenant or "", self.api_key)
        if api_key:
            headers["authorization"] = f"Bearer {api_key}"
        if request.session:
            headers["x-session-id"] = request.session
        headers.update(self.band_headers.get(request.band or "", {}))
        if self.api == RESPONSES and request.priority is not None:
            headers[PRIORITY_HEADER] = str(request.priority)
        return headers

    def body(self, request: BenchRequest) -> dict[str, Any]:
        if self.api == RESPONSES:
            return self.responses_body(request)
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": request.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if request.messages is not None:
            body["messages"] = list(request.messages)
        else:
            body["prompt"] = request.prompt
        salt = request.cache_salt
        if self.salt_by_tenant and request.tenant:
            salt = f"{request.tenant}:{salt}" if salt else request.tenant
        if salt:
            body["cache_salt"] = salt
        if request.priority is not None:
            body["priority"] = request.priority
        if self.ignore_eos:
            body["ignore_eos"] = True
        if self.exact_length:
            body["min_tokens"] = request.max_tokens
        return body

    def responses_body(self, request: BenchRequest) -> dict[str, Any]:
        """The request as `/v1/responses` takes it (module docstring)."""
        body: dict[str, Any] = {
            "model": self.model,
            "max_output_tokens": request.max_tokens,
            "temperature": 0.0,
            "stream": True,
        }
        if request.cache_salt:
            raise UserError(f"request {request.index} has a cache_salt, which /v1/responses does not take: --api chat")
        if request.messages is None:
            body["input"] = request.prompt
            return body
        messages = list(request.messages)
        if messages and messages[0]["role"] == "system":
            body["instructions"] = messages.pop(0)["content"]
        if request.previous_response_id is not None:
            answered = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
            messages = messages[answered[-1] + 1 :] if answered else messages
            body["previous_response_id"] = request.previous_response_id
        body["input"] = [{"type": "message", "role": m["role"], "content": m["content"]} for m in messages]
        return body


async def send_one(client: httpx.AsyncClient, target: Target, request: BenchRequest, t0: float) -> RequestRecord:
    """Send one streaming request and time it (see loadtest.bench_stats for the definitions). Never raises
    for a failed request: the record's status names the kind of failure. A stream that ends properly with
    no text but output tokens in its usage (a model that ended its turn at once) completed, with no TTFT,
    as vLLM's benchmark counts it; one with neither is `empty_stream`. A chat or completion stream ends with
    `data: [DONE]`; a Responses stream with `response.completed` or `response.incomplete` (its `response`
    holds the id and usage), and fails with `response.failed` or an `error` event."""
    body = target.body(request)
    payload = orjson.dumps(body)
    read_event = _responses_event if target.api == RESPONSES else _chat_event
    start = time.perf_counter()
    record = RequestRecord(
        request.index, start - t0, session=request.session, tenant=request.tenant, band=request.band,
        after=request.after, previous_response_id=body.get("previous_response_id"),
    )  # fmt: skip
    last_content: float | None = None
    done = False
    pieces: list[str] = []
    try:
        async with client.stream(
            "POST", target.url.rstrip("/") + target.path(request), content=payload, headers=target.headers(request)
        ) as response:
            record.worker = response.headers.get(WORKER_HEADER)
            record.route = response.headers.get(ROUTE_HEADER)
            if response.status_code != 200:
                body_text = (await response.aread()).decode("utf-8", "replace")
                return _failed(record, f"http_{response.status_code}", _error_message(body_text))
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                event = read_event(line[5:].strip())
                if event.error is not None:
                    return _failed(record, "stream_error", event.error)
                now = time.perf_counter()
                if event.text:
                    pieces.append(event.text)
                    if last_content is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last_content)
                    last_content = now
                    record.output_tokens += 1  # replaced by the usage's count when the server sends it
                if event.usage is not None:
                    record.prompt_tokens, record.cached_tokens, output_tokens = event.usage
                    record.output_tokens = output_tokens or record.output_tokens
                record.response_id = event.response_id or record.response_id
                if event.done:
                    done = True
                    break
    except httpx.TimeoutException as exc:
        return _failed(record, "timeout", str(exc) or type(exc).__name__)
    except httpx.ConnectError as exc:
        return _failed(record, "connect_error", str(exc))
    except httpx.HTTPError as exc:
        return _failed(record, "transport_error", f"{type(exc).__name__}: {exc}")
    except (orjson.JSONDecodeError, AttributeError, TypeError) as exc:
        return _failed(record, "bad_stream", f"unparsable event: {exc}")
    record.e2e_s = time.perf_counter() - start
    record.output_text = "".join(pieces)
    if not done:
        last = "response.completed" if target.api == RESPONSES else "data: [DONE]"
        return _failed(record, "incomplete_stream", f"the stream ended without {last}")
    return _ended(record)


class _Event(NamedTuple):
    """What one `data:` line of a stream says: its text, the usage (prompt, cached, output tokens), whether the
    stream is done, an error's message, the response's id."""

    text: str = ""
    usage: tuple[int, int, int] | None = None
    done: bool = False
    error: str | None = None
    response_id: str | None = None


def _chat_event(data: str) -> _Event:
    """A chat or completion chunk (one choice asked for), or `[DONE]`."""
    if data == "[DONE]":
        return _Event(done=True)
    chunk = orjson.loads(data)
    if "error" in chunk:
        return _Event(error=_error_message(data))
    text = "".join(c.get("text") or (c.get("delta") or {}).get("content") or "" for c in chunk.get("choices") or ())
    usage = chunk.get("usage")
    if not usage:
        return _Event(text)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return _Event(text, (usage.get("prompt_tokens") or 0, cached, usage.get("completion_tokens") or 0))


def _responses_event(data: str) -> _Event:
    """A Responses stream event: text from `response.output_text.delta`; the id and usage from the response a
    `response.*` event carries; the end at `response.completed` / `response.incomplete`."""
    event = orjson.loads(data)
    kind = event.get("type")
    if kind == "response.output_text.delta":
        return _Event(event.get("delta") or "")
    if kind == "error":
        return _Event(error=str(event.get("message") or _error_message(data)))
    response = event.get("response") or {}
    if kind == "response.failed":
        return _Event(error=str((response.get("error") or {}).get("message") or "response.failed"))
    if kind not in ("response.completed", "response.incomplete"):
        return _Event(response_id=response.get("id"))
    usage = response.get("usage") or {}
    cached = (usage.get("input_tokens_details") or {}).get("cached_tokens") or 0
    tokens = (usage.get("input_tokens") or 0, cached, usage.get("output_tokens") or 0)
    return _Event(usage=tokens, done=True, response_id=response.get("id"))


def _ended(record: RequestRecord) -> RequestRecord:
    """The record of a stream that ended properly: with neither text nor output tokens it is `empty_stream`;
    with output tokens but no text (the model ended its turn at once) it completed, with no TTFT."""
    if record.ttft_s is None and record.output_tokens == 0:
        return _failed(record, "empty_stream", "no content in the stream")
    return record


def _failed(record: RequestRecord, status: str, message: str) -> RequestRecord:
    record.status = status
    record.error = message[:500]
    return record


def _error_message(body: str) -> str:
    try:
        error = json.loads(body).get("error")
        return str(error.get("message", error)) if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        return body[:500]


class HttpSender:
    """Streams each request over one pooled httpx client (HTTP/1.1 keep-alive, no connection limit)."""

    def __init__(self, target: Target) -> None:
        self.target = target
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
        self._client = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(target.timeout_s, connect=30.0))

    async def send(self, request: BenchRequest, t0: float) -> RequestRecord:
        return await send_one(self._client, self.target, request, t0)

    async def close(self) -> None:
        await self._client.aclose()


class GrpcSender:
    """Streams each request through the gateway's gRPC front door (`Gateway.Generate`) on one channel."""

    def __init__(
        self, address: str, api_key: str | None, ignore_eos: bool, timeout_s: float, exact_length: bool = False
    ) -> None:
        import grpc

        from proto import gateway_pb2_grpc

        self._channel = grpc.aio.insecure_channel(address.removeprefix("grpc://"))
        self._stub = gateway_pb2_grpc.GatewayStub(self._channel)
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._ignore_eos = ignore_eos
        self._exact_length = exact_length
        self._timeout_s = timeout_s

    async def send(self, request: BenchRequest, t0: float) -> RequestRecord:
        """As `send_one`, over gRPC: a reply with text is a content chunk; errors are `grpc_<code>`. A band's
        priority goes as the `x-kvroute-priority` metadata (the proto has no field for it)."""
        import grpc

        from proto import gateway_pb2, worker_pb2

        sampling = worker_pb2.SamplingParams(
            max_tokens=request.max_tokens,
            temperature=0.0,
            ignore_eos=self._ignore_eos,
            min_tokens=request.max_tokens if self._exact_length else 0,
        )
        message = gateway_pb2.GatewayGenerateRequest(
            sampling=sampling, session_id=request.session or "", cache_salt=request.cache_salt
        )
        if request.messages is not None:
            message.chat.messages.extend(gateway_pb2.ChatMessage(**m) for m in request.messages)
        else:
            message.prompt = request.prompt or ""
        metadata = self._metadata
        if request.priority is not None:
            metadata += ((PRIORITY_HEADER, str(request.priority)),)
        start = time.perf_counter()
        record = RequestRecord(
            request.index, start - t0, session=request.session, band=request.band, after=request.after
        )
        last_content: float | None = None
        pieces: list[str] = []
        try:
            async for reply in self._stub.Generate(message, metadata=metadata, timeout=self._timeout_s):
                now = time.perf_counter()
                if reply.route.worker_id:
                    record.worker = reply.route.worker_id
                if reply.text:
                    pieces.append(reply.text)
                    if last_content is None:
                        record.ttft_s = now - start
                    else:
                        record.itl_s.append(now - last_content)
                    last_content = now
                if reply.HasField("usage"):
                    record.output_tokens = reply.usage.completion_tokens
                    record.prompt_tokens = reply.usage.prompt_tokens
                    record.cached_tokens = reply.usage.cached_tokens
        except grpc.aio.AioRpcError as exc:
            return _failed(record, f"grpc_{exc.code().name.lower()}", exc.details() or "")
        record.e2e_s = time.perf_counter() - start
        record.output_text = "".join(pieces)
        return _ended(record)

    async def close(self) -> None:
        await self._channel.close()


class Sender(Protocol):
    """What `run_requests` sends through: HttpSender, GrpcSender, or the soak's failover over several gateways."""

    async def send(self, request: BenchRequest, t0: float) -> RequestRecord: ...

    async def close(self) -> None: ...


async def run_requests(
    workload: Workload,
    make_sender: Callable[[], Sender],
    arrivals: Arrivals,
    progress: bool = True,
    live_history: bool = True,
) -> tuple[list[RequestRecord], float]:
    """Send the workload through a sender made inside this event loop (gRPC channels bind to the loop they
    are made in); returns the records of the requests sent (by index) and the run's duration: from the
    first send to the last finish. A request is sent `think_s` after the later of its arrival time (none
    under fixed concurrency) and its previous turn's finish. With `live_history`, a chat turn carries the
    answers the server gave to the session's earlier turns instead of the logged ones (as a chat client
    does). A turn whose previous turn got a response id (a Responses stream's) carries it as
    `previous_response_id`."""
    requests = workload.requests
    answers: dict[int, str] = {}
    response_ids: dict[int, str] = {}
    sender = make_sender()
    send_at = arrivals.send_times(requests)
    finished = [asyncio.Event() for _ in requests]
    finished_at = [0.0] * len(requests)
    slots = asyncio.Semaphore(arrivals.concurrency) if arrivals.concurrency else None
    records: list[RequestRecord] = []
    bar = _progress_bar(len(requests), workload.name, progress)
    t0 = time.perf_counter()
    deadline = None if arrivals.duration_s is None else t0 + arrivals.duration_s

    async def one(request: BenchRequest) -> None:
        try:
            ready = t0 if send_at is None else t0 + send_at[request.index]
            if deadline is not None and ready >= deadline:
                return
            await asyncio.sleep(max(0.0, ready - time.perf_counter()))
            if request.after is not None:
                await finished[request.after].wait()
                ready = max(ready, finished_at[request.after])
                if live_history:
                    request = with_answers(request, requests, answers)
                if request.after in response_ids:
                    request = dataclasses.replace(request, previous_response_id=response_ids[request.after])
            await asyncio.sleep(max(0.0, ready + request.think_s - time.perf_counter()))
            if slots is not None:
                await slots.acquire()
            try:
                if deadline is not None and time.perf_counter() >= deadline:
                    return
                record = await sender.send(request, t0)
                records.append(record)
                if record.ok:
                    answers[request.index] = record.output_text
                    if record.response_id is not None:
                        response_ids[request.index] = record.response_id
                if bar is not None:
                    bar.update(1)
            finally:
                if slots is not None:
                    slots.release()
        finally:
            finished_at[request.index] = time.perf_counter()
            finished[request.index].set()

    try:
        await asyncio.gather(*(one(r) for r in requests))
    finally:
        await sender.close()
        if bar is not None:
            bar.close()
    wall = time.perf_counter() - t0
    records.sort(key=lambda r: r.index)
    # A failed request has no E2E; the run lasted until the later of the last finish and the last send.
    return records, max((r.sent_s + (r.e2e_s or 0.0) for r in records), default=wall)


def with_answers(request: BenchRequest, requests: tuple[BenchRequest, ...], answers: dict[int, str]) -> BenchRequest:
    """`request` with its assistant messages replaced by the answers its session's earlier turns got, oldest
    first (a turn that failed keeps its logged answer). Completion prompts are returned unchanged."""
    if request.messages is None:
        return request
    chain, previous = [], request.after
    while previous is not None:
        chain.append(previous)
        previous = requests[previous].after
    chain.reverse()
    turn = iter(chain)
    messages = []
    for message in request.messages:
        if message["role"] == "assistant":
            index = next(turn, None)
            if index is not None and index in answers:
                message = {**message, "content": answers[index]}
        messages.append(message)
    return dataclasses.replace(request, messages=tuple(messages))


def _progress_bar(total: int, name: str, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=name, unit="req", file=sys.stderr, dynamic_ncols=True)


async def served_model(url: str, api_key: str | None) -> str:
    """The first model `GET /v1/models` lists."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(timeout=30.0) as client:
            response = await client.get(url.rstrip("/") + "/v1/models", headers=headers)
    except httpx.HTTPError as exc:
        raise UserError(f"--url {url}: cannot reach it ({type(exc).__name__}: {exc})") from None
    if response.status_code != 200:
        raise UserError(f"--url {url}: GET /v1/models answered {response.status_code}; pass --served-model-name")
    models = response.json().get("data") or []
    if not models:
        raise UserError(f"--url {url}: GET /v1/models lists no model; pass --served-model-name")
    return models[0]["id"]


def bench_json(summary: Summary, records: list[RequestRecord]) -> dict[str, Any]:
    """The summary and every request's figures (times in ms)."""
    return {
        "summary": summary.to_json(),
        "per_request": [
            {
                "index": r.index,
                "status": r.status,
                "sent_ms": round(r.sent_s * 1e3, 3),
                "ttft_ms": None if r.ttft_s is None else round(r.ttft_s * 1e3, 3),
                "e2e_ms": None if r.e2e_s is None else round(r.e2e_s * 1e3, 3),
                "tpot_ms": None if r.tpot_s is None else round(r.tpot_s * 1e3, 3),
                "output_tokens": r.output_tokens,
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "worker": r.worker,
                **({"route": r.route} if r.route is not None else {}),
                **({"response_id": r.response_id} if r.response_id is not None else {}),
                **({"previous_response_id": r.previous_response_id} if r.previous_response_id is not None else {}),
                "session": r.session,
                **({"tenant": r.tenant} if r.tenant is not None else {}),
                **({"band": r.band} if r.band is not None else {}),
                **({"error": r.error} if r.status != OK else {}),
            }
            for r in records
        ],
    }
