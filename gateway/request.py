"""The gateway's one internal request type and what comes back, between the front doors and the request path.

    HTTP (OpenAI) ─┐                                                          ┌─► Chunk, Chunk, ... (per choice)
    gRPC Gateway ──┼─► GatewayRequest ─► RequestPath.generate(request) ─► Generation ─┤
    gRPC Worker ───┘   (validated shape)  auth → template → tokenize → hash    └─► usage, route
                                           → route → forward → detokenize

A front door only translates: it parses its wire format into a `GatewayRequest` (refusing malformed input
with gateway.errors.InvalidRequestError naming the field), calls `RequestPath.generate`, and renders the
`Generation` back. Everything else (auth, limits, templates, tokenization, routing, retries, stop strings,
detokenization) happens once, in the request path.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

from kvroute.sampling import SamplingParams

# The priorities a request may name (vLLM's `priority`, or x-kvroute-priority), and a tenant's file may set.
PRIORITY_RANGE = (-1_000_000, 1_000_000)


@dataclass(frozen=True)
class Tenant:
    """Who is calling, from the authenticated API key (or the one open tenant when no keys are configured)."""

    name: str
    cache_salt: str  # set on the server; a client's salt is only ever mixed in under it
    max_concurrency: int | None = None  # requests in flight at once; past it: 429 with Retry-After
    priority: int = 0  # its requests' default priority (lower is more urgent; vLLM's `priority`)
    min_priority: int | None = None  # the most urgent priority its requests may take (None: `priority`)
    weight: float = 1.0  # its fair share of a band, in tokens, against the other tenants' weights

    def clamped_priority(self, asked: int | None) -> int:
        """The priority a request of this tenant runs at: what it asked (else the tenant's default), never
        more urgent than the tenant's ceiling."""
        ceiling = self.priority if self.min_priority is None else self.min_priority
        return max(self.priority if asked is None else asked, ceiling)


@dataclass
class GatewayRequest:
    """One client request, validated for shape by its front door. Exactly one of `prompt`, `messages` and
    `prompt_token_ids` is set."""

    api_key: str | None  # as the client sent it (Authorization: Bearer / gRPC metadata); None when absent
    model: str | None  # the model the client named; None or the served model's name are both accepted
    prompt: str | None = None  # completions: plain text, tokenized with the model's BOS when it wants one
    messages: list[dict[str, Any]] | None = None  # chat: rendered through the model's chat template
    prompt_token_ids: list[int] | None = None  # token-level clients (gRPC); used as given
    params: SamplingParams = field(default_factory=SamplingParams)  # token-level sampling, sent to the worker
    # The client set no max_tokens: params.max_tokens is the front door's default, which the request path
    # cuts to the context the worker has left (a limit the client chose is refused instead when it is too big).
    max_tokens_defaulted: bool = False
    stop: tuple[str, ...] = ()  # stop strings, matched on the detokenized text across token boundaries
    n: int = 1  # independent choices for the same prompt (each its own worker request)
    session_id: str | None = None  # x-session-id header or OpenAI `user`: the `session` policy's key
    app: str | None = None  # x-kvroute-app header: the prefix doctor's grouping (default: the API key's tenant)
    client_cache_salt: str = ""  # mixed in under the tenant's salt, never replacing it
    priority: int | None = None  # body `priority` or x-kvroute-priority (the header wins); None: the tenant's
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # extra variables for the chat template
    # Tool calls and structured output, the same for every front door (gateway/structured_request.py: the rules;
    # docs/structured-output.md). `tools` reach the prompt through the tokenizer's chat step (with `messages`; a
    # caller that sends `prompt_token_ids` renders them itself, kvroute.tokenizer.Tokenizer.encode_chat); the
    # constraint they imply goes to a kvroute worker in params.structured, and the output's tool calls come back
    # parsed, in Chunk.extra["tool_calls"] (chat delta shape), finish_reason "tool_calls".
    tools: list[dict[str, Any]] | None = None  # chat's `{"type": "function", "function": {"name", ...}}`
    tool_choice: str | dict[str, Any] | None = None  # "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool = True  # False: at most one call (a forced call's grammar stops after it)
    # chat's: {"type": "json_schema", "json_schema": {"name", "schema", "strict"?}}, {"type": "json_object"}, text
    response_format: dict[str, Any] | None = None
    skip_special_tokens: bool = True
    # The special tokens (a BOS) around the prompt's ids: None = the default, on for a prompt and off for
    # messages (whose template writes its own), as vLLM's; /tokenize's clients may set it.
    add_special_tokens: bool | None = None
    stream: bool = False
    kind: Literal["chat", "completion", "tokens"] = "completion"
    trace_context: dict[str, str] = field(default_factory=dict)  # W3C traceparent from the client, if any
    # The worker that served the conversation's previous turn (/v1/responses): kv_aware's first choice while it
    # holds the prefix and is under its load bound (reason `conversation`).
    conversation_worker: str | None = None
    # The JSON body as the client sent it (HTTP front door only; parsed only when an HTTP engine is sent it, so
    # the fields only the engine understands, such as tools, response_format or its own extensions, reach it).
    api_json: bytes | None = None


@dataclass(frozen=True)
class TokenizeResult:
    """What /tokenize answers: the prompt's ids and the longest sequence the fleet's workers take."""

    token_ids: list[int]
    max_model_len: int


@dataclass(frozen=True)
class RouteInfo:
    """Where a request went and why: the `x-kvroute-worker` and `x-kvroute-route` headers."""

    worker_id: str
    address: str
    policy: str
    reason: str
    matched_blocks: int = 0
    skipped: tuple[str, ...] = ()  # replicas passed over for load (or excluded after a failure)
    attempts: int = 1  # workers tried, the last one included
    flags: tuple[str, ...] = ()  # why the worker's cached prefixes are not scored (FleetState.flags)

    def header(self) -> str:
        """`policy=kv_aware; reason=hit; matched_blocks=12; skipped=w1,w3; attempts=1[; flags=no_kv_events]`."""
        parts = [f"policy={self.policy}", f"reason={self.reason}", f"matched_blocks={self.matched_blocks}"]
        if self.skipped:
            parts.append(f"skipped={','.join(self.skipped)}")
        parts.append(f"attempts={self.attempts}")
        if self.flags:
            parts.append(f"flags={','.join(self.flags)}")
        return "; ".join(parts)


@dataclass(frozen=True)
class TokenLogprob:
    token: str  # the token's text (bytes that are not valid UTF-8 alone are shown as in OpenAI: "bytes:\\xe2")
    token_id: int
    logprob: float
    bytes: list[int]
    top: tuple[TokenLogprob, ...] = ()  # the most likely alternatives, most likely first (top_logprobs)


@dataclass(frozen=True)
class Chunk:
    """New output of one choice: text to append (stop strings already cut) and the tokens it came from.
    The last chunk of a choice has `finish_reason` set ("stop" | "length" | "abort")."""

    index: int
    text: str
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()  # one per token, when params.logprobs
    finish_reason: str | None = None
    # Fields of an HTTP engine's chat delta beyond its content (tool_calls, reasoning_content), as it sent them.
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0  # over every choice
    cached_tokens: int = 0  # prompt tokens the worker served from its prefix cache (of the first choice)


class Generation:
    """The answer to one request. `route` is known before the first chunk (so headers can be sent), `usage`
    once the iteration has ended. Iterating yields Chunks of every choice, interleaved; an error after the
    first chunk raises a GatewayError (UpstreamError) from the iteration. Leaving the iteration early (a
    client that disconnected) cancels every worker request of this generation, freeing their blocks."""

    request_id: str
    route: RouteInfo
    prompt_token_ids: list[int]
    usage: Usage

    def __aiter__(self) -> AsyncIterator[Chunk]:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError
