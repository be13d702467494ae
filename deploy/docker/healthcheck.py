"""The images' HEALTHCHECK (Docker and Compose; Kubernetes uses the chart's probes instead).

    healthcheck.py http URL                 healthy: the URL answers 200 (the gateway's /health)
    healthcheck.py grpc HOST:PORT [SERVICE] healthy: the standard gRPC health service says SERVING for SERVICE

Exit status 0 when healthy, 1 otherwise, with one line on stderr saying why.
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request

TIMEOUT_S = 3.0


def check_http(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=TIMEOUT_S) as response:
            return None if response.status == 200 else f"{url} answered {response.status}"
    except (urllib.error.URLError, OSError) as exc:
        return f"{url}: {exc}"


def check_grpc(target: str, service: str) -> str | None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT_S
            )
        except grpc.RpcError as exc:
            return f"{target} health {service!r}: {exc.code().name}"
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        return f"{target} health {service!r}: {health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)}"
    return None


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "http":
        problem = check_http(argv[1])
    elif len(argv) in (2, 3) and argv[0] == "grpc":
        problem = check_grpc(argv[1], argv[2] if len(argv) == 3 else "")
    else:
        print(__doc__, file=sys.stderr)
        return 2
    if problem is not None:
        print(f"unhealthy: {problem}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
