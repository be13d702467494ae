"""vLLM's render endpoints, `POST /v1/chat/completions/render` and `POST /v1/completions/render`: a generation
request turned into the token ids the engine would be given, without generating. Routers that route from the
engines' KV events tokenize through them (llm-d's precise prefix scorer; vllm-router's `kv_aware` tries them
before `/tokenize`), so a kvroute worker serves them as `vllm serve` does.

Request: the endpoint's own OpenAI body, read and checked as a generation request is (the same wire models,
body limit and errors), then templated and tokenized as `RequestPath.tokenize` does for /tokenize (the key,
the model, the chat template, the prompt-length limit); nothing is routed. Response: vLLM 0.33's
`GenerateRequest` (`vllm.entrypoints.scale_out.token_in_token_out.protocol`), for chat one object, for
completions a list of one (vLLM answers one per prompt; a completion here takes one prompt):
`{"request_id", "token_ids", "features": null, "sampling_params", "model", "stream", "stream_options",
"cache_salt", "priority": 0}`, `sampling_params` under vLLM's `SamplingParams` names, defaults left out as
vLLM's msgspec struct leaves them out. The client's `cache_salt` is echoed as vLLM does; a tenant's own salt
is the server's and never leaves it.
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING, Any

import orjson

from gateway.errors import GatewayError
from gateway.frontdoors.http_protocol import Exchange
from gateway.frontdoors.http_routes import Reply, Route, error_reply
from gateway.frontdoors.http_server import DEFAULT_MAX_BODY_BYTES, read_body, read_headers, request_headers
from gateway.frontdoors.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    client_request_id_of,
    parse_request,
)

if TYPE_CHECKING:
    from gateway.frontdoors.http_server import ServesRequests
    from gateway.request import GatewayRequest

CHAT_RENDER_PATH = "/v1/chat/completions/render"
COMPLETION_RENDER_PATH = "/v1/completions/render"
# vLLM's SamplingParams defaults for the fields a kvroute request sets; equal ones are left out, as there.
_SAMPLING_DEFAULTS: dict[str, Any] = {
    "n": 1, "temperature": 1.0, "top_p": 1.0, "top_k": 0, "seed": None, "stop": None, "stop_token_ids": None,
    "ignore_eos": False, "max_tokens": 16, "min_tokens": 0, "logprobs": None, "skip_special_tokens": True,
}  # fmt: skip


class RenderEndpoints:
    """The two render routes over one request path (`routes()`, for `build_app`'s `extra_routes`)."""

    def __init__(
        self,
        request_path: ServesRequests,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        default_max_tokens: int | None = None,
    ) -> None:
        self.request_path = request_path
        self.max_body_bytes = max_body_bytes
        self.default_max_tokens = default_max_tokens

    def routes(self) -> list[Route]:
        return [
            Route(b"POST", CHAT_RENDER_PATH, self.render_chat),
            Route(b"POST", COMPLETION_RENDER_PATH, self.render_completion),
        ]

    async def render_chat(self, exchange: Exchange) -> Reply:
        return await self._render(exchange, ChatCompletionRequest, listed=False)

    async def render_completion(self, exchange: Exchange) -> Reply:
        return await self._render(exchange, CompletionRequest, listed=True)

    async def _render(self, exchange: Exchange, wire_type: type[SamplingFields], listed: bool) -> Reply:
        read = read_headers(exchange.headers)
        request_id = client_request_id_of(read.get("x-request-id")) or uuid.uuid4().hex
        headers = {"x-request-id": request_id}
        try:
            body = await read_body(exchange, read, self.max_body_bytes)
            wire = parse_request(wire_type, body)
            gateway_request = wire.to_gateway_request(request_headers(read), self.default_max_tokens)
            pool = self.request_path.pool(gateway_request.model)
            result = await pool.tokenize(gateway_request)
        except GatewayError as exc:
            self.request_path.metrics.errors.labels(type(exc).__name__).inc()
            return error_reply(exc, headers)
        rendered = generate_request(request_id, result.token_ids, wire, gateway_request)
        return Reply(200, headers, orjson.dumps([rendered] if listed else rendered))


def generate_request(
    request_id: str, token_ids: list[int], wire: SamplingFields, request: GatewayRequest
) -> dict[str, Any]:
    """vLLM's `GenerateRequest` for one rendered prompt (the module docstring says which fields)."""
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "features": None,
        "sampling_params": sampling_params(request),
        "model": wire.model,
        "stream": wire.stream,
        "stream_options": wire.stream_options.model_dump() if wire.stream and wire.stream_options else None,
        "cache_salt": wire.cache_salt,
        "priority": 0,
    }


def sampling_params(request: GatewayRequest) -> dict[str, Any]:
    """The request's sampling as vLLM's `SamplingParams` JSON: its field names, its defaults left out."""
    params = request.params
    fields: dict[str, Any] = {
        "n": request.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "seed": params.seed,
        "stop": list(request.stop) or None,
        "stop_token_ids": list(params.stop_token_ids) or None,
        "ignore_eos": params.ignore_eos,
        "max_tokens": params.max_tokens,
        "min_tokens": params.min_tokens,
        "logprobs": params.top_logprobs if params.logprobs else None,
        "skip_special_tokens": request.skip_special_tokens,
    }
    return {name: value for name, value in fields.items() if value != _SAMPLING_DEFAULTS[name]}
