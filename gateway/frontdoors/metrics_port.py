"""The metrics port (`--metrics-port`): `GET /metrics`, the gateway's registry (gateway.metrics) in the
Prometheus text format 0.0.4 whatever the Accept header asks for; nothing else. Apart from the API port, whose
clients have no business reading it."""

from __future__ import annotations

from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from gateway.admission.limits import Limits
from gateway.frontdoors.http_protocol import Exchange
from gateway.frontdoors.http_routes import HttpRoutes, Reply, Route
from gateway.metrics import GatewayMetrics

TEXT_FORMAT = CONTENT_TYPE_PLAIN_0_0_4.encode()


def metrics_app(metrics: GatewayMetrics) -> HttpRoutes:
    async def serve_metrics(exchange: Exchange) -> Reply:
        return Reply(200, {}, metrics.render(), TEXT_FORMAT)

    return HttpRoutes([Route(b"GET", "/metrics", serve_metrics)], Limits().max_body_bytes)
