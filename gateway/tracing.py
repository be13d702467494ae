"""OpenTelemetry for the gateway: one span per request, parent of the worker's span.

The request's span continues the client's W3C trace context when one came (`traceparent` header or gRPC
metadata), carries the routing decision as attributes (`kvroute.route.*`), and its context is sent to the
worker in `GenerateRequest.trace_context`, where the worker's `kvroute.worker.generate` span continues it.

Spans are exported over OTLP/gRPC only when the standard `OTEL_EXPORTER_OTLP_ENDPOINT` (or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set; otherwise no exporter runs and spans cost next to nothing
(the API's non-recording spans still pass a client's trace context on to the worker).
"""

from __future__ import annotations

import logging
import os

from opentelemetry import propagate, trace

from gateway.request import RouteInfo

logger = logging.getLogger(__name__)
tracer = trace.get_tracer("kvroute.gateway")
_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def setup_tracing(service_name: str = "kvroute-gateway") -> bool:
    """Install an OTLP exporter if the environment names an endpoint; returns whether one was installed.
    Call once per process, before serving."""
    endpoint = next((os.environ[v] for v in _ENDPOINT_VARIABLES if os.environ.get(v)), None)
    if endpoint is None:
        return False
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", service_name)})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    logger.info("tracing: exporting spans over OTLP to %s", endpoint)
    return True


def start_request_span(request_id: str, kind: str, client_context: dict[str, str]) -> trace.Span:
    """The gateway span of one request, continuing the client's trace context if it sent one."""
    parent = propagate.extract(client_context) if client_context else None
    return tracer.start_span(
        "kvroute.gateway.generate",
        context=parent,
        kind=trace.SpanKind.SERVER,
        attributes={"kvroute.request_id": request_id, "kvroute.kind": kind},
    )


def worker_trace_context(span: trace.Span) -> dict[str, str]:
    """The W3C headers (traceparent, tracestate) that make the worker's span a child of `span`."""
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
