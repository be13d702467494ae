#!/bin/sh
# xds-protos (Envoy's protos, which `kvroute epp` speaks) ships its own, older copy of OpenTelemetry's protos under
# opentelemetry/proto/ and overwrites opentelemetry-proto's files when it installs after it; the OTLP exporter then
# fails to import (no InstrumentationScope). This reinstalls the resolved opentelemetry-proto over it, and checks.
# Run after every pip install that brings xds-protos:  sh deploy/docker/otel-proto-over-xds.sh PYTHON
set -eu
py="$1"
version="$("$py" -c 'import importlib.metadata as m; print(m.version("opentelemetry-proto"))')"
"$py" -m pip install -q --no-deps --force-reinstall "opentelemetry-proto==$version"
"$py" -c 'from opentelemetry.proto.common.v1.common_pb2 import InstrumentationScope'
