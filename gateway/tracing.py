"""OpenTelemetry for the gateway: one span per request, parent of the worker's span.

The request's span continues the client's W3C trace context when one came (`traceparent` header or gRPC
metadata), carries the routing decision as attributes (`kvroute.route.*`), and its context is sent to the
worker in `GenerateRequest.trace_context`, where the worker's `kvroute.worker.generate` span continues it.

The span carries the GenAI semantic-convention attributes (`gen_ai.operation.name`, `gen_ai.request.*`,
`gen_ai.usage.*`, `gen_ai.response.finish_reasons`). Exporting is set up by `kvroute.tracing.setup_tracing`
(only when the standard OTLP endpoint variables are set).
"""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry import propagate, trace

from gateway.request import GatewayRequest, RouteInfo, Usage
from kvroute.tracing import GEN_AI_PROVIDER

tracer = trace.get_tracer("kvroute.gateway")
# GatewayRequest.kind -> gen_ai.operation.name
_OPERATIONS = {"chat": "chat", "completion": "text_completion", "tokens": "text_completion"}


def start_request_span(request_id: str, request: GatewayRequest, model: str) -> trace.Span:
    """The gateway span of one request, continuing the client's trace context if it sent one. `model`: the
    served model name the request asked for. With no tracer provider installed and no client context this is
    `trace.INVALID_SPAN` at once, the span the API's no-op tracer would make (so nothing goes to the worker)."""
    if not request.trace_context and isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        return trace.INVALID_SPAN
    parent = propagate.extract(request.trace_context) if request.trace_context else None
    params = request.params
    attributes: dict[str, str | int | float] = {
        "kvroute.request_id": request_id,
        "kvroute.kind": request.kind,
        "gen_ai.operation.name": _OPERATIONS.get(request.kind, request.kind),
        "gen_ai.provider.name": GEN_AI_PROVIDER,
        "gen_ai.request.model": model,
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
    }
    if request.n > 1:
        attributes["gen_ai.request.choice.count"] = request.n
    if params.seed is not None:
        attributes["gen_ai.request.seed"] = params.seed
    return tracer.start_span(
        "kvroute.gateway.generate", context=parent, kind=trace.SpanKind.SERVER, attributes=attributes
    )


def record_usage(span: trace.Span, request_id: str, usage: Usage, finish_reasons: Sequence[str]) -> None:
    """The request's outcome on its span, in the GenAI conventions' names (and kvroute's, kept for dashboards)."""
    if not span.is_recording():
        return
    span.set_attributes(
        {
            "gen_ai.response.id": request_id,
            "gen_ai.usage.input_tokens": usage.prompt_tokens,
            "gen_ai.usage.output_tokens": usage.completion_tokens,
            "gen_ai.usage.cache_read.input_tokens": usage.cached_tokens,
            "gen_ai.response.finish_reasons": list(finish_reasons),
            "kvroute.prompt_tokens": usage.prompt_tokens,
            "kvroute.completion_tokens": usage.completion_tokens,
            "kvroute.cached_tokens": usage.cached_tokens,
        }
    )


def worker_trace_context(span: trace.Span) -> dict[str, str]:
    """The W3C headers (traceparent, tracestate) that make the worker's span a child of `span`; none for a span
    that continues no trace (the propagators write nothing for it: the gateway puts no baggage in its context)."""
    if not span.get_span_context().is_valid:
        return {}
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def record_route(span: trace.Span, route: RouteInfo) -> None:
    if span.is_recording():
        span.set_attributes(
            {
                "kvroute.route.worker": route.worker_id,
                "kvroute.route.address": route.address,
                "kvroute.route.policy": route.policy,
                "kvroute.route.reason": route.reason,
                "kvroute.route.matched_blocks": route.matched_blocks,
                "kvroute.route.skipped": ",".join(route.skipped),
                "kvroute.route.attempts": route.attempts,
            }
        )
