"""The gateway's span and the trace context it sends the worker (gateway/tracing.py), with no tracer provider
installed and with one, in a fresh process (the provider is process-global: once set it stays)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from gateway.request import GatewayRequest
    from gateway.tracing import start_request_span, worker_trace_context

    CLIENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    plain = GatewayRequest(api_key=None, model=None, prompt="hi")
    traced = GatewayRequest(api_key=None, model=None, prompt="hi", trace_context={"traceparent": CLIENT})

    # No provider: no span; a client's context still reaches the worker as the client sent it.
    span = start_request_span("r1", plain, "m")
    assert not span.is_recording() and worker_trace_context(span) == {}
    span = start_request_span("r2", traced, "m")
    assert not span.is_recording() and worker_trace_context(span) == {"traceparent": CLIENT}

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    for request in (plain, traced):
        span = start_request_span("r3", request, "m")
        assert span.is_recording()
        context = span.get_span_context()
        sent = worker_trace_context(span)["traceparent"]
        assert sent.split("-")[1:3] == [f"{context.trace_id:032x}", f"{context.span_id:016x}"], sent
        span.end()
    first, second = exporter.get_finished_spans()
    assert first.parent is None and first.attributes["kvroute.request_id"] == "r3"
    assert format(second.context.trace_id, "032x") == "0af7651916cd43dd8448eb211c80319c"
    assert format(second.parent.span_id, "016x") == "b7ad6b7169203331"
    print("ok")
    """
)


def test_spans_and_the_workers_trace_context_with_and_without_a_provider() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
