"""OpenTelemetry setup shared by the gateway and the worker (which never import each other).

Spans are exported over OTLP/gRPC only when the standard `OTEL_EXPORTER_OTLP_ENDPOINT` (or
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set; otherwise no exporter runs and spans cost next to nothing
(the API's non-recording spans still pass a caller's W3C trace context on). The exporter reads the other
standard variables itself (`OTEL_EXPORTER_OTLP_INSECURE`, `..._HEADERS`, `OTEL_SERVICE_NAME`, ...). An exporter
that does not import is logged as a warning and leaves tracing off; the process serves on.
"""

from __future__ import annotations

import logging
import os
from importlib import metadata

from opentelemetry import trace

logger = logging.getLogger(__name__)
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
GEN_AI_PROVIDER = "kvroute"  # gen_ai.provider.name on every span that carries GenAI attributes


def setup_tracing(service_name: str) -> bool:
    """Install an OTLP exporter if the environment names an endpoint; returns whether one was installed.
    Call once per process, before serving; `flush_tracing()` exports what is left before the process exits."""
    variable = next((v for v in ENDPOINT_VARIABLES if os.environ.get(v)), None)
    if variable is None:
        return False
    try:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        # A plain `pip install` can leave the exporter broken: xds-protos (`kvroute epp`'s Envoy protos) carries an
        # older copy of opentelemetry-proto's files and overwrites them when pip installs it second. Serving
        # without spans beats not serving.
        logger.warning(
            "tracing: %s is set but the OTLP exporter does not import (%s); serving without exporting spans. "
            "If xds-protos overwrote opentelemetry-proto's files, put them back: "
            "pip install --no-deps --force-reinstall opentelemetry-proto==%s",
            variable,
            exc,
            _installed_version("opentelemetry-proto"),
        )
        return False
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", service_name)})
    # No exit hook: its flush waits out the exporter's retries (10 s and more on an unreachable endpoint),
    # which would break a drain's stated exit time; flush_tracing() bounds the wait instead.
    provider = TracerProvider(resource=resource, shutdown_on_exit=False)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    logger.info("tracing: exporting spans over OTLP to %s", os.environ[variable])
    return True


def flush_tracing(timeout: float = 2.0) -> None:
    """Export the spans still buffered, waiting at most `timeout` seconds (what is not sent by then is lost)."""
    provider = trace.get_tracer_provider()
    flush = getattr(provider, "force_flush", None)  # the SDK's provider; the API's default has none
    if flush is not None:
        flush(int(timeout * 1000))


def _installed_version(distribution: str) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return "VERSION"
