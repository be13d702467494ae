"""The worker's spans: one `kvroute.worker.generate` span per Generate call, the child of the gateway's span
(whose W3C context arrives in `GenerateRequest.trace_context`), and under it one span per phase of the
request in the engine: `kvroute.worker.queue`, `kvroute.worker.prefill` and `kvroute.worker.decode`, each
with the engine steps it took.

Nothing here runs per token: the request span is opened when the call arrives and closed when it ends, and
the phase spans are written once, at the end, from the engine's `RequestTimings` with their real start and
end times. Exporting is set up by `kvroute.tracing.setup_tracing` (`kvroute worker` calls it; only when the
standard OTLP endpoint variables are set).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from opentelemetry import propagate, trace
from opentelemetry.context import Context

from kvroute.sampling import SamplingParams
from kvroute.tracing import GEN_AI_PROVIDER
from worker.sequence import RequestTimings

tracer = trace.get_tracer("kvroute.worker")


def start_generate_span(request_id: str, trace_context: dict[str, str], model: str, prompt_tokens: int) -> trace.Span:
    """The span of one Generate call, continuing the caller's trace context (none: a new trace)."""
    return tracer.start_span(
        "kvroute.worker.generate",
        context=propagate.extract(trace_context) if trace_context else None,
        kind=trace.SpanKind.SERVER,
        attributes={
            "kvroute.request_id": request_id,
            "kvroute.prompt_tokens": prompt_tokens,
            "gen_ai.operation.name": "text_completion",
            "gen_ai.provider.name": GEN_AI_PROVIDER,
            "gen_ai.request.model": model,
            "gen_ai.usage.input_tokens": prompt_tokens,
        },
    )


def record_params(span: trace.Span, params: SamplingParams) -> None:
    """The request's sampling parameters, once they are known to be valid."""
    if not span.is_recording():
        return
    attributes: dict[str, int | float] = {
        "gen_ai.request.max_tokens": params.max_tokens,
        "gen_ai.request.temperature": params.temperature,
        "gen_ai.request.top_p": params.top_p,
    }
    if params.seed is not None:
        attributes["gen_ai.request.seed"] = params.seed
    span.set_attributes(attributes)


def record_finished(
    span: trace.Span,
    finish_reason: str,
    completion_tokens: int,
    cached_tokens: int,
    timings: RequestTimings | None,
) -> None:
    """The request's outcome on its span, and its phases (when the engine finished it) as child spans."""
    if not span.is_recording():
        return
    span.set_attributes(
        {
            "gen_ai.usage.output_tokens": completion_tokens,
            "gen_ai.usage.cache_read.input_tokens": cached_tokens,
            "gen_ai.response.finish_reasons": [finish_reason],
            "kvroute.cached_tokens": cached_tokens,
            "kvroute.completion_tokens": completion_tokens,
            "kvroute.finish_reason": finish_reason,
        }
    )
    if timings is None:
        return
    to_ns = _monotonic_to_epoch_ns()
    parent = trace.set_span_in_context(span)
    if timings.first_scheduled is not None:
        _phase(parent, "kvroute.worker.queue", to_ns(timings.arrival), to_ns(timings.first_scheduled),
               {"kvroute.preemptions": timings.preemptions})  # fmt: skip
    if timings.first_scheduled is not None and timings.first_token is not None:
        _phase(parent, "kvroute.worker.prefill", to_ns(timings.first_scheduled), to_ns(timings.first_token),
               {"kvroute.steps": timings.prefill_steps, "kvroute.cached_tokens": cached_tokens})  # fmt: skip
    if timings.first_token is not None and timings.last_token is not None:
        _phase(parent, "kvroute.worker.decode", to_ns(timings.first_token), to_ns(timings.last_token),
               {"kvroute.steps": timings.decode_steps, "gen_ai.usage.output_tokens": completion_tokens})  # fmt: skip


def _phase(parent: Context, name: str, start_ns: int, end_ns: int, attributes: dict[str, int]) -> None:
    span = tracer.start_span(name, context=parent, start_time=start_ns, attributes=attributes)
    span.end(end_time=max(end_ns, start_ns))


def _monotonic_to_epoch_ns() -> Callable[[float], int]:
    """time.monotonic() seconds -> epoch nanoseconds (what span times are), by one offset read now."""
    offset = time.time_ns() - time.monotonic_ns()
    return lambda t: int(t * 1e9) + offset
